//! Optimizers whose whole state can be saved, restored and sent to another node, and the
//! learning-rate schedule they follow.
//!
//! candle-nn's `SGD` has no momentum and its `AdamW` keeps its moments private, so a joining
//! peer could not inherit them and a checkpoint could not hold them. These two keep every
//! buffer in the open, named after the parameter it belongs to, in the canonical parameter
//! order. The schedule's position is the optimizer's step count, which checkpoints and state
//! transfers carry, so a restarted or joining node resumes the schedule where it was.
//!
//! On the CPU, AdamW updates its moments and the parameters in place, in three passes over
//! memory and without allocating ([`MomentUpdate`], [`AdamwUpdate`]); elsewhere it falls back
//! to tensor ops.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor};
use serde::Serialize;

use crate::params::{ensure_finite, Params};
use crate::{Error, Result};

/// Which optimizer and its hyper-parameters. Part of the run identity.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerSpec {
    /// Stochastic gradient descent with (optionally Nesterov) momentum and L2 weight decay.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum coefficient; 0 disables the momentum buffer.
        momentum: f64,
        /// Nesterov's look-ahead variant of momentum.
        nesterov: bool,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// Adam with decoupled weight decay (Loshchilov & Hutter).
    Adamw {
        /// Learning rate.
        lr: f64,
        /// Decay of the first moment.
        beta1: f64,
        /// Decay of the second moment.
        beta2: f64,
        /// Added to the denominator for stability.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
}

impl OptimizerSpec {
    /// Checks the hyper-parameters; errors name the offending one.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, v: f64| {
            Err(Error::Spec(format!(
                "optimizer {what} = {v} is out of range"
            )))
        };
        match *self {
            OptimizerSpec::Sgd {
                lr,
                momentum,
                weight_decay,
                ..
            } => {
                if !(lr > 0.0 && lr.is_finite()) {
                    return bad("lr", lr);
                }
                if !(0.0..1.0).contains(&momentum) {
                    return bad("momentum", momentum);
                }
                if !(weight_decay >= 0.0 && weight_decay.is_finite()) {
                    return bad("weight_decay", weight_decay);
                }
            }
            OptimizerSpec::Adamw {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                if !(lr > 0.0 && lr.is_finite()) {
                    return bad("lr", lr);
                }
                if !(0.0..1.0).contains(&beta1) {
                    return bad("beta1", beta1);
                }
                if !(0.0..1.0).contains(&beta2) {
                    return bad("beta2", beta2);
                }
                if !(eps > 0.0 && eps.is_finite()) {
                    return bad("eps", eps);
                }
                if !(weight_decay >= 0.0 && weight_decay.is_finite()) {
                    return bad("weight_decay", weight_decay);
                }
            }
        }
        Ok(())
    }

    /// The names of the per-parameter state buffers this optimizer keeps, as prefixes: a buffer
    /// is named `<prefix><parameter name>`.
    fn buffer_prefixes(&self) -> &'static [&'static str] {
        match self {
            OptimizerSpec::Sgd { momentum, .. } if *momentum > 0.0 => &[SGD_MOMENTUM],
            OptimizerSpec::Sgd { .. } => &[],
            OptimizerSpec::Adamw { .. } => &[ADAM_M, ADAM_V],
        }
    }
}

/// How the learning rate moves with the optimizer's step count `t` (1 on the first step): the
/// configured rate times [`Schedule::factor`]. Part of the run identity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Schedule {
    /// The configured rate throughout.
    Constant,
    /// Linear warm-up from 0 over `warmup_steps`, then a cosine from the full rate down to
    /// `min_factor` of it at step `total_steps`, and that floor after.
    Cosine {
        /// Steps of linear warm-up.
        warmup_steps: u64,
        /// The step at which the cosine reaches its floor (counted from the first step).
        total_steps: u64,
        /// The floor, as a fraction of the rate, in `[0, 1]`.
        min_factor: f64,
    },
}

impl Schedule {
    /// Whether this is the constant schedule (left out of run identities, so runs configured
    /// before schedules existed keep theirs).
    pub fn is_constant(&self) -> bool {
        matches!(self, Schedule::Constant)
    }

    /// The factor on the learning rate at step `t` (1-based).
    pub fn factor(&self, t: u64) -> f64 {
        match *self {
            Schedule::Constant => 1.0,
            Schedule::Cosine {
                warmup_steps,
                total_steps,
                min_factor,
            } => {
                if t < warmup_steps {
                    return t as f64 / warmup_steps as f64;
                }
                let span = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let progress = ((t - warmup_steps) as f64 / span).min(1.0);
                min_factor
                    + (1.0 - min_factor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }

    /// Checks the numbers; errors name the offending one.
    pub fn validate(&self) -> Result<()> {
        if let Schedule::Cosine {
            warmup_steps,
            total_steps,
            min_factor,
        } = *self
        {
            if !(0.0..=1.0).contains(&min_factor) {
                return Err(Error::Spec(format!(
                    "schedule min_factor = {min_factor} must be in [0, 1]"
                )));
            }
            if total_steps <= warmup_steps {
                return Err(Error::Spec(format!(
                    "schedule total_steps = {total_steps} must exceed warmup_steps = {warmup_steps}"
                )));
            }
        }
        Ok(())
    }
}

/// Prefix of SGD's momentum buffers in checkpoints: `optim.momentum.fc0.weight`, ...
pub const SGD_MOMENTUM: &str = "optim.momentum.";
/// Prefix of AdamW's first-moment buffers in checkpoints.
pub const ADAM_M: &str = "optim.adam_m.";
/// Prefix of AdamW's second-moment buffers in checkpoints.
pub const ADAM_V: &str = "optim.adam_v.";

/// What a step does with the gradients before the optimizer's update, as fine-tuning recipes
/// ask: clip their global norm, and leave chosen tensors (say, the embeddings) as they are.
/// Part of the run identity: both change the training.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GradientPolicy {
    /// The largest global L2 norm of the gradients, over every tensor the optimizer trains: a
    /// larger one is scaled down to it (PyTorch's `clip_grad_norm_`, whose `1e-6` it adds to
    /// the norm). Not `sync.clip_value`, which clamps neighbours' updates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_norm: Option<f64>,
    /// Tensors the optimizer never changes (no update, no weight decay): parameter names, or
    /// prefixes ending in `*` (`model.layers.0.*`). Each must name at least one parameter.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub freeze: Vec<String>,
}

impl GradientPolicy {
    /// Whether it changes nothing (the default): runs configured without it keep their id.
    pub fn is_default(&self) -> bool {
        self.clip_norm.is_none() && self.freeze.is_empty()
    }

    /// Checks the numbers and patterns; errors name the offending one.
    pub fn validate(&self) -> Result<()> {
        if let Some(c) = self.clip_norm {
            if !(c > 0.0 && c.is_finite()) {
                return Err(Error::Spec(format!(
                    "a gradient norm clip of {c} is not a positive number"
                )));
            }
        }
        if let Some(p) = self
            .freeze
            .iter()
            .find(|p| p.trim_end_matches('*').is_empty())
        {
            return Err(Error::Spec(format!(
                "freeze pattern {p:?} names no parameter (a name, or a prefix ending in *)"
            )));
        }
        Ok(())
    }

    /// For each parameter of `params`, whether it is frozen. A pattern that matches no
    /// parameter is refused, the model's parameter names listed: a misspelt name would
    /// otherwise train what the user froze.
    pub fn frozen(&self, params: &Params) -> Result<Vec<bool>> {
        self.validate()?;
        let matches = |pattern: &str, name: &str| match pattern.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == pattern,
        };
        if let Some(p) = self
            .freeze
            .iter()
            .find(|p| !params.vars().iter().any(|(name, _)| matches(p, name)))
        {
            const SHOWN: usize = 24;
            let names: Vec<&str> = params.vars().iter().map(|(n, _)| n.as_str()).collect();
            let more = names.len().saturating_sub(SHOWN);
            return Err(Error::Spec(format!(
                "freeze pattern {p:?} matches no parameter of the model; its parameters: {}{}",
                names[..names.len().min(SHOWN)].join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )));
        }
        Ok(params
            .vars()
            .iter()
            .map(|(name, _)| self.freeze.iter().any(|p| matches(p, name)))
            .collect())
    }
}

/// An optimizer bound to one parameter set, holding one state buffer (or two, for AdamW) per
/// parameter, all in the open.
#[derive(Debug)]
pub struct Optimizer {
    spec: OptimizerSpec,
    schedule: Schedule,
    gradients: GradientPolicy,
    /// Per parameter, whether [`GradientPolicy::freeze`] keeps it as it is.
    frozen: Vec<bool>,
    /// The global gradient norm of the last step that measured it: every step where the
    /// policy clips, else one step after each [`Optimizer::measure_grad_norm_once`].
    last_grad_norm: Option<f64>,
    /// Whether the next step measures the gradients' norm though the policy does not clip.
    measure_norm_once: bool,
    /// Optimizer steps taken so far; AdamW's bias correction depends on it.
    steps: u64,
    /// `buffers[k][i]`: buffer kind `k` (see `buffer_prefixes`) of parameter `i`.
    buffers: Vec<Vec<Tensor>>,
}

impl Optimizer {
    /// Creates zeroed state for every parameter of `params`.
    pub fn new(spec: &OptimizerSpec, params: &Params) -> Result<Optimizer> {
        spec.validate()?;
        let buffers = spec
            .buffer_prefixes()
            .iter()
            .map(|_| {
                params
                    .vars()
                    .iter()
                    .map(|(_, v)| v.as_tensor().zeros_like())
                    .collect::<candle_core::Result<Vec<_>>>()
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Optimizer {
            spec: spec.clone(),
            schedule: Schedule::Constant,
            gradients: GradientPolicy::default(),
            frozen: vec![false; params.vars().len()],
            last_grad_norm: None,
            measure_norm_once: false,
            steps: 0,
            buffers,
        })
    }

    /// An optimizer with every setting a run configures: its hyper-parameters, schedule and
    /// gradient policy. The one place they are put together, so a new setting reaches every
    /// caller (the trainer, a restore, the benchmarks).
    pub fn configured(
        spec: &OptimizerSpec,
        schedule: Schedule,
        gradients: &GradientPolicy,
        params: &Params,
    ) -> Result<Optimizer> {
        Optimizer::new(spec, params)?
            .with_schedule(schedule)?
            .with_gradients(gradients.clone(), params)
    }

    /// A fresh optimizer (zeroed state, step 0) with this one's settings, for `params`: what a
    /// restore loads a checkpoint's state into before it replaces this one.
    pub fn fresh_like(&self, params: &Params) -> Result<Optimizer> {
        Optimizer::configured(&self.spec, self.schedule, &self.gradients, params)
    }

    /// The same optimizer treating gradients as `policy` says, for the parameters `params`
    /// (the set it was created for); a freeze pattern that names no parameter is refused.
    pub fn with_gradients(mut self, policy: GradientPolicy, params: &Params) -> Result<Optimizer> {
        self.frozen = policy.frozen(params)?;
        self.gradients = policy;
        Ok(self)
    }

    /// How it treats gradients.
    pub fn gradients(&self) -> &GradientPolicy {
        &self.gradients
    }

    /// The global norm of the gradients (over the trained tensors, before clipping) of the
    /// last step that measured it: every step where the policy clips, else the step after each
    /// [`Optimizer::measure_grad_norm_once`]; `None` before the first.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_grad_norm
    }

    /// Has the next step measure its gradients' norm ([`Optimizer::last_grad_norm`]) where the
    /// policy does not clip: one pass over the gradients and one value read back, which a
    /// node's status pays now and then rather than every step.
    pub fn measure_grad_norm_once(&mut self) {
        self.measure_norm_once = true;
    }

    /// The global L2 norm of the gradients of the tensors it trains, summed in f64 (an f32 sum
    /// of squares overflows for gradients past ~1e19, just where clipping matters), each
    /// tensor's sum kept on its device and the total read back once.
    fn grad_norm(&self, params: &Params, grads: &GradStore) -> Result<f64> {
        let mut sums = Vec::new();
        for ((_, var), frozen) in params.vars().iter().zip(&self.frozen) {
            if let (false, Some(g)) = (*frozen, grads.get(var.as_tensor())) {
                sums.push(g.to_dtype(DType::F64)?.sqr()?.sum_all()?);
            }
        }
        if sums.is_empty() {
            return Ok(0.0);
        }
        let total = Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f64>()?;
        Ok(total.sqrt())
    }

    /// The same optimizer following `schedule`.
    pub fn with_schedule(mut self, schedule: Schedule) -> Result<Optimizer> {
        schedule.validate()?;
        self.schedule = schedule;
        Ok(self)
    }

    /// The schedule it follows.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// The learning rate of the next step, after the schedule.
    pub fn current_lr(&self) -> f64 {
        let lr = match self.spec {
            OptimizerSpec::Sgd { lr, .. } | OptimizerSpec::Adamw { lr, .. } => lr,
        };
        lr * self.schedule.factor(self.steps + 1)
    }

    /// The hyper-parameters.
    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Moves the step count forward by `steps` without updating anything: a node that takes
    /// its mesh's parameters at a later step takes the mesh's place in the learning-rate
    /// schedule (and AdamW's bias correction) with them.
    pub fn skip_steps(&mut self, steps: u64) {
        self.steps = self.steps.saturating_add(steps);
    }

    /// Applies one update from `grads` to `params` (which must be the set this optimizer was
    /// created for).
    pub fn step(&mut self, params: &Params, grads: &GradStore) -> Result<()> {
        let _uploads = params
            .vars()
            .first()
            .map(|(_, var)| crate::gpu::step_guard(var.device()));
        // PyTorch's coefficient `max / (norm + 1e-6)`, applied where it is below 1. A
        // non-finite norm (an infinite or NaN gradient) is refused before anything changes:
        // no clip makes such an update safe.
        if std::mem::take(&mut self.measure_norm_once) && self.gradients.clip_norm.is_none() {
            self.last_grad_norm = Some(self.grad_norm(params, grads)?);
        }
        let clip = match self.gradients.clip_norm {
            Some(max) => {
                let norm = self.grad_norm(params, grads)?;
                self.last_grad_norm = Some(norm);
                if !norm.is_finite() {
                    return Err(Error::NonFinite(format!(
                        "the gradients' norm is {norm}: the step is refused, nothing changed"
                    )));
                }
                let coefficient = max / (norm + 1e-6);
                (coefficient < 1.0).then_some(coefficient)
            }
            None => None,
        };
        self.steps = self.steps.saturating_add(1);
        let factor = self.schedule.factor(self.steps);
        for (i, (_, var)) in params.vars().iter().enumerate() {
            if self.frozen.get(i).copied().unwrap_or(false) {
                continue;
            }
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let clipped;
            let g = match clip {
                Some(scale) => {
                    clipped = g.affine(scale, 0.0)?;
                    &clipped
                }
                None => g,
            };
            let p = var.as_tensor();
            // Buffers are detached so no autograd graph survives from one step to the next.
            let next = match self.spec {
                OptimizerSpec::Sgd {
                    lr,
                    momentum,
                    nesterov,
                    weight_decay,
                } => {
                    let lr = lr * factor;
                    if momentum > 0.0 && in_place_applies(&[p, g, &self.buffers[0][i]]) {
                        self.buffers[0][i].inplace_op3(
                            g,
                            p,
                            &SgdMomentum {
                                momentum,
                                weight_decay,
                            },
                        )?;
                        p.inplace_op3(
                            g,
                            &self.buffers[0][i],
                            &SgdStep {
                                lr,
                                weight_decay,
                                nesterov: nesterov.then_some(momentum),
                            },
                        )?;
                        continue;
                    }
                    if momentum == 0.0 && in_place_applies(&[p, g]) {
                        p.inplace_op2(g, &SgdPlain { lr, weight_decay })?;
                        continue;
                    }
                    let g = if weight_decay > 0.0 {
                        (g + p.affine(weight_decay, 0.0)?)?
                    } else {
                        g.clone()
                    };
                    let direction = if momentum > 0.0 {
                        let v = (self.buffers[0][i].affine(momentum, 0.0)? + &g)?.detach();
                        let d = if nesterov {
                            (&g + v.affine(momentum, 0.0)?)?
                        } else {
                            v.clone()
                        };
                        self.buffers[0][i] = v;
                        d
                    } else {
                        g
                    };
                    (p - direction.affine(lr, 0.0)?)?
                }
                OptimizerSpec::Adamw {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                } => {
                    let lr = lr * factor;
                    // Past 2^31 steps the bias correction is 1 to the last bit; a cast of
                    // the count itself wraps (2^32 steps made it 0: a division by zero).
                    let t = self.steps.min(i32::MAX as u64) as i32;
                    let (m, v) = (&self.buffers[0][i], &self.buffers[1][i]);
                    if in_place_applies(&[p, g, m, v]) {
                        m.inplace_op2(
                            g,
                            &MomentUpdate {
                                decay: beta1,
                                squared: false,
                            },
                        )?;
                        v.inplace_op2(
                            g,
                            &MomentUpdate {
                                decay: beta2,
                                squared: true,
                            },
                        )?;
                        p.inplace_op3(
                            m,
                            v,
                            &AdamwUpdate {
                                lr,
                                decay: 1.0 - lr * weight_decay,
                                m_scale: 1.0 / (1.0 - beta1.powi(t)),
                                v_scale: 1.0 / (1.0 - beta2.powi(t)),
                                eps,
                            },
                        )?;
                        continue;
                    }
                    let m = (self.buffers[0][i].affine(beta1, 0.0)?
                        + g.affine(1.0 - beta1, 0.0)?)?
                    .detach();
                    let v = (self.buffers[1][i].affine(beta2, 0.0)?
                        + g.sqr()?.affine(1.0 - beta2, 0.0)?)?
                    .detach();
                    let m_hat = m.affine(1.0 / (1.0 - beta1.powi(t)), 0.0)?;
                    let v_hat = v.affine(1.0 / (1.0 - beta2.powi(t)), 0.0)?;
                    let update = (m_hat / v_hat.sqrt()?.affine(1.0, eps)?)?;
                    self.buffers[0][i] = m;
                    self.buffers[1][i] = v;
                    (p.affine(1.0 - lr * weight_decay, 0.0)? - update.affine(lr, 0.0)?)?
                }
            };
            var.set(&next)?;
        }
        Ok(())
    }

    /// The state buffers, named `<prefix><parameter>` (see [`SGD_MOMENTUM`], [`ADAM_M`],
    /// [`ADAM_V`]), for checkpoints and for a joining peer.
    pub fn named_buffers(&self, params: &Params) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (k, prefix) in self.spec.buffer_prefixes().iter().enumerate() {
            for (i, (name, _)) in params.vars().iter().enumerate() {
                out.push((format!("{prefix}{name}"), self.buffers[k][i].clone()));
            }
        }
        out
    }

    /// Values in the state: one per parameter and buffer kind (0 for plain SGD, 2 for AdamW).
    pub fn state_len(&self) -> usize {
        self.buffers.iter().flatten().map(|t| t.elem_count()).sum()
    }

    /// The whole state as one `f32` vector, buffer kind by kind, each in the parameters'
    /// canonical order: `ddp` members average it with their parameters in a parameter round,
    /// so that a joiner leaves it with the members' moments, not its donor's older ones.
    pub fn flatten_state(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.state_len());
        for t in self.buffers.iter().flatten() {
            crate::params::extend_flat(&mut out, t)?;
        }
        Ok(out)
    }

    /// Replaces the whole state from a vector laid out as [`Optimizer::flatten_state`] gives
    /// it. The length and finiteness are checked first, so a bad vector changes nothing.
    pub fn write_state(&mut self, flat: &[f32]) -> Result<()> {
        crate::params::check_flat(flat, self.state_len(), "optimizer state")?;
        let mut offset = 0;
        for t in self.buffers.iter_mut().flatten() {
            let n = t.elem_count();
            // A tensor of its own: the buffers are updated in place.
            *t = Tensor::from_slice(&flat[offset..offset + n], t.dims(), t.device())?
                .to_dtype(t.dtype())?;
            offset += n;
        }
        Ok(())
    }

    /// Replaces the whole state from named buffers and a step count. Every buffer must be
    /// present, shaped like its parameter and finite; nothing changes unless all are.
    pub fn load(
        &mut self,
        params: &Params,
        steps: u64,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<()> {
        let mut staged = Vec::new();
        for prefix in self.spec.buffer_prefixes() {
            let mut kind = Vec::new();
            for (name, var) in params.vars() {
                let key = format!("{prefix}{name}");
                let t = tensors
                    .get(&key)
                    .ok_or_else(|| Error::Layout(format!("missing optimizer state {key}")))?;
                if t.dims() != var.dims() {
                    return Err(Error::Layout(format!(
                        "optimizer state {key} has shape {:?}, expected {:?}",
                        t.dims(),
                        var.dims()
                    )));
                }
                // A copy of its own: the buffers are updated in place.
                let t = t.to_device(var.device())?.to_dtype(DType::F32)?.copy()?;
                ensure_finite(&t, &key)?;
                kind.push(t);
            }
            staged.push(kind);
        }
        self.buffers = staged;
        self.steps = steps;
        Ok(())
    }
}

/// SGD's momentum buffer in place, given the gradient and the parameter:
/// `v = momentum·v + (g + weight_decay·p)`.
struct SgdMomentum {
    momentum: f64,
    weight_decay: f64,
}

/// SGD's parameter update in place after [`SgdMomentum`], given the gradient and the new
/// buffer: `p −= lr·v`, or with Nesterov's look-ahead `p −= lr·((g + weight_decay·p) +
/// momentum·v)`.
struct SgdStep {
    lr: f64,
    weight_decay: f64,
    /// Nesterov's form, with its momentum coefficient.
    nesterov: Option<f64>,
}

/// SGD without momentum in place, given the gradient: `p −= lr·(g + weight_decay·p)`.
struct SgdPlain {
    lr: f64,
    weight_decay: f64,
}

/// One of AdamW's moment updates in place over CPU `f32` memory, given the gradient:
/// `m = decay·m + (1 − decay)·g`, or with `squared`, `v = decay·v + (1 − decay)·g²`.
struct MomentUpdate {
    decay: f64,
    squared: bool,
}

/// AdamW's parameter update in place, given the two moments:
/// `p = decay·p − lr·(m·m_scale) / (sqrt(v·v_scale) + eps)` (bias-corrected moments, decoupled
/// weight decay).
struct AdamwUpdate {
    lr: f64,
    decay: f64,
    m_scale: f64,
    v_scale: f64,
    eps: f64,
}

/// Whether the in-place passes can run: every tensor `f32`, contiguous and of one size, on the
/// CPU or on a GPU whose kernels are on ([`crate::gpu`]).
fn in_place_applies(tensors: &[&Tensor]) -> bool {
    let n = tensors[0].elem_count();
    tensors.iter().all(|t| {
        crate::gpu::kernels_serve(t.device())
            && t.dtype() == DType::F32
            && t.is_contiguous()
            && t.elem_count() == n
    })
}

/// The contiguous `f32` elements of a CPU storage under `layout`.
fn f32_slice<'a>(s: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    let (from, to) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("in-place optimizer: not contiguous".into()))?;
    Ok(&s.as_slice::<f32>()?[from..to])
}

/// The same, writable.
fn f32_slice_mut<'a>(s: &'a mut CpuStorage, layout: &Layout) -> candle_core::Result<&'a mut [f32]> {
    let (from, to) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("in-place optimizer: not contiguous".into()))?;
    match s {
        CpuStorage::F32(v) => Ok(&mut v[from..to]),
        _ => Err(candle_core::Error::Msg(
            "in-place optimizer: not f32".into(),
        )),
    }
}

impl InplaceOp3 for SgdMomentum {
    fn name(&self) -> &'static str {
        "sgd-momentum"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
        p: &CpuStorage,
        p_l: &Layout,
    ) -> candle_core::Result<()> {
        let (mu, wd) = (self.momentum as f32, self.weight_decay as f32);
        let v = f32_slice_mut(dst, dst_l)?;
        let (g, p) = (f32_slice(g, g_l)?, f32_slice(p, p_l)?);
        if wd == 0.0 {
            for (v, g) in v.iter_mut().zip(g) {
                *v = mu * *v + g;
            }
        } else {
            for ((v, g), p) in v.iter_mut().zip(g).zip(p) {
                *v = mu * *v + (g + wd * p);
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
        p: &candle_core::CudaStorage,
        p_l: &Layout,
    ) -> candle_core::Result<()> {
        crate::gpu::ops::sgd_momentum(
            (dst, dst_l),
            (g, g_l),
            (p, p_l),
            self.momentum,
            self.weight_decay,
        )
    }
}

impl InplaceOp3 for SgdStep {
    fn name(&self) -> &'static str {
        "sgd-step"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let (lr, wd) = (self.lr as f32, self.weight_decay as f32);
        let p = f32_slice_mut(dst, dst_l)?;
        let (g, v) = (f32_slice(g, g_l)?, f32_slice(v, v_l)?);
        match self.nesterov {
            Some(mu) => {
                let mu = mu as f32;
                for ((p, g), v) in p.iter_mut().zip(g).zip(v) {
                    *p -= lr * ((g + wd * *p) + mu * v);
                }
            }
            None => {
                for (p, v) in p.iter_mut().zip(v) {
                    *p -= lr * v;
                }
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        crate::gpu::ops::sgd_step(
            (dst, dst_l),
            (g, g_l),
            (v, v_l),
            self.lr,
            self.weight_decay,
            self.nesterov,
        )
    }
}

impl InplaceOp2 for SgdPlain {
    fn name(&self) -> &'static str {
        "sgd-plain"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        let (lr, wd) = (self.lr as f32, self.weight_decay as f32);
        let p = f32_slice_mut(dst, dst_l)?;
        for (p, g) in p.iter_mut().zip(f32_slice(g, g_l)?) {
            *p -= lr * (g + wd * *p);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        crate::gpu::ops::sgd_plain((dst, dst_l), (g, g_l), self.lr, self.weight_decay)
    }
}

impl InplaceOp2 for MomentUpdate {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        let (moment, g) = (f32_slice_mut(dst, dst_l)?, f32_slice(g, g_l)?);
        let (a, b) = (self.decay as f32, (1.0 - self.decay) as f32);
        if self.squared {
            for (v, g) in moment.iter_mut().zip(g) {
                *v = a * *v + b * g * g;
            }
        } else {
            for (m, g) in moment.iter_mut().zip(g) {
                *m = a * *m + b * g;
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        crate::gpu::ops::adam_moment((dst, dst_l), (g, g_l), self.decay, self.squared)
    }
}

impl InplaceOp3 for AdamwUpdate {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        m: &CpuStorage,
        m_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let (lr, decay, m_scale, v_scale, eps) = (
            self.lr as f32,
            self.decay as f32,
            self.m_scale as f32,
            self.v_scale as f32,
            self.eps as f32,
        );
        let p = f32_slice_mut(dst, dst_l)?;
        let (m, v) = (f32_slice(m, m_l)?, f32_slice(v, v_l)?);
        for ((p, m), v) in p.iter_mut().zip(m).zip(v) {
            *p = decay * *p - lr * (m * m_scale) / ((v * v_scale).sqrt() + eps);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        m: &candle_core::CudaStorage,
        m_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        crate::gpu::ops::adamw_step(
            (dst, dst_l),
            (m, m_l),
            (v, v_l),
            [self.lr, self.decay, self.m_scale, self.v_scale, self.eps],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Minimises `sum((p - 3)^2)` and returns the final parameter.
    fn minimise(spec: &OptimizerSpec, steps: usize) -> f32 {
        let p = Var::from_slice(&[0.0f32, 10.0], 2, &Device::Cpu).expect("var");
        let params = Params::new(vec![("p".into(), p.clone())]).expect("params");
        let mut opt = Optimizer::new(spec, &params).expect("opt");
        for _ in 0..steps {
            let loss = (p.as_tensor() - 3.0)
                .and_then(|d| d.sqr())
                .and_then(|d| d.sum_all())
                .expect("loss");
            let grads = loss.backward().expect("grads");
            opt.step(&params, &grads).expect("step");
        }
        let v = p.as_tensor().to_vec1::<f32>().expect("vec");
        (v[0] - 3.0).abs().max((v[1] - 3.0).abs())
    }

    #[test]
    fn the_flat_state_round_trips_and_a_bad_one_changes_nothing() {
        let p = Var::from_slice(&[0.5f32, -1.5, 2.0], 3, &Device::Cpu).expect("var");
        let params = Params::new(vec![("p".into(), p.clone())]).expect("params");
        let spec = OptimizerSpec::Adamw {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut opt = Optimizer::new(&spec, &params).expect("opt");
        let loss = p.as_tensor().sqr().and_then(|x| x.sum_all()).expect("loss");
        opt.step(&params, &loss.backward().expect("grads"))
            .expect("step");
        let state = opt.flatten_state().expect("flat");
        assert_eq!(state.len(), 6);
        assert_eq!(opt.state_len(), 6);
        // First moments: 0.1 * g = 0.1 * 2p.
        assert!((state[0] - 0.1).abs() < 1e-6, "{state:?}");
        assert!(opt.write_state(&state[..5]).is_err());
        let mut bad = state.clone();
        bad[4] = f32::NAN;
        assert!(opt.write_state(&bad).is_err());
        assert_eq!(opt.flatten_state().expect("flat"), state);
        let doubled: Vec<f32> = state.iter().map(|v| 2.0 * v).collect();
        opt.write_state(&doubled).expect("write");
        assert_eq!(opt.flatten_state().expect("flat"), doubled);
        // The next step updates the written buffers in place.
        opt.step(&params, &loss.backward().expect("grads"))
            .expect("step");
        assert_ne!(opt.flatten_state().expect("flat"), doubled);
    }

    /// Clipping scales the gradients of the trained tensors to the norm asked (plain SGD
    /// moves each parameter by `lr` times its clipped gradient), leaves a gradient under it as
    /// it is, and a frozen tensor neither moves nor counts in the norm.
    /// Without clipping the norm is measured only on request, once, and the step is the
    /// unclipped one either way.
    #[test]
    fn the_gradient_norm_is_measured_once_when_asked_without_clipping() {
        let spec = OptimizerSpec::Sgd {
            lr: 1.0,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let a = Var::from_slice(&[0.0f32, 0.0], 2, &Device::Cpu).expect("a");
        let params = Params::new(vec![("a".into(), a.clone())]).expect("params");
        let mut opt = Optimizer::new(&spec, &params).expect("opt");
        // The gradient (3, 4): norm 5.
        let grads = || {
            let weights = Tensor::new(&[3f32, 4.0], &Device::Cpu).expect("w");
            (a.as_tensor() * &weights)
                .and_then(|t| t.sum_all())
                .and_then(|l| l.backward())
                .expect("grads")
        };
        opt.step(&params, &grads()).expect("step");
        assert_eq!(opt.last_grad_norm(), None, "measured unasked");
        opt.measure_grad_norm_once();
        opt.step(&params, &grads()).expect("step");
        let norm = opt.last_grad_norm().expect("measured when asked");
        assert!((norm - 5.0).abs() < 1e-9, "{norm}");
        assert_eq!(
            a.as_tensor().to_vec1::<f32>().expect("values"),
            [-6.0, -8.0],
            "two unclipped steps"
        );
    }

    #[test]
    fn clipping_scales_to_the_global_norm_and_frozen_tensors_stay() {
        let spec = OptimizerSpec::Sgd {
            lr: 1.0,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.5,
        };
        let make = || {
            let a = Var::from_slice(&[0.0f32, 0.0], 2, &Device::Cpu).expect("a");
            let b = Var::from_slice(&[0.0f32], 1, &Device::Cpu).expect("b");
            let frozen = Var::from_slice(&[1.0f32], 1, &Device::Cpu).expect("frozen");
            let params = Params::new(vec![
                ("layer.a".into(), a.clone()),
                ("layer.b".into(), b.clone()),
                ("embed".into(), frozen.clone()),
            ])
            .expect("params");
            (params, [a, b, frozen])
        };
        // Gradients (3, 0) and (4): a global norm of 5 over the trained tensors; the frozen
        // one's gradient of 100 would dominate it if it counted.
        let loss = |vars: &[Var; 3]| {
            let [a, b, frozen] = vars;
            let weights = Tensor::new(&[3f32, 0.0], &Device::Cpu).expect("w");
            ((a.as_tensor() * &weights)
                .and_then(|t| t.sum_all())
                .expect("a")
                + (b.as_tensor() * 4.0).and_then(|t| t.sum_all()).expect("b")
                + (frozen.as_tensor() * 100.0)
                    .and_then(|t| t.sum_all())
                    .expect("f"))
            .expect("loss")
        };
        for (clip, want) in [
            (Some(1.0), [-0.6f32, 0.0, -0.8]),
            (Some(10.0), [-3.0, 0.0, -4.0]),
        ] {
            let (params, vars) = make();
            let policy = GradientPolicy {
                clip_norm: clip,
                freeze: vec!["embed".into()],
            };
            let mut opt = Optimizer::new(&spec, &params)
                .and_then(|o| o.with_gradients(policy, &params))
                .expect("opt");
            opt.step(&params, &loss(&vars).backward().expect("grads"))
                .expect("step");
            let values = |v: &Var| v.as_tensor().to_vec1::<f32>().expect("values");
            let got = [values(&vars[0]), values(&vars[1])].concat();
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() < 1e-5,
                    "clip {clip:?}: {got:?}, want {want:?}"
                );
            }
            assert_eq!(
                values(&vars[2]),
                [1.0],
                "the frozen tensor moved (or decayed)"
            );
            let norm = opt.last_grad_norm().expect("norm");
            assert!((norm - 5.0).abs() < 1e-6, "{norm}");
        }
        // A gradient of 1e30 (its square past f32) is clipped to the norm asked; an infinite
        // one is refused, and nothing changes.
        for (scale, finite) in [(1e30f64, true), (f64::INFINITY, false)] {
            let (params, vars) = make();
            let policy = GradientPolicy {
                clip_norm: Some(1.0),
                freeze: vec![],
            };
            let mut opt = Optimizer::new(&spec, &params)
                .and_then(|o| o.with_gradients(policy, &params))
                .expect("opt");
            let big = (vars[1].as_tensor() * scale)
                .and_then(|t| t.sum_all())
                .expect("loss");
            let result = opt.step(&params, &big.backward().expect("grads"));
            let b = vars[1].as_tensor().to_vec1::<f32>().expect("b")[0];
            if finite {
                result.expect("a finite norm clips");
                assert!((b + 1.0).abs() < 1e-5, "{b}");
            } else {
                assert!(result.is_err(), "an infinite norm is refused");
                assert_eq!((b, opt.steps()), (0.0, 0), "nothing changed");
            }
        }
        // A prefix freezes both layer tensors; a pattern naming nothing is refused.
        let (params, _) = make();
        let prefix = GradientPolicy {
            clip_norm: None,
            freeze: vec!["layer.*".into()],
        };
        let frozen = prefix.frozen(&params).expect("frozen");
        for ((name, _), frozen) in params.vars().iter().zip(frozen) {
            assert_eq!(frozen, name.starts_with("layer."), "{name}");
        }
        for bad in [
            GradientPolicy {
                clip_norm: None,
                freeze: vec!["lm_head.weight".into()],
            },
            GradientPolicy {
                clip_norm: None,
                freeze: vec!["*".into()],
            },
            GradientPolicy {
                clip_norm: Some(0.0),
                freeze: vec![],
            },
            GradientPolicy {
                clip_norm: Some(f64::NAN),
                freeze: vec![],
            },
        ] {
            assert!(
                Optimizer::new(&spec, &params)
                    .and_then(|o| o.with_gradients(bad.clone(), &params))
                    .is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn optimizers_converge_on_a_quadratic() {
        let sgd = OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.0,
        };
        assert!(minimise(&sgd, 200) < 1e-3);
        let plain = OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        assert!(minimise(&plain, 200) < 1e-3);
        let adamw = OptimizerSpec::Adamw {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        assert!(minimise(&adamw, 500) < 1e-2);
    }

    /// AdamW with lr 0.01, betas 0.9 and 0.99, eps 1e-8 and weight decay 0.1.
    fn adamw_0_01() -> OptimizerSpec {
        OptimizerSpec::Adamw {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }

    #[test]
    fn in_place_adamw_matches_the_tensor_formula() {
        let spec = adamw_0_01();
        let start = [0.5f32, -1.5, 2.0, 0.0];
        let p = Var::from_slice(&start, 4, &Device::Cpu).expect("var");
        let params = Params::new(vec![("p".into(), p.clone())]).expect("params");
        let mut opt = Optimizer::new(&spec, &params).expect("opt");
        let (mut m, mut v, mut want) = ([0f64; 4], [0f64; 4], start.map(f64::from));
        for t in 1..=3 {
            let loss = p.as_tensor().sqr().and_then(|x| x.sum_all()).expect("loss");
            let grads = loss.backward().expect("grads");
            opt.step(&params, &grads).expect("step");
            for i in 0..4 {
                let g = 2.0 * want[i];
                m[i] = 0.9 * m[i] + 0.1 * g;
                v[i] = 0.99 * v[i] + 0.01 * g * g;
                let (mh, vh) = (
                    m[i] / (1.0 - 0.9f64.powi(t)),
                    v[i] / (1.0 - 0.99f64.powi(t)),
                );
                want[i] = want[i] * (1.0 - 0.01 * 0.1) - 0.01 * mh / (vh.sqrt() + 1e-8);
            }
        }
        let got = p.as_tensor().to_vec1::<f32>().expect("vec");
        for (g, w) in got.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    /// A step count from a loaded state that no run reaches (a hostile donor's) still gives
    /// finite parameters: AdamW's bias correction neither wraps nor overflows.
    #[test]
    fn adamw_stays_finite_at_any_step_count() {
        let spec = adamw_0_01();
        for steps in [u64::from(u32::MAX), u64::MAX - 1, u64::MAX] {
            let p = Var::from_slice(&[0.5f32, -1.5], 2, &Device::Cpu).expect("var");
            let params = Params::new(vec![("p".into(), p.clone())]).expect("params");
            let mut opt = Optimizer::new(&spec, &params).expect("opt");
            opt.skip_steps(steps);
            for _ in 0..2 {
                let loss = p.as_tensor().sqr().and_then(|x| x.sum_all()).expect("loss");
                let grads = loss.backward().expect("grads");
                opt.step(&params, &grads).expect("step");
            }
            let got = p.as_tensor().to_vec1::<f32>().expect("vec");
            assert!(got.iter().all(|v| v.is_finite()), "{steps}: {got:?}");
        }
    }

    /// Plain, heavy-ball and Nesterov SGD with weight decay, in place, against the formula.
    #[test]
    fn in_place_sgd_matches_the_formula() {
        for (momentum, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
            let (lr, wd) = (0.05, 0.1);
            let spec = OptimizerSpec::Sgd {
                lr,
                momentum,
                nesterov,
                weight_decay: wd,
            };
            let start = [0.5f32, -1.5, 2.0, 0.0];
            let p = Var::from_slice(&start, 4, &Device::Cpu).expect("var");
            let params = Params::new(vec![("p".into(), p.clone())]).expect("params");
            let mut opt = Optimizer::new(&spec, &params).expect("opt");
            let (mut buf, mut want) = ([0f64; 4], start.map(f64::from));
            for _ in 0..3 {
                let loss = p.as_tensor().sqr().and_then(|x| x.sum_all()).expect("loss");
                let grads = loss.backward().expect("grads");
                opt.step(&params, &grads).expect("step");
                for i in 0..4 {
                    let g = 2.0 * want[i] + wd * want[i];
                    buf[i] = momentum * buf[i] + g;
                    let d = match (momentum > 0.0, nesterov) {
                        (false, _) => g,
                        (true, false) => buf[i],
                        (true, true) => g + momentum * buf[i],
                    };
                    want[i] -= lr * d;
                }
            }
            let got = p.as_tensor().to_vec1::<f32>().expect("vec");
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (f64::from(*g) - w).abs() < 1e-6,
                    "momentum {momentum} nesterov {nesterov}: {got:?} vs {want:?}"
                );
            }
        }
    }

    #[test]
    fn the_cosine_schedule_warms_up_decays_and_rests_at_its_floor() {
        let s = Schedule::Cosine {
            warmup_steps: 10,
            total_steps: 110,
            min_factor: 0.1,
        };
        assert!((s.factor(1) - 0.1).abs() < 1e-12);
        assert!((s.factor(10) - 1.0).abs() < 1e-12);
        assert!(
            (s.factor(60) - 0.55).abs() < 1e-9,
            "half way: {}",
            s.factor(60)
        );
        assert!((s.factor(110) - 0.1).abs() < 1e-12);
        assert!((s.factor(10_000) - 0.1).abs() < 1e-12);
        assert!(s.validate().is_ok());
        let bad = Schedule::Cosine {
            warmup_steps: 10,
            total_steps: 10,
            min_factor: 0.1,
        };
        assert!(bad.validate().is_err());
        // The position is the step count a checkpoint restores.
        let p = Var::from_slice(&[1.0f32], 1, &Device::Cpu).expect("var");
        let params = Params::new(vec![("p".into(), p)]).expect("params");
        let spec = OptimizerSpec::Sgd {
            lr: 1.0,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let mut opt = Optimizer::new(&spec, &params)
            .expect("opt")
            .with_schedule(s)
            .expect("schedule");
        opt.load(&params, 59, &HashMap::new()).expect("load");
        assert!((opt.current_lr() - 0.55).abs() < 1e-9);
    }

    #[test]
    fn state_round_trips_and_bad_state_is_refused() {
        let p = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu).expect("var");
        let params = Params::new(vec![("w".into(), p.clone())]).expect("params");
        let spec = OptimizerSpec::Adamw {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut opt = Optimizer::new(&spec, &params).expect("opt");
        let grads = p
            .as_tensor()
            .sqr()
            .and_then(|t| t.sum_all())
            .and_then(|t| t.backward())
            .expect("g");
        opt.step(&params, &grads).expect("step");
        let named: HashMap<String, Tensor> = opt.named_buffers(&params).into_iter().collect();
        assert!(named.contains_key("optim.adam_m.w") && named.contains_key("optim.adam_v.w"));
        let mut other = Optimizer::new(&spec, &params).expect("opt");
        other.load(&params, opt.steps(), &named).expect("load");
        assert_eq!(other.steps(), 1);
        let m = |o: &Optimizer| o.named_buffers(&params)[0].1.to_vec1::<f32>().expect("v");
        assert_eq!(m(&other), m(&opt));
        let mut poisoned = named.clone();
        poisoned.insert(
            "optim.adam_v.w".into(),
            Tensor::from_slice(&[f32::NAN, 0.0], 2, &Device::Cpu).expect("t"),
        );
        assert!(other.load(&params, 5, &poisoned).is_err());
        assert_eq!(other.steps(), 1, "a refused load changes nothing");
    }
}
