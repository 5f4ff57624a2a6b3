//! Held-out evaluation: when (every so many steps, or on the wall clock's grid so members
//! evaluate together), the figures published with progress, and the eval log a benchmark reads.

use super::*;

/// Whether an evaluation reaches a `train.target` (false when there is none): bits per byte
/// at or below it for a language model, accuracy at or above it otherwise. One rule for the
/// trainer's log and `local`'s count.
pub fn reaches_target(target: Option<f64>, accuracy: f64, bits_per_byte: Option<f64>) -> bool {
    match (target, bits_per_byte) {
        (None, _) => false,
        (Some(t), Some(bpb)) => bpb <= t,
        (Some(t), None) => accuracy >= t,
    }
}

/// One line of the eval log ([`Setup::eval_log`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvalRecord {
    /// The step evaluated at.
    pub step: u64,
    /// Wall-clock time of the evaluation's end, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// Mean held-out loss.
    pub loss: f64,
    /// Held-out accuracy (next-byte accuracy for text).
    pub accuracy: f64,
    /// Held-out bits per byte (text models only).
    pub bits_per_byte: Option<f64>,
    /// Seconds this process has spent evaluating, this evaluation included: what a
    /// benchmark subtracts to time training alone (0 in logs written before it was kept).
    #[serde(default)]
    pub eval_secs: f64,
    /// The mean training loss over the last steps before it, so that the log holds the run's
    /// training curve too (what the live page draws after a reload).
    #[serde(default)]
    pub train_loss: Option<f64>,
}

/// The slot of the wall clock's grid of `period` that `at` falls in (ms since the epoch ÷
/// the period).
pub(super) fn wall_slot_of(at: std::time::SystemTime, period: Duration) -> u128 {
    let ms = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    ms / period.as_millis().max(1)
}

/// The slot of the wall clock's grid of `period` now.
pub(super) fn wall_slot(period: Duration) -> u128 {
    wall_slot_of(std::time::SystemTime::now(), period)
}

impl Loop {
    pub(super) fn evaluate(&mut self) -> Result<(), TrainerError> {
        let started = Instant::now();
        let e = evaluate(&self.s.model, self.s.data.test(), &self.s.device)?;
        self.stats.eval_secs += started.elapsed().as_secs_f64();
        self.last_eval_at = Instant::now();
        self.last_eval_wall = std::time::SystemTime::now();
        // Evaluations can come many times a second on small models: log at info only now and
        // then, so the log stays readable; status always has the latest.
        if self
            .last_eval_log
            .is_none_or(|t| t.elapsed() >= EVAL_LOG_EVERY)
        {
            match e.bits_per_byte {
                Some(bpb) => tracing::info!(
                    step = self.counters.step,
                    bits_per_byte = format!("{bpb:.3}"),
                    loss = format!("{:.4}", e.loss),
                    samples_per_sec = format!("{:.0}", self.stats.training.samples_per_sec),
                    "evaluated on held-out text"
                ),
                None => tracing::info!(
                    step = self.counters.step,
                    accuracy = format!("{:.4}", e.accuracy),
                    loss = format!("{:.4}", e.loss),
                    samples_per_sec = format!("{:.0}", self.stats.training.samples_per_sec),
                    "evaluated on held-out set"
                ),
            }
            self.last_eval_log = Some(Instant::now());
        } else {
            tracing::debug!(
                step = self.counters.step,
                accuracy = e.accuracy,
                loss = e.loss,
                "evaluated on held-out set"
            );
        }
        self.stats.training.eval = Some(EvalStats {
            accuracy: e.accuracy,
            loss: e.loss,
            step: self.counters.step,
            bits_per_byte: e.bits_per_byte,
            perplexity: e.bits_per_byte.map(|_| e.loss.exp()),
        });
        self.log_evaluation(&e);
        if !self.target_reached && reaches_target(self.s.target, e.accuracy, e.bits_per_byte) {
            self.target_reached = true;
            tracing::info!(
                step = self.counters.step,
                target = self.s.target,
                secs = format!("{:.1}", self.clock.started.elapsed().as_secs_f64()),
                "reached the target"
            );
        }
        Ok(())
    }

    /// Appends an evaluation to the eval log, if there is one. A log that cannot be written
    /// is given up with a warning: it must never stop training.
    pub(super) fn log_evaluation(&mut self, e: &p2ptrain_models::train::Evaluation) {
        let Some(path) = &self.s.eval_log else {
            return;
        };
        let record = EvalRecord {
            step: self.counters.step,
            unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            loss: e.loss,
            accuracy: e.accuracy,
            bits_per_byte: e.bits_per_byte,
            eval_secs: self.stats.eval_secs,
            train_loss: (!self.losses.is_empty()).then(|| {
                self.losses.iter().map(|&l| f64::from(l)).sum::<f64>() / self.losses.len() as f64
            }),
        };
        let written = serde_json::to_string(&record)
            .map_err(std::io::Error::other)
            .and_then(|line| {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?;
                f.write_all(format!("{line}\n").as_bytes())
            });
        if let Err(err) = written {
            tracing::warn!(path = %path.display(), "evaluation log not written, given up: {err}");
            self.s.eval_log = None;
        }
    }

    /// Whether `eval_every_time` has come round. Alone (or out of lockstep), by this node's
    /// own clock since its last evaluation. In lockstep (`eval_align_steps` > 1) by the wall
    /// clock's grid of that period, read only at a multiple of `eval_align_steps`: members
    /// finish a step within milliseconds of each other, so they read the same slot at the
    /// same step and evaluate together; a clock of their own would keep apart for good two
    /// members that once fell on either side of a boundary. Half a period since the last
    /// evaluation is still required, so a slot begun just after one does not bring another.
    pub(super) fn clock_says_evaluate(&self) -> bool {
        let every = self.s.eval_every_time;
        if every.is_zero() {
            return false;
        }
        let since = self.last_eval_at.elapsed();
        if self.s.eval_align_steps <= 1 {
            return since >= every;
        }
        self.counters.step.is_multiple_of(self.s.eval_align_steps)
            && since >= every / 2
            && wall_slot(every) != wall_slot_of(self.last_eval_wall, every)
    }
}

#[cfg(test)]
mod tests {
    use super::reaches_target;

    /// The trainer knows no network and no config: no file of it names them, the actors or
    /// libp2p (its setup comes as values, its commands over channels).
    #[test]
    fn the_trainer_knows_no_network_or_config() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/trainer");
        let forbidden = [
            "crate::network",
            "crate::config",
            "crate::mesh::",
            "crate::node",
            "crate::transfer",
            "crate::control",
            "libp2p",
        ];
        let read = crate::import_scan::assert_names_none(dir.as_ref(), &[], &forbidden);
        assert!(read >= 5, "read {read} files of the trainer");
    }

    /// Bits per byte at or below a language model's target, accuracy at or above a
    /// classifier's; no target is never reached.
    #[test]
    fn a_target_is_reached_by_bits_per_byte_or_else_by_accuracy() {
        assert!(reaches_target(Some(0.9), 0.95, None));
        assert!(!reaches_target(Some(0.9), 0.85, None));
        assert!(reaches_target(Some(2.8), 0.0, Some(2.79)));
        assert!(!reaches_target(Some(2.8), 1.0, Some(2.81)));
        assert!(!reaches_target(None, 1.0, Some(0.0)));
    }
}
