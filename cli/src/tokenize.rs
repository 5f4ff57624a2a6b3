//! `p2ptrain tokenize`: text files to a token file (flat little-endian ids, nanoGPT's format),
//! which `data.source = "tokens"` trains on.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use p2ptrain_models::tokenizer::TextTokenizer;

/// Arguments of `p2ptrain tokenize`.
#[derive(Args)]
pub struct TokenizeArgs {
    /// A Hugging Face tokenizer.json (byte-level BPE, as Llama 3, SmolLM, Qwen and GPT-2 ship).
    #[arg(long)]
    tokenizer: PathBuf,
    /// The token file to write (never overwrites an existing file).
    #[arg(long)]
    out: PathBuf,
    /// Bytes per id: 2 (uint16, vocabularies up to 65,536) or 4 (uint32); default: the
    /// smallest that holds the tokenizer's vocabulary.
    #[arg(long, value_parser = clap::value_parser!(u8).range(2..=4))]
    token_bytes: Option<u8>,
    /// Text files (UTF-8, plain or gzipped), tokenized one after the other.
    #[arg(required = true)]
    texts: Vec<PathBuf>,
}

/// Tokenizes the texts into the token file and prints what it wrote.
pub fn run(args: TokenizeArgs) -> Result<()> {
    let tokenizer = TextTokenizer::load(&args.tokenizer)?;
    let vocab = tokenizer.id_bound();
    let width = match args.token_bytes {
        Some(w @ (2 | 4)) => usize::from(w),
        Some(w) => bail!("--token-bytes is 2 or 4, not {w}"),
        None if vocab <= 1 << 16 => 2,
        None => 4,
    };
    if width == 2 && vocab > 1 << 16 {
        bail!(
            "ids up to {} do not fit 2-byte ids: use --token-bytes 4",
            vocab - 1
        );
    }
    if args.out.exists() {
        bail!(
            "{} exists (an existing file is never overwritten)",
            args.out.display()
        );
    }
    // Written beside the target and renamed into place once whole: a failure (a file that is
    // not text, a full disk) leaves no half token file that trains on a cut corpus. The
    // partial file is this run's own (created new), so only this run removes it.
    let partial = args.out.with_extension("partial");
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    let file = opts.open(&partial).with_context(|| {
        format!(
            "cannot create {} (another tokenize writing it, or one that was stopped?)",
            partial.display()
        )
    })?;
    let written = write_tokens(&args, &tokenizer, width, file);
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    let (ids_written, text_bytes) = written?;
    std::fs::rename(&partial, &args.out)
        .with_context(|| format!("moving {} into place", args.out.display()))?;
    p2ptrain_daemon::atomic_file::flush_folder_of(&args.out)
        .with_context(|| format!("flushing the folder of {}", args.out.display()))?;
    println!(
        "wrote {}: {ids_written} tokens of {width} bytes ({text_bytes} bytes of text, vocabulary {vocab})",
        args.out.display()
    );
    Ok(())
}

/// Writes the texts' ids into `file`; answers (ids, bytes of text).
fn write_tokens(
    args: &TokenizeArgs,
    tokenizer: &TextTokenizer,
    width: usize,
    file: std::fs::File,
) -> Result<(u64, u64)> {
    let mut out = std::io::BufWriter::new(file);
    let table = tokenizer.bytes_per_token();
    let (mut ids_written, mut text_bytes) = (0u64, 0u64);
    for path in &args.texts {
        let bytes = p2ptrain_models::samples::read_maybe_gz(path)?;
        let text = std::str::from_utf8(&bytes)
            .with_context(|| format!("{} is not UTF-8 text", path.display()))?;
        let ids = tokenizer.encode(text)?;
        for &id in &ids {
            if width == 2 {
                let id = u16::try_from(id)
                    .with_context(|| format!("token id {id} does not fit 2 bytes"))?;
                out.write_all(&id.to_le_bytes())?;
            } else {
                out.write_all(&id.to_le_bytes())?;
            }
        }
        let covered: u64 = ids
            .iter()
            .map(|&id| u64::from(table.get(id as usize).copied().unwrap_or(0)))
            .sum();
        eprintln!(
            "{}: {} bytes, {} tokens ({:.2} bytes a token)",
            path.display(),
            bytes.len(),
            ids.len(),
            covered as f64 / ids.len().max(1) as f64
        );
        ids_written += ids.len() as u64;
        text_bytes += bytes.len() as u64;
    }
    out.flush().context("writing the token file")?;
    // On disk before it is renamed into place: a power cut after the rename finds it whole.
    out.get_ref()
        .sync_all()
        .context("flushing the token file to disk")?;
    Ok((ids_written, text_bytes))
}
