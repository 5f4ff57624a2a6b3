//! The launchers of `kernels.cu` behind the fused ops' and the optimizer passes' `cuda_fwd`,
//! and the device-wide levers (events, memory pool, TF32). Every launcher checks the sizes the
//! CPU kernel checks and the sizes its launch can number in 32 bits, reads contiguous `f32`
//! inputs (with their offsets) and writes a fresh output of exactly the size the kernel writes
//! whole, or updates its destination in place.
//!
//! The crate's second module with `unsafe`: kernel launches, uninitialised device allocations
//! that the kernel then writes in full, and the driver calls for the memory pool.
#![allow(unsafe_code)]

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    result, sys, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Shape};

use super::Levers;

/// The name the kernels' module is loaded under on each device.
const MODULE: &str = "p2ptrain_kernels";

/// The kernels' CUDA C source.
const SOURCE: &str = include_str!("kernels.cu");

type CandleResult<T> = candle_core::Result<T>;

/// The kernels' PTX, compiled by NVRTC once per process (for the oldest architecture NVRTC
/// targets, so the driver can load it on any GPU it supports).
pub(crate) fn ptx() -> CandleResult<&'static str> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        nvrtc::compile_ptx(SOURCE)
            .map(|p| p.to_src())
            .map_err(|e| e.to_string())
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(format!("cannot compile p2ptrain's GPU kernels: {e}")))
}

/// Applies the device-wide levers to a device on which no tensor exists yet.
pub(crate) fn prepare(dev: &CudaDevice, levers: &Levers) -> crate::Result<()> {
    if levers.events_off && dev.is_event_tracking() {
        // SAFETY: a node uses the device's one stream (Candle's), so no buffer is shared
        // between streams, which is all event tracking orders; and no tensor exists yet.
        unsafe { dev.disable_event_tracking() };
    }
    if levers.pool {
        let context = dev.cuda_stream().context().clone();
        let mut threshold = u64::MAX;
        // SAFETY: the device handle is the context's own; the attribute takes a u64.
        unsafe {
            let pool = result::device::get_default_mem_pool(context.cu_device())
                .map_err(candle_core::Error::wrap)?;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .map_err(candle_core::Error::wrap)?;
        }
    }
    if levers.tf32 {
        candle_core::cuda::set_gemm_reduced_precision_f32(true);
    }
    if levers.kernels {
        // One clear error at start-up rather than at the first step.
        ptx()?;
    }
    Ok(())
}

/// Waits for `dev`'s queued work, then trims its default memory pool to nothing kept.
pub(crate) fn release_cached_memory(dev: &CudaDevice) -> crate::Result<()> {
    candle_core::backend::BackendDevice::synchronize(dev)?;
    let context = dev.cuda_stream().context().clone();
    // SAFETY: the device handle is the context's own; trimming frees only memory the pool
    // holds unallocated.
    unsafe {
        let pool = result::device::get_default_mem_pool(context.cu_device())
            .map_err(candle_core::Error::wrap)?;
        result::mem_pool::trim_to(pool, 0).map_err(candle_core::Error::wrap)?;
    }
    Ok(())
}

/// Loads `$name` from the kernels' module on `$dev` and launches it with `$cfg` and the
/// arguments (references to values and device memory that outlive the launch).
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let func = $dev.get_or_load_custom_func($name, MODULE, ptx()?)?;
        let mut builder = func.builder();
        $( builder.arg($arg); )+
        // SAFETY: the arguments match the kernel's signature in kernels.cu, and every buffer
        // holds at least the elements the kernel reads or writes for these sizes.
        unsafe { builder.launch($cfg) }.w()?;
    }};
}

/// The contiguous `f32` elements of an input under `layout`.
fn input<'a>(op: &str, s: &'a CudaStorage, l: &Layout) -> CandleResult<CudaView<'a, f32>> {
    let (from, to) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: input not contiguous")))?;
    Ok(s.as_cuda_slice::<f32>()?.slice(from..to))
}

/// The contiguous `u32` elements of an input (class indices).
fn input_u32<'a>(op: &str, s: &'a CudaStorage, l: &Layout) -> CandleResult<CudaView<'a, u32>> {
    let (from, to) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: targets not contiguous")))?;
    Ok(s.as_cuda_slice::<u32>()?.slice(from..to))
}

/// The contiguous `f32` elements of an in-place destination.
fn in_place<'a>(
    op: &str,
    s: &'a mut CudaStorage,
    l: &Layout,
) -> CandleResult<CudaViewMut<'a, f32>> {
    let (from, to) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: destination not contiguous")))?;
    Ok(s.as_cuda_slice_mut::<f32>()?.slice_mut(from..to))
}

/// A fresh output of `n` values that the kernel writes whole.
fn output(dev: &CudaDevice, n: usize) -> CandleResult<CudaSlice<f32>> {
    // SAFETY: every caller launches a kernel that writes all `n` values before any read.
    unsafe { dev.alloc::<f32>(n) }
}

fn done(dev: &CudaDevice, out: CudaSlice<f32>, shape: Shape) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(out, dev.clone()), shape)
}

fn size_error(op: &str, what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {what}"))
}

/// `u32` for a kernel argument, or an error for sizes past 2^32 − 1.
fn u32_of(op: &str, n: usize) -> CandleResult<u32> {
    u32::try_from(n).map_err(|_| size_error(op, "more than 2^32 - 1 rows or columns"))
}

/// One thread per value, for at most 2^32 − 1 values (a grid of 1024-thread blocks).
fn per_value(op: &str, n: usize) -> CandleResult<LaunchConfig> {
    Ok(LaunchConfig::for_num_elems(u32_of(op, n.max(1))?))
}

/// One warp per row, four rows to a block: the kernels number a row by its thread's index
/// over 32 in 32 bits, so at most 2^27 − 1 rows.
fn warp_per_row(op: &str, rows: u32) -> CandleResult<LaunchConfig> {
    if rows >= 1 << 27 {
        return Err(size_error(op, "more than 2^27 - 1 rows for one warp each"));
    }
    Ok(LaunchConfig {
        grid_dim: (rows.div_ceil(4).max(1), 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One block per row, as many threads as pay for the row's width; at most 2^31 − 1 rows (the
/// grid's limit, and layer norm's gradient keeps two statistics a row at index 2·row).
fn block_per_row(op: &str, rows: u32, width: u32) -> CandleResult<LaunchConfig> {
    if rows >= 1 << 31 {
        return Err(size_error(op, "more than 2^31 - 1 rows for one block each"));
    }
    Ok(LaunchConfig {
        grid_dim: (rows.max(1), 1, 1),
        block_dim: (if width > 512 { 256 } else { 128 }, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Rows per chunk of a column sum: about 128 chunks, at least 32 rows each.
fn rows_per_chunk(rows: u32) -> u32 {
    rows.div_ceil(128).max(32)
}

/// Launches the second pass of a column sum: `out[c]` = the sum of `partial`'s `chunks` rows.
fn col_sum_final(
    dev: &CudaDevice,
    partial: &CudaSlice<f32>,
    out: &mut CudaViewMut<'_, f32>,
    chunks: u32,
    width: u32,
) -> CandleResult<()> {
    let cfg = LaunchConfig {
        grid_dim: (width.div_ceil(256).max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "p2p_col_sum_final", cfg, partial, out, &chunks, &width);
    Ok(())
}

/// `x + bias` row by row.
pub(crate) fn add_bias(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "add-bias";
    let (x, bias) = (input(op, s1, l1)?, input(op, s2, l2)?);
    let width = l1.dims().last().copied().unwrap_or(1);
    if width == 0 || bias.len() != width {
        return Err(size_error(op, "bias not as wide as a row"));
    }
    let dev = s1.device();
    let n = x.len();
    let out = output(dev, n)?;
    let (n64, width32) = (n as u64, u32_of(op, width)?);
    launch!(
        dev,
        "p2p_add_bias",
        per_value(op, n)?,
        &x,
        &bias,
        &out,
        &n64,
        &width32
    );
    Ok(done(dev, out, l1.shape().clone()))
}

/// The sum of the rows of `(…, n)`: `(n,)`.
pub(crate) fn sum_rows(s: &CudaStorage, l: &Layout) -> CandleResult<(CudaStorage, Shape)> {
    let op = "sum-rows";
    let x = input(op, s, l)?;
    let width = l.dims().last().copied().unwrap_or(1);
    if width == 0 {
        return Err(size_error(op, "empty rows"));
    }
    let dev = s.device();
    let (rows, width32) = (u32_of(op, x.len() / width)?, u32_of(op, width)?);
    let chunk = rows_per_chunk(rows);
    let chunks = rows.div_ceil(chunk).max(1);
    let partial = dev.alloc_zeros::<f32>(chunks as usize * width)?;
    let cfg = LaunchConfig {
        grid_dim: (width32.div_ceil(32), chunks, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        "p2p_col_sum_partial",
        cfg,
        &x,
        &partial,
        &rows,
        &width32,
        &chunk
    );
    let mut out = output(dev, width)?;
    col_sum_final(dev, &partial, &mut out.slice_mut(..), chunks, width32)?;
    Ok(done(dev, out, Shape::from(width)))
}

/// Layer norm over the last dimension.
pub(crate) fn layer_norm(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    eps: f32,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "layer-norm";
    let (x, weight, bias) = (input(op, s1, l1)?, input(op, s2, l2)?, input(op, s3, l3)?);
    let width = l1.dims().last().copied().unwrap_or(1);
    if width == 0 || weight.len() != width || bias.len() != width {
        return Err(size_error(op, "weight or bias not as wide as a row"));
    }
    let dev = s1.device();
    let (rows, width32) = (u32_of(op, x.len() / width)?, u32_of(op, width)?);
    let out = output(dev, x.len())?;
    launch!(
        dev,
        "p2p_layer_norm",
        block_per_row(op, rows, width32)?,
        &x,
        &weight,
        &bias,
        &out,
        &rows,
        &width32,
        &eps
    );
    Ok(done(dev, out, l1.shape().clone()))
}

/// Layer norm's gradients packed as `(rows + 2, width)`: the input's rows, then the weight's,
/// then the bias's (as the CPU kernel packs them).
pub(crate) fn layer_norm_grad(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    eps: f32,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "layer-norm-grad";
    let (x, weight, grad) = (input(op, s1, l1)?, input(op, s2, l2)?, input(op, s3, l3)?);
    let width = l1.dims().last().copied().unwrap_or(1);
    if width == 0 || weight.len() != width || grad.len() != x.len() {
        return Err(size_error(op, "weight or gradient of the wrong size"));
    }
    let dev = s1.device();
    let rows_n = x.len() / width;
    let (rows, width32) = (u32_of(op, rows_n)?, u32_of(op, width)?);
    let mut out = output(dev, (rows_n + 2) * width)?;
    let stats = output(dev, 2 * rows_n.max(1))?;
    {
        let dx = out.slice(..rows_n * width);
        launch!(
            dev,
            "p2p_layer_norm_grad_rows",
            block_per_row(op, rows, width32)?,
            &x,
            &weight,
            &grad,
            &dx,
            &stats,
            &rows,
            &width32,
            &eps
        );
    }
    let chunk = rows_per_chunk(rows);
    let chunks = rows.div_ceil(chunk).max(1);
    let partial = dev.alloc_zeros::<f32>(chunks as usize * 2 * width)?;
    let cfg = LaunchConfig {
        grid_dim: (width32.div_ceil(32), chunks, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        "p2p_layer_norm_grad_partial",
        cfg,
        &x,
        &grad,
        &stats,
        &partial,
        &rows,
        &width32,
        &chunk
    );
    let double_width = u32_of(op, 2 * width)?;
    col_sum_final(
        dev,
        &partial,
        &mut out.slice_mut(rows_n * width..),
        chunks,
        double_width,
    )?;
    Ok(done(dev, out, Shape::from((rows_n + 2, width))))
}

/// RMS norm over the last dimension.
pub(crate) fn rms_norm(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    eps: f32,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "rms-norm";
    let (x, weight) = (input(op, s1, l1)?, input(op, s2, l2)?);
    let width = l1.dims().last().copied().unwrap_or(1);
    if width == 0 || weight.len() != width {
        return Err(size_error(op, "weight not as wide as a row"));
    }
    let dev = s1.device();
    let (rows, width32) = (u32_of(op, x.len() / width)?, u32_of(op, width)?);
    let out = output(dev, x.len())?;
    launch!(
        dev,
        "p2p_rms_norm",
        block_per_row(op, rows, width32)?,
        &x,
        &weight,
        &out,
        &rows,
        &width32,
        &eps
    );
    Ok(done(dev, out, l1.shape().clone()))
}

/// RMS norm's gradients packed as `(rows + 1, width)`: the input's rows, then the weight's (as
/// the CPU kernel packs them).
pub(crate) fn rms_norm_grad(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    eps: f32,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "rms-norm-grad";
    let (x, weight, grad) = (input(op, s1, l1)?, input(op, s2, l2)?, input(op, s3, l3)?);
    let width = l1.dims().last().copied().unwrap_or(1);
    if width == 0 || weight.len() != width || grad.len() != x.len() {
        return Err(size_error(op, "weight or gradient of the wrong size"));
    }
    let dev = s1.device();
    let rows_n = x.len() / width;
    let (rows, width32) = (u32_of(op, rows_n)?, u32_of(op, width)?);
    let mut out = output(dev, (rows_n + 1) * width)?;
    let stats = output(dev, rows_n.max(1))?;
    {
        let dx = out.slice(..rows_n * width);
        launch!(
            dev,
            "p2p_rms_norm_grad_rows",
            block_per_row(op, rows, width32)?,
            &x,
            &weight,
            &grad,
            &dx,
            &stats,
            &rows,
            &width32,
            &eps
        );
    }
    let chunk = rows_per_chunk(rows);
    let chunks = rows.div_ceil(chunk).max(1);
    let partial = dev.alloc_zeros::<f32>(chunks as usize * width)?;
    let cfg = LaunchConfig {
        grid_dim: (width32.div_ceil(32), chunks, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        "p2p_rms_norm_grad_partial",
        cfg,
        &x,
        &grad,
        &stats,
        &partial,
        &rows,
        &width32,
        &chunk
    );
    col_sum_final(
        dev,
        &partial,
        &mut out.slice_mut(rows_n * width..),
        chunks,
        width32,
    )?;
    Ok(done(dev, out, Shape::from((rows_n + 1, width))))
}

/// SwiGLU's gate, `silu(gate) · up`.
pub(crate) fn swiglu(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "swiglu";
    let (gate, up) = (input(op, s1, l1)?, input(op, s2, l2)?);
    if gate.len() != up.len() {
        return Err(size_error(op, "gate and up differ"));
    }
    let dev = s1.device();
    let n = gate.len();
    let out = output(dev, n)?;
    let n64 = n as u64;
    launch!(dev, "p2p_swiglu", per_value(op, n)?, &gate, &up, &out, &n64);
    Ok(done(dev, out, l1.shape().clone()))
}

/// SwiGLU's gradients packed as `(2, n)`: the gate's, then the up projection's.
pub(crate) fn swiglu_grad(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "swiglu-grad";
    let (gate, up, g) = (input(op, s1, l1)?, input(op, s2, l2)?, input(op, s3, l3)?);
    if up.len() != gate.len() || g.len() != gate.len() {
        return Err(size_error(op, "inputs of different sizes"));
    }
    let dev = s1.device();
    let n = gate.len();
    let out = output(dev, 2 * n)?;
    let n64 = n as u64;
    launch!(
        dev,
        "p2p_swiglu_grad",
        per_value(op, n)?,
        &gate,
        &up,
        &g,
        &out,
        &n64
    );
    Ok(done(dev, out, Shape::from((2, n))))
}

/// Rotary embeddings fused with the move between a projection's rows and attention's heads:
/// `x` `(batch, a, b, head_dim)` into `(batch, b, a, head_dim)`, turned by the angles of `a`'s
/// positions, or of `b`'s and back with `back` (see the CPU twin, `cpu::fused::rotary`).
pub(crate) fn rotary(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    [batch, a, b, head_dim]: [usize; 4],
    back: bool,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "rotary";
    let (x, cos, sin) = (input(op, s1, l1)?, input(op, s2, l2)?, input(op, s3, l3)?);
    let positions = if back { b } else { a };
    if x.len() != batch * a * b * head_dim
        || head_dim % 2 != 0
        || cos.len() < positions * head_dim
        || sin.len() < positions * head_dim
    {
        return Err(size_error(op, "input or tables of the wrong size"));
    }
    let dev = s1.device();
    let out = output(dev, x.len())?;
    let [batch32, a32, b32, head_dim32] = [
        u32_of(op, batch)?,
        u32_of(op, a)?,
        u32_of(op, b)?,
        u32_of(op, head_dim)?,
    ];
    let back32 = u32::from(back);
    launch!(
        dev,
        "p2p_rotary",
        per_value(op, x.len() / 2)?,
        &x,
        &cos,
        &sin,
        &out,
        &batch32,
        &a32,
        &b32,
        &head_dim32,
        &back32
    );
    Ok(done(dev, out, Shape::from((batch, b, a, head_dim))))
}

/// The causal softmax of `(…, time, time)` scores times `scale`.
pub(crate) fn causal_softmax(
    s: &CudaStorage,
    l: &Layout,
    scale: f32,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "causal-softmax";
    let x = input(op, s, l)?;
    let time = l.dims().last().copied().unwrap_or(1);
    if time == 0 {
        return Err(size_error(op, "empty rows"));
    }
    let dev = s.device();
    let (rows, time32) = (u32_of(op, x.len() / time)?, u32_of(op, time)?);
    let out = output(dev, x.len())?;
    launch!(
        dev,
        "p2p_causal_softmax",
        warp_per_row(op, rows)?,
        &x,
        &out,
        &rows,
        &time32,
        &scale
    );
    Ok(done(dev, out, l.shape().clone()))
}

/// Softmax's input gradient from its output and the output's gradient.
pub(crate) fn softmax_grad(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    scale: f32,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "softmax-grad";
    let (y, g) = (input(op, s1, l1)?, input(op, s2, l2)?);
    let width = l1.dims().last().copied().unwrap_or(1);
    if width == 0 || g.len() != y.len() {
        return Err(size_error(op, "gradient of the wrong size"));
    }
    let dev = s1.device();
    let (rows, width32) = (u32_of(op, y.len() / width)?, u32_of(op, width)?);
    let out = output(dev, y.len())?;
    launch!(
        dev,
        "p2p_softmax_grad",
        warp_per_row(op, rows)?,
        &y,
        &g,
        &out,
        &rows,
        &width32,
        &scale
    );
    Ok(done(dev, out, l1.shape().clone()))
}

/// SiLU.
pub(crate) fn silu(s: &CudaStorage, l: &Layout) -> CandleResult<(CudaStorage, Shape)> {
    let x = input("silu", s, l)?;
    let dev = s.device();
    let n = x.len();
    let out = output(dev, n)?;
    let n64 = n as u64;
    launch!(dev, "p2p_silu", per_value("silu", n)?, &x, &out, &n64);
    Ok(done(dev, out, l.shape().clone()))
}

/// SiLU's input gradient.
pub(crate) fn silu_grad(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "silu-grad";
    let (x, g) = (input(op, s1, l1)?, input(op, s2, l2)?);
    if g.len() != x.len() {
        return Err(size_error(op, "gradient of the wrong size"));
    }
    let dev = s1.device();
    let n = x.len();
    let out = output(dev, n)?;
    let n64 = n as u64;
    launch!(dev, "p2p_silu_grad", per_value(op, n)?, &x, &g, &out, &n64);
    Ok(done(dev, out, l1.shape().clone()))
}

/// Rows and classes of logits with as many `u32` targets as rows.
fn logits_and_targets<'a>(
    op: &str,
    (s1, l1): (&'a CudaStorage, &Layout),
    (s2, l2): (&'a CudaStorage, &Layout),
) -> CandleResult<(CudaView<'a, f32>, CudaView<'a, u32>, u32, u32)> {
    let (logits, targets) = (input(op, s1, l1)?, input_u32(op, s2, l2)?);
    let classes = l1.dims().last().copied().unwrap_or(1);
    if classes == 0 {
        return Err(size_error(op, "no classes"));
    }
    let rows = logits.len() / classes;
    if targets.len() != rows {
        return Err(size_error(
            op,
            &format!("{} targets for {rows} rows", targets.len()),
        ));
    }
    Ok((logits, targets, u32_of(op, rows)?, u32_of(op, classes)?))
}

/// The mean cross-entropy, a scalar (NaN if a target is outside the classes).
pub(crate) fn cross_entropy(
    logits: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "cross-entropy";
    let dev = logits.0.device();
    let (logits, targets, rows, classes) = logits_and_targets(op, logits, targets)?;
    let losses = output(dev, rows.max(1) as usize)?;
    launch!(
        dev,
        "p2p_cross_entropy_rows",
        warp_per_row(op, rows)?,
        &logits,
        &targets,
        &losses,
        &rows,
        &classes
    );
    let mean = output(dev, 1)?;
    let one_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "p2p_mean", one_block, &losses, &mean, &rows);
    Ok(done(dev, mean, Shape::from(())))
}

/// Cross-entropy's gradient `scale · (softmax − one-hot) / rows`.
pub(crate) fn cross_entropy_grad(
    logits: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
    scale: f32,
) -> CandleResult<(CudaStorage, Shape)> {
    let op = "cross-entropy-grad";
    let dev = logits.0.device();
    let shape = logits.1.shape().clone();
    let (logits, targets, rows, classes) = logits_and_targets(op, logits, targets)?;
    let per_row = scale / rows.max(1) as f32;
    let out = output(dev, logits.len())?;
    launch!(
        dev,
        "p2p_cross_entropy_grad",
        warp_per_row(op, rows)?,
        &logits,
        &targets,
        &out,
        &rows,
        &classes,
        &per_row
    );
    Ok(done(dev, out, shape))
}

/// The element count shared by an in-place destination and its sources, or an error.
fn same_len(op: &str, dst: usize, srcs: &[usize]) -> CandleResult<u64> {
    if srcs.iter().any(|&n| n != dst) {
        return Err(size_error(op, "tensors of different sizes"));
    }
    Ok(dst as u64)
}

/// AdamW's moment update in place: `m = decay·m + (1 − decay)·g` (or `g²` with `squared`).
pub(crate) fn adam_moment(
    (dst, dst_l): (&mut CudaStorage, &Layout),
    (g, g_l): (&CudaStorage, &Layout),
    decay: f64,
    squared: bool,
) -> CandleResult<()> {
    let op = "adamw-moment";
    let dev = dst.device().clone();
    let g = input(op, g, g_l)?;
    let mut m = in_place(op, dst, dst_l)?;
    let n = same_len(op, m.len(), &[g.len()])?;
    let (a, b, squared) = (decay as f32, (1.0 - decay) as f32, u32::from(squared));
    launch!(
        dev,
        "p2p_adam_moment",
        per_value(op, n as usize)?,
        &mut m,
        &g,
        &n,
        &a,
        &b,
        &squared
    );
    Ok(())
}

/// AdamW's parameter update in place (see `optim::AdamwUpdate`).
pub(crate) fn adamw_step(
    (dst, dst_l): (&mut CudaStorage, &Layout),
    (m, m_l): (&CudaStorage, &Layout),
    (v, v_l): (&CudaStorage, &Layout),
    [lr, decay, m_scale, v_scale, eps]: [f64; 5],
) -> CandleResult<()> {
    let op = "adamw-step";
    let dev = dst.device().clone();
    let (m, v) = (input(op, m, m_l)?, input(op, v, v_l)?);
    let mut p = in_place(op, dst, dst_l)?;
    let n = same_len(op, p.len(), &[m.len(), v.len()])?;
    let [lr, decay, m_scale, v_scale, eps] = [lr, decay, m_scale, v_scale, eps].map(|x| x as f32);
    launch!(
        dev,
        "p2p_adamw_step",
        per_value(op, n as usize)?,
        &mut p,
        &m,
        &v,
        &n,
        &lr,
        &decay,
        &m_scale,
        &v_scale,
        &eps
    );
    Ok(())
}

/// SGD's momentum buffer in place: `v = mu·v + (g + wd·p)`.
pub(crate) fn sgd_momentum(
    (dst, dst_l): (&mut CudaStorage, &Layout),
    (g, g_l): (&CudaStorage, &Layout),
    (p, p_l): (&CudaStorage, &Layout),
    mu: f64,
    wd: f64,
) -> CandleResult<()> {
    let op = "sgd-momentum";
    let dev = dst.device().clone();
    let (g, p) = (input(op, g, g_l)?, input(op, p, p_l)?);
    let mut v = in_place(op, dst, dst_l)?;
    let n = same_len(op, v.len(), &[g.len(), p.len()])?;
    let (mu, wd) = (mu as f32, wd as f32);
    launch!(
        dev,
        "p2p_sgd_momentum",
        per_value(op, n as usize)?,
        &mut v,
        &g,
        &p,
        &n,
        &mu,
        &wd
    );
    Ok(())
}

/// SGD's step in place from the momentum buffer (Nesterov's form when `nesterov` holds the
/// momentum).
pub(crate) fn sgd_step(
    (dst, dst_l): (&mut CudaStorage, &Layout),
    (g, g_l): (&CudaStorage, &Layout),
    (v, v_l): (&CudaStorage, &Layout),
    lr: f64,
    wd: f64,
    nesterov: Option<f64>,
) -> CandleResult<()> {
    let op = "sgd-step";
    let dev = dst.device().clone();
    let (g, v) = (input(op, g, g_l)?, input(op, v, v_l)?);
    let mut p = in_place(op, dst, dst_l)?;
    let n = same_len(op, p.len(), &[g.len(), v.len()])?;
    let (lr, wd) = (lr as f32, wd as f32);
    let (mu, flag) = (
        nesterov.unwrap_or(0.0) as f32,
        u32::from(nesterov.is_some()),
    );
    launch!(
        dev,
        "p2p_sgd_step",
        per_value(op, n as usize)?,
        &mut p,
        &g,
        &v,
        &n,
        &lr,
        &wd,
        &mu,
        &flag
    );
    Ok(())
}

/// Plain SGD in place: `p −= lr·(g + wd·p)`.
pub(crate) fn sgd_plain(
    (dst, dst_l): (&mut CudaStorage, &Layout),
    (g, g_l): (&CudaStorage, &Layout),
    lr: f64,
    wd: f64,
) -> CandleResult<()> {
    let op = "sgd-plain";
    let dev = dst.device().clone();
    let g = input(op, g, g_l)?;
    let mut p = in_place(op, dst, dst_l)?;
    let n = same_len(op, p.len(), &[g.len()])?;
    let (lr, wd) = (lr as f32, wd as f32);
    launch!(
        dev,
        "p2p_sgd_plain",
        per_value(op, n as usize)?,
        &mut p,
        &g,
        &n,
        &lr,
        &wd
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the kernels (this runs without a GPU: NVRTC is a library), and every
    /// kernel a launcher names is in the PTX.
    #[test]
    fn the_kernels_compile_and_every_launched_name_is_there() {
        let ptx = ptx().expect("NVRTC");
        for name in [
            "p2p_add_bias",
            "p2p_col_sum_partial",
            "p2p_col_sum_final",
            "p2p_layer_norm",
            "p2p_layer_norm_grad_rows",
            "p2p_layer_norm_grad_partial",
            "p2p_rms_norm",
            "p2p_rms_norm_grad_rows",
            "p2p_rms_norm_grad_partial",
            "p2p_swiglu",
            "p2p_swiglu_grad",
            "p2p_rotary",
            "p2p_causal_softmax",
            "p2p_softmax_grad",
            "p2p_silu",
            "p2p_silu_grad",
            "p2p_cross_entropy_rows",
            "p2p_mean",
            "p2p_cross_entropy_grad",
            "p2p_adam_moment",
            "p2p_adamw_step",
            "p2p_sgd_momentum",
            "p2p_sgd_step",
            "p2p_sgd_plain",
        ] {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{name} missing from the PTX"
            );
        }
    }
}
