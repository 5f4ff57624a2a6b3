//! What the rest of the daemon sees of the trainer: the commands it takes, the progress it
//! publishes, what it needs to start, how it ends, and the step limit the mesh sets. The loop
//! that answers them is in the parent module.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::Duration;

use candle_core::Device;
use p2ptrain_models::data::Data;
use p2ptrain_models::{Model, Optimizer};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::Snapshot;
use crate::mesh_core::{TrainerCommand, TrainerEvent};
use crate::store::Loaded;

/// Why the trainer failed or refused a restore.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// A model, data or optimizer operation failed.
    #[error(transparent)]
    Model(#[from] p2ptrain_models::Error),
    /// A tensor operation failed outside the models crate.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// A checkpoint of another run or layout, or with non-finite values: nothing was changed.
    #[error("{0}")]
    Refused(String),
    /// The loss became NaN or infinite.
    #[error(
        "training diverged at step {step} (loss {loss}); the last checkpoint is kept untouched"
    )]
    Diverged {
        /// The step at which it happened.
        step: u64,
        /// The loss.
        loss: f32,
    },
}

/// The highest step the mesh lets the trainer reach (SSP's staleness bound, a round's
/// boundary), shared without a lock: the mesh writes it, the trainer reads it before every
/// step. [`StepLimit::NONE`] when nothing holds the trainer back. A trainer held by it parks,
/// and the mesh wakes it when it raises the limit or hands it a command, so a synchronous
/// round does not wait out a polling interval.
#[derive(Debug, Clone, Default)]
pub struct StepLimit {
    limit: Arc<AtomicU64>,
    trainer: Arc<Mutex<Option<Thread>>>,
}

impl StepLimit {
    /// No limit.
    pub const NONE: u64 = u64::MAX;

    /// A limit that holds nothing back.
    pub fn new() -> StepLimit {
        StepLimit {
            limit: Arc::new(AtomicU64::new(Self::NONE)),
            trainer: Arc::new(Mutex::new(None)),
        }
    }

    /// Sets the limit (`None`: no limit), waking the trainer when it rises.
    pub fn set(&self, limit: Option<u64>) {
        let new = limit.unwrap_or(Self::NONE);
        if self.limit.swap(new, Ordering::Relaxed) < new {
            self.wake();
        }
    }

    /// Whether a step from `step` is allowed now.
    pub fn allows(&self, step: u64) -> bool {
        step < self.limit.load(Ordering::Relaxed)
    }

    /// Makes the calling thread the one [`StepLimit::wake`] wakes.
    pub fn register_trainer(&self) {
        if let Ok(mut t) = self.trainer.lock() {
            *t = Some(std::thread::current());
        }
    }

    /// Wakes the trainer if it is parked (and makes its next park return at once if not).
    pub fn wake(&self) {
        if let Some(t) = self.trainer.lock().ok().and_then(|t| t.clone()) {
            t.unpark();
        }
    }
}

/// Where a restored state comes from: it decides whether the trainer evaluates it at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreFrom {
    /// A checkpoint of this node's (the control API's restore): evaluated at once, so status
    /// shows what it is worth.
    Checkpoint,
    /// The members' state, downloaded by a joiner: evaluated at once too, except in lockstep
    /// (`ddp`), where the members would wait for that evaluation at their next round and
    /// their latest evaluation is already this state's, and at step 0: the run's initial
    /// weights, trained by nobody, whose evaluation shows nothing, while a member that waits
    /// for its neighbours before its first step (gossip's `sync.min_members`) would wait for
    /// it (some 6 s of the small GPT's on one core).
    Members,
}

/// A request to the trainer thread, handled between two steps.
#[derive(Debug)]
pub enum Command {
    /// Copy the current state for a checkpoint.
    Snapshot(oneshot::Sender<Snapshot>),
    /// Replace the state with a verified checkpoint.
    Restore(
        Box<Loaded>,
        RestoreFrom,
        oneshot::Sender<Result<(), TrainerError>>,
    ),
    /// Finish the current step, then stop and hand back the final state.
    Stop,
    /// Begin training: a joiner starts paused until its state has been downloaded.
    Start,
    /// The current step and flat parameters, for a neighbour that syncs with this node.
    Params(oneshot::Sender<(u64, Vec<f32>)>),
    /// Work the mesh core asks for.
    Mesh(TrainerCommand),
}

/// What the trainer is doing: defined with the core's messages, which carry it.
pub use crate::mesh_core::Phase;

/// The latest evaluation on the held-out set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalStats {
    /// Fraction correct.
    pub accuracy: f64,
    /// Mean cross-entropy.
    pub loss: f64,
    /// Step at which it was taken.
    pub step: u64,
    /// For a language model: the held-out loss in bits per byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
    /// For a language model: the held-out perplexity per byte, `e^loss`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
}

impl EvalStats {
    /// The figure people read first: bits per byte for a language model, accuracy otherwise.
    pub fn headline(&self) -> String {
        match self.bits_per_byte {
            Some(bpb) => format!("{bpb:.3} bpb"),
            None => format!("{:.2}%", self.accuracy * 100.0),
        }
    }
}

/// The trainer's progress as status shows it (the `training` part of [`Stats`], flattened into
/// the status report).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TrainingStatus {
    /// What the trainer is doing.
    pub phase: Phase,
    /// Training steps taken (including those restored from a checkpoint).
    pub step: u64,
    /// Samples trained on (including those restored).
    pub samples_seen: u64,
    /// Mean loss over the last steps.
    pub loss: Option<f64>,
    /// Latest evaluation on the held-out set.
    pub eval: Option<EvalStats>,
    /// Recent throughput.
    pub samples_per_sec: f64,
    /// Milliseconds of forward and backward pass per sample, a running mean of recent steps
    /// (batch gathering included, evaluation and waits not): how fast this box computes,
    /// whatever the mesh makes it wait for. `ddp` members size their batches by each other's.
    #[serde(default)]
    pub ms_per_sample: Option<f64>,
    /// The learning rate of the next step, after the schedule.
    #[serde(default)]
    pub learning_rate: Option<f64>,
    /// The global L2 norm of a recent step's gradients, before clipping: every step's where
    /// `optimizer.clip_grad_norm` is set, else one step's every 10 s.
    #[serde(default)]
    pub grad_norm: Option<f64>,
}

/// Progress the trainer publishes; read by the status API.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Stats {
    /// What status shows of it as `training`.
    #[serde(flatten)]
    pub training: TrainingStatus,
    /// Steps taken since this process started.
    pub steps_this_run: u64,
    /// Seconds spent in the training loop since this process started (evaluation included).
    pub train_secs: f64,
    /// Of those, seconds spent evaluating on the held-out set.
    pub eval_secs: f64,
    /// Neighbours' updates applied.
    pub updates_applied: u64,
    /// Own deltas handed to the mesh.
    pub updates_published: u64,
    /// L2 norm of the parameters at the last publish or evaluation; the mesh bounds
    /// neighbours' updates relative to it.
    pub param_norm: f64,
    /// Whether the mesh's step limit (the staleness bound) holds this node back now.
    pub held: bool,
    /// Seconds spent held back by the staleness bound.
    pub held_secs: f64,
}

/// Everything the trainer thread needs, prepared (and validated) before it starts.
pub struct Setup {
    /// The built model, already holding the initial or restored parameters.
    pub model: Model,
    /// Its optimizer, already holding restored state if any.
    pub optimizer: Optimizer,
    /// Training and held-out data.
    pub data: Arc<Data>,
    /// Where tensors live.
    pub device: Device,
    /// Samples per step.
    pub batch_size: usize,
    /// Steps between evaluations (0: not by steps).
    pub eval_every: u64,
    /// ... or time since the last one (zero: by steps only).
    pub eval_every_time: Duration,
    /// Stop at this step (0: never).
    pub max_steps: u64,
    /// Seed of this node's data order.
    pub node_seed: u64,
    /// Automatic checkpoint every this many steps (0: off).
    pub checkpoint_every_steps: u64,
    /// ... or after this long (zero: off).
    pub checkpoint_every: Duration,
    /// Identities recorded in snapshots.
    pub identity: Identity,
    /// Counters restored from a checkpoint (zero for a fresh start).
    pub start: Counters,
    /// Whether this node publishes deltas at all (`sync.publish_every > 0`): without, it keeps
    /// no anchor (a copy of the parameters).
    pub publishes: bool,
    /// Whether to measure ‖pending delta‖ / ‖parameters‖ after each step, for the policy's
    /// early-publish rule (it costs a copy of the parameters).
    pub measure_pending_ratio: bool,
    /// Wait for [`Command::Start`] (or a restore) before the first step.
    pub start_paused: bool,
    /// Debug throttle: sleep this long after every step.
    pub step_delay: Duration,
    /// Debug throttle: sleep this long per sample inside every forward-backward pass (a
    /// slower box, as the pass's timing sees it).
    pub sample_delay: Duration,
    /// DiLoCo's outer optimizer, applied when a round's mean is combined; `None`: the mean
    /// is taken as it is (`allreduce`, `fedavg`).
    pub outer: Option<OuterSgd>,
    /// The outer optimizer's velocity restored from a checkpoint (empty: zeros).
    pub outer_velocity: Vec<f32>,
    /// `ddp`: a parameter round carries the optimizer's state after the parameters, so a
    /// joiner leaves it with the members' moments and every member steps alike from then on.
    pub rounds_carry_state: bool,
    /// Every evaluation is appended here as a JSON line (step, wall-clock time, loss,
    /// accuracy, bits per byte), so a run's curve is known by steps and by time, exactly,
    /// whatever polls status (`bench scaling` reads it). `None`: not kept.
    pub eval_log: Option<std::path::PathBuf>,
    /// `train.target`: the first evaluation that reaches it is logged with its step and the
    /// seconds since start.
    pub target: Option<f64>,
    /// A clock-triggered evaluation (`eval_every_time`) waits for a step that is a multiple
    /// of this (0 or 1: none). Members that step in lockstep (`ddp`) then evaluate at the same
    /// step, together, instead of each stalling the others' next round for its own.
    pub eval_align_steps: u64,
    /// Parameter-averaging modes (`allreduce`, `diloco`, `fedavg`; `ddp` steps only on
    /// rounds' means and needs none): at `max_steps`, a trainer the mesh holds at a round's boundary
    /// waits (up to [`FINAL_ROUND_WAIT`]) for that round before it stops, so every member's
    /// final checkpoint is the round's mean, not its own last local step.
    pub ends_on_a_round: bool,
    /// `diloco` with `sync.overlap_steps`: the trainer keeps a copy of the parameters it gives
    /// a round, because it trains on while the round runs and must add what it trained since
    /// to the round's result.
    pub keeps_given_params: bool,
}

/// How long a trainer at `max_steps` waits for the round it is held at
/// ([`Setup::ends_on_a_round`]); past it, it stops on its own parameters (members gone).
pub const FINAL_ROUND_WAIT: Duration = Duration::from_secs(30);

/// [`Setup::eval_align_steps`] for members that step in lockstep: about two seconds of a GPT
/// on one core, which delays an evaluation on a ten-second clock by at most that.
pub const LOCKSTEP_EVAL_ALIGN_STEPS: u64 = 10;

/// DiLoCo's outer optimizer, defined with the arithmetic that applies it.
pub use p2ptrain_models::replica::OuterSgd;

/// Identities stamped on every snapshot.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Run id.
    pub run_id: String,
    /// Full configuration hash.
    pub config_hash: String,
}

/// Step and sample counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    /// Training steps.
    pub step: u64,
    /// Samples trained on.
    pub samples_seen: u64,
}

/// Why the trainer stopped, with its final state.
#[derive(Debug)]
pub struct Finish {
    /// The state at the moment it stopped.
    pub snapshot: Snapshot,
    /// True when `max_steps` was reached, false when it was asked to stop.
    pub reached_max_steps: bool,
    /// Final progress.
    pub stats: Stats,
}

/// Handles to a running trainer thread.
pub struct Handle {
    /// Commands to the thread.
    pub cmd_tx: mpsc::Sender<Command>,
    /// Its progress.
    pub stats_rx: watch::Receiver<Stats>,
    /// What it tells the mesh.
    pub events_rx: mpsc::Receiver<TrainerEvent>,
    /// Resolves when the thread ends: its final state, or why it failed.
    pub done_rx: oneshot::Receiver<Result<Finish, TrainerError>>,
}
