//! Writing a file so that a reader, or a node restarted after a crash, finds either the old
//! contents or all of the new: the one helper for the identity key, checkpoints, a joiner's
//! downloaded chunks and `checkpoint export`. The bytes go to `.NAME.tmp` beside the target
//! (one fixed name, so a crash leaves at most one, overwritten by the next write), which is
//! renamed over the target. A [`Durability::Flushed`] write also flushes the file and then the
//! folder to disk, so neither the contents nor the rename is lost to a power cut.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;

/// Whether a write must survive a power cut, or only a crash of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Flushed to disk before and after the rename: checkpoints and the identity key.
    Flushed,
    /// Left to the page cache: a joiner's chunks, which are verified by hash when read back
    /// (thousands of them per state, where a flush each would cost seconds on a slow disk).
    Cached,
}

/// Writes `bytes` to `path` atomically. On Unix a new file gets permissions `mode` when one is
/// given (the identity key is 0600), else the usual `0666` less the umask. Errors name nothing:
/// callers add the path.
pub fn write(
    path: &Path,
    bytes: &[u8],
    mode: Option<u32>,
    durability: Durability,
) -> std::io::Result<()> {
    let dir = folder_of(path);
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let mut opts = OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if let Some(mode) = mode {
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = opts.open(&tmp)?;
    f.write_all(bytes)?;
    if durability == Durability::Flushed {
        f.sync_all()?;
    }
    drop(f);
    fs::rename(&tmp, path)?;
    if durability == Durability::Flushed {
        flush_folder_of(path)?;
    }
    Ok(())
}

/// The folder `path` lies in (`.` for a bare name).
fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Flushes the folder `path` lies in to disk, so that a name just given to it (a rename into
/// place) survives a power cut: what [`write`] does after its rename, for callers that
/// rename something of their own (an export's folder, a token file). A no-op off Unix, where a
/// folder cannot be opened to flush.
pub fn flush_folder_of(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    fs::File::open(folder_of(path))?.sync_all()?;
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_file_replaces_the_old_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        write(&path, b"old", None, Durability::Cached).expect("write");
        write(&path, b"new contents", None, Durability::Flushed).expect("write");
        assert_eq!(fs::read(&path).expect("read"), b"new contents");
        let names: Vec<_> = fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f")]);
    }

    #[cfg(unix)]
    #[test]
    fn a_given_mode_is_kept_and_none_leaves_the_file_readable_by_others() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let mode_of = |p: &Path| fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        let key = dir.path().join("key");
        write(&key, b"secret", Some(0o600), Durability::Flushed).expect("write");
        assert_eq!(mode_of(&key), 0o600);
        let plain = dir.path().join("plain");
        write(&plain, b"x", None, Durability::Flushed).expect("write");
        assert_eq!(
            mode_of(&plain) & 0o044,
            0o044 & !umask(dir.path()),
            "{:o}",
            mode_of(&plain)
        );
    }

    /// The process's umask, as a file created the ordinary way shows it.
    #[cfg(unix)]
    fn umask(dir: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        let probe = dir.join("probe");
        fs::write(&probe, b"").expect("probe");
        0o666 & !(fs::metadata(&probe).expect("meta").permissions().mode() & 0o777)
    }

    #[test]
    fn a_missing_folder_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(write(
            &dir.path().join("no/such/f"),
            b"x",
            None,
            Durability::Flushed
        )
        .is_err());
    }
}
