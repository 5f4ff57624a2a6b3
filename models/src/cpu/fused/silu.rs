//! SiLU, `x * sigmoid(x)`, forward and backward.

use super::*;

/// SiLU, `x · sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if !serves(x) {
        return Ok(x.silu()?);
    }
    Ok(x.contiguous()?.apply_op1(Silu)?)
}

pub(super) struct Silu;

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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::silu(s, l)
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &SiluGrad)?))
    }
}

/// `out = silu(x)`, value by value.
#[inline(always)]
pub(super) fn silu_values(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v / (1.0 + exp(-v));
    }
}

/// SiLU's input gradient: `g · s · (1 + x · (1 − s))` with `s = sigmoid(x)`.
pub(super) struct SiluGrad;

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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::gpu::ops::silu_grad(s1, l1, s2, l2)
    }
}

/// SiLU's input gradient value by value into `out`.
#[inline(always)]
pub(super) fn silu_grad_values(x: &[f32], g: &[f32], out: &mut [f32]) {
    for ((o, &x), g) in out.iter_mut().zip(x).zip(g) {
        let s = 1.0 / (1.0 + exp(-x));
        *o = g * s * (1.0 + x * (1.0 - s));
    }
}

/// SiLU's input gradient at `x` for the output gradient `grad`.
pub(crate) fn silu_grad(x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &SiluGrad)?)
}
