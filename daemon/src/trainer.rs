//! The trainer: one OS thread that owns the model, the optimizer, the data and the device.
//!
//! Candle compute never runs on a tokio worker (a training step would stall every socket the
//! runtime drives). The async side talks to this thread through a bounded command channel that
//! the loop polls between steps, reads its progress from a `watch` channel, and receives
//! periodic snapshots for checkpointing through another bounded channel. The loop never
//! blocks on any of them: a full snapshot channel means the writer is behind, and that
//! checkpoint is skipped rather than stalling training.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use p2ptrain_models::data::{Sampler, Split};
use p2ptrain_models::params::l2_norm;
use p2ptrain_models::train::{evaluate, train_step};
use p2ptrain_models::{Model, ModelSpec, Optimizer, OptimizerSpec};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::{HostTensor, Snapshot, StateInfo};
use crate::policy::{Action, PolicyConfig, PolicyEvent, SyncPolicy};
use crate::store::Loaded;
use crate::sync_guard::{self, SyncRefusal};

/// Capacity of the command channel: commands are rare (checkpoint, restore, stop) and each
/// is handled within one training step.
pub const COMMAND_CAP: usize = 16;
/// Capacity of the automatic-snapshot channel; a second pending snapshot means the disk is
/// slower than the checkpoint interval, and the newer one is dropped.
pub const SNAPSHOT_CAP: usize = 1;
/// How often progress is published to the `watch` channel.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
/// Steps averaged into the reported recent loss.
const LOSS_WINDOW: usize = 50;
/// Least time between two evaluation lines in the log.
const EVAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// How often a node held back by the staleness bound looks again.
const HELD_POLL: Duration = Duration::from_millis(5);
/// Samples per evaluation batch.
const EVAL_BATCH: usize = 1000;

/// A request to the trainer thread, handled between two steps.
#[derive(Debug)]
pub enum Command {
    /// Copy the current state for a checkpoint.
    Snapshot(oneshot::Sender<Snapshot>),
    /// Replace the state with a verified checkpoint.
    Restore(Box<Loaded>, oneshot::Sender<Result<(), String>>),
    /// Finish the current step, then stop and hand back the final state.
    Stop,
    /// A neighbour's update, validated by the mesh; the sync policy weighs it by the
    /// neighbourhood's size and its staleness, then it is added to the parameters.
    ApplyUpdate {
        /// Its author.
        peer: String,
        /// The author's step when it published.
        step: u64,
        /// Flat values in canonical order.
        values: Vec<f32>,
    },
    /// A peer entered (`up`) or left this node's neighbour set.
    Neighbour {
        /// The peer.
        peer: String,
        /// Whether it joined the set.
        up: bool,
    },
    /// Progress news about a peer (its heartbeat), for the staleness bound.
    PeerStep {
        /// The peer.
        peer: String,
        /// Its step.
        step: u64,
    },
    /// A full sync the trainer asked for (see [`Outgoing::Sync`]) ended.
    SyncFinished {
        /// The neighbour.
        peer: String,
        /// Whether the parameters were averaged.
        ok: bool,
    },
    /// The current step and flat parameters, for a neighbour that syncs with this node.
    Params(oneshot::Sender<(u64, Vec<f32>)>),
    /// Averages the parameters with a neighbour's if they pass [`sync_guard::judge`] against
    /// `bound`; answers the relative L2 distance `|mine - theirs| / |mine|` measured before
    /// averaging, or why the reply was refused (nothing is changed then).
    Average {
        /// The neighbour's flat parameters.
        theirs: Vec<f32>,
        /// The largest distance accepted (see [`sync_guard::SyncGuard::bound`]).
        bound: f64,
        /// The distance or the refusal; the outer error is the trainer's own failure.
        reply: oneshot::Sender<Result<Result<f64, SyncRefusal>, String>>,
    },
    /// Begin training: a joiner starts paused until its state has been downloaded.
    Start,
}

/// Work the trainer's sync policy hands to the mesh.
#[derive(Debug)]
pub enum Outgoing {
    /// An update to publish: the change this node's own optimizer made since the last one
    /// (neighbours' updates and syncs excluded, so nothing echoes back through the mesh).
    Update {
        /// Step of the previous update: this one covers `base_step..step`.
        base_step: u64,
        /// Step at which it was taken.
        step: u64,
        /// Flat change, canonical order.
        delta: Vec<f32>,
    },
    /// Run a full sync with this neighbour and report [`Command::SyncFinished`].
    Sync {
        /// The neighbour.
        peer: String,
    },
}

/// What the trainer is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Building the model or loading state.
    #[default]
    Starting,
    /// Taking steps.
    Training,
    /// Stopped (max steps reached or asked to stop).
    Stopped,
}

/// The latest evaluation on the held-out set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalStats {
    /// Fraction correct.
    pub accuracy: f64,
    /// Mean cross-entropy.
    pub loss: f64,
    /// Step at which it was taken.
    pub step: u64,
}

/// Progress the trainer publishes; read by the status API.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Stats {
    /// What the trainer is doing.
    pub phase: Phase,
    /// Training steps taken (including those restored from a checkpoint).
    pub step: u64,
    /// Samples trained on (including those restored).
    pub samples_seen: u64,
    /// Mean loss over the last steps.
    pub loss: Option<f64>,
    /// Latest evaluation.
    pub eval: Option<EvalStats>,
    /// Recent throughput.
    pub samples_per_sec: f64,
    /// Steps taken since this process started.
    pub steps_this_run: u64,
    /// Seconds spent in the training loop since this process started (evaluation included).
    pub train_secs: f64,
    /// Of those, seconds spent evaluating on the held-out set.
    pub eval_secs: f64,
    /// Neighbours' updates applied.
    pub updates_applied: u64,
    /// Own updates handed over for publishing.
    pub updates_published: u64,
    /// L2 norm of the parameters at the last publish or evaluation; the mesh bounds
    /// neighbours' updates relative to it.
    pub param_norm: f64,
    /// Neighbours' updates dropped as too stale.
    pub updates_dropped_stale: u64,
    /// Whether the staleness bound holds this node back now.
    pub held: bool,
    /// Seconds spent held back by the staleness bound.
    pub held_secs: f64,
    /// Steps this node is ahead of its slowest neighbour, as far as it knows.
    pub lead_over_slowest: Option<u64>,
}

/// Everything the trainer thread needs, prepared (and validated) before it starts.
pub struct Setup {
    /// The built model, already holding the initial or restored parameters.
    pub model: Model,
    /// Its optimizer, already holding restored state if any.
    pub optimizer: Optimizer,
    /// Training and held-out data.
    pub split: Arc<Split>,
    /// Where tensors live.
    pub device: Device,
    /// Samples per step.
    pub batch_size: usize,
    /// Steps between evaluations (0: never).
    pub eval_every: u64,
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
    /// When to publish, sync and wait (see [`crate::policy`]).
    pub policy: PolicyConfig,
    /// Fixed weight for neighbours' updates instead of the policy's (a debug override).
    pub update_weight: Option<f32>,
    /// Wait for [`Command::Start`] (or a restore) before the first step.
    pub start_paused: bool,
    /// Debug throttle: sleep this long after every step.
    pub step_delay: Duration,
}

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
    /// Resolves when the thread ends: its final state, or why it failed.
    pub done_rx: oneshot::Receiver<Result<Finish, String>>,
}

/// Builds the model and optimizer for a run, restoring a checkpoint when one is given.
pub fn build(
    spec: &ModelSpec,
    opt_spec: &OptimizerSpec,
    init_seed: u64,
    device: &Device,
    identity: &Identity,
    resume: Option<&Loaded>,
) -> Result<(Model, Optimizer, Counters), String> {
    let model = Model::new(spec, init_seed, device).map_err(|e| e.to_string())?;
    let mut optimizer = Optimizer::new(opt_spec, model.params()).map_err(|e| e.to_string())?;
    let mut counters = Counters::default();
    if let Some(loaded) = resume {
        counters = restore_into(&model, &mut optimizer, identity, loaded)?;
    }
    Ok((model, optimizer, counters))
}

/// Loads a verified checkpoint into model and optimizer; refuses one of another run or layout
/// and changes nothing then.
fn restore_into(
    model: &Model,
    optimizer: &mut Optimizer,
    identity: &Identity,
    loaded: &Loaded,
) -> Result<Counters, String> {
    let info = &loaded.meta.info;
    if info.run_id != identity.run_id {
        return Err(format!(
            "checkpoint {} belongs to run {}, this node runs {}",
            loaded.meta.id, info.run_id, identity.run_id
        ));
    }
    let layout = model.params().layout().hash();
    if info.layout_hash != layout {
        return Err(format!(
            "checkpoint {} has parameter layout {}, the model has {layout}",
            loaded.meta.id, info.layout_hash
        ));
    }
    // A checksummed file can still hold NaN (a donor whose model diverged, or a hostile one):
    // nothing non-finite is loaded.
    if let Some((name, _)) = loaded
        .tensors
        .iter()
        .find(|(_, t)| t.values.iter().any(|v| !v.is_finite()))
    {
        return Err(format!(
            "checkpoint {} holds NaN or infinite values in {name}",
            loaded.meta.id
        ));
    }
    let device = model
        .params()
        .vars()
        .first()
        .map(|(_, v)| v.device().clone())
        .unwrap_or(Device::Cpu);
    let tensors = to_device(&loaded.tensors, &device).map_err(|e| e.to_string())?;
    // Check the optimizer state loads before touching the parameters, so a failure leaves both
    // as they were.
    let mut staged = Optimizer::new(optimizer.spec(), model.params()).map_err(|e| e.to_string())?;
    staged
        .load(model.params(), info.optimizer_steps, &tensors)
        .map_err(|e| e.to_string())?;
    model.params().load(&tensors).map_err(|e| e.to_string())?;
    *optimizer = staged;
    Ok(Counters {
        step: info.step,
        samples_seen: info.samples_seen,
    })
}

fn to_device(
    tensors: &BTreeMap<String, HostTensor>,
    dev: &Device,
) -> candle_core::Result<HashMap<String, Tensor>> {
    tensors
        .iter()
        .map(|(name, t)| {
            Ok((
                name.clone(),
                Tensor::from_slice(&t.values, t.shape.as_slice(), dev)?,
            ))
        })
        .collect()
}

fn host(t: &Tensor) -> candle_core::Result<HostTensor> {
    Ok(HostTensor {
        shape: t.dims().to_vec(),
        values: t
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?,
    })
}

/// Starts the trainer thread.
pub fn spawn(
    setup: Setup,
    snapshot_tx: mpsc::Sender<Snapshot>,
    update_tx: mpsc::Sender<Outgoing>,
) -> std::io::Result<Handle> {
    let (cmd_tx, cmd_rx) = mpsc::channel(COMMAND_CAP);
    let (stats_tx, stats_rx) = watch::channel(Stats::default());
    let (done_tx, done_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || {
            let mut lp = Loop::new(setup, stats_tx, snapshot_tx, update_tx);
            let result = lp.run(cmd_rx);
            let _ = done_tx.send(result);
        })?;
    Ok(Handle {
        cmd_tx,
        stats_rx,
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
    losses: VecDeque<f32>,
    last_checkpoint_step: u64,
    last_checkpoint_at: Instant,
    last_eval_log: Option<Instant>,
    update_tx: mpsc::Sender<Outgoing>,
    /// Parameters when the last update was handed over.
    anchor: Vec<f32>,
    /// Changes since then that were not this node's own steps (neighbours' updates, syncs).
    foreign: Vec<f32>,
    last_publish_step: u64,
    paused: bool,
    policy: SyncPolicy<String>,
    held_since: Option<Instant>,
}

impl Loop {
    fn new(
        s: Setup,
        stats_tx: watch::Sender<Stats>,
        snapshot_tx: mpsc::Sender<Snapshot>,
        update_tx: mpsc::Sender<Outgoing>,
    ) -> Loop {
        let mut sampler = Sampler::new(s.split.train.len(), s.node_seed);
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
            losses: VecDeque::with_capacity(LOSS_WINDOW),
            last_checkpoint_step: counters.step,
            last_checkpoint_at: Instant::now(),
            last_eval_log: None,
            update_tx,
            anchor: Vec::new(),
            foreign: Vec::new(),
            last_publish_step: counters.step,
            paused: s.start_paused,
            policy: SyncPolicy::new(s.policy.clone(), counters.step),
            held_since: None,
            s,
        }
    }

    fn snapshot(&self) -> Result<Snapshot, String> {
        let params = self.s.model.params();
        let mut tensors = BTreeMap::new();
        for (name, var) in params.vars() {
            tensors.insert(
                name.clone(),
                host(var.as_tensor()).map_err(|e| e.to_string())?,
            );
        }
        for (name, t) in self.s.optimizer.named_buffers(params) {
            tensors.insert(name, host(&t).map_err(|e| e.to_string())?);
        }
        Ok(Snapshot {
            info: StateInfo {
                run_id: self.s.identity.run_id.clone(),
                config_hash: self.s.identity.config_hash.clone(),
                layout_hash: params.layout().hash(),
                model: self.s.model.spec().name(),
                optimizer: match self.s.optimizer.spec() {
                    OptimizerSpec::Sgd { .. } => "sgd".into(),
                    OptimizerSpec::Adamw { .. } => "adamw".into(),
                },
                step: self.counters.step,
                samples_seen: self.counters.samples_seen,
                optimizer_steps: self.s.optimizer.steps(),
            },
            tensors,
        })
    }

    fn evaluate(&mut self) -> Result<(), String> {
        let started = Instant::now();
        let e = evaluate(
            &self.s.model,
            &self.s.split.test,
            EVAL_BATCH,
            &self.s.device,
        )
        .map_err(|e| e.to_string())?;
        self.stats.eval_secs += started.elapsed().as_secs_f64();
        // Evaluations can come many times a second on small models: log at info only now and
        // then, so the log stays readable; status always has the latest.
        if self
            .last_eval_log
            .is_none_or(|t| t.elapsed() >= EVAL_LOG_EVERY)
        {
            tracing::info!(
                step = self.counters.step,
                accuracy = format!("{:.4}", e.accuracy),
                loss = format!("{:.4}", e.loss),
                samples_per_sec = format!("{:.0}", self.stats.samples_per_sec),
                "evaluated on held-out set"
            );
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

    /// Handles pending commands; returns true when asked to stop.
    fn handle_commands(&mut self, cmd_rx: &mut mpsc::Receiver<Command>) -> Result<bool, String> {
        while let Ok(cmd) = cmd_rx.try_recv() {
            match cmd {
                Command::Stop => return Ok(true),
                Command::Snapshot(reply) => {
                    let _ = reply.send(self.snapshot()?);
                }
                Command::Restore(loaded, reply) => {
                    let result = restore_into(
                        &self.s.model,
                        &mut self.s.optimizer,
                        &self.s.identity,
                        &loaded,
                    );
                    if let Ok(c) = &result {
                        self.counters = *c;
                        self.sampler.seek(c.samples_seen);
                        self.losses.clear();
                        self.last_publish_step = c.step;
                        self.reset_anchor()?;
                        tracing::info!(id = loaded.meta.id, step = c.step, "restored state");
                        // The first evaluation right away shows what the restored state is worth.
                        self.evaluate()?;
                        self.paused = false;
                        self.publish();
                    }
                    let _ = reply.send(result.map(|_| ()));
                }
                Command::Start => self.paused = false,
                Command::Params(reply) => {
                    let flat = self.s.model.params().flatten().map_err(|e| e.to_string())?;
                    let _ = reply.send((self.counters.step, flat));
                }
                Command::ApplyUpdate { peer, step, values } => {
                    let actions = self
                        .policy
                        .handle(PolicyEvent::UpdateArrived { peer, step }, Instant::now());
                    for action in actions {
                        match action {
                            Action::Apply { weight, .. } => {
                                let weight = self.s.update_weight.unwrap_or(weight);
                                self.apply_update(&values, weight)?;
                            }
                            Action::Drop { peer, staleness } => {
                                tracing::debug!(%peer, staleness, "stale update dropped");
                                self.stats.updates_dropped_stale += 1;
                            }
                            other => self.act(other)?,
                        }
                    }
                }
                Command::Neighbour { peer, up } => {
                    let ev = if up {
                        PolicyEvent::NeighbourUp { peer }
                    } else {
                        PolicyEvent::NeighbourDown { peer }
                    };
                    self.feed(ev)?;
                }
                Command::PeerStep { peer, step } => self.feed(PolicyEvent::Heard { peer, step })?,
                Command::SyncFinished { peer, ok } => {
                    self.feed(PolicyEvent::SyncFinished { peer, ok })?
                }
                Command::Average {
                    theirs,
                    bound,
                    reply,
                } => {
                    let _ = reply.send(self.average(&theirs, bound));
                }
            }
        }
        Ok(false)
    }

    /// Takes the current parameters as the base of the next outgoing update.
    fn reset_anchor(&mut self) -> Result<(), String> {
        let flat = self.s.model.params().flatten().map_err(|e| e.to_string())?;
        self.stats.param_norm = l2_norm(&flat);
        if self.s.policy.publish_every > 0 {
            self.foreign = vec![0.0; flat.len()];
            self.anchor = flat;
        }
        Ok(())
    }

    fn apply_update(&mut self, values: &[f32], weight: f32) -> Result<(), String> {
        let mut flat = self.s.model.params().flatten().map_err(|e| e.to_string())?;
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

    /// Feeds the sync policy one event and carries out what it asks.
    fn feed(&mut self, ev: PolicyEvent<String>) -> Result<(), String> {
        let actions = self.policy.handle(ev, Instant::now());
        for a in actions {
            self.act(a)?;
        }
        Ok(())
    }

    fn act(&mut self, action: Action<String>) -> Result<(), String> {
        match action {
            Action::Publish => self.publish_update()?,
            Action::FullSync { peer } => {
                if let Err(e) = self.update_tx.try_send(Outgoing::Sync { peer }) {
                    // The mesh is behind; report the sync as failed so another is tried.
                    if let Outgoing::Sync { peer } = e.into_inner() {
                        self.feed(PolicyEvent::SyncFinished { peer, ok: false })?;
                    }
                }
            }
            Action::Hold => {
                if !self.policy.is_held() {
                    return Ok(());
                }
                if self.held_since.is_none() {
                    self.held_since = Some(Instant::now());
                }
                self.stats.held = true;
            }
            Action::Resume => {
                if let Some(t) = self.held_since.take() {
                    self.stats.held_secs += t.elapsed().as_secs_f64();
                }
                self.stats.held = false;
            }
            // Answers to arriving updates are handled where the update is.
            Action::Apply { .. } | Action::Drop { .. } => {}
        }
        Ok(())
    }

    fn average(&mut self, theirs: &[f32], bound: f64) -> Result<Result<f64, SyncRefusal>, String> {
        let mine = self.s.model.params().flatten().map_err(|e| e.to_string())?;
        let distance = match sync_guard::judge(&mine, theirs, bound) {
            Ok(d) => d,
            Err(refusal) => return Ok(Err(refusal)),
        };
        let merged: Vec<f32> = mine
            .iter()
            .zip(theirs)
            .map(|(a, b)| 0.5 * (a + b))
            .collect();
        self.s
            .model
            .params()
            .write_back(&merged)
            .map_err(|e| e.to_string())?;
        if self.foreign.len() == merged.len() {
            for ((f, m), a) in self.foreign.iter_mut().zip(&merged).zip(&mine) {
                *f += m - a;
            }
        }
        Ok(Ok(distance))
    }

    /// ‖own change since the last update‖ / ‖parameters‖, for the policy's early-publish
    /// rule; measured only when that rule is on (it costs a copy of the parameters).
    fn pending_ratio(&self) -> Result<f64, String> {
        if self.s.policy.publish_early_ratio <= 0.0 || self.anchor.is_empty() {
            return Ok(0.0);
        }
        let now = self.s.model.params().flatten().map_err(|e| e.to_string())?;
        let (mut d, mut n) = (0.0f64, 0.0f64);
        for ((x, a), f) in now.iter().zip(&self.anchor).zip(&self.foreign) {
            d += f64::from(x - a - f).powi(2);
            n += f64::from(*x).powi(2);
        }
        Ok(d.sqrt() / n.sqrt().max(f64::MIN_POSITIVE))
    }

    /// Hands the mesh this node's own change since the last update. When the mesh has not
    /// taken the previous one yet, nothing is queued: the change keeps accumulating and goes
    /// out whole next time (merged, never stale).
    fn publish_update(&mut self) -> Result<(), String> {
        // Publish only into an empty channel (room stays for a sync request), and only the
        // newest change: a queued update would be older than the one after it.
        if self.update_tx.capacity() < self.update_tx.max_capacity() {
            return Ok(());
        }
        let now = self.s.model.params().flatten().map_err(|e| e.to_string())?;
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
        if self
            .update_tx
            .try_send(Outgoing::Update {
                base_step: self.last_publish_step,
                step,
                delta,
            })
            .is_ok()
        {
            self.anchor = now;
            self.foreign.iter_mut().for_each(|f| *f = 0.0);
            self.stats.updates_published += 1;
            self.last_publish_step = step;
            self.feed(PolicyEvent::Published { step })?;
        }
        Ok(())
    }

    fn run(&mut self, mut cmd_rx: mpsc::Receiver<Command>) -> Result<Finish, String> {
        self.reset_anchor()?;
        // The parameters' norm, which bounds neighbours' updates, is known from the start.
        self.publish();
        // A joiner waits here for its downloaded state (or the word to start without one).
        while self.paused {
            match cmd_rx.blocking_recv() {
                None | Some(Command::Stop) => {
                    self.stats.phase = Phase::Stopped;
                    self.publish();
                    return Ok(Finish {
                        snapshot: self.snapshot()?,
                        reached_max_steps: false,
                        stats: self.stats.clone(),
                    });
                }
                Some(Command::Start) => self.paused = false,
                Some(other) => {
                    // Put it back through the normal handler.
                    let (tx, mut rx) = mpsc::channel(1);
                    let _ = tx.try_send(other);
                    drop(tx);
                    self.handle_commands(&mut rx)?;
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
            if self.policy.is_held() {
                // The staleness bound: wait for the slowest neighbour (or its timeout).
                std::thread::sleep(HELD_POLL);
                self.feed(PolicyEvent::Tick)?;
                self.stats.lead_over_slowest = self.policy.lead_over_slowest(Instant::now());
                if last_publish.elapsed() >= PUBLISH_EVERY {
                    self.publish();
                    last_publish = Instant::now();
                }
                continue;
            }
            let indices = self.sampler.next_batch(self.s.batch_size);
            let (xs, ys) = self
                .s
                .split
                .train
                .batch(&indices, &self.s.device)
                .map_err(|e| e.to_string())?;
            let loss = train_step(&self.s.model, &mut self.s.optimizer, &xs, &ys)
                .map_err(|e| e.to_string())?;
            if !loss.is_finite() {
                return Err(format!(
                    "training diverged at step {} (loss {loss}); the last checkpoint is kept untouched",
                    self.counters.step
                ));
            }
            self.counters.step += 1;
            self.counters.samples_seen += indices.len() as u64;
            self.stats.steps_this_run += 1;
            if self.losses.len() == LOSS_WINDOW {
                self.losses.pop_front();
            }
            self.losses.push_back(loss);

            if self.s.eval_every > 0 && self.counters.step.is_multiple_of(self.s.eval_every) {
                self.evaluate()?;
            }
            let pending_ratio = self.pending_ratio()?;
            self.feed(PolicyEvent::Stepped {
                step: self.counters.step,
                pending_ratio,
            })?;
            if !self.s.step_delay.is_zero() {
                std::thread::sleep(self.s.step_delay);
            }
            let by_steps = self.s.checkpoint_every_steps > 0
                && self.counters.step - self.last_checkpoint_step >= self.s.checkpoint_every_steps;
            let by_time = !self.s.checkpoint_every.is_zero()
                && self.last_checkpoint_at.elapsed() >= self.s.checkpoint_every;
            if by_steps || by_time {
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
                self.feed(PolicyEvent::Tick)?;
                self.stats.lead_over_slowest = self.policy.lead_over_slowest(now);
                self.publish();
                last_publish = now;
            }
        }
        self.stats.train_secs = started.elapsed().as_secs_f64();
        if self.s.eval_every > 0 && self.stats.eval.map(|e| e.step) != Some(self.counters.step) {
            self.evaluate()?;
        }
        self.stats.phase = Phase::Stopped;
        self.publish();
        Ok(Finish {
            snapshot: self.snapshot()?,
            reached_max_steps,
            stats: self.stats.clone(),
        })
    }
}
