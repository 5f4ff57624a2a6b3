//! `p2ptrain local`: a whole mesh on this machine, for demos and benchmarks. Starts N daemons
//! as child processes on 127.0.0.1 (OS-chosen ports, a data directory each), wires them into one
//! mesh through the first, shows their progress, stops them, and summarises.
//!
//! Without `--config` it runs the demo (`configs/digits-skewed.toml`, built in): node k of N
//! holds part k/N of the digits cut by class (`--shard k/N`), and the summary sets what each
//! node reaches in the mesh beside what a node with the same part reaches alone (trained here,
//! after the mesh, for as many steps): the number that shows what the mesh adds.
//!
//! The slow-link races instead put each node on a host of a namespace lab
//! ([`LocalArgs::hosts`]); this process cannot reach a node's API on that host's loopback, so it
//! asks through `p2ptrain status` and `stop` run on the host ([`NodeApi`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::config::Overrides;
use p2ptrain_daemon::status::Status;
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
    /// A different configuration for some nodes (by index), e.g. a throttled straggler.
    #[arg(skip)]
    pub node_configs: BTreeMap<usize, PathBuf>,
    /// Record every node's status over time in the summary.
    #[arg(skip)]
    pub trace: bool,
    /// Stop the nodes once every node has evaluated and their mean held-out accuracy reached
    /// this (a race to a target).
    #[arg(skip)]
    pub stop_at_mean_accuracy: Option<f64>,
    /// Where each node runs, by index (empty: all here, on loopback).
    #[arg(skip)]
    pub hosts: Vec<LabHost>,
}

/// A host of a namespace lab for one node: its network namespace and its listen address.
#[derive(Debug, Clone)]
pub struct LabHost {
    /// The network namespace (`ip netns exec` runs the node in it).
    pub netns: String,
    /// The libp2p listen multiaddr on the host's lab address.
    pub listen: String,
}

/// How this process reaches one node's control API.
enum NodeApi {
    /// Over HTTP: the node shares this process's network namespace.
    Direct(Client),
    /// Through this binary's `status --json` and `stop`, run on the node's lab host, whose
    /// loopback this process cannot reach.
    OnHost { netns: String, api: String },
}

impl NodeApi {
    fn new(api: String, host: Option<&LabHost>) -> Result<NodeApi> {
        Ok(match host {
            None => NodeApi::Direct(Client::new(&api, None)?),
            Some(h) => NodeApi::OnHost {
                netns: h.netns.clone(),
                api,
            },
        })
    }

    /// Runs this binary with `args` on the node's host; its stdout.
    async fn on_host(netns: &str, args: &[&str]) -> Result<Vec<u8>> {
        let exe = std::env::current_exe().context("cannot find this executable")?;
        let out = tokio::process::Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(exe)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .context("cannot run ip netns exec")?;
        if !out.status.success() {
            bail!(
                "p2ptrain {} on {netns}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out.stdout)
    }

    async fn status(&self) -> Result<Status> {
        match self {
            NodeApi::Direct(c) => c.get("/v1/status").await,
            NodeApi::OnHost { netns, api } => {
                let out = Self::on_host(netns, &["status", "--json", "--api", api]).await?;
                Ok(serde_json::from_slice(&out)?)
            }
        }
    }

    async fn stop(&self) -> Result<()> {
        match self {
            NodeApi::Direct(c) => c.post::<serde_json::Value>("/v1/stop").await.map(drop),
            NodeApi::OnHost { netns, api } => Self::on_host(netns, &["stop", "--api", api])
                .await
                .map(drop),
        }
    }
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
    /// The final status of each node.
    #[serde(skip)]
    pub final_status: Vec<Status>,
}

/// Every local node's control API: loopback, a port the OS picks.
const LOCAL_API: &str = "127.0.0.1:0";

/// Every local node's libp2p address: loopback, a port the OS picks.
const LOCAL_LISTEN: &str = "/ip4/127.0.0.1/tcp/0";

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

fn spawn_node(
    dir: &Path,
    config: Option<&Path>,
    shard: Option<&str>,
    steps: Option<u64>,
    bootstrap: Option<&str>,
    host: Option<&LabHost>,
) -> Result<Child> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let log =
        std::fs::File::create(dir.with_extension("log")).context("cannot create a node log")?;
    let exe = std::env::current_exe().context("cannot find this executable")?;
    // `ip netns exec` execs the node, so the child is the node itself.
    let (mut cmd, listen) = match host {
        None => (Command::new(exe), LOCAL_LISTEN),
        Some(h) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &h.netns]).arg(exe);
            (c, h.listen.as_str())
        }
    };
    cmd.arg("join")
        .arg("--data-dir")
        .arg(dir)
        .args(["--api", LOCAL_API, "--listen", listen]);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    if let Some(s) = shard {
        cmd.args(["--shard", s]);
    }
    if let Some(s) = steps {
        cmd.args(["--max-steps", &s.to_string()]);
    }
    if let Some(b) = bootstrap {
        cmd.args(["--bootstrap", b]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
    cmd.spawn().context("cannot start a node")
}

async fn wait_api(dir: &Path, child: &mut Child) -> Result<String> {
    let file = dir.join(p2ptrain_daemon::node::API_ADDR_FILE);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(s) = std::fs::read_to_string(&file) {
            if !s.trim().is_empty() {
                return Ok(s.trim().to_string());
            }
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "a node exited during start-up ({status}); see {}",
                dir.with_extension("log").display()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "a node did not start within 120 s; see {}",
                dir.with_extension("log").display()
            );
        }
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
    (config.data.partition != p2ptrain_daemon::config::PartitionKind::Iid
        && config.train.shard.is_none())
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
        ..Overrides::default()
    })?;
    checked.check_shard()?;
    let rt = crate::client_runtime()?;
    let result = rt.block_on(run_mesh(&args, &base));
    let result = match result {
        Ok(mut summary) if !args.no_alone => compare_alone(&args, &mut summary).map(|()| summary),
        other => other,
    };
    if temp {
        let _ = std::fs::remove_dir_all(&base);
    }
    result
}

async fn run_mesh(args: &LocalArgs, base: &Path) -> Result<LocalSummary> {
    let started = Instant::now();
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
    if !args.hosts.is_empty() && args.hosts.len() != args.nodes {
        bail!("{} lab hosts for {} nodes", args.hosts.len(), args.nodes);
    }
    let host_of = |i: usize| args.hosts.get(i);
    let shards = (0..args.nodes)
        .map(|i| Ok(shard_for(&Config::load(config_of(i))?, i, args.nodes)))
        .collect::<Result<Vec<_>>>()?;
    children.0.push(spawn_node(
        &dirs[0],
        config_of(0),
        shards[0].as_deref(),
        args.steps,
        None,
        host_of(0),
    )?);
    let first_api = wait_api(&dirs[0], &mut children.0[0]).await?;
    let first = NodeApi::new(first_api, host_of(0))?;
    let bootstrap = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s: Status = first.status().await?;
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
            shards[i].as_deref(),
            args.steps,
            Some(&bootstrap),
            host_of(i),
        )?);
    }
    let mut clients = vec![first];
    for (i, dir) in dirs.iter().enumerate().skip(1) {
        let api = wait_api(dir, &mut children.0[i]).await?;
        clients.push(NodeApi::new(api, host_of(i))?);
    }

    let duration = match (args.steps, args.duration) {
        (Some(_), _) => None,
        (None, Some(d)) => Some(Duration::from_secs_f64(d.max(0.0))),
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
            if let Ok(s) = c.status().await {
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
        let target_reached = args.stop_at_mean_accuracy.is_some_and(|target| {
            let accs: Vec<f64> = last
                .values()
                .filter_map(|s| s.training.eval.map(|e| e.accuracy))
                .collect();
            accs.len() == args.nodes && accs.iter().sum::<f64>() / accs.len() as f64 >= target
        });
        let out_of_time = duration.is_some_and(|d| started.elapsed() >= d);
        if out_of_time || target_reached {
            for c in &clients {
                let _ = c.stop().await;
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
                let (e, step) = crate::evaluate_file(&file, &prepared)?;
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
        human_bytes(s.network.bytes_sent as f64 / s.node.uptime_s.max(1e-3)),
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
        crate::set_compute_threads(config.train.threads);
        let prepared = p2ptrain_daemon::node::prepare(config)?;
        let model = p2ptrain_models::Model::new(
            &prepared.spec,
            prepared.config.train.init_seed,
            &prepared.device,
        )?;
        crate::bench::train_steps(&prepared, &model, steps)?;
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
            format!("{}/s", human_bytes(n.sent_bytes_per_sec)),
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
}

/// Bytes in B, kB, MB or GB (powers of 1000), for people.
pub(crate) fn human_bytes(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.1} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}
