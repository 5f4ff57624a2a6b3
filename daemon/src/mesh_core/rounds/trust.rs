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
//! 4. A stall suspects the members whose parts it waited for, or, where every part came, the
//!    one owner whose aggregate is missing, if only one is; a suspect shows it is at the
//!    boundary when a heartbeat since the attempt started names this round and a step it
//!    cannot reach while training towards it, or when it sent a hop of a later attempt or
//!    round ([`stall_suspects`]: `a_stall_suspects_the_parts_withheld_or_one_missing_aggregate`,
//!    `a_suspect_shows_it_is_at_the_boundary_by_its_heartbeat_or_a_later_hop`).
//! 5. A stall that would leave out every other member heard, two or more, shows this node is
//!    the one out of step ([`Trust::out_of_step`]: `a_node_that_would_leave_out_every_member_is_out_of_step`).
//! 6. A suspect left out is also accused when it alone withheld its part and its heartbeat
//!    names this round ([`withheld_alone`]: `a_member_that_alone_withheld_its_part_in_this_round_is_accused`).

use std::collections::HashMap;
use std::time::Instant;

use libp2p::PeerId;

use super::roster::Roster;
use super::{remember_newest, STALL_EXCUSES};

/// A stalled attempt as the trust judges it: what `Rounds` read off its ring and inbox.
#[derive(Debug)]
pub(super) struct Stall {
    /// This node's round (`None`: it has none yet).
    pub(super) round: Option<u64>,
    /// The step where this node's training stopped for the round.
    pub(super) boundary: u64,
    /// Whether the round sums gradients: every member is then held at its step, so a step
    /// shows nothing.
    pub(super) gradient: bool,
    /// When the attempt started: a heartbeat heard since says where its member is now.
    pub(super) started: Instant,
    /// The members whose hops it still waited for.
    pub(super) awaited: Vec<Awaited>,
}

/// One member a stalled attempt waited for.
#[derive(Debug)]
pub(super) struct Awaited {
    pub(super) peer: PeerId,
    /// Its part of this node's chunk had not come (else only its aggregate).
    pub(super) part_missing: bool,
    /// The step its heartbeat named when the attempt started.
    pub(super) step_at_start: Option<u64>,
    /// A hop of it naming a later attempt of this round, or a later round, waits in this
    /// node's inbox: it is not training towards the boundary, it went on.
    pub(super) went_ahead: bool,
}

/// The members `stall` waited for that it suspects, each with whether it showed it is at
/// the boundary (rule 4). Those it waited for a part from, if any (an honest member sends
/// its parts to the members of its list at once); otherwise the one owner whose aggregate is
/// missing, if only one is: an owner may itself wait for a part a rogue withheld from it
/// alone, and blaming every owner missing would let that rogue make a member leave out the
/// others. A member shows it is at the boundary when a heartbeat since the attempt started
/// names this node's round, and the step it named then or a step past this node's
/// boundary, where no honest member of the round is. (In a gradient round every member is
/// held at its step, so that shows nothing; a member whose heartbeat names a later round
/// went on with the mesh, and this node is the one behind: it is excused, as the mesh's
/// next hops take this node on.) A member whose hop of a later attempt or round this node
/// did not follow is at the boundary, in any round.
pub(super) fn stall_suspects(stall: &Stall, roster: &Roster) -> Vec<(PeerId, bool)> {
    let parts: Vec<&Awaited> = stall.awaited.iter().filter(|a| a.part_missing).collect();
    let suspects = match parts.len() {
        0 if stall.awaited.len() == 1 => vec![&stall.awaited[0]],
        0 => Vec::new(),
        _ => parts,
    };
    suspects
        .into_iter()
        .map(|a| {
            let at_boundary = (!stall.gradient
                && roster.round_said(&a.peer) == stall.round
                && match (a.step_at_start, roster.step_said(&a.peer)) {
                    (Some(then), Some((step, heard))) => {
                        heard > stall.started && (step <= then || step > stall.boundary)
                    }
                    _ => false,
                })
                || a.went_ahead;
            (a.peer, at_boundary)
        })
        .collect()
}

/// Whether a stall's left-out suspect `peer` is also accused (rule 6): it alone withheld
/// its part from this node while its heartbeats say it is in this node's round. Others may
/// have theirs (a rogue that names the next round to this node alone, or sends nothing to
/// it), and their own attempts stall on this node's missing aggregate instead, where they
/// blame no one. A member whose heartbeats name a later round finished this one (this node
/// missed an aggregate): accused, an honest member that went on first was left out by all
/// the others, and the rounds of the rest raced thousands apart (`ring_rogue`'s
/// `next_attempt`).
pub(super) fn withheld_alone(stall: &Stall, roster: &Roster, peer: &PeerId) -> bool {
    let mut withheld = stall.awaited.iter().filter(|a| a.part_missing);
    withheld.next().is_some_and(|a| a.peer == *peer)
        && withheld.next().is_none()
        && roster.round_said(peer) == stall.round
}

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

    /// Whether leaving out a stall's `suspects` ([`stall_suspects`]) of `round` now
    /// would leave this node with none of the other members it hears (`heard`, less those
    /// it leaves out), two or more (rule 5): then it is the one out of step, not they.
    /// (Leaving them all out, an honest member that completed an attempt the others gave up
    /// for a rogue's next one went on alone: its parameters and theirs stayed apart until
    /// the leave-outs ended, and its lone rounds and theirs took each other's numbers,
    /// thousands apart: `ring_rogue`'s `allreduce` next-attempt test, one group run in
    /// three.)
    pub(super) fn out_of_step(
        &self,
        heard: &[PeerId],
        suspects: &[(PeerId, bool)],
        round: u64,
    ) -> bool {
        heard.len() >= 2
            && heard.iter().all(|p| {
                suspects
                    .iter()
                    .any(|(s, at_boundary)| s == p && self.stall_leaves_out(s, *at_boundary, round))
            })
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
    use crate::wire::Heartbeat;
    use std::time::Duration;

    /// `peer`'s heartbeat, in rounds at `round` and `step`, heard at `at`.
    fn said(roster: &mut Roster, peer: PeerId, round: u64, step: u64, at: Instant) {
        let hb = Heartbeat {
            in_rounds: true,
            round: Some(round),
            step,
            ..Heartbeat::default()
        };
        roster.heard(peer, &hb, false, at);
    }

    /// A stall of round 4, boundary step 100, started at `started`, that waited for
    /// `awaited` (peer, part missing, step said at the start, went ahead).
    fn stall(started: Instant, awaited: &[(PeerId, bool, Option<u64>, bool)]) -> Stall {
        Stall {
            round: Some(4),
            boundary: 100,
            gradient: false,
            started,
            awaited: awaited
                .iter()
                .map(|&(peer, part_missing, step_at_start, went_ahead)| Awaited {
                    peer,
                    part_missing,
                    step_at_start,
                    went_ahead,
                })
                .collect(),
        }
    }

    /// Rule 4: the parts' senders; with every part in, the one owner missing, or no one
    /// where two are.
    #[test]
    fn a_stall_suspects_the_parts_withheld_or_one_missing_aggregate() {
        let (a, b, c) = (PeerId::random(), PeerId::random(), PeerId::random());
        let now = Instant::now();
        let roster = Roster::default();
        let peers = |s: &Stall| -> Vec<PeerId> {
            stall_suspects(s, &roster)
                .into_iter()
                .map(|(p, _)| p)
                .collect()
        };
        let parts = stall(
            now,
            &[
                (a, true, None, false),
                (b, false, None, false),
                (c, true, None, false),
            ],
        );
        assert_eq!(peers(&parts), [a, c]);
        let one_owner = stall(now, &[(b, false, None, false)]);
        assert_eq!(peers(&one_owner), [b]);
        let two_owners = stall(now, &[(a, false, None, false), (b, false, None, false)]);
        assert!(peers(&two_owners).is_empty());
    }

    /// Rule 4: a heartbeat since the start naming this round and the step it named then (or
    /// one past the boundary) shows the member at the boundary; one from before the start, of
    /// another round, with a step between, or in a gradient round shows nothing; a hop of a
    /// later attempt always does.
    #[test]
    fn a_suspect_shows_it_is_at_the_boundary_by_its_heartbeat_or_a_later_hop() {
        let p = PeerId::random();
        let started = Instant::now();
        let after = started + Duration::from_millis(10);
        let at_boundary = |roster: &Roster, s: &Stall| stall_suspects(s, roster)[0].1;
        let waited = stall(started, &[(p, true, Some(100), false)]);
        for (round, step, at, shows) in [
            (4, 100, after, true),
            (4, 101, after, true),
            (4, 100, started, false),
            (5, 100, after, false),
        ] {
            let mut roster = Roster::default();
            said(&mut roster, p, round, step, at);
            assert_eq!(at_boundary(&roster, &waited), shows, "{round} {step}");
        }
        // Still training towards the boundary: it said step 90 at the start, 95 now.
        let mut roster = Roster::default();
        said(&mut roster, p, 4, 95, after);
        let training = stall(started, &[(p, true, Some(90), false)]);
        assert!(!at_boundary(&roster, &training));
        let went_ahead = stall(started, &[(p, true, Some(90), true)]);
        assert!(at_boundary(&roster, &went_ahead));
        // In a gradient round every member is held at its step: that shows nothing.
        said(&mut roster, p, 4, 100, after);
        let mut gradient = stall(started, &[(p, true, Some(100), false)]);
        assert!(at_boundary(&roster, &gradient));
        gradient.gradient = true;
        assert!(!at_boundary(&roster, &gradient));
    }

    /// Rule 5: out of step when the stall would leave out every member heard, two or more;
    /// not when one of them is only excused, or when it hears one member alone.
    #[test]
    fn a_node_that_would_leave_out_every_member_is_out_of_step() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let t = Trust::default();
        assert!(t.out_of_step(&[a, b], &[(a, true), (b, true)], 4));
        assert!(
            !t.out_of_step(&[a, b], &[(a, true), (b, false)], 4),
            "b excused"
        );
        assert!(!t.out_of_step(&[a, b], &[(a, true)], 4));
        assert!(!t.out_of_step(&[a], &[(a, true)], 4), "one member heard");
        let mut t = Trust::default();
        for _ in 0..STALL_EXCUSES {
            t.excuse(b, 4);
        }
        assert!(
            t.out_of_step(&[a, b], &[(a, true), (b, false)], 4),
            "b's excuses spent"
        );
    }

    /// Rule 6: accused only where it alone withheld its part and says it is in this round.
    #[test]
    fn a_member_that_alone_withheld_its_part_in_this_round_is_accused() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        let mut roster = Roster::default();
        said(&mut roster, a, 4, 100, now);
        said(&mut roster, b, 4, 100, now);
        let alone = stall(now, &[(a, true, None, false), (b, false, None, false)]);
        assert!(withheld_alone(&alone, &roster, &a));
        assert!(!withheld_alone(&alone, &roster, &b), "only its aggregate");
        let both = stall(now, &[(a, true, None, false), (b, true, None, false)]);
        assert!(!withheld_alone(&both, &roster, &a));
        said(&mut roster, a, 5, 100, now);
        assert!(!withheld_alone(&alone, &roster, &a), "a later round");
    }

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
