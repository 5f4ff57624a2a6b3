//! `p2ptrain local`: a whole mesh on this machine, for demos and benchmarks. Starts N daemons
//! as child processes on 127.0.0.1 (OS-chosen ports, a data directory each), wires them into one
//! mesh through the first, shows their progress, stops them, and summarises.
//!
//! Without `--config` it runs the demo (`configs/digits-skewed.toml`, built in): node k of N
//! holds part k/N of the digits cut by class (`--shard k/N`), and the summary sets what each
//! node reaches in the mesh beside what a node with the same part reaches alone (trained here,
//! after the mesh, for as many steps): the number that shows what the mesh adds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::config::{reaches_target, Overrides, PartitionKind};
use p2ptrain_daemon::status::Status;
use p2ptrain_daemon::trainer::EvalRecord;
use p2ptrain_daemon::Config;
use serde::Serialize;

use crate::client::Client;

/// Arguments of `local`.
#[derive(Args, Clone)]
pub struct LocalArgs {
    /// Number of nodes.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Configuration for every node; default: the built-in demo, configs/digits-skewed.toml
    /// (digits, each node a few classes, 1-bit updates). A config whose `data.partition` is
    /// not `iid` gives node k part k/N unless it names a `train.shard`.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Skip the comparison with nodes trained alone on the same parts.
    #[arg(long)]
    pub no_alone: bool,
    /// Stop the nodes after this many seconds (default 30 unless --steps is given).
    #[arg(long, conflicts_with = "steps")]
    pub duration: Option<f64>,
    /// Let every node train this many steps, then stop by itself.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Keep the nodes' data here (default: a temporary directory, removed afterwards).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Print the summary as JSON (and no progress lines).
    #[arg(long)]
    pub json: bool,
    /// A held-out figure to reach (default: the config's `train.target`): bits per byte for a
    /// language model, accuracy otherwise. The mesh stops once every node has reached it (or
    /// after --duration, default 600 s), then one node alone on the whole data trains to it,
    /// and the summary sets the steps each needed side by side: what the other boxes bought.
    #[arg(long)]
    pub target: Option<f64>,
    /// The sync mode of every mesh node (`gossip`, `allreduce`, `ddp`, `diloco`, `fedavg`),
    /// replacing the config's `sync.mode`.
    #[arg(long)]
    pub sync_mode: Option<String>,
    /// Pin each node to this many CPU cores of its own (`taskset`), so the times to the
    /// target compare as if each node were a box: node k gets cores kK..(k+1)K-1, the lone
    /// control node 0's. More nodes than this machine has core sets is an error.
    #[arg(long)]
    pub cores_per_node: Option<usize>,
    /// A different configuration for some nodes (by index), e.g. a throttled straggler.
    #[arg(skip)]
    pub node_configs: BTreeMap<usize, PathBuf>,
    /// Record every node's status over time in the summary.
    #[arg(skip)]
    pub trace: bool,
}

/// One node's status at one moment, for curves over time.
#[derive(Debug, Clone, Serialize)]
pub struct TracePoint {
    /// Seconds since the first node started.
    pub t: f64,
    /// Node index.
    pub node: usize,
    /// Its step.
    pub step: u64,
    /// Samples it has trained on.
    pub samples_seen: u64,
    /// Its latest held-out accuracy.
    pub accuracy: Option<f64>,
    /// Its latest held-out bits per byte (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
    /// Bytes it has sent.
    pub bytes_sent: u64,
    /// Its distance to the neighbour it last synced with, before averaging.
    pub consensus_distance: Option<f64>,
}

/// One node's line in the summary.
#[derive(Debug, Serialize)]
pub struct NodeSummary {
    /// Index in start order (0 founded the mesh).
    pub index: usize,
    /// Peer id.
    pub peer_id: String,
    /// Step at the end.
    pub step: u64,
    /// Held-out accuracy of its final checkpoint.
    pub accuracy: Option<f64>,
    /// Held-out loss of its final checkpoint.
    pub loss: Option<f64>,
    /// Held-out bits per byte of its final checkpoint (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
    /// Peers it saw at the end.
    pub peers: usize,
    /// Bytes sent (libp2p counters).
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Updates sent, received, applied, rejected.
    pub updates: p2ptrain_daemon::mesh::UpdateCounters,
    /// Why it last rejected an update, if it did ("author: why").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_rejection: Option<String>,
    /// Samples per second (recent).
    pub samples_per_sec: f64,
    /// The state download it joined with (not the founder).
    pub state_download_secs: Option<f64>,
    /// Members it lost without a goodbye during the run: an honest mesh loses none.
    pub peer_drops: u64,
    /// Peers it had banned at the end, with why.
    pub banned: Vec<p2ptrain_daemon::network::BannedPeer>,
    /// The classes its part of the training set holds.
    pub classes: Vec<usize>,
    /// Bytes it sent per second of its life.
    pub sent_bytes_per_sec: f64,
    /// What a node with the same part of the data reaches alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alone: Option<Alone>,
    /// With a target: when its evaluations first reached it (none: never did).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_target: Option<Reached>,
}

/// When a node's evaluation first reached the target: its step and the seconds since its run
/// (the mesh, or the lone control) started.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Reached {
    /// The evaluated step.
    pub step: u64,
    /// Seconds since the run started, from the node's own evaluation log.
    pub secs: f64,
}

/// One node alone on the whole data, trained to the target: the control of a race.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LoneControl {
    /// When it reached the target (none: not within `cap` steps or the time limit).
    pub reached: Option<Reached>,
    /// The most steps it could train.
    pub cap: u64,
    /// Its last evaluated step and figure.
    pub last: Option<(u64, f64)>,
}

/// A run to a target: each mesh node's steps beside one node alone on the whole data.
#[derive(Debug, Serialize)]
pub struct TargetSummary {
    /// The held-out figure: bits per byte (at or below) for a language model, else accuracy
    /// (at or above).
    pub target: f64,
    /// `"bits_per_byte"` or `"accuracy"`.
    pub metric: &'static str,
    /// Cores each node was pinned to (none: not pinned, so times do not compare).
    pub cores_per_node: Option<usize>,
    /// The lone control (none with `--no-alone`).
    pub alone: Option<LoneControl>,
    /// The lone control's steps ÷ the slowest mesh node's: steps per node the mesh saved.
    pub steps_ratio: Option<f64>,
    /// The lone control's seconds ÷ the mesh's (every node there): the speed-up, when pinned.
    pub speedup: Option<f64>,
}

/// A node's part of the data trained alone, outside any mesh: the control for what the mesh
/// adds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Alone {
    /// Steps it trained (the most any node with this part took, up to [`ALONE_MAX_STEPS`]).
    pub steps: u64,
    /// Held-out accuracy after them.
    pub accuracy: f64,
    /// Held-out bits per byte (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
}

/// The most steps a lone control trains: on the demo a lone node's accuracy has levelled
/// off after a few thousand (it cannot learn the classes it never sees).
pub const ALONE_MAX_STEPS: u64 = 20_000;

/// The demo `local` runs without `--config`.
const DEMO_CONFIG: &str = include_str!("../../configs/digits-skewed.toml");

/// The summary of a local run.
#[derive(Debug, Serialize)]
pub struct LocalSummary {
    /// Nodes started.
    pub nodes: usize,
    /// Seconds from the first start to the last exit.
    pub wall_secs: f64,
    /// Each node.
    pub per_node: Vec<NodeSummary>,
    /// Largest relative L2 distance between two nodes' final parameters.
    pub consensus_distance_max: f64,
    /// Mean over pairs.
    pub consensus_distance_mean: f64,
    /// Mean final accuracy.
    pub mean_accuracy: f64,
    /// Mean final bits per byte (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_bits_per_byte: Option<f64>,
    /// Mean accuracy of the lone controls (when they ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_alone_accuracy: Option<f64>,
    /// Every node's status every half second (only when asked for).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub trace: Vec<TracePoint>,
    /// With a target: the mesh's steps and times to it beside a lone node's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<TargetSummary>,
    /// The final status of each node.
    #[serde(skip)]
    pub final_status: Vec<Status>,
}

/// How long a run to a target may take, the mesh and the lone control each, when no
/// `--duration` says.
const TARGET_TIMEOUT: Duration = Duration::from_secs(600);

/// Milliseconds since the Unix epoch: evaluation logs are stamped so.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Every evaluation a node logged, oldest first (`evals.jsonl` in its data directory).
pub(crate) fn read_evals(dir: &Path) -> Vec<EvalRecord> {
    std::fs::read_to_string(dir.join(p2ptrain_daemon::node::EVAL_LOG))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The first of a node's evaluations since `started_ms` that reached `target`, timed from
/// then.
fn first_at_target(dir: &Path, target: Option<f64>, started_ms: u64) -> Option<Reached> {
    read_evals(dir)
        .iter()
        // A reused data directory keeps an earlier run's evaluations: not this run's.
        .filter(|e| e.unix_ms >= started_ms)
        .find(|e| reaches_target(target, e.accuracy, e.bits_per_byte))
        .map(|e| Reached {
            step: e.step,
            secs: e.unix_ms.saturating_sub(started_ms) as f64 / 1e3,
        })
}

/// Every local node's control API: loopback, a port the OS picks.
const LOCAL_API: &str = "127.0.0.1:0";

/// Every local node's libp2p address: loopback, a port the OS picks.
const LOCAL_LISTEN: &str = "/ip4/127.0.0.1/tcp/0";
/// The control API's status path.
const STATUS: &str = "/v1/status";

/// Child processes that are killed if this guard drops before they exit.
pub(crate) struct Children(pub(crate) Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `join` flags one node starts with, beside its data directory and config.
#[derive(Clone, Copy, Default)]
struct NodeFlags<'a> {
    /// `--shard k/n`.
    shard: Option<&'a str>,
    /// `--max-steps`.
    steps: Option<u64>,
    /// `--bootstrap`: none for the founder and for a lone node.
    bootstrap: Option<&'a str>,
    /// `--sync-mode`.
    sync_mode: Option<&'a str>,
    /// `--min-members`: the mesh's size, so a synchronous mode starts with every node from
    /// one state (gossip ignores it).
    min_members: Option<usize>,
    /// `--target`: the node logs when it first reaches it.
    target: Option<f64>,
}

fn spawn_node(
    dir: &Path,
    config: Option<&Path>,
    flags: NodeFlags<'_>,
    cores: Option<&str>,
) -> Result<Child> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let log =
        std::fs::File::create(dir.with_extension("log")).context("cannot create a node log")?;
    let exe = std::env::current_exe().context("cannot find this executable")?;
    // `taskset` execs what follows, so the child is the node itself.
    let mut cmd = match cores {
        Some(c) => {
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", c]).arg(exe);
            cmd
        }
        None => Command::new(exe),
    };
    cmd.arg("join")
        .arg("--data-dir")
        .arg(dir)
        .args(["--api", LOCAL_API, "--listen", LOCAL_LISTEN]);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    if let Some(s) = flags.shard {
        cmd.args(["--shard", s]);
    }
    if let Some(s) = flags.steps {
        cmd.args(["--max-steps", &s.to_string()]);
    }
    if let Some(b) = flags.bootstrap {
        cmd.args(["--bootstrap", b]);
    }
    if let Some(m) = flags.sync_mode {
        cmd.args(["--sync-mode", m]);
    }
    if let Some(m) = flags.min_members {
        cmd.args(["--min-members", &m.to_string()]);
    }
    if let Some(t) = flags.target {
        cmd.args(["--target", &t.to_string()]);
    }
    if let Some(c) = cores {
        cmd.args(["--threads", &c.split(',').count().to_string()]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
    cmd.spawn().with_context(|| {
        format!(
            "cannot start a node{}",
            if cores.is_some() {
                " under taskset (is util-linux installed?)"
            } else {
                ""
            }
        )
    })
}

/// The cores of core set `k` of `per` cores each, as `taskset -c` takes them.
pub(crate) fn core_set(k: usize, per: usize) -> String {
    (k * per..(k + 1) * per)
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Fails unless this machine has `sets` sets of `per` cores each: pinning two nodes to one
/// core would measure contention, not what another box buys.
pub(crate) fn check_core_sets(sets: usize, per: usize) -> Result<()> {
    if per == 0 {
        bail!("--cores-per-node must be at least 1");
    }
    let available = std::thread::available_parallelism().map_or(1, usize::from);
    if sets * per > available {
        bail!(
            "{sets} nodes of {per} cores each need {} cores; this machine offers {available}",
            sets * per
        );
    }
    Ok(())
}

/// How long a node may take to start (its API address written, its listen address known).
pub(crate) const START_WAIT: Duration = Duration::from_secs(120);

/// An error once a starting node has exited, or once `deadline` has passed, naming its log;
/// the start-up waits of `local` and `bench scaling` call it between their polls.
pub(crate) fn check_starting(child: &mut Child, log: &Path, deadline: Instant) -> Result<()> {
    if let Some(status) = child.try_wait()? {
        bail!(
            "a node exited during start-up ({status}); see {}",
            log.display()
        );
    }
    if Instant::now() > deadline {
        bail!(
            "a node did not start within {} s; see {}",
            START_WAIT.as_secs(),
            log.display()
        );
    }
    Ok(())
}

async fn wait_api(dir: &Path, child: &mut Child) -> Result<String> {
    let file = dir.join(p2ptrain_daemon::node::API_ADDR_FILE);
    let deadline = Instant::now() + START_WAIT;
    loop {
        if let Ok(s) = std::fs::read_to_string(&file) {
            if !s.trim().is_empty() {
                return Ok(s.trim().to_string());
            }
        }
        check_starting(child, &dir.with_extension("log"), deadline)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn relative_distance(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += f64::from(x - y).powi(2);
        n += f64::from(*y).powi(2);
    }
    d.sqrt() / n.sqrt().max(f64::MIN_POSITIVE)
}

/// Flat parameters (no optimizer state) of the newest checkpoint in a node's data dir.
fn final_params(dir: &Path) -> Option<(PathBuf, Vec<f32>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("checkpoints"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let file = files.pop()?;
    let bytes = std::fs::read(&file).ok()?;
    let (_, tensors) = p2ptrain_daemon::checkpoint::decode(&bytes, "final").ok()?;
    let flat = tensors
        .iter()
        .filter(|(name, _)| !name.starts_with("optim."))
        .flat_map(|(_, t)| t.values.iter().copied())
        .collect();
    Some((file, flat))
}

/// The part node `index` of `nodes` trains on: none for an `iid` config or one that names
/// its own `train.shard`, else `index/nodes`.
fn shard_for(config: &Config, index: usize, nodes: usize) -> Option<String> {
    (config.data.partition != PartitionKind::Iid && config.train.shard.is_none())
        .then(|| format!("{index}/{nodes}"))
}

/// Runs the local mesh.
pub fn run(mut args: LocalArgs) -> Result<LocalSummary> {
    if args.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let temp = args.data_dir.is_none();
    let base = args.data_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "p2ptrain-local-{}-{}",
            std::process::id(),
            p2ptrain_daemon::store::unix_now()
        ))
    });
    if args.config.is_none() {
        std::fs::create_dir_all(&base)
            .with_context(|| format!("cannot create {}", base.display()))?;
        let demo = base.join("digits-skewed.toml");
        std::fs::write(&demo, DEMO_CONFIG)
            .with_context(|| format!("cannot write {}", demo.display()))?;
        args.config = Some(demo);
    }
    // Fail on a bad config here, once, rather than in N children; they get the same
    // overrides as flags (see `spawn_node`).
    let config = Config::load(args.config.as_deref())?;
    let mut checked = config.clone();
    checked.apply(&Overrides {
        max_steps: args.steps,
        api: Some(LOCAL_API.parse()?),
        listen: vec![LOCAL_LISTEN.into()],
        shard: shard_for(&config, 0, args.nodes),
        target: args.target,
        sync_mode: args.sync_mode.clone(),
        ..Overrides::default()
    })?;
    checked.check_shard()?;
    args.target = checked.train.target;
    if let Some(per) = args.cores_per_node {
        check_core_sets(args.nodes, per)?;
    }
    let rt = crate::runtime::client_runtime()?;
    let result = rt.block_on(run_mesh(&args, &base));
    // With a target on an `iid` config every node's part is the whole data: the lone node
    // trained to the target below is that control, with its steps counted.
    let per_part_control =
        !args.no_alone && (args.target.is_none() || config.data.partition != PartitionKind::Iid);
    let result = match result {
        Ok(mut summary) if per_part_control => compare_alone(&args, &mut summary).map(|()| summary),
        other => other,
    };
    let result = match (result, args.target) {
        (Ok(mut summary), Some(target)) => {
            let alone = if args.no_alone {
                Ok(None)
            } else {
                rt.block_on(lone_to_target(&args, &checked, &base, target, &summary))
                    .map(Some)
            };
            alone.map(|alone| {
                summary.target = Some(target_summary(&args, &checked, target, &summary, alone));
                summary
            })
        }
        (other, _) => other,
    };
    if temp {
        let _ = std::fs::remove_dir_all(&base);
    }
    result
}

async fn run_mesh(args: &LocalArgs, base: &Path) -> Result<LocalSummary> {
    let started = Instant::now();
    let started_ms = unix_ms();
    let config = args
        .config
        .as_deref()
        .map(std::path::absolute)
        .transpose()?;
    let dirs: Vec<PathBuf> = (0..args.nodes)
        .map(|i| base.join(format!("node-{i}")))
        .collect();
    let mut children = Children(Vec::new());
    let node_configs: BTreeMap<usize, PathBuf> = args
        .node_configs
        .iter()
        .map(|(i, p)| Ok((*i, std::path::absolute(p)?)))
        .collect::<Result<_>>()?;
    let config_of = |i: usize| {
        node_configs
            .get(&i)
            .map(PathBuf::as_path)
            .or(config.as_deref())
    };
    let cores: Vec<Option<String>> = (0..args.nodes)
        .map(|i| args.cores_per_node.map(|per| core_set(i, per)))
        .collect();
    let place_of = |i: usize| cores[i].as_deref();
    let shards = (0..args.nodes)
        .map(|i| Ok(shard_for(&Config::load(config_of(i))?, i, args.nodes)))
        .collect::<Result<Vec<_>>>()?;
    let flags_of = |i: usize| NodeFlags {
        shard: shards[i].as_deref(),
        steps: args.steps,
        bootstrap: None,
        sync_mode: args.sync_mode.as_deref(),
        min_members: Some(args.nodes),
        target: args.target,
    };
    children.0.push(spawn_node(
        &dirs[0],
        config_of(0),
        flags_of(0),
        place_of(0),
    )?);
    let first_api = wait_api(&dirs[0], &mut children.0[0]).await?;
    let first = Client::new(&first_api, None)?;
    let bootstrap = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s: Status = first.get(STATUS).await?;
            if let Some(a) = s.network.listen_addrs.first() {
                break a.clone();
            }
            if Instant::now() > deadline {
                bail!("the first node reports no listen address");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    if !args.json {
        eprintln!("node 0 founded the mesh at {bootstrap}");
    }
    for (i, dir) in dirs.iter().enumerate().skip(1) {
        children.0.push(spawn_node(
            dir,
            config_of(i),
            NodeFlags {
                bootstrap: Some(&bootstrap),
                ..flags_of(i)
            },
            place_of(i),
        )?);
    }
    let mut clients = vec![first];
    for (i, dir) in dirs.iter().enumerate().skip(1) {
        let api = wait_api(dir, &mut children.0[i]).await?;
        clients.push(Client::new(&api, None)?);
    }

    let target = args.target;
    let duration = match (args.steps, args.duration) {
        (Some(_), _) => None,
        (None, Some(d)) => Some(Duration::from_secs_f64(d.max(0.0))),
        (None, None) if target.is_some() => Some(TARGET_TIMEOUT),
        (None, None) => Some(Duration::from_secs(30)),
    };
    let mut last: BTreeMap<usize, Status> = BTreeMap::new();
    let lines = if args.json {
        None
    } else {
        crate::progress::NodeLines::new(args.nodes)
    };
    let mut trace = Vec::new();
    let mut last_print = Instant::now() - Duration::from_secs(10);
    loop {
        for (i, c) in clients.iter().enumerate() {
            if let Ok(s) = c.get::<Status>(STATUS).await {
                if args.trace {
                    trace.push(TracePoint {
                        t: started.elapsed().as_secs_f64(),
                        node: i,
                        step: s.training.step,
                        samples_seen: s.training.samples_seen,
                        accuracy: s.training.eval.map(|e| e.accuracy),
                        bits_per_byte: s.training.eval.and_then(|e| e.bits_per_byte),
                        bytes_sent: s.network.bytes_sent,
                        consensus_distance: s.mesh.consensus_distance,
                    });
                }
                last.insert(i, s);
            }
        }
        match &lines {
            Some(lines) => {
                for (i, s) in &last {
                    lines.set(*i, node_line(s));
                }
            }
            None if !args.json && last_print.elapsed() >= Duration::from_secs(2) => {
                for (i, s) in &last {
                    eprintln!("node {i}  {}", node_line(s));
                }
                eprintln!();
                last_print = Instant::now();
            }
            None => {}
        }
        let all_exited = children
            .0
            .iter_mut()
            .all(|c| matches!(c.try_wait(), Ok(Some(_))));
        if all_exited {
            break;
        }
        let all_at_target = target.is_some()
            && dirs
                .iter()
                .all(|d| first_at_target(d, target, started_ms).is_some());
        let out_of_time = duration.is_some_and(|d| started.elapsed() >= d);
        if out_of_time || all_at_target {
            for c in &clients {
                let _ = c.post::<serde_json::Value>("/v1/stop").await;
            }
            break;
        }
        if started.elapsed() > Duration::from_secs(3600) {
            bail!("the mesh ran for an hour without finishing");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(lines);
    // Wait for every node to write its final checkpoint and exit.
    let deadline = Instant::now() + Duration::from_secs(60);
    for c in children.0.iter_mut() {
        while c.try_wait()?.is_none() {
            if Instant::now() > deadline {
                bail!("a node did not exit within 60 s of being stopped");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let wall_secs = started.elapsed().as_secs_f64();

    // The final checkpoints are evaluated on the held-out set, which every part shares.
    let mut eval_config = Config::load(config.as_deref())?;
    eval_config.apply(&Overrides {
        shard: shard_for(&eval_config, 0, args.nodes),
        ..Overrides::default()
    })?;
    let prepared = p2ptrain_daemon::node::prepare(eval_config)?;
    let mut per_node = Vec::new();
    let mut finals = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let s = last
            .get(&i)
            .ok_or_else(|| anyhow!("node {i} never answered"))?;
        let (eval, step) = match final_params(dir) {
            Some((file, flat)) => {
                let (e, step) = crate::evaluate::evaluate_file(&file, &prepared)?;
                finals.push(flat);
                (Some(e), step)
            }
            None => (None, s.training.step),
        };
        per_node.push(NodeSummary {
            index: i,
            peer_id: s.node.peer_id.clone(),
            step,
            accuracy: eval.map(|e| e.accuracy),
            loss: eval.map(|e| e.loss),
            bits_per_byte: eval.and_then(|e| e.bits_per_byte),
            peers: s.peers.count,
            bytes_sent: s.network.bytes_sent,
            bytes_received: s.network.bytes_received,
            updates: s.mesh.updates.clone(),
            last_rejection: s.mesh.last_rejection.clone(),
            samples_per_sec: s.training.samples_per_sec,
            state_download_secs: s.mesh.state_download.as_ref().map(|d| d.secs),
            peer_drops: s.network.peer_drops,
            banned: s.network.banned_peers.clone(),
            classes: (0..s.node.train_classes.len())
                .filter(|&c| s.node.train_classes[c] > 0)
                .collect(),
            sent_bytes_per_sec: s.network.bytes_sent as f64 / s.node.uptime_s.max(1e-3),
            alone: None,
            at_target: first_at_target(dir, args.target, started_ms),
        });
    }
    let mut distances = Vec::new();
    for i in 0..finals.len() {
        for j in (i + 1)..finals.len() {
            distances.push(relative_distance(&finals[i], &finals[j]));
        }
    }
    let accs: Vec<f64> = per_node.iter().filter_map(|n| n.accuracy).collect();
    let bpbs: Vec<f64> = per_node.iter().filter_map(|n| n.bits_per_byte).collect();
    Ok(LocalSummary {
        nodes: args.nodes,
        wall_secs,
        consensus_distance_max: distances.iter().copied().fold(0.0, f64::max),
        consensus_distance_mean: if distances.is_empty() {
            0.0
        } else {
            distances.iter().sum::<f64>() / distances.len() as f64
        },
        mean_accuracy: if accs.is_empty() {
            0.0
        } else {
            accs.iter().sum::<f64>() / accs.len() as f64
        },
        mean_bits_per_byte: (!bpbs.is_empty())
            .then(|| bpbs.iter().sum::<f64>() / bpbs.len() as f64),
        mean_alone_accuracy: None,
        per_node,
        trace,
        target: None,
        final_status: last.into_values().collect(),
    })
}

/// One node's progress in a line: step, loss, evaluation, peers, updates, speed, traffic, and
/// the state download while one runs.
fn node_line(s: &Status) -> String {
    let acc = s
        .training
        .eval
        .map(|e| e.headline())
        .unwrap_or_else(|| "-".into());
    let download = s
        .mesh
        .state_download_progress
        .map(|p| {
            format!(
                "  downloading state {:.0}%",
                100.0 * p.bytes_done as f64 / p.bytes_total.max(1) as f64
            )
        })
        .unwrap_or_default();
    format!(
        "step {:>7}  loss {:>7}  eval {:>9}  peers {}  updates in {:>5} out {:>5}  {:>8.0} samples/s  sent {:>9}/s{download}",
        s.training.step,
        s.training
            .loss
            .map(|l| format!("{l:.4}"))
            .unwrap_or_else(|| "-".into()),
        acc,
        s.peers.count,
        s.mesh.updates.applied,
        s.mesh.updates.sent,
        s.training.samples_per_sec,
        crate::output::human_bytes(s.network.bytes_sent as f64 / s.node.uptime_s.max(1e-3)),
    )
}

/// Trains each node's part of the data alone, here, from the run's initial weights, and
/// evaluates it on the same held-out set: the control that shows what the mesh added. Nodes
/// with the same part (the same config and shard) share one control, trained for as many steps
/// as the furthest of them took (at most [`ALONE_MAX_STEPS`]), so the control never trained
/// less than a node it is set beside.
fn compare_alone(args: &LocalArgs, summary: &mut LocalSummary) -> Result<()> {
    type Part = (Option<String>, PathBuf);
    let mut parts: BTreeMap<Part, (Config, u64)> = BTreeMap::new();
    let mut part_of = Vec::new();
    for node in &summary.per_node {
        let i = node.index;
        let path = args
            .node_configs
            .get(&i)
            .or(args.config.as_ref())
            .cloned()
            .ok_or_else(|| anyhow!("no config for node {i}"))?;
        let config = Config::load(Some(&path))?;
        let part = (shard_for(&config, i, args.nodes), path);
        let steps = node.step.clamp(1, ALONE_MAX_STEPS);
        let entry = parts.entry(part.clone()).or_insert((config, steps));
        entry.1 = entry.1.max(steps);
        part_of.push(part);
    }
    let mut controls: BTreeMap<Part, Alone> = BTreeMap::new();
    for (part, (mut config, steps)) in parts {
        config.apply(&Overrides {
            shard: part.0.clone(),
            ..Overrides::default()
        })?;
        crate::runtime::set_compute_threads(config.train.threads);
        let prepared = p2ptrain_daemon::node::prepare(config)?;
        let model = p2ptrain_models::Model::new(
            &prepared.spec,
            prepared.config.train.init_seed,
            &prepared.device,
        )?;
        crate::measure::train_steps(&prepared, &model, steps)?;
        let e = p2ptrain_models::train::evaluate(&model, prepared.data.test(), &prepared.device)?;
        controls.insert(
            part,
            Alone {
                steps,
                accuracy: e.accuracy,
                bits_per_byte: e.bits_per_byte,
            },
        );
    }
    for (node, part) in summary.per_node.iter_mut().zip(&part_of) {
        node.alone = controls.get(part).copied();
    }
    let accs: Vec<f64> = summary
        .per_node
        .iter()
        .filter_map(|n| n.alone.map(|a| a.accuracy))
        .collect();
    summary.mean_alone_accuracy =
        (!accs.is_empty()).then(|| accs.iter().sum::<f64>() / accs.len() as f64);
    Ok(())
}

/// Trains one node alone on the whole data, pinned like node 0, until its evaluations reach
/// the target (or `2 × nodes ×` the mesh's steps, or the time limit): the control that shows
/// what the mesh's other boxes bought, in steps per node and, pinned, in time. It runs after
/// the mesh, so it has the machine to itself as each mesh node had its cores, and as a plain
/// node (`gossip`, no peers): a synchronous mode's `min_members` would hold it forever.
async fn lone_to_target(
    args: &LocalArgs,
    config: &Config,
    base: &Path,
    target: f64,
    summary: &LocalSummary,
) -> Result<LoneControl> {
    let furthest = summary
        .per_node
        .iter()
        .map(|n| n.at_target.map_or(n.step, |r| r.step))
        .max()
        .unwrap_or(0);
    let cap = (2 * args.nodes as u64 * furthest).clamp(1000, ALONE_MAX_STEPS);
    let dir = base.join("alone-whole-data");
    let _ = std::fs::remove_dir_all(&dir);
    let config_path = args
        .config
        .as_deref()
        .map(std::path::absolute)
        .transpose()?;
    let cores = args.cores_per_node.map(|per| core_set(0, per));
    if !args.json {
        eprintln!("one node alone on the whole data, to the target (at most {cap} steps)");
    }
    let started_ms = unix_ms();
    let started = Instant::now();
    let flags = NodeFlags {
        // A partition that cuts the set between nodes, cut in one part: all of it.
        shard: (config.data.partition != PartitionKind::Iid).then_some("0/1"),
        steps: Some(cap),
        bootstrap: None,
        sync_mode: Some("gossip"),
        min_members: None,
        target: Some(target),
    };
    let mut child = Children(vec![spawn_node(
        &dir,
        config_path.as_deref(),
        flags,
        cores.as_deref(),
    )?]);
    let client = Client::new(&wait_api(&dir, &mut child.0[0]).await?, None)?;
    let limit = args
        .duration
        .map_or(TARGET_TIMEOUT, |d| Duration::from_secs_f64(d.max(0.0)));
    let exit = loop {
        let exited = child.0[0].try_wait()?;
        let reached = first_at_target(&dir, Some(target), started_ms).is_some();
        if exited.is_some() || reached || started.elapsed() > limit {
            if exited.is_none() {
                let _ = client.post::<serde_json::Value>("/v1/stop").await;
            }
            break exited;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.0[0].try_wait()?.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(child);
    // Read after it stopped: an evaluation written as it exited counts.
    let reached = first_at_target(&dir, Some(target), started_ms);
    if let Some(status) = exit.filter(|s| !s.success() && reached.is_none()) {
        bail!(
            "the lone control node failed ({status}); see {}",
            dir.with_extension("log").display()
        );
    }
    Ok(LoneControl {
        reached,
        cap,
        last: read_evals(&dir)
            .iter()
            .rfind(|e| e.unix_ms >= started_ms)
            .map(|e| (e.step, e.bits_per_byte.unwrap_or(e.accuracy))),
    })
}

/// The race to the target, summarised: each mesh node's step and time beside the lone
/// control's (none with `--no-alone`), and the ratios.
fn target_summary(
    args: &LocalArgs,
    config: &Config,
    target: f64,
    summary: &LocalSummary,
    alone: Option<LoneControl>,
) -> TargetSummary {
    let mesh: Option<Vec<Reached>> = summary.per_node.iter().map(|n| n.at_target).collect();
    let slowest =
        |f: fn(&Reached) -> f64| mesh.as_ref().and_then(|m| m.iter().map(f).reduce(f64::max));
    let (mesh_steps, mesh_secs) = (slowest(|r| r.step as f64), slowest(|r| r.secs));
    let lone = alone.and_then(|a| a.reached);
    TargetSummary {
        target,
        metric: if config.model.is_language_model() {
            "bits_per_byte"
        } else {
            "accuracy"
        },
        cores_per_node: args.cores_per_node,
        alone,
        steps_ratio: lone
            .zip(mesh_steps)
            .map(|(a, m)| a.step as f64 / m.max(1.0)),
        speedup: args
            .cores_per_node
            .and(lone.zip(mesh_secs))
            .map(|(a, m)| a.secs / m.max(1e-3)),
    }
}

/// Prints a summary for people: what each node reached in the mesh beside what its part of
/// the data reaches alone, and the mesh's health (peers, rejections, drops, bans), since a
/// split mesh still shows a good accuracy on small data.
pub fn print_summary(s: &LocalSummary) {
    println!("{} nodes, {:.1} s", s.nodes, s.wall_secs);
    println!(
        "{:>4} {:>10} {:>8} {:>9} {:>9} {:>6} {:>10} {:>13} {:>8} {:>6} {:>5}",
        "node",
        "classes",
        "step",
        "alone",
        "in mesh",
        "peers",
        "sent/s",
        "updates in/out",
        "rejected",
        "drops",
        "bans"
    );
    let figure = |bpb: Option<f64>, acc: Option<f64>| match (bpb, acc) {
        (Some(bpb), _) => format!("{bpb:.3} bpb"),
        (None, Some(a)) => format!("{:.2}%", a * 100.0),
        (None, None) => "-".into(),
    };
    for n in &s.per_node {
        let classes = if n.classes.len() > 6 {
            format!("{} classes", n.classes.len())
        } else {
            n.classes
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        println!(
            "{:>4} {:>10} {:>8} {:>9} {:>9} {:>6} {:>10} {:>6}/{:<6} {:>8} {:>6} {:>5}",
            n.index,
            classes,
            n.step,
            n.alone
                .map(|a| figure(a.bits_per_byte, Some(a.accuracy)))
                .unwrap_or_else(|| "-".into()),
            figure(n.bits_per_byte, n.accuracy),
            n.peers,
            format!("{}/s", crate::output::human_bytes(n.sent_bytes_per_sec)),
            n.updates.applied,
            n.updates.sent,
            n.updates.rejected,
            n.peer_drops,
            n.banned.len()
        );
        for b in &n.banned {
            println!("     banned {}: {}", b.peer_id, b.reason);
        }
        if let Some(why) = &n.last_rejection {
            println!("     last rejected {why}");
        }
    }
    if let (Some(alone), None) = (s.mean_alone_accuracy, s.mean_bits_per_byte) {
        let steps = s
            .per_node
            .iter()
            .filter_map(|n| n.alone.map(|a| a.steps))
            .max();
        println!(
            "held-out accuracy: {:.2}% alone (each node's part of the data, trained by itself for up to {} steps), {:.2}% in the mesh",
            alone * 100.0,
            steps.unwrap_or(0),
            s.mean_accuracy * 100.0
        );
    }
    let quality = match s.mean_bits_per_byte {
        Some(bpb) => format!("mean {bpb:.3} bits per byte"),
        None => format!("mean accuracy {:.2}%", s.mean_accuracy * 100.0),
    };
    println!(
        "{quality}, consensus distance max {:.3}% mean {:.3}%",
        s.consensus_distance_max * 100.0,
        s.consensus_distance_mean * 100.0
    );
    if let Some(t) = &s.target {
        print_target(s, t);
    }
}

/// The race to the target in a few lines: each mesh node's steps (and, pinned, seconds)
/// beside the lone control's, and the ratios.
fn print_target(s: &LocalSummary, t: &TargetSummary) {
    let language = t.metric == "bits_per_byte";
    let figure = |v: f64| {
        if language {
            format!("{v:.3} bits per byte")
        } else {
            format!("{:.2}% held-out accuracy", v * 100.0)
        }
    };
    let at = |r: Option<Reached>| match r {
        Some(r) => format!("step {} ({:.1} s)", r.step, r.secs),
        None => "not reached".into(),
    };
    println!("target {}:", figure(t.target));
    let mesh: Vec<String> = s
        .per_node
        .iter()
        .map(|n| format!("node {} {}", n.index, at(n.at_target)))
        .collect();
    println!("  in the mesh: {}", mesh.join(", "));
    if let Some(a) = &t.alone {
        let last = a
            .last
            .map(|(step, v)| format!(", last evaluated step {step} at {}", figure(v)))
            .unwrap_or_default();
        println!(
            "  one node alone on the whole data: {} (at most {} steps{last})",
            at(a.reached),
            a.cap
        );
    }
    if let Some(r) = t.steps_ratio {
        println!("  the lone node needed {r:.2}x the steps each mesh node needed");
    }
    match (t.speedup, t.cores_per_node) {
        (Some(x), Some(k)) => println!(
            "  the mesh got there {x:.2}x as fast (each node pinned to {k} core{})",
            if k == 1 { "" } else { "s" }
        ),
        (None, None) if t.alone.is_some() => println!(
            "  times do not compare unpinned: --cores-per-node K gives each node cores of its own"
        ),
        _ => {}
    }
}
