//! How this node takes part in rounds: what the sync config decides for them (steps
//! between rounds, gradient or parameter rounds, the members' minimum, weights, the stall
//! timeout, how hops are cut and encoded), and the few answers every member derives from it
//! alike (where training first stops, what a round sums).

use std::time::Duration;

#[cfg(doc)]
use super::{balanced_batch, pieces, Rounds, STALL_TIMEOUT};
use crate::wire::ValueEncoding;

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
    /// `diloco`: the trainer's parameters come with its round anchor and outer velocity
    /// (three parts of one length), and a parameter attempt carries all three only when a
    /// member of its ring needs them ([`Rounds::needs_state`]); otherwise the parameters
    /// alone. Every member then takes its outer step from the same anchor and velocity, so a
    /// joiner holds the members' bits from its first round on, at three times a round's
    /// bytes once, not in every round.
    pub outer_state: bool,
    /// An attempt that made no progress for this long is aborted and retried
    /// (`sync.stall_timeout_secs`, by default [`STALL_TIMEOUT`]).
    pub stall_timeout: Duration,
    /// The most any one member's weight can be: 1 where members weigh 1 or less (`allreduce`,
    /// `diloco`; a `ddp` member with a smaller batch its share; a joiner 0), so a round whose
    /// weight total exceeds the ring's size was inflated by a member, which shrinks the mean
    /// towards zero by an amount the distance judge may admit. `f32::INFINITY` in `fedavg`,
    /// whose weights are the members' sample counts, which nothing proves yet (members may
    /// train on files of their own, so not even the training set's size is shared).
    pub max_weight: f32,
    /// Bytes of values a hop's request carries at most; a larger hop travels in pieces
    /// ([`pieces`]). Every member must cut alike: the wire's [`crate::wire::RING_PIECE_BYTES`]
    /// (smaller only in tests, to cut the hops of small models).
    pub piece_bytes: usize,
    /// How a `diloco` ring that sums outer changes ([`RoundConfig::sums_outer_changes`])
    /// sends them: bf16, or int8 in blocks on a slow link (`sync.outer_values`, a sync term:
    /// members must agree).
    pub outer_values: ValueEncoding,
    /// `diloco`: steps a synced member's trainer may take past its boundary while the round
    /// it gave its parameters to runs (`sync.overlap_steps`; 0: held at the boundary). The
    /// trainer keeps those steps on top of the round's outer step, and the next boundary is
    /// `steps` after this one, as without overlap.
    pub overlap_steps: u64,
}

impl RoundConfig {
    /// The step limit a node at `step` starts with: a founder (`synced`) trains to its first
    /// boundary; a joiner, a resumed node and any node in gradient rounds hold at once.
    pub fn first_boundary(&self, step: u64, synced: bool) -> u64 {
        if synced && self.gradients.is_none() {
            step.saturating_add(self.steps.max(1))
        } else {
            step
        }
    }

    /// Whether round `round` sums gradients (else parameters).
    pub fn sums_gradients(&self, round: u64) -> bool {
        self.gradients
            .is_some_and(|k| k > 1 && !round.is_multiple_of(k))
    }

    /// Whether an attempt at round `round` with `members` members sums the members' outer
    /// changes (round start minus parameters) instead of their parameters, as
    /// [`RoundConfig::outer_values`] says: `diloco` members that share a round start (the
    /// ring carries no state, so none needs it) and are more than one. A change is a round's
    /// few steps, so bf16's 2^-8 of it (or int8's 2^-7 of its block's largest value) is far
    /// below what rounding the parameters would cost; a half (a quarter) of the bytes of
    /// `f32` parameters. Every member of a ring decides alike: the member digest names
    /// whether it carries the state.
    pub fn sums_outer_changes(&self, round: u64, carries_state: bool, members: usize) -> bool {
        self.outer_state && !carries_state && !self.sums_gradients(round) && members > 1
    }
}
