//! The checkpoint store: safetensors files in `<data dir>/checkpoints`, indexed in sled.
//!
//! The files are the truth; the sled index is a cache of their metadata for fast listing. sled
//! 0.34 has open reports of corruption after unclean stops, so when the index will not open (or
//! holds garbage) the store says so, moves it aside, and rebuilds it from the files instead of
//! refusing to start. Every file is verified by checksum before it is loaded, and a corrupt one
//! is renamed `*.corrupt`, reported once, and never loaded.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::checkpoint::{self, CheckpointError, CheckpointMeta, HostTensor, Snapshot};

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A filesystem operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// The index could not be opened even after being rebuilt.
    #[error("checkpoint index {}: {msg}", path.display())]
    Index {
        /// The index directory.
        path: PathBuf,
        /// sled's reason.
        msg: String,
    },
    /// No checkpoint has that id.
    #[error("no checkpoint with id {0}")]
    NotFound(u64),
    /// The file exists but cannot be trusted.
    #[error("checkpoint {id} ({file}) is corrupt: {source}")]
    Corrupt {
        /// Its id.
        id: u64,
        /// Its file name.
        file: String,
        /// What is wrong with it.
        source: CheckpointError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A checkpoint read back from disk and verified.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Its index entry.
    pub meta: CheckpointMeta,
    /// Parameters and optimizer buffers by name.
    pub tensors: BTreeMap<String, HostTensor>,
}

/// A checkpoint that was found corrupt and set aside, for reporting.
#[derive(Debug, Clone)]
pub struct Skipped {
    /// Its file name.
    pub file: String,
    /// Why it was skipped.
    pub reason: String,
}

/// Checkpoint files plus their sled index. Safe to share between threads.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    db: sled::Db,
    index: sled::Tree,
    /// Serialises writers so ids stay unique and pruning never races a save.
    write_lock: Mutex<()>,
}

const INDEX_DIR: &str = "index.sled";
const CHECKPOINT_DIR: &str = "checkpoints";

impl Store {
    /// Opens (creating if needed) the store under `data_dir`. The returned notes describe any
    /// repair it made: a rebuilt index, files set aside as corrupt.
    pub fn open(data_dir: &Path) -> Result<(Store, Vec<String>), StoreError> {
        let dir = data_dir.join(CHECKPOINT_DIR);
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let index_path = data_dir.join(INDEX_DIR);
        let mut notes = Vec::new();

        let db = match open_index(&index_path) {
            Ok(db) => db,
            Err(msg) => {
                let aside = data_dir.join(format!("{INDEX_DIR}.broken-{}", unix_now()));
                notes.push(format!(
                    "checkpoint index {} will not open ({msg}); moved it to {} and rebuilding it from the checkpoint files",
                    index_path.display(),
                    aside.display()
                ));
                fs::rename(&index_path, &aside).map_err(io(&index_path))?;
                open_index(&index_path).map_err(|msg| StoreError::Index {
                    path: index_path.clone(),
                    msg,
                })?
            }
        };
        let index = db.open_tree("checkpoints").map_err(|e| StoreError::Index {
            path: index_path.clone(),
            msg: e.to_string(),
        })?;
        let store = Store {
            dir,
            db,
            index,
            write_lock: Mutex::new(()),
        };
        store.reconcile(&mut notes)?;
        Ok((store, notes))
    }

    /// Makes the index agree with the files: drops entries without a file or with unreadable
    /// values, indexes files it does not know (verifying them), removes half-written temp files.
    fn reconcile(&self, notes: &mut Vec<String>) -> Result<(), StoreError> {
        let mut indexed = BTreeMap::new();
        let mut garbage = Vec::new();
        for item in self.index.iter() {
            match item {
                Ok((k, v)) => match serde_json::from_slice::<CheckpointMeta>(&v) {
                    Ok(meta) => {
                        indexed.insert(meta.id, meta);
                    }
                    Err(_) => garbage.push(k),
                },
                Err(e) => notes.push(format!(
                    "checkpoint index entry unreadable ({e}); rebuilding it"
                )),
            }
        }
        for k in garbage {
            let _ = self.index.remove(k);
        }
        let mut on_disk = BTreeMap::new();
        for entry in fs::read_dir(&self.dir).map_err(io(&self.dir))? {
            let entry = entry.map_err(io(&self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".tmp") {
                // A write that a crash interrupted before its rename: never a checkpoint.
                let _ = fs::remove_file(entry.path());
                continue;
            }
            if let Some(id) = checkpoint::id_from_file_name(&name) {
                on_disk.insert(id, name);
            }
        }
        for (id, meta) in &indexed {
            if !on_disk.contains_key(id) {
                notes.push(format!(
                    "checkpoint {id} ({}) is indexed but its file is gone; dropped from the index",
                    meta.file
                ));
                let _ = self.index.remove(id.to_be_bytes());
            }
        }
        for (id, file) in on_disk {
            if indexed.contains_key(&id) {
                continue;
            }
            match self.read_verified(id, &file) {
                Ok(loaded) => self.put_index(&loaded.meta)?,
                // What it holds is wrong: never tried again.
                Err(e @ StoreError::Corrupt { .. }) => notes.push(self.set_aside(id, &file, &e)),
                // It could not be read now (too many open files, a failing disk): it may be
                // good, so it stays where it is, unindexed, and the next open reads it again.
                Err(e) => notes.push(format!(
                    "{e}; left in place, not indexed until a later start reads it"
                )),
            }
        }
        self.db.flush().map_err(|e| StoreError::Index {
            path: self.dir.clone(),
            msg: e.to_string(),
        })?;
        Ok(())
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Full path of a checkpoint's file.
    pub fn path_of(&self, meta: &CheckpointMeta) -> PathBuf {
        self.dir.join(&meta.file)
    }

    /// All indexed checkpoints, oldest first.
    pub fn list(&self) -> Vec<CheckpointMeta> {
        self.index
            .iter()
            .values()
            .filter_map(|v| v.ok())
            .filter_map(|v| serde_json::from_slice(&v).ok())
            .collect()
    }

    /// The index entry of one checkpoint.
    pub fn get(&self, id: u64) -> Option<CheckpointMeta> {
        self.index
            .get(id.to_be_bytes())
            .ok()
            .flatten()
            .and_then(|v| serde_json::from_slice(&v).ok())
    }

    /// Writes a snapshot as a new checkpoint: temp file, fsync, rename, fsync of the directory,
    /// then the index; then prunes to the newest `keep`.
    pub fn save(&self, snapshot: &Snapshot, keep: usize) -> Result<CheckpointMeta, StoreError> {
        let _guard = self.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        let id = self
            .list()
            .last()
            .map_or(1, |m| m.id + 1)
            .max(self.max_file_id() + 1);
        let (bytes, meta) =
            checkpoint::encode(snapshot, id, unix_now()).map_err(|source| StoreError::Corrupt {
                id,
                file: checkpoint::file_name(id),
                source,
            })?;
        let path = self.path_of(&meta);
        crate::atomic_file::write(&path, &bytes, None, crate::atomic_file::Durability::Flushed)
            .map_err(io(&path))?;
        self.put_index(&meta)?;
        let all = self.list();
        if all.len() > keep {
            for old in &all[..all.len() - keep] {
                let _ = self.index.remove(old.id.to_be_bytes());
                let _ = fs::remove_file(self.path_of(old));
            }
        }
        let _ = self.db.flush();
        Ok(meta)
    }

    /// Reads and verifies one checkpoint.
    pub fn load(&self, id: u64) -> Result<Loaded, StoreError> {
        let meta = self.get(id).ok_or(StoreError::NotFound(id))?;
        self.read_verified(id, &meta.file)
    }

    /// The newest checkpoint that verifies, with a note for every newer one that did not (a
    /// corrupt one, or one whose file is gone: set aside and dropped from the index so it is
    /// never tried again). A file that cannot be read for another reason (too many open
    /// files, a failing disk) may be good: that is an error, the file is left as it is, and
    /// nothing older is loaded in its place.
    pub fn load_newest_valid(&self) -> Result<(Option<Loaded>, Vec<Skipped>), StoreError> {
        let mut skipped = Vec::new();
        for meta in self.list().into_iter().rev() {
            match self.read_verified(meta.id, &meta.file) {
                Ok(loaded) => return Ok((Some(loaded), skipped)),
                Err(StoreError::Io { path, source })
                    if source.kind() != std::io::ErrorKind::NotFound =>
                {
                    return Err(StoreError::Io { path, source });
                }
                Err(e) => {
                    let reason = self.set_aside(meta.id, &meta.file, &e);
                    skipped.push(Skipped {
                        file: meta.file.clone(),
                        reason,
                    });
                }
            }
        }
        Ok((None, skipped))
    }

    fn read_verified(&self, id: u64, file: &str) -> Result<Loaded, StoreError> {
        let path = self.dir.join(file);
        let bytes = fs::read(&path).map_err(io(&path))?;
        let (meta, tensors) =
            checkpoint::decode(&bytes, file).map_err(|source| StoreError::Corrupt {
                id,
                file: file.to_string(),
                source,
            })?;
        if meta.id != id {
            return Err(StoreError::Corrupt {
                id,
                file: file.to_string(),
                source: CheckpointError::Metadata(format!("file holds checkpoint {}", meta.id)),
            });
        }
        Ok(Loaded { meta, tensors })
    }

    /// Renames a bad file out of the way and drops it from the index; returns the report line.
    fn set_aside(&self, id: u64, file: &str, err: &StoreError) -> String {
        let from = self.dir.join(file);
        let to = self.dir.join(format!("{file}.corrupt"));
        let _ = self.index.remove(id.to_be_bytes());
        let _ = self.db.flush();
        match fs::rename(&from, &to) {
            Ok(()) => format!("{err}; skipped it and moved it to {}", to.display()),
            Err(e) => format!("{err}; skipped it (could not move it aside: {e})"),
        }
    }

    fn put_index(&self, meta: &CheckpointMeta) -> Result<(), StoreError> {
        let value = serde_json::to_vec(meta).unwrap_or_default();
        self.index
            .insert(meta.id.to_be_bytes(), value)
            .map_err(|e| StoreError::Index {
                path: self.dir.clone(),
                msg: e.to_string(),
            })?;
        Ok(())
    }

    /// Highest id among files on disk, corrupt ones included, so a new id never reuses a name.
    fn max_file_id(&self) -> u64 {
        fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                checkpoint::id_from_file_name(name.trim_end_matches(".corrupt"))
            })
            .max()
            .unwrap_or(0)
    }
}

/// Opens sled, turning both errors and panics into a message: a damaged index must never take
/// the daemon down.
fn open_index(path: &Path) -> Result<sled::Db, String> {
    let path = path.to_owned();
    match std::panic::catch_unwind(move || sled::Config::new().path(path).open()) {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("sled panicked while opening it".into()),
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::StateInfo;

    fn snapshot(step: u64) -> Snapshot {
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "w".into(),
            HostTensor {
                shape: vec![3],
                values: vec![step as f32, 1.0, 2.0],
            },
        );
        Snapshot {
            info: StateInfo {
                run_id: "run".into(),
                config_hash: "cfg".into(),
                layout_hash: "lay".into(),
                model: "m".into(),
                optimizer: "sgd".into(),
                step,
                samples_seen: step * 32,
                optimizer_steps: step,
            },
            tensors,
        }
    }

    #[test]
    fn save_list_prune_and_load() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (store, notes) = Store::open(tmp.path()).expect("open");
        assert!(notes.is_empty());
        for step in 1..=4 {
            store.save(&snapshot(step * 10), 3).expect("save");
        }
        let ids: Vec<u64> = store.list().iter().map(|m| m.id).collect();
        assert_eq!(ids, [2, 3, 4]);
        assert!(!store.dir().join(checkpoint::file_name(1)).exists());
        let (newest, skipped) = store.load_newest_valid().expect("load");
        assert!(skipped.is_empty());
        assert_eq!(newest.expect("newest").meta.info.step, 40);
    }

    #[test]
    fn truncated_newest_is_skipped_for_the_previous() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (store, _) = Store::open(tmp.path()).expect("open");
        store.save(&snapshot(10), 5).expect("save");
        let newest = store.save(&snapshot(20), 5).expect("save");
        let path = store.path_of(&newest);
        let len = fs::metadata(&path).expect("meta").len();
        fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(len - 5))
            .expect("truncate");
        let (loaded, skipped) = store.load_newest_valid().expect("load");
        assert_eq!(loaded.expect("previous").meta.info.step, 10);
        assert_eq!(skipped.len(), 1);
        assert!(
            skipped[0].reason.contains("corrupt"),
            "{}",
            skipped[0].reason
        );
        // The bad file is out of the way and a new save does not reuse its name.
        let next = store.save(&snapshot(30), 5).expect("save");
        assert_eq!(next.id, 3);
    }

    #[test]
    fn a_checkpoint_that_cannot_be_read_is_an_error_and_left_in_place() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (store, _) = Store::open(tmp.path()).expect("open");
        store.save(&snapshot(10), 5).expect("save");
        let newest = store.save(&snapshot(20), 5).expect("save");
        // A read that fails for another reason than what the file holds: a directory where
        // the file was (which even root cannot read as a file).
        let path = store.path_of(&newest);
        fs::remove_file(&path).expect("remove");
        fs::create_dir(&path).expect("a directory in its place");
        let err = store
            .load_newest_valid()
            .expect_err("an unreadable newest checkpoint");
        assert!(matches!(err, StoreError::Io { .. }), "{err}");
        assert!(path.is_dir(), "left where it was");
        assert_eq!(store.list().len(), 2, "still in the index");
        // A file that is gone is not worth keeping in the index.
        fs::remove_dir(&path).expect("remove the directory");
        let (loaded, skipped) = store.load_newest_valid().expect("load");
        assert_eq!(loaded.expect("previous").meta.info.step, 10);
        assert_eq!(skipped.len(), 1);
        assert_eq!(store.list().len(), 1);
    }

    /// A checkpoint the index does not name (an index rebuilt after a crash) that cannot be
    /// read for another reason than what it holds (too many open files, a failing disk; here
    /// a directory in its place) is left where it is and indexed at a later open, not set
    /// aside as corrupt: a transient error loses no good checkpoint.
    #[test]
    fn an_unindexed_checkpoint_that_cannot_be_read_now_is_left_for_a_later_open() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (path, bytes) = {
            let (store, _) = Store::open(tmp.path()).expect("open");
            store.save(&snapshot(10), 5).expect("save");
            let newest = store.save(&snapshot(20), 5).expect("save");
            let path = store.path_of(&newest);
            (path.clone(), fs::read(&path).expect("read"))
        };
        fs::remove_dir_all(tmp.path().join(INDEX_DIR)).expect("drop the index");
        fs::remove_file(&path).expect("remove");
        fs::create_dir(&path).expect("a directory in its place");
        {
            let (store, notes) = Store::open(tmp.path()).expect("reopen");
            assert!(path.is_dir(), "left where it was: {notes:?}");
            let aside = path.with_file_name(format!(
                "{}.corrupt",
                path.file_name().expect("name").to_string_lossy()
            ));
            assert!(!aside.exists(), "set aside as corrupt: {notes:?}");
            assert!(
                notes.iter().any(|n| n.contains("left in place")),
                "{notes:?}"
            );
            let steps: Vec<u64> = store.list().iter().map(|m| m.info.step).collect();
            assert_eq!(steps, [10]);
        }
        // Readable again: the next open indexes it.
        fs::remove_dir(&path).expect("remove the directory");
        fs::write(&path, bytes).expect("the file back");
        let (store, _) = Store::open(tmp.path()).expect("reopen");
        let steps: Vec<u64> = store.list().iter().map(|m| m.info.step).collect();
        assert_eq!(steps, [10, 20]);
    }

    #[test]
    fn broken_index_is_moved_aside_and_rebuilt_from_files() {
        let tmp = tempfile::tempdir().expect("tmp");
        {
            let (store, _) = Store::open(tmp.path()).expect("open");
            store.save(&snapshot(10), 5).expect("save");
            store.save(&snapshot(20), 5).expect("save");
        }
        // Replace the index with garbage that sled cannot open.
        let index = tmp.path().join(INDEX_DIR);
        fs::remove_dir_all(&index).expect("rm");
        fs::create_dir_all(&index).expect("mkdir");
        fs::write(index.join("conf"), b"\x00garbage\xff").expect("write");
        fs::write(index.join("db"), b"not a sled database at all").expect("write");
        let (store, notes) = Store::open(tmp.path()).expect("reopen");
        assert!(notes.iter().any(|n| n.contains("rebuilding")), "{notes:?}");
        let steps: Vec<u64> = store.list().iter().map(|m| m.info.step).collect();
        assert_eq!(steps, [10, 20]);
    }
}
