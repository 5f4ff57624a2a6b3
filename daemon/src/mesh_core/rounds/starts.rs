//! When this node may start an attempt: not before the pause after an aborted one, and,
//! while it knows no round, only once it has waited [`ADOPT_WAIT`] hearing no member say that
//! rounds are running (then it starts them itself, at round 0). Records times and answers;
//! [`super::Rounds`] starts the attempts.
//!
//! The rules, each with its test below:
//! 1. After an abort no attempt starts for [`RETRY_PAUSE`]; a started attempt or a new
//!    ring clears the pause (`an_abort_pauses_the_next_attempt`).
//! 2. A node without a round starts the rounds itself after [`ADOPT_WAIT`] of waiting with
//!    no ready member heard saying it knows the round within [`READY_FRESH`]; hearing one
//!    starts the wait again (`a_node_without_a_round_starts_them_only_when_none_runs`).

use std::time::Instant;

use super::{ADOPT_WAIT, READY_FRESH, RETRY_PAUSE};

/// The times that decide when an attempt may start.
#[derive(Debug, Default)]
pub(super) struct Starts {
    /// No attempt starts before this (an abort's pause).
    retry_at: Option<Instant>,
    /// Since when this node, ready, has waited for a round number.
    waiting_since: Option<Instant>,
    /// When a ready member last said it knows the round: then rounds are running, and a
    /// node without a round waits for their hops instead of starting its own.
    rounds_heard: Option<Instant>,
}

impl Starts {
    /// An attempt was aborted at `now`: the next waits out the pause (rule 1).
    pub(super) fn aborted(&mut self, now: Instant) {
        self.retry_at = Some(now + RETRY_PAUSE);
    }

    /// An attempt started, or a round's ring may start at once (rule 1).
    pub(super) fn unpaused(&mut self) {
        self.retry_at = None;
    }

    /// Whether the pause after an abort is over at `now` (rule 1).
    pub(super) fn may_retry(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|t| now >= t)
    }

    /// A ready member said at `now` that it knows the round (rule 2).
    pub(super) fn rounds_heard(&mut self, now: Instant) {
        self.rounds_heard = Some(now);
    }

    /// This node has a round again (it completed one, or restarts its wait): the next time
    /// it has none, its wait starts anew (rule 2).
    pub(super) fn round_known(&mut self) {
        self.waiting_since = None;
    }

    /// Whether a node that knows no round, ready at `now`, starts the rounds itself now
    /// (rule 2). Counts its wait from its first call.
    pub(super) fn adopt_due(&mut self, now: Instant) -> bool {
        let running = self
            .rounds_heard
            .is_some_and(|t| now.saturating_duration_since(t) < READY_FRESH);
        if running {
            self.waiting_since = None;
        }
        let since = *self.waiting_since.get_or_insert(now);
        !running && now.saturating_duration_since(since) >= ADOPT_WAIT
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Rule 1.
    #[test]
    fn an_abort_pauses_the_next_attempt() {
        let t = Instant::now();
        let mut s = Starts::default();
        assert!(s.may_retry(t));
        s.aborted(t);
        assert!(!s.may_retry(t + RETRY_PAUSE / 2));
        assert!(s.may_retry(t + RETRY_PAUSE));
        s.aborted(t);
        s.unpaused();
        assert!(s.may_retry(t));
    }

    /// Rule 2.
    #[test]
    fn a_node_without_a_round_starts_them_only_when_none_runs() {
        let t = Instant::now();
        let at = |d: Duration| t + d;
        let mut s = Starts::default();
        assert!(!s.adopt_due(t), "the wait starts");
        assert!(s.adopt_due(at(ADOPT_WAIT)), "nobody runs rounds");
        let mut s = Starts::default();
        s.rounds_heard(t);
        assert!(!s.adopt_due(at(ADOPT_WAIT)), "a member runs them");
        let quiet = READY_FRESH + Duration::from_millis(1);
        assert!(!s.adopt_due(at(quiet)), "the wait starts once it is stale");
        assert!(s.adopt_due(at(quiet + ADOPT_WAIT)));
        s.round_known();
        assert!(!s.adopt_due(at(quiet + ADOPT_WAIT)), "a new wait");
    }
}
