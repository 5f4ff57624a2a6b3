//! Building a trainer's model and optimizer, loading a verified checkpoint into them, and
//! copying them out as a snapshot: the state side of the trainer, apart from its loop.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use p2ptrain_models::optim::{GradientPolicy, Schedule};
use p2ptrain_models::{Model, ModelSpec, Optimizer, OptimizerSpec};

use super::{Counters, Identity, TrainerError};
use crate::checkpoint::{HostTensor, Snapshot, StateInfo};
use crate::store::Loaded;

/// Builds the model and optimizer for a run, restoring a checkpoint when one is given. A freeze
/// pattern of `gradients` that names no parameter of the model is refused here.
#[allow(clippy::too_many_arguments)]
pub fn build(
    spec: &ModelSpec,
    opt_spec: &OptimizerSpec,
    schedule: Schedule,
    gradients: &GradientPolicy,
    init_seed: u64,
    device: &Device,
    identity: &Identity,
    resume: Option<&Loaded>,
) -> Result<(Model, Optimizer, Counters), TrainerError> {
    let model = Model::new(spec, init_seed, device)?;
    let mut optimizer = Optimizer::configured(opt_spec, schedule, gradients, model.params())?;
    let mut counters = Counters::default();
    if let Some(loaded) = resume {
        counters = restore_into(&model, &mut optimizer, identity, loaded)?;
    }
    Ok((model, optimizer, counters))
}

/// A counter in a checkpoint at or past this (2^48: 8,900 years at a million a second) is not
/// an honest run's.
pub(super) const COUNTER_LIMIT: u64 = 1 << 48;

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
    // Counters no run reaches (a hostile donor's: a step count at its maximum wraps at the
    // next step) are refused too. Below the limit any count is safe: AdamW's bias correction
    // no longer wraps at 2^32 steps (see its test in models' optim).
    for (name, n) in [
        ("step", info.step),
        ("samples_seen", info.samples_seen),
        ("optimizer_steps", info.optimizer_steps),
    ] {
        if n >= COUNTER_LIMIT {
            return Err(TrainerError::Refused(format!(
                "checkpoint {} counts {n} for {name}, past what any run reaches",
                loaded.meta.id
            )));
        }
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
    let mut staged = optimizer.fresh_like(model.params())?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::CheckpointMeta;
    use p2ptrain_models::MlpSpec;

    fn built() -> (Model, Optimizer, Identity) {
        built_with(&GradientPolicy::default()).expect("built")
    }

    fn built_with(
        gradients: &GradientPolicy,
    ) -> Result<(Model, Optimizer, Identity), TrainerError> {
        let spec = ModelSpec::Mlp(MlpSpec {
            widths: vec![4, 3, 2],
        });
        let opt = OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        };
        let identity = Identity {
            run_id: "run".into(),
            config_hash: "cfg".into(),
        };
        let (model, optimizer, _) = build(
            &spec,
            &opt,
            Schedule::Constant,
            gradients,
            1,
            &Device::Cpu,
            &identity,
            None,
        )?;
        Ok((model, optimizer, identity))
    }

    /// The trainer's optimizer carries the config's gradient policy (and a restored state
    /// keeps it); a freeze pattern naming no parameter of the model stops the build, named.
    #[test]
    fn the_gradient_policy_reaches_the_optimizer_and_a_pattern_naming_nothing_stops_it() {
        let policy = GradientPolicy {
            clip_norm: Some(0.5),
            freeze: vec!["fc0.*".into()],
        };
        let (model, mut optimizer, identity) = built_with(&policy).expect("built");
        assert_eq!(optimizer.gradients(), &policy);
        let snap =
            snapshot(&model, &optimizer, &identity, Counters::default(), &[]).expect("snapshot");
        let loaded = Loaded {
            meta: CheckpointMeta {
                id: 1,
                info: snap.info,
                created_unix: 0,
                checksum: String::new(),
                file: String::new(),
                bytes: 0,
            },
            tensors: snap.tensors,
        };
        restore_into(&model, &mut optimizer, &identity, &loaded).expect("restore");
        assert_eq!(optimizer.gradients(), &policy);
        let typo = GradientPolicy {
            clip_norm: None,
            freeze: vec!["fc9.weight".into()],
        };
        let e = built_with(&typo).expect_err("typo").to_string();
        assert!(e.contains("fc9.weight"), "{e}");
    }

    /// A state whose counters no run reaches is refused like one with NaN, and changes
    /// nothing; the same state with honest counters loads.
    #[test]
    fn a_state_with_counters_past_any_runs_is_refused() {
        let (model, mut optimizer, identity) = built();
        let counters = Counters {
            step: 100,
            samples_seen: 3200,
        };
        let snap = snapshot(&model, &optimizer, &identity, counters, &[]).expect("snapshot");
        let loaded = |info: StateInfo| Loaded {
            meta: CheckpointMeta {
                id: 1,
                info,
                created_unix: 0,
                checksum: String::new(),
                file: String::new(),
                bytes: 0,
            },
            tensors: snap.tensors.clone(),
        };
        let honest = restore_into(
            &model,
            &mut optimizer,
            &identity,
            &loaded(snap.info.clone()),
        )
        .expect("honest counters");
        assert_eq!(honest.step, 100);
        for liar in [
            StateInfo {
                optimizer_steps: COUNTER_LIMIT,
                ..snap.info.clone()
            },
            StateInfo {
                step: u64::MAX,
                ..snap.info.clone()
            },
            StateInfo {
                samples_seen: COUNTER_LIMIT,
                ..snap.info.clone()
            },
        ] {
            let before = optimizer.steps();
            let err = restore_into(&model, &mut optimizer, &identity, &loaded(liar))
                .expect_err("a liar's counters");
            assert!(
                err.to_string().contains("past what any run reaches"),
                "{err}"
            );
            assert_eq!(optimizer.steps(), before);
        }
    }
}
