//! The node's data directory: created and locked for the node's lifetime (two nodes never
//! share one), its identity key loaded or created, and its checkpoint store opened with the
//! newest valid checkpoint to resume from, which must be of this configuration's run.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use super::error::NodeError;
use crate::config::Config;
use crate::store::{self, Store};
use crate::{identity, trainer};

/// The data directory, opened for this node's lifetime: its lock, identity and checkpoints.
pub(super) struct OpenedDataDir {
    pub(super) key: libp2p::identity::Keypair,
    pub(super) local_peer: libp2p::PeerId,
    pub(super) ident: trainer::Identity,
    pub(super) store: Arc<Store>,
    /// The newest valid checkpoint, to resume from.
    pub(super) resume: Option<store::Loaded>,
    /// Held until the node has stopped ([`lock_data_dir`]); the last field, so that it is
    /// released after the store closes.
    _lock: File,
}

/// Creates and locks the data directory, loads or creates the node's key, and opens its
/// checkpoints (which must be of this configuration's run).
pub(super) fn open_data_dir(config: &Config, data_dir: &Path) -> Result<OpenedDataDir, NodeError> {
    make_private_dir(data_dir)
        .map_err(|e| NodeError::DataDir(format!("{}: {e}", data_dir.display())))?;
    let lock = lock_data_dir(data_dir)?;
    let key = identity::load_or_create(data_dir)?;
    let local_peer = identity::peer_id(&key);
    let ident = trainer::Identity {
        run_id: config.run_id(),
        config_hash: config.config_hash(),
    };
    let (store, resume) = open_store(data_dir, &ident.run_id)?;
    Ok(OpenedDataDir {
        _lock: lock,
        key,
        local_peer,
        ident,
        store,
        resume,
    })
}

/// Creates the data directory, readable by its owner only (0700): it holds the node's key, its
/// checkpoints (the model and the optimizer's state) and its API token. One that exists is
/// narrowed to 0700 too, with a warning, where others could read it. Public for what starts
/// nodes in folders of its own (`local`, the benchmarks), which writes a node's log there
/// first: made with `create_dir_all`, each node warned once that its folder was open.
pub fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(not(unix))]
    std::fs::create_dir_all(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        // Made 0700 (not 0777 less the umask, then narrowed): never readable by others, even
        // for a moment. Folders above it that it creates are 0700 too.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let mode = std::fs::metadata(dir)?.permissions().mode() & 0o777;
        if mode != 0o700 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
            if mode & 0o077 != 0 {
                tracing::warn!(
                    "data dir {} was open to others (mode {mode:o}); now 0700",
                    dir.display()
                );
            }
        }
    }
    Ok(())
}

/// Holds an exclusive lock on the data directory for the node's lifetime, so two nodes never
/// share one (they would fight over the identity and corrupt each other's checkpoints).
fn lock_data_dir(dir: &Path) -> Result<File, NodeError> {
    let path = dir.join("LOCK");
    let file =
        File::create(&path).map_err(|e| NodeError::DataDir(format!("{}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(NodeError::DataDir(format!(
            "data dir {} is in use by another p2ptrain node",
            dir.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(NodeError::DataDir(format!(
            "{}: cannot lock: {e}",
            path.display()
        ))),
    }
}

/// Opens the checkpoint store in `data_dir` and loads its newest valid checkpoint, which must
/// be of run `run_id` (a data directory holds one run).
fn open_store(
    data_dir: &Path,
    run_id: &str,
) -> Result<(Arc<Store>, Option<store::Loaded>), NodeError> {
    let (store, notes) = Store::open(data_dir)?;
    for note in notes {
        tracing::warn!("{note}");
    }
    let (resume, skipped) = store.load_newest_valid().map_err(|e| {
        NodeError::DataDir(format!(
            "cannot read a checkpoint ({e}); it is left as it is: start again once it can be read"
        ))
    })?;
    for s in &skipped {
        tracing::warn!("{}", s.reason);
    }
    if let Some(loaded) = &resume {
        if loaded.meta.info.run_id != run_id {
            return Err(NodeError::DataDir(format!(
                "data dir {} holds checkpoints of run {} but this configuration is run {run_id}; use another --data-dir or the matching config",
                data_dir.display(),
                loaded.meta.info.run_id,
            )));
        }
    }
    Ok((Arc::new(store), resume))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's data directory is its owner's alone, whether the node creates it or finds it
    /// open to others (the key file inside is 0600 already; the checkpoints were not).
    #[cfg(unix)]
    #[test]
    fn the_data_dir_is_readable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().expect("tmp");
        let config = Config::load(None).expect("default config");
        let fresh = root.path().join("fresh");
        let open = root.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        for dir in [fresh, open] {
            let opened = open_data_dir(&config, &dir).expect("open");
            let mode = std::fs::metadata(&dir).expect("meta").permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}: {mode:o}", dir.display());
            drop(opened);
        }
    }
}
