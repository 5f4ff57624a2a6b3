//! The mean cross-entropy of logits against class indices, with its gradient
//! `(softmax - one-hot) / n`.

use super::*;

/// The mean cross-entropy of `logits` `(n, classes)` against class indices `targets` `(n,)`
/// (u32 or i64), a scalar: Candle's `cross_entropy` in one pass, and its gradient
/// `(softmax − one-hot) / n` in one more.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if !serves(logits) {
        return Ok(candle_nn::loss::cross_entropy(logits, targets)?);
    }
    let (n, _) = logits.dims2()?;
    if targets.dims() != [n] {
        return Err(Error::Layout(format!(
            "{n} rows of logits against targets {:?}",
            targets.dims()
        )));
    }
    let targets = targets.to_dtype(DType::U32)?;
    Ok(logits.contiguous()?.apply_op2(&targets, CrossEntropy)?)
}

/// Reads class indices as `usize`, refusing any outside `0..classes`.
pub(super) fn class_indices(
    storage: &CpuStorage,
    layout: &Layout,
    classes: usize,
) -> candle_core::Result<Vec<usize>> {
    let (from, to) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("cross-entropy: targets not contiguous".into()))?;
    storage.as_slice::<u32>()?[from..to]
        .iter()
        .map(|&t| {
            let t = t as usize;
            if t < classes {
                Ok(t)
            } else {
                Err(candle_core::Error::Msg(format!(
                    "cross-entropy: target {t} outside {classes} classes"
                )))
            }
        })
        .collect()
}

/// A row's maximum, and the log of its exponentials' sum after subtracting it, with the
/// exponentials left in `exps` (as long as the row).
#[inline(always)]
pub(super) fn log_sum_exp(row: &[f32], exps: &mut [f32]) -> (f32, f32) {
    let top = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for (e, v) in exps.iter_mut().zip(row) {
        *e = exp(v - top);
    }
    (top, sum(exps).ln())
}

/// The summed cross-entropy of rows of `logits` against `targets` (checked indices).
#[inline(always)]
pub(super) fn cross_entropy_total(logits: &[f32], targets: &[usize], classes: usize) -> f64 {
    let mut exps = vec![0f32; classes];
    let mut total = 0f64;
    for (row, &t) in logits.chunks_exact(classes).zip(targets) {
        let (top, lse) = log_sum_exp(row, &mut exps);
        total += f64::from(lse + top - row[t]);
    }
    total
}

/// Cross-entropy's gradient rows into `out`: `per_row · (softmax − one-hot)`.
#[inline(always)]
pub(super) fn cross_entropy_grad_rows(
    logits: &[f32],
    targets: &[usize],
    classes: usize,
    per_row: f32,
    out: &mut [f32],
) {
    for ((row, &t), out) in logits
        .chunks_exact(classes)
        .zip(targets)
        .zip(out.chunks_exact_mut(classes))
    {
        // softmax = e^(v − top) / Σ e^(v − top), from the exponentials log_sum_exp leaves.
        let (_, lse) = log_sum_exp(row, out);
        let scale = per_row / lse.exp();
        for o in out.iter_mut() {
            *o *= scale;
        }
        out[t] -= per_row;
    }
}

pub(super) struct CrossEntropy;

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let logits = f32_slice("cross-entropy", s1, l1)?;
        let (rows, classes) = rows_of("cross-entropy", l1.dims())?;
        let targets = class_indices(s2, l2, classes)?;
        if targets.len() != rows {
            return Err(candle_core::Error::Msg(format!(
                "cross-entropy: {} targets for {rows} rows",
                targets.len()
            )));
        }
        let mut total = 0.0;
        Kernel::CrossEntropy {
            logits,
            targets: &targets,
            classes,
            total: &mut total,
        }
        .run();
        let mean = (total / rows.max(1) as f64) as f32;
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::cross_entropy((s1, l1), (s2, l2))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let op = CrossEntropyGrad {
            scale: grad.to_dtype(DType::F32)?.to_scalar::<f32>()?,
        };
        Ok((Some(logits.apply_op2_no_bwd(targets, &op)?), None))
    }
}

/// Cross-entropy's gradient for the logits: `scale · (softmax − one-hot) / n`.
pub(super) struct CrossEntropyGrad {
    scale: f32,
}

impl CustomOp2 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let logits = f32_slice("cross-entropy-grad", s1, l1)?;
        let (rows, classes) = rows_of("cross-entropy-grad", l1.dims())?;
        let targets = class_indices(s2, l2, classes)?;
        if targets.len() != rows {
            return Err(candle_core::Error::Msg(format!(
                "cross-entropy: {} targets for {rows} rows",
                targets.len()
            )));
        }
        let per_row = self.scale / rows.max(1) as f32;
        let mut out = vec![0f32; logits.len()];
        Kernel::CrossEntropyGrad {
            logits,
            targets: &targets,
            classes,
            per_row,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::cross_entropy_grad((s1, l1), (s2, l2), self.scale)
    }
}

/// The mean cross-entropy's gradient for `logits`: `(softmax − one-hot) / n`.
pub(crate) fn cross_entropy_grad(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let targets = targets.to_dtype(DType::U32)?;
    Ok(logits
        .contiguous()?
        .apply_op2_no_bwd(&targets, &CrossEntropyGrad { scale: 1.0 })?)
}
