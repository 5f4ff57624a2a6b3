//! The node's configuration: a TOML file read strictly (unknown keys are errors), command-line
//! overrides merged in ([`Config::apply`]), and the result validated into typed values, with
//! errors that name the file and the key, or the flag. It owns every default of a setting; it
//! does not open devices, files or sockets.
//!
//! Most sections deserialize straight into their checked types: each has a `Default` impl
//! (the one place its defaults are written) and `#[serde(default)]`, and typed values
//! (multiaddrs, peer ids, the device, the codec) are parsed as the file is read. Model,
//! optimizer and data go through `Raw*` structs first because what they require depends on
//! their `kind` or `source`. Relative paths in a file are relative to that file, so a config
//! works from any working directory.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use p2ptrain_models::codec::Codec;
use p2ptrain_models::data::{self, Data};
use p2ptrain_models::gpt::GptSpec;
use p2ptrain_models::llama::LlamaSpec;
use p2ptrain_models::optim::{GradientPolicy, Schedule};
use p2ptrain_models::text::{self, TextOptions};
use p2ptrain_models::tokenizer::TextTokenizer;
use p2ptrain_models::tokens::{self, TokenFile, TokenOptions};
use p2ptrain_models::{CnnSpec, MlpSpec, ModelSpec, OptimizerSpec};
use serde::{de, Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};

use crate::device::DeviceSpec;

mod raw;
mod sections;
mod setting;

use raw::RawConfig;
use sections::{parse_all, parse_bootstrap};
pub use sections::{
    ApiConfig, CheckpointConfig, DebugConfig, NetworkConfig, SyncConfig, SyncMode, TrainConfig,
    DEFAULT_API, DEFAULT_DATA_DIR, DEFAULT_LISTEN_PORT,
};
pub use setting::{apply_settings, Setting};

/// The default configuration (`configs/digits-mlp.toml`), compiled in so that `p2ptrain join`
/// works with no file at all.
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../../configs/digits-mlp.toml");

/// Name shown for the compiled-in default configuration.
pub const DEFAULT_CONFIG_NAME: &str = "<built-in configs/digits-mlp.toml>";

/// A configuration problem, in one line: the file, then the key or line, then the cause; or
/// the command-line flag and the cause.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A problem in a config file (or the built-in default).
    #[error("{file}: {msg}")]
    File {
        /// The config file (or the built-in default's name).
        file: String,
        /// What is wrong, naming the key.
        msg: String,
    },
    /// A command-line override that cannot be applied; the message names the flag.
    #[error("{0}")]
    Override(String),
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
    /// A text file for a language model (`data.path`; absent: the bundled Hamlet): bytes for
    /// a GPT, a tokenizer's ids (`data.tokenizer`) for a Llama.
    Text,
    /// A token file (`data.path`: flat little-endian ids of `data.token_bytes` bytes, as
    /// `p2ptrain tokenize` and nanoGPT write them) for a Llama.
    Tokens,
}

impl DataSource {
    /// The name the config file uses.
    pub fn as_str(self) -> &'static str {
        match self {
            DataSource::Digits => "digits",
            DataSource::Mnist => "mnist",
            DataSource::Synthetic => "synthetic",
            DataSource::Text => "text",
            DataSource::Tokens => "tokens",
        }
    }
}

/// How `train.shard` cuts the training set between the boxes that each own part of it
/// (`data.partition`); see [`data::Partition`] for the cuts themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionKind {
    /// Uniform parts: every n-th sample.
    Iid,
    /// Each part holds a few classes (`data.classes_per_node`), as federated users' data does.
    ByLabel,
    /// Classes spread over parts by a Dirichlet draw (`data.alpha`).
    Dirichlet,
}

impl PartitionKind {
    /// The name the config file uses.
    pub fn as_str(self) -> &'static str {
        match self {
            PartitionKind::Iid => "iid",
            PartitionKind::ByLabel => "by_label",
            PartitionKind::Dirichlet => "dirichlet",
        }
    }
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
    /// A byte-level GPT; it needs `data.source = "text"`.
    Gpt(GptSpec),
    /// A Llama-family decoder over a tokenizer's ids (`data.source = "tokens"`, or `"text"`
    /// with `data.tokenizer`), from a Hugging Face folder's shape and weights (`model.hf`) or
    /// shaped by the config and drawn from the run's seed.
    Llama {
        /// Its shape.
        #[serde(flatten)]
        spec: LlamaSpec,
        /// Where it starts: the digest of `model.hf`'s folder (part of the run's identity), or
        /// none for weights drawn from the run's seed.
        genesis: Option<String>,
        /// The folder `model.hf` names, resolved against the config file (a local path: not
        /// part of the run's identity).
        #[serde(skip)]
        hf: Option<PathBuf>,
        /// Whether `genesis` was computed from the folder's files at load (`model.hf` alone),
        /// not taken from `model.hf_digest`: a digest taken on the config's word is checked
        /// where a node starts the run from the folder, and nowhere else.
        #[serde(skip)]
        genesis_checked: bool,
    },
}

impl ModelConfig {
    /// Whether it is a language model: judged by held-out bits per byte (lower is better),
    /// where the classifiers are judged by accuracy.
    pub fn is_language_model(&self) -> bool {
        matches!(self, ModelConfig::Gpt(_) | ModelConfig::Llama { .. })
    }

    /// The tokens (a GPT's bytes) a language model reads at once; `None` for a classifier.
    pub fn context(&self) -> Option<usize> {
        match self {
            ModelConfig::Gpt(g) => Some(g.context),
            ModelConfig::Llama { spec, .. } => Some(spec.context),
            _ => None,
        }
    }

    /// The Hugging Face folder whose weights the run starts from, where the run starts from
    /// one: its path (`model.hf`, which may be absent on a box that joins), and the digest
    /// its files must have where that is still to be checked (`model.hf_digest`).
    pub fn genesis_folder(&self) -> Option<(&Path, Option<&str>)> {
        match self {
            ModelConfig::Llama {
                hf: Some(dir),
                genesis: Some(digest),
                genesis_checked,
                ..
            } => Some((dir, (!genesis_checked).then_some(digest.as_str()))),
            _ => None,
        }
    }
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
    /// How `train.shard = "k/n"` cuts the training set (a local setting, like the shard).
    pub partition: PartitionKind,
    /// `dirichlet`: the concentration; small values give few classes per node.
    pub alpha: f64,
    /// `by_label`: classes per node; absent, just enough that every class has a node.
    pub classes_per_node: Option<usize>,
    /// Text: held-out bytes each evaluation reads (0: the whole tail).
    pub eval_bytes: usize,
    /// Tokens: bytes per id in the token file, 2 (`uint16`) or 4 (`uint32`).
    pub token_bytes: usize,
    /// A Hugging Face `tokenizer.json`: a text's ids for a Llama, and the bytes each id
    /// stands for (bits per byte), resolved against the config file.
    pub tokenizer: Option<PathBuf>,
    /// Tokens: held-out ids each evaluation reads (0: the whole tail).
    pub eval_tokens: usize,
}

/// Settings given on the command line. Every CLI command that loads a config hands its flags
/// to [`Config::apply`], the one place they are merged into the file's values.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--device`: replaces `train.device`.
    pub device: Option<String>,
    /// `--threads`: replaces `train.threads`.
    pub threads: Option<usize>,
    /// `--max-steps`: replaces `train.max_steps`.
    pub max_steps: Option<u64>,
    /// `--api`: replaces `api.listen`.
    pub api: Option<SocketAddr>,
    /// `--listen`: replaces `network.listen` when given.
    pub listen: Vec<String>,
    /// `--bootstrap`: added to `network.bootstrap`.
    pub bootstrap: Vec<String>,
    /// `--mdns`: turns mDNS on (it cannot turn the file's `mdns = true` off).
    pub mdns: bool,
    /// `--psk`: replaces `network.psk`.
    pub psk: Option<PathBuf>,
    /// `--sync-mode`: replaces `sync.mode`.
    pub sync_mode: Option<String>,
    /// `--min-members`: replaces `sync.min_members` (`local` starts a synchronous mesh with
    /// all its nodes, from one state).
    pub min_members: Option<usize>,
    /// `--shard k/n`: replaces `train.shard`, so one config file serves every node of a
    /// skewed mesh.
    pub shard: Option<String>,
    /// `--target` (of `local`): replaces `train.target`.
    pub target: Option<f64>,
}

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
    /// Its learning-rate schedule (`optimizer.schedule`).
    pub schedule: Schedule,
    /// What a step does with the gradients (`optimizer.clip_grad_norm`, `optimizer.freeze`).
    /// Left out of the hash when it changes nothing, so configs without it keep theirs.
    #[serde(skip_serializing_if = "GradientPolicy::is_default")]
    pub gradients: GradientPolicy,
    /// The data set.
    pub data: DataConfig,
    /// Training loop settings.
    pub train: TrainConfig,
    /// Checkpoint policy.
    pub checkpoint: CheckpointConfig,
    /// Control API.
    pub api: ApiConfig,
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
        Config::load_with(path, &[])
    }

    /// [`Config::load`] with `settings` (a command line's `--set`) written over the file's
    /// keys before it is parsed, so each is checked as the same line in the file would be.
    pub fn load_with(path: Option<&Path>, settings: &[Setting]) -> Result<Config, ConfigError> {
        let (text, name, base) = match path {
            None => (
                DEFAULT_CONFIG_TOML.to_string(),
                DEFAULT_CONFIG_NAME.to_string(),
                None,
            ),
            Some(p) => {
                let name = p.display().to_string();
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError::File {
                    file: name.clone(),
                    msg: format!("cannot read config: {e}"),
                })?;
                (text, name, p.parent())
            }
        };
        let text = apply_settings(&text, settings).map_err(|msg| ConfigError::File {
            file: name.clone(),
            msg,
        })?;
        let origin = if settings.is_empty() {
            name
        } else {
            format!("{name} with --set")
        };
        Config::parse(&text, &origin, base)
    }

    /// Parses TOML text; `base` is the directory relative paths are resolved against.
    pub fn parse(text: &str, origin: &str, base: Option<&Path>) -> Result<Config, ConfigError> {
        let err = |msg: String| ConfigError::File {
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

        let model = raw.model.check(resolve).map_err(err)?;
        let (optimizer, schedule, gradients) = raw.optimizer.check().map_err(err)?;
        let data = raw.data.check(&model, resolve).map_err(err)?;

        raw.train.check().map_err(err)?;
        if raw.checkpoint.keep == 0 {
            return Err(err("checkpoint.keep must be at least 1".into()));
        }
        raw.sync.check().map_err(err)?;
        raw.api.check().map_err(err)?;
        raw.network.check().map_err(err)?;
        if raw.debug.ring_attack.is_some() && !cfg!(debug_assertions) {
            return Err(err(
                "debug.ring_attack makes this node a hostile round member, for tests: a release build refuses it".into(),
            ));
        }

        let config = Config {
            origin: origin.to_string(),
            model,
            optimizer,
            schedule,
            gradients,
            data,
            train: raw.train,
            checkpoint: raw.checkpoint,
            api: raw.api,
            network: raw.network,
            sync: raw.sync,
            debug: raw.debug,
        };
        config.check_target().map_err(err)?;
        Ok(config)
    }

    /// Merges command-line settings into this configuration, parsing and checking each, so
    /// that what the node runs with is one validated [`Config`]. Every CLI command that takes
    /// such flags calls this, and only this.
    pub fn apply(&mut self, o: &Overrides) -> Result<(), ConfigError> {
        let err = ConfigError::Override;
        if let Some(d) = &o.device {
            self.train.device = d.parse().map_err(|e| err(format!("--device: {e}")))?;
        }
        if let Some(t) = o.threads {
            if t == 0 {
                return Err(err("--threads must be at least 1".into()));
            }
            self.train.threads = t;
        }
        if let Some(m) = o.max_steps {
            self.train.max_steps = m;
        }
        if let Some(a) = o.api {
            self.api.listen = a;
        }
        if !o.listen.is_empty() {
            self.network.listen = parse_all("--listen", o.listen.clone()).map_err(err)?;
        }
        let bootstrap = parse_bootstrap("--bootstrap", o.bootstrap.clone()).map_err(err)?;
        self.network.bootstrap.extend(bootstrap);
        self.network.mdns |= o.mdns;
        if let Some(p) = &o.psk {
            self.network.psk = Some(p.clone());
        }
        if let Some(m) = &o.sync_mode {
            self.sync.mode = m.parse().map_err(|e| err(format!("--sync-mode: {e}")))?;
            // The file's sync settings were checked for its own mode; some only bind in
            // another (diloco's overlap below its round), so they are checked again for this one.
            self.sync
                .check()
                .map_err(|e| err(format!("--sync-mode {m}: {e}")))?;
        }
        if let Some(m) = o.min_members {
            if m == 0 {
                return Err(err(
                    "--min-members must be at least 1 (the node itself)".into()
                ));
            }
            self.sync.min_members = m;
        }
        if let Some(s) = &o.shard {
            self.train.shard = Some(parse_shard(s).map_err(|e| err(format!("--shard: {e}")))?);
        }
        if let Some(t) = o.target {
            self.train.target = Some(t);
            self.train
                .check()
                .and_then(|()| self.check_target())
                .map_err(|e| err(format!("--target: {e}")))?;
        }
        Ok(())
    }

    /// A target that can never be reached is a clear error, not a run that never ends: an
    /// accuracy above 1 (bits per byte, a language model's figure, may be any positive
    /// number), or any target when nothing evaluates.
    fn check_target(&self) -> Result<(), String> {
        match self.train.target {
            Some(t) if !self.model.is_language_model() && t > 1.0 => Err(format!(
                "train.target = {t} is a held-out accuracy for this model: at most 1"
            )),
            Some(_) if self.train.eval_every == 0 && self.train.eval_every_secs == 0.0 => Err(
                "train.target is judged by evaluations: set train.eval_every or \
                 train.eval_every_secs"
                    .into(),
            ),
            _ => Ok(()),
        }
    }

    /// Checks that a partition other than `iid`, which cuts the training set between nodes,
    /// knows which part this node holds (`train.shard` or `--shard`). Checked when a node is
    /// prepared rather than when the file is read, since the part may come from the command
    /// line.
    pub fn check_shard(&self) -> Result<(), ConfigError> {
        if self.data.partition != PartitionKind::Iid && self.train.shard.is_none() {
            return Err(ConfigError::File {
                file: self.origin.clone(),
                msg: format!(
                    "data.partition = \"{}\" cuts the set between nodes, so it needs \
                     train.shard = \"k/n\" or --shard k/n (which part this node holds)",
                    self.data.partition.as_str()
                ),
            });
        }
        Ok(())
    }

    /// Builds the model spec for a loaded data set, checking that the two fit.
    pub fn model_spec(&self, data: &Data) -> Result<ModelSpec, ConfigError> {
        let err = |msg: String| ConfigError::File {
            file: self.origin.clone(),
            msg,
        };
        let split = match (&self.model, data) {
            (ModelConfig::Gpt(g), Data::Text(_)) => return Ok(ModelSpec::Gpt(*g)),
            // [`Config::load_data`] checked the tokenizer's ids against the vocabulary.
            (ModelConfig::Llama { spec, .. }, Data::Tokens(_)) => {
                return Ok(ModelSpec::Llama(*spec))
            }
            (_, Data::Labeled(split)) => split,
            _ => {
                return Err(err(format!(
                    "model.kind and {} do not fit: a gpt reads text, a llama tokens (or text \
                     with data.tokenizer), the others labelled samples",
                    self.data.describe()
                )))
            }
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
                ModelSpec::Mlp(MlpSpec {
                    widths: widths.clone(),
                })
            }
            ModelConfig::Cnn { channels, hidden } => {
                let image = split.train.image.ok_or_else(|| {
                    err(format!(
                        "model.kind = \"cnn\" needs image data; {} is not",
                        self.data.describe()
                    ))
                })?;
                ModelSpec::Cnn(CnnSpec {
                    image,
                    channels: *channels,
                    hidden: hidden.clone(),
                    classes,
                })
            }
            ModelConfig::Gpt(g) => ModelSpec::Gpt(*g),
            ModelConfig::Llama { spec, .. } => ModelSpec::Llama(*spec),
        };
        spec.validate()
            .map_err(|e| err(format!("model does not fit {}: {e}", self.data.describe())))?;
        Ok(spec)
    }

    /// The run identity: a hash of everything that must match between nodes training one model
    /// together (model, optimizer, data spec, init seed). Paths and local settings are left out.
    pub fn run_id(&self) -> String {
        short_hash(&self.identity())
    }

    /// The run id's parts, each hashed on its own (`model/…/optimizer/…/data/…/seed/…`): what a
    /// node tells its peers beside the run id, so a node refused for another run can say which
    /// part differs instead of only that the ids do.
    pub fn run_parts(&self) -> String {
        let identity = self.identity();
        let optimizer = (identity.optimizer, identity.schedule, identity.gradients);
        format!(
            "model/{}/optimizer/{}/data/{}/seed/{}",
            short_hash(identity.model),
            short_hash(&optimizer),
            short_hash(&identity.data),
            identity.init_seed
        )
    }

    /// What [`Config::run_id`] hashes.
    fn identity(&self) -> Identity<'_> {
        let d = &self.data;
        let llama = matches!(self.model, ModelConfig::Llama { .. });
        Identity {
            protocol: "p2ptrain/1",
            model: &self.model,
            optimizer: &self.optimizer,
            schedule: self.schedule,
            gradients: &self.gradients,
            data: DataIdentity {
                source: d.source,
                test_fraction: d.test_fraction,
                split_seed: d.split_seed,
                standardize: d.standardize,
                synthetic: (d.source == DataSource::Synthetic)
                    .then_some((d.samples, d.dim, d.classes, d.seed)),
                // What a llama reads is tokens, from a token file or a text.
                text_eval_bytes: (d.source == DataSource::Text && !llama).then_some(d.eval_bytes),
                eval_tokens: llama.then_some(d.eval_tokens),
            },
            init_seed: self.train.init_seed,
        }
    }

    /// A hash of the whole validated configuration, recorded in checkpoints.
    pub fn config_hash(&self) -> String {
        short_hash(self)
    }

    /// Loads the configured data set and its train/test split.
    pub fn load_data(&self) -> Result<Data, p2ptrain_models::Error> {
        let d = &self.data;
        // A llama's tokenizer, loaded once: its ids must fit the model's vocabulary (a
        // tokenizer with more ids is another model's, whatever ids this text happens to give).
        let tokenizer = match (&self.model, d.tokenizer.as_deref()) {
            (ModelConfig::Llama { spec, .. }, Some(path)) => {
                let tokenizer = TextTokenizer::load(path)?;
                tokenizer.check_fits(spec.vocab, path)?;
                Some(tokenizer)
            }
            _ => None,
        };
        let tokens = |ids: Option<(&Path, Vec<u32>)>| -> Result<Data, p2ptrain_models::Error> {
            let ModelConfig::Llama { spec, .. } = &self.model else {
                return Err(p2ptrain_models::Error::Spec(
                    "token data needs model.kind = \"llama\"".into(),
                ));
            };
            let opts = TokenOptions {
                context: spec.context,
                width: d.token_bytes,
                vocab: spec.vocab,
                test_fraction: d.test_fraction,
                eval_tokens: d.eval_tokens,
                bytes_per_token: tokenizer.as_ref().map(TextTokenizer::bytes_per_token),
            };
            Ok(Data::Tokens(match ids {
                Some((source, ids)) => {
                    tokens::split_tokens(TokenFile::from_ids(source, ids), opts)?
                }
                None => tokens::load_tokens(d.path.as_deref().unwrap_or(Path::new("")), opts)?,
            }))
        };
        let mut split = match d.source {
            DataSource::Tokens => return tokens(None),
            // A text for a Llama: its tokenizer's ids, in memory.
            DataSource::Text if matches!(self.model, ModelConfig::Llama { .. }) => {
                let path = d.path.as_deref();
                let bytes = match path {
                    Some(p) => p2ptrain_models::samples::read_maybe_gz(p)?,
                    None => text::bundled_hamlet()?,
                };
                let source = path.unwrap_or(Path::new("<bundled hamlet.txt.gz>"));
                let text =
                    std::str::from_utf8(&bytes).map_err(|e| p2ptrain_models::Error::Format {
                        path: source.to_owned(),
                        msg: format!(
                            "not UTF-8 text (invalid byte at offset {})",
                            e.valid_up_to()
                        ),
                    })?;
                let tokenizer = tokenizer.as_ref().ok_or_else(|| {
                    p2ptrain_models::Error::Spec("a text for a llama needs data.tokenizer".into())
                })?;
                let ids = tokenizer.encode(text)?;
                return tokens(Some((source, ids)));
            }
            DataSource::Text => {
                let context = self.model.context().unwrap_or(1);
                let opts = TextOptions {
                    context,
                    test_fraction: d.test_fraction,
                    eval_bytes: d.eval_bytes,
                };
                return Ok(Data::Text(text::load_text(d.path.as_deref(), opts)?));
            }
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
        Ok(Data::Labeled(split))
    }
}

// `data.source` has no default (the file must say which set), so the data section is read raw
// and only its other keys fall back to these.
impl Default for DataConfig {
    fn default() -> DataConfig {
        DataConfig {
            source: DataSource::Digits,
            path: None,
            dir: None,
            test_fraction: 0.2,
            split_seed: 1,
            samples: 2000,
            dim: 32,
            classes: 4,
            seed: 1,
            standardize: true,
            partition: PartitionKind::Iid,
            alpha: 0.5,
            classes_per_node: None,
            eval_bytes: 32_768,
            token_bytes: 2,
            tokenizer: None,
            eval_tokens: 16_384,
        }
    }
}

impl DataConfig {
    /// The cut that `train.shard = "k/n"` makes, with `parts` = n, of a set of `classes`.
    pub fn cut(&self, parts: usize, classes: usize) -> data::Partition {
        match self.partition {
            PartitionKind::Iid => data::Partition::Iid,
            PartitionKind::ByLabel => data::Partition::ByLabel {
                classes_per_part: self
                    .classes_per_node
                    .unwrap_or_else(|| data::Partition::covering_classes_per_part(classes, parts)),
            },
            PartitionKind::Dirichlet => data::Partition::Dirichlet { alpha: self.alpha },
        }
    }

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
            DataSource::Text => match &self.path {
                Some(p) => format!("text ({})", p.display()),
                None => "text (bundled Hamlet)".into(),
            },
            DataSource::Tokens => format!(
                "tokens ({})",
                self.path.as_deref().unwrap_or(Path::new("?")).display()
            ),
        }
    }
}

/// What the run id hashes of a run's data: its spec, not where its files are.
#[derive(Serialize)]
struct DataIdentity {
    source: DataSource,
    test_fraction: f64,
    split_seed: u64,
    standardize: bool,
    /// Only a synthetic set's shape and seed define its content.
    synthetic: Option<(usize, usize, usize, u64)>,
    /// A text's held-out bytes: nodes that evaluate the same tail compare.
    #[serde(skip_serializing_if = "Option::is_none")]
    text_eval_bytes: Option<usize>,
    /// A llama's held-out ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    eval_tokens: Option<usize>,
}

/// Everything the run id hashes (see [`Config::run_id`]); its serialisation is the id's.
#[derive(Serialize)]
struct Identity<'a> {
    protocol: &'static str,
    model: &'a ModelConfig,
    optimizer: &'a OptimizerSpec,
    /// Left out when constant, so runs configured before schedules keep their id.
    #[serde(skip_serializing_if = "Schedule::is_constant")]
    schedule: Schedule,
    /// Left out when it changes nothing, so runs configured before it keep their id.
    #[serde(skip_serializing_if = "GradientPolicy::is_default")]
    gradients: &'a GradientPolicy,
    data: DataIdentity,
    init_seed: u64,
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
mod tests;
