//! Hugging Face model folders in and out: a local `LlamaForCausalLM` folder (`config.json`
//! and `model.safetensors`, or shards `model-*.safetensors` with their index) read into a
//! [`LlamaSpec`] and named `f32` tensors, and a model written back in that format (HF's names
//! and layouts, `f32` or `bf16`), which `transformers`, llama.cpp's converter and vLLM read.
//!
//! Nothing here downloads: the user points at a folder. Everything read is checked before it
//! is used: a config key or value this model does not implement is refused with the key
//! named (never loaded as something else silently), shard names must be plain file names in
//! the folder, every parameter must be present with its exact shape and finite values, and a
//! tensor the model has no place for is refused.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{json, Map, Value};

use crate::llama::LlamaSpec;
use crate::params::Params;
use crate::{Error, Result};

/// The single-file weights' name in a Hugging Face folder.
const WEIGHTS: &str = "model.safetensors";
/// The shard index's name.
const INDEX: &str = "model.safetensors.index.json";
/// Largest `config.json` or index read (real ones are a few KiB, an index of a large model
/// some tens of KiB).
const MAX_JSON_BYTES: u64 = 16 << 20;

/// Config keys that say nothing about the computation (token ids for generation, the
/// initialiser's scale, bookkeeping): read past.
const IGNORED_KEYS: &[&str] = &[
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "is_llama_config",
    "pretraining_tp",
    "tokenizer_class",
];

/// Config keys whose value is read (or checked to be the one value this model implements).
const READ_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_interleaved",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
    "hidden_act",
    "tie_word_embeddings",
    "sliding_window",
];

/// A Hugging Face model read from its folder: the spec its `config.json` describes and its
/// weights as `f32`, under HF's names.
#[derive(Debug)]
pub struct HfModel {
    /// The model's shape (its context: `max_position_embeddings`).
    pub spec: LlamaSpec,
    /// Every parameter the spec has, by name, as `f32` on the CPU.
    pub tensors: HashMap<String, Tensor>,
    /// The dtype the weights were stored in (`F32`, `BF16` or `F16`).
    pub stored_as: String,
}

/// Reads the Llama spec a `config.json`'s text describes. Refused: another architecture, a
/// key this reader does not know, or a value of a known key that this model does not
/// implement (biases, dropout, rotary scaling, interleaved rotary pairs, an activation other
/// than SiLU, a sliding window); each error names the key.
pub fn parse_config(text: &str) -> Result<LlamaSpec> {
    let bad = |msg: String| Error::Spec(format!("config.json: {msg}"));
    let value: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Value::Object(cfg) = value else {
        return Err(bad("not a JSON object".into()));
    };
    if let Some(key) = cfg
        .keys()
        .find(|k| !IGNORED_KEYS.contains(&k.as_str()) && !READ_KEYS.contains(&k.as_str()))
    {
        return Err(bad(format!(
            "key `{key}` is not one p2ptrain's Llama reads; refused rather than ignored, \
             since it may change the computation"
        )));
    }
    match cfg.get("model_type").and_then(Value::as_str) {
        Some("llama") => {}
        other => {
            return Err(bad(format!(
                "model_type {other:?}: p2ptrain reads \"llama\" models"
            )))
        }
    }
    if let Some(archs) = cfg.get("architectures") {
        let names: Vec<&str> = archs
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if names != ["LlamaForCausalLM"] {
            return Err(bad(format!(
                "architectures {archs}: p2ptrain reads [\"LlamaForCausalLM\"]"
            )));
        }
    }
    let size = |key: &str| -> Result<Option<usize>> {
        match cfg.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad(format!("`{key}` is {v}, not a whole number"))),
        }
    };
    let required = |key: &str| -> Result<usize> {
        size(key)?.ok_or_else(|| bad(format!("`{key}` is missing")))
    };
    let float = |key: &str, value: Option<&Value>| -> Result<Option<f64>> {
        match value {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad(format!("`{key}` is {v}, not a number"))),
        }
    };
    // Keys this model implements only at one value: present at another, refused.
    let must_be = |key: &str, allowed: &[Value]| -> Result<()> {
        match cfg.get(key) {
            Some(v) if !allowed.contains(v) => Err(bad(format!(
                "`{key}` is {v}; p2ptrain's Llama implements only {}",
                allowed
                    .iter()
                    .map(Value::to_string)
                    .collect::<Vec<_>>()
                    .join(" or ")
            ))),
            _ => Ok(()),
        }
    };
    must_be("attention_bias", &[json!(false)])?;
    must_be("mlp_bias", &[json!(false)])?;
    must_be("attention_dropout", &[json!(0.0), json!(0)])?;
    must_be("hidden_act", &[json!("silu")])?;
    must_be("rope_scaling", &[Value::Null])?;
    must_be("rope_interleaved", &[json!(false)])?;
    must_be("sliding_window", &[Value::Null])?;
    // transformers 5 writes the rotary settings as `rope_parameters`; 4.x as `rope_theta`
    // (and `rope_scaling`).
    let mut rope_theta = float("rope_theta", cfg.get("rope_theta"))?;
    if let Some(params) = cfg.get("rope_parameters").filter(|v| !v.is_null()) {
        let Value::Object(params) = params else {
            return Err(bad(format!("`rope_parameters` is {params}, not an object")));
        };
        rope_theta = rope_parameters(params, rope_theta).map_err(bad)?;
    }
    let hidden = required("hidden_size")?;
    let heads = required("num_attention_heads")?;
    let head_dim = match size("head_dim")? {
        Some(d) => d,
        None if heads > 0 && hidden.is_multiple_of(heads) => hidden / heads,
        None => {
            return Err(bad(format!(
                "no `head_dim`, and hidden_size {hidden} is not a multiple of {heads} heads"
            )))
        }
    };
    let tied = match cfg.get("tie_word_embeddings") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(format!(
                "`tie_word_embeddings` is {v}, not true or false"
            )))
        }
    };
    let spec = LlamaSpec {
        vocab: required("vocab_size")?,
        // transformers' LlamaConfig defaults.
        context: size("max_position_embeddings")?.unwrap_or(2048),
        hidden,
        intermediate: required("intermediate_size")?,
        layers: required("num_hidden_layers")?,
        heads,
        kv_heads: size("num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        rms_eps: float("rms_norm_eps", cfg.get("rms_norm_eps"))?.unwrap_or(1e-6),
        rope_theta: rope_theta.unwrap_or(10_000.0),
        tied,
    };
    spec.validate().map_err(|e| bad(e.to_string()))?;
    Ok(spec)
}

/// The base in transformers 5's `rope_parameters` (only `rope_type` "default" is
/// implemented); `theta`, the top-level `rope_theta` where one was given, must agree.
fn rope_parameters(
    params: &Map<String, Value>,
    theta: Option<f64>,
) -> std::result::Result<Option<f64>, String> {
    for (key, v) in params {
        match key.as_str() {
            "rope_type" if v == "default" => {}
            "rope_theta" => {}
            _ => {
                return Err(format!(
                    "`rope_parameters.{key}` is {v}; p2ptrain's Llama implements the \
                     default rotary embedding only (rope_type \"default\", a rope_theta)"
                ))
            }
        }
    }
    let Some(v) = params.get("rope_theta") else {
        return Ok(theta);
    };
    let base = v
        .as_f64()
        .ok_or_else(|| format!("`rope_parameters.rope_theta` is {v}, not a number"))?;
    match theta {
        Some(t) if t != base => Err(format!(
            "`rope_theta` {t} and `rope_parameters.rope_theta` {base} differ"
        )),
        _ => Ok(Some(base)),
    }
}

/// The spec's `config.json` for `transformers` (`dtype` the weights' stored type:
/// "float32" or "bfloat16"), with the rotary base both as transformers 5 and 4 read it.
pub fn config_json(spec: &LlamaSpec, dtype: &str) -> String {
    let cfg = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.context,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "rope_scaling": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied,
        "torch_dtype": dtype,
        "dtype": dtype,
    });
    // Serialising a `Value` built from literals cannot fail.
    serde_json::to_string_pretty(&cfg).unwrap_or_default()
}

/// The spec of the model in folder `dir`: its `config.json` read (at most 16 MiB) and checked
/// by [`parse_config`], the file named in any error.
pub fn read_config(dir: &Path) -> Result<LlamaSpec> {
    let path = dir.join("config.json");
    let text = read_json(&path)?;
    parse_config(&text).map_err(|e| Error::Format {
        path,
        msg: e.to_string(),
    })
}

/// Reads the model in folder `dir`: its `config.json`, then its weights (one
/// `model.safetensors`, or the shards its `model.safetensors.index.json` names), each
/// converted to `f32`. Every parameter of the spec must be present with its shape and finite
/// values; a tensor the spec has no place for is refused (but for the rotary tables some old
/// checkpoints stored, `*.rotary_emb.inv_freq`, which are computed here).
pub fn read_folder(dir: &Path) -> Result<HfModel> {
    let spec = read_config(dir)?;
    let files = weight_files(dir)?;
    let mut tensors = HashMap::new();
    let mut stored_as = BTreeMap::new();
    for file in &files {
        regular_file(file)?;
        let bytes = std::fs::read(file).map_err(|source| Error::Io {
            path: file.clone(),
            source,
        })?;
        let format = |msg: String| Error::Format {
            path: file.clone(),
            msg,
        };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| format(e.to_string()))?;
        for (name, view) in st.tensors() {
            if name.ends_with(".rotary_emb.inv_freq") {
                continue;
            }
            *stored_as
                .entry(format!("{:?}", view.dtype()))
                .or_insert(0usize) += 1;
            let values = to_f32(&view).map_err(|e| format(format!("{name}: {e}")))?;
            let t = Tensor::from_vec(values, view.shape(), &Device::Cpu)?;
            if tensors.insert(name.clone(), t).is_some() {
                return Err(format(format!("tensor {name} is stored twice")));
            }
        }
    }
    let expected = expected_shapes(&spec)?;
    if let Some(name) = tensors.keys().find(|n| !expected.contains_key(*n)) {
        return Err(Error::Layout(format!(
            "{}: tensor {name} is no parameter of a {} ({})",
            dir.display(),
            spec.name(),
            if spec.tied && name == "lm_head.weight" {
                "its head is tied to the embedding"
            } else {
                "is the config the weights' own?"
            }
        )));
    }
    for (name, shape) in &expected {
        let t = tensors.get(name).ok_or_else(|| {
            Error::Layout(format!("{}: parameter {name} is missing", dir.display()))
        })?;
        if t.dims() != shape.as_slice() {
            return Err(Error::Layout(format!(
                "{}: parameter {name} has shape {:?}, the config says {shape:?}",
                dir.display(),
                t.dims()
            )));
        }
        crate::params::ensure_finite(t, name)?;
    }
    Ok(HfModel {
        spec,
        tensors,
        stored_as: stored_as.into_keys().collect::<Vec<_>>().join("+"),
    })
}

/// Writes `params` (a model of `spec`) into folder `dir` as Hugging Face does: `config.json`
/// and one `model.safetensors` under HF's names, in `f32` or, with `bf16`, rounded to
/// bfloat16 (to nearest, ties to even).
pub fn write_folder(dir: &Path, spec: &LlamaSpec, params: &Params, bf16: bool) -> Result<()> {
    let mut values = HashMap::new();
    for (name, var) in params.vars() {
        let flat = var
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        values.insert(name.clone(), (var.dims().to_vec(), flat));
    }
    write_tensors(
        dir,
        spec,
        |name| values.get(name).map(|(s, v)| (s.as_slice(), v.as_slice())),
        bf16,
    )
}

/// Writes a model of `spec` whose parameter `name` has the shape and values `lookup(name)`
/// gives (a checkpoint's tensors, where optimizer state sits beside them) into folder `dir`,
/// as [`write_folder`] does. Every parameter of the spec must be there with its shape and
/// finite values; nothing else is written.
pub fn write_tensors<'a>(
    dir: &Path,
    spec: &LlamaSpec,
    lookup: impl Fn(&str) -> Option<(&'a [usize], &'a [f32])>,
    bf16: bool,
) -> Result<()> {
    let mut raw: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape) in expected_shapes(spec)? {
        let (got, values) =
            lookup(&name).ok_or_else(|| Error::Layout(format!("parameter {name} is missing")))?;
        if got != shape.as_slice() || values.len() != shape.iter().product::<usize>() {
            return Err(Error::Layout(format!(
                "parameter {name} has shape {got:?} ({} values), a {} has {shape:?}",
                values.len(),
                spec.name()
            )));
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite(format!(
                "{name} {} at index {i}",
                values[i]
            )));
        }
        let bytes: Vec<u8> = if bf16 {
            values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect()
        } else {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        raw.push((name, shape, bytes));
    }
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
    let views = raw
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::Layout(format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    // transformers refuses safetensors files whose metadata does not name their format.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| Error::Layout(format!("serialising the weights: {e}")))?;
    let io = |path: PathBuf| move |source| Error::Io { path, source };
    std::fs::create_dir_all(dir).map_err(io(dir.to_path_buf()))?;
    let weights = dir.join(WEIGHTS);
    std::fs::write(&weights, bytes).map_err(io(weights.clone()))?;
    let config = dir.join("config.json");
    let dtype_name = if bf16 { "bfloat16" } else { "float32" };
    std::fs::write(&config, config_json(spec, dtype_name)).map_err(io(config.clone()))?;
    Ok(())
}

/// Keys of the base folder's `config.json` an export carries into its own: the special token
/// ids generation stops and pads at.
const CARRIED_KEYS: &[&str] = &["bos_token_id", "eos_token_id", "pad_token_id"];
/// Files of the base folder an export carries (where it has no file of that name yet): how
/// tools tokenize and generate with the model.
const CARRIED_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// A Hugging Face folder checked to hold the exported model ([`check_base`]): what
/// [`carry_from_base`] takes, so that nothing carries from an unchecked folder.
#[derive(Debug, Clone)]
pub struct CheckedBase {
    dir: PathBuf,
    /// The base's own spec (its context: its `max_position_embeddings`).
    spec: LlamaSpec,
    /// The exported model's.
    exported: LlamaSpec,
}

/// Checks that the Hugging Face folder `base` holds the model `spec` describes, context aside
/// (a run may train on shorter windows): an export carries only its own base's settings. Run
/// before anything is written, so a wrong base leaves no half-made export behind.
pub fn check_base(base: &Path, spec: &LlamaSpec) -> Result<CheckedBase> {
    let base_spec = read_config(base)?;
    let same_model = LlamaSpec {
        context: spec.context,
        ..base_spec
    } == *spec;
    if !same_model {
        return Err(Error::Format {
            path: base.join("config.json"),
            msg: format!(
                "a {} is not the exported {}: the base must be the folder the run started from",
                base_spec.name(),
                spec.name()
            ),
        });
    }
    Ok(CheckedBase {
        dir: base.to_path_buf(),
        spec: base_spec,
        exported: *spec,
    })
}

/// Completes the export in `dir` (just written by [`write_tensors`] for the checked base's
/// model) with what the Hugging Face folder the run started from says and the weights do not:
/// its special token ids, its `max_position_embeddings` where longer than the run's context (a
/// run may train on shorter windows; rotary positions extend to the base's length as they
/// did), and its generation and tokenizer files (its tokenizer's own files only where
/// `own_tokenizer` is false: an export given another tokenizer keeps that one alone). Returns
/// what it carried, for the user.
pub fn carry_from_base(dir: &Path, base: &CheckedBase, own_tokenizer: bool) -> Result<Vec<String>> {
    let base_config = base.dir.join("config.json");
    let (base_spec, spec) = (&base.spec, &base.exported);
    let parse = |path: &Path| -> Result<Map<String, Value>> {
        match serde_json::from_str(&read_json(path)?) {
            Ok(Value::Object(map)) => Ok(map),
            _ => Err(Error::Format {
                path: path.to_path_buf(),
                msg: "not a JSON object".into(),
            }),
        }
    };
    let base_map = parse(&base_config)?;
    let config_path = dir.join("config.json");
    let mut config = parse(&config_path)?;
    let mut carried = Vec::new();
    for key in CARRIED_KEYS {
        if let Some(v) = base_map.get(*key).filter(|v| !v.is_null()) {
            config.insert(key.to_string(), v.clone());
            carried.push(format!("{key} {v}"));
        }
    }
    if base_spec.context > spec.context {
        config.insert(
            "max_position_embeddings".into(),
            Value::from(base_spec.context),
        );
        carried.push(format!("max_position_embeddings {}", base_spec.context));
    }
    let text = serde_json::to_string_pretty(&Value::Object(config))
        .map_err(|e| Error::Layout(format!("config.json: {e}")))?;
    let io = |path: PathBuf| move |source| Error::Io { path, source };
    std::fs::write(&config_path, text).map_err(io(config_path.clone()))?;
    for file in CARRIED_FILES {
        let tokenizer_file = file.starts_with("tokenizer") || file.starts_with("special_tokens");
        if own_tokenizer && tokenizer_file {
            continue;
        }
        let (from, to) = (base.dir.join(file), dir.join(file));
        if std::fs::symlink_metadata(&from).is_ok() && !to.exists() {
            let text = folder_json(&base.dir, file)?;
            std::fs::write(&to, text).map_err(io(to.clone()))?;
            carried.push((*file).to_string());
        }
    }
    Ok(carried)
}

/// A digest of the model in folder `dir`: its `config.json` and weight files, streamed
/// through SHA-256 (hex, 16 characters). Part of a run's identity where the run starts from
/// the folder: nodes that start from other weights are another run.
pub fn folder_digest(dir: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut h = Sha256::new();
    let mut files = vec![dir.join("config.json")];
    files.extend(weight_files(dir)?);
    let mut buf = vec![0u8; 1 << 20];
    for path in &files {
        let io = |source| Error::Io {
            path: path.clone(),
            source,
        };
        regular_file(path)?;
        let mut file = std::fs::File::open(path).map_err(io)?;
        h.update(
            path.file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or_default(),
        );
        loop {
            let n = file.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(hex::encode(&h.finalize()[..8]))
}

/// Each parameter's name and shape in a model of `spec`, as Hugging Face names them.
pub fn expected_shapes(spec: &LlamaSpec) -> Result<BTreeMap<String, Vec<usize>>> {
    Ok(spec.parameter_shapes().into_iter().collect())
}

/// The weight files of folder `dir`: `model.safetensors`, or the shards the index names
/// (plain file names in `dir`, each once).
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join(WEIGHTS);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index_path = dir.join(INDEX);
    if !index_path.is_file() {
        return Err(Error::Format {
            path: dir.to_path_buf(),
            msg: format!("neither {WEIGHTS} nor {INDEX} is in the folder"),
        });
    }
    let index: Value =
        serde_json::from_str(&read_json(&index_path)?).map_err(|e| Error::Format {
            path: index_path.clone(),
            msg: format!("not JSON: {e}"),
        })?;
    let bad = |msg: String| Error::Format {
        path: index_path.clone(),
        msg,
    };
    let map = index
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("{tensor}: file {file} is not a string")))?;
        let plain = Path::new(file)
            .file_name()
            .is_some_and(|n| n == std::ffi::OsStr::new(file));
        if !plain || !file.ends_with(".safetensors") {
            return Err(bad(format!(
                "{tensor}: {file:?} is not a .safetensors file name in the folder"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

/// The length of `path`, a regular file once links are followed: a FIFO would block the
/// read, a device (`/dev/zero`) stream without end, and both report a length of 0.
fn regular_file(path: &Path) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.is_file() {
        return Err(Error::Format {
            path: path.to_path_buf(),
            msg: "not a regular file (a FIFO, a device or a folder): refused".into(),
        });
    }
    Ok(meta.len())
}

/// A JSON file's text, refused past [`MAX_JSON_BYTES`] (read no further than that, whatever
/// its length said) or where it is no regular file.
fn read_json(path: &Path) -> Result<String> {
    use std::io::Read;
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let too_long = |len: u64| Error::Format {
        path: path.to_path_buf(),
        msg: format!("{len} bytes, past the {MAX_JSON_BYTES} a config or index may have"),
    };
    let len = regular_file(path)?;
    if len > MAX_JSON_BYTES {
        return Err(too_long(len));
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(MAX_JSON_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_JSON_BYTES {
        return Err(too_long(text.len() as u64));
    }
    Ok(text)
}

/// The text of JSON file `name` of Hugging Face folder `dir` (its `tokenizer.json`), as a
/// copy may carry it elsewhere: a regular file inside the folder (or its cache's blobs, see
/// [`links_inside`]), at most [`MAX_JSON_BYTES`], and JSON; anything else is refused.
pub fn folder_json(dir: &Path, name: &str) -> Result<String> {
    let path = dir.join(name);
    links_inside(&path, dir)?;
    let text = read_json(&path)?;
    if serde_json::from_str::<Value>(&text).is_err() {
        return Err(Error::Format {
            path,
            msg: "not JSON: refused, not carried".into(),
        });
    }
    Ok(text)
}

/// Refuses `file` of `folder` where it links outside the folder: a folder fetched from
/// elsewhere may link its `tokenizer.json` to a private key, which an export would carry into
/// what the user uploads. A Hugging Face cache's snapshot (`snapshots/<revision>/`) links
/// each file into the cache's `blobs/`, which counts as inside.
fn links_inside(file: &Path, folder: &Path) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let target = file.canonicalize().map_err(io(file))?;
    let folder = folder.canonicalize().map_err(io(folder))?;
    let blobs = folder
        .parent()
        .filter(|p| p.file_name() == Some(std::ffi::OsStr::new("snapshots")))
        .and_then(Path::parent)
        .map(|cache| cache.join("blobs"));
    if target.starts_with(&folder) || blobs.is_some_and(|b| target.starts_with(b)) {
        return Ok(());
    }
    Err(Error::Format {
        path: file.to_path_buf(),
        msg: format!(
            "links outside the folder (to {}): refused, not carried",
            target.display()
        ),
    })
}

/// A stored tensor's values as `f32`: `F32` as it is, `BF16` and `F16` widened exactly.
fn to_f32(view: &TensorView<'_>) -> std::result::Result<Vec<f32>, String> {
    let data = view.data();
    match view.dtype() {
        Dtype::F32 => Ok(data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()),
        Dtype::BF16 => Ok(data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()),
        Dtype::F16 => Ok(data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()),
        other => Err(format!(
            "stored as {other:?}; p2ptrain reads F32, BF16 and F16 weights"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf-llama-tiny")
    }

    fn fixture_config() -> Value {
        serde_json::from_str(
            &std::fs::read_to_string(fixture().join("config.json")).expect("config"),
        )
        .expect("json")
    }

    #[test]
    fn the_fixtures_config_reads_as_its_shape() {
        let spec = parse_config(&fixture_config().to_string()).expect("spec");
        assert_eq!(
            spec,
            LlamaSpec {
                vocab: 384,
                context: 256,
                hidden: 64,
                intermediate: 128,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                rms_eps: 1e-5,
                rope_theta: 10_000.0,
                tied: false,
            }
        );
        // What this writes reads back as the same spec.
        assert_eq!(
            parse_config(&config_json(&spec, "float32")).expect("again"),
            spec
        );
    }

    #[test]
    fn a_key_or_value_the_model_does_not_implement_is_refused_by_name() {
        let cases: [(&str, Value); 9] = [
            ("attention_bias", json!(true)),
            ("mlp_bias", json!(true)),
            ("hidden_act", json!("gelu")),
            (
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0}),
            ),
            (
                "rope_parameters",
                json!({"rope_type": "yarn", "rope_theta": 10000.0}),
            ),
            ("rope_interleaved", json!(true)),
            ("model_type", json!("qwen2")),
            ("sliding_window", json!(4096)),
            ("some_new_switch", json!(1)),
        ];
        for (key, value) in cases {
            let mut cfg = fixture_config();
            cfg[key] = value;
            let err = parse_config(&cfg.to_string()).expect_err(key).to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
        let mut cfg = fixture_config();
        cfg.as_object_mut().expect("object").remove("hidden_size");
        let err = parse_config(&cfg.to_string())
            .expect_err("missing")
            .to_string();
        assert!(err.contains("hidden_size"), "{err}");
        // transformers 4's layout: a top-level rope_theta, no rope_parameters.
        let mut cfg = fixture_config();
        cfg.as_object_mut()
            .expect("object")
            .remove("rope_parameters");
        cfg["rope_theta"] = json!(500000.0);
        assert_eq!(
            parse_config(&cfg.to_string()).expect("4.x").rope_theta,
            500_000.0
        );
        cfg["rope_parameters"] = json!({"rope_theta": 10000.0, "rope_type": "default"});
        assert!(
            parse_config(&cfg.to_string()).is_err(),
            "two bases that differ"
        );
    }

    /// The expected values `bench/hf_fixture/make_fixture.py` recorded from `transformers`.
    struct Expected {
        input_ids: Tensor,
        logits: Tensor,
        loss: f64,
        logits_bf16: Tensor,
        loss_bf16: f64,
    }

    fn expected() -> Expected {
        let bytes = std::fs::read(fixture().join("expected.safetensors")).expect("expected");
        let st = SafeTensors::deserialize(&bytes).expect("safetensors");
        let tensor = |name: &str| {
            let view = st.tensor(name).expect(name);
            match view.dtype() {
                Dtype::I64 => {
                    let ids: Vec<u32> = view
                        .data()
                        .chunks_exact(8)
                        .map(|b| {
                            let id = i64::from_le_bytes(b.try_into().expect("8 bytes"));
                            u32::try_from(id).expect("a token id")
                        })
                        .collect();
                    Tensor::from_vec(ids, view.shape(), &Device::Cpu).expect("ids")
                }
                Dtype::F64 => {
                    let v: Vec<f64> = view
                        .data()
                        .chunks_exact(8)
                        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .collect();
                    Tensor::from_vec(v, view.shape(), &Device::Cpu).expect("f64")
                }
                _ => Tensor::from_vec(to_f32(&view).expect("f32"), view.shape(), &Device::Cpu)
                    .expect("f32"),
            }
        };
        let scalar = |name: &str| {
            tensor(name)
                .flatten_all()
                .expect("flat")
                .to_vec1::<f64>()
                .expect("f64")[0]
        };
        Expected {
            input_ids: tensor("input_ids"),
            logits: tensor("logits"),
            loss: scalar("loss"),
            logits_bf16: tensor("logits_bf16"),
            loss_bf16: scalar("loss_bf16"),
        }
    }

    /// The model in folder `dir`, built and loaded as a run's genesis would be.
    fn load(dir: &Path) -> (crate::llama::Llama, Params) {
        let hf = read_folder(dir).expect("read");
        let mut vars = Vec::new();
        let model = crate::llama::Llama::new(&hf.spec, 0, &Device::Cpu, &mut vars).expect("build");
        let params = Params::new(vars).expect("params");
        params.load(&hf.tensors).expect("load");
        (model, params)
    }

    /// (largest absolute logit difference, relative loss difference) against transformers'.
    fn compare(logits: &Tensor, tokens: &Tensor, want: &Tensor, want_loss: f64) -> (f32, f64) {
        let diff = crate::testing::max_diff(logits, want);
        let loss = crate::llama::next_token_loss(logits, tokens)
            .expect("loss")
            .to_scalar::<f32>()
            .expect("scalar");
        (diff, (f64::from(loss) - want_loss).abs() / want_loss)
    }

    /// The independent check: `transformers`' own logits and loss for the fixture (a briefly
    /// trained tiny Llama with grouped-query attention), matched to 1e-4 and a relative 1e-5.
    /// Measured: see the note of the issue that built it.
    #[test]
    fn the_fixture_gives_transformers_logits_and_loss() {
        let want = expected();
        let (model, _) = load(&fixture());
        let logits = model.forward(&want.input_ids).expect("forward");
        let (diff, loss) = compare(&logits, &want.input_ids, &want.logits, want.loss);
        eprintln!("f32 fixture: logits within {diff:e}, loss within {loss:e} (relative)");
        assert!(diff <= 1e-4, "logits differ by {diff}");
        assert!(loss <= 1e-5, "loss differs by {loss} (relative)");
        // The bf16 copy, sharded: widened to f32 on import, it gives transformers' logits of
        // the same bf16 weights.
        let (model, _) = load(&fixture().join("bf16"));
        let logits = model.forward(&want.input_ids).expect("forward");
        let (diff, loss) = compare(&logits, &want.input_ids, &want.logits_bf16, want.loss_bf16);
        eprintln!("bf16 shards: logits within {diff:e}, loss within {loss:e} (relative)");
        assert!(diff <= 1e-4 && loss <= 1e-5, "bf16: {diff} {loss}");
    }

    /// The comparison can fail: the other rotary layout (pairs `2i`, `2i + 1`), as a
    /// converter that forgot Hugging Face's permutation of the query and key weights would
    /// compute, is far from transformers' logits.
    #[test]
    fn a_wrong_rotary_layout_fails_the_comparison() {
        let want = expected();
        let (model, _) = load(&fixture());
        let logits = model
            .forward_with(&want.input_ids, crate::llama::Rotary::Interleaved)
            .expect("forward");
        let (diff, loss) = compare(&logits, &want.input_ids, &want.logits, want.loss);
        eprintln!("interleaved rotary: logits off by {diff}, loss by {loss} (relative)");
        assert!(diff > 1.0 && loss > 1e-3, "{diff} {loss}");
    }

    /// An export (f32) reads back as the same tensors under HF's names and shapes, to
    /// identical logits; a bf16 export to the bf16-rounded weights, within bf16's precision.
    #[test]
    fn an_export_re_imports_to_identical_logits() {
        let want = expected();
        let (model, params) = load(&fixture());
        let logits = model.forward(&want.input_ids).expect("forward");
        let dir = tempfile::tempdir().expect("tmp");
        let spec = *model.spec();
        write_folder(dir.path(), &spec, &params, false).expect("export");
        let (again, again_params) = load(dir.path());
        assert_eq!(again.spec(), &spec);
        assert_eq!(again_params.layout(), params.layout());
        assert_eq!(
            again_params.flatten().expect("f"),
            params.flatten().expect("f")
        );
        let relogits = again.forward(&want.input_ids).expect("forward");
        assert_eq!(crate::testing::max_diff(&logits, &relogits), 0.0);
        // The names and shapes are the fixture's own, as transformers wrote them.
        let theirs = std::fs::read(fixture().join(WEIGHTS)).expect("fixture weights");
        let ours = std::fs::read(dir.path().join(WEIGHTS)).expect("our weights");
        let shapes = |bytes: &[u8]| -> BTreeMap<String, Vec<usize>> {
            SafeTensors::deserialize(bytes)
                .expect("st")
                .tensors()
                .into_iter()
                .map(|(n, v)| (n, v.shape().to_vec()))
                .collect()
        };
        assert_eq!(shapes(&ours), shapes(&theirs));
        let bf16_dir = tempfile::tempdir().expect("tmp");
        write_folder(bf16_dir.path(), &spec, &params, true).expect("bf16 export");
        // `P2PTRAIN_HF_EXPORT_DIR=DIR` keeps both exports (DIR/f32, DIR/bf16) for
        // `bench/hf_fixture/check_export.py`, which loads them with transformers.
        if let Some(keep) = std::env::var_os("P2PTRAIN_HF_EXPORT_DIR") {
            let keep = PathBuf::from(keep);
            write_folder(&keep.join("f32"), &spec, &params, false).expect("kept f32 export");
            write_folder(&keep.join("bf16"), &spec, &params, true).expect("kept bf16 export");
        }
        let (rounded, _) = load(bf16_dir.path());
        let rounded_logits = rounded.forward(&want.input_ids).expect("forward");
        let (diff, _) = compare(
            &rounded_logits,
            &want.input_ids,
            &want.logits_bf16,
            want.loss_bf16,
        );
        assert!(diff <= 1e-4, "our bf16 rounding is transformers': {diff}");
    }

    /// An export of a run that started from a folder and trained on shorter windows carries
    /// the folder's special token ids, its longer context and its generation and tokenizer
    /// files, and still reads back as the same model; a base of another model is refused.
    #[test]
    fn an_export_carries_the_base_folders_token_ids_context_and_files() {
        let (model, params) = load(&fixture());
        let base = tempfile::tempdir().expect("tmp");
        let mut config = fixture_config();
        config["bos_token_id"] = json!(1);
        config["eos_token_id"] = json!(2);
        std::fs::write(base.path().join("config.json"), config.to_string()).expect("config");
        for file in ["generation_config.json", "tokenizer.json"] {
            std::fs::copy(fixture().join(file), base.path().join(file)).expect("copy");
        }
        let trained = LlamaSpec {
            context: 64,
            ..*model.spec()
        };
        let dir = tempfile::tempdir().expect("tmp");
        write_folder(dir.path(), &trained, &params, false).expect("export");
        let checked = check_base(base.path(), &trained).expect("the same model");
        let carried = carry_from_base(dir.path(), &checked, false).expect("carry");
        assert_eq!(
            carried,
            [
                "bos_token_id 1",
                "eos_token_id 2",
                "max_position_embeddings 256",
                "generation_config.json",
                "tokenizer.json"
            ]
        );
        let exported: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("config.json")).expect("read"),
        )
        .expect("json");
        assert_eq!(exported["eos_token_id"], json!(2));
        let (again, again_params) = load(dir.path());
        assert_eq!(again.spec(), model.spec(), "context 256 again");
        assert_eq!(
            again_params.flatten().expect("f"),
            params.flatten().expect("f")
        );
        // Given a tokenizer of its own, the export keeps it alone: none of the base's
        // tokenizer files come along.
        let own = tempfile::tempdir().expect("tmp");
        write_folder(own.path(), &trained, &params, false).expect("export");
        let carried = carry_from_base(own.path(), &checked, true).expect("carry");
        assert!(
            !carried.iter().any(|c| c.starts_with("tokenizer")),
            "{carried:?}"
        );
        assert!(!own.path().join("tokenizer.json").exists());
        let other = LlamaSpec {
            layers: 3,
            ..trained
        };
        let e = check_base(base.path(), &other)
            .expect_err("another model")
            .to_string();
        assert!(e.contains("the folder the run started from"), "{e}");
    }

    /// A folder a user fetched from elsewhere may hold links and special files. A carried
    /// file linking out of the folder (a `tokenizer.json` pointing at a private key) is refused,
    /// not copied into the export the user then uploads; one linking into a Hugging Face cache's
    /// `blobs` beside the snapshot is carried; a config that is a FIFO, and a shard linking to
    /// `/dev/zero`, are refused at once instead of blocking or streaming without end.
    #[cfg(unix)]
    #[test]
    fn links_out_of_a_folder_and_special_files_are_refused() {
        use std::os::unix::fs::symlink;
        let (model, params) = load(&fixture());
        let spec = *model.spec();
        // A Hugging Face cache: snapshots/<rev>/ whose files link to ../../blobs/.
        let cache = tempfile::tempdir().expect("tmp");
        let (blobs, base) = (
            cache.path().join("blobs"),
            cache.path().join("snapshots/abc"),
        );
        std::fs::create_dir_all(&blobs).expect("blobs");
        std::fs::create_dir_all(&base).expect("snapshot");
        for file in ["config.json", "generation_config.json"] {
            std::fs::copy(fixture().join(file), blobs.join(file)).expect("blob");
            symlink(Path::new("../../blobs").join(file), base.join(file)).expect("link");
        }
        let secret = cache.path().join("id_ed25519");
        std::fs::write(&secret, "-----BEGIN OPENSSH PRIVATE KEY-----\n").expect("secret");
        symlink(&secret, base.join("tokenizer.json")).expect("link");
        let checked = check_base(&base, &spec).expect("the same model");
        let out = tempfile::tempdir().expect("tmp");
        write_folder(out.path(), &spec, &params, false).expect("export");
        let e = carry_from_base(out.path(), &checked, false)
            .expect_err("a link out of the folder")
            .to_string();
        assert!(e.contains("tokenizer.json") && e.contains("outside"), "{e}");
        let leaked = std::fs::read_to_string(out.path().join("tokenizer.json")).unwrap_or_default();
        assert!(
            !leaked.contains("PRIVATE KEY"),
            "the key went into the export"
        );
        // Without the bad link, the cache's linked files are carried.
        std::fs::remove_file(base.join("tokenizer.json")).expect("rm");
        let out = tempfile::tempdir().expect("tmp");
        write_folder(out.path(), &spec, &params, false).expect("export");
        let carried = carry_from_base(out.path(), &checked, false).expect("carry");
        assert!(
            carried.iter().any(|c| c == "generation_config.json"),
            "{carried:?}"
        );
        // A FIFO in place of config.json, a shard linking to /dev/zero.
        let odd = tempfile::tempdir().expect("tmp");
        let made = std::process::Command::new("mkfifo")
            .arg(odd.path().join("config.json"))
            .status()
            .expect("mkfifo");
        assert!(made.success());
        let e = read_config(odd.path()).expect_err("a FIFO").to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(odd.path().join("config.json")).expect("rm");
        std::fs::copy(
            fixture().join("config.json"),
            odd.path().join("config.json"),
        )
        .expect("cfg");
        std::fs::write(
            odd.path().join(INDEX),
            r#"{"weight_map": {"model.norm.weight": "zero.safetensors"}}"#,
        )
        .expect("index");
        symlink("/dev/zero", odd.path().join("zero.safetensors")).expect("link");
        let e = folder_digest(odd.path())
            .expect_err("/dev/zero")
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_shard_index_naming_a_path_outside_the_folder_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::write(
            dir.path().join(INDEX),
            r#"{"weight_map": {"model.norm.weight": "../../etc/model.safetensors"}}"#,
        )
        .expect("index");
        let err = weight_files(dir.path()).expect_err("traversal").to_string();
        assert!(err.contains("not a .safetensors file name"), "{err}");
    }
}
