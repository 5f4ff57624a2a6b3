//! Fused CPU kernels, each with its own backward pass, for the element-wise and row-wise
//! parts of a training step: bias addition, layer norm, causal softmax, SiLU and the
//! cross-entropy loss.
//!
//! Candle 0.11 builds these from its basic ops, so on one core a small GPT's step spent more
//! time outside the matrix products than in them: each basic op allocates its output, autograd
//! seeds and sums a gradient for every intermediate, and a bias's gradient (a sum over the rows
//! of a broadcast) takes Candle's strided reduction, the slowest loop of the step. Here each
//! composite is one loop over its rows forward and one backward. The numbers are those of the
//! composition they replace (the tests compare values and gradients against it); off the CPU,
//! or for other float types, the Candle composition itself runs.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

use crate::{Error, Result};

/// Whether the fused kernels (and the hand-written backward passes built on them) serve this
/// tensor: f32 on the CPU; elsewhere the Candle composition runs.
pub(crate) fn serves(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// `e^x` in plain f32 arithmetic that the compiler vectorises over a slice (the C library's
/// `expf` is a call per value, a tenth of the GPT's step in SiLU, softmax and cross-entropy).
/// Cephes' method: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`, a degree-7 polynomial for `e^r`
/// (relative error under 2·10⁻⁷, a couple of ulp), and `2^n` put into the exponent's bits.
/// The input is clamped to `[-87, 88]`, where `e^x` is a normal f32: below, the answer is
/// `e^-87` (~1.6·10⁻³⁸) instead of a denormal or zero, above `e^88` instead of a larger
/// value or infinity; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2²³ rounds to the nearest integer n and leaves it in the low bits of the
    // sum's mantissa: no rounding instruction (the baseline x86-64 target lacks one) and no
    // float-to-integer cast (Rust's saturating cast keeps the loop from vectorising).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    // n is in [-126, 127]: 2^n is the normal float with biased exponent n + 127.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    e_r * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// The fused kernels with their arguments, each run by [`Kernel::run`] compiled for the
/// widest vector instructions this CPU has, picked at run time (AVX2 with FMA on most x86-64
/// boxes, through `pulp`). The build targets baseline x86-64, whose SSE2 loops are four lanes
/// wide without fused multiply-add; these loops were about a seventh of the GPT's step that
/// way. Only code inlined into the dispatched function gets the wider instructions: a closure is
/// inlined only when the compiler finds it small enough (the larger kernels stayed out of
/// line), so each kernel is an `#[inline(always)]` function of plain loops over slices (the
/// standard library's `extend` and `collect` stay out of line too), called from an
/// `#[inline(always)]` `with_simd`. The numbers are the same either way up to the rounding of
/// a fused multiply-add.
enum Kernel<'a> {
    AddBias {
        x: &'a [f32],
        bias: &'a [f32],
        out: &'a mut [f32],
    },
    SumRows {
        x: &'a [f32],
        sum: &'a mut [f32],
    },
    LayerNorm {
        x: &'a [f32],
        weight: &'a [f32],
        bias: &'a [f32],
        eps: f32,
        out: &'a mut [f32],
    },
    LayerNormGrad {
        x: &'a [f32],
        weight: &'a [f32],
        grad: &'a [f32],
        eps: f32,
        out: &'a mut [f32],
    },
    CausalSoftmax {
        x: &'a [f32],
        time: usize,
        scale: f32,
        out: &'a mut [f32],
    },
    SoftmaxGrad {
        y: &'a [f32],
        g: &'a [f32],
        width: usize,
        scale: f32,
        out: &'a mut [f32],
    },
    Silu {
        x: &'a [f32],
        out: &'a mut [f32],
    },
    SiluGrad {
        x: &'a [f32],
        g: &'a [f32],
        out: &'a mut [f32],
    },
    CrossEntropy {
        logits: &'a [f32],
        targets: &'a [usize],
        classes: usize,
        total: &'a mut f64,
    },
    CrossEntropyGrad {
        logits: &'a [f32],
        targets: &'a [usize],
        classes: usize,
        per_row: f32,
        out: &'a mut [f32],
    },
}

impl pulp::WithSimd for Kernel<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        match self {
            Kernel::AddBias { x, bias, out } => add_bias_rows(x, bias, out),
            Kernel::SumRows { x, sum } => add_rows_into(x, sum),
            Kernel::LayerNorm {
                x,
                weight,
                bias,
                eps,
                out,
            } => layer_norm_rows(x, weight, bias, eps, out),
            Kernel::LayerNormGrad {
                x,
                weight,
                grad,
                eps,
                out,
            } => layer_norm_grad_rows(x, weight, grad, eps, out),
            Kernel::CausalSoftmax {
                x,
                time,
                scale,
                out,
            } => causal_softmax_rows(x, time, scale, out),
            Kernel::SoftmaxGrad {
                y,
                g,
                width,
                scale,
                out,
            } => softmax_grad_rows(y, g, width, scale, out),
            Kernel::Silu { x, out } => silu_values(x, out),
            Kernel::SiluGrad { x, g, out } => silu_grad_values(x, g, out),
            Kernel::CrossEntropy {
                logits,
                targets,
                classes,
                total,
            } => *total = cross_entropy_total(logits, targets, classes),
            Kernel::CrossEntropyGrad {
                logits,
                targets,
                classes,
                per_row,
                out,
            } => cross_entropy_grad_rows(logits, targets, classes, per_row, out),
        }
    }
}

impl Kernel<'_> {
    /// Runs the kernel compiled for the widest vector instructions the CPU has.
    fn run(self) {
        pulp::Arch::new().dispatch(self)
    }
}

/// The sum of `v` in eight running partial sums, so it vectorises (the result differs from
/// a left-to-right sum by rounding only).
#[inline(always)]
pub(crate) fn sum(v: &[f32]) -> f32 {
    sum_map(v, |x| x)
}

/// The sum of `f(x)` over `v`, in eight running partial sums (see [`sum`]).
#[inline(always)]
fn sum_map(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder().iter().map(|&x| f(x)).sum::<f32>();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f(x);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// The dot product of `a` and `b` (of one length), in eight running partial sums.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (chunks_a, chunks_b) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = chunks_a
        .remainder()
        .iter()
        .zip(chunks_b.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (ca, cb) in chunks_a.zip(chunks_b) {
        for ((lane, x), y) in lanes.iter_mut().zip(ca).zip(cb) {
            *lane += x * y;
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// A contiguous f32 slice of a custom op's input, or an error naming the op.
pub(crate) fn f32_slice<'a>(
    op: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [f32]> {
    let (from, to) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: input not contiguous")))?;
    Ok(&storage.as_slice::<f32>()?[from..to])
}

/// The last dimension of `dims`, which must be non-zero, and how many rows of it there are.
pub(crate) fn rows_of(op: &str, dims: &[usize]) -> candle_core::Result<(usize, usize)> {
    let width = dims.last().copied().unwrap_or(1);
    if width == 0 {
        return Err(candle_core::Error::Msg(format!("{op}: empty rows")));
    }
    Ok((dims.iter().product::<usize>() / width, width))
}

/// `x + bias` with `bias` `(n,)` added to every row of `x` `(…, n)`.
pub fn add_bias(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    if !serves(x) {
        return Ok(x.broadcast_add(bias)?);
    }
    Ok(x.contiguous()?.apply_op2(&bias.contiguous()?, AddBias)?)
}

struct AddBias;

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "add-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, bias) = (
            f32_slice("add-bias", s1, l1)?,
            f32_slice("add-bias", s2, l2)?,
        );
        let (_, width) = rows_of("add-bias", l1.dims())?;
        if bias.len() != width {
            return Err(candle_core::Error::Msg(format!(
                "add-bias: {} biases for rows of {width}",
                bias.len()
            )));
        }
        let mut out = vec![0f32; x.len()];
        Kernel::AddBias {
            x,
            bias,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_bias = grad
            .contiguous()?
            .apply_op1_no_bwd(&SumRows)?
            .reshape(bias.shape())?;
        Ok((Some(grad.clone()), Some(grad_bias)))
    }
}

/// `out = x + bias` row by row (`bias` as wide as a row).
#[inline(always)]
fn add_bias_rows(x: &[f32], bias: &[f32], out: &mut [f32]) {
    let width = bias.len();
    for (out, row) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        for ((o, a), b) in out.iter_mut().zip(row).zip(bias) {
            *o = a + b;
        }
    }
}

/// The sum of the rows of `(…, n)`: `(n,)`.
struct SumRows;

impl CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "sum-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("sum-rows", s, l)?;
        let (_, width) = rows_of("sum-rows", l.dims())?;
        let mut sum = vec![0f32; width];
        Kernel::SumRows { x, sum: &mut sum }.run();
        Ok((CpuStorage::F32(sum), Shape::from(width)))
    }
}

/// Adds every row of `x` onto `sum` (as wide as a row).
#[inline(always)]
fn add_rows_into(x: &[f32], sum: &mut [f32]) {
    for row in x.chunks_exact(sum.len()) {
        for (s, v) in sum.iter_mut().zip(row) {
            *s += v;
        }
    }
}

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

struct LayerNorm {
    eps: f32,
}

/// A row's mean and reciprocal standard deviation.
#[inline(always)]
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
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
fn layer_norm_rows(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
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
struct LayerNormGrad {
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
}

/// Layer norm's gradients for rows `x` with output gradient `grad`, into `out`
/// `(rows + 2, width)`: the input's rows, then the weight's and the bias's.
#[inline(always)]
fn layer_norm_grad_rows(x: &[f32], weight: &[f32], grad: &[f32], eps: f32, out: &mut [f32]) {
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

struct CausalSoftmax {
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
fn causal_softmax_rows(x: &[f32], time: usize, scale: f32, out: &mut [f32]) {
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
struct SoftmaxGrad {
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
}

/// Softmax's input gradient row by row: `scale · y · (g − Σ g·y)` into `out`.
#[inline(always)]
fn softmax_grad_rows(y: &[f32], g: &[f32], width: usize, scale: f32, out: &mut [f32]) {
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

/// SiLU, `x · sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if !serves(x) {
        return Ok(x.silu()?);
    }
    Ok(x.contiguous()?.apply_op1(Silu)?)
}

struct Silu;

impl CustomOp1 for Silu {
    fn name(&self) -> &'static str {
        "silu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice("silu", s, l)?;
        let mut out = vec![0f32; x.len()];
        Kernel::Silu { x, out: &mut out }.run();
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &SiluGrad)?))
    }
}

/// `out = silu(x)`, value by value.
#[inline(always)]
fn silu_values(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v / (1.0 + exp(-v));
    }
}

/// SiLU's input gradient: `g · s · (1 + x · (1 − s))` with `s = sigmoid(x)`.
struct SiluGrad;

impl CustomOp2 for SiluGrad {
    fn name(&self) -> &'static str {
        "silu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, g) = (
            f32_slice("silu-grad", s1, l1)?,
            f32_slice("silu-grad", s2, l2)?,
        );
        if g.len() != x.len() {
            return Err(candle_core::Error::Msg(
                "silu-grad: gradient of the wrong size".into(),
            ));
        }
        let mut out = vec![0f32; x.len()];
        Kernel::SiluGrad {
            x,
            g,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// SiLU's input gradient value by value into `out`.
#[inline(always)]
fn silu_grad_values(x: &[f32], g: &[f32], out: &mut [f32]) {
    for ((o, &x), g) in out.iter_mut().zip(x).zip(g) {
        let s = 1.0 / (1.0 + exp(-x));
        *o = g * s * (1.0 + x * (1.0 - s));
    }
}

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
fn class_indices(
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
fn log_sum_exp(row: &[f32], exps: &mut [f32]) -> (f32, f32) {
    let top = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for (e, v) in exps.iter_mut().zip(row) {
        *e = exp(v - top);
    }
    (top, sum(exps).ln())
}

/// The summed cross-entropy of rows of `logits` against `targets` (checked indices).
#[inline(always)]
fn cross_entropy_total(logits: &[f32], targets: &[usize], classes: usize) -> f64 {
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
fn cross_entropy_grad_rows(
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

struct CrossEntropy;

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
struct CrossEntropyGrad {
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
}

/// The sum of the rows of `x` `(…, n)`: `(n,)` (a bias's gradient).
pub(crate) fn sum_rows(x: &Tensor) -> Result<Tensor> {
    if !serves(x) {
        let (rows, width) = rows_of("sum-rows", x.dims())?;
        return Ok(x.reshape((rows, width))?.sum(0)?);
    }
    Ok(x.contiguous()?.apply_op1_no_bwd(&SumRows)?)
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

/// The causal softmax's input gradient from its output `weights` and their gradient.
pub(crate) fn causal_softmax_grad(weights: &Tensor, grad: &Tensor, scale: f64) -> Result<Tensor> {
    let op = SoftmaxGrad {
        scale: scale as f32,
    };
    Ok(weights
        .contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &op)?)
}

/// SiLU's input gradient at `x` for the output gradient `grad`.
pub(crate) fn silu_grad(x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &SiluGrad)?)
}

/// The mean cross-entropy's gradient for `logits`: `(softmax − one-hot) / n`.
pub(crate) fn cross_entropy_grad(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let targets = targets.to_dtype(DType::U32)?;
    Ok(logits
        .contiguous()?
        .apply_op2_no_bwd(&targets, &CrossEntropyGrad { scale: 1.0 })?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_diff;
    use candle_core::{Device, Var};

    /// The vectorisable `exp` stays within a few ulp of the C library's over the whole
    /// clamped range, clamps outside it, and keeps NaN; the eight-lane sum adds up.
    #[test]
    fn exp_and_sum_match_the_standard_library() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let (ours, std) = (f64::from(exp(x)), f64::from(x.exp()));
            worst = worst.max((ours - std).abs() / std);
        }
        assert!(worst < 4e-7, "relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
        assert_eq!(exp(1000.0), exp(88.0));
        assert!(exp(f32::NAN).is_nan());
        let v: Vec<f32> = (0..1003).map(|i| i as f32 * 0.5).collect();
        assert_eq!(sum(&v), v.iter().sum::<f32>());
    }

    /// Seeded values in [-2, 2): wide enough that SiLU and softmax see both tails.
    fn seeded(shape: &[usize], seed: u64) -> Var {
        crate::testing::seeded(shape, seed, 2.0)
    }

    /// A loss that weighs every output value differently, so a gradient that mixes up
    /// positions shows.
    fn weighted_sum(t: &Tensor, seed: u64) -> Tensor {
        let weights = seeded(t.dims(), seed);
        (t * weights.as_tensor())
            .and_then(|t| t.sum_all())
            .expect("loss")
    }

    /// Runs `fused` and `reference` on the same variables and compares the outputs and every
    /// variable's gradient.
    fn same_as(
        what: &str,
        vars: &[&Var],
        fused: impl Fn() -> Tensor,
        reference: impl Fn() -> Tensor,
    ) {
        let (ours, theirs) = (fused(), reference());
        assert_eq!(ours.dims(), theirs.dims(), "{what}: shape");
        assert!(max_diff(&ours, &theirs) < 1e-5, "{what}: forward");
        let g_ours = weighted_sum(&ours, 9).backward().expect("ours backward");
        let g_theirs = weighted_sum(&theirs, 9)
            .backward()
            .expect("reference backward");
        for (i, v) in vars.iter().enumerate() {
            let (a, b) = (
                g_ours.get(v.as_tensor()).expect("our gradient"),
                g_theirs.get(v.as_tensor()).expect("reference gradient"),
            );
            assert!(max_diff(a, b) < 1e-4, "{what}: gradient of input {i}");
        }
    }

    #[test]
    fn linear_matches_candles_linear() {
        let x = seeded(&[3, 5, 7], 1);
        let w = seeded(&[4, 7], 2);
        let b = seeded(&[4], 3);
        same_as(
            "linear",
            &[&x, &w, &b],
            || {
                crate::cpu::matmul::linear_nd(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()))
                    .expect("ours")
            },
            || {
                use candle_core::Module;
                candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))
                    .forward(x.as_tensor())
                    .expect("candle")
            },
        );
    }

    #[test]
    fn layer_norm_matches_the_composition() {
        let x = seeded(&[2, 3, 16], 4);
        let w = seeded(&[16], 5);
        let b = seeded(&[16], 6);
        same_as(
            "layer norm",
            &[&x, &w, &b],
            || layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).expect("ours"),
            || {
                let composed = || -> candle_core::Result<Tensor> {
                    let x = x.as_tensor();
                    let centred = x.broadcast_sub(&(x.sum_keepdim(D::Minus1)? / 16.0)?)?;
                    let var = (centred.sqr()?.sum_keepdim(D::Minus1)? / 16.0)?;
                    centred
                        .broadcast_div(&(var + 1e-5)?.sqrt()?)?
                        .broadcast_mul(w.as_tensor())?
                        .broadcast_add(b.as_tensor())
                };
                composed().expect("composition")
            },
        );
    }

    #[test]
    fn causal_softmax_matches_a_masked_softmax() {
        let scores = seeded(&[2, 3, 6, 6], 7);
        let scale = 0.35;
        same_as(
            "causal softmax",
            &[&scores],
            || causal_softmax(scores.as_tensor(), scale).expect("ours"),
            || {
                let mask: Vec<f32> = (0..36)
                    .map(|k| if k % 6 > k / 6 { -1e9 } else { 0.0 })
                    .collect();
                let mask = Tensor::from_vec(mask, (6, 6), &Device::Cpu).expect("mask");
                let masked = (scores.as_tensor() * scale)
                    .and_then(|s| s.broadcast_add(&mask))
                    .expect("masked");
                candle_nn::ops::softmax(&masked, D::Minus1).expect("softmax")
            },
        );
    }

    #[test]
    fn silu_matches_candles() {
        let x = seeded(&[4, 9], 8);
        same_as(
            "silu",
            &[&x],
            || silu(x.as_tensor()).expect("ours"),
            || x.as_tensor().silu().expect("candle"),
        );
    }

    #[test]
    fn cross_entropy_matches_candles() {
        let logits = seeded(&[6, 5], 10);
        let targets = Tensor::new(&[0u32, 4, 2, 2, 1, 3], &Device::Cpu).expect("targets");
        same_as(
            "cross-entropy",
            &[&logits],
            || cross_entropy(logits.as_tensor(), &targets).expect("ours"),
            || candle_nn::loss::cross_entropy(logits.as_tensor(), &targets).expect("candle"),
        );
    }

    #[test]
    fn cross_entropy_refuses_a_target_outside_the_classes() {
        let logits = seeded(&[2, 3], 11);
        let targets = Tensor::new(&[0u32, 3], &Device::Cpu).expect("targets");
        assert!(cross_entropy(logits.as_tensor(), &targets).is_err());
    }

    #[test]
    fn add_bias_refuses_a_bias_of_the_wrong_width() {
        let x = seeded(&[2, 3], 12);
        let b = seeded(&[4], 13);
        assert!(add_bias(x.as_tensor(), b.as_tensor()).is_err());
    }
}
