//! How long this node's rounds took: the last one, the mean over rounds in rings of two or
//! more (what a round costs here), and a histogram of every completed round that `/metrics`
//! serves, so a round counter and its histogram's count always agree.

use crate::mesh_core::status::RoundSeconds;

/// The rounds' durations, each from this node's contribution to the mean it received.
#[derive(Debug, Clone, Default)]
pub(crate) struct RoundTimes {
    /// The last round's milliseconds, set when its mean arrives.
    last_ms: f64,
    /// Milliseconds summed over completed rounds in rings of two or more, and their count.
    in_rings: (f64, u64),
    /// Every completed round's seconds.
    histogram: RoundSeconds,
}

impl RoundTimes {
    /// A round's mean arrived `ms` milliseconds after this node gave its contribution.
    pub(crate) fn mean_arrived(&mut self, ms: f64) {
        self.last_ms = ms;
    }

    /// The round whose mean arrived last completed, in a ring of `ring_size` members.
    pub(crate) fn completed(&mut self, ring_size: usize) {
        if ring_size > 1 {
            self.in_rings.0 += self.last_ms;
            self.in_rings.1 += 1;
        }
        self.histogram.observe(self.last_ms / 1e3);
    }

    /// The last round's milliseconds (0 before the first).
    pub(crate) fn last_ms(&self) -> f64 {
        self.last_ms
    }

    /// The mean milliseconds of completed rounds in rings of two or more (0 before one).
    pub(crate) fn mean_ms(&self) -> f64 {
        match self.in_rings {
            (_, 0) => 0.0,
            (sum, n) => sum / n as f64,
        }
    }

    /// Every completed round's seconds.
    pub(crate) fn histogram(&self) -> &RoundSeconds {
        &self.histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_completed_round_is_counted_and_only_rings_make_the_mean() {
        let mut t = RoundTimes::default();
        assert_eq!((t.mean_ms(), t.histogram().count), (0.0, 0));
        t.mean_arrived(40.0);
        t.completed(1);
        t.mean_arrived(300.0);
        t.completed(2);
        t.mean_arrived(100.0);
        t.completed(3);
        assert_eq!(t.last_ms(), 100.0);
        assert_eq!(t.mean_ms(), 200.0);
        let h = t.histogram();
        assert_eq!(h.count, 3);
        assert!((h.sum - 0.44).abs() < 1e-12, "{}", h.sum);
        // 0.04 s in the 0.05 bucket, 0.1 in the 0.1 one, 0.3 in the 0.5 one.
        let buckets = h.buckets();
        let at = |bound: f64| buckets.iter().find(|(b, _)| *b == bound).map(|(_, n)| *n);
        assert_eq!(
            (at(0.05), at(0.1), at(0.5), at(1.0)),
            (Some(1), Some(1), Some(1), Some(0))
        );
        assert_eq!(buckets.iter().map(|(_, n)| n).sum::<u64>(), 3);
        assert_eq!(buckets.last().map(|(b, _)| *b), Some(f64::INFINITY));
    }
}
