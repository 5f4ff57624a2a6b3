//! Rotary position embeddings in Hugging Face's layout (each head's dimension `i` turns with
//! `i + head_dim / 2`), fused with the move between a linear layer's row layout and attention's
//! per-head layout, forward and backward: one pass over the values each way.
//!
//! The Llama's hand-written backward pass is the one caller; on a GPU with the `kernels` lever
//! the op runs its twin in `gpu/kernels.cu`.

use super::*;

/// Turns the heads of `x` `(batch, time, heads, head_dim)` (a projection's output, its rows
/// split into heads) by each position's angles and returns them per head, `(batch, heads,
/// time, head_dim)`: `x · cos + rotate_half(x) · sin`, with `cos` and `sin` `(time, head_dim)`
/// (each row's halves equal, as the Llama's tables are).
pub(crate) fn rotary_to_heads(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotary(x, cos, sin, false)
}

/// The gradient of [`rotary_to_heads`]: turns a gradient `(batch, heads, time, head_dim)` back
/// by each position's angles (the transpose of a rotation is the rotation by minus its angle)
/// into the rows' layout `(batch, time, heads, head_dim)`.
pub(crate) fn rotary_from_heads(grad: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotary(grad, cos, sin, true)
}

fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor, back: bool) -> Result<Tensor> {
    let (batch, a, b, head_dim) = x.dims4()?;
    let time = if back { b } else { a };
    if !serves(x) || !serves(cos) || !serves(sin) || !x.device().same_device(cos.device()) {
        return Err(Error::Layout(
            "the fused rotary embedding runs on f32 tensors of one device where the fused kernels serve".into(),
        ));
    }
    if cos.dims() != [time, head_dim] || sin.dims() != [time, head_dim] || head_dim % 2 != 0 {
        return Err(Error::Layout(format!(
            "rotary tables {:?} and {:?} for {time} positions of heads {head_dim} wide",
            cos.dims(),
            sin.dims()
        )));
    }
    let op = Rotary {
        dims: [batch, a, b, head_dim],
        back,
    };
    Ok(x.contiguous()?
        .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)?)
}

/// Reads `(batch, a, b, head_dim)` and writes `(batch, b, a, head_dim)`, each head turned by
/// the angles of its position: dimension `a` forward, `b` back (where the turn is reversed).
struct Rotary {
    dims: [usize; 4],
    back: bool,
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        "rotary"
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
        let x = f32_slice("rotary", s1, l1)?;
        let cos = f32_slice("rotary", s2, l2)?;
        let sin = f32_slice("rotary", s3, l3)?;
        let [batch, a, b, head_dim] = self.dims;
        if x.len() != batch * a * b * head_dim {
            return Err(candle_core::Error::Msg(
                "rotary: input of the wrong size".into(),
            ));
        }
        let mut out = vec![0f32; x.len()];
        Kernel::Rotary {
            x,
            cos,
            sin,
            dims: self.dims,
            back: self.back,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), Shape::from((batch, b, a, head_dim))))
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
        crate::gpu::ops::rotary((s1, l1), (s2, l2), (s3, l3), self.dims, self.back)
    }
}

/// The rotary kernel's loop (see [`Rotary`]).
#[inline(always)]
pub(super) fn rotary_rows(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    [batch, a, b, head_dim]: [usize; 4],
    back: bool,
    out: &mut [f32],
) {
    let half = head_dim / 2;
    let sign = if back { -1.0f32 } else { 1.0 };
    for n in 0..batch {
        for i in 0..a {
            for j in 0..b {
                let position = if back { j } else { i };
                let src = &x[((n * a + i) * b + j) * head_dim..][..head_dim];
                let dst = &mut out[((n * b + j) * a + i) * head_dim..][..head_dim];
                // The halves of a table row are equal: the first serves both.
                let c = &cos[position * head_dim..][..half];
                let s = &sin[position * head_dim..][..half];
                let (x1, x2) = src.split_at(half);
                let (o1, o2) = dst.split_at_mut(half);
                for ((((o1, o2), (&x1, &x2)), &c), &s) in o1
                    .iter_mut()
                    .zip(o2.iter_mut())
                    .zip(x1.iter().zip(x2))
                    .zip(c)
                    .zip(s)
                {
                    let s = sign * s;
                    *o1 = x1 * c - x2 * s;
                    *o2 = x2 * c + x1 * s;
                }
            }
        }
    }
}
