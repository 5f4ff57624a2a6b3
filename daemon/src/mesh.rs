//! The mesh: membership, neighbours, and the flow of updates and syncs between this node's
//! trainer and its peers. It routes between the network task and the trainer thread and holds
//! no model itself.
//!
//! Each node publishes its own updates on a topic of its own; its neighbours (a bounded set,
//! `degree` peers) subscribe to it. So a node receives from about `degree` peers whatever the
//! mesh's size, and the traffic per node depends on the degree, not on N. Every so often a node
//! pulls a random neighbour's full parameters and averages with them (the neighbour sync), which
//! carries updates beyond one hop and keeps the copies close.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libp2p::gossipsub::{MessageAcceptance, MessageId};
use libp2p::PeerId;
use p2ptrain_models::codec::{self, Codec, ErrorFeedback, UpdateHeader};
use p2ptrain_models::params::{l2_norm, Layout};
use rand::seq::IteratorRandom;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint;
use crate::guard::{Arrival, GuardConfig, SeenSteps, UpdateGuard};
use crate::network::{BulkRequest, BulkResponse, Client, Event};
use crate::sync_guard::{SyncGuard, SyncRefusal};
use crate::trainer::{Command, Outgoing, Phase, Stats};
use crate::transfer::{self, Frozen};

/// How often neighbours are re-chosen and heartbeats sent.
const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How often a node tells the mesh its progress.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// Large updates kept for neighbours to pull.
const LARGE_UPDATE_CAP: usize = 4;
/// Gossip payload kinds on an update topic.
const INLINE: u8 = b'U';
const ANNOUNCE: u8 = b'A';

/// The topic a node publishes its updates on.
pub fn update_topic(run_id: &str, peer: &PeerId) -> String {
    format!("p2ptrain/{run_id}/updates/{peer}")
}

/// The topic every member publishes its progress on.
pub fn heartbeat_topic(run_id: &str) -> String {
    format!("p2ptrain/{run_id}/heartbeat")
}

/// Mesh settings.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// Neighbours to keep.
    pub degree: usize,
    /// Updates up to this many bytes travel inside the gossip message; larger ones are
    /// announced and pulled over the bulk channel.
    pub inline_max: usize,
    /// A neighbour's update whose norm exceeds this times our parameters' norm is rejected.
    pub max_update_ratio: f64,
    /// Debug throttle: delay before serving each state chunk.
    pub serve_chunk_delay: Duration,
    /// How own updates are encoded.
    pub codec: Codec,
    /// Kept fraction for top-k.
    pub density: f64,
    /// Keep what a lossy codec did not send and add it to the next update.
    pub error_feedback: bool,
    /// Outlier bound and rate limit on neighbours' updates.
    pub guard: GuardConfig,
    /// Cap on the distance bound of full-sync replies (`sync.max_sync_distance`).
    pub max_sync_distance: f64,
}

/// A neighbour sync, as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncInfo {
    /// The neighbour.
    pub peer: String,
    /// Our step when it happened.
    pub step: u64,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// Counters of updates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateCounters {
    /// Own updates published.
    pub sent: u64,
    /// Neighbours' updates received.
    pub received: u64,
    /// Of those, applied to the model.
    pub applied: u64,
    /// Of those, rejected: proof of breakage or hostility (malformed, other run or layout,
    /// another sender, non-finite, oversized or outlier norm). Each costs the author score.
    pub rejected: u64,
    /// Accepted although older than the author's newest (gossip reordered them); applied
    /// with the sync policy's staleness discount.
    #[serde(default)]
    pub late: u64,
    /// Dropped without blame: a step the author already delivered.
    #[serde(default)]
    pub duplicates: u64,
    /// Dropped without blame: older than every step still remembered for its author (gossip
    /// delivered it very late; it cannot be told from a replay).
    #[serde(default)]
    pub too_old: u64,
    /// Accepted, but scaled down to the outlier bound: beyond a multiple of the median of
    /// recent updates, yet not far enough beyond to prove hostility.
    #[serde(default)]
    pub scaled_down: u64,
    /// Of the rejected, those whose norm was an outlier against recent updates.
    #[serde(default)]
    pub outliers: u64,
    /// Dropped unread because their author sent faster than the per-peer limit.
    #[serde(default)]
    pub rate_limited: u64,
    /// Median norm of recently accepted updates: the outlier bound is a multiple of it.
    #[serde(default)]
    pub median_norm: Option<f64>,
    /// Values of accepted updates clamped by `sync.clip_value`.
    #[serde(default)]
    pub clipped_values: u64,
}

/// Counters of full neighbour syncs, as status shows them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FullSyncCounters {
    /// Replies judged and averaged.
    pub accepted: u64,
    /// Replies refused (wrong layout or answer, not finite, beyond the bound); each lowers
    /// the neighbour's score.
    pub refused: u64,
    /// Syncs that got no reply to judge (timeout, no connection, or the neighbour declined):
    /// not the neighbour's fault, not punished.
    pub failed: u64,
    /// The distance bound a reply must meet now (see [`crate::sync_guard`]).
    pub bound: f64,
    /// The largest distance accepted since start: what `sync.max_sync_distance` must leave
    /// room for.
    pub largest_accepted: Option<f64>,
    /// The latest refusal.
    pub last_refusal: Option<SyncRefusalInfo>,
}

/// A refused full sync, as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncRefusalInfo {
    /// The neighbour.
    pub peer: String,
    /// Why, in words.
    pub reason: String,
    /// Its relative distance, when one was measured.
    pub distance: Option<f64>,
    /// The bound in force.
    pub bound: f64,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// What a peer last told the mesh about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Its step.
    pub step: u64,
    /// Its recent loss.
    pub loss: Option<f64>,
    /// Its throughput.
    pub samples_per_sec: f64,
    /// Its latest held-out accuracy.
    pub accuracy: Option<f64>,
    /// Set in the last heartbeat of a node that leaves gracefully.
    #[serde(default)]
    pub leaving: bool,
}

/// The mesh's part of the status report.
#[derive(Debug, Clone, Default)]
pub struct MeshStatus {
    /// Current neighbours.
    pub neighbours: Vec<String>,
    /// Update counters (`applied` is filled from the trainer's count).
    pub updates: UpdateCounters,
    /// Rejected updates by author.
    pub rejected_by_peer: BTreeMap<String, u64>,
    /// The latest neighbour sync.
    pub last_sync: Option<SyncInfo>,
    /// Relative L2 distance to the last synced neighbour, measured before averaging.
    pub consensus_distance: Option<f64>,
    /// Full syncs judged, refused and failed.
    pub full_syncs: FullSyncCounters,
    /// Refused full-sync replies by neighbour.
    pub sync_refusals: BTreeMap<String, u64>,
    /// Latest heartbeat of each peer.
    pub progress: BTreeMap<String, Heartbeat>,
    /// The state download this node started with, if any.
    pub download: Option<transfer::DownloadReport>,
    /// Member peers connected now.
    pub members: Vec<PeerId>,
    /// L2 norm of what error feedback still owes the mesh, after the last update.
    pub residual_norm: f64,
    /// Bytes of the own update messages published (our framing, before gossipsub's), once
    /// per update.
    pub payload_bytes_sent: u64,
}

/// Routes between network and trainer; see the module docs.
pub struct Mesh {
    /// Network handle.
    pub net: Client,
    /// Trainer commands.
    pub trainer_tx: mpsc::Sender<Command>,
    /// Trainer progress.
    pub stats_rx: watch::Receiver<Stats>,
    /// Shared with the status API.
    pub status: Arc<Mutex<MeshStatus>>,
    /// Frozen states this node can serve.
    pub cache: Arc<Mutex<transfer::Cache>>,
    /// Settings.
    pub cfg: MeshConfig,
    /// This node.
    pub me: PeerId,
    /// Run id.
    pub run_id: String,
    /// Layout hash of the model.
    pub layout_hash: String,
    /// The model's parameter layout, which every update must fit.
    pub layout: Layout,
    numel: usize,
    me_bytes: [u8; 8],
    compressor: ErrorFeedback,
    members: BTreeSet<PeerId>,
    neighbours: BTreeSet<PeerId>,
    large: VecDeque<([u8; 32], Arc<Vec<u8>>)>,
    seen_steps: HashMap<PeerId, SeenSteps>,
    guard: UpdateGuard<PeerId>,
    /// Shared with the sync tasks, one at a time (the policy runs one sync at a time).
    sync_guard: Arc<Mutex<SyncGuard>>,
    pending_apply: VecDeque<(PeerId, u64, Vec<f32>)>,
    fetched_tx: mpsc::Sender<Fetched>,
    fetched_rx: Option<mpsc::Receiver<Fetched>>,
}

/// An announced update fetched (or not) from its author, awaiting its verdict.
struct Fetched {
    owner: PeerId,
    source: PeerId,
    id: MessageId,
    /// The bytes, or whether the failure was the author's fault (a wrong answer) rather than
    /// the network's.
    bytes: Result<Vec<u8>, bool>,
}

/// Pause after a neighbour declined a sync, before the policy may start the next one.
const SYNC_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Updates waiting for a busy trainer before they are merged.
const PENDING_CAP: usize = 8;
/// Announced updates being fetched at once, at most.
const FETCH_CAP: usize = 16;

impl Mesh {
    /// A mesh router for this node.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        net: Client,
        trainer_tx: mpsc::Sender<Command>,
        stats_rx: watch::Receiver<Stats>,
        status: Arc<Mutex<MeshStatus>>,
        cache: Arc<Mutex<transfer::Cache>>,
        cfg: MeshConfig,
        me: PeerId,
        run_id: String,
        layout_hash: String,
        layout: Layout,
    ) -> Mesh {
        let numel = layout.numel();
        let compressor = ErrorFeedback::new(numel, cfg.error_feedback);
        let guard = UpdateGuard::new(cfg.guard);
        let sync_guard = SyncGuard::new(cfg.max_sync_distance);
        if let Ok(mut st) = status.lock() {
            st.full_syncs.bound = sync_guard.bound();
        }
        let (fetched_tx, fetched_rx) = mpsc::channel(FETCH_CAP);
        Mesh {
            net,
            trainer_tx,
            stats_rx,
            status,
            cache,
            cfg,
            me,
            run_id,
            layout_hash,
            layout,
            numel,
            me_bytes: codec::sender_bytes(&me.to_bytes()),
            compressor,
            members: BTreeSet::new(),
            neighbours: BTreeSet::new(),
            large: VecDeque::new(),
            seen_steps: HashMap::new(),
            guard,
            sync_guard: Arc::new(Mutex::new(sync_guard)),
            pending_apply: VecDeque::new(),
            fetched_tx,
            fetched_rx: Some(fetched_rx),
        }
    }

    fn with_status(&self, f: impl FnOnce(&mut MeshStatus)) {
        if let Ok(mut s) = self.status.lock() {
            f(&mut s);
        }
    }

    /// Runs until `stop` turns true or the network goes away.
    pub async fn run(
        mut self,
        mut events: mpsc::Receiver<Event>,
        mut outgoing: mpsc::Receiver<Outgoing>,
        mut stop: watch::Receiver<bool>,
    ) {
        let _ = self.net.subscribe(heartbeat_topic(&self.run_id)).await;
        let mut refresh = tokio::time::interval(REFRESH_EVERY);
        let mut heartbeat = tokio::time::interval(HEARTBEAT_EVERY);
        let mut flush = tokio::time::interval(Duration::from_millis(50));
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::pin!(stopped);
        let Some(mut fetched_rx) = self.fetched_rx.take() else {
            return;
        };
        loop {
            tokio::select! {
                _ = &mut stopped => break,
                ev = events.recv() => match ev {
                    Some(ev) => self.on_event(ev).await,
                    None => return,
                },
                out = outgoing.recv() => match out {
                    Some(Outgoing::Update { base_step, step, delta }) => {
                        self.publish_update(base_step, step, delta).await;
                    }
                    Some(Outgoing::Sync { peer }) => self.start_sync(peer),
                    None => {}
                },
                _ = refresh.tick() => self.refresh_neighbours().await,
                _ = heartbeat.tick() => self.send_heartbeat().await,
                _ = flush.tick() => self.flush_pending(),
                Some(f) = fetched_rx.recv() => self.on_fetched(f).await,
            }
        }
        self.announce_leave().await;
    }

    async fn on_event(&mut self, ev: Event) {
        match ev {
            Event::PeerUp(peer) => {
                self.members.insert(peer);
                self.publish_members();
                self.refresh_neighbours().await;
            }
            Event::PeerDown(peer) => self.drop_member(peer).await,
            Event::Subscribed { .. } => {}
            Event::Gossip {
                source,
                author,
                id,
                topic,
                data,
            } => {
                let verdict = self.on_gossip(source, author, &id, &topic, data).await;
                if let Some(verdict) = verdict {
                    let _ = self.net.validate(id, source, verdict).await;
                }
            }
            Event::Request {
                peer,
                request,
                channel,
            } => self.on_request(peer, request, channel),
        }
    }

    /// Validates a gossip message; `None` means the verdict is given later (announced updates).
    async fn on_gossip(
        &mut self,
        source: PeerId,
        author: Option<PeerId>,
        id: &MessageId,
        topic: &str,
        data: Vec<u8>,
    ) -> Option<MessageAcceptance> {
        if topic == heartbeat_topic(&self.run_id) {
            return Some(match (author, serde_json::from_slice::<Heartbeat>(&data)) {
                (Some(a), Ok(hb)) if hb.leaving => {
                    tracing::info!(peer = %a, "peer is leaving");
                    let _ = self.net.forget(a).await;
                    self.drop_member(a).await;
                    MessageAcceptance::Accept
                }
                (Some(a), Ok(hb)) => {
                    if self.neighbours.contains(&a) {
                        let _ = self.trainer_tx.try_send(Command::PeerStep {
                            peer: a.to_string(),
                            step: hb.step,
                        });
                    }
                    self.with_status(|s| {
                        s.progress.insert(a.to_string(), hb);
                    });
                    MessageAcceptance::Accept
                }
                (author, _) => {
                    if let Some(a) = author {
                        tracing::warn!(peer = %a, "rejected a malformed heartbeat");
                        self.net.report_offence(a, "malformed heartbeat".into());
                    }
                    MessageAcceptance::Reject
                }
            });
        }
        let Some(owner) = topic
            .strip_prefix(&format!("p2ptrain/{}/updates/", self.run_id))
            .and_then(|p| p.parse::<PeerId>().ok())
        else {
            return Some(MessageAcceptance::Reject);
        };
        // A node still waiting for its state (a joiner) has nothing to apply an update to,
        // and no parameters yet to bound its norm by: such updates are dropped unjudged.
        if self.stats_rx.borrow().phase != Phase::Training {
            return Some(MessageAcceptance::Ignore);
        }
        // Only the topic's owner may publish on it: a signed author must match.
        if author != Some(owner) {
            self.reject(owner, "update published on another peer's topic");
            return Some(MessageAcceptance::Reject);
        }
        // Before any decoding, so a flood costs little. Dropped, not rejected: a box
        // configured to publish very often is not hostile.
        if let Err(why) = self.guard.admit(&owner, std::time::Instant::now()) {
            tracing::debug!(peer = %owner, "dropped update: {why}");
            self.with_status(|s| s.updates.rate_limited += 1);
            return Some(MessageAcceptance::Ignore);
        }
        match data.split_first() {
            Some((&INLINE, bytes)) => Some(self.accept_update(owner, bytes)),
            Some((&ANNOUNCE, rest)) if rest.len() == 32 + 8 + 8 => {
                let mut hash = [0u8; 32];
                hash.copy_from_slice(&rest[..32]);
                let size = u64::from_le_bytes(rest[32..40].try_into().unwrap_or([0; 8]));
                if size as usize > codec::max_len(&self.layout) {
                    self.reject(owner, "announced update larger than any valid update");
                    return Some(MessageAcceptance::Reject);
                }
                // Fetch it in a task of its own: two nodes that announce to each other at the
                // same moment would otherwise each wait on the other's busy loop. The verdict
                // follows the fetch (see `on_fetched`).
                let net = self.net.clone();
                let fetched_tx = self.fetched_tx.clone();
                let id = id.clone();
                tokio::spawn(async move {
                    let answer = net
                        .request(
                            owner,
                            BulkRequest::Update {
                                hash: ByteBuf::from(hash.to_vec()),
                            },
                        )
                        .await;
                    // Only bytes that contradict the announced hash (or an answer of the
                    // wrong kind) blame the author. An honest author keeps just its last few
                    // large updates, so a fetch that arrives late on a slow link is refused
                    // through no fault of its own, as is one lost to the network.
                    let bytes = match answer {
                        Ok(BulkResponse::Update(bytes))
                            if Sha256::digest(&bytes)[..] == hash[..] =>
                        {
                            Ok(bytes.into_vec())
                        }
                        Ok(BulkResponse::Refused(_)) | Err(_) => Err(false),
                        Ok(_) => Err(true),
                    };
                    let _ = fetched_tx
                        .send(Fetched {
                            owner,
                            source,
                            id,
                            bytes,
                        })
                        .await;
                });
                None
            }
            _ => {
                self.reject(owner, "unknown update message kind");
                Some(MessageAcceptance::Reject)
            }
        }
    }

    async fn on_fetched(&mut self, f: Fetched) {
        let verdict = match f.bytes {
            Ok(bytes) => self.accept_update(f.owner, &bytes),
            Err(true) => {
                self.reject(
                    f.owner,
                    "announced update does not match its hash, or the answer was no update",
                );
                MessageAcceptance::Reject
            }
            Err(false) => MessageAcceptance::Ignore,
        };
        let _ = self.net.validate(f.id, f.source, verdict).await;
    }

    fn publish_members(&self) {
        let members: Vec<PeerId> = self.members.iter().copied().collect();
        self.with_status(|s| s.members = members);
    }

    async fn drop_member(&mut self, peer: PeerId) {
        self.members.remove(&peer);
        // A member that comes back may have restarted from an older checkpoint: its step
        // numbers repeat, and its updates are news again.
        self.seen_steps.remove(&peer);
        self.publish_members();
        self.with_status(|s| {
            s.progress.remove(&peer.to_string());
        });
        if self.neighbours.contains(&peer) {
            self.refresh_neighbours().await;
        }
    }

    fn reject(&mut self, author: PeerId, why: &str) {
        tracing::warn!(peer = %author, "rejected update: {why}");
        self.net
            .report_offence(author, format!("rejected update: {why}"));
        self.with_status(|s| {
            s.updates.received += 1;
            s.updates.rejected += 1;
            *s.rejected_by_peer.entry(author.to_string()).or_default() += 1;
        });
    }

    /// Checks an encoded update and, if it passes, queues it for the trainer.
    fn accept_update(&mut self, author: PeerId, bytes: &[u8]) -> MessageAcceptance {
        let (header, values) = match codec::decode(bytes, &self.layout) {
            Ok(v) => v,
            Err(e) => {
                self.reject(author, &e.to_string());
                return MessageAcceptance::Reject;
            }
        };
        if header.run_id != codec::id_bytes(&self.run_id) {
            self.reject(author, "update of another run");
            return MessageAcceptance::Reject;
        }
        if header.layout != codec::id_bytes(&self.layout_hash) {
            self.reject(author, "update for another parameter layout");
            return MessageAcceptance::Reject;
        }
        if header.sender != codec::sender_bytes(&author.to_bytes()) {
            self.reject(author, "update names another sender");
            return MessageAcceptance::Reject;
        }
        if values.iter().any(|v| !v.is_finite()) {
            self.reject(author, "update holds NaN or infinite values");
            return MessageAcceptance::Reject;
        }
        let norm = l2_norm(&values);
        let param_norm = self.stats_rx.borrow().param_norm;
        let bound = self.cfg.max_update_ratio * param_norm.max(1.0);
        if norm > bound {
            self.reject(
                author,
                &format!(
                    "update norm {norm:.3e} exceeds the bound {bound:.3e} ({} x the parameters' norm {param_norm:.3e})",
                    self.cfg.max_update_ratio
                ),
            );
            return MessageAcceptance::Reject;
        }
        // Order proves nothing (gossip reorders honest messages): a late update is applied
        // with the policy's staleness discount, a repeated one dropped, neither punished.
        let seen = self.seen_steps.entry(author).or_default();
        let arrival = seen.classify(header.step);
        let lateness = seen
            .newest()
            .map_or(0, |newest| newest.saturating_sub(header.step));
        if matches!(arrival, Arrival::Duplicate | Arrival::TooOld) {
            tracing::debug!(peer = %author, step = header.step, ?arrival, "update dropped unapplied");
            self.with_status(|s| match arrival {
                Arrival::Duplicate => s.updates.duplicates += 1,
                _ => s.updates.too_old += 1,
            });
            return MessageAcceptance::Ignore;
        }
        let span = header.step.saturating_sub(header.base_step);
        let scale = match self.guard.judge_norm(norm, span, lateness) {
            Ok(scale) => scale,
            Err(why) => {
                self.reject(author, &why.to_string());
                self.with_status(|s| s.updates.outliers += 1);
                return MessageAcceptance::Reject;
            }
        };
        self.seen_steps
            .entry(author)
            .or_default()
            .remember(header.step);
        if arrival == Arrival::Late {
            self.with_status(|s| s.updates.late += 1);
        }
        self.guard.record(norm, span);
        let median = self.guard.median();
        let mut values = values;
        if scale < 1.0 {
            tracing::debug!(peer = %author, norm, scale, span, lateness, "large update scaled down to the outlier bound");
            values.iter_mut().for_each(|v| *v *= scale as f32);
            self.with_status(|s| s.updates.scaled_down += 1);
        }
        let clipped = crate::guard::clip(&mut values, self.cfg.guard.clip_value) as u64;
        self.with_status(|s| {
            s.updates.received += 1;
            s.updates.median_norm = median;
            s.updates.clipped_values += clipped;
        });
        // While the trainer is busy, a short queue; beyond it, merge into the newest entry
        // rather than queueing more copies (the older step is kept: the merged update is as
        // stale as its oldest part).
        let full = self.pending_apply.len() >= PENDING_CAP;
        match self.pending_apply.back_mut() {
            Some((_, _, p)) if full => {
                p.iter_mut().zip(&values).for_each(|(a, b)| *a += b);
            }
            _ => self.pending_apply.push_back((author, header.step, values)),
        }
        self.flush_pending();
        // Valid, applied, and not forwarded: the author publishes straight to every subscriber
        // of its topic (its neighbours, all connected to it), so relaying among them would only
        // add copies, and more of them the more popular the author. `Ignore` drops the message
        // from gossip without penalising anyone.
        MessageAcceptance::Ignore
    }

    fn flush_pending(&mut self) {
        while let Some((peer, step, values)) = self.pending_apply.pop_front() {
            let cmd = Command::ApplyUpdate {
                peer: peer.to_string(),
                step,
                values,
            };
            if let Err(mpsc::error::TrySendError::Full(Command::ApplyUpdate {
                step, values, ..
            })) = self.trainer_tx.try_send(cmd)
            {
                self.pending_apply.push_front((peer, step, values));
                return;
            }
        }
    }

    async fn publish_update(&mut self, base_step: u64, step: u64, delta: Vec<f32>) {
        let header = UpdateHeader {
            run_id: codec::id_bytes(&self.run_id),
            layout: codec::id_bytes(&self.layout_hash),
            sender: self.me_bytes,
            base_step,
            step,
            codec: self.cfg.codec,
            numel: delta.len() as u32,
        };
        let bytes = match self
            .compressor
            .compress(&header, &self.layout, &delta, self.cfg.density)
        {
            Ok(e) => e.bytes,
            Err(e) => {
                tracing::warn!("own update not published: {e}");
                return;
            }
        };
        let mut msg;
        if bytes.len() <= self.cfg.inline_max {
            msg = Vec::with_capacity(bytes.len() + 1);
            msg.push(INLINE);
            msg.extend_from_slice(&bytes);
        } else {
            let hash: [u8; 32] = Sha256::digest(&bytes).into();
            msg = vec![ANNOUNCE];
            msg.extend_from_slice(&hash);
            msg.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            msg.extend_from_slice(&step.to_le_bytes());
            if self.large.len() == LARGE_UPDATE_CAP {
                self.large.pop_front();
            }
            self.large.push_back((hash, Arc::new(bytes)));
        }
        let residual = self.compressor.residual_norm();
        let payload = msg.len() as u64;
        match self
            .net
            .publish(update_topic(&self.run_id, &self.me), msg)
            .await
        {
            Ok(()) => self.with_status(|s| {
                s.updates.sent += 1;
                s.residual_norm = residual;
                s.payload_bytes_sent += payload;
            }),
            Err(e) => tracing::debug!("update not published: {e}"),
        }
    }

    async fn refresh_neighbours(&mut self) {
        let before = self.neighbours.clone();
        self.neighbours.retain(|p| self.members.contains(p));
        let want = self.cfg.degree.saturating_sub(self.neighbours.len());
        let extra: Vec<PeerId> = self
            .members
            .iter()
            .filter(|p| !self.neighbours.contains(p))
            .copied()
            .choose_multiple(&mut rand::rng(), want);
        self.neighbours.extend(extra);
        let gone = before.difference(&self.neighbours).map(|p| (*p, false));
        let new = self.neighbours.difference(&before).map(|p| (*p, true));
        let changes: Vec<(PeerId, bool)> = gone.chain(new).collect();
        for (peer, up) in changes {
            let topic = update_topic(&self.run_id, &peer);
            if up {
                let _ = self.net.subscribe(topic).await;
                tracing::info!(peer = %peer, "new neighbour");
            } else {
                let _ = self.net.unsubscribe(topic).await;
                tracing::info!(peer = %peer, "neighbour dropped");
            }
            let _ = self
                .trainer_tx
                .send(Command::Neighbour {
                    peer: peer.to_string(),
                    up,
                })
                .await;
        }
        let list: Vec<String> = self.neighbours.iter().map(|p| p.to_string()).collect();
        self.with_status(|s| s.neighbours = list);
    }

    async fn send_heartbeat(&self) {
        self.heartbeat(false).await;
    }

    /// Tells the mesh this node is leaving, so neighbours replace it at once.
    pub async fn announce_leave(&self) {
        self.heartbeat(true).await;
    }

    async fn heartbeat(&self, leaving: bool) {
        let stats = self.stats_rx.borrow().clone();
        let hb = Heartbeat {
            step: stats.step,
            loss: stats.loss,
            samples_per_sec: stats.samples_per_sec,
            accuracy: stats.eval.map(|e| e.accuracy),
            leaving,
        };
        if let Ok(bytes) = serde_json::to_vec(&hb) {
            let _ = self.net.publish(heartbeat_topic(&self.run_id), bytes).await;
        }
    }

    /// Runs the full sync the trainer's policy asked for, in a task of its own.
    fn start_sync(&mut self, peer: String) {
        let task = SyncTask {
            net: self.net.clone(),
            trainer_tx: self.trainer_tx.clone(),
            status: self.status.clone(),
            guard: self.sync_guard.clone(),
            layout_hash: self.layout_hash.clone(),
            numel: self.numel,
            step: self.stats_rx.borrow().step,
        };
        tokio::spawn(task.run(peer));
    }

    fn on_request(
        &mut self,
        peer: PeerId,
        request: BulkRequest,
        channel: libp2p::request_response::ResponseChannel<BulkResponse>,
    ) {
        let net = self.net.clone();
        match request {
            BulkRequest::Params => {
                // A joiner still waiting for its state holds only initial parameters: it
                // declines rather than have its neighbour refuse (and punish) the answer.
                if self.stats_rx.borrow().phase != Phase::Training {
                    tokio::spawn(async move {
                        let _ = net
                            .respond(channel, BulkResponse::Refused("no state yet".into()))
                            .await;
                    });
                    return;
                }
                let trainer_tx = self.trainer_tx.clone();
                let layout = self.layout_hash.clone();
                tokio::spawn(async move {
                    let (tx, rx) = oneshot::channel();
                    let response = match trainer_tx.send(Command::Params(tx)).await {
                        Ok(()) => match rx.await {
                            Ok((step, values)) => BulkResponse::Params {
                                step,
                                layout,
                                values: ByteBuf::from(
                                    values
                                        .iter()
                                        .flat_map(|v| v.to_le_bytes())
                                        .collect::<Vec<u8>>(),
                                ),
                            },
                            Err(_) => BulkResponse::Refused("trainer stopped".into()),
                        },
                        Err(_) => BulkResponse::Refused("trainer stopped".into()),
                    };
                    let _ = net.respond(channel, response).await;
                });
            }
            BulkRequest::Update { hash } => {
                let found = self
                    .large
                    .iter()
                    .find(|(h, _)| h[..] == hash[..])
                    .map(|(_, b)| b.clone());
                let response = match found {
                    Some(bytes) => BulkResponse::Update(ByteBuf::from(bytes.to_vec())),
                    None => BulkResponse::Refused("no such update".into()),
                };
                tokio::spawn(async move {
                    let _ = net.respond(channel, response).await;
                });
            }
            BulkRequest::StateManifest => {
                let cache = self.cache.clone();
                let trainer_tx = self.trainer_tx.clone();
                tokio::spawn(async move {
                    let response = match freeze(&cache, &trainer_tx).await {
                        Ok(frozen) => {
                            let (load, cached) = cache
                                .lock()
                                .map(|mut c| (c.load(), c.hashes()))
                                .unwrap_or_default();
                            let others = cached.into_iter().filter(|h| *h != frozen.hash).collect();
                            BulkResponse::StateManifest(frozen.manifest(load, others))
                        }
                        Err(e) => BulkResponse::Refused(e),
                    };
                    let _ = net.respond(channel, response).await;
                });
            }
            BulkRequest::StateChunk { state, index } => {
                let frozen = self.cache.lock().ok().and_then(|mut c| {
                    c.note_downloader(peer);
                    c.get(&state)
                });
                let delay = self.cfg.serve_chunk_delay;
                tokio::spawn(async move {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let response = match frozen.as_ref().and_then(|f| f.chunk(index)) {
                        Some(bytes) => BulkResponse::StateChunk(ByteBuf::from(bytes.to_vec())),
                        None => BulkResponse::Refused("no such state or chunk".into()),
                    };
                    let _ = net.respond(channel, response).await;
                });
            }
        }
    }
}

/// Freezes the trainer's current state (or reuses a very recent freeze).
async fn freeze(
    cache: &Mutex<transfer::Cache>,
    trainer_tx: &mpsc::Sender<Command>,
) -> Result<Arc<Frozen>, String> {
    if let Some(f) = cache.lock().ok().and_then(|mut c| c.reusable()) {
        return Ok(f);
    }
    let (tx, rx) = oneshot::channel();
    trainer_tx
        .send(Command::Snapshot(tx))
        .await
        .map_err(|_| "trainer stopped".to_string())?;
    let snapshot = rx.await.map_err(|_| "trainer stopped".to_string())?;
    let step = snapshot.info.step;
    let frozen = tokio::task::spawn_blocking(move || {
        checkpoint::encode(&snapshot, 0, crate::store::unix_now())
            .map(|(bytes, _)| Arc::new(Frozen::new(step, bytes, true)))
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())??;
    if let Ok(mut c) = cache.lock() {
        c.insert(frozen.clone());
    }
    Ok(frozen)
}

/// One neighbour sync, run as its own task so a slow or dead neighbour never blocks the mesh.
struct SyncTask {
    net: Client,
    trainer_tx: mpsc::Sender<Command>,
    status: Arc<Mutex<MeshStatus>>,
    guard: Arc<Mutex<SyncGuard>>,
    layout_hash: String,
    numel: usize,
    step: u64,
}

/// How a sync ended, when it did not average.
enum SyncError {
    /// The neighbour's reply was judged and refused: its fault.
    Refused(SyncRefusal),
    /// No reply to judge (network, our own trainer): nobody's fault.
    Failed(String),
    /// The neighbour declined (a joiner still downloading, a node stopping): not its fault.
    Declined(String),
}

impl SyncTask {
    async fn run(self, peer: String) {
        let result = match peer.parse::<PeerId>() {
            Ok(p) => self.sync(p).await,
            Err(e) => Err(SyncError::Failed(format!("not a peer id: {e}"))),
        };
        let current = self.guard.lock().map(|g| g.bound()).unwrap_or(0.0);
        match &result {
            Ok(_) => {}
            Err(SyncError::Failed(e)) => {
                tracing::info!(%peer, "neighbour sync skipped: {e}");
                self.with_status(|s| s.full_syncs.failed += 1);
            }
            Err(SyncError::Declined(e)) => {
                tracing::info!(%peer, "neighbour sync skipped: the neighbour declined: {e}");
                self.with_status(|s| s.full_syncs.failed += 1);
                // The policy retries at its next step; without a pause a lone neighbour that
                // declines (a joiner still downloading) was asked ~300 times a second.
                tokio::time::sleep(SYNC_RETRY_PAUSE).await;
            }
            Err(SyncError::Refused(why)) => {
                let bound = why.bound().unwrap_or(current);
                tracing::warn!(
                    %peer,
                    distance = why.distance(),
                    bound,
                    "refused neighbour sync: {why}; the peer's score is lowered"
                );
                self.with_status(|s| {
                    s.full_syncs.refused += 1;
                    *s.sync_refusals.entry(peer.clone()).or_default() += 1;
                    s.full_syncs.last_refusal = Some(SyncRefusalInfo {
                        peer: peer.clone(),
                        reason: why.to_string(),
                        distance: why.distance(),
                        bound,
                        at: crate::store::unix_now(),
                    });
                });
                if let Ok(p) = peer.parse::<PeerId>() {
                    self.net
                        .report_offence(p, format!("refused full-sync reply: {why}"));
                    let _ = self.net.sync_refused(p).await;
                }
            }
        }
        // The policy starts no other sync until it hears how this one ended; a failure makes
        // it pick the least recently synced other neighbour at the next step.
        let _ = self
            .trainer_tx
            .send(Command::SyncFinished {
                peer,
                ok: result.is_ok(),
            })
            .await;
    }

    fn with_status(&self, f: impl FnOnce(&mut MeshStatus)) {
        if let Ok(mut s) = self.status.lock() {
            f(&mut s);
        }
    }

    async fn sync(&self, peer: PeerId) -> Result<(), SyncError> {
        let answer = self
            .net
            .request(peer, BulkRequest::Params)
            .await
            .map_err(|e| SyncError::Failed(e.to_string()))?;
        let (values, their_step) = match answer {
            BulkResponse::Params {
                step,
                layout,
                values,
            } => {
                if layout != self.layout_hash {
                    return Err(SyncError::Refused(SyncRefusal::Layout(format!(
                        "layout {layout}, ours is {}",
                        self.layout_hash
                    ))));
                }
                if values.len() != self.numel * 4 {
                    return Err(SyncError::Refused(SyncRefusal::Layout(format!(
                        "{} bytes, the model has {} values",
                        values.len(),
                        self.numel
                    ))));
                }
                let v: Vec<f32> = values
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                (v, step)
            }
            // An honest neighbour declines while it has no state or is stopping.
            BulkResponse::Refused(why) => return Err(SyncError::Declined(why)),
            other => {
                let what = match other {
                    BulkResponse::StateManifest(_) => "a state manifest",
                    BulkResponse::StateChunk(_) => "a state chunk",
                    _ => "an update",
                };
                return Err(SyncError::Refused(SyncRefusal::WrongAnswer(what.into())));
            }
        };
        let bound = self
            .guard
            .lock()
            .map(|g| g.bound())
            .map_err(|_| SyncError::Failed("sync guard poisoned".into()))?;
        let stopped = || SyncError::Failed("trainer stopped".into());
        let (tx, rx) = oneshot::channel();
        self.trainer_tx
            .send(Command::Average {
                theirs: values,
                bound,
                reply: tx,
            })
            .await
            .map_err(|_| stopped())?;
        let distance = rx
            .await
            .map_err(|_| stopped())?
            .map_err(SyncError::Failed)?
            .map_err(SyncError::Refused)?;
        tracing::debug!(peer = %peer, their_step, distance, bound, "neighbour sync");
        let (new_bound, largest) = match self.guard.lock() {
            Ok(mut g) => {
                g.record(distance);
                (g.bound(), g.largest_accepted())
            }
            Err(_) => (bound, None),
        };
        self.with_status(|s| {
            s.consensus_distance = Some(distance);
            s.full_syncs.accepted += 1;
            s.full_syncs.bound = new_bound;
            s.full_syncs.largest_accepted = largest;
            s.last_sync = Some(SyncInfo {
                peer: peer.to_string(),
                step: self.step,
                at: crate::store::unix_now(),
            });
        });
        Ok(())
    }
}
