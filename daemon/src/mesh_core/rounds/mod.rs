//! Synchronous rounds, for the sync modes `allreduce`, `ddp`, `diloco` and `fedavg`.
//!
//! # A round
//!
//! Every `steps` steps each member stops at the round's boundary, and the members average a weighted copy
//! of their parameters in a butterfly all-reduce (each member owns one chunk of the model;
//! every member sends each owner its part of that chunk, the owner aggregates the parts and
//! sends the aggregate to every member: each member sends `2(N-1)/N` of the model per round,
//! as in a ring, in two waves instead of `2(N-1)` turns), and every member hands its trainer
//! the same mean, bit for bit, because each chunk is aggregated once, by its owner, and then
//! copied. The aggregate is robust to one bad part among three or more ([`robust`]: weights
//! bounded, then CenteredClip), and each member judges every part and aggregate it gets by
//! the bound the trainer judges the round's result by: a part beyond it counts for nothing,
//! an aggregate beyond it aborts the attempt, and either is an offence of its sender (a
//! score penalty, so a ban). What the trainer makes of the mean (take it, or an outer
//! Nesterov step towards it) is the trainer's business ([`super::TrainerCommand::Combine`]).
//!
//! # Who is in a ring, and when an attempt gives way
//!
//! No member leads. The ring of an attempt is the sorted list of members each node holds ready
//! (heard saying so within [`READY_FRESH`]); every hop carries a digest of the sender's list,
//! and lists that differ abort the attempt (once the parts of this node's list are judged,
//! see [`LISTS_DIFFER_WAIT`]), which is retried with the next number after [`RETRY_PAUSE`]
//! (by then heartbeats have made the lists agree). A member that dies aborts
//! the attempt at once when its connection closes or a hop to it cannot be delivered, and
//! after [`STALL_TIMEOUT`] without progress otherwise; the retry leaves it out. An attempt that
//! can no longer finish because its members went on to the next round without this node gives
//! way at once where two members' hops (or most heartbeats) name that round, or
//! [`LATE_ROUND_WAIT`] after the first hop of the next round from a member it still waits
//! for, without progress since, once for each member ([`Rounds::may_move`]: followed every
//! time, a rogue drags the mesh on). One member's hop of the next round that most of the
//! others' hops of the running attempt contradict (they are still in it) is not followed:
//! the member that got it sits out briefly and names the sender in its heartbeats, and a
//! sender most members name is left out by all of them ([`Rounds::contradicted`]; followed
//! at once, a rogue naming the next round to a few members only moved them, and their hops
//! the rest). So is a member one member names again ([`ACCUSED_AGAIN`]): a rogue that lies
//! to the same few members every round, or withholds its part from one of them, is never
//! named by most. In a direct ring of two, whose parts are all there is, an attempt always
//! waits. It gives up its weight for that round only when most
//! members' heartbeats say they are past its own, or in a gradient round (one member's hop
//! is no proof, see [`Rounds::adopt_newer_round`]).
//!
//! # Joiners, founders and `diloco`'s state
//!
//! A joiner (or a
//! node restored from a checkpoint) holds before its first step, takes the round number of the
//! first hop that reaches it, and contributes with weight 0: it leaves the round with the
//! members' mean, that is the current state, at a round boundary. A parameter attempt whose
//! members are all unsynced (weights summing to 0) founds one state instead: each marks
//! itself synced and the round is retried with their parameters at full weight. In `diloco`
//! ([`RoundConfig::outer_state`]) the members' outer steps also need one round start and one
//! velocity: a member without them says so in its heartbeats, and the parameter attempts of
//! a ring with such a member carry every member's start and velocity too (the member digest
//! covers that choice, so members that disagree on it abort as on different lists). A ring
//! that carries no state sums the members' outer changes (round start minus parameters)
//! instead of their parameters, as bf16 or int8 ([`RoundConfig::sums_outer_changes`]): the
//! members share the start, and each leaves with it minus the mean change.
//!
//! # `ddp`
//!
//! In `ddp` ([`RoundConfig::gradients`]) there is a round at every step and most rounds sum
//! gradients, not parameters: the trainer steps only with a round's mean gradient. Those hops
//! travel as bf16 (rounded where sent, so the bits still agree), and a ring of two swaps whole
//! contributions in one message each way (each aggregates both, in the members' order). Every `resync_every`-th round sums parameters and
//! optimizer state, and hands a node that was not synced the members' step with them. No round
//! starts with fewer than [`RoundConfig::min_members`] members. With
//! [`RoundConfig::balance`], a member that computes slower than the fastest (by the
//! milliseconds per sample each puts in its heartbeats) is asked for a smaller batch, the one
//! it computes while the fastest computes the whole batch ([`balanced_batch`]), and its
//! gradient weighs by its samples, so the mean is still the gradient of every sample computed.
//!
//! # Rooms
//!
//! `Rounds` runs the attempts; where it is and what it reads and remembers lives in rooms
//! that each own one thing: [`config`] what the sync config decides for the rounds;
//! [`attempt`] the round, attempt, boundary and stage it is at;
//! [`roster`] records what members said and decides nothing; [`members`] counts the
//! members the roster heard as this node's lists leave them (and reads their word: is the
//! mesh past a round, what do hops vouch for); [`follow`] which later round or attempt
//! the hops make it take; [`trust`] decides whom a stall suspects,
//! leaves out or accuses, and whom this node blames; [`lists`] and
//! [`stance`] what differing lists and accusations make it do; [`standing`] whether its own
//! parameters and state are the members'; [`moves`] whose hops may move it on; [`starts`]
//! when an attempt may start; [`work`] its own speed, batch and gradient scale; [`inbox`] the
//! hops it keeps; [`counts`] what status counts.
//!
//! # Rules
//!
//! Each with the tests in `tests.rs` that show it (the rooms' own rules are numbered in their
//! docs: [`trust`], [`members`], [`follow`], [`lists`], [`stance`], [`roster`], [`moves`]):
//! 1. Every member ends a round with the same bits of the weighted mean, in gradient rounds
//!    too, where bf16 rounds as `half` does
//!    (`every_member_ends_a_round_with_the_same_bits_of_the_weighted_mean`,
//!    `gradient_rounds_follow_a_parameter_round_and_end_identical_in_bf16`,
//!    `bf16_rounding_matches_half_and_round_trips`).
//! 2. No round starts with fewer than `min_members` members, nor in a ring smaller than the
//!    members heard sitting out (`rounds_wait_for_the_minimum_of_members`,
//!    `a_member_completes_no_round_alone_while_most_members_sit_out`).
//! 3. A member that dies aborts the attempt and the retry leaves it out; one that leaves
//!    after completing the round does not abort it
//!    (`a_member_that_dies_aborts_the_round_and_the_retry_leaves_it_out`,
//!    `a_member_that_leaves_after_completing_the_round_does_not_abort_it`).
//! 4. A ring without a synced member founds one state, but a joiner alone not beside a
//!    member it could not reach; a joiner takes the round and leaves it with the members'
//!    mean; one member's step moves no joiner or founder past the others; a member the mesh
//!    went on without takes its round with weight 0
//!    (`a_ring_without_a_synced_member_founds_one_state`,
//!    `a_joiner_founds_no_state_alone_beside_a_member_it_could_not_reach`,
//!    `a_joiner_adopts_the_round_and_leaves_it_with_the_members_mean`,
//!    `one_members_step_moves_no_joiner_or_founder_past_the_others`,
//!    `a_member_the_mesh_went_on_without_takes_its_round_with_weight_zero`).
//! 5. Later rounds are followed on the members' word, not one hop's
//!    (`an_attempt_without_hops_gives_way_to_a_member_already_in_the_next_round`,
//!    `one_members_hop_of_a_later_round_hijacks_nothing`,
//!    `a_member_behind_takes_the_round_most_heartbeats_name_not_one_hops_newer_one`,
//!    `a_last_hop_that_never_comes_gives_way_to_the_next_round_soon`,
//!    `a_last_hop_that_comes_after_the_next_rounds_first_still_completes_the_round`,
//!    `hops_carry_a_member_no_further_than_a_jump_past_what_most_members_say`,
//!    `no_member_follows_a_hop_to_counters_near_their_limits`).
//! 6. A later round most members' hops contradict is not followed: its sender is accused, and
//!    left out where most accuse it or one accuses it again; a joiner is no witness
//!    (`a_later_round_most_members_contradict_is_not_followed`,
//!    `a_member_most_found_contradicted_is_left_out_and_fewer_accusers_are_not_enough`,
//!    `a_member_one_member_accuses_again_is_left_out`,
//!    `a_joiner_in_a_ring_of_three_is_no_witness_against_a_member_a_round_ahead`).
//! 7. A hop no honest member sends is an offence and never reaches the mean
//!    (`a_hop_past_any_meshs_round_attempt_or_step_is_an_offence_and_changes_nothing`,
//!    `hostile_hops_are_offences_and_never_reach_the_mean`,
//!    `one_hostile_member_of_four_poisons_no_round`,
//!    `a_weight_past_what_a_member_weighs_is_refused`,
//!    `an_aggregate_that_counts_nothing_is_an_offence`,
//!    `a_weightless_part_no_honest_member_sends_is_an_offence`,
//!    `a_rogue_that_tells_each_member_something_else_moves_them_a_bounded_amount`,
//!    `a_member_that_is_not_synced_refuses_a_huge_aggregate_too`,
//!    `a_direct_ring_aborts_on_a_refused_part`,
//!    `a_rogue_poisons_no_part_of_a_diloco_round_that_carries_the_state`).
//! 8. Lists that differ are judged after the parts, and settled by most members' word
//!    (`parts_are_judged_before_an_attempt_aborts_on_lists_that_differ`,
//!    `a_member_outvoted_on_a_peer_it_left_out_sits_out_and_the_rest_go_on`,
//!    `a_member_heard_sitting_out_counts_among_the_members_a_sit_out_needs_most_of`,
//!    `a_member_most_others_left_out_is_left_out`,
//!    `a_member_moved_on_while_its_lists_differ_still_weighs_them`,
//!    `a_member_back_fresh_follows_a_leave_out_it_never_weighed_a_whole_attempt_of`,
//!    `a_member_whose_list_is_nobody_elses_is_left_out_without_blame`).
//! 9. A stall leaves out the member it waited for at the boundary, excuses one still
//!    training, and holds the node that would leave out every member
//!    (`a_member_an_attempt_stalls_on_at_the_boundary_is_left_out_for_longer_each_time`,
//!    `a_member_still_training_towards_the_boundary_is_waited_for_not_left_out`,
//!    `a_member_that_says_it_trains_is_excused_only_twice_a_round`,
//!    `a_member_missing_several_owners_aggregates_leaves_out_none_of_them`,
//!    `a_member_that_sits_out_while_awaited_is_excused_as_a_staller_is`,
//!    `a_member_that_would_leave_out_every_other_member_holds_instead`).
//! 10. `diloco` carries the state only while a member needs it, and otherwise sums outer
//!     changes (`a_diloco_ring_carries_the_state_only_while_a_member_needs_it`,
//!     `diloco_members_sharing_a_round_start_sum_their_outer_changes_compactly`,
//!     `a_synced_diloco_member_trains_on_through_its_round_up_to_the_overlap`,
//!     `a_need_for_the_state_named_at_an_earlier_round_is_stale`,
//!     `a_carried_round_meets_the_needs_heard_before_it`,
//!     `a_diloco_node_that_starts_the_rounds_itself_still_needs_the_state`,
//!     `a_diloco_member_that_took_a_later_rounds_number_unproven_asks_for_the_state`).
//! 11. `ddp` balances batches by speed and judges gradients by a scale no member shrinks
//!     (`a_slower_member_takes_the_batch_it_computes_while_the_fastest_computes_its_own`,
//!     `a_balanced_gradient_round_weighs_each_member_by_its_samples`,
//!     `a_tiny_own_gradient_does_not_shrink_the_scale_others_are_judged_by`).
//! 12. The inbox is bounded, and a flooding sender evicts only its own hops
//!     (`the_inbox_keeps_at_most_its_bound_in_values_oldest_out_first`,
//!     `a_flooding_sender_evicts_only_its_own_hops_from_the_inbox`).
//! 13. A member's digest claims only what a ring proved: none while unsynced, none for a
//!     lone member's round, and a refused mean unsyncs only after several in a row
//!     (`an_unsynced_member_claims_no_digest_until_a_parameter_round_syncs_it`,
//!     `a_lone_members_round_claims_no_digest_and_a_rings_names_its_members`,
//!     `a_refused_mean_leaves_members_synced_until_they_refused_several_in_a_row`).
//! 14. This list names every test of the room's own, and no other
//!     (`the_module_docs_rules_name_every_test_here`).
//!
//! Pure state: the core feeds it and carries out what it returns.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::PeerId;

use super::status::RoundStatus;
use super::{Output, TrainerCommand, HEARTBEAT_EVERY};
use crate::wire::Heartbeat;
use crate::wire::{largest_hop_values, ValueEncoding};
use attempt::{Attempt, Stage};
use config::RoundConfig;
use contribution::{outer_change, parameters_after, parameters_only};
use counts::RoundCounts;
use inbox::Inbox;
use lists::{Action, Lists, Verdict};
use members::Members;
use moves::Moves;
#[cfg(test)]
pub(in crate::mesh_core) use ring::members_digest;
use ring::{Judge, Ring};
use roster::Roster;
use stance::Stance;
use standing::Standing;
use starts::Starts;
use trust::{Awaited, Stall, Trust};
use work::Work;

pub use ring::balanced_batch;

mod attempt;
pub mod config;
mod contribution;
mod counts;
mod follow;
mod hops;
mod inbox;
pub mod lists;
mod members;
mod moves;
pub mod pieces;
mod ring;
pub mod robust;
mod roster;
mod stance;
mod standing;
mod starts;
#[cfg(test)]
mod tests;
mod times;
mod trust;
mod work;

/// A member heard ready within this long is put in the ring: three heartbeats, so one lost
/// heartbeat does not drop it, while a hung member falls out of the next attempt.
pub const READY_FRESH: Duration = Duration::from_secs(3 * HEARTBEAT_EVERY.as_secs());
/// By default, an attempt that made no progress for this long is aborted and retried (a
/// member that hung without closing its connection). An honest member still training towards
/// the boundary costs only a retry, never a punishment. `sync.stall_timeout_secs` sets it.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(20);
/// An attempt that a member it still waits for has sent a hop of the next round, and that
/// made no progress for this long since that hop came, is aborted; the retry takes the
/// mesh's round. The member sent its hops of this round before that one, over the same
/// connection, so one still missing this long after is not coming (the member finished the
/// round in an attempt this node left).
pub const LATE_ROUND_WAIT: Duration = Duration::from_secs(2);
/// An attempt that got a hop naming another member list waits at most this long for the
/// parts of its own list's members, to judge them, before it aborts (see
/// `Ring::lists_differ_since`): the members of one list start an attempt within a tick or
/// two of each other ([`RETRY_PAUSE`] after the same abort).
pub const LISTS_DIFFER_WAIT: Duration = Duration::from_millis(500);
/// Attempts of one round a member's hops may make this node give up for later ones
/// ([`Rounds::may_move`]). Two would follow an honest member that aborts alone twice in a
/// round (rare: an abort for lists that differ or a member gone is every member's), but
/// they let a rogue naming the next attempt cost two restarts a round, forever, never left
/// out (the simulator: `ddp` at 53% of the control's rounds, against 78% with one).
const ATTEMPT_MOVES: u32 = 1;
/// A member that found a later round contradicted ([`Rounds::contradicted`]) sits out this
/// long: the others complete the round without it meanwhile (one that is not in it rarely
/// takes longer), and it comes back to their next one.
pub const CONTRADICTED_SIT_OUT: Duration = LATE_ROUND_WAIT;
/// A member says in its heartbeats for this long that it found a peer's later round
/// contradicted, or left it out for a part it withheld ([`Rounds::accuse`]); the others
/// count such accusations for as long ([`lists`]).
pub const ACCUSATION_KEPT: Duration = Duration::from_secs(60);
/// A member that one member accused this many times in a row (each within
/// [`ACCUSATION_KEPT`] of the one before) is left out by every member that hears it
/// ([`Rounds::leave_out_accused_again`]). An honest member is contradicted once, by few,
/// where it took a later round a moment before the others; a rogue that named the next
/// round to the same two or three members of eight every round was never named by most,
/// and each round it made them sit out or stall: in the simulator `allreduce` completed 104
/// of 252 rounds at 7.7 x the control's loss, and `ddp` 20 of 826 with every member
/// unsynced. One accuser can keep one member out at a time (a heartbeat names one), for the
/// back-off of [`lists`]; no more than a member it stalled would be.
pub const ACCUSED_AGAIN: u32 = 2;
/// Peers that went away, remembered (for [`lists`]) at most this many.
const GONE_KEPT: usize = 64;

/// Records `peer` at `at` in a map kept to the newest [`GONE_KEPT`] peers (peers that went
/// away, peers blamed): when full, the one recorded longest ago gives way, so a flood of
/// identities cannot grow it; a peer already there is only renewed.
fn remember_newest(map: &mut HashMap<PeerId, Instant>, peer: PeerId, at: Instant) {
    if map.len() >= GONE_KEPT && !map.contains_key(&peer) {
        if let Some(oldest) = map.iter().min_by_key(|(_, t)| **t).map(|(p, _)| *p) {
            map.remove(&oldest);
        }
    }
    map.insert(peer, at);
}
/// Pause before an aborted attempt is retried, so the members' lists can settle.
pub const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// A node that has no round number yet (it resumed from a checkpoint) and hears no ring for
/// this long while ready starts the rounds itself, at round 0: a whole mesh restarted from
/// checkpoints must not wait for each other forever.
pub const ADOPT_WAIT: Duration = Duration::from_secs(5);
/// Means a synced member refuses in a row before it takes the next one unsynced (judged by
/// norm alone, see `sync_guard::judge_round_mean`): a member whose own parameters drifted
/// far must not refuse the mesh's forever; a member spoiling every round makes the mesh lose
/// them all either way, and decides every fourth.
pub const REFUSALS_BEFORE_UNSYNCED: u32 = 3;
/// Hops kept for an attempt this node has not reached yet.
const INBOX_CAP: usize = 256;
/// Values all the hops kept hold together (256 MiB as `f32`), or for a model whose largest
/// hop ([`largest_hop_values`]) holds more, that many: a member waits for a hop or two of the
/// next round, which arrive before it has taken this round's (the other members' parts of
/// its chunk sum to less than one largest hop). Without a bound in bytes a peer could make
/// it keep 256 hops of a model's share each. The pieces of hops not complete yet
/// ([`pieces`]) have bounds of their own.
const INBOX_VALUES: usize = 64 * 1024 * 1024;
/// A weight no member claims honestly (a `fedavg` sample count of a trillion): a part that
/// claims more is refused. Below it, `fedavg` weights are bounded relative to the others'
/// ([`robust::WEIGHT_SPREAD`]), and `w * x` stays far from `f32`'s range.
const WEIGHT_LIMIT: f32 = 1e12;
/// Rounds no mesh reaches (2^48: 8,900 years at a thousand rounds a second): a hop that names
/// one cannot be honest, and would make the round counter wrap.
const ROUND_LIMIT: u64 = 1 << 48;
/// Attempts no round takes (2^24: a month of retries, each at least [`RETRY_PAUSE`] apart).
const ATTEMPT_LIMIT: u32 = 1 << 24;
/// From this round on, a hop is followed only [`ROUND_JUMP`] rounds at a time (see
/// `hops`): half of [`ROUND_LIMIT`]. Members already past it go on in steps of one.
const FOLLOWED_ROUND_LIMIT: u64 = ROUND_LIMIT / 2;
/// The same for attempts: half of [`ATTEMPT_LIMIT`] (attempts start at 0 every round).
const FOLLOWED_ATTEMPT_LIMIT: u32 = ATTEMPT_LIMIT / 2;
/// A hop naming a round more than this past the one most members' heartbeats name
/// ([`Members::round_said_by_most`]) is not followed, and a member whose own round is that
/// far past it gives way. The heartbeats a member goes by are up to [`READY_FRESH`] (6 s)
/// old, and a `ddp` mesh of a small model completes 40 rounds a second: a jump of 64 left
/// joiners unable to take such a mesh's round; this is ten times what it completes in 6 s.
pub const ROUND_JUMP: u64 = 4096;
/// Past [`FOLLOWED_ATTEMPT_LIMIT`], the most attempts one hop moves a member.
pub const ATTEMPT_JUMP: u32 = 256;
/// Stalls in a round a member waited for is excused while it says it is still training
/// towards the boundary (or said nothing since the attempt started): the next stall leaves it
/// out whatever it says. An honest member more than this many stall timeouts behind the rest
/// of a round (a box far slower than the others, or a `ddp` gradient that takes longer than
/// the timeout) is left out too, and comes back as any member left out does; no offence.
pub const STALL_EXCUSES: u32 = 2;
/// Steps no run reaches (2^48, as a checkpoint's counters are bounded): a hop that carries
/// one cannot be honest, and an unsynced member would take it as its step.
const STEP_LIMIT: u64 = 1 << 48;
/// A `ddp` member whose forward-backward per sample is within this fraction of the fastest
/// member's takes the whole batch: boxes of one kind differ by noise, and a sample dropped
/// for noise costs more per step than the few milliseconds it saves.
pub const BALANCE_SLACK: f64 = 0.1;
/// A `ddp` member's batch is never cut below `batch / MAX_SHRINK` (and never below one
/// sample), whatever the others claim: a peer that says it is very fast cuts honest members'
/// batches (and so their weight beside its own) by this much at most. (A ring member can
/// already scale its own contribution as it likes: the ring trusts its members.)
pub const MAX_SHRINK: usize = 8;
/// A gradient round's parameters are digested only when the round number is a multiple of
/// this (a digest reads every parameter: ~2 ms a step on the 0.83 M GPT); parameter rounds
/// always are.
pub const DIGEST_EVERY: u64 = 10;

/// A hop's place: (round, attempt, hop, sender).
type HopKey = (u64, u32, u32, PeerId);
/// A hop waiting in the inbox: (member-list digest, values, the step it carries).
type Hop = (u64, Vec<f32>, u64);

/// The rounds of one node; see the module docs.
#[derive(Debug)]
pub struct Rounds {
    cfg: RoundConfig,
    me: PeerId,
    /// The round and attempt it is in, where its training stops, the attempt's stage, and
    /// what the last attempts left for the next ([`attempt`]).
    attempt: Attempt,
    /// Whether its parameters (and state) are the members' ([`standing`]).
    standing: Standing,
    /// Hops for attempts this node has not reached, those of the running attempt not taken
    /// yet, and those whose pieces are still coming ([`inbox`]).
    inbox: Inbox,
    /// When an attempt may start ([`starts`]).
    starts: Starts,
    /// What the other members said ([`roster`]): read here, never decided there.
    roster: Roster,
    /// Whom this member excuses for stalls, and whom it blamed ([`trust`]).
    trust: Trust,
    /// Whose hops of later rounds and attempts moved this node, and the offences that buy
    /// further moves ([`moves`], [`Rounds::may_move`]).
    moves: Moves,
    /// Its own speed, batch and gradient scale ([`work`]).
    work: Work,
    /// What attempts whose lists differed said, and what this node did about it.
    lists: Lists,
    /// Whether this node sits out, and whom it accuses ([`stance`], [`lists`],
    /// [`Rounds::contradicted`], [`Rounds::accuse`]).
    stance: Stance,
    /// What status counts ([`counts`]); the rest of [`RoundStatus`] is read off the fields
    /// above.
    counts: RoundCounts,
}

impl Rounds {
    /// Rounds for a node at `step`. A founder (`synced`) starts at round 0 and trains to the
    /// first boundary; a joiner or a resumed node holds at once and adopts the mesh's round.
    pub fn new(cfg: RoundConfig, me: PeerId, step: u64, synced: bool) -> Rounds {
        let cfg = RoundConfig {
            steps: cfg.steps.max(1),
            ..cfg
        };
        // In gradient rounds the trainer takes no step of its own: it is held at its step.
        let boundary = cfg.first_boundary(step, synced);
        Rounds {
            cfg,
            me,
            attempt: Attempt::new(boundary, synced),
            standing: Standing::new(synced),
            inbox: Inbox::with_default_bound(cfg.piece_bytes),
            starts: Starts::default(),
            roster: Roster::default(),
            trust: Trust::default(),
            moves: Moves::default(),
            work: Work::default(),
            lists: Lists::default(),
            stance: Stance::default(),
            counts: RoundCounts::default(),
        }
    }

    /// These rounds for a model of `params` parameters: the inbox and the hops whose pieces
    /// are still coming may each hold one of its largest hops ([`largest_hop_values`]), where
    /// that is more than [`INBOX_VALUES`]; a model's hop the inbox could not hold would be
    /// dropped whenever it came before this node reached its attempt.
    pub fn sized_for(mut self, params: usize) -> Rounds {
        self.inbox = Inbox::new(
            self.cfg.piece_bytes,
            INBOX_VALUES.max(largest_hop_values(params)),
        );
        self
    }

    /// Bytes of values a hop's request carries at most: a larger hop is sent in pieces
    /// ([`crate::wire::RingMessage::into_pieces`]).
    pub fn piece_bytes(&self) -> usize {
        self.cfg.piece_bytes
    }

    /// The highest step the trainer may reach: the round's boundary, or past it by
    /// [`RoundConfig::overlap_steps`] while a round it may train on through runs.
    pub fn step_limit(&self) -> u64 {
        self.attempt.step_limit(self.cfg.overlap_steps)
    }

    /// Whether the trainer may train on while the round it gives `gradient` (or parameters)
    /// to runs: only a synced member's parameters in `diloco` with `overlap_steps`, where the
    /// members share the round start and the outer step's result is the same bits for each,
    /// whatever each trained meanwhile. A joiner, a founder, or one that needs the members'
    /// state takes the members' parameters whole, so it waits.
    fn runs_on(&self, gradient: bool) -> bool {
        self.cfg.overlap_steps > 0
            && self.cfg.outer_state
            && !gradient
            && self.standing.judged()
            && !self.needs_state()
    }

    /// The round under way, once this node knows it.
    pub fn round(&self) -> Option<u64> {
        self.attempt.round
    }

    /// The round a goodbye names: one past the last round whose ring this node completed.
    /// A node whose mean went to the trainer completed that round's ring (every hop it had to
    /// send is sent), even where the trainer's answer is not in yet: the stop can come first,
    /// and an event dropped for a full channel never comes.
    pub fn leaving_round(&self) -> Option<u64> {
        self.attempt.leaving_round()
    }

    /// What status shows.
    pub fn status(&self, now: Instant) -> RoundStatus {
        RoundStatus {
            left_out: self
                .lists
                .left_out_now(now)
                .iter()
                .map(PeerId::to_string)
                .collect(),
            sitting_out: self.sitting_out(now),
            round: self.attempt.round,
            attempt: self.attempt.number,
            ring_size: self.attempt.ring_size,
            completed: self.counts.completed(),
            aborted: self.counts.aborted_by_reason().clone(),
            last_round_ms: self.counts.times().last_ms(),
            batch: self.work.batch(),
            mean_round_ms: self.counts.times().mean_ms(),
            round_seconds: self.counts.times().histogram().clone(),
            bytes_sent: self.counts.bytes_sent(),
            parts_refused: self.counts.parts_refused(),
            parts_clipped: self.counts.parts_clipped(),
            boundary: self.attempt.boundary,
            synced: self.standing.synced(),
            digests: self.counts.digests(),
        }
    }

    /// A member's heartbeat said whether it is ready for rounds, how fast it computes (a
    /// claim that is not a positive number is no claim) and whether it needs the members'
    /// state.
    pub fn heard(&mut self, peer: PeerId, hb: &Heartbeat, now: Instant) {
        // Every accusation is kept (so that the next count is news), except one by a member
        // this node leaves out (one just left out would name its accuser next); it counts
        // where it names a member this node hears ready or has in its ring: a member naming
        // strangers accuses no one. Only a member accuses again.
        let named = hb
            .accused
            .as_deref()
            .and_then(|x| x.parse::<PeerId>().ok())
            .filter(|x| *x != peer && !self.lists.left_out(&peer, now));
        if let Some(x) = named {
            let member =
                hb.in_rounds || self.roster.is_ready(&peer) || self.attempt.ring_has(&peer);
            let again = self.lists.accused(x, peer, hb.accusations, self.me, now);
            if self.roster.is_ready(&x) || self.attempt.ring_has(&x) {
                self.leave_out_if_accused_by_most(x, now);
                if again && member {
                    self.leave_out_accused_again(x, peer, now);
                }
            }
        }
        if !hb.in_rounds {
            // A member that says it is not in rounds sends no more hops: an attempt waiting
            // for one of its hops would only stall. It counts as a stall of that member's
            // (excused `STALL_EXCUSES` times a round, then left out), or a member could put
            // off its leave-out for good by saying so just before each stall timeout.
            let awaited = matches!(&self.attempt.stage, Stage::Reducing { ring: Some(r), .. }
                if r.index_of(&peer).is_some_and(|i| r.awaits(i)));
            if awaited {
                self.abort("a member sat out", now);
                self.excuse_or_leave_out(peer, false, now);
            }
        }
        if hb.in_rounds && hb.round.is_some() {
            self.starts.rounds_heard(now);
        }
        let in_ring = self.attempt.ring_has(&peer);
        self.roster.heard(peer, hb, in_ring, now);
    }

    /// Leaves `x` out (with the back-off of [`lists`]) where most of the members heard ready
    /// (this node among them, `x` not) said in their heartbeats within [`ACCUSATION_KEPT`]
    /// that `x` named them a later round most members' hops contradicted. Each honest member
    /// hears the same heartbeats within moments of each other, so they leave it out
    /// together, and their lists agree. One member's accusations are never most (in a ring of
    /// three or more members).
    pub(super) fn leave_out_if_accused_by_most(&mut self, x: PeerId, now: Instant) {
        if x == self.me || self.lists.left_out(&x, now) {
            return;
        }
        let voters: Vec<PeerId> = self
            .roster
            .fresh(now)
            .filter(|p| *p != x)
            .chain(std::iter::once(self.me))
            .collect();
        if !self.lists.accused_by_most(x, &voters, now) {
            return;
        }
        if let Some(last) = self.lists.left_out_accused(x, now) {
            tracing::info!(peer = %x, "most members accused a member (a later round contradicted, or a part withheld); leaving it out of the rounds for {last:?}");
            self.abort_counter("left out a member most accused");
            if self.attempt.ring_has(&x) {
                self.abort("most members accused a member", now);
            }
        }
    }

    /// Leaves `x` out (with the back-off of [`lists`]) where member `by` accused it
    /// [`ACCUSED_AGAIN`] times in a row, `x` is not left out already, and no other member
    /// `by` accused again is left out on its word now ([`Lists::left_out_again`]): every
    /// member hears `by`'s heartbeat within moments, so they leave it out together, and one
    /// accuser keeps one member out at a time.
    pub(super) fn leave_out_accused_again(&mut self, x: PeerId, by: PeerId, now: Instant) {
        if x == self.me {
            return;
        }
        if let Some(last) = self.lists.left_out_again(x, by, self.me, now) {
            tracing::info!(peer = %x, "a member accused a member again; leaving it out of the rounds for {last:?}");
            self.abort_counter("left out a member accused again");
            if self.attempt.ring_has(&x) {
                self.abort("a member accused a member again", now);
            }
        }
    }

    /// This node found `x`'s later round contradicted ([`Rounds::contradicted`]), or left
    /// `x` out for a part that only it withheld ([`Rounds::stalled`]): its heartbeats name
    /// `x` for [`ACCUSATION_KEPT`], with how many times in a row, and it counts its own
    /// accusation as the others do.
    pub(super) fn accuse(&mut self, x: PeerId, now: Instant) {
        let times = self.stance.accuse(x, now);
        let again = self.lists.accused(x, self.me, times, self.me, now);
        self.leave_out_if_accused_by_most(x, now);
        if again {
            self.leave_out_accused_again(x, self.me, now);
        }
    }

    /// The member this node accused within [`ACCUSATION_KEPT`], and how many times in a
    /// row, for its heartbeats.
    pub fn accusation(&self, now: Instant) -> Option<(PeerId, u32)> {
        self.stance.accusation(now)
    }

    /// The other members as this node counts them at `now` ([`members`]).
    fn members(&self, now: Instant) -> Members<'_> {
        Members::new(&self.roster, &self.lists, self.me, now)
    }

    /// Whether `from`'s hop of a later round (`to_round`) or attempt may make this node give
    /// up the attempt under way for it: once for a round, or [`ATTEMPT_MOVES`] times for
    /// attempts, for each member until a round completes here, the attempts' count also
    /// starting again each time this node aborts an attempt for a reason of its own (not a
    /// stall or a wait for members that went on); and once more for each offence of the
    /// member since then (a round claimed by a member with an offence credit is followed at
    /// once; any other member's, only where nothing contradicts it, after
    /// [`LATE_ROUND_WAIT`] without progress: [`Rounds::weigh_lone_claims`]). In an honest
    /// mesh a member that aborted alone goes on to the next attempt, and the others follow
    /// its attempt at once rather than wait for a stall (while members'
    /// lists settle, many times a round: each time they abort too); but a rogue whose hops
    /// always named the round or attempt after its own dragged every member on, one restart
    /// per hop, and no round completed (the simulator: 0 rounds in 40 s, in every mode). A
    /// hop not followed waits in the inbox: the member that sent it is then one the attempt
    /// stalls on, and is left out as at the boundary ([`Rounds::went_ahead`]). A round is
    /// not given up again on the word of a member that already moved this node's round: in
    /// `ddp` each such move costs this node its weight. The offence credit keeps a poisoner
    /// judged: it goes on to the next round alone once its aggregate is refused, and left
    /// to a stall it was banned 30-90 s after it started instead of 1-4 s; a chaser must
    /// offend once for each further move.
    pub(super) fn may_move(&mut self, from: PeerId, to_round: bool) -> bool {
        self.moves.may_move(from, to_round)
    }

    /// Whether this node's round anchor and outer velocity are not the members' (`diloco`):
    /// it is not synced, or it founds the members' state with others. Its heartbeats say so,
    /// and its parameter attempts carry the state until one completes.
    pub fn needs_state(&self) -> bool {
        self.standing.needs_state(self.cfg.outer_state)
    }

    /// Whether an attempt at parameter round `round` with `members` carries the state: some
    /// member needs it (a member's word naming an earlier round is stale: that round's ring
    /// gave it the state).
    fn carries_state(&self, round: u64, members: &[PeerId]) -> bool {
        if !self.cfg.outer_state || self.cfg.sums_gradients(round) {
            return false;
        }
        self.needs_state()
            || members
                .iter()
                .any(|m| self.roster.needs_state_for(m, round))
    }

    /// This node's own forward-backward milliseconds per sample.
    pub fn own_speed(&mut self, ms_per_sample: Option<f64>) {
        self.work.speed(ms_per_sample);
    }

    /// A member went away: an attempt it was part of cannot finish, unless the member
    /// completed it before it left ([`Rounds::peer_leaving`]).
    pub fn peer_down(&mut self, peer: PeerId, now: Instant) {
        self.roster.down(peer, now);
        self.trust.forgive(&peer);
        self.inbox.retain(|(_, _, _, from)| *from != peer);
        let completed = matches!(&self.attempt.stage, Stage::Reducing { ring: Some(r), .. } if r.left_done.contains(&peer));
        if self.attempt.ring_has(&peer) && !completed {
            self.abort("member left", now);
        }
    }

    /// A member said goodbye at `their_round`, one past the last round whose ring it
    /// completed ([`Rounds::leaving_round`]). If that is past this node's round, it completed
    /// this round (a member stopping at `max_steps` leaves right after its last round, often
    /// before the others took its last hops): it sent every hop it had, and waited up to the
    /// mesh actor's `RING_HOPS_DRAIN` for them to be taken before its goodbye, so its going
    /// does not abort the attempt, which ends with the hops already sent.
    /// (Aborting it left the rest of a `ddp` mesh one round short of `max_steps`, waiting for
    /// the `min_members` it could no longer have.) Where that is not so (it completed the
    /// round in an attempt without this node, or a hop was never taken) the attempt ends as a
    /// silent member's does: [`LATE_ROUND_WAIT`] after a member it waits for went on, or
    /// [`STALL_TIMEOUT`]. A forged round buys no more than going silent.
    pub fn peer_leaving(&mut self, peer: PeerId, their_round: Option<u64>) {
        let past = matches!((their_round, self.attempt.round), (Some(t), Some(mine)) if t > mine);
        if let Stage::Reducing { ring: Some(r), .. } = &mut self.attempt.stage {
            if past && r.members.contains(&peer) && !r.left_done.contains(&peer) {
                r.left_done.push(peer);
            }
        }
    }

    /// A hop to `peer` could not be delivered.
    pub fn undelivered(&mut self, peer: PeerId, round: u64, attempt: u32, now: Instant) {
        if self.attempt.is(round, attempt) && self.attempt.ring_has(&peer) {
            self.roster.unreachable(peer, now);
            self.abort("hop undelivered", now);
        }
    }

    /// Time passed; `step` is the trainer's, `training` whether it trains (a joiner still
    /// downloading does not, and is not asked for parameters).
    pub fn tick(&mut self, step: u64, training: bool, now: Instant, out: &mut Vec<Output>) {
        self.roster.forget_stale_speeds(now);
        match &self.attempt.stage {
            // A step report at the boundary may have been dropped: the tick asks instead.
            Stage::Training if training => self.stepped(step, out),
            Stage::Reducing { ring: Some(r), .. }
                if r.lists_differ_since
                    .is_some_and(|t| now.saturating_duration_since(t) >= LISTS_DIFFER_WAIT) =>
            {
                self.lists_differ(now);
            }
            Stage::Reducing { ring: Some(r), .. }
                if now.saturating_duration_since(r.last_progress) >= self.cfg.stall_timeout =>
            {
                self.stalled(now);
            }
            Stage::Reducing { ring: Some(r), .. }
                if r.went_on.is_some_and(|t| {
                    now.saturating_duration_since(t.max(r.last_progress)) >= LATE_ROUND_WAIT
                }) =>
            {
                // One member's word, not contradicted: the retry takes its round.
                if let Some((_, claimed)) = r.lone_claim {
                    self.attempt.followed = Some(claimed);
                }
                self.abort("the mesh went on", now);
            }
            Stage::Reducing { ring: None, .. } if !self.sitting_out(now) => {
                if self.attempt.round.is_none() && self.starts.adopt_due(now) {
                    tracing::info!("no ring heard; starting the rounds at round 0");
                    self.attempt.round = Some(0);
                    // Others may have started too, each from its own checkpoint: in
                    // `diloco` their first ring founds one round start and velocity.
                    self.standing.starts_the_rounds(self.cfg.outer_state);
                }
                if self.starts.may_retry(now) {
                    self.start(now, out);
                }
            }
            _ => {}
        }
    }

    /// The trainer reached a step: at the boundary, its parameters are asked for, or in a
    /// gradient round its next gradient. (A node whose parameters are not the members' gives
    /// its gradient with weight 0 too, and is brought in by the next parameter round; one
    /// that does not know the round yet gives its parameters.)
    pub fn stepped(&mut self, step: u64, out: &mut Vec<Output>) {
        if matches!(self.attempt.stage, Stage::Training) && step >= self.attempt.boundary {
            let gradient = self
                .attempt
                .round
                .is_some_and(|r| self.cfg.sums_gradients(r));
            self.ask(gradient, out);
        }
    }

    fn ask(&mut self, gradient: bool, out: &mut Vec<Output>) {
        self.attempt.stage = Stage::Asked { gradient };
        out.push(Output::Trainer(if gradient {
            let batch = self.work.ask_batch(&self.cfg, self.roster.speeds());
            TrainerCommand::TakeGradient { batch }
        } else {
            TrainerCommand::TakeParams
        }));
    }

    /// The trainer's parameters at the boundary: see [`Rounds::contribute`].
    pub fn params(&mut self, values: Vec<f32>, step: u64, now: Instant, out: &mut Vec<Output>) {
        self.contribute(values, false, 1.0, step, now, out);
    }

    /// The trainer's gradient in a gradient round, the mean over `samples` samples: it weighs
    /// `samples / batch` of a whole batch's, so a member that took a smaller batch
    /// ([`balanced_batch`]) counts for what it computed (members of a run share
    /// `train.batch_size`, so the mean is that of every sample computed). The share is
    /// rounded to bf16 first, as gradient hops carry it: the weight a member sends is the
    /// one its values were scaled by.
    pub fn gradient(
        &mut self,
        values: Vec<f32>,
        samples: usize,
        step: u64,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let share = samples.min(self.cfg.batch) as f32 / self.cfg.batch.max(1) as f32;
        let share = half::bf16::from_f32(share).to_f32();
        self.contribute(values, true, share, step, now, out);
    }

    /// This node's contribution is `values` at `weight * share` (0 where it is not synced).
    /// An answer to another question than the one asked (one from before a restore) is
    /// dropped.
    fn contribute(
        &mut self,
        values: Vec<f32>,
        gradient: bool,
        share: f32,
        step: u64,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        if !matches!(self.attempt.stage, Stage::Asked { gradient: g } if g == gradient) {
            return;
        }
        let weight = if self.standing.synced() {
            self.cfg.weight * share
        } else {
            0.0
        };
        self.attempt.stage = Stage::Reducing {
            contribution: values,
            weight,
            gradient,
            step,
            runs_on: self.runs_on(gradient),
            ring: None,
            since: now,
        };
        self.starts.unpaused();
        self.start(now, out);
    }

    /// Takes a later round the inbox holds hops of: the mesh completed rounds without this
    /// node. A node with no round, or one most members' heartbeats say they are past
    /// ([`Members::say_past`]), takes a round two members' hops name where it is as far as
    /// most heartbeats say, else the round they say where a hop names it or a later one, else
    /// the newest ([`Rounds::proven_later_round`]). Otherwise it takes
    /// the newest round that two members' hops name (or the only other's, where
    /// it hears one: [`members::vouched`]); else the round one member's hop named, where nothing
    /// contradicted it ([`Rounds::weigh_lone_claims`]), once for each member until a round
    /// completes ([`Rounds::may_move`]). Followed every time, a
    /// rogue whose hops always named the round after its own made every member take it, and
    /// followed them there, one round per hop, so that no round completed (the simulator:
    /// 0 rounds in 40 s, in every mode). Where most members are past this node's round, or
    /// in a gradient round (a member that missed one missed a step: kept at full weight, its
    /// stale parameters split the ring, as the simulator's churn showed), or taking a
    /// gradient round's number (it missed the mean of the parameter round it was in), its
    /// parameters are not the mesh's: it contributes with weight 0 and leaves the round with
    /// the mean; synced again only after a parameter round. Otherwise a synced member keeps
    /// its weight (one member's word is no proof that this node's parameters are not the
    /// mesh's); in `diloco` it asks for the members' round start and velocity too, which it
    /// may have missed.
    fn adopt_newer_round(&mut self, now: Instant) {
        if !matches!(self.attempt.stage, Stage::Reducing { .. }) {
            return;
        }
        let Some(target) = self.later_round_to_take(now) else {
            return;
        };
        self.attempt.followed = None;
        let attempt = follow::attempt_to_enter(self.inbox.keys(), &self.members(now), target);
        let Some(mine) = self.attempt.round else {
            self.attempt.enter(target, attempt);
            return;
        };
        let proven = self.members(now).say_past(mine);
        // Taking a gradient round's number, a member that skipped rounds would step from
        // parameters the others no longer hold (it missed their steps, or the mean of the
        // parameter round it was in), so every gradient round up to the next parameter round
        // would leave it apart: the simulator's `ddp` churn of seed 1, where a member that
        // lost a parameter round's last hop to a kill took the next round on the one member
        // that finished it, and the two split three rings.
        let steps_apart = self.cfg.sums_gradients(target);
        let Stage::Reducing {
            weight, gradient, ..
        } = &mut self.attempt.stage
        else {
            return;
        };
        if proven || *gradient || steps_apart || !self.standing.synced() {
            tracing::info!(
                mine,
                theirs = target,
                "the mesh is rounds ahead; adopting its round"
            );
            self.standing.unsynced();
            *weight = 0.0;
        } else {
            tracing::info!(
                mine,
                theirs = target,
                "members are rounds ahead, most are not; taking their round's number and keeping this node's weight"
            );
            self.standing.took_a_round_on_one_word(self.cfg.outer_state);
        }
        self.attempt.enter(target, attempt);
    }

    /// The later round the inbox's hops make this node take ([`Rounds::adopt_newer_round`]),
    /// if any.
    pub(super) fn later_round_to_take(&self, now: Instant) -> Option<u64> {
        let mine = self.attempt.round;
        self.proven_later_round(now).or_else(|| {
            self.attempt
                .followed
                .filter(|r| mine.is_some_and(|m| *r > m))
        })
    }

    /// The later round the inbox's hops make this node take on more than one member's word
    /// ([`follow::proven_later_round`]).
    pub(super) fn proven_later_round(&self, now: Instant) -> Option<u64> {
        follow::proven_later_round(self.inbox.keys(), &self.members(now), self.attempt.round)
    }

    /// The later attempt of this node's round the inbox's hops make it take
    /// ([`follow::later_attempt`]).
    pub(super) fn later_attempt_to_take(&self, now: Instant) -> Option<u32> {
        let round = self.attempt.round?;
        follow::later_attempt(
            self.inbox.keys(),
            &self.members(now),
            round,
            self.attempt.number,
        )
    }

    /// The running attempt stalled: it is aborted, and the members it waited for
    /// ([`trust::stall_suspects`]) are left out of the next attempts ([`Lists::stalled`])
    /// where they showed they are at the boundary, or were excused [`STALL_EXCUSES`] times
    /// this round already; unless that would leave out every other member this node hears,
    /// two or more ([`Trust::out_of_step`]): then this node holds as a joiner and gives up
    /// its weight for the round it next takes. (So a rogue that drives an honest member of a
    /// ring of three ahead of it, and stalls the third, costs that third member one round's
    /// weight, where it used to go on alone.) A suspect left out that alone withheld its
    /// part in this round is accused too ([`trust::withheld_alone`]).
    fn stalled(&mut self, now: Instant) {
        let Some(stall) = self.stall() else {
            return;
        };
        let suspects = trust::stall_suspects(&stall, &self.roster);
        self.abort("stalled", now);
        if self.alone_without(&suspects, now) {
            return;
        }
        for (peer, at_boundary) in suspects {
            let left_out = self.excuse_or_leave_out(peer, at_boundary, now);
            if left_out && trust::withheld_alone(&stall, &self.roster, &peer) {
                self.accuse(peer, now);
            }
        }
    }

    /// The running attempt as a stall shows it to the trust: whom it still waits for, and
    /// how far each was.
    fn stall(&self) -> Option<Stall> {
        let Stage::Reducing { ring: Some(r), .. } = &self.attempt.stage else {
            return None;
        };
        let round = self.attempt.round;
        let awaited = (0..r.len())
            .filter(|i| r.awaits(*i))
            .map(|i| Awaited {
                peer: r.members[i],
                part_missing: r.awaits_part(i),
                step_at_start: r.steps_said[i],
                went_ahead: self.went_ahead(r.members[i]),
            })
            .collect();
        Some(Stall {
            round,
            boundary: self.attempt.boundary,
            gradient: round.is_some_and(|r| self.cfg.sums_gradients(r)),
            started: r.started,
            awaited,
        })
    }

    /// Where a stall's `suspects` show this node is the one out of step
    /// ([`Trust::out_of_step`]), it leaves none of them out and holds as a joiner does
    /// ([`Rounds::restored`]): it takes the round of the next attempt it is in, with weight
    /// 0, and the parameters that round gives. Answers whether it did.
    fn alone_without(&mut self, suspects: &[(PeerId, bool)], now: Instant) -> bool {
        let heard: Vec<PeerId> = self.members(now).in_next_ring().collect();
        let round = self.attempt.round.unwrap_or(0);
        if !self.trust.out_of_step(&heard, suspects, round) {
            return false;
        }
        tracing::info!(
            members = heard.len(),
            "an attempt stalled waiting for every other member heard ready; this node is the one out of step: holding, to take the members' round and parameters"
        );
        self.abort_counter("out of step with every member");
        for (peer, _) in suspects {
            self.trust.forgive(peer);
        }
        let step = self.attempt.boundary;
        self.restored(step);
        true
    }

    /// An attempt ended waiting for `peer`: it is excused [`STALL_EXCUSES`] times a round,
    /// unless it showed it is at the boundary, and left out after that ([`Lists::stalled`]).
    /// Answers whether it was left out now.
    fn excuse_or_leave_out(&mut self, peer: PeerId, at_boundary: bool, now: Instant) -> bool {
        let round = self.attempt.round.unwrap_or(0);
        if !self.trust.stall_leaves_out(&peer, at_boundary, round) {
            self.trust.excuse(peer, round);
            return false;
        }
        self.trust.forgive(&peer);
        match self.lists.stalled(peer, now) {
            Some(last) => {
                tracing::info!(%peer, at_boundary, "an attempt stalled waiting for a member; leaving it out of the rounds for {last:?}");
                self.abort_counter("left a staller out");
                true
            }
            None => false,
        }
    }

    /// Whether a hop of `peer` naming a later attempt of this round, or a later round, waits
    /// in the inbox: `peer` is not training towards the boundary, it went on (a hop this
    /// node did not follow, [`Rounds::may_move`]).
    fn went_ahead(&self, peer: PeerId) -> bool {
        let Some(round) = self.attempt.round else {
            return false;
        };
        self.inbox.keys().any(|(r, a, _, from)| {
            *from == peer && (*r > round || (*r == round && *a > self.attempt.number))
        })
    }

    /// This node found a hop of `peer` no honest member sends: an offence that buys it a
    /// move ([`moves`]), and blame ([`trust`]). Only a peer it went without for such a reason
    /// makes it sit out: a peer that merely lost its connection to it (a rogue banned by it,
    /// which runs the same rules) does not, or both would sit out together and the others
    /// never judge the rogue.
    fn blamed(&mut self, peer: PeerId, now: Instant) {
        self.moves.offended(peer);
        self.trust.blame(peer, now);
    }

    /// Whether this member sits out of the rounds now ([`lists`]): its heartbeats say it
    /// is not ready, and it starts no attempt.
    ///
    /// A sit-out over a contradicted member ([`Rounds::contradicted`]) ends as soon as that
    /// member is left out, for whatever reason. Every member that contradicted it in the
    /// same instant sat out (its own accusation alone was not most), and most accusations
    /// came moments later. Sitting on for the rest of [`CONTRADICTED_SIT_OUT`], all of them
    /// came back to a mesh none of them was in, hearing no member ready but the rogue, and
    /// took the round it had raced to alone (`ring_rogue`'s `ddp` next-round test: rounds
    /// 882 -> 2,184 in the 2 s, and a state founded anew, one run in six).
    pub fn sitting_out(&self, now: Instant) -> bool {
        self.stance
            .sitting_out(now, |x| self.lists.left_out(x, now))
    }

    /// The running attempt's lists differ, and every hop of this member's list that came is
    /// judged: it is aborted, and what the others' lists said is weighed ([`lists`]): a
    /// member most others leave out is left out here too, one most others list again is
    /// taken back, and where most others list a peer this node lost and blamed itself
    /// ([`trust`]), it sits out and comes back as a joiner (weight 0, the
    /// members' mean).
    ///
    /// "Most others" there counts the members heard sitting out too, which list no peer.
    /// Counting only the ring's, a member that banned a rogue before the others sat out (as
    /// it should: most listed the rogue); a second that banned it next heard, in a ring of
    /// two, only the third member, which had not banned it yet, and sat out on its word
    /// alone; and the third, its two fellows both sitting out, never heard most of them
    /// leave the rogue out, and waited with it for the sit-outs to end (doubling each time:
    /// `ring_rogue`'s `diloco` kill test, one run in six, 10 s and more without a round).
    fn lists_differ(&mut self, now: Instant) {
        let Some(verdict) = self.lists_verdict(now) else {
            return;
        };
        self.abort("member lists differ", now);
        let action = self.lists.named(verdict, now);
        self.act_on_lists(verdict, action, now);
    }

    /// The running attempt's lists differed, and members' hops of a later attempt move this
    /// node on before it weighed them ([`Rounds::lists_differ`] waits for the parts of its
    /// own list's members, or [`LISTS_DIFFER_WAIT`]): what they said may still confirm the
    /// verdict earlier attempts named ([`Lists::named_again`]). Moved on unweighed, a member
    /// whose other members both left a rogue out never left it out itself once the rogue
    /// stopped sending to it: the two aborted each attempt at its first part, and their next
    /// attempt's hops moved it on within the wait, attempt after attempt (`ring_rogue`'s
    /// `diloco` kill test: no round for 60 s, in CI and in 2 runs of 9 beside a busy core).
    /// With nothing pending (a member back fresh), it names a leave-out where the only hops
    /// missing are of the member most left out, gone on to a later round by its heartbeat:
    /// they never come, and no attempt is weighed whole while the others' leave-out of it
    /// runs (`ring_rogue`'s `allreduce` joiner test: 69 s without a round, one run in 15).
    pub(super) fn weigh_lists_before_moving_on(&mut self, now: Instant) {
        let Stage::Reducing {
            ring: Some(ring), ..
        } = &self.attempt.stage
        else {
            return;
        };
        if ring.lists_differ_since.is_none() {
            return;
        }
        let Some(verdict) = self.lists_verdict(now) else {
            return;
        };
        // Only the hops of the member most left out are missing, and its heartbeat says it
        // went on to a later round: they are not coming, and this attempt is as whole as this
        // node's attempts get while that member's leave-out runs.
        let whole_but_x = match verdict {
            Some(Verdict::LeftOut(x)) => {
                ring.parts_accounted_for_but(&x)
                    && self.attempt.round.is_some_and(|mine| {
                        self.roster
                            .round_said(&x)
                            .is_some_and(|theirs| theirs > mine)
                    })
            }
            _ => false,
        };
        let action = self.lists.named_again(verdict, whole_but_x, now);
        self.act_on_lists(verdict, action, now);
    }

    /// What the running attempt's lists say ([`lists`]), where an attempt runs.
    fn lists_verdict(&self, now: Instant) -> Option<Option<Verdict>> {
        let not_in_rounds = self.members(now).sitting_out();
        let Stage::Reducing {
            ring: Some(ring), ..
        } = &self.attempt.stage
        else {
            return None;
        };
        let trust = &self.trust;
        let candidates: Vec<PeerId> = self
            .roster
            .gone()
            .filter(|p| trust.blamed(p))
            .copied()
            .chain(self.lists.ever_left_out())
            .collect();
        let known: Vec<PeerId> = self
            .roster
            .ever_ready()
            .chain(self.roster.gone())
            .chain(not_in_rounds.iter())
            .copied()
            .chain(self.lists.ever_left_out())
            .collect();
        Some(
            ring.left_out_by_most()
                .map(Verdict::LeftOut)
                .or_else(|| {
                    ring.listed_by_most(candidates.into_iter(), &not_in_rounds)
                        .map(Verdict::Listed)
                })
                .or_else(|| ring.unmatched_list(&known).map(Verdict::Unmatched)),
        )
    }

    /// Does `action`, what `verdict` (an attempt's lists) calls for now.
    fn act_on_lists(&mut self, verdict: Option<Verdict>, action: Option<Action>, now: Instant) {
        tracing::debug!(?verdict, ?action, "member lists differ: what the lists say");
        match action {
            None => {}
            Some(Action::LeaveOut(peer)) if matches!(verdict, Some(Verdict::Unmatched(_))) => {
                tracing::info!(%peer, "a member names a member list nobody else names; leaving it out of this node's rounds for a while");
                self.abort_counter("left out a member whose list is nobody else's");
            }
            Some(Action::LeaveOut(peer)) => {
                tracing::info!(%peer, "most members leave a member out of their rounds; so does this node");
                self.abort_counter("left a member out");
            }
            Some(Action::TakeBack(peer)) => {
                tracing::info!(%peer, "most members list a member this node left out; taking it back");
            }
            Some(Action::SitOut(peer, last)) => {
                tracing::warn!(
                    %peer,
                    "most members list a peer this node left out (banned, or out of reach); sitting out of the rounds for {last:?}"
                );
                self.stance.sit_out(now + last, None);
                self.abort_counter("sat out");
                // Its hops held are of rings it is no longer in.
                self.inbox.clear();
                let step = self.attempt.boundary;
                self.restored(step);
            }
        }
    }

    /// Starts an attempt with the members ready now, if the round is known.
    fn start(&mut self, now: Instant, out: &mut Vec<Output>) {
        if self.sitting_out(now) {
            return;
        }
        self.adopt_newer_round(now);
        let Some(round) = self.attempt.round else {
            return;
        };
        // A node that adopted the mesh's round may hold the other kind of contribution
        // (parameters for a gradient round): it asks the trainer again, and its answer
        // starts the attempt.
        if let Stage::Reducing { gradient, .. } = self.attempt.stage {
            if gradient != self.cfg.sums_gradients(round) {
                self.ask(!gradient, out);
                return;
            }
        }
        if !matches!(self.attempt.stage, Stage::Reducing { .. }) {
            return;
        }
        // Members may already be at a later attempt of this round: join it, where two say
        // so (or the only other). One member's word alone moves the attempt only as a hop
        // that makes this node give up its own ([`Rounds::may_move`]).
        if let Some(a) = self.later_attempt_to_take(now) {
            self.attempt.number = a;
        }
        let mut members: Vec<PeerId> = self.members(now).in_next_ring().collect();
        members.push(self.me);
        if members.len() < self.cfg.min_members {
            // Waiting for members: the tick tries again.
            return;
        }
        // A member whose parameters are not the mesh's founds a state of its own in a ring
        // of one (its weight 0 makes the total 0): not while a member it could not reach is
        // neither heard again nor gone, which may hold the mesh's state. Founded beside it,
        // the two would later sum outer changes from two round starts (`modes`' large-state
        // test in CI: a joiner's hop to the founder undelivered, the joiner founding alone,
        // their digests apart from the next round on).
        if members.len() == 1 && !self.standing.synced() && self.roster.any_unreachable() {
            return;
        }
        // Nor while fewer members are ready than sit out: a round they did not take part in
        // would be contradicted by most of them when they come back, and they would blame
        // this node for it ([`CONTRADICTED_SIT_OUT`] ends for one member a moment before
        // the others). One of a pair still goes on alone.
        if members.len() < self.members(now).sitting_out().len() {
            return;
        }
        members.sort();
        let me = members.iter().position(|p| *p == self.me).unwrap_or(0);
        let carries_state = self.carries_state(round, &members);
        let Some(r) = self.new_ring(round, members, me, carries_state, now) else {
            return;
        };
        tracing::debug!(round, attempt = self.attempt.number, members = ?r.members, "attempt started");
        self.attempt.ring_size = r.len();
        self.starts.unpaused();
        if r.len() == 1 {
            let step = r.members_step();
            let (acc, total) = (r.acc, r.weight);
            self.finish(round, acc, total, step, carries_state, now, out);
            return;
        }
        for (peer, msg) in r.part_messages(round, self.attempt.number) {
            self.counts.sent(msg.values.len());
            out.push(Output::SendRing { peer, msg });
        }
        if let Stage::Reducing { ring, .. } = &mut self.attempt.stage {
            *ring = Some(Box::new(r));
        }
        self.drain(now, out);
    }

    /// The ring of an attempt at `round` with `members` (sorted, this node at `me`): what
    /// this member sends (its parameters, with the state or not, their outer change, or its
    /// gradient), in which encoding, and what it judges the others' parts and aggregates by.
    fn new_ring(
        &mut self,
        round: u64,
        members: Vec<PeerId>,
        me: usize,
        carries_state: bool,
        now: Instant,
    ) -> Option<Ring> {
        let Stage::Reducing {
            contribution,
            weight,
            step,
            ..
        } = &self.attempt.stage
        else {
            return None;
        };
        let gradient = self.cfg.sums_gradients(round);
        let sums_changes = self
            .cfg
            .sums_outer_changes(round, carries_state, members.len());
        let acc = if sums_changes {
            outer_change(contribution)
        } else if self.cfg.outer_state && !carries_state {
            parameters_only(contribution)
        } else {
            contribution.clone()
        };
        // What this member judges the others' parts and aggregates by: what the trainer
        // judges the round's result by (a synced member by distance from its own parameters,
        // one whose parameters are not the mesh's by norm alone), the parameters (members
        // that share a round start differ in their outer changes exactly as in their
        // parameters).
        let norm = if sums_changes {
            p2ptrain_models::params::l2_norm(&parameters_only(contribution))
        } else {
            p2ptrain_models::params::l2_norm(&acc)
        };
        let judge = if gradient {
            Judge::GradientNorm {
                norm: self.work.gradient_norm(norm),
            }
        } else if self.standing.judged() && *weight > 0.0 {
            Judge::Distance { norm }
        } else {
            Judge::Norm { norm }
        };
        let encoding = if gradient {
            ValueEncoding::Bf16
        } else if sums_changes {
            self.cfg.outer_values
        } else {
            ValueEncoding::F32
        };
        let said: Vec<Option<u64>> = members
            .iter()
            .map(|m| self.roster.step_said(m).map(|(step, _)| step))
            .collect();
        let mut r = Ring::new(
            members,
            me,
            acc,
            *weight,
            judge,
            carries_state,
            encoding,
            *step,
            now,
        );
        r.steps_said = said;
        Some(r)
    }

    /// The aggregates are complete: the weighted mean (`total` the weights of this node's
    /// chunk) goes to the trainer, and with a parameter mean, to a node that was not synced,
    /// the members' step.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &mut self,
        round: u64,
        mean: Vec<f32>,
        total: f32,
        step: u64,
        carried_state: bool,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let gradient = self.cfg.sums_gradients(round);
        if total <= 0.0 && !gradient {
            // Nobody in the ring holds parameters from a round (joiners only, or members
            // whose synced peers died): each would keep its own, and they would differ.
            // They found one state together instead, as founders do: synced from now, they
            // try the round again with their parameters at full weight and all leave it
            // with one mean and the members' step (in `diloco` with the means of their
            // round anchors and outer velocities too: founding needs the state).
            tracing::info!(
                round,
                "no member of the ring is synced; founding one state together"
            );
            self.standing.founds_together();
            self.attempt.retry();
            self.abort_counter("no member synced");
            self.ask(false, out);
            return;
        }
        let (since, mean, ran_on) = match &self.attempt.stage {
            Stage::Reducing {
                since,
                contribution,
                runs_on,
                ..
            } if self
                .cfg
                .sums_outer_changes(round, carried_state, self.attempt.ring_size) =>
            {
                (*since, parameters_after(contribution, &mean), *runs_on)
            }
            Stage::Reducing { since, runs_on, .. } => (*since, mean, *runs_on),
            _ => (now, mean, false),
        };
        self.counts
            .mean_arrived(now.saturating_duration_since(since).as_secs_f64() * 1e3);
        let ring = match &self.attempt.stage {
            Stage::Reducing { ring: Some(r), .. } if r.len() > 1 => {
                Some(ring::members_digest(&r.members, carried_state))
            }
            _ => None,
        };
        // A member that became unsynced meanwhile takes the members' parameters whole: its
        // trainer drops what it trained on, and its boundary counts from where it is.
        let ran_on_from = (ran_on && self.standing.judged()).then_some(step);
        self.attempt.stage = Stage::Combining {
            carried_state,
            ran_on_from,
            ring,
        };
        let step = (!gradient && !self.standing.judged()).then_some(step);
        let judged = self.standing.judged();
        if total > 0.0 {
            out.push(Output::Trainer(TrainerCommand::Combine {
                round,
                mean,
                gradient,
                step,
                judged,
                ran_on: ran_on_from.is_some(),
            }));
        } else {
            // A gradient round in which no member is synced: each steps with its own
            // gradient, and the next parameter round founds their state.
            out.push(Output::Trainer(TrainerCommand::Combine {
                round,
                mean: Vec::new(),
                gradient,
                step: None,
                judged,
                ran_on: false,
            }));
        }
    }

    /// The trainer took round `round`'s mean at `step`; `digest` is its parameters' digest.
    /// A parameter round leaves every member with the mean, so synced (in `diloco`, only one
    /// that carried the members' round start and velocity); a gradient round changes nothing
    /// in that. In gradient rounds the next one starts at once.
    pub fn combined(&mut self, round: u64, step: u64, digest: String, out: &mut Vec<Output>) {
        let Stage::Combining {
            carried_state,
            ran_on_from,
            ring,
        } = self.attempt.stage
        else {
            return;
        };
        if self.attempt.round != Some(round) {
            return;
        }
        tracing::debug!(round, ring = self.attempt.ring_size, "round completed");
        self.attempt.completed(round);
        // A parameter round leaves every member the mean; in `diloco` only one that carried
        // the state leaves them the same anchor and velocity too.
        if !self.cfg.sums_gradients(round) && (carried_state || !self.cfg.outer_state) {
            self.standing.parameter_round_completed();
        }
        // The ring gave its members the state: a need heard before it is met. One said before
        // its node had a round names none to go stale by; the node's next heartbeat says
        // whether it still needs the state (it was not in this ring).
        if carried_state {
            self.roster.state_carried(round);
            self.standing.state_carried();
        }
        // As a synced member's first boundary: `steps` on, or in gradient rounds, none. One
        // that trained on through the round counts from where it gave its parameters, so
        // every round is `steps` of its training.
        self.attempt.boundary = match ran_on_from {
            Some(from) => from.saturating_add(self.cfg.steps.max(1)).max(step),
            None => self.cfg.first_boundary(step, true),
        };
        self.attempt.stage = Stage::Training;
        self.starts.round_known();
        self.counts.round_completed(self.attempt.ring_size);
        self.standing.mean_taken();
        self.lists.agreed();
        self.trust.round_completed();
        self.moves.round_completed();
        // A trainer digests gradient rounds only now and then (see `DIGEST_EVERY`). An
        // unsynced member (a joiner, or one that adopted a round the mesh completed without
        // it) holds parameters that are not the mesh's: it claims no digest until a parameter
        // round syncs it. A ring of one promises nobody anything, and claims none either. So
        // two members' digests of one round and one ring are equal bits, or a broken promise.
        if let Some(ring) = ring.filter(|_| !digest.is_empty() && self.standing.claims_digest()) {
            self.counts.digest(round, digest, ring);
        }
        self.stepped(step, out);
    }

    /// The trainer could not take the mean (it refused it, see
    /// `sync_guard::judge_round_mean`): hold, and let the round be retried. The trainer kept
    /// its parameters, those it had before the round, so the member stays as synced as it
    /// was: made unsynced, it would take the next mean judged by norm alone, and a member
    /// that spoiled one round would decide the next (the honest members' weights 0). Only
    /// after [`REFUSALS_BEFORE_UNSYNCED`] refusals in a row does it give up its parameters
    /// as the mesh's: an honest member that drifted far must come back some time.
    pub fn combine_failed(&mut self) {
        if matches!(self.attempt.stage, Stage::Combining { .. }) {
            self.standing.mean_refused();
            self.attempt.stage = Stage::Training;
            // The retry is a new attempt: a member still in this one (waiting for a late
            // aggregate) takes this node's new parts as the next attempt's, not as second
            // parts of this one.
            self.attempt.retry();
            self.abort_counter("trainer failed");
        }
    }

    /// An aggregate this member got was beyond the bound it judges by: the attempt is
    /// aborted. It does not count towards [`REFUSALS_BEFORE_UNSYNCED`]: a rogue owner would
    /// then make every honest member unsynced (weight 0) in three attempts, under the ban's
    /// count, and its own parts the next mean. (A member whose own parameters drifted beyond
    /// the bound, which honest ones do not come near, refuses every owner's aggregate and
    /// blames them until it restores or rejoins.)
    pub(super) fn aggregate_refused(&mut self, now: Instant) {
        self.abort("aggregate refused", now);
    }

    /// The parameters were replaced (a checkpoint, a downloaded state): they are no longer the
    /// mesh's; hold and adopt the mesh's round.
    pub fn restored(&mut self, step: u64) {
        self.standing.restored();
        self.attempt.restored(step);
        self.starts.round_known();
    }

    fn abort(&mut self, why: &str, now: Instant) {
        if let Stage::Reducing { ring, .. } = &mut self.attempt.stage {
            if ring.take().is_some() {
                tracing::info!(round = ?self.attempt.round, attempt = self.attempt.number, why, "round attempt aborted; retrying");
                // An attempt that failed for a reason of this node's own (not a wait on
                // members, which may be a rogue's doing) lets members move it once more.
                if !matches!(why, "stalled" | "the mesh went on" | "a member sat out") {
                    self.moves.own_abort();
                }
                self.attempt.retry();
                self.starts.aborted(now);
                self.abort_counter(why);
            }
        }
    }

    /// Whether the hops held for later are within their bounds in count and in values (for
    /// the core's property tests).
    #[cfg(test)]
    pub(in crate::mesh_core) fn inbox_within_bounds(&self) -> bool {
        self.inbox.within_bounds()
    }

    fn abort_counter(&mut self, why: &str) {
        self.counts.aborted(why);
    }
}
