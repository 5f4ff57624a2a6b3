//! One attempt's ring and what travels on it: a butterfly all-reduce (each member owns one
//! chunk of the model: every member sends each owner its part of the owner's chunk, the
//! owner aggregates the parts robustly and sends the aggregate to every member), the hop
//! messages (as `wire::hop_values` encodes them, rounded where sent so every member keeps the
//! same bits),
//! the member lists' digest, and a `ddp` member's balanced batch. Arithmetic only:
//! [`super::Rounds`] decides when an attempt starts, goes on or ends.

use std::time::Instant;

use libp2p::PeerId;
use serde_bytes::ByteBuf;
use sha2::{Digest, Sha256};

use p2ptrain_models::params::l2_norm;

use super::robust::{aggregate, distance};
use super::{BALANCE_SLACK, MAX_SHRINK};
use crate::sync_guard::{
    MEAN_GRADIENT_NORM_FACTOR, ROUND_MEAN_MAX_DISTANCE, UNSYNCED_MEAN_NORM_FACTOR,
};
use crate::wire::{Piece, RingMessage, ValueEncoding};

/// The hop that carries a member's part of the receiver's chunk, its weight after it.
pub(super) const PART: u32 = 0;
/// The hop that carries the sender's chunk's aggregate, the weight total after it.
pub(super) const AGGREGATE: u32 = 1;

/// How a member tells a part or an aggregate no honest member sends: by what the trainer
/// would judge the round's result by, so that what is refused here would have been refused
/// there (where nobody could be named).
#[derive(Debug, Clone, Copy)]
pub(super) enum Judge {
    /// A synced member's parameters: a chunk further from this member's own than the round
    /// mean's bound (`ROUND_MEAN_MAX_DISTANCE` of the norm of its whole contribution) alone
    /// puts the mean beyond that bound.
    Distance { norm: f64 },
    /// Parameters that are not the mesh's (a joiner's, an unsynced or founding member's): a
    /// chunk longer than `UNSYNCED_MEAN_NORM_FACTOR` times this member's whole contribution
    /// alone puts the mean beyond the norm bound it is judged by.
    Norm { norm: f64 },
    /// A gradient: a chunk longer than `MEAN_GRADIENT_NORM_FACTOR` times this member's whole
    /// gradient alone puts the mean gradient beyond that bound.
    GradientNorm { norm: f64 },
}

impl Judge {
    /// What a part that weighs nothing (a joiner's, an unsynced member's) is judged by: it
    /// changes no mean, so only what no honest member sends is refused, parameters beyond
    /// the norm bound (an honest member's parameters, however far from the mesh's, are the
    /// model's as initialised, restored or downloaded: of the mesh's size). Unjudged, a
    /// rogue that joined sent what it liked in its parts unblamed, and was caught only by
    /// its aggregates, which it makes only when every member sends it a part: a member that
    /// had banned it sent none, and the others never banned it. A weightless gradient is not
    /// judged (finite is all): a joiner's gradient at its own parameters may be far longer
    /// than a trained member's.
    pub(super) fn for_weightless(self) -> Option<Judge> {
        match self {
            Judge::Distance { norm } | Judge::Norm { norm } => Some(Judge::Norm { norm }),
            Judge::GradientNorm { .. } => None,
        }
    }

    /// How `values` (a chunk) compare with `own` (this member's contribution at that chunk):
    /// `None` when within the bound, else why not.
    pub(super) fn beyond(&self, values: &[f32], own: &[f32]) -> Option<String> {
        match *self {
            Judge::Distance { norm } => {
                let d = distance(values, own);
                (d > ROUND_MEAN_MAX_DISTANCE * norm).then(|| {
                    format!(
                        "a chunk at distance {d:.3e}, beyond {ROUND_MEAN_MAX_DISTANCE} x the norm of this member's parameters ({norm:.3e})"
                    )
                })
            }
            Judge::Norm { norm: own_norm } => {
                let n = l2_norm(values);
                (n > UNSYNCED_MEAN_NORM_FACTOR * own_norm.max(f64::MIN_POSITIVE)).then(|| {
                    format!(
                        "a chunk of norm {n:.3e}, beyond {UNSYNCED_MEAN_NORM_FACTOR} x this member's parameters ({own_norm:.3e})"
                    )
                })
            }
            Judge::GradientNorm { norm: own_norm } => {
                let n = l2_norm(values);
                (n > MEAN_GRADIENT_NORM_FACTOR * own_norm.max(f64::MIN_POSITIVE)).then(|| {
                    format!(
                        "a gradient chunk of norm {n:.3e}, beyond {MEAN_GRADIENT_NORM_FACTOR} x this member's gradient ({own_norm:.3e})"
                    )
                })
            }
        }
    }
}

/// What a hop of the running attempt did to it ([`Ring::take`]).
#[derive(Debug, PartialEq)]
pub(super) enum Judged {
    /// Taken into the attempt.
    Taken,
    /// A part that cannot be honest: it counts for nothing (weight 0), the round goes on,
    /// and its sender offended (why).
    PartRefused(String),
    /// A part refused in a direct ring: the attempt cannot go on (each member aggregates
    /// the whole, so a part one refused and the other kept would leave them apart), and its
    /// sender offended (why).
    DirectPartRefused(String),
    /// The attempt cannot go on: the abort's reason, and the sender's offence where it is to
    /// blame.
    Ends(&'static str, Option<String>),
    /// An aggregate beyond the judge's bound: the sender's offence where it is to blame (it
    /// judges as this member does).
    AggregateRefused(Option<String>),
}

/// One attempt's ring under way.
#[derive(Debug)]
pub(super) struct Ring {
    pub(super) members: Vec<PeerId>,
    pub(super) digest: u64,
    pub(super) me: usize,
    /// This member's contribution (unweighted; rounded chunk by chunk as [`Ring::encoding`]
    /// sends it), then, chunk by chunk as the aggregates come, the result.
    pub(super) acc: Vec<f32>,
    /// This member's weight in the mean.
    pub(super) weight: f32,
    /// What this member judges the parts and aggregates it gets by.
    pub(super) judge: Judge,
    /// They carry the members' round anchor and outer velocity besides the parameters
    /// (`diloco`, when a member needs them); the member digest says so, so that members that
    /// disagree on it abort, as with different lists.
    pub(super) carries_state: bool,
    /// How hops travel: `f32` (parameters), bf16 (gradient rounds, and `diloco` rounds of
    /// outer changes) or int8 (`diloco`'s outer changes, where `sync.outer_values` says). Every
    /// value is rounded where it is sent, the sender's own copy included, so the members
    /// still end bit-identical.
    pub(super) encoding: ValueEncoding,
    /// This member's trainer step when it gave its contribution: what its hops name.
    pub(super) step: u64,
    /// The step each member's counted part named (one that weighed something and was not
    /// refused), by member index, this member's own among them where it weighs something:
    /// what [`Ring::members_step`] takes the members' step from.
    pub(super) part_steps: Vec<Option<u64>>,
    /// The members' parts of this member's chunk (of the whole, in a direct ring), by member
    /// index: values and weight (0 for a part refused).
    pub(super) parts: Vec<Option<(Vec<f32>, f32)>>,
    /// The weights the members' parts of this member's chunk claimed, by member index: a
    /// member whose part weighed something holds the mesh's parameters, and judges by
    /// distance as this one does.
    pub(super) part_weights: Vec<Option<f32>>,
    /// The weight totals of the members' aggregates that came in, by member index (this
    /// member's own once it made it: then it went out, and members may finish the attempt).
    pub(super) totals: Vec<Option<f32>>,
    pub(super) last_progress: Instant,
    /// When a member this attempt still waits for sent a hop of the next round.
    pub(super) went_on: Option<Instant>,
    /// The later round one member's hop named, not yet contradicted, that the retry takes if
    /// this attempt ends for [`Ring::went_on`] (`Rounds::weigh_lone_claims`).
    pub(super) lone_claim: Option<(PeerId, u64)>,
    /// When the first hop naming another member list came: this attempt cannot finish, and
    /// ends once every member of this list sent its part or showed another list (or after
    /// [`super::LISTS_DIFFER_WAIT`]). Until then the parts of this list's members are still
    /// judged: a rogue's part is an offence whatever else becomes of the attempt. (Aborted at
    /// the first such hop, an attempt whose lists never agree, because one member banned a
    /// rogue the others still hear, judged the rogue's parts only when they happened to come
    /// first, and the others never banned it.)
    pub(super) lists_differ_since: Option<Instant>,
    /// The senders of hops naming another list, with the digest each named.
    pub(super) other_lists: Vec<(PeerId, u64)>,
    /// Members that left after completing this round: a member completes a round only after
    /// it sent all its hops of it, and waits for them to be taken before it says goodbye, so
    /// the attempt still finishes without it (see [`super::Rounds::peer_leaving`]).
    pub(super) left_done: Vec<PeerId>,
    /// The trainer step each member's last heartbeat named when the attempt started, by
    /// member index: one it stalls waiting for whose step moved since says it is still
    /// training (see [`super::trust::stall_suspects`]).
    pub(super) steps_said: Vec<Option<u64>>,
    /// When the attempt started: a heartbeat heard since says where its member is now.
    pub(super) started: Instant,
}

impl Ring {
    /// A ring of `members` (sorted), `me` among them, with this member's contribution.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        members: Vec<PeerId>,
        me: usize,
        mut acc: Vec<f32>,
        weight: f32,
        judge: Judge,
        carries_state: bool,
        encoding: ValueEncoding,
        step: u64,
        now: Instant,
    ) -> Ring {
        let n = members.len();
        // Rounded as every receiver decodes it, chunk by chunk as the parts are cut: in a
        // direct ring both members aggregate the whole from the same bits.
        let weight = encoding.round_weight(weight);
        for i in 0..n {
            let range = chunk_range(encoding, n, acc.len(), i);
            encoding.round_as_sent(&mut acc[range]);
        }
        let mut part_steps = vec![None; n];
        if weight > 0.0 {
            part_steps[me] = Some(step);
        }
        Ring {
            digest: members_digest(&members, carries_state),
            members,
            me,
            acc,
            weight,
            judge,
            carries_state,
            encoding,
            step,
            part_steps,
            parts: vec![None; n],
            part_weights: vec![None; n],
            totals: vec![None; n],
            last_progress: now,
            went_on: None,
            lone_claim: None,
            lists_differ_since: None,
            other_lists: Vec::new(),
            left_done: Vec::new(),
            steps_said: vec![None; n],
            started: now,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.members.len()
    }

    /// Two members of a compact round swap their whole contributions in one
    /// message each way and each aggregates the whole (from the same bits, in the members'
    /// order, so both hold the same result), rather than halves in two turns: the same
    /// bytes, half the waits.
    pub(super) fn direct(&self) -> bool {
        direct(self.encoding, self.len())
    }

    /// The members' step, which a node that was not synced (a joiner, a founder) takes with
    /// the mean: the highest step two members' counted parts reach (the only other's in a
    /// ring of two), as rounds and attempts are taken ([`super::members::vouched`]), or the lowest
    /// counted where fewer counted; this member's own where none did. Taken as the highest
    /// step any hop named, one member's word moved every joiner and founder to the end of any
    /// schedule (a step just under the hop bound: its next hops were offences, its next
    /// checkpoint one its own restore refuses).
    pub(super) fn members_step(&self) -> u64 {
        let counted = || {
            self.part_steps
                .iter()
                .zip(&self.members)
                .filter_map(|(step, member)| step.map(|s| (*member, s, true)))
        };
        super::members::vouched(counted(), self.len().saturating_sub(1))
            .or_else(|| counted().map(|(_, s, _)| s).min())
            .unwrap_or(self.step)
    }

    /// The member index of `peer`.
    pub(super) fn index_of(&self, peer: &PeerId) -> Option<usize> {
        self.members.iter().position(|p| p == peer)
    }

    /// The values of the chunk member `i` owns (all of them in a direct ring).
    pub(super) fn chunk_of(&self, i: usize) -> std::ops::Range<usize> {
        chunk_range(self.encoding, self.len(), self.acc.len(), i)
    }

    /// Whether a member may have finished this attempt: each needs this member's aggregate
    /// (in a direct ring, its part, sent at the start).
    pub(super) fn could_have_finished(&self) -> bool {
        self.direct() || self.totals[self.me].is_some()
    }

    /// Whether this attempt still waits for a hop from member `i`.
    pub(super) fn awaits(&self, i: usize) -> bool {
        self.awaits_part(i) || (i != self.me && !self.direct() && self.totals[i].is_none())
    }

    /// Whether this attempt still waits for member `i`'s part of this member's chunk.
    pub(super) fn awaits_part(&self, i: usize) -> bool {
        i != self.me && self.totals[self.me].is_none() && self.parts[i].is_none()
    }

    /// Takes member `i`'s hop `hop` (its values with the weight last, and the step it
    /// carries) into this attempt, judged as [`Judged`] says: a hop out of turn or of the
    /// wrong size ends the attempt; a part weighing more than `max_weight`, or beyond the
    /// judge's bound, counts for nothing; an aggregate weighing more than the members can,
    /// or 0 where this member's part counted, ends it; one beyond the bound is refused.
    pub(super) fn take(
        &mut self,
        i: usize,
        hop: u32,
        mut values: Vec<f32>,
        step: u64,
        max_weight: f32,
        now: Instant,
    ) -> Judged {
        let expected = match hop {
            PART if self.totals[self.me].is_none() && self.parts[i].is_none() => {
                self.chunk_of(self.me)
            }
            AGGREGATE if !self.direct() && self.totals[i].is_none() => self.chunk_of(i),
            // A second part, an aggregate of a direct ring, a hop no ring has.
            _ => {
                return Judged::Ends(
                    "hop out of turn",
                    Some(format!("ring hop {hop} out of turn")),
                )
            }
        };
        if values.len() != expected.len() + 1 {
            let why = format!(
                "ring hop of {} values where {} belong",
                values.len(),
                expected.len() + 1
            );
            return Judged::Ends("hop of the wrong size", Some(why));
        }
        let weight = values.pop().unwrap_or(0.0);
        let own = &self.acc[expected.clone()];
        let mut judged = Judged::Taken;
        if hop == PART {
            self.part_weights[i] = Some(weight);
            // A part that cannot be honest counts for nothing; the round goes on.
            let refused = if !(0.0..=max_weight).contains(&weight) {
                Some(format!(
                    "a ring part weighing {weight}, past what a member weighs ({max_weight})"
                ))
            } else {
                let judge = if weight > 0.0 {
                    Some(self.judge)
                } else {
                    self.judge.for_weightless()
                };
                judge
                    .and_then(|j| j.beyond(&values, own))
                    .map(|why| format!("a ring part refused: {why}"))
            };
            let weight = match refused {
                Some(why) if self.direct() => return Judged::DirectPartRefused(why),
                Some(why) => {
                    judged = Judged::PartRefused(why);
                    0.0
                }
                None => weight,
            };
            if weight > 0.0 {
                self.part_steps[i] = Some(step);
            }
            self.parts[i] = Some((values, weight));
        } else {
            let most = max_weight * self.len() as f32 * (1.0 + 1e-5);
            if !(0.0..=most).contains(&weight) {
                let why = format!(
                    "a ring aggregate of weight total {weight}, past what its {} members weigh",
                    self.len()
                );
                return Judged::Ends("weight total past the members' weights", Some(why));
            }
            // Its owner is to blame only where it judges as this member does: a synced
            // member (its part here weighed something). An unsynced owner judges by norm
            // alone, and may have let in what this member would not.
            let judges_alike = self.part_weights[i].is_some_and(|w| w > 0.0);
            if weight == 0.0 && self.weight > 0.0 {
                // This member's part weighed something, and an owner that judges as this
                // member does refuses no part this member sends: one that counts nothing
                // aborts the attempt (the totals differ), and unpunished it could do so at
                // every attempt.
                let why = judges_alike.then(|| {
                    format!(
                        "a ring aggregate of weight total 0, though this member's part weighed {}",
                        self.weight
                    )
                });
                return Judged::Ends("weight total of 0", why);
            }
            if let Some(why) = (weight > 0.0)
                .then(|| self.judge.beyond(&values, own))
                .flatten()
            {
                let why = judges_alike.then(|| format!("a ring aggregate refused: {why}"));
                return Judged::AggregateRefused(why);
            }
            self.acc[expected].copy_from_slice(&values);
            self.totals[i] = Some(weight);
        }
        self.last_progress = now;
        judged
    }

    /// Every part of this member's chunk came: aggregates them with its own ([`aggregate`],
    /// `bound_weights` where nothing else bounds a member's weight: `fedavg`'s samples),
    /// keeps the result as its chunk, and answers the weight total and how many parts were
    /// clipped.
    pub(super) fn aggregate_own_chunk(&mut self, bound_weights: bool) -> (f32, usize) {
        let me = self.me;
        let range = self.chunk_of(me);
        let parts = std::mem::replace(&mut self.parts, vec![None; self.members.len()]);
        let own = self.acc[range.clone()].to_vec();
        let refs: Vec<(&[f32], f32)> = parts
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                _ if i == me => (own.as_slice(), self.weight),
                Some((v, w)) => (v.as_slice(), *w),
                None => (&[][..], 0.0),
            })
            .collect();
        let agg = aggregate(&refs, range.len(), bound_weights);
        self.acc[range].copy_from_slice(&agg.mean);
        self.totals[me] = Some(agg.total);
        (agg.total, agg.clipped)
    }

    /// Whether member `i` sent a hop of this attempt naming this list (a part, taken or
    /// refused, or an aggregate): it is in this attempt.
    pub(super) fn sent_in_attempt(&self, i: usize) -> bool {
        self.part_weights[i].is_some() || self.totals[i].is_some()
    }

    /// Whether most of the members other than this one and member `i` sent a hop of this
    /// attempt naming this list: they are in this attempt, so a member that says it
    /// finished the round contradicts them.
    pub(super) fn in_attempt_besides(&self, i: usize) -> bool {
        let others: Vec<usize> = (0..self.len())
            .filter(|j| *j != self.me && *j != i)
            .collect();
        let sent = others.iter().filter(|j| self.sent_in_attempt(**j)).count();
        !others.is_empty() && sent * 2 > others.len()
    }

    /// `from` sent a hop naming another member list, of digest `digest`.
    pub(super) fn other_list(&mut self, from: PeerId, digest: u64, now: Instant) {
        self.lists_differ_since.get_or_insert(now);
        if !self.other_lists.iter().any(|(p, _)| *p == from) {
            self.other_lists.push((from, digest));
        }
    }

    /// The member of this list that most of its other members (that one counted among them)
    /// left out of theirs (their hops named this list without it, with or without the
    /// state), if there is one: they banned it, or cannot reach it. One rogue alone is never
    /// most (and in a ring of three, no member is left out this way: of the two others, one
    /// is the member named).
    pub(super) fn left_out_by_most(&self) -> Option<PeerId> {
        let others = self.len() - 1;
        (0..self.len())
            .filter(|i| *i != self.me)
            .map(|i| self.members[i])
            .find(|x| {
                let without: Vec<PeerId> =
                    self.members.iter().filter(|p| *p != x).copied().collect();
                let named = [
                    members_digest(&without, false),
                    members_digest(&without, true),
                ];
                let by = self
                    .other_lists
                    .iter()
                    .filter(|(p, d)| p != x && self.members.contains(p) && named.contains(d))
                    .count();
                by * 2 > others
            })
    }

    /// The peer among `candidates` that most of this list's other members put in their
    /// lists besides this list's members (their hops named this list with it added, with or
    /// without the state), if there is one; `not_in_rounds`, members outside this list that
    /// said they are not in rounds, count among the members and list no one. In a ring of
    /// two with no such member, the other member's word.
    pub(super) fn listed_by_most(
        &self,
        candidates: impl Iterator<Item = PeerId>,
        not_in_rounds: &[PeerId],
    ) -> Option<PeerId> {
        candidates.into_iter().find(|x| {
            if self.members.contains(x) {
                return false;
            }
            let absent = not_in_rounds
                .iter()
                .filter(|p| *p != x && !self.members.contains(p))
                .count();
            let others = self.len() - 1 + absent;
            let mut with: Vec<PeerId> = self.members.clone();
            with.push(*x);
            with.sort();
            let named = [members_digest(&with, false), members_digest(&with, true)];
            let by = self
                .other_lists
                .iter()
                .filter(|(p, d)| {
                    *p != self.members[self.me] && self.members.contains(p) && named.contains(d)
                })
                .count();
            by * 2 > others
        })
    }

    /// The member of this list whose hops named a list that no other member named and that
    /// nothing explains: not this list with one member fewer, nor with one of `known` (the
    /// peers this member heard of) more, nor this list with the other choice of carrying
    /// the state (a need heard late), if there is one ([`super::lists::Verdict::Unmatched`]).
    pub(super) fn unmatched_list(&self, known: &[PeerId]) -> Option<PeerId> {
        let digests = |list: &[PeerId]| [members_digest(list, false), members_digest(list, true)];
        let mut explained: Vec<u64> = vec![members_digest(&self.members, !self.carries_state)];
        for x in &self.members {
            let without: Vec<PeerId> = self.members.iter().filter(|p| *p != x).copied().collect();
            explained.extend(digests(&without));
        }
        for c in known.iter().filter(|c| !self.members.contains(c)) {
            let mut with = self.members.clone();
            with.push(*c);
            with.sort();
            explained.extend(digests(&with));
        }
        self.other_lists
            .iter()
            .filter(|(p, d)| {
                self.members.contains(p)
                    && !explained.contains(d)
                    && !self
                        .other_lists
                        .iter()
                        .any(|(q, e)| q != p && e == d && self.members.contains(q))
            })
            .map(|(p, _)| *p)
            .min()
    }

    /// The other members that sent neither their part of this member's chunk (taken or
    /// refused) nor a hop naming another list: what of this attempt is left to judge.
    fn unaccounted(&self) -> impl Iterator<Item = &PeerId> {
        (0..self.len())
            .filter(|&i| {
                i != self.me
                    && self.part_weights[i].is_none()
                    && !self.other_lists.iter().any(|(p, _)| *p == self.members[i])
            })
            .map(|i| &self.members[i])
    }

    /// Whether each other member sent its part of this member's chunk (taken or refused) or
    /// a hop naming another list: nothing more of this attempt is left to judge.
    pub(super) fn parts_accounted_for(&self) -> bool {
        self.unaccounted().next().is_none()
    }

    /// Whether each other member but `x` sent its part or a hop naming another list: only
    /// `x`'s hops are missing, which no verdict on `x` counts ([`Ring::left_out_by_most`]).
    pub(super) fn parts_accounted_for_but(&self, x: &PeerId) -> bool {
        self.unaccounted().all(|p| p == x)
    }

    /// Whether every part of this member's chunk is in.
    pub(super) fn parts_complete(&self) -> bool {
        (0..self.len()).all(|i| i == self.me || self.parts[i].is_some())
    }

    /// Whether the result is complete.
    pub(super) fn complete(&self) -> bool {
        self.totals[self.me].is_some() && (self.direct() || self.totals.iter().all(Option::is_some))
    }

    /// The parts to send at the start: member `i`'s chunk of this member's contribution,
    /// with its weight, to each other member.
    pub(super) fn part_messages(&self, round: u64, attempt: u32) -> Vec<(PeerId, RingMessage)> {
        (0..self.len())
            .filter(|i| *i != self.me)
            .map(|i| {
                let values = &self.acc[self.chunk_of(i)];
                let msg = self.message(round, attempt, PART, values, self.weight);
                (self.members[i], msg)
            })
            .collect()
    }

    /// This member's aggregate, with its weight total, to each other member (rounded as sent
    /// in place first, so this member keeps what the others get).
    pub(super) fn aggregate_messages(
        &mut self,
        round: u64,
        attempt: u32,
        total: f32,
    ) -> Vec<(PeerId, RingMessage)> {
        let range = self.chunk_of(self.me);
        self.encoding.round_as_sent(&mut self.acc[range.clone()]);
        let values = &self.acc[range];
        let msg = self.message(round, attempt, AGGREGATE, values, total);
        (0..self.len())
            .filter(|i| *i != self.me)
            .map(|i| (self.members[i], msg.clone()))
            .collect()
    }

    fn message(
        &self,
        round: u64,
        attempt: u32,
        hop: u32,
        values: &[f32],
        last: f32,
    ) -> RingMessage {
        RingMessage {
            round,
            attempt,
            members: self.digest,
            hop,
            values: ByteBuf::from(self.encoding.encode(values, last)),
            step: self.step,
            encoding: self.encoding,
            piece: Piece::WHOLE,
        }
    }
}

/// Whether a ring of `members` swaps whole contributions (see [`Ring::direct`]): two members
/// whose hops are compact (a ring of two in `f32` still halves its chunks).
fn direct(encoding: ValueEncoding, members: usize) -> bool {
    encoding != ValueEncoding::F32 && members == 2
}

/// Member `i`'s chunk of a contribution of `len` values in a ring of `members`: the whole in a
/// direct ring.
fn chunk_range(
    encoding: ValueEncoding,
    members: usize,
    len: usize,
    i: usize,
) -> std::ops::Range<usize> {
    if direct(encoding, members) {
        return 0..len;
    }
    let n = members.max(1);
    (i * len / n)..((i + 1) * len / n)
}

/// Digest of a sorted member list, and of whether the attempt carries the state.
pub(in crate::mesh_core) fn members_digest(members: &[PeerId], carries_state: bool) -> u64 {
    let mut h = Sha256::new();
    for m in members {
        h.update(m.to_bytes());
    }
    if carries_state {
        h.update(b"+state");
    }
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().unwrap_or_default())
}

/// Whether every value is finite: a sum over all of them (no early exit), which vectorises.
pub(super) fn all_finite(values: &[f32]) -> bool {
    values
        .iter()
        .fold(0u32, |bad, v| bad | u32::from(!v.is_finite()))
        == 0
}

/// The batch a `ddp` member takes so that its forward-backward ends with the fastest
/// member's: `batch` when it is within [`BALANCE_SLACK`] of the fastest (or when its own speed
/// is not known yet), else the samples it computes in the time the fastest computes `batch`,
/// never below `batch / MAX_SHRINK` nor one sample. `others` are the members'
/// milliseconds per sample; a value that is not a positive number is passed over.
pub fn balanced_batch(batch: usize, own: Option<f64>, others: impl Iterator<Item = f64>) -> usize {
    let Some(own) = own.filter(|v| v.is_finite() && *v > 0.0) else {
        return batch;
    };
    let fastest = others
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(own, f64::min);
    if own <= fastest * (1.0 + BALANCE_SLACK) {
        return batch;
    }
    let fits = (batch as f64 * fastest / own).floor() as usize;
    fits.clamp((batch / MAX_SHRINK).max(1), batch.max(1))
}
