//! The mesh core: every decision this node makes about peers, updates and syncs, as one IO-less
//! state machine.
//!
//! It owns membership and the choice of neighbours (from a seeded RNG), the sync policy
//! ([`crate::policy`]), the guards on neighbours' updates ([`crate::guard`]) and on full-sync
//! replies ([`crate::sync_guard`]), the replay and staleness bookkeeping, this node's
//! error-feedback residual, the queue of updates waiting for the trainer, and the offences that
//! feed peer scoring. It holds no socket, task, channel or clock: the mesh actor
//! ([`crate::mesh`]) turns network events, trainer events and timer ticks into [`Input`]s, calls
//! [`MeshCore::handle`] with the current instant, and carries out the returned [`Output`]s. The
//! seeded simulator in this module's tests drives the very same code with many nodes.
//!
//! Peers are keyed by libp2p's [`PeerId`] throughout. Nothing in here panics, whatever the
//! inputs and instants.

mod messages;
pub mod rounds;
#[cfg(test)]
mod sim;
pub mod status;
mod syncs;
#[cfg(test)]
mod tests;
mod updates;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::gossipsub::MessageAcceptance;
use libp2p::PeerId;
use p2ptrain_models::codec::{self, Codec, ErrorFeedback};
use p2ptrain_models::params::Layout;
use rand::rngs::StdRng;
use rand::seq::IteratorRandom;
use rand::SeedableRng;

use crate::guard::{GuardConfig, SeenSteps, UpdateGuard};
use crate::policy::{Action, PolicyConfig, PolicyEvent, SyncPolicy};
use crate::sync_guard::SyncGuard;
use crate::wire::{self, Heartbeat};
use rounds::{RoundConfig, Rounds};

pub use messages::{
    AverageOutcome, FetchAnswer, Input, Output, Phase, Progress, RequestFailed, TrainerCommand,
    TrainerEvent,
};
pub use status::{FullSyncCounters, MeshStatus, SyncInfo, SyncRefusalInfo, UpdateCounters};

/// How often neighbours are re-chosen.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How often a node tells the mesh its progress.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// In a synchronous mode, a new member hears this node's heartbeat this soon after it
/// connects (time for gossip to learn its subscriptions), not up to [`HEARTBEAT_EVERY`] later:
/// a round waits for every member's word that it is ready.
pub const NEW_MEMBER_HEARTBEAT_AFTER: Duration = Duration::from_millis(300);
/// Large updates kept for neighbours to pull.
const LARGE_UPDATE_CAP: usize = 4;
/// Updates waiting for a busy trainer before they are merged.
const PENDING_CAP: usize = 8;
/// Pause after a neighbour declined a sync, before the policy may start the next one: without
/// it a lone neighbour that declines (a joiner still downloading) was asked ~300 times a second.
const SYNC_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Peers kept in the per-peer counters of status (rejections, refusals): beyond it the oldest
/// entries go, so a flood of fresh identities cannot grow memory.
const PER_PEER_CAP: usize = 1024;

/// Mesh settings.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// Neighbours to keep.
    pub degree: usize,
    /// Updates up to this many bytes travel inside the gossip message; larger ones are
    /// announced and pulled over the bulk channel.
    pub inline_max: usize,
    /// A neighbour's update whose norm exceeds this times our parameters' norm is rejected.
    pub max_update_ratio: f64,
    /// Debug throttle: delay before serving each state chunk (used by the actor).
    pub serve_chunk_delay: Duration,
    /// How own updates are encoded.
    pub codec: Codec,
    /// Kept fraction for top-k.
    pub density: f64,
    /// Keep what a lossy codec did not send and add it to the next update.
    pub error_feedback: bool,
    /// Outlier bound and rate limit on neighbours' updates.
    pub guard: GuardConfig,
    /// Cap on the distance bound of full-sync replies (`sync.max_sync_distance`).
    pub max_sync_distance: f64,
}

/// Everything the core needs to know about this node and its run.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// This node.
    pub me: PeerId,
    /// The run every update must belong to.
    pub run_id: String,
    /// The model's parameter layout, which every update and sync must fit.
    pub layout: Layout,
    /// Neighbours, codec and guards.
    pub mesh: MeshConfig,
    /// When to publish, sync and hold.
    pub policy: PolicyConfig,
    /// Fixed weight for neighbours' updates instead of the policy's (`sync.update_weight`).
    pub update_weight: Option<f32>,
    /// This node's step when the core starts (a resumed checkpoint's).
    pub start_step: u64,
    /// Seeds neighbour choice, so a simulation replays exactly.
    pub seed: u64,
    /// Dates what the status records (syncs, refusals) from the instants the core is handed.
    pub wall_clock: WallClock,
    /// Synchronous rounds instead of gossip (sync modes `allreduce`, `diloco`, `fedavg`), and
    /// whether this node starts with the mesh's parameters (a founder) or must adopt them (a
    /// joiner, a resumed node).
    pub rounds: Option<(RoundConfig, bool)>,
}

/// The Unix time at one instant. The core dates what it records from the instants it is
/// handed, never from the system clock, so a simulation in virtual time dates in it too.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    /// Seconds since the Unix epoch at `at`.
    pub unix_secs: u64,
    /// The instant those seconds were read.
    pub at: Instant,
}

impl WallClock {
    /// Unix seconds at `now` (at `at` for an instant before it).
    pub fn unix_at(&self, now: Instant) -> u64 {
        self.unix_secs
            .saturating_add(now.saturating_duration_since(self.at).as_secs())
    }
}

/// One neighbour sync under way.
#[derive(Debug, Clone)]
struct SyncInFlight {
    peer: PeerId,
    /// Numbers the trainer's answer, so one for an older sync is not taken for this one.
    seq: u64,
    /// Our step when it started.
    step: u64,
    /// When it was asked for: a sync's latency runs from here to the averaging.
    started: Instant,
}

/// The mesh core; see the module docs.
pub struct MeshCore {
    cfg: CoreConfig,
    me_bytes: [u8; 8],
    run_bytes: [u8; 8],
    layout_bytes: [u8; 8],
    update_topic_prefix: String,
    heartbeat_topic: String,
    rng: StdRng,
    progress: Progress,
    members: BTreeSet<PeerId>,
    neighbours: BTreeSet<PeerId>,
    policy: SyncPolicy<PeerId>,
    guard: UpdateGuard<PeerId>,
    seen_steps: HashMap<PeerId, SeenSteps>,
    sync_guard: SyncGuard,
    compressor: ErrorFeedback,
    large: VecDeque<([u8; 32], Arc<Vec<u8>>)>,
    pending_apply: VecDeque<(Vec<f32>, f32)>,
    delta_asked: bool,
    sync: Option<SyncInFlight>,
    sync_seq: u64,
    /// A declined sync reported to the policy only after [`SYNC_RETRY_PAUSE`].
    sync_finish_at: Option<(PeerId, Instant)>,
    next_refresh: Option<Instant>,
    next_heartbeat: Option<Instant>,
    rounds: Option<Rounds>,
    /// A round's trainer command the trainer's full queue refused, sent again at the next tick.
    round_command: Option<TrainerCommand>,
    heartbeats_sent: u64,
    /// What the last heartbeat told the rounds: whether this node is ready for them, and
    /// whether it knew its speed. When either changes, the next heartbeat goes out at once
    /// (a `ddp` member's batch depends on the others' speeds).
    announced: (bool, bool),
    status: MeshStatus,
}

/// The topic a node publishes its updates on.
pub fn update_topic(run_id: &str, peer: &PeerId) -> String {
    format!("p2ptrain/{run_id}/updates/{peer}")
}

/// The topic every member publishes its progress on.
pub fn heartbeat_topic(run_id: &str) -> String {
    format!("p2ptrain/{run_id}/heartbeat")
}

impl MeshCore {
    /// A core for this node; [`MeshCore::start`] gives the first outputs.
    pub fn new(cfg: CoreConfig) -> MeshCore {
        let numel = cfg.layout.numel();
        let sync_guard = SyncGuard::new(cfg.mesh.max_sync_distance);
        let status = MeshStatus {
            full_syncs: FullSyncCounters {
                bound: sync_guard.bound(),
                ..FullSyncCounters::default()
            },
            ..MeshStatus::default()
        };
        MeshCore {
            me_bytes: codec::sender_bytes(&cfg.me.to_bytes()),
            run_bytes: codec::id_bytes(&cfg.run_id),
            layout_bytes: codec::id_bytes(&cfg.layout.hash()),
            update_topic_prefix: format!("p2ptrain/{}/updates/", cfg.run_id),
            heartbeat_topic: heartbeat_topic(&cfg.run_id),
            rng: StdRng::seed_from_u64(cfg.seed),
            progress: Progress::default(),
            members: BTreeSet::new(),
            neighbours: BTreeSet::new(),
            policy: SyncPolicy::new(cfg.policy.clone(), cfg.start_step),
            guard: UpdateGuard::new(cfg.mesh.guard),
            seen_steps: HashMap::new(),
            sync_guard,
            compressor: ErrorFeedback::new(numel, cfg.mesh.error_feedback),
            large: VecDeque::new(),
            pending_apply: VecDeque::new(),
            delta_asked: false,
            sync: None,
            sync_seq: 0,
            sync_finish_at: None,
            next_refresh: None,
            next_heartbeat: None,
            rounds: cfg
                .rounds
                .map(|(rc, synced)| Rounds::new(rc, cfg.me, cfg.start_step, synced)),
            round_command: None,
            heartbeats_sent: 0,
            announced: (false, false),
            status,
            cfg,
        }
    }

    /// What to do before the first input: listen to the run's heartbeats.
    pub fn start(&self) -> Vec<Output> {
        vec![Output::Subscribe(self.heartbeat_topic.clone())]
    }

    /// Handles one input at `now` and says what to do about it.
    pub fn handle(&mut self, input: Input, now: Instant) -> Vec<Output> {
        let mut out = Vec::new();
        let tick = matches!(input, Input::Tick);
        match input {
            Input::PeerUp(peer) => {
                if peer != self.cfg.me {
                    if self.members.insert(peer) && self.rounds.is_some() {
                        let soon = now + NEW_MEMBER_HEARTBEAT_AFTER;
                        if self.next_heartbeat.is_none_or(|t| t > soon) {
                            self.next_heartbeat = Some(soon);
                        }
                    }
                    self.refresh_neighbours(now, &mut out);
                }
            }
            Input::PeerDown(peer) => self.drop_member(peer, now, &mut out),
            Input::Ring { peer, msg } => {
                if let Some(r) = self
                    .rounds
                    .as_mut()
                    .filter(|_| self.members.contains(&peer))
                {
                    r.message(peer, msg, now, &mut out);
                }
            }
            Input::RingUndelivered {
                peer,
                round,
                attempt,
            } => {
                if let Some(r) = &mut self.rounds {
                    r.undelivered(peer, round, attempt, now);
                }
            }
            Input::Gossip {
                source,
                author,
                id,
                topic,
                data,
            } => {
                if let Some(acceptance) =
                    self.on_gossip(source, author, &id, &topic, data, now, &mut out)
                {
                    out.push(Output::Validate {
                        id,
                        source,
                        acceptance,
                    });
                }
            }
            Input::Fetched {
                owner,
                source,
                id,
                hash,
                answer,
            } => {
                let acceptance = self.on_fetched(owner, hash, answer, now, &mut out);
                out.push(Output::Validate {
                    id,
                    source,
                    acceptance,
                });
            }
            Input::ParamsReply { peer, answer } => {
                self.on_params_reply(peer, answer, now, &mut out)
            }
            Input::UpdatePublished { payload, ok } => self.on_update_published(payload, ok),
            Input::Progress(p) => {
                if let Some(r) = &mut self.rounds {
                    r.own_speed(p.ms_per_sample);
                }
                self.progress = p;
            }
            Input::Trainer(ev) => self.on_trainer(ev, now, &mut out),
            Input::TrainerBusy(cmd) => self.on_trainer_busy(cmd, now, &mut out),
            Input::Tick => self.on_tick(now, &mut out),
            Input::Leave => out.push(self.heartbeat(true)),
        }
        self.status.lead_over_slowest = self.policy.lead_over_slowest(now);
        // Status leaves the core on ticks; the rounds' part is read off then.
        if let (true, Some(r)) = (tick, &self.rounds) {
            self.status.rounds = Some(r.status());
        }
        out
    }

    /// The highest step the trainer may reach before it must wait for its slowest neighbour
    /// (SSP); `None` when nothing holds it back. The trainer may take a step while its step is
    /// below this.
    pub fn step_limit(&self, now: Instant) -> Option<u64> {
        let ssp = self.policy.step_limit(now);
        match &self.rounds {
            Some(r) => Some(ssp.map_or(r.step_limit(), |l| l.min(r.step_limit()))),
            None => ssp,
        }
    }

    /// The next update waiting for the trainer, with its weight.
    pub fn next_apply(&mut self) -> Option<TrainerCommand> {
        self.pending_apply
            .pop_front()
            .map(|(values, weight)| TrainerCommand::Apply { values, weight })
    }

    /// Updates waiting for the trainer.
    pub fn pending_applies(&self) -> usize {
        self.pending_apply.len()
    }

    /// Whether this node trains (and so may answer syncs and judge updates).
    pub fn is_training(&self) -> bool {
        self.progress.phase == Phase::Training
    }

    /// A large update of ours that a neighbour asks for by hash.
    pub fn large_update(&self, hash: &[u8]) -> Option<Arc<Vec<u8>>> {
        self.large
            .iter()
            .find(|(h, _)| h[..] == hash[..])
            .map(|(_, b)| b.clone())
    }

    /// The core's status report.
    pub fn status(&self) -> &MeshStatus {
        &self.status
    }

    /// Current neighbours.
    pub fn neighbours(&self) -> &BTreeSet<PeerId> {
        &self.neighbours
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<Output>) {
        if self.next_refresh.is_none_or(|t| now >= t) {
            self.refresh_neighbours(now, out);
        }
        if self.next_heartbeat.is_none_or(|t| now >= t) || self.rounds_news() != self.announced {
            self.next_heartbeat = Some(now + HEARTBEAT_EVERY);
            out.push(self.heartbeat(false));
        }
        if let Some(cmd) = self.round_command.take() {
            out.push(Output::Trainer(cmd));
        }
        if let Some(r) = &mut self.rounds {
            let training = self.progress.phase == Phase::Training;
            r.tick(self.progress.step, training, now, out);
        }
        if let Some((peer, at)) = self.sync_finish_at {
            if now >= at {
                self.sync_finish_at = None;
                self.feed(PolicyEvent::SyncFinished { peer, ok: false }, now, out);
            }
        }
        self.feed(PolicyEvent::Tick, now, out);
    }

    fn on_trainer(&mut self, ev: TrainerEvent, now: Instant, out: &mut Vec<Output>) {
        match ev {
            TrainerEvent::Stepped {
                step,
                pending_ratio,
            } => {
                self.progress.step = self.progress.step.max(step);
                if let Some(r) = &mut self.rounds {
                    r.stepped(step, out);
                }
                self.feed(
                    PolicyEvent::Stepped {
                        step,
                        pending_ratio,
                    },
                    now,
                    out,
                );
            }
            TrainerEvent::Delta {
                base_step,
                step,
                delta,
            } => {
                self.delta_asked = false;
                self.feed(PolicyEvent::Published { step }, now, out);
                self.publish_update(base_step, step, &delta, out);
            }
            TrainerEvent::Averaged { seq, outcome } => self.on_averaged(seq, outcome, now, out),
            TrainerEvent::Params { step, values } => {
                self.progress.step = self.progress.step.max(step);
                if let Some(r) = &mut self.rounds {
                    r.params(values, step, now, out);
                }
            }
            TrainerEvent::Gradient {
                step,
                values,
                samples,
            } => {
                self.progress.step = self.progress.step.max(step);
                if let Some(r) = &mut self.rounds {
                    r.gradient(values, samples, step, now, out);
                }
            }
            TrainerEvent::Combined {
                round,
                step,
                outcome,
            } => {
                if let Some(r) = &mut self.rounds {
                    match outcome {
                        Ok(digest) => r.combined(round, step, digest, out),
                        Err(e) => {
                            tracing::warn!(
                                round,
                                "the trainer could not take the round's mean: {e}"
                            );
                            r.combine_failed();
                        }
                    }
                }
            }
            TrainerEvent::Restored { step } => self.on_restored(step, now, out),
        }
    }

    fn on_trainer_busy(&mut self, cmd: TrainerCommand, now: Instant, out: &mut Vec<Output>) {
        match cmd {
            // Asked again at the next step the policy finds a publish due.
            TrainerCommand::TakeDelta => self.delta_asked = false,
            TrainerCommand::Apply { values, weight } => {
                self.pending_apply.push_front((values, weight));
            }
            TrainerCommand::Average { seq, .. } => self.on_averaged(
                seq,
                AverageOutcome::Failed("the trainer is busy".into()),
                now,
                out,
            ),
            cmd @ (TrainerCommand::TakeParams
            | TrainerCommand::TakeGradient { .. }
            | TrainerCommand::Combine { .. }) => {
                self.round_command = Some(cmd);
            }
        }
    }

    /// A checkpoint replaced the parameters: the residual, the pending updates and the
    /// policy's counts referred to the old ones.
    fn on_restored(&mut self, step: u64, now: Instant, out: &mut Vec<Output>) {
        self.compressor.reset();
        self.status.residual_norm = 0.0;
        self.pending_apply.clear();
        self.delta_asked = false;
        self.progress.step = step;
        let mut policy = SyncPolicy::new(self.cfg.policy.clone(), step);
        for peer in &self.neighbours {
            let _ = policy.handle(PolicyEvent::NeighbourUp { peer: *peer }, now);
        }
        self.policy = policy;
        // A sync under way measured the old parameters: its answer is ignored.
        self.sync = None;
        self.sync_finish_at = None;
        if let Some(r) = &mut self.rounds {
            r.restored(step);
        }
        self.round_command = None;
        let _ = out;
    }

    /// Feeds the sync policy one event and carries out what it asks.
    fn feed(&mut self, ev: PolicyEvent<PeerId>, now: Instant, out: &mut Vec<Output>) {
        for action in self.policy.handle(ev, now) {
            self.act(action, now, out);
        }
    }

    fn act(&mut self, action: Action<PeerId>, now: Instant, out: &mut Vec<Output>) {
        match action {
            Action::Publish => {
                if !self.delta_asked {
                    self.delta_asked = true;
                    out.push(Output::Trainer(TrainerCommand::TakeDelta));
                }
            }
            Action::FullSync { peer } => self.start_sync(peer, now, out),
            // The trainer reads the step limit; the policy's own hold flag needs no action.
            Action::Hold | Action::Resume => {}
            // Answers to arriving updates are handled where the update is.
            Action::Apply { .. } | Action::Drop { .. } => {}
        }
    }

    fn drop_member(&mut self, peer: PeerId, now: Instant, out: &mut Vec<Output>) {
        self.members.remove(&peer);
        if let Some(r) = &mut self.rounds {
            r.peer_down(peer, now);
        }
        // A member that comes back may have restarted from an older checkpoint: its step
        // numbers repeat, and its updates are news again.
        self.seen_steps.remove(&peer);
        self.guard.forget(&peer);
        self.status.progress.remove(&peer.to_string());
        self.status.members = self.members.iter().copied().collect();
        if self.neighbours.contains(&peer) {
            self.refresh_neighbours(now, out);
        }
    }

    /// Keeps `degree` neighbours among the members, replacing those gone with ones drawn from
    /// the seeded RNG, and tells the network and the policy what changed.
    fn refresh_neighbours(&mut self, now: Instant, out: &mut Vec<Output>) {
        self.next_refresh = Some(now + REFRESH_EVERY);
        self.status.members = self.members.iter().copied().collect();
        let before = self.neighbours.clone();
        self.neighbours.retain(|p| self.members.contains(p));
        let want = self.cfg.mesh.degree.saturating_sub(self.neighbours.len());
        let extra: Vec<PeerId> = self
            .members
            .iter()
            .filter(|p| !self.neighbours.contains(p))
            .copied()
            .choose_multiple(&mut self.rng, want);
        self.neighbours.extend(extra);
        let gone: Vec<PeerId> = before.difference(&self.neighbours).copied().collect();
        let new: Vec<PeerId> = self.neighbours.difference(&before).copied().collect();
        for peer in gone {
            tracing::info!(peer = %peer, "neighbour dropped");
            out.push(Output::Unsubscribe(update_topic(&self.cfg.run_id, &peer)));
            self.feed(PolicyEvent::NeighbourDown { peer }, now, out);
        }
        for peer in new {
            tracing::info!(peer = %peer, "new neighbour");
            out.push(Output::Subscribe(update_topic(&self.cfg.run_id, &peer)));
            self.feed(PolicyEvent::NeighbourUp { peer }, now, out);
            // Its last heartbeat, heard while it was only a member, is what SSP knows of its
            // step until the next one: without it a new neighbour did not count for up to a
            // heartbeat period (the simulator caught a node running 76 steps ahead so).
            if let Some(step) = self.status.progress.get(&peer.to_string()).map(|h| h.step) {
                self.feed(PolicyEvent::Heard { peer, step }, now, out);
            }
        }
        self.status.neighbours = self.neighbours.iter().map(|p| p.to_string()).collect();
    }

    /// What a heartbeat tells the rounds now: ready for them, and speed known.
    fn rounds_news(&self) -> (bool, bool) {
        let rounds = self.rounds.is_some();
        (
            rounds && self.is_training(),
            rounds && self.progress.ms_per_sample.is_some(),
        )
    }

    fn heartbeat(&mut self, leaving: bool) -> Output {
        self.heartbeats_sent += 1;
        let in_rounds = self.rounds.is_some() && self.is_training() && !leaving;
        self.announced = self.rounds_news();
        let hb = Heartbeat {
            step: self.progress.step,
            loss: self.progress.loss,
            samples_per_sec: self.progress.samples_per_sec,
            accuracy: self.progress.accuracy,
            ms_per_sample: self.progress.ms_per_sample,
            leaving,
            in_rounds,
            round: self.rounds.as_ref().and_then(Rounds::round),
            seq: self.heartbeats_sent,
        };
        Output::Publish {
            topic: self.heartbeat_topic.clone(),
            data: wire::encode_heartbeat(&hb),
        }
    }

    /// Validates a heartbeat: a leaving peer is dropped, a neighbour's step feeds the policy.
    fn on_heartbeat(
        &mut self,
        author: Option<PeerId>,
        data: &[u8],
        now: Instant,
        out: &mut Vec<Output>,
    ) -> MessageAcceptance {
        match (author, wire::decode_heartbeat(data)) {
            (Some(a), Ok(hb)) if hb.leaving => {
                tracing::info!(peer = %a, "peer is leaving");
                out.push(Output::Forget(a));
                self.drop_member(a, now, out);
                MessageAcceptance::Accept
            }
            (Some(a), Ok(hb)) => {
                if let Some(r) = self.rounds.as_mut().filter(|_| self.members.contains(&a)) {
                    r.heard(a, hb.in_rounds, hb.round, hb.ms_per_sample, now);
                }
                if self.neighbours.contains(&a) {
                    self.feed(
                        PolicyEvent::Heard {
                            peer: a,
                            step: hb.step,
                        },
                        now,
                        out,
                    );
                }
                if self.status.progress.len() < PER_PEER_CAP || self.members.contains(&a) {
                    self.status.progress.insert(a.to_string(), hb);
                }
                MessageAcceptance::Accept
            }
            (author, _) => {
                if let Some(a) = author {
                    tracing::warn!(peer = %a, "rejected a malformed heartbeat");
                    out.push(Output::Offence {
                        peer: a,
                        why: "malformed heartbeat".into(),
                    });
                }
                MessageAcceptance::Reject
            }
        }
    }
}

/// Counts one more for `peer` in a per-peer map, dropping the first entry when the map is
/// full, so hostile identities cannot grow it without bound.
fn count_for(map: &mut std::collections::BTreeMap<String, u64>, peer: &PeerId) {
    let key = peer.to_string();
    if !map.contains_key(&key) && map.len() >= PER_PEER_CAP {
        if let Some(first) = map.keys().next().cloned() {
            map.remove(&first);
        }
    }
    *map.entry(key).or_default() += 1;
}
