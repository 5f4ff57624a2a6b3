//! `p2ptrain bench sim`: the mesh core at sizes no lab can start. Runs the core's seeded
//! simulator ([`p2ptrain_daemon::mesh_core::sim`]: the daemon's own decisions, the real codec,
//! virtual time) in its large-mesh scenario (churn, 1% hostile peers, two labs split for 10 s
//! and healed) for each N, with the same run never split as the control, and reports what a
//! planner needs: bytes each node sends per step, the replicas' consensus distance at the heal
//! and at the end against the control's, and the wall time the simulation took. With
//! `--sync-mode allreduce` or `ddp` it runs the rounds' scenario instead
//! ([`SimParams::rounds`]: every node connected, silent kills and joiners every
//! `--churn-every-ms`), and reports the rounds' pace, traffic and whether every round left its
//! members identical.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::config::{SyncConfig, SyncMode};
use p2ptrain_daemon::mesh_core::sim::{Sim, SimParams, SimReport};
use serde_json::{json, Value};

/// Arguments of `bench sim`.
#[derive(Args)]
pub struct SimArgs {
    /// Mesh sizes, comma-separated [default: 100,300,1000 in gossip, 4,12,32 in the
    /// synchronous modes, whose rings every node is in].
    #[arg(long)]
    nodes: Option<String>,
    /// Seeds each size runs with, comma-separated.
    #[arg(long, default_value = "1")]
    seeds: String,
    /// The nodes' sync mode: `gossip` (the large-mesh scenario), or `allreduce` or `ddp`
    /// with the config's defaults for their rounds (the rounds' scenario).
    #[arg(long, default_value = "gossip", value_parser = ["gossip", "allreduce", "ddp"])]
    sync_mode: String,
    /// Rounds' scenario only: the churn intervals to compare, in virtual ms between a silent
    /// kill (and a joiner) and the next, comma-separated; 0 runs without churn.
    #[arg(long)]
    churn_every_ms: Option<String>,
    /// Write the JSON report here (it is printed either way).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Runs `bench sim`.
pub fn run(args: SimArgs) -> Result<()> {
    let mode: SyncMode = args.sync_mode.parse().map_err(anyhow::Error::msg)?;
    let default_sizes = if mode == SyncMode::Gossip {
        "100,300,1000"
    } else {
        "4,12,32"
    };
    let sizes = parse_list(args.nodes.as_deref().unwrap_or(default_sizes), "--nodes")?;
    let seeds = parse_list(&args.seeds, "--seeds")?;
    if sizes.iter().any(|&n| n < 4) {
        bail!("--nodes: every size must be at least 4");
    }
    let report = match mode {
        SyncMode::Gossip => {
            if args.churn_every_ms.is_some() {
                bail!("--churn-every-ms is for the rounds' scenario (--sync-mode allreduce or ddp); the gossip scenario kills a node every second");
            }
            gossip_report(&sizes, &seeds)
        }
        SyncMode::Allreduce | SyncMode::Ddp => {
            let churns = parse_list(
                args.churn_every_ms.as_deref().unwrap_or("0,10000,5000"),
                "--churn-every-ms",
            )?;
            rounds_report(mode, &sizes, &seeds, &churns)?
        }
        SyncMode::Diloco | SyncMode::Fedavg => bail!(
            "--sync-mode {}: the simulator runs gossip, allreduce and ddp (its trainers have no outer optimizer or epochs)",
            mode.name()
        ),
    };
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// The large-mesh scenario for each size and seed, split and never split.
fn gossip_report(sizes: &[u64], seeds: &[u64]) -> Value {
    let mut runs = Vec::new();
    for &nodes in sizes {
        for &seed in seeds {
            let (split, split_secs) = timed(SimParams::large_mesh(nodes as usize, seed, true));
            let (whole, whole_secs) = timed(SimParams::large_mesh(nodes as usize, seed, false));
            let row = json!({
                "nodes": nodes,
                "seed": seed,
                "bytes_per_node_per_step": per_step(&split),
                "consensus_at_heal": split.consensus_at_heal,
                "consensus_end": split.consensus,
                "consensus_never_split": whole.consensus,
                "bytes_per_node_per_step_never_split": per_step(&whole),
                "honest_blamed": split.honest_blamed + whole.honest_blamed,
                "hostile_blamed": split.hostile_blamed,
                "syncs": split.syncs,
                "updates_applied": split.applied,
                "nodes_started": split.nodes_started,
                "wall_secs": split_secs,
                "wall_secs_never_split": whole_secs,
            });
            eprintln!(
                "{nodes} nodes, seed {seed}: {:.0} B per node per step, consensus {:.4} at the heal, {:.4} at the end ({:.4} never split), {split_secs:.1} s",
                per_step(&split),
                split.consensus_at_heal.unwrap_or(f64::NAN),
                split.consensus,
                whole.consensus
            );
            runs.push(row);
        }
    }
    json!({
        "benchmark": "sim",
        "sync_mode": "gossip",
        "scenario": "SimParams::large_mesh: each node dials up to 8 others, 1% hostile, a node killed and a joiner started every second, two labs (optima 0.2 apart per value) split from 10 s to 20 s, 40 s of virtual time; gossip mode, updates every 20 steps, a neighbour sync every 50",
        "runs": runs,
    })
}

/// The rounds' scenario for each size, seed and churn interval, with the config's default
/// rounds for `mode`.
fn rounds_report(mode: SyncMode, sizes: &[u64], seeds: &[u64], churns: &[u64]) -> Result<Value> {
    let sync = SyncConfig {
        mode,
        ..SyncConfig::default()
    };
    let Some(rounds) = sync.rounds(1, 32) else {
        bail!("--sync-mode {}: no rounds", mode.name());
    };
    let mut runs = Vec::new();
    for &nodes in sizes {
        for &seed in seeds {
            for &churn in churns {
                let p = SimParams {
                    churn_every_ms: churn,
                    ..SimParams::rounds(nodes as usize, seed, rounds)
                };
                let secs = p.secs;
                let (r, wall) = timed(p);
                let Some(rr) = &r.rounds else {
                    bail!("the simulation ran no rounds");
                };
                eprintln!(
                    "{nodes} nodes, seed {seed}, churn every {churn} ms: {} rounds ({:.1} per minute), {} split, {} unsynced, {wall:.1} s",
                    rr.highest,
                    rr.highest as f64 * 60.0 / secs as f64,
                    rr.split,
                    rr.unsynced
                );
                runs.push(json!({
                    "nodes": nodes,
                    "seed": seed,
                    "churn_every_ms": churn,
                    "rounds": rr.highest,
                    "rounds_per_minute": rr.highest as f64 * 60.0 / secs as f64,
                    "rounds_split": rr.split,
                    "unsynced": rr.unsynced,
                    "aborted": rr.aborted,
                    "ring_bytes_per_node_per_round": rr.ring_bytes as f64 / rr.completed.max(1) as f64,
                    "consensus_end": r.consensus,
                    "honest_blamed": r.honest_blamed,
                    "nodes_started": r.nodes_started,
                    "wall_secs": wall,
                }));
            }
        }
    }
    Ok(json!({
        "benchmark": "sim",
        "sync_mode": mode.name(),
        "rounds": {
            "steps": rounds.steps,
            "gradients": rounds.gradients,
            "min_members": rounds.min_members,
        },
        "scenario": "SimParams::rounds: the first node founds the mesh and the others join it at the start; every node connected to every other; one box in eight four times slower and behind 80-160 ms links (the others 5-10 ms); a node killed without a word (noticed after 4 s, or when a hop to it fails) and a joiner started from a survivor's state every churn_every_ms until 25 s, then 15 s of quiet; 40 s of virtual time",
        "runs": runs,
    }))
}

fn timed(p: SimParams) -> (SimReport, f64) {
    let started = Instant::now();
    let r = Sim::new(p).run();
    (r, started.elapsed().as_secs_f64())
}

/// Bytes each honest node sent per step it took.
fn per_step(r: &SimReport) -> f64 {
    r.bytes_sent as f64 / r.steps.max(1) as f64
}

fn parse_list(text: &str, flag: &str) -> Result<Vec<u64>> {
    text.split(',')
        .map(|s| {
            s.trim()
                .parse::<u64>()
                .with_context(|| format!("{flag}: {s:?} is not a whole number"))
        })
        .collect()
}
