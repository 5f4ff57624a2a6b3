//! Where a node is in the rounds: the round and the attempt it runs, the step its training
//! stops at for the round (the boundary), the attempt's stage (training, asked, reducing with
//! its ring, combining), and what the last attempts leave for the next: a later round one
//! member's hop made it give up for, the round it last sent its aggregate in, and the size
//! of the last ring. [`super::Rounds`] decides when each moves; this room holds them and
//! says how a round is entered, completed or left. Nothing here reads a peer's word.

use std::time::Instant;

use libp2p::PeerId;

use super::ring::Ring;

/// See the module docs.
#[derive(Debug)]
pub(super) struct Attempt {
    /// The round it is in; `None` while a joiner or restored node waits to adopt the mesh's.
    pub(super) round: Option<u64>,
    /// The attempt's number within the round: each abort retries with the next.
    pub(super) number: u32,
    /// The step its training stops at for this round.
    pub(super) boundary: u64,
    /// The attempt's stage.
    pub(super) stage: Stage,
    /// A later round one member's hop made this node give up its attempt for
    /// ([`super::Rounds::may_move`]), to be taken by the restart.
    pub(super) followed: Option<u64>,
    /// The round in whose attempts this node last sent its aggregate: a member may have
    /// finished it, so its word that it did is not contradicted
    /// ([`super::Rounds::contradicted`]).
    pub(super) aggregated_in: Option<u64>,
    /// The members of the last attempt's ring (status shows it; [`super::Rounds::finish`]
    /// reads it).
    pub(super) ring_size: usize,
}

impl Attempt {
    /// A founder (`synced`) in round 0, a joiner or resumed node in none yet; training
    /// towards `boundary`.
    pub(super) fn new(boundary: u64, synced: bool) -> Attempt {
        Attempt {
            round: synced.then_some(0),
            number: 0,
            boundary,
            stage: Stage::Training,
            followed: None,
            aggregated_in: None,
            ring_size: 0,
        }
    }

    /// Whether it runs attempt `number` of `round`.
    pub(super) fn is(&self, round: u64, number: u32) -> bool {
        self.round == Some(round) && self.number == number
    }

    /// The next attempt of the same round, after an abort.
    pub(super) fn retry(&mut self) {
        self.number = self.number.saturating_add(1);
    }

    /// Attempt `number` of `round`, taken from the mesh.
    pub(super) fn enter(&mut self, round: u64, number: u32) {
        self.round = Some(round);
        self.number = number;
    }

    /// `round` completed: the first attempt of the next.
    pub(super) fn completed(&mut self, round: u64) {
        self.round = Some(round.saturating_add(1));
        self.number = 0;
    }

    /// The highest step the trainer may reach: the boundary, or past it by `overlap_steps`
    /// while a round it may train on through runs.
    pub(super) fn step_limit(&self, overlap_steps: u64) -> u64 {
        match self.stage {
            Stage::Reducing { runs_on: true, .. }
            | Stage::Combining {
                ran_on_from: Some(_),
                ..
            } => self.boundary.saturating_add(overlap_steps),
            _ => self.boundary,
        }
    }

    /// The round a goodbye names: one past the last round whose ring this node completed
    /// (see [`super::Rounds::leaving_round`]).
    pub(super) fn leaving_round(&self) -> Option<u64> {
        match self.stage {
            Stage::Combining { .. } => self.round.map(|r| r.saturating_add(1)),
            _ => self.round,
        }
    }

    /// Whether `peer` is in the running attempt's ring.
    pub(super) fn ring_has(&self, peer: &PeerId) -> bool {
        matches!(&self.stage, Stage::Reducing { ring: Some(r), .. } if r.members.contains(peer))
    }

    /// Out of the rounds, training towards (held at) `step` until the mesh's round is
    /// adopted again (a state restored from a checkpoint or a donor).
    pub(super) fn restored(&mut self, step: u64) {
        self.round = None;
        self.number = 0;
        self.boundary = step;
        self.stage = Stage::Training;
    }
}

/// Where this node is in the round.
#[derive(Debug)]
pub(super) enum Stage {
    /// Training towards the boundary.
    Training,
    /// Its parameters (or, in a gradient round, the next batch's gradient) were asked of the
    /// trainer.
    Asked {
        /// A gradient was asked for.
        gradient: bool,
    },
    /// Holding its contribution, with an attempt under way or waiting to be retried.
    Reducing {
        /// Parameters or a gradient, unweighted.
        contribution: Vec<f32>,
        /// Its weight in the mean (0 where this node's parameters are not the mesh's).
        weight: f32,
        /// The contribution is a gradient (else parameters).
        gradient: bool,
        /// The trainer's step when it gave the contribution.
        step: u64,
        /// The trainer trains on past `step` while the round runs ([`Rounds::runs_on`]).
        runs_on: bool,
        /// The attempt under way (boxed: most of a node's life is spent in other stages).
        ring: Option<Box<Ring>>,
        since: Instant,
    },
    /// The mean went to the trainer.
    Combining {
        /// The ring carried the members' round anchor and outer velocity (`diloco`).
        carried_state: bool,
        /// The step the trainer gave its parameters at, where it trained on past it: the next
        /// boundary counts from there.
        ran_on_from: Option<u64>,
        /// The digest of the ring's member list (`ring::members_digest`); `None` for a ring
        /// of one, whose mean is its own parameters, a promise to nobody.
        ring: Option<u64>,
    },
}
