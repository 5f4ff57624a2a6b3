//! Token datasets: flat files of token ids, as nanoGPT writes them and `p2ptrain tokenize`
//! does (little-endian `uint16` or `uint32`, no header), cut into a training head and a
//! held-out tail, and served as windows of `context + 1` tokens like [`crate::text`]'s bytes.
//!
//! The file is never read whole: each batch reads its windows at their offsets (positional
//! reads on one open file), so a corpus larger than memory trains as well as a small one.
//! (Not memory-mapped: a mapped file that another program truncates kills the process with a
//! bus error, and mapping needs unsafe code; a window's read is one system call.) Every id
//! read is checked against the model's vocabulary: a token file made with another tokenizer
//! is an error that names the id and where it is, never an out-of-range embedding.
//!
//! Evaluation in bits per byte needs the bytes each token stands for: given a table of them
//! (a tokenizer's), [`Samples::target_bytes`] counts them, so runs with different tokenizers
//! (or bytes) compare.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::samples::Samples;
use crate::text::TRAIN_STRIDE_DIVISOR;
use crate::{Error, Result};

/// Tokens (inputs) per evaluation batch, as for text.
const EVAL_TOKENS: usize = 8192;

/// Token ids: an open token file (how wide each id is and how many there are), or ids
/// tokenized at start-up and held in memory (a text and a tokenizer).
#[derive(Debug)]
pub struct TokenFile {
    /// The file, or where the ids in memory came from, for errors.
    path: PathBuf,
    ids: Backing,
    /// Ids in the file.
    len: usize,
}

#[derive(Debug)]
enum Backing {
    /// Read at offsets; ids of `width` bytes: 2 (`uint16`) or 4 (`uint32`).
    File {
        file: File,
        width: usize,
    },
    Memory(Vec<u32>),
}

impl TokenFile {
    /// Opens `path` as ids of `width` bytes (2 or 4). Its length must be a whole number of
    /// ids.
    pub fn open(path: &Path, width: usize) -> Result<TokenFile> {
        if width != 2 && width != 4 {
            return Err(Error::Spec(format!(
                "token ids are 2 (uint16) or 4 (uint32) bytes wide, not {width}"
            )));
        }
        let io = |source| Error::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let bytes = file.metadata().map_err(io)?.len();
        if bytes % width as u64 != 0 {
            return Err(Error::Format {
                path: path.to_owned(),
                msg: format!(
                    "{bytes} bytes are not a whole number of {width}-byte token ids (is \
                     data.token_bytes the file's?)"
                ),
            });
        }
        let len = usize::try_from(bytes / width as u64).map_err(|_| Error::Format {
            path: path.to_owned(),
            msg: format!("{bytes} bytes of tokens are past this machine's address space"),
        })?;
        Ok(TokenFile {
            path: path.to_owned(),
            ids: Backing::File { file, width },
            len,
        })
    }

    /// Ids already in memory (a text tokenized at start-up); `source` names them in errors.
    pub fn from_ids(source: &Path, ids: Vec<u32>) -> TokenFile {
        TokenFile {
            path: source.to_owned(),
            len: ids.len(),
            ids: Backing::Memory(ids),
        }
    }

    /// Ids in the file.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the file holds no id.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads every id once, a stretch at a time, and refuses the file at its first id at or
    /// past `vocab`: a file made with another tokenizer is refused when the run starts, not
    /// hours in, when a batch first reads that window.
    pub fn check_vocabulary(&self, vocab: usize) -> Result<()> {
        const STRETCH: usize = 1 << 20;
        let mut ids = Vec::with_capacity(STRETCH.min(self.len));
        let mut from = 0;
        while from < self.len {
            let count = STRETCH.min(self.len - from);
            ids.clear();
            self.read(from, count, &mut ids)?;
            if let Some(k) = ids.iter().position(|&id| id as usize >= vocab) {
                return Err(self.past_vocabulary(ids[k], from + k, vocab));
            }
            from += count;
        }
        Ok(())
    }

    /// The error for id `id` at `position`, at or past the vocabulary `vocab`.
    fn past_vocabulary(&self, id: u32, position: usize, vocab: usize) -> Error {
        Error::Format {
            path: self.path.clone(),
            msg: format!(
                "token id {id} at position {position} is past the model's vocabulary of {vocab} \
                 (a file made with another tokenizer?)"
            ),
        }
    }

    /// Ids `from..from + count`, read from disk.
    fn read(&self, from: usize, count: usize, out: &mut Vec<u32>) -> Result<()> {
        let (file, width) = match &self.ids {
            Backing::Memory(ids) => {
                let stretch = ids.get(from..from + count).ok_or_else(|| {
                    Error::Layout(format!("ids {from}..{} past {}", from + count, ids.len()))
                })?;
                out.extend_from_slice(stretch);
                return Ok(());
            }
            Backing::File { file, width } => (file, *width),
        };
        let mut buf = vec![0u8; count * width];
        file.read_exact_at(&mut buf, (from * width) as u64)
            .map_err(|source| Error::Io {
                path: self.path.clone(),
                source,
            })?;
        match width {
            2 => out.extend(
                buf.chunks_exact(2)
                    .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))),
            ),
            _ => out.extend(
                buf.chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
        }
        Ok(())
    }
}

/// Windows of `context + 1` ids over a stretch of a token file.
#[derive(Debug, Clone)]
pub struct TokenSet {
    file: Arc<TokenFile>,
    /// The stretch: ids `from..to` of the file.
    from: usize,
    to: usize,
    context: usize,
    stride: usize,
    /// Ids must be below this (the model's vocabulary).
    vocab: usize,
    /// Bytes each id stands for, where a tokenizer says (for bits per byte).
    bytes_per_token: Option<Arc<Vec<u32>>>,
}

impl TokenSet {
    /// Part `k` of `n`: the `k`-th of `n` consecutive stretches, for boxes that each own part
    /// of the data.
    pub fn part(&self, k: usize, n: usize) -> Result<TokenSet> {
        if n == 0 || k >= n {
            return Err(Error::Spec(format!("part {k} of {n} does not exist")));
        }
        let len = self.to - self.from;
        Ok(TokenSet {
            from: self.from + len * k / n,
            to: self.from + len * (k + 1) / n,
            ..self.clone()
        })
    }

    /// Ids in the stretch.
    pub fn tokens(&self) -> usize {
        self.to - self.from
    }

    /// Window `i`'s `context + 1` ids, checked against the vocabulary.
    fn window(&self, i: usize, out: &mut Vec<u32>) -> Result<()> {
        let start = self.from + i * self.stride;
        let want = self.context + 1;
        if start + want > self.to {
            return Err(Error::Layout(format!(
                "token window {i} lies past the end of its stretch"
            )));
        }
        let at = out.len();
        self.file.read(start, want, out)?;
        // Checked at open too ([`TokenFile::check_vocabulary`]); again here, for a file that
        // another program changed since.
        match out[at..].iter().position(|&id| id as usize >= self.vocab) {
            Some(k) => Err(self
                .file
                .past_vocabulary(out[at + k], start + k, self.vocab)),
            None => Ok(()),
        }
    }
}

impl Samples for TokenSet {
    fn len(&self) -> usize {
        match self.tokens().checked_sub(self.context + 1) {
            Some(spare) => spare / self.stride + 1,
            None => 0,
        }
    }

    /// `(batch, context)` input ids and `(batch, context)` next ids, both `u32`.
    fn batch(&self, indices: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
        let t = self.context;
        let mut xs = Vec::with_capacity(indices.len() * t);
        let mut ys = Vec::with_capacity(indices.len() * t);
        let mut window = Vec::with_capacity(t + 1);
        for &i in indices {
            window.clear();
            self.window(i, &mut window)?;
            xs.extend_from_slice(&window[..t]);
            ys.extend_from_slice(&window[1..]);
        }
        let xs = Tensor::from_vec(xs, (indices.len(), t), dev)?;
        let ys = Tensor::from_vec(ys, (indices.len(), t), dev)?;
        Ok((xs, ys))
    }

    fn target_bytes(&self, targets: &Tensor) -> Result<Option<u64>> {
        let Some(table) = &self.bytes_per_token else {
            return Ok(None);
        };
        let ids = targets.flatten_all()?.to_vec1::<u32>()?;
        Ok(Some(
            ids.iter()
                .map(|&id| u64::from(table.get(id as usize).copied().unwrap_or(0)))
                .sum(),
        ))
    }

    fn eval_batch(&self) -> usize {
        (EVAL_TOKENS / self.context).max(1)
    }
}

/// A token file cut into the head a node trains on and the tail it evaluates on.
#[derive(Debug, Clone)]
pub struct TokenSplit {
    /// The head: training windows (overlapping, every `context / 4` ids).
    pub train: TokenSet,
    /// The tail: held-out windows that do not overlap, never trained on.
    pub test: TokenSet,
}

/// How to read a token file.
#[derive(Debug, Clone)]
pub struct TokenOptions {
    /// Ids the model reads at once.
    pub context: usize,
    /// Bytes per id: 2 or 4.
    pub width: usize,
    /// The model's vocabulary: every id must be below it.
    pub vocab: usize,
    /// Fraction of the file, at its end, held out.
    pub test_fraction: f64,
    /// Held-out ids evaluated (0: the whole tail).
    pub eval_tokens: usize,
    /// Bytes each id stands for (a tokenizer's), for bits per byte.
    pub bytes_per_token: Option<Arc<Vec<u32>>>,
}

/// Opens a token file and cuts it into a training head and a held-out tail.
pub fn load_tokens(path: &Path, opts: TokenOptions) -> Result<TokenSplit> {
    split_tokens(TokenFile::open(path, opts.width)?, opts)
}

/// Cuts token ids into a training head and a held-out tail (`opts.width` unused: the ids are
/// open already).
pub fn split_tokens(file: TokenFile, opts: TokenOptions) -> Result<TokenSplit> {
    let path = file.path.clone();
    let path = path.as_path();
    let file = Arc::new(file);
    if !(opts.test_fraction > 0.0 && opts.test_fraction < 1.0) {
        return Err(Error::Spec(format!(
            "a token file needs a held-out tail: test_fraction must be in (0, 1), got {}",
            opts.test_fraction
        )));
    }
    file.check_vocabulary(opts.vocab)?;
    let len = file.len();
    let n_test = (len as f64 * opts.test_fraction).round() as usize;
    let cut = len - n_test;
    let window = opts.context + 1;
    if cut < window || n_test < window {
        return Err(Error::Format {
            path: path.to_owned(),
            msg: format!(
                "{len} tokens are too few for windows of {window} in both the training head \
                 and the held-out tail ({:.0}% of the file)",
                opts.test_fraction * 100.0
            ),
        });
    }
    let test_to = if opts.eval_tokens > 0 {
        len.min(cut + opts.eval_tokens.max(opts.context) + 1)
    } else {
        len
    };
    let set = |from, to, stride| TokenSet {
        file: Arc::clone(&file),
        from,
        to,
        context: opts.context,
        stride,
        vocab: opts.vocab,
        bytes_per_token: opts.bytes_per_token.clone(),
    };
    Ok(TokenSplit {
        train: set(0, cut, (opts.context / TRAIN_STRIDE_DIVISOR).max(1)),
        test: set(cut, test_to, opts.context),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_bytes(ids: &[u32], width: usize) -> Vec<u8> {
        ids.iter()
            .flat_map(|&id| {
                if width == 2 {
                    (id as u16).to_le_bytes().to_vec()
                } else {
                    id.to_le_bytes().to_vec()
                }
            })
            .collect()
    }

    fn write(ids: &[u32], width: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        std::io::Write::write_all(&mut f, &write_bytes(ids, width)).expect("write");
        f
    }

    fn opts(context: usize, width: usize, vocab: usize) -> TokenOptions {
        TokenOptions {
            context,
            width,
            vocab,
            test_fraction: 0.1,
            eval_tokens: 0,
            bytes_per_token: None,
        }
    }

    #[test]
    fn windows_predict_the_next_id_and_stay_inside_their_half() {
        for width in [2, 4] {
            let ids: Vec<u32> = (0..200u32).map(|i| i * 7 % 300).collect();
            let f = write(&ids, width);
            let split = load_tokens(f.path(), opts(8, width, 300)).expect("split");
            assert_eq!(split.train.tokens(), 180);
            assert_eq!(split.test.tokens(), 20);
            assert_eq!(split.train.len(), (180 - 9) / 2 + 1);
            assert_eq!(split.test.len(), (20 - 9) / 8 + 1);
            let last = split.train.len() - 1;
            let (xs, ys) = split.train.batch(&[0, last], &Device::Cpu).expect("batch");
            let xs: Vec<Vec<u32>> = xs.to_vec2().expect("xs");
            let ys: Vec<Vec<u32>> = ys.to_vec2().expect("ys");
            assert_eq!(xs[0], ids[0..8]);
            assert_eq!(ys[0], ids[1..9]);
            assert_eq!(xs[1], ids[last * 2..last * 2 + 8]);
            let (held, _) = split.test.batch(&[0], &Device::Cpu).expect("test");
            assert_eq!(held.to_vec2::<u32>().expect("v")[0], ids[180..188]);
            assert!(split
                .train
                .batch(&[split.train.len()], &Device::Cpu)
                .is_err());
            let parts: Vec<usize> = (0..3)
                .map(|k| split.train.part(k, 3).expect("part").tokens())
                .collect();
            assert_eq!(parts.iter().sum::<usize>(), 180);
        }
    }

    #[test]
    fn an_id_past_the_vocabulary_or_a_ragged_file_is_refused_with_where() {
        let mut ids: Vec<u32> = (0..100).map(|i| i % 50).collect();
        ids[30] = 77;
        let f = write(&ids, 2);
        // Refused at open, not when a batch first reads that window.
        let e = load_tokens(f.path(), opts(8, 2, 50)).expect_err("id 77");
        assert!(e.to_string().contains("token id 77 at position 30"), "{e}");
        // A file changed after it was opened: the window that reads the bad id says where.
        let good: Vec<u32> = (0..100).map(|i| i % 50).collect();
        let g = write(&good, 2);
        let split = load_tokens(g.path(), opts(8, 2, 50)).expect("split");
        std::fs::write(g.path(), write_bytes(&ids, 2)).expect("rewrite");
        let e = split.train.batch(&[13], &Device::Cpu).expect_err("id 77");
        assert!(e.to_string().contains("token id 77 at position 30"), "{e}");
        let ragged = write(&[1, 2, 3], 2);
        std::fs::OpenOptions::new()
            .append(true)
            .open(ragged.path())
            .and_then(|mut f| std::io::Write::write_all(&mut f, &[9]))
            .expect("append");
        let e = TokenFile::open(ragged.path(), 2).expect_err("ragged");
        assert!(e.to_string().contains("whole number"), "{e}");
        assert!(TokenFile::open(ragged.path(), 3).is_err());
        let short = write(&[1, 2, 3, 4, 5], 2);
        assert!(load_tokens(short.path(), opts(8, 2, 50)).is_err());
    }

    #[test]
    fn target_bytes_count_what_each_predicted_id_stands_for() {
        let ids: Vec<u32> = (0..100).map(|i| i % 4).collect();
        let f = write(&ids, 2);
        let table = Arc::new(vec![1, 2, 3, 4]);
        let split = load_tokens(
            f.path(),
            TokenOptions {
                bytes_per_token: Some(table),
                ..opts(4, 2, 4)
            },
        )
        .expect("split");
        // Window 0 predicts ids 1, 2, 3, 0: 2 + 3 + 4 + 1 bytes.
        let (_, targets) = split.train.batch(&[0], &Device::Cpu).expect("batch");
        assert_eq!(split.train.target_bytes(&targets).expect("bytes"), Some(10));
        let plain = load_tokens(f.path(), opts(4, 2, 4)).expect("split");
        assert_eq!(plain.train.target_bytes(&targets).expect("bytes"), None);
    }
}
