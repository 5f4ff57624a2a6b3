//! `p2ptrain bench race`: time to a target accuracy, each sync mode against PyTorch DDP.
//!
//! For each run (a sync mode with its codec, on each partition asked for), a local mesh of
//! `--nodes` daemons trains the configured model, node `k` on its own part `k/N` of the data,
//! until the mean of the nodes' latest held-out accuracies reaches the target or the timeout
//! passes. Then the same model, batch, optimizer and parts train under PyTorch DDP with the gloo
//! backend (`bench/ddp_race.py`, run with the Python of a virtual environment holding torch;
//! `bench/setup_torch.sh` makes one). `DIR/report.json` holds per run `mode`, `codec`,
//! `partition`, `time_to_target_s`, `bytes_sent_per_node`, `final_accuracy` and the curve, and
//! the DDP runs under `ddp`; `DIR/report.svg` plots mean accuracy against wall time.
//!
//! Links: loopback, or with `--link RATE` (root only) a host each in a namespace lab
//! (`p2ptrain-netlab`) whose outgoing link `tc` limits to RATE, for p2ptrain's nodes and DDP's
//! processes alike. With `--eval-secs`, both sides also evaluate on a clock, since a
//! synchronous step over a slow link can take a second.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use crate::bench_mesh::{base_text, write_report, write_run_config};
use crate::local::{self, Children, LabHost, LocalArgs, LocalSummary};

/// Arguments of `bench race`.
#[derive(Args)]
pub struct RaceArgs {
    /// Where `report.json`, `report.svg`, the run configs and DDP's outputs go.
    #[arg(long)]
    out: PathBuf,
    /// Nodes (and DDP processes).
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Base configuration.
    #[arg(long, default_value = "configs/mnist-mlp.toml")]
    config: PathBuf,
    /// Mean held-out accuracy to reach.
    #[arg(long, default_value_t = 0.97)]
    target: f64,
    /// Give up on a run after this many seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    /// Runs, comma-separated `mode:codec` (codec ignored by the synchronous modes).
    #[arg(
        long,
        default_value = "gossip:onebit,allreduce:dense,diloco:dense,fedavg:dense"
    )]
    runs: String,
    /// Data partitions, comma-separated (`iid`, `by_label`).
    #[arg(long, default_value = "iid")]
    partitions: String,
    /// Steps between evaluations, for p2ptrain and DDP alike.
    #[arg(long, default_value_t = 250)]
    eval_every: u64,
    /// Python with torch for the DDP runs.
    #[arg(long, default_value = "bench/.venv/bin/python")]
    python: PathBuf,
    /// Leave DDP out.
    #[arg(long)]
    no_ddp: bool,
    /// Run every node and DDP process on a host of a namespace lab whose outgoing link is
    /// limited to this rate (`tc` syntax, e.g. `10mbit`); needs root. Default: loopback.
    #[arg(long)]
    link: Option<String>,
    /// Also evaluate once this many seconds passed since the last evaluation, for p2ptrain
    /// and DDP alike (0: by steps only).
    #[arg(long, default_value_t = 10.0)]
    eval_secs: f64,
}

/// DDP's rendezvous port on the first lab host.
const DDP_MASTER_PORT: u16 = 29517;

/// One p2ptrain run of the race.
#[derive(Debug, Serialize)]
struct RaceRun {
    mode: String,
    codec: String,
    partition: String,
    links: String,
    nodes: usize,
    /// Seconds from the first node's start until the nodes' mean accuracy reached the
    /// target; `None` when it did not within the timeout.
    time_to_target_s: Option<f64>,
    /// Mean over nodes of all bytes each sent (libp2p's counters: updates, rounds, syncs,
    /// state transfer, control).
    bytes_sent_per_node: f64,
    /// Mean of the nodes' final accuracies.
    final_accuracy: f64,
    steps: Vec<u64>,
    wall_s: f64,
    /// `[seconds, mean accuracy of the nodes that have evaluated]`.
    accuracy_over_time: Vec<[f64; 2]>,
}

#[derive(Debug, Serialize)]
struct Report {
    benchmark: &'static str,
    config: String,
    target: f64,
    nodes: usize,
    timeout_s: f64,
    /// What links joined the nodes: loopback, or the lab's shaping.
    links: String,
    runs: Vec<RaceRun>,
    ddp: Vec<serde_json::Value>,
}

/// The nodes' mean accuracy over time (once all have evaluated), and when it first reached
/// `target`.
fn mean_curve(s: &LocalSummary, nodes: usize, target: f64) -> (Vec<[f64; 2]>, Option<f64>) {
    let mut latest: BTreeMap<usize, f64> = BTreeMap::new();
    let mut curve = Vec::new();
    let mut reached = None;
    for p in &s.trace {
        if let Some(a) = p.accuracy {
            latest.insert(p.node, a);
        }
        if latest.len() == nodes && p.node == nodes - 1 {
            let mean = latest.values().sum::<f64>() / nodes as f64;
            curve.push([p.t, mean]);
            if reached.is_none() && mean >= target {
                reached = Some(p.t);
            }
        }
    }
    (curve, reached)
}

/// Waits for every DDP rank to finish. A rank that fails would leave the others waiting
/// for it in a collective, so the first failure (or the deadline) ends the wait, and dropping
/// `ranks` kills them all.
fn wait_for_ranks(mut ranks: Children, deadline_s: f64) -> Result<()> {
    let started = std::time::Instant::now();
    let mut exited: Vec<Option<std::process::ExitStatus>> = vec![None; ranks.0.len()];
    let failure = loop {
        for (rank, child) in ranks.0.iter_mut().enumerate() {
            if exited[rank].is_none() {
                exited[rank] = child.try_wait()?;
            }
        }
        let failed = exited
            .iter()
            .enumerate()
            .find_map(|(rank, s)| s.filter(|s| !s.success()).map(|s| (rank, s)));
        if let Some((rank, status)) = failed {
            break Some(format!("rank {rank}: {status}"));
        }
        if exited.iter().all(Option::is_some) {
            break None;
        }
        if started.elapsed().as_secs_f64() > deadline_s {
            break Some(format!("the ranks ran past {deadline_s:.0} s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    if let Some(why) = failure {
        bail!("bench/ddp_race.py failed: {why}");
    }
    Ok(())
}

/// Runs the benchmark.
pub fn run(args: RaceArgs) -> Result<()> {
    if args.nodes < 2 {
        bail!("--nodes must be at least 2: a race of one is no mesh");
    }
    if !(args.target > 0.0 && args.target <= 1.0) {
        bail!("--target {} must be in (0, 1]", args.target);
    }
    if std::time::Duration::try_from_secs_f64(args.eval_secs).is_err() {
        bail!(
            "--eval-secs {} must be a number of seconds, 0 or more",
            args.eval_secs
        );
    }
    let base = p2ptrain_daemon::config::Config::load(Some(&args.config))?;
    if matches!(base.model, p2ptrain_daemon::config::ModelConfig::Gpt(_)) {
        bail!(
            "bench race runs to a held-out accuracy; a gpt is judged by bits per byte \
             (use `local` or `bench mesh` for it)"
        );
    }
    if args.eval_every == 0 && args.eval_secs == 0.0 {
        bail!("--eval-every 0 with --eval-secs 0 never evaluates: no run could reach the target");
    }
    let runs: Vec<(String, String)> = args
        .runs
        .split(',')
        .map(|r| {
            let (mode, codec) = r.trim().split_once(':').unwrap_or((r.trim(), "dense"));
            mode.parse::<p2ptrain_daemon::config::SyncMode>()
                .map_err(anyhow::Error::msg)?;
            codec
                .parse::<p2ptrain_models::codec::Codec>()
                .map_err(anyhow::Error::msg)?;
            Ok((mode.to_string(), codec.to_string()))
        })
        .collect::<Result<_>>()?;
    let partitions: Vec<String> = args
        .partitions
        .split(',')
        .map(|p| p.trim().to_string())
        .collect();
    for p in &partitions {
        if !["iid", "by_label"].contains(&p.as_str()) {
            bail!("--partitions: {p:?} is not iid or by_label");
        }
    }
    if !args.no_ddp && !args.python.exists() {
        bail!(
            "no Python with torch at {}: run bench/setup_torch.sh (it makes bench/.venv), pass --python, or --no-ddp",
            args.python.display()
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    // The lab lives until the race ends; dropping it deletes its namespaces.
    let lab = match &args.link {
        None => None,
        Some(rate) => {
            let lab =
                p2ptrain_netlab::Lab::new(args.nodes).context("--link needs a namespace lab")?;
            let shaping = lab.shape(rate, "0ms", "0%")?;
            eprintln!("bench race: {} lab hosts, {shaping}", args.nodes);
            Some((lab, shaping))
        }
    };
    let links = lab
        .as_ref()
        .map_or_else(|| "loopback".to_string(), |(_, s)| s.clone());
    let hosts: Vec<LabHost> = lab
        .as_ref()
        .map(|(lab, _)| {
            (0..args.nodes)
                .map(|i| LabHost {
                    netns: lab.ns(i).to_string(),
                    listen: lab.listen(i),
                })
                .collect()
        })
        .unwrap_or_default();
    let (base, config_name) = base_text(Some(&args.config))?;
    let base_table: toml::Table = toml::from_str(&base)?;
    let mnist_dir = base_table
        .get("data")
        .and_then(|d| d.get("dir"))
        .and_then(|d| d.as_str())
        .map(PathBuf::from);
    let optimizer = base_table.get("optimizer").cloned();
    let mut report = Report {
        benchmark: "race",
        config: config_name,
        target: args.target,
        nodes: args.nodes,
        timeout_s: args.timeout,
        links: links.clone(),
        runs: Vec::new(),
        ddp: Vec::new(),
    };
    let mut progress =
        crate::progress::Counted::items("bench race", (partitions.len() * runs.len()) as u64);
    let mut done = 0;
    for partition in &partitions {
        for (mode, codec) in &runs {
            let name = format!("{mode}-{codec}-{partition}");
            progress.set_quietly(done, &name);
            done += 1;
            let mut node_configs = BTreeMap::new();
            for k in 0..args.nodes {
                let settings = [
                    ("sync", "mode", toml::Value::String(mode.clone())),
                    ("sync", "codec", toml::Value::String(codec.clone())),
                    (
                        "train",
                        "shard",
                        toml::Value::String(format!("{k}/{}", args.nodes)),
                    ),
                    (
                        "train",
                        "eval_every",
                        toml::Value::Integer(args.eval_every as i64),
                    ),
                    (
                        "train",
                        "eval_every_secs",
                        toml::Value::Float(args.eval_secs),
                    ),
                    ("data", "partition", toml::Value::String(partition.clone())),
                    ("checkpoint", "every_steps", toml::Value::Integer(0)),
                    ("checkpoint", "every_secs", toml::Value::Integer(0)),
                ];
                node_configs.insert(
                    k,
                    write_run_config(&base, &args.out, &format!("{name}-{k}"), &settings)?,
                );
            }
            progress.println(format!(
                "bench race: {} nodes, {name}, until {:.0}% or {:.0} s",
                args.nodes,
                args.target * 100.0,
                args.timeout
            ));
            let summary = local::run(LocalArgs {
                nodes: args.nodes,
                config: node_configs.get(&0).cloned(),
                duration: Some(args.timeout),
                steps: None,
                data_dir: None,
                json: true,
                node_configs,
                trace: true,
                stop_at_mean_accuracy: Some(args.target),
                hosts: hosts.clone(),
                no_alone: true,
                target: None,
                sync_mode: None,
                cores_per_node: None,
            })?;
            let (curve, reached) = mean_curve(&summary, args.nodes, args.target);
            let n = summary.per_node.len().max(1) as f64;
            let r = RaceRun {
                mode: mode.clone(),
                codec: if mode == "gossip" {
                    codec.clone()
                } else {
                    "dense".into()
                },
                partition: partition.clone(),
                links: links.clone(),
                nodes: args.nodes,
                time_to_target_s: reached,
                bytes_sent_per_node: summary
                    .per_node
                    .iter()
                    .map(|p| p.bytes_sent as f64)
                    .sum::<f64>()
                    / n,
                final_accuracy: summary.mean_accuracy,
                steps: summary.per_node.iter().map(|p| p.step).collect(),
                wall_s: summary.wall_secs,
                accuracy_over_time: curve,
            };
            progress.println(format!(
                "  {name}: {} , {:.1} MB sent per node, final mean accuracy {:.2}%",
                r.time_to_target_s
                    .map_or("target not reached".into(), |t| format!(
                        "{t:.1} s to target"
                    )),
                r.bytes_sent_per_node / 1e6,
                r.final_accuracy * 100.0
            ));
            report.runs.push(r);
        }
        if !args.no_ddp {
            let Some(dir) = &mnist_dir else {
                bail!("the DDP run reads MNIST: the config has no data.dir");
            };
            let out = args.out.join(format!("ddp-{partition}.json"));
            let (lr, momentum) = match &optimizer {
                Some(o) => (
                    o.get("lr").and_then(toml::Value::as_float).unwrap_or(0.01),
                    o.get("momentum")
                        .and_then(toml::Value::as_float)
                        .unwrap_or(0.0),
                ),
                None => (0.01, 0.0),
            };
            progress.println(format!(
                "bench race: PyTorch DDP (gloo), {} processes, {partition}",
                args.nodes
            ));
            let ddp_args = |c: &mut Command| {
                c.arg("bench/ddp_race.py")
                    .args(["--mnist", &dir.display().to_string()])
                    .args(["--nodes", &args.nodes.to_string()])
                    .args(["--target", &args.target.to_string()])
                    .args(["--timeout", &args.timeout.to_string()])
                    .args(["--lr", &lr.to_string(), "--momentum", &momentum.to_string()])
                    .args(["--eval-every", &args.eval_every.to_string()])
                    .args(["--eval-secs", &args.eval_secs.to_string()])
                    .args(["--partition", partition])
                    .args(["--out", &out.display().to_string()]);
            };
            match &lab {
                None => {
                    let mut c = Command::new(&args.python);
                    ddp_args(&mut c);
                    let status = c
                        .status()
                        .with_context(|| format!("cannot run {}", args.python.display()))?;
                    if !status.success() {
                        bail!("bench/ddp_race.py failed ({status})");
                    }
                }
                Some((lab, _)) => {
                    // One process per lab host; rank 0 (on host 0) is the rendezvous and
                    // writes the result.
                    let master = format!("{}:{DDP_MASTER_PORT}", lab.addr(0));
                    // Killed if anything below fails: a rank left alone would wait in its
                    // rendezvous for gloo's 30 minutes.
                    let mut ranks = Children(Vec::new());
                    for rank in 0..args.nodes {
                        let mut c = lab.command(rank, &args.python);
                        ddp_args(&mut c);
                        c.args(["--rank", &rank.to_string(), "--master", &master])
                            .args(["--iface", "eth0"]);
                        ranks
                            .0
                            .push(c.spawn().with_context(|| {
                                format!("cannot run {}", args.python.display())
                            })?);
                    }
                    wait_for_ranks(ranks, args.timeout + 300.0)?;
                }
            }
            let mut v: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(&out)
                    .with_context(|| format!("cannot read {}", out.display()))?,
            )?;
            v["links"] = links.clone().into();
            progress.println(format!(
                "  DDP {partition}: {} s to target",
                v["time_to_target_s"]
            ));
            report.ddp.push(v);
        }
    }
    progress.finish(done);
    let json = serde_json::to_string_pretty(&report)?;
    let mut lines: Vec<(String, Vec<(f64, f64)>)> = report
        .runs
        .iter()
        .map(|r| {
            (
                format!("{} {} {}", r.mode, r.codec, r.partition),
                r.accuracy_over_time.iter().map(|p| (p[0], p[1])).collect(),
            )
        })
        .collect();
    for d in &report.ddp {
        let points = d["accuracy_over_time"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                    .collect()
            })
            .unwrap_or_default();
        lines.push((
            format!("DDP gloo {}", d["partition"].as_str().unwrap_or("")),
            points,
        ));
    }
    let svg = crate::plot::render_race_svg(
        &format!(
            "p2ptrain bench race: {} nodes, time to {:.0}%, {}",
            args.nodes,
            args.target * 100.0,
            links
        ),
        &lines,
        args.target,
    )?;
    write_report(&args.out, &json, &svg)
}
