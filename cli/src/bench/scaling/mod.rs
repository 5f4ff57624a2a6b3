//! `p2ptrain bench scaling`: what another box buys, measured as time to a target loss.
//!
//! For one config and one or more targets (held-out bits per byte for a language model, lower
//! is better; held-out accuracy otherwise), each seed runs:
//! - `alone`: one node, pinned to its cores, at each learning rate of the grid;
//! - `alone_xN`: one node with N times the batch, same grid: the most N boxes could gain per
//!   step, counted in steps (the ideal);
//! - `alone_<mode>` for each sync mode of `--modes` with an outer optimizer (`diloco`): one
//!   node in that mode alone (a ring of one, with the mesh runs' `--set` settings), so DiLoCo's
//!   outer optimizer with one replica is a lone control too and the mesh gets no credit for
//!   the optimizer;
//! - `alone_loaded` (with `--loaded-control`): N independent lone nodes at once, one per core
//!   set, so the lone control pays what sharing the machine costs, as the mesh's nodes do;
//! - one run per sync mode and learning rate of `--mesh-lrs`: N nodes, each pinned to its own
//!   cores, in a mesh on loopback (with `--straggler-delay-us`, the last one a slower box;
//!   with `--set`, every one given those settings);
//! - `pytorch_ddp` (unless `--no-torch`): the same model, optimizer, schedule, batch and
//!   learning rates under PyTorch DDP with the gloo backend, one process per node on the same
//!   pinning (`bench/ddp_train.py`, with the Python of `bench/setup_torch.sh`'s environment).
//!   Both sides read the very same samples: the benchmark writes the config's data, as
//!   p2ptrain loads it, to `DIR/data`. `--straggler-delay-us` and `--set` are p2ptrain's
//!   settings and do not apply to DDP's runs.
//!
//! With `--link RATE` (root only) the mesh's nodes and DDP's processes each run on a host of a
//! namespace lab (`p2ptrain-netlab`) whose outgoing link `tc` limits to RATE; lone runs need
//! no link and stay on loopback.
//!
//! Every node appends each evaluation to `evals.jsonl` in its data directory with its step and
//! wall-clock time, evaluating every `--eval-every` steps, so steps and times to a target are
//! exact, not read off a poll. The report gives, per kind of run, the median and spread over
//! seeds of the steps and seconds to each target (and the seconds less the nodes' own
//! evaluations: training seconds), the steps per second, the bytes each node
//! sent, for a synchronous mode the share of the run spent in rounds, the speedup over one box
//! (`alone`, or for a mode with an outer optimizer whichever of `alone` and `alone_<mode>`
//! reached the last target sooner, best learning rate each) and the scaling efficiency: the
//! speedup over the ideal `steps(alone) / steps(alone_xN)`. One box's figures do not depend on
//! the link, so `--lone-from` takes them from an earlier report instead of running them again
//! (one invocation per `--link`, the lone arms measured once). `DIR/report.json` holds it and
//! every run's curve; `DIR/report.svg` draws each kind's median curve over its seeds against
//! wall time (at the learning rate its summary chose), each seed's curve faint behind it.
//!
//! Pinning uses `taskset` (util-linux); more nodes than core sets is a clear error. The same
//! comparison across real boxes: start the lone control on one box, then `p2ptrain join` on
//! each box with the same config (see docs/benchmarks.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::config::Config;
use p2ptrain_daemon::trainer::EvalRecord;
use p2ptrain_models::data::Data;
use p2ptrain_netlab::Lab;
use serde::Serialize;

use super::mesh::{base_text, write_report, write_run_config};
use crate::local::{
    check_core_sets, check_starting, core_set, read_evals, unix_ms, Children, START_WAIT,
};
use crate::measure::median;
use nodes::*;
use report::*;
use torch::*;

mod nodes;
mod report;
mod torch;

/// Arguments of `bench scaling`.
#[derive(Args)]
pub struct ScalingArgs {
    /// Where `report.json`, `report.svg`, the run configs and every node's data go.
    #[arg(long)]
    out: PathBuf,
    /// Base configuration.
    #[arg(long, default_value = "configs/text-gpt.toml")]
    config: PathBuf,
    /// Nodes of each mesh (and N of the `alone_xN` batch).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// CPU cores each node is pinned to (its compute threads too).
    #[arg(long, default_value_t = 1)]
    cores_per_node: usize,
    /// Targets, comma-separated: held-out bits per byte for a language model (reached when
    /// at or below), held-out accuracy otherwise (at or above).
    #[arg(long, value_delimiter = ',', default_value = "3.0,2.8")]
    targets: Vec<f64>,
    /// Sync modes to run, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ddp,allreduce,diloco,gossip",
        value_parser = clap::builder::PossibleValuesParser::new(
            p2ptrain_daemon::config::SyncMode::names()
        )
    )]
    modes: Vec<String>,
    /// Seeds (each run repeated with node seeds from each).
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// The first of the seeds (they run from it up): `--first-seed 4` confirms an arm chosen
    /// on seeds 1-3 on seeds no choice was made on.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    first_seed: u64,
    /// Learning rates of the lone runs' grid, comma-separated (default: the config's).
    #[arg(long, value_delimiter = ',')]
    lrs: Vec<f64>,
    /// Learning rates of the mesh runs' grid, comma-separated (default: the config's). N
    /// members of a synchronous mode step with N times the batch, which may take a larger
    /// rate than one node's.
    #[arg(long, value_delimiter = ',')]
    mesh_lrs: Vec<f64>,
    /// Steps between evaluations, every run alike.
    #[arg(long, default_value_t = 50)]
    eval_every: u64,
    /// Reuse the lone runs (`alone`, `alone_xN`, `alone_<mode>`) of the `bench scaling` report
    /// in this directory instead of running them again; it must have the same config,
    /// targets, nodes, cores per node, seeds, evaluation period and learning-rate grid (and,
    /// for `alone_<mode>`, the same `--set` settings). A lone kind it lacks runs here.
    #[arg(long, value_name = "DIR")]
    lone_from: Option<PathBuf>,
    /// Give up on a run after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Also run the lone control with the other core sets busy with lone runs of their own.
    #[arg(long)]
    loaded_control: bool,
    /// Leave out the one-node-with-N-times-the-batch runs (the ideal).
    #[arg(long)]
    no_ideal: bool,
    /// In every mesh run, the last node computes slower: this many microseconds of sleep
    /// per sample in each forward-backward pass (`debug.sample_delay_us`; about 4200 halves
    /// the small GPT's speed on one core here). A slower box that takes no core from the
    /// others, as a second machine would not; the lone runs are not slowed: the question is
    /// whether the mesh with a slow box still beats the fast box alone.
    #[arg(long, default_value_t = 0)]
    straggler_delay_us: u64,
    /// A setting for every node of the mesh runs, `section.key=VALUE` with VALUE in TOML
    /// (e.g. `sync.balance_batches=false`); repeat for more.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    settings: Vec<String>,
    /// Leave PyTorch DDP out.
    #[arg(long)]
    no_torch: bool,
    /// Python with torch for the DDP runs (`bench/setup_torch.sh` makes this one).
    #[arg(long, default_value = "bench/.venv/bin/python")]
    python: PathBuf,
    /// Run every mesh node and DDP process on a host of a namespace lab whose outgoing link
    /// is limited to this rate (`tc` syntax, e.g. `10mbit`); needs root. Default: loopback.
    #[arg(long)]
    link: Option<String>,
}

/// Set by SIGINT or SIGTERM. The benchmark's waits see it and return an error, so the runs'
/// processes are killed and the lab's namespaces deleted as their owners drop, where dying
/// by the signal's default action would leave both behind.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Turns SIGINT and SIGTERM into [`INTERRUPTED`] for the rest of the process.
fn catch_signals() -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut int, mut term) = rt.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    std::thread::spawn(move || {
        rt.block_on(async {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        });
        INTERRUPTED.store(true, Ordering::SeqCst);
    });
    Ok(())
}

/// An error once a signal asked the benchmark to stop.
fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted: the runs' processes are stopped and the lab removed");
    }
    Ok(())
}

/// A `--set` setting: section, key, value.
type Setting = (String, String, toml::Value);

/// Settings the benchmark itself gives every run: `--set` may not change them, or the mesh
/// runs would differ from the lone ones in more than the mesh.
const HARNESS_KEYS: [&str; 8] = [
    "train.batch_size",
    "train.eval_every",
    "train.eval_every_secs",
    "train.threads",
    "train.node_seed",
    "optimizer.lr",
    "sync.mode",
    "sync.min_members",
];

/// Reads `section.key=VALUE` (VALUE in TOML; a bare word is a string); a key the benchmark
/// sets itself is refused.
fn parse_setting(s: &str) -> Result<Setting> {
    let p2ptrain_daemon::config::Setting {
        section,
        key,
        value,
    } = s
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--set {e}"))?;
    if HARNESS_KEYS.contains(&format!("{section}.{key}").as_str()) {
        bail!("--set {section}.{key}: the benchmark sets it for every run (see its own options)");
    }
    Ok((section, key, value))
}

/// What a run trains with.
#[derive(Debug, Clone, PartialEq)]
enum Arm {
    /// Lone nodes, independent when more than one.
    Lone,
    /// One node alone in this sync mode, with the mesh runs' settings: a ring of one, so a
    /// mode's outer optimizer works with one replica.
    LoneIn(String),
    /// A p2ptrain mesh in this sync mode.
    Mesh(String),
    /// PyTorch DDP (gloo), one process per node.
    Torch,
}

/// What one run is made of.
struct Plan {
    kind: String,
    seed: u64,
    lr: f64,
    batch_size: i64,
    nodes: usize,
    arm: Arm,
}

/// Where the runs happen and what the DDP side needs, fixed for the whole benchmark.
struct Bench<'a> {
    args: &'a ScalingArgs,
    base: &'a str,
    extra: &'a [Setting],
    metric: Metric,
    /// The namespace lab of `--link` and its shaping.
    lab: Option<(Lab, String)>,
    /// The DDP runs' fixed arguments (`None` with `--no-torch`).
    torch: Option<TorchSide>,
}

impl Bench<'_> {
    fn lab_ns(&self, arm: &Arm, k: usize) -> Option<&str> {
        match (arm, &self.lab) {
            (Arm::Mesh(_) | Arm::Torch, Some((lab, _))) => Some(lab.ns(k)),
            _ => None,
        }
    }

    /// A command that runs `program` pinned to node `k`'s cores, on its lab host for the
    /// runs that cross links.
    fn pinned(&self, arm: &Arm, k: usize, program: &Path) -> Command {
        let cores = core_set(k, self.args.cores_per_node);
        let mut cmd = match (self.lab_ns(arm, k), &self.lab) {
            (Some(_), Some((lab, _))) => lab.command(k, "taskset"),
            _ => Command::new("taskset"),
        };
        cmd.args(["-c", &cores]).arg(program);
        cmd
    }
}

/// Runs one plan to the last target (or the timeout) and measures it.
fn run_one(bench: &Bench, plan: &Plan, index: usize) -> Result<Run> {
    let (args, metric) = (bench.args, bench.metric);
    let name = format!("{index:02}-{}-seed{}-lr{}", plan.kind, plan.seed, plan.lr);
    let dir = args.out.join("runs").join(&name);
    let _ = std::fs::remove_dir_all(&dir);
    let mut configs = Vec::new();
    for k in 0..plan.nodes {
        if plan.arm == Arm::Torch {
            break;
        }
        let mut settings: Vec<(&str, &str, toml::Value)> = vec![
            ("train", "batch_size", toml::Value::Integer(plan.batch_size)),
            (
                "train",
                "eval_every",
                toml::Value::Integer(args.eval_every as i64),
            ),
            ("train", "eval_every_secs", toml::Value::Float(0.0)),
            (
                "train",
                "threads",
                toml::Value::Integer(args.cores_per_node as i64),
            ),
            (
                "train",
                "node_seed",
                toml::Value::Integer((plan.seed * 100 + k as u64) as i64),
            ),
            ("optimizer", "lr", toml::Value::Float(plan.lr)),
        ];
        if let Arm::Mesh(mode) | Arm::LoneIn(mode) = &plan.arm {
            for (section, key, value) in bench.extra {
                settings.push((section.as_str(), key.as_str(), value.clone()));
            }
            let mesh = matches!(plan.arm, Arm::Mesh(_));
            if mesh && k + 1 == plan.nodes && args.straggler_delay_us > 0 {
                settings.push((
                    "debug",
                    "sample_delay_us",
                    toml::Value::Integer(args.straggler_delay_us as i64),
                ));
            }
            settings.push(("sync", "mode", toml::Value::String(mode.clone())));
            // The synchronous modes start with all N from one state, and a gossip node takes
            // its first step once it hears the N - 1 others (at most `degree`); a lone node
            // has itself alone.
            settings.push((
                "sync",
                "min_members",
                toml::Value::Integer(plan.nodes as i64),
            ));
        }
        configs.push(write_run_config(
            bench.base,
            &dir,
            &format!("node{k}"),
            &settings,
        )?);
    }
    let node_dirs: Vec<PathBuf> = (0..plan.nodes).map(|k| dir.join(format!("n{k}"))).collect();
    let started_ms = unix_ms();
    let started = Instant::now();
    let mut children = Children(Vec::new());
    match &plan.arm {
        Arm::Torch => {
            let master = match &bench.lab {
                Some((lab, _)) => format!("{}:{}", lab.addr(0), DDP_MASTER_PORT),
                None => format!("127.0.0.1:{}", free_port()?),
            };
            for (k, d) in node_dirs.iter().enumerate() {
                children.0.push(spawn_rank(bench, plan, k, d, &master)?);
            }
        }
        Arm::Lone | Arm::LoneIn(_) => {
            for (k, cfg) in configs.iter().enumerate() {
                children
                    .0
                    .push(spawn(bench, &plan.arm, k, &node_dirs[k], cfg, None)?);
            }
        }
        Arm::Mesh(_) => {
            let mut boot = None;
            for (k, cfg) in configs.iter().enumerate() {
                let node_dir = &node_dirs[k];
                let child = spawn(bench, &plan.arm, k, node_dir, cfg, boot.as_deref())?;
                children.0.push(child);
                if k == 0 {
                    let child = children.0.last_mut().context("node 0")?;
                    boot = Some(wait_listen_addr(
                        node_dir,
                        bench.lab_ns(&plan.arm, 0),
                        child,
                    )?);
                }
            }
        }
    }
    // Lone runs with other lone runs beside them measure node 0 only; DDP's replicas are
    // identical and rank 0 alone evaluates.
    let measured = match plan.arm {
        Arm::Mesh(_) => plan.nodes,
        Arm::Lone | Arm::LoneIn(_) | Arm::Torch => 1,
    };
    let last = args.targets.iter().copied().reduce(|a, b| match metric {
        Metric::BitsPerByte => a.min(b),
        Metric::Accuracy => a.max(b),
    });
    let last = last.context("no target")?;
    let timed_out = loop {
        std::thread::sleep(Duration::from_millis(500));
        check_interrupted()?;
        let done = node_dirs[..measured]
            .iter()
            .all(|d| first_reaching(&read_evals(d), metric, last).is_some());
        if done {
            break false;
        }
        if started.elapsed().as_secs_f64() > args.timeout {
            break true;
        }
        for c in &mut children.0 {
            if let Some(st) = c.try_wait()? {
                bail!(
                    "a node of {name} exited early ({st}); see {}",
                    dir.display()
                );
            }
        }
    };
    let finals: Vec<serde_json::Value> = node_dirs[..measured]
        .iter()
        .enumerate()
        .map(|(k, d)| match plan.arm {
            // What rank 0 wrote at its latest evaluation, in the status's field names.
            Arm::Torch => std::fs::read_to_string(d.join("ddp.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .map(|v| serde_json::json!({"bytes_sent": v["bytes_sent_per_node"], "torch": v["torch"]}))
                .unwrap_or_default(),
            _ => status(d, bench.lab_ns(&plan.arm, k)).unwrap_or_default(),
        })
        .collect();
    let run_secs = started.elapsed().as_secs_f64();
    drop(children);
    // A synchronous mode's nodes wait for their rounds: the share of the run each spent in
    // them (rounds completed times their mean duration), the mean over nodes.
    let round_shares: Vec<f64> = finals
        .iter()
        .filter_map(|s| {
            let rounds = s["rounds"]["completed"].as_f64()?;
            let mean_ms = s["rounds"]["mean_round_ms"].as_f64()?;
            Some(rounds * mean_ms / 1e3 / run_secs.max(1e-9))
        })
        .collect();
    let evals: Vec<Vec<EvalRecord>> = node_dirs[..measured]
        .iter()
        .map(|d| read_evals(d))
        .collect();
    let mut steps_to_target = BTreeMap::new();
    let mut seconds_to_target = BTreeMap::new();
    let mut train_seconds_to_target = BTreeMap::new();
    for &t in &args.targets {
        let per_node: Option<Vec<&EvalRecord>> =
            evals.iter().map(|e| first_reaching(e, metric, t)).collect();
        let secs = |e: &EvalRecord| e.unix_ms.saturating_sub(started_ms) as f64 / 1e3;
        let (steps, wall, train) = match per_node {
            Some(v) => (
                v.iter().map(|e| e.step).max(),
                v.iter().map(|e| secs(e)).reduce(f64::max),
                v.iter().map(|e| secs(e) - e.eval_secs).reduce(f64::max),
            ),
            None => (None, None, None),
        };
        steps_to_target.insert(target_key(t), steps);
        seconds_to_target.insert(target_key(t), wall);
        train_seconds_to_target.insert(target_key(t), train);
    }
    let node0 = &evals[0];
    let curve: Vec<[f64; 3]> = node0
        .iter()
        .filter_map(|e| {
            let v = metric.value(e)?;
            Some([
                e.unix_ms.saturating_sub(started_ms) as f64 / 1e3,
                e.step as f64,
                v,
            ])
        })
        .collect();
    let steps_per_sec = node0
        .last()
        .map(|e| e.step as f64 / (e.unix_ms.saturating_sub(started_ms).max(1) as f64 / 1e3))
        .unwrap_or(0.0);
    let bytes: Vec<f64> = finals
        .iter()
        .filter_map(|s| s["bytes_sent"].as_f64())
        .collect();
    let mesh = if plan.arm == Arm::Torch {
        finals
    } else {
        finals
            .iter()
            .map(|s| {
                serde_json::json!({
                    "peers": s["peers"]["count"],
                    "rejected": s["updates"]["rejected"],
                    "banned": s["banned_peers"].as_array().map_or(0, Vec::len),
                    "rounds": s["rounds"]["completed"],
                    "mean_round_ms": s["rounds"]["mean_round_ms"],
                    "batch": s["rounds"]["batch"],
                    "ms_per_sample": s["ms_per_sample"],
                })
            })
            .collect()
    };
    eprintln!(
        "{name}: steps {steps_to_target:?}, seconds {seconds_to_target:?}, training seconds {train_seconds_to_target:?}{}",
        if timed_out { " (timed out)" } else { "" }
    );
    Ok(Run {
        kind: plan.kind.clone(),
        seed: plan.seed,
        lr: plan.lr,
        batch_size: plan.batch_size,
        nodes: plan.nodes,
        steps_to_target,
        seconds_to_target,
        train_seconds_to_target,
        steps_per_sec,
        bytes_sent_per_node: if bytes.is_empty() {
            0.0
        } else {
            bytes.iter().sum::<f64>() / bytes.len() as f64
        },
        round_share: (!round_shares.is_empty())
            .then(|| round_shares.iter().sum::<f64>() / round_shares.len() as f64),
        curve,
        mesh,
    })
}

/// Runs the benchmark.
pub fn run(args: ScalingArgs) -> Result<()> {
    if args.nodes < 2 {
        bail!("--nodes must be at least 2: the benchmark compares a mesh with one node");
    }
    check_core_sets(args.nodes, args.cores_per_node)?;
    let extra = args
        .settings
        .iter()
        .map(|s| parse_setting(s))
        .collect::<Result<Vec<_>>>()?;
    if args.targets.is_empty() {
        bail!("--targets: at least one");
    }
    for m in &args.modes {
        m.parse::<p2ptrain_daemon::config::SyncMode>()
            .map_err(anyhow::Error::msg)?;
    }
    if !args.no_torch && !Path::new(DDP_SCRIPT).exists() {
        bail!("{DDP_SCRIPT} not found: run bench scaling from the repository's root, or pass --no-torch");
    }
    if !args.no_torch && !args.python.exists() {
        bail!(
            "no Python with torch at {}: run bench/setup_torch.sh (it makes bench/.venv), pass --python, or --no-torch",
            args.python.display()
        );
    }
    std::fs::create_dir_all(&args.out)?;
    catch_signals()?;
    let (base, config_name) = base_text(Some(&args.config))?;
    let table: toml::Table = toml::from_str(&base)?;
    // The language models' held-out figure is bits per byte.
    let metric = if Config::load(Some(&args.config))?.model.is_language_model() {
        Metric::BitsPerByte
    } else {
        Metric::Accuracy
    };
    let batch = table["train"]
        .get("batch_size")
        .and_then(toml::Value::as_integer)
        .context("train.batch_size")?;
    let config_lr = table["optimizer"]
        .get("lr")
        .and_then(toml::Value::as_float)
        .context("optimizer.lr")?;
    let grid = |given: &[f64]| {
        if given.is_empty() {
            vec![config_lr]
        } else {
            given.to_vec()
        }
    };
    let (lrs, mesh_lrs) = (grid(&args.lrs), grid(&args.mesh_lrs));
    let big = format!("alone_x{}", args.nodes);
    // The modes whose lone control has their outer optimizer, by kind.
    let lone_in: Vec<(String, String)> = args
        .modes
        .iter()
        .filter(|m| has_outer_optimizer(m))
        .map(|m| (format!("alone_{m}"), m.clone()))
        .collect();
    let reused = match &args.lone_from {
        None => Vec::new(),
        Some(dir) => {
            let mut plain = vec!["alone".to_string()];
            if !args.no_ideal {
                plain.push(big.clone());
            }
            let wanted = LoneKinds {
                plain,
                with_settings: lone_in.iter().map(|(kind, _)| kind.clone()).collect(),
            };
            reused_lone_runs(dir, &args, &config_name, &lrs, &wanted)?
        }
    };
    let is_reused = |kind: &str| reused.iter().any(|r| r.kind == kind);
    let mut plans = Vec::new();
    for seed in args.first_seed..args.first_seed.saturating_add(args.seeds) {
        for &lr in &lrs {
            if !is_reused("alone") {
                plans.push(Plan {
                    kind: "alone".into(),
                    seed,
                    lr,
                    batch_size: batch,
                    nodes: 1,
                    arm: Arm::Lone,
                });
            }
            if !args.no_ideal && !is_reused(&big) {
                plans.push(Plan {
                    kind: big.clone(),
                    seed,
                    lr,
                    batch_size: batch * args.nodes as i64,
                    nodes: 1,
                    arm: Arm::Lone,
                });
            }
            for (kind, mode) in lone_in.iter().filter(|(kind, _)| !is_reused(kind)) {
                plans.push(Plan {
                    kind: kind.clone(),
                    seed,
                    lr,
                    batch_size: batch,
                    nodes: 1,
                    arm: Arm::LoneIn(mode.clone()),
                });
            }
        }
        if args.loaded_control {
            plans.push(Plan {
                kind: "alone_loaded".into(),
                seed,
                lr: config_lr,
                batch_size: batch,
                nodes: args.nodes,
                arm: Arm::Lone,
            });
        }
        for m in &args.modes {
            for &lr in &mesh_lrs {
                plans.push(Plan {
                    kind: m.clone(),
                    seed,
                    lr,
                    batch_size: batch,
                    nodes: args.nodes,
                    arm: Arm::Mesh(m.clone()),
                });
            }
        }
        if !args.no_torch {
            for &lr in &mesh_lrs {
                plans.push(Plan {
                    kind: TORCH_KIND.into(),
                    seed,
                    lr,
                    batch_size: batch,
                    nodes: args.nodes,
                    arm: Arm::Torch,
                });
            }
        }
    }
    // The lab lives until the benchmark ends; dropping it deletes its namespaces.
    let lab = match &args.link {
        None => None,
        Some(rate) => {
            let lab =
                Lab::new(args.nodes).context("--link needs a namespace lab (root, `ip`, `tc`)")?;
            let shaping = lab.shape(rate, "0ms", "0%")?;
            eprintln!("bench scaling: {} lab hosts, {shaping}", args.nodes);
            Some((lab, shaping))
        }
    };
    let links = lab
        .as_ref()
        .map_or_else(|| "loopback".to_string(), |(_, s)| s.clone());
    let torch = if args.no_torch {
        None
    } else {
        Some(torch_side(&args.config, &args.out.join("data"))?)
    };
    let bench = Bench {
        args: &args,
        base: &base,
        extra: &extra,
        metric,
        lab,
        torch,
    };
    let mut runs = reused;
    for (i, plan) in plans.iter().enumerate() {
        runs.push(run_one(&bench, plan, i)?);
    }
    let keys: Vec<String> = args.targets.iter().map(|t| target_key(*t)).collect();
    let last = target_key(
        args.targets
            .iter()
            .copied()
            .reduce(|a, b| match metric {
                Metric::BitsPerByte => a.min(b),
                Metric::Accuracy => a.max(b),
            })
            .context("no target")?,
    );
    let mut kinds = vec!["alone".to_string()];
    if !args.no_ideal {
        kinds.push(big.clone());
    }
    kinds.extend(lone_in.iter().map(|(kind, _)| kind.clone()));
    if args.loaded_control {
        kinds.push("alone_loaded".into());
    }
    kinds.extend(args.modes.iter().cloned());
    if !args.no_torch {
        kinds.push(TORCH_KIND.into());
    }
    let mut summary: Vec<KindSummary> = kinds
        .iter()
        .filter_map(|k| summarise(k, &runs, &last))
        .collect();
    type Figure = fn(&KindSummary) -> &BTreeMap<String, Spread>;
    let steps: Figure = |s| &s.steps_to_target;
    let secs: Figure = |s| &s.seconds_to_target;
    let train_secs: Figure = |s| &s.train_seconds_to_target;
    let median_of = |kind: &str, k: &str, figure: Figure| -> Option<f64> {
        figure(summary.iter().find(|s| s.kind == kind)?)[k].median
    };
    let ideal: BTreeMap<String, Option<f64>> = keys
        .iter()
        .map(|k| {
            let v = match (median_of("alone", k, steps), median_of(&big, k, steps)) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            (k.clone(), v)
        })
        .collect();
    // Each kind's one box: `alone`, or for a mode with an outer optimizer whichever of `alone`
    // and `alone_<mode>` reached the last target sooner, so the mesh gets no credit for the
    // optimizer. Per kind: its name and its median seconds and training seconds per target.
    let last_secs = |kind: &str| median_of(kind, &last, secs).unwrap_or(f64::INFINITY);
    type OneBox = (String, BTreeMap<String, (Option<f64>, Option<f64>)>);
    let one_boxes: Vec<OneBox> = summary
        .iter()
        .map(|s| {
            let own = format!("alone_{}", s.kind);
            let with_outer = lone_in.iter().any(|(kind, _)| *kind == own);
            let one_box = if with_outer && last_secs(&own) < last_secs("alone") {
                own
            } else {
                "alone".to_string()
            };
            let figures = keys
                .iter()
                .map(|k| {
                    let figure = (
                        median_of(&one_box, k, secs),
                        median_of(&one_box, k, train_secs),
                    );
                    (k.clone(), figure)
                })
                .collect();
            (one_box, figures)
        })
        .collect();
    let ratio = |a: Option<f64>, m: Option<f64>| match (a, m) {
        (Some(a), Some(m)) if m > 0.0 => Some(a / m),
        _ => None,
    };
    for (s, (one_box, figures)) in summary.iter_mut().zip(one_boxes) {
        for k in &keys {
            let (box_secs, box_train) = figures[k];
            let speedup = ratio(box_secs, s.seconds_to_target[k].median);
            s.speedup.insert(k.clone(), speedup);
            s.train_speedup.insert(
                k.clone(),
                ratio(box_train, s.train_seconds_to_target[k].median),
            );
            let eff = match (speedup, ideal[k]) {
                (Some(x), Some(i)) if i > 0.0 => Some(x / i),
                _ => None,
            };
            s.scaling_efficiency.insert(k.clone(), eff);
        }
        s.one_box = one_box;
    }
    let report = Report {
        measured: Measured::of(&args, &config_name),
        metric,
        straggler_delay_us: args.straggler_delay_us,
        links,
        ideal_speedup: ideal,
        summary,
        runs,
    };
    let json = serde_json::to_string_pretty(&report)?;
    let svg = render_report_svg(&report)?;
    write_report(&args.out, &json, &svg)
}

/// `report.svg`: per kind of run (at the learning rate its summary chose), each seed's curve
/// faint and the median over seeds bold, labelled with the seeds it is the median of.
fn render_report_svg(report: &Report) -> Result<String> {
    let mut lines = Vec::new();
    for (colour, s) in report.summary.iter().enumerate() {
        let runs: Vec<&Run> = report
            .runs
            .iter()
            .filter(|r| r.kind == s.kind && r.lr == s.lr)
            .collect();
        for r in &runs {
            lines.push(crate::plot::CurveLine {
                label: None,
                points: r.curve.iter().map(|p| (p[0], p[2])).collect(),
                colour,
            });
        }
        lines.push(crate::plot::CurveLine {
            label: Some(format!(
                "{} lr {} (median of {} seed{})",
                s.kind,
                s.lr,
                runs.len(),
                if runs.len() == 1 { "" } else { "s" }
            )),
            points: report::median_curve(&runs),
            colour,
        });
    }
    crate::plot::render_curves_svg(
        &format!(
            "p2ptrain bench scaling: {}, {} nodes, {}",
            report.measured.config, report.measured.nodes, report.links
        ),
        match report.metric {
            Metric::BitsPerByte => "held-out bits per byte",
            Metric::Accuracy => "held-out accuracy",
        },
        &lines,
    )
}

/// Whether a sync mode steps with an outer optimizer, which one node alone can use too.
fn has_outer_optimizer(mode: &str) -> bool {
    mode.parse::<p2ptrain_daemon::config::SyncMode>()
        .is_ok_and(|mode| {
            p2ptrain_daemon::config::SyncConfig {
                mode,
                ..Default::default()
            }
            .outer()
            .is_some()
        })
}

/// The lone kinds `--lone-from` may reuse.
struct LoneKinds {
    /// Kinds that only the config, batch and grid define (`alone`, `alone_xN`).
    plain: Vec<String>,
    /// Kinds the mesh runs' `--set` settings define too (`alone_<mode>`).
    with_settings: Vec<String>,
}

/// The runs of `wanted` kinds in the report in `dir`, once it is shown to measure what this
/// invocation would: same config (by the path given; its contents are not compared), targets,
/// nodes, cores per node, seeds, evaluation period and learning-rate grid; `alone_<mode>` runs
/// only under the same `--set` settings.
fn reused_lone_runs(
    dir: &Path,
    args: &ScalingArgs,
    config_name: &str,
    lrs: &[f64],
    wanted: &LoneKinds,
) -> Result<Vec<Run>> {
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("--lone-from: cannot read {}", path.display()))?;
    let report: ReusedReport = serde_json::from_str(&text).with_context(|| {
        format!(
            "--lone-from: {} is not a bench scaling report",
            path.display()
        )
    })?;
    let (theirs, ours) = (&report.measured, Measured::of(args, config_name));
    let mismatch = |what: &str, theirs: String, ours: String| -> Result<()> {
        if theirs != ours {
            bail!(
                "--lone-from {}: its {what} is {theirs}, this run's {ours}: its lone runs measured something else",
                dir.display()
            );
        }
        Ok(())
    };
    let figures = [
        (
            "benchmark",
            theirs.benchmark.clone(),
            ours.benchmark.clone(),
        ),
        ("config", theirs.config.clone(), ours.config.clone()),
        (
            "targets",
            format!("{:?}", theirs.targets),
            format!("{:?}", ours.targets),
        ),
        ("nodes", theirs.nodes.to_string(), ours.nodes.to_string()),
        (
            "cores per node",
            theirs.cores_per_node.to_string(),
            ours.cores_per_node.to_string(),
        ),
        ("seeds", theirs.seeds.to_string(), ours.seeds.to_string()),
        (
            "first seed",
            theirs.first_seed.to_string(),
            ours.first_seed.to_string(),
        ),
        (
            "evaluation period",
            theirs.eval_every.to_string(),
            ours.eval_every.to_string(),
        ),
    ];
    for (what, theirs, ours) in figures {
        mismatch(what, theirs, ours)?;
    }
    let same_settings = theirs.mesh_settings == ours.mesh_settings;
    let runs: Vec<Run> = report
        .runs
        .into_iter()
        .filter(|r| {
            wanted.plain.contains(&r.kind)
                || (same_settings && wanted.with_settings.contains(&r.kind))
        })
        .collect();
    for kind in wanted.plain.iter().chain(&wanted.with_settings) {
        let mut grid: Vec<String> = runs
            .iter()
            .filter(|r| &r.kind == kind)
            .map(|r| format!("{}", r.lr))
            .collect();
        grid.sort();
        grid.dedup();
        let mut ours: Vec<String> = lrs.iter().map(|lr| format!("{lr}")).collect();
        ours.sort();
        ours.dedup();
        if grid.is_empty() {
            let why = if same_settings || !wanted.with_settings.contains(kind) {
                "is not in"
            } else {
                "ran under other --set settings in"
            };
            eprintln!(
                "bench scaling: {kind} {why} {}: it runs here",
                path.display()
            );
        } else if grid != ours {
            mismatch(
                &format!("{kind} learning rates"),
                grid.join(","),
                ours.join(","),
            )?;
        } else {
            eprintln!("bench scaling: {kind} reused from {}", path.display());
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lone_run(kind: &str, lr: f64) -> Run {
        Run {
            kind: kind.into(),
            seed: 1,
            lr,
            batch_size: 32,
            nodes: 1,
            steps_to_target: BTreeMap::from([("2.8".to_string(), Some(1100))]),
            seconds_to_target: BTreeMap::from([("2.8".to_string(), Some(360.0))]),
            train_seconds_to_target: BTreeMap::from([("2.8".to_string(), Some(350.0))]),
            steps_per_sec: 3.0,
            bytes_sent_per_node: 0.0,
            round_share: None,
            curve: vec![[10.0, 50.0, 4.3]],
            mesh: Vec::new(),
        }
    }

    /// At each step more than half of a kind's seeds evaluated, the median seconds and value;
    /// a step only one seed of three reached, and a point that is not a number, left out.
    #[test]
    fn a_kinds_median_curve_is_taken_step_by_step_over_its_seeds() {
        let with_curve = |seed, curve: Vec<[f64; 3]>| Run {
            seed,
            curve,
            ..lone_run("gossip", 0.003)
        };
        let a = with_curve(
            1,
            vec![[10.0, 50.0, 4.0], [20.0, 100.0, 3.0], [30.0, 150.0, 2.9]],
        );
        let b = with_curve(2, vec![[12.0, 50.0, 4.2], [22.0, 100.0, 3.2]]);
        let c = with_curve(
            3,
            vec![
                [11.0, 50.0, 4.1],
                [21.0, 100.0, 3.4],
                [f64::NAN, 150.0, 2.0],
            ],
        );
        assert_eq!(median_curve(&[&a, &b, &c]), vec![(11.0, 4.1), (21.0, 3.2)]);
        // The picture: one legend entry per kind, at the learning rate its summary chose.
        let runs = vec![a, b, c, lone_run("alone", 0.003), lone_run("alone", 0.006)];
        let report = Report {
            measured: Measured::of(&scaling_args(&[]), "c.toml"),
            metric: Metric::BitsPerByte,
            straggler_delay_us: 0,
            links: "loopback".into(),
            ideal_speedup: BTreeMap::new(),
            summary: ["alone", "gossip"]
                .iter()
                .filter_map(|k| summarise(k, &runs, "2.8"))
                .collect(),
            runs,
        };
        let svg = render_report_svg(&report).expect("svg");
        assert!(svg.contains("c.toml, 2 nodes, loopback"), "{svg}");
        assert!(svg.contains("gossip lr 0.003 (median of 3 seeds)"), "{svg}");
        assert!(svg.contains("alone lr 0.003 (median of 1 seed)"), "{svg}");
        assert!(
            !svg.contains("lr 0.006") && !svg.contains("seed 1"),
            "{svg}"
        );
    }

    fn scaling_args(extra: &[&str]) -> ScalingArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ScalingArgs,
        }
        let mut argv = vec!["bench", "--out", "out", "--seeds", "1", "--targets", "2.8"];
        argv.extend_from_slice(extra);
        <Cli as clap::Parser>::parse_from(argv).args
    }

    #[test]
    fn lone_runs_are_reused_only_from_a_report_that_measured_the_same() {
        let dir = tempfile::tempdir().expect("tmp");
        let runs = [
            lone_run("alone", 0.003),
            lone_run("alone_x2", 0.003),
            lone_run("alone_diloco", 0.003),
            lone_run("diloco", 0.003),
        ];
        let report = serde_json::json!({
            "benchmark": "scaling", "config": "text-gpt-shakespeare.toml", "metric": "bits_per_byte",
            "targets": [2.8], "nodes": 2, "cores_per_node": 1, "seeds": 1, "eval_every": 50,
            "mesh_settings": ["sync.outer_lr=1.0"], "runs": runs,
        });
        std::fs::write(dir.path().join("report.json"), report.to_string()).expect("write");
        let wanted = LoneKinds {
            plain: vec!["alone".into(), "alone_x2".into()],
            with_settings: vec!["alone_diloco".into()],
        };
        let config = "text-gpt-shakespeare.toml";
        let kinds = |runs: Vec<Run>| runs.into_iter().map(|r| r.kind).collect::<Vec<_>>();

        let same = scaling_args(&["--set", "sync.outer_lr=1.0"]);
        let reused = reused_lone_runs(dir.path(), &same, config, &[0.003], &wanted);
        assert_eq!(
            kinds(reused.expect("the same measure")),
            ["alone", "alone_x2", "alone_diloco"],
            "the lone kinds, never a mesh's runs"
        );
        let other_settings = scaling_args(&["--set", "sync.outer_lr=0.7"]);
        let reused = reused_lone_runs(dir.path(), &other_settings, config, &[0.003], &wanted);
        assert_eq!(
            kinds(reused.expect("the plain lone runs")),
            ["alone", "alone_x2"],
            "another outer optimizer: alone_diloco runs again"
        );
        let other_targets = scaling_args(&["--targets", "3.0,2.8"]);
        let refused = reused_lone_runs(dir.path(), &other_targets, config, &[0.003], &wanted);
        assert!(format!("{:#}", refused.expect_err("refused")).contains("targets"));
        // A report from before `--first-seed` ran seeds from 1: fresh seeds reuse none of it.
        let fresh_seeds = scaling_args(&["--set", "sync.outer_lr=1.0", "--first-seed", "4"]);
        let refused = reused_lone_runs(dir.path(), &fresh_seeds, config, &[0.003], &wanted);
        assert!(format!("{:#}", refused.expect_err("refused")).contains("first seed"));
        let refused = reused_lone_runs(dir.path(), &same, "text-gpt.toml", &[0.003], &wanted);
        assert!(format!("{:#}", refused.expect_err("refused")).contains("config"));
        let refused = reused_lone_runs(dir.path(), &same, config, &[0.003, 0.0045], &wanted);
        assert!(format!("{:#}", refused.expect_err("refused")).contains("learning rates"));
        let refused = reused_lone_runs(&dir.path().join("none"), &same, config, &[0.003], &wanted);
        assert!(format!("{:#}", refused.expect_err("refused")).contains("cannot read"));
    }

    #[test]
    fn only_an_outer_optimizer_gets_a_lone_control_in_its_mode() {
        assert!(has_outer_optimizer("diloco"));
        for mode in ["gossip", "ddp", "allreduce", "fedavg", "nonsense"] {
            assert!(!has_outer_optimizer(mode), "{mode}");
        }
    }

    #[test]
    fn settings_read_as_toml_and_the_harness_keys_are_refused() {
        let (s, k, v) = parse_setting("sync.balance_batches=false").expect("a setting");
        assert_eq!((s.as_str(), k.as_str()), ("sync", "balance_batches"));
        assert_eq!(v, toml::Value::Boolean(false));
        let (_, _, v) = parse_setting("sync.resync_every = 50").expect("a setting");
        assert_eq!(v, toml::Value::Integer(50));
        let (_, _, v) = parse_setting("sync.codec=onebit").expect("a bare word");
        assert_eq!(v, toml::Value::String("onebit".into()));
        for bad in [
            "nokey=1",
            "sync.mode",
            "train.batch_size=64",
            "optimizer.lr=0.1",
        ] {
            assert!(parse_setting(bad).is_err(), "{bad}");
        }
    }
}
