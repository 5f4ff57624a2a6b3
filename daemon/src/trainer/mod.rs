//! The trainer: one OS thread that owns the model, the optimizer, the data and the device, and
//! only computes.
//!
//! Candle compute never runs on a tokio worker (a training step would stall every socket the
//! runtime drives). The async side talks to this thread through a bounded command channel that
//! the loop polls between steps, reads its progress from a `watch` channel, and receives
//! periodic snapshots for checkpointing through another bounded channel. The loop never
//! blocks on any of them: a full snapshot channel means the writer is behind, and that
//! checkpoint is skipped rather than stalling training.
//!
//! It holds no peer logic. The mesh core ([`crate::mesh_core`]) decides; the trainer answers its
//! typed [`TrainerCommand`]s (take the delta since the last one, apply values with a weight,
//! average with given parameters within a bound), reports its steps as [`TrainerEvent`]s, and
//! takes a step only while its step is below the [`StepLimit`] the core sets (SSP). The one
//! piece of bookkeeping it keeps about the mesh is the base of the next delta (`anchor`, and
//! `foreign`: what came from elsewhere since), because it is about its own parameters; a
//! restore resets it and tells the core, which resets what it keeps.

mod interface;
mod state;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use p2ptrain_models::data::Sampler;
use p2ptrain_models::params::l2_norm;
use p2ptrain_models::train::{evaluate, forward_backward, loss_value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::Snapshot;
use crate::mesh_core::{AverageOutcome, TrainerCommand, TrainerEvent};
use crate::sync_guard;
use crate::timeline::{self, Lane};

pub use interface::{
    Command, Counters, EvalStats, Finish, Handle, Identity, OuterSgd, Phase, Setup, Stats,
    StepLimit, TrainerError,
};
pub use state::{build, outer_velocity};

/// Capacity of the command channel: commands are handled between two steps, and the mesh
/// keeps a few slots free for its own (see [`MESH_RESERVED`]).
pub const COMMAND_CAP: usize = 16;
/// Command slots the mesh leaves free when it hands over neighbours' updates, so a delta
/// request, an average or a control command always fits.
pub const MESH_RESERVED: usize = 4;
/// Capacity of the trainer's event channel to the mesh.
pub const EVENT_CAP: usize = 64;
/// Event slots a step report leaves free, so a delta, an average's answer or a restore is
/// never refused for lack of room.
const EVENT_RESERVED: usize = 8;
/// Capacity of the automatic-snapshot channel; a second pending snapshot means the disk is
/// slower than the checkpoint interval, and the newer one is dropped.
pub const SNAPSHOT_CAP: usize = 1;
/// How often progress is published to the `watch` channel.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
/// Steps averaged into the reported recent loss.
const LOSS_WINDOW: usize = 50;
/// Least time between two evaluation lines in the log.
const EVAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// How often a node held back by the step limit looks again.
const HELD_POLL: Duration = Duration::from_millis(5);

/// Starts the trainer thread; it steps only while `limit` allows.
pub fn spawn(
    setup: Setup,
    snapshot_tx: mpsc::Sender<Snapshot>,
    limit: StepLimit,
) -> std::io::Result<Handle> {
    let (cmd_tx, cmd_rx) = mpsc::channel(COMMAND_CAP);
    let (events_tx, events_rx) = mpsc::channel(EVENT_CAP);
    let (stats_tx, stats_rx) = watch::channel(Stats::default());
    let (done_tx, done_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || {
            limit.register_trainer();
            let mut lp = Loop::new(setup, stats_tx, snapshot_tx, events_tx, limit);
            let result = lp.run(cmd_rx);
            let _ = done_tx.send(result);
        })?;
    Ok(Handle {
        cmd_tx,
        stats_rx,
        events_rx,
        done_rx,
    })
}

struct Loop {
    s: Setup,
    sampler: Sampler,
    counters: Counters,
    stats: Stats,
    stats_tx: watch::Sender<Stats>,
    snapshot_tx: mpsc::Sender<Snapshot>,
    events_tx: mpsc::Sender<TrainerEvent>,
    limit: StepLimit,
    losses: VecDeque<f32>,
    last_checkpoint_step: u64,
    last_checkpoint_at: Instant,
    /// When the held-out set was last evaluated (or training started).
    last_eval_at: Instant,
    last_eval_log: Option<Instant>,
    /// Parameters when the last delta was handed over.
    anchor: Vec<f32>,
    /// Changes since then that were not this node's own steps (neighbours' updates, syncs).
    foreign: Vec<f32>,
    last_delta_step: u64,
    /// The parameters at the start of the round (DiLoCo's outer step starts from them); empty
    /// without an outer optimizer.
    round_anchor: Vec<f32>,
    /// The outer optimizer's velocity (checkpointed).
    outer_velocity: Vec<f32>,
    paused: bool,
    held_since: Option<Instant>,
}

impl Loop {
    fn new(
        s: Setup,
        stats_tx: watch::Sender<Stats>,
        snapshot_tx: mpsc::Sender<Snapshot>,
        events_tx: mpsc::Sender<TrainerEvent>,
        limit: StepLimit,
    ) -> Loop {
        let mut sampler = Sampler::new(s.data.train().len(), s.node_seed);
        sampler.seek(s.start.samples_seen);
        let counters = s.start;
        Loop {
            sampler,
            counters,
            stats: Stats {
                step: counters.step,
                samples_seen: counters.samples_seen,
                ..Stats::default()
            },
            stats_tx,
            snapshot_tx,
            events_tx,
            limit,
            losses: VecDeque::with_capacity(LOSS_WINDOW),
            last_checkpoint_step: counters.step,
            last_checkpoint_at: Instant::now(),
            last_eval_at: Instant::now(),
            last_eval_log: None,
            anchor: Vec::new(),
            foreign: Vec::new(),
            last_delta_step: counters.step,
            round_anchor: Vec::new(),
            outer_velocity: s.outer_velocity.clone(),
            paused: s.start_paused,
            held_since: None,
            s,
        }
    }

    fn snapshot(&self) -> Result<Snapshot, TrainerError> {
        state::snapshot(
            &self.s.model,
            &self.s.optimizer,
            &self.s.identity,
            self.counters,
            &self.outer_velocity,
        )
    }

    fn flat(&self) -> Result<Vec<f32>, TrainerError> {
        Ok(self.s.model.params().flatten()?)
    }

    fn evaluate(&mut self) -> Result<(), TrainerError> {
        let started = Instant::now();
        let e = evaluate(&self.s.model, self.s.data.test(), &self.s.device)?;
        self.stats.eval_secs += started.elapsed().as_secs_f64();
        self.last_eval_at = Instant::now();
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
                    samples_per_sec = format!("{:.0}", self.stats.samples_per_sec),
                    "evaluated on held-out text"
                ),
                None => tracing::info!(
                    step = self.counters.step,
                    accuracy = format!("{:.4}", e.accuracy),
                    loss = format!("{:.4}", e.loss),
                    samples_per_sec = format!("{:.0}", self.stats.samples_per_sec),
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
        self.stats.eval = Some(EvalStats {
            accuracy: e.accuracy,
            loss: e.loss,
            step: self.counters.step,
            bits_per_byte: e.bits_per_byte,
            perplexity: e.bits_per_byte.map(|_| e.loss.exp()),
        });
        Ok(())
    }

    fn publish(&mut self) {
        self.stats.step = self.counters.step;
        self.stats.samples_seen = self.counters.samples_seen;
        if !self.losses.is_empty() {
            self.stats.loss = Some(
                self.losses.iter().map(|&l| f64::from(l)).sum::<f64>() / self.losses.len() as f64,
            );
        }
        self.stats_tx.send_replace(self.stats.clone());
    }

    /// Tells the mesh something it must not miss; the reserved room makes a refusal mean the
    /// mesh is gone.
    fn tell(&self, ev: TrainerEvent) {
        let _ = self.events_tx.try_send(ev);
    }

    /// Handles pending commands; returns true when asked to stop.
    fn handle_commands(
        &mut self,
        cmd_rx: &mut mpsc::Receiver<Command>,
    ) -> Result<bool, TrainerError> {
        while let Ok(cmd) = cmd_rx.try_recv() {
            if self.handle(cmd)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Handles one command; returns true when asked to stop.
    fn handle(&mut self, cmd: Command) -> Result<bool, TrainerError> {
        match cmd {
            Command::Stop => return Ok(true),
            Command::Snapshot(reply) => {
                let _ = reply.send(self.snapshot()?);
            }
            Command::Restore(loaded, reply) => {
                let result = state::restore_into(
                    &self.s.model,
                    &mut self.s.optimizer,
                    &self.s.identity,
                    &loaded,
                );
                match result {
                    Ok(c) => {
                        self.counters = c;
                        self.sampler.seek(c.samples_seen);
                        self.losses.clear();
                        self.last_delta_step = c.step;
                        self.reset_anchor()?;
                        self.outer_velocity = state::outer_velocity(&loaded);
                        self.reset_round_anchor()?;
                        self.tell(TrainerEvent::Restored { step: c.step });
                        tracing::info!(id = loaded.meta.id, step = c.step, "restored state");
                        // The first evaluation right away shows what the restored state is worth.
                        self.evaluate()?;
                        self.paused = false;
                        self.publish();
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Start => self.paused = false,
            Command::Params(reply) => {
                let _ = reply.send((self.counters.step, self.flat()?));
            }
            Command::Mesh(TrainerCommand::TakeDelta) => self.take_delta()?,
            Command::Mesh(TrainerCommand::TakeParams) => {
                self.tell(TrainerEvent::Params {
                    step: self.counters.step,
                    values: self.flat()?,
                });
            }
            Command::Mesh(TrainerCommand::Combine { round, mean }) => {
                let outcome = self.combine(&mean).map_err(|e| e.to_string());
                self.tell(TrainerEvent::Combined {
                    round,
                    step: self.counters.step,
                    outcome,
                });
            }
            Command::Mesh(TrainerCommand::Apply { values, weight }) => {
                let _span = timeline::span(Lane::Trainer, "apply").at_step(self.counters.step);
                self.apply(&values, weight)?
            }
            Command::Mesh(TrainerCommand::Average { seq, theirs, bound }) => {
                let _span =
                    timeline::span(Lane::Trainer, "full_sync_average").at_step(self.counters.step);
                let outcome = match self.average(&theirs, bound) {
                    Ok(outcome) => outcome,
                    Err(e) => AverageOutcome::Failed(e.to_string()),
                };
                self.tell(TrainerEvent::Averaged { seq, outcome });
            }
        }
        Ok(false)
    }

    /// Takes the current parameters as the base of the next delta.
    fn reset_anchor(&mut self) -> Result<(), TrainerError> {
        let flat = self.flat()?;
        self.stats.param_norm = l2_norm(&flat);
        if self.s.publishes {
            self.foreign = vec![0.0; flat.len()];
            self.anchor = flat;
        } else {
            self.foreign.clear();
            self.anchor.clear();
        }
        Ok(())
    }

    /// Adds `weight * values` to the parameters.
    fn apply(&mut self, values: &[f32], weight: f32) -> Result<(), TrainerError> {
        let mut flat = self.flat()?;
        if values.len() != flat.len() {
            tracing::warn!(
                got = values.len(),
                expected = flat.len(),
                "update of the wrong size dropped"
            );
            return Ok(());
        }
        for (p, v) in flat.iter_mut().zip(values) {
            *p += weight * v;
        }
        if let Err(e) = self.s.model.params().write_back(&flat) {
            tracing::warn!("update not applied: {e}");
            return Ok(());
        }
        if self.foreign.len() == values.len() {
            for (f, v) in self.foreign.iter_mut().zip(values) {
                *f += weight * v;
            }
        }
        self.stats.updates_applied += 1;
        Ok(())
    }

    /// Averages with a neighbour's parameters if they pass [`sync_guard::judge`] against
    /// `bound`: the outcome carries the relative distance measured before averaging, or why
    /// they were refused (nothing is changed then).
    fn average(&mut self, theirs: &[f32], bound: f64) -> Result<AverageOutcome, TrainerError> {
        let mine = self.flat()?;
        let distance = match sync_guard::judge(&mine, theirs, bound) {
            Ok(d) => d,
            Err(refusal) => return Ok(AverageOutcome::Refused(refusal)),
        };
        let merged: Vec<f32> = mine
            .iter()
            .zip(theirs)
            .map(|(a, b)| 0.5 * (a + b))
            .collect();
        self.s.model.params().write_back(&merged)?;
        if self.foreign.len() == merged.len() {
            for ((f, m), a) in self.foreign.iter_mut().zip(&merged).zip(&mine) {
                *f += m - a;
            }
        }
        Ok(AverageOutcome::Averaged(distance))
    }

    /// Takes a round's mean (an empty one keeps the parameters): as it is, or, with an outer
    /// optimizer (DiLoCo), by a Nesterov step along `round start - mean` from the round's
    /// start. Answers the parameters' digest, so members can show they hold the same bits.
    fn combine(&mut self, mean: &[f32]) -> Result<String, TrainerError> {
        if mean.is_empty() {
            self.reset_round_anchor()?;
            return Ok(crate::mesh_core::rounds::params_digest(&self.flat()?));
        }
        let numel = self.s.model.params().numel();
        if mean.len() != numel {
            return Err(TrainerError::Refused(format!(
                "a round's mean of {} values for {numel} parameters",
                mean.len()
            )));
        }
        let next = match self.s.outer {
            None => mean.to_vec(),
            Some(outer) => {
                if self.outer_velocity.len() != numel {
                    self.outer_velocity = vec![0.0; numel];
                }
                let mut next = Vec::with_capacity(numel);
                let start = self.round_anchor.iter().zip(mean);
                for ((s, m), v) in start.zip(self.outer_velocity.iter_mut()) {
                    let g = s - m;
                    *v = outer.momentum * *v + g;
                    next.push(s - outer.lr * (g + outer.momentum * *v));
                }
                next
            }
        };
        self.s.model.params().write_back(&next)?;
        self.stats.param_norm = l2_norm(&next);
        let digest = crate::mesh_core::rounds::params_digest(&next);
        if self.s.outer.is_some() {
            self.round_anchor = next;
        }
        Ok(digest)
    }

    /// With an outer optimizer, takes the current parameters as the start of the round
    /// (DiLoCo's pseudo-gradient is measured from it); without one, keeps no copy.
    fn reset_round_anchor(&mut self) -> Result<(), TrainerError> {
        if self.s.outer.is_some() {
            self.round_anchor = self.flat()?;
        }
        Ok(())
    }

    /// ‖own change since the last delta‖ / ‖parameters‖, for the policy's early-publish rule;
    /// measured only when that rule is on (it costs a copy of the parameters).
    fn pending_ratio(&self) -> Result<f64, TrainerError> {
        if !self.s.measure_pending_ratio || self.anchor.is_empty() {
            return Ok(0.0);
        }
        let now = self.flat()?;
        let (mut d, mut n) = (0.0f64, 0.0f64);
        for ((x, a), f) in now.iter().zip(&self.anchor).zip(&self.foreign) {
            d += f64::from(x - a - f).powi(2);
            n += f64::from(*x).powi(2);
        }
        Ok(d.sqrt() / n.sqrt().max(f64::MIN_POSITIVE))
    }

    /// Hands the mesh this node's own change since the last delta (neighbours' updates and
    /// syncs excluded, so nothing echoes back through the mesh).
    fn take_delta(&mut self) -> Result<(), TrainerError> {
        let now = self.flat()?;
        self.stats.param_norm = l2_norm(&now);
        if self.anchor.len() != now.len() {
            self.anchor = now;
            self.foreign = vec![0.0; self.anchor.len()];
            return Ok(());
        }
        let delta: Vec<f32> = now
            .iter()
            .zip(&self.anchor)
            .zip(&self.foreign)
            .map(|((n, a), f)| n - a - f)
            .collect();
        let step = self.counters.step;
        let sent = self.events_tx.try_send(TrainerEvent::Delta {
            base_step: self.last_delta_step,
            step,
            delta,
        });
        if sent.is_ok() {
            self.anchor = now;
            self.foreign.iter_mut().for_each(|f| *f = 0.0);
            self.stats.updates_published += 1;
            self.last_delta_step = step;
        }
        Ok(())
    }

    /// Waits on the step limit, keeping the held time.
    fn wait_for_limit(&mut self) {
        if self.held_since.is_none() {
            self.held_since = Some(Instant::now());
            self.stats.held = true;
            self.publish();
        }
        // The mesh wakes it when it raises the limit or sends a command.
        std::thread::park_timeout(HELD_POLL);
    }

    fn released(&mut self) {
        if let Some(t) = self.held_since.take() {
            self.stats.held_secs += t.elapsed().as_secs_f64();
            self.stats.held = false;
        }
    }

    fn finish(&mut self, reached_max_steps: bool) -> Result<Finish, TrainerError> {
        self.stats.phase = Phase::Stopped;
        self.publish();
        Ok(Finish {
            snapshot: self.snapshot()?,
            reached_max_steps,
            stats: self.stats.clone(),
        })
    }

    fn run(&mut self, mut cmd_rx: mpsc::Receiver<Command>) -> Result<Finish, TrainerError> {
        self.reset_anchor()?;
        self.reset_round_anchor()?;
        // The parameters' norm, which bounds neighbours' updates, is known from the start.
        self.publish();
        // A joiner waits here for its downloaded state (or the word to start without one).
        while self.paused {
            match cmd_rx.blocking_recv() {
                None | Some(Command::Stop) => return self.finish(false),
                Some(other) => {
                    if self.handle(other)? {
                        return self.finish(false);
                    }
                }
            }
        }
        let started = Instant::now();
        let mut rate_mark = (Instant::now(), self.counters.samples_seen);
        let mut last_publish = Instant::now();
        self.stats.phase = Phase::Training;
        self.publish();
        let mut reached_max_steps = false;
        loop {
            if self.handle_commands(&mut cmd_rx)? {
                break;
            }
            if self.s.max_steps > 0 && self.counters.step >= self.s.max_steps {
                reached_max_steps = true;
                break;
            }
            if !self.limit.allows(self.counters.step) {
                // The staleness bound: wait for the slowest neighbour (or its timeout).
                self.wait_for_limit();
                continue;
            }
            self.released();
            let indices = self.sampler.next_batch(self.s.batch_size);
            let (xs, ys) = self.s.data.train().batch(&indices, &self.s.device)?;
            let step = self.counters.step + 1;
            let span = timeline::span(Lane::Trainer, "forward_backward").at_step(step);
            let (loss, grads) = forward_backward(&self.s.model, &xs, &ys)?;
            drop(span);
            let span = timeline::span(Lane::Trainer, "optimizer").at_step(step);
            self.s.optimizer.step(self.s.model.params(), &grads)?;
            let loss = loss_value(&loss)?;
            drop(span);
            if !loss.is_finite() {
                return Err(TrainerError::Diverged {
                    step: self.counters.step,
                    loss,
                });
            }
            self.counters.step += 1;
            self.counters.samples_seen += indices.len() as u64;
            self.stats.steps_this_run += 1;
            if self.losses.len() == LOSS_WINDOW {
                self.losses.pop_front();
            }
            self.losses.push_back(loss);

            let eval_by_steps =
                self.s.eval_every > 0 && self.counters.step.is_multiple_of(self.s.eval_every);
            let eval_by_time = !self.s.eval_every_time.is_zero()
                && self.last_eval_at.elapsed() >= self.s.eval_every_time;
            if eval_by_steps || eval_by_time {
                self.evaluate()?;
            }
            // A step report is the one event that may be dropped (the next one carries a
            // newer step); it leaves room for those that may not.
            if self.events_tx.capacity() > EVENT_RESERVED {
                let pending_ratio = self.pending_ratio()?;
                self.tell(TrainerEvent::Stepped {
                    step: self.counters.step,
                    pending_ratio,
                });
            }
            if !self.s.step_delay.is_zero() {
                std::thread::sleep(self.s.step_delay);
            }
            let by_steps = self.s.checkpoint_every_steps > 0
                && self.counters.step - self.last_checkpoint_step >= self.s.checkpoint_every_steps;
            let by_time = !self.s.checkpoint_every.is_zero()
                && self.last_checkpoint_at.elapsed() >= self.s.checkpoint_every;
            if by_steps || by_time {
                let _span = timeline::span(Lane::Trainer, "checkpoint_snapshot").at_step(step);
                if self.snapshot_tx.try_send(self.snapshot()?).is_err() {
                    tracing::debug!(
                        step = self.counters.step,
                        "checkpoint writer busy; skipping this checkpoint"
                    );
                }
                self.last_checkpoint_step = self.counters.step;
                self.last_checkpoint_at = Instant::now();
            }
            let now = Instant::now();
            if now.duration_since(last_publish) >= PUBLISH_EVERY {
                let dt = now.duration_since(rate_mark.0).as_secs_f64();
                if dt >= 1.0 {
                    self.stats.samples_per_sec =
                        (self.counters.samples_seen - rate_mark.1) as f64 / dt;
                    rate_mark = (now, self.counters.samples_seen);
                }
                self.stats.train_secs = started.elapsed().as_secs_f64();
                self.publish();
                last_publish = now;
            }
        }
        self.released();
        self.stats.train_secs = started.elapsed().as_secs_f64();
        let evaluates = self.s.eval_every > 0 || !self.s.eval_every_time.is_zero();
        if evaluates && self.stats.eval.map(|e| e.step) != Some(self.counters.step) {
            self.evaluate()?;
        }
        self.finish(reached_max_steps)
    }
}
