//! Fused CPU kernels, each with its own backward pass, for the element-wise and row-wise
//! parts of a training step: bias addition, layer norm, causal softmax, SiLU and the
//! cross-entropy loss; for the Llama, RMS norm, SwiGLU's gate and rotary embeddings.
//!
//! Candle 0.11 builds these from its basic ops, so on one core a small GPT's step spent more
//! time outside the matrix products than in them: each basic op allocates its output, autograd
//! seeds and sums a gradient for every intermediate, and a bias's gradient (a sum over the rows
//! of a broadcast) takes Candle's strided reduction, the slowest loop of the step. Here each
//! composite is one loop over its rows forward and one backward. The numbers are those of the
//! composition they replace (the tests compare values and gradients against it). On a GPU
//! (the `cuda` feature, with the `kernels` lever of [`crate::gpu`]) each op runs its twin in
//! `gpu/kernels.cu`; for other float types or devices, the Candle composition itself runs.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

use crate::{Error, Result};

pub use loss::*;
pub use norm::*;
pub(crate) use rms::rms_norm_grad;
pub use rms::*;
pub(crate) use rotary::{rotary_from_heads, rotary_to_heads};
pub use silu::*;
pub use softmax::*;
pub(crate) use swiglu::swiglu_grad;
pub use swiglu::*;

mod loss;
mod norm;
mod rms;
mod rotary;
mod silu;
mod softmax;
mod swiglu;

/// Whether the fused kernels (and the hand-written backward passes built on them) serve this
/// tensor: f32 on the CPU, or on a GPU whose kernels are on; elsewhere the Candle composition
/// runs.
pub(crate) fn serves(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && crate::gpu::kernels_serve(x.device())
}

/// Whether `x` is f32 on the CPU: what the CPU-only kernels (gemm, convolutions) need.
pub(crate) fn on_cpu(x: &Tensor) -> bool {
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
    RmsNorm {
        x: &'a [f32],
        weight: &'a [f32],
        eps: f32,
        out: &'a mut [f32],
    },
    RmsNormGrad {
        x: &'a [f32],
        weight: &'a [f32],
        grad: &'a [f32],
        eps: f32,
        out: &'a mut [f32],
    },
    SwiGlu {
        gate: &'a [f32],
        up: &'a [f32],
        out: &'a mut [f32],
    },
    SwiGluGrad {
        gate: &'a [f32],
        up: &'a [f32],
        g: &'a [f32],
        out: &'a mut [f32],
    },
    Rotary {
        x: &'a [f32],
        cos: &'a [f32],
        sin: &'a [f32],
        dims: [usize; 4],
        back: bool,
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
            Kernel::RmsNorm {
                x,
                weight,
                eps,
                out,
            } => rms::rms_norm_rows(x, weight, eps, out),
            Kernel::RmsNormGrad {
                x,
                weight,
                grad,
                eps,
                out,
            } => rms::rms_norm_grad_rows(x, weight, grad, eps, out),
            Kernel::SwiGlu { gate, up, out } => swiglu::swiglu_values(gate, up, out),
            Kernel::SwiGluGrad { gate, up, g, out } => swiglu::swiglu_grad_values(gate, up, g, out),
            Kernel::Rotary {
                x,
                cos,
                sin,
                dims,
                back,
                out,
            } => rotary::rotary_rows(x, cos, sin, dims, back, out),
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::add_bias(s1, l1, s2, l2)
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::sum_rows(s, l)
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

/// The sum of the rows of `x` `(…, n)`: `(n,)` (a bias's gradient).
pub(crate) fn sum_rows(x: &Tensor) -> Result<Tensor> {
    if !serves(x) {
        let (rows, width) = rows_of("sum-rows", x.dims())?;
        return Ok(x.reshape((rows, width))?.sum(0)?);
    }
    Ok(x.contiguous()?.apply_op1_no_bwd(&SumRows)?)
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
    fn rms_norm_matches_the_composition() {
        let x = seeded(&[2, 3, 16], 14);
        let w = seeded(&[16], 15);
        same_as(
            "rms norm",
            &[&x, &w],
            || rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).expect("ours"),
            || {
                let composed = || -> candle_core::Result<Tensor> {
                    let x = x.as_tensor();
                    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
                    x.broadcast_div(&(mean_square + 1e-5)?.sqrt()?)?
                        .broadcast_mul(w.as_tensor())
                };
                composed().expect("composition")
            },
        );
    }

    #[test]
    fn swiglu_matches_the_composition() {
        let gate = seeded(&[5, 9], 16);
        let up = seeded(&[5, 9], 17);
        same_as(
            "swiglu",
            &[&gate, &up],
            || swiglu(gate.as_tensor(), up.as_tensor()).expect("ours"),
            || (gate.as_tensor().silu().expect("silu") * up.as_tensor()).expect("product"),
        );
    }

    /// The fused rotary embedding turns and moves heads as the composition `x · cos +
    /// rotate_half(x) · sin` after a transpose does, and its gradient is autograd's through
    /// that composition.
    #[test]
    fn rotary_matches_the_composition_both_ways() {
        let (batch, time, heads, hd) = (2, 5, 3, 6);
        let x = seeded(&[batch, time, heads, hd], 18);
        let angles: Vec<f32> = (0..time * hd)
            .map(|k| (k / hd) as f32 * 0.3 / (1 + k % (hd / 2)) as f32)
            .collect();
        let angles = Tensor::from_vec(angles, (time, hd), &Device::Cpu).expect("angles");
        let (cos, sin) = (angles.cos().expect("cos"), angles.sin().expect("sin"));
        let composed = |x: &Tensor| -> Tensor {
            let turn = || -> candle_core::Result<Tensor> {
                let x = x.transpose(1, 2)?;
                let (first, second) = (x.narrow(3, 0, hd / 2)?, x.narrow(3, hd / 2, hd / 2)?);
                let half = Tensor::cat(&[&second.neg()?, &first], 3)?;
                x.broadcast_mul(&cos)? + half.broadcast_mul(&sin)?
            };
            turn().expect("composition")
        };
        let ours = rotary_to_heads(x.as_tensor(), &cos, &sin).expect("ours");
        let theirs = composed(x.as_tensor());
        assert_eq!(ours.dims(), [batch, heads, time, hd]);
        assert!(max_diff(&ours, &theirs) < 1e-6);
        let g = seeded(&[batch, heads, time, hd], 19);
        let reference = (theirs * g.as_tensor())
            .and_then(|t| t.sum_all())
            .and_then(|l| l.backward())
            .expect("autograd");
        let back = rotary_from_heads(g.as_tensor(), &cos, &sin).expect("back");
        assert_eq!(back.dims(), [batch, time, heads, hd]);
        assert!(max_diff(&back, reference.get(x.as_tensor()).expect("grad")) < 1e-6);
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
