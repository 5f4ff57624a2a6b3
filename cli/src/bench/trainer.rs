//! `p2ptrain bench trainer`: does the daemon cost training speed?
//!
//! Each run times a bare Candle loop (batch, step, nothing else) and then a real node (trainer
//! thread, control API, automatic checkpoints and evaluation as configured) for the same number
//! of steps of the same model and batch, alternating so that machine noise hits both. The
//! report holds every run and the medians, as JSON.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::config::Overrides;
use p2ptrain_daemon::node::{self, Options, Prepared};
use p2ptrain_daemon::Config;
use serde::Serialize;

use crate::measure::{bare_loop, median};

/// Arguments of `bench trainer`.
#[derive(Args)]
pub struct TrainerArgs {
    /// Configuration to benchmark; default: the built-in digits config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Steps per measurement.
    #[arg(long, default_value_t = 3000)]
    steps: u64,
    /// Runs (each: one bare loop, one daemon).
    #[arg(long, default_value_t = 9)]
    runs: usize,
    /// Write the JSON report here (it is printed either way).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    model: String,
    data: String,
    batch_size: usize,
    threads: usize,
    eval_every: u64,
    steps_per_run: u64,
    runs: usize,
    bare_steps_per_sec: Vec<f64>,
    /// Training steps per second in the node's trainer loop, evaluation time excluded.
    daemon_steps_per_sec: Vec<f64>,
    /// The same with evaluation time included.
    daemon_steps_per_sec_with_eval: Vec<f64>,
    bare_median: f64,
    daemon_median: f64,
    daemon_with_eval_median: f64,
    /// `daemon_median / bare_median`.
    ratio_of_medians: f64,
    /// `daemon_with_eval_median / bare_median`.
    ratio_of_medians_with_eval: f64,
    /// Median of the per-run ratios (each daemon run against the bare run just before it).
    median_of_paired_ratios: f64,
}

/// Runs a real node for `steps` steps; returns its steps/s without and with evaluation time.
fn daemon_run(p: &Prepared, steps: u64, rt: &tokio::runtime::Runtime) -> Result<(f64, f64)> {
    let s = daemon_stats(p, steps, rt)?;
    Ok((
        s.steps_this_run as f64 / (s.train_secs - s.eval_secs),
        s.steps_this_run as f64 / s.train_secs,
    ))
}

/// Runs a real node for `steps` steps; returns the trainer's figures of the run.
fn daemon_stats(
    p: &Prepared,
    steps: u64,
    rt: &tokio::runtime::Runtime,
) -> Result<p2ptrain_daemon::trainer::Stats> {
    let mut p = p.clone();
    p.config.apply(&Overrides {
        max_steps: Some(steps),
        api: Some("127.0.0.1:0".parse().context("address")?),
        listen: vec!["/ip4/127.0.0.1/tcp/0".into()],
        ..Overrides::default()
    })?;
    let dir = std::env::temp_dir().join(format!(
        "p2ptrain-bench-{}-{}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = Options {
        data_dir: dir.clone(),
        api_token: None,
        download_progress: Default::default(),
    };
    let summary = rt.block_on(node::run(p, opts, std::future::pending()));
    let _ = std::fs::remove_dir_all(&dir);
    let s = summary?.stats;
    if s.steps_this_run != steps {
        bail!("daemon ran {} steps, expected {steps}", s.steps_this_run);
    }
    Ok(s)
}

static NEXT_DIR: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Runs the benchmark and prints (and optionally writes) the report.
pub fn run(args: TrainerArgs) -> Result<std::process::ExitCode> {
    if args.runs == 0 || args.steps == 0 {
        bail!("--runs and --steps must be at least 1");
    }
    let config = Config::load(args.config.as_deref())?;
    crate::runtime::set_compute_threads(config.train.threads);
    let rt = crate::runtime::runtime()?;
    let p = node::prepare(config)?;
    let (mut bare, mut daemon, mut daemon_with_eval) = (Vec::new(), Vec::new(), Vec::new());
    // One unmeasured warm-up of each, so first-touch costs (page faults, pool start) hit neither.
    bare_loop(&p, args.steps.min(200))?;
    daemon_run(&p, args.steps.min(200), &rt)?;
    let mut progress = crate::progress::Counted::items("bench trainer", args.runs as u64);
    for run in 0..args.runs {
        progress.set_quietly(run as u64, "bare loop");
        let b = bare_loop(&p, args.steps)?;
        progress.set_quietly(run as u64, "daemon");
        let (d, de) = daemon_run(&p, args.steps, &rt)?;
        progress.println(format!(
            "run {}: bare {b:.1} steps/s, daemon {d:.1} steps/s ({:.1}%), {de:.1} with evaluation ({:.1}%)",
            run + 1,
            100.0 * d / b,
            100.0 * de / b
        ));
        bare.push(b);
        daemon.push(d);
        daemon_with_eval.push(de);
    }
    progress.finish(args.runs as u64);
    let paired: Vec<f64> = bare.iter().zip(&daemon).map(|(b, d)| d / b).collect();
    let report = Report {
        benchmark: "trainer-in-daemon-vs-bare-loop",
        model: p.spec.name(),
        data: p.config.data.describe(),
        batch_size: p.config.train.batch_size,
        threads: p.config.train.threads,
        eval_every: p.config.train.eval_every,
        steps_per_run: args.steps,
        runs: args.runs,
        bare_median: median(&bare),
        daemon_median: median(&daemon),
        daemon_with_eval_median: median(&daemon_with_eval),
        ratio_of_medians: median(&daemon) / median(&bare),
        ratio_of_medians_with_eval: median(&daemon_with_eval) / median(&bare),
        median_of_paired_ratios: median(&paired),
        bare_steps_per_sec: bare,
        daemon_steps_per_sec: daemon,
        daemon_steps_per_sec_with_eval: daemon_with_eval,
    };
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(out) = &args.out {
        std::fs::write(out, &json).map_err(|e| anyhow!("cannot write {}: {e}", out.display()))?;
    }
    println!("{json}");
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The evaluation time a run reports lies within its training time, the final
    /// evaluation included, so training without evaluation takes `train_secs - eval_secs`
    /// and never less than nothing. `train_secs` was read before the final evaluation, which
    /// `eval_secs` counted: a short run whose final evaluation took longer than its steps
    /// reported negative steps a second (a CI run of `bench trainer`: -67,266). This test
    /// failed on that order: a one-step run's final evaluation outlasts its step.
    #[test]
    fn a_runs_evaluation_time_lies_within_its_training_time() {
        let p = node::prepare(Config::load(None).expect("the built-in config")).expect("prepared");
        let rt = crate::runtime::runtime().expect("runtime");
        let s = daemon_stats(&p, 1, &rt).expect("one step");
        assert!(s.eval_secs > 0.0, "the run ends with an evaluation");
        assert!(
            s.eval_secs <= s.train_secs,
            "evaluation {} s of a run of {} s",
            s.eval_secs,
            s.train_secs
        );
    }
}
