//! The node: prepares a validated [`Config`] (data, model, device), starts the actors (network
//! event loop, mesh, trainer thread, checkpoint writer, control API), wires them together
//! through a [`NodeHandle`], and owns start-up and shutdown. It reads no flags and writes no
//! defaults: both are settled in [`crate::config`] before it runs.
//!
//! Start-up order matters for "bad input writes nothing": the configuration, data and device
//! are checked and the API port is bound before the data directory is touched. Shutdown (Ctrl-C,
//! SIGTERM, `p2ptrain stop`, or reaching `max_steps`) lets the current step finish, writes a
//! final checkpoint, and only then returns.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;
use p2ptrain_models::data::{Data, Samples};
use p2ptrain_models::ModelSpec;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, watch};

use crate::checkpoint::CheckpointMeta;
use crate::config::Config;
use crate::handle::NodeHandle;
use crate::mesh::{MeshActor, MeshConfig, MeshStatus};
use crate::mesh_core::{CoreConfig, MeshCore, WallClock};
use crate::status::{ModelInfo, SyncSettings};
use crate::trainer::{self, Command, Stats};
use crate::{control, network, transfer};
use api::{api_access, check_api_token, serve_api, ServedApi};
use data_dir::{open_data_dir, OpenedDataDir};
pub use error::NodeError;

mod api;
mod data_dir;
pub use data_dir::make_private_dir;
mod error;

/// Settings that belong to this node's process, not to the run, and are no config key (the
/// config's own settings, command-line overrides included, are in [`Config`]).
#[derive(Debug, Clone)]
pub struct Options {
    /// Where identity, checkpoints and index live.
    pub data_dir: PathBuf,
    /// Access token for the API; none: the one kept in the data directory (made at the first
    /// start). Kept out of [`Config`] so that it is never serialised or hashed.
    pub api_token: Option<String>,
    /// Where a joiner's state download reports its progress (the CLI draws a bar from it).
    pub download_progress: Arc<transfer::DownloadProgress>,
}

/// Reads a private network key file (the format `p2ptrain keygen --psk` writes, which is
/// go-libp2p's and IPFS's `swarm.key` format).
pub fn read_psk(path: &Path) -> Result<network::PreSharedKey, NodeError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        NodeError::Psk(format!(
            "cannot read the network key {}: {e}",
            path.display()
        ))
    })?;
    let not_a_key = |why: String| {
        NodeError::Psk(format!(
            "{} is not a network key file ({why}); write one with `p2ptrain keygen --psk FILE`",
            path.display()
        ))
    };
    // libp2p-pnet slices the key line at every second byte, which panics inside a character
    // of more than one byte.
    if !text.is_ascii() {
        return Err(not_a_key("it holds characters that are not ASCII".into()));
    }
    text.parse().map_err(|e| not_a_key(format!("{e}")))
}

/// A fresh random private network key in the key file format.
pub fn new_psk_file() -> String {
    let mut key = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut key);
    network::PreSharedKey::new(key).to_key_file()
}

/// File in the data directory that holds the API's actual address while the node runs (useful
/// with port 0, and for tools that only know the data directory).
pub const API_ADDR_FILE: &str = "api.addr";
/// File in the data directory to which the trainer appends every evaluation, one JSON line
/// each (see [`crate::trainer::EvalRecord`]).
pub const EVAL_LOG: &str = "evals.jsonl";

/// A configuration whose data, model and device have been checked, ready to run. Cloning
/// shares the loaded data.
#[derive(Clone)]
pub struct Prepared {
    /// The validated configuration.
    pub config: Config,
    /// Training and held-out data.
    pub data: Arc<Data>,
    /// The model to build.
    pub spec: ModelSpec,
    /// The opened device (`config.train.device`).
    pub device: Device,
}

/// Loads the data, builds the model spec and opens the device, touching no file but the data.
pub fn prepare(config: Config) -> Result<Prepared, NodeError> {
    config.check_shard()?;
    let dev = config.train.device.open()?;
    let mut data = config.load_data().map_err(NodeError::Data)?;
    let spec = config.model_spec(&data)?;
    if let (Some((k, n)), Data::Text(text)) = (config.train.shard, &mut data) {
        text.train = text
            .train
            .part(k, n)
            .map_err(|e| NodeError::Shard(format!("train.shard {k}/{n}: {e}")))?;
        if text.train.is_empty() {
            return Err(NodeError::Shard(format!(
                "train.shard {k}/{n} leaves too little text for one window"
            )));
        }
        tracing::info!(
            "training on shard {k}/{n}: {} bytes of text",
            text.train.bytes().len()
        );
    }
    if let (Some((k, n)), Data::Tokens(tokens)) = (config.train.shard, &mut data) {
        tokens.train = tokens
            .train
            .part(k, n)
            .map_err(|e| NodeError::Shard(format!("train.shard {k}/{n}: {e}")))?;
        if tokens.train.is_empty() {
            return Err(NodeError::Shard(format!(
                "train.shard {k}/{n} leaves too few tokens for one window"
            )));
        }
        tracing::info!(
            "training on shard {k}/{n}: {} tokens",
            tokens.train.tokens()
        );
    }
    if let (Some((k, n)), Data::Labeled(split)) = (config.train.shard, &mut data) {
        let cut = config.data.cut(n, split.train.classes);
        split.train = split
            .train
            .part(cut, k, n, config.data.split_seed)
            .map_err(|e| NodeError::Shard(format!("train.shard {k}/{n}: {e}")))?;
        if split.train.is_empty() {
            return Err(NodeError::Shard(format!(
                "train.shard {k}/{n} with data.partition = \"{}\" leaves no training sample",
                config.data.partition.as_str()
            )));
        }
        tracing::info!(
            partition = config.data.partition.as_str(),
            classes = ?split.train.class_counts(),
            "training on shard {k}/{n}: {} samples",
            split.train.len()
        );
    }
    Ok(Prepared {
        config,
        data: Arc::new(data),
        spec,
        device: dev,
    })
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Final trainer progress.
    pub stats: Stats,
    /// The checkpoint written at the end.
    pub final_checkpoint: Option<CheckpointMeta>,
    /// True when it stopped because `max_steps` was reached.
    pub reached_max_steps: bool,
}

/// A node's data order seed from its peer id, so each node samples differently without
/// configuration and keeps its order across restarts.
fn seed_from(peer_id: &str) -> u64 {
    let digest = Sha256::digest(peer_id.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(b)
}

/// The network's settings from the config: addresses, the run and its sync terms (which the
/// handshake compares), a private mesh's key (read from its file before the node writes
/// anything), and the bulk channel's limits for a model of `model_params` values.
fn net_config(
    config: &Config,
    run_id: &str,
    psk: Option<network::PreSharedKey>,
    model_params: usize,
) -> Result<network::NetConfig, NodeError> {
    if let Some(k) = &psk {
        tracing::info!(
            "private network: PSK fingerprint {} (TCP only; peers without this key cannot connect)",
            k.fingerprint()
        );
    }
    Ok(network::NetConfig {
        listen: config.network.listen.clone(),
        bootstrap: config.network.bootstrap.clone(),
        run_id: run_id.to_string(),
        run_parts: config.run_parts(),
        sync_terms: config.sync.shared_terms(),
        mdns: config.network.mdns,
        psk,
        allow: config
            .network
            .allow
            .as_ref()
            .map(|ids| ids.iter().copied().collect()),
        relay_server: config.network.relay_server,
        upnp: config.network.upnp,
        bulk: network::BulkLimits::for_model(model_params),
        request_timeout: Duration::from_secs_f64(config.network.request_timeout_secs),
        kad_walk_every: match config.debug.kad_walk_secs {
            0 => network::KAD_WALK_EVERY,
            secs => Duration::from_secs(secs),
        },
    })
}

/// The mesh core's settings from the config's sync and debug sections.
fn mesh_config(config: &Config) -> MeshConfig {
    MeshConfig {
        degree: config.sync.degree,
        inline_max: config.sync.inline_max_bytes,
        max_update_ratio: config.sync.max_update_ratio,
        serve_chunk_delay: Duration::from_millis(config.debug.serve_chunk_delay_ms),
        codec: config.sync.codec,
        density: config.sync.density,
        error_feedback: config.sync.error_feedback,
        guard: config.sync.guard(),
        max_sync_distance: config.sync.max_sync_distance,
    }
}

/// What this start of the node brings to the trainer, beside the config: what was built or
/// restored, and how it starts.
struct TrainerStart {
    model: p2ptrain_models::Model,
    optimizer: p2ptrain_models::Optimizer,
    data: Arc<Data>,
    device: Device,
    identity: trainer::Identity,
    start: trainer::Counters,
    node_seed: u64,
    /// A fresh node joining a mesh: it holds until the mesh's state is loaded.
    joining: bool,
    outer_velocity: Vec<f32>,
    /// A parameter-averaging mode: at `max_steps` the trainer waits for the round it is held
    /// at. (`ddp` needs no final wait: every step is a round, so its members already end on
    /// the same optimizer step, and it is always held at its step, so it would wait.)
    ends_on_a_round: bool,
    /// The rounds let a synced member train on past its boundary (`sync.overlap_steps`): the
    /// trainer keeps the parameters it gave a round, to add its later steps to the result.
    keeps_given_params: bool,
}

impl TrainerStart {
    /// This start's: the model, optimizer and counters built or restored, the node's data
    /// and device, and from the data directory the run's identity and, on a resumed DiLoCo
    /// node, its outer velocity.
    fn new(
        (model, optimizer, start): (
            p2ptrain_models::Model,
            p2ptrain_models::Optimizer,
            trainer::Counters,
        ),
        data: Arc<Data>,
        device: Device,
        opened: &OpenedDataDir,
        node_seed: u64,
        joining: bool,
        rounds: Option<&(crate::mesh_core::rounds::config::RoundConfig, bool)>,
    ) -> TrainerStart {
        TrainerStart {
            model,
            optimizer,
            data,
            device,
            identity: opened.ident.clone(),
            start,
            node_seed,
            joining,
            outer_velocity: opened
                .resume
                .as_ref()
                .map(trainer::outer_velocity)
                .unwrap_or_default(),
            ends_on_a_round: rounds.is_some_and(|(rc, _)| rc.gradients.is_none()),
            keeps_given_params: rounds.is_some_and(|(rc, _)| rc.overlap_steps > 0),
        }
    }
}

/// The trainer's setup: the config's training, checkpoint, sync and debug settings around
/// what this start brings.
fn trainer_setup(config: &Config, data_dir: &Path, t: TrainerStart) -> trainer::Setup {
    // The synchronous modes publish no deltas (the policy's `publish_every` is 0 there), so
    // their trainers keep no delta baseline.
    let policy = config.sync.policy();
    // `ddp` members take every step together.
    let lockstep = config.sync.mode == crate::config::SyncMode::Ddp;
    trainer::Setup {
        model: t.model,
        optimizer: t.optimizer,
        data: t.data,
        device: t.device,
        batch_size: config.train.batch_size,
        eval_every: config.train.eval_every,
        eval_every_time: Duration::from_secs_f64(config.train.eval_every_secs),
        max_steps: config.train.max_steps,
        node_seed: t.node_seed,
        checkpoint_every_steps: config.checkpoint.every_steps,
        checkpoint_every: Duration::from_secs(config.checkpoint.every_secs),
        identity: t.identity,
        start: t.start,
        publishes: policy.publish_every > 0,
        measure_pending_ratio: policy.publish_every > 0 && policy.publish_early_ratio > 0.0,
        start_paused: t.joining,
        step_delay: Duration::from_millis(config.debug.step_delay_ms),
        sample_delay: Duration::from_micros(config.debug.sample_delay_us),
        outer: config.sync.outer(),
        outer_velocity: t.outer_velocity,
        rounds_carry_state: lockstep,
        eval_log: Some(data_dir.join(EVAL_LOG)),
        target: config.train.target,
        eval_align_steps: if lockstep {
            trainer::LOCKSTEP_EVAL_ALIGN_STEPS
        } else {
            1
        },
        ends_on_a_round: t.ends_on_a_round,
        keeps_given_params: t.keeps_given_params,
    }
}

/// The system clock now, for the core, anchored at the start of its current second: an
/// anchor at the read itself, with the second's fraction dropped, dated the core's events up
/// to a second early (CI read a sync refusal dated before the state download it followed).
fn wall_clock_now() -> WallClock {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let now = Instant::now();
    let fraction = Duration::from_nanos(u64::from(since_epoch.subsec_nanos()));
    WallClock {
        unix_secs: since_epoch.as_secs(),
        at: now.checked_sub(fraction).unwrap_or(now),
    }
}

/// A fresh node's join: it waits for members on the mesh actor's watch, downloads the
/// mesh's state and hands it to the trainer.
fn joiner(
    shared: &NodeHandle,
    reached: watch::Receiver<transfer::Reached>,
    config: &Config,
) -> transfer::Joiner {
    let network = &config.network;
    transfer::Joiner {
        net: shared.net.clone(),
        run_id: shared.run_id.clone(),
        trainer: shared.cmd_tx.clone(),
        stats: shared.stats_rx.clone(),
        reached,
        stop: shared.stop_tx.subscribe(),
        limits: transfer::Limits {
            progress: shared.download_progress.clone(),
            ..transfer::Limits::for_params(shared.model.params, shared.data_dir.join("download"))
        },
        // A gossip mesh started together: every member holds the run's initial weights
        // (from its seed) until they all take their first step.
        own_initial_state: config.sync.mode == crate::config::SyncMode::Gossip
            && config.sync.policy().wait_for_neighbours > 0,
        cache: shared.cache.clone(),
        report: shared.download.clone(),
        wait: Duration::from_secs_f64(network.join_wait_secs),
        deadline: network.join_deadline(),
        bootstrap_peers: network::bootstrap_peers(&network.bootstrap).len(),
    }
}

/// Automatic checkpoints: the trainer hands over snapshots; this task writes them.
async fn write_checkpoints(
    shared: Arc<NodeHandle>,
    mut snapshots: mpsc::Receiver<crate::checkpoint::Snapshot>,
) {
    while let Some(snapshot) = snapshots.recv().await {
        if let Err(e) = shared.save(snapshot).await {
            tracing::error!("automatic checkpoint failed: {e}");
        }
    }
}

/// Runs a node until `shutdown` resolves, it is asked to stop, or it reaches `max_steps`:
/// opens the data directory, builds or restores the model, starts the network, the trainer,
/// the mesh and the API, waits, and stops them in order.
pub async fn run(
    prepared: Prepared,
    opts: Options,
    shutdown: impl Future<Output = ()>,
) -> Result<Summary, NodeError> {
    let Prepared {
        config,
        data,
        spec,
        device,
    } = prepared;
    let listener = control::bind(config.api.listen).await?;
    let api_addr = listener.local_addr().map_err(control::BindError::Socket)?;

    // A bad key file, or a token no header can carry, is refused before the node writes
    // anything.
    let psk = config.network.psk.as_deref().map(read_psk).transpose()?;
    check_api_token(&opts)?;
    // From here on the node writes to its data directory.
    let data_dir = opts.data_dir.clone();
    let mut opened = open_data_dir(&config, &data_dir)?;
    let access = api_access(&config, &opts, &data_dir)?;
    let (model, optimizer, start) = build_model(&config, &spec, &device, &opened)?;
    let model_info = ModelInfo {
        name: spec.name(),
        params: model.params().numel(),
    };
    let layout = model.params().layout();
    let start_step = start.step;
    // The network: listen, dial the bootstrap members.
    let net_cfg = net_config(&config, &opened.ident.run_id, psk, model_info.params)?;
    let mut registry = network::Registry::default();
    let (net, net_events, event_loop) = network::new(opened.key.clone(), &net_cfg, &mut registry)?;
    let (net_task, net_ended) = watch_network(tokio::spawn(event_loop.run()));
    // A fresh node joining a mesh takes the mesh's state before its first step.
    let joining = opened.resume.is_none() && !net_cfg.bootstrap.is_empty();
    let node_seed = config
        .train
        .node_seed
        .unwrap_or_else(|| seed_from(&opened.local_peer.to_string()));
    let rounds = config
        .sync
        .rounds(data.train().len(), config.train.batch_size)
        .map(|rc| (rc, !joining && opened.resume.is_none()));
    let train_classes = data
        .labeled()
        .map(|s| s.train.class_counts())
        .unwrap_or_default();
    let trainer_start = TrainerStart::new(
        (model, optimizer, start),
        data,
        device,
        &opened,
        node_seed,
        joining,
        rounds.as_ref(),
    );
    let StartedTrainer {
        handle:
            trainer::Handle {
                cmd_tx,
                stats_rx,
                events_rx: trainer_events,
                done_rx,
            },
        snapshots,
        limit,
    } = start_trainer(&config, &data_dir, trainer_start, rounds.as_ref())?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let shared = node_handle(
        &config,
        &opts,
        &opened,
        HandleParts {
            model: model_info,
            train_classes,
            api_addr,
            stats_rx,
            cmd_tx: cmd_tx.clone(),
            stop_tx,
            net: net.clone(),
            registry,
            dense_bytes: p2ptrain_models::codec::dense_len(&layout) as u64,
        },
    );
    let core = mesh_core(&config, &opened, layout, start_step, node_seed, rounds);
    // The checkpoint resumed from is in the trainer now: free its copy.
    opened.resume = None;
    let (mesh_task, join_task) = start_mesh(
        &config,
        &shared,
        core,
        trainer_events,
        limit,
        net_events,
        joining,
    );
    print_listen_addrs(
        &net,
        &shared.peer_id,
        &shared.run_id,
        config.network.psk.is_some(),
    )
    .await;

    let writer = tokio::spawn(write_checkpoints(shared.clone(), snapshots));
    let api = serve_api(listener, shared.clone(), access);
    tracing::info!(peer_id = %shared.peer_id, run_id = %shared.run_id, api = %format!("http://{api_addr}"), data_dir = %data_dir.display(), model = %spec.name(), "node started");

    let (finished, failure) =
        until_finished(shutdown, stop_rx, done_rx, (join_task, net_ended), &cmd_tx).await;
    let result = final_summary(&shared, writer, finished).await;
    let result = match failure {
        Some(e) => Err(e),
        None => result,
    };
    Stopping {
        shared,
        mesh_task,
        net,
        net_task,
        api,
    }
    .stop()
    .await;
    // Last: the store closes before the data directory's lock is released.
    drop(opened);
    result
}

/// A joiner's task: it fails only when the bootstrap peers train another run.
type JoinTask = tokio::task::JoinHandle<Result<(), transfer::JoinError>>;

/// Why the network task ended, sent once it has: it ends by itself only on a bug (a panic,
/// here or in libp2p), and a node without its network would train on alone, unheard, with
/// its status still answering as if nothing happened.
type NetworkEnded = oneshot::Receiver<String>;

/// Watches the network task: returns the task that ends with it (what [`Stopping`] awaits)
/// and the word of why it ended, sent only if it ends before the node stops it.
fn watch_network(
    net_task: tokio::task::JoinHandle<()>,
) -> (tokio::task::JoinHandle<()>, NetworkEnded) {
    let (ended_tx, ended_rx) = oneshot::channel();
    let watcher = tokio::spawn(async move {
        let why = match net_task.await {
            Ok(()) => "it returned".to_string(),
            Err(e) => task_failure(e),
        };
        let _ = ended_tx.send(why);
    });
    (watcher, ended_rx)
}

/// What a task that did not finish says of itself: its panic's message, or that it was
/// cancelled.
fn task_failure(e: tokio::task::JoinError) -> String {
    if !e.is_panic() {
        return "it was cancelled".into();
    }
    let panic = e.into_panic();
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// What the trainer finished with, as its thread answers.
type TrainerEnd = Result<Result<trainer::Finish, trainer::TrainerError>, oneshot::error::RecvError>;

/// The trainer's end: when it finishes by itself (`max_steps`, a fault), or when a stop is
/// asked (a signal, the API), the joiner failed or the network task ended (with the
/// failure), after it has finished its step and written its final checkpoint.
async fn until_finished(
    shutdown: impl Future<Output = ()>,
    mut stop_rx: watch::Receiver<bool>,
    mut done_rx: oneshot::Receiver<Result<trainer::Finish, trainer::TrainerError>>,
    (join_task, net_ended): (Option<JoinTask>, NetworkEnded),
    cmd_tx: &mpsc::Sender<Command>,
) -> (TrainerEnd, Option<NodeError>) {
    let join_failed = async {
        match join_task {
            Some(task) => match task.await {
                Ok(Err(e)) => e,
                // A bug: no state will come, and the trainer would wait for it for ever.
                Err(e) if e.is_panic() => {
                    let why = task_failure(e);
                    tracing::error!("the join task panicked: {why}");
                    transfer::JoinError::Failed(why)
                }
                // Joined, or gave up on the mesh and trains alone: nothing to stop for.
                _ => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    };
    let net_failed = async {
        match net_ended.await {
            Ok(why) => {
                tracing::error!("the network task ended: {why}");
                NodeError::NetworkStopped(why)
            }
            // The watcher went without a word: the node is stopping it.
            Err(_) => std::future::pending().await,
        }
    };
    tokio::pin!(shutdown, join_failed, net_failed);
    let mut failure = None;
    tokio::select! {
        done = &mut done_rx => return (done, None),
        _ = &mut shutdown => {}
        _ = stop_rx.wait_for(|stop| *stop) => {}
        e = &mut join_failed => failure = Some(NodeError::Join(e)),
        e = &mut net_failed => failure = Some(e),
    }
    if failure.is_none() {
        tracing::info!("stopping: finishing the current step and writing a final checkpoint");
    }
    let _ = cmd_tx.send(Command::Stop).await;
    (done_rx.await, failure)
}

/// Builds the model and its optimizer, restored from the checkpoint to resume from if any.
fn build_model(
    config: &Config,
    spec: &ModelSpec,
    device: &Device,
    opened: &OpenedDataDir,
) -> Result<
    (
        p2ptrain_models::Model,
        p2ptrain_models::Optimizer,
        trainer::Counters,
    ),
    NodeError,
> {
    let built = trainer::build(
        spec,
        &config.optimizer,
        config.schedule,
        &config.gradients,
        config.train.init_seed,
        device,
        &opened.ident,
        opened.resume.as_ref(),
    )
    .map_err(|e| NodeError::Trainer(e.to_string()))?;
    if let Some(loaded) = &opened.resume {
        tracing::info!(
            id = loaded.meta.id,
            step = loaded.meta.info.step,
            "resumed from checkpoint"
        );
    } else if let Some((dir, unchecked)) = config.model.genesis_folder() {
        // The run starts from the folder's weights (its digest is in the run id, so every
        // node of the run read the same ones); a joiner's download replaces them. With the
        // digest on the config's word (`model.hf_digest`), a joiner reads nothing of the
        // folder, which its box need not have, and a node that starts the run checks it.
        let joining = !config.network.bootstrap.is_empty();
        if unchecked.is_some() && joining {
            tracing::info!("joining: the weights come from the mesh, not model.hf's folder");
            return Ok(built);
        }
        if let Some(want) = unchecked {
            check_genesis(dir, want)?;
        }
        let folder = p2ptrain_models::hf::read_folder(dir)
            .map_err(|e| NodeError::Trainer(format!("model.hf: {e}")))?;
        built
            .0
            .params()
            .load(&folder.tensors)
            .map_err(|e| NodeError::Trainer(format!("model.hf {}: {e}", dir.display())))?;
        tracing::info!(
            folder = %dir.display(),
            stored_as = folder.stored_as,
            "starting from a Hugging Face model's weights"
        );
    }
    Ok(built)
}

/// The folder a node starts the run from has the digest the config names
/// (`model.hf_digest`): read whole once, here, on the box that starts the run.
fn check_genesis(dir: &Path, want: &str) -> Result<(), NodeError> {
    if !dir.join("config.json").is_file() {
        return Err(NodeError::Trainer(format!(
            "model.hf: {} is not a Hugging Face folder here; the node that starts the run \
             needs it (a node that joins with --bootstrap takes the weights from the mesh)",
            dir.display()
        )));
    }
    let got = p2ptrain_models::hf::folder_digest(dir)
        .map_err(|e| NodeError::Trainer(format!("model.hf: {e}")))?;
    if got != want {
        return Err(NodeError::Trainer(format!(
            "model.hf_digest = {want:?}, but {}'s files digest to {got:?}: other weights than \
             the config was written for (`p2ptrain init --hf` writes the digest again)",
            dir.display()
        )));
    }
    Ok(())
}

/// What the node's handle holds beside the config and the data directory: what the
/// start-up built.
struct HandleParts {
    model: ModelInfo,
    train_classes: Vec<u64>,
    api_addr: std::net::SocketAddr,
    stats_rx: watch::Receiver<Stats>,
    cmd_tx: mpsc::Sender<Command>,
    stop_tx: watch::Sender<bool>,
    net: network::Client,
    registry: network::Registry,
    /// A dense update's bytes, for status.
    dense_bytes: u64,
}

/// The handle the API, the mesh, the joiner and the checkpoint writer share.
fn node_handle(
    config: &Config,
    opts: &Options,
    opened: &OpenedDataDir,
    parts: HandleParts,
) -> Arc<NodeHandle> {
    Arc::new(NodeHandle {
        peer_id: opened.local_peer.to_string(),
        run_id: opened.ident.run_id.clone(),
        model: parts.model,
        optimizer: optimizer_kind(&config.optimizer).into(),
        device: config.train.device,
        data_dir: opts.data_dir.clone(),
        data: config.data.describe(),
        train_classes: parts.train_classes,
        api_addr: parts.api_addr,
        store: opened.store.clone(),
        keep: config.checkpoint.keep,
        started: Instant::now(),
        stats_rx: parts.stats_rx,
        cmd_tx: parts.cmd_tx,
        last_checkpoint: Mutex::new(None),
        resumed_from: opened.resume.as_ref().map(|l| l.meta.clone()),
        stop_tx: parts.stop_tx,
        net: parts.net,
        mesh: Arc::new(Mutex::new(MeshStatus::default())),
        cache: Arc::new(Mutex::new(transfer::Cache::default())),
        download: Arc::default(),
        download_progress: opts.download_progress.clone(),
        sync: SyncSettings {
            config: config.sync.clone(),
            topic: crate::mesh::update_topic(&opened.ident.run_id, &opened.local_peer),
            dense_bytes: parts.dense_bytes,
        },
        registry: Arc::new(parts.registry),
    })
}

/// The mesh core of this node, from the config and how it starts.
fn mesh_core(
    config: &Config,
    opened: &OpenedDataDir,
    layout: p2ptrain_models::params::Layout,
    start_step: u64,
    node_seed: u64,
    rounds: Option<(crate::mesh_core::rounds::config::RoundConfig, bool)>,
) -> MeshCore {
    MeshCore::new(CoreConfig {
        me: opened.local_peer,
        run_id: opened.ident.run_id.clone(),
        layout,
        mesh: mesh_config(config),
        policy: config.sync.policy(),
        update_weight: config.sync.update_weight.map(|w| w as f32),
        start_step,
        seed: node_seed,
        wall_clock: wall_clock_now(),
        rounds,
    })
}

/// What is still running once the trainer has finished, stopped in order by
/// [`Stopping::stop`].
struct Stopping {
    shared: Arc<NodeHandle>,
    mesh_task: tokio::task::JoinHandle<()>,
    net: network::Client,
    net_task: tokio::task::JoinHandle<()>,
    api: ServedApi,
}

impl Stopping {
    /// The mesh actor says goodbye (after its ring hops under way are taken), then the
    /// network and the API stop.
    async fn stop(self) {
        self.shared.stop_tx.send_replace(true);
        let mesh_grace = crate::mesh::RING_HOPS_DRAIN + Duration::from_secs(2);
        let _ = tokio::time::timeout(mesh_grace, self.mesh_task).await;
        drop(self.net);
        drop(self.shared);
        let _ = tokio::time::timeout(Duration::from_secs(2), self.net_task).await;
        self.api.stop().await;
    }
}

/// The optimizer's kind as status names it.
fn optimizer_kind(spec: &p2ptrain_models::OptimizerSpec) -> &'static str {
    match spec {
        p2ptrain_models::OptimizerSpec::Sgd { .. } => "sgd",
        p2ptrain_models::OptimizerSpec::Adamw { .. } => "adamw",
    }
}

/// A trainer thread started, with what the node keeps of it.
struct StartedTrainer {
    handle: trainer::Handle,
    /// The automatic checkpoints it hands over.
    snapshots: mpsc::Receiver<crate::checkpoint::Snapshot>,
    /// The step it may not pass, which the mesh sets.
    limit: trainer::StepLimit,
}

/// Starts the trainer thread under the rounds' first limit, before the mesh's first
/// decision: in `ddp` not one step is taken outside a round, and a joiner takes none before
/// its state; in `gossip` a node that waits for its neighbours (`sync.min_members`) takes
/// none before it hears them.
fn start_trainer(
    config: &Config,
    data_dir: &Path,
    t: TrainerStart,
    rounds: Option<&(crate::mesh_core::rounds::config::RoundConfig, bool)>,
) -> Result<StartedTrainer, NodeError> {
    let (snapshot_tx, snapshots) = mpsc::channel(trainer::SNAPSHOT_CAP);
    let limit = trainer::StepLimit::new();
    if let Some((rc, synced)) = rounds {
        limit.set(Some(rc.first_boundary(t.start.step, *synced)));
    } else if config.sync.policy().wait_for_neighbours > 0 {
        limit.set(Some(t.start.step));
    }
    let handle = trainer::spawn(
        trainer_setup(config, data_dir, t),
        snapshot_tx,
        limit.clone(),
    )
    .map_err(|e| NodeError::Trainer(format!("cannot start trainer thread: {e}")))?;
    Ok(StartedTrainer {
        handle,
        snapshots,
        limit,
    })
}

/// Starts the mesh actor around `core` (and, on a fresh node joining a mesh, the joiner that
/// downloads the mesh's state once the actor names members, whose task is returned too).
fn start_mesh(
    config: &Config,
    shared: &Arc<NodeHandle>,
    core: MeshCore,
    trainer_events: mpsc::Receiver<crate::mesh_core::TrainerEvent>,
    limit: trainer::StepLimit,
    net_events: mpsc::Receiver<network::Event>,
    joining: bool,
) -> (tokio::task::JoinHandle<()>, Option<JoinTask>) {
    let (reached_tx, reached_rx) = watch::channel(transfer::Reached::default());
    let mesh = MeshActor::new(
        shared.net.clone(),
        core,
        shared.cmd_tx.clone(),
        shared.stats_rx.clone(),
        trainer_events,
        shared.mesh.clone(),
        reached_tx,
        shared.cache.clone(),
        limit,
        Duration::from_millis(config.debug.serve_chunk_delay_ms),
        config.debug.ring_attack,
    );
    if let Some(attack) = config.debug.ring_attack {
        tracing::warn!(
            ?attack,
            "debug.ring_attack: this node sends hostile round hops"
        );
    }
    let mesh_task = tokio::spawn(mesh.run(net_events, shared.stop_tx.subscribe()));
    let join_task = joining.then(|| tokio::spawn(joiner(shared, reached_rx, config).run()));
    (mesh_task, join_task)
}

/// What the node ends with once its trainer finished: the final checkpoint (unless the newest
/// automatic one already holds that state, or the node never took a step) and the summary.
async fn final_summary(
    shared: &NodeHandle,
    writer: tokio::task::JoinHandle<()>,
    finished: TrainerEnd,
) -> Result<Summary, NodeError> {
    match finished {
        Ok(Ok(finish)) => {
            // Let a pending automatic checkpoint land first, so the final one is the newest.
            let _ = writer.await;
            let last = shared
                .last_checkpoint
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            let final_checkpoint = match last {
                // The automatic checkpoint of the last step already holds this exact state.
                Some(meta) if meta.info == finish.snapshot.info => Some(meta),
                // A node that never took a step (a joiner stopped while waiting) holds only the
                // run's initial weights; a checkpoint of them would make its next start resume
                // from nothing instead of downloading the mesh's state.
                _ if finish.snapshot.info.step == 0 => None,
                _ => match shared.save(finish.snapshot).await {
                    Ok(meta) => Some(meta),
                    Err(e) => {
                        tracing::error!("final checkpoint failed: {e}");
                        None
                    }
                },
            };
            Ok(Summary {
                stats: finish.stats,
                final_checkpoint,
                reached_max_steps: finish.reached_max_steps,
            })
        }
        Ok(Err(e)) => Err(NodeError::Trainer(e.to_string())),
        Err(_) => Err(NodeError::Trainer(
            "the trainer thread ended without a result".into(),
        )),
    }
}

/// Prints the addresses other nodes can join through (routable ones first, as the network
/// lists them), once the network has them, with the run id and what a joiner must bring.
async fn print_listen_addrs(net: &network::Client, peer_id: &str, run_id: &str, private: bool) {
    let key = if private {
        ", and this mesh's key file (--psk)"
    } else {
        ""
    };
    for _ in 0..40 {
        if let Ok(snap) = net.snapshot().await {
            if !snap.status.listen_addrs.is_empty() {
                println!("p2ptrain node {peer_id}, run {run_id}: join this mesh from a box with the same config and data{key}, through an address it can reach (the TCP port open), with");
                for a in &snap.status.listen_addrs {
                    println!("  p2ptrain join --bootstrap {a}");
                }
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs [`until_finished`] with no shutdown or stop asked, the join task and the
    /// network's word as given, and a trainer that ends once told to stop: the failure the
    /// node ended with, and whether the trainer was told to stop.
    async fn failure_of(parts: (Option<JoinTask>, NetworkEnded)) -> (String, bool) {
        let (_stop_tx, stop_rx) = watch::channel(false);
        let (done_tx, done_rx) = oneshot::channel();
        let (cmd_tx, mut cmd_rx) = mpsc::channel(4);
        // The trainer: it ends (its answer dropped) once it is told to stop.
        let trainer = tokio::spawn(async move {
            while let Some(cmd) = cmd_rx.recv().await {
                if matches!(cmd, Command::Stop) {
                    drop(done_tx);
                    return true;
                }
            }
            false
        });
        let (_, failure) = tokio::time::timeout(
            Duration::from_secs(10),
            until_finished(std::future::pending(), stop_rx, done_rx, parts, &cmd_tx),
        )
        .await
        .expect("the node ended instead of waiting for ever");
        let failure = failure.expect("the node ended with a failure").to_string();
        (failure, trainer.await.expect("trainer task"))
    }

    /// A join task that panicked (a bug, never a peer's doing) ends the node with an error
    /// naming it, after the trainer was asked to stop: it is not left waiting for a state
    /// that will never come.
    #[tokio::test]
    async fn a_panicked_join_task_stops_the_node_with_an_error() {
        let join_task: JoinTask = tokio::spawn(async { panic!("a bug in the joiner") });
        let (_net_ended_tx, net_ended) = oneshot::channel();
        let (failure, told) = failure_of((Some(join_task), net_ended)).await;
        assert!(failure.contains("a bug in the joiner"), "{failure}");
        assert!(told, "the trainer was told to stop");
    }

    /// A network task that panicked (a bug, here or in libp2p: CI once saw libp2p's
    /// request-response assert in a debug build) ends the node with an error naming it,
    /// after the trainer was asked to stop, instead of a node that trains on unheard while
    /// its status answers. Before the watch, nothing awaited the task until the node
    /// stopped: this test waited its 10 s for an end that never came.
    #[tokio::test]
    async fn a_panicked_network_task_stops_the_node_with_an_error() {
        let (watcher, net_ended) =
            watch_network(tokio::spawn(async { panic!("a bug in the swarm") }));
        let (failure, told) = failure_of((None, net_ended)).await;
        assert!(
            failure.contains("network") && failure.contains("a bug in the swarm"),
            "{failure}"
        );
        assert!(told, "the trainer was told to stop");
        watcher.await.expect("the watcher ends with the task");
    }

    /// The node that starts a run from a folder named by its digest (`model.hf_digest`)
    /// reads it and finds the digest the config names, or stops with an error naming both:
    /// other weights than the config was written for, or no folder on this box.
    #[test]
    fn a_founders_folder_must_have_the_configs_digest() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/fixtures/hf-llama-tiny");
        let digest = p2ptrain_models::hf::folder_digest(&fixture).expect("the fixture's digest");
        check_genesis(&fixture, &digest).expect("the fixture has its own digest");
        let e = check_genesis(&fixture, "0123456789abcdef")
            .expect_err("another digest")
            .to_string();
        assert!(e.contains("0123456789abcdef") && e.contains(&digest), "{e}");
        let e = check_genesis(Path::new("/nonexistent/hf"), &digest)
            .expect_err("no folder")
            .to_string();
        assert!(e.contains("not a Hugging Face folder here"), "{e}");
    }

    /// A key file that is not one (missing, a short key, characters that are not hex, bytes
    /// that are not ASCII) is a clear error, never a panic inside the key parser.
    #[test]
    fn a_bad_network_key_file_is_an_error() {
        let tmp = tempfile::tempdir().expect("tmp");
        let good = tmp.path().join("good.key");
        std::fs::write(&good, new_psk_file()).expect("write");
        assert!(read_psk(&good).is_ok());
        let header = "/key/swarm/psk/1.0.0/\n/base16/\n";
        // 64 bytes whose second byte starts a two-byte character.
        let non_ascii = format!("a{}a", "\u{e9}".repeat(31));
        assert_eq!(non_ascii.len(), 64);
        for (name, key) in [
            ("short", "abcd".to_string()),
            ("not-hex", "zz".repeat(32)),
            ("non-ascii", non_ascii),
        ] {
            let path = tmp.path().join(name);
            std::fs::write(&path, format!("{header}{key}\n")).expect("write");
            let err = read_psk(&path).expect_err(name);
            assert!(
                err.to_string().contains("is not a network key file"),
                "{name}: {err}"
            );
        }
        let err = read_psk(&tmp.path().join("missing")).expect_err("missing");
        assert!(
            err.to_string().contains("cannot read the network key"),
            "{err}"
        );
    }
}
