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
//! seeded simulator ([`sim`]; the tests and `p2ptrain bench sim` run it) drives the very same
//! code with many nodes.
//!
//! Peers are keyed by libp2p's [`PeerId`] throughout. Nothing in the core panics, whatever the
//! inputs and instants (the simulator, a harness of its own, may on a broken invariant).

mod header;
mod membership;
mod messages;
pub mod rounds;
pub mod sim;
pub mod status;
mod syncs;
#[cfg(test)]
mod tests;
mod updates;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::gossipsub::MessageAcceptance;
use libp2p::PeerId;
use p2ptrain_models::codec::Codec;
use p2ptrain_models::params::Layout;

use crate::guard::GuardConfig;
use crate::policy::{Action, PolicyConfig, PolicyEvent, SyncPolicy};
pub use crate::wire::{heartbeat_topic, update_topic};
use membership::{HeartbeatNews, Membership, NeighbourChange, RoundsNews};
use rounds::config::RoundConfig;
use rounds::Rounds;
use syncs::{SyncDone, Syncs};
use updates::{Updates, Verdict};

pub use membership::{
    HEARTBEAT_BURST, HEARTBEAT_EVERY, HEARTBEAT_RATE, NEW_MEMBER_HEARTBEAT_AFTER, REFRESH_EVERY,
};
pub use messages::{
    AverageOutcome, FetchAnswer, Input, Output, Phase, Progress, RequestFailed, TrainerCommand,
    TrainerEvent,
};
pub use status::{
    FullSyncCounters, MeshStatus, RoundStatus, SyncInfo, SyncRefusalInfo, UpdateCounters,
};
pub use syncs::ParamsEncoder;

/// Peers kept in each per-peer map (rejections, refusals, heard heartbeats): beyond it a new
/// peer displaces the one with the smallest id in a counter map, and a non-member's heartbeat
/// is not kept, so a flood of fresh identities cannot grow memory.
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

impl MeshConfig {
    /// A plain mesh for the simulator and the core's tests: three neighbours, dense updates
    /// with error feedback, the default outlier bound and sync distance, no clipping, no
    /// rate limit to speak of.
    pub fn plain(inline_max: usize) -> MeshConfig {
        MeshConfig {
            degree: 3,
            inline_max,
            max_update_ratio: 2.0,
            serve_chunk_delay: Duration::ZERO,
            codec: Codec::Dense,
            density: 1.0,
            error_feedback: true,
            guard: GuardConfig {
                outlier_factor: 10.0,
                max_updates_per_sec: 1e6,
                burst: 1e6,
                clip_value: 0.0,
            },
            max_sync_distance: crate::sync_guard::DEFAULT_MAX_SYNC_DISTANCE,
        }
    }
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
    /// The instant at which the Unix time was exactly `unix_secs` (a whole second).
    pub at: Instant,
}

impl WallClock {
    /// Unix seconds at `now` (at `at` for an instant before it).
    pub fn unix_at(&self, now: Instant) -> u64 {
        self.unix_secs
            .saturating_add(now.saturating_duration_since(self.at).as_secs())
    }
}

/// The mesh core; see the module docs.
pub struct MeshCore {
    /// What the trainer last published about itself: every path reads a part of it.
    progress: Progress,
    /// When to publish, sync and hold; every path reports to it, only the router feeds it.
    policy: SyncPolicy<PeerId>,
    membership: Membership,
    updates: Updates,
    syncs: Syncs,
    rounds: Option<Rounds>,
    /// A round's trainer command the trainer's full queue refused, sent again at the next tick.
    round_command: Option<TrainerCommand>,
}

impl MeshCore {
    /// A core for this node; [`MeshCore::start`] gives the first outputs.
    pub fn new(cfg: CoreConfig) -> MeshCore {
        let CoreConfig {
            me,
            run_id,
            layout,
            mesh,
            policy,
            update_weight,
            start_step,
            seed,
            wall_clock,
            rounds,
        } = cfg;
        let policy_mixing = policy.mixing;
        MeshCore {
            progress: Progress::default(),
            policy: SyncPolicy::new(policy, start_step),
            membership: Membership::new(me, &run_id, mesh.degree, rounds.is_some(), seed)
                .numbering_from(wall_clock.unix_secs),
            syncs: Syncs::new(
                &me,
                &run_id,
                layout.clone(),
                mesh.max_sync_distance,
                wall_clock,
            ),
            rounds: rounds.map(|(rc, synced)| {
                Rounds::new(rc, me, start_step, synced).sized_for(layout.numel())
            }),
            updates: Updates::new(
                &me,
                &run_id,
                layout,
                mesh,
                update_weight,
                policy_mixing == crate::policy::Mixing::Mean,
            ),
            round_command: None,
        }
    }

    /// What to do before the first input: listen to the run's heartbeats.
    pub fn start(&self) -> Vec<Output> {
        vec![Output::Subscribe(self.membership.topic().to_string())]
    }

    /// Handles one input at `now` and says what to do about it.
    pub fn handle(&mut self, input: Input, now: Instant) -> Vec<Output> {
        let mut out = Vec::new();
        match input {
            Input::PeerUp(peer) => {
                let changes = self.membership.peer_up(peer, now);
                self.neighbours_changed(changes, now, &mut out);
            }
            Input::PeerDown(peer) => self.drop_member(peer, now, &mut out),
            Input::Ring { peer, msg } => {
                if let Some(r) = self
                    .rounds
                    .as_mut()
                    .filter(|_| self.membership.is_member(&peer))
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
                let verdict = if topic == self.membership.topic() {
                    Verdict::Judged(self.on_heartbeat(source, author, &data, now, &mut out))
                } else if let Some(owner) = self.updates.owner_of(&topic) {
                    let param_norm = self.is_training().then_some(self.progress.param_norm);
                    self.updates
                        .on_gossip(source, author, owner, &id, &data, param_norm, now, &mut out)
                } else {
                    Verdict::Judged(MessageAcceptance::Reject)
                };
                if let Some(acceptance) = self.weigh(verdict, now) {
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
                let verdict = self.updates.on_fetched(
                    owner,
                    hash,
                    answer,
                    self.progress.param_norm,
                    &mut out,
                );
                if let Some(acceptance) = self.weigh(verdict, now) {
                    out.push(Output::Validate {
                        id,
                        source,
                        acceptance,
                    });
                }
            }
            Input::ParamsReply { peer, answer } => {
                let done = self.syncs.on_reply(peer, answer, now, &mut out);
                self.sync_done(done, now, &mut out);
            }
            Input::UpdatePublished { payload, ok } => {
                if let Some(sent) = self.updates.published(payload, ok) {
                    if let Some(weight) = self.policy.own_change_weight(now) {
                        self.updates.enqueue_own(sent, weight);
                    }
                }
            }
            Input::Progress(p) => {
                if let Some(r) = &mut self.rounds {
                    r.own_speed(p.ms_per_sample);
                }
                self.progress = p;
            }
            Input::Trainer(ev) => self.on_trainer(ev, now, &mut out),
            Input::TrainerBusy(cmd) => self.on_trainer_busy(cmd, now, &mut out),
            Input::Tick => self.on_tick(now, &mut out),
            Input::Leave => {
                let news = RoundsNews {
                    round: self.rounds.as_ref().and_then(Rounds::leaving_round),
                    needs_state: false,
                    sitting_out: false,
                    accused: None,
                };
                out.push(self.membership.leaving_heartbeat(&self.progress, news));
            }
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
        self.updates.next_apply()
    }

    /// Updates waiting for the trainer.
    pub fn pending_applies(&self) -> usize {
        self.updates.pending_len()
    }

    /// Bytes of values one ring request carries at most (a larger hop is sent in pieces:
    /// [`crate::wire::RingMessage::into_pieces`]); `None` without rounds.
    pub fn ring_piece_bytes(&self) -> Option<usize> {
        self.rounds.as_ref().map(Rounds::piece_bytes)
    }

    /// The values of the model's largest honest ring hop (what a test rogue pads its hops
    /// to; see `ring_attack::RingAttack::Oversize`).
    pub fn largest_ring_hop_values(&self) -> usize {
        crate::wire::largest_hop_values(self.updates.numel())
    }

    /// The step the trainer last reported: a donor's freeze is reused only near it.
    pub fn step(&self) -> u64 {
        self.progress.step
    }

    /// Whether this node trains (and so may answer syncs and judge updates).
    pub fn is_training(&self) -> bool {
        self.progress.phase == Phase::Training
    }

    /// A large update of ours that a neighbour asks for by hash.
    pub fn large_update(&self, hash: &[u8]) -> Option<Arc<Vec<u8>>> {
        self.updates.large_update(hash)
    }

    /// What the actor needs to answer a neighbour's sync request.
    pub fn params_encoder(&self) -> ParamsEncoder {
        self.syncs.params_encoder()
    }

    /// The core's status report at `now`, rendered from each path's state (peers named as
    /// strings only here).
    pub fn status(&self, now: Instant) -> MeshStatus {
        let mut status = MeshStatus {
            lead_over_slowest: self.policy.lead_over_slowest(now),
            rounds: self.rounds.as_ref().map(|r| r.status(now)),
            ..MeshStatus::default()
        };
        self.membership.render(&mut status);
        self.updates.render(&mut status);
        self.syncs.render(&mut status);
        status
    }

    /// Current neighbours.
    pub fn neighbours(&self) -> &std::collections::BTreeSet<PeerId> {
        self.membership.neighbours()
    }

    /// The run's connected members now.
    pub fn members(&self) -> &std::collections::BTreeSet<PeerId> {
        self.membership.members()
    }

    /// The sizes of what the core keeps per peer or per message, for tests that bound memory.
    fn sizes(&self) -> Sizes {
        let (large, seen_steps, rejected_by_peer) = self.updates.sizes();
        Sizes {
            per_peer_max: rejected_by_peer
                .max(self.syncs.refusals_len())
                .max(self.membership.heard_len()),
            pending: self.updates.pending_len(),
            large,
            seen_steps,
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<Output>) {
        if self.membership.refresh_due(now) {
            let changes = self.membership.refresh(now);
            self.neighbours_changed(changes, now, out);
        }
        let news = RoundsNews {
            round: self.rounds.as_ref().and_then(Rounds::round),
            needs_state: self.rounds.as_ref().is_some_and(Rounds::needs_state),
            sitting_out: self.rounds.as_ref().is_some_and(|r| r.sitting_out(now)),
            accused: self.rounds.as_ref().and_then(|r| r.accusation(now)),
        };
        if let Some(beat) = self.membership.tick_heartbeat(now, &self.progress, news) {
            out.push(beat);
        }
        if let Some(cmd) = self.round_command.take() {
            out.push(Output::Trainer(cmd));
        }
        if let Some(r) = &mut self.rounds {
            let training = self.progress.phase == Phase::Training;
            r.tick(self.progress.step, training, now, out);
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
                self.updates.delta_answered();
                self.feed(PolicyEvent::Published { step }, now, out);
                let alone = self.membership.is_alone();
                self.updates.publish(base_step, step, &delta, alone, out);
            }
            TrainerEvent::Averaged { seq, outcome } => {
                let done = self.syncs.on_averaged(seq, outcome, now, out);
                self.sync_done(done, now, out);
            }
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
            TrainerEvent::Restored { step } => self.on_restored(step, now),
        }
    }

    fn on_trainer_busy(&mut self, cmd: TrainerCommand, now: Instant, out: &mut Vec<Output>) {
        match cmd {
            // Asked again at the next step the policy finds a publish due.
            TrainerCommand::TakeDelta => self.updates.delta_answered(),
            TrainerCommand::Apply { values, weight } => self.updates.requeue(values, weight),
            TrainerCommand::Average { seq, .. } => {
                let failed = AverageOutcome::Failed("the trainer is busy".into());
                let done = self.syncs.on_averaged(seq, failed, now, out);
                self.sync_done(done, now, out);
            }
            cmd @ (TrainerCommand::TakeParams
            | TrainerCommand::TakeGradient { .. }
            | TrainerCommand::Combine { .. }) => {
                self.round_command = Some(cmd);
            }
        }
    }

    /// A checkpoint replaced the parameters: the residual, the pending updates, a sync under
    /// way and the policy's counts referred to the old ones.
    fn on_restored(&mut self, step: u64, now: Instant) {
        self.updates.restored();
        self.progress.step = step;
        let mut policy = SyncPolicy::new(self.policy.config().clone(), step);
        for peer in self.membership.neighbours() {
            let _ = policy.handle(PolicyEvent::NeighbourUp { peer: *peer }, now);
        }
        self.policy = policy;
        self.syncs.restored();
        if let Some(r) = &mut self.rounds {
            r.restored(step);
        }
        self.round_command = None;
    }

    /// Weighs an update that passed every check by the policy (neighbourhood size,
    /// staleness) and queues it; gives the verdict gossip is to hear, if there is one yet.
    fn weigh(&mut self, verdict: Verdict, now: Instant) -> Option<MessageAcceptance> {
        let (author, step, values) = match verdict {
            Verdict::Judged(acceptance) => return Some(acceptance),
            Verdict::Fetching => return None,
            Verdict::Passed {
                author,
                step,
                values,
            } => (author, step, values),
        };
        let actions = self
            .policy
            .handle(PolicyEvent::UpdateArrived { peer: author, step }, now);
        let mut values = Some(values);
        for action in actions {
            match action {
                Action::Apply { weight, .. } => {
                    if let Some(v) = values.take() {
                        self.updates.enqueue(v, weight);
                    }
                }
                Action::Drop { peer, staleness } => self.updates.dropped_stale(peer, staleness),
                // Hold and resume are read through the step limit; nothing else follows an
                // arrival.
                _ => {}
            }
        }
        // Valid, applied, and not forwarded: the author publishes straight to every subscriber
        // of its topic (its neighbours, all connected to it), so relaying among them would only
        // add copies, and more of them the more popular the author. `Ignore` drops the message
        // from gossip without penalising anyone.
        Some(MessageAcceptance::Ignore)
    }

    /// Tells the policy how a sync ended.
    fn sync_done(&mut self, done: Option<SyncDone>, now: Instant, out: &mut Vec<Output>) {
        if let Some(SyncDone { peer, ok }) = done {
            self.feed(PolicyEvent::SyncFinished { peer, ok }, now, out);
        }
    }

    /// Feeds the sync policy one event and carries out what it asks.
    fn feed(&mut self, ev: PolicyEvent<PeerId>, now: Instant, out: &mut Vec<Output>) {
        for action in self.policy.handle(ev, now) {
            match action {
                Action::Publish => self.updates.want_delta(out),
                Action::FullSync { peer } => self.syncs.start(peer, self.progress.step, now, out),
                // The trainer reads the step limit; the policy's own hold flag needs no action.
                Action::Hold | Action::Resume => {}
                // Answers to arriving updates are handled where the update is.
                Action::Apply { .. } | Action::Drop { .. } => {}
            }
        }
    }

    /// A peer is gone: the rounds, the update guard and membership forget it.
    fn drop_member(&mut self, peer: PeerId, now: Instant, out: &mut Vec<Output>) {
        if let Some(r) = &mut self.rounds {
            r.peer_down(peer, now);
        }
        self.updates.forget(&peer);
        let changes = self.membership.drop(peer, now);
        self.neighbours_changed(changes, now, out);
    }

    /// Tells the network and the policy of changed neighbours, the gone ones first.
    fn neighbours_changed(
        &mut self,
        changes: Vec<NeighbourChange>,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        for change in changes {
            match change {
                NeighbourChange::Gone(peer) => {
                    tracing::info!(peer = %peer, "neighbour dropped");
                    out.push(Output::Unsubscribe(self.membership.update_topic(&peer)));
                    self.feed(PolicyEvent::NeighbourDown { peer }, now, out);
                }
                NeighbourChange::New { peer, last_step } => {
                    tracing::info!(peer = %peer, "new neighbour");
                    out.push(Output::Subscribe(self.membership.update_topic(&peer)));
                    self.feed(PolicyEvent::NeighbourUp { peer }, now, out);
                    if let Some(step) = last_step {
                        self.feed(PolicyEvent::Heard { peer, step }, now, out);
                    }
                }
            }
        }
    }

    /// Routes a heartbeat's news: a leaving peer is dropped, a member's readiness goes to the
    /// rounds, a neighbour's step to the policy. One over its author's rate is not forwarded,
    /// and rejected (a gossip penalty) only when its author sent it to us itself: an honest
    /// peer that forwarded it is not to blame.
    fn on_heartbeat(
        &mut self,
        source: PeerId,
        author: Option<PeerId>,
        data: &[u8],
        now: Instant,
        out: &mut Vec<Output>,
    ) -> MessageAcceptance {
        match self.membership.on_heartbeat(author, data, now, out) {
            HeartbeatNews::Leaving { peer, round } => {
                tracing::info!(peer = %peer, "peer is leaving");
                if let Some(r) = &mut self.rounds {
                    r.peer_leaving(peer, round);
                }
                out.push(Output::Forget(peer));
                self.drop_member(peer, now, out);
                MessageAcceptance::Accept
            }
            HeartbeatNews::Heard {
                peer,
                heartbeat: hb,
                member,
                neighbour,
            } => {
                if let Some(r) = self.rounds.as_mut().filter(|_| member) {
                    r.heard(peer, &hb, now);
                }
                if let Some(step) = hb.training_step().filter(|_| neighbour) {
                    self.feed(PolicyEvent::Heard { peer, step }, now, out);
                }
                MessageAcceptance::Accept
            }
            HeartbeatNews::Malformed => MessageAcceptance::Reject,
            HeartbeatNews::Old | HeartbeatNews::Untracked => MessageAcceptance::Ignore,
            HeartbeatNews::OverRate { peer, first } => {
                if first {
                    let why = format!(
                        "heartbeats above {HEARTBEAT_RATE}/s (a burst of {HEARTBEAT_BURST})"
                    );
                    tracing::warn!(peer = %peer, "ignoring heartbeats: {why}");
                    out.push(Output::Offence { peer, why });
                }
                // Whether a heartbeat is over its author's rate is this node's own count: an
                // honest member may have taken and forwarded the same one within its count.
                // Rejected, gossipsub would also penalise every peer that delivered a copy
                // while the author's own was judged (the flood test's starved honest node was
                // banned that way, for relaying the flooder's heartbeats). So it is ignored,
                // and the author alone penalised, when it sent the heartbeat itself.
                if source == peer {
                    out.push(Output::Penalise(peer));
                }
                MessageAcceptance::Ignore
            }
        }
    }
}

/// What the core keeps, in numbers (see [`MeshCore::sizes`]); the simulator reads the
/// largest map, the tests every field.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// The largest per-peer map.
    per_peer_max: usize,
    /// Updates waiting for the trainer.
    pending: usize,
    /// Own large updates kept.
    large: usize,
    /// Authors whose steps are remembered.
    seen_steps: usize,
}

/// Counts one more for `peer` in a per-peer map, dropping the smallest key when the map is
/// full, so hostile identities cannot grow it without bound.
fn count_for(map: &mut BTreeMap<PeerId, u64>, peer: &PeerId) {
    if !map.contains_key(peer) && map.len() >= PER_PEER_CAP {
        if let Some(first) = map.keys().next().copied() {
            map.remove(&first);
        }
    }
    *map.entry(*peer).or_default() += 1;
}
