//! The shapes the control API speaks, shared by the daemon (which serialises them) and the CLI
//! (which reads them back), so the two cannot drift apart.
//!
//! [`Status`] is composed of sections, each built from the state of the part that owns it
//! (the trainer's [`Stats`], the network's [`NetSnapshot`], the mesh's [`MeshStatus`], the
//! checkpoint store) and flattened into one JSON object. Where the owner's type already is
//! what status shows, it is used as it is: the network's [`NetworkStatus`], a peer's
//! [`PeerInfo`] and last [`Heartbeat`] inside [`PeerStatus`]. This module only shapes; it
//! reads no live state itself (see [`crate::handle`]).

use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::checkpoint::CheckpointMeta;
use crate::mesh::{FullSyncCounters, MeshStatus, SyncInfo, UpdateCounters};
pub use crate::network::NetworkStatus;
use crate::network::{NetSnapshot, PeerInfo};
use crate::trainer::Stats;
pub use crate::trainer::TrainingStatus;
use crate::transfer::DownloadReport;
use crate::wire::Heartbeat;

/// A connected peer of the same run: what the network knows of it and what its last
/// heartbeat said, each as its owner keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerStatus {
    /// Its connection: id, address, round trip, score, path, bytes.
    #[serde(flatten)]
    pub link: PeerInfo,
    /// Whether it is one of this node's neighbours.
    pub neighbour: bool,
    /// Its last heartbeat (step, loss, throughput, accuracy, round), if one came.
    #[serde(flatten)]
    pub heartbeat: Option<Heartbeat>,
}

/// The peers part of the status.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Peers {
    /// How many.
    pub count: usize,
    /// Each of them.
    pub list: Vec<PeerStatus>,
}

/// The model a node trains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Short name, e.g. `mlp-64-128-10`.
    pub name: String,
    /// Number of scalar parameters.
    pub params: usize,
}

/// A reference to a checkpoint, as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRef {
    /// Checkpoint id.
    pub id: u64,
    /// Training step it holds.
    pub step: u64,
    /// Its file.
    pub path: String,
}

/// Everything `p2ptrain status` shows, composed of one section per owner. Each section is
/// flattened into the one JSON object the API has always served, so the wire shape does not
/// depend on how the parts are grouped here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Who this node is and what it trains: fixed at start.
    #[serde(flatten)]
    pub node: NodeStatus,
    /// The trainer's progress.
    #[serde(flatten)]
    pub training: TrainingStatus,
    /// Checkpoints written and resumed from.
    #[serde(flatten)]
    pub checkpoints: CheckpointStatus,
    /// Connected peers of this run.
    #[serde(default)]
    pub peers: Peers,
    /// The libp2p side: traffic, addresses, bans, private network, NAT.
    #[serde(flatten)]
    pub network: NetworkStatus,
    /// The mesh's side: neighbours, updates, syncs, the state download.
    #[serde(flatten)]
    pub mesh: MeshReport,
    /// Joiners downloading this node's state now.
    #[serde(default)]
    pub state_serving: u32,
    /// How updates are compressed and paced, and what they cost on the wire.
    #[serde(default)]
    pub sync: SyncStatus,
}

/// The part of the status fixed when the node starts (plus its uptime and memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// p2ptrain version of the daemon.
    pub version: String,
    /// The node's libp2p peer id.
    pub peer_id: String,
    /// The run it belongs to (hash of model, optimizer, data spec and init seed).
    pub run_id: String,
    /// The model.
    pub model: ModelInfo,
    /// Optimizer kind.
    pub optimizer: String,
    /// Compute device, e.g. `cpu` or `cuda:0`.
    pub device: String,
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// The node's data directory.
    pub data_dir: String,
    /// The data set, described.
    pub data: String,
    /// How many training samples of each class this node holds (indexed by class): with a
    /// skewed `data.partition`, which classes only its neighbours can teach it.
    #[serde(default)]
    pub train_classes: Vec<u64>,
    /// Control API address.
    pub api: String,
    /// What the node's memory holds now.
    #[serde(default)]
    pub memory: MemoryStatus,
}

/// The node's memory (see [`crate::memory`] for why both counts are shown).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryStatus {
    /// Bytes its allocations hold: what grows if the node leaks. `None` when the binary
    /// does not count allocations.
    pub heap_bytes: Option<u64>,
    /// Bytes resident (`VmRSS`): the heap plus what the allocator keeps, stacks and the
    /// mapped binary. `None` where `/proc` does not say (not Linux).
    pub resident_bytes: Option<u64>,
}

/// Checkpoints, as status shows them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CheckpointStatus {
    /// The newest checkpoint written.
    pub last_checkpoint: Option<CheckpointRef>,
    /// The checkpoint this process resumed from, if any.
    pub resumed_from: Option<CheckpointRef>,
}

/// The mesh's part of the status: neighbours, updates, syncs, the state download.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MeshReport {
    /// Peer ids of the current neighbours.
    #[serde(default)]
    pub neighbours: Vec<String>,
    /// Update counters.
    #[serde(default)]
    pub updates: UpdateCounters,
    /// Rejected updates by author.
    #[serde(default)]
    pub rejected_by_peer: BTreeMap<String, u64>,
    /// The latest rejection, "author: why".
    #[serde(default)]
    pub last_rejection: Option<String>,
    /// The latest neighbour sync.
    #[serde(default)]
    pub last_sync: Option<SyncInfo>,
    /// Relative L2 distance to the last synced neighbour, before averaging.
    #[serde(default)]
    pub consensus_distance: Option<f64>,
    /// Full neighbour syncs: accepted, refused, failed, the distance bound in force.
    #[serde(default)]
    pub full_syncs: FullSyncCounters,
    /// Refused full-sync replies by neighbour.
    #[serde(default)]
    pub sync_refusals: BTreeMap<String, u64>,
    /// The state download this node started with, if it joined a running mesh.
    #[serde(default)]
    pub state_download: Option<DownloadReport>,
    /// The state download under way: bytes done of the chosen state's (absent before one
    /// starts and once it is done).
    #[serde(default)]
    pub state_download_progress: Option<DownloadProgressView>,
    /// Synchronous rounds (sync modes `allreduce`, `diloco`, `fedavg`).
    #[serde(default)]
    pub rounds: Option<crate::mesh_core::status::RoundStatus>,
    /// Peers' bulk requests this node declined because the peer asked beyond its share:
    /// too many at once, or states and parameters too often.
    #[serde(default)]
    pub requests_declined: u64,
}

impl MeshReport {
    /// The mesh's view, with the applied-update count taken from the trainer (which is the one
    /// that applies them).
    pub fn new(
        mesh: MeshStatus,
        stats: &Stats,
        state_download: Option<DownloadReport>,
        (bytes_done, bytes_total): (u64, u64),
    ) -> MeshReport {
        let mut updates = mesh.updates;
        updates.applied = stats.updates_applied;
        let state_download_progress =
            (state_download.is_none() && bytes_total > 0).then_some(DownloadProgressView {
                bytes_done,
                bytes_total,
            });
        MeshReport {
            state_download_progress,
            neighbours: mesh.neighbours,
            updates,
            rejected_by_peer: mesh.rejected_by_peer,
            last_rejection: mesh.last_rejection,
            last_sync: mesh.last_sync,
            consensus_distance: mesh.consensus_distance,
            full_syncs: mesh.full_syncs,
            sync_refusals: mesh.sync_refusals,
            state_download,
            rounds: mesh.rounds,
            requests_declined: mesh.requests_declined,
        }
    }
}

impl Peers {
    /// Connected peers as the network sees them, with what their heartbeats told the mesh.
    pub fn new(peers: &[PeerInfo], mesh: &MeshStatus) -> Peers {
        let list: Vec<PeerStatus> = peers
            .iter()
            .map(|p| PeerStatus {
                link: p.clone(),
                neighbour: mesh.neighbours.contains(&p.peer_id),
                heartbeat: mesh.progress.get(&p.peer_id).cloned(),
            })
            .collect();
        Peers {
            count: list.len(),
            list,
        }
    }
}

/// A state download under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DownloadProgressView {
    /// Bytes verified so far.
    pub bytes_done: u64,
    /// Bytes of the state.
    pub bytes_total: u64,
}

/// The update exchange as status shows it: what a user tunes `[sync]` by.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncStatus {
    /// How the members combine their training (`sync.mode`).
    #[serde(default)]
    pub mode: String,
    /// How gossip combines own and neighbours' changes (`sync.mix`: `mean` or `add`).
    #[serde(default)]
    pub mix: String,
    /// Codec of this node's own updates.
    pub codec: String,
    /// Fraction kept by top-k.
    pub density: f64,
    /// Whether error feedback is on.
    pub error_feedback: bool,
    /// Own update messages sent, counted once per peer each went to.
    pub update_copies_sent: u64,
    /// Their bytes, gossipsub's envelope included.
    pub update_bytes_sent: u64,
    /// Mean bytes of one update message on the wire (envelope included).
    pub bytes_per_update: Option<f64>,
    /// Bytes a dense `f32` update of this model takes (header and checksum, no envelope).
    pub dense_update_bytes: u64,
    /// Mean bytes of one own update message before gossipsub's envelope; the envelope is
    /// `bytes_per_update` minus this.
    pub payload_bytes_per_update: Option<f64>,
    /// L2 norm of what error feedback still owes the mesh.
    pub residual_norm: f64,
    /// Neighbours' updates dropped as too stale.
    pub dropped_stale: u64,
    /// The SSP bound, if any.
    pub staleness_bound: Option<u64>,
    /// Whether the bound holds this node back now.
    pub held: bool,
    /// Seconds held back so far.
    pub held_secs: f64,
    /// Steps ahead of the slowest neighbour, as far as this node knows.
    pub lead_over_slowest: Option<u64>,
}

/// The parts of the sync status fixed at start.
#[derive(Debug, Clone)]
pub struct SyncSettings {
    /// The `[sync]` settings.
    pub config: crate::config::SyncConfig,
    /// This node's update topic.
    pub topic: String,
    /// Bytes of a dense update of this model.
    pub dense_bytes: u64,
}

impl SyncStatus {
    /// The settings, with what the network counted on this node's topic, the mesh's payload
    /// and residual, the mesh core's staleness bookkeeping and the trainer's
    /// time held by it.
    pub fn new(
        settings: &SyncSettings,
        net: &NetSnapshot,
        mesh: &MeshStatus,
        stats: &Stats,
    ) -> SyncStatus {
        let (copies, bytes) = net
            .topic_sent
            .get(&settings.topic)
            .copied()
            .unwrap_or_default();
        SyncStatus {
            mode: settings.config.mode.name().to_string(),
            mix: settings.config.mix.name().to_string(),
            codec: settings.config.codec.name().to_string(),
            density: settings.config.density,
            error_feedback: settings.config.error_feedback,
            update_copies_sent: copies,
            update_bytes_sent: bytes,
            bytes_per_update: (copies > 0).then(|| bytes as f64 / copies as f64),
            dense_update_bytes: settings.dense_bytes,
            payload_bytes_per_update: (mesh.updates.sent > 0)
                .then(|| mesh.payload_bytes_sent as f64 / mesh.updates.sent as f64),
            residual_norm: mesh.residual_norm,
            dropped_stale: mesh.dropped_stale,
            staleness_bound: settings.config.staleness_bound,
            held: stats.held,
            held_secs: stats.held_secs,
            lead_over_slowest: mesh.lead_over_slowest,
        }
    }
}

/// A checkpoint as the API lists it: the index entry plus its full path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointView {
    /// The index entry.
    #[serde(flatten)]
    pub meta: CheckpointMeta,
    /// Full path of the file on the daemon's machine.
    pub path: String,
}

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiErrorBody {
    /// One line saying what went wrong.
    pub error: String,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A status with every section at its default and a few fixed names.
    pub(crate) fn sample() -> Status {
        Status {
            node: NodeStatus {
                version: "0".into(),
                peer_id: "p".into(),
                run_id: "r".into(),
                model: ModelInfo {
                    name: "m".into(),
                    params: 1,
                },
                optimizer: "sgd".into(),
                device: "cpu".into(),
                uptime_s: 1.0,
                data_dir: "d".into(),
                data: "digits".into(),
                train_classes: vec![3, 0, 1],
                api: "http://127.0.0.1:1".into(),
                memory: MemoryStatus::default(),
            },
            training: TrainingStatus::default(),
            checkpoints: CheckpointStatus::default(),
            peers: Peers::default(),
            network: NetworkStatus::default(),
            mesh: MeshReport::default(),
            state_serving: 0,
            sync: SyncStatus::default(),
        }
    }

    /// The sections are flattened: the JSON stays one flat object, and reads back.
    #[test]
    fn status_json_is_flat_and_round_trips() {
        let s = sample();
        let v = serde_json::to_value(&s).expect("json");
        for key in [
            "version",
            "peer_id",
            "device",
            "phase",
            "step",
            "last_checkpoint",
            "peers",
            "bytes_sent",
            "banned_peers",
            "nat",
            "neighbours",
            "updates",
            "state_download",
            "state_serving",
            "sync",
        ] {
            assert!(v.get(key).is_some(), "status lacks {key}: {v}");
        }
        for section in ["node", "training", "checkpoints", "network", "mesh"] {
            assert!(v.get(section).is_none(), "{section} must be flattened");
        }
        let back: Status = serde_json::from_value(v).expect("read back");
        assert_eq!(back, s);
    }

    /// A peer's entry is one flat object of its connection's and its heartbeat's fields (the
    /// names the CLI and scripts read), with or without a heartbeat, and reads back.
    #[test]
    fn a_peer_is_flat_with_or_without_a_heartbeat() {
        let link = PeerInfo {
            peer_id: "peer-a".into(),
            address: "/ip4/127.0.0.1/tcp/1".into(),
            rtt_ms: Some(1.5),
            agent: None,
            score: Some(0.0),
            path: Some("direct".into()),
            remote: None,
            connections: 1,
            bytes_sent: Some(10),
            bytes_received: Some(20),
            offences: 0,
            last_offence: None,
        };
        let heard = PeerStatus {
            link: link.clone(),
            neighbour: true,
            heartbeat: Some(Heartbeat {
                step: 7,
                loss: Some(0.5),
                samples_per_sec: 100.0,
                accuracy: Some(0.9),
                ms_per_sample: None,
                leaving: false,
                in_rounds: true,
                round: Some(3),
                needs_state: false,
                starting: false,
                seq: 4,
                accused: None,
                accusations: 0,
            }),
        };
        let silent = PeerStatus {
            link,
            neighbour: false,
            heartbeat: None,
        };
        let v = serde_json::to_value(&heard).expect("json");
        for key in [
            "peer_id",
            "rtt_ms",
            "score",
            "neighbour",
            "step",
            "loss",
            "accuracy",
            "round",
        ] {
            assert!(v.get(key).is_some(), "{key} in {v}");
        }
        assert_eq!(v["step"], 7);
        for p in [heard, silent] {
            let back: PeerStatus =
                serde_json::from_value(serde_json::to_value(&p).expect("json")).expect("back");
            assert_eq!(back, p);
        }
    }
}
