//! Matrix products on the CPU, straight through the `gemm` crate that Candle itself calls, for
//! the two things Candle's `matmul` cannot say.
//!
//! Candle 0.11 fills every product's output with zeros before gemm overwrites it (on the 2-core
//! box a twentieth of the small GPT's step went to that memset), and a linear layer's bias is
//! one more pass over the output after it. Here the output is written once: by gemm alone
//! ([`matmul`]), or starting from the bias in every row, onto which gemm adds the product
//! ([`linear`]). The numbers are gemm's, as through Candle. Off the CPU, or for other float
//! types, Candle's own ops run (on a GPU, cuBLAS: operands whose strides cuBLAS cannot take,
//! such as the GPT's per-head views of one product, are copied contiguous first). Both ops
//! carry a backward pass, so autograd can go through them; the hand-written backward passes
//! call them on detached tensors.
//!
//! This is one of the crate's two modules with `unsafe` (the other, `gpu/ops.rs`, launches GPU
//! kernels): gemm takes raw pointers and strides. Before each call the operands' slices are
//! checked to hold every element their dimensions and strides reach, and the output is a fresh
//! vector of exactly the product's size, which gemm writes whole (it reads it only for the
//! bias, which is written first).
#![allow(unsafe_code)]

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use gemm::Parallelism;

use crate::cpu::fused::{self, on_cpu, serves, sum_rows};
use crate::Result;

/// `a @ b` for `a` `(…, m, k)` and `b` `(…, k, n)` with the same leading (batch) dimensions,
/// any strides: what Candle's `matmul` gives, without zero-filling the output first.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !on_cpu(a) || !on_cpu(b) {
        return Ok(gemm_ready(a)?.matmul(&gemm_ready(b)?)?);
    }
    Ok(a.apply_op2(b, MatMul)?)
}

/// `t` itself on the CPU (Candle's own product takes any strides there) or if a strided batched
/// product (cuBLAS through Candle) can read it: its last two dimensions row- or column-major
/// and its leading ones one evenly strided batch; else a contiguous copy.
fn gemm_ready(t: &Tensor) -> Result<Tensor> {
    let (dims, strides) = (t.dims(), t.stride());
    let rank = dims.len();
    if t.device().is_cpu() || t.is_contiguous() || rank < 2 {
        return Ok(t.clone());
    }
    let (rows, cols) = (dims[rank - 2], dims[rank - 1]);
    let (row_stride, col_stride) = (strides[rank - 2], strides[rank - 1]);
    let inner = (col_stride == 1 || cols == 1) && (row_stride == cols || rows == 1)
        || (row_stride == 1 || rows == 1) && (col_stride == rows || cols == 1);
    let batch = match (&dims[..rank - 2], &strides[..rank - 2]) {
        ([], []) | ([_], [_]) => true,
        ([d0, d1], [s0, s1]) => *s0 == s1 * d1 || *d0 == 1 || *d1 == 1,
        _ => false,
    };
    Ok(if inner && batch {
        t.clone()
    } else {
        t.contiguous()?
    })
}

/// `x @ weightᵀ + bias` for rows `x` `(rows, in)`, `weight` `(out, in)` and `bias` `(out,)`:
/// the output starts as the bias in every row and gemm adds the product onto it, one pass.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let Some(bias) = bias else {
        return matmul(x, &weight.t()?);
    };
    if !on_cpu(x) || !on_cpu(weight) {
        let product = matmul(x, &weight.t()?)?;
        return if serves(&product) {
            fused::add_bias(&product, bias)
        } else {
            Ok(product.broadcast_add(bias)?)
        };
    }
    Ok(x.apply_op3(weight, &bias.contiguous()?, Linear)?)
}

/// `x @ weightᵀ + bias` over the last dimension of `x`, any leading dimensions flattened into
/// one matrix product, so the weight's gradient is one product too (Candle's `Linear`
/// broadcasts the weight over a 3-D input and then sums the batch of gradients).
pub fn linear_nd(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (rows, fan_in) = fused::rows_of("linear", &dims)?;
    let y = linear(&x.reshape((rows, fan_in))?, weight, bias)?;
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = y.dim(1)?;
    }
    Ok(y.reshape(out)?)
}

/// Gemm's parallelism for Candle's thread count (`RAYON_NUM_THREADS`, as Candle reads it:
/// from the environment, so once per op, not per matrix of a batch).
fn parallelism() -> Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// An operand's `f32` values with its layout's offset and strides, checked to reach no
/// element outside its storage.
struct Operand<'a> {
    values: &'a [f32],
    start: usize,
    strides: &'a [usize],
}

impl<'a> Operand<'a> {
    fn new(op: &str, storage: &'a CpuStorage, layout: &'a Layout) -> candle_core::Result<Self> {
        let values = storage.as_slice::<f32>()?;
        let (dims, strides) = (layout.dims(), layout.stride());
        let start = layout.start_offset();
        if !dims.contains(&0) {
            let last = dims.iter().zip(strides).try_fold(start, |at, (&d, &s)| {
                (d - 1).checked_mul(s)?.checked_add(at)
            });
            if last.is_none_or(|last| last >= values.len()) {
                return Err(candle_core::Error::Msg(format!(
                    "{op}: operand of dims {dims:?} and strides {strides:?} outside its storage"
                )));
            }
        }
        Ok(Operand {
            values,
            start,
            strides,
        })
    }

    /// The row and column strides of its matrices (the last two dimensions).
    fn matrix_strides(&self) -> (isize, isize) {
        let r = self.strides.len();
        (self.strides[r - 2] as isize, self.strides[r - 1] as isize)
    }

    /// Where the `index`-th matrix of the batch starts, for batch dimensions `batch_dims`.
    fn matrix_start(&self, batch_dims: &[usize], mut index: usize) -> usize {
        let mut at = self.start;
        for (&d, &s) in batch_dims.iter().zip(self.strides).rev() {
            at += (index % d) * s;
            index /= d;
        }
        at
    }
}

/// How [`gemm_into`] treats its output vector.
#[derive(Clone, Copy, PartialEq)]
enum Dst {
    /// Append the product's `m·n` values after those already there.
    Append,
    /// The vector holds exactly `m·n` values: add the product onto them.
    AddOnto,
}

/// The product of `lhs` `(m, k)` and `rhs` `(k, n)`, each given as (values, offset, (row,
/// column) strides) that [`Operand::new`] checked, into `dst` as `how` says, row-major.
fn gemm_into(
    dst: &mut Vec<f32>,
    how: Dst,
    (m, n, k): (usize, usize, usize),
    lhs: (&[f32], usize, (isize, isize)),
    rhs: (&[f32], usize, (isize, isize)),
    parallelism: Parallelism,
) -> candle_core::Result<()> {
    let (lhs_values, lhs_start, (lhs_rs, lhs_cs)) = lhs;
    let (rhs_values, rhs_start, (rhs_rs, rhs_cs)) = rhs;
    let size = m * n;
    let read_dst = how == Dst::AddOnto;
    let start = match how {
        Dst::Append => {
            dst.reserve(size);
            dst.len()
        }
        Dst::AddOnto if dst.len() == size => 0,
        Dst::AddOnto => {
            return Err(candle_core::Error::Msg(format!(
                "matmul: {} values to add a ({m}, {n}) product onto",
                dst.len()
            )))
        }
    };
    // SAFETY: every element gemm reads of `lhs` and `rhs` lies inside their slices (the
    // callers checked each operand's whole reach with `Operand::new`); `dst` has room for
    // `m·n` values from `start` (reserved above, or its length when adding onto it), gemm
    // writes all of them (reading them first only when adding onto values already there),
    // and nothing else aliases `dst`. Only then does the length cover them (f32 needs no
    // drop, so a panic in between would leak nothing).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(start),
            1,
            n as isize,
            read_dst,
            lhs_values.as_ptr().add(lhs_start),
            lhs_cs,
            lhs_rs,
            rhs_values.as_ptr().add(rhs_start),
            rhs_cs,
            rhs_rs,
            if read_dst { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        if how == Dst::Append {
            dst.set_len(start + size);
        }
    }
    Ok(())
}

/// `a @ b` batch by batch (see [`matmul`]).
struct MatMul;

impl CustomOp2 for MatMul {
    fn name(&self) -> &'static str {
        "matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (a_dims, b_dims) = (l1.dims(), l2.dims());
        let rank = a_dims.len();
        if rank < 2 || b_dims.len() != rank || a_dims[..rank - 2] != b_dims[..rank - 2] {
            return Err(candle_core::Error::Msg(format!(
                "matmul of {a_dims:?} and {b_dims:?}: want (…, m, k) and (…, k, n)"
            )));
        }
        let (m, k, n) = (a_dims[rank - 2], a_dims[rank - 1], b_dims[rank - 1]);
        if b_dims[rank - 2] != k {
            return Err(candle_core::Error::Msg(format!(
                "matmul of {a_dims:?} and {b_dims:?}: inner dimensions differ"
            )));
        }
        let batch_dims = &a_dims[..rank - 2];
        let batch: usize = batch_dims.iter().product();
        let mut out_dims = a_dims.to_vec();
        out_dims[rank - 1] = n;
        let len = batch * m * n;
        if k == 0 || len == 0 {
            return Ok((CpuStorage::F32(vec![0.0; len]), Shape::from(out_dims)));
        }
        let (a, b) = (
            Operand::new("matmul", s1, l1)?,
            Operand::new("matmul", s2, l2)?,
        );
        let mut out = Vec::with_capacity(len);
        let threads = parallelism();
        for i in 0..batch {
            gemm_into(
                &mut out,
                Dst::Append,
                (m, n, k),
                (a.values, a.matrix_start(batch_dims, i), a.matrix_strides()),
                (b.values, b.matrix_start(batch_dims, i), b.matrix_strides()),
                threads,
            )?;
        }
        Ok((CpuStorage::F32(out), Shape::from(out_dims)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_a = matmul(grad, &b.t()?).map_err(candle_core::Error::wrap)?;
        let grad_b = matmul(&a.t()?, grad).map_err(candle_core::Error::wrap)?;
        Ok((Some(grad_a), Some(grad_b)))
    }
}

/// `x @ weightᵀ + bias` (see [`linear`]).
struct Linear;

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear"
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
        let (&[rows, fan_in], &[fan_out, w_in], &[b_len]) = (l1.dims(), l2.dims(), l3.dims())
        else {
            return Err(candle_core::Error::Msg(format!(
                "linear wants x (rows, in), weight (out, in), bias (out,), got {:?}, {:?}, {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )));
        };
        if w_in != fan_in || b_len != fan_out {
            return Err(candle_core::Error::Msg(format!(
                "linear of x {:?} with weight {:?} and bias {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )));
        }
        let bias = crate::cpu::fused::f32_slice("linear", s3, l3)?;
        // The bias in every row, for gemm to add the product onto.
        let size = rows * fan_out;
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(bias);
        // Doubling what is there: a few long copies rather than one per (maybe short) row.
        while out.len() < size {
            out.extend_from_within(..out.len().min(size - out.len()));
        }
        if rows == 0 || fan_in == 0 || fan_out == 0 {
            out.truncate(size);
            return Ok((CpuStorage::F32(out), Shape::from((rows, fan_out))));
        }
        let (x, w) = (
            Operand::new("linear", s1, l1)?,
            Operand::new("linear", s2, l2)?,
        );
        let (w_rs, w_cs) = w.matrix_strides();
        gemm_into(
            &mut out,
            Dst::AddOnto,
            (rows, fan_out, fan_in),
            (x.values, x.start, x.matrix_strides()),
            // Wᵀ's (row, column) strides are W's (column, row) ones.
            (w.values, w.start, (w_cs, w_rs)),
            parallelism(),
        )?;
        Ok((CpuStorage::F32(out), Shape::from((rows, fan_out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let wrap = candle_core::Error::wrap;
        let grad_x = matmul(grad, weight).map_err(wrap)?;
        let grad_weight = matmul(&grad.t()?, x).map_err(wrap)?;
        let grad_bias = sum_rows(grad).map_err(wrap)?.reshape(bias.shape())?;
        Ok((Some(grad_x), Some(grad_weight), Some(grad_bias)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_diff;
    use candle_core::{DType, Device, Var};

    fn seeded(shape: &[usize], seed: u64) -> Var {
        crate::init::normal(seed, "m", shape, 1.0, &Device::Cpu).expect("init")
    }

    #[test]
    fn matches_candles_matmul_for_plain_transposed_and_batched_operands() {
        let a = seeded(&[2, 3, 5, 7], 1);
        let b = seeded(&[2, 3, 7, 4], 2);
        let want = a.matmul(&b).expect("candle");
        assert!(max_diff(&matmul(&a, &b).expect("ours"), &want) < 1e-5);
        // Transposed views and a narrowed (offset) operand.
        let bt = seeded(&[2, 3, 4, 7], 3);
        let want = a.matmul(&bt.t().expect("t")).expect("candle");
        let got = matmul(&a, &bt.t().expect("t")).expect("ours");
        assert!(max_diff(&got, &want) < 1e-5);
        let wide = seeded(&[9, 6], 4);
        let part = wide.narrow(0, 2, 5).expect("narrow").t().expect("t");
        let x = seeded(&[3, 6], 5);
        let want = x.matmul(&part).expect("candle");
        assert!(max_diff(&matmul(&x, &part).expect("ours"), &want) < 1e-5);
        // Empty inner dimension: zeros, as Candle.
        let (e1, e2) = (
            Tensor::zeros((3, 0), DType::F32, &Device::Cpu).expect("e1"),
            Tensor::zeros((0, 2), DType::F32, &Device::Cpu).expect("e2"),
        );
        let z = matmul(&e1, &e2).expect("empty");
        assert_eq!(z.dims(), &[3, 2]);
        assert!(
            matmul(&a, &seeded(&[2, 3, 6, 4], 6)).is_err(),
            "inner dims differ"
        );
    }

    #[test]
    fn linear_matches_candle_forward_and_backward() {
        let x = seeded(&[6, 5], 1);
        let w = seeded(&[4, 5], 2);
        let b = seeded(&[4], 3);
        let probe = seeded(&[6, 4], 4);
        let want = x
            .matmul(&w.t().expect("t"))
            .expect("mm")
            .broadcast_add(&b)
            .expect("b");
        let got = linear(&x, &w, Some(&b)).expect("ours");
        assert!(max_diff(&got, &want) < 1e-5);
        let (gw, gg) = (
            (want * probe.as_tensor())
                .expect("*")
                .sum_all()
                .expect("s")
                .backward()
                .expect("bw"),
            (got * probe.as_tensor())
                .expect("*")
                .sum_all()
                .expect("s")
                .backward()
                .expect("bw"),
        );
        for v in [&x, &w, &b] {
            let (a, c) = (
                gw.get(v).expect("candle grad"),
                gg.get(v).expect("our grad"),
            );
            assert!(max_diff(a, c) < 1e-4);
        }
        assert!(
            linear(&x, &seeded(&[4, 6], 5), Some(&b)).is_err(),
            "fan-in differs"
        );
    }
}
