//! The hops a node receives: which attempt a hop belongs to (a later one is joined where two
//! members name it, or once on one member's word where the others' hops do not contradict
//! it; one not reached yet waits in the inbox; a stale one is dropped), and taking the
//! running attempt's
//! hops: judging each member's part and each owner's aggregate, aggregating this member's
//! chunk when its parts are in, finishing when every aggregate is. Part of
//! [`super::Rounds`].

use std::time::Instant;

use libp2p::PeerId;

use super::pieces::Taken;
use super::ring::{all_finite, Judged};
use super::{
    HopKey, Output, Rounds, Stage, ATTEMPT_JUMP, ATTEMPT_LIMIT, CONTRADICTED_SIT_OUT,
    FOLLOWED_ATTEMPT_LIMIT, FOLLOWED_ROUND_LIMIT, ROUND_JUMP, ROUND_LIMIT, STEP_LIMIT,
    WEIGHT_LIMIT,
};
use crate::wire::{Piece, RingMessage};

/// Reports a hop no honest member sends: named for a ban's reason (status shows each peer's
/// count and last offence; the ban is logged with it), and penalised (the peer's score falls;
/// enough such hops in a short time ban it). Hops travel as bulk requests, which gossipsub's
/// own rejection count never sees. Logged at debug level: a peer sending them as fast as it
/// can would otherwise fill the log before its ban.
fn offence(out: &mut Vec<Output>, from: PeerId, why: String) {
    tracing::debug!(peer = %from, "refused a ring hop: {why}");
    out.push(Output::Offence { peer: from, why });
    out.push(Output::Penalise(from));
}

/// Why `msg` names a round, attempt or step past any mesh's, if it does.
fn past_limits(msg: &RingMessage) -> Option<String> {
    (msg.round >= ROUND_LIMIT || msg.attempt >= ATTEMPT_LIMIT || msg.step >= STEP_LIMIT).then(
        || {
            format!(
                "ring hop of round {} attempt {} at step {}, past what any mesh reaches",
                msg.round, msg.attempt, msg.step
            )
        },
    )
}

impl Rounds {
    /// A hop from `from`. Hops of a later attempt or round make this node join it where two
    /// members' hops name it; on one member's word, a later attempt at once and a later round
    /// where the others' hops do not contradict it ([`Rounds::weigh_lone_claims`]), each once
    /// for each member ([`Rounds::may_move`]); hops of attempts it has not reached wait in
    /// the inbox; stale ones are dropped. A hop that cannot be
    /// honest is an offence: one of odd size, with values that are not finite, or naming a
    /// round, attempt or step past any mesh's changes nothing.
    /// A hop that comes in pieces is put together first ([`super::pieces`]); each piece is
    /// checked for its counters and jump as a whole hop is, before it is kept.
    pub fn message(&mut self, from: PeerId, msg: RingMessage, now: Instant, out: &mut Vec<Output>) {
        let first = out.len();
        if msg.piece == Piece::WHOLE {
            self.take(from, msg, now, out);
        } else if let Some(why) = past_limits(&msg) {
            self.refuse(from, why, now, out);
        } else if !self.too_far(&msg, now) {
            let (round, attempt, members) = (msg.round, msg.attempt, msg.members);
            match self.inbox.take_piece(from, msg, now) {
                Ok(Taken::Whole(whole)) => self.take(from, whole, now, out),
                Ok(Taken::Kept) => self.piece_came(from, (round, attempt, members), now),
                Ok(Taken::Dropped) => {}
                Err(why) => self.refuse(from, why, now, out),
            }
        }
        for o in &out[first..] {
            if let Output::Offence { peer, .. } = o {
                self.blamed(*peer, now);
            }
        }
    }

    /// A hop refused as it came, before it could reach any attempt (of odd length, not
    /// finite, past the limits, a piece no split gives): an offence. A sender that takes
    /// part in rounds (heard ready, or in the running attempt) is also left out of the next
    /// attempts as a staller is, with the same back-off (not again while it is left out);
    /// where the running attempt still waits for a hop of it, that attempt is retried at
    /// once without it. Kept in, such a sender (`ring_rogue`'s rogue naming round
    /// `u64::MAX`) stalled each attempt for the stall timeout, twice excused a round, and
    /// was not banned within 60 s: it sends its hops only in attempts of its own. Where most
    /// members still list it (it sent such a hop to this member alone), it is taken back as
    /// a staller is: one such hop does not make an honest member sit out.
    fn refuse(&mut self, from: PeerId, why: String, now: Instant, out: &mut Vec<Output>) {
        offence(out, from, why);
        let (in_ring, awaited) = match &self.attempt.stage {
            Stage::Reducing {
                ring: Some(ring), ..
            } => match ring.index_of(&from) {
                Some(i) => (true, ring.awaits(i)),
                None => (false, false),
            },
            _ => (false, false),
        };
        if awaited {
            self.abort("a member's hop was an offence", now);
        }
        let in_rounds = in_ring || self.roster.is_fresh(&from, now);
        if in_rounds && !self.lists.left_out(&from, now) {
            if let Some(last) = self.lists.stalled(from, now) {
                tracing::info!(peer = %from, "a member sent a ring hop no honest member sends; leaving it out of the rounds for {last:?}");
                self.abort_counter("left an offender out");
            }
        }
    }

    fn take(&mut self, from: PeerId, msg: RingMessage, now: Instant, out: &mut Vec<Output>) {
        let Some(values) = msg.encoding.decode(&msg.values) else {
            self.refuse(from, "ring hop of odd length".into(), now, out);
            return;
        };
        if !all_finite(&values) {
            self.refuse(
                from,
                "ring hop with NaN or infinite values".into(),
                now,
                out,
            );
            return;
        }
        if let Some(why) = past_limits(&msg) {
            self.refuse(from, why, now, out);
            return;
        }
        if self.too_far(&msg, now) {
            tracing::debug!(peer = %from, round = msg.round, attempt = msg.attempt, "a ring hop further ahead than a member follows; dropped");
            return;
        }
        // A hop is proof that its sender takes part in rounds now.
        self.roster.hop_from(from, now);
        let key = (msg.round, msg.attempt, msg.hop, from);
        let hop = (msg.members, values, msg.step);
        let reducing = matches!(self.attempt.stage, Stage::Reducing { .. });
        match self.attempt.round {
            // A round this node has not reached. Right after a round, a faster member may
            // already be in the next one while this node waits for an aggregate: that hop
            // waits. A member can only have finished an attempt this node takes part in once
            // this node sent its aggregate (in a direct ring, its part), so before that the
            // attempt is not finishing. Otherwise the mesh went on without this node (it
            // joined, was cut off, or aborted an attempt the others completed): `start` takes
            // the mesh's round (with weight 0 only where most members say they are past this
            // one, see `adopt_newer_round`).
            Some(r) if msg.round > r => {
                let finishing = msg.round == r.saturating_add(1)
                    && matches!(&self.attempt.stage, Stage::Reducing { ring: Some(ring), .. } if ring.could_have_finished());
                tracing::debug!(peer = %from, theirs = msg.round, mine = r, attempt = self.attempt.number, finishing, "a hop of a later round");
                self.inbox.keep(key, hop);
                let awaited = matches!(&self.attempt.stage, Stage::Reducing { ring: Some(ring), .. }
                    if ring.index_of(&from).is_some_and(|i| ring.awaits(i)));
                if reducing && !finishing {
                    // Only to take a later round (starting again at the same round and
                    // attempt would send the parts twice): one that two members name, or
                    // most heartbeats. One member's word is weighed against what the
                    // others' hops of the running attempt say ([`Rounds::weigh_lone_claims`],
                    // in `drain`); between attempts it waits for the next one.
                    if self.proven_later_round(now).is_some() {
                        self.restart(now, out);
                    } else if self.moves.has_credit(&from) && self.may_move(from, true) {
                        // An offender went on alone (its aggregate was refused): followed,
                        // it is judged again in the next round (see `may_move`).
                        self.attempt.followed = Some(msg.round);
                        self.restart(now, out);
                    } else {
                        self.drain(now, out);
                    }
                } else if awaited
                    && (self.later_round_to_take(now).is_some() || self.may_move(from, true))
                {
                    // The retry takes its round, as a member that went on says.
                    self.attempt.followed = Some(msg.round);
                    if let Stage::Reducing {
                        ring: Some(ring), ..
                    } = &mut self.attempt.stage
                    {
                        ring.went_on.get_or_insert(now);
                    }
                }
                return;
            }
            None => {
                self.inbox.keep(key, hop);
                if reducing {
                    self.restart(now, out);
                }
                return;
            }
            Some(r) if msg.round < r => {
                if self.far_ahead(now) {
                    tracing::warn!(
                        mine = r,
                        theirs = msg.round,
                        "this node's round is far past the one most members name; taking theirs as a joiner"
                    );
                    let step = self.attempt.boundary;
                    self.restored(step);
                    self.inbox.keep(key, hop);
                }
                return;
            }
            Some(_) if msg.attempt < self.attempt.number => return,
            Some(_) if msg.attempt > self.attempt.number => {
                self.inbox.keep(key, hop);
                if !reducing {
                    self.attempt.number = msg.attempt;
                } else if let Some(attempt) = self.later_attempt_to_take(now) {
                    self.attempt.number = attempt;
                    self.restart(now, out);
                } else if self.may_move(from, false) {
                    self.attempt.number = msg.attempt;
                    self.restart(now, out);
                }
                return;
            }
            Some(_) => {}
        }
        self.inbox.keep(key, hop);
        self.drain(now, out);
    }

    /// Weighs the hops of a later round that members of the running attempt sent, where no
    /// two members (nor most heartbeats) name that round and this node has not sent its
    /// aggregate (so no member can have finished this attempt). Where most of the ring's
    /// other members sent hops of this attempt with this list, the claim contradicts them
    /// ([`Rounds::contradicted`]), unless this node is a joiner in a ring of three (see
    /// below). Otherwise, once for each member ([`Rounds::may_move`]),
    /// the retry after [`super::LATE_ROUND_WAIT`] without progress takes that round.
    /// Followed at once, one member naming the next round to a quarter of the members
    /// (`RingAttack::RelayNextRound`) moved them, and their hops then moved the rest: 55 of
    /// 252 rounds completed in the simulator, at 9.6 x the loss. Answers whether the attempt
    /// was aborted.
    fn weigh_lone_claims(&mut self, now: Instant) -> bool {
        let Some(round) = self.attempt.round else {
            return false;
        };
        let Stage::Reducing {
            ring: Some(ring), ..
        } = &self.attempt.stage
        else {
            return false;
        };
        // Once this node sent its aggregate in an attempt of this round (this one, or one it
        // aborted since), a member may have finished the round honestly.
        if ring.could_have_finished() || self.attempt.aggregated_in == Some(round) {
            return false;
        }
        // A claim whose sender has since sent a hop of this attempt is stale.
        if let Some((claimant, _)) = ring.lone_claim {
            if ring
                .index_of(&claimant)
                .is_some_and(|i| ring.sent_in_attempt(i))
            {
                if let Stage::Reducing {
                    ring: Some(ring), ..
                } = &mut self.attempt.stage
                {
                    ring.lone_claim = None;
                }
            }
        }
        let Stage::Reducing {
            ring: Some(ring), ..
        } = &self.attempt.stage
        else {
            return false;
        };
        let mut claims: Vec<(PeerId, u64)> = Vec::new();
        for &(r, _, _, from) in self.inbox.keys().rev() {
            if r <= round {
                break;
            }
            if from != self.me
                && ring.index_of(&from).is_some()
                && !claims.iter().any(|(p, _)| *p == from)
            {
                claims.push((from, r));
            }
        }
        if claims.is_empty() || self.proven_later_round(now).is_some() {
            return false;
        }
        // In a ring of three the contradiction rests on one other member's hops. A joiner
        // that completed no round here yet took its round on the members' word (their
        // heartbeats or hops, often that very member's): its attempt and one other member's
        // are no proof against a member that finished that round before the joiner was
        // ready (a synced third member's word goes unheard this way too: the claim is then
        // followed once, as one member's word, [`Rounds::may_move`]). Counted as proof, the
        // two joiners of a founder that had just completed a round alone both found it
        // contradicted and left it out, again at each return (`ring_rogue`'s `diloco` tests
        // before the rogue came: the founder out for 10, 20 and 40 s, its rounds apart from
        // theirs, one run in ten). In larger rings the founding members of the simulator,
        // which are joiners too, need the rule as it is.
        let witness = self.standing.synced() || self.counts.completed() > 0 || ring.len() > 3;
        for (x, claimed) in claims {
            let Stage::Reducing {
                ring: Some(ring), ..
            } = &mut self.attempt.stage
            else {
                return false;
            };
            // A member that sent a hop of this attempt is in it: a later round it named
            // before is stale.
            let Some(i) = ring.index_of(&x).filter(|i| !ring.sent_in_attempt(*i)) else {
                continue;
            };
            if witness && ring.in_attempt_besides(i) {
                self.contradicted(x, claimed, now);
                return true;
            }
            if ring.awaits(i) && ring.lone_claim.is_none() && self.may_move(x, true) {
                if let Stage::Reducing {
                    ring: Some(ring), ..
                } = &mut self.attempt.stage
                {
                    ring.lone_claim = Some((x, claimed));
                    ring.went_on.get_or_insert(now);
                }
            }
        }
        false
    }

    /// Member `x` named round `claimed`, which most members' hops of the running attempt
    /// contradict. Nothing shows which is wrong to the others (the hop came to this node
    /// alone), so this node does not leave `x` out of its lists on its own word the first
    /// time: a list of its own would make every attempt of the others abort. It aborts,
    /// names `x` in its heartbeats ([`Rounds::accuse`]), and sits out for
    /// [`CONTRADICTED_SIT_OUT`] (its heartbeat says so at once, and the others retry
    /// without it: no attempt waits on a member that says it is not in rounds). A member
    /// that most members found contradicted is left out by all of them, as their heartbeats
    /// reach each other ([`Rounds::heard`]), and so is one that one member names
    /// [`super::ACCUSED_AGAIN`] times in a row; where this node's own accusation makes
    /// either, it leaves `x` out at once and does not sit out (the sit-out cost the
    /// simulator's `RelayNextRound` row 21 rounds of 252, and 0.30 x of the control's loss).
    /// The sit-out ends early once `x` is left out ([`Rounds::sitting_out`]). No offence:
    /// an honest member that took a later round a moment before the others is contradicted
    /// once, by few.
    pub(super) fn contradicted(&mut self, x: PeerId, claimed: u64, now: Instant) {
        tracing::info!(peer = %x, claimed, round = ?self.attempt.round, "a member named a later round that most members' hops of this attempt contradict");
        self.abort("a member's later round contradicts the others'", now);
        // Its word is not taken this round: its later hops go, and it moves this node no
        // more until a round completes here ([`Rounds::may_move`]).
        let round = self.attempt.round;
        self.inbox
            .retain(|(r, _, _, from)| *from != x || round.is_none_or(|mine| *r <= mine));
        self.moves.contradicted(x);
        // Where this accusation makes most, or names `x` again, the member is left out here
        // at once and the retry goes on without it; otherwise this node steps aside for the
        // round.
        self.accuse(x, now);
        if !self.lists.left_out(&x, now) {
            tracing::info!("sitting out for {CONTRADICTED_SIT_OUT:?}");
            self.stance.sit_out(now + CONTRADICTED_SIT_OUT, Some(x));
            self.abort_counter("sat out a contradicted round");
        }
    }

    /// A new piece of a hop of the running attempt from a member it waits for (naming its
    /// member list) is progress: a large hop on a slow link may take longer than the stall
    /// timeout, piece by piece. (So a member can put off a stall by sending its hop a piece
    /// at a time, at most once per piece: a dozen stall timeouts for a 17 M-parameter
    /// model's largest hop.)
    fn piece_came(
        &mut self,
        from: PeerId,
        (round, attempt, members): (u64, u32, u64),
        now: Instant,
    ) {
        if !self.attempt.is(round, attempt) {
            return;
        }
        if let Stage::Reducing {
            ring: Some(ring), ..
        } = &mut self.attempt.stage
        {
            let awaited = ring.index_of(&from).is_some_and(|i| ring.awaits(i));
            if awaited && members == ring.digest {
                ring.last_progress = now;
            }
        }
    }

    /// Whether `msg` names a round or attempt further ahead than this node follows: a round
    /// more than [`ROUND_JUMP`] past the one most members' heartbeats name
    /// ([`Members::round_said_by_most`]; this node's own where none says one), or a jump to
    /// half the limits or past them by more than [`ROUND_JUMP`] rounds or [`ATTEMPT_JUMP`]
    /// attempts. Followed as far as they named, one member's hops carried every member to
    /// round 2^47 at once, on the way to the limits, where their own hops are offences to
    /// each other; and in `ddp` every member followed with weight 0, so that no round
    /// completed. Not an offence: nothing shows which member is wrong.
    fn too_far(&self, msg: &RingMessage, now: Instant) -> bool {
        let (round, attempt) = match self.attempt.round {
            Some(r) if msg.round < r => return false,
            Some(r) if msg.round == r => (r, self.attempt.number),
            // A later round starts at attempt 0.
            Some(r) => (r, 0),
            None => (0, 0),
        };
        let base = self
            .members(now)
            .round_said_by_most()
            .or(self.attempt.round);
        base.is_some_and(|b| msg.round.saturating_sub(b) > ROUND_JUMP)
            || (msg.round >= FOLLOWED_ROUND_LIMIT && msg.round - round > ROUND_JUMP)
            || (msg.attempt >= FOLLOWED_ATTEMPT_LIMIT
                && msg.attempt.saturating_sub(attempt) > ATTEMPT_JUMP)
    }

    /// Whether this node's round is more than [`ROUND_JUMP`] past the one most members'
    /// heartbeats name: one member's hops carried it there (each within the jump of what
    /// it heard), or its side of a split went on far longer. The others do not follow it
    /// so far, so it gives way: its parameters are no longer the mesh's, and it takes the
    /// mesh's round as a joiner does (weight 0, the members' mean).
    fn far_ahead(&self, now: Instant) -> bool {
        match (self.attempt.round, self.members(now).round_said_by_most()) {
            (Some(r), Some(said)) => r.saturating_sub(said) > ROUND_JUMP,
            _ => false,
        }
    }

    /// Drops the attempt under way (if any; where its lists differed, what they said is
    /// weighed first: [`Rounds::weigh_lists_before_moving_on`]) and starts again at once,
    /// with what the inbox says of the mesh's round and attempt.
    pub(super) fn restart(&mut self, now: Instant, out: &mut Vec<Output>) {
        self.weigh_lists_before_moving_on(now);
        if let Stage::Reducing { ring, .. } = &mut self.attempt.stage {
            *ring = None;
        }
        self.start(now, out);
    }

    /// Takes the hops of the running attempt from the inbox: each member's part of this
    /// member's chunk (judged, then kept for the aggregate) and each owner's aggregate of its
    /// chunk (judged, then copied into the result). With every part in, this member
    /// aggregates its chunk and sends the aggregate to every member; with every aggregate
    /// in, the round is done.
    pub(super) fn drain(&mut self, now: Instant, out: &mut Vec<Output>) {
        let Some(round) = self.attempt.round else {
            return;
        };
        let attempt = self.attempt.number;
        // Hops of older attempts of this round, or of older rounds, are no use any more.
        self.inbox
            .retain(|(r, a, _, _)| *r > round || (*r == round && *a >= attempt));
        let Stage::Reducing {
            ring: Some(ring), ..
        } = &mut self.attempt.stage
        else {
            return;
        };
        let keys: Vec<HopKey> = self
            .inbox
            .keys()
            .filter(|(r, a, _, _)| *r == round && *a == attempt)
            .copied()
            .collect();
        let max_weight = self.cfg.max_weight.min(WEIGHT_LIMIT);
        for key in keys {
            let Some((digest, values, step)) = self.inbox.remove(&key) else {
                continue;
            };
            let (_, _, hop, from) = key;
            if digest != ring.digest {
                // A hop from a peer this member does not list is no part of its attempt (a
                // joiner's, before its heartbeat came; a member this one left out); from a
                // member, the attempt ends once the hops of this member's list are judged.
                if ring.index_of(&from).is_some() {
                    tracing::debug!(peer = %from, theirs = digest, mine = ring.digest, carries_state = ring.carries_state, "a hop naming another member list");
                    ring.other_list(from, digest, now);
                }
                continue;
            }
            let Some(i) = ring.index_of(&from).filter(|i| *i != ring.me) else {
                // The same list leaves the sender out: cannot be honest.
                offence(out, from, "ring hop from outside the ring".into());
                continue;
            };
            match ring.take(i, hop, values, step, max_weight, now) {
                Judged::Taken => {}
                Judged::PartRefused(why) => {
                    offence(out, from, why);
                    self.counts.part_refused();
                }
                Judged::DirectPartRefused(why) => {
                    offence(out, from, why);
                    self.counts.part_refused();
                    self.abort("part refused", now);
                    return;
                }
                Judged::Ends(abort, why) => {
                    if let Some(why) = why {
                        offence(out, from, why);
                    }
                    self.abort(abort, now);
                    return;
                }
                Judged::AggregateRefused(why) => {
                    if let Some(why) = why {
                        offence(out, from, why);
                    }
                    self.aggregate_refused(now);
                    return;
                }
            }
        }
        if self.weigh_lone_claims(now) {
            return;
        }
        let Stage::Reducing {
            ring: Some(ring), ..
        } = &mut self.attempt.stage
        else {
            return;
        };
        if ring.lists_differ_since.is_some() {
            if ring.parts_accounted_for() {
                self.lists_differ(now);
            }
            return;
        }
        if ring.totals[ring.me].is_none() && ring.parts_complete() {
            let (total, clipped) = ring.aggregate_own_chunk(self.cfg.max_weight.is_infinite());
            if clipped > 0 {
                tracing::debug!(
                    round,
                    clipped,
                    "parts beyond the clipping radius of the plain mean"
                );
                self.counts.clipped(clipped);
            }
            self.attempt.aggregated_in = Some(round);
            if !ring.direct() {
                for (peer, msg) in ring.aggregate_messages(round, attempt, total) {
                    self.counts.sent(msg.values.len());
                    out.push(Output::SendRing { peer, msg });
                }
            }
        }
        if ring.complete() {
            // Every honest owner weighs the same parts alike: totals that differ in whether
            // anything counted mean the members were not handed the same weights.
            let counted = ring
                .totals
                .iter()
                .filter(|t| t.is_some_and(|t| t > 0.0))
                .count();
            if counted != 0 && counted != ring.totals.len() && !ring.direct() {
                self.abort("weight totals differ", now);
                return;
            }
            let total = ring.totals[ring.me].unwrap_or(0.0);
            let acc = std::mem::take(&mut ring.acc);
            let (step, carried) = (ring.members_step(), ring.carries_state);
            self.finish(round, acc, total, step, carried, now, out);
        }
    }
}
