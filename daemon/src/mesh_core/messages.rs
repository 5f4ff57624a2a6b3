//! The core's messages: what the mesh actor hands [`super::MeshCore::handle`] ([`Input`]), what
//! the core asks it to carry out ([`Output`]), and the commands and events it exchanges with
//! the trainer through the actor ([`TrainerCommand`], [`TrainerEvent`]). Plain data, no logic.

use libp2p::gossipsub::{MessageAcceptance, MessageId};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use crate::sync_guard::SyncRefusal;
use crate::wire::{BulkResponse, RingMessage};

/// What the trainer is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Building the model or loading state.
    #[default]
    Starting,
    /// Taking steps.
    Training,
    /// Stopped (max steps reached or asked to stop).
    Stopped,
}

/// What the trainer last published about itself, as the core needs it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Progress {
    /// Whether it trains yet (a joiner waits for its state).
    pub phase: Phase,
    /// Its step.
    pub step: u64,
    /// Its parameters' L2 norm: neighbours' updates are bounded by a multiple of it.
    pub param_norm: f64,
    /// Its recent loss.
    pub loss: Option<f64>,
    /// Its throughput.
    pub samples_per_sec: f64,
    /// Its latest held-out accuracy.
    pub accuracy: Option<f64>,
    /// Its forward-backward milliseconds per sample (see `trainer::Stats::ms_per_sample`).
    pub ms_per_sample: Option<f64>,
}

/// What an announced update's fetch from its author brought back.
#[derive(Debug, Clone, PartialEq)]
pub enum FetchAnswer {
    /// The bytes the author sent.
    Bytes(Vec<u8>),
    /// The author declined (it keeps only its last few) or the network failed: nobody's fault.
    Unavailable,
    /// An answer of another kind: the author's fault.
    WrongKind,
}

/// How the trainer answered an [`TrainerCommand::Average`].
#[derive(Debug, Clone, PartialEq)]
pub enum AverageOutcome {
    /// Averaged; the relative distance measured before.
    Averaged(f64),
    /// Judged and refused; nothing changed.
    Refused(SyncRefusal),
    /// The trainer could not do it (its own failure).
    Failed(String),
}

/// What the trainer tells the core.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainerEvent {
    /// It finished a step.
    Stepped {
        /// The step reached.
        step: u64,
        /// ‖own change since the last delta‖ / ‖parameters‖ (0 when not measured).
        pending_ratio: f64,
    },
    /// The delta asked for with [`TrainerCommand::TakeDelta`].
    Delta {
        /// Step of the previous delta: this one covers `base_step..step`.
        base_step: u64,
        /// Step at which it was taken.
        step: u64,
        /// Own change, flat in canonical order.
        delta: Vec<f32>,
    },
    /// The answer to [`TrainerCommand::Average`] number `seq`.
    Averaged {
        /// The command's number.
        seq: u64,
        /// What happened.
        outcome: AverageOutcome,
    },
    /// The parameters asked for with [`TrainerCommand::TakeParams`]; in `diloco`, followed
    /// by the round start and the outer velocity (three equal parts), which a round carries
    /// only while a member needs them.
    Params {
        /// The step they were taken at.
        step: u64,
        /// Flat, in canonical order (each part).
        values: Vec<f32>,
    },
    /// The gradient asked for with [`TrainerCommand::TakeGradient`].
    Gradient {
        /// The step it leads from (the step it makes is `step + 1`).
        step: u64,
        /// Flat, in canonical order: the mean over the batch's samples.
        values: Vec<f32>,
        /// Samples in the batch (the ring weighs each member's gradient by them).
        samples: usize,
    },
    /// The answer to [`TrainerCommand::Combine`]: the digest of the parameters it left
    /// (see [`p2ptrain_models::params::params_digest`]), or why it could not combine.
    Combined {
        /// The round.
        round: u64,
        /// The trainer's step.
        step: u64,
        /// The parameters' digest, or the failure.
        outcome: Result<String, String>,
    },
    /// The parameters were replaced by a checkpoint at `step`: everything that referred to
    /// the old ones is void.
    Restored {
        /// The restored step.
        step: u64,
    },
}

/// What the core asks of the trainer.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainerCommand {
    /// Hand over the current parameters, and in `diloco` the round start and outer velocity
    /// after them ([`TrainerEvent::Params`]): a round's boundary.
    TakeParams,
    /// Compute the next batch's gradient at the current parameters, keep it, and hand it
    /// over ([`TrainerEvent::Gradient`]): a `ddp` round, whose mean gradient makes the step.
    TakeGradient {
        /// Samples in the batch: the configured batch, or fewer for a member slower than the
        /// others (`rounds::balanced_batch`).
        batch: usize,
    },
    /// Take the members' weighted mean of round `round` (an outer optimizer step towards it,
    /// in `diloco`); an empty `mean` keeps the parameters. With `gradient`, the mean is of
    /// gradients: the trainer steps with it from the gradient it kept (with its own where
    /// `mean` is empty), or, having kept none, changes nothing. Answer with
    /// [`TrainerEvent::Combined`].
    Combine {
        /// The round.
        round: u64,
        /// The mean, flat in canonical order.
        mean: Vec<f32>,
        /// The mean is of gradients, not of parameters.
        gradient: bool,
        /// The members' step, for a node that was not synced and takes their parameters:
        /// its step count (and its optimizer's, so its learning-rate schedule) moves there.
        step: Option<u64>,
        /// This member held the mesh's parameters before the round: a mean of parameters
        /// must lie within a distance bound of its own
        /// ([`crate::sync_guard::judge_round_mean`]).
        judged: bool,
        /// The trainer trained on past the parameters it gave the round
        /// ([`crate::mesh_core::rounds::config::RoundConfig::overlap_steps`]): it keeps what it
        /// trained since on top of the round's result.
        ran_on: bool,
    },
    /// Hand over the own change since the last delta ([`TrainerEvent::Delta`]).
    TakeDelta,
    /// Add `weight * values` to the parameters.
    Apply {
        /// Flat values in canonical order.
        values: Vec<f32>,
        /// Their weight.
        weight: f32,
    },
    /// Average with `theirs` if within `bound` ([`crate::sync_guard::judge`]); answer with
    /// [`TrainerEvent::Averaged`].
    Average {
        /// Numbers the answer.
        seq: u64,
        /// The neighbour's parameters.
        theirs: Vec<f32>,
        /// The largest relative distance accepted.
        bound: f64,
    },
}

/// An event for the core.
#[derive(Debug, Clone)]
pub enum Input {
    /// A member of this run connected.
    PeerUp(PeerId),
    /// A member went away (or was dropped as silent).
    PeerDown(PeerId),
    /// A gossip message awaiting its verdict.
    Gossip {
        /// The peer that forwarded it.
        source: PeerId,
        /// Its signed author.
        author: Option<PeerId>,
        /// Its id, for the verdict.
        id: MessageId,
        /// Its topic.
        topic: String,
        /// Its payload.
        data: Vec<u8>,
    },
    /// An announced update's fetch ended.
    Fetched {
        /// The author.
        owner: PeerId,
        /// The forwarder of the announcement.
        source: PeerId,
        /// The announcement's id, for the verdict.
        id: MessageId,
        /// The announced hash.
        hash: [u8; 32],
        /// What came back.
        answer: FetchAnswer,
    },
    /// A full sync's request ended: the neighbour's answer, or why there was none.
    ParamsReply {
        /// The neighbour asked.
        peer: PeerId,
        /// Its answer.
        answer: Result<BulkResponse, RequestFailed>,
    },
    /// The network took (`ok`) or refused an own update of `payload` bytes.
    UpdatePublished {
        /// Bytes of the framed update.
        payload: u64,
        /// Whether gossip took it.
        ok: bool,
    },
    /// A hop of a synchronous round's ring.
    Ring {
        /// Its sender.
        peer: PeerId,
        /// The hop.
        msg: RingMessage,
    },
    /// A hop could not be delivered to `peer`.
    RingUndelivered {
        /// The intended receiver.
        peer: PeerId,
        /// The hop's round.
        round: u64,
        /// The hop's attempt.
        attempt: u32,
    },
    /// The trainer's latest progress.
    Progress(Progress),
    /// News from the trainer.
    Trainer(TrainerEvent),
    /// A command could not be handed to the trainer (its queue is full).
    TrainerBusy(TrainerCommand),
    /// Time passed.
    Tick,
    /// This node leaves: say so to the mesh.
    Leave,
}

/// Work for the mesh actor.
#[derive(Debug, Clone)]
pub enum Output {
    /// Subscribe to a topic.
    Subscribe(String),
    /// Unsubscribe from a topic.
    Unsubscribe(String),
    /// Publish an own update on its topic, then report [`Input::UpdatePublished`].
    PublishUpdate {
        /// The topic.
        topic: String,
        /// The framed update.
        data: Vec<u8>,
    },
    /// Publish on a topic.
    Publish {
        /// The topic.
        topic: String,
        /// The payload.
        data: Vec<u8>,
    },
    /// Give gossip a message's verdict.
    Validate {
        /// The message.
        id: MessageId,
        /// Its forwarder.
        source: PeerId,
        /// The verdict.
        acceptance: MessageAcceptance,
    },
    /// Record an offence, so a ban can name it.
    Offence {
        /// The offender.
        peer: PeerId,
        /// What it did.
        why: String,
    },
    /// Lower a peer's score for a provable offence that gossipsub's own rejection count
    /// cannot punish alone: a refused full-sync reply, a ring hop no honest member sends, a
    /// heartbeat it sent over its rate. Enough of them in a short time ban the peer (see [`crate::scoring::Penalties`]).
    Penalise(PeerId),
    /// Forget a peer that said goodbye (no redial).
    Forget(PeerId),
    /// Fetch an announced update from its author, then report [`Input::Fetched`].
    Fetch {
        /// The author.
        owner: PeerId,
        /// The announcement's forwarder.
        source: PeerId,
        /// The announcement's id.
        id: MessageId,
        /// The announced hash.
        hash: [u8; 32],
    },
    /// Ask a neighbour for its parameters, then report [`Input::ParamsReply`].
    RequestParams(PeerId),
    /// Send a ring hop; if it cannot be delivered, report [`Input::RingUndelivered`].
    SendRing {
        /// The member it goes to.
        peer: PeerId,
        /// The hop.
        msg: RingMessage,
    },
    /// Hand the trainer a command; if its queue is full, report [`Input::TrainerBusy`].
    Trainer(TrainerCommand),
}

/// Why a full-sync request brought no answer. Nobody's fault: the core counts it as a failed
/// sync and the policy moves on to another neighbour.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestFailed {
    /// The actor already had as many requests under way as it allows, so it sent none.
    #[error("too many requests under way")]
    TooManyUnderWay,
    /// The network could not carry it: the peer went, the stream broke or the request timed
    /// out (the network error's text).
    #[error("{0}")]
    Network(String),
}
