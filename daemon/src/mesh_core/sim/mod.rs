//! A seeded, deterministic simulation that drives the daemon's own [`MeshCore`] with many
//! nodes: virtual time, links with delays, churn, a partition that heals, slow boxes and
//! hostile peers. Each node's "trainer" is a few lines here (a quadratic objective towards a
//! target of its own, so the nodes disagree and only the mesh brings them together); every
//! decision about peers, updates and syncs is the core's, byte for byte as in the daemon:
//! updates are encoded with the real codec, syncs answered in the real dense format. With
//! [`SimParams::rounds`] the nodes run a synchronous mode instead of gossip: the core's own
//! rounds, ring hops carried between the simulated nodes (in order on each link), the
//! trainer's side of a round here (parameters, gradients, the mean taken), and every round's
//! resulting parameter digests compared across its members.
//!
//! The core's tests drive it (`mesh_core::tests`), and `p2ptrain bench sim` runs it at sizes
//! no lab can start, for planning: bytes per node per step and consensus against N.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use libp2p::gossipsub::{MessageAcceptance, MessageId};
use libp2p::identity::Keypair;
use libp2p::PeerId;
use p2ptrain_models::codec::{self, Codec, UpdateHeader};
use p2ptrain_models::params::{l2_norm, Layout};
use p2ptrain_models::replica::{self, OwnChange};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_bytes::ByteBuf;

use super::rounds::config::RoundConfig;
use super::{
    AverageOutcome, CoreConfig, FetchAnswer, Input, MeshConfig, MeshCore, Output, Phase, Progress,
    RequestFailed, TrainerCommand, TrainerEvent, WallClock, HEARTBEAT_EVERY,
};
use crate::guard::GuardConfig;
use crate::policy::{Mixing, PolicyConfig};
use crate::ring_attack::RingAttack;
use crate::sync_guard;
use crate::wire::{BulkResponse, RingMessage};
use p2ptrain_models::params::params_digest;

mod network;
mod replicas;

const RUN: &str = "00112233445566778899aabbccddeeff";
/// How long a silent peer takes to be noticed (the network's `SILENT_AFTER`).
const SILENT_MS: u64 = 4_000;
const TICK_MS: u64 = 50;
/// How long a ring hop to a node gone takes to come back undelivered: a dial that fails.
const RING_DIAL_MS: u64 = 100;

/// What a simulation is asked to do.
#[derive(Debug, Clone)]
pub struct SimParams {
    /// Seeds everything: keys, links, delays, data, churn.
    pub seed: u64,
    /// Nodes at the start.
    pub nodes: usize,
    /// Of those, how many are hostile (garbage and huge updates, scaled sync replies; in
    /// rounds, the last nodes, doing [`SimParams::ring_attack`] to their ring hops).
    pub hostile: usize,
    /// Virtual seconds to run.
    pub secs: u64,
    /// Parameters per node.
    pub dim: usize,
    /// Every node's sync policy.
    pub policy: PolicyConfig,
    /// Kill a random honest node and start a joiner this often (0: no churn).
    pub churn_every_ms: u64,
    /// No churn from this virtual ms on: the mesh's state after a quiet spell.
    pub quiet_from_ms: Option<u64>,
    /// Split the mesh in two during this window (virtual ms).
    pub partition: Option<(u64, u64)>,
    /// Updates larger than this are announced and pulled from their author (`mesh.inline_max`).
    pub inline_max: usize,
    /// `None`: every node is connected to every other. `Some(k)`: each node dials `k` random
    /// others (a joiner too), so a node has about `2k` connected members, as a large mesh
    /// whose nodes discover only part of it; heartbeats and updates reach connected peers only.
    pub links: Option<usize>,
    /// How far apart the two sides' data pull (0: sides alike).
    pub side_skew: f32,
    /// A synchronous mode's rounds instead of gossip (`policy` should then publish and sync
    /// nothing, as [`crate::config`] makes it): founders start synced, joiners hold until a
    /// round brings them in. `None`: the gossip mode.
    pub rounds: Option<RoundConfig>,
    /// What the hostile nodes do to every ring hop they send (`debug.ring_attack`), as the
    /// integration tests' rogue process does.
    pub ring_attack: Option<RingAttack>,
}

impl SimParams {
    /// The large-mesh scenario: `nodes` nodes, each dialing up to 8 others, 1% hostile; every
    /// second a node is killed and a joiner started; from 10 s to 20 s the mesh is split into
    /// two labs whose data pull apart (each lab's optimum offset by 0.1 per value the other way,
    /// 0.2 apart, against a spread of 0.2 within a lab); 40 s
    /// in all. Gossip mode: updates every 20 steps, a neighbour sync every 50. `None` for
    /// `partition` gives the same run never split, its control.
    pub fn large_mesh(nodes: usize, seed: u64, partition: bool) -> SimParams {
        SimParams {
            seed,
            nodes,
            hostile: nodes / 100,
            secs: 40,
            dim: 32,
            policy: PolicyConfig {
                publish_every: 20,
                full_sync_every: 50,
                staleness_bound: None,
                mixing: Mixing::Add,
                ..PolicyConfig::default()
            },
            churn_every_ms: 1_000,
            quiet_from_ms: None,
            partition: partition.then_some((10_000, 20_000)),
            inline_max: 1 << 20,
            links: Some(8),
            side_skew: 0.1,
            rounds: None,
            ring_attack: None,
        }
    }

    /// The synchronous scenario: `nodes` honest nodes, all connected, in the rounds of
    /// `rounds` (no gossip, no neighbour syncs), the first the founder and the others joined
    /// from its state at the start; every `churn_every_ms` (3 s here) until 25 s a node is
    /// killed without a word (its peers notice its silence after 4 s, or at once when a hop
    /// to it fails) and a joiner started from a survivor's state; then 15 s of quiet, 40 s in
    /// all.
    pub fn rounds(nodes: usize, seed: u64, rounds: RoundConfig) -> SimParams {
        SimParams {
            seed,
            nodes,
            hostile: 0,
            secs: 40,
            dim: 32,
            policy: PolicyConfig {
                publish_every: 0,
                publish_early_ratio: 0.0,
                full_sync_every: 0,
                staleness_bound: None,
                ..PolicyConfig::default()
            },
            churn_every_ms: 3_000,
            quiet_from_ms: Some(25_000),
            partition: None,
            inline_max: 1 << 20,
            links: None,
            side_skew: 0.0,
            rounds: Some(rounds),
            ring_attack: None,
        }
    }
}

/// What it measured.
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    /// Mean relative distance of the live honest nodes from their mean, at the end.
    pub consensus: f64,
    /// Offences (rejections, refused syncs) an honest node blamed on an honest peer.
    pub honest_blamed: u64,
    /// The first few of those offences, in words.
    pub honest_why: Vec<String>,
    /// Offences blamed on hostile peers.
    pub hostile_blamed: u64,
    /// Steps taken while ahead of a known, reachable neighbour by the staleness bound or more.
    pub ssp_violations: u64,
    /// Steps an SSP hold cost.
    pub held_steps: u64,
    /// Largest parameter norm of an honest node relative to the targets' norm.
    pub worst_norm_ratio: f64,
    /// All honest parameters finite.
    pub finite: bool,
    /// Syncs the honest nodes averaged.
    pub syncs: u64,
    /// Neighbours' updates the honest nodes applied.
    pub applied: u64,
    /// Largest per-peer map seen in any core.
    pub largest_map: usize,
    /// Longest apply queue seen in any core.
    pub largest_queue: usize,
    /// Nodes started, joiners included.
    pub nodes_started: usize,
    /// [`SimReport::consensus`] when the partition healed.
    pub consensus_at_heal: Option<f64>,
    /// Steps the honest nodes took.
    pub steps: u64,
    /// Bytes the honest nodes sent (update and heartbeat messages once per receiver, sync
    /// replies): with `steps`, traffic per node per step, for planning.
    pub bytes_sent: u64,
    /// The live honest cores' status counters, summed at the end: what each rule of the core
    /// decided, so a change that moves a decision changes a figure.
    pub counters: BTreeMap<&'static str, u64>,
    /// What the rounds did, when the nodes ran a synchronous mode.
    pub rounds: Option<RoundsReport>,
}

/// What a synchronous mode's rounds did in a simulation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoundsReport {
    /// Rounds completed mesh-wide, as the most advanced live node knows them.
    pub highest: u64,
    /// Rings of two or more members whose mean a member took (each counted once).
    pub taken: u64,
    /// Of those, rings after which two members held different parameters: the ring's
    /// promise (every member the same mean, bit for bit) broken. (Two rings may complete one
    /// round apart, as nodes that have not heard each other do under a `min_members` below
    /// the mesh's size: each keeps its own promise.)
    pub split: u64,
    /// Rounds the live nodes completed, summed.
    pub completed: u64,
    /// Attempts the live nodes aborted, by reason, summed.
    pub aborted: BTreeMap<String, u64>,
    /// Live nodes started more than [`SETTLE_MS`] before the end whose parameters are still
    /// not the members' (a joiner no round brought in).
    pub unsynced: u64,
    /// Bytes of ring hops the live nodes sent, summed.
    pub ring_bytes: u64,
    /// Parts the live nodes' aggregates clipped (beyond the clipping radius of the plain
    /// mean), summed: where none is, the aggregate is the plain mean.
    pub clipped: u64,
    /// Parts the live nodes refused as no honest member's, summed (each an offence).
    pub refused: u64,
    /// Bans an honest node made of a hostile one ([`BAN_OFFENCES`] offences), and of an
    /// honest one.
    pub bans: (u64, u64),
    /// The most rounds an honest node had completed when it banned a hostile one (0: none
    /// banned): the rogues attack from the start, so the rounds a ban took.
    pub rounds_to_ban: u64,
    /// Honest nodes that, at the end, left a hostile node out of their rounds
    /// (`rounds.left_out`).
    pub hostile_left_out: u64,
    /// The loss of the live honest nodes' mean parameters at the end: its mean squared
    /// distance from the honest nodes' common optimum (the mean of their targets), what a
    /// held-out loss is to a real run. (Each node's own drifts towards its own target
    /// between rounds, and waits at its boundary furthest from the others.)
    pub loss: f64,
    /// The highest trainer step a live honest node reached: a joiner or founder moved to a
    /// step no member of the mesh reached shows here.
    pub top_step: u64,
}

/// Offences one node blames on one peer before it bans it, in rounds scenarios: as the
/// daemon's score falls to its ban in about seven (`scoring`), here without the decay over
/// time. The ban closes their connection: each end sees the other go down, and no hop or
/// heartbeat passes between them again. (Gossip scenarios keep no bans: their figures were
/// recorded without them.)
pub const BAN_OFFENCES: u32 = 7;

/// A joiner started this long before a simulation's end is expected to have been brought in
/// by a round ([`RoundsReport::unsynced`]).
pub const SETTLE_MS: u64 = 5_000;

struct SimNode {
    id: PeerId,
    core: MeshCore,
    x: Vec<f32>,
    /// Its own change since its last delta, as the trainer keeps it.
    own: OwnChange,
    last_delta_step: u64,
    target: Vec<f32>,
    step: u64,
    alive: bool,
    hostile: bool,
    step_ms: u64,
    side: u8,
    subs: BTreeSet<String>,
    heard: BTreeSet<usize>,
    last_advanced: u64,
    /// When it started (virtual ms).
    born: u64,
    /// The ring of its last hop sent: (round, member-list digest).
    last_ring: Option<(u64, u64)>,
    /// The gradient it gave to a `ddp` round, kept for the step the round's mean makes.
    kept_gradient: Option<Vec<f32>>,
    /// When its trainer finishes the gradient it is computing (virtual ms): it takes one
    /// command after another, so its later answers wait for that one.
    trainer_free_at: u64,
    /// `diloco` ([`RoundConfig::outer_state`]): the round's start and the outer velocity, as
    /// the trainer keeps them (its outer step is the daemon's default [`OUTER`]).
    outer: Option<OuterState>,
}

/// A `diloco` node's outer state: where its round started, its outer optimizer's velocity,
/// and the parameters it gave its last round (with `overlap_steps` it trains on, and keeps
/// those steps on top of the round's result).
struct OuterState {
    anchor: Vec<f32>,
    velocity: Vec<f32>,
    given: Vec<f32>,
}

/// The simulated `diloco` nodes' outer optimizer: the daemon's defaults (DiLoCo's).
const OUTER: p2ptrain_models::replica::OuterSgd = p2ptrain_models::replica::OuterSgd {
    lr: 0.7,
    momentum: 0.9,
};

enum Ev {
    Step(usize),
    Tick,
    Churn,
    Deliver(usize, Box<Input>),
    /// A sync request from the first node reaches the second, which answers.
    Serve(usize, usize),
    /// A ring hop from the first node reaches the second.
    Hop(usize, usize, Box<RingMessage>),
}

/// One simulation, run once by [`Sim::run`].
pub struct Sim {
    p: SimParams,
    rng: StdRng,
    base: Instant,
    t: u64,
    seq: u64,
    queue: BTreeMap<(u64, u64), Ev>,
    nodes: Vec<SimNode>,
    index: BTreeMap<PeerId, usize>,
    layout: Layout,
    partitioned: bool,
    report: SimReport,
    msg_ids: u64,
    common: Vec<f32>,
    /// Who is connected to whom, when not everybody to everybody ([`SimParams::links`]).
    links: Option<Vec<BTreeSet<usize>>>,
    /// The parameter digests the members of each ring (round, member-list digest) took its
    /// mean with: more than one is a split.
    round_digests: BTreeMap<(u64, u64), BTreeSet<String>>,
    /// When the last ring hop on each link (from, to) arrives: hops on one link keep their
    /// order, as on one connection.
    ring_arrivals: BTreeMap<(usize, usize), u64>,
    /// Offences each node blamed on each peer (blamer, blamed), in rounds scenarios.
    offences: BTreeMap<(usize, usize), u32>,
    /// Bans (banner, banned): the two are never connected again; with the rounds the banner
    /// had completed then.
    bans: BTreeMap<(usize, usize), u64>,
}

/// The simulated nodes' mesh: [`MeshConfig::plain`] with the daemon's default rate limit.
fn mesh_config(inline_max: usize) -> MeshConfig {
    let plain = MeshConfig::plain(inline_max);
    MeshConfig {
        guard: GuardConfig {
            max_updates_per_sec: 200.0,
            burst: 400.0,
            ..plain.guard
        },
        ..plain
    }
}

impl Sim {
    /// Starts `p.nodes` nodes, all connected (or linked as `p.links` says).
    pub fn new(p: SimParams) -> Sim {
        let layout = Layout {
            entries: vec![("w".into(), vec![p.dim])],
        };
        let mut sim = Sim {
            rng: StdRng::seed_from_u64(p.seed),
            base: Instant::now(),
            t: 0,
            seq: 0,
            queue: BTreeMap::new(),
            nodes: Vec::new(),
            index: BTreeMap::new(),
            layout,
            partitioned: false,
            report: SimReport::default(),
            msg_ids: 0,
            common: Vec::new(),
            links: None,
            round_digests: BTreeMap::new(),
            ring_arrivals: BTreeMap::new(),
            offences: BTreeMap::new(),
            bans: BTreeMap::new(),
            p,
        };
        sim.common = (0..sim.p.dim)
            .map(|_| sim.rng.random_range(-1.0..1.0))
            .collect();
        let init: Vec<f32> = (0..sim.p.dim)
            .map(|_| sim.rng.random_range(-1.0..1.0))
            .collect();
        for i in 0..sim.p.nodes {
            // In rounds the first node founds the mesh: the hostile ones come last.
            let hostile = if sim.p.rounds.is_some() {
                i >= sim.p.nodes.saturating_sub(sim.p.hostile)
            } else {
                i < sim.p.hostile
            };
            sim.add_node(init.clone(), 0, hostile);
        }
        let n = sim.nodes.len();
        if let Some(k) = sim.p.links {
            sim.links = Some(vec![BTreeSet::new(); n]);
            for i in 0..n {
                sim.dial(i, k, 200);
            }
        } else {
            for i in 0..n {
                for j in 0..n {
                    if i != j {
                        let id = sim.nodes[j].id;
                        let d = sim.rng.random_range(0..200);
                        sim.at(d, Ev::Deliver(i, Box::new(Input::PeerUp(id))));
                    }
                }
            }
        }
        sim.at(0, Ev::Tick);
        if sim.p.churn_every_ms > 0 {
            sim.at(sim.p.churn_every_ms, Ev::Churn);
        }
        sim
    }

    fn at(&mut self, dt: u64, ev: Ev) {
        self.seq += 1;
        self.queue.insert((self.t + dt, self.seq), ev);
    }

    fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.t)
    }

    fn add_node(&mut self, x: Vec<f32>, step: u64, hostile: bool) -> usize {
        let i = self.nodes.len();
        let mut secret = [0u8; 32];
        self.rng.fill(&mut secret);
        let id = Keypair::ed25519_from_bytes(secret)
            .expect("ed25519 key")
            .public()
            .to_peer_id();
        tracing::debug!(i, hostile, peer = %id, "a simulated node");
        let core = MeshCore::new(CoreConfig {
            me: id,
            run_id: RUN.into(),
            layout: self.layout.clone(),
            mesh: mesh_config(self.p.inline_max),
            policy: self.p.policy.clone(),
            update_weight: None,
            start_step: step,
            seed: self.rng.random(),
            wall_clock: WallClock {
                unix_secs: 0,
                at: self.base,
            },
            // As a mesh is started: the first node founds it, the others join it (they hold
            // the first node's state, as a download gives it, but no round has synced them).
            rounds: self.p.rounds.map(|rc| (rc, i == 0)),
        });
        // Every node pulls towards the run's common optimum plus a skew of its own, as nodes
        // with different data do, and its side of the partition's skew (two labs with data of
        // their own).
        let side_sign = if i.is_multiple_of(2) { 1.0 } else { -1.0 };
        let side_skew = self.p.side_skew;
        let target: Vec<f32> = self
            .common
            .clone()
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let lab = if k.is_multiple_of(2) {
                    side_skew
                } else {
                    -side_skew
                };
                c + 0.2 * self.rng.random_range(-1.0f32..1.0) + side_sign * lab
            })
            .collect();
        // One box in eight is four times slower, as on a mixed home lab.
        let step_ms = if self.rng.random_range(0..8) == 0 {
            40
        } else {
            10
        };
        let side = (i % 2) as u8;
        // Its round starts where its parameters are; no outer step taken yet.
        let outer = self
            .p
            .rounds
            .is_some_and(|rc| rc.outer_state)
            .then(|| OuterState {
                anchor: x.clone(),
                velocity: vec![0.0; x.len()],
                given: Vec::new(),
            });
        self.nodes.push(SimNode {
            id,
            core,
            own: {
                let mut own = OwnChange::default();
                own.reset(&x);
                own
            },
            x,
            last_delta_step: step,
            target,
            step,
            alive: true,
            hostile,
            step_ms,
            side,
            subs: BTreeSet::new(),
            heard: BTreeSet::new(),
            last_advanced: self.t,
            born: self.t,
            last_ring: None,
            kept_gradient: None,
            trainer_free_at: 0,
            outer,
        });
        self.index.insert(id, i);
        if let Some(links) = self.links.as_mut() {
            links.push(BTreeSet::new());
        }
        self.report.nodes_started += 1;
        let start = self.nodes[i].core.start();
        self.carry_out(i, start);
        if self.p.rounds.is_some() {
            // Its state is in place (a download's work, here instant): it trains, or holds
            // at its boundary and is asked for its part in a round.
            self.input(i, Input::Progress(self.nodes[i].progress()));
        }
        let first = self.rng.random_range(1..step_ms + 1);
        self.at(first, Ev::Step(i));
        i
    }

    /// Runs to `p.secs` of virtual time and reports.
    pub fn run(mut self) -> SimReport {
        let end = self.p.secs * 1000;
        while let Some(((t, seq), ev)) = self.queue.pop_first() {
            if t > end {
                break;
            }
            let _ = seq;
            self.t = t;
            self.partition_edges();
            match ev {
                Ev::Tick => {
                    for i in 0..self.nodes.len() {
                        if self.nodes[i].alive {
                            self.input(i, Input::Tick);
                        }
                    }
                    self.at(TICK_MS, Ev::Tick);
                }
                Ev::Step(i) => self.step(i),
                Ev::Churn => self.churn(),
                Ev::Serve(i, j) => self.serve_sync(i, j),
                Ev::Hop(i, j, msg) => self.take_ring(i, j, *msg),
                Ev::Deliver(i, input) => {
                    if self.nodes[i].alive {
                        self.note_heard(i, &input);
                        self.input(i, *input);
                    }
                }
            }
        }
        self.finish()
    }

    /// Starts and ends the partition; each side notices the other's silence after a while.
    fn partition_edges(&mut self) {
        let Some((from, to)) = self.p.partition else {
            return;
        };
        let want = self.t >= from && self.t < to;
        if want == self.partitioned {
            return;
        }
        self.partitioned = want;
        if !want {
            self.report.consensus_at_heal = Some(self.consensus());
        }
        let n = self.nodes.len();
        for i in 0..n {
            for j in self.peers_of(i) {
                if !self.nodes[i].alive || !self.nodes[j].alive {
                    continue;
                }
                if self.nodes[i].side != self.nodes[j].side {
                    let id = self.nodes[j].id;
                    if want {
                        self.at(SILENT_MS, Ev::Deliver(i, Box::new(Input::PeerDown(id))));
                    } else {
                        let d = 500 + self.rng.random_range(0..1000);
                        self.at(d, Ev::Deliver(i, Box::new(Input::PeerUp(id))));
                    }
                }
            }
        }
    }

    fn churn(&mut self) {
        if self.p.quiet_from_ms.is_some_and(|quiet| self.t >= quiet) {
            return;
        }
        let honest: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].alive && !self.nodes[i].hostile)
            .collect();
        if honest.len() > 2 {
            let victim = honest[self.rng.random_range(0..honest.len())];
            self.nodes[victim].alive = false;
            let id = self.nodes[victim].id;
            for i in self.peers_of(victim) {
                if self.nodes[i].alive {
                    self.at(SILENT_MS, Ev::Deliver(i, Box::new(Input::PeerDown(id))));
                }
            }
            // A joiner takes a random survivor's state, as a state download would.
            let donor = loop {
                let d = honest[self.rng.random_range(0..honest.len())];
                if d != victim {
                    break d;
                }
            };
            let (x, step) = (self.nodes[donor].x.clone(), self.nodes[donor].step);
            let j = self.add_node(x, step, false);
            match self.p.links {
                Some(k) => self.dial(j, k, 100),
                None => {
                    for i in 0..self.nodes.len() {
                        if i != j && self.nodes[i].alive {
                            let (a, b) = (self.nodes[i].id, self.nodes[j].id);
                            self.at(100, Ev::Deliver(j, Box::new(Input::PeerUp(a))));
                            self.at(100, Ev::Deliver(i, Box::new(Input::PeerUp(b))));
                        }
                    }
                }
            }
        }
        self.at(self.p.churn_every_ms, Ev::Churn);
    }

    fn finish(mut self) -> SimReport {
        let honest: Vec<&SimNode> = self
            .nodes
            .iter()
            .filter(|n| n.alive && !n.hostile)
            .collect();
        self.report.consensus = self.consensus();
        let target_norm = honest
            .iter()
            .map(|n| l2_norm(&n.target))
            .fold(0.0, f64::max)
            .max(1e-9);
        self.report.finite = honest.iter().all(|n| n.x.iter().all(|v| v.is_finite()));
        let now = self.now();
        for n in &honest {
            let s = n.core.status(now);
            let (u, f) = (&s.updates, &s.full_syncs);
            for (name, v) in [
                ("updates.sent", u.sent),
                ("updates.received", u.received),
                ("updates.rejected", u.rejected),
                ("updates.late", u.late),
                ("updates.duplicates", u.duplicates),
                ("updates.too_old", u.too_old),
                ("updates.scaled_down", u.scaled_down),
                ("updates.over_budget", u.over_budget),
                ("updates.outliers", u.outliers),
                ("updates.rate_limited", u.rate_limited),
                ("updates.clipped_values", u.clipped_values),
                ("full_syncs.accepted", f.accepted),
                ("full_syncs.refused", f.refused),
                ("full_syncs.failed", f.failed),
                ("full_syncs.bytes_received", f.bytes_received),
                ("dropped_stale", s.dropped_stale),
                ("payload_bytes_sent", s.payload_bytes_sent),
                ("neighbours", s.neighbours.len() as u64),
                ("members", s.members.len() as u64),
                ("heard", s.progress.len() as u64),
                ("rejected_by_peer", s.rejected_by_peer.values().sum()),
                ("sync_refusals", s.sync_refusals.values().sum()),
            ] {
                *self.report.counters.entry(name).or_default() += v;
            }
        }
        self.report.worst_norm_ratio = honest
            .iter()
            .map(|n| l2_norm(&n.x) / target_norm)
            .fold(0.0, f64::max);
        if self.p.rounds.is_some() {
            self.report.rounds = Some(self.rounds_report(&honest, now));
        }
        self.report
    }

    fn rounds_report(&self, live: &[&SimNode], now: Instant) -> RoundsReport {
        let end = self.p.secs * 1000;
        let mut r = RoundsReport {
            taken: self.round_digests.len() as u64,
            split: self
                .round_digests
                .values()
                .filter(|digests| digests.len() > 1)
                .count() as u64,
            ..RoundsReport::default()
        };
        for n in live {
            let Some(s) = n.core.status(now).rounds else {
                continue;
            };
            r.highest = r.highest.max(s.round.unwrap_or(0));
            r.completed += s.completed;
            for (why, count) in s.aborted {
                *r.aborted.entry(why).or_default() += count;
            }
            if !s.synced && n.born + SETTLE_MS < end {
                r.unsynced += 1;
            }
            r.ring_bytes += s.bytes_sent;
            r.clipped += s.parts_clipped;
            r.refused += s.parts_refused;
            let hostile_ids: Vec<String> = self
                .nodes
                .iter()
                .filter(|n| n.hostile)
                .map(|n| n.id.to_string())
                .collect();
            if s.left_out.iter().any(|p| hostile_ids.contains(p)) {
                r.hostile_left_out += 1;
            }
        }
        let mut optimum = vec![0.0f64; self.p.dim];
        for n in live {
            for (o, t) in optimum.iter_mut().zip(&n.target) {
                *o += f64::from(*t) / live.len() as f64;
            }
        }
        let mut mean = vec![0.0f64; self.p.dim];
        for n in live {
            for (m, x) in mean.iter_mut().zip(&n.x) {
                *m += f64::from(*x) / live.len() as f64;
            }
        }
        r.loss = mean
            .iter()
            .zip(&optimum)
            .map(|(m, o)| (m - o).powi(2))
            .sum::<f64>()
            / self.p.dim as f64;
        r.top_step = live
            .iter()
            .filter(|n| !n.hostile)
            .map(|n| n.step)
            .max()
            .unwrap_or(0);
        for (&(_, banned), &rounds) in &self.bans {
            if self.nodes[banned].hostile {
                r.bans.0 += 1;
                r.rounds_to_ban = r.rounds_to_ban.max(rounds);
            } else {
                r.bans.1 += 1;
            }
        }
        r
    }
}
