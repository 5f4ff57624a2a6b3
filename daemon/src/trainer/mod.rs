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
//! piece of bookkeeping it keeps about the mesh is its own change since the last delta
//! ([`OwnChange`]: what came from elsewhere kept apart), because it is about its own
//! parameters; a restore resets it and tells the core, which resets what it keeps.

mod evaluation;
mod interface;
mod mesh_side;
mod state;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use p2ptrain_models::data::Sampler;
use p2ptrain_models::params::l2_norm;
use p2ptrain_models::replica::{self, OwnChange};
use p2ptrain_models::train::{evaluate, forward_backward, loss_value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::Snapshot;
use crate::mesh_core::{AverageOutcome, TrainerCommand, TrainerEvent};
use crate::sync_guard;
use crate::timeline::{self, Lane};

pub use evaluation::{reaches_target, EvalRecord};
pub use interface::{
    Command, Counters, EvalStats, Finish, Handle, Identity, OuterSgd, Phase, RestoreFrom, Setup,
    Stats, StepLimit, TrainerError, TrainingStatus, FINAL_ROUND_WAIT, LOCKSTEP_EVAL_ALIGN_STEPS,
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
/// How often a step measures its gradients' norm for status where clipping does not measure
/// every step's (the first step measures it too): a pass over every gradient in f64 and a
/// value read back, which a small model's trainer on one core would notice every second.
const GRAD_NORM_EVERY: Duration = Duration::from_secs(10);
/// Steps averaged into the reported recent loss.
const LOSS_WINDOW: usize = 50;
/// Least time between two evaluation lines in the log.
const EVAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// How often a node held back by the step limit looks again.
const HELD_POLL: Duration = Duration::from_millis(5);
/// Weight of the newest step in the running mean of forward-backward time per sample: about
/// the last ten steps count, so a box that slows down is seen within a second or two, while
/// one slow step does not move a `ddp` member's batch.
const SPEED_SMOOTHING: f64 = 0.1;

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
            // Subnormal activations and gradients slow every multiply-add that meets one.
            p2ptrain_models::cpu::denormals::flush_on_compute_threads();
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
    /// Whether an evaluation has reached `train.target` (logged once).
    target_reached: bool,
    /// The wall-clock time of the last evaluation (lockstep members align on it).
    last_eval_wall: std::time::SystemTime,
    /// This node's own change since the last delta was handed over, neighbours' updates and
    /// syncs kept apart.
    own: OwnChange,
    last_delta_step: u64,
    /// The parameters at the start of the round (DiLoCo's outer step starts from them); empty
    /// without an outer optimizer.
    round_anchor: Vec<f32>,
    /// The outer optimizer's velocity (checkpointed).
    outer_velocity: Vec<f32>,
    /// The parameters given to the round under way, where [`Setup::keeps_given_params`]:
    /// the trainer trains on, and what it trained since is kept on top of the round's result.
    given: Option<Vec<f32>>,
    paused: bool,
    held_since: Option<Instant>,
    /// A `ddp` round's gradient, kept until the round's mean gradient makes the step.
    pending: Option<PendingStep>,
    /// What a round's mean gradient is judged by: the largest of the last own gradients'
    /// norms (as the round judges members' parts).
    gradient_scale: sync_guard::GradientScale,
    /// When training started, the last rate measurement (time, samples seen) and the last
    /// progress publish.
    clock: StepClock,
}

/// A step computed up to its gradient and waiting for its round (`ddp`).
struct PendingStep {
    /// The batch's loss.
    loss: f32,
    /// The batch's gradients, replaced by the round's mean before the optimizer takes them.
    grads: candle_core::backprop::GradStore,
    /// Samples in the batch.
    samples: usize,
    /// The gradient, flat, until it is handed to the mesh.
    values: Vec<f32>,
    /// Its L2 norm: a round's mean gradient is judged against it.
    norm: f64,
}

/// The trainer's clocks for rates and publishing.
struct StepClock {
    started: Instant,
    rate_mark: (Instant, u64),
    last_publish: Instant,
    /// When a step was last asked to measure its gradients' norm.
    last_grad_norm: Instant,
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
                training: TrainingStatus {
                    step: counters.step,
                    samples_seen: counters.samples_seen,
                    ..TrainingStatus::default()
                },
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
            target_reached: false,
            last_eval_wall: std::time::SystemTime::now(),
            own: OwnChange::default(),
            last_delta_step: counters.step,
            round_anchor: Vec::new(),
            outer_velocity: s.outer_velocity.clone(),
            given: None,
            paused: s.start_paused,
            held_since: None,
            pending: None,
            gradient_scale: sync_guard::GradientScale::default(),
            clock: StepClock {
                started: Instant::now(),
                rate_mark: (Instant::now(), counters.samples_seen),
                last_publish: Instant::now(),
                last_grad_norm: Instant::now(),
            },
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

    fn publish(&mut self) {
        self.stats.training.step = self.counters.step;
        self.stats.training.samples_seen = self.counters.samples_seen;
        self.stats.training.learning_rate = Some(self.s.optimizer.current_lr());
        self.stats.training.grad_norm = self.s.optimizer.last_grad_norm();
        if !self.losses.is_empty() {
            self.stats.training.loss = Some(
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
            Command::Restore(loaded, from, reply) => {
                let result = state::restore_into(
                    &self.s.model,
                    &mut self.s.optimizer,
                    &self.s.identity,
                    &loaded,
                );
                match result {
                    Ok(c) => {
                        self.counters = c;
                        self.pending = None;
                        self.given = None;
                        self.sampler.seek(c.samples_seen);
                        self.losses.clear();
                        self.last_delta_step = c.step;
                        // The next automatic checkpoint counts from the restored step, not
                        // from a later one written before the restore.
                        self.last_checkpoint_step = c.step;
                        self.clock.rate_mark = (Instant::now(), c.samples_seen);
                        self.reset_anchor()?;
                        self.outer_velocity = state::outer_velocity(&loaded);
                        self.reset_round_anchor()?;
                        self.tell(TrainerEvent::Restored { step: c.step });
                        tracing::info!(id = loaded.meta.id, step = c.step, "restored state");
                        // The first evaluation right away shows what the restored state is worth
                        // (see `RestoreFrom` for the exceptions).
                        let lockstep = self.s.eval_align_steps > 1;
                        if !(from == RestoreFrom::Members && (lockstep || c.step == 0)) {
                            self.evaluate()?;
                        }
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
                let mut values = self.flat()?;
                if self.s.keeps_given_params {
                    self.given = Some(values.clone());
                }
                if self.s.rounds_carry_state {
                    values.extend(self.s.optimizer.flatten_state()?);
                }
                if self.s.outer.is_some() {
                    self.extend_with_outer_state(&mut values);
                }
                // A step's loss is checked before its optimizer step: parameters it made
                // non-finite are caught here, before its ring refuses the hop as an offence
                // (and its score falls for what is no attack).
                if values.iter().any(|v| !v.is_finite()) {
                    return Err(TrainerError::Diverged {
                        step: self.counters.step,
                        loss: f32::NAN,
                    });
                }
                self.tell(TrainerEvent::Params {
                    step: self.counters.step,
                    values,
                });
            }
            Command::Mesh(TrainerCommand::TakeGradient { batch }) => self.take_gradient(batch)?,
            Command::Mesh(TrainerCommand::Combine {
                round,
                mean,
                gradient: true,
                ..
            }) => {
                let outcome = self.step_with_mean_gradient(round, &mean)?;
                self.tell(TrainerEvent::Combined {
                    round,
                    step: self.counters.step,
                    outcome,
                });
            }
            Command::Mesh(TrainerCommand::Combine {
                round,
                mean,
                gradient: false,
                step,
                judged,
                ran_on,
            }) => {
                // A gradient kept for a round that turned out to sum parameters (this node
                // adopted the mesh's round) is stale.
                self.pending = None;
                let outcome = self
                    .combine(&mean, judged, ran_on)
                    .map_err(|e| e.to_string());
                if let (Ok(_), Some(step)) = (&outcome, step) {
                    self.take_mesh_step(step);
                }
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

    /// The debug throttle `sample_delay`, for a pass of `samples` samples.
    fn throttle(&self, samples: usize) {
        if !self.s.sample_delay.is_zero() {
            let samples = u32::try_from(samples).unwrap_or(u32::MAX);
            std::thread::sleep(self.s.sample_delay.saturating_mul(samples));
        }
    }

    /// Folds one forward-backward pass (batch gathering included) of `samples` samples that
    /// took `took` into the running milliseconds per sample, which status and heartbeats
    /// carry: `ddp` members size their batches by it.
    fn note_speed(&mut self, took: Duration, samples: usize) {
        if samples == 0 {
            return;
        }
        let ms = took.as_secs_f64() * 1e3 / samples as f64;
        self.stats.training.ms_per_sample = Some(match self.stats.training.ms_per_sample {
            Some(old) => old + SPEED_SMOOTHING * (ms - old),
            None => ms,
        });
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
        self.stats.training.phase = Phase::Stopped;
        self.publish();
        Ok(Finish {
            snapshot: self.snapshot()?,
            reached_max_steps,
            stats: self.stats.clone(),
        })
    }

    /// What follows every step, taken locally or with a round's mean gradient: counters, the
    /// loss window, evaluation, the step report, the straggler delay, checkpoints, progress.
    fn after_step(&mut self, loss: f32, samples: usize) -> Result<(), TrainerError> {
        self.counters.step += 1;
        self.counters.samples_seen += samples as u64;
        self.stats.steps_this_run += 1;
        if self.losses.len() == LOSS_WINDOW {
            self.losses.pop_front();
        }
        self.losses.push_back(loss);

        let eval_by_steps =
            self.s.eval_every > 0 && self.counters.step.is_multiple_of(self.s.eval_every);
        let eval_by_time = self.clock_says_evaluate();
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
            && self.counters.step.saturating_sub(self.last_checkpoint_step)
                >= self.s.checkpoint_every_steps;
        let by_time = !self.s.checkpoint_every.is_zero()
            && self.last_checkpoint_at.elapsed() >= self.s.checkpoint_every;
        if by_steps || by_time {
            let _span =
                timeline::span(Lane::Trainer, "checkpoint_snapshot").at_step(self.counters.step);
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
        if now.duration_since(self.clock.last_publish) >= PUBLISH_EVERY {
            let dt = now.duration_since(self.clock.rate_mark.0).as_secs_f64();
            if dt >= 1.0 {
                self.stats.training.samples_per_sec =
                    self.counters
                        .samples_seen
                        .saturating_sub(self.clock.rate_mark.1) as f64
                        / dt;
                self.clock.rate_mark = (now, self.counters.samples_seen);
            }
            self.stats.train_secs = self.clock.started.elapsed().as_secs_f64();
            self.publish();
            self.clock.last_publish = now;
            if now.duration_since(self.clock.last_grad_norm) >= GRAD_NORM_EVERY {
                self.s.optimizer.measure_grad_norm_once();
                self.clock.last_grad_norm = now;
            }
        }
        Ok(())
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
        self.clock = StepClock {
            started: Instant::now(),
            rate_mark: (Instant::now(), self.counters.samples_seen),
            last_publish: Instant::now(),
            last_grad_norm: Instant::now(),
        };
        // The run's time starts here: an evaluation before it (of a restored state) is not
        // the run's.
        self.stats.eval_secs = 0.0;
        self.s.optimizer.measure_grad_norm_once();
        self.stats.training.phase = Phase::Training;
        self.publish();
        let mut reached_max_steps = false;
        let mut final_wait: Option<Instant> = None;
        loop {
            if self.handle_commands(&mut cmd_rx)? {
                break;
            }
            if self.s.max_steps > 0 && self.counters.step >= self.s.max_steps {
                // Held at a round's boundary, or trained on past one whose round runs: that
                // round's mean is the run's result.
                let since = *final_wait.get_or_insert_with(Instant::now);
                if self.s.ends_on_a_round
                    && (!self.limit.allows(self.counters.step) || self.given.is_some())
                    && since.elapsed() < FINAL_ROUND_WAIT
                {
                    self.wait_for_limit();
                    continue;
                }
                reached_max_steps = true;
                break;
            }
            if !self.limit.allows(self.counters.step) {
                // The staleness bound: wait for the slowest neighbour (or its timeout).
                self.wait_for_limit();
                continue;
            }
            self.released();
            let started = Instant::now();
            let indices = self.sampler.next_batch(self.s.batch_size);
            let (xs, ys) = self.s.data.train().batch(&indices, &self.s.device)?;
            let step = self.counters.step + 1;
            let span = timeline::span(Lane::Trainer, "forward_backward").at_step(step);
            let (loss, grads) = forward_backward(&self.s.model, &xs, &ys)?;
            self.throttle(indices.len());
            drop(span);
            self.note_speed(started.elapsed(), indices.len());
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
            self.after_step(loss, indices.len())?;
        }
        self.released();
        let evaluates = self.s.eval_every > 0 || !self.s.eval_every_time.is_zero();
        if evaluates && self.stats.training.eval.map(|e| e.step) != Some(self.counters.step) {
            self.evaluate()?;
        }
        // After the final evaluation, which `eval_secs` counts: the run's evaluations lie
        // within its time.
        self.stats.train_secs = self.clock.started.elapsed().as_secs_f64();
        self.finish(reached_max_steps)
    }
}
