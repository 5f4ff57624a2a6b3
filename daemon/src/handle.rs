//! [`NodeHandle`]: the running node as the control API (and the node's own tasks) see it.
//!
//! It holds the node's shared state (channels to the trainer, the network client, the mesh's
//! view, the checkpoint store) and offers what a controller needs: status, checkpoint now,
//! restore, stop. [`crate::node`] builds it and [`crate::control`] serves it, so the API never
//! depends on how the node is wired. It owns no task and starts nothing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::{CheckpointMeta, Snapshot};
use crate::device::DeviceSpec;
use crate::mesh::MeshStatus;
use crate::status::{
    CheckpointRef, CheckpointStatus, CheckpointView, MeshReport, ModelInfo, NodeStatus, Peers,
    Status, SyncSettings, SyncStatus,
};
use crate::store::{Store, StoreError};
use crate::trainer::{Command, Stats};
use crate::{network, transfer};

/// How long status waits for the network task's part: a status request must answer even
/// when that task is swamped (its other parts are the node's own).
pub const NET_ANSWER_WAIT: Duration = Duration::from_secs(3);

/// Why a checkpoint or restore asked of a running node failed.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// The trainer thread has ended (the node is stopping).
    #[error("the trainer has stopped")]
    TrainerStopped,
    /// The blocking task that reads or writes the checkpoint died.
    #[error("checkpoint writer failed: {0}")]
    Blocking(#[from] tokio::task::JoinError),
    /// The store refused.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The trainer refused the state (its reason, in one line).
    #[error("{0}")]
    Refused(String),
}

/// State shared between the node's tasks and the API handlers.
pub struct NodeHandle {
    /// Peer id, printed and reported.
    pub peer_id: String,
    /// Run id.
    pub run_id: String,
    /// Model description.
    pub model: ModelInfo,
    /// Optimizer kind.
    pub optimizer: String,
    /// The device training runs on.
    pub device: DeviceSpec,
    /// Data directory.
    pub data_dir: PathBuf,
    /// Data set description.
    pub data: String,
    /// Training samples of each class this node holds.
    pub train_classes: Vec<u64>,
    /// Actual API address.
    pub api_addr: SocketAddr,
    /// Checkpoints.
    pub store: Arc<Store>,
    /// How many checkpoints to keep.
    pub keep: usize,
    /// When the node started.
    pub started: Instant,
    /// Trainer progress.
    pub stats_rx: watch::Receiver<Stats>,
    /// Commands to the trainer.
    pub cmd_tx: mpsc::Sender<Command>,
    /// The newest checkpoint written by this process.
    pub last_checkpoint: Mutex<Option<CheckpointMeta>>,
    /// The checkpoint this process resumed from.
    pub resumed_from: Option<CheckpointMeta>,
    /// Set to true to ask the node to stop.
    pub stop_tx: watch::Sender<bool>,
    /// The network.
    pub net: network::Client,
    /// The mesh's view (neighbours, updates, syncs).
    pub mesh: Arc<Mutex<MeshStatus>>,
    /// Frozen states this node serves to joiners.
    pub cache: Arc<Mutex<transfer::Cache>>,
    /// The state download this node started with, if any.
    pub download: Arc<Mutex<Option<transfer::DownloadReport>>>,
    /// How far the state download under way has come.
    pub download_progress: Arc<transfer::DownloadProgress>,
    /// The update settings and this node's update topic, for status.
    pub sync: SyncSettings,
    /// libp2p's and gossipsub's Prometheus metrics, served with p2ptrain's own on `/metrics`.
    pub registry: Arc<network::Registry>,
}

impl NodeHandle {
    fn reference(&self, meta: &CheckpointMeta) -> CheckpointRef {
        CheckpointRef {
            id: meta.id,
            step: meta.info.step,
            path: self.store.path_of(meta).display().to_string(),
        }
    }

    /// The index entry plus its path, as the API returns it.
    pub fn view(&self, meta: CheckpointMeta) -> CheckpointView {
        let path = self.store.path_of(&meta).display().to_string();
        CheckpointView { meta, path }
    }

    /// The part of the status fixed at start.
    fn node_status(&self) -> NodeStatus {
        NodeStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            peer_id: self.peer_id.clone(),
            run_id: self.run_id.clone(),
            model: self.model.clone(),
            optimizer: self.optimizer.clone(),
            device: self.device.to_string(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            data_dir: self.data_dir.display().to_string(),
            data: self.data.clone(),
            train_classes: self.train_classes.clone(),
            api: format!("http://{}", self.api_addr),
            memory: crate::status::MemoryStatus {
                heap_bytes: crate::memory::heap_bytes(),
                resident_bytes: crate::memory::resident_bytes(),
            },
        }
    }

    /// The checkpoints part: the newest written by this process, else the newest on disk.
    fn checkpoint_status(&self) -> CheckpointStatus {
        let last = self
            .last_checkpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        CheckpointStatus {
            last_checkpoint: last
                .or_else(|| self.store.list().pop())
                .map(|m| self.reference(&m)),
            resumed_from: self.resumed_from.as_ref().map(|m| self.reference(m)),
        }
    }

    /// The status report, one section from each part of the node.
    pub async fn status(&self) -> Status {
        let net = match tokio::time::timeout(NET_ANSWER_WAIT, self.net.snapshot()).await {
            Ok(answer) => answer.unwrap_or_default(),
            Err(_) => {
                tracing::warn!(
                    "the network task did not answer a status request within {NET_ANSWER_WAIT:?}"
                );
                let mut net = network::NetSnapshot::default();
                net.status.unanswered = true;
                net
            }
        };
        let mesh = self.mesh.lock().map(|m| m.clone()).unwrap_or_default();
        let stats = self.stats_rx.borrow().clone();
        let peers = Peers::new(&net.peers, &mesh);
        let sync = SyncStatus::new(&self.sync, &net, &mesh, &stats);
        Status {
            node: self.node_status(),
            training: stats.training.clone(),
            checkpoints: self.checkpoint_status(),
            peers,
            network: net.status,
            mesh: MeshReport::new(
                mesh,
                &stats,
                self.download.lock().ok().and_then(|d| d.clone()),
                self.download_progress.bytes(),
            ),
            state_serving: self.cache.lock().map(|mut c| c.load()).unwrap_or(0),
            sync,
        }
    }

    /// Writes a snapshot as a checkpoint on a blocking thread and records it as the latest.
    pub async fn save(&self, snapshot: Snapshot) -> Result<CheckpointMeta, HandleError> {
        let store = self.store.clone();
        let keep = self.keep;
        let meta = tokio::task::spawn_blocking(move || {
            let _span = crate::timeline::span(crate::timeline::Lane::Checkpoint, "checkpoint")
                .at_step(snapshot.info.step);
            store.save(&snapshot, keep)
        })
        .await??;
        tracing::info!(id = meta.id, step = meta.info.step, file = %meta.file, "checkpoint written");
        *self
            .last_checkpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(meta.clone());
        Ok(meta)
    }

    /// Asks the trainer for its state now and writes it.
    pub async fn checkpoint_now(&self) -> Result<CheckpointMeta, HandleError> {
        let (tx, rx) = oneshot::channel();
        self.cmd_tx
            .send(Command::Snapshot(tx))
            .await
            .map_err(|_| HandleError::TrainerStopped)?;
        let snapshot = rx.await.map_err(|_| HandleError::TrainerStopped)?;
        self.save(snapshot).await
    }

    /// Loads a checkpoint (verified) into the trainer.
    pub async fn restore(&self, id: u64) -> Result<CheckpointMeta, HandleError> {
        let store = self.store.clone();
        let loaded = tokio::task::spawn_blocking(move || store.load(id)).await??;
        let meta = loaded.meta.clone();
        let (tx, rx) = oneshot::channel();
        self.cmd_tx
            .send(Command::Restore(
                Box::new(loaded),
                crate::trainer::RestoreFrom::Checkpoint,
                tx,
            ))
            .await
            .map_err(|_| HandleError::TrainerStopped)?;
        rx.await
            .map_err(|_| HandleError::TrainerStopped)?
            .map_err(|e| HandleError::Refused(e.to_string()))?;
        Ok(meta)
    }

    /// Asks the node to stop gracefully.
    pub fn request_stop(&self) {
        self.stop_tx.send_replace(true);
    }
}
