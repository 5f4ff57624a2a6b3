//! The sections whose requirements depend on their `kind` or `source` (model, optimizer,
//! data), as serde reads them, and their checks into typed values. [`super::Config::parse`]
//! reads the file into [`RawConfig`] and puts each error in the file's name.

use std::path::PathBuf;

use p2ptrain_models::gpt::GptSpec;
use p2ptrain_models::hf;
use p2ptrain_models::llama::LlamaSpec;
use p2ptrain_models::optim::{GradientPolicy, Schedule};
use p2ptrain_models::{MlpSpec, ModelSpec, OptimizerSpec};
use serde::Deserialize;

use super::sections::{
    ApiConfig, CheckpointConfig, DebugConfig, NetworkConfig, SyncConfig, TrainConfig,
};
use super::{DataConfig, DataSource, ModelConfig, PartitionKind};

/// The file as serde reads it: the sections with defaults are the checked types themselves
/// (each with `#[serde(default)]` and a `Default` impl, the one place its defaults live);
/// model, optimizer and data are raw because what they require depends on their `kind` or
/// `source`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) model: RawModel,
    pub(super) optimizer: RawOptimizer,
    pub(super) data: RawData,
    #[serde(default)]
    pub(super) train: TrainConfig,
    #[serde(default)]
    pub(super) checkpoint: CheckpointConfig,
    #[serde(default)]
    pub(super) api: ApiConfig,
    #[serde(default)]
    pub(super) network: NetworkConfig,
    #[serde(default)]
    pub(super) sync: SyncConfig,
    #[serde(default)]
    pub(super) debug: DebugConfig,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    kind: String,
    widths: Option<Vec<usize>>,
    channels: Option<Vec<usize>>,
    hidden: Option<Vec<usize>>,
    context: Option<usize>,
    layers: Option<usize>,
    width: Option<usize>,
    heads: Option<usize>,
    hf: Option<PathBuf>,
    hf_digest: Option<String>,
    vocab: Option<usize>,
    intermediate: Option<usize>,
    kv_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_eps: Option<f64>,
    rope_theta: Option<f64>,
    tied: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOptimizer {
    kind: String,
    lr: f64,
    momentum: Option<f64>,
    nesterov: Option<bool>,
    weight_decay: Option<f64>,
    beta1: Option<f64>,
    beta2: Option<f64>,
    eps: Option<f64>,
    schedule: Option<String>,
    warmup_steps: Option<u64>,
    total_steps: Option<u64>,
    min_lr_factor: Option<f64>,
    clip_grad_norm: Option<f64>,
    freeze: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawData {
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
    partition: Option<PartitionKind>,
    alpha: Option<f64>,
    classes_per_node: Option<usize>,
    eval_bytes: Option<usize>,
    token_bytes: Option<usize>,
    tokenizer: Option<PathBuf>,
    eval_tokens: Option<usize>,
}

impl RawModel {
    /// The model section checked: each kind's keys, and only its keys; `resolve` makes
    /// `model.hf` relative to the config file.
    pub(super) fn check(self, resolve: impl Fn(PathBuf) -> PathBuf) -> Result<ModelConfig, String> {
        let gpt_keys_set = [
            ("context", self.context.is_some()),
            ("layers", self.layers.is_some()),
            ("width", self.width.is_some()),
            ("heads", self.heads.is_some()),
        ];
        let llama_keys_set = [
            ("hf", self.hf.is_some()),
            ("hf_digest", self.hf_digest.is_some()),
            ("vocab", self.vocab.is_some()),
            ("intermediate", self.intermediate.is_some()),
            ("kv_heads", self.kv_heads.is_some()),
            ("head_dim", self.head_dim.is_some()),
            ("rms_eps", self.rms_eps.is_some()),
            ("rope_theta", self.rope_theta.is_some()),
            ("tied", self.tied.is_some()),
        ];
        if self.kind != "llama" {
            if let Some((k, _)) = llama_keys_set.iter().find(|(_, set)| *set) {
                return Err(format!("model.{k} is a llama setting"));
            }
        }
        let model = match self.kind.as_str() {
            "llama" => {
                if self.widths.is_some() || self.channels.is_some() || self.hidden.is_some() {
                    return Err(
                        "model.widths, model.channels and model.hidden are not llama settings"
                            .into(),
                    );
                }
                return self.llama(resolve);
            }
            "gpt" => {
                if self.widths.is_some() || self.channels.is_some() || self.hidden.is_some() {
                    return Err("model.widths, model.channels and model.hidden are not gpt settings; a gpt takes model.context, layers, width and heads".into());
                }
                let m = &self;
                let spec = GptSpec {
                    context: m.context.unwrap_or(64),
                    layers: m.layers.unwrap_or(4),
                    width: m.width.unwrap_or(128),
                    heads: m.heads.unwrap_or(4),
                };
                spec.validate().map_err(|e| format!("model: {e}"))?;
                ModelConfig::Gpt(spec)
            }
            "mlp" => {
                if self.channels.is_some() || self.hidden.is_some() {
                    return Err("model.channels and model.hidden are for kind = \"cnn\"; an mlp takes model.widths".into());
                }
                let widths = self
                    .widths
                    .ok_or_else(|| "model.widths is required for kind = \"mlp\"".to_string())?;
                ModelSpec::Mlp(MlpSpec {
                    widths: widths.clone(),
                })
                .validate()
                .map_err(|e| format!("model.widths: {e}"))?;
                ModelConfig::Mlp { widths }
            }
            "cnn" => {
                if self.widths.is_some() {
                    return Err("model.widths is for kind = \"mlp\"; a cnn takes model.channels and model.hidden".into());
                }
                let ch = self.channels.unwrap_or_else(|| vec![6, 16]);
                let channels: [usize; 2] = ch.as_slice().try_into().map_err(|_| {
                    format!("model.channels must list exactly two numbers, got {ch:?}")
                })?;
                let hidden = self.hidden.unwrap_or_else(|| vec![120, 84]);
                if channels.contains(&0) || hidden.contains(&0) {
                    return Err("model.channels and model.hidden must be non-zero".into());
                }
                ModelConfig::Cnn { channels, hidden }
            }
            other => {
                return Err(format!(
                    "model.kind = {other:?} is unknown; use \"mlp\", \"cnn\", \"gpt\" or \"llama\""
                ))
            }
        };
        if !matches!(model, ModelConfig::Gpt(_)) {
            for (k, set) in gpt_keys_set {
                if set {
                    return Err(format!("model.{k} is a gpt setting"));
                }
            }
        }
        Ok(model)
    }
}

impl RawModel {
    /// A llama: shaped by a Hugging Face folder's `config.json` (`model.hf`, whose weights the
    /// run starts from; `model.context` may shorten the training windows), by the keys with
    /// the folder named by its digest (`model.hf_digest`, as `p2ptrain init` writes it: no
    /// folder is read here), or by the keys alone (weights drawn from the run's seed).
    fn llama(self, resolve: impl Fn(PathBuf) -> PathBuf) -> Result<ModelConfig, String> {
        let m = self;
        let dir = m.hf.clone().map(resolve);
        if let Some(digest) = &m.hf_digest {
            if digest.len() != 16 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "model.hf_digest = {digest:?} is not 16 hex digits (`p2ptrain init --hf DIR` \
                     writes it)"
                ));
            }
            if dir.is_none() {
                return Err(
                    "model.hf_digest goes with model.hf: the folder's path on the box \
                            that starts the run (the others need not have it)"
                        .into(),
                );
            }
            let spec = m.llama_shape("model.hf_digest")?;
            // The folder, where this box has it: only its config.json is read (a few hundred
            // bytes); the weights' digest is checked when a node starts the run from them.
            if let Some(dir) = dir.as_deref().filter(|d| d.join("config.json").is_file()) {
                let folder = hf::read_config(dir).map_err(|e| format!("model.hf: {e}"))?;
                same_shape(&spec, &folder).map_err(|e| {
                    format!(
                        "model.{e} in {}'s config.json: the keys are another model's",
                        dir.display()
                    )
                })?;
            }
            return Ok(ModelConfig::Llama {
                spec,
                genesis: Some(digest.to_ascii_lowercase()),
                hf: dir,
                genesis_checked: false,
            });
        }
        let Some(dir) = dir else {
            let spec = m.llama_shape("model.hf")?;
            return Ok(ModelConfig::Llama {
                spec,
                genesis: None,
                hf: None,
                genesis_checked: false,
            });
        };
        let shape_keys = [
            ("layers", m.layers.is_some()),
            ("width", m.width.is_some()),
            ("heads", m.heads.is_some()),
            ("vocab", m.vocab.is_some()),
            ("intermediate", m.intermediate.is_some()),
            ("kv_heads", m.kv_heads.is_some()),
            ("head_dim", m.head_dim.is_some()),
            ("rms_eps", m.rms_eps.is_some()),
            ("rope_theta", m.rope_theta.is_some()),
            ("tied", m.tied.is_some()),
        ];
        if let Some((k, _)) = shape_keys.iter().find(|(_, set)| *set) {
            return Err(format!(
                "model.{k}: with model.hf the shape is the folder's config.json (only \
                 model.context may shorten the training windows; with model.hf_digest the keys \
                 give the whole shape)"
            ));
        }
        let mut spec = hf::read_config(&dir).map_err(|e| format!("model.hf: {e}"))?;
        if let Some(context) = m.context {
            if context > spec.context {
                return Err(format!(
                    "model.context = {context} is past the folder's max_position_embeddings {}",
                    spec.context
                ));
            }
            spec.context = context;
        }
        spec.validate().map_err(|e| format!("model: {e}"))?;
        let digest = hf::folder_digest(&dir).map_err(|e| format!("model.hf: {e}"))?;
        Ok(ModelConfig::Llama {
            spec,
            genesis: Some(digest),
            hf: Some(dir),
            genesis_checked: true,
        })
    }

    /// A llama's shape from the keys (`alternative`: the key that would give it instead).
    fn llama_shape(&self, alternative: &str) -> Result<LlamaSpec, String> {
        let m = self;
        let required = |v: Option<usize>, k: &str| {
            v.ok_or_else(|| format!("model.{k} is required for a llama (or {alternative})"))
        };
        let hidden = required(m.width, "width")?;
        let heads = required(m.heads, "heads")?;
        let spec = LlamaSpec {
            vocab: required(m.vocab, "vocab")?,
            context: m.context.unwrap_or(128),
            hidden,
            intermediate: m.intermediate.unwrap_or(hidden.saturating_mul(8) / 3),
            layers: m.layers.unwrap_or(4),
            heads,
            kv_heads: m.kv_heads.unwrap_or(heads),
            head_dim: m.head_dim.unwrap_or(hidden / heads.max(1)),
            rms_eps: m.rms_eps.unwrap_or(1e-5),
            rope_theta: m.rope_theta.unwrap_or(10_000.0),
            tied: m.tied.unwrap_or(false),
        };
        spec.validate().map_err(|e| format!("model: {e}"))?;
        Ok(spec)
    }
}

/// Whether the config's llama shape is the folder's (its context at most the folder's);
/// the first key that differs, with both values, if not.
fn same_shape(keys: &LlamaSpec, folder: &LlamaSpec) -> Result<(), String> {
    let differ = |k: &str, a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| {
        Err(format!("{k} = {a:?} here, {b:?}"))
    };
    let pairs: [(&str, usize, usize); 7] = [
        ("vocab", keys.vocab, folder.vocab),
        ("width", keys.hidden, folder.hidden),
        ("intermediate", keys.intermediate, folder.intermediate),
        ("layers", keys.layers, folder.layers),
        ("heads", keys.heads, folder.heads),
        ("kv_heads", keys.kv_heads, folder.kv_heads),
        ("head_dim", keys.head_dim, folder.head_dim),
    ];
    for (k, a, b) in pairs {
        if a != b {
            return differ(k, &a, &b);
        }
    }
    if keys.context > folder.context {
        return differ("context", &keys.context, &folder.context);
    }
    if keys.rms_eps != folder.rms_eps {
        return differ("rms_eps", &keys.rms_eps, &folder.rms_eps);
    }
    if keys.rope_theta != folder.rope_theta {
        return differ("rope_theta", &keys.rope_theta, &folder.rope_theta);
    }
    if keys.tied != folder.tied {
        return differ("tied", &keys.tied, &folder.tied);
    }
    Ok(())
}

impl RawOptimizer {
    /// The optimizer, its learning-rate schedule and what it does with gradients, checked:
    /// each kind's keys, and only its keys.
    pub(super) fn check(&self) -> Result<(OptimizerSpec, Schedule, GradientPolicy), String> {
        let o = self;
        let optimizer = match o.kind.as_str() {
            "sgd" => {
                for (k, v) in [("beta1", o.beta1), ("beta2", o.beta2), ("eps", o.eps)] {
                    if v.is_some() {
                        return Err(format!("optimizer.{k} is an adamw setting, not sgd"));
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
                        return Err(format!("optimizer.{k} is an sgd setting, not adamw"));
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
                return Err(format!(
                    "optimizer.kind = {other:?} is unknown; use \"sgd\" or \"adamw\""
                ))
            }
        };
        optimizer.validate().map_err(|e| e.to_string())?;
        let schedule = match o.schedule.as_deref().unwrap_or("constant") {
            "constant" => {
                for (k, set) in [
                    ("warmup_steps", o.warmup_steps.is_some()),
                    ("total_steps", o.total_steps.is_some()),
                    ("min_lr_factor", o.min_lr_factor.is_some()),
                ] {
                    if set {
                        return Err(format!(
                            "optimizer.{k} needs optimizer.schedule = \"cosine\""
                        ));
                    }
                }
                Schedule::Constant
            }
            "cosine" => {
                let total_steps = o.total_steps.ok_or_else(|| {
                    "optimizer.schedule = \"cosine\" needs optimizer.total_steps (where the decay ends)".to_string()
                })?;
                Schedule::Cosine {
                    warmup_steps: o.warmup_steps.unwrap_or(0),
                    total_steps,
                    min_factor: o.min_lr_factor.unwrap_or(0.1),
                }
            }
            other => {
                return Err(format!(
                    "optimizer.schedule = {other:?} is unknown; use \"constant\" or \"cosine\""
                ))
            }
        };
        schedule.validate().map_err(|e| format!("optimizer: {e}"))?;
        // Sorted and without repeats: the same tensors frozen are the same run, whatever the
        // order they are listed in.
        let mut freeze = o.freeze.clone().unwrap_or_default();
        freeze.sort();
        freeze.dedup();
        let gradients = GradientPolicy {
            clip_norm: o.clip_grad_norm,
            freeze,
        };
        gradients
            .validate()
            .map_err(|e| format!("optimizer.clip_grad_norm / optimizer.freeze: {e}"))?;
        Ok((optimizer, schedule, gradients))
    }
}

impl RawData {
    /// The data section checked against the model it feeds; `resolve` makes a relative path
    /// relative to the config file.
    pub(super) fn check(
        self,
        model: &ModelConfig,
        resolve: impl Fn(PathBuf) -> PathBuf,
    ) -> Result<DataConfig, String> {
        let d = self;
        let def = DataConfig::default();
        let data = DataConfig {
            source: d.source,
            path: d.path.map(&resolve),
            dir: d.dir.map(&resolve),
            test_fraction: d.test_fraction.unwrap_or(def.test_fraction),
            split_seed: d.split_seed.unwrap_or(def.split_seed),
            samples: d.samples.unwrap_or(def.samples),
            dim: d.dim.unwrap_or(def.dim),
            classes: d.classes.unwrap_or(def.classes),
            seed: d.seed.unwrap_or(def.seed),
            standardize: d.standardize.unwrap_or(def.standardize),
            partition: d.partition.unwrap_or(def.partition),
            alpha: d.alpha.unwrap_or(def.alpha),
            classes_per_node: d.classes_per_node,
            eval_bytes: d.eval_bytes.unwrap_or(def.eval_bytes),
            token_bytes: d.token_bytes.unwrap_or(def.token_bytes),
            tokenizer: d.tokenizer.map(&resolve),
            eval_tokens: d.eval_tokens.unwrap_or(def.eval_tokens),
        };
        let llama = matches!(model, ModelConfig::Llama { .. });
        if data.token_bytes != 2 && data.token_bytes != 4 {
            return Err(format!(
                "data.token_bytes = {} must be 2 (uint16 ids) or 4 (uint32)",
                data.token_bytes
            ));
        }
        if !llama && data.tokenizer.is_some() {
            return Err("data.tokenizer is for model.kind = \"llama\" (a gpt reads bytes)".into());
        }
        match data.source {
            DataSource::Tokens if !llama => {
                return Err("data.source = \"tokens\" feeds a model.kind = \"llama\"".into())
            }
            DataSource::Tokens if data.path.is_none() => {
                return Err("data.path is required for source = \"tokens\" (the token file)".into())
            }
            // The tokenizer tokenizes a text, and says the bytes each id stands for: a llama's
            // held-out figure is bits per byte, as a gpt's is.
            DataSource::Text | DataSource::Tokens if llama && data.tokenizer.is_none() => {
                return Err(
                    "a llama needs data.tokenizer (a tokenizer.json): it reads a text through it, and it says how many bytes each id stands for (bits per byte)"
                        .into(),
                )
            }
            DataSource::Digits | DataSource::Mnist | DataSource::Synthetic if llama => {
                return Err(format!(
                    "model.kind = \"llama\" reads tokens; data.source = \"{}\" is not text",
                    data.source.as_str()
                ))
            }
            DataSource::Tokens if data.partition != PartitionKind::Iid => {
                return Err(format!(
                    "data.partition = \"{}\" cuts by class; tokens have none (train.shard gives each node a stretch of them)",
                    data.partition.as_str()
                ))
            }
            _ => {}
        }
        if !(0.0..1.0).contains(&data.test_fraction) {
            return Err(format!(
                "data.test_fraction = {} must be in [0, 1)",
                data.test_fraction
            ));
        }
        match data.source {
            DataSource::Mnist if data.dir.is_none() => {
                return Err(
                    "data.dir is required for source = \"mnist\" (the folder with the IDX files)"
                        .into(),
                )
            }
            DataSource::Mnist if data.path.is_some() => {
                return Err(
                    "data.path is for source = \"digits\" or \"text\"; mnist takes data.dir".into(),
                )
            }
            DataSource::Digits | DataSource::Text | DataSource::Tokens if data.dir.is_some() => {
                return Err(format!(
                    "data.dir is for source = \"mnist\"; {} takes data.path",
                    data.source.as_str()
                ))
            }
            DataSource::Text if !model.is_language_model() => {
                return Err(
                    "data.source = \"text\" trains a language model: it needs model.kind = \"gpt\" or \"llama\""
                        .into(),
                )
            }
            DataSource::Text if data.partition != PartitionKind::Iid => {
                return Err(format!(
                    "data.partition = \"{}\" cuts by class; a text has none (train.shard gives each node a stretch of it)",
                    data.partition.as_str()
                ))
            }
            _ if data.source != DataSource::Text && matches!(model, ModelConfig::Gpt(_)) => {
                return Err(format!(
                    "model.kind = \"gpt\" reads bytes of text; data.source = \"{}\" is not text",
                    data.source.as_str()
                ))
            }
            DataSource::Synthetic if data.samples == 0 || data.dim == 0 || data.classes < 2 => {
                return Err(
                    "data.samples and data.dim must be > 0 and data.classes >= 2".into(),
                )
            }
            _ => {}
        }
        if !(data.alpha.is_finite() && data.alpha > 0.0) {
            return Err(format!("data.alpha = {} must be > 0", data.alpha));
        }
        // Each key is read by its model and source only: one set where nothing reads it is
        // refused, not ignored (two nodes that differ in it would think they evaluate alike).
        let unread = [
            (
                "data.token_bytes",
                d.token_bytes.is_some() && data.source != DataSource::Tokens,
            ),
            ("data.eval_tokens", d.eval_tokens.is_some() && !llama),
            (
                "data.eval_bytes",
                d.eval_bytes.is_some() && (llama || data.source != DataSource::Text),
            ),
        ];
        if let Some((key, _)) = unread.iter().find(|(_, set)| *set) {
            return Err(format!(
                "{key} is not read with model.kind and data.source = \"{}\" (token_bytes: \
                 a token file's; eval_tokens: a llama's; eval_bytes: a gpt's text)",
                data.source.as_str()
            ));
        }
        if data.classes_per_node == Some(0) {
            return Err("data.classes_per_node must be at least 1".into());
        }
        Ok(data)
    }
}
