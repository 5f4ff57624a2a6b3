//! What this node's rounds counted, for status and `/metrics`: rounds completed and how long
//! they took ([`RoundTimes`]), attempts aborted by reason, ring bytes sent, members' parts
//! refused and clipped, and the digests of the parameters after recent rounds. Counts only:
//! nothing here decides anything (the one count a decision reads is whether any round
//! completed yet).

use std::collections::{BTreeMap, VecDeque};

use super::times::RoundTimes;

/// Digests of recent rounds kept in status.
const DIGESTS_KEPT: usize = 32;

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct RoundCounts {
    completed: u64,
    aborted: BTreeMap<String, u64>,
    times: RoundTimes,
    bytes_sent: u64,
    /// Members' parts refused as no honest member's (each an offence of its sender).
    parts_refused: u64,
    /// Parts that lay beyond the clipping radius of the plain mean of this node's chunks.
    parts_clipped: u64,
    /// `(round, parameters' digest, ring's member-list digest)`, the last [`DIGESTS_KEPT`].
    digests: VecDeque<(u64, String, String)>,
}

impl RoundCounts {
    /// A round's mean arrived `ms` milliseconds after this node gave its contribution.
    pub(super) fn mean_arrived(&mut self, ms: f64) {
        self.times.mean_arrived(ms);
    }

    /// The round whose mean arrived last completed, in a ring of `ring_size` members.
    pub(super) fn round_completed(&mut self, ring_size: usize) {
        self.completed += 1;
        self.times.completed(ring_size);
    }

    /// An attempt was aborted (or a leave-out or sit-out decided), for reason `why`.
    pub(super) fn aborted(&mut self, why: &str) {
        *self.aborted.entry(why.to_string()).or_default() += 1;
    }

    /// A hop of `bytes` was sent.
    pub(super) fn sent(&mut self, bytes: usize) {
        self.bytes_sent += bytes as u64;
    }

    /// A member's part was refused.
    pub(super) fn part_refused(&mut self) {
        self.parts_refused += 1;
    }

    /// An aggregate clipped `parts` parts.
    pub(super) fn clipped(&mut self, parts: usize) {
        self.parts_clipped += parts as u64;
    }

    /// The parameters after `round`, completed in the ring whose member-list digest is
    /// `ring`, digest to `digest`.
    pub(super) fn digest(&mut self, round: u64, digest: String, ring: u64) {
        if self.digests.len() >= DIGESTS_KEPT {
            self.digests.pop_front();
        }
        self.digests
            .push_back((round, digest, format!("{ring:016x}")));
    }

    /// Rounds completed.
    pub(super) fn completed(&self) -> u64 {
        self.completed
    }

    /// Attempts aborted, by reason.
    pub(super) fn aborted_by_reason(&self) -> &BTreeMap<String, u64> {
        &self.aborted
    }

    /// The rounds' durations.
    pub(super) fn times(&self) -> &RoundTimes {
        &self.times
    }

    /// Ring bytes sent.
    pub(super) fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Members' parts refused.
    pub(super) fn parts_refused(&self) -> u64 {
        self.parts_refused
    }

    /// Parts clipped.
    pub(super) fn parts_clipped(&self) -> u64 {
        self.parts_clipped
    }

    /// The recent rounds' digests, oldest first.
    pub(super) fn digests(&self) -> Vec<(u64, String, String)> {
        self.digests.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Status keeps the last [`DIGESTS_KEPT`] digests, oldest first, each naming its ring.
    #[test]
    fn the_last_digests_are_kept_with_their_rings() {
        let mut c = RoundCounts::default();
        for round in 0..40 {
            c.digest(round, format!("d{round}"), 0xab);
        }
        let kept = c.digests();
        assert_eq!(kept.len(), DIGESTS_KEPT);
        assert_eq!(
            kept[0],
            (8, "d8".to_string(), "00000000000000ab".to_string())
        );
        assert_eq!(kept[DIGESTS_KEPT - 1].0, 39);
    }
}
