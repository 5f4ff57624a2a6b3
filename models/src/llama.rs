//! A Llama-family decoder: the architecture of the models home labs fine-tune (Llama and
//! SmolLM checkpoints; other families' `config.json` is refused on import, see [`crate::hf`]),
//! so that a user can start from a Hugging Face checkpoint and take the result back to the
//! tools they use.
//!
//! Token embeddings, `layers` pre-norm blocks (RMS norm, causal self-attention with rotary
//! position embeddings and grouped-query attention, RMS norm, a SwiGLU MLP, each added to the
//! residual stream), a final RMS norm and an output head (or the token embedding, tied). No
//! biases. Rotary embeddings pair each head's dimension `i` with `i + head_dim / 2` (Hugging
//! Face's `rotate_half`, the layout its Llama checkpoints are stored in), and query head `h`
//! reads key-value head `h / (heads / kv_heads)`, as `transformers` does.
//!
//! Parameters carry Hugging Face's names (`model.layers.0.self_attn.q_proj.weight`, ...) and
//! layouts (a linear layer's weight `(out, in)`), so import and export copy tensors as they
//! are ([`crate::hf`]). Weights built from a seed come from [`crate::init`]: normal(0, 0.02),
//! as `transformers` initialises a Llama, norms at one.
//!
//! The forward pass is on Candle's graph, so autograd can train through it: in f32 on the CPU
//! (or on a GPU with its kernels on, [`crate::gpu`]) the RMS norm, causal softmax and SwiGLU's
//! gate are [`crate::cpu::fused`]'s kernels with their own backward passes, elsewhere
//! compositions of Candle ops (never candle-nn's fused RMS norm, which has no backward pass).
//! Where those kernels serve, training takes the hand-written backward pass of
//! `llama/backward.rs` instead (the same gradients, a test checks; on a GPU, the same as the
//! CPU's, `gpu/twins.rs`).

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Module, Tensor, Var, D};
use candle_nn::Embedding;
use serde::{Deserialize, Serialize};

use crate::cpu::{fused, matmul};
use crate::kind::{Kind, Network};
use crate::{init, Error, Result};

mod backward;

/// Standard deviation of the initial weights (`transformers`' `initializer_range` default).
const INIT_STD: f32 = 0.02;
/// Largest vocabulary, context, width and layer count a spec may ask for: past any model a
/// box trains, and small enough that a corrupt config cannot make a node allocate without
/// bound.
const MAX_VOCAB: usize = 1 << 20;
const MAX_CONTEXT: usize = 1 << 17;
const MAX_WIDTH: usize = 1 << 15;
const MAX_LAYERS: usize = 256;
const MAX_HEADS: usize = 1024;
const MAX_HEAD_DIM: usize = 1024;
const MAX_PARAMS: usize = 4_000_000_000;
/// Largest rotary table (positions x head width, each of cos and sin): 256 MiB of `f32`.
const MAX_ROTARY: usize = 1 << 26;

/// The shape of a Llama-family decoder. Part of the run identity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LlamaSpec {
    /// Token ids the model reads and predicts (`vocab_size`).
    pub vocab: usize,
    /// Tokens of context the model sees in training (its windows' length); at most the
    /// positions its rotary table was built for.
    pub context: usize,
    /// Width of the residual stream (`hidden_size`).
    pub hidden: usize,
    /// Width of the SwiGLU MLP (`intermediate_size`).
    pub intermediate: usize,
    /// Transformer blocks (`num_hidden_layers`).
    pub layers: usize,
    /// Query heads (`num_attention_heads`).
    pub heads: usize,
    /// Key-value heads (`num_key_value_heads`); divides `heads`.
    pub kv_heads: usize,
    /// Width of each head (`head_dim`; `hidden / heads` where a config does not say).
    pub head_dim: usize,
    /// The RMS norms' epsilon (`rms_norm_eps`).
    pub rms_eps: f64,
    /// The rotary embeddings' base (`rope_theta`).
    pub rope_theta: f64,
    /// Whether the output head is the token embedding (`tie_word_embeddings`).
    pub tied: bool,
}

/// Never NaN: [`LlamaSpec::validate`] refuses a spec whose epsilon or base is not a positive
/// finite number, and nothing builds an unvalidated spec.
impl Eq for LlamaSpec {}

impl LlamaSpec {
    /// Checks the numbers; errors say which one is wrong.
    pub fn validate(&self) -> Result<()> {
        let s = self;
        if [
            s.vocab,
            s.context,
            s.hidden,
            s.intermediate,
            s.layers,
            s.heads,
            s.kv_heads,
            s.head_dim,
        ]
        .contains(&0)
        {
            return Err(Error::Spec(format!(
                "a llama needs no zero size, got {s:?}"
            )));
        }
        if !s.heads.is_multiple_of(s.kv_heads) {
            return Err(Error::Spec(format!(
                "a llama's {} attention heads are not a multiple of its {} key-value heads",
                s.heads, s.kv_heads
            )));
        }
        if !s.head_dim.is_multiple_of(2) {
            return Err(Error::Spec(format!(
                "a llama's head width {} is odd: rotary embeddings turn pairs",
                s.head_dim
            )));
        }
        if !(s.rms_eps > 0.0
            && s.rms_eps.is_finite()
            && s.rope_theta > 1.0
            && s.rope_theta.is_finite())
        {
            return Err(Error::Spec(format!(
                "a llama's rms_norm_eps {} must be positive and its rope_theta {} above 1",
                s.rms_eps, s.rope_theta
            )));
        }
        // Each size bounded alone before any product of them, so no product overflows.
        if s.vocab > MAX_VOCAB
            || s.context > MAX_CONTEXT
            || s.hidden > MAX_WIDTH
            || s.intermediate > 8 * MAX_WIDTH
            || s.heads > MAX_HEADS
            || s.kv_heads > MAX_HEADS
            || s.head_dim > MAX_HEAD_DIM
            || s.heads * s.head_dim > 4 * MAX_WIDTH
            || s.context * s.head_dim > MAX_ROTARY
            || s.layers > MAX_LAYERS
        {
            return Err(Error::Spec(format!(
                "a llama of {s:?} is past the limits (vocabulary {MAX_VOCAB}, context \
                 {MAX_CONTEXT}, width {MAX_WIDTH}, {MAX_HEADS} heads of at most \
                 {MAX_HEAD_DIM}, {MAX_LAYERS} layers, rotary tables of {MAX_ROTARY} values)"
            )));
        }
        if self.numel() > MAX_PARAMS {
            return Err(Error::Spec(format!(
                "a llama of {} parameters is past the limit of {MAX_PARAMS}",
                self.numel()
            )));
        }
        Ok(())
    }

    /// A name such as `llama-v384-c256-l2-w64-i128-h4-k2-d16-e0.00001-r10000` (`-tied` where
    /// the head is the embedding), from which [`LlamaSpec::from_name`] rebuilds the spec (a
    /// checkpoint records the name).
    pub fn name(&self) -> String {
        let s = self;
        format!(
            "llama-v{}-c{}-l{}-w{}-i{}-h{}-k{}-d{}-e{}-r{}{}",
            s.vocab,
            s.context,
            s.layers,
            s.hidden,
            s.intermediate,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.rms_eps,
            s.rope_theta,
            if s.tied { "-tied" } else { "" }
        )
    }

    /// The spec a [`LlamaSpec::name`] stands for, if `name` is one.
    pub fn from_name(name: &str) -> Option<LlamaSpec> {
        let (body, tied) = match name.strip_suffix("-tied") {
            Some(body) => (body, true),
            None => (name, false),
        };
        let mut parts = body.strip_prefix("llama-")?.split('-');
        let mut field = |tag: char| -> Option<&str> { parts.next()?.strip_prefix(tag) };
        let mut size = |tag: char| -> Option<usize> { field(tag)?.parse().ok() };
        let (vocab, context, layers, hidden, intermediate, heads, kv_heads, head_dim) = (
            size('v')?,
            size('c')?,
            size('l')?,
            size('w')?,
            size('i')?,
            size('h')?,
            size('k')?,
            size('d')?,
        );
        let rms_eps = field('e')?.parse().ok()?;
        let rope_theta = field('r')?.parse().ok()?;
        let spec = LlamaSpec {
            vocab,
            context,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            rms_eps,
            rope_theta,
            tied,
        };
        (parts.next().is_none() && spec.validate().is_ok()).then_some(spec)
    }

    /// Each parameter's Hugging Face name and shape, without building the model (an import
    /// or export checks a folder against them).
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let s = self;
        let (q_width, kv_width) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let mut shapes = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![s.vocab, s.hidden],
        )];
        for i in 0..s.layers {
            let p = format!("model.layers.{i}");
            for (name, shape) in [
                ("input_layernorm", vec![s.hidden]),
                ("self_attn.q_proj", vec![q_width, s.hidden]),
                ("self_attn.k_proj", vec![kv_width, s.hidden]),
                ("self_attn.v_proj", vec![kv_width, s.hidden]),
                ("self_attn.o_proj", vec![s.hidden, q_width]),
                ("post_attention_layernorm", vec![s.hidden]),
                ("mlp.gate_proj", vec![s.intermediate, s.hidden]),
                ("mlp.up_proj", vec![s.intermediate, s.hidden]),
                ("mlp.down_proj", vec![s.hidden, s.intermediate]),
            ] {
                shapes.push((format!("{p}.{name}.weight"), shape));
            }
        }
        shapes.push(("model.norm.weight".to_string(), vec![s.hidden]));
        if !s.tied {
            shapes.push(("lm_head.weight".to_string(), vec![s.vocab, s.hidden]));
        }
        shapes
    }

    /// Number of parameters the model has.
    ///
    /// Saturating: a spec past every limit counts as `usize::MAX`, never wraps to a small
    /// number that would pass [`LlamaSpec::validate`].
    pub fn numel(&self) -> usize {
        let s = self;
        let mul = |a: usize, b: usize| a.saturating_mul(b);
        let heads = s.heads.saturating_add(s.kv_heads);
        let attention = mul(mul(s.hidden, s.head_dim), mul(2, heads));
        let mlp = mul(mul(3, s.hidden), s.intermediate);
        let block = attention
            .saturating_add(mlp)
            .saturating_add(mul(2, s.hidden));
        let head = if s.tied { 0 } else { mul(s.vocab, s.hidden) };
        mul(s.vocab, s.hidden)
            .saturating_add(mul(s.layers, block))
            .saturating_add(s.hidden)
            .saturating_add(head)
    }
}

impl Kind for LlamaSpec {
    fn name(&self) -> String {
        LlamaSpec::name(self)
    }

    fn input_dim(&self) -> usize {
        self.context
    }

    fn classes(&self) -> usize {
        self.vocab
    }

    fn validate(&self) -> Result<()> {
        LlamaSpec::validate(self)
    }

    fn build(
        &self,
        seed: u64,
        dev: &Device,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Arc<dyn Network>> {
        Ok(Arc::new(Llama::new(self, seed, dev, vars)?))
    }
}

impl Network for Llama {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        Llama::forward(self, tokens)
    }

    fn loss_and_grads(&self, xs: &Tensor, ys: &Tensor) -> Option<Result<(Tensor, GradStore)>> {
        self.has_hand_backward()
            .then(|| Llama::loss_and_grads(self, xs, ys))
    }
}

/// One pre-norm block's weights (linear weights `(out, in)`, no biases).
#[derive(Debug, Clone)]
struct Block {
    input_norm: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    post_norm: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

/// A built Llama: the layers that read the parameters (which [`crate::Model`] holds), and the
/// rotary tables for `context` positions.
#[derive(Debug, Clone)]
pub struct Llama {
    spec: LlamaSpec,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Tensor,
    /// The output head `(vocab, hidden)`: `lm_head.weight`, or the embedding where tied.
    head: Tensor,
    /// `cos` and `sin` of each position's angles `(context, head_dim)`, each half of a row
    /// the other's copy (the pairs `i`, `i + head_dim / 2` turn by one angle).
    cos: Tensor,
    sin: Tensor,
}

impl Llama {
    /// Builds the layers with weights drawn from `seed`, appending each parameter (under its
    /// Hugging Face name) to `vars`.
    pub fn new(
        spec: &LlamaSpec,
        seed: u64,
        dev: &Device,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Llama> {
        spec.validate()?;
        let s = spec;
        let mut param = |name: &str, shape: &[usize], normal: bool| -> Result<Tensor> {
            let var = if normal {
                init::normal(seed, name, shape, INIT_STD, dev)?
            } else {
                init::ones(shape, dev)?
            };
            let t = var.as_tensor().clone();
            vars.push((name.to_string(), var));
            Ok(t)
        };
        let embed = param("model.embed_tokens.weight", &[s.vocab, s.hidden], true)?;
        let (q_width, kv_width) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let mut blocks = Vec::with_capacity(s.layers);
        for i in 0..s.layers {
            let p = format!("model.layers.{i}");
            blocks.push(Block {
                input_norm: param(&format!("{p}.input_layernorm.weight"), &[s.hidden], false)?,
                q: param(
                    &format!("{p}.self_attn.q_proj.weight"),
                    &[q_width, s.hidden],
                    true,
                )?,
                k: param(
                    &format!("{p}.self_attn.k_proj.weight"),
                    &[kv_width, s.hidden],
                    true,
                )?,
                v: param(
                    &format!("{p}.self_attn.v_proj.weight"),
                    &[kv_width, s.hidden],
                    true,
                )?,
                o: param(
                    &format!("{p}.self_attn.o_proj.weight"),
                    &[s.hidden, q_width],
                    true,
                )?,
                post_norm: param(
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[s.hidden],
                    false,
                )?,
                gate: param(
                    &format!("{p}.mlp.gate_proj.weight"),
                    &[s.intermediate, s.hidden],
                    true,
                )?,
                up: param(
                    &format!("{p}.mlp.up_proj.weight"),
                    &[s.intermediate, s.hidden],
                    true,
                )?,
                down: param(
                    &format!("{p}.mlp.down_proj.weight"),
                    &[s.hidden, s.intermediate],
                    true,
                )?,
            });
        }
        let norm = param("model.norm.weight", &[s.hidden], false)?;
        let head = if s.tied {
            embed.clone()
        } else {
            param("lm_head.weight", &[s.vocab, s.hidden], true)?
        };
        let (cos, sin) = rotary_tables(s, dev)?;
        Ok(Llama {
            spec: *spec,
            embed: Embedding::new(embed, s.hidden),
            blocks,
            norm,
            head,
            cos,
            sin,
        })
    }

    /// The shape this model was built with.
    pub fn spec(&self) -> &LlamaSpec {
        &self.spec
    }

    /// Logits `(batch, time, vocab)` for token ids `(batch, time)` (`u32`, `time <=
    /// context`): position `t`'s logits predict token `t + 1` and depend on tokens `0..=t`
    /// only.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.forward_with(tokens, Rotary::Halves)
    }

    /// [`Llama::forward`] with the rotary layout `rotary`.
    pub(crate) fn forward_with(&self, tokens: &Tensor, rotary: Rotary) -> Result<Tensor> {
        let s = &self.spec;
        let (batch, time) = tokens.dims2()?;
        if time == 0 || time > s.context {
            return Err(Error::Layout(format!(
                "a llama of context {} cannot read {time} tokens at once",
                s.context
            )));
        }
        let (cos, sin) = (self.cos.narrow(0, 0, time)?, self.sin.narrow(0, 0, time)?);
        let heads_of = |x: Tensor, heads: usize| -> candle_core::Result<Tensor> {
            x.reshape((batch, time, heads, s.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let scale = 1.0 / (s.head_dim as f64).sqrt();
        let mut x = self.embed.forward(tokens)?;
        for b in &self.blocks {
            let h = rms_norm(&x, &b.input_norm, s.rms_eps)?;
            let q = heads_of(linear(&h, &b.q)?, s.heads)?;
            let k = heads_of(linear(&h, &b.k)?, s.kv_heads)?;
            let v = heads_of(linear(&h, &b.v)?, s.kv_heads)?;
            let q = rotate(&q, &cos, &sin, rotary)?;
            let k = repeat_kv(&rotate(&k, &cos, &sin, rotary)?, s.heads / s.kv_heads)?;
            let v = repeat_kv(&v, s.heads / s.kv_heads)?;
            let weights = fused::causal_softmax(&q.matmul(&k.t()?)?, scale)?;
            let attended = weights.matmul(&v)?.transpose(1, 2)?.reshape((
                batch,
                time,
                s.heads * s.head_dim,
            ))?;
            x = (x + linear(&attended, &b.o)?)?;
            let h = rms_norm(&x, &b.post_norm, s.rms_eps)?;
            let gated = fused::swiglu(&linear(&h, &b.gate)?, &linear(&h, &b.up)?)?;
            x = (x + linear(&gated, &b.down)?)?;
        }
        let x = rms_norm(&x, &self.norm, s.rms_eps)?;
        Ok(linear(&x, &self.head)?.reshape((batch, time, s.vocab))?)
    }
}

impl Llama {
    /// Continues the token ids `prompt` (not empty) by `count` ids, each drawn from the
    /// model's distribution at `temperature` (0: always the likeliest) with a generator seeded
    /// by `seed`. The model reads the last `context` ids at each step.
    pub fn generate(
        &self,
        prompt: &[u32],
        count: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(Error::Spec(
                "a llama continues a prompt of one token or more".into(),
            ));
        }
        crate::generate::continue_ids(
            |tokens| self.forward(tokens),
            self.spec.context,
            self.head.device(),
            prompt,
            count,
            temperature,
            seed,
        )
    }
}

/// Which dimensions of a head a rotary embedding turns together: `Halves` (`i` with `i +
/// head_dim / 2`, Hugging Face's layout) is the model's; `Interleaved` (`2i` with `2i + 1`,
/// the original Llama release's) exists so a test can show that the wrong one fails the
/// comparison with `transformers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rotary {
    Halves,
    #[cfg_attr(not(test), allow(dead_code))]
    Interleaved,
}

/// The rotary tables `(context, head_dim)`: position `p`'s angle for pair `i` is `p ·
/// theta^(-2i / head_dim)`, each row's second half a copy of its first.
fn rotary_tables(s: &LlamaSpec, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = s.head_dim / 2;
    let mut cos = Vec::with_capacity(s.context * s.head_dim);
    let mut sin = Vec::with_capacity(s.context * s.head_dim);
    for p in 0..s.context {
        for i in 0..s.head_dim {
            let frequency = s
                .rope_theta
                .powf(-2.0 * (i % half) as f64 / s.head_dim as f64);
            let angle = p as f64 * frequency;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (s.context, s.head_dim), dev)?,
        Tensor::from_vec(sin, (s.context, s.head_dim), dev)?,
    ))
}

/// Turns each head's pairs of `x` `(batch, heads, time, head_dim)` by its position's angles:
/// `x · cos + rotate_half(x) · sin`.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, rotary: Rotary) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let half = d / 2;
    match rotary {
        Rotary::Halves => {
            let (first, second) = (
                x.narrow(D::Minus1, 0, half)?,
                x.narrow(D::Minus1, half, half)?,
            );
            let turned = Tensor::cat(&[&second.neg()?, &first], D::Minus1)?;
            Ok((x.broadcast_mul(cos)? + turned.broadcast_mul(sin)?)?)
        }
        Rotary::Interleaved => {
            // Pair (2i, 2i + 1) turns by angle i: the tables' first half, each angle twice.
            let dims = x.dims().to_vec();
            let pairs = x.reshape(((), half, 2))?;
            let (even, odd) = (pairs.narrow(2, 0, 1)?, pairs.narrow(2, 1, 1)?);
            let turned = Tensor::cat(&[&odd.neg()?, &even], 2)?.reshape(dims.as_slice())?;
            let time = cos.dim(0)?;
            let twice = |t: &Tensor| -> candle_core::Result<Tensor> {
                t.narrow(1, 0, half)?
                    .reshape((time, half, 1))?
                    .repeat((1, 1, 2))?
                    .reshape((time, d))
            };
            Ok((x.broadcast_mul(&twice(cos)?)? + turned.broadcast_mul(&twice(sin)?)?)?)
        }
    }
}

/// Each key-value head `(batch, kv_heads, time, head_dim)` repeated for the `times` query
/// heads that read it, in order: query head `h` reads key-value head `h / times`.
fn repeat_kv(x: &Tensor, times: usize) -> Result<Tensor> {
    if times == 1 {
        return Ok(x.clone());
    }
    let (batch, kv_heads, time, head_dim) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((batch, kv_heads, times, time, head_dim))?
        .contiguous()?
        .reshape((batch, kv_heads * times, time, head_dim))?)
}

/// RMS norm over the last dimension, `x / sqrt(mean(x²) + eps) · weight`: the fused kernel with
/// its own backward pass (never candle-nn's, which has none).
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    fused::rms_norm(x, weight, eps)
}

/// `x @ weightᵀ` over the last dimension of `x`.
fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    matmul::linear_nd(x, weight, None)
}

/// The mean cross-entropy of next-token predictions: `logits` `(batch, time, vocab)` at
/// positions `0..time - 1` against `tokens` `(batch, time)` at `1..time`, as `transformers`'
/// causal language models compute their loss from labels equal to the inputs: what the tests
/// compare with transformers' loss (training and evaluation take the samples' shifted targets).
#[cfg(test)]
pub(crate) fn next_token_loss(logits: &Tensor, tokens: &Tensor) -> Result<Tensor> {
    let (batch, time, vocab) = logits.dims3()?;
    if tokens.dims() != [batch, time] || time < 2 {
        return Err(Error::Layout(format!(
            "logits {:?} against tokens {:?}",
            logits.dims(),
            tokens.dims()
        )));
    }
    let predicted = logits
        .narrow(1, 0, time - 1)?
        .contiguous()?
        .reshape((batch * (time - 1), vocab))?
        .to_dtype(candle_core::DType::F32)?;
    let targets = tokens
        .narrow(1, 1, time - 1)?
        .contiguous()?
        .reshape(batch * (time - 1))?;
    Ok(candle_nn::loss::cross_entropy(&predicted, &targets)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::Params;

    fn tiny(tied: bool) -> LlamaSpec {
        LlamaSpec {
            vocab: 40,
            context: 8,
            hidden: 16,
            intermediate: 24,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            tied,
        }
    }

    fn build(spec: &LlamaSpec, seed: u64) -> (Llama, Params) {
        let mut vars = Vec::new();
        let model = Llama::new(spec, seed, &Device::Cpu, &mut vars).expect("build");
        (model, Params::new(vars).expect("params"))
    }

    #[test]
    fn shapes_names_and_parameter_count() {
        for tied in [false, true] {
            let spec = tiny(tied);
            let (model, params) = build(&spec, 1);
            assert_eq!(params.numel(), spec.numel(), "tied {tied}");
            let mut built: Vec<(String, Vec<usize>)> = params
                .vars()
                .iter()
                .map(|(n, v)| (n.clone(), v.dims().to_vec()))
                .collect();
            let mut listed = spec.parameter_shapes();
            built.sort();
            listed.sort();
            assert_eq!(built, listed, "tied {tied}");
            assert_eq!(params.get("lm_head.weight").is_some(), !tied);
            assert!(params
                .get("model.layers.1.self_attn.k_proj.weight")
                .is_some());
            assert_eq!(
                params
                    .get("model.layers.0.self_attn.k_proj.weight")
                    .expect("k")
                    .dims(),
                [8, 16]
            );
            let tokens = Tensor::new(&[[1u32, 2, 3, 39], [0, 5, 6, 7]], &Device::Cpu).expect("t");
            let logits = model.forward(&tokens).expect("forward");
            assert_eq!(logits.dims(), [2, 4, 40]);
        }
    }

    #[test]
    fn a_later_token_cannot_change_an_earlier_prediction() {
        let (model, _) = build(&tiny(false), 3);
        let a = Tensor::new(&[[1u32, 2, 3, 4, 5]], &Device::Cpu).expect("a");
        let b = Tensor::new(&[[1u32, 2, 3, 9, 30]], &Device::Cpu).expect("b");
        let (la, lb) = (model.forward(&a).expect("a"), model.forward(&b).expect("b"));
        let first = |l: &Tensor| {
            l.narrow(1, 0, 3)
                .expect("n")
                .flatten_all()
                .expect("f")
                .to_vec1::<f32>()
                .expect("v")
        };
        assert_eq!(first(&la), first(&lb));
        let last = |l: &Tensor| {
            l.narrow(1, 4, 1)
                .expect("n")
                .flatten_all()
                .expect("f")
                .to_vec1::<f32>()
                .expect("v")
        };
        assert_ne!(last(&la), last(&lb));
    }

    #[test]
    fn gradients_reach_every_parameter() {
        for tied in [false, true] {
            let (model, params) = build(&tiny(tied), 5);
            let tokens = Tensor::new(&[[1u32, 2, 3, 4, 5, 6]], &Device::Cpu).expect("t");
            let loss = next_token_loss(&model.forward(&tokens).expect("f"), &tokens).expect("loss");
            let grads = loss.backward().expect("backward");
            for (name, var) in params.vars() {
                let g = grads
                    .get(var)
                    .unwrap_or_else(|| panic!("no gradient for {name}"));
                let norm = g
                    .sqr()
                    .expect("sq")
                    .sum_all()
                    .expect("sum")
                    .to_scalar::<f32>()
                    .expect("s");
                assert!(norm > 0.0 && norm.is_finite(), "{name}: {norm}");
            }
        }
    }

    #[test]
    fn names_round_trip_and_bad_specs_are_refused() {
        for tied in [false, true] {
            let spec = tiny(tied);
            assert_eq!(
                LlamaSpec::from_name(&spec.name()),
                Some(spec),
                "{}",
                spec.name()
            );
        }
        assert_eq!(
            tiny(false).name(),
            "llama-v40-c8-l2-w16-i24-h4-k2-d4-e0.00001-r10000"
        );
        assert_eq!(LlamaSpec::from_name("gpt-c8-l2-w16-h4"), None);
        let bad = [
            LlamaSpec {
                kv_heads: 3,
                ..tiny(false)
            },
            LlamaSpec {
                head_dim: 5,
                ..tiny(false)
            },
            LlamaSpec {
                rms_eps: f64::NAN,
                ..tiny(false)
            },
            LlamaSpec {
                rope_theta: 0.5,
                ..tiny(false)
            },
            LlamaSpec {
                vocab: 0,
                ..tiny(false)
            },
            LlamaSpec {
                layers: 100_000,
                ..tiny(false)
            },
            LlamaSpec {
                heads: 1 << 32,
                head_dim: 1 << 32,
                kv_heads: 1,
                ..tiny(false)
            },
            LlamaSpec {
                context: 131_072,
                head_dim: 1024,
                heads: 1,
                kv_heads: 1,
                ..tiny(false)
            },
        ];
        for spec in bad {
            assert!(spec.validate().is_err(), "{spec:?}");
        }
    }

    /// Rotary embeddings against the formula written out per element: pair `(i, i + d/2)` of
    /// position `p` turns by `p · theta^(-2i/d)`.
    #[test]
    fn rotary_embeddings_match_the_formula() {
        let spec = LlamaSpec {
            rope_theta: 500.0,
            ..tiny(false)
        };
        let (model, _) = build(&spec, 2);
        let (time, d) = (6, spec.head_dim);
        let x = crate::testing::seeded(&[1, 1, time, d], 9, 1.0);
        let (cos, sin) = (
            model.cos.narrow(0, 0, time).expect("c"),
            model.sin.narrow(0, 0, time).expect("s"),
        );
        let got = rotate(x.as_tensor(), &cos, &sin, Rotary::Halves)
            .expect("rotate")
            .flatten_all()
            .expect("f")
            .to_vec1::<f32>()
            .expect("v");
        let xs = x
            .as_tensor()
            .flatten_all()
            .expect("f")
            .to_vec1::<f32>()
            .expect("v");
        let half = d / 2;
        for p in 0..time {
            for i in 0..half {
                let angle = p as f64 * 500f64.powf(-2.0 * i as f64 / d as f64);
                let (a, b) = (f64::from(xs[p * d + i]), f64::from(xs[p * d + i + half]));
                let want = [
                    a * angle.cos() - b * angle.sin(),
                    b * angle.cos() + a * angle.sin(),
                ];
                for (k, w) in [(i, want[0]), (i + half, want[1])] {
                    assert!((f64::from(got[p * d + k]) - w).abs() < 1e-5, "p {p} i {k}");
                }
            }
        }
    }

    /// Grouped-query attention is full attention with each key-value head repeated: a model
    /// of 4 query heads over 2 key-value heads gives the logits of the model of 4 over 4
    /// whose key and value weights hold each head twice (heads 0, 1 read head 0).
    #[test]
    fn grouped_query_attention_is_full_attention_with_repeated_heads() {
        let grouped = tiny(false);
        let full = LlamaSpec {
            kv_heads: 4,
            ..grouped
        };
        let (g_model, g_params) = build(&grouped, 11);
        let (f_model, f_params) = build(&full, 12);
        let mut tensors = std::collections::HashMap::new();
        for (name, var) in g_params.vars() {
            let t = var.as_tensor().clone();
            let t = if name.ends_with("k_proj.weight") || name.ends_with("v_proj.weight") {
                // Rows of head h are h·d..(h+1)·d: repeat each head's block of rows.
                let d = grouped.head_dim;
                let blocks: Vec<Tensor> = (0..grouped.kv_heads)
                    .flat_map(|h| {
                        let block = t.narrow(0, h * d, d).expect("head");
                        [block.clone(), block]
                    })
                    .collect();
                Tensor::cat(&blocks, 0).expect("cat")
            } else {
                t
            };
            tensors.insert(name.clone(), t);
        }
        f_params.load(&tensors).expect("load");
        let tokens = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6]], &Device::Cpu).expect("t");
        let (a, b) = (
            g_model.forward(&tokens).expect("grouped"),
            f_model.forward(&tokens).expect("full"),
        );
        assert!(crate::testing::max_diff(&a, &b) < 1e-5);
    }

    /// The gradients autograd takes through the forward pass against central finite
    /// differences of the loss, for a few entries of every kind of parameter.
    #[test]
    fn gradients_match_finite_differences() {
        let spec = tiny(true);
        let (model, params) = build(&spec, 13);
        let tokens = Tensor::new(&[[1u32, 7, 3, 30, 2, 8]], &Device::Cpu).expect("t");
        let loss = |m: &Llama| -> f64 {
            let l = next_token_loss(&m.forward(&tokens).expect("f"), &tokens).expect("loss");
            f64::from(l.to_scalar::<f32>().expect("s"))
        };
        let grads = next_token_loss(&model.forward(&tokens).expect("f"), &tokens)
            .expect("loss")
            .backward()
            .expect("backward");
        for name in [
            "model.embed_tokens.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.1.mlp.gate_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.norm.weight",
        ] {
            let var = params.get(name).expect(name);
            let g = grads
                .get(var)
                .expect("gradient")
                .flatten_all()
                .expect("f")
                .to_vec1::<f32>()
                .expect("v");
            let base = var
                .as_tensor()
                .flatten_all()
                .expect("f")
                .to_vec1::<f32>()
                .expect("v");
            // The entry with the largest gradient, and one other.
            let top = (0..g.len())
                .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                .expect("top");
            for k in [top, g.len() / 3] {
                let h = 1e-2f32;
                let at = |delta: f32| {
                    let mut v = base.clone();
                    v[k] += delta;
                    var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).expect("t"))
                        .expect("set");
                    loss(&model)
                };
                let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
                at(0.0);
                let analytic = f64::from(g[k]);
                assert!(
                    (numeric - analytic).abs() <= 2e-3 + 0.05 * analytic.abs(),
                    "{name}[{k}]: finite differences {numeric}, autograd {analytic}"
                );
            }
        }
    }

    #[test]
    fn the_two_rotary_layouts_differ_and_both_keep_the_norm() {
        let spec = tiny(false);
        let (model, _) = build(&spec, 7);
        let x = crate::testing::seeded(&[1, 2, 5, 4], 3, 1.0);
        let (cos, sin) = (
            model.cos.narrow(0, 0, 5).expect("c"),
            model.sin.narrow(0, 0, 5).expect("s"),
        );
        let halves = rotate(x.as_tensor(), &cos, &sin, Rotary::Halves).expect("halves");
        let pairs = rotate(x.as_tensor(), &cos, &sin, Rotary::Interleaved).expect("pairs");
        let norm = |t: &Tensor| {
            t.sqr()
                .expect("s")
                .sum_all()
                .expect("s")
                .to_scalar::<f32>()
                .expect("s")
        };
        assert!((norm(&halves) - norm(x.as_tensor())).abs() < 1e-4);
        assert!((norm(&pairs) - norm(x.as_tensor())).abs() < 1e-4);
        assert!(crate::testing::max_diff(&halves, &pairs) > 1e-2);
        // Position 0 turns nothing.
        let at0 = |t: &Tensor| {
            t.narrow(2, 0, 1)
                .expect("n")
                .flatten_all()
                .expect("f")
                .to_vec1::<f32>()
                .expect("v")
        };
        assert_eq!(at0(&halves), at0(x.as_tensor()));
    }
}
