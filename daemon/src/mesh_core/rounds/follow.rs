//! Which later round or attempt the hops waiting in the inbox make this node take, on the
//! members' word ([`Members`]): pure rules over the hops' places (round, attempt, hop,
//! sender). `Rounds` asks them and enters what they answer (`Rounds::adopt_newer_round`,
//! `Rounds::start`, the hops' handling); one member's word alone, weighed over time, is
//! `Rounds`' own business (`Rounds::weigh_lone_claims`).
//!
//! The rules, each with its test below (none needs a ring):
//! 1. A later round is taken where two members' hops name it (or the only other's, see
//!    [`super::members::vouched`]); where this node has no round, or most heartbeats say
//!    the mesh is past its own, that round only if it is as far as most heartbeats say,
//!    else the round they say where a hop names it or a later one, else the newest a hop of
//!    a member not left out on accusations names ([`proven_later_round`]:
//!    `a_later_round_is_taken_on_two_members_word_or_the_meshs`).
//! 2. A later attempt of this node's round is taken where two members' hops name it (or
//!    the only other's) ([`later_attempt`]: `a_later_attempt_is_taken_on_two_members_word`).
//! 3. Entering a round it takes, a node joins the attempt two members' hops of that round
//!    name, else the lowest any names, else the first ([`attempt_to_enter`]:
//!    `a_round_taken_is_entered_at_the_attempt_its_hops_name`).

use super::members::Members;
use super::HopKey;

/// The later round `hops` make a node at round `mine` take on more than one member's word
/// (rule 1), if any. (Taking the newest hop's round always, a member that sat out came
/// back to the round a rogue named to it alone, one past the others': their hops then
/// contradicted its own, most members accused the honest member, and the others' rounds
/// raced on thousands apart.)
pub(super) fn proven_later_round<'k>(
    hops: impl DoubleEndedIterator<Item = &'k HopKey> + Clone,
    members: &Members,
    mine: Option<u64>,
) -> Option<u64> {
    let later = hops
        .clone()
        .filter(|(r, _, _, _)| mine.is_none_or(|m| *r > m))
        .map(|(r, _, _, from)| (*from, *r));
    let vouched = members.vouch(later);
    if !mine.is_none_or(|m| members.say_past(m)) {
        return vouched;
    }
    // The newest round a hop names, of a member not left out on accusations.
    let &(newest, _, _, _) = hops.rev().find(|(_, _, _, from)| !members.accused(from))?;
    if mine.is_some_and(|m| newest <= m) {
        return None;
    }
    // Heartbeats go out every 2 s, and in short rounds their round lags the hops: a round
    // two members' hops name counts where it is as far as most heartbeats say (taking the
    // heartbeats' round over it cost a stall in `diloco`, 16 s -> 36 s in a `ring_rogue`
    // test). A heartbeat's round is one member's word, however far: taken only where a hop
    // names it or a later one.
    let said = members.round_said_by_most();
    let vouched = vouched.filter(|v| said.is_none_or(|s| *v >= s));
    let said = said.filter(|s| *s <= newest && mine.is_none_or(|m| *s > m));
    Some(vouched.or(said).unwrap_or(newest))
}

/// The later attempt of `round` than `number` that `hops` make a node take (rule 2), if
/// any.
pub(super) fn later_attempt<'k>(
    hops: impl Iterator<Item = &'k HopKey>,
    members: &Members,
    round: u64,
    number: u32,
) -> Option<u32> {
    let attempts = hops
        .filter(|(r, a, _, _)| *r == round && *a > number)
        .map(|(_, a, _, from)| (*from, u64::from(*a)));
    members.vouch(attempts).map(|a| a as u32)
}

/// The attempt a node entering round `target` joins (rule 3).
pub(super) fn attempt_to_enter<'k>(
    hops: impl Iterator<Item = &'k HopKey> + Clone,
    members: &Members,
    target: u64,
) -> u32 {
    let of_target = hops
        .filter(|(r, _, _, _)| *r == target)
        .map(|(_, a, _, from)| (*from, u64::from(*a)));
    members
        .vouch(of_target.clone())
        .or_else(|| of_target.map(|(_, a)| a).min())
        .unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use libp2p::PeerId;

    use super::super::lists::Lists;
    use super::super::roster::Roster;
    use super::*;
    use crate::wire::Heartbeat;

    /// A roster that heard each of `peers` ready at the round beside it.
    fn roster(peers: &[(PeerId, u64)], now: Instant) -> Roster {
        let mut r = Roster::default();
        for (p, round) in peers {
            let hb = Heartbeat {
                in_rounds: true,
                round: Some(*round),
                ..Heartbeat::default()
            };
            r.heard(*p, &hb, false, now);
        }
        r
    }

    /// Hops of (round, attempt, sender), in the inbox's order.
    fn hops(places: &[(u64, u32, PeerId)]) -> Vec<HopKey> {
        let mut keys: Vec<HopKey> = places.iter().map(|&(r, a, p)| (r, a, 0, p)).collect();
        keys.sort();
        keys
    }

    /// Rule 1: two senders' word, not one; past the node's round by most heartbeats, the
    /// newest hop's round unless a vouched or said one is as far as most say; never a hop of
    /// a member left out on accusations alone.
    #[test]
    fn a_later_round_is_taken_on_two_members_word_or_the_meshs() {
        let now = Instant::now();
        let [me, a, b, c] = [(); 4].map(|_| PeerId::random());
        let lists = Lists::default();
        // The members say round 5, as this node is.
        let at_5 = roster(&[(a, 5), (b, 5), (c, 5)], now);
        let m = Members::new(&at_5, &lists, me, now);
        assert_eq!(
            proven_later_round(hops(&[(9, 0, a)]).iter(), &m, Some(5)),
            None
        );
        let two = hops(&[(9, 0, a), (7, 0, b)]);
        assert_eq!(proven_later_round(two.iter(), &m, Some(5)), Some(7));
        // Most say round 8: past this node, which takes the newest hop's round where none
        // vouched is as far; one named by two senders as far as most say wins.
        let at_8 = roster(&[(a, 8), (b, 8), (c, 8)], now);
        let m = Members::new(&at_8, &lists, me, now);
        assert_eq!(
            proven_later_round(hops(&[(9, 0, a)]).iter(), &m, Some(5)),
            Some(8),
            "said, and a hop names 9"
        );
        assert_eq!(
            proven_later_round(hops(&[(7, 0, a)]).iter(), &m, Some(5)),
            Some(7),
            "no hop names 8"
        );
        let vouched = hops(&[(9, 0, a), (9, 0, b), (11, 0, c)]);
        assert_eq!(proven_later_round(vouched.iter(), &m, Some(5)), Some(9));
        // No round of its own: the same, from nothing.
        assert_eq!(
            proven_later_round(hops(&[(9, 0, a)]).iter(), &m, None),
            Some(8)
        );
        // The newest hop's sender left out on accusations: the next newest counts.
        let mut accused = Lists::default();
        accused.left_out_accused(c, now);
        let m = Members::new(&at_8, &accused, me, now);
        let lie = hops(&[(7, 0, a), (2000, 0, c)]);
        assert_eq!(proven_later_round(lie.iter(), &m, Some(5)), Some(7));
        assert_eq!(
            proven_later_round(hops(&[(2000, 0, c)]).iter(), &m, Some(5)),
            None
        );
    }

    /// Rule 2: the highest later attempt two senders reach; one sender's alone only where it
    /// is the only other member; hops of other rounds and earlier attempts aside.
    #[test]
    fn a_later_attempt_is_taken_on_two_members_word() {
        let now = Instant::now();
        let [me, a, b, c] = [(); 4].map(|_| PeerId::random());
        let lists = Lists::default();
        let three = roster(&[(a, 5), (b, 5), (c, 5)], now);
        let m = Members::new(&three, &lists, me, now);
        let keys = hops(&[(5, 4, a), (5, 3, b), (6, 9, c), (5, 1, c)]);
        assert_eq!(later_attempt(keys.iter(), &m, 5, 2), Some(3));
        assert_eq!(later_attempt(keys.iter(), &m, 5, 3), None);
        let one = roster(&[(a, 5)], now);
        let m = Members::new(&one, &lists, me, now);
        assert_eq!(later_attempt(hops(&[(5, 4, a)]).iter(), &m, 5, 2), Some(4));
    }

    /// Rule 3: the attempt two senders of the round reach, else the lowest named, else 0.
    #[test]
    fn a_round_taken_is_entered_at_the_attempt_its_hops_name() {
        let now = Instant::now();
        let [me, a, b, c] = [(); 4].map(|_| PeerId::random());
        let lists = Lists::default();
        let three = roster(&[(a, 5), (b, 5), (c, 5)], now);
        let m = Members::new(&three, &lists, me, now);
        let keys = hops(&[(9, 4, a), (9, 2, b), (9, 7, c), (10, 1, a)]);
        assert_eq!(attempt_to_enter(keys.iter(), &m, 9), 4);
        assert_eq!(attempt_to_enter(hops(&[(9, 6, a)]).iter(), &m, 9), 6);
        assert_eq!(attempt_to_enter(keys.iter(), &m, 11), 0);
    }
}
