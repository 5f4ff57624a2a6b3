//! `p2ptrain bench sim`: the mesh core at sizes no lab can start. Runs the core's seeded
//! simulator ([`p2ptrain_daemon::mesh_core::sim`]: the daemon's own decisions, the real codec,
//! virtual time) in its large-mesh scenario (churn, 1% hostile peers, two labs split for 10 s
//! and healed) for each N, with the same run never split as the control, and reports what a
//! planner needs: bytes each node sends per step, the replicas' consensus distance at the heal
//! and at the end against the control's, and the wall time the simulation took.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::mesh_core::sim::{Sim, SimParams, SimReport};
use serde_json::json;

/// Arguments of `bench sim`.
#[derive(Args)]
pub struct SimArgs {
    /// Mesh sizes, comma-separated.
    #[arg(long, default_value = "100,300,1000")]
    nodes: String,
    /// Seeds each size runs with, comma-separated.
    #[arg(long, default_value = "1")]
    seeds: String,
    /// Write the JSON report here (it is printed either way).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Runs `bench sim`.
pub fn run(args: SimArgs) -> Result<()> {
    let sizes = parse_list(&args.nodes, "--nodes")?;
    let seeds = parse_list(&args.seeds, "--seeds")?;
    if sizes.iter().any(|&n| n < 4) {
        bail!("--nodes: every size must be at least 4");
    }
    let mut runs = Vec::new();
    for &nodes in &sizes {
        for &seed in &seeds {
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
    let report = json!({
        "benchmark": "sim",
        "scenario": "SimParams::large_mesh: each node dials up to 8 others, 1% hostile, a node killed and a joiner started every second, two labs (optima 0.2 apart per value) split from 10 s to 20 s, 40 s of virtual time; gossip mode, updates every 20 steps, a neighbour sync every 50",
        "runs": runs,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
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
