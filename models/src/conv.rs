//! 2-D convolution on the CPU as im2col and one matrix product, with its own backward pass.
//!
//! Candle 0.11's `conv2d` backward computes the input's gradient with a direct
//! `conv_transpose2d` (a dot product per output value), and does so even where no gradient is
//! wanted, such as for the images themselves: on the LeNet-style CNN that was about 78% of a
//! training step. Here the convolution is `im2col(x) · Wᵀ + b`: the matrix product and the
//! bias are Candle's ordinary differentiable ops (gemm forward and backward), and `im2col`
//! is a custom op whose backward (`col2im`) scatters the columns' gradient back onto the
//! input, only when the input needs one. Off the CPU, Candle's own `conv2d` is used.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::{Error, Result};

/// A stride-1, dilation-1 convolution of `x` `(batch, channels, height, width)` with `weight`
/// `(out, channels, k, k)`, zero padding `padding` on every side, plus `bias` `(out,)`:
/// the same numbers as Candle's `conv2d` followed by the bias.
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: &Tensor, padding: usize) -> Result<Tensor> {
    let (out_ch, in_ch, k, k_w) = weight.dims4()?;
    let (batch, channels, height, width) = x.dims4()?;
    if channels != in_ch || k != k_w {
        return Err(Error::Layout(format!(
            "a {out_ch}x{in_ch}x{k}x{k_w} kernel cannot convolve {channels} channels"
        )));
    }
    if !x.device().is_cpu() {
        let out = x.conv2d(weight, padding, 1, 1, 1)?;
        return Ok(out.broadcast_add(&bias.reshape((1, out_ch, 1, 1))?)?);
    }
    let (out_h, out_w) = (
        (height + 2 * padding + 1).checked_sub(k),
        (width + 2 * padding + 1).checked_sub(k),
    );
    let (Some(out_h), Some(out_w)) = (out_h, out_w) else {
        return Err(Error::Layout(format!(
            "a {k}x{k} kernel does not fit a padded {height}x{width} image"
        )));
    };
    let cols = x.contiguous()?.apply_op1(Im2Col { k, padding })?;
    let out = cols
        .matmul(&weight.reshape((out_ch, in_ch * k * k))?.t()?)?
        .broadcast_add(bias)?;
    Ok(out
        .reshape((batch, out_h, out_w, out_ch))?
        .permute((0, 3, 1, 2))?
        .contiguous()?)
}

/// `(batch, channels, height, width)` to `(batch·out_h·out_w, channels·k·k)`: row `(b, y, x)`
/// holds the `k×k` patch of every channel whose top-left corner is `(y − padding, x −
/// padding)`, zeros outside the image, in the order of a contiguous `(out, channels, k, k)`
/// kernel's rows.
struct Im2Col {
    k: usize,
    padding: usize,
}

/// The geometry both directions share.
struct Geometry {
    batch: usize,
    channels: usize,
    height: usize,
    width: usize,
    out_h: usize,
    out_w: usize,
}

impl Im2Col {
    fn geometry(&self, dims: &[usize]) -> candle_core::Result<Geometry> {
        let &[batch, channels, height, width] = dims else {
            return Err(candle_core::Error::Msg(format!(
                "im2col wants 4 dimensions, got {dims:?}"
            )));
        };
        let fits = |side: usize| (side + 2 * self.padding + 1).checked_sub(self.k);
        let (Some(out_h), Some(out_w)) = (fits(height), fits(width)) else {
            return Err(candle_core::Error::Msg(
                "im2col: kernel larger than image".into(),
            ));
        };
        Ok(Geometry {
            batch,
            channels,
            height,
            width,
            out_h,
            out_w,
        })
    }

    /// Calls `f(column index, input index)` for every patch value inside the image.
    fn for_each_pair(&self, g: &Geometry, mut f: impl FnMut(usize, usize)) {
        let (k, p) = (self.k, self.padding);
        let row_len = g.channels * k * k;
        for b in 0..g.batch {
            for oy in 0..g.out_h {
                for ox in 0..g.out_w {
                    let row = ((b * g.out_h + oy) * g.out_w + ox) * row_len;
                    for c in 0..g.channels {
                        let plane = (b * g.channels + c) * g.height;
                        for ky in 0..k {
                            let Some(iy) = (oy + ky).checked_sub(p).filter(|&y| y < g.height)
                            else {
                                continue;
                            };
                            let col = row + (c * k + ky) * k;
                            let line = (plane + iy) * g.width;
                            for kx in 0..k {
                                if let Some(ix) = (ox + kx).checked_sub(p).filter(|&x| x < g.width)
                                {
                                    f(col + kx, line + ix);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

impl CustomOp1 for Im2Col {
    fn name(&self) -> &'static str {
        "im2col"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = self.geometry(layout.dims())?;
        let (from, to) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("im2col: input not contiguous".into()))?;
        let x = &storage.as_slice::<f32>()?[from..to];
        let rows = g.batch * g.out_h * g.out_w;
        let row_len = g.channels * self.k * self.k;
        let mut cols = vec![0f32; rows * row_len];
        self.for_each_pair(&g, |col, input| cols[col] = x[input]);
        Ok((CpuStorage::F32(cols), Shape::from((rows, row_len))))
    }

    /// `col2im`: every column value's gradient added back onto the input value it came from.
    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = self.geometry(arg.dims())?;
        let grad = grad_res.flatten_all()?.to_vec1::<f32>()?;
        let mut grad_x = vec![0f32; arg.elem_count()];
        self.for_each_pair(&g, |col, input| grad_x[input] += grad[col]);
        Ok(Some(Tensor::from_vec(grad_x, arg.shape(), arg.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn seeded(shape: &[usize], seed: u64) -> Var {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n as u64)
            .map(|i| (((i + 1) * (seed | 1) * 2_654_435_761 % 1000) as f32) / 500.0 - 1.0)
            .collect();
        Var::from_vec(values, shape, &Device::Cpu).expect("var")
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .and_then(|d| d.abs())
            .and_then(|d| d.max_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("diff")
    }

    /// Forward values and the gradients of input, kernel and bias equal Candle's `conv2d`
    /// with autograd, with and without padding.
    #[test]
    fn matches_candles_conv2d_forward_and_backward() {
        for padding in [0, 2] {
            let x = seeded(&[3, 2, 9, 8], 1);
            let w = seeded(&[4, 2, 5, 5], 2);
            let b = seeded(&[4], 3);
            let ours = conv2d(x.as_tensor(), w.as_tensor(), b.as_tensor(), padding).expect("ours");
            let theirs = x
                .as_tensor()
                .conv2d(w.as_tensor(), padding, 1, 1, 1)
                .and_then(|t| t.broadcast_add(&b.as_tensor().reshape((1, 4, 1, 1))?))
                .expect("candle");
            assert_eq!(ours.dims(), theirs.dims());
            assert!(
                max_diff(&ours, &theirs) < 1e-4,
                "forward, padding {padding}"
            );
            // A loss that weighs every output differently.
            let weights = seeded(theirs.dims(), 4);
            let loss = |t: &Tensor| {
                (t * weights.as_tensor())
                    .and_then(|t| t.sum_all())
                    .expect("loss")
            };
            let g_ours = loss(&ours).backward().expect("ours backward");
            let g_theirs = loss(&theirs).backward().expect("candle backward");
            for (name, v) in [("input", &x), ("kernel", &w), ("bias", &b)] {
                let (a, c) = (
                    g_ours.get(v.as_tensor()).expect("ours"),
                    g_theirs.get(v.as_tensor()).expect("candle"),
                );
                assert!(max_diff(a, c) < 1e-3, "{name} gradient, padding {padding}");
            }
        }
    }

    #[test]
    fn refuses_a_kernel_that_does_not_fit() {
        let x = seeded(&[1, 1, 3, 3], 1);
        let w = seeded(&[1, 1, 5, 5], 2);
        let b = seeded(&[1], 3);
        assert!(conv2d(x.as_tensor(), w.as_tensor(), b.as_tensor(), 0).is_err());
        let w2 = seeded(&[1, 2, 3, 3], 2);
        assert!(conv2d(x.as_tensor(), w2.as_tensor(), b.as_tensor(), 0).is_err());
    }
}
