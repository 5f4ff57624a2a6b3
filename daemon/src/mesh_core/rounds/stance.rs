//! This node's own stance in the rounds, as its heartbeats say it: whether it sits out, and
//! until when (and over which member, whose leave-out ends it early), and the member it
//! accuses, since when and how many times in a row. `Rounds` decides when to sit out or
//! accuse; this keeps what it decided, for the heartbeats and for the next decision.

use std::time::Instant;

use libp2p::PeerId;

use super::ACCUSATION_KEPT;

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Stance {
    /// Sitting out of the rounds until then.
    sit_out_until: Option<Instant>,
    /// The member whose later round this node sits out (`Rounds::contradicted`): once it
    /// is left out, the sit-out ends.
    sitting_out_over: Option<PeerId>,
    /// The member this node last accused, when, and how many times in a row: said in its
    /// heartbeats for [`ACCUSATION_KEPT`].
    accusing: Option<(PeerId, Instant, u32)>,
}

impl Stance {
    /// Sits out until `until`; over member `over` where its leave-out is to end it.
    pub(super) fn sit_out(&mut self, until: Instant, over: Option<PeerId>) {
        self.sit_out_until = Some(until);
        self.sitting_out_over = over;
    }

    /// Whether this node sits out now: until its time is up, or until the member it sits
    /// out over is left out (`left_out` says whether a member is).
    pub(super) fn sitting_out(&self, now: Instant, left_out: impl Fn(&PeerId) -> bool) -> bool {
        self.sit_out_until.is_some_and(|t| now < t)
            && !self.sitting_out_over.is_some_and(|x| left_out(&x))
    }

    /// Accuses `x` now: how many times in a row (one more where `x` was accused within
    /// [`ACCUSATION_KEPT`], else one).
    pub(super) fn accuse(&mut self, x: PeerId, now: Instant) -> u32 {
        let times = match self.accusing {
            Some((p, at, n)) if p == x && now.saturating_duration_since(at) < ACCUSATION_KEPT => {
                n.saturating_add(1)
            }
            _ => 1,
        };
        self.accusing = Some((x, now, times));
        times
    }

    /// The member accused within [`ACCUSATION_KEPT`], and how many times in a row.
    pub(super) fn accusation(&self, now: Instant) -> Option<(PeerId, u32)> {
        self.accusing
            .filter(|(_, at, _)| now.saturating_duration_since(*at) < ACCUSATION_KEPT)
            .map(|(p, _, times)| (p, times))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Accusing one member again within [`ACCUSATION_KEPT`] counts up; another member, or
    /// the same one later, starts over; the heartbeats stop naming it once it is stale.
    #[test]
    fn accusations_count_in_a_row_and_go_stale() {
        let now = Instant::now();
        let (x, y) = (PeerId::random(), PeerId::random());
        let mut s = Stance::default();
        assert_eq!(s.accuse(x, now), 1);
        assert_eq!(s.accuse(x, now + Duration::from_secs(1)), 2);
        assert_eq!(s.accuse(y, now + Duration::from_secs(2)), 1);
        assert_eq!(s.accusation(now + Duration::from_secs(2)), Some((y, 1)));
        let later = now + Duration::from_secs(2) + ACCUSATION_KEPT;
        assert_eq!(s.accusation(later), None);
        assert_eq!(s.accuse(y, later), 1);
    }

    /// A sit-out ends at its time, or at once where the member it is over is left out.
    #[test]
    fn a_sit_out_ends_at_its_time_or_with_the_members_leave_out() {
        let now = Instant::now();
        let x = PeerId::random();
        let mut s = Stance::default();
        assert!(!s.sitting_out(now, |_| false));
        s.sit_out(now + Duration::from_secs(2), Some(x));
        assert!(s.sitting_out(now, |_| false));
        assert!(!s.sitting_out(now, |p| *p == x), "over a member left out");
        assert!(!s.sitting_out(now + Duration::from_secs(2), |_| false));
        s.sit_out(now + Duration::from_secs(2), None);
        assert!(s.sitting_out(now, |_| true));
    }
}
