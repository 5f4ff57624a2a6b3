//! The node's configuration: a TOML file read strictly (unknown keys are errors) and turned
//! into validated values, with errors that name the file and the key.
//!
//! Two layers, as in ripgrep: `Raw*` structs mirror the file; [`Config`] holds checked values
//! the rest of the daemon can trust. Relative paths in a file are relative to that file, so a
//! config works from any working directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use p2ptrain_models::codec::Codec;
use p2ptrain_models::data::{self, Split};
use p2ptrain_models::{ModelSpec, OptimizerSpec};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The default configuration (`configs/digits-mlp.toml`), compiled in so that `p2ptrain join`
/// works with no file at all.
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../configs/digits-mlp.toml");

/// Name shown for the compiled-in default configuration.
pub const DEFAULT_CONFIG_NAME: &str = "<built-in configs/digits-mlp.toml>";

/// A configuration problem, in one line: the file, then the key or line, then the cause.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {msg}")]
pub struct ConfigError {
    /// The config file (or the built-in default's name).
    pub file: String,
    /// What is wrong, naming the key.
    pub msg: String,
}

/// Where a data set comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The handwritten-digits CSV (bundled, or from `data.path`).
    Digits,
    /// MNIST IDX files in `data.dir`.
    Mnist,
    /// A seeded synthetic set.
    Synthetic,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    model: RawModel,
    optimizer: RawOptimizer,
    data: RawData,
    #[serde(default)]
    train: RawTrain,
    #[serde(default)]
    checkpoint: RawCheckpoint,
    #[serde(default)]
    api: RawApi,
    #[serde(default)]
    network: RawNetwork,
    #[serde(default)]
    sync: RawSync,
    #[serde(default)]
    debug: RawDebug,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    listen: Option<Vec<String>>,
    bootstrap: Option<Vec<String>>,
    mdns: Option<bool>,
    psk: Option<PathBuf>,
    allow: Option<Vec<String>>,
    relay_server: Option<bool>,
    upnp: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSync {
    degree: Option<usize>,
    publish_every: Option<u64>,
    full_sync_every: Option<u64>,
    inline_max_bytes: Option<usize>,
    max_update_ratio: Option<f64>,
    update_weight: Option<f64>,
    codec: Option<String>,
    density: Option<f64>,
    error_feedback: Option<bool>,
    staleness_bound: Option<u64>,
    stale_after: Option<u64>,
    publish_early_ratio: Option<f64>,
    outlier_factor: Option<f64>,
    max_updates_per_sec: Option<f64>,
    clip_value: Option<f32>,
    max_sync_distance: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDebug {
    serve_chunk_delay_ms: Option<u64>,
    step_delay_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    kind: String,
    widths: Option<Vec<usize>>,
    channels: Option<Vec<usize>>,
    hidden: Option<Vec<usize>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOptimizer {
    kind: String,
    lr: f64,
    momentum: Option<f64>,
    nesterov: Option<bool>,
    weight_decay: Option<f64>,
    beta1: Option<f64>,
    beta2: Option<f64>,
    eps: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawData {
    source: DataSource,
    path: Option<PathBuf>,
    dir: Option<PathBuf>,
    test_fraction: Option<f64>,
    split_seed: Option<u64>,
    samples: Option<usize>,
    dim: Option<usize>,
    classes: Option<usize>,
    seed: Option<u64>,
    standardize: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrain {
    batch_size: Option<usize>,
    init_seed: Option<u64>,
    node_seed: Option<u64>,
    shard: Option<String>,
    eval_every: Option<u64>,
    max_steps: Option<u64>,
    threads: Option<usize>,
    device: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoint {
    every_steps: Option<u64>,
    every_secs: Option<u64>,
    keep: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApi {
    listen: Option<SocketAddr>,
}

/// The model section, before the data set fills in input size and classes for a CNN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ModelConfig {
    /// An MLP with explicit widths (input first, classes last).
    Mlp {
        /// Layer widths.
        widths: Vec<usize>,
    },
    /// A LeNet-style CNN; image size and classes come from the data set.
    Cnn {
        /// Channels of the two convolutions.
        channels: [usize; 2],
        /// Hidden widths of the fully connected part.
        hidden: Vec<usize>,
    },
}

/// The data section, checked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataConfig {
    /// Which kind of set.
    pub source: DataSource,
    /// Digits CSV file (absent: the bundled copy), resolved against the config file.
    pub path: Option<PathBuf>,
    /// MNIST directory, resolved against the config file.
    pub dir: Option<PathBuf>,
    /// Held-out fraction for sets without a fixed split (digits, synthetic).
    pub test_fraction: f64,
    /// Seed of the train/test split; identical on every node of a run.
    pub split_seed: u64,
    /// Synthetic: number of samples.
    pub samples: usize,
    /// Synthetic: features per sample.
    pub dim: usize,
    /// Synthetic: number of classes.
    pub classes: usize,
    /// Synthetic: generator seed.
    pub seed: u64,
    /// Shift and scale features by the training set's mean and standard deviation.
    pub standardize: bool,
}

/// The train section, checked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainConfig {
    /// Samples per step.
    pub batch_size: usize,
    /// Seed of the initial weights: identical on every node of a run.
    pub init_seed: u64,
    /// Seed of this node's data order; absent, it is derived from the node's peer id.
    pub node_seed: Option<u64>,
    /// `(k, n)`: train only on shard `k` of `n` of the training set (every n-th sample from
    /// k), for boxes that each own part of the data. Absent: the whole set. A local setting,
    /// not part of the run id.
    pub shard: Option<(usize, usize)>,
    /// Steps between evaluations on the held-out set (0: never).
    pub eval_every: u64,
    /// Stop after this many steps (0: train until stopped).
    pub max_steps: u64,
    /// Compute threads Candle may use.
    pub threads: usize,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
}

/// The checkpoint section, checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointConfig {
    /// Write a checkpoint every this many steps (0: not by steps).
    pub every_steps: u64,
    /// ... or when this many seconds have passed since the last one (0: not by time).
    pub every_secs: u64,
    /// How many checkpoints to keep on disk (the oldest go first).
    pub keep: usize,
}

/// The network section, checked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NetworkConfig {
    /// Addresses to listen on (default `/ip4/0.0.0.0/tcp/4001`).
    pub listen: Vec<String>,
    /// Members to join through.
    pub bootstrap: Vec<String>,
    /// Find peers on the local network with mDNS (off by default).
    pub mdns: bool,
    /// The private network's key file (`p2ptrain keygen --psk`): only nodes with the same key
    /// can connect. Relative paths are taken from the working directory.
    pub psk: Option<PathBuf>,
    /// If given, the only peers allowed to connect.
    pub allow: Option<Vec<libp2p::PeerId>>,
    /// Relay for members behind NATs once AutoNAT finds this node reachable (on by default;
    /// libp2p's default limits of 128 KiB and two minutes per circuit keep bulk traffic off).
    pub relay_server: bool,
    /// Ask the router for a port mapping with UPnP (off by default: it talks to the real
    /// router of the machine's network).
    pub upnp: bool,
}

/// The sync section, checked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SyncConfig {
    /// Neighbours each node keeps.
    pub degree: usize,
    /// Steps between published updates (0: never).
    pub publish_every: u64,
    /// Steps between neighbour syncs (0: never).
    pub full_sync_every: u64,
    /// Updates up to this size travel inline in gossip.
    pub inline_max_bytes: usize,
    /// Reject a neighbour's update whose norm exceeds this times our parameters' norm.
    pub max_update_ratio: f64,
    /// Fixed weight of a neighbour's update (default: the policy's `1 / (neighbours + 1)`
    /// times its staleness discount).
    pub update_weight: Option<f64>,
    /// How own updates are encoded.
    #[serde(serialize_with = "codec_name")]
    pub codec: Codec,
    /// Fraction of values top-k keeps.
    pub density: f64,
    /// Keep what a lossy codec did not send and add it to the next update.
    pub error_feedback: bool,
    /// SSP: run at most this many steps ahead of the slowest neighbour (`None`: no bound).
    pub staleness_bound: Option<u64>,
    /// Staleness scale: an update `t` of its sender's steps behind the sender's latest known
    /// progress is weighted by `1 / (1 + t / stale_after)` (0: no discount).
    pub stale_after: u64,
    /// Publish before `publish_every` steps once the pending update's norm exceeds this
    /// fraction of the parameters' norm (0: off).
    pub publish_early_ratio: f64,
    /// Reject a neighbour's update whose norm exceeds this times the median of recently
    /// accepted ones (0: off).
    pub outlier_factor: f64,
    /// Sustained updates per second accepted from one neighbour, with a burst of twice that;
    /// beyond it updates are dropped unread (0: no limit).
    pub max_updates_per_sec: f64,
    /// Clamp every value of a neighbour's update to `[-clip_value, clip_value]` (0: off).
    pub clip_value: f32,
    /// Cap on the relative distance `|mine - theirs| / |mine|` of a full-sync reply that is
    /// averaged; below it the bound follows recent accepted syncs (see
    /// [`crate::sync_guard`]). In (0, 1): a reply scaled by 2, or zeros, is at 1.
    pub max_sync_distance: f64,
}

fn codec_name<S: serde::Serializer>(c: &Codec, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(c.name())
}

impl SyncConfig {
    /// The policy settings these give.
    pub fn policy(&self) -> crate::policy::PolicyConfig {
        crate::policy::PolicyConfig {
            publish_every: self.publish_every,
            publish_early_ratio: self.publish_early_ratio,
            full_sync_every: self.full_sync_every,
            staleness_bound: self.staleness_bound,
            stale_after: self.stale_after,
            ..crate::policy::PolicyConfig::default()
        }
    }

    /// The update guard's settings these give.
    pub fn guard(&self) -> crate::guard::GuardConfig {
        crate::guard::GuardConfig {
            outlier_factor: self.outlier_factor,
            max_updates_per_sec: self.max_updates_per_sec,
            burst: 2.0 * self.max_updates_per_sec,
            clip_value: self.clip_value,
        }
    }
}

/// Debug knobs (for tests and experiments).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DebugConfig {
    /// Delay before serving each state chunk, to make transfers slow on purpose.
    pub serve_chunk_delay_ms: u64,
    /// Sleep after every training step: a throttle for tests (pacing, stragglers).
    pub step_delay_ms: u64,
}

/// Default listen address: a stable port, for firewall rules.
pub const DEFAULT_LISTEN: &str = "/ip4/0.0.0.0/tcp/4001";

/// A validated configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    /// Where it came from, for messages.
    #[serde(skip)]
    pub origin: String,
    /// The model to build.
    pub model: ModelConfig,
    /// The optimizer.
    pub optimizer: OptimizerSpec,
    /// The data set.
    pub data: DataConfig,
    /// Training loop settings.
    pub train: TrainConfig,
    /// Checkpoint policy.
    pub checkpoint: CheckpointConfig,
    /// Control API address from the file, if any (the CLI's `--api` wins).
    pub api_listen: Option<SocketAddr>,
    /// Networking.
    pub network: NetworkConfig,
    /// Update exchange and neighbour sync.
    pub sync: SyncConfig,
    /// Debug knobs.
    pub debug: DebugConfig,
}

impl Config {
    /// Reads and validates a config file; `None` gives the built-in default.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        match path {
            None => Config::parse(DEFAULT_CONFIG_TOML, DEFAULT_CONFIG_NAME, None),
            Some(p) => {
                let name = p.display().to_string();
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError {
                    file: name.clone(),
                    msg: format!("cannot read config: {e}"),
                })?;
                Config::parse(&text, &name, p.parent())
            }
        }
    }

    /// Parses TOML text; `base` is the directory relative paths are resolved against.
    pub fn parse(text: &str, origin: &str, base: Option<&Path>) -> Result<Config, ConfigError> {
        let err = |msg: String| ConfigError {
            file: origin.to_string(),
            msg,
        };
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
            let msg = e.message().replace('\n', " ");
            match line {
                Some(l) => err(format!("line {l}: {msg}")),
                None => err(msg),
            }
        })?;
        let resolve = |p: PathBuf| match base {
            Some(b) if p.is_relative() => b.join(p),
            _ => p,
        };

        let model = match raw.model.kind.as_str() {
            "mlp" => {
                if raw.model.channels.is_some() || raw.model.hidden.is_some() {
                    return Err(err("model.channels and model.hidden are for kind = \"cnn\"; an mlp takes model.widths".into()));
                }
                let widths = raw
                    .model
                    .widths
                    .ok_or_else(|| err("model.widths is required for kind = \"mlp\"".into()))?;
                ModelSpec::Mlp {
                    widths: widths.clone(),
                }
                .validate()
                .map_err(|e| err(format!("model.widths: {e}")))?;
                ModelConfig::Mlp { widths }
            }
            "cnn" => {
                if raw.model.widths.is_some() {
                    return Err(err("model.widths is for kind = \"mlp\"; a cnn takes model.channels and model.hidden".into()));
                }
                let ch = raw.model.channels.unwrap_or_else(|| vec![6, 16]);
                let channels: [usize; 2] = ch.as_slice().try_into().map_err(|_| {
                    err(format!(
                        "model.channels must list exactly two numbers, got {ch:?}"
                    ))
                })?;
                let hidden = raw.model.hidden.unwrap_or_else(|| vec![120, 84]);
                if channels.contains(&0) || hidden.contains(&0) {
                    return Err(err(
                        "model.channels and model.hidden must be non-zero".into()
                    ));
                }
                ModelConfig::Cnn { channels, hidden }
            }
            other => {
                return Err(err(format!(
                    "model.kind = {other:?} is unknown; use \"mlp\" or \"cnn\""
                )))
            }
        };

        let o = &raw.optimizer;
        let optimizer = match o.kind.as_str() {
            "sgd" => {
                for (k, v) in [("beta1", o.beta1), ("beta2", o.beta2), ("eps", o.eps)] {
                    if v.is_some() {
                        return Err(err(format!("optimizer.{k} is an adamw setting, not sgd")));
                    }
                }
                OptimizerSpec::Sgd {
                    lr: o.lr,
                    momentum: o.momentum.unwrap_or(0.9),
                    nesterov: o.nesterov.unwrap_or(false),
                    weight_decay: o.weight_decay.unwrap_or(0.0),
                }
            }
            "adamw" => {
                for (k, set) in [
                    ("momentum", o.momentum.is_some()),
                    ("nesterov", o.nesterov.is_some()),
                ] {
                    if set {
                        return Err(err(format!("optimizer.{k} is an sgd setting, not adamw")));
                    }
                }
                OptimizerSpec::Adamw {
                    lr: o.lr,
                    beta1: o.beta1.unwrap_or(0.9),
                    beta2: o.beta2.unwrap_or(0.999),
                    eps: o.eps.unwrap_or(1e-8),
                    weight_decay: o.weight_decay.unwrap_or(0.01),
                }
            }
            other => {
                return Err(err(format!(
                    "optimizer.kind = {other:?} is unknown; use \"sgd\" or \"adamw\""
                )))
            }
        };
        optimizer.validate().map_err(|e| err(e.to_string()))?;

        let d = raw.data;
        let data = DataConfig {
            source: d.source,
            path: d.path.map(resolve),
            dir: d.dir.map(resolve),
            test_fraction: d.test_fraction.unwrap_or(0.2),
            split_seed: d.split_seed.unwrap_or(1),
            samples: d.samples.unwrap_or(2000),
            dim: d.dim.unwrap_or(32),
            classes: d.classes.unwrap_or(4),
            seed: d.seed.unwrap_or(1),
            standardize: d.standardize.unwrap_or(true),
        };
        if !(0.0..1.0).contains(&data.test_fraction) {
            return Err(err(format!(
                "data.test_fraction = {} must be in [0, 1)",
                data.test_fraction
            )));
        }
        match data.source {
            DataSource::Mnist if data.dir.is_none() => {
                return Err(err(
                    "data.dir is required for source = \"mnist\" (the folder with the IDX files)"
                        .into(),
                ))
            }
            DataSource::Mnist if data.path.is_some() => {
                return Err(err(
                    "data.path is for source = \"digits\"; mnist takes data.dir".into(),
                ))
            }
            DataSource::Digits if data.dir.is_some() => {
                return Err(err(
                    "data.dir is for source = \"mnist\"; digits takes data.path".into(),
                ))
            }
            DataSource::Synthetic if data.samples == 0 || data.dim == 0 || data.classes < 2 => {
                return Err(err(
                    "data.samples and data.dim must be > 0 and data.classes >= 2".into(),
                ))
            }
            _ => {}
        }

        let t = raw.train;
        let train = TrainConfig {
            batch_size: t.batch_size.unwrap_or(32),
            init_seed: t.init_seed.unwrap_or(42),
            node_seed: t.node_seed,
            shard: t
                .shard
                .as_deref()
                .map(parse_shard)
                .transpose()
                .map_err(err)?,
            eval_every: t.eval_every.unwrap_or(500),
            max_steps: t.max_steps.unwrap_or(0),
            threads: t.threads.unwrap_or(1),
            device: t.device.unwrap_or_else(|| "cpu".into()),
        };
        if train.batch_size == 0 {
            return Err(err("train.batch_size must be at least 1".into()));
        }
        if train.threads == 0 {
            return Err(err("train.threads must be at least 1".into()));
        }
        crate::device::parse(&train.device).map_err(|e| err(format!("train.device: {e}")))?;

        let c = raw.checkpoint;
        let checkpoint = CheckpointConfig {
            every_steps: c.every_steps.unwrap_or(5000),
            every_secs: c.every_secs.unwrap_or(60),
            keep: c.keep.unwrap_or(5),
        };
        if checkpoint.keep == 0 {
            return Err(err("checkpoint.keep must be at least 1".into()));
        }

        let n = raw.network;
        let network = NetworkConfig {
            listen: n.listen.unwrap_or_else(|| vec![DEFAULT_LISTEN.to_string()]),
            bootstrap: n.bootstrap.unwrap_or_default(),
            mdns: n.mdns.unwrap_or(false),
            psk: n.psk,
            allow: n
                .allow
                .map(|ids| {
                    ids.iter()
                        .map(|id| {
                            id.parse::<libp2p::PeerId>().map_err(|e| {
                                err(format!("network.allow: {id:?} is not a peer id ({e})"))
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
                .transpose()?,
            relay_server: n.relay_server.unwrap_or(true),
            upnp: n.upnp.unwrap_or(false),
        };
        for (key, addrs) in [
            ("network.listen", &network.listen),
            ("network.bootstrap", &network.bootstrap),
        ] {
            for a in addrs {
                a.parse::<libp2p::Multiaddr>()
                    .map_err(|e| err(format!("{key}: {a:?} is not a multiaddr ({e})")))?;
            }
        }
        let y = raw.sync;
        let sync = SyncConfig {
            degree: y.degree.unwrap_or(4),
            publish_every: y.publish_every.unwrap_or(20),
            full_sync_every: y.full_sync_every.unwrap_or(500),
            inline_max_bytes: y.inline_max_bytes.unwrap_or(1024 * 1024),
            max_update_ratio: y.max_update_ratio.unwrap_or(1.0),
            update_weight: y.update_weight,
            codec: match &y.codec {
                Some(c) => c.parse().map_err(|e| err(format!("sync.codec: {e}")))?,
                None => Codec::Dense,
            },
            density: y.density.unwrap_or(0.01),
            error_feedback: y.error_feedback.unwrap_or(true),
            staleness_bound: y.staleness_bound,
            stale_after: y.stale_after.unwrap_or(100),
            publish_early_ratio: y.publish_early_ratio.unwrap_or(0.0),
            outlier_factor: y.outlier_factor.unwrap_or(10.0),
            max_updates_per_sec: y.max_updates_per_sec.unwrap_or(200.0),
            clip_value: y.clip_value.unwrap_or(0.0),
            max_sync_distance: y
                .max_sync_distance
                .unwrap_or(crate::sync_guard::DEFAULT_MAX_SYNC_DISTANCE),
        };
        // At 1 or beyond, a neighbour could replace the model with zeros, random values or
        // its own copy scaled by 2 and still be averaged in.
        if !(sync.max_sync_distance > 0.0 && sync.max_sync_distance < 1.0) {
            return Err(err(format!(
                "sync.max_sync_distance = {} must be a number in (0, 1): a reply of zeros or scaled by 2 is at 1",
                sync.max_sync_distance
            )));
        }
        if !(sync.clip_value >= 0.0 && sync.clip_value.is_finite()) {
            return Err(err(
                "sync.clip_value must be 0 (off) or a positive number".into()
            ));
        }
        for (key, v) in [
            ("sync.outlier_factor", sync.outlier_factor),
            ("sync.max_updates_per_sec", sync.max_updates_per_sec),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(err(format!("{key} must be 0 (off) or a positive number")));
            }
        }
        if sync.outlier_factor > 0.0 && sync.outlier_factor < 2.0 {
            return Err(err(
                "sync.outlier_factor below 2 would reject honest updates (0 turns it off)".into(),
            ));
        }
        if !(sync.density > 0.0 && sync.density <= 1.0) {
            return Err(err(format!(
                "sync.density = {} must be in (0, 1]",
                sync.density
            )));
        }
        if sync.staleness_bound == Some(0) {
            return Err(err(
                "sync.staleness_bound must be at least 1 (0 would make neighbours wait for each other forever)".into(),
            ));
        }
        if !(sync.publish_early_ratio >= 0.0 && sync.publish_early_ratio.is_finite()) {
            return Err(err(
                "sync.publish_early_ratio must be 0 or a positive number".into(),
            ));
        }
        if let Some(w) = sync.update_weight {
            if !(w > 0.0 && w <= 1.0) {
                return Err(err(format!("sync.update_weight = {w} must be in (0, 1]")));
            }
        }
        if sync.degree == 0 {
            return Err(err("sync.degree must be at least 1".into()));
        }
        if sync.inline_max_bytes > crate::network::MAX_TRANSMIT_SIZE - 4096 {
            return Err(err(format!(
                "sync.inline_max_bytes must stay below the gossip limit ({} bytes) minus framing",
                crate::network::MAX_TRANSMIT_SIZE
            )));
        }
        if !(sync.max_update_ratio > 0.0 && sync.max_update_ratio.is_finite()) {
            return Err(err("sync.max_update_ratio must be a positive number".into()));
        }
        let debug = DebugConfig {
            serve_chunk_delay_ms: raw.debug.serve_chunk_delay_ms.unwrap_or(0),
            step_delay_ms: raw.debug.step_delay_ms.unwrap_or(0),
        };

        Ok(Config {
            origin: origin.to_string(),
            network,
            sync,
            debug,
            model,
            optimizer,
            data,
            train,
            checkpoint,
            api_listen: raw.api.listen,
        })
    }

    /// Builds the model spec for a loaded data set, checking that the two fit.
    pub fn model_spec(&self, split: &Split) -> Result<ModelSpec, ConfigError> {
        let err = |msg: String| ConfigError {
            file: self.origin.clone(),
            msg,
        };
        let dim = split.train.dim;
        let classes = split.train.classes;
        let spec = match &self.model {
            ModelConfig::Mlp { widths } => {
                let (first, last) = (widths[0], widths[widths.len() - 1]);
                if first != dim || last != classes {
                    return Err(err(format!(
                        "model.widths = {widths:?} does not fit the data: {} has {dim} features and {classes} classes per sample, so the widths must start with {dim} and end with {classes}",
                        self.data.describe()
                    )));
                }
                ModelSpec::Mlp {
                    widths: widths.clone(),
                }
            }
            ModelConfig::Cnn { channels, hidden } => {
                let image = split.train.image.ok_or_else(|| {
                    err(format!(
                        "model.kind = \"cnn\" needs image data; {} is not",
                        self.data.describe()
                    ))
                })?;
                ModelSpec::Cnn {
                    image,
                    channels: *channels,
                    hidden: hidden.clone(),
                    classes,
                }
            }
        };
        spec.validate()
            .map_err(|e| err(format!("model does not fit {}: {e}", self.data.describe())))?;
        Ok(spec)
    }

    /// The run identity: a hash of everything that must match between nodes training one model
    /// together (model, optimizer, data spec, init seed). Paths and local settings are left out.
    pub fn run_id(&self) -> String {
        #[derive(Serialize)]
        struct DataIdentity {
            source: DataSource,
            test_fraction: f64,
            split_seed: u64,
            standardize: bool,
            /// Only a synthetic set's shape and seed define its content.
            synthetic: Option<(usize, usize, usize, u64)>,
        }
        #[derive(Serialize)]
        struct Identity<'a> {
            protocol: &'static str,
            model: &'a ModelConfig,
            optimizer: &'a OptimizerSpec,
            data: DataIdentity,
            init_seed: u64,
        }
        let d = &self.data;
        let identity = Identity {
            protocol: "p2ptrain/1",
            model: &self.model,
            optimizer: &self.optimizer,
            data: DataIdentity {
                source: d.source,
                test_fraction: d.test_fraction,
                split_seed: d.split_seed,
                standardize: d.standardize,
                synthetic: (d.source == DataSource::Synthetic)
                    .then_some((d.samples, d.dim, d.classes, d.seed)),
            },
            init_seed: self.train.init_seed,
        };
        short_hash(&identity)
    }

    /// A hash of the whole validated configuration, recorded in checkpoints.
    pub fn config_hash(&self) -> String {
        short_hash(self)
    }

    /// Loads the configured data set and its train/test split.
    pub fn load_data(&self) -> Result<Split, p2ptrain_models::Error> {
        let d = &self.data;
        let mut split = match d.source {
            DataSource::Digits => data::split_seeded(
                &data::load_digits(d.path.as_deref())?,
                d.test_fraction,
                d.split_seed,
            )?,
            DataSource::Mnist => data::load_mnist(d.dir.as_deref().unwrap_or(Path::new(".")))?,
            DataSource::Synthetic => data::split_seeded(
                &data::synthetic(d.samples, d.dim, d.classes, d.seed)?,
                d.test_fraction,
                d.split_seed,
            )?,
        };
        if d.standardize {
            split.standardize();
        }
        Ok(split)
    }
}

impl DataConfig {
    /// A short description for messages, e.g. `mnist (../shared/data/mnist)`.
    pub fn describe(&self) -> String {
        match self.source {
            DataSource::Digits => match &self.path {
                Some(p) => format!("digits ({})", p.display()),
                None => "digits (bundled)".into(),
            },
            DataSource::Mnist => format!(
                "mnist ({})",
                self.dir.as_deref().unwrap_or(Path::new("?")).display()
            ),
            DataSource::Synthetic => format!(
                "synthetic ({} samples, {} features, {} classes)",
                self.samples, self.dim, self.classes
            ),
        }
    }
}

fn short_hash<T: Serialize>(value: &T) -> String {
    // serde_json of these structs is deterministic: fields in declaration order, no maps.
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    hex::encode(&Sha256::digest(&bytes)[..8])
}

/// Parses `train.shard`, `"k/n"` with `0 <= k < n`.
fn parse_shard(text: &str) -> Result<(usize, usize), String> {
    let bad =
        || format!("train.shard must be \"k/n\" with 0 <= k < n (e.g. \"0/2\"), not {text:?}");
    let (k, n) = text.split_once('/').ok_or_else(bad)?;
    let k: usize = k.trim().parse().map_err(|_| bad())?;
    let n: usize = n.trim().parse().map_err(|_| bad())?;
    if n == 0 || k >= n {
        return Err(bad());
    }
    Ok((k, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        let c = Config::load(None).expect("default");
        assert_eq!(
            c.model,
            ModelConfig::Mlp {
                widths: vec![64, 128, 10]
            }
        );
        assert_eq!(c.run_id().len(), 16);
    }

    #[test]
    fn relaying_is_on_and_upnp_off_unless_the_config_says_otherwise() {
        let c = Config::load(None).expect("default");
        assert!(c.network.relay_server);
        assert!(!c.network.upnp);
        let text = format!("{DEFAULT_CONFIG_TOML}\n[network]\nrelay_server = false\nupnp = true\n");
        let c = Config::parse(&text, "x.toml", None).expect("parse");
        assert!(!c.network.relay_server);
        assert!(c.network.upnp);
        let bad = format!("{DEFAULT_CONFIG_TOML}\n[network]\nupnp = \"yes\"\n");
        let e = Config::parse(&bad, "x.toml", None)
            .expect_err("must fail")
            .to_string();
        assert!(e.contains("line") && e.contains("boolean"), "{e}");
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let text = DEFAULT_CONFIG_TOML.replace("[train]", "[train]\nbatchsize = 3");
        let e = Config::parse(&text, "x.toml", None)
            .expect_err("must fail")
            .to_string();
        assert!(e.starts_with("x.toml: line"), "{e}");
        assert!(e.contains("batchsize"), "{e}");
        assert!(!e.contains('\n'));
    }

    #[test]
    fn run_id_covers_model_and_seed_but_not_local_settings() {
        let base = Config::load(None).expect("default");
        let other_seed = Config::parse(
            &DEFAULT_CONFIG_TOML.replace("init_seed = 42", "init_seed = 43"),
            "x",
            None,
        )
        .expect("c");
        let other_threads = Config::parse(
            &DEFAULT_CONFIG_TOML.replace("threads = 1", "threads = 2"),
            "x",
            None,
        )
        .expect("c");
        assert_ne!(base.run_id(), other_seed.run_id());
        assert_eq!(base.run_id(), other_threads.run_id());
    }

    #[test]
    fn widths_must_fit_data() {
        let c = Config::parse(
            &DEFAULT_CONFIG_TOML.replace("[64, 128, 10]", "[784, 128, 10]"),
            "x",
            None,
        )
        .expect("c");
        let split = c.load_data().expect("data");
        let e = c.model_spec(&split).expect_err("must fail").to_string();
        assert!(
            e.contains("model.widths") && e.contains("64 features"),
            "{e}"
        );
    }

    #[test]
    fn shard_is_parsed_checked_and_local() {
        let with = |v: &str| {
            Config::parse(
                &DEFAULT_CONFIG_TOML
                    .replace("threads = 1", &format!("threads = 1\nshard = \"{v}\"")),
                "x",
                None,
            )
        };
        let c = with("1/3").expect("valid");
        assert_eq!(c.train.shard, Some((1, 3)));
        assert_eq!(c.run_id(), Config::load(None).expect("default").run_id());
        for bad in ["3/3", "1/0", "x/2", "2", "-1/2"] {
            let e = with(bad).expect_err(bad).to_string();
            assert!(e.contains("train.shard"), "{bad}: {e}");
        }
    }

    #[test]
    fn max_sync_distance_defaults_and_must_lie_between_0_and_1() {
        let with = |v: &str| {
            Config::parse(
                &format!("{DEFAULT_CONFIG_TOML}\n[sync]\nmax_sync_distance = {v}\n"),
                "x",
                None,
            )
        };
        let c = Config::load(None).expect("default");
        assert_eq!(
            c.sync.max_sync_distance,
            crate::sync_guard::DEFAULT_MAX_SYNC_DISTANCE
        );
        assert_eq!(with("0.3").expect("valid").sync.max_sync_distance, 0.3);
        for bad in ["0", "-0.5", "1", "1.5", "nan", "inf"] {
            let e = with(bad).expect_err(bad).to_string();
            assert!(e.contains("sync.max_sync_distance"), "{bad}: {e}");
        }
    }
}
