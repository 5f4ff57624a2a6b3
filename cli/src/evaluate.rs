//! Evaluating a checkpoint file on the config's held-out set, for `p2ptrain eval` and for
//! `local`'s summary of the nodes' final models.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use p2ptrain_daemon::node;

/// Reads and decodes a checkpoint file, naming the file in any error.
pub(crate) fn read_checkpoint_file(
    path: &Path,
) -> Result<(String, p2ptrain_daemon::store::Loaded)> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file = path.display().to_string();
    let (meta, tensors) =
        p2ptrain_daemon::checkpoint::decode(&bytes, &file).map_err(|e| anyhow!("{file}: {e}"))?;
    Ok((file, p2ptrain_daemon::store::Loaded { meta, tensors }))
}

/// Builds the model from a loaded checkpoint and evaluates it on the held-out set.
pub(crate) fn evaluate_loaded(
    file: &str,
    loaded: &p2ptrain_daemon::store::Loaded,
    prepared: &node::Prepared,
) -> Result<p2ptrain_models::train::Evaluation> {
    let ident = p2ptrain_daemon::trainer::Identity {
        run_id: prepared.config.run_id(),
        config_hash: loaded.meta.info.config_hash.clone(),
    };
    let (model, _, _) = p2ptrain_daemon::trainer::build(
        &prepared.spec,
        &prepared.config.optimizer,
        prepared.config.schedule,
        &prepared.config.gradients,
        prepared.config.train.init_seed,
        &prepared.device,
        &ident,
        Some(loaded),
    )
    .map_err(|e| anyhow!("{file}: {e}"))?;
    Ok(p2ptrain_models::train::evaluate(
        &model,
        prepared.data.test(),
        &prepared.device,
    )?)
}

/// Evaluates a checkpoint file on the held-out set; also returns its step.
pub(crate) fn evaluate_file(
    path: &Path,
    prepared: &node::Prepared,
) -> Result<(p2ptrain_models::train::Evaluation, u64)> {
    let (file, loaded) = read_checkpoint_file(path)?;
    let e = evaluate_loaded(&file, &loaded, prepared)?;
    Ok((e, loaded.meta.info.step))
}
