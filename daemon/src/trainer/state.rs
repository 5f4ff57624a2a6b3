//! Building a trainer's model and optimizer, loading a verified checkpoint into them, and
//! copying them out as a snapshot: the state side of the trainer, apart from its loop.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use p2ptrain_models::optim::Schedule;
use p2ptrain_models::{Model, ModelSpec, Optimizer, OptimizerSpec};

use super::{Counters, Identity, TrainerError};
use crate::checkpoint::{HostTensor, Snapshot, StateInfo};
use crate::store::Loaded;

/// Builds the model and optimizer for a run, restoring a checkpoint when one is given.
pub fn build(
    spec: &ModelSpec,
    opt_spec: &OptimizerSpec,
    schedule: Schedule,
    init_seed: u64,
    device: &Device,
    identity: &Identity,
    resume: Option<&Loaded>,
) -> Result<(Model, Optimizer, Counters), TrainerError> {
    let model = Model::new(spec, init_seed, device)?;
    let mut optimizer = Optimizer::new(opt_spec, model.params())?.with_schedule(schedule)?;
    let mut counters = Counters::default();
    if let Some(loaded) = resume {
        counters = restore_into(&model, &mut optimizer, identity, loaded)?;
    }
    Ok((model, optimizer, counters))
}

/// Loads a verified checkpoint into model and optimizer; refuses one of another run or layout
/// and changes nothing then.
pub(super) fn restore_into(
    model: &Model,
    optimizer: &mut Optimizer,
    identity: &Identity,
    loaded: &Loaded,
) -> Result<Counters, TrainerError> {
    let info = &loaded.meta.info;
    if info.run_id != identity.run_id {
        return Err(TrainerError::Refused(format!(
            "checkpoint {} belongs to run {}, this node runs {}",
            loaded.meta.id, info.run_id, identity.run_id
        )));
    }
    let layout = model.params().layout().hash();
    if info.layout_hash != layout {
        return Err(TrainerError::Refused(format!(
            "checkpoint {} has parameter layout {}, the model has {layout}",
            loaded.meta.id, info.layout_hash
        )));
    }
    // A checksummed file can still hold NaN (a donor whose model diverged, or a hostile one):
    // nothing non-finite is loaded.
    if let Some((name, _)) = loaded
        .tensors
        .iter()
        .find(|(_, t)| t.values.iter().any(|v| !v.is_finite()))
    {
        return Err(TrainerError::Refused(format!(
            "checkpoint {} holds NaN or infinite values in {name}",
            loaded.meta.id
        )));
    }
    let device = model
        .params()
        .vars()
        .first()
        .map(|(_, v)| v.device().clone())
        .unwrap_or(Device::Cpu);
    let tensors = to_device(&loaded.tensors, &device)?;
    // Check the optimizer state loads before touching the parameters, so a failure leaves both
    // as they were.
    let mut staged =
        Optimizer::new(optimizer.spec(), model.params())?.with_schedule(optimizer.schedule())?;
    staged.load(model.params(), info.optimizer_steps, &tensors)?;
    model.params().load(&tensors)?;
    *optimizer = staged;
    Ok(Counters {
        step: info.step,
        samples_seen: info.samples_seen,
    })
}

/// The checkpoint's name for DiLoCo's outer velocity (flat, in canonical order).
pub const OUTER_VELOCITY: &str = "optim.outer_velocity";

/// The outer optimizer's velocity a checkpoint holds (empty when it holds none).
pub fn outer_velocity(loaded: &Loaded) -> Vec<f32> {
    loaded
        .tensors
        .get(OUTER_VELOCITY)
        .map(|t| t.values.clone())
        .unwrap_or_default()
}

fn to_device(
    tensors: &BTreeMap<String, HostTensor>,
    dev: &Device,
) -> candle_core::Result<HashMap<String, Tensor>> {
    tensors
        .iter()
        .map(|(name, t)| {
            Ok((
                name.clone(),
                Tensor::from_slice(&t.values, t.shape.as_slice(), dev)?,
            ))
        })
        .collect()
}

fn host(t: &Tensor) -> candle_core::Result<HostTensor> {
    Ok(HostTensor {
        shape: t.dims().to_vec(),
        values: t
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?,
    })
}

/// Copies the model's parameters and the optimizer's state to host memory, stamped with the
/// run's identities and the counters.
pub(super) fn snapshot(
    model: &Model,
    optimizer: &Optimizer,
    identity: &Identity,
    counters: Counters,
    outer_velocity: &[f32],
) -> Result<Snapshot, TrainerError> {
    let params = model.params();
    let mut tensors = BTreeMap::new();
    if !outer_velocity.is_empty() {
        tensors.insert(
            OUTER_VELOCITY.to_string(),
            HostTensor {
                shape: vec![outer_velocity.len()],
                values: outer_velocity.to_vec(),
            },
        );
    }
    for (name, var) in params.vars() {
        tensors.insert(name.clone(), host(var.as_tensor())?);
    }
    for (name, t) in optimizer.named_buffers(params) {
        tensors.insert(name, host(&t)?);
    }
    Ok(Snapshot {
        info: StateInfo {
            run_id: identity.run_id.clone(),
            config_hash: identity.config_hash.clone(),
            layout_hash: params.layout().hash(),
            model: model.spec().name(),
            optimizer: match optimizer.spec() {
                OptimizerSpec::Sgd { .. } => "sgd".into(),
                OptimizerSpec::Adamw { .. } => "adamw".into(),
            },
            step: counters.step,
            samples_seen: counters.samples_seen,
            optimizer_steps: optimizer.steps(),
        },
        tensors,
    })
}
