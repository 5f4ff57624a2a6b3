//! Timing helpers the benchmarks and `local` share: the median of runs, and a bare Candle
//! training loop (batch, forward, backward, optimizer step; nothing else) in steps per second.

use std::time::Instant;

use anyhow::Result;
use p2ptrain_daemon::node::Prepared;
use p2ptrain_models::data::Sampler;
use p2ptrain_models::optim::Optimizer;
use p2ptrain_models::train::{forward_backward, loss_value, train_step};
use p2ptrain_models::Model;

/// The median (mean of the middle two for an even count); NaN for none.
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The bare loop on a fresh model: batch, forward, backward, optimizer step; nothing else.
/// Returns steps per second.
pub(crate) fn bare_loop(p: &Prepared, steps: u64) -> Result<f64> {
    let model = Model::new(&p.spec, p.config.train.init_seed, &p.device)?;
    train_steps(p, &model, steps)
}

/// Trains `model` for `steps` steps with a fresh optimizer of the config; steps per second.
pub(crate) fn train_steps(p: &Prepared, model: &Model, steps: u64) -> Result<f64> {
    let config = &p.config;
    let mut opt = Optimizer::configured(
        &config.optimizer,
        config.schedule,
        &config.gradients,
        model.params(),
    )?;
    let mut sampler = Sampler::new(p.data.train().len(), 1);
    let start = Instant::now();
    for _ in 0..steps {
        let idx = sampler.next_batch(config.train.batch_size);
        let (xs, ys) = p.data.train().batch(&idx, &p.device)?;
        train_step(model, &mut opt, &xs, &ys)?;
    }
    Ok(steps as f64 / start.elapsed().as_secs_f64())
}

/// Trains a fresh model `steps` steps, timing apart the host issuing each step (batch, forward,
/// backward, optimizer) and the wait for the loss's value, which on a GPU is the wait for the
/// step's kernels; returns the waits' share of the whole (near 0 for a host-bound step). A step
/// that reads values back before its end (the MLP's labels, autograd's loss scale) waits
/// there too, counted as issuing: for those the share is a lower bound.
pub(crate) fn gpu_wait_fraction(p: &Prepared, steps: u64) -> Result<f64> {
    let model = Model::new(&p.spec, p.config.train.init_seed, &p.device)?;
    let config = &p.config;
    let mut opt = Optimizer::configured(
        &config.optimizer,
        config.schedule,
        &config.gradients,
        model.params(),
    )?;
    let mut sampler = Sampler::new(p.data.train().len(), 1);
    let (mut issuing, mut waiting) = (0f64, 0f64);
    for _ in 0..steps {
        let start = Instant::now();
        let idx = sampler.next_batch(config.train.batch_size);
        let (xs, ys) = p.data.train().batch(&idx, &p.device)?;
        let (loss, grads) = forward_backward(&model, &xs, &ys)?;
        opt.step(model.params(), &grads)?;
        let issued = Instant::now();
        loss_value(&loss)?;
        issuing += (issued - start).as_secs_f64();
        waiting += issued.elapsed().as_secs_f64();
    }
    Ok(waiting / (issuing + waiting).max(f64::MIN_POSITIVE))
}
