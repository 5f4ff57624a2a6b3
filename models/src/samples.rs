//! What every data source shares and what training reads through: the [`Samples`] view (how
//! many, and a batch as input and target tensors), and reading a file that may be gzipped.
//! Below the loaders (`data` for labelled sets, `text` for language models), which both
//! depend on it and not on each other.

use std::io::Read;
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::{Error, Result};

/// Samples a model trains or is evaluated on, as a trainer reads them: how many there are, and
/// a batch of them as an input and a target tensor.
pub trait Samples {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there is no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The inputs and targets of the given samples, on `dev`.
    fn batch(&self, indices: &[usize], dev: &Device) -> Result<(Tensor, Tensor)>;

    /// The bytes of text that `targets` (a batch's, as [`Samples::batch`] gave them) stand
    /// for, where the samples are text (a byte each for bytes, what a tokenizer says for
    /// tokens), so that a language model's loss reads as bits per byte whatever its
    /// vocabulary; `None` for labels. Counted from the batch, so nothing is read twice.
    fn target_bytes(&self, _targets: &Tensor) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Samples per evaluation batch.
    fn eval_batch(&self) -> usize {
        256
    }
}

/// Reads the bytes of a file, transparently gunzipping when the content starts with the gzip
/// magic (so `.gz` and raw copies both work, whatever their names).
pub fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    gunzip_if_needed(raw, path)
}

/// `raw` as it is, or gunzipped when it starts with the gzip magic.
pub(crate) fn gunzip_if_needed(raw: Vec<u8>, path: &Path) -> Result<Vec<u8>> {
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| Error::Format {
                path: path.to_owned(),
                msg: format!("broken gzip stream: {e}"),
            })?;
        Ok(out)
    } else {
        Ok(raw)
    }
}
