//! The checkpoint file format: a standard safetensors file holding the parameters under their
//! own names, the optimizer state under `optim.*` names, and metadata with a checksum.
//!
//! Any safetensors reader can open a checkpoint. The checksum (SHA-256 over the metadata that
//! matters and every tensor's name, shape and bytes, in name order) lets a node tell a torn or
//! tampered file from a good one before it loads a single value.

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Value of the `format` metadata key; bump when the layout of the file changes.
pub const FORMAT: &str = "p2ptrain-checkpoint/1";

/// A tensor copied to the CPU: shape and row-major `f32` values.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f32>,
}

/// What the trainer knows about the state it snapshots (everything but the tensors).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateInfo {
    /// Run identity the state belongs to.
    pub run_id: String,
    /// Hash of the full configuration that produced it.
    pub config_hash: String,
    /// Hash of the parameter layout (names and shapes).
    pub layout_hash: String,
    /// Model name, e.g. `mlp-64-128-10`.
    pub model: String,
    /// Optimizer kind, `sgd` or `adamw`.
    pub optimizer: String,
    /// Training steps taken.
    pub step: u64,
    /// Samples this node has trained on (also the data sampler's position).
    pub samples_seen: u64,
    /// Optimizer steps taken (AdamW's bias correction depends on it).
    pub optimizer_steps: u64,
}

/// A consistent copy of a node's training state, taken between two steps.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Counters and identities.
    pub info: StateInfo,
    /// Parameters and optimizer buffers, sorted by name.
    pub tensors: BTreeMap<String, HostTensor>,
}

/// The index entry of one checkpoint file, also stored in the file's metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Sequence number: larger is newer. The id users type.
    pub id: u64,
    /// The state's counters and identities.
    #[serde(flatten)]
    pub info: StateInfo,
    /// Seconds since the Unix epoch when it was written.
    pub created_unix: u64,
    /// SHA-256 (hex) over metadata and tensors; see the module docs.
    pub checksum: String,
    /// File name inside the checkpoint directory.
    pub file: String,
    /// File size in bytes.
    pub bytes: u64,
}

/// Why a checkpoint file cannot be trusted.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Not a safetensors file, or a truncated one.
    #[error("not a readable safetensors file ({0})")]
    Unreadable(String),
    /// Readable, but missing p2ptrain metadata or of another format version.
    #[error("bad metadata: {0}")]
    Metadata(String),
    /// The checksum does not match the content: the file is torn or was altered.
    #[error("checksum mismatch (file says {expected}, content hashes to {actual})")]
    Checksum {
        /// Checksum recorded in the file.
        expected: String,
        /// Checksum of what the file actually holds.
        actual: String,
    },
}

/// The file name for checkpoint `id`: zero-padded so names sort like ids.
pub fn file_name(id: u64) -> String {
    format!("ckpt-{id:08}.safetensors")
}

/// Parses the id back out of a checkpoint file name.
pub fn id_from_file_name(name: &str) -> Option<u64> {
    name.strip_prefix("ckpt-")?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

fn checksum(id: u64, info: &StateInfo, tensors: &[(&str, &[usize], &[u8])]) -> String {
    let mut h = Sha256::new();
    h.update(FORMAT.as_bytes());
    h.update(id.to_le_bytes());
    for field in [
        &info.run_id,
        &info.config_hash,
        &info.layout_hash,
        &info.model,
        &info.optimizer,
    ] {
        h.update(field.as_bytes());
        h.update([0]);
    }
    for n in [info.step, info.samples_seen, info.optimizer_steps] {
        h.update(n.to_le_bytes());
    }
    for (name, shape, data) in tensors {
        h.update(name.as_bytes());
        h.update([0]);
        h.update((shape.len() as u64).to_le_bytes());
        for d in *shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update((data.len() as u64).to_le_bytes());
        h.update(data);
    }
    hex::encode(h.finalize())
}

/// Serialises a snapshot as checkpoint `id`; returns the file bytes and its index entry.
pub fn encode(
    snapshot: &Snapshot,
    id: u64,
    created_unix: u64,
) -> Result<(Vec<u8>, CheckpointMeta), CheckpointError> {
    let raw: Vec<(&str, &[usize], Vec<u8>)> = snapshot
        .tensors
        .iter()
        .map(|(name, t)| {
            let bytes = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.as_str(), t.shape.as_slice(), bytes)
        })
        .collect();
    let views: Vec<(&str, &[usize], &[u8])> =
        raw.iter().map(|(n, s, b)| (*n, *s, b.as_slice())).collect();
    let sum = checksum(id, &snapshot.info, &views);
    let mut meta = CheckpointMeta {
        id,
        info: snapshot.info.clone(),
        created_unix,
        checksum: sum,
        file: file_name(id),
        bytes: 0,
    };
    let mut header = HashMap::new();
    header.insert("format".to_string(), FORMAT.to_string());
    for (k, v) in meta_to_strings(&meta) {
        header.insert(k, v);
    }
    let tensor_views = views
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.to_vec(), data)
                .map(|v| (name.to_string(), v))
                .map_err(|e| CheckpointError::Unreadable(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = safetensors::serialize(tensor_views, Some(header))
        .map_err(|e| CheckpointError::Unreadable(e.to_string()))?;
    meta.bytes = bytes.len() as u64;
    Ok((bytes, meta))
}

fn meta_to_strings(meta: &CheckpointMeta) -> Vec<(String, String)> {
    let i = &meta.info;
    vec![
        ("id".into(), meta.id.to_string()),
        ("run_id".into(), i.run_id.clone()),
        ("config_hash".into(), i.config_hash.clone()),
        ("layout_hash".into(), i.layout_hash.clone()),
        ("model".into(), i.model.clone()),
        ("optimizer".into(), i.optimizer.clone()),
        ("step".into(), i.step.to_string()),
        ("samples_seen".into(), i.samples_seen.to_string()),
        ("optimizer_steps".into(), i.optimizer_steps.to_string()),
        ("created_unix".into(), meta.created_unix.to_string()),
        ("checksum".into(), meta.checksum.clone()),
    ]
}

/// Parses and verifies checkpoint bytes. Nothing is returned unless the checksum matches.
pub fn decode(
    bytes: &[u8],
    file: &str,
) -> Result<(CheckpointMeta, BTreeMap<String, HostTensor>), CheckpointError> {
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Unreadable(e.to_string()))?;
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| CheckpointError::Unreadable(e.to_string()))?;
    let md = header
        .metadata()
        .as_ref()
        .ok_or_else(|| CheckpointError::Metadata("no __metadata__ section".into()))?;
    let get = |k: &str| {
        md.get(k)
            .cloned()
            .ok_or_else(|| CheckpointError::Metadata(format!("missing key {k}")))
    };
    let num = |k: &str| -> Result<u64, CheckpointError> {
        get(k)?
            .parse()
            .map_err(|_| CheckpointError::Metadata(format!("{k} is not a number")))
    };
    let format = get("format")?;
    if format != FORMAT {
        return Err(CheckpointError::Metadata(format!(
            "format {format:?}, this node reads {FORMAT:?}"
        )));
    }
    let info = StateInfo {
        run_id: get("run_id")?,
        config_hash: get("config_hash")?,
        layout_hash: get("layout_hash")?,
        model: get("model")?,
        optimizer: get("optimizer")?,
        step: num("step")?,
        samples_seen: num("samples_seen")?,
        optimizer_steps: num("optimizer_steps")?,
    };
    let id = num("id")?;
    let expected = get("checksum")?;
    let mut named = st.tensors();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in &named {
        if view.dtype() != Dtype::F32 {
            return Err(CheckpointError::Metadata(format!(
                "tensor {name} is {:?}, expected F32",
                view.dtype()
            )));
        }
    }
    let views: Vec<(&str, &[usize], &[u8])> = named
        .iter()
        .map(|(n, v)| (n.as_str(), v.shape(), v.data()))
        .collect();
    let actual = checksum(id, &info, &views);
    if actual != expected {
        return Err(CheckpointError::Checksum { expected, actual });
    }
    let tensors = named
        .iter()
        .map(|(name, v)| {
            let values = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (
                name.clone(),
                HostTensor {
                    shape: v.shape().to_vec(),
                    values,
                },
            )
        })
        .collect();
    let meta = CheckpointMeta {
        id,
        info,
        created_unix: num("created_unix")?,
        checksum: expected,
        file: file.to_string(),
        bytes: bytes.len() as u64,
    };
    Ok((meta, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Snapshot {
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "fc0.weight".into(),
            HostTensor {
                shape: vec![2, 2],
                values: vec![1.0, -2.0, 3.5, 0.0],
            },
        );
        tensors.insert(
            "optim.momentum.fc0.weight".into(),
            HostTensor {
                shape: vec![2, 2],
                values: vec![0.1; 4],
            },
        );
        Snapshot {
            info: StateInfo {
                run_id: "r".into(),
                config_hash: "c".into(),
                layout_hash: "l".into(),
                model: "mlp-2-2".into(),
                optimizer: "sgd".into(),
                step: 10,
                samples_seen: 320,
                optimizer_steps: 10,
            },
            tensors,
        }
    }

    #[test]
    fn round_trip() {
        let snap = sample();
        let (bytes, meta) = encode(&snap, 3, 99).expect("encode");
        let (back, tensors) = decode(&bytes, &meta.file).expect("decode");
        assert_eq!(back, meta);
        assert_eq!(tensors, snap.tensors);
    }

    #[test]
    fn truncation_and_bit_flips_are_detected() {
        let (bytes, meta) = encode(&sample(), 3, 99).expect("encode");
        for cut in [bytes.len() - 1, bytes.len() / 2, 8, 0] {
            assert!(decode(&bytes[..cut], &meta.file).is_err(), "cut at {cut}");
        }
        let mut flipped = bytes.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 0x40;
        assert!(matches!(
            decode(&flipped, &meta.file),
            Err(CheckpointError::Checksum { .. })
        ));
    }

    #[test]
    fn file_names_round_trip() {
        assert_eq!(id_from_file_name(&file_name(42)), Some(42));
        assert_eq!(id_from_file_name("ckpt-x.safetensors"), None);
    }
}
