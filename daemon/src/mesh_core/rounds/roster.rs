//! What the other members of the rounds said, as this node heard it: who is ready and since
//! when (a heartbeat saying so, or a hop), who said it is not in rounds, who went away, and
//! each ready member's last word (the round and step its heartbeat named, its speed, whether
//! it needs the members' state). The roster records; it decides nothing: who is in a ring,
//! left out, excused or blamed is decided by `Rounds` and `lists`, which read it.

use std::collections::HashMap;
use std::time::Instant;

use libp2p::PeerId;

use super::{remember_newest, READY_FRESH};
use crate::wire::Heartbeat;

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Roster {
    /// When each member was last heard ready (a heartbeat saying so, or a hop).
    ready: HashMap<PeerId, Instant>,
    /// Members that were in rounds (heard ready, or in this node's ring) and whose heartbeats
    /// since say they are not (sitting out), and when: members all the same, that list no
    /// peer. Joiners that were never ready are not recorded: two downloading a large state
    /// would keep a member that banned a rogue from sitting out while the others' attempts
    /// abort, until they are ready (read from the code in a review).
    not_in_rounds: HashMap<PeerId, Instant>,
    /// Ready members whose last heartbeat said they need the members' state (`diloco`), with
    /// the round it named: a word from before a round that gave them the state is stale.
    needs_state: HashMap<PeerId, Option<u64>>,
    /// Ready members' forward-backward milliseconds per sample, from their heartbeats.
    speeds: HashMap<PeerId, f64>,
    /// The round each ready member's last heartbeat named.
    rounds_said: HashMap<PeerId, u64>,
    /// The trainer step each ready member's last heartbeat named, and when it came.
    steps_said: HashMap<PeerId, (u64, Instant)>,
    /// Peers that went away (their connection closed, or a ban closed it), and when: the
    /// ones other members may still list.
    gone: HashMap<PeerId, Instant>,
    /// Members a hop could not be delivered to since they were last heard, and when: not
    /// ready, and not gone either (their connection is up).
    unreachable: HashMap<PeerId, Instant>,
}

impl Roster {
    /// Records `peer`'s heartbeat. `was_member`: it is in this node's running ring (a member
    /// that says it is not in rounds is then recorded as one that sits out, as is one heard
    /// ready before).
    pub(super) fn heard(&mut self, peer: PeerId, hb: &Heartbeat, was_member: bool, now: Instant) {
        if hb.in_rounds {
            self.ready.insert(peer, now);
            self.not_in_rounds.remove(&peer);
            self.gone.remove(&peer);
            self.unreachable.remove(&peer);
            match hb.ms_per_sample.filter(|v| v.is_finite() && *v > 0.0) {
                Some(v) => self.speeds.insert(peer, v),
                None => self.speeds.remove(&peer),
            };
            match hb.needs_state {
                true => self.needs_state.insert(peer, hb.round),
                false => self.needs_state.remove(&peer),
            };
            match hb.round {
                Some(r) => self.rounds_said.insert(peer, r),
                None => self.rounds_said.remove(&peer),
            };
            self.steps_said.insert(peer, (hb.step, now));
        } else {
            let was_in_rounds = self.ready.remove(&peer).is_some()
                || self.not_in_rounds.contains_key(&peer)
                || was_member;
            if was_in_rounds {
                self.not_in_rounds.insert(peer, now);
            }
            self.forget_word(&peer);
        }
    }

    /// A hop from `peer`: proof that it takes part in rounds now.
    pub(super) fn hop_from(&mut self, peer: PeerId, now: Instant) {
        self.ready.insert(peer, now);
        self.not_in_rounds.remove(&peer);
        self.unreachable.remove(&peer);
    }

    /// `peer` went away (its connection closed).
    pub(super) fn down(&mut self, peer: PeerId, now: Instant) {
        self.ready.remove(&peer);
        self.not_in_rounds.remove(&peer);
        self.unreachable.remove(&peer);
        remember_newest(&mut self.gone, peer, now);
        self.forget_word(&peer);
    }

    /// A hop to `peer` could not be delivered: it is not ready until heard again.
    pub(super) fn unreachable(&mut self, peer: PeerId, now: Instant) {
        self.ready.remove(&peer);
        remember_newest(&mut self.unreachable, peer, now);
    }

    /// Whether a member a hop could not be delivered to is neither heard again nor gone.
    pub(super) fn any_unreachable(&self) -> bool {
        !self.unreachable.is_empty()
    }

    /// Forgets what a member's heartbeats said of itself.
    fn forget_word(&mut self, peer: &PeerId) {
        self.steps_said.remove(peer);
        self.speeds.remove(peer);
        self.needs_state.remove(peer);
        self.rounds_said.remove(peer);
    }

    /// A member unheard for long (hung, or gone without a word) no longer sizes batches.
    pub(super) fn forget_stale_speeds(&mut self, now: Instant) {
        let ready = &self.ready;
        self.speeds.retain(|peer, _| {
            ready
                .get(peer)
                .is_some_and(|at| now.saturating_duration_since(*at) < READY_FRESH)
        });
    }

    /// Whether `peer` was ever heard ready and not heard otherwise since.
    pub(super) fn is_ready(&self, peer: &PeerId) -> bool {
        self.ready.contains_key(peer)
    }

    /// Whether `peer` was heard ready within [`READY_FRESH`].
    pub(super) fn is_fresh(&self, peer: &PeerId, now: Instant) -> bool {
        self.ready
            .get(peer)
            .is_some_and(|at| now.saturating_duration_since(*at) < READY_FRESH)
    }

    /// The members heard ready within [`READY_FRESH`], in no particular order.
    pub(super) fn fresh(&self, now: Instant) -> impl Iterator<Item = PeerId> + '_ {
        self.ready
            .iter()
            .filter(move |(_, at)| now.saturating_duration_since(**at) < READY_FRESH)
            .map(|(p, _)| *p)
    }

    /// Every member ever heard ready (and not heard otherwise since), fresh or not.
    pub(super) fn ever_ready(&self) -> impl Iterator<Item = &PeerId> {
        self.ready.keys()
    }

    /// The members heard within [`READY_FRESH`] saying they are not in rounds.
    pub(super) fn fresh_not_in_rounds(&self, now: Instant) -> impl Iterator<Item = PeerId> + '_ {
        self.not_in_rounds
            .iter()
            .filter(move |(_, at)| now.saturating_duration_since(**at) < READY_FRESH)
            .map(|(p, _)| *p)
    }

    /// The peers that went away (the most recent [`super::GONE_KEPT`]).
    pub(super) fn gone(&self) -> impl Iterator<Item = &PeerId> {
        self.gone.keys()
    }

    /// The round `peer`'s last heartbeat named.
    pub(super) fn round_said(&self, peer: &PeerId) -> Option<u64> {
        self.rounds_said.get(peer).copied()
    }

    /// The step `peer`'s last heartbeat named, and when it came.
    pub(super) fn step_said(&self, peer: &PeerId) -> Option<(u64, Instant)> {
        self.steps_said.get(peer).copied()
    }

    /// The ready members' speeds (milliseconds per sample).
    pub(super) fn speeds(&self) -> impl Iterator<Item = f64> + '_ {
        self.speeds.values().copied()
    }

    /// Whether `peer` said it needs the members' state for round `round` or later (or named
    /// no round).
    pub(super) fn needs_state_for(&self, peer: &PeerId, round: u64) -> bool {
        self.needs_state
            .get(peer)
            .is_some_and(|said| said.is_none_or(|r| r >= round))
    }

    /// A ring carried the members' state at `round`: a need said before it is met.
    pub(super) fn state_carried(&mut self, round: u64) {
        self.needs_state
            .retain(|_, said| said.is_some_and(|r| r > round));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn word(in_rounds: bool, round: Option<u64>, step: u64) -> Heartbeat {
        Heartbeat {
            in_rounds,
            round,
            step,
            ..Heartbeat::default()
        }
    }

    /// A ready member's word is kept until it says it is not in rounds or goes away; then
    /// it counts as one that sits out (it was ready) or as gone, and its word is forgotten.
    #[test]
    fn a_members_word_lasts_until_it_sits_out_or_goes() {
        let now = Instant::now();
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut r = Roster::default();
        r.heard(a, &word(true, Some(7), 140), false, now);
        assert!(r.is_fresh(&a, now) && r.round_said(&a) == Some(7));
        assert_eq!(r.step_said(&a), Some((140, now)));
        assert!(
            !r.is_fresh(&a, now + READY_FRESH),
            "stale after READY_FRESH"
        );
        r.heard(a, &word(false, Some(7), 141), false, now);
        assert!(!r.is_ready(&a) && r.round_said(&a).is_none());
        assert_eq!(r.fresh_not_in_rounds(now).collect::<Vec<_>>(), [a]);
        // A peer never heard ready that says it is not in rounds is no member sitting out.
        r.heard(b, &word(false, None, 0), false, now);
        assert_eq!(r.fresh_not_in_rounds(now).count(), 1);
        r.heard(
            a,
            &word(true, Some(8), 160),
            false,
            now + Duration::from_secs(1),
        );
        assert_eq!(r.fresh_not_in_rounds(now).count(), 0);
        r.down(a, now);
        assert!(!r.is_ready(&a) && r.step_said(&a).is_none());
        assert_eq!(r.gone().collect::<Vec<_>>(), [&a]);
    }

    /// A need for the members' state said at round 5 is met by a ring that carried it at
    /// round 5 or later, and not by one before.
    #[test]
    fn a_need_for_the_state_is_met_by_a_ring_that_carried_it() {
        let now = Instant::now();
        let a = PeerId::random();
        let mut r = Roster::default();
        let needs = Heartbeat {
            needs_state: true,
            ..word(true, Some(5), 0)
        };
        r.heard(a, &needs, false, now);
        assert!(r.needs_state_for(&a, 5) && !r.needs_state_for(&a, 6));
        r.state_carried(4);
        assert!(r.needs_state_for(&a, 5), "a ring before its word");
        r.state_carried(5);
        assert!(!r.needs_state_for(&a, 5));
    }
}
