//! Writing a file so that a reader, or a node restarted after a crash, finds either the old
//! contents or all of the new: the one helper for the identity key, checkpoints, a joiner's
//! downloaded chunks and the CLI's outputs. A temporary file in the same folder, written and
//! flushed to disk, renamed over the target with `tempfile`'s `persist`, then the folder
//! flushed so the rename itself survives a power cut.

use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically; on Unix the file gets permissions `mode` when one is
/// given (the identity key is 0600). Any error names nothing: callers add the path.
pub fn write(path: &Path, bytes: &[u8], mode: Option<u32>) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".p2ptrain-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    #[cfg(unix)]
    if let Some(mode) = mode {
        use std::os::unix::fs::PermissionsExt;
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(mode))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    #[cfg(unix)]
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_file_replaces_the_old_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        write(&path, b"old", None).expect("write");
        write(&path, b"new contents", Some(0o600)).expect("write");
        assert_eq!(std::fs::read(&path).expect("read"), b"new contents");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f")]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn a_missing_folder_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(write(&dir.path().join("no/such/f"), b"x", None).is_err());
    }
}
