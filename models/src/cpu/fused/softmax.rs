//! The causal softmax of attention scores (scaled, future positions masked), forward and
//! backward.

use super::*;

/// Softmax over the last dimension of attention scores `(…, T, T)` times `scale`, each query
/// `i` seeing only keys `j ≤ i` (later keys get weight exactly 0), as adding a mask far below
/// any score above the diagonal would. Off the fused path that mask is −1e9: finite, so no
/// `inf·0` can reach a gradient.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    let time = scores.dim(D::Minus1)?;
    if scores.dim(D::Minus2)? != time {
        return Err(Error::Layout(format!(
            "causal softmax over non-square scores {:?}",
            scores.dims()
        )));
    }
    if !serves(scores) {
        let mask: Vec<f32> = (0..time * time)
            .map(|k| {
                if k % time > k / time {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask =
            Tensor::from_vec(mask, (time, time), scores.device())?.to_dtype(scores.dtype())?;
        let masked = (scores * scale)?.broadcast_add(&mask)?;
        return Ok(candle_nn::ops::softmax(&masked, D::Minus1)?);
    }
    Ok(scores.contiguous()?.apply_op1(CausalSoftmax {
        scale: scale as f32,
    })?)
}

pub(super) struct CausalSoftmax {
    scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("causal-softmax", s, l)?;
        let (_, time) = rows_of("causal-softmax", l.dims())?;
        let mut out = vec![0f32; x.len()];
        let scale = self.scale;
        Kernel::CausalSoftmax {
            x,
            time,
            scale,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::causal_softmax(s, l, self.scale)
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let op = SoftmaxGrad { scale: self.scale };
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &op)?))
    }
}

/// The causal softmax of `(…, time, time)` scores `x` into `out` (zeros above the diagonal).
#[inline(always)]
pub(super) fn causal_softmax_rows(x: &[f32], time: usize, scale: f32, out: &mut [f32]) {
    for (r, (row, y)) in x
        .chunks_exact(time)
        .zip(out.chunks_exact_mut(time))
        .enumerate()
    {
        let seen = r % time + 1;
        let top = row[..seen]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
        for (y, v) in y[..seen].iter_mut().zip(row) {
            *y = exp(v * scale - top);
        }
        let total = sum(&y[..seen]);
        for y in &mut y[..seen] {
            *y /= total;
        }
    }
}

/// Softmax's input gradient from its output `y` and the output's gradient `g`, per row:
/// `scale · y · (g − Σ g·y)` (zero where `y` is).
pub(super) struct SoftmaxGrad {
    scale: f32,
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (y, g) = (
            f32_slice("softmax-grad", s1, l1)?,
            f32_slice("softmax-grad", s2, l2)?,
        );
        let (_, width) = rows_of("softmax-grad", l1.dims())?;
        if g.len() != y.len() {
            return Err(candle_core::Error::Msg(
                "softmax-grad: gradient of the wrong size".into(),
            ));
        }
        let mut out = vec![0f32; y.len()];
        let scale = self.scale;
        Kernel::SoftmaxGrad {
            y,
            g,
            width,
            scale,
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
        crate::gpu::ops::softmax_grad(s1, l1, s2, l2, self.scale)
    }
}

/// Softmax's input gradient row by row: `scale · y · (g − Σ g·y)` into `out`.
#[inline(always)]
pub(super) fn softmax_grad_rows(y: &[f32], g: &[f32], width: usize, scale: f32, out: &mut [f32]) {
    for ((out, y), g) in out
        .chunks_exact_mut(width)
        .zip(y.chunks_exact(width))
        .zip(g.chunks_exact(width))
    {
        let dot = dot(y, g);
        for ((o, y), g) in out.iter_mut().zip(y).zip(g) {
            *o = scale * y * (g - dot);
        }
    }
}

/// The causal softmax's input gradient from its output `weights` and their gradient.
pub(crate) fn causal_softmax_grad(weights: &Tensor, grad: &Tensor, scale: f64) -> Result<Tensor> {
    let op = SoftmaxGrad {
        scale: scale as f32,
    };
    Ok(weights
        .contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &op)?)
}
