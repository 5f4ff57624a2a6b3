//! RMS norm (the Llama's), forward and backward, one loop over the rows each.
//!
//! On a GPU with the `kernels` lever each runs its twin in `gpu/kernels.cu`; for other float
//! types or devices the Candle composition runs (and the Llama trains through autograd there).

use super::*;

/// RMS norm over the last dimension: `x / sqrt(mean(x²) + eps) · weight`, as `transformers`'
/// `LlamaRMSNorm` computes it in f32. Never candle-nn's fused RMS norm, which has no backward
/// pass: this op carries its own.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if !serves(x) {
        let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x.broadcast_div(&(mean_square + eps)?.sqrt()?)?;
        return Ok(normed.broadcast_mul(weight)?);
    }
    let width = x.dim(D::Minus1)?;
    if weight.dims() != [width] {
        return Err(Error::Layout(format!(
            "rms norm over {width} values with weight {:?}",
            weight.dims()
        )));
    }
    Ok(x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })?)
}

struct RmsNorm {
    eps: f32,
}

/// A row's reciprocal root mean square.
#[inline(always)]
fn rms_rstd(row: &[f32], eps: f32) -> f32 {
    let mean_square = sum_map(row, |v| v * v) / row.len() as f32;
    1.0 / (mean_square + eps).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("rms-norm", s1, l1)?;
        let weight = f32_slice("rms-norm", s2, l2)?;
        let (_, width) = rows_of("rms-norm", l1.dims())?;
        if weight.len() != width {
            return Err(candle_core::Error::Msg(
                "rms-norm: weight not as wide as a row".into(),
            ));
        }
        let mut out = vec![0f32; x.len()];
        Kernel::RmsNorm {
            x,
            weight,
            eps: self.eps,
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
        crate::gpu::ops::rms_norm((s1, l1), (s2, l2), self.eps)
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (grad_x, grad_weight) = rms_norm_grad(x, weight, grad, f64::from(self.eps))
            .map_err(candle_core::Error::wrap)?;
        Ok((Some(grad_x), Some(grad_weight)))
    }
}

/// RMS norm of each row of `x` into `out` (`weight` as wide as a row).
#[inline(always)]
pub(super) fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (out, row) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        let rstd = rms_rstd(row, eps);
        for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
            *o = v * rstd * w;
        }
    }
}

/// RMS norm's two gradients from `(x, weight, grad)`, packed as one `(rows + 1, n)` tensor:
/// the input's rows, then the weight's.
struct RmsNormGrad {
    eps: f32,
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("rms-norm-grad", s1, l1)?;
        let weight = f32_slice("rms-norm-grad", s2, l2)?;
        let grad = f32_slice("rms-norm-grad", s3, l3)?;
        let (rows, width) = rows_of("rms-norm-grad", l1.dims())?;
        if weight.len() != width || grad.len() != x.len() {
            return Err(candle_core::Error::Msg(
                "rms-norm-grad: weight or gradient of the wrong size".into(),
            ));
        }
        let mut out = vec![0f32; (rows + 1) * width];
        Kernel::RmsNormGrad {
            x,
            weight,
            grad,
            eps: self.eps,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), Shape::from((rows + 1, width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::rms_norm_grad((s1, l1), (s2, l2), (s3, l3), self.eps)
    }
}

/// RMS norm's gradients for rows `x` with output gradient `grad`, into `out`
/// `(rows + 1, width)`: the input's rows, then the weight's.
#[inline(always)]
pub(super) fn rms_norm_grad_rows(
    x: &[f32],
    weight: &[f32],
    grad: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let width = weight.len();
    let n = width as f32;
    let (grad_x, grad_weight) = out.split_at_mut(x.len());
    let (mut x_hat, mut scaled) = (vec![0f32; width], vec![0f32; width]);
    for ((row, g), gx) in x
        .chunks_exact(width)
        .zip(grad.chunks_exact(width))
        .zip(grad_x.chunks_exact_mut(width))
    {
        let rstd = rms_rstd(row, eps);
        // With x̂ = x·rstd and ĝ = g·weight: dx = rstd · (ĝ − x̂ · mean(ĝ · x̂)).
        for (((xh, s), &v), (&g, &w)) in x_hat
            .iter_mut()
            .zip(scaled.iter_mut())
            .zip(row)
            .zip(g.iter().zip(weight))
        {
            *xh = v * rstd;
            *s = g * w;
        }
        for (gw, (&g, &xh)) in grad_weight.iter_mut().zip(g.iter().zip(&x_hat)) {
            *gw += g * xh;
        }
        let mean_gx = dot(&scaled, &x_hat) / n;
        for ((gx, &xh), &s) in gx.iter_mut().zip(&x_hat).zip(&scaled) {
            *gx = rstd * (s - xh * mean_gx);
        }
    }
}

/// RMS norm's gradients `(input, weight)` for the output gradient `grad` (f32, where the fused
/// kernels serve).
pub(crate) fn rms_norm_grad(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (rows, _) = rows_of("rms-norm-grad", x.dims())?;
    let packed = x.contiguous()?.apply_op3_no_bwd(
        &weight.contiguous()?,
        &grad.contiguous()?,
        &RmsNormGrad { eps: eps as f32 },
    )?;
    Ok((
        packed.narrow(0, 0, rows)?.reshape(x.shape())?,
        packed.narrow(0, rows, 1)?.reshape(weight.shape())?,
    ))
}
