//! The CPU kernels and their own backward passes, below every model: `matmul` (products through
//! gemm with no zero fill, a linear layer's bias under the product; with `unsafe`, as
//! `gpu/ops.rs`), `fused` (bias, layer norm, causal softmax, SiLU, cross-entropy, row sums;
//! AVX2+FMA where the CPU has them), `conv` (im2col convolution as one product, 2x2 max
//! pooling). On a GPU the fused kernels run their twins in [`crate::gpu`]; products and
//! convolutions fall back to Candle's own ops (cuBLAS), as everything does on other devices.

pub mod conv;
pub mod denormals;
pub mod fused;
pub mod matmul;
