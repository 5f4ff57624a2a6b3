//! Synchronous rounds, for the sync modes `allreduce`, `ddp`, `diloco` and `fedavg`: every `steps`
//! steps each member stops at the round's boundary, the members sum a weighted copy of their
//! parameters in a bandwidth-optimal ring (reduce-scatter, then all-gather: each member sends
//! `2(N-1)/N` of the model per round), and every member hands its trainer the same mean, bit
//! for bit, because each chunk is summed once, by one member, and then copied around the ring.
//! What the trainer makes of the mean (take it, or an outer Nesterov step towards it) is the
//! trainer's business ([`super::TrainerCommand::Combine`]).
//!
//! No member leads. The ring of an attempt is the sorted list of members each node holds ready
//! (heard saying so within [`READY_FRESH`]); every hop carries a digest of the sender's list,
//! and lists that differ abort the attempt, which is retried with the next number after
//! [`RETRY_PAUSE`] (by then heartbeats have made the lists agree). A member that dies aborts
//! the attempt at once when its connection closes or a hop to it cannot be delivered, and
//! after [`STALL_TIMEOUT`] without progress otherwise; the retry leaves it out. An attempt that
//! can no longer finish because its members went on to the next round without this node gives
//! way at once (it had no hop yet) or [`LATE_ROUND_WAIT`] after its predecessor's first hop of
//! the next round (it had some). A joiner (or a
//! node restored from a checkpoint) holds before its first step, takes the round number of the
//! first hop that reaches it, and contributes with weight 0: it leaves the round with the
//! members' mean, that is the current state, at a round boundary.
//!
//! In `ddp` ([`RoundConfig::gradients`]) there is a round at every step and most rounds sum
//! gradients, not parameters: the trainer steps only with a round's mean gradient. Those hops
//! travel as bf16 (rounded where sent, so the bits still agree), and a ring of two swaps whole
//! contributions in one message each way. Every `resync_every`-th round sums parameters and
//! optimizer state, and hands a node that was not synced the members' step with them. No round
//! starts with fewer than [`RoundConfig::min_members`] members. With
//! [`RoundConfig::balance`], a member that computes slower than the fastest (by the
//! milliseconds per sample each puts in its heartbeats) is asked for a smaller batch, the one
//! it computes while the fastest computes the whole batch ([`balanced_batch`]), and its
//! gradient weighs by its samples, so the mean is still the gradient of every sample computed.
//!
//! Pure state: the core feeds it and carries out what it returns.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use sha2::{Digest, Sha256};

use super::{Output, TrainerCommand, HEARTBEAT_EVERY};
use crate::wire::RingMessage;

/// A member heard ready within this long is put in the ring: three heartbeats, so one lost
/// heartbeat does not drop it, while a hung member falls out of the next attempt.
pub const READY_FRESH: Duration = Duration::from_secs(3 * HEARTBEAT_EVERY.as_secs());
/// An attempt that made no progress for this long is aborted and retried (a member that hung
/// without closing its connection). An honest member still training towards the boundary
/// costs only a retry, never a punishment.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(20);
/// An attempt whose predecessor has sent a hop of the next round, and that made no progress
/// for this long since that hop came, is aborted; the retry takes the mesh's round. The
/// predecessor sent its last hop of this round before that one, over the same connection, so
/// a last hop still missing this long after is not coming (the predecessor finished the
/// round in an attempt this node left).
pub const LATE_ROUND_WAIT: Duration = Duration::from_secs(2);
/// Pause before an aborted attempt is retried, so the members' lists can settle.
pub const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// A node that has no round number yet (it resumed from a checkpoint) and hears no ring for
/// this long while ready starts the rounds itself, at round 0: a whole mesh restarted from
/// checkpoints must not wait for each other forever.
pub const ADOPT_WAIT: Duration = Duration::from_secs(5);
/// Hops kept for an attempt this node has not reached yet.
const INBOX_CAP: usize = 256;
/// Digests of recent rounds kept in status.
const DIGESTS_KEPT: usize = 32;
/// A `ddp` member whose forward-backward per sample is within this fraction of the fastest
/// member's takes the whole batch: boxes of one kind differ by noise, and a sample dropped
/// for noise costs more per step than the few milliseconds it saves.
pub const BALANCE_SLACK: f64 = 0.1;
/// A `ddp` member's batch is never cut below `batch / MAX_SHRINK` (and never below one
/// sample), whatever the others claim: a peer that says it is very fast cuts honest members'
/// batches (and so their weight beside its own) by this much at most. (A ring member can
/// already scale its own contribution as it likes: the ring trusts its members.)
pub const MAX_SHRINK: usize = 8;
/// A gradient round's parameters are digested only when the round number is a multiple of
/// this (a digest reads every parameter: ~2 ms a step on the 0.83 M GPT); parameter rounds
/// always are.
pub const DIGEST_EVERY: u64 = 10;

/// How this node takes part in rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundConfig {
    /// Steps between two rounds (at least 1).
    pub steps: u64,
    /// This node's weight in the mean: 1, or its training samples for `fedavg`.
    pub weight: f32,
    /// `ddp`: the rounds sum gradients, one round per step, and the trainer steps only with
    /// a round's mean gradient; every round whose number this divides sums parameters
    /// instead (round 0 among them), which is how a joiner takes the members' state.
    /// `None`: every round sums parameters, `steps` apart.
    pub gradients: Option<u64>,
    /// No round starts with fewer members than this (this node included): a mesh that should
    /// train as N boxes waits for them, as DDP waits for its world, and takes its first step
    /// with all of them, from one state.
    pub min_members: usize,
    /// Samples of a step's batch (`train.batch_size`): a `ddp` gradient of `b` samples
    /// weighs `b / batch` in the mean, so the mean is the whole batch's gradient.
    pub batch: usize,
    /// `ddp`: a member slower than the fastest takes a batch that it computes in the time
    /// the fastest computes the whole one ([`balanced_batch`]), so a slow box adds what it
    /// can instead of holding every step back.
    pub balance: bool,
}

impl RoundConfig {
    /// The step limit a node at `step` starts with: a founder (`synced`) trains to its first
    /// boundary; a joiner, a resumed node and any node in gradient rounds hold at once.
    pub fn first_boundary(&self, step: u64, synced: bool) -> u64 {
        if synced && self.gradients.is_none() {
            step + self.steps.max(1)
        } else {
            step
        }
    }

    /// Whether round `round` sums gradients (else parameters).
    pub fn sums_gradients(&self, round: u64) -> bool {
        self.gradients
            .is_some_and(|k| k > 1 && !round.is_multiple_of(k))
    }
}

/// Rounds as status shows them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundStatus {
    /// Rounds completed mesh-wide before the one under way (`None`: not yet known, a joiner
    /// waiting for its first ring).
    pub round: Option<u64>,
    /// The attempt at it.
    pub attempt: u32,
    /// Members in the last ring this node built.
    pub ring_size: usize,
    /// Rounds this node completed.
    pub completed: u64,
    /// Attempts aborted, by reason.
    pub aborted: BTreeMap<String, u64>,
    /// Milliseconds from this node's contribution to the mean, in the last round.
    pub last_round_ms: f64,
    /// Samples this node was last asked to compute a gradient of: the whole batch, or fewer
    /// where it is slower than another member ([`balanced_batch`]); 0 before its first
    /// gradient round.
    #[serde(default)]
    pub batch: usize,
    /// Mean of the same over every round this node completed in a ring of two or more: what
    /// a round costs here, waits for slower members included.
    #[serde(default)]
    pub mean_round_ms: f64,
    /// Bytes of ring hops this node sent.
    pub bytes_sent: u64,
    /// The step of the next boundary.
    pub boundary: u64,
    /// Whether this node's parameters come from a completed round (a joiner's do not, and it
    /// contributes with weight 0 until they do).
    pub synced: bool,
    /// Digest of the parameters after recent rounds (`round`, first 8 bytes of SHA-256 of the
    /// little-endian values, hex), kept only for rounds after which this node was synced:
    /// equal digests for a round mean bit-identical parameters.
    pub digests: Vec<(u64, String)>,
}

/// A hop's place: (round, attempt, hop).
type HopKey = (u64, u32, u32);
/// A hop waiting in the inbox: (sender, member-list digest, values, the step it carries).
type Hop = (PeerId, u64, Vec<f32>, u64);

/// One attempt's ring under way.
#[derive(Debug)]
struct Ring {
    members: Vec<PeerId>,
    digest: u64,
    me: usize,
    /// The running sums, then the finished ones.
    acc: Vec<f32>,
    /// Hops travel as bf16 (gradient rounds): half the bytes. Every value is rounded where
    /// it is sent, the sender's own copy included, so the members still end bit-identical.
    compact: bool,
    /// The highest trainer step among the contributions this node has seen in the ring: at
    /// the end, the members' step, which a node that was not synced takes with the mean.
    step: u64,
    /// The hop expected next from the predecessor.
    next_hop: u32,
    last_progress: Instant,
    /// When the predecessor's first hop of the next round came, while this attempt still
    /// waited for one of this round.
    predecessor_went_on: Option<Instant>,
    /// Members that left after completing this round: a member completes a round only after
    /// it sent all its hops of it, and waits for them to be taken before it says goodbye, so
    /// the attempt still finishes without it (see [`Rounds::peer_leaving`]).
    left_done: Vec<PeerId>,
}

impl Ring {
    fn len(&self) -> usize {
        self.members.len()
    }

    fn hops(&self) -> u32 {
        if self.direct() {
            1
        } else {
            2 * (self.len() as u32 - 1)
        }
    }

    /// Two members of a compact (gradient) round swap their whole contributions in one
    /// message each way, rather than halves in two turns: the same bytes, half the waits.
    /// Each adds the other's to its own; `a + b == b + a` in floating point, so both hold
    /// the same bits.
    fn direct(&self) -> bool {
        self.compact && self.len() == 2
    }

    /// The values sent at `hop`.
    fn sent_range(&self, hop: u32) -> std::ops::Range<usize> {
        if self.direct() {
            0..self.acc.len()
        } else {
            self.chunk(self.sent_chunk(hop))
        }
    }

    /// The values received at `hop`.
    fn received_range(&self, hop: u32) -> std::ops::Range<usize> {
        if self.direct() {
            0..self.acc.len()
        } else {
            self.chunk(self.received_chunk(hop))
        }
    }

    fn successor(&self) -> PeerId {
        self.members[(self.me + 1) % self.len()]
    }

    fn predecessor(&self) -> PeerId {
        self.members[(self.me + self.len() - 1) % self.len()]
    }

    /// The value range of chunk `c`.
    fn chunk(&self, c: usize) -> std::ops::Range<usize> {
        let (n, total) = (self.len(), self.acc.len());
        (c * total / n)..((c + 1) * total / n)
    }

    /// The chunk sent at `hop`: reduce-scatter sends chunk `me - hop`, all-gather chunk
    /// `me + 1 - (hop - (N-1))`.
    fn sent_chunk(&self, hop: u32) -> usize {
        let n = self.len() as i64;
        let (me, hop) = (self.me as i64, i64::from(hop));
        let c = if hop < n - 1 {
            me - hop
        } else {
            me + 1 - (hop - (n - 1))
        };
        c.rem_euclid(n) as usize
    }

    /// The chunk received at `hop`: the one the predecessor sent.
    fn received_chunk(&self, hop: u32) -> usize {
        let n = self.len() as i64;
        let (pred, hop) = ((self.me as i64 - 1).rem_euclid(n), i64::from(hop));
        let c = if hop < n - 1 {
            pred - hop
        } else {
            pred + 1 - (hop - (n - 1))
        };
        c.rem_euclid(n) as usize
    }
}

/// Where this node is in the round.
#[derive(Debug)]
enum Stage {
    /// Training towards the boundary.
    Training,
    /// Its parameters (or, in a gradient round, the next batch's gradient) were asked of the
    /// trainer.
    Asked {
        /// A gradient was asked for.
        gradient: bool,
    },
    /// Holding its contribution, with an attempt under way or waiting to be retried.
    Reducing {
        contribution: Vec<f32>,
        /// The contribution is a gradient (else parameters).
        gradient: bool,
        /// The trainer's step when it gave the contribution.
        step: u64,
        ring: Option<Ring>,
        since: Instant,
    },
    /// The mean went to the trainer.
    Combining,
}

/// The rounds of one node; see the module docs.
#[derive(Debug)]
pub struct Rounds {
    cfg: RoundConfig,
    me: PeerId,
    round: Option<u64>,
    attempt: u32,
    boundary: u64,
    synced: bool,
    stage: Stage,
    /// Hops for attempts this node has not reached: (round, attempt, hop) -> (sender, digest,
    /// values).
    inbox: BTreeMap<HopKey, Hop>,
    retry_at: Option<Instant>,
    ready: HashMap<PeerId, Instant>,
    /// Ready members' forward-backward milliseconds per sample, from their heartbeats.
    speeds: HashMap<PeerId, f64>,
    /// This node's own.
    own_ms_per_sample: Option<f64>,
    /// Samples of the last gradient asked of the trainer.
    batch: usize,
    /// Since when this node, ready, has waited for a round number.
    waiting_since: Option<Instant>,
    /// When a ready member last said it knows the round: then rounds are running, and a
    /// node without a round waits for their hops instead of starting its own.
    rounds_heard: Option<Instant>,
    /// What status counts; the rest of [`RoundStatus`] is read off the fields above.
    ring_size: usize,
    completed: u64,
    aborted: BTreeMap<String, u64>,
    last_round_ms: f64,
    /// Milliseconds summed over rounds in rings of two or more, and their count.
    round_ms_sum: (f64, u64),
    bytes_sent: u64,
    digests: VecDeque<(u64, String)>,
}

impl Rounds {
    /// Rounds for a node at `step`. A founder (`synced`) starts at round 0 and trains to the
    /// first boundary; a joiner or a resumed node holds at once and adopts the mesh's round.
    pub fn new(cfg: RoundConfig, me: PeerId, step: u64, synced: bool) -> Rounds {
        let cfg = RoundConfig {
            steps: cfg.steps.max(1),
            ..cfg
        };
        // In gradient rounds the trainer takes no step of its own: it is held at its step.
        let boundary = cfg.first_boundary(step, synced);
        Rounds {
            cfg,
            me,
            round: synced.then_some(0),
            attempt: 0,
            boundary,
            synced,
            stage: Stage::Training,
            inbox: BTreeMap::new(),
            retry_at: None,
            ready: HashMap::new(),
            speeds: HashMap::new(),
            own_ms_per_sample: None,
            batch: 0,
            waiting_since: None,
            rounds_heard: None,
            ring_size: 0,
            completed: 0,
            aborted: BTreeMap::new(),
            last_round_ms: 0.0,
            round_ms_sum: (0.0, 0),
            bytes_sent: 0,
            digests: VecDeque::new(),
        }
    }

    /// The highest step the trainer may reach: the round's boundary.
    pub fn step_limit(&self) -> u64 {
        self.boundary
    }

    /// The round under way, once this node knows it.
    pub fn round(&self) -> Option<u64> {
        self.round
    }

    /// What status shows.
    pub fn status(&self) -> RoundStatus {
        RoundStatus {
            round: self.round,
            attempt: self.attempt,
            ring_size: self.ring_size,
            completed: self.completed,
            aborted: self.aborted.clone(),
            last_round_ms: self.last_round_ms,
            batch: self.batch,
            mean_round_ms: if self.round_ms_sum.1 > 0 {
                self.round_ms_sum.0 / self.round_ms_sum.1 as f64
            } else {
                0.0
            },
            bytes_sent: self.bytes_sent,
            boundary: self.boundary,
            synced: self.synced,
            digests: self.digests.iter().cloned().collect(),
        }
    }

    /// A member's heartbeat said whether it is ready for rounds, and how fast it computes
    /// (a claim that is not a positive number is no claim).
    pub fn heard(
        &mut self,
        peer: PeerId,
        in_rounds: bool,
        round: Option<u64>,
        ms_per_sample: Option<f64>,
        now: Instant,
    ) {
        if in_rounds {
            self.ready.insert(peer, now);
            if round.is_some() {
                self.rounds_heard = Some(now);
            }
            match ms_per_sample.filter(|v| v.is_finite() && *v > 0.0) {
                Some(v) => self.speeds.insert(peer, v),
                None => self.speeds.remove(&peer),
            };
        } else {
            self.ready.remove(&peer);
            self.speeds.remove(&peer);
        }
    }

    /// This node's own forward-backward milliseconds per sample.
    pub fn own_speed(&mut self, ms_per_sample: Option<f64>) {
        self.own_ms_per_sample = ms_per_sample;
    }

    /// A member went away: an attempt it was part of cannot finish, unless the member
    /// completed it before it left ([`Rounds::peer_leaving`]).
    pub fn peer_down(&mut self, peer: PeerId, now: Instant) {
        self.ready.remove(&peer);
        self.speeds.remove(&peer);
        self.inbox.retain(|_, (from, _, _, _)| *from != peer);
        let completed = matches!(&self.stage, Stage::Reducing { ring: Some(r), .. } if r.left_done.contains(&peer));
        if self.ring_has(&peer) && !completed {
            self.abort("member left", now);
        }
    }

    /// A member said goodbye at `their_round`, one past the last round it completed. If that
    /// is past this node's round, it completed the attempt under way here (a member stopping
    /// at `max_steps` leaves right after its last round, often before its successors took
    /// their last hops): everything it had to send is sent and taken, so its going does not
    /// abort the attempt, which ends with the hops the others still forward. (Aborting it
    /// left the rest of a `ddp` mesh one round short of `max_steps`, waiting for the
    /// `min_members` it could no longer have.)
    pub fn peer_leaving(&mut self, peer: PeerId, their_round: Option<u64>) {
        let past = matches!((their_round, self.round), (Some(t), Some(mine)) if t > mine);
        if let Stage::Reducing { ring: Some(r), .. } = &mut self.stage {
            if past && r.members.contains(&peer) && !r.left_done.contains(&peer) {
                r.left_done.push(peer);
            }
        }
    }

    /// A hop to `peer` could not be delivered.
    pub fn undelivered(&mut self, peer: PeerId, round: u64, attempt: u32, now: Instant) {
        if Some(round) == self.round && attempt == self.attempt && self.ring_has(&peer) {
            self.ready.remove(&peer);
            self.abort("hop undelivered", now);
        }
    }

    fn ring_has(&self, peer: &PeerId) -> bool {
        matches!(&self.stage, Stage::Reducing { ring: Some(r), .. } if r.members.contains(peer))
    }

    /// Time passed; `step` is the trainer's, `training` whether it trains (a joiner still
    /// downloading does not, and is not asked for parameters).
    pub fn tick(&mut self, step: u64, training: bool, now: Instant, out: &mut Vec<Output>) {
        // A member unheard for long (hung, or gone without a word) no longer sizes batches.
        let ready = &self.ready;
        self.speeds.retain(|peer, _| {
            ready
                .get(peer)
                .is_some_and(|at| now.saturating_duration_since(*at) < READY_FRESH)
        });
        match &self.stage {
            // A step report at the boundary may have been dropped: the tick asks instead.
            Stage::Training if training => self.stepped(step, out),
            Stage::Reducing { ring: Some(r), .. }
                if now.saturating_duration_since(r.last_progress) >= STALL_TIMEOUT =>
            {
                self.abort("stalled", now);
            }
            Stage::Reducing { ring: Some(r), .. }
                if r.predecessor_went_on.is_some_and(|t| {
                    now.saturating_duration_since(t.max(r.last_progress)) >= LATE_ROUND_WAIT
                }) =>
            {
                self.abort("the mesh went on", now);
            }
            Stage::Reducing { ring: None, .. } => {
                if self.round.is_none() {
                    let running = self
                        .rounds_heard
                        .is_some_and(|t| now.saturating_duration_since(t) < READY_FRESH);
                    if running {
                        self.waiting_since = None;
                    }
                    let since = *self.waiting_since.get_or_insert(now);
                    if !running && now.saturating_duration_since(since) >= ADOPT_WAIT {
                        tracing::info!("no ring heard; starting the rounds at round 0");
                        self.round = Some(0);
                        self.synced = true;
                    }
                }
                if self.retry_at.is_none_or(|t| now >= t) {
                    self.start(now, out);
                }
            }
            _ => {}
        }
    }

    /// The trainer reached a step: at the boundary, its parameters are asked for, or in a
    /// gradient round its next gradient. (A node whose parameters are not the members' gives
    /// its gradient with weight 0 too, and is brought in by the next parameter round; one
    /// that does not know the round yet gives its parameters.)
    pub fn stepped(&mut self, step: u64, out: &mut Vec<Output>) {
        if matches!(self.stage, Stage::Training) && step >= self.boundary {
            let gradient = self.round.is_some_and(|r| self.cfg.sums_gradients(r));
            self.ask(gradient, out);
        }
    }

    fn ask(&mut self, gradient: bool, out: &mut Vec<Output>) {
        self.stage = Stage::Asked { gradient };
        out.push(Output::Trainer(if gradient {
            let batch = if self.cfg.balance {
                balanced_batch(
                    self.cfg.batch,
                    self.own_ms_per_sample,
                    self.speeds.values().copied(),
                )
            } else {
                self.cfg.batch
            };
            self.batch = batch;
            TrainerCommand::TakeGradient { batch }
        } else {
            TrainerCommand::TakeParams
        }));
    }

    /// The trainer's parameters at the boundary: see [`Rounds::contribute`].
    pub fn params(&mut self, values: Vec<f32>, step: u64, now: Instant, out: &mut Vec<Output>) {
        self.contribute(values, false, 1.0, step, now, out);
    }

    /// The trainer's gradient in a gradient round, the mean over `samples` samples: it weighs
    /// `samples / batch` of a whole batch's, so a member that took a smaller batch
    /// ([`balanced_batch`]) counts for what it computed (members of a run share
    /// `train.batch_size`, so the mean is that of every sample computed). The share is
    /// rounded to bf16 first, as gradient hops carry it: the weight a member sends is the
    /// one its values were scaled by.
    pub fn gradient(
        &mut self,
        values: Vec<f32>,
        samples: usize,
        step: u64,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let share = samples.min(self.cfg.batch) as f32 / self.cfg.batch.max(1) as f32;
        let share = half::bf16::from_f32(share).to_f32();
        self.contribute(values, true, share, step, now, out);
    }

    /// This node's contribution is `weight * share * values`, with that weight itself
    /// appended, so the ring's sum divides into the weighted mean. An answer to another
    /// question than the one asked (one from before a restore) is dropped.
    fn contribute(
        &mut self,
        values: Vec<f32>,
        gradient: bool,
        share: f32,
        step: u64,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        if !matches!(self.stage, Stage::Asked { gradient: g } if g == gradient) {
            return;
        }
        let w = if self.synced {
            self.cfg.weight * share
        } else {
            0.0
        };
        let mut contribution = values;
        if w != 1.0 {
            contribution.iter_mut().for_each(|v| *v *= w);
        }
        contribution.push(w);
        self.stage = Stage::Reducing {
            contribution,
            gradient,
            step,
            ring: None,
            since: now,
        };
        self.retry_at = None;
        self.start(now, out);
    }

    /// Takes the newest round the inbox holds hops of, when it is past this node's (or this
    /// node has none): the mesh completed rounds without it. Its parameters are then not
    /// the mesh's, so it contributes with weight 0 and leaves the round with the mean.
    fn adopt_newer_round(&mut self) {
        let Some(&(newest, attempt, _)) = self.inbox.keys().next_back() else {
            return;
        };
        let Stage::Reducing { contribution, .. } = &mut self.stage else {
            return;
        };
        match self.round {
            Some(mine) if newest <= mine => return,
            Some(mine) => {
                tracing::info!(
                    mine,
                    theirs = newest,
                    "the mesh is rounds ahead; adopting its round"
                );
                self.synced = false;
                contribution.iter_mut().for_each(|v| *v = 0.0);
            }
            None => {}
        }
        self.round = Some(newest);
        self.attempt = attempt;
    }

    /// Starts an attempt with the members ready now, if the round is known.
    fn start(&mut self, now: Instant, out: &mut Vec<Output>) {
        self.adopt_newer_round();
        let Some(round) = self.round else {
            return;
        };
        // A node that adopted the mesh's round may hold the other kind of contribution
        // (parameters for a gradient round): it asks the trainer again, and its answer
        // starts the attempt.
        if let Stage::Reducing { gradient, .. } = self.stage {
            if gradient != self.cfg.sums_gradients(round) {
                self.ask(!gradient, out);
                return;
            }
        }
        let Stage::Reducing {
            contribution,
            ring,
            step,
            ..
        } = &mut self.stage
        else {
            return;
        };
        // Someone may already be at a later attempt of this round: join it.
        if let Some(a) = self
            .inbox
            .range((round, 0, 0)..=(round, u32::MAX, u32::MAX))
            .map(|((_, a, _), _)| *a)
            .max()
        {
            self.attempt = self.attempt.max(a);
        }
        let mut members: Vec<PeerId> = self
            .ready
            .iter()
            .filter(|(_, at)| now.saturating_duration_since(**at) < READY_FRESH)
            .map(|(p, _)| *p)
            .collect();
        members.push(self.me);
        if members.len() < self.cfg.min_members {
            // Waiting for members: the tick tries again.
            return;
        }
        members.sort();
        let me = members.iter().position(|p| *p == self.me).unwrap_or(0);
        let r = Ring {
            digest: members_digest(&members),
            members,
            me,
            acc: contribution.clone(),
            compact: self.cfg.sums_gradients(round),
            step: *step,
            next_hop: 0,
            last_progress: now,
            predecessor_went_on: None,
            left_done: Vec::new(),
        };
        self.ring_size = r.len();
        self.retry_at = None;
        if r.len() == 1 {
            let (acc, step) = (r.acc, r.step);
            self.finish(round, acc, step, now, out);
            return;
        }
        let mut r = r;
        let first = hop_message(round, self.attempt, &mut r, 0);
        self.bytes_sent += first.values.len() as u64;
        out.push(Output::SendRing {
            peer: r.successor(),
            msg: first,
        });
        *ring = Some(r);
        self.drain(now, out);
    }

    /// A hop from `from`. Hops of a later attempt make this node join it; hops of attempts
    /// it has not reached wait in the inbox; stale ones are dropped. A hop that cannot be
    /// honest (wrong size, not finite) is an offence and aborts the attempt.
    pub fn message(&mut self, from: PeerId, msg: RingMessage, now: Instant, out: &mut Vec<Output>) {
        let Some(values) = decode_values(&msg.values, msg.bf16) else {
            out.push(Output::Offence {
                peer: from,
                why: "ring hop of odd length".into(),
            });
            return;
        };
        if !all_finite(&values) {
            out.push(Output::Offence {
                peer: from,
                why: "ring hop with NaN or infinite values".into(),
            });
            return;
        }
        // A hop is proof that its sender takes part in rounds now.
        self.ready.insert(from, now);
        let key = (msg.round, msg.attempt, msg.hop);
        let reducing = matches!(self.stage, Stage::Reducing { .. });
        match self.round {
            // A round this node has not reached. Right after a round, a faster member may
            // already be in the next one while this node waits for its last hop: that hop
            // waits. A member can only have finished an attempt this node took part in once
            // this node had hops of it, so an attempt without any is not finishing. Otherwise
            // the mesh went on without this node (it joined, was cut off, or aborted an
            // attempt the others completed): `start` takes the mesh's round.
            Some(r) if msg.round > r => {
                let finishing = msg.round == r + 1
                    && matches!(&self.stage, Stage::Reducing { ring: Some(ring), .. } if ring.next_hop > 0);
                self.keep(key, (from, msg.members, values, msg.step));
                if reducing && !finishing {
                    self.restart(now, out);
                } else if let Stage::Reducing {
                    ring: Some(ring), ..
                } = &mut self.stage
                {
                    if ring.predecessor() == from {
                        ring.predecessor_went_on.get_or_insert(now);
                    }
                }
                return;
            }
            None => {
                self.keep(key, (from, msg.members, values, msg.step));
                if reducing {
                    self.restart(now, out);
                }
                return;
            }
            Some(r) if msg.round < r => return,
            Some(_) if msg.attempt < self.attempt => return,
            Some(_) if msg.attempt > self.attempt => {
                self.attempt = msg.attempt;
                self.keep(key, (from, msg.members, values, msg.step));
                if reducing {
                    self.restart(now, out);
                }
                return;
            }
            Some(_) => {}
        }
        self.keep(key, (from, msg.members, values, msg.step));
        self.drain(now, out);
    }

    /// Drops the attempt under way (if any) and starts again at once, with what the inbox
    /// says of the mesh's round and attempt.
    fn restart(&mut self, now: Instant, out: &mut Vec<Output>) {
        if let Stage::Reducing { ring, .. } = &mut self.stage {
            *ring = None;
        }
        self.start(now, out);
    }

    fn keep(&mut self, key: HopKey, hop: Hop) {
        if self.inbox.len() >= INBOX_CAP {
            self.inbox.pop_first();
        }
        self.inbox.insert(key, hop);
    }

    /// Takes the hops the running attempt expects, in order, from the inbox.
    fn drain(&mut self, now: Instant, out: &mut Vec<Output>) {
        loop {
            let Some(round) = self.round else {
                return;
            };
            let attempt = self.attempt;
            let Stage::Reducing {
                ring: Some(ring), ..
            } = &mut self.stage
            else {
                return;
            };
            // Hops of older attempts of this round, or of older rounds, are no use any more.
            let stale: Vec<_> = self
                .inbox
                .keys()
                .filter(|(r, a, _)| *r < round || (*r == round && *a < attempt))
                .copied()
                .collect();
            for k in stale {
                self.inbox.remove(&k);
            }
            let key = (round, attempt, ring.next_hop);
            let Some((from, digest, values, step)) = self.inbox.remove(&key) else {
                // A hop of this attempt with another member list means the lists differ.
                let differs = self
                    .inbox
                    .range((round, attempt, 0)..=(round, attempt, u32::MAX))
                    .any(|(_, (_, d, _, _))| *d != ring.digest);
                if differs {
                    self.abort("member lists differ", now);
                }
                return;
            };
            if digest != ring.digest {
                self.abort("member lists differ", now);
                return;
            }
            if from != ring.predecessor() {
                // The same list puts the sender elsewhere: cannot be honest.
                out.push(Output::Offence {
                    peer: from,
                    why: "ring hop out of turn".into(),
                });
                self.abort("hop out of turn", now);
                return;
            }
            let hop = ring.next_hop;
            let range = ring.received_range(hop);
            if values.len() != range.len() {
                out.push(Output::Offence {
                    peer: from,
                    why: format!(
                        "ring hop of {} values where {} belong",
                        values.len(),
                        range.len()
                    ),
                });
                self.abort("hop of the wrong size", now);
                return;
            }
            let reducing = hop < ring.len() as u32 - 1 || ring.direct();
            for (a, v) in ring.acc[range].iter_mut().zip(&values) {
                if reducing {
                    *a += v;
                } else {
                    *a = *v;
                }
            }
            ring.step = ring.step.max(step);
            ring.next_hop += 1;
            ring.last_progress = now;
            if ring.next_hop == ring.hops() {
                let acc = std::mem::take(&mut ring.acc);
                let step = ring.step;
                self.finish(round, acc, step, now, out);
                return;
            }
            let msg = hop_message(round, attempt, ring, ring.next_hop);
            let peer = ring.successor();
            self.bytes_sent += msg.values.len() as u64;
            out.push(Output::SendRing { peer, msg });
        }
    }

    /// The sums are complete: the weighted mean goes to the trainer, and with a parameter
    /// mean, to a node that was not synced, the members' step.
    fn finish(
        &mut self,
        round: u64,
        mut acc: Vec<f32>,
        step: u64,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let since = match &self.stage {
            Stage::Reducing { since, .. } => *since,
            _ => now,
        };
        self.last_round_ms = now.saturating_duration_since(since).as_secs_f64() * 1e3;
        if self.ring_size > 1 {
            self.round_ms_sum.0 += self.last_round_ms;
            self.round_ms_sum.1 += 1;
        }
        let total = acc.pop().unwrap_or(0.0);
        self.stage = Stage::Combining;
        let gradient = self.cfg.sums_gradients(round);
        let step = (!gradient && !self.synced).then_some(step);
        if total > 0.0 {
            acc.iter_mut().for_each(|v| *v /= total);
            out.push(Output::Trainer(TrainerCommand::Combine {
                round,
                mean: acc,
                gradient,
                step,
            }));
        } else {
            // Nobody in the ring had parameters from a round (joiners only): each keeps its
            // own and they are synced from the next round on.
            out.push(Output::Trainer(TrainerCommand::Combine {
                round,
                mean: Vec::new(),
                gradient,
                step: None,
            }));
        }
    }

    /// The trainer took round `round`'s mean at `step`; `digest` is its parameters' digest.
    /// A parameter round leaves every member with the mean, so synced; a gradient round
    /// changes nothing in that. In gradient rounds the next one starts at once.
    pub fn combined(&mut self, round: u64, step: u64, digest: String, out: &mut Vec<Output>) {
        if !matches!(self.stage, Stage::Combining) || self.round != Some(round) {
            return;
        }
        self.round = Some(round + 1);
        self.attempt = 0;
        if !self.cfg.sums_gradients(round) {
            self.synced = true;
        }
        // As a synced member's first boundary: `steps` on, or in gradient rounds, none.
        self.boundary = self.cfg.first_boundary(step, true);
        self.stage = Stage::Training;
        self.waiting_since = None;
        self.completed += 1;
        // A trainer digests gradient rounds only now and then (see `DIGEST_EVERY`). An
        // unsynced member (a joiner, or one that adopted a round the mesh completed without
        // it) holds parameters that are not the mesh's: it claims no digest until a parameter
        // round syncs it, so equal rounds in two members' lists mean equal bits.
        if !digest.is_empty() && self.synced {
            if self.digests.len() >= DIGESTS_KEPT {
                self.digests.pop_front();
            }
            self.digests.push_back((round, digest));
        }
        self.stepped(step, out);
    }

    /// The trainer could not take the mean: hold, and let the round be retried. The trainer
    /// keeps its parameters, which are no longer the members': it is unsynced.
    pub fn combine_failed(&mut self) {
        if matches!(self.stage, Stage::Combining) {
            self.synced = false;
            self.stage = Stage::Training;
            self.abort_counter("trainer failed");
        }
    }

    /// The parameters were replaced (a checkpoint, a downloaded state): they are no longer the
    /// mesh's; hold and adopt the mesh's round.
    pub fn restored(&mut self, step: u64) {
        self.round = None;
        self.attempt = 0;
        self.synced = false;
        self.boundary = step;
        self.stage = Stage::Training;
        self.waiting_since = None;
    }

    fn abort(&mut self, why: &str, now: Instant) {
        if let Stage::Reducing { ring, .. } = &mut self.stage {
            if ring.take().is_some() {
                tracing::info!(round = ?self.round, attempt = self.attempt, why, "round attempt aborted; retrying");
                self.attempt += 1;
                self.retry_at = Some(now + RETRY_PAUSE);
                self.abort_counter(why);
            }
        }
    }

    fn abort_counter(&mut self, why: &str) {
        *self.aborted.entry(why.to_string()).or_default() += 1;
    }
}

/// The message of `hop`: the chunk the ring sends then, little-endian; in a compact ring
/// as bf16, rounded in place first so this node keeps exactly what the others receive.
fn hop_message(round: u64, attempt: u32, ring: &mut Ring, hop: u32) -> RingMessage {
    let range = ring.sent_range(hop);
    let values = &mut ring.acc[range];
    // Loops over pre-sized slices, not `extend`, so that they vectorise: on the critical
    // path of every `ddp` step (0.83 M values for the small GPT).
    let bytes = if ring.compact {
        let mut bytes = vec![0u8; values.len() * 2];
        for (v, out) in values.iter_mut().zip(bytes.chunks_exact_mut(2)) {
            let bits = bf16_bits(*v);
            *v = f32::from_bits(u32::from(bits) << 16);
            out.copy_from_slice(&bits.to_le_bytes());
        }
        bytes
    } else {
        let mut bytes = vec![0u8; values.len() * 4];
        for (v, out) in values.iter().zip(bytes.chunks_exact_mut(4)) {
            out.copy_from_slice(&v.to_le_bytes());
        }
        bytes
    };
    RingMessage {
        round,
        attempt,
        members: ring.digest,
        hop,
        values: ByteBuf::from(bytes),
        step: ring.step,
        bf16: ring.compact,
    }
}

/// Digest of a sorted member list.
fn members_digest(members: &[PeerId]) -> u64 {
    let mut h = Sha256::new();
    for m in members {
        h.update(m.to_bytes());
    }
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().unwrap_or_default())
}

/// `v` rounded to the nearest bf16 (ties to even), as its bits: what `half::bf16::from_f32`
/// gives, bit for bit (a NaN stays a NaN, a finite value past bf16's range becomes infinite),
/// written so that a loop of it vectorises.
#[inline(always)]
fn bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let nearest_even = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((x >> 16) | 0x0040) as u16;
    if x & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        nearest_even
    }
}

/// A hop's values (`bf16` or `f32`, little-endian); `None` when the bytes are not whole
/// values. One pass into a pre-sized vector, which vectorises.
fn decode_values(bytes: &[u8], bf16: bool) -> Option<Vec<f32>> {
    let width = if bf16 { 2 } else { 4 };
    if !bytes.len().is_multiple_of(width) {
        return None;
    }
    let mut values = vec![0f32; bytes.len() / width];
    if bf16 {
        for (v, b) in values.iter_mut().zip(bytes.chunks_exact(2)) {
            *v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
        }
    } else {
        for (v, b) in values.iter_mut().zip(bytes.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    Some(values)
}

/// Whether every value is finite: a sum over all of them (no early exit), which vectorises.
fn all_finite(values: &[f32]) -> bool {
    values
        .iter()
        .fold(0u32, |bad, v| bad | u32::from(!v.is_finite()))
        == 0
}

/// The batch a `ddp` member takes so that its forward-backward ends with the fastest
/// member's: `batch` when it is within [`BALANCE_SLACK`] of the fastest (or when its own speed
/// is not known yet), else the samples it computes in the time the fastest computes `batch`,
/// never below `batch / MAX_SHRINK` nor one sample. `others` are the members'
/// milliseconds per sample; a value that is not a positive number is passed over.
pub fn balanced_batch(batch: usize, own: Option<f64>, others: impl Iterator<Item = f64>) -> usize {
    let Some(own) = own.filter(|v| v.is_finite() && *v > 0.0) else {
        return batch;
    };
    let fastest = others
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(own, f64::min);
    if own <= fastest * (1.0 + BALANCE_SLACK) {
        return batch;
    }
    let fits = (batch as f64 * fastest / own).floor() as usize;
    fits.clamp((batch / MAX_SHRINK).max(1), batch.max(1))
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// The hops' own bf16 rounding is `half`'s, bit for bit, on edge cases and on a sweep of
    /// bit patterns; and a compact hop decodes to exactly the values its sender kept.
    #[test]
    fn bf16_rounding_matches_half_and_round_trips() {
        let edges = [
            0.0f32,
            -0.0,
            1.0,
            -1.5,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x3f80_8000), // a tie, even below: stays
            f32::from_bits(0x3f81_8000), // a tie, odd below: rounds up
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0x0000_0001),
        ];
        let sweep = (0..200_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)));
        for v in edges.into_iter().chain(sweep) {
            let want = half::bf16::from_f32(v);
            let got = bf16_bits(v);
            if v.is_nan() {
                assert!(half::bf16::from_bits(got).is_nan(), "{v}");
            } else {
                assert_eq!(got, want.to_bits(), "{v} ({:#x})", v.to_bits());
            }
        }
        let values: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.0137).collect();
        let mut r = super::Ring {
            digest: 0,
            members: vec![PeerId::random(), PeerId::random()],
            me: 0,
            acc: values.clone(),
            compact: true,
            step: 0,
            next_hop: 0,
            last_progress: Instant::now(),
            predecessor_went_on: None,
            left_done: Vec::new(),
        };
        let msg = hop_message(0, 0, &mut r, 0);
        let sent = decode_values(&msg.values, true).expect("whole values");
        assert_eq!(sent.len(), r.sent_range(0).len());
        assert_eq!(&sent[..], &r.acc[r.sent_range(0)]);
        assert!(all_finite(&sent));
        assert!(!all_finite(&[1.0, f32::NAN, 2.0]));
        assert!(decode_values(&[1, 2, 3], true).is_none());
    }

    /// Nodes of one mesh, their outputs carried in order (a perfect network).
    struct Ring {
        ids: Vec<PeerId>,
        nodes: Vec<Rounds>,
        params: Vec<Vec<f32>>,
        means: Vec<Option<Vec<f32>>>,
        offences: usize,
    }

    impl Ring {
        fn new(n: usize, weights: &[f32], synced: &[bool]) -> Ring {
            Ring::with_gradients(n, weights, synced, None)
        }

        fn with_gradients(
            n: usize,
            weights: &[f32],
            synced: &[bool],
            gradients: Option<u64>,
        ) -> Ring {
            let ids: Vec<PeerId> = (0..n).map(|_| PeerId::random()).collect();
            let nodes = (0..n)
                .map(|i| {
                    Rounds::new(
                        RoundConfig {
                            steps: 5,
                            weight: weights[i],
                            gradients,
                            min_members: 1,
                            batch: 4,
                            balance: false,
                        },
                        ids[i],
                        0,
                        synced[i],
                    )
                })
                .collect();
            let params = (0..n)
                .map(|i| (0..10).map(|j| (i * 10 + j) as f32 * 0.37).collect())
                .collect();
            Ring {
                ids,
                nodes,
                params,
                means: vec![None; n],
                offences: 0,
            }
        }

        fn hear_all(&mut self, now: Instant) {
            for i in 0..self.nodes.len() {
                for j in 0..self.nodes.len() {
                    if i != j {
                        let round = self.nodes[j].status().round;
                        self.nodes[i].heard(self.ids[j], true, round, None, now);
                    }
                }
            }
        }

        /// Brings node `i` to its boundary with its parameters handed over, outputs dropped.
        fn bring_to_boundary(&mut self, i: usize, now: Instant) {
            let mut out = Vec::new();
            let step = self.nodes[i].step_limit();
            self.nodes[i].tick(step, true, now, &mut out);
            self.nodes[i].params(self.params[i].clone(), 0, now, &mut out);
        }

        /// The members' sorted list and its digest, as every node builds them.
        fn sorted(&self) -> (Vec<PeerId>, u64) {
            let mut ids = self.ids.clone();
            ids.sort();
            let digest = members_digest(&ids);
            (ids, digest)
        }

        /// Runs every node to its boundary and carries messages until none is left.
        fn run(&mut self, now: Instant, alive: &[bool]) {
            let mut queue: VecDeque<(usize, Output)> = VecDeque::new();
            for (i, _) in alive.iter().enumerate().filter(|(_, a)| **a) {
                let mut out = Vec::new();
                let step = self.nodes[i].step_limit();
                self.nodes[i].tick(step, true, now, &mut out);
                queue.extend(out.into_iter().map(|o| (i, o)));
            }
            self.carry(queue, now, alive);
        }

        /// Carries outputs (node, output) until none is left; a trainer asked for a gradient
        /// answers with its `params` vector.
        fn carry(&mut self, queue: VecDeque<(usize, Output)>, now: Instant, alive: &[bool]) {
            self.carry_until(queue, now, alive, |_| false);
        }

        /// [`Ring::carry`] until `stop` holds after an output was carried; answers what is
        /// left to carry.
        fn carry_until(
            &mut self,
            mut queue: VecDeque<(usize, Output)>,
            now: Instant,
            alive: &[bool],
            stop: impl Fn(&Ring) -> bool,
        ) -> VecDeque<(usize, Output)> {
            while let Some((i, o)) = queue.pop_front() {
                let mut out = Vec::new();
                match o {
                    Output::Trainer(TrainerCommand::TakeParams) => {
                        self.nodes[i].params(self.params[i].clone(), 0, now, &mut out)
                    }
                    Output::Trainer(TrainerCommand::TakeGradient { batch }) => {
                        self.nodes[i].gradient(self.params[i].clone(), batch, 0, now, &mut out)
                    }
                    Output::Trainer(TrainerCommand::Combine { mean, .. }) => {
                        self.means[i] = Some(mean)
                    }
                    Output::SendRing { peer, msg } => {
                        let j = self.ids.iter().position(|p| *p == peer).expect("peer");
                        if alive[j] {
                            self.nodes[j].message(self.ids[i], msg, now, &mut out);
                            queue.extend(out.drain(..).map(|o| (j, o)));
                        }
                    }
                    Output::Offence { .. } => self.offences += 1,
                    _ => {}
                }
                queue.extend(out.into_iter().map(|o| (i, o)));
                if stop(self) {
                    break;
                }
            }
            queue
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_member_ends_a_round_with_the_same_bits_of_the_weighted_mean() {
        for n in [2, 3, 4, 7] {
            let weights: Vec<f32> = (0..n).map(|i| 1.0 + i as f32).collect();
            let mut ring = Ring::new(n, &weights, &vec![true; n]);
            let now = Instant::now();
            ring.hear_all(now);
            ring.run(now, &vec![true; n]);
            let first = ring.means[0].clone().expect("a mean");
            for m in &ring.means {
                assert_eq!(bits(m.as_ref().expect("a mean")), bits(&first), "n = {n}");
            }
            // It is the weighted mean.
            let total: f32 = weights.iter().sum();
            for (j, got) in first.iter().enumerate() {
                let want: f32 = (0..n).map(|i| weights[i] * ring.params[i][j]).sum::<f32>() / total;
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
            // Each member sent 2(N-1)/N of the model (and the weight), no more.
            let per_member = ring.nodes[0].status().bytes_sent as f64;
            let model = 11.0 * 4.0;
            let optimal = 2.0 * (n as f64 - 1.0) / n as f64 * model;
            assert!(
                per_member <= optimal + 8.0 * n as f64,
                "{per_member} vs {optimal}"
            );
            assert_eq!(ring.offences, 0);
        }
    }

    /// `ddp`: round 0 sums parameters, the next ones gradients (each asked for as soon as
    /// the last round is combined, in bf16 on the wire) until the next multiple of
    /// `resync_every`; every member ends each with the same bits, the bf16-rounded mean.
    #[test]
    fn gradient_rounds_follow_a_parameter_round_and_end_identical_in_bf16() {
        for n in [2, 3] {
            gradient_rounds_of(n);
        }
    }

    #[test]
    fn a_slower_member_takes_the_batch_it_computes_while_the_fastest_computes_its_own() {
        let batch =
            |own: Option<f64>, others: &[f64]| balanced_batch(32, own, others.iter().copied());
        // Unknown, equal or within the slack: the whole batch.
        assert_eq!(batch(None, &[1.0]), 32);
        assert_eq!(batch(Some(4.0), &[4.0]), 32);
        assert_eq!(batch(Some(4.3), &[4.0]), 32);
        assert_eq!(batch(Some(4.0), &[]), 32);
        // The fastest never shrinks; the one at half speed takes half.
        assert_eq!(batch(Some(4.0), &[8.0]), 32);
        assert_eq!(batch(Some(8.0), &[4.0, 6.0]), 16);
        assert_eq!(batch(Some(6.0), &[4.0]), 21);
        // Claims that are no number are passed over; a claim of great speed costs at most
        // MAX_SHRINK, and a batch is never empty.
        assert_eq!(batch(Some(4.0), &[0.0, -1.0, f64::NAN, f64::INFINITY]), 32);
        assert_eq!(batch(Some(4.0), &[1e-9]), 32 / MAX_SHRINK);
        assert_eq!(balanced_batch(3, Some(4.0), [1e-9].into_iter()), 1);
        assert_eq!(batch(Some(f64::NAN), &[1.0]), 32);
    }

    /// With `balance`, a member that computes at half the other's speed is asked for half
    /// the batch, and its gradient weighs half: the mean is that of the samples computed.
    #[test]
    fn a_balanced_gradient_round_weighs_each_member_by_its_samples() {
        let alive = vec![true; 2];
        let mut ring = Ring::with_gradients(2, &[1.0, 1.0], &alive, Some(3));
        for node in &mut ring.nodes {
            node.cfg.balance = true;
        }
        ring.nodes[0].own_speed(Some(1.0));
        ring.nodes[1].own_speed(Some(2.0));
        let now = Instant::now();
        for (i, j, ms) in [(0, 1, 2.0), (1, 0, 1.0)] {
            let round = ring.nodes[j].status().round;
            ring.nodes[i].heard(ring.ids[j], true, round, Some(ms), now);
        }
        // Round 0 sums parameters; round 1 is the first gradient round.
        ring.run(now, &alive);
        assert!(ring.means.iter().all(Option::is_some));
        let mut queue = VecDeque::new();
        for i in 0..2 {
            let mut out = Vec::new();
            ring.means[i] = None;
            ring.nodes[i].combined(0, 1, "d0".into(), &mut out);
            queue.extend(out.into_iter().map(|o| (i, o)));
        }
        let asked: Vec<usize> = queue
            .iter()
            .filter_map(|(_, o)| match o {
                Output::Trainer(TrainerCommand::TakeGradient { batch }) => Some(*batch),
                _ => None,
            })
            .collect();
        assert_eq!(asked, vec![4, 2]);
        ring.carry(queue, now, &alive);
        let mean = ring.means[0].clone().expect("a mean");
        assert_eq!(bits(&mean), bits(ring.means[1].as_ref().expect("a mean")));
        for (j, got) in mean.iter().enumerate() {
            let want = (ring.params[0][j] + 0.5 * ring.params[1][j]) / 1.5;
            assert!(
                (got - want).abs() <= 1e-2 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
        assert_eq!(ring.nodes[1].status().batch, 2);
        assert_eq!(ring.nodes[0].status().batch, 4);
    }

    fn gradient_rounds_of(n: usize) {
        let alive = vec![true; n];
        let mut ring = Ring::with_gradients(n, &vec![1.0; n], &alive, Some(3));
        let now = Instant::now();
        ring.hear_all(now);
        ring.run(now, &alive);
        for round in 0..4u64 {
            let means: Vec<Vec<f32>> = ring
                .means
                .iter_mut()
                .map(|m| m.take().expect("mean"))
                .collect();
            let gradient = round % 3 != 0;
            for m in &means {
                assert_eq!(bits(m), bits(&means[0]), "round {round}");
            }
            for (j, got) in means[0].iter().enumerate() {
                let want: f32 = (0..n).map(|i| ring.params[i][j]).sum::<f32>() / n as f32;
                let tolerance = if gradient { 1e-2 } else { 1e-5 };
                assert!(
                    (got - want).abs() <= tolerance * want.abs().max(1.0),
                    "round {round}: {got} vs {want}"
                );
                let bf = |v: f32| half::bf16::from_f32(v).to_f32();
                if gradient && n == 2 {
                    // Two swap whole contributions, each rounded to bf16, and add them.
                    let sum = bf(ring.params[0][j]) + bf(ring.params[1][j]);
                    assert_eq!(got * 2.0, sum);
                } else if gradient {
                    // Each sum went through bf16 on its way round the ring.
                    assert_eq!(bf(got * n as f32), got * n as f32);
                }
            }
            // The trainers take the means; the next round is asked for at once, by kind.
            let mut queue = VecDeque::new();
            for i in 0..n {
                let mut out = Vec::new();
                ring.nodes[i].combined(round, round + 1, format!("d{round}"), &mut out);
                let next_is_gradient = (round + 1) % 3 != 0;
                assert!(
                    out.iter().any(|o| matches!(
                        o,
                        Output::Trainer(TrainerCommand::TakeGradient { .. }) if next_is_gradient
                    ) || matches!(
                        o,
                        Output::Trainer(TrainerCommand::TakeParams) if !next_is_gradient
                    )),
                    "after round {round}: {out:?}"
                );
                // The trainer takes no step of its own.
                assert_eq!(ring.nodes[i].step_limit(), round + 1);
                queue.extend(out.into_iter().map(|o| (i, o)));
            }
            ring.carry(queue, now, &alive);
        }
        assert_eq!(ring.offences, 0);
        // Each member sent 2(N-1)/N of the model per round: for two, one whole contribution
        // each way (the gradient rounds in bf16, half the bytes).
        let model = 11.0 * 4.0;
        let per_round = 2.0 * (n as f64 - 1.0) / n as f64 * model;
        let sent = ring.nodes[0].status().bytes_sent as f64;
        // Rounds 0 and 3 of parameters in f32, rounds 1, 2 and 4 of gradients in bf16.
        let want = 2.0 * per_round + 3.0 * per_round / 2.0;
        assert!(
            (sent - want).abs() <= 8.0 * n as f64,
            "n = {n}: {sent} vs {want}"
        );
    }

    /// With `min_members`, no round starts until that many members are ready; then it runs.
    #[test]
    fn rounds_wait_for_the_minimum_of_members() {
        let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
        for node in &mut ring.nodes {
            node.cfg.min_members = 3;
        }
        let now = Instant::now();
        // Nodes 0 and 1 know each other only.
        for (i, j) in [(0, 1), (1, 0)] {
            ring.nodes[i].heard(ring.ids[j], true, Some(0), None, now);
        }
        ring.run(now, &[true, true, false]);
        assert!(
            ring.means.iter().all(Option::is_none),
            "a round of two started"
        );
        assert_eq!(ring.nodes[0].status().ring_size, 0);
        // The third is heard: the next tick starts the round, with all three.
        ring.hear_all(now);
        let mut queue = VecDeque::new();
        for i in 0..3 {
            let mut out = Vec::new();
            let step = ring.nodes[i].step_limit();
            ring.nodes[i].tick(step, true, now, &mut out);
            queue.extend(out.into_iter().map(|o| (i, o)));
        }
        ring.carry(queue, now, &[true; 3]);
        assert!(ring.means.iter().all(Option::is_some), "{:?}", ring.means);
        assert_eq!(ring.nodes[0].status().ring_size, 3);
    }

    #[test]
    fn a_member_that_dies_aborts_the_round_and_the_retry_leaves_it_out() {
        let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
        let now = Instant::now();
        ring.hear_all(now);
        // The third never answers: the others wait, then learn it is gone.
        ring.run(now, &[true, true, false]);
        assert!(ring.means.iter().all(Option::is_none));
        let dead = ring.ids[2];
        for node in &mut ring.nodes[..2] {
            node.peer_down(dead, now);
            assert_eq!(node.status().aborted.get("member left"), Some(&1));
        }
        // After the pause the retry, without it, completes.
        let later = now + RETRY_PAUSE;
        ring.run(later, &[true, true, false]);
        let (a, b) = (ring.means[0].clone(), ring.means[1].clone());
        let a = a.expect("a mean after the retry");
        assert_eq!(bits(&a), bits(&b.expect("a mean")));
        let want: Vec<f32> = (0..10)
            .map(|j| (ring.params[0][j] + ring.params[1][j]) / 2.0)
            .collect();
        assert_eq!(bits(&a), bits(&want));
        assert_eq!(ring.nodes[0].status().ring_size, 2);
    }

    /// A member that completed the round and left at once (at `max_steps`) took nothing the
    /// others still need: they finish the attempt with the hops under way, with its mean. A
    /// member that leaves without having completed it still aborts it.
    #[test]
    fn a_member_that_leaves_after_completing_the_round_does_not_abort_it() {
        for completed in [true, false] {
            let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
            let now = Instant::now();
            ring.hear_all(now);
            let mut queue = VecDeque::new();
            for i in 0..3 {
                let mut out = Vec::new();
                let step = ring.nodes[i].step_limit();
                ring.nodes[i].tick(step, true, now, &mut out);
                queue.extend(out.into_iter().map(|o| (i, o)));
            }
            let combining = |n: &Rounds| matches!(n.stage, Stage::Combining);
            let rest = ring.carry_until(queue, now, &[true; 3], |r| r.nodes.iter().any(combining));
            let first = ring.nodes.iter().position(combining).expect("a mean");
            assert_eq!(ring.nodes.iter().filter(|n| combining(n)).count(), 1);
            let leaver = ring.ids[first];
            let their_round = if completed {
                let mut out = Vec::new();
                ring.nodes[first].combined(0, 5, String::new(), &mut out);
                ring.nodes[first].status().round
            } else {
                Some(0)
            };
            assert_eq!(their_round, Some(u64::from(completed)));
            let mut alive = [true; 3];
            alive[first] = false;
            for j in (0..3).filter(|j| *j != first) {
                ring.nodes[j].peer_leaving(leaver, their_round);
                ring.nodes[j].peer_down(leaver, now);
            }
            ring.carry(rest, now, &alive);
            let want = ring.means[first].clone().expect("the leaver's mean");
            for j in (0..3).filter(|j| *j != first) {
                let aborted = ring.nodes[j].status().aborted.get("member left").copied();
                if completed {
                    assert_eq!(aborted, None, "node {j}");
                    let got = ring.means[j].clone().expect("a mean without the leaver");
                    assert_eq!(bits(&got), bits(&want), "node {j}");
                } else {
                    assert_eq!(aborted, Some(1), "node {j}");
                    assert!(ring.means[j].is_none(), "node {j}");
                }
            }
        }
    }

    #[test]
    fn a_joiner_adopts_the_round_and_leaves_it_with_the_members_mean() {
        let mut ring = Ring::new(3, &[1.0; 3], &[true, true, false]);
        let now = Instant::now();
        assert_eq!(ring.nodes[2].step_limit(), 0, "a joiner holds at once");
        ring.hear_all(now);
        ring.run(now, &[true; 3]);
        let means: Vec<Vec<f32>> = ring
            .means
            .iter()
            .map(|m| m.clone().expect("mean"))
            .collect();
        assert_eq!(bits(&means[2]), bits(&means[0]));
        // Weight 0: its own parameters are not in the mean.
        let want: Vec<f32> = (0..10)
            .map(|j| (ring.params[0][j] + ring.params[1][j]) / 2.0)
            .collect();
        assert_eq!(bits(&means[0]), bits(&want));
        assert_eq!(ring.nodes[2].status().round, Some(0));
        ring.nodes[2].combined(0, 0, "x".into(), &mut Vec::new());
        assert!(ring.nodes[2].status().synced);
        assert_eq!(ring.nodes[2].status().round, Some(1));
        assert_eq!(ring.nodes[2].step_limit(), 5);
    }

    /// An unsynced member (here a joiner in `ddp`) holds parameters that are not the mesh's:
    /// the gradient rounds it takes part in leave no digest in its status until a parameter
    /// round syncs it, so members' digests of one round can be compared as they are.
    #[test]
    fn an_unsynced_member_claims_no_digest_until_a_parameter_round_syncs_it() {
        let mut ring = Ring::with_gradients(2, &[1.0; 2], &[true, false], Some(4));
        let node = &mut ring.nodes[1];
        node.round = Some(1);
        node.stage = Stage::Combining;
        node.combined(1, 1, "gradient".into(), &mut Vec::new());
        assert!(!node.status().synced);
        assert!(
            node.status().digests.is_empty(),
            "{:?}",
            node.status().digests
        );
        // Round 4 sums parameters: the node leaves it with the members' mean.
        node.round = Some(4);
        node.stage = Stage::Combining;
        node.combined(4, 4, "params".into(), &mut Vec::new());
        assert!(node.status().synced);
        assert_eq!(node.status().digests, vec![(4, "params".to_string())]);
    }

    #[test]
    fn a_member_the_mesh_went_on_without_takes_its_round_with_weight_zero() {
        let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
        let now = Instant::now();
        ring.hear_all(now);
        // Node 0 reaches its boundary and its attempt is aborted (a hop failed) ...
        ring.bring_to_boundary(0, now);
        ring.nodes[0].undelivered(ring.ids[1], 0, 0, now);
        assert_eq!(
            ring.nodes[0].status().aborted.get("hop undelivered"),
            Some(&1)
        );
        // ... while the mesh went on: node 1 is at round 3 and sends it its first hop.
        let (sorted, digest) = ring.sorted();
        let sender_index = sorted.iter().position(|p| *p == ring.ids[1]).expect("in");
        let len = if sender_index == 0 { 5 } else { 6 };
        let msg = RingMessage {
            step: 0,
            bf16: false,
            round: 3,
            attempt: 2,
            members: digest,
            hop: 0,
            values: ByteBuf::from(0.5f32.to_le_bytes().repeat(len)),
        };
        let mut out = Vec::new();
        ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
        let st = ring.nodes[0].status();
        assert_eq!((st.round, st.attempt, st.synced), (Some(3), 2, false));
        // It joined that attempt at once, contributing nothing of its own.
        let sent: Vec<&RingMessage> = out
            .iter()
            .filter_map(|o| match o {
                Output::SendRing { msg, .. } => Some(msg),
                _ => None,
            })
            .collect();
        assert!(!sent.is_empty(), "{out:?}");
        assert!(sent.iter().all(|m| m.round == 3 && m.attempt == 2));
        let own = sent.iter().find(|m| m.hop == 0).expect("its own first hop");
        assert!(own.values.iter().all(|b| *b == 0), "weight 0: zeros");
    }

    /// A hop of the next round (node 1's, to node 0) as the members' list makes it.
    fn next_round_hop(ring: &Ring, round: u64) -> RingMessage {
        let (sorted, digest) = ring.sorted();
        let sender_index = sorted.iter().position(|p| *p == ring.ids[1]).expect("in");
        let len = if sender_index == 0 { 5 } else { 6 };
        RingMessage {
            step: 0,
            bf16: false,
            round,
            attempt: 0,
            members: digest,
            hop: 0,
            values: ByteBuf::from(0.5f32.to_le_bytes().repeat(len)),
        }
    }

    #[test]
    fn an_attempt_without_hops_gives_way_to_a_member_already_in_the_next_round() {
        // The CI case: a third member died after node 1 had its last hop of round 0 and
        // before node 0 had its own; node 0 retried round 0 while node 1 went on to round 1.
        let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
        let now = Instant::now();
        ring.hear_all(now);
        ring.bring_to_boundary(0, now);
        assert_eq!(ring.nodes[0].status().ring_size, 2);
        let msg = next_round_hop(&ring, 1);
        let mut out = Vec::new();
        ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
        let st = ring.nodes[0].status();
        assert_eq!((st.round, st.synced), (Some(1), false), "{st:?}");
        assert!(out
            .iter()
            .any(|o| matches!(o, Output::SendRing { msg, .. } if msg.round == 1 && msg.hop == 0)));
    }

    #[test]
    fn a_last_hop_that_never_comes_gives_way_to_the_next_round_soon() {
        let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
        let now = Instant::now();
        ring.hear_all(now);
        ring.bring_to_boundary(0, now);
        // Node 0 had a hop of this attempt (so node 1 may have finished it with node 0)...
        let (sorted, digest) = ring.sorted();
        let sender_index = sorted.iter().position(|p| *p == ring.ids[1]).expect("in");
        let msg = RingMessage {
            step: 0,
            bf16: false,
            round: 0,
            attempt: 0,
            members: digest,
            hop: 0,
            values: ByteBuf::from(0.5f32.to_le_bytes().repeat(if sender_index == 0 {
                5
            } else {
                6
            })),
        };
        let mut out = Vec::new();
        ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
        // ... and a hop of the next round waits for the last hop of this one ...
        let next = next_round_hop(&ring, 1);
        ring.nodes[0].message(ring.ids[1], next, now, &mut out);
        assert_eq!(ring.nodes[0].status().round, Some(0));
        // ... but not for long.
        ring.nodes[0].tick(5, true, now + LATE_ROUND_WAIT / 2, &mut out);
        assert_eq!(ring.nodes[0].status().round, Some(0));
        let later = now + LATE_ROUND_WAIT;
        ring.nodes[0].tick(5, true, later, &mut out);
        let st = ring.nodes[0].status();
        assert_eq!(st.aborted.get("the mesh went on"), Some(&1), "{st:?}");
        ring.nodes[0].tick(5, true, later + RETRY_PAUSE, &mut out);
        let st = ring.nodes[0].status();
        assert_eq!((st.round, st.synced), (Some(1), false), "{st:?}");
    }

    #[test]
    fn a_last_hop_that_comes_after_the_next_rounds_first_still_completes_the_round() {
        let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
        let now = Instant::now();
        ring.hear_all(now);
        ring.bring_to_boundary(0, now);
        let (sorted, digest) = ring.sorted();
        let me = sorted.iter().position(|p| *p == ring.ids[0]).expect("in");
        let hop = |h: u32, chunk_of: usize| RingMessage {
            step: 0,
            bf16: false,
            round: 0,
            attempt: 0,
            members: digest,
            hop: h,
            values: ByteBuf::from(
                0.5f32
                    .to_le_bytes()
                    .repeat(if chunk_of == 0 { 5 } else { 6 }),
            ),
        };
        let mut out = Vec::new();
        // Hop 0 brings the sender's chunk (the other one's), hop 1 this node's own, summed.
        ring.nodes[0].message(ring.ids[1], hop(0, 1 - me), now, &mut out);
        let next = next_round_hop(&ring, 1);
        ring.nodes[0].message(ring.ids[1], next, now, &mut out);
        ring.nodes[0].tick(5, true, now + LATE_ROUND_WAIT / 2, &mut out);
        ring.nodes[0].message(ring.ids[1], hop(1, me), now + LATE_ROUND_WAIT / 2, &mut out);
        let st = ring.nodes[0].status();
        assert!(st.aborted.is_empty(), "{st:?}");
        assert!(
            out.iter()
                .any(|o| matches!(o, Output::Trainer(TrainerCommand::Combine { round: 0, .. }))),
            "{out:?}"
        );
    }

    #[test]
    fn hostile_hops_are_offences_and_never_reach_the_mean() {
        let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
        let now = Instant::now();
        ring.hear_all(now);
        ring.bring_to_boundary(0, now);
        let (_, digest) = ring.sorted();
        let from = ring.ids[1];
        for values in [vec![1, 2, 3], f32::NAN.to_le_bytes().repeat(5)] {
            let mut out = Vec::new();
            let msg = RingMessage {
                step: 0,
                bf16: false,
                round: 0,
                attempt: 0,
                members: digest,
                hop: 0,
                values: ByteBuf::from(values),
            };
            ring.nodes[0].message(from, msg, now, &mut out);
            assert!(
                out.iter().any(|o| matches!(o, Output::Offence { .. })),
                "{out:?}"
            );
            assert!(!out
                .iter()
                .any(|o| matches!(o, Output::Trainer(TrainerCommand::Combine { .. }))));
        }
        // A hop of the wrong size aborts the attempt.
        let mut out = Vec::new();
        let msg = RingMessage {
            step: 0,
            bf16: false,
            round: 0,
            attempt: 0,
            members: digest,
            hop: 0,
            values: ByteBuf::from(1.0f32.to_le_bytes().repeat(2)),
        };
        ring.nodes[0].message(from, msg, now, &mut out);
        assert!(out.iter().any(|o| matches!(o, Output::Offence { .. })));
        assert_eq!(
            ring.nodes[0].status().aborted.get("hop of the wrong size"),
            Some(&1)
        );
    }
}
