//! The other members as this node counts them now: what the roster heard, less what this
//! node's lists leave out, read at one instant. It records nothing and changes nothing;
//! `Rounds` asks it who is in its next ring and what the members' word says, and acts.
//!
//! Who counts, and for what:
//! - the members of the next ring: heard ready within [`READY_FRESH`], less every member
//!   this node leaves out, for whatever reason ([`Members::in_next_ring`]);
//! - the members whose heartbeats' rounds count: heard ready, less those left out on
//!   accusations only ([`Members::not_accused`]). A member left out on accusations raced
//!   through rounds of its own; counted, its heartbeat alone said the mesh was past a
//!   member that came back from sitting out while the others still sat out. A member left
//!   out for a stall still counts: that is this node's own view of a member that may be
//!   honest;
//! - the members sitting out: heard within [`READY_FRESH`] saying they are not in rounds
//!   after they were in them, less those left out ([`Members::sitting_out`]).
//!
//! The rules that read them, each with its test below (none needs a ring):
//! 1. The mesh is past round `r` when most members whose rounds count say a later one
//!    (`the_mesh_is_past_a_round_when_most_members_say_so`).
//! 2. The round most members say is the median of their heartbeats' rounds, rounded down
//!    (`the_round_most_members_say_is_their_median`).
//! 3. A round or attempt is vouched for by two senders' hops, one sender's alone only where
//!    it is the only other member of the next ring, and never by senders left out on
//!    accusations alone (`a_round_or_attempt_is_vouched_for_by_two_members_not_one`,
//!    `a_member_left_out_on_accusations_vouches_for_nothing_alone`).

use std::collections::HashMap;
use std::time::Instant;

use libp2p::PeerId;

use super::lists::Lists;
use super::roster::Roster;
#[cfg(doc)]
use super::READY_FRESH;

/// The other members at one instant; see the module docs.
pub(super) struct Members<'a> {
    roster: &'a Roster,
    lists: &'a Lists,
    me: PeerId,
    now: Instant,
}

impl<'a> Members<'a> {
    /// The members `roster` heard, as `lists` count them at `now`, for node `me`.
    pub(super) fn new(roster: &'a Roster, lists: &'a Lists, me: PeerId, now: Instant) -> Self {
        Members {
            roster,
            lists,
            me,
            now,
        }
    }

    /// The other members heard ready within [`READY_FRESH`].
    fn ready(&self) -> impl Iterator<Item = PeerId> + 'a {
        let me = self.me;
        self.roster.fresh(self.now).filter(move |p| *p != me)
    }

    /// The members of this node's next ring, itself aside: heard ready, not left out.
    pub(super) fn in_next_ring(&self) -> impl Iterator<Item = PeerId> + 'a {
        let (lists, now) = (self.lists, self.now);
        self.ready().filter(move |p| !lists.left_out(p, now))
    }

    /// The members whose heartbeats' rounds count: heard ready, not left out on
    /// accusations.
    pub(super) fn not_accused(&self) -> impl Iterator<Item = PeerId> + 'a {
        let (lists, now) = (self.lists, self.now);
        self.ready()
            .filter(move |p| !lists.out_on_accusations(p, now))
    }

    /// Whether `peer` is left out on accusations: its word about rounds does not count.
    pub(super) fn accused(&self, peer: &PeerId) -> bool {
        self.lists.out_on_accusations(peer, self.now)
    }

    /// The members heard sitting out, not left out.
    pub(super) fn sitting_out(&self) -> Vec<PeerId> {
        self.roster
            .fresh_not_in_rounds(self.now)
            .filter(|p| *p != self.me && !self.lists.left_out(p, self.now))
            .collect()
    }

    /// Whether most of the members whose rounds count say they are past round `mine` (rule
    /// 1): then the mesh went on without this node, and its parameters are not the mesh's.
    /// One member's hop of a later round is no such proof.
    pub(super) fn say_past(&self, mine: u64) -> bool {
        let others: Vec<PeerId> = self.not_accused().collect();
        let past = others
            .iter()
            .filter(|p| self.roster.round_said(p).is_some_and(|r| r > mine))
            .count();
        past * 2 > others.len()
    }

    /// The highest round that most of the members whose rounds count say they reached (rule
    /// 2), if any says one.
    pub(super) fn round_said_by_most(&self) -> Option<u64> {
        let mut said: Vec<u64> = self
            .not_accused()
            .filter_map(|p| self.roster.round_said(&p))
            .collect();
        if said.is_empty() {
            return None;
        }
        said.sort_unstable();
        // More than half of them said this round or a later one.
        Some(said[(said.len() - 1) / 2])
    }

    /// What hops' `items` (sender, round or attempt) vouch for ([`vouched`], rule 3) among
    /// the members of the next ring. A member left out on accusations (the mesh's word that
    /// it lies about rounds) may be the second sender, never the only one: left out, a rogue
    /// raced through rounds of its own while the honest members sat out its contradiction,
    /// and each of them, hearing no other member ready as it came back, took the rogue's
    /// round on its hop alone and founded a state of its own (the honest members' loss 0.08
    /// -> 0.24 in `ring_rogue`'s `ddp` next-round test, about one run in six). A member this
    /// node left out for a stall counts as any other: that is its own view, and where each
    /// member left out another after stalls, `fedavg` under `NextAttempt` completed 161
    /// rounds of 203 in the simulator without their word.
    pub(super) fn vouch(&self, items: impl Iterator<Item = (PeerId, u64)>) -> Option<u64> {
        let (lists, now) = (self.lists, self.now);
        let items = items.map(move |(from, v)| (from, v, !lists.out_on_accusations(&from, now)));
        vouched(items, self.in_next_ring().count())
    }
}

/// The highest value (a round, an attempt) that two senders' items reach, each sender
/// counted once by its highest; one sender's alone where it is the only other member
/// (`others`, the members this node hears besides itself, is at most 1): so that no one
/// member's word moves it. Each item says whether its sender counts (is not left out on
/// accusations): a value is vouched for only where a sender that counts reaches it.
pub(super) fn vouched(
    items: impl Iterator<Item = (PeerId, u64, bool)>,
    others: usize,
) -> Option<u64> {
    let mut highest: HashMap<PeerId, (u64, bool)> = HashMap::new();
    for (from, value, counts) in items {
        let h = highest.entry(from).or_insert((value, counts));
        h.0 = h.0.max(value);
    }
    let mut values: Vec<(u64, bool)> = highest.into_values().collect();
    values.sort_unstable_by_key(|v| std::cmp::Reverse(v.0));
    let needed = others.clamp(1, 2);
    // The first value with `needed` senders at or past it, one of which counts.
    let first_counted = values.iter().position(|(_, counts)| *counts)?;
    values
        .get(first_counted.max(needed - 1))
        .map(|(value, _)| *value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Heartbeat;

    /// A roster that heard each of `rounds` from a member of its own, ready, at `now`.
    fn heard(rounds: &[Option<u64>], now: Instant) -> (Roster, Vec<PeerId>) {
        let mut roster = Roster::default();
        let peers: Vec<PeerId> = rounds.iter().map(|_| PeerId::random()).collect();
        for (p, round) in peers.iter().zip(rounds) {
            let hb = Heartbeat {
                in_rounds: true,
                round: *round,
                ..Heartbeat::default()
            };
            roster.heard(*p, &hb, false, now);
        }
        (roster, peers)
    }

    /// Rule 1: most, not one; a member left out on accusations does not count, one left out
    /// for a stall does.
    #[test]
    fn the_mesh_is_past_a_round_when_most_members_say_so() {
        let now = Instant::now();
        let me = PeerId::random();
        let (roster, peers) = heard(&[Some(9), Some(5), Some(5)], now);
        let mut lists = Lists::default();
        assert!(!Members::new(&roster, &lists, me, now).say_past(5));
        assert!(Members::new(&roster, &lists, me, now).say_past(4));
        // The two at 5 left out: on accusations, the one at 9 is most.
        lists.left_out_accused(peers[1], now);
        assert!(
            !Members::new(&roster, &lists, me, now).say_past(5),
            "one of two"
        );
        lists.left_out_accused(peers[2], now);
        assert!(Members::new(&roster, &lists, me, now).say_past(5));
        // Left out for a stall, a member still counts.
        let mut stalled = Lists::default();
        stalled.stalled(peers[1], now);
        stalled.stalled(peers[2], now);
        assert!(!Members::new(&roster, &stalled, me, now).say_past(5));
        assert_eq!(
            Members::new(&roster, &stalled, me, now)
                .in_next_ring()
                .collect::<Vec<_>>(),
            [peers[0]],
            "not in the next ring"
        );
    }

    /// Rule 2: the median, rounded down; members that said no round are not counted.
    #[test]
    fn the_round_most_members_say_is_their_median() {
        let now = Instant::now();
        let me = PeerId::random();
        let lists = Lists::default();
        let (roster, _) = heard(&[Some(7), Some(3), None, Some(12), Some(8)], now);
        assert_eq!(
            Members::new(&roster, &lists, me, now).round_said_by_most(),
            Some(7)
        );
        let (roster, _) = heard(&[None], now);
        assert_eq!(
            Members::new(&roster, &lists, me, now).round_said_by_most(),
            None
        );
        // Heard too long ago, a member says nothing.
        let (roster, _) = heard(&[Some(7)], now);
        let later = now + super::super::READY_FRESH;
        assert_eq!(
            Members::new(&roster, &lists, me, later).round_said_by_most(),
            None
        );
    }

    /// Rule 3: the highest round or attempt two senders reach, each counted once by its
    /// highest; one sender's alone only where it is the only other member heard. A rogue
    /// whose hops named the next round or attempt in every hop, and was followed each time,
    /// stopped every round (the simulator's attack matrix).
    #[test]
    fn a_round_or_attempt_is_vouched_for_by_two_members_not_one() {
        let (a, b, c) = (PeerId::random(), PeerId::random(), PeerId::random());
        assert_eq!(vouched([(a, 5, true), (a, 9, true)].into_iter(), 3), None);
        assert_eq!(
            vouched([(a, 5, true), (a, 9, true)].into_iter(), 1),
            Some(9)
        );
        assert_eq!(
            vouched([(a, 9, true), (b, 6, true), (b, 4, true)].into_iter(), 3),
            Some(6)
        );
        assert_eq!(vouched(std::iter::empty(), 0), None);
        // A sender left out (`false`) vouches only with one that counts: never alone,
        // however few members this node hears; as the second sender, for the value both
        // reach.
        assert_eq!(vouched([(a, 2249, false)].into_iter(), 0), None);
        assert_eq!(
            vouched([(a, 2249, false), (b, 892, true)].into_iter(), 0),
            Some(892)
        );
        assert_eq!(
            vouched([(a, 9, false), (b, 6, true), (c, 5, true)].into_iter(), 3),
            Some(6)
        );
        assert_eq!(
            vouched([(a, 9, false), (b, 8, false), (c, 5, true)].into_iter(), 3),
            Some(5)
        );
    }

    /// Rule 3 as `Rounds` asks it: the only other member heard vouches alone, unless it is
    /// left out on accusations.
    #[test]
    fn a_member_left_out_on_accusations_vouches_for_nothing_alone() {
        let now = Instant::now();
        let me = PeerId::random();
        let (roster, peers) = heard(&[Some(3)], now);
        let mut lists = Lists::default();
        let hops = || [(peers[0], 2249)].into_iter();
        assert_eq!(
            Members::new(&roster, &lists, me, now).vouch(hops()),
            Some(2249)
        );
        lists.left_out_accused(peers[0], now);
        assert_eq!(Members::new(&roster, &lists, me, now).vouch(hops()), None);
    }
}
