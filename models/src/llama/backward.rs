//! The Llama's training loss and every parameter's gradient, by hand, in f32 on the CPU or on a
//! GPU whose fused kernels are on (`crate::gpu`).
//!
//! Candle's autograd gives the same numbers (a test checks) but seeds each intermediate's
//! gradient with zeros and adds into it, and goes through the composed rotary embedding and
//! the copies that repeat each key-value head for its query heads. Here the forward pass keeps
//! what the backward pass reads, and the backward pass walks the blocks in reverse with matrix
//! products and [`crate::cpu::fused`]'s kernels, writing each gradient once:
//! - the rotary embedding is one pass that also moves a projection's rows into attention's
//!   per-head layout (and one pass back);
//! - grouped-query attention reads each key-value head in place: a key-value head's query
//!   heads are adjacent, so the `group` query heads of one key-value head are one matrix of
//!   `group · time` rows against that head's keys, and the keys' and values' gradients come
//!   out of the products already summed over the group.

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::{Block, Llama};
use crate::cpu::fused;
use crate::cpu::matmul::matmul;
use crate::Result;

/// What one block's backward pass reads from its forward pass (`n` rows of `batch · time`).
struct BlockCache {
    /// The block's input (the input norm's input), `(n, hidden)`.
    x_in: Tensor,
    /// The input norm's output, `(n, hidden)`.
    h1: Tensor,
    /// Turned queries grouped by key-value head, `(batch, kv_heads, group · time, head_dim)`.
    q: Tensor,
    /// Turned keys, `(batch, kv_heads, time, head_dim)`.
    k: Tensor,
    /// Values, `(batch, kv_heads, time, head_dim)`: a strided view of the projection's rows.
    v: Tensor,
    /// Attention weights grouped as the queries, `(batch, kv_heads, group · time, time)`.
    weights: Tensor,
    /// The heads' outputs merged, `(n, heads · head_dim)` (the output projection's input).
    attended: Tensor,
    /// The residual stream after attention (the post-attention norm's input).
    x_mid: Tensor,
    /// The post-attention norm's output, `(n, hidden)`.
    h2: Tensor,
    /// The MLP's gate and up projections, `(n, intermediate)` each.
    gate: Tensor,
    up: Tensor,
    /// `silu(gate) · up`, the down projection's input.
    act: Tensor,
}

/// `x @ weightᵀ` for rows `x` `(n, in)` and a weight `(out, in)`.
fn project(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    matmul(x, &weight.t()?)
}

/// A linear layer's weight gradient `gradᵀ @ input`, stored under `weight`.
fn weight_grad(
    weight: &Tensor,
    input: &Tensor,
    grad: &Tensor,
    grads: &mut GradStore,
) -> Result<()> {
    grads.insert(weight, matmul(&grad.t()?, input)?);
    Ok(())
}

impl Llama {
    /// Whether [`Llama::loss_and_grads`] serves these parameters: f32 where the fused kernels
    /// serve (the CPU, or a GPU with its kernels on).
    pub(crate) fn has_hand_backward(&self) -> bool {
        fused::serves(&self.head)
    }

    /// The mean cross-entropy of predicting `targets` `(batch, time)` from `tokens`, and the
    /// gradient of every parameter.
    pub(crate) fn loss_and_grads(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<(Tensor, GradStore)> {
        let s = &self.spec;
        let (batch, time) = tokens.dims2()?;
        if time == 0 || time > s.context {
            return Err(crate::Error::Layout(format!(
                "a llama of context {} cannot read {time} tokens at once",
                s.context
            )));
        }
        // A GPU caches this step's small uploads (shapes and strides, the same every step).
        let _uploads = crate::gpu::step_guard(tokens.device());
        let (hd, heads, kv_heads) = (s.head_dim, s.heads, s.kv_heads);
        let group = heads / kv_heads;
        let n = batch * time;
        let scale = 1.0 / (hd as f64).sqrt();
        let (cos, sin) = (
            self.cos.narrow(0, 0, time)?.contiguous()?,
            self.sin.narrow(0, 0, time)?.contiguous()?,
        );
        let embed = self.embed.embeddings().detach();
        let flat_tokens = tokens.flatten_all()?;
        // Forward, keeping what the backward pass reads; every parameter read detached.
        let mut x = embed.index_select(&flat_tokens, 0)?;
        let mut caches = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let b = detached(b);
            let x_in = x;
            let h1 = fused::rms_norm(&x_in, &b.input_norm, s.rms_eps)?;
            let q = fused::rotary_to_heads(
                &project(&h1, &b.q)?.reshape((batch, time, heads, hd))?,
                &cos,
                &sin,
            )?
            .reshape((batch, kv_heads, group * time, hd))?;
            let k = fused::rotary_to_heads(
                &project(&h1, &b.k)?.reshape((batch, time, kv_heads, hd))?,
                &cos,
                &sin,
            )?;
            let v = project(&h1, &b.v)?
                .reshape((batch, time, kv_heads, hd))?
                .transpose(1, 2)?;
            let scores = matmul(&q, &k.t()?)?.reshape((batch, heads, time, time))?;
            let weights = fused::causal_softmax(&scores, scale)?.reshape((
                batch,
                kv_heads,
                group * time,
                time,
            ))?;
            let attended = matmul(&weights, &v)?
                .reshape((batch, heads, time, hd))?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((n, heads * hd))?;
            let x_mid = (&x_in + project(&attended, &b.o)?)?;
            let h2 = fused::rms_norm(&x_mid, &b.post_norm, s.rms_eps)?;
            let gate = project(&h2, &b.gate)?;
            let up = project(&h2, &b.up)?;
            let act = fused::swiglu(&gate, &up)?;
            x = (&x_mid + project(&act, &b.down)?)?;
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
                gate,
                up,
                act,
            });
        }
        let (norm, head) = (self.norm.detach(), self.head.detach());
        let final_in = x;
        let normed = fused::rms_norm(&final_in, &norm, s.rms_eps)?;
        let logits = project(&normed, &head)?;
        let flat_targets = targets.flatten_all()?;
        let loss = fused::cross_entropy(&logits, &flat_targets)?;

        // Backward.
        let mut grads = GradStore::default();
        let d_logits = fused::cross_entropy_grad(&logits, &flat_targets)?;
        let d_head = matmul(&d_logits.t()?, &normed)?;
        let d_normed = matmul(&d_logits, &head)?;
        let (mut dx, d_norm) = fused::rms_norm_grad(&final_in, &norm, &d_normed, s.rms_eps)?;
        grads.insert(&self.norm, d_norm);
        for (b, c) in self.blocks.iter().zip(&caches).rev() {
            let w = detached(b);
            // The MLP: x = x_mid + down(silu(gate(h2)) · up(h2)), h2 = norm(x_mid).
            weight_grad(&b.down, &c.act, &dx, &mut grads)?;
            let d_act = matmul(&dx, &w.down)?;
            let (d_gate, d_up) = fused::swiglu_grad(&c.gate, &c.up, &d_act)?;
            weight_grad(&b.gate, &c.h2, &d_gate, &mut grads)?;
            weight_grad(&b.up, &c.h2, &d_up, &mut grads)?;
            let d_h2 = (matmul(&d_gate, &w.gate)? + matmul(&d_up, &w.up)?)?;
            let (d_mid, d_w) = fused::rms_norm_grad(&c.x_mid, &w.post_norm, &d_h2, s.rms_eps)?;
            grads.insert(&b.post_norm, d_w);
            dx = (dx + d_mid)?;
            // Attention: x_mid = x_in + o(attend(q, k, v of norm(x_in))).
            weight_grad(&b.o, &c.attended, &dx, &mut grads)?;
            let d_out = matmul(&dx, &w.o)?
                .reshape((batch, time, heads, hd))?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((batch, kv_heads, group * time, hd))?;
            let d_weights = matmul(&d_out, &c.v.t()?)?.reshape((batch, heads, time, time))?;
            let d_v = matmul(&c.weights.t()?, &d_out)?;
            let weights = c.weights.reshape((batch, heads, time, time))?;
            let d_scores = fused::causal_softmax_grad(&weights, &d_weights, scale)?.reshape((
                batch,
                kv_heads,
                group * time,
                time,
            ))?;
            let d_q = matmul(&d_scores, &c.k)?.reshape((batch, heads, time, hd))?;
            let d_k = matmul(&d_scores.t()?, &c.q)?;
            let d_q = fused::rotary_from_heads(&d_q, &cos, &sin)?.reshape((n, heads * hd))?;
            let d_k = fused::rotary_from_heads(&d_k, &cos, &sin)?.reshape((n, kv_heads * hd))?;
            let d_v = d_v
                .transpose(1, 2)?
                .contiguous()?
                .reshape((n, kv_heads * hd))?;
            weight_grad(&b.q, &c.h1, &d_q, &mut grads)?;
            weight_grad(&b.k, &c.h1, &d_k, &mut grads)?;
            weight_grad(&b.v, &c.h1, &d_v, &mut grads)?;
            let d_h1 = ((matmul(&d_q, &w.q)? + matmul(&d_k, &w.k)?)? + matmul(&d_v, &w.v)?)?;
            let (d_in, d_w) = fused::rms_norm_grad(&c.x_in, &w.input_norm, &d_h1, s.rms_eps)?;
            grads.insert(&b.input_norm, d_w);
            dx = (dx + d_in)?;
        }
        // The embedding: each token's gradient summed over its occurrences, plus the tied
        // head's.
        let embed_var = self.embed.embeddings();
        if s.tied {
            grads.insert(embed_var, d_head.index_add(&flat_tokens, &dx, 0)?);
        } else {
            grads.insert(&self.head, d_head);
            let zeros = Tensor::zeros((s.vocab, s.hidden), dx.dtype(), dx.device())?;
            grads.insert(embed_var, zeros.index_add(&flat_tokens, &dx, 0)?);
        }
        Ok((loss, grads))
    }
}

/// A block whose parameters are read without gradient tracking; the gradient store is keyed
/// by the original block's tensors, so this copy is for reading.
fn detached(b: &Block) -> Block {
    Block {
        input_norm: b.input_norm.detach(),
        q: b.q.detach(),
        k: b.k.detach(),
        v: b.v.detach(),
        o: b.o.detach(),
        post_norm: b.post_norm.detach(),
        gate: b.gate.detach(),
        up: b.up.detach(),
        down: b.down.detach(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::LlamaSpec;
    use super::*;
    use crate::params::Params;
    use candle_core::Device;

    /// The hand-written loss and gradients equal Candle's autograd through the forward pass,
    /// for every parameter, tied and untied, grouped and full attention, on a full context and
    /// a shorter one, with parameters moved off their initial values (unit norms) so every
    /// term counts.
    #[test]
    fn the_llama_backward_by_hand_matches_autograd() {
        for (tied, kv_heads) in [(false, 2), (true, 1), (false, 4)] {
            let spec = LlamaSpec {
                vocab: 40,
                context: 8,
                hidden: 16,
                intermediate: 24,
                layers: 2,
                heads: 4,
                kv_heads,
                head_dim: 6,
                rms_eps: 1e-5,
                rope_theta: 100.0,
                tied,
            };
            let mut vars = Vec::new();
            let model = Llama::new(&spec, 7, &Device::Cpu, &mut vars).expect("llama");
            let params = Params::new(vars).expect("params");
            crate::testing::nudge(&params, 0.4);
            for time in [8, 5] {
                let ids = |offset: usize| -> Tensor {
                    let v: Vec<u32> = (0..3 * time)
                        .map(|i| ((i * 17 + offset) % 40) as u32)
                        .collect();
                    Tensor::from_vec(v, (3, time), &Device::Cpu).expect("ids")
                };
                let (tokens, targets) = (ids(0), ids(11));
                let (loss, grads) = model.loss_and_grads(&tokens, &targets).expect("by hand");
                let logits = model
                    .forward(&tokens)
                    .and_then(|l| Ok(l.reshape((3 * time, spec.vocab))?))
                    .expect("forward");
                let reference = candle_nn::loss::cross_entropy(
                    &logits,
                    &targets.flatten_all().expect("flat targets"),
                )
                .expect("loss");
                let reference_grads = reference.backward().expect("autograd");
                let scalar = |t: &Tensor| t.to_scalar::<f32>().expect("scalar");
                let context = format!("tied {tied}, {kv_heads} kv heads, time {time}");
                assert!(
                    (scalar(&loss) - scalar(&reference)).abs() < 1e-5,
                    "loss, {context}"
                );
                crate::testing::assert_grads_match(&params, &grads, &reference_grads, &context);
            }
        }
    }
}
