//! Text for a byte-level language model: any UTF-8 (or ASCII) file, plain or gzipped, cut into
//! a training head and a held-out tail, and served as windows of bytes.
//!
//! A training sample is a window of `context + 1` bytes starting at a multiple of a small
//! stride: the model reads the first `context` and predicts each next byte. Which windows a
//! node draws, and in which order, is the [`crate::data::Sampler`]'s business (seeded per
//! node). The held-out tail is read as consecutive windows that do not overlap, up to a byte
//! budget, so every node evaluates on the very same bytes.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::samples::{gunzip_if_needed, read_maybe_gz, Samples};
use crate::{Error, Result};

/// Hamlet (about 174 KB), cut from the public-domain Shakespeare corpus (see
/// `data/README.md`), so the text demo and tests need no download.
pub const BUNDLED_HAMLET_GZ: &[u8] = include_bytes!("../../data/hamlet.txt.gz");

/// Training windows start every `context / TRAIN_STRIDE_DIVISOR` bytes: windows overlap by
/// three quarters, and the sampler's permutation holds `4 · len / context` entries, not one
/// per byte.
pub const TRAIN_STRIDE_DIVISOR: usize = 4;
/// Bytes (inputs) per evaluation batch: the attention scores of a batch grow with its windows
/// times the context squared, so long contexts evaluate fewer windows at once.
const EVAL_TOKENS: usize = 8192;

/// Bytes served as windows of `context + 1`.
#[derive(Debug, Clone)]
pub struct TextSet {
    bytes: Vec<u8>,
    context: usize,
    stride: usize,
}

impl TextSet {
    /// Training windows over `bytes`.
    fn training(bytes: Vec<u8>, context: usize) -> TextSet {
        TextSet {
            bytes,
            context,
            stride: (context / TRAIN_STRIDE_DIVISOR).max(1),
        }
    }

    /// Non-overlapping windows over at most `max_bytes` of `bytes` (all when `max_bytes` is 0;
    /// at least one window's worth).
    fn held_out(mut bytes: Vec<u8>, context: usize, max_bytes: usize) -> TextSet {
        let keep = max_bytes.max(context) + 1;
        if max_bytes > 0 && bytes.len() > keep {
            bytes.truncate(keep);
        }
        TextSet {
            bytes,
            context,
            stride: context,
        }
    }

    /// The text's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Part `k` of `n`: the `k`-th of `n` consecutive stretches of the text, for boxes that
    /// each own part of it.
    pub fn part(&self, k: usize, n: usize) -> Result<TextSet> {
        if n == 0 || k >= n {
            return Err(Error::Spec(format!("part {k} of {n} does not exist")));
        }
        let len = self.bytes.len();
        let (from, to) = (len * k / n, len * (k + 1) / n);
        Ok(TextSet {
            bytes: self.bytes[from..to].to_vec(),
            ..*self
        })
    }
}

impl Samples for TextSet {
    fn len(&self) -> usize {
        match self.bytes.len().checked_sub(self.context + 1) {
            Some(spare) => spare / self.stride + 1,
            None => 0,
        }
    }

    /// `(batch, context)` input bytes and `(batch, context)` next bytes, both `u32`.
    fn batch(&self, indices: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
        let t = self.context;
        let mut xs = Vec::with_capacity(indices.len() * t);
        let mut ys = Vec::with_capacity(indices.len() * t);
        for &i in indices {
            let start = i * self.stride;
            let window = self.bytes.get(start..start + t + 1).ok_or_else(|| {
                Error::Layout(format!("text window {i} lies past the end of the text"))
            })?;
            xs.extend(window[..t].iter().map(|&b| u32::from(b)));
            ys.extend(window[1..].iter().map(|&b| u32::from(b)));
        }
        let xs = Tensor::from_vec(xs, (indices.len(), t), dev)?;
        let ys = Tensor::from_vec(ys, (indices.len(), t), dev)?;
        Ok((xs, ys))
    }

    fn target_bytes(&self, targets: &Tensor) -> Result<Option<u64>> {
        Ok(Some(targets.elem_count() as u64))
    }

    fn eval_batch(&self) -> usize {
        (EVAL_TOKENS / self.context).max(1)
    }
}

/// A text cut into the head a node trains on and the tail it evaluates on.
#[derive(Debug, Clone)]
pub struct TextSplit {
    /// The head: training windows.
    pub train: TextSet,
    /// The tail: held-out windows, never trained on.
    pub test: TextSet,
}

/// How to read a text.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TextOptions {
    /// Bytes the model reads at once.
    pub context: usize,
    /// Fraction of the text, at its end, held out.
    pub test_fraction: f64,
    /// Held-out bytes evaluated (0: the whole tail).
    pub eval_bytes: usize,
}

/// The bundled Hamlet's text.
pub fn bundled_hamlet() -> Result<Vec<u8>> {
    gunzip_if_needed(
        BUNDLED_HAMLET_GZ.to_vec(),
        Path::new("<bundled hamlet.txt.gz>"),
    )
}

/// Loads a text file (gzipped or not; `None`: the bundled Hamlet) and cuts it.
pub fn load_text(path: Option<&Path>, opts: TextOptions) -> Result<TextSplit> {
    let (bytes, path) = match path {
        Some(p) => (read_maybe_gz(p)?, p.to_owned()),
        None => {
            let p = PathBuf::from("<bundled hamlet.txt.gz>");
            (gunzip_if_needed(BUNDLED_HAMLET_GZ.to_vec(), &p)?, p)
        }
    };
    split_text(bytes, &path, opts)
}

/// Checks that `bytes` is text and cuts it into a training head and a held-out tail.
pub fn split_text(bytes: Vec<u8>, path: &Path, opts: TextOptions) -> Result<TextSplit> {
    let bad = |msg: String| Error::Format {
        path: path.to_owned(),
        msg,
    };
    if let Err(e) = std::str::from_utf8(&bytes) {
        return Err(bad(format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.valid_up_to()
        )));
    }
    if !(opts.test_fraction > 0.0 && opts.test_fraction < 1.0) {
        return Err(Error::Spec(format!(
            "a text needs a held-out tail: test_fraction must be in (0, 1), got {}",
            opts.test_fraction
        )));
    }
    let n_test = (bytes.len() as f64 * opts.test_fraction).round() as usize;
    let cut = bytes.len() - n_test;
    let window = opts.context + 1;
    if cut < window || n_test < window {
        return Err(bad(format!(
            "{} bytes are too few for windows of {window} bytes in both the training head and \
             the held-out tail ({:.0}% of the text)",
            bytes.len(),
            opts.test_fraction * 100.0
        )));
    }
    let test = bytes[cut..].to_vec();
    let mut train = bytes;
    train.truncate(cut);
    Ok(TextSplit {
        train: TextSet::training(train, opts.context),
        test: TextSet::held_out(test, opts.context, opts.eval_bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(context: usize) -> TextOptions {
        TextOptions {
            context,
            test_fraction: 0.1,
            eval_bytes: 0,
        }
    }

    #[test]
    fn windows_predict_the_next_byte_and_stay_inside_their_half() {
        let text: Vec<u8> = (0..200u32).map(|i| b'a' + (i % 26) as u8).collect();
        let split = split_text(text, Path::new("t"), opts(8)).expect("split");
        assert_eq!(split.train.bytes().len(), 180);
        assert_eq!(split.test.bytes().len(), 20);
        // Training windows every 2 bytes; held-out ones every 8, not overlapping.
        assert_eq!(split.train.len(), (180 - 9) / 2 + 1);
        assert_eq!(split.test.len(), (20 - 9) / 8 + 1);
        let (xs, ys) = split
            .train
            .batch(&[0, split.train.len() - 1], &Device::Cpu)
            .expect("batch");
        assert_eq!(xs.dims(), &[2, 8]);
        let xs: Vec<Vec<u32>> = xs.to_vec2().expect("xs");
        let ys: Vec<Vec<u32>> = ys.to_vec2().expect("ys");
        assert_eq!(
            &xs[0][1..],
            &ys[0][..7],
            "targets are the inputs shifted by one"
        );
        assert!(split
            .train
            .batch(&[split.train.len()], &Device::Cpu)
            .is_err());
    }

    #[test]
    fn the_bundled_play_loads_and_parts_are_consecutive() {
        let split = load_text(None, opts(64)).expect("hamlet");
        assert!(split.train.bytes().len() > 150_000);
        assert!(split.train.bytes().starts_with(b"HAMLET"));
        let parts: Vec<TextSet> = (0..3)
            .map(|k| split.train.part(k, 3).expect("part"))
            .collect();
        let joined: Vec<u8> = parts.iter().flat_map(|p| p.bytes().to_vec()).collect();
        assert_eq!(joined, split.train.bytes());
        assert!(split.train.part(3, 3).is_err());
    }

    #[test]
    fn what_is_not_text_or_too_short_is_refused_with_a_reason() {
        let e = split_text(vec![b'a', 0xff, b'b'], Path::new("bin"), opts(1)).expect_err("binary");
        assert!(e.to_string().contains("offset 1"), "{e}");
        let e = split_text(b"short".to_vec(), Path::new("s"), opts(64)).expect_err("too short");
        assert!(e.to_string().contains("too few"), "{e}");
        let capped = TextSet::held_out(vec![b'x'; 1000], 10, 100);
        assert_eq!(capped.len(), 10);
        // A budget below one window still evaluates one; no tail at all is refused.
        assert_eq!(TextSet::held_out(vec![b'x'; 1000], 10, 3).len(), 1);
        let none = TextOptions {
            test_fraction: 0.0,
            ..opts(4)
        };
        let e = split_text(vec![b'a'; 100], Path::new("t"), none).expect_err("no tail");
        assert!(e.to_string().contains("held-out tail"), "{e}");
    }
}
