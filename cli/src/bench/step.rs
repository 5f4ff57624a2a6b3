//! `p2ptrain bench step`: how fast is one training step against PyTorch eager on this CPU (or,
//! with `--device cuda`, this GPU)?
//!
//! For each model (a shipped config) and optimizer, runs alternate timings of the bare Candle
//! loop [`crate::measure::bare_loop`] (batch gather, forward, loss, backward, optimizer step) and
//! of `bench/step_torch.py` (the same architecture, batch, optimizer and thread count in
//! PyTorch eager), the same number of steps each, so that machine noise hits both. It also
//! times what the mesh adds to a step's CPU: compressing one update (error feedback included)
//! and decoding it, for the 1-bit codecs (a scale per row, and per tensor) and top-k, on a real
//! update of the model. The report holds every run, medians, spreads and ratios, as JSON.
//!
//! On a GPU the report also says which of the GPU levers were on (`P2PTRAIN_CUDA_LEVERS`, see
//! `p2ptrain_models::gpu`; TF32 on one side means TF32 on both) and, per case, how a step's
//! time splits between the host issuing its work and waiting for the GPU at the loss's read
//! back: a host-bound step barely waits.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use p2ptrain_daemon::node::{self, Prepared};
use p2ptrain_daemon::Config;
use p2ptrain_models::codec::{self, Codec, ErrorFeedback, UpdateHeader};
use p2ptrain_models::optim::{OptimizerSpec, Schedule};
use p2ptrain_models::Model;
use serde::Serialize;
use serde_json::Value;

use crate::measure::{bare_loop, median};

/// Arguments of `bench step`.
#[derive(Args)]
pub struct StepArgs {
    /// Models to time, comma-separated: shipped config names in `--configs`.
    #[arg(long, default_value = "digits-mlp,mnist-mlp,mnist-cnn,text-gpt")]
    models: String,
    /// Optimizers, comma-separated: `sgd` (momentum 0.9), `nesterov` (the same, Nesterov's
    /// form), `adamw`. The learning rate is the config's when its optimizer is of that kind.
    #[arg(long, default_value = "sgd,nesterov,adamw")]
    optimizers: String,
    /// Seconds each timed run should take (steps are fitted from a warm-up of the bare loop
    /// and are the same for both sides).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Timed runs of each side per case.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Folder of the configs named by `--models`.
    #[arg(long, default_value = "configs")]
    configs: PathBuf,
    /// Python with torch (`bench/setup_torch.sh` makes bench/.venv).
    #[arg(long, default_value = "bench/.venv/bin/python")]
    python: PathBuf,
    /// The PyTorch side's script.
    #[arg(long, default_value = "bench/step_torch.py")]
    torch_script: PathBuf,
    /// Time p2ptrain alone (the report then has no ratios).
    #[arg(long)]
    no_torch: bool,
    /// For a Llama, time transformers' own `LlamaForCausalLM` (eager attention) on the PyTorch
    /// side, rather than the script's written-out twin of p2ptrain's Llama.
    #[arg(long)]
    transformers_llama: bool,
    /// Repetitions of each codec's timing per model (a 100 M-parameter update takes seconds
    /// per codec on the CPU).
    #[arg(long, default_value_t = 21, value_parser = clap::value_parser!(u32).range(1..))]
    codec_reps: u32,
    /// The device of both sides (`cpu`, `cuda`, `cuda:N`); each config's own when not given.
    #[arg(long)]
    device: Option<String>,
    /// Write the JSON report here (it is printed either way).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    /// The device both sides ran on (the last case's, when configs differ).
    device: String,
    /// The GPU levers that were on (`none` on the CPU).
    gpu_levers: String,
    threads: usize,
    seconds_per_run: f64,
    runs: usize,
    torch: Option<String>,
    cases: Vec<Case>,
    codecs: Vec<CodecTiming>,
}

/// One model and optimizer, both sides.
#[derive(Serialize)]
struct Case {
    model: String,
    config: String,
    optimizer: String,
    batch_size: usize,
    params: usize,
    steps_per_run: u64,
    p2ptrain_steps_per_sec: Vec<f64>,
    torch_steps_per_sec: Vec<f64>,
    p2ptrain_median: f64,
    torch_median: Option<f64>,
    /// Samples (images, or text windows) per second: the median times the batch.
    p2ptrain_samples_per_sec: f64,
    torch_samples_per_sec: Option<f64>,
    /// `p2ptrain_median / torch_median`: 1.0 is PyTorch's speed.
    ratio: Option<f64>,
    /// Median of each p2ptrain run against the torch run just after it.
    median_of_paired_ratios: Option<f64>,
    /// On a GPU: the fraction of a step's wall time spent waiting for the GPU when the loss is
    /// read back (the rest is the host issuing the step's work), from one more run.
    gpu_wait_fraction: Option<f64>,
    /// What the PyTorch side ran: `llama-transformers` for transformers' own
    /// `LlamaForCausalLM`, else the model's kind as `bench/step_torch.py` writes it out.
    torch_model: Option<String>,
}

/// What one update costs the sender and the receiver.
#[derive(Serialize)]
struct CodecTiming {
    model: String,
    codec: String,
    density: f64,
    bytes: usize,
    /// Compression with error feedback (residual added, encoded, residual kept), median µs.
    encode_us: f64,
    decode_us: f64,
    encode_us_runs: Vec<f64>,
    decode_us_runs: Vec<f64>,
    /// `(encode + decode) / one training step` of the model's first case.
    fraction_of_step: f64,
}

/// The optimizer a case names, with the config's hyper-parameters where its kind matches.
fn optimizer_for(name: &str, config: &OptimizerSpec) -> Result<OptimizerSpec> {
    let sgd_lr = match config {
        OptimizerSpec::Sgd { lr, .. } => *lr,
        OptimizerSpec::Adamw { .. } => 0.01,
    };
    let sgd = |nesterov| OptimizerSpec::Sgd {
        lr: sgd_lr,
        momentum: 0.9,
        nesterov,
        weight_decay: match config {
            OptimizerSpec::Sgd { weight_decay, .. } => *weight_decay,
            OptimizerSpec::Adamw { .. } => 0.0,
        },
    };
    Ok(match name {
        "sgd" => sgd(false),
        "nesterov" => sgd(true),
        "adamw" => match config {
            OptimizerSpec::Adamw { .. } => config.clone(),
            OptimizerSpec::Sgd { .. } => OptimizerSpec::Adamw {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
            },
        },
        other => bail!("unknown optimizer {other:?} (sgd, nesterov, adamw)"),
    })
}

/// What one run of the PyTorch side answered.
struct TorchRun {
    steps_per_sec: f64,
    version: String,
    /// The model the script built (see [`Case::torch_model`]).
    model: String,
}

/// Untimed steps before the PyTorch side's timed run: as many as p2ptrain's own warm-up.
const TORCH_WARMUP_STEPS: u64 = 20;

/// Runs the PyTorch side once on the case's device (with TF32 products when `tf32`).
fn torch_run(args: &StepArgs, p: &Prepared, steps: u64, tf32: bool) -> Result<TorchRun> {
    let out = Command::new(&args.python)
        .arg(&args.torch_script)
        .arg("--spec")
        .arg(serde_json::to_string(&p.spec)?)
        .arg("--optim")
        .arg(serde_json::to_string(&p.config.optimizer)?)
        .args(["--batch", &p.config.train.batch_size.to_string()])
        .args(["--steps", &steps.to_string()])
        .args(["--threads", &p.config.train.threads.to_string()])
        .args(["--device", &p.config.train.device.to_string()])
        .args(["--warmup", &TORCH_WARMUP_STEPS.to_string()])
        .args(tf32.then_some("--tf32"))
        .args(args.transformers_llama.then_some("--transformers-llama"))
        .output()
        .with_context(|| format!("cannot run {}", args.python.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.torch_script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: Value = serde_json::from_slice(&out.stdout).context("the torch script's JSON")?;
    let rate = v["steps_per_sec"][0]
        .as_f64()
        .ok_or_else(|| anyhow!("no steps_per_sec in {v}"))?;
    Ok(TorchRun {
        steps_per_sec: rate,
        version: v["torch"].as_str().unwrap_or("?").to_string(),
        model: v["model"].as_str().unwrap_or("?").to_string(),
    })
}

/// Times compress (with error feedback) and decode of one real update: the parameters' change
/// over 20 steps of training.
fn codec_timings(p: &Prepared, step_secs: f64, reps: u32) -> Result<Vec<CodecTiming>> {
    let model = Model::new(&p.spec, p.config.train.init_seed, &p.device)?;
    let before = model.params().flatten()?;
    crate::measure::train_steps(p, &model, 20)?;
    let delta: Vec<f32> = model
        .params()
        .flatten()?
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    let layout = model.params().layout();
    let mut out = Vec::new();
    for (name, density) in [("onebit", 1.0), ("onebit-tensor", 1.0), ("topk", 0.01)] {
        let codec: Codec = name.parse().map_err(|e: String| anyhow!(e))?;
        let header = UpdateHeader {
            run_id: codec::id_bytes("0000000000000000"),
            layout: codec::id_bytes("0000000000000000"),
            sender: codec::sender_bytes(b"bench"),
            base_step: 0,
            step: 20,
            codec,
            numel: delta.len() as u32,
        };
        let mut feedback = ErrorFeedback::new(delta.len(), true);
        let (mut enc, mut dec, mut bytes) = (Vec::new(), Vec::new(), 0);
        for _ in 0..reps {
            let t = Instant::now();
            let e = feedback.compress(&header, &layout, &delta, density)?;
            enc.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            let decoded = codec::decode(&e.bytes, &layout)?;
            dec.push(t.elapsed().as_secs_f64() * 1e6);
            bytes = e.bytes.len();
            std::hint::black_box(decoded);
        }
        let (e, d) = (median(&enc), median(&dec));
        out.push(CodecTiming {
            model: p.spec.name(),
            codec: name.into(),
            density,
            bytes,
            encode_us: e,
            decode_us: d,
            encode_us_runs: enc,
            decode_us_runs: dec,
            fraction_of_step: (e + d) * 1e-6 / step_secs,
        });
    }
    Ok(out)
}

fn load(dir: &Path, name: &str, device: Option<&str>) -> Result<Prepared> {
    let path = dir.join(format!("{name}.toml"));
    let mut config = Config::load(Some(&path))?;
    if let Some(device) = device {
        config.train.device = device.parse()?;
    }
    // A schedule changes nothing a step costs, and PyTorch's side has none; nor does it clip
    // or freeze, so neither does ours here: like against like.
    config.schedule = Schedule::Constant;
    config.gradients = Default::default();
    Ok(node::prepare(config)?)
}

/// Runs the benchmark and prints (and optionally writes) the report.
pub fn run(args: StepArgs) -> Result<std::process::ExitCode> {
    if args.runs == 0 || args.seconds.is_nan() || args.seconds <= 0.0 {
        bail!("--runs must be at least 1 and --seconds above 0");
    }
    if !args.no_torch && !args.python.exists() {
        bail!(
            "{} not found: run bench/setup_torch.sh (or pass --python, or --no-torch to time p2ptrain alone)",
            args.python.display()
        );
    }
    let optimizers: Vec<&str> = args.optimizers.split(',').map(str::trim).collect();
    // A malformed lever list fails a GPU's opening with its own message; the CPU ignores it.
    let levers =
        p2ptrain_models::gpu::Levers::current().unwrap_or(p2ptrain_models::gpu::Levers::NONE);
    let mut device = String::from("cpu");
    let mut cases = Vec::new();
    let mut codecs = Vec::new();
    let mut torch_version = None;
    let mut threads = 1;
    let models: Vec<&str> = args.models.split(',').map(str::trim).collect();
    let total_runs = (models.len() * optimizers.len() * args.runs) as u64;
    let mut progress = crate::progress::Counted::items("bench step", total_runs);
    let mut runs_done = 0;
    for name in models {
        let base = load(&args.configs, name, args.device.as_deref())?;
        threads = base.config.train.threads;
        device = base.config.train.device.to_string();
        let on_gpu = !base.device.is_cpu();
        crate::runtime::set_compute_threads(threads);
        let mut first_step_secs = None;
        for opt in &optimizers {
            let mut p = base.clone();
            p.config.optimizer = optimizer_for(opt, &base.config.optimizer)?;
            // Fit the steps to --seconds from an untimed warm-up (which also pays first-touch
            // costs for both).
            let warm = bare_loop(&p, 20)?;
            let steps = ((warm * args.seconds) as u64).clamp(20, 1_000_000);
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            let mut torch_model = None;
            for run in 0..args.runs {
                progress.set_quietly(runs_done, &format!("{name} {opt}"));
                runs_done += 1;
                let b = bare_loop(&p, steps)?;
                ours.push(b);
                if !args.no_torch {
                    // The GPU memory p2ptrain's pool keeps would be the PyTorch side's.
                    p2ptrain_models::gpu::release_cached_memory(&p.device)?;
                    let t = torch_run(&args, &p, steps, on_gpu && levers.tf32)?;
                    theirs.push(t.steps_per_sec);
                    torch_version = Some(t.version);
                    torch_model = Some(t.model);
                }
                progress.println(format!(
                    "{name} {opt} run {}: p2ptrain {b:.1} steps/s{}",
                    run + 1,
                    theirs
                        .last()
                        .map(|t| format!(", torch {t:.1} steps/s ({:.2}x)", b / t))
                        .unwrap_or_default()
                ));
            }
            let batch = p.config.train.batch_size;
            let ours_median = median(&ours);
            first_step_secs.get_or_insert(1.0 / ours_median);
            let torch_median = (!theirs.is_empty()).then(|| median(&theirs));
            let paired: Vec<f64> = ours.iter().zip(&theirs).map(|(a, b)| a / b).collect();
            let gpu_wait_fraction = if on_gpu {
                Some(crate::measure::gpu_wait_fraction(&p, steps)?)
            } else {
                None
            };
            cases.push(Case {
                model: p.spec.name(),
                config: name.to_string(),
                optimizer: opt.to_string(),
                batch_size: batch,
                params: Model::new(&p.spec, 0, &p.device)?.params().numel(),
                steps_per_run: steps,
                p2ptrain_median: ours_median,
                torch_median,
                p2ptrain_samples_per_sec: ours_median * batch as f64,
                torch_samples_per_sec: torch_median.map(|t| t * batch as f64),
                ratio: torch_median.map(|t| ours_median / t),
                median_of_paired_ratios: (!paired.is_empty()).then(|| median(&paired)),
                gpu_wait_fraction,
                torch_model,
                p2ptrain_steps_per_sec: ours,
                torch_steps_per_sec: theirs,
            });
        }
        if let Some(step_secs) = first_step_secs {
            codecs.extend(codec_timings(&base, step_secs, args.codec_reps)?);
        }
    }
    let report = Report {
        benchmark: "train-step-vs-pytorch-eager",
        gpu_levers: if device == "cpu" {
            "none".into()
        } else {
            levers.names()
        },
        device,
        threads,
        seconds_per_run: args.seconds,
        runs: args.runs,
        torch: torch_version,
        cases,
        codecs,
    };
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(out) = &args.out {
        std::fs::write(out, &json).map_err(|e| anyhow!("cannot write {}: {e}", out.display()))?;
    }
    println!("{json}");
    Ok(std::process::ExitCode::SUCCESS)
}
