//! What this member computes for the rounds: its own speed (which, beside the others', sizes
//! the batch a balanced `ddp` round asks of it), the batch it was last asked for, and the
//! scale of its own gradients that others' gradient parts are judged by.

use crate::sync_guard::GradientScale;

use super::balanced_batch;
use super::RoundConfig;

/// This member's own work.
#[derive(Debug, Default)]
pub(super) struct Work {
    /// Its forward-backward milliseconds per sample.
    ms_per_sample: Option<f64>,
    /// Samples of the last gradient asked of the trainer.
    batch: usize,
    /// The largest of its own last gradients' norms.
    gradient_scale: GradientScale,
}

impl Work {
    /// The trainer measured its milliseconds per sample.
    pub(super) fn speed(&mut self, ms_per_sample: Option<f64>) {
        self.ms_per_sample = ms_per_sample;
    }

    /// The batch of the gradient asked of the trainer now: the whole batch, or with
    /// balanced batches the share this member computes while the fastest of `speeds`
    /// computes the whole.
    pub(super) fn ask_batch(
        &mut self,
        cfg: &RoundConfig,
        speeds: impl Iterator<Item = f64>,
    ) -> usize {
        self.batch = if cfg.balance {
            balanced_batch(cfg.batch, self.ms_per_sample, speeds)
        } else {
            cfg.batch
        };
        self.batch
    }

    /// Samples of the last gradient asked of the trainer (status).
    pub(super) fn batch(&self) -> usize {
        self.batch
    }

    /// The norm others' gradient parts are judged by, given this member's own gradient's
    /// `norm` now.
    pub(super) fn gradient_norm(&mut self, norm: f64) -> f64 {
        self.gradient_scale.with(norm)
    }
}
