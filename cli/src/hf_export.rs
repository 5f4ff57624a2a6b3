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
    // Written whole into a hidden folder beside `out`, flushed, then renamed into place: an
    // export that fails or is killed leaves no half-written `out` for a re-run to refuse as
    // not empty (a killed one leaves the hidden folder, which the next export clears).
    let staging = staging_folder(out)?;
    let written = write_into(&spec, tensors, &staging, bf16, tokenizer, base)
        .and_then(|()| flush_folder(&staging))
        .and_then(|()| {
            if out.exists() {
                // Empty, as checked above: the rename replaces it.
                std::fs::remove_dir(out)
                    .with_context(|| format!("replacing the empty folder {}", out.display()))?;
            }
            std::fs::rename(&staging, out)
                .with_context(|| format!("moving the export into {}", out.display()))?;
            p2ptrain_daemon::atomic_file::flush_folder_of(out)
                .with_context(|| format!("flushing the folder of {}", out.display()))
        });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    written
}

/// The hidden folder an export to `out` is written in first (`.NAME.partial` beside it), empty:
/// what a killed export left there is cleared.
fn staging_folder(out: &Path) -> Result<std::path::PathBuf> {
    let name = out
        .file_name()
        .ok_or_else(|| anyhow!("{} names no folder", out.display()))?;
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let staging = parent.join(format!(".{}.partial", name.to_string_lossy()));
    if std::fs::symlink_metadata(&staging).is_ok() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("clearing {}", staging.display()))?;
    }
    std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    Ok(staging)
}

/// Flushes every file of `dir` and then `dir` itself to disk, so that the rename publishes
/// contents that a power cut does not take back.
fn flush_folder(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("flushing {}", path.display()))?;
    }
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("flushing {}", dir.display()))
}

/// The export's files, written into `out`.
fn write_into(
    spec: &LlamaSpec,
    tensors: &BTreeMap<String, HostTensor>,
    out: &Path,
    bf16: bool,
    tokenizer: Option<&Path>,
    base: Option<(&Path, hf::CheckedBase)>,
) -> Result<()> {
    hf::write_tensors(
        out,
        spec,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A small llama's parameters, every value 0.01.
    fn tensors(spec: &LlamaSpec) -> BTreeMap<String, HostTensor> {
        hf::expected_shapes(spec)
            .expect("shapes")
            .into_iter()
            .map(|(name, shape)| {
                let values = vec![0.01; shape.iter().product()];
                (name, HostTensor { shape, values })
            })
            .collect()
    }

    /// An export that fails part way (here: the tokenizer to copy is missing, after the
    /// weights were written) leaves no folder behind, nor its hidden staging folder, so the
    /// same export run again is not refused as "not empty"; one that succeeds has the files.
    #[test]
    fn a_failed_export_leaves_no_torn_folder_and_a_rerun_succeeds() {
        let name = "llama-v384-c64-l2-w64-i128-h4-k2-d16-e0.00001-r10000";
        let spec = LlamaSpec::from_name(name).expect("spec");
        let tensors = tensors(&spec);
        let root = tempfile::tempdir().expect("tmp");
        let out = root.path().join("export");
        let missing = root.path().join("no-tokenizer.json");
        let err = write(name, &tensors, &out, false, Some(&missing), None)
            .expect_err("a missing tokenizer");
        assert!(format!("{err:#}").contains("no-tokenizer.json"), "{err:#}");
        let left: Vec<_> = std::fs::read_dir(root.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        write(name, &tensors, &out, true, None, None).expect("the export again");
        for file in ["config.json", "model.safetensors"] {
            assert!(out.join(file).is_file(), "{file}");
        }
        let left: Vec<_> = std::fs::read_dir(root.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("export")]);
    }
}
