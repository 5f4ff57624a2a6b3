//! What attempts whose member lists differed tell a member, and what it does about it:
//! leave out a member that most others leave out (they banned it, or cannot reach it), take
//! back one it left out that most others list, or sit out of the rounds when most others
//! list a peer it cannot take (one it banned, or lost); failing those, leave out a member
//! whose list nobody else names and nothing explains ([`Verdict::Unmatched`]: liveness, no
//! blame). A verdict is acted on once the attempts have named it for [`OUTVOTED_FOR`] (a
//! joiner's heartbeat, or a death one member noticed first, settles well within that), or
//! at once where the same verdict was acted on before (after a leave-out or a sit-out ends,
//! the disagreement comes back at once if its cause remains: each time, it lasts twice as
//! long, up to [`LONGEST`]). A member an attempt stalled waiting for is left out the same
//! way, at once ([`Lists::stalled`]), and so is a member most members' heartbeats said
//! named them a later round their attempts' hops contradicted ([`Lists::accused`],
//! [`Lists::accused_by_most`]): heartbeats are gossiped, so the members count the same
//! accusations within moments of each other, where member lists are each member's own view.
//! Pure state: part of [`super::Rounds`].
//!
//! Without it, one member that banned a rogue the others still listed stalled every round
//! for as long as the ban lasted (10 minutes), and the others never got to judge the rogue.
//! One rogue is never most in a ring of three or more; in a ring of two the other member's
//! word decides, as it already does where a member is rounds ahead
//! (`Members::say_past`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::PeerId;

/// A verdict named by the attempts for this long is acted on: two heartbeats, by when the
/// others heard a joiner's, and dropped a member that died (its connection closed) or hung
/// (each drops it [`super::READY_FRESH`] after its last heartbeat, within a heartbeat of
/// each other).
pub const OUTVOTED_FOR: Duration = Duration::from_secs(2 * super::HEARTBEAT_EVERY.as_secs());
/// How long a member is left out, or this member sits out, the first time.
pub const SIT_OUT: Duration = Duration::from_secs(10);
/// The longest a member is left out, or this member sits out (after doublings).
pub const LONGEST: Duration = Duration::from_secs(320);
/// Peers remembered (left out, sat out over) at most: a bound on a public mesh.
const KEPT: usize = 64;
/// A peer not named by a verdict for this long is forgotten (its doublings start over).
const FORGET_AFTER: Duration = Duration::from_secs(600);

/// What the attempts' lists said (see [`super::ring::Ring::left_out_by_most`] and
/// [`super::ring::Ring::listed_by_most`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Most members leave out this member, which this node lists.
    LeftOut(PeerId),
    /// Most members list this peer, which this node does not.
    Listed(PeerId),
    /// This member's hops name a list no other member names and no peer explains (not this
    /// list with one member fewer or one known peer more): a list of its own, honest or not
    /// (a random digest matches no verdict, and without this one stalled every attempt it
    /// was in, forever). Left out as [`Verdict::LeftOut`], with no blame: liveness only.
    Unmatched(PeerId),
}

/// What a member does about a verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Leave the member out of its lists (until [`Lists::left_out`] says otherwise).
    LeaveOut(PeerId),
    /// List again a member it had left out.
    TakeBack(PeerId),
    /// Sit out of the rounds for this long.
    SitOut(PeerId, Duration),
}

/// One peer's record: until when it is left out (or this node sits out over it), how many
/// times, and when a verdict last named it.
#[derive(Debug, Clone, Copy)]
struct Record {
    until: Instant,
    times: u32,
    named: Instant,
    /// Left out on heartbeats' accusations ([`Lists::left_out_accused`]).
    accused: bool,
}

/// The verdicts of a member's attempts and what it did about them.
#[derive(Debug, Default)]
pub struct Lists {
    /// The verdict the last attempts named, and since when.
    pending: Option<(Verdict, Instant)>,
    /// Members left out of this node's lists.
    left_out: HashMap<PeerId, Record>,
    /// Peers this node sat out over.
    sat_out_over: HashMap<PeerId, Record>,
    /// Each accuser's accusation (see `Rounds::accuse`): the member it named, when it last
    /// did, and how many times in a row it said. Keyed by accuser, who names one member at
    /// a time: a member naming a new peer in every heartbeat replaces its own accusation,
    /// and crowds out no one else's.
    accusations: HashMap<PeerId, (PeerId, Instant, u32)>,
    /// Until when each accuser's last accusation-again keeps its member out
    /// ([`Lists::left_out_again`]).
    again_by: HashMap<PeerId, Instant>,
}

impl Lists {
    /// Whether `peer` is left out of this node's lists now.
    pub fn left_out(&self, peer: &PeerId, now: Instant) -> bool {
        self.left_out.get(peer).is_some_and(|r| now < r.until)
    }

    /// Whether `peer` is left out now on heartbeats' accusations (most members', or one
    /// member's again): the mesh's word that it lies about rounds, where a leave-out for a
    /// stall is this node's own view of a member that may be honest.
    pub fn out_on_accusations(&self, peer: &PeerId, now: Instant) -> bool {
        self.left_out
            .get(peer)
            .is_some_and(|r| r.accused && now < r.until)
    }

    /// Peers this node left out, now or before (most members may list them again).
    pub fn ever_left_out(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.left_out.keys().copied()
    }

    /// `by` said that `x` named it a later round most members' hops contradicted, or
    /// withheld a part from it alone, `times` times in a row (`Rounds::accuse`). Counts for
    /// [`super::ACCUSATION_KEPT`] from the last heartbeat that said so (accusers say so for
    /// as long, so a member most accused is left out again, for twice as long, while the
    /// accusations last); at most [`KEPT`] accusers are kept (this node's own always).
    /// Answers whether `by` now accuses `x` [`super::ACCUSED_AGAIN`] times or more, one more
    /// time than its last accusation this node heard named `x`: each new accusation is news
    /// once, however many heartbeats repeat it, and a count that did not rise one by one
    /// (a new peer named at once twice, or a jump) is none.
    pub fn accused(&mut self, x: PeerId, by: PeerId, times: u32, me: PeerId, now: Instant) -> bool {
        self.accusations
            .retain(|_, (_, at, _)| now.saturating_duration_since(*at) < super::ACCUSATION_KEPT);
        if by != me && !self.accusations.contains_key(&by) && self.accusations.len() >= KEPT {
            return false;
        }
        let before = self.accusations.insert(by, (x, now, times));
        times >= super::ACCUSED_AGAIN
            && before.is_some_and(|(p, _, t)| p == x && t.checked_add(1) == Some(times))
    }

    /// `by` accused `x` again ([`Lists::accused`]): `x` is left out as on heartbeats'
    /// accusations ([`Lists::left_out_accused`]) unless a member `by` accused again before
    /// is still left out on its word, so that one accuser keeps one member out at a time. A
    /// member left out already (a stall of its here, most members' accusations) is the one
    /// `by` keeps out until then, as it is at the members that left it out on `by`'s word.
    /// At most [`KEPT`] accusers are kept (this node, `me`, always). Answers how long, or
    /// `None` where it is not left out now.
    pub fn left_out_again(
        &mut self,
        x: PeerId,
        by: PeerId,
        me: PeerId,
        now: Instant,
    ) -> Option<Duration> {
        self.again_by.retain(|_, until| now < *until);
        if self.again_by.contains_key(&by) || (by != me && self.again_by.len() >= KEPT) {
            return None;
        }
        if let Some(until) = self.left_out.get(&x).map(|r| r.until).filter(|u| now < *u) {
            self.again_by.insert(by, until);
            return None;
        }
        let last = self.left_out_accused(x, now)?;
        self.again_by.insert(by, now + last);
        Some(last)
    }

    /// Whether more than half of `voters` accused `x` within [`super::ACCUSATION_KEPT`].
    pub fn accused_by_most(&self, x: PeerId, voters: &[PeerId], now: Instant) -> bool {
        let count = voters
            .iter()
            .filter(|v| {
                self.accusations.get(*v).is_some_and(|(named, at, _)| {
                    *named == x && now.saturating_duration_since(*at) < super::ACCUSATION_KEPT
                })
            })
            .count();
        count * 2 > voters.len()
    }

    /// A round completed: the lists agreed, so what attempts before named is no longer news.
    pub fn agreed(&mut self) {
        self.pending = None;
    }

    /// An attempt whose lists differed named `verdict` (`None`: nothing most members agree
    /// on, which changes nothing). Answers what to do now.
    pub fn named(&mut self, verdict: Option<Verdict>, now: Instant) -> Option<Action> {
        let verdict = verdict?;
        self.forget_old(now);
        let since = match self.pending {
            Some((v, since)) if v == verdict => since,
            _ => now,
        };
        if let Verdict::Listed(peer) = verdict {
            if let Some(r) = self.left_out.get_mut(&peer) {
                // Most members list a member this node left out: take it back at once (its
                // leave-out would end the same way, later); one left out on heartbeats'
                // accusations only once named for `OUTVOTED_FOR`, since the others leave it
                // out too as those heartbeats reach them. (Taken back at once, members that
                // heard them a moment apart took it back and left it out again in turn,
                // for back-offs that then differed, and no list was most members'.)
                if r.accused && now < r.until && now.saturating_duration_since(since) < OUTVOTED_FOR
                {
                    self.pending = Some((verdict, since));
                    return None;
                }
                r.until = now;
                r.named = now;
                self.pending = None;
                return Some(Action::TakeBack(peer));
            }
        }
        self.pending = Some((verdict, since));
        let (records, peer) = match verdict {
            Verdict::LeftOut(p) | Verdict::Unmatched(p) => (&mut self.left_out, p),
            Verdict::Listed(p) => (&mut self.sat_out_over, p),
        };
        let again = records.contains_key(&peer);
        if !again && now.saturating_duration_since(since) < OUTVOTED_FOR {
            return None;
        }
        let last = record(records, peer, false, now)?;
        self.pending = None;
        Some(match verdict {
            Verdict::LeftOut(p) | Verdict::Unmatched(p) => Action::LeaveOut(p),
            Verdict::Listed(p) => Action::SitOut(p, last),
        })
    }

    /// As [`Lists::named`], for an attempt left before every hop of its own list came (a
    /// later attempt moved this node on): it may confirm the verdict whole attempts named,
    /// and names none of its own but one: where none is pending, a [`Verdict::LeftOut`]
    /// whose member's hops are the only ones missing while its heartbeat says it is in a
    /// later round (`whole_but_x`, `Rounds::weigh_lists_before_moving_on`): no verdict on
    /// it counts them, and they are not coming, so the attempt named it as a whole one
    /// would. Its lists are partial, and a verdict of theirs that differs would start the
    /// pending one's [`OUTVOTED_FOR`] over (weighed as whole attempts, they cost the
    /// simulator's rogue whose hops name no list 14 of 224 rounds, and 203 of 714 in
    /// `ddp`). Confirming only, a member back fresh (restarted, nothing pending) whose
    /// fellows had left out for a stall a rogue gone on to the next round was moved on
    /// within each attempt's wait for the rogue's part, weighed none whole, and never
    /// followed them (`ring_rogue`'s `allreduce` joiner test: 69 s without a round, one run
    /// in 15). A partial attempt naming any leave-out or listing that most members' hops
    /// make fixed that too, but then members left a rogue whose hops name round 2^48 out
    /// before its offences reached them (the simulator: banned after 23 rounds instead of
    /// 13, against a bound of 20), and the next-attempt rogue's rows lost 7 rounds of 203.
    pub fn named_again(
        &mut self,
        verdict: Option<Verdict>,
        whole_but_x: bool,
        now: Instant,
    ) -> Option<Action> {
        match (verdict, self.pending) {
            (Some(v), Some((pending, _))) if v == pending => self.named(verdict, now),
            (Some(Verdict::LeftOut(_)), None) if whole_but_x => self.named(verdict, now),
            _ => None,
        }
    }

    /// An attempt stalled waiting for `peer` (see `Rounds::stalled`): it is left out at
    /// once, no vote needed (the stall itself took `sync.stall_timeout_secs`, and the other
    /// members that waited for it do the same when their own attempts stall, within a tick
    /// of each other as a rule), for [`SIT_OUT`] the first time and twice as long each time
    /// after, up to [`LONGEST`]. A stall proves nothing (a hung trainer, a link gone quiet): this is no
    /// offence and no score, only a member the next attempts do not wait for. Answers how
    /// long, or `None` where this node keeps no more records.
    pub fn stalled(&mut self, peer: PeerId, now: Instant) -> Option<Duration> {
        self.forget_old(now);
        record(&mut self.left_out, peer, false, now)
    }

    /// Heartbeats' accusations leave `peer` out (`Rounds::leave_out_if_accused_by_most`,
    /// `Rounds::leave_out_accused_again`): as [`Lists::stalled`], but most members listing it
    /// take it back only after [`OUTVOTED_FOR`] ([`Lists::named`]).
    pub fn left_out_accused(&mut self, peer: PeerId, now: Instant) -> Option<Duration> {
        self.forget_old(now);
        record(&mut self.left_out, peer, true, now)
    }

    /// Members left out of this node's lists now, for status.
    pub fn left_out_now(&self, now: Instant) -> Vec<PeerId> {
        let mut peers: Vec<PeerId> = self
            .left_out
            .iter()
            .filter(|(_, r)| now < r.until)
            .map(|(p, _)| *p)
            .collect();
        peers.sort();
        peers
    }

    fn forget_old(&mut self, now: Instant) {
        for records in [&mut self.left_out, &mut self.sat_out_over] {
            records.retain(|_, r| {
                now < r.until || now.saturating_duration_since(r.named) < FORGET_AFTER
            });
        }
    }
}

/// Records `peer` in `records` from now: for [`SIT_OUT`] the first time, twice as long each
/// time after, up to [`LONGEST`]; `None` (nothing recorded) for a new peer past [`KEPT`].
fn record(
    records: &mut HashMap<PeerId, Record>,
    peer: PeerId,
    accused: bool,
    now: Instant,
) -> Option<Duration> {
    if !records.contains_key(&peer) && records.len() >= KEPT {
        return None;
    }
    let times = records.get(&peer).map_or(0, |r| r.times) + 1;
    let last = SIT_OUT
        .saturating_mul(1 << (times - 1).min(10))
        .min(LONGEST);
    records.insert(
        peer,
        Record {
            until: now + last,
            times,
            named: now,
            accused,
        },
    );
    Some(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A verdict is acted on only once named for `OUTVOTED_FOR`; named again after its
    /// leave-out ended, at once and for twice as long; a member most others list again is
    /// taken back at once.
    #[test]
    fn a_verdict_waits_then_repeats_at_once_for_longer() {
        let (x, t0) = (PeerId::random(), Instant::now());
        let mut lists = Lists::default();
        let out = Some(Verdict::LeftOut(x));
        assert_eq!(lists.named(out, t0), None);
        // Nothing agreed on in between changes nothing.
        assert_eq!(lists.named(None, t0 + OUTVOTED_FOR / 2), None);
        assert_eq!(lists.named(out, t0 + OUTVOTED_FOR / 2), None);
        let t1 = t0 + OUTVOTED_FOR;
        assert_eq!(lists.named(out, t1), Some(Action::LeaveOut(x)));
        assert!(lists.left_out(&x, t1 + SIT_OUT / 2));
        assert!(!lists.left_out(&x, t1 + SIT_OUT));
        let t2 = t1 + SIT_OUT;
        assert_eq!(lists.named(out, t2), Some(Action::LeaveOut(x)));
        assert!(lists.left_out(&x, t2 + SIT_OUT * 3 / 2));
        assert_eq!(
            lists.named(Some(Verdict::Listed(x)), t2 + SIT_OUT),
            Some(Action::TakeBack(x))
        );
        assert!(!lists.left_out(&x, t2 + SIT_OUT));
    }

    /// An attempt left partial names a verdict only where none is pending and the member
    /// most left out is the only one whose hops are missing (acted on as a whole attempt's,
    /// after `OUTVOTED_FOR`); otherwise it confirms the pending verdict and names no other.
    #[test]
    fn a_partial_attempt_names_only_a_leave_out_its_missing_hops_cannot_change() {
        let (x, y, t0) = (PeerId::random(), PeerId::random(), Instant::now());
        let out = Some(Verdict::LeftOut(x));
        let mut lists = Lists::default();
        assert_eq!(lists.named_again(out, false, t0), None);
        assert_eq!(
            lists.named_again(out, false, t0 + OUTVOTED_FOR),
            None,
            "other hops missing: nothing named"
        );
        for v in [Verdict::Unmatched(y), Verdict::Listed(y)] {
            assert_eq!(lists.named_again(Some(v), true, t0 + OUTVOTED_FOR), None);
        }
        let t1 = t0 + OUTVOTED_FOR * 2;
        assert_eq!(lists.named_again(out, true, t1), None);
        assert_eq!(lists.named_again(Some(Verdict::LeftOut(y)), true, t1), None);
        assert_eq!(
            lists.named_again(out, false, t1 + OUTVOTED_FOR),
            Some(Action::LeaveOut(x)),
            "confirmed; the other verdict did not start the wait over"
        );
        assert!(lists.left_out(&x, t1 + OUTVOTED_FOR));
    }

    /// A member left out on heartbeats' accusations is taken back only once most members
    /// listed it for `OUTVOTED_FOR` (the others leave it out as the heartbeats reach them);
    /// one left out for a stall, at once.
    #[test]
    fn an_accused_member_is_taken_back_only_when_outvoted() {
        let (x, y, t0) = (PeerId::random(), PeerId::random(), Instant::now());
        let mut lists = Lists::default();
        assert_eq!(lists.left_out_accused(x, t0), Some(SIT_OUT));
        assert_eq!(lists.stalled(y, t0), Some(SIT_OUT));
        let listed = |p| Some(Verdict::Listed(p));
        assert_eq!(lists.named(listed(y), t0), Some(Action::TakeBack(y)));
        assert_eq!(lists.named(listed(x), t0), None);
        assert_eq!(lists.named(listed(x), t0 + OUTVOTED_FOR / 2), None);
        assert!(lists.left_out(&x, t0 + OUTVOTED_FOR / 2));
        assert_eq!(
            lists.named(listed(x), t0 + OUTVOTED_FOR),
            Some(Action::TakeBack(x))
        );
        assert!(!lists.left_out(&x, t0 + OUTVOTED_FOR));
    }

    /// An accuser's accusation is news once per count from `ACCUSED_AGAIN` on, each one
    /// above the last it named the same member with: a new member named at a count past 1,
    /// or a count that jumps, is none.
    #[test]
    fn an_accusation_is_news_once_per_count() {
        let (x, z, by, me, t0) = (
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
            Instant::now(),
        );
        let mut lists = Lists::default();
        assert!(!lists.accused(x, by, 1, me, t0));
        assert!(lists.accused(x, by, 2, me, t0));
        assert!(!lists.accused(x, by, 2, me, t0));
        assert!(lists.accused(x, by, 3, me, t0));
        // Another peer named at once with a count past 1, or a count that jumps: no news.
        assert!(!lists.accused(z, by, 3, me, t0));
        assert!(!lists.accused(z, by, 5, me, t0));
        assert!(lists.accused(z, by, 6, me, t0));
    }

    /// One accuser keeps one member out at a time on its accusations-again; another
    /// accuser's leaves out another; a member left out already is the one its accuser
    /// keeps out until then; once that ends, the same accuser's next one counts.
    #[test]
    fn one_accuser_keeps_one_member_out_at_a_time() {
        let [x, y, z, by, other, me] = [(); 6].map(|_| PeerId::random());
        let t0 = Instant::now();
        let mut lists = Lists::default();
        assert_eq!(lists.left_out_again(x, by, me, t0), Some(SIT_OUT));
        assert_eq!(lists.left_out_again(y, by, me, t0 + SIT_OUT / 2), None);
        assert!(!lists.left_out(&y, t0 + SIT_OUT / 2));
        assert_eq!(
            lists.left_out_again(y, other, me, t0 + SIT_OUT / 2),
            Some(SIT_OUT)
        );
        // Left out already (here, for a stall): `by` keeps it out until then.
        let t1 = t0 + SIT_OUT;
        assert_eq!(lists.stalled(z, t1), Some(SIT_OUT));
        assert_eq!(lists.left_out_again(z, by, me, t1), None);
        assert_eq!(lists.left_out_again(x, by, me, t1 + SIT_OUT / 2), None);
        assert_eq!(
            lists.left_out_again(x, by, me, t1 + SIT_OUT),
            Some(2 * SIT_OUT)
        );
    }

    /// Sitting out: after `OUTVOTED_FOR`, then at once and twice as long each time, up to
    /// `LONGEST`; another verdict in between starts the wait over; a round that completed
    /// clears what was pending.
    #[test]
    fn sitting_out_doubles_up_to_the_longest() {
        let (x, y, t0) = (PeerId::random(), PeerId::random(), Instant::now());
        let mut lists = Lists::default();
        let listed = Some(Verdict::Listed(x));
        assert_eq!(lists.named(listed, t0), None);
        lists.agreed();
        assert_eq!(lists.named(listed, t0 + OUTVOTED_FOR), None);
        assert_eq!(
            lists.named(Some(Verdict::LeftOut(y)), t0 + OUTVOTED_FOR),
            None
        );
        let t1 = t0 + OUTVOTED_FOR * 2;
        assert_eq!(lists.named(listed, t1), None);
        let mut t = t1 + OUTVOTED_FOR;
        let mut lasts = Vec::new();
        for _ in 0..8 {
            match lists.named(listed, t) {
                Some(Action::SitOut(p, last)) if p == x => {
                    lasts.push(last.as_secs());
                    t += last;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(lasts, vec![10, 20, 40, 80, 160, 320, 320, 320]);
    }
}
