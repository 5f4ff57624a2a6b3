//! The GPT's training loss and every parameter's gradient, by hand, on the CPU or a GPU.
//!
//! Candle's autograd gives the same numbers (a test checks) but seeds each intermediate's
//! gradient with a zero tensor and adds into it: on the 2-core box's small GPT that
//! bookkeeping (zeros, adds, their allocations) was a sixth of a step once the kernels were
//! fused. Here the forward pass keeps what the backward pass reads, and the backward pass
//! walks the blocks in reverse with matrix products and [`crate::cpu::fused`]'s gradient kernels,
//! writing each gradient once.

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use candle_nn::Linear;

use super::{Block, Gpt, LN_EPS, VOCAB};
use crate::cpu::matmul::matmul;
use crate::cpu::{fused, matmul};
use crate::Result;

/// What one block's backward pass reads from its forward pass.
struct BlockCache {
    /// The block's input (layer norm 1's input).
    x_in: Tensor,
    /// Layer norm 1's output (the qkv product's input), `(n, w)`.
    h1: Tensor,
    /// Queries, keys and values, `(batch, heads, time, head_dim)` each: strided views of the
    /// qkv product.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// Attention weights, `(batch, heads, time, time)`.
    weights: Tensor,
    /// The heads' outputs merged, `(n, w)` (the projection's input).
    attended: Tensor,
    /// The residual stream after attention (layer norm 2's input).
    x_mid: Tensor,
    /// Layer norm 2's output, `(n, w)`.
    h2: Tensor,
    /// The MLP's pre-activation, `(n, 4w)`.
    pre: Tensor,
    /// Its SiLU, `(n, 4w)`.
    act: Tensor,
}

/// `x @ weightᵀ + bias` on rows `(n, in)`.
fn affine(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    matmul::linear_nd(x, layer.weight(), layer.bias())
}

/// Gradients of a linear layer whose input was `input` and whose output's gradient is
/// `grad`: the weight's and bias's go into `grads`, the input's is returned.
fn affine_back(
    layer: &Linear,
    input: &Tensor,
    grad: &Tensor,
    grads: &mut GradStore,
) -> Result<Tensor> {
    grads.insert(layer.weight(), matmul(&grad.t()?, input)?);
    if let Some(b) = layer.bias() {
        grads.insert(b, fused::sum_rows(grad)?);
    }
    matmul(grad, &layer.weight().detach())
}

impl Gpt {
    /// Whether [`Gpt::loss_and_grads`] serves these parameters (f32 on the CPU, or on a GPU
    /// whose kernels are on).
    pub(crate) fn has_hand_backward(&self) -> bool {
        fused::serves(&self.tok_weight)
    }

    /// The mean cross-entropy of predicting `targets` `(batch, time)` from `tokens`, and the
    /// gradient of every parameter.
    pub(crate) fn loss_and_grads(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<(Tensor, GradStore)> {
        let (batch, time) = tokens.dims2()?;
        if time == 0 || time > self.spec.context {
            return Err(crate::Error::Layout(format!(
                "a gpt of context {} cannot read {time} bytes at once",
                self.spec.context
            )));
        }
        // The batch is on the device already, and nothing below uploads data: what it uploads
        // (dimensions and strides) is the same for every step of this shape.
        let _uploads = crate::gpu::step_guard(tokens.device());
        let w = self.spec.width;
        let heads = self.spec.heads;
        let head_dim = w / heads;
        let n = batch * time;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let tok_weight = self.tok_weight.detach();
        let flat_tokens = tokens.flatten_all()?;
        // Forward, keeping what the backward pass reads; every parameter read detached.
        let positions = self
            .pos_emb
            .detach()
            .narrow(0, 0, time)?
            .reshape(time * w)?;
        let embedded = tok_weight
            .index_select(&flat_tokens, 0)?
            .reshape((batch, time * w))?;
        let mut x = fused::add_bias(&embedded, &positions)?.reshape((n, w))?;
        let mut caches = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let b = detached(b);
            let x_in = x;
            let h1 = fused::layer_norm(&x_in, &b.ln1.0, &b.ln1.1, LN_EPS)?;
            // Queries, keys and values as strided views of the product (the matrix products
            // take any strides): no copy into a per-head layout.
            let qkv = affine(&h1, &b.qkv)?
                .reshape((batch, time, 3, heads, head_dim))?
                .permute((2, 0, 3, 1, 4))?;
            let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
            // cuBLAS reads a batch of heads only as one evenly strided batch: on a GPU, copy
            // each of the three once here rather than before each of its two products.
            let (q, k, v) = if fused::on_cpu(&q) {
                (q, k, v)
            } else {
                (q.contiguous()?, k.contiguous()?, v.contiguous()?)
            };
            let weights = fused::causal_softmax(&matmul(&q, &k.t()?)?, scale)?;
            let attended = matmul(&weights, &v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((n, w))?;
            let x_mid = (&x_in + affine(&attended, &b.proj)?)?;
            let h2 = fused::layer_norm(&x_mid, &b.ln2.0, &b.ln2.1, LN_EPS)?;
            let pre = affine(&h2, &b.fc)?;
            let act = fused::silu(&pre)?;
            x = (&x_mid + affine(&act, &b.fc_proj)?)?;
            caches.push(BlockCache {
                x_in,
                h1,
                q,
                k,
                v,
                weights,
                attended,
                x_mid,
                h2,
                pre,
                act,
            });
        }
        let (ln_w, ln_b) = (self.ln_f.0.detach(), self.ln_f.1.detach());
        let final_in = x;
        let normed = fused::layer_norm(&final_in, &ln_w, &ln_b, LN_EPS)?;
        let logits = matmul(&normed, &tok_weight.t()?)?;
        let flat_targets = targets.flatten_all()?;
        let loss = fused::cross_entropy(&logits, &flat_targets)?;

        // Backward.
        let mut grads = GradStore::default();
        let d_logits = fused::cross_entropy_grad(&logits, &flat_targets)?;
        let d_tok_head = matmul(&d_logits.t()?, &normed)?;
        let d_normed = matmul(&d_logits, &tok_weight)?;
        let (mut dx, d_ln_w, d_ln_b) = fused::layer_norm_grad(&final_in, &ln_w, &d_normed, LN_EPS)?;
        grads.insert(&self.ln_f.0, d_ln_w);
        grads.insert(&self.ln_f.1, d_ln_b);
        for (b, c) in self.blocks.iter().zip(&caches).rev() {
            // The MLP: x = x_mid + fc_proj(silu(fc(ln2(x_mid)))).
            let d_act = affine_back(&b.fc_proj, &c.act, &dx, &mut grads)?;
            let d_pre = fused::silu_grad(&c.pre, &d_act)?;
            let d_h2 = affine_back(&b.fc, &c.h2, &d_pre, &mut grads)?;
            let (d_mid, d_w, d_b) = fused::layer_norm_grad(&c.x_mid, &b.ln2.0, &d_h2, LN_EPS)?;
            grads.insert(&b.ln2.0, d_w);
            grads.insert(&b.ln2.1, d_b);
            dx = (dx + d_mid)?;
            // Attention: x_mid = x_in + proj(attend(qkv(ln1(x_in)))).
            let d_attended = affine_back(&b.proj, &c.attended, &dx, &mut grads)?;
            let d_out = d_attended
                .reshape((batch, time, heads, head_dim))?
                .transpose(1, 2)?;
            let d_out = if fused::on_cpu(&d_out) {
                d_out
            } else {
                d_out.contiguous()?
            };
            let d_weights = matmul(&d_out, &c.v.t()?)?;
            let d_v = matmul(&c.weights.t()?, &d_out)?;
            let d_scores = fused::causal_softmax_grad(&c.weights, &d_weights, scale)?;
            let d_q = matmul(&d_scores, &c.k)?;
            let d_k = matmul(&d_scores.t()?, &c.q)?;
            let d_qkv = Tensor::stack(&[d_q, d_k, d_v], 0)?
                .permute((1, 3, 0, 2, 4))?
                .contiguous()?
                .reshape((n, 3 * w))?;
            let d_h1 = affine_back(&b.qkv, &c.h1, &d_qkv, &mut grads)?;
            let (d_in, d_w, d_b) = fused::layer_norm_grad(&c.x_in, &b.ln1.0, &d_h1, LN_EPS)?;
            grads.insert(&b.ln1.0, d_w);
            grads.insert(&b.ln1.1, d_b);
            dx = (dx + d_in)?;
        }
        // The embeddings: each position's gradient summed over the batch, each byte's over
        // its occurrences, plus the tied head's.
        let d_pos = fused::sum_rows(&dx.reshape((batch, time * w))?)?.reshape((time, w))?;
        let d_pos = if time < self.spec.context {
            let rest = Tensor::zeros((self.spec.context - time, w), dx.dtype(), dx.device())?;
            Tensor::cat(&[&d_pos, &rest], 0)?
        } else {
            d_pos
        };
        grads.insert(&self.pos_emb, d_pos);
        let d_tok = d_tok_head.index_add(&flat_tokens, &dx, 0)?;
        debug_assert_eq!(d_tok.dim(0)?, VOCAB);
        grads.insert(&self.tok_weight, d_tok);
        Ok((loss, grads))
    }
}

/// A block whose parameters are read without gradient tracking; the tensors keep the ids the
/// gradient store is keyed by only in the original block, so this copy is for reading.
fn detached(b: &Block) -> Block {
    let linear = |l: &Linear| Linear::new(l.weight().detach(), l.bias().map(|b| b.detach()));
    Block {
        ln1: (b.ln1.0.detach(), b.ln1.1.detach()),
        qkv: linear(&b.qkv),
        proj: linear(&b.proj),
        ln2: (b.ln2.0.detach(), b.ln2.1.detach()),
        fc: linear(&b.fc),
        fc_proj: linear(&b.fc_proj),
    }
}

#[cfg(test)]
mod tests {
    use super::super::GptSpec;
    use super::*;
    use crate::params::Params;
    use candle_core::Device;

    /// The hand-written loss and gradients equal Candle's autograd through the same forward
    /// pass, for every parameter, on a full context and a shorter one, with parameters moved
    /// off their initial values (zero biases, unit norms) so every term counts.
    #[test]
    fn the_gpt_backward_by_hand_matches_autograd() {
        let spec = GptSpec {
            context: 8,
            layers: 2,
            width: 16,
            heads: 4,
        };
        let mut vars = Vec::new();
        let gpt = Gpt::new(&spec, 7, &Device::Cpu, &mut vars).expect("gpt");
        let params = Params::new(vars).expect("params");
        crate::testing::nudge(&params, 0.2);
        for time in [8, 5] {
            let ids = |offset: usize| -> Tensor {
                let v: Vec<u32> = (0..3 * time)
                    .map(|i| ((i * 37 + offset) % 251) as u32)
                    .collect();
                Tensor::from_vec(v, (3, time), &Device::Cpu).expect("ids")
            };
            let (tokens, targets) = (ids(0), ids(11));
            let (loss, grads) = gpt.loss_and_grads(&tokens, &targets).expect("by hand");
            let logits = gpt
                .forward(&tokens)
                .and_then(|l| Ok(l.reshape((3 * time, VOCAB))?))
                .expect("forward");
            let reference = candle_nn::loss::cross_entropy(
                &logits,
                &targets.flatten_all().expect("flat targets"),
            )
            .expect("loss");
            let reference_grads = reference.backward().expect("autograd");
            let scalar = |t: &Tensor| t.to_scalar::<f32>().expect("scalar");
            assert!(
                (scalar(&loss) - scalar(&reference)).abs() < 1e-5,
                "loss, time {time}"
            );
            let context = format!("time {time}");
            crate::testing::assert_grads_match(&params, &grads, &reference_grads, &context);
        }
    }
}
