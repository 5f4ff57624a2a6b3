//! Tests' reading of which rooms a room names: every source file under a folder, test modules
//! and comments left out, checked for paths it must not name. The layering tests of the core,
//! the network and the trainer share it.

use std::path::{Path, PathBuf};

/// Asserts that no code line of a `.rs` file under `folder` (but not under a folder named in
/// `skip`, nor a `tests.rs`, nor after a file's inline `mod tests`) contains any of
/// `forbidden`; answers how many files it read.
pub(crate) fn assert_names_none(folder: &Path, skip: &[&str], forbidden: &[&str]) -> usize {
    let mut read = 0;
    let mut folders = vec![folder.to_path_buf()];
    let mut files: Vec<PathBuf> = Vec::new();
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).expect("a source folder") {
            let path = entry.expect("an entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() && !skip.contains(&name) {
                folders.push(path);
            } else if name.ends_with(".rs") && name != "tests.rs" {
                files.push(path);
            }
        }
    }
    for path in files {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(&path).expect("a source file");
        // Test modules written inline are left out; `mod tests;` declarations point at
        // `tests.rs` files, which are skipped above.
        let code = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or("");
        for (n, line) in code.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for word in forbidden {
                assert!(!line.contains(word), "{name}:{}: {word} in {line:?}", n + 1);
            }
        }
        read += 1;
    }
    read
}
