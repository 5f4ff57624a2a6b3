//! The mesh actor: the task that connects the mesh core ([`crate::mesh_core`]) to the world.
//! Every decision about peers, updates and syncs is the core's.
//!
//! It turns network events, the trainer's events and timer ticks into the core's inputs, and
//! carries out the core's outputs: gossip publishes and verdicts, subscriptions, requests to
//! peers, commands to the trainer, the step limit; it tells a joiner which members are
//! connected (a watch). It also answers peers' bulk requests (parameters for a sync, large
//! updates; state downloads through [`transfer::serve`]), with the one rule serving a sync
//! needs: a node without a state yet declines it. Every request it sends or serves
//! runs in a task of a bounded set ([`TASK_CAP`]), joined (aborted) when the actor stops; when
//! the set is full a request is declined, never queued without bound, and so is a request of a
//! peer beyond its share of the set ([`crate::serving`]). Ring hops under way are
//! the exception on the way out: the actor waits for them (up to [`RING_HOPS_DRAIN`]) before
//! it says goodbye, since the members need them to finish the round this node finished.
//!
//! Each node publishes its own updates on a topic of its own; its neighbours (a bounded set,
//! `degree` peers) subscribe to it. So a node receives from about `degree` peers whatever the
//! mesh's size, and the traffic per node depends on the degree, not on N. Every so often a node
//! pulls a random neighbour's full parameters and averages with them (the neighbour sync), which
//! carries updates beyond one hop and keeps the copies close.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_bytes::ByteBuf;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::JoinSet;

use crate::mesh_core::{
    FetchAnswer, Input, MeshCore, Output, Progress, RequestFailed, TrainerEvent,
};
use crate::network::{Client, Event};
use crate::ring_attack::RingAttack;
use crate::serving::{self, ServeLimits};
use crate::timeline::{self, Lane};
use crate::trainer::{self, Command, Stats, StepLimit};
use crate::transfer;
use crate::wire::{BulkRequest, BulkResponse};

pub use crate::mesh_core::status::{
    FullSyncCounters, MeshStatus, SyncInfo, SyncRefusalInfo, UpdateCounters,
};
pub use crate::mesh_core::{heartbeat_topic, update_topic, MeshConfig};
pub use crate::wire::Heartbeat;

/// How often the core's clock ticks (timeouts, neighbour refresh, heartbeats) and status is
/// copied out for the control API.
const TICK_EVERY: Duration = Duration::from_millis(50);
/// Request tasks (fetches, syncs, served requests) under way at once, at most.
pub const TASK_CAP: usize = 32;
/// Capacity of the channel on which request tasks report back.
const RESULT_CAP: usize = 64;
/// How long a stopping node waits for its ring hops still under way to be taken before it
/// says goodbye: the members need them to finish the round this node finished, and a member
/// that hears the goodbye of one that completed the round goes on without it only if every
/// hop it sent was taken. A hop to a live member takes milliseconds; one to a dead member
/// fails at once.
pub const RING_HOPS_DRAIN: Duration = Duration::from_secs(5);

/// The mesh actor's handles, built by the node; see the module docs.
pub struct MeshActor {
    /// Network handle.
    net: Client,
    /// The decisions.
    core: MeshCore,
    /// Commands to the trainer.
    trainer_tx: mpsc::Sender<Command>,
    /// The trainer's progress.
    stats_rx: watch::Receiver<Stats>,
    /// The trainer's events.
    trainer_rx: mpsc::Receiver<TrainerEvent>,
    /// Shared with the status API.
    status: Arc<Mutex<MeshStatus>>,
    /// The run's connected members (and a bootstrap peer of another run), for a joiner
    /// waiting for donors.
    reached_tx: watch::Sender<transfer::Reached>,
    /// Frozen states this node can serve.
    cache: Arc<Mutex<transfer::Cache>>,
    /// Where the core's SSP limit reaches the trainer.
    limit: StepLimit,
    /// Debug throttle: delay before serving each state chunk.
    serve_chunk_delay: Duration,
    /// Test only (`debug.ring_attack`): what this node does to the round hops it sends.
    ring_attack: Option<RingAttack>,
    tasks: JoinSet<()>,
    /// The ring hops under way, apart from `tasks`: a stopping node waits for them.
    ring_hops: JoinSet<()>,
    permits: Arc<Semaphore>,
    /// Each peer's share of the requests served (see [`crate::serving`]).
    serving: ServeLimits,
    results_tx: mpsc::Sender<Input>,
    results_rx: mpsc::Receiver<Input>,
}

impl MeshActor {
    /// An actor around `core`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        net: Client,
        core: MeshCore,
        trainer_tx: mpsc::Sender<Command>,
        stats_rx: watch::Receiver<Stats>,
        trainer_rx: mpsc::Receiver<TrainerEvent>,
        status: Arc<Mutex<MeshStatus>>,
        reached_tx: watch::Sender<transfer::Reached>,
        cache: Arc<Mutex<transfer::Cache>>,
        limit: StepLimit,
        serve_chunk_delay: Duration,
        ring_attack: Option<RingAttack>,
    ) -> MeshActor {
        let (results_tx, results_rx) = mpsc::channel(RESULT_CAP);
        MeshActor {
            net,
            core,
            trainer_tx,
            stats_rx,
            trainer_rx,
            status,
            reached_tx,
            cache,
            limit,
            serve_chunk_delay,
            ring_attack,
            tasks: JoinSet::new(),
            ring_hops: JoinSet::new(),
            permits: Arc::new(Semaphore::new(TASK_CAP)),
            serving: ServeLimits::default(),
            results_tx,
            results_rx,
        }
    }

    /// Runs until `stop` turns true or the network goes away; says goodbye to the mesh and
    /// stops its request tasks on the way out.
    pub async fn run(mut self, mut events: mpsc::Receiver<Event>, mut stop: watch::Receiver<bool>) {
        for out in self.core.start() {
            self.carry_out(out).await;
        }
        let mut tick = tokio::time::interval(TICK_EVERY);
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::pin!(stopped);
        loop {
            self.note_progress();
            let input = tokio::select! {
                _ = &mut stopped => break,
                ev = events.recv() => match ev {
                    Some(ev) => match self.on_event(ev).await {
                        Some(input) => input,
                        None => continue,
                    },
                    None => break,
                },
                Some(ev) = self.trainer_rx.recv() => Input::Trainer(ev),
                Some(input) = self.results_rx.recv() => input,
                Some(_) = self.tasks.join_next(), if !self.tasks.is_empty() => continue,
                Some(_) = self.ring_hops.join_next(), if !self.ring_hops.is_empty() => continue,
                _ = tick.tick() => Input::Tick,
            };
            let is_tick = matches!(input, Input::Tick);
            self.drive(input).await;
            // Status leaves the core on ticks, once the tick brought it up to date.
            if is_tick {
                self.publish_status();
            }
        }
        self.drain_ring_hops(&mut events).await;
        // Before the goodbye goes out: the members that close their connections in answer
        // are not lost members.
        let _ = self.net.leaving().await;
        self.drive(Input::Leave).await;
        self.publish_status();
        self.tasks.shutdown().await;
        self.ring_hops.shutdown().await;
    }

    /// Waits up to [`RING_HOPS_DRAIN`] for the ring hops under way to be taken. Reports and
    /// network events are read and dropped meanwhile (this node is leaving), so neither the
    /// hops' tasks nor the network loop that carries them can block on a full channel.
    async fn drain_ring_hops(&mut self, events: &mut mpsc::Receiver<Event>) {
        let deadline = tokio::time::sleep(RING_HOPS_DRAIN);
        tokio::pin!(deadline);
        while !self.ring_hops.is_empty() {
            tokio::select! {
                _ = &mut deadline => {
                    tracing::warn!(hops = self.ring_hops.len(), "ring hops still under way at the goodbye");
                    return;
                }
                _ = self.ring_hops.join_next() => {}
                Some(_) = self.results_rx.recv() => {}
                Some(_) = events.recv() => {}
            }
        }
    }

    /// Passes the trainer's latest progress to the core when it changed.
    fn note_progress(&mut self) {
        if self.stats_rx.has_changed().unwrap_or(false) {
            let s = self.stats_rx.borrow_and_update().clone();
            let t = &s.training;
            let progress = Progress {
                phase: t.phase,
                step: t.step,
                param_norm: s.param_norm,
                loss: t.loss,
                samples_per_sec: t.samples_per_sec,
                accuracy: t.eval.map(|e| e.accuracy),
                ms_per_sample: t.ms_per_sample,
            };
            let _ = self.core.handle(Input::Progress(progress), Instant::now());
        }
    }

    /// Copies the core's status out for the control API.
    fn publish_status(&self) {
        if let Ok(mut s) = self.status.lock() {
            *s = self.core.status(Instant::now());
            s.requests_declined = self.serving.declined();
        }
    }

    /// Hands `input` to the core and carries out what follows, including the inputs that
    /// carrying out produces; then passes queued updates to the trainer and sets the limit.
    async fn drive(&mut self, input: Input) {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            // The span covers the core's decision only; carrying it out (a publish) has its own.
            let outputs = {
                let _span = span_of(&input).map(|name| timeline::span(Lane::Mesh, name));
                self.core.handle(input, Instant::now())
            };
            for out in outputs {
                if let Some(next) = self.carry_out(out).await {
                    inputs.push_back(next);
                }
            }
        }
        self.flush_applies();
        self.limit.set(self.core.step_limit(Instant::now()));
        let members = self.core.members();
        self.reached_tx.send_if_modified(|r| {
            let changed = !r.members.iter().eq(members.iter());
            if changed {
                r.members = members.iter().copied().collect();
            }
            changed
        });
    }

    /// Hands queued updates to the trainer while its queue has room for them and for the
    /// commands that must not wait.
    fn flush_applies(&mut self) {
        while self.trainer_tx.capacity() > trainer::MESH_RESERVED {
            let Some(cmd) = self.core.next_apply() else {
                return;
            };
            if let Err(e) = self.trainer_tx.try_send(Command::Mesh(cmd)) {
                if let Command::Mesh(cmd) = e.into_inner() {
                    let _ = self.core.handle(Input::TrainerBusy(cmd), Instant::now());
                }
                return;
            }
        }
    }

    /// Does one thing the core asked for; some report back at once.
    async fn carry_out(&mut self, out: Output) -> Option<Input> {
        match out {
            Output::Subscribe(topic) => {
                let _ = self.net.subscribe(topic).await;
            }
            Output::Unsubscribe(topic) => {
                let _ = self.net.unsubscribe(topic).await;
            }
            Output::PublishUpdate { topic, data } => {
                let _span = timeline::span(Lane::Mesh, "publish");
                let payload = data.len() as u64;
                let result = self.net.publish(topic, data).await;
                if let Err(e) = &result {
                    tracing::debug!("update not published: {e}");
                }
                return Some(Input::UpdatePublished {
                    payload,
                    ok: result.is_ok(),
                });
            }
            Output::Publish { topic, data } => {
                let _ = self.net.publish(topic, data).await;
            }
            Output::Validate {
                id,
                source,
                acceptance,
            } => {
                let _ = self.net.validate(id, source, acceptance).await;
            }
            Output::Offence { peer, why } => {
                let _ = self.net.report_offence(peer, why).await;
            }
            Output::Penalise(peer) => {
                let _ = self.net.penalise(peer).await;
            }
            Output::Forget(peer) => {
                let _ = self.net.forget(peer).await;
            }
            Output::Fetch {
                owner,
                source,
                id,
                hash,
            } => {
                let fetch_id = id.clone();
                let net = self.net.clone();
                let results = self.results_tx.clone();
                let started = self.spawn_bounded(async move {
                    let request = BulkRequest::Update {
                        hash: ByteBuf::from(hash.to_vec()),
                    };
                    let answer = match net.request(owner, request).await {
                        Ok(BulkResponse::Update(bytes)) => FetchAnswer::Bytes(bytes.into_vec()),
                        Ok(BulkResponse::Refused(_)) | Err(_) => FetchAnswer::Unavailable,
                        Ok(_) => FetchAnswer::WrongKind,
                    };
                    let _ = results
                        .send(Input::Fetched {
                            owner,
                            source,
                            id,
                            hash,
                            answer,
                        })
                        .await;
                });
                if started.is_err() {
                    return Some(Input::Fetched {
                        owner,
                        source,
                        id: fetch_id,
                        hash,
                        answer: FetchAnswer::Unavailable,
                    });
                }
            }
            Output::RequestParams(peer) => {
                let net = self.net.clone();
                let results = self.results_tx.clone();
                let started = self.spawn_bounded(async move {
                    let answer = net.request(peer, BulkRequest::Params).await;
                    let _ = results
                        .send(Input::ParamsReply {
                            peer,
                            answer: answer.map_err(|e| RequestFailed::Network(e.to_string())),
                        })
                        .await;
                });
                if started.is_err() {
                    return Some(Input::ParamsReply {
                        peer,
                        answer: Err(RequestFailed::TooManyUnderWay),
                    });
                }
            }
            Output::SendRing { peer, msg } => {
                let (round, attempt) = (msg.round, msg.attempt);
                // A rogue (test only) may send nothing: then nothing comes back either.
                let msg = match self.ring_attack {
                    Some(attack) => {
                        attack.apply(msg, &peer, self.core.largest_ring_hop_values())?
                    }
                    None => msg,
                };
                let undelivered = Input::RingUndelivered {
                    peer,
                    round,
                    attempt,
                };
                let net = self.net.clone();
                let results = self.results_tx.clone();
                // A large hop goes in pieces, one after the other: one request slot, and
                // the receiver holds at most the pieces of the hops under way.
                let pieces = match self.core.ring_piece_bytes() {
                    Some(bytes) => msg.into_pieces(bytes),
                    None => vec![msg],
                };
                let started = self.spawn_ring_hop(async move {
                    for piece in pieces {
                        match net.request(peer, BulkRequest::Ring(piece)).await {
                            Ok(BulkResponse::RingTaken) => {}
                            other => {
                                tracing::debug!(peer = %peer, "ring hop not delivered: {other:?}");
                                let _ = results
                                    .send(Input::RingUndelivered {
                                        peer,
                                        round,
                                        attempt,
                                    })
                                    .await;
                                return;
                            }
                        }
                    }
                });
                if started.is_err() {
                    return Some(undelivered);
                }
            }
            Output::Trainer(cmd) => {
                if let Err(e) = self.trainer_tx.try_send(Command::Mesh(cmd)) {
                    if let Command::Mesh(cmd) = e.into_inner() {
                        return Some(Input::TrainerBusy(cmd));
                    }
                }
                // A trainer held at a round's boundary waits for exactly this.
                self.limit.wake();
            }
        }
        None
    }

    /// Runs `task` in the bounded set; `Err` when it is full (the caller declines).
    fn spawn_bounded<F>(&mut self, task: F) -> Result<(), ()>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        spawn_with_permit(&mut self.tasks, &self.permits, task)
    }

    /// [`Self::spawn_bounded`] for a ring hop, which a stopping node waits for.
    fn spawn_ring_hop<F>(&mut self, task: F) -> Result<(), ()>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        spawn_with_permit(&mut self.ring_hops, &self.permits, task)
    }

    /// Turns a network event into the core's input, or serves a request.
    async fn on_event(&mut self, ev: Event) -> Option<Input> {
        match ev {
            Event::PeerUp(peer) => Some(Input::PeerUp(peer)),
            Event::PeerDown(peer) => Some(Input::PeerDown(peer)),
            Event::Subscribed { .. } => None,
            Event::BootstrapOfAnotherRun { peer, differs } => {
                self.reached_tx.send_modify(|r| r.other_run(peer, differs));
                None
            }
            Event::Gossip {
                source,
                author,
                id,
                topic,
                data,
            } => Some(Input::Gossip {
                source,
                author,
                id,
                topic,
                data,
            }),
            // A ring hop is the round's to judge; taking it is all the answer says.
            Event::Request {
                peer,
                request: BulkRequest::Ring(msg),
                channel,
            } => {
                let _ = self.net.respond(channel, BulkResponse::RingTaken).await;
                Some(Input::Ring { peer, msg })
            }
            Event::Request {
                peer,
                request,
                channel,
            } => {
                self.serve(peer, request, channel).await;
                None
            }
        }
    }

    /// Answers a peer's bulk request in a bounded task; declines when the set is full or the
    /// peer asks beyond its share ([`crate::serving`]).
    async fn serve(
        &mut self,
        peer: libp2p::PeerId,
        request: BulkRequest,
        channel: libp2p::request_response::ResponseChannel<BulkResponse>,
    ) {
        let net = self.net.clone();
        let slot = match self
            .serving
            .admit(peer, serving::is_costly(&request), Instant::now())
        {
            Ok(slot) => slot,
            Err((why, worth_a_line)) => {
                if worth_a_line {
                    tracing::info!(%peer, declined = self.serving.declined(), "declined a bulk request: {why}");
                }
                let _ = net
                    .respond(channel, BulkResponse::Refused(why.to_string()))
                    .await;
                return;
            }
        };
        let answer: std::pin::Pin<Box<dyn std::future::Future<Output = BulkResponse> + Send>> =
            match request {
                // A joiner still waiting for its state holds only initial parameters: it
                // declines rather than have its neighbour refuse (and punish) the answer.
                BulkRequest::Params if !self.core.is_training() => {
                    Box::pin(async { BulkResponse::Refused("no state yet".into()) })
                }
                BulkRequest::Params => {
                    let trainer_tx = self.trainer_tx.clone();
                    let encoder = self.core.params_encoder();
                    Box::pin(async move {
                        let (tx, rx) = oneshot::channel();
                        let stopped = || BulkResponse::Refused("trainer stopped".into());
                        if trainer_tx.send(Command::Params(tx)).await.is_err() {
                            return stopped();
                        }
                        let Ok((step, values)) = rx.await else {
                            return stopped();
                        };
                        match encoder.encode(step, &values) {
                            Ok(bytes) => BulkResponse::Params {
                                step,
                                layout: encoder.layout_hash(),
                                values: ByteBuf::from(bytes),
                            },
                            Err(e) => BulkResponse::Refused(format!("cannot encode: {e}")),
                        }
                    })
                }
                BulkRequest::Ring(_) => {
                    Box::pin(async { BulkResponse::Refused("ring hops are taken apart".into()) })
                }
                BulkRequest::Update { hash } => {
                    let response = match self.core.large_update(&hash) {
                        Some(bytes) => BulkResponse::Update(ByteBuf::from(bytes.to_vec())),
                        None => BulkResponse::Refused("no such update".into()),
                    };
                    Box::pin(async move { response })
                }
                BulkRequest::StateManifest => Box::pin(transfer::serve::manifest(
                    self.cache.clone(),
                    self.trainer_tx.clone(),
                    self.core.step(),
                )),
                BulkRequest::StateChunk { state, index } => Box::pin(transfer::serve::chunk(
                    &self.cache,
                    peer,
                    &state,
                    index,
                    self.serve_chunk_delay,
                )),
            };
        let responder = net.clone();
        let (channel_tx, channel_rx) = oneshot::channel();
        let started = self.spawn_bounded(async move {
            let response = answer.await;
            if let Ok(channel) = channel_rx.await {
                let _ = responder.respond(channel, response).await;
            }
            // The peer's slot is given back once its answer is on its way.
            drop(slot);
        });
        match started {
            Ok(()) => {
                let _ = channel_tx.send(channel);
            }
            Err(()) => {
                let _ = net
                    .respond(channel, BulkResponse::Refused("busy".into()))
                    .await;
            }
        }
    }
}

/// The timeline's name for the core's handling of `input`, for the inputs whose handling
/// costs time worth seeing: validating a neighbour's update (decode and checks), encoding an
/// own update, taking a full sync's reply, a round's hop. Others are not timed.
fn span_of(input: &Input) -> Option<&'static str> {
    match input {
        Input::Gossip { .. } | Input::Fetched { .. } => Some("receive_validate"),
        Input::Trainer(TrainerEvent::Delta { .. }) => Some("encode"),
        Input::ParamsReply { .. } | Input::Trainer(TrainerEvent::Averaged { .. }) => {
            Some("full_sync")
        }
        Input::Trainer(TrainerEvent::Params { .. } | TrainerEvent::Gradient { .. }) => {
            Some("round_contribute")
        }
        Input::Ring { .. } => Some("round_hop"),
        Input::Trainer(TrainerEvent::Combined { .. }) => Some("round_combined"),
        _ => None,
    }
}

/// Runs `task` in `set` while it holds one of `permits`; `Err` when none is left.
fn spawn_with_permit<F>(set: &mut JoinSet<()>, permits: &Arc<Semaphore>, task: F) -> Result<(), ()>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let permit = permits.clone().try_acquire_owned().map_err(|_| ())?;
    set.spawn(async move {
        task.await;
        drop(permit);
    });
    Ok(())
}
