//! `p2ptrain bench mesh`: what each update codec costs in bytes and buys in accuracy.
//!
//! For each codec asked for, a whole mesh runs on this machine (`p2ptrain local` with a
//! trace), then the report gathers what the nodes measured themselves: update sizes from
//! gossipsub's own counters (its envelope included), bytes sent, samples per second, held-out
//! accuracy over time and at the end, and the distance between the nodes' final parameters.
//! It writes `report.json` and a picture, `report.svg`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::builder::TypedValueParser as _;
use clap::Args;
use p2ptrain_daemon::config::{apply_settings, Setting};
use p2ptrain_daemon::Config;
use p2ptrain_models::codec::Codec;
use serde::Serialize;

use crate::local::{self, LocalArgs, LocalSummary};
use crate::plot::{self, NodeCurve, RunSeries};

/// Bytes PyTorch DDP all-reduces per step for the MNIST MLP 784-256-10 (203,530 `f32`
/// gradients), and the samples each process trains on per step in the comparison.
const DDP_BYTES_PER_STEP: f64 = 814_120.0;
const DDP_SAMPLES_PER_STEP: f64 = 32.0;

/// Arguments of `bench mesh`.
#[derive(Args)]
pub struct MeshArgs {
    /// Nodes in the mesh.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Base configuration; default: the built-in digits config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Codecs to compare, comma-separated; each gets a run of its own.
    #[arg(long, value_delimiter = ',', default_value = "dense",
          value_parser = clap::builder::PossibleValuesParser::new(Codec::ALL.map(Codec::name))
              .map(|name| name.parse::<Codec>().expect("a listed codec name parses")))]
    codec: Vec<Codec>,
    /// Fraction of values top-k keeps.
    #[arg(long)]
    density: Option<f64>,
    /// Turn error feedback off (to show what it is for).
    #[arg(long)]
    no_error_feedback: bool,
    /// Seconds each mesh runs.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Steps between published updates (default: the config's).
    #[arg(long)]
    publish_every: Option<u64>,
    /// Steps between full neighbour syncs (default: the config's).
    #[arg(long)]
    full_sync_every: Option<u64>,
    /// Sleep this long after every step on every node (to keep nodes' pace independent of
    /// how many share this machine's cores).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// Make the last node a straggler that sleeps this long after every step.
    #[arg(long)]
    straggler_delay_ms: Option<u64>,
    /// Also train one node alone on as many samples as the first run's whole mesh did.
    #[arg(long)]
    single_baseline: bool,
    /// Where `report.json`, `report.svg` and the run configs go.
    #[arg(long)]
    out: PathBuf,
}

/// One run of the report.
#[derive(Debug, Serialize)]
struct RunReport {
    /// Codec name (or "single-node" for the baseline).
    codec: String,
    error_feedback: bool,
    density: Option<f64>,
    nodes: usize,
    params: usize,
    /// Mean gossip message per own update, gossipsub's envelope included (its own counters).
    bytes_per_update: Option<f64>,
    /// The same for a dense `f32` update of this model: its size plus the measured envelope.
    dense_bytes_per_update: Option<f64>,
    compression_ratio: Option<f64>,
    final_accuracy: AccuracyReport,
    /// Per node, over the run (after its first status).
    samples_per_sec: Vec<f64>,
    consensus_distance: ConsensusReport,
    bytes_sent_per_node_per_sec: Vec<f64>,
    /// Bytes sent per sample trained, per node (everything: updates, syncs, control).
    bytes_per_sample: Vec<f64>,
    /// PyTorch DDP's all-reduce bytes per sample over ours (mean over nodes).
    ddp_bytes_per_sample_ratio: Option<f64>,
    updates_sent: Vec<u64>,
    updates_applied: Vec<u64>,
    updates_dropped_stale: Vec<u64>,
    steps: Vec<u64>,
    total_samples: u64,
    wall_secs: f64,
    /// Accuracy over time, per node: `[seconds, accuracy]`.
    accuracy_over_time: Vec<Vec<[f64; 2]>>,
}

#[derive(Debug, Serialize)]
struct AccuracyReport {
    per_node: Vec<Option<f64>>,
    mean: f64,
}

#[derive(Debug, Serialize)]
struct ConsensusReport {
    /// Largest relative L2 distance between two nodes' final parameters.
    final_max: f64,
    final_mean: f64,
    /// `[seconds, largest last-sync distance any node reports]`.
    over_time: Vec<[f64; 2]>,
}

#[derive(Debug, Serialize)]
struct Report {
    benchmark: &'static str,
    config: String,
    model: String,
    duration_secs: f64,
    step_delay_ms: u64,
    straggler_delay_ms: Option<u64>,
    ddp_bytes_per_sample: f64,
    runs: Vec<RunReport>,
}

/// Writes a run's config: the base config with the sync and debug settings of this run.
fn write_config(
    base: &str,
    out: &Path,
    name: &str,
    sync: &[(&str, toml::Value)],
    step_delay_ms: u64,
) -> Result<PathBuf> {
    let mut settings: Vec<(&str, &str, toml::Value)> =
        sync.iter().map(|(k, v)| ("sync", *k, v.clone())).collect();
    if step_delay_ms > 0 {
        settings.push((
            "debug",
            "step_delay_ms",
            toml::Value::Integer(step_delay_ms as i64),
        ));
    }
    write_run_config(base, out, name, &settings)
}

/// Writes `out/configs/NAME.toml`: the base config with each `(section, key, value)` set.
pub(crate) fn write_run_config(
    base: &str,
    out: &Path,
    name: &str,
    settings: &[(&str, &str, toml::Value)],
) -> Result<PathBuf> {
    let settings: Vec<Setting> = settings
        .iter()
        .map(|(section, key, value)| Setting {
            section: section.to_string(),
            key: key.to_string(),
            value: value.clone(),
        })
        .collect();
    let text = apply_settings(base, &settings).map_err(|e| anyhow::anyhow!("base config: {e}"))?;
    let path = out.join("configs").join(format!("{name}.toml"));
    std::fs::create_dir_all(out.join("configs"))?;
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// Reads the base config's text, making relative paths in it absolute (the run configs live
/// elsewhere): the data's, the tokenizer's and a llama's Hugging Face folder.
pub(crate) fn base_text(config: Option<&Path>) -> Result<(String, String)> {
    match config {
        None => Ok((
            p2ptrain_daemon::config::DEFAULT_CONFIG_TOML.to_string(),
            "built-in digits-mlp".into(),
        )),
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            let mut table: toml::Table =
                toml::from_str(&text).with_context(|| format!("{} is not TOML", p.display()))?;
            let dir = std::path::absolute(p)?
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default();
            for (section, keys) in [
                ("data", &["dir", "path", "tokenizer"][..]),
                ("model", &["hf"][..]),
            ] {
                let Some(toml::Value::Table(t)) = table.get_mut(section) else {
                    continue;
                };
                for key in keys {
                    if let Some(toml::Value::String(v)) = t.get_mut(*key) {
                        if Path::new(v.as_str()).is_relative() {
                            *v = dir.join(v.as_str()).display().to_string();
                        }
                    }
                }
            }
            Ok((toml::to_string(&table)?, p.display().to_string()))
        }
    }
}

fn median(v: Vec<f64>) -> Option<f64> {
    (!v.is_empty()).then(|| crate::measure::median(&v))
}

fn summarise(
    label: &str,
    error_feedback: bool,
    density: Option<f64>,
    params: usize,
    s: &LocalSummary,
) -> RunReport {
    let nodes = s.per_node.len();
    let mut per_node_rate = Vec::new();
    let mut per_node_bytes = Vec::new();
    let mut curves = Vec::new();
    for i in 0..nodes {
        let points: Vec<_> = s.trace.iter().filter(|p| p.node == i).collect();
        let (rate, bytes) = match (points.first(), points.last()) {
            (Some(a), Some(b)) if b.t > a.t => (
                (b.samples_seen.saturating_sub(a.samples_seen)) as f64 / (b.t - a.t),
                (b.bytes_sent.saturating_sub(a.bytes_sent)) as f64 / (b.t - a.t),
            ),
            _ => (0.0, 0.0),
        };
        per_node_rate.push(rate);
        per_node_bytes.push(bytes);
        curves.push(
            points
                .iter()
                .filter_map(|p| p.accuracy.map(|a| [p.t, a]))
                .collect::<Vec<_>>(),
        );
    }
    let mut over_time: BTreeMap<u64, f64> = BTreeMap::new();
    for p in &s.trace {
        if let Some(d) = p.consensus_distance {
            let e = over_time.entry((p.t * 2.0) as u64).or_insert(0.0);
            *e = e.max(d);
        }
    }
    let bytes_per_update = median(
        s.final_status
            .iter()
            .filter_map(|st| st.sync.bytes_per_update)
            .collect(),
    );
    let payload = median(
        s.final_status
            .iter()
            .filter_map(|st| st.sync.payload_bytes_per_update)
            .collect(),
    );
    let dense = s.final_status.first().map(|st| st.sync.dense_update_bytes);
    let dense_bytes_per_update = match (bytes_per_update, payload, dense) {
        // The dense message: its update bytes, our one framing byte, and the envelope
        // gossipsub added to this run's messages.
        (Some(b), Some(p), Some(d)) => Some(d as f64 + 1.0 + (b - p)),
        _ => None,
    };
    let bytes_per_sample: Vec<f64> = per_node_bytes
        .iter()
        .zip(&per_node_rate)
        .map(|(b, r)| if *r > 0.0 { b / r } else { 0.0 })
        .collect();
    let mean_bps = bytes_per_sample.iter().sum::<f64>() / bytes_per_sample.len().max(1) as f64;
    let ddp = DDP_BYTES_PER_STEP / DDP_SAMPLES_PER_STEP;
    RunReport {
        codec: label.to_string(),
        error_feedback,
        density,
        nodes,
        params,
        bytes_per_update,
        dense_bytes_per_update,
        compression_ratio: match (dense_bytes_per_update, bytes_per_update) {
            (Some(d), Some(b)) if b > 0.0 => Some(d / b),
            _ => None,
        },
        final_accuracy: AccuracyReport {
            per_node: s.per_node.iter().map(|n| n.accuracy).collect(),
            mean: s.mean_accuracy,
        },
        samples_per_sec: per_node_rate,
        consensus_distance: ConsensusReport {
            final_max: s.consensus_distance_max,
            final_mean: s.consensus_distance_mean,
            over_time: over_time
                .into_iter()
                .map(|(k, v)| [k as f64 / 2.0, v])
                .collect(),
        },
        bytes_sent_per_node_per_sec: per_node_bytes,
        ddp_bytes_per_sample_ratio: (mean_bps > 0.0).then(|| ddp / mean_bps),
        bytes_per_sample,
        updates_sent: s.per_node.iter().map(|n| n.updates.sent).collect(),
        updates_applied: s.per_node.iter().map(|n| n.updates.applied).collect(),
        updates_dropped_stale: s
            .final_status
            .iter()
            .map(|st| st.sync.dropped_stale)
            .collect(),
        steps: s.per_node.iter().map(|n| n.step).collect(),
        total_samples: s
            .final_status
            .iter()
            .map(|st| st.training.samples_seen)
            .sum(),
        wall_secs: s.wall_secs,
        accuracy_over_time: curves,
    }
}

/// Runs the benchmark.
pub fn run(args: MeshArgs) -> Result<()> {
    if args.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let codecs = args.codec;
    if let Some(d) = args.density {
        if !(d > 0.0 && d <= 1.0) {
            bail!("--density {d} must be in (0, 1]");
        }
    }
    let base_config = Config::load(args.config.as_deref())?;
    let prepared = p2ptrain_daemon::node::prepare(base_config.clone())?;
    let params = p2ptrain_models::Model::new(&prepared.spec, 0, &prepared.device)?
        .params()
        .numel();
    let model_name = prepared.spec.name();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let (base, config_name) = base_text(args.config.as_deref())?;
    let ef = !args.no_error_feedback;
    let mut runs = Vec::new();
    let mut progress = crate::progress::Counted::items("bench mesh", codecs.len() as u64);
    for (done, codec) in codecs.iter().enumerate() {
        progress.set_quietly(done as u64, codec.name());
        let mut sync = vec![
            ("codec", toml::Value::String(codec.name().into())),
            ("error_feedback", toml::Value::Boolean(ef)),
        ];
        if let Some(d) = args.density {
            sync.push(("density", toml::Value::Float(d)));
        }
        if let Some(h) = args.publish_every {
            sync.push(("publish_every", toml::Value::Integer(h as i64)));
        }
        if let Some(f) = args.full_sync_every {
            sync.push(("full_sync_every", toml::Value::Integer(f as i64)));
        }
        let name = format!("{}{}", codec.name(), if ef { "" } else { "-no-ef" });
        let path = write_config(&base, &args.out, &name, &sync, args.step_delay_ms)?;
        let mut node_configs = BTreeMap::new();
        if let Some(delay) = args.straggler_delay_ms {
            let p = write_config(&base, &args.out, &format!("{name}-straggler"), &sync, delay)?;
            node_configs.insert(args.nodes - 1, p);
        }
        progress.println(format!(
            "bench mesh: {} nodes, codec {name}, {:.0} s",
            args.nodes, args.duration
        ));
        let summary = local::run(LocalArgs {
            nodes: args.nodes,
            config: Some(path),
            duration: Some(args.duration),
            steps: None,
            data_dir: None,
            json: true,
            node_configs,
            trace: true,
            no_alone: true,
            target: None,
            sync_mode: None,
            cores_per_node: None,
        })?;
        let density = matches!(codec, Codec::TopK(_))
            .then(|| args.density.unwrap_or(base_config.sync.density));
        let r = summarise(&name, ef, density, params, &summary);
        progress.println(format!(
            "  {name}: mean accuracy {:.2}%, {:.0} bytes/update ({:.1}x), {:.1} bytes/sample",
            r.final_accuracy.mean * 100.0,
            r.bytes_per_update.unwrap_or(0.0),
            r.compression_ratio.unwrap_or(0.0),
            r.bytes_per_sample.iter().sum::<f64>() / r.bytes_per_sample.len().max(1) as f64
        ));
        runs.push(r);
    }
    progress.finish(codecs.len() as u64);
    if args.single_baseline {
        if let Some(first) = runs.first() {
            let batch = base_config.train.batch_size as u64;
            let steps = (first.total_samples / batch.max(1)).max(1);
            let path = write_config(&base, &args.out, "single-node", &[], 0)?;
            eprintln!("bench mesh: one node, {steps} steps (the first run's samples)");
            let summary = local::run(LocalArgs {
                nodes: 1,
                config: Some(path),
                duration: None,
                steps: Some(steps),
                data_dir: None,
                json: true,
                node_configs: BTreeMap::new(),
                trace: true,
                no_alone: true,
                target: None,
                sync_mode: None,
                cores_per_node: None,
            })?;
            let r = summarise("single-node", false, None, params, &summary);
            eprintln!(
                "  single node: accuracy {:.2}%",
                r.final_accuracy.mean * 100.0
            );
            runs.push(r);
        }
    }
    let report = Report {
        benchmark: "mesh",
        config: config_name.clone(),
        model: model_name,
        duration_secs: args.duration,
        step_delay_ms: args.step_delay_ms,
        straggler_delay_ms: args.straggler_delay_ms,
        ddp_bytes_per_sample: DDP_BYTES_PER_STEP / DDP_SAMPLES_PER_STEP,
        runs,
    };
    let json = serde_json::to_string_pretty(&report)?;
    let series: Vec<RunSeries> = report
        .runs
        .iter()
        .map(|r| RunSeries {
            codec: r.codec.clone(),
            nodes: r
                .accuracy_over_time
                .iter()
                .enumerate()
                .map(|(i, pts)| NodeCurve {
                    label: format!("node {i}"),
                    points: pts.iter().map(|p| (p[0], p[1])).collect(),
                })
                .collect(),
            bytes_per_update: r.bytes_per_update.unwrap_or(0.0),
            dense_bytes_per_update: r.dense_bytes_per_update.unwrap_or(0.0),
        })
        .collect();
    let svg = plot::render_svg(&format!("p2ptrain bench mesh: {config_name}"), &series)?;
    write_report(&args.out, &json, &svg)
}

/// Writes `DIR/report.json` and `DIR/report.svg`, prints the JSON and says where both went.
pub(crate) fn write_report(out: &Path, json: &str, svg: &str) -> Result<()> {
    std::fs::write(out.join("report.json"), json)?;
    std::fs::write(out.join("report.svg"), svg)?;
    println!("{json}");
    eprintln!(
        "wrote {} and {}",
        out.join("report.json").display(),
        out.join("report.svg").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A base config's relative paths (data, tokenizer, a llama's Hugging Face folder) are made
    /// absolute against its folder, since the run configs are written elsewhere; absolute ones
    /// stay as they are.
    #[test]
    fn a_base_configs_relative_paths_become_absolute() {
        let tmp = tempfile::tempdir().expect("tmp");
        let cfg = tmp.path().join("base.toml");
        std::fs::write(
            &cfg,
            "[model]\nkind = \"llama\"\nhf = \"models/tiny\"\n\
             [data]\nsource = \"text\"\npath = \"/corpus.txt\"\ntokenizer = \"../t.json\"\n",
        )
        .expect("write");
        let (text, _) = base_text(Some(&cfg)).expect("base");
        let table: toml::Table = toml::from_str(&text).expect("toml");
        let dir = std::path::absolute(tmp.path()).expect("abs");
        let get = |section: &str, key: &str| table[section][key].as_str().expect(key).to_string();
        assert_eq!(
            get("model", "hf"),
            dir.join("models/tiny").display().to_string()
        );
        assert_eq!(
            get("data", "tokenizer"),
            dir.join("../t.json").display().to_string()
        );
        assert_eq!(get("data", "path"), "/corpus.txt");
    }
}
