//! SwiGLU's gate, `silu(gate) · up` (the Llama's MLP), forward and backward, one pass each.
//!
//! On a GPU with the `kernels` lever each runs its twin in `gpu/kernels.cu`; elsewhere the
//! composition of [`silu`] and a product runs.

use super::*;

/// `silu(gate) · up`, value by value (`gate` and `up` of one shape).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        return Err(Error::Layout(format!(
            "swiglu of gate {:?} and up {:?}",
            gate.dims(),
            up.dims()
        )));
    }
    if !serves(gate) {
        return Ok((silu(gate)? * up)?);
    }
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)?)
}

struct SwiGlu;

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (gate, up) = (f32_slice("swiglu", s1, l1)?, f32_slice("swiglu", s2, l2)?);
        if gate.len() != up.len() {
            return Err(candle_core::Error::Msg("swiglu: gate and up differ".into()));
        }
        let mut out = vec![0f32; gate.len()];
        Kernel::SwiGlu {
            gate,
            up,
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
        crate::gpu::ops::swiglu(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (d_gate, d_up) = swiglu_grad(gate, up, grad).map_err(candle_core::Error::wrap)?;
        Ok((Some(d_gate), Some(d_up)))
    }
}

/// `out = silu(gate) · up`, value by value.
#[inline(always)]
pub(super) fn swiglu_values(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &x), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = x / (1.0 + exp(-x)) * u;
    }
}

/// SwiGLU's two gradients from `(gate, up, grad)`, packed as one `(2, n)` tensor: the gate's,
/// then the up projection's.
struct SwiGluGrad;

impl CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "swiglu-grad"
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
        let gate = f32_slice("swiglu-grad", s1, l1)?;
        let up = f32_slice("swiglu-grad", s2, l2)?;
        let g = f32_slice("swiglu-grad", s3, l3)?;
        if up.len() != gate.len() || g.len() != gate.len() {
            return Err(candle_core::Error::Msg(
                "swiglu-grad: inputs of different sizes".into(),
            ));
        }
        let mut out = vec![0f32; 2 * gate.len()];
        Kernel::SwiGluGrad {
            gate,
            up,
            g,
            out: &mut out,
        }
        .run();
        Ok((CpuStorage::F32(out), Shape::from((2, gate.len()))))
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
        crate::gpu::ops::swiglu_grad((s1, l1), (s2, l2), (s3, l3))
    }
}

/// With `s = sigmoid(gate)`: the gate's gradient `g · up · s · (1 + gate · (1 − s))` and the up
/// projection's `g · silu(gate)`, into the two halves of `out`.
#[inline(always)]
pub(super) fn swiglu_grad_values(gate: &[f32], up: &[f32], g: &[f32], out: &mut [f32]) {
    let (d_gate, d_up) = out.split_at_mut(gate.len());
    for (((dg, du), (&x, &u)), &g) in d_gate
        .iter_mut()
        .zip(d_up.iter_mut())
        .zip(gate.iter().zip(up))
        .zip(g)
    {
        let s = 1.0 / (1.0 + exp(-x));
        *du = g * x * s;
        *dg = g * u * s * (1.0 + x * (1.0 - s));
    }
}

/// SwiGLU's gradients `(gate, up)` for the output gradient `grad` (f32, where the fused kernels
/// serve).
pub(crate) fn swiglu_grad(gate: &Tensor, up: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let packed =
        gate.contiguous()?
            .apply_op3_no_bwd(&up.contiguous()?, &grad.contiguous()?, &SwiGluGrad)?;
    Ok((
        packed.get(0)?.reshape(gate.shape())?,
        packed.get(1)?.reshape(gate.shape())?,
    ))
}
