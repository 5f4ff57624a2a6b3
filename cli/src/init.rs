//! `p2ptrain init --hf DIR`: a fine-tune of a Hugging Face llama-family folder as a bundle to
//! copy to every box: a config whose shape is the folder's and whose run starts from the
//! folder's digest (so a joining box needs neither the folder nor a hash of it), the folder's
//! tokenizer, and the text. Only the box that starts the run reads the folder's weights.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::config::{Config, SyncMode};
use p2ptrain_models::llama::LlamaSpec;

/// The config file a bundle holds.
pub const CONFIG_NAME: &str = "p2ptrain.toml";

/// Arguments of `p2ptrain init`.
#[derive(Args)]
pub struct InitArgs {
    /// A Hugging Face llama-family folder (config.json, model.safetensors or shards,
    /// tokenizer.json), as `huggingface-cli download` leaves it.
    #[arg(long, value_name = "DIR")]
    hf: PathBuf,
    /// The text to fine-tune on (UTF-8, plain or gzipped), copied into the bundle; default:
    /// the bundled Hamlet.
    #[arg(long, value_name = "FILE")]
    text: Option<PathBuf>,
    /// The bundle's folder, written new (never into an existing one).
    #[arg(long, default_value = "finetune", value_name = "DIR")]
    out: PathBuf,
    /// Tokens the model reads at once (at most the folder's max_position_embeddings).
    #[arg(long, default_value_t = 256, value_name = "TOKENS")]
    context: usize,
    /// How the boxes combine their training (see docs/modes.md): diloco (the default) sends
    /// the model every 25 steps, as int8; ddp a gradient every step, for a fast LAN.
    #[arg(long, default_value = "diloco",
          value_parser = clap::builder::PossibleValuesParser::new(SyncMode::names()))]
    sync_mode: String,
}

/// Writes the bundle and prints what to run on each box.
pub fn run(args: InitArgs) -> Result<()> {
    let hf = args
        .hf
        .canonicalize()
        .with_context(|| format!("--hf {}", args.hf.display()))?;
    let spec =
        p2ptrain_models::hf::read_config(&hf).with_context(|| format!("--hf {}", hf.display()))?;
    // Carried to every box: a regular file of the folder's own, never what a link in a
    // folder fetched from elsewhere points at (a private key).
    let tokenizer = p2ptrain_models::hf::folder_json(&hf, "tokenizer.json").with_context(|| {
        format!(
            "--hf {}: the folder's tokenizer.json (the fine-tune tokenizes the text with the \
             model's own tokenizer)",
            hf.display()
        )
    })?;
    if args.context == 0 || args.context > spec.context {
        bail!(
            "--context {}: 1 to the folder's max_position_embeddings, {}",
            args.context,
            spec.context
        );
    }
    if let Some(text) = &args.text {
        if !text.is_file() {
            bail!("--text {}: not a file", text.display());
        }
    }
    eprintln!("reading {} for its digest ...", hf.display());
    let digest = p2ptrain_models::hf::folder_digest(&hf)
        .with_context(|| format!("--hf {}", hf.display()))?;
    let text_name = args
        .text
        .as_deref()
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned());
    if text_name.as_deref() == Some(CONFIG_NAME) || text_name.as_deref() == Some("tokenizer.json") {
        bail!("--text: a file named as the bundle's own files; rename it");
    }
    let config = config_text(&Bundle {
        hf: &hf,
        digest: &digest,
        spec: &spec,
        context: args.context,
        text: text_name.as_deref(),
        mode: &args.sync_mode,
    });
    std::fs::create_dir(&args.out).with_context(|| {
        format!(
            "--out {}: writes a new folder (is there one already?)",
            args.out.display()
        )
    })?;
    let written = write_bundle(&args, &tokenizer, text_name.as_deref(), &config);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&args.out);
        return Err(e);
    }
    let path = args.out.join(CONFIG_NAME);
    // The bundle as every box reads it: the real config code, the folder's shape checked.
    let loaded = Config::load(Some(&path)).map_err(anyhow::Error::new);
    let loaded = match loaded {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&args.out);
            return Err(e.context("the written config does not load"));
        }
    };
    let out = args.out.display();
    println!(
        "wrote {out}/ ({CONFIG_NAME}, tokenizer.json{}): {} parameters from {}, digest {digest}, \
         run {}",
        text_name
            .as_deref()
            .map(|t| format!(", {t}"))
            .unwrap_or_default(),
        spec_params(&spec),
        hf.display(),
        loaded.run_id(),
    );
    println!("This box starts the run (it reads the folder's weights):");
    println!("  p2ptrain join --config {out}/{CONFIG_NAME}");
    println!(
        "Every other box: copy {out}/ there (not the model folder), then, with the address \
         the first box prints:"
    );
    println!("  p2ptrain join --config {out}/{CONFIG_NAME} --bootstrap /ip4/.../tcp/7471/p2p/...");
    println!(
        "Afterwards, from a running node: p2ptrain checkpoint export --hf --out DIR --base {}",
        hf.display()
    );
    Ok(())
}

/// What a bundle's config says.
struct Bundle<'a> {
    hf: &'a Path,
    digest: &'a str,
    spec: &'a LlamaSpec,
    context: usize,
    text: Option<&'a str>,
    mode: &'a str,
}

/// The bundle's files: the config, the tokenizer, and the text (a hard link where the file
/// system allows, else a copy).
fn write_bundle(
    args: &InitArgs,
    tokenizer: &str,
    text_name: Option<&str>,
    config: &str,
) -> Result<()> {
    std::fs::write(args.out.join("tokenizer.json"), tokenizer)
        .with_context(|| format!("writing {}", args.out.join("tokenizer.json").display()))?;
    if let (Some(text), Some(name)) = (&args.text, text_name) {
        let to = args.out.join(name);
        let plain = std::fs::symlink_metadata(text).is_ok_and(|m| m.is_file());
        if !plain || std::fs::hard_link(text, &to).is_err() {
            std::fs::copy(text, &to).with_context(|| format!("copying {}", text.display()))?;
        }
    }
    std::fs::write(args.out.join(CONFIG_NAME), config)
        .with_context(|| format!("writing {}", args.out.join(CONFIG_NAME).display()))
}

/// A llama's parameter count, with thousands separated.
fn spec_params(spec: &LlamaSpec) -> String {
    let n = spec.numel();
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The config: the folder's shape and digest, fine-tuning settings, the mode's settings for
/// home links (`README.md`'s table).
fn config_text(b: &Bundle) -> String {
    let s = b.spec;
    let path =
        b.hf.to_string_lossy()
            .replace('\\', "\\\\")
            .replace('"', "\\\"");
    let shown = b.hf.to_string_lossy().replace(['\n', '\r'], " ");
    let data_path = match b.text {
        Some(name) => format!(
            "path = \"{}\"\n",
            name.replace('\\', "\\\\").replace('"', "\\\"")
        ),
        None => "# no path: the bundled Hamlet\n".to_string(),
    };
    let mode_keys = match b.mode {
        "diloco" => "inner_steps = 25\nouter_values = \"int8\"\n",
        "gossip" => "mix = \"mean\"\ncodec = \"onebit\"\npublish_every = 4\n",
        _ => "",
    };
    format!(
        r#"# A fine-tune of {shown}, written by `p2ptrain init`. Copy this folder (this file,
# tokenizer.json and the text) to every box; only the box that starts the run needs the model
# folder. The shape keys are the folder's config.json and hf_digest its files' digest: a box
# computes the run id from this file alone. Any key may be changed (`join --set
# section.key=VALUE`); those marked "run id" in configs/reference.toml must match on every box.

[model]
kind = "llama"
hf = "{path}"
hf_digest = "{digest}"
vocab = {vocab}
context = {context}
width = {width}
layers = {layers}
heads = {heads}
kv_heads = {kv_heads}
head_dim = {head_dim}
intermediate = {intermediate}
rms_eps = {rms_eps:?}
rope_theta = {rope_theta:?}
tied = {tied}

[optimizer]
kind = "adamw"
lr = 0.0003
weight_decay = 0.01
schedule = "cosine"
warmup_steps = 50
total_steps = 2000
min_lr_factor = 0.1
clip_grad_norm = 1.0

[data]
source = "text"
{data_path}tokenizer = "tokenizer.json"
test_fraction = 0.1

[train]
batch_size = 8
init_seed = 42
eval_every = 0
eval_every_secs = 60
max_steps = 0

[checkpoint]
every_steps = 0
every_secs = 600
keep = 3

[sync]
mode = "{mode}"
{mode_keys}"#,
        digest = b.digest,
        vocab = s.vocab,
        context = b.context,
        width = s.hidden,
        layers = s.layers,
        heads = s.heads,
        kv_heads = s.kv_heads,
        head_dim = s.head_dim,
        intermediate = s.intermediate,
        rms_eps = s.rms_eps,
        rope_theta = s.rope_theta,
        tied = s.tied,
        mode = b.mode,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/fixtures/hf-llama-tiny")
    }

    fn args(hf: &Path, out: &Path) -> InitArgs {
        InitArgs {
            hf: hf.to_path_buf(),
            text: None,
            out: out.to_path_buf(),
            context: 64,
            sync_mode: "diloco".into(),
        }
    }

    /// The keys `init` writes that `model.hf` alone reads from the folder.
    const SHAPE: [&str; 11] = [
        "hf_digest",
        "vocab",
        "width",
        "layers",
        "heads",
        "kv_heads",
        "head_dim",
        "intermediate",
        "rms_eps",
        "rope_theta",
        "tied",
    ];

    /// The bundle loads as a config whose run id is the folder's own (`model.hf` alone gives
    /// the same), and `init` never writes into a folder that exists.
    #[test]
    fn the_bundle_is_the_folders_run_and_init_writes_only_a_new_folder() {
        let tmp = tempfile::tempdir().expect("tmp");
        let out = tmp.path().join("ft");
        run(args(&fixture(), &out)).expect("init");
        let bundle = Config::load(Some(&out.join(CONFIG_NAME))).expect("the bundle loads");
        let by_hand = Config::parse(
            &std::fs::read_to_string(out.join(CONFIG_NAME))
                .expect("config")
                .lines()
                // `model.hf` alone: the shape and the digest from the folder.
                .filter(|l| !SHAPE.iter().any(|k| l.starts_with(&format!("{k} = "))))
                .collect::<Vec<_>>()
                .join("\n"),
            "by-hand.toml",
            Some(&out),
        )
        .expect("model.hf alone");
        assert_eq!(bundle.run_id(), by_hand.run_id());
        let e = run(args(&fixture(), &out)).expect_err("an existing folder");
        assert!(format!("{e:#}").contains("writes a new folder"), "{e:#}");
    }

    /// A folder fetched from elsewhere whose `tokenizer.json` links outside it (to a private
    /// key) is refused, and no bundle is left: `init` copied the link's target into the
    /// bundle the user copies to every box (seen: the secret's bytes in the bundle's
    /// tokenizer.json, before `hf::folder_json`).
    #[test]
    fn a_tokenizer_linking_outside_the_folder_is_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        let secret = tmp.path().join("id_ed25519");
        std::fs::write(&secret, "{\"secret\": \"key\"}").expect("secret");
        let folder = tmp.path().join("model");
        std::fs::create_dir(&folder).expect("folder");
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture().join(file), folder.join(file)).expect(file);
        }
        std::os::unix::fs::symlink(&secret, folder.join("tokenizer.json")).expect("link");
        let out = tmp.path().join("ft");
        let e = run(args(&folder, &out)).expect_err("a link outside");
        assert!(
            format!("{e:#}").contains("links outside the folder"),
            "{e:#}"
        );
        assert!(!out.exists());
    }
}
