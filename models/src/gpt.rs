//! A decoder-only transformer over bytes (a small GPT): the model a mesh of GPU boxes gathers
//! for, in the smallest honest form.
//!
//! Token and learned position embeddings, `layers` pre-norm blocks (causal multi-head
//! self-attention, then an MLP four times as wide with SiLU, each added to the residual stream), a
//! final layer norm, and an output head tied to the token embedding. The vocabulary is the 256
//! byte values, so any text file is data and nothing needs a tokenizer.
//!
//! Weights come from [`crate::init`] (GPT-2's normal(0, 0.02), with the projections into the
//! residual stream scaled by `1/sqrt(2·layers)`), so every node builds bit-identical
//! parameters from the run's seed. Layer norm, the causal softmax, SiLU and the linear layers
//! are [`crate::cpu::fused`]'s kernels, which carry their own backward passes (candle-nn's fused
//! softmax and layer norm have none).

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{Embedding, Linear};
use serde::{Deserialize, Serialize};

use crate::cpu::{fused, matmul};
use crate::kind::{Kind, Network};
use crate::{init, Error, Result};

mod backward;

/// Byte values: the vocabulary.
pub const VOCAB: usize = 256;
/// Standard deviation of the initial weights (GPT-2's).
const INIT_STD: f32 = 0.02;
/// Layer norm's epsilon.
const LN_EPS: f64 = 1e-5;
/// Largest context, width, layers and parameter count a spec may ask for: far beyond what a
/// box trains, and small enough that a corrupt config or checkpoint name cannot make a node
/// try to allocate without bound.
const MAX_CONTEXT: usize = 8192;
const MAX_WIDTH: usize = 16_384;
const MAX_LAYERS: usize = 256;
const MAX_PARAMS: usize = 4_000_000_000;
/// The shape of a GPT. Part of the run identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptSpec {
    /// Bytes of context the model sees (and the length of its training windows).
    pub context: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub width: usize,
    /// Attention heads; must divide `width`.
    pub heads: usize,
}

impl GptSpec {
    /// Checks the numbers; errors say which one is wrong.
    pub fn validate(&self) -> Result<()> {
        let GptSpec {
            context,
            layers,
            width,
            heads,
        } = *self;
        if context == 0 || layers == 0 || width == 0 || heads == 0 {
            return Err(Error::Spec(format!(
                "a gpt needs non-zero context, layers, width and heads, got {self:?}"
            )));
        }
        if !width.is_multiple_of(heads) {
            return Err(Error::Spec(format!(
                "gpt width {width} is not a multiple of its {heads} heads"
            )));
        }
        if context > MAX_CONTEXT || width > MAX_WIDTH || layers > MAX_LAYERS {
            return Err(Error::Spec(format!(
                "a gpt of context {context}, width {width} and {layers} layers is past the \
                 limits ({MAX_CONTEXT}, {MAX_WIDTH}, {MAX_LAYERS})"
            )));
        }
        if self.numel() > MAX_PARAMS {
            return Err(Error::Spec(format!(
                "a gpt of {} parameters is past the limit of {MAX_PARAMS}",
                self.numel()
            )));
        }
        Ok(())
    }

    /// A short name such as `gpt-c64-l4-w128-h4`, from which [`GptSpec::from_name`] rebuilds
    /// the spec (a checkpoint records the name, so `sample` needs no config).
    pub fn name(&self) -> String {
        format!(
            "gpt-c{}-l{}-w{}-h{}",
            self.context, self.layers, self.width, self.heads
        )
    }

    /// The spec a [`GptSpec::name`] stands for, if `name` is one.
    pub fn from_name(name: &str) -> Option<GptSpec> {
        let mut parts = name.strip_prefix("gpt-")?.split('-');
        let mut field =
            |tag: char| -> Option<usize> { parts.next()?.strip_prefix(tag)?.parse().ok() };
        let spec = GptSpec {
            context: field('c')?,
            layers: field('l')?,
            width: field('w')?,
            heads: field('h')?,
        };
        (parts.next().is_none() && spec.validate().is_ok()).then_some(spec)
    }

    /// Number of parameters the model has.
    pub fn numel(&self) -> usize {
        let w = self.width;
        let block =
            2 * (2 * w) + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w);
        VOCAB * w + self.context * w + self.layers * block + 2 * w
    }
}

impl Kind for GptSpec {
    fn name(&self) -> String {
        GptSpec::name(self)
    }

    fn input_dim(&self) -> usize {
        self.context
    }

    fn classes(&self) -> usize {
        VOCAB
    }

    fn validate(&self) -> Result<()> {
        GptSpec::validate(self)
    }

    fn build(
        &self,
        seed: u64,
        dev: &Device,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Arc<dyn Network>> {
        Ok(Arc::new(Gpt::new(self, seed, dev, vars)?))
    }
}

impl Network for Gpt {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        Gpt::forward(self, tokens)
    }

    fn loss_and_grads(&self, xs: &Tensor, ys: &Tensor) -> Option<Result<(Tensor, GradStore)>> {
        self.has_hand_backward()
            .then(|| Gpt::loss_and_grads(self, xs, ys))
    }
}

/// One pre-norm transformer block.
#[derive(Debug, Clone)]
struct Block {
    ln1: (Tensor, Tensor),
    qkv: Linear,
    proj: Linear,
    ln2: (Tensor, Tensor),
    fc: Linear,
    fc_proj: Linear,
}

/// A built GPT: the layers that read the parameters (which [`crate::Model`] holds).
#[derive(Debug, Clone)]
pub struct Gpt {
    spec: GptSpec,
    tok_emb: Embedding,
    /// The token embedding's matrix `(256, width)`, which the tied output head also reads.
    tok_weight: Tensor,
    pos_emb: Tensor,
    blocks: Vec<Block>,
    ln_f: (Tensor, Tensor),
}

impl Gpt {
    /// Builds the layers with weights drawn from `seed`, appending each parameter (named as
    /// documented in docs/configuration.md) to `vars`.
    pub fn new(
        spec: &GptSpec,
        seed: u64,
        dev: &Device,
        vars: &mut Vec<(String, candle_core::Var)>,
    ) -> Result<Gpt> {
        spec.validate()?;
        let w = spec.width;
        let residual_std = INIT_STD / (2.0 * spec.layers as f32).sqrt();
        let mut b = Builder { seed, dev, vars };
        let mut blocks = Vec::with_capacity(spec.layers);
        for i in 0..spec.layers {
            let p = format!("blocks.{i}");
            blocks.push(Block {
                ln1: b.norm(&format!("{p}.ln1"), w)?,
                qkv: b.linear(&format!("{p}.attn.qkv"), 3 * w, w, INIT_STD)?,
                proj: b.linear(&format!("{p}.attn.proj"), w, w, residual_std)?,
                ln2: b.norm(&format!("{p}.ln2"), w)?,
                fc: b.linear(&format!("{p}.mlp.fc"), 4 * w, w, INIT_STD)?,
                fc_proj: b.linear(&format!("{p}.mlp.proj"), w, 4 * w, residual_std)?,
            });
        }
        let tok_weight = b.param("tok_emb.weight", &[VOCAB, w], Init::Normal(INIT_STD))?;
        let pos_emb = b.param("pos_emb.weight", &[spec.context, w], Init::Normal(INIT_STD))?;
        let ln_f = b.norm("ln_f", w)?;
        Ok(Gpt {
            spec: *spec,
            tok_emb: Embedding::new(tok_weight.clone(), w),
            tok_weight,
            pos_emb,
            blocks,
            ln_f,
        })
    }

    /// The shape this model was built with.
    pub fn spec(&self) -> &GptSpec {
        &self.spec
    }

    /// Logits `(batch, time, 256)` for bytes `(batch, time)` (`u32`, `time <= context`):
    /// position `t`'s logits predict byte `t + 1` and depend on bytes `0..=t` only.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let (batch, time) = tokens.dims2()?;
        if time == 0 || time > self.spec.context {
            return Err(Error::Layout(format!(
                "a gpt of context {} cannot read {time} bytes at once",
                self.spec.context
            )));
        }
        let w = self.spec.width;
        let heads = self.spec.heads;
        let head_dim = w / heads;
        // The positions' embeddings added to every sequence of the batch, as one bias row.
        let positions = self.pos_emb.narrow(0, 0, time)?.reshape(time * w)?;
        let mut x = fused::add_bias(
            &self.tok_emb.forward(tokens)?.reshape((batch, time * w))?,
            &positions,
        )?
        .reshape((batch, time, w))?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        for b in &self.blocks {
            let h = layer_norm(&x, &b.ln1)?;
            let qkv = linear(&h, &b.qkv)?;
            let split = |k: usize| -> candle_core::Result<Tensor> {
                qkv.narrow(2, k * w, w)?
                    .reshape((batch, time, heads, head_dim))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (split(0)?, split(1)?, split(2)?);
            let weights = fused::causal_softmax(&q.matmul(&k.t()?)?, scale)?;
            let attended = weights
                .matmul(&v)?
                .transpose(1, 2)?
                .reshape((batch, time, w))?;
            x = (x + linear(&attended, &b.proj)?)?;
            let h = layer_norm(&x, &b.ln2)?;
            let h = linear(&fused::silu(&linear(&h, &b.fc)?)?, &b.fc_proj)?;
            x = (x + h)?;
        }
        let x = layer_norm(&x, &self.ln_f)?.reshape((batch * time, w))?;
        let logits = x.matmul(&self.tok_weight.t()?)?;
        Ok(logits.reshape((batch, time, VOCAB))?)
    }

    /// Continues `prompt` by `count` bytes, drawing each from the model's distribution at
    /// `temperature` (0: always the likeliest byte) with a generator seeded by `seed`. The
    /// model reads the last `context` bytes at each step.
    pub fn generate(
        &self,
        prompt: &[u8],
        count: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Vec<u8>> {
        let prompt: Vec<u32> = if prompt.is_empty() {
            vec![u32::from(b'\n')]
        } else {
            prompt.iter().map(|&b| u32::from(b)).collect()
        };
        let ids = crate::generate::continue_ids(
            |tokens| self.forward(tokens),
            self.spec.context,
            self.tok_weight.device(),
            &prompt,
            count,
            temperature,
            seed,
        )?;
        // A byte model's ids are bytes.
        Ok(ids.into_iter().map(|id| id as u8).collect())
    }
}

/// How a parameter starts.
#[derive(Clone, Copy)]
enum Init {
    Normal(f32),
    Zeros,
    Ones,
}

/// Creates the parameters, in the order the layers ask for them, into the model's list.
struct Builder<'a> {
    seed: u64,
    dev: &'a Device,
    vars: &'a mut Vec<(String, candle_core::Var)>,
}

impl Builder<'_> {
    fn param(&mut self, name: &str, shape: &[usize], kind: Init) -> Result<Tensor> {
        let var = match kind {
            Init::Normal(std) => init::normal(self.seed, name, shape, std, self.dev)?,
            Init::Zeros => init::zeros(shape, self.dev)?,
            Init::Ones => init::ones(shape, self.dev)?,
        };
        let t = var.as_tensor().clone();
        self.vars.push((name.to_string(), var));
        Ok(t)
    }

    /// `<name>.weight` `(fan_out, fan_in)` drawn with `std`, `<name>.bias` zeros.
    fn linear(&mut self, name: &str, fan_out: usize, fan_in: usize, std: f32) -> Result<Linear> {
        let weight = self.param(
            &format!("{name}.weight"),
            &[fan_out, fan_in],
            Init::Normal(std),
        )?;
        let bias = self.param(&format!("{name}.bias"), &[fan_out], Init::Zeros)?;
        Ok(Linear::new(weight, Some(bias)))
    }

    /// A layer norm's `<name>.weight` (ones) and `<name>.bias` (zeros).
    fn norm(&mut self, name: &str, width: usize) -> Result<(Tensor, Tensor)> {
        Ok((
            self.param(&format!("{name}.weight"), &[width], Init::Ones)?,
            self.param(&format!("{name}.bias"), &[width], Init::Zeros)?,
        ))
    }
}

/// Layer norm over the last dimension.
fn layer_norm(x: &Tensor, (weight, bias): &(Tensor, Tensor)) -> Result<Tensor> {
    fused::layer_norm(x, weight, bias, LN_EPS)
}

/// A linear layer over the last dimension.
fn linear(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    matmul::linear_nd(x, layer.weight(), layer.bias())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::Params;
    use candle_core::DType;

    fn tiny() -> GptSpec {
        GptSpec {
            context: 8,
            layers: 2,
            width: 16,
            heads: 4,
        }
    }

    fn build(spec: &GptSpec, seed: u64) -> (Gpt, Params) {
        let mut vars = Vec::new();
        let gpt = Gpt::new(spec, seed, &Device::Cpu, &mut vars).expect("gpt");
        (gpt, Params::new(vars).expect("params"))
    }

    fn tokens(bytes: &[u8]) -> Tensor {
        let ids: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
        Tensor::from_vec(ids, (1, bytes.len()), &Device::Cpu).expect("tokens")
    }

    #[test]
    fn shapes_names_and_parameter_count() {
        let spec = tiny();
        let (gpt, params) = build(&spec, 1);
        assert_eq!(params.numel(), spec.numel());
        let names: Vec<String> = params.layout().entries.into_iter().map(|e| e.0).collect();
        for name in [
            "tok_emb.weight",
            "pos_emb.weight",
            "blocks.0.attn.qkv.weight",
            "blocks.1.mlp.proj.bias",
            "ln_f.weight",
        ] {
            assert!(names.iter().any(|n| n == name), "{name} in {names:?}");
        }
        let xs = Tensor::zeros((3, 5), DType::U32, &Device::Cpu).expect("xs");
        assert_eq!(gpt.forward(&xs).expect("fwd").dims(), &[3, 5, VOCAB]);
        let too_long = Tensor::zeros((1, 9), DType::U32, &Device::Cpu).expect("xs");
        assert!(gpt.forward(&too_long).is_err());
    }

    #[test]
    fn a_later_byte_cannot_change_an_earlier_prediction() {
        let (gpt, _) = build(&tiny(), 3);
        let a = gpt.forward(&tokens(b"abcdefgh")).expect("a");
        let b = gpt.forward(&tokens(b"abcdeXYZ")).expect("b");
        let diff = (a - b).expect("diff").abs().expect("abs");
        let per_position: Vec<f32> = diff
            .max_keepdim(2)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .expect("max");
        // Positions 0..=4 saw the same bytes; 5.. did not.
        assert!(
            per_position[..5].iter().all(|d| *d < 1e-6),
            "{per_position:?}"
        );
        assert!(
            per_position[5..].iter().all(|d| *d > 1e-6),
            "{per_position:?}"
        );
    }

    /// A `ddp` node keeps a batch's gradients while it computes the next batch's and
    /// steps: the kept ones must not change under it.
    #[test]
    fn kept_gradients_do_not_change_under_a_later_step() {
        use crate::optim::{Optimizer, OptimizerSpec};
        let (gpt, params) = build(&tiny(), 5);
        let xs = tokens(b"to be or not to b").reshape((1, 17)).expect("r");
        let (xs, ys) = (
            xs.narrow(1, 0, 8).expect("x"),
            xs.narrow(1, 1, 8).expect("y"),
        );
        let (_, first) = gpt.loss_and_grads(&xs, &ys).expect("grads");
        let kept = params.flatten_grads(&first).expect("flat");
        let mut opt = Optimizer::new(
            &OptimizerSpec::Adamw {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.01,
            },
            &params,
        )
        .expect("opt");
        let (_, second) = gpt.loss_and_grads(&xs, &ys).expect("grads");
        opt.step(&params, &second).expect("step");
        assert_eq!(params.flatten_grads(&first).expect("flat"), kept);
    }

    #[test]
    fn gradients_reach_every_parameter() {
        let (gpt, params) = build(&tiny(), 5);
        let logits = gpt.forward(&tokens(b"to be or")).expect("fwd");
        let targets = tokens(b"o be or ");
        let loss = candle_nn::loss::cross_entropy(
            &logits.reshape((8, VOCAB)).expect("r"),
            &targets.flatten_all().expect("t"),
        )
        .expect("loss");
        // Uniform over 256 bytes at first: ln 256 = 5.55.
        let l = loss.to_scalar::<f32>().expect("scalar");
        assert!((l - 5.545).abs() < 0.1, "{l}");
        let grads = loss.backward().expect("backward");
        for (name, var) in params.vars() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no grad for {name}"));
            let norm = g
                .sqr()
                .and_then(|t| t.sum_all())
                .and_then(|t| t.to_scalar::<f32>())
                .expect("norm");
            assert!(norm.is_finite() && norm > 0.0, "{name}: {norm}");
        }
    }

    #[test]
    fn same_seed_same_model_and_names_round_trip() {
        let (_, a) = build(&tiny(), 9);
        let (_, b) = build(&tiny(), 9);
        let (_, c) = build(&tiny(), 10);
        assert_eq!(a.hash().expect("a"), b.hash().expect("b"));
        assert_ne!(a.hash().expect("a"), c.hash().expect("c"));
        assert_eq!(GptSpec::from_name(&tiny().name()), Some(tiny()));
        assert_eq!(GptSpec::from_name("gpt-c8-l2-w16-h5"), None, "16 % 5 != 0");
        assert_eq!(GptSpec::from_name("mlp-64-10"), None);
        // A name (from a checkpoint) asking for an absurd model is refused before any allocation.
        assert_eq!(GptSpec::from_name("gpt-c100000000-l2-w16-h4"), None);
        assert_eq!(GptSpec::from_name("gpt-c64-l200-w16384-h4"), None);
    }

    #[test]
    fn generation_gives_the_bytes_asked_for_and_is_seeded() {
        let (gpt, _) = build(&tiny(), 2);
        let a = gpt.generate(b"Hamlet", 20, 1.0, 7).expect("a");
        let b = gpt.generate(b"Hamlet", 20, 1.0, 7).expect("b");
        assert_eq!(a.len(), 20);
        assert_eq!(a, b);
        assert_eq!(gpt.generate(b"", 3, 0.0, 1).expect("greedy").len(), 3);
    }
}
