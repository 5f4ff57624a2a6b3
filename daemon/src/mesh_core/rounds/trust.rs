//! Whom this member excuses and whom it blames: the stalls of this round it forgave each
//! member, and the peers whose hops it found no honest member sends. It decides from what it
//! is told; [`super::Rounds`] reads the ring and the roster, asks it, and acts (a staller left
//! out through [`super::lists`], a sit-out over a peer it lost and blamed).
//!
//! The rules, each with its test below (none needs a ring):
//! 1. A stall leaves a member out when it showed it is at the boundary, or when it was
//!    already excused [`STALL_EXCUSES`] times this round; otherwise it is excused once more
//!    (`a_staller_is_excused_twice_a_round_then_left_out`).
//! 2. Excuses count per round: a stall of a later round starts the count again, and a
//!    completed round, a member gone or a member left out forgets them
//!    (`excuses_count_per_round_and_are_forgotten`).
//! 3. Blame is kept with when it fell, for at most [`super::GONE_KEPT`] peers: the oldest is
//!    forgotten first, so a flood of blamed identities cannot grow it
//!    (`blame_keeps_the_newest_peers`).

use std::collections::HashMap;
use std::time::Instant;

use libp2p::PeerId;

use super::{remember_newest, STALL_EXCUSES};

/// Excuses and blame, by peer.
#[derive(Debug, Default)]
pub(super) struct Trust {
    /// Stalls of a round each member was excused for, with the round.
    excused: HashMap<PeerId, (u64, u32)>,
    /// Peers whose hops this node found no honest member sends, and when: its own proof, as
    /// behind a ban.
    blamed: HashMap<PeerId, Instant>,
}

impl Trust {
    /// Whether a stall of `round` waiting for `peer` leaves it out now (rule 1).
    pub(super) fn stall_leaves_out(&self, peer: &PeerId, at_boundary: bool, round: u64) -> bool {
        at_boundary
            || self
                .excused
                .get(peer)
                .is_some_and(|(r, times)| *r == round && *times >= STALL_EXCUSES)
    }

    /// Excuses one more stall of `round` waiting for `peer` (rules 1 and 2).
    pub(super) fn excuse(&mut self, peer: PeerId, round: u64) {
        let excused = self.excused.entry(peer).or_insert((round, 0));
        if excused.0 != round {
            *excused = (round, 0);
        }
        excused.1 += 1;
    }

    /// Forgets `peer`'s excuses: it went away, or was left out (rule 2).
    pub(super) fn forgive(&mut self, peer: &PeerId) {
        self.excused.remove(peer);
    }

    /// A round completed: every excuse is forgotten (rule 2).
    pub(super) fn round_completed(&mut self) {
        self.excused.clear();
    }

    /// This node found a hop of `peer` no honest member sends, at `now` (rule 3).
    pub(super) fn blame(&mut self, peer: PeerId, now: Instant) {
        remember_newest(&mut self.blamed, peer, now);
    }

    /// Whether this node blamed `peer`.
    pub(super) fn blamed(&self, peer: &PeerId) -> bool {
        self.blamed.contains_key(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::super::GONE_KEPT;
    use super::*;
    use std::time::Duration;

    /// Rule 1: excused [`STALL_EXCUSES`] times in a round, left out at the next stall; at
    /// once when it showed it is at the boundary.
    #[test]
    fn a_staller_is_excused_twice_a_round_then_left_out() {
        let mut t = Trust::default();
        let peer = PeerId::random();
        for _ in 0..STALL_EXCUSES {
            assert!(!t.stall_leaves_out(&peer, false, 7));
            t.excuse(peer, 7);
        }
        assert!(t.stall_leaves_out(&peer, false, 7));
        assert!(
            Trust::default().stall_leaves_out(&peer, true, 7),
            "at the boundary"
        );
    }

    /// Rule 2: a later round's stall counts from nothing; a completed round, or forgiving the
    /// peer, forgets its excuses.
    #[test]
    fn excuses_count_per_round_and_are_forgotten() {
        let mut t = Trust::default();
        let peer = PeerId::random();
        for _ in 0..STALL_EXCUSES {
            t.excuse(peer, 7);
        }
        assert!(t.stall_leaves_out(&peer, false, 7));
        assert!(!t.stall_leaves_out(&peer, false, 8), "a later round");
        t.excuse(peer, 8);
        assert!(
            !t.stall_leaves_out(&peer, false, 8),
            "one excuse of round 8"
        );
        for forgive_the_peer in [false, true] {
            for _ in 0..STALL_EXCUSES {
                t.excuse(peer, 8);
            }
            assert!(t.stall_leaves_out(&peer, false, 8));
            if forgive_the_peer {
                t.forgive(&peer);
            } else {
                t.round_completed();
            }
            assert!(!t.stall_leaves_out(&peer, false, 8), "forgotten");
        }
    }

    /// Rule 3: blame stays for [`GONE_KEPT`] peers; one more forgets the oldest, and blaming a
    /// peer again renews its time.
    #[test]
    fn blame_keeps_the_newest_peers() {
        let mut t = Trust::default();
        let start = Instant::now();
        let peers: Vec<PeerId> = (0..=GONE_KEPT).map(|_| PeerId::random()).collect();
        for (i, p) in peers.iter().take(GONE_KEPT).enumerate() {
            t.blame(*p, start + Duration::from_millis(i as u64));
        }
        t.blame(peers[0], start + Duration::from_secs(10));
        t.blame(peers[GONE_KEPT], start + Duration::from_secs(11));
        assert!(t.blamed(&peers[0]), "renewed");
        assert!(!t.blamed(&peers[1]), "the oldest forgotten");
        assert!(peers[2..].iter().all(|p| t.blamed(p)));
    }
}
