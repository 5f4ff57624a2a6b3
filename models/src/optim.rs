//! Optimizers whose whole state can be saved, restored and sent to another node.
//!
//! candle-nn's `SGD` has no momentum and its `AdamW` keeps its moments private, so a joining
//! peer could not inherit them and a checkpoint could not hold them. These two keep every
//! buffer in the open, named after the parameter it belongs to, in the canonical parameter
//! order.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
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

/// Prefix of SGD's momentum buffers in checkpoints: `optim.momentum.fc0.weight`, ...
pub const SGD_MOMENTUM: &str = "optim.momentum.";
/// Prefix of AdamW's first-moment buffers in checkpoints.
pub const ADAM_M: &str = "optim.adam_m.";
/// Prefix of AdamW's second-moment buffers in checkpoints.
pub const ADAM_V: &str = "optim.adam_v.";

/// An optimizer bound to one parameter set, holding one state buffer (or two, for AdamW) per
/// parameter, all in the open.
#[derive(Debug)]
pub struct Optimizer {
    spec: OptimizerSpec,
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
            steps: 0,
            buffers,
        })
    }

    /// The hyper-parameters.
    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Applies one update from `grads` to `params` (which must be the set this optimizer was
    /// created for).
    pub fn step(&mut self, params: &Params, grads: &GradStore) -> Result<()> {
        self.steps += 1;
        for (i, (_, var)) in params.vars().iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
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
                    let t = self.steps as i32;
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
                let t = t.to_device(var.device())?.to_dtype(DType::F32)?;
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
