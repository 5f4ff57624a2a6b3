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
use p2ptrain_daemon::config::{Overrides, PartitionKind};
use p2ptrain_daemon::control::token;
use p2ptrain_daemon::status::Status;
use p2ptrain_daemon::trainer::{reaches_target, EvalRecord};
use p2ptrain_daemon::Config;
use serde::Serialize;

use crate::client::Client;
use alone::*;
use nodes::*;

pub(crate) use nodes::{
    check_core_sets, check_starting, core_set, read_evals, unix_ms, Children, START_WAIT,
};
pub use summary::*;

mod alone;
mod nodes;
mod summary;

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
    /// The sync mode of every mesh node, replacing the config's `sync.mode`.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(p2ptrain_daemon::config::SyncMode::names()))]
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

/// The demo `local` runs without `--config`.
const DEMO_CONFIG: &str = include_str!("../../../configs/digits-skewed.toml");

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
    let first = Client::new(&first_api, token::read(&dirs[0]))?;
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
        clients.push(Client::new(&api, token::read(dir))?);
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
