//! One attempt's ring and what travels on it: which chunk each hop carries (reduce-scatter,
//! then all-gather), the hop messages (little-endian, or bf16 rounded where sent so every
//! member keeps the same bits), the member lists' digest, and a `ddp` member's balanced
//! batch. Arithmetic only: [`super::Rounds`] decides when an attempt starts, goes on or ends.

use std::time::Instant;

use libp2p::PeerId;
use serde_bytes::ByteBuf;
use sha2::{Digest, Sha256};

use super::{BALANCE_SLACK, MAX_SHRINK};
use crate::wire::RingMessage;

/// One attempt's ring under way.
#[derive(Debug)]
pub(super) struct Ring {
    pub(super) members: Vec<PeerId>,
    pub(super) digest: u64,
    pub(super) me: usize,
    /// The running sums, then the finished ones.
    pub(super) acc: Vec<f32>,
    /// They carry the members' round anchor and outer velocity besides the parameters
    /// (`diloco`, when a member needs them); the member digest says so, so that members that
    /// disagree on it abort, as with different lists.
    pub(super) carries_state: bool,
    /// Hops travel as bf16 (gradient rounds): half the bytes. Every value is rounded where
    /// it is sent, the sender's own copy included, so the members still end bit-identical.
    pub(super) compact: bool,
    /// The highest trainer step among the contributions this node has seen in the ring: at
    /// the end, the members' step, which a node that was not synced takes with the mean.
    pub(super) step: u64,
    /// The hop expected next from the predecessor.
    pub(super) next_hop: u32,
    pub(super) last_progress: Instant,
    /// When the predecessor's first hop of the next round came, while this attempt still
    /// waited for one of this round.
    pub(super) predecessor_went_on: Option<Instant>,
    /// Members that left after completing this round: a member completes a round only after
    /// it sent all its hops of it, and waits for them to be taken before it says goodbye, so
    /// the attempt still finishes without it (see [`super::Rounds::peer_leaving`]).
    pub(super) left_done: Vec<PeerId>,
}

impl Ring {
    pub(super) fn len(&self) -> usize {
        self.members.len()
    }

    pub(super) fn hops(&self) -> u32 {
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
    pub(super) fn direct(&self) -> bool {
        self.compact && self.len() == 2
    }

    /// The values sent at `hop`.
    pub(super) fn sent_range(&self, hop: u32) -> std::ops::Range<usize> {
        if self.direct() {
            0..self.acc.len()
        } else {
            self.chunk(self.sent_chunk(hop))
        }
    }

    /// The values received at `hop`.
    pub(super) fn received_range(&self, hop: u32) -> std::ops::Range<usize> {
        if self.direct() {
            0..self.acc.len()
        } else {
            self.chunk(self.received_chunk(hop))
        }
    }

    pub(super) fn successor(&self) -> PeerId {
        self.members[(self.me + 1) % self.len()]
    }

    pub(super) fn predecessor(&self) -> PeerId {
        self.members[(self.me + self.len() - 1) % self.len()]
    }

    /// The value range of chunk `c`.
    pub(super) fn chunk(&self, c: usize) -> std::ops::Range<usize> {
        let (n, total) = (self.len(), self.acc.len());
        (c * total / n)..((c + 1) * total / n)
    }

    /// The chunk sent at `hop`: reduce-scatter sends chunk `me - hop`, all-gather chunk
    /// `me + 1 - (hop - (N-1))`.
    pub(super) fn sent_chunk(&self, hop: u32) -> usize {
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
    pub(super) fn received_chunk(&self, hop: u32) -> usize {
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

/// The message of `hop`: the chunk the ring sends then, little-endian; in a compact ring
/// as bf16, rounded in place first so this node keeps exactly what the others receive.
pub(super) fn hop_message(round: u64, attempt: u32, ring: &mut Ring, hop: u32) -> RingMessage {
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

/// Digest of a sorted member list, and of whether the attempt carries the state.
pub(in crate::mesh_core) fn members_digest(members: &[PeerId], carries_state: bool) -> u64 {
    let mut h = Sha256::new();
    for m in members {
        h.update(m.to_bytes());
    }
    if carries_state {
        h.update(b"+state");
    }
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().unwrap_or_default())
}

/// `v` rounded to the nearest bf16 (ties to even), as its bits: what `half::bf16::from_f32`
/// gives, bit for bit (a NaN stays a NaN, a finite value past bf16's range becomes infinite),
/// written so that a loop of it vectorises.
#[inline(always)]
pub(super) fn bf16_bits(v: f32) -> u16 {
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
pub(super) fn decode_values(bytes: &[u8], bf16: bool) -> Option<Vec<f32>> {
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
pub(super) fn all_finite(values: &[f32]) -> bool {
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
