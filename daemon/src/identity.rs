//! The node's persistent ed25519 identity, kept in the data directory.
//!
//! A node keeps its peer id across restarts so that neighbours, logs and checkpoints can name
//! it; the key file is written once, atomically, readable only by its owner.

use std::fs;
use std::io::Write;
use std::path::Path;

use libp2p::identity::{Keypair, PeerId};

/// File name of the key inside the data directory.
pub const KEY_FILE: &str = "identity.key";

/// Loads the key from `data_dir`, creating one on first start.
pub fn load_or_create(data_dir: &Path) -> Result<Keypair, String> {
    let path = data_dir.join(KEY_FILE);
    match fs::read(&path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes).map_err(|e| {
            format!(
                "{}: not a valid identity key ({e}); move it away to start this data dir with a new identity",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            let bytes = key
                .to_protobuf_encoding()
                .map_err(|e| format!("cannot encode a new identity key: {e}"))?;
            let tmp = data_dir.join(format!(".{KEY_FILE}.tmp"));
            let write = || -> std::io::Result<()> {
                let mut opts = fs::OpenOptions::new();
                opts.write(true).create(true).truncate(true);
                #[cfg(unix)]
                std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
                let mut f = opts.open(&tmp)?;
                f.write_all(&bytes)?;
                f.sync_all()?;
                fs::rename(&tmp, &path)
            };
            write().map_err(|e| format!("{}: cannot write identity key: {e}", path.display()))?;
            Ok(key)
        }
        Err(e) => Err(format!("{}: cannot read identity key: {e}", path.display())),
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
