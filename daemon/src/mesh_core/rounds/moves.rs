//! Whose word may move this node on: which members' hops of a later round or attempt made it
//! give up the attempt under way, how often, and the offences each member committed since a
//! round last completed here (each good for one more move). The rule is
//! [`Moves::may_move`]; `Rounds` asks it and carries out the move.

use std::collections::{HashMap, HashSet};

use libp2p::PeerId;

use super::{ATTEMPT_MOVES, GONE_KEPT};

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Moves {
    /// Members whose hop of a later round moved this node, until a round completes here.
    rounds: HashSet<PeerId>,
    /// How many times each member's hop of a later attempt did, until a round completes
    /// here or this node aborts an attempt for a reason of its own.
    attempts: HashMap<PeerId, u32>,
    /// Offences of each member since a round last completed here (at most [`GONE_KEPT`]
    /// members).
    offence_credits: HashMap<PeerId, u32>,
}

impl Moves {
    /// Whether `from`'s hop of a later round (`to_round`) or attempt may make this node give
    /// up the attempt under way for it: once for a round, or [`ATTEMPT_MOVES`] times for
    /// attempts, for each member until a round completes here; a member that moved this
    /// node's round moves it no more; and once more for each offence of the member since
    /// then (`Rounds::may_move` says why).
    pub(super) fn may_move(&mut self, from: PeerId, to_round: bool) -> bool {
        if let Some(credit) = self.offence_credits.get_mut(&from).filter(|c| **c > 0) {
            *credit -= 1;
            return true;
        }
        let attempt_moves = self.attempts.get(&from).copied().unwrap_or(0);
        if self.rounds.contains(&from) {
            return false;
        }
        if to_round {
            if attempt_moves > 0 {
                return false;
            }
            self.rounds.insert(from);
        } else {
            if attempt_moves >= ATTEMPT_MOVES {
                return false;
            }
            self.attempts.insert(from, attempt_moves + 1);
        }
        true
    }

    /// Whether `from` has an offence credit left (a round it claims is followed at once).
    pub(super) fn has_credit(&self, from: &PeerId) -> bool {
        self.offence_credits.get(from).is_some_and(|c| *c > 0)
    }

    /// `peer` committed an offence: one more move on its word.
    pub(super) fn offended(&mut self, peer: PeerId) {
        if self.offence_credits.len() < GONE_KEPT || self.offence_credits.contains_key(&peer) {
            *self.offence_credits.entry(peer).or_default() += 1;
        }
    }

    /// `x`'s later round was contradicted: it moves this node's round no more until a round
    /// completes here.
    pub(super) fn contradicted(&mut self, x: PeerId) {
        self.rounds.insert(x);
    }

    /// This node aborted an attempt for a reason of its own: members may move its attempt
    /// once more.
    pub(super) fn own_abort(&mut self) {
        self.attempts.clear();
    }

    /// A round completed here: every member's word counts afresh.
    pub(super) fn round_completed(&mut self) {
        self.rounds.clear();
        self.attempts.clear();
        self.offence_credits.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member moves this node's round once and its attempt [`ATTEMPT_MOVES`] times until
    /// a round completes; a member that moved an attempt does not move the round; an
    /// offence buys one more move; a contradicted member moves nothing more; an abort of
    /// this node's own lets attempts move it again.
    #[test]
    fn a_members_word_moves_this_node_a_bounded_number_of_times() {
        let (a, b, c) = (PeerId::random(), PeerId::random(), PeerId::random());
        let mut m = Moves::default();
        assert!(m.may_move(a, true));
        assert!(!m.may_move(a, true), "a round once");
        assert!(!m.may_move(a, false), "nor its attempts after");
        for _ in 0..ATTEMPT_MOVES {
            assert!(m.may_move(b, false));
        }
        assert!(!m.may_move(b, false), "attempts ATTEMPT_MOVES times");
        assert!(
            !m.may_move(b, true),
            "a member that moved an attempt moves no round"
        );
        m.own_abort();
        assert!(
            m.may_move(b, false),
            "again after an abort of this node's own"
        );
        m.offended(a);
        assert!(m.has_credit(&a));
        assert!(m.may_move(a, true), "an offence buys a move");
        assert!(!m.has_credit(&a) && !m.may_move(a, true));
        m.contradicted(c);
        assert!(!m.may_move(c, true));
        m.round_completed();
        assert!(m.may_move(a, true) && m.may_move(c, true));
    }
}
