//! A rogue peer of the same run, living in the test process: a real libp2p node (the daemon's
//! own network module) that joins through an honest node and publishes whatever the test
//! hands it on its own update topic. It refuses every bulk request, so it never serves a
//! state, except that a rogue started with [`Rogue::join_serving`] answers parameter requests
//! (full syncs) with hostile parameters of the right layout, and publishes heartbeats so the
//! honest nodes count it as a live neighbour and sync with it; and one started with
//! [`Rogue::join_donor`] offers joiners a hostile state (see [`DonorAnswer`]).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::PeerId;
use p2ptrain_daemon::mesh::{heartbeat_topic, update_topic, Heartbeat};
use p2ptrain_daemon::network::{self, BulkRequest, BulkResponse, Client, Event, NetConfig};
use p2ptrain_models::codec::{self, Codec, UpdateHeader};
use p2ptrain_models::Layout;
use serde_bytes::ByteBuf;

/// How a serving rogue answers a full-sync request (cycled through, one per request).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SyncAnswer {
    /// The asker's own current parameters (fetched from it) times this factor.
    Scaled(f32),
    /// Freshly initialised parameters from another seed: random, of the model's own scale.
    Random,
}

/// What a hostile donor offers a joiner.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DonorAnswer {
    /// A manifest claiming 1 GiB, far beyond any checkpoint of the run, so the joiner's own
    /// check refuses it. It lists the hashes of its first [`OVERSIZED_HASHES`] chunks only: a
    /// hash for every chunk (4,096 of them, ~139 KB) would be cut off by the bulk channel
    /// before that check, since an answer to a manifest request is read only as long as the
    /// hashes of the run's largest state make it (`BulkLimits`, unit-tested there).
    Oversized,
    /// A plausible manifest of the most advanced state, whose chunks come back 1,000 bytes long.
    WrongLength,
    /// A plausible manifest of the most advanced state, whose chunks are the right length but
    /// fail their hash.
    BadHash,
    /// A state of this run and layout that verifies (its hash and checksum are right), at
    /// the step it claims, whose counters are at their limit (2^48 optimizer steps: AdamW's
    /// bias correction divided by zero at 2^32 before counters were bounded).
    MaxCounters,
    /// [`DonorAnswer::BadHash`]'s manifest, each chunk answered [`DRIP_DELAY`] late: just
    /// under the joiner's request timeout in the test that uses it.
    Drip,
}

/// How late a [`DonorAnswer::Drip`] donor answers each chunk.
pub const DRIP_DELAY: Duration = Duration::from_millis(2500);

/// The bytes of a [`DonorAnswer::MaxCounters`] state of run `run_id` and layout
/// `layout_hash` (no tensors: the counters are refused before any is loaded).
fn max_counters_state(run_id: &str, layout_hash: &str) -> Arc<p2ptrain_daemon::transfer::Frozen> {
    use p2ptrain_daemon::checkpoint::{self, Snapshot, StateInfo};
    let step = 1_000_000_000;
    let snapshot = Snapshot {
        info: StateInfo {
            run_id: run_id.to_string(),
            config_hash: "hostile".into(),
            layout_hash: layout_hash.to_string(),
            model: "hostile".into(),
            optimizer: "adamw".into(),
            step,
            samples_seen: 0,
            optimizer_steps: 1 << 48,
        },
        tensors: Default::default(),
    };
    let (bytes, _) = checkpoint::encode(&snapshot, 0, 0).expect("encode a state");
    Arc::new(p2ptrain_daemon::transfer::Frozen::new(step, bytes))
}

/// Bytes of the plausible hostile state: three chunks.
const HOSTILE_STATE: u64 = 2 * p2ptrain_daemon::wire::STATE_CHUNK_BYTES as u64 + 100;

/// Chunk hashes listed by the [`DonorAnswer::Oversized`] manifest.
const OVERSIZED_HASHES: u64 = 16;

/// The manifest a hostile donor offers.
fn hostile_manifest(answer: DonorAnswer) -> network::StateManifest {
    let chunk = p2ptrain_daemon::wire::STATE_CHUNK_BYTES as u64;
    let total = match answer {
        DonorAnswer::Oversized => 1 << 30,
        _ => HOSTILE_STATE,
    };
    // Each lie its own state: donors of one hash are taken for holders of one state.
    let tag = match answer {
        DonorAnswer::Oversized => 0xA1,
        DonorAnswer::WrongLength => 0xA2,
        DonorAnswer::BadHash => 0xA3,
        DonorAnswer::MaxCounters => 0xA4,
        DonorAnswer::Drip => 0xA5,
    };
    let listed = match answer {
        DonorAnswer::Oversized => OVERSIZED_HASHES,
        _ => total.div_ceil(chunk),
    };
    network::StateManifest {
        hash: ByteBuf::from(vec![tag; 32]),
        // Far ahead of any honest node, so a joiner tries it first.
        step: 1_000_000_000,
        total,
        chunk_size: chunk as u32,
        chunk_hashes: (0..listed)
            .map(|i| ByteBuf::from(vec![(i % 251) as u8; 32]))
            .collect(),
        load: 0,
        cached: Vec::new(),
    }
}

/// See the module docs.
pub struct Rogue {
    /// Its runtime; the network task runs on it between calls.
    pub rt: tokio::runtime::Runtime,
    client: Client,
    /// Its peer id.
    pub id: PeerId,
    /// Its update topic.
    pub topic: String,
    /// The run it claims to belong to.
    pub run_id: String,
    /// The model's parameter layout.
    pub layout: Layout,
    /// Scalar parameters of the model.
    pub numel: usize,
}

impl Rogue {
    /// Joins the mesh of `config` through `bootstrap`.
    pub fn join(config: &Path, bootstrap: &str) -> Rogue {
        Rogue::join_serving(config, bootstrap, &[])
    }

    /// [`Rogue::join`], answering parameter requests with `answers` in turn (refusing them if
    /// there are none) and, if there are, publishing a heartbeat every second.
    pub fn join_serving(config: &Path, bootstrap: &str, answers: &[SyncAnswer]) -> Rogue {
        Rogue::join_with(config, bootstrap, answers, None)
    }

    /// [`Rogue::join`], offering joiners the hostile state `donor`.
    pub fn join_donor(config: &Path, bootstrap: &str, donor: DonorAnswer) -> Rogue {
        Rogue::join_with(config, bootstrap, &[], Some(donor))
    }

    fn join_with(
        config: &Path,
        bootstrap: &str,
        answers: &[SyncAnswer],
        donor: Option<DonorAnswer>,
    ) -> Rogue {
        let config = p2ptrain_daemon::Config::load(Some(config)).expect("config");
        let run_id = config.run_id();
        let sync_terms = config.sync.shared_terms();
        let run_parts = config.run_parts();
        let prepared = p2ptrain_daemon::node::prepare(config).expect("prepare");
        let model = p2ptrain_models::Model::new(&prepared.spec, 1, &candle_core::Device::Cpu)
            .expect("model");
        let layout = model.params().layout();
        let numel = model.params().numel();
        let random = model.params().flatten().expect("flatten");
        let layout_hash = layout.hash();
        let dense_layout = layout.clone();
        let run = run_id.clone();
        let answers = answers.to_vec();
        // Built only for the donor that offers it.
        let counters_state = (donor == Some(DonorAnswer::MaxCounters))
            .then(|| max_counters_state(&run_id, &layout_hash));
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let key = Keypair::generate_ed25519();
        let id = key.public().to_peer_id();
        let net_cfg = NetConfig {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().expect("addr")],
            bootstrap: vec![bootstrap.parse().expect("addr")],
            run_id: run_id.clone(),
            run_parts,
            sync_terms,
            mdns: false,
            psk: None,
            allow: None,
            relay_server: false,
            upnp: false,
            kad_walk_every: network::KAD_WALK_EVERY,
            bulk: network::BulkLimits::for_model(random.len()),
            request_timeout: network::BULK_TIMEOUT,
        };
        let client = rt.block_on(async {
            let (client, mut events, event_loop) =
                network::new(key, &net_cfg, &mut network::Registry::default())
                    .expect("rogue network");
            tokio::spawn(event_loop.run());
            let responder = client.clone();
            let serving = !answers.is_empty();
            tokio::spawn(async move {
                let mut turn = 0;
                while let Some(ev) = events.recv().await {
                    let Event::Request {
                        peer,
                        request,
                        channel,
                    } = ev
                    else {
                        continue;
                    };
                    let hostile_state = match (&request, donor, counters_state.as_deref()) {
                        (BulkRequest::StateManifest, _, Some(state)) => {
                            Some(BulkResponse::StateManifest(state.manifest(0, Vec::new())))
                        }
                        (BulkRequest::StateChunk { index, .. }, _, Some(state)) => {
                            Some(match state.chunk(*index) {
                                Some(bytes) => {
                                    BulkResponse::StateChunk(ByteBuf::from(bytes.to_vec()))
                                }
                                None => BulkResponse::Refused("no such chunk".into()),
                            })
                        }
                        (BulkRequest::StateManifest, Some(d), _) => {
                            Some(BulkResponse::StateManifest(hostile_manifest(d)))
                        }
                        (BulkRequest::StateChunk { index, .. }, Some(DonorAnswer::Drip), _) => {
                            // In a task of its own: other requests are answered meanwhile.
                            let chunk = p2ptrain_daemon::wire::STATE_CHUNK_BYTES as u64;
                            let len = HOSTILE_STATE
                                .saturating_sub(u64::from(*index) * chunk)
                                .min(chunk);
                            let net = responder.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(DRIP_DELAY).await;
                                let bytes = ByteBuf::from(vec![7u8; len as usize]);
                                let _ = net.respond(channel, BulkResponse::StateChunk(bytes)).await;
                            });
                            continue;
                        }
                        (BulkRequest::StateChunk { .. }, Some(DonorAnswer::WrongLength), _) => {
                            Some(BulkResponse::StateChunk(ByteBuf::from(vec![0u8; 1000])))
                        }
                        (BulkRequest::StateChunk { index, .. }, Some(DonorAnswer::BadHash), _) => {
                            let chunk = p2ptrain_daemon::wire::STATE_CHUNK_BYTES as u64;
                            let len = HOSTILE_STATE
                                .saturating_sub(u64::from(*index) * chunk)
                                .min(chunk);
                            Some(BulkResponse::StateChunk(ByteBuf::from(vec![
                                7u8;
                                len as usize
                            ])))
                        }
                        _ => None,
                    };
                    if let Some(response) = hostile_state {
                        let _ = responder.respond(channel, response).await;
                        continue;
                    }
                    let answer = match request {
                        BulkRequest::Params if serving => {
                            turn += 1;
                            Some(answers[(turn - 1) % answers.len()])
                        }
                        _ => None,
                    };
                    // In a task of its own: fetching the asker's parameters is a request back.
                    let net = responder.clone();
                    let random = random.clone();
                    let layout = layout_hash.clone();
                    let dense = dense_layout.clone();
                    let header = UpdateHeader {
                        run_id: codec::id_bytes(&run),
                        layout: codec::id_bytes(&layout_hash),
                        sender: codec::sender_bytes(&id.to_bytes()),
                        base_step: 1_000_000,
                        step: 1_000_000,
                        codec: Codec::Dense,
                        numel: numel as u32,
                    };
                    tokio::spawn(async move {
                        // Parameters travel in the codec's dense format: the rogue's are well
                        // formed and of the right layout, only their values are hostile.
                        let values = match answer {
                            Some(SyncAnswer::Random) => Some(random),
                            Some(SyncAnswer::Scaled(k)) => {
                                match net.request(peer, BulkRequest::Params).await {
                                    Ok(BulkResponse::Params { values, .. }) => {
                                        codec::decode(&values, &dense).ok().map(|(_, v)| {
                                            v.iter().map(|x| k * x).collect::<Vec<f32>>()
                                        })
                                    }
                                    _ => None,
                                }
                            }
                            None => None,
                        };
                        let encoded =
                            values.and_then(|v| codec::encode(&header, &dense, &v, 1.0).ok());
                        let response = match encoded {
                            Some(e) => BulkResponse::Params {
                                step: 1_000_000,
                                layout,
                                values: ByteBuf::from(e.bytes),
                            },
                            None => BulkResponse::Refused("rogue".into()),
                        };
                        let _ = net.respond(channel, response).await;
                    });
                }
            });
            if serving {
                let beat = client.clone();
                let topic = heartbeat_topic(&run_id);
                tokio::spawn(async move {
                    for step in 1u64.. {
                        let hb = Heartbeat {
                            step: step * 500,
                            seq: step,
                            ..Heartbeat::default()
                        };
                        let bytes = serde_json::to_vec(&hb).expect("heartbeat json");
                        let _ = beat.publish(topic.clone(), bytes).await;
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                });
            }
            client
        });
        Rogue {
            rt,
            client,
            topic: update_topic(&run_id, &id),
            id,
            run_id,
            layout,
            numel,
        }
    }

    /// A header for a dense update of `numel` values at `step`, of run `run`, from this rogue.
    pub fn header(&self, step: u64, run: &str, numel: usize) -> UpdateHeader {
        UpdateHeader {
            run_id: codec::id_bytes(run),
            layout: codec::id_bytes(&self.layout.hash()),
            sender: codec::sender_bytes(&self.id.to_bytes()),
            base_step: step.saturating_sub(1),
            step,
            codec: Codec::Dense,
            numel: numel as u32,
        }
    }

    /// A well-formed inline update message (as the mesh frames it) of `values` at `step`.
    pub fn update(&self, step: u64, values: &[f32]) -> Vec<u8> {
        inline(self.encode(self.header(step, &self.run_id, self.numel), values))
    }

    /// A well-formed inline top-k update (one value per tensor kept): about a hundred bytes,
    /// so a flood of them is limited by the receiver, not by the wire.
    pub fn tiny_update(&self, step: u64, values: &[f32]) -> Vec<u8> {
        let mut header = self.header(step, &self.run_id, self.numel);
        header.codec = Codec::TopK(codec::ValueFormat::F16);
        inline(
            codec::encode(&header, &self.layout, values, 1e-9)
                .expect("encode")
                .bytes,
        )
    }

    /// Encodes `values` under `header` with the model's layout.
    pub fn encode(&self, header: UpdateHeader, values: &[f32]) -> Vec<u8> {
        codec::encode(&header, &self.layout, values, 1.0)
            .expect("encode")
            .bytes
    }

    /// Publishes once the honest node has subscribed to the rogue's topic (it does when it
    /// makes the rogue a neighbour), retrying for up to a minute.
    pub fn publish_when_heard(&self, msg: Vec<u8>) {
        self.rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while self
                .client
                .publish(self.topic.clone(), msg.clone())
                .await
                .is_err()
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the honest node never subscribed to the rogue"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
    }

    /// Publishes each message, `gap` apart; Err if some could not be (no subscriber left, as
    /// once the rogue is banned).
    pub fn publish_all(&self, msgs: &[Vec<u8>], gap: Duration) -> Result<(), String> {
        self.rt.block_on(async {
            let mut result = Ok(());
            for msg in msgs {
                tokio::time::sleep(gap).await;
                if let Err(e) = self.client.publish(self.topic.clone(), msg.clone()).await {
                    result = Err(e.to_string());
                }
            }
            result
        })
    }
}

/// What a flood sent, counted as it goes.
#[derive(Debug, Default)]
pub struct Flood {
    /// Heartbeats gossip took.
    pub heartbeats: AtomicU64,
    /// Topics subscribed.
    pub subscriptions: AtomicU64,
    /// Bulk requests answered (refused or not).
    pub requests: AtomicU64,
}

impl Rogue {
    /// Floods `target` from tasks of the rogue's runtime until `span` has passed:
    /// subscriptions to ever new topics of the run and bulk requests (state manifests,
    /// parameters, state chunks) from 32 tasks at once, and from `heartbeats_after` on,
    /// valid heartbeats as fast as gossip takes them (each numbered anew, claiming a rising
    /// step). Returns at once; the counts grow as the flood goes.
    pub fn flood(&self, target: PeerId, span: Duration, heartbeats_after: Duration) -> Arc<Flood> {
        let flood = Arc::new(Flood::default());
        let start = tokio::time::Instant::now();
        let end = start + span;
        let (client, run) = (self.client.clone(), self.run_id.clone());
        let sent = flood.clone();
        self.rt.spawn(async move {
            tokio::time::sleep_until(start + heartbeats_after).await;
            let topic = heartbeat_topic(&run);
            // Numbered as a node started now numbers them, so none is taken for a replay.
            let first = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs() << 20);
            for seq in first.. {
                if tokio::time::Instant::now() >= end {
                    break;
                }
                let hb = Heartbeat {
                    step: seq - first,
                    seq,
                    ..Heartbeat::default()
                };
                let bytes = serde_json::to_vec(&hb).expect("heartbeat json");
                if client.publish(topic.clone(), bytes).await.is_ok() {
                    sent.heartbeats.fetch_add(1, Ordering::Relaxed);
                } else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        });
        let (client, run) = (self.client.clone(), self.run_id.clone());
        let sent = flood.clone();
        self.rt.spawn(async move {
            loop {
                if tokio::time::Instant::now() >= end {
                    break;
                }
                // Update topics of made-up members: topics of the run, so they pass both
                // the rogue's own subscription filter and its target's, whose count caps them.
                let topic = update_topic(&run, &PeerId::random());
                let _ = client.subscribe(topic).await;
                sent.subscriptions.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        });
        for task in 0..32u32 {
            let client = self.client.clone();
            let sent = flood.clone();
            self.rt.spawn(async move {
                for n in 0u32.. {
                    if tokio::time::Instant::now() >= end {
                        break;
                    }
                    let request = match (task + n) % 3 {
                        0 => BulkRequest::StateManifest,
                        1 => BulkRequest::Params,
                        _ => BulkRequest::StateChunk {
                            state: ByteBuf::from(vec![0u8; 32]),
                            index: n,
                        },
                    };
                    let answered = tokio::time::timeout(
                        Duration::from_secs(5),
                        client.request(target, request),
                    )
                    .await;
                    if matches!(answered, Ok(Ok(_))) {
                        sent.requests.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        flood
    }
}

/// Frames encoded update bytes as an inline update message.
pub fn inline(bytes: Vec<u8>) -> Vec<u8> {
    [vec![b'U'], bytes].concat()
}
