//! The node's persistent ed25519 identity, kept in the data directory. It owns the key file,
//! not the peer ids of others (those are parsed with the config).
//!
//! A node keeps its peer id across restarts so that neighbours, logs and checkpoints can name
//! it; the key file is written once, atomically, readable only by its owner.

use std::fs;
use std::path::{Path, PathBuf};

use libp2p::identity::{DecodingError, Keypair, PeerId};

use crate::atomic_file::Durability;

/// File name of the key inside the data directory.
pub const KEY_FILE: &str = "identity.key";

/// Why the identity could not be loaded or created; each names the key file.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The file is not a key this daemon wrote.
    #[error("{}: not a valid identity key ({source}); move it away to start this data dir with a new identity", path.display())]
    Invalid {
        /// The key file.
        path: PathBuf,
        /// libp2p's reason.
        source: DecodingError,
    },
    /// A fresh key could not be encoded.
    #[error("cannot encode a new identity key: {0}")]
    Encode(DecodingError),
    /// The key file could not be read.
    #[error("{}: cannot read identity key: {source}", path.display())]
    Read {
        /// The key file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A fresh key could not be written.
    #[error("{}: cannot write identity key: {source}", path.display())]
    Write {
        /// The key file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Loads the key from `data_dir`, creating one on first start.
pub fn load_or_create(data_dir: &Path) -> Result<Keypair, IdentityError> {
    let path = data_dir.join(KEY_FILE);
    match fs::read(&path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes)
            .map_err(|source| IdentityError::Invalid { path, source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            let bytes = key.to_protobuf_encoding().map_err(IdentityError::Encode)?;
            match crate::atomic_file::write(&path, &bytes, Some(0o600), Durability::Flushed) {
                Ok(()) => Ok(key),
                Err(source) => Err(IdentityError::Write { path, source }),
            }
        }
        Err(source) => Err(IdentityError::Read { path, source }),
    }
}

/// The peer id of a key.
pub fn peer_id(key: &Keypair) -> PeerId {
    key.public().to_peer_id()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_persists_and_garbage_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let a = peer_id(&load_or_create(dir.path()).expect("create"));
        let b = peer_id(&load_or_create(dir.path()).expect("load"));
        assert_eq!(a, b);
        fs::write(dir.path().join(KEY_FILE), b"junk").expect("write");
        assert!(load_or_create(dir.path()).is_err());
    }
}
