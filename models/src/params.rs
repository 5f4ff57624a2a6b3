//! The parameters of a model as one name-sorted list, and its flat `f32` view.
//!
//! Every node of a run must agree on which number is which: an update computed on one node is
//! applied by position on another. So the canonical order is the parameter names sorted
//! bytewise, never a hash-map order, and the [`Layout`] (names and shapes in that order) is
//! hashed into the run identity.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Storage, Tensor, Var};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The digest status shows for a parameter vector: the first 8 bytes of SHA-256 over its
/// little-endian values, in hex.
pub fn params_digest(values: &[f32]) -> String {
    // Fed in blocks: one `update` per value cost ~10 ms a round on the 0.83 M GPT.
    let mut h = Sha256::new();
    let mut block = Vec::with_capacity(4 * 4096);
    for chunk in values.chunks(4096) {
        block.clear();
        for v in chunk {
            block.extend_from_slice(&v.to_le_bytes());
        }
        h.update(&block);
    }
    hex::encode(&h.finalize()[..8])
}

/// The L2 norm of a flat vector, summed in `f64` so that 200k `f32` squares lose nothing:
/// parameter norms bound neighbours' updates, and residual norms show what is still owed.
/// Eight running partial sums, so the loop vectorises (a lone node's trainer takes the norm
/// of its parameters at every publish).
pub fn l2_norm(values: &[f32]) -> f64 {
    let square = |v: f32| f64::from(v) * f64::from(v);
    let mut lanes = [0f64; 8];
    let chunks = values.chunks_exact(8);
    let rest: f64 = chunks.remainder().iter().map(|&v| square(v)).sum();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += square(v);
        }
    }
    (lanes.iter().sum::<f64>() + rest).sqrt()
}

/// Names and shapes of a model's parameters in canonical (name-sorted) order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// `(name, shape)` pairs, sorted by name.
    pub entries: Vec<(String, Vec<usize>)>,
}

impl Layout {
    /// Total number of scalar parameters.
    pub fn numel(&self) -> usize {
        self.entries
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// A short stable fingerprint of the layout, part of what nodes compare before trusting
    /// each other's tensors.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for (name, shape) in &self.entries {
            h.update(name.as_bytes());
            h.update([0]);
            for d in shape {
                h.update((*d as u64).to_le_bytes());
            }
            h.update([0xff]);
        }
        hex::encode(&h.finalize()[..8])
    }
}

/// A model's trainable variables, sorted by name. Cloning shares the underlying storage.
#[derive(Debug, Clone)]
pub struct Params {
    vars: Vec<(String, Var)>,
}

impl Params {
    /// Builds the set from named variables, sorting them into canonical order. Duplicate names
    /// are a programming error in a model definition and are refused.
    pub fn new(mut vars: Vec<(String, Var)>) -> Result<Params> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = vars.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::Spec(format!("duplicate parameter name {}", w[0].0)));
        }
        Ok(Params { vars })
    }

    /// The variables in canonical order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Looks a variable up by name.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()
            .map(|i| &self.vars[i].1)
    }

    /// Names and shapes in canonical order.
    pub fn layout(&self) -> Layout {
        Layout {
            entries: self
                .vars
                .iter()
                .map(|(n, v)| (n.clone(), v.dims().to_vec()))
                .collect(),
        }
    }

    /// Total number of scalar parameters.
    pub fn numel(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// All parameters as one `f32` vector in canonical order (copied to the CPU).
    pub fn flatten(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.numel());
        for (_, v) in &self.vars {
            extend_flat(&mut out, v.as_tensor())?;
        }
        Ok(out)
    }

    /// Every parameter's gradient in `grads` as one `f32` vector in canonical order (a
    /// parameter without a gradient counts as zeros): what the members of a `ddp` mesh sum in
    /// their ring before each optimizer step.
    pub fn flatten_grads(&self, grads: &GradStore) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.numel());
        for (_, v) in &self.vars {
            match grads.get(v.as_tensor()) {
                Some(g) => extend_flat(&mut out, g)?,
                None => out.resize(out.len() + v.elem_count(), 0.0),
            }
        }
        Ok(out)
    }

    /// Replaces every parameter's gradient in `grads` by its part of `flat` (canonical order,
    /// as [`Params::flatten_grads`] gives it). The length and finiteness are checked first, so
    /// a bad vector changes nothing.
    pub fn replace_grads(&self, grads: &mut GradStore, flat: &[f32]) -> Result<()> {
        for ((_, v), g) in self.vars.iter().zip(self.split_flat(flat, "gradient")?) {
            grads.insert(v.as_tensor(), g);
        }
        Ok(())
    }

    /// Overwrites every parameter from a flat vector in canonical order. The length is checked
    /// first and non-finite values are refused, so a bad vector changes nothing.
    pub fn write_back(&self, flat: &[f32]) -> Result<()> {
        for ((_, v), t) in self
            .vars
            .iter()
            .zip(self.split_flat(flat, "parameter vector")?)
        {
            v.set(&t)?;
        }
        Ok(())
    }

    /// `flat` (canonical order) cut into one tensor per parameter, with each parameter's
    /// shape, device and dtype. The length and finiteness are checked before anything is
    /// built (`what` names the vector in the error), so a caller that writes only after this
    /// returns changes nothing on a bad vector.
    fn split_flat(&self, flat: &[f32], what: &str) -> Result<Vec<Tensor>> {
        check_flat(flat, self.numel(), what)?;
        let mut offset = 0;
        let mut parts = Vec::with_capacity(self.vars.len());
        for (_, v) in &self.vars {
            let n = v.elem_count();
            parts.push(
                Tensor::from_slice(&flat[offset..offset + n], v.dims(), v.device())?
                    .to_dtype(v.dtype())?,
            );
            offset += n;
        }
        Ok(parts)
    }

    /// A fingerprint of the values (and layout): equal hashes mean bit-identical parameters.
    pub fn hash(&self) -> Result<String> {
        let mut h = Sha256::new();
        h.update(self.layout().hash().as_bytes());
        for v in self.flatten()? {
            h.update(v.to_le_bytes());
        }
        Ok(hex::encode(&h.finalize()[..16]))
    }

    /// Copies named tensors into the parameters. Every parameter must be present with its exact
    /// shape and finite values; all are checked before any is written, so a mismatch changes
    /// nothing. Extra names in `tensors` are ignored (a checkpoint also holds optimizer state).
    pub fn load(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let mut staged = Vec::with_capacity(self.vars.len());
        for (name, var) in &self.vars {
            let t = tensors
                .get(name)
                .ok_or_else(|| Error::Layout(format!("missing parameter {name}")))?;
            if t.dims() != var.dims() {
                return Err(Error::Layout(format!(
                    "parameter {name} has shape {:?}, the model expects {:?}",
                    t.dims(),
                    var.dims()
                )));
            }
            let t = t.to_device(var.device())?.to_dtype(var.dtype())?;
            ensure_finite(&t, name)?;
            staged.push((var, t));
        }
        for (var, t) in staged {
            var.set(&t)?;
        }
        Ok(())
    }
}

/// Refuses a flat vector of `what` that is not `len` long or holds a NaN or an infinity, so
/// that writing it back can change nothing when it is bad.
pub(crate) fn check_flat(flat: &[f32], len: usize, what: &str) -> Result<()> {
    if flat.len() != len {
        return Err(Error::Layout(format!(
            "flat {what} of {} values, expected {len}",
            flat.len()
        )));
    }
    match flat.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::NonFinite(format!("{what} {} at index {i}", flat[i]))),
        None => Ok(()),
    }
}

/// Appends `t`'s values to `out` as `f32`. An f32 tensor contiguous on the CPU, as parameters
/// and gradients are, is copied straight from its storage: one copy rather than two (a node
/// flattens its parameters at every publish, and a `ddp` member its gradient at every step).
pub(crate) fn extend_flat(out: &mut Vec<f32>, t: &Tensor) -> Result<()> {
    if t.dtype() == DType::F32 {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((from, to))) = (&*storage, layout.contiguous_offsets()) {
            out.extend_from_slice(&cpu.as_slice::<f32>()?[from..to]);
            return Ok(());
        }
    }
    out.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    Ok(())
}

/// Fails when `t` holds a NaN or an infinity; `what` names it in the error.
pub fn ensure_finite(t: &Tensor, what: &str) -> Result<()> {
    let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::NonFinite(format!("{what}[{i}] = {}", values[i]))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The digest members compare at a round's end: SHA-256 over the little-endian values,
    /// first 8 bytes in hex, the same whether fed in one block or several.
    #[test]
    fn params_digest_is_sha256_of_the_little_endian_values() {
        assert_eq!(params_digest(&[]), "e3b0c44298fc1c14");
        assert_eq!(params_digest(&[1.0, 2.0]), "b9c80b5adeca4507");
        let long: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5).collect();
        assert_eq!(params_digest(&long), "1f127723b6cb20cb");
    }

    fn params() -> Params {
        let dev = Device::Cpu;
        let a = Var::from_slice(&[1.0f32, 2.0, 3.0, 4.0], (2, 2), &dev).expect("var");
        let b = Var::from_slice(&[5.0f32], 1, &dev).expect("var");
        // Given out of order on purpose: the canonical order is by name.
        Params::new(vec![("z.bias".into(), b), ("a.weight".into(), a)]).expect("params")
    }

    #[test]
    fn flatten_is_name_sorted_and_round_trips() {
        let p = params();
        assert_eq!(p.flatten().expect("flat"), vec![1.0, 2.0, 3.0, 4.0, 5.0]);
        p.write_back(&[9.0, 8.0, 7.0, 6.0, 5.5]).expect("write");
        assert_eq!(p.flatten().expect("flat"), vec![9.0, 8.0, 7.0, 6.0, 5.5]);
        assert_eq!(p.layout().numel(), 5);
    }

    #[test]
    fn gradients_flatten_in_canonical_order_and_are_replaced_whole_or_not_at_all() {
        let p = params();
        let a = p.get("a.weight").expect("a").as_tensor().clone();
        let loss = (a.sqr().expect("sqr").sum_all().expect("sum") * 0.5).expect("scale");
        // z.bias takes no part in the loss: its gradient counts as zeros.
        let mut grads = loss.backward().expect("backward");
        assert_eq!(
            p.flatten_grads(&grads).expect("flat"),
            vec![1.0, 2.0, 3.0, 4.0, 0.0]
        );
        assert!(p.replace_grads(&mut grads, &[1.0; 4]).is_err());
        assert!(p
            .replace_grads(&mut grads, &[1.0, f32::INFINITY, 1.0, 1.0, 1.0])
            .is_err());
        assert_eq!(p.flatten_grads(&grads).expect("flat")[1], 2.0);
        p.replace_grads(&mut grads, &[0.5, 0.5, 0.5, 0.5, 7.0])
            .expect("replace");
        assert_eq!(
            p.flatten_grads(&grads).expect("flat"),
            vec![0.5, 0.5, 0.5, 0.5, 7.0]
        );
    }

    #[test]
    fn bad_writes_change_nothing() {
        let p = params();
        let before = p.hash().expect("hash");
        assert!(p.write_back(&[1.0; 4]).is_err());
        assert!(p.write_back(&[1.0, 1.0, f32::NAN, 1.0, 1.0]).is_err());
        let mut m = HashMap::new();
        m.insert(
            "a.weight".to_string(),
            Tensor::zeros((4,), DType::F32, &Device::Cpu).expect("t"),
        );
        assert!(p.load(&m).is_err());
        assert_eq!(p.hash().expect("hash"), before);
    }
}
