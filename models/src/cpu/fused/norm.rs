//! Layer norm, forward and backward, one loop over the rows each.

use super::*;

/// Layer norm over the last dimension: `(x − mean) / sqrt(var + eps) · weight + bias`, the
/// variance the biased one (as in PyTorch's `LayerNorm`).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if !serves(x) {
        let width = x.dim(D::Minus1)? as f64;
        let centred = x.broadcast_sub(&(x.sum_keepdim(D::Minus1)? / width)?)?;
        let var = (centred.sqr()?.sum_keepdim(D::Minus1)? / width)?;
        let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
        return Ok(normed.broadcast_mul(weight)?.broadcast_add(bias)?);
    }
    let width = x.dim(D::Minus1)?;
    if weight.dims() != [width] || bias.dims() != [width] {
        return Err(Error::Layout(format!(
            "layer norm over {width} values with weight {:?} and bias {:?}",
            weight.dims(),
            bias.dims()
        )));
    }
    Ok(x.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        LayerNorm { eps: eps as f32 },
    )?)
}

pub(super) struct LayerNorm {
    eps: f32,
}

/// A row's mean and reciprocal standard deviation.
#[inline(always)]
pub(super) fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = sum(row) / n;
    let var = sum_map(row, |v| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
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
        let x = f32_slice("layer-norm", s1, l1)?;
        let (weight, bias) = (
            f32_slice("layer-norm", s2, l2)?,
            f32_slice("layer-norm", s3, l3)?,
        );
        let (_, width) = rows_of("layer-norm", l1.dims())?;
        if weight.len() != width || bias.len() != width {
            return Err(candle_core::Error::Msg(
                "layer-norm: weight or bias not as wide as a row".into(),
            ));
        }
        let mut out = vec![0f32; x.len()];
        Kernel::LayerNorm {
            x,
            weight,
            bias,
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
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::layer_norm((s1, l1), (s2, l2), (s3, l3), self.eps)
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (grad_x, grad_weight, grad_bias) =
            layer_norm_grad(x, weight, grad, f64::from(self.eps))
                .map_err(candle_core::Error::wrap)?;
        Ok((Some(grad_x), Some(grad_weight), Some(grad_bias)))
    }
}

/// Layer norm of each row of `x` into `out` (`weight` and `bias` as wide as a row).
#[inline(always)]
pub(super) fn layer_norm_rows(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (out, row) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        let (mean, rstd) = moments(row, eps);
        for ((o, v), (w, b)) in out.iter_mut().zip(row).zip(weight.iter().zip(bias)) {
            *o = (v - mean) * rstd * w + b;
        }
    }
}

/// Layer norm's three gradients from `(x, weight, grad)`, packed as one `(rows + 2, n)`
/// tensor: the input's rows, then the weight's, then the bias's.
pub(super) struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer-norm-grad"
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
        let x = f32_slice("layer-norm-grad", s1, l1)?;
        let weight = f32_slice("layer-norm-grad", s2, l2)?;
        let grad = f32_slice("layer-norm-grad", s3, l3)?;
        let (rows, width) = rows_of("layer-norm-grad", l1.dims())?;
        if weight.len() != width || grad.len() != x.len() {
            return Err(candle_core::Error::Msg(
                "layer-norm-grad: weight or gradient of the wrong size".into(),
            ));
        }
        let mut out = vec![0f32; (rows + 2) * width];
        let eps = self.eps;
        Kernel::LayerNormGrad {
            x,
            weight,
            grad,
            eps,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), Shape::from((rows + 2, width))))
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
        crate::gpu::ops::layer_norm_grad((s1, l1), (s2, l2), (s3, l3), self.eps)
    }
}

/// Layer norm's gradients for rows `x` with output gradient `grad`, into `out`
/// `(rows + 2, width)`: the input's rows, then the weight's and the bias's.
#[inline(always)]
pub(super) fn layer_norm_grad_rows(
    x: &[f32],
    weight: &[f32],
    grad: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let width = weight.len();
    let n = width as f32;
    let (grad_x, sums) = out.split_at_mut(x.len());
    let (grad_weight, grad_bias) = sums.split_at_mut(width);
    // Per row, x̂ and ĝ in buffers, so each loop below is element-wise (vectorised) and the two
    // sums are eight-lane ones.
    let (mut x_hat, mut scaled) = (vec![0f32; width], vec![0f32; width]);
    for ((row, g), gx) in x
        .chunks_exact(width)
        .zip(grad.chunks_exact(width))
        .zip(grad_x.chunks_exact_mut(width))
    {
        let (mean, rstd) = moments(row, eps);
        // With x̂ = (x − mean)·rstd and ĝ = g·weight:
        // dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)).
        for (((xh, s), &v), (&g, &w)) in x_hat
            .iter_mut()
            .zip(scaled.iter_mut())
            .zip(row)
            .zip(g.iter().zip(weight))
        {
            *xh = (v - mean) * rstd;
            *s = g * w;
        }
        for ((gw, gb), (&g, &xh)) in grad_weight
            .iter_mut()
            .zip(grad_bias.iter_mut())
            .zip(g.iter().zip(&x_hat))
        {
            *gw += g * xh;
            *gb += g;
        }
        let (mean_g, mean_gx) = (sum(&scaled) / n, dot(&scaled, &x_hat) / n);
        for ((gx, &xh), &s) in gx.iter_mut().zip(&x_hat).zip(&scaled) {
            *gx = rstd * (s - mean_g - xh * mean_gx);
        }
    }
}

/// Layer norm's gradients `(input, weight, bias)` for the output gradient `grad`.
pub(crate) fn layer_norm_grad(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (rows, _) = rows_of("layer-norm", x.dims())?;
    let packed = x.contiguous()?.apply_op3_no_bwd(
        &weight.contiguous()?,
        &grad.contiguous()?,
        &LayerNormGrad { eps: eps as f32 },
    )?;
    Ok((
        packed.narrow(0, 0, rows)?.reshape(x.shape())?,
        packed.narrow(0, rows, 1)?.reshape(weight.shape())?,
        packed.narrow(0, rows + 1, 1)?.reshape(weight.shape())?,
    ))
}
