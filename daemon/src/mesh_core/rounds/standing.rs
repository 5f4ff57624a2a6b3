//! This member's standing: whether its parameters are the members' (synced), whether it is
//! founding the members' state with others, whether in `diloco` its round start and velocity
//! may not be the members' (it took a later round's number on one member's word), and how
//! many means it refused in a row. [`super::Rounds`] says what happened; this room keeps the
//! consequences in one place.
//!
//! The rules, each with its test below:
//! 1. Only a synced member that is not founding has its parameters judged against the
//!    members' and its weight in a parameter round; a founder and an unsynced member give
//!    theirs to be taken whole (`judged_only_when_synced_and_not_founding`).
//! 2. In `diloco` a member needs the members' state while unsynced, founding, or unproven;
//!    a ring that carried the state proves it (`the_state_is_needed_until_a_ring_carries_it`).
//! 3. After [`REFUSALS_BEFORE_UNSYNCED`] means refused in a row, a member gives up its
//!    parameters as the mesh's; a mean taken, a founding or a restore starts the count
//!    again (`refusals_in_a_row_unsync_a_member`).
//! 4. A member claims a digest for a round only when synced and proven: its parameters are
//!    then the members' bits (`a_digest_is_claimed_only_when_synced_and_proven`).

use super::REFUSALS_BEFORE_UNSYNCED;

/// This member's standing in the rounds.
#[derive(Debug)]
pub(super) struct Standing {
    /// Its parameters are the members' (a founder's from the start).
    synced: bool,
    /// The last parameter attempt's ring found no synced member: the one under way founds
    /// the members' state, and hands every one of them the members' step.
    founding: bool,
    /// `diloco`: it took a later round's number on one member's word, and may have missed
    /// rounds' outer steps: it asks for the members' round start and velocity until a ring
    /// carried them.
    unproven: bool,
    /// Means refused in a row.
    refused_in_a_row: u32,
}

impl Standing {
    /// A founder's standing (`synced`), or a joiner's or resumed node's.
    pub(super) fn new(synced: bool) -> Standing {
        Standing {
            synced,
            founding: false,
            unproven: false,
            refused_in_a_row: 0,
        }
    }

    /// Whether its parameters are the members'.
    pub(super) fn synced(&self) -> bool {
        self.synced
    }

    /// Whether its parameters count as the members' in a parameter round: judged against the
    /// others' and at full weight (rule 1).
    pub(super) fn judged(&self) -> bool {
        self.synced && !self.founding
    }

    /// Whether, in `diloco` (`outer_state`), it needs the members' round start and velocity
    /// (rule 2).
    pub(super) fn needs_state(&self, outer_state: bool) -> bool {
        outer_state && (!self.synced || self.founding || self.unproven)
    }

    /// Whether it claims a digest for a round it completed (rule 4).
    pub(super) fn claims_digest(&self) -> bool {
        self.synced && !self.unproven
    }

    /// It heard no ring and starts the rounds itself at round 0; in `diloco` its first ring
    /// founds one state with any others that started too.
    pub(super) fn starts_the_rounds(&mut self, outer_state: bool) {
        self.synced = true;
        self.founding = outer_state;
    }

    /// No member of its ring was synced: they found one state together (rules 1 and 3).
    pub(super) fn founds_together(&mut self) {
        self.synced = true;
        self.founding = true;
        self.refused_in_a_row = 0;
    }

    /// It adopted a round the mesh completed without it: its parameters are not the
    /// members' (rule 1).
    pub(super) fn unsynced(&mut self) {
        self.synced = false;
        self.founding = false;
    }

    /// It took a later round's number on one member's word and kept its weight; in `diloco`
    /// its state is unproven until a ring carries the members' (rule 2).
    pub(super) fn took_a_round_on_one_word(&mut self, outer_state: bool) {
        self.unproven = outer_state;
    }

    /// A parameter round left it the members' mean (and, where the ring carried it, their
    /// state): synced, no longer founding.
    pub(super) fn parameter_round_completed(&mut self) {
        self.synced = true;
        self.founding = false;
    }

    /// A ring carried the members' state to it (rule 2).
    pub(super) fn state_carried(&mut self) {
        self.unproven = false;
    }

    /// The trainer took a round's mean (rule 3).
    pub(super) fn mean_taken(&mut self) {
        self.refused_in_a_row = 0;
    }

    /// The trainer refused a round's mean (rule 3).
    pub(super) fn mean_refused(&mut self) {
        self.refused_in_a_row += 1;
        if self.refused_in_a_row >= REFUSALS_BEFORE_UNSYNCED {
            self.synced = false;
            self.refused_in_a_row = 0;
        }
    }

    /// Its parameters were replaced (a checkpoint, a downloaded state): nothing of its
    /// standing holds.
    pub(super) fn restored(&mut self) {
        *self = Standing::new(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule 1.
    #[test]
    fn judged_only_when_synced_and_not_founding() {
        let mut s = Standing::new(true);
        assert!(s.judged());
        s.founds_together();
        assert!(
            s.synced() && !s.judged(),
            "a founder's parameters are taken whole"
        );
        s.parameter_round_completed();
        assert!(s.judged());
        s.unsynced();
        assert!(!s.judged());
        assert!(!Standing::new(false).judged(), "a joiner");
    }

    /// Rule 2.
    #[test]
    fn the_state_is_needed_until_a_ring_carries_it() {
        let mut s = Standing::new(true);
        assert!(!s.needs_state(true));
        s.took_a_round_on_one_word(true);
        assert!(s.needs_state(true) && !s.needs_state(false));
        s.state_carried();
        assert!(!s.needs_state(true));
        let mut joiner = Standing::new(false);
        assert!(joiner.needs_state(true));
        joiner.starts_the_rounds(true);
        assert!(joiner.needs_state(true), "founding its first ring");
        joiner.parameter_round_completed();
        assert!(!joiner.needs_state(true));
    }

    /// Rule 3.
    #[test]
    fn refusals_in_a_row_unsync_a_member() {
        let mut s = Standing::new(true);
        for _ in 1..REFUSALS_BEFORE_UNSYNCED {
            s.mean_refused();
        }
        s.mean_taken();
        for _ in 1..REFUSALS_BEFORE_UNSYNCED {
            s.mean_refused();
        }
        assert!(s.synced(), "a taken mean started the count again");
        s.mean_refused();
        assert!(!s.synced());
        s.founds_together();
        for _ in 1..REFUSALS_BEFORE_UNSYNCED {
            s.mean_refused();
        }
        assert!(s.synced(), "founding started the count again");
    }

    /// Rule 4.
    #[test]
    fn a_digest_is_claimed_only_when_synced_and_proven() {
        let mut s = Standing::new(true);
        assert!(s.claims_digest());
        s.took_a_round_on_one_word(true);
        assert!(!s.claims_digest());
        s.state_carried();
        assert!(s.claims_digest());
        s.restored();
        assert!(!s.claims_digest());
    }
}
