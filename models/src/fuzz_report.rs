//! Where the fuzz targets (the update codecs' here, the wire formats' in the daemon) say how
//! many inputs they ran: `.ci/run` prints the file after the tests, whose output is hidden
//! where they pass, so a target that ran no input shows.

use std::io::Write;

/// Appends `line` (a fuzz target's count of inputs) to the file `P2PTRAIN_FUZZ_REPORT` names,
/// where set; nothing otherwise, and a file that cannot be written is left alone (a count is
/// a report, not a test).
pub fn append(line: &str) {
    let Some(path) = std::env::var_os("P2PTRAIN_FUZZ_REPORT") else {
        return;
    };
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write per line, so that targets running at once do not interleave.
        let _ = file.write_all(format!("{line}\n").as_bytes());
    }
}
