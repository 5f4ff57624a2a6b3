//! 2-D convolution on the CPU as im2col and one matrix product, with its own backward pass.
//!
//! Candle 0.11's `conv2d` backward computes the input's gradient with a direct
//! `conv_transpose2d` (a dot product per output value), and does so even where no gradient is
//! wanted, such as for the images themselves: on the LeNet-style CNN that was about 78% of a
//! training step. Here the convolution is `im2col(x)ᵀ · Wᵀ + b`: the matrix product with
//! its bias is [`crate::cpu::matmul::linear`] (gemm forward and backward), and `im2col` is a
//! custom op whose backward (`col2im`) scatters the patches' gradient back onto the input,
//! only when the input needs one. Off the CPU, Candle's own `conv2d` is used.
//!
//! The 2×2 max pool is here too, as one loop each way: Candle 0.11's pooling backward
//! upsamples, compares and pools again, several passes over the feature maps.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

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
    let out = crate::cpu::matmul::linear(
        &cols.t()?,
        &weight.reshape((out_ch, in_ch * k * k))?,
        Some(bias),
    )?;
    Ok(out
        .reshape((batch, out_h, out_w, out_ch))?
        .permute((0, 3, 1, 2))?
        .contiguous()?)
}

/// `x`'s patches as columns, `(channels·k·k, batch·out_h·out_w)` (see [`Im2Col`]), with no
/// gradient tracking: for a backward pass written by hand.
pub(crate) fn im2col(x: &Tensor, k: usize, padding: usize) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1_no_bwd(&Im2Col { k, padding })?)
}

/// The gradient of [`im2col`]'s input `(batch, channels, height, width)` = `input_dims` from
/// its output's gradient `(channels·k·k, batch·out_h·out_w)`.
pub(crate) fn col2im(
    grad: &Tensor,
    k: usize,
    padding: usize,
    input_dims: &[usize],
) -> Result<Tensor> {
    let col2im = Col2Im {
        im2col: Im2Col { k, padding },
        input_dims: input_dims.to_vec(),
    };
    Ok(grad.contiguous()?.apply_op1_no_bwd(&col2im)?)
}

/// `(batch, channels, height, width)` to `(channels·k·k, batch·out_h·out_w)`: row
/// `(c, ky, kx)` (the order of a contiguous `(out, channels, k, k)` kernel's values) holds,
/// for every output position `(b, y, x)`, the input value at `(b, c, y + ky − padding,
/// x + kx − padding)`, zero outside the image. Patches as columns rather than rows: each row
/// is made of whole output rows, each a shifted run of one input row, so the copies here and
/// the additions of [`Col2Im`] are long runs (with patches as rows they were runs of `k`
/// values, a call to `memcpy` each, and a fifth of the CNN's step).
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

/// One output row's run within a patch row: where it starts in the patch matrix, and (if
/// its input row lies inside the image) where its values start in the input and which
/// output columns `lo..hi` they fill (the rest is padding).
struct Run {
    col: usize,
    input: Option<usize>,
    lo: usize,
    hi: usize,
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

    /// Calls `f` for every output row of every patch row, in the patch matrix's order.
    fn for_each_run(&self, g: &Geometry, mut f: impl FnMut(Run)) {
        let (k, p) = (self.k, self.padding);
        let mut col = 0;
        for c in 0..g.channels {
            for ky in 0..k {
                for kx in 0..k {
                    // Output columns whose input column x + kx − p lies inside the image.
                    let lo = p.saturating_sub(kx).min(g.out_w);
                    let hi = (g.width + p).saturating_sub(kx).clamp(lo, g.out_w);
                    for b in 0..g.batch {
                        let plane = (b * g.channels + c) * g.height;
                        for oy in 0..g.out_h {
                            let input = (oy + ky)
                                .checked_sub(p)
                                .filter(|&y| y < g.height && lo < hi)
                                .map(|iy| (plane + iy) * g.width + lo + kx - p);
                            f(Run { col, input, lo, hi });
                            col += g.out_w;
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
        let x = crate::cpu::fused::f32_slice("im2col", storage, layout)?;
        let positions = g.batch * g.out_h * g.out_w;
        let row_len = g.channels * self.k * self.k;
        // The runs come in the matrix's order, so they are appended, with zeros only where
        // the padding is: no pass to zero the whole matrix first.
        let mut cols = Vec::with_capacity(row_len * positions);
        self.for_each_run(&g, |run| match run.input {
            Some(input) => {
                cols.resize(run.col + run.lo, 0.0);
                cols.extend_from_slice(&x[input..input + run.hi - run.lo]);
                cols.resize(run.col + g.out_w, 0.0);
            }
            None => cols.resize(run.col + g.out_w, 0.0),
        });
        Ok((CpuStorage::F32(cols), Shape::from((row_len, positions))))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let col2im = Col2Im {
            im2col: Im2Col {
                k: self.k,
                padding: self.padding,
            },
            input_dims: arg.dims().to_vec(),
        };
        Ok(Some(grad_res.contiguous()?.apply_op1_no_bwd(&col2im)?))
    }
}

/// `im2col`'s backward: every patch value's gradient added back onto the input value it
/// came from, giving the input's gradient `(batch, channels, height, width)`.
struct Col2Im {
    im2col: Im2Col,
    input_dims: Vec<usize>,
}

impl CustomOp1 for Col2Im {
    fn name(&self) -> &'static str {
        "col2im"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = self.im2col.geometry(&self.input_dims)?;
        let grad = crate::cpu::fused::f32_slice("col2im", storage, layout)?;
        let row_len = g.channels * self.im2col.k * self.im2col.k;
        if grad.len() != g.batch * g.out_h * g.out_w * row_len {
            return Err(candle_core::Error::Msg(
                "col2im: gradient of the wrong size".into(),
            ));
        }
        let mut grad_x = vec![0f32; self.input_dims.iter().product()];
        self.im2col.for_each_run(&g, |run| {
            if let Some(input) = run.input {
                let len = run.hi - run.lo;
                let from = run.col + run.lo;
                for (gx, g) in grad_x[input..input + len]
                    .iter_mut()
                    .zip(&grad[from..from + len])
                {
                    *gx += g;
                }
            }
        });
        Ok((
            CpuStorage::F32(grad_x),
            Shape::from(self.input_dims.clone()),
        ))
    }
}

/// 2×2 max pooling with stride 2 of `(batch, channels, height, width)`, an odd last row or
/// column dropped (as Candle's `max_pool2d(2)`). The gradient goes to the first maximum of
/// each window in row order, as in PyTorch. (Candle 0.11's own backward scales each window's
/// gradient by its count of maxima over 4: a quarter of it where the maximum is unique.)
pub fn max_pool2x2(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 {
        return Ok(x.max_pool2d(2)?);
    }
    let (batch, channels, height, width) = x.dims4()?;
    if height < 2 || width < 2 {
        return Err(Error::Layout(format!(
            "a 2x2 pool does not fit a {height}x{width} image"
        )));
    }
    // Each (image, channel) plane as an image of one channel: a pool over rows.
    let rows = x
        .contiguous()?
        .reshape((batch * channels * height * width, 1))?;
    let pool = PoolRows::new(&rows, batch * channels, height, width)?;
    Ok(rows
        .apply_op1(pool)?
        .reshape((batch, channels, height / 2, width / 2))?)
}

/// [`max_pool2x2`] read straight off a convolution's matrix-product rows: `rows`
/// `(batch·height·width, channels)` (position-major, as `im2col(x)ᵀ · Wᵀ` leaves them) pooled
/// into `(batch, channels, height/2, width/2)`, the layout the next layer reads. The same
/// values, and the same first maximum per window, as permuting the rows to
/// `(batch, channels, height, width)` and pooling that, without the permuted copy. No
/// gradient tracking: for a backward pass written by hand ([`max_pool2x2_rows_grad`]).
pub(crate) fn max_pool2x2_rows(
    rows: &Tensor,
    batch: usize,
    height: usize,
    width: usize,
) -> Result<Tensor> {
    let pool = PoolRows::new(rows, batch, height, width)?;
    Ok(rows.contiguous()?.apply_op1_no_bwd(&pool)?)
}

/// The gradient of [`max_pool2x2_rows`]'s input `rows` from its output's gradient `grad`:
/// each window's gradient at its first maximum, zeros elsewhere, in the rows' layout.
pub(crate) fn max_pool2x2_rows_grad(
    rows: &Tensor,
    grad: &Tensor,
    batch: usize,
    height: usize,
    width: usize,
) -> Result<Tensor> {
    let pool = PoolRows::new(rows, batch, height, width)?;
    Ok(rows
        .contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &PoolRowsGrad(pool))?)
}

/// The geometry of a 2×2 pool over position-major rows.
#[derive(Clone, Copy)]
struct PoolRows {
    batch: usize,
    height: usize,
    width: usize,
    channels: usize,
}

impl PoolRows {
    fn new(rows: &Tensor, batch: usize, height: usize, width: usize) -> Result<PoolRows> {
        let (n, channels) = rows.dims2()?;
        if n != batch * height * width || height < 2 || width < 2 {
            return Err(Error::Layout(format!(
                "cannot pool {n} rows as {batch} images of {height}x{width}"
            )));
        }
        Ok(PoolRows {
            batch,
            height,
            width,
            channels,
        })
    }

    fn out_dims(&self) -> [usize; 4] {
        [self.batch, self.channels, self.height / 2, self.width / 2]
    }

    /// Calls `f(output index, input index of the window's first maximum)` for every window,
    /// the candidates in row order (top left, top right, bottom left, bottom right).
    fn for_each_window(&self, x: &[f32], mut f: impl FnMut(usize, usize)) {
        let (c, w) = (self.channels, self.width);
        let (out_h, out_w) = (self.height / 2, self.width / 2);
        let plane = out_h * out_w;
        for b in 0..self.batch {
            for oy in 0..out_h {
                for ox in 0..out_w {
                    // The window's four positions, each a run of `c` channel values.
                    let corner = ((b * self.height + 2 * oy) * w + 2 * ox) * c;
                    let below = corner + w * c;
                    let starts = [corner, corner + c, below, below + c];
                    let [first, rest @ ..] = starts.map(|s| &x[s..s + c]);
                    let out = (b * c * out_h + oy) * out_w + ox;
                    for ch in 0..c {
                        let (mut best, mut top) = (corner + ch, first[ch]);
                        for (start, values) in starts[1..].iter().zip(rest) {
                            // Selected, not branched on: which value wins is a coin toss
                            // the branch predictor loses half the time.
                            let v = values[ch];
                            let wins = v > top;
                            best = if wins { start + ch } else { best };
                            top = if wins { v } else { top };
                        }
                        f(out + ch * plane, best);
                    }
                }
            }
        }
    }
}

impl CustomOp1 for PoolRows {
    fn name(&self) -> &'static str {
        "max-pool-2x2-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = crate::cpu::fused::f32_slice("max-pool-rows", storage, layout)?;
        let dims = self.out_dims();
        let mut out = vec![0f32; dims.iter().product()];
        self.for_each_window(x, |o, at| out[o] = x[at]);
        Ok((CpuStorage::F32(out), Shape::from(dims.to_vec())))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(
            &grad.contiguous()?,
            &PoolRowsGrad(*self),
        )?))
    }
}

/// [`PoolRows`]' backward, from `(rows, output gradient)`.
struct PoolRowsGrad(PoolRows);

impl CustomOp2 for PoolRowsGrad {
    fn name(&self) -> &'static str {
        "max-pool-2x2-rows-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = crate::cpu::fused::f32_slice("max-pool-rows-grad", s1, l1)?;
        let grad = crate::cpu::fused::f32_slice("max-pool-rows-grad", s2, l2)?;
        if grad.len() != self.0.out_dims().iter().product::<usize>() {
            return Err(candle_core::Error::Msg(
                "max-pool-rows-grad: gradient of the wrong size".into(),
            ));
        }
        let mut grad_x = vec![0f32; x.len()];
        self.0.for_each_window(x, |o, at| grad_x[at] = grad[o]);
        Ok((CpuStorage::F32(grad_x), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_diff;
    use candle_core::{Device, Var};

    fn seeded(shape: &[usize], seed: u64) -> Var {
        crate::testing::seeded(shape, seed, 1.0)
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

    /// Without ties the pool's values equal Candle's `max_pool2d(2)`, odd edges dropped alike,
    /// and each window's gradient lands whole on its maximum, as in PyTorch. (Candle 0.11's
    /// own backward scales it by the window's count of maxima over 4, so a quarter when the
    /// maximum is unique: the CNN's convolutions learned at a quarter of the rate before.)
    #[test]
    fn max_pool_matches_candles_values_and_routes_the_gradient_to_the_maximum() {
        for (h, w) in [(6, 4), (5, 7)] {
            let n = 2 * 3 * h * w;
            // Distinct values in a scrambled order: no window has two equal maxima.
            let values: Vec<f32> = (0..n).map(|i| ((i * 7919) % n) as f32 / n as f32).collect();
            let x = Var::from_vec(values.clone(), (2, 3, h, w), &Device::Cpu).expect("var");
            let ours = max_pool2x2(x.as_tensor()).expect("ours");
            let theirs = x.as_tensor().max_pool2d(2).expect("candle");
            assert_eq!(ours.dims(), theirs.dims());
            assert_eq!(max_diff(&ours, &theirs), 0.0, "forward {h}x{w}");
            let weights = seeded(theirs.dims(), 5);
            let grads = (&ours * weights.as_tensor())
                .and_then(|t| t.sum_all())
                .and_then(|t| t.backward())
                .expect("backward");
            let got = grads
                .get(x.as_tensor())
                .and_then(|g| g.flatten_all().ok())
                .and_then(|g| g.to_vec1::<f32>().ok())
                .expect("gradient");
            let weights = weights
                .as_tensor()
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("weights");
            let mut expected = vec![0f32; n];
            let (out_h, out_w) = (h / 2, w / 2);
            for plane in 0..6 {
                for oy in 0..out_h {
                    for ox in 0..out_w {
                        let window = [(0, 0), (0, 1), (1, 0), (1, 1)]
                            .map(|(dy, dx)| plane * h * w + (2 * oy + dy) * w + 2 * ox + dx);
                        let at = window
                            .into_iter()
                            .max_by(|&a, &b| values[a].total_cmp(&values[b]))
                            .expect("a window");
                        expected[at] = weights[(plane * out_h + oy) * out_w + ox];
                    }
                }
            }
            assert_eq!(got, expected, "gradient {h}x{w}");
        }
        let tiny = seeded(&[1, 1, 1, 4], 6);
        assert!(max_pool2x2(tiny.as_tensor()).is_err());
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
