//! A Llama checkpoint written as a Hugging Face folder (`config.json` and `model.safetensors`
//! under HF's names, `f32` or `bf16`), which `transformers`, llama.cpp's converter and vLLM
//! read: for `p2ptrain export` (a checkpoint file, offline) and `p2ptrain checkpoint export
//! --hf` (a running node's).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use p2ptrain_daemon::checkpoint::HostTensor;
use p2ptrain_models::hf;
use p2ptrain_models::llama::LlamaSpec;

/// Writes the parameters of a checkpoint of model `model` (its name, as the checkpoint
/// records it) into the folder `out` (new or empty), with `tokenizer` copied beside them
/// where given, and what the run's starting folder `base` says that the weights do not (see
/// [`hf::carry_from_base`]).
pub(crate) fn write(
    model: &str,
    tensors: &BTreeMap<String, HostTensor>,
    out: &Path,
    bf16: bool,
    tokenizer: Option<&Path>,
    base: Option<&Path>,
) -> Result<()> {
    let spec = LlamaSpec::from_name(model).ok_or_else(|| {
        anyhow!("a checkpoint of a {model}: only a llama exports to Hugging Face's format")
    })?;
    if out.exists()
        && std::fs::read_dir(out)
            .with_context(|| format!("{} is not a folder", out.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} is not empty (an export never overwrites)",
            out.display()
        );
    }
    // A wrong base is refused before anything is written.
    let base = base
        .map(|dir| {
            hf::check_base(dir, &spec)
                .map(|checked| (dir, checked))
                .with_context(|| format!("--base {}", dir.display()))
        })
        .transpose()?;
    hf::write_tensors(
        out,
        &spec,
        |name| {
            tensors
                .get(name)
                .map(|t| (t.shape.as_slice(), t.values.as_slice()))
        },
        bf16,
    )
    .with_context(|| format!("writing {}", out.display()))?;
    if let Some(t) = tokenizer {
        std::fs::copy(t, out.join("tokenizer.json"))
            .with_context(|| format!("copying {} into the folder", t.display()))?;
    }
    if let Some((dir, checked)) = base {
        let carried = hf::carry_from_base(out, &checked, tokenizer.is_some())
            .with_context(|| format!("carrying {} into the export", dir.display()))?;
        println!(
            "carried from {}: {}",
            dir.display(),
            if carried.is_empty() {
                "nothing (no token ids, longer context or tokenizer files there)".to_string()
            } else {
                carried.join(", ")
            }
        );
    }
    Ok(())
}
