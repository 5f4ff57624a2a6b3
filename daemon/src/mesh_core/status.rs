//! What the mesh core reports: counters of updates and syncs, peers' heartbeats, the latest
//! sync. The core keeps one [`MeshStatus`] current as it decides; the mesh actor copies it out
//! for the control API, so no field is maintained anywhere else.

use std::collections::BTreeMap;

use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use crate::wire::Heartbeat;

/// A neighbour sync, as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncInfo {
    /// The neighbour.
    pub peer: String,
    /// Our step when it happened.
    pub step: u64,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// Counters of updates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateCounters {
    /// Own updates published.
    pub sent: u64,
    /// Neighbours' updates received.
    pub received: u64,
    /// Of those, applied to the model.
    pub applied: u64,
    /// Of those, rejected: proof of breakage or hostility (malformed, other run or layout,
    /// another sender, non-finite, oversized or outlier norm). Each costs the author score.
    pub rejected: u64,
    /// Accepted although older than the author's newest (gossip reordered them); applied
    /// with the sync policy's staleness discount.
    #[serde(default)]
    pub late: u64,
    /// Dropped without blame: a step the author already delivered.
    #[serde(default)]
    pub duplicates: u64,
    /// Dropped without blame: older than every step still remembered for its author (gossip
    /// delivered it very late; it cannot be told from a replay).
    #[serde(default)]
    pub too_old: u64,
    /// Accepted, but scaled down to the outlier bound: beyond a multiple of the median of
    /// recent updates, yet not far enough beyond to prove hostility.
    #[serde(default)]
    pub scaled_down: u64,
    /// Accepted, but scaled down to what their author's budget had left: it sent more, all
    /// together, than this node's own updates allow a neighbour (an honest box faster than
    /// this one, or a neighbour pushing one way).
    #[serde(default)]
    pub over_budget: u64,
    /// Of the rejected, those whose norm was an outlier against recent updates, or beyond
    /// the outlier bound once too often in a row.
    #[serde(default)]
    pub outliers: u64,
    /// Dropped unread because their author sent faster than the per-peer limit.
    #[serde(default)]
    pub rate_limited: u64,
    /// Median norm of recently accepted updates: the outlier bound is a multiple of it.
    #[serde(default)]
    pub median_norm: Option<f64>,
    /// Values of accepted updates clamped by `sync.clip_value`.
    #[serde(default)]
    pub clipped_values: u64,
}

/// Counters of full neighbour syncs, as status shows them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FullSyncCounters {
    /// Replies judged and averaged.
    pub accepted: u64,
    /// Replies refused (wrong layout or answer, not finite, beyond the bound); each lowers
    /// the neighbour's score.
    pub refused: u64,
    /// Syncs that got no reply to judge (timeout, no connection, or the neighbour declined):
    /// not the neighbour's fault, not punished.
    pub failed: u64,
    /// The distance bound a reply must meet now (see [`crate::sync_guard`]).
    pub bound: f64,
    /// The largest distance accepted since start: what `sync.max_sync_distance` must leave
    /// room for.
    pub largest_accepted: Option<f64>,
    /// The latest refusal.
    pub last_refusal: Option<SyncRefusalInfo>,
    /// Bytes of neighbours' parameters received for syncs (the messages' payloads).
    #[serde(default)]
    pub bytes_received: u64,
    /// Seconds the latest accepted sync took, from asking to averaged.
    #[serde(default)]
    pub last_secs: Option<f64>,
    /// Seconds all accepted syncs took together (with `accepted`, the mean latency).
    #[serde(default)]
    pub secs_total: f64,
}

/// A refused full sync, as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncRefusalInfo {
    /// The neighbour.
    pub peer: String,
    /// Why, in words.
    pub reason: String,
    /// Its relative distance, when one was measured.
    pub distance: Option<f64>,
    /// The bound in force.
    pub bound: f64,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// The mesh's part of the status report.
#[derive(Debug, Clone, Default)]
pub struct MeshStatus {
    /// Current neighbours.
    pub neighbours: Vec<String>,
    /// Update counters (`applied` is filled from the trainer's count).
    pub updates: UpdateCounters,
    /// Rejected updates by author.
    pub rejected_by_peer: BTreeMap<String, u64>,
    /// The latest rejection, "author: why", so an operator (or a failing test) sees the
    /// reason without the node's log.
    pub last_rejection: Option<String>,
    /// The latest neighbour sync.
    pub last_sync: Option<SyncInfo>,
    /// Relative L2 distance to the last synced neighbour, measured before averaging.
    pub consensus_distance: Option<f64>,
    /// Full syncs judged, refused and failed.
    pub full_syncs: FullSyncCounters,
    /// Refused full-sync replies by neighbour.
    pub sync_refusals: BTreeMap<String, u64>,
    /// Latest heartbeat of each peer.
    pub progress: BTreeMap<String, Heartbeat>,
    /// Member peers connected now.
    pub members: Vec<PeerId>,
    /// L2 norm of what error feedback still owes the mesh, after the last update.
    pub residual_norm: f64,
    /// Bytes of the own update messages published (our framing, before gossipsub's), once
    /// per update.
    pub payload_bytes_sent: u64,
    /// Neighbours' updates the sync policy dropped as too stale (`sync.drop_after`).
    pub dropped_stale: u64,
    /// How many steps this node is ahead of its slowest live neighbour, when SSP knows one.
    pub lead_over_slowest: Option<u64>,
    /// Synchronous rounds, in the sync modes that have them.
    pub rounds: Option<RoundStatus>,
    /// Peers' bulk requests declined over their share of this node's service (set by the
    /// mesh actor, which serves them: [`crate::serving`]).
    pub requests_declined: u64,
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
    /// where it is slower than another member (`rounds::balanced_batch`); 0 before its first
    /// gradient round.
    #[serde(default)]
    pub batch: usize,
    /// Mean of the same over every round this node completed in a ring of two or more: what
    /// a round costs here, waits for slower members included.
    #[serde(default)]
    pub mean_round_ms: f64,
    /// Bytes of ring hops this node sent.
    pub bytes_sent: u64,
    /// Members' parts of this node's chunks refused as no honest member's (a weight past what
    /// a member weighs, or a part beyond the bound the round's mean is judged by): each an
    /// offence of its sender, and the round went on without it.
    #[serde(default)]
    pub parts_refused: u64,
    /// Parts beyond the clipping radius of the plain mean of this node's chunks: then the
    /// chunk's aggregate was CenteredClip's, not the plain mean (0 in an honest mesh, as a
    /// rule; see `rounds::robust`).
    #[serde(default)]
    pub parts_clipped: u64,
    /// The step of the next boundary.
    pub boundary: u64,
    /// Whether this node's parameters come from a completed round (a joiner's do not, and it
    /// contributes with weight 0 until they do).
    pub synced: bool,
    /// Members this node leaves out of its rounds now (most others left them out, or an
    /// attempt stalled waiting for them: `rounds::lists`), peer ids.
    #[serde(default)]
    pub left_out: Vec<String>,
    /// Whether this node sits out of the rounds now (most members list a peer it lost and
    /// blamed: `rounds::lists`).
    #[serde(default)]
    pub sitting_out: bool,
    /// Digest of the parameters after recent rounds (`round`, first 8 bytes of SHA-256 of the
    /// little-endian values, hex; then the ring's member-list digest, hex), kept only for
    /// rounds after which this node was synced, in a ring of two or more: two members'
    /// digests of one round and one ring are equal exactly when their parameters are.
    pub digests: Vec<(u64, String, String)>,
    /// How long each completed round took, as a histogram (its count is `completed`).
    #[serde(default)]
    pub round_seconds: RoundSeconds,
}

/// Upper bounds, in seconds, of [`RoundSeconds`]' buckets; one more bucket holds the rest. A
/// `ddp` round on loopback takes tens of milliseconds, a DiLoCo round over a slow link
/// minutes.
pub const ROUND_SECONDS_BOUNDS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

/// A histogram of round durations in seconds, over [`ROUND_SECONDS_BOUNDS`]: what `/metrics`
/// serves as `p2ptrain_round_duration_seconds`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundSeconds {
    /// Rounds per bucket, not cumulative: one count per bound, then one for the rest (empty
    /// before the first round).
    pub counts: Vec<u64>,
    /// The seconds of every round, summed.
    pub sum: f64,
    /// Rounds counted.
    pub count: u64,
}

impl RoundSeconds {
    /// Counts a round of `secs` seconds (one that is not a number counts beyond the last
    /// bound, adding nothing to the sum).
    pub fn observe(&mut self, secs: f64) {
        if self.counts.len() != ROUND_SECONDS_BOUNDS.len() + 1 {
            self.counts = vec![0; ROUND_SECONDS_BOUNDS.len() + 1];
        }
        let bucket = ROUND_SECONDS_BOUNDS
            .iter()
            .position(|&bound| secs <= bound)
            .unwrap_or(ROUND_SECONDS_BOUNDS.len());
        self.counts[bucket] += 1;
        if secs.is_finite() {
            self.sum += secs;
        }
        self.count += 1;
    }

    /// Each bucket's upper bound (the last one infinite) and its rounds, not cumulative.
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        ROUND_SECONDS_BOUNDS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .enumerate()
            .map(|(i, bound)| (bound, self.counts.get(i).copied().unwrap_or(0)))
            .collect()
    }
}
