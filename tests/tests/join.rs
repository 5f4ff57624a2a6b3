//! Joins that survive a crash: a joiner killed in the middle of its state download and started
//! again on the same data directory fetches only the chunks it lacks.

use std::time::Duration;

use crate::harness::{eventually, Node};
use crate::mesh::{config, listen_addr, peers, start, step};

/// Chunk files a joiner has kept under its data directory, over all states.
fn kept_chunks(node: &Node) -> usize {
    let dir = node.data_dir.join("download");
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|state| std::fs::read_dir(state.path()).ok())
        .flatten()
        .flatten()
        .filter(|f| f.path().extension().is_some_and(|e| e == "chunk"))
        .count()
}

#[test]
fn a_joiner_killed_mid_download_resumes_with_the_chunks_it_kept() {
    let tmp = tempfile::tempdir().expect("tmp");
    // A state of about 1.2 MB (5 chunks) served one chunk per second per request, so the
    // download lasts seconds and the kill lands in its middle.
    let cfg = config(
        tmp.path(),
        "wide.toml",
        &[("widths = [64, 128, 10]", "widths = [64, 2048, 10]")],
        "serve_chunk_delay_ms = 1000\n",
    );
    let donor = start(tmp.path(), "donor", &cfg, None, &[]);
    let addr = listen_addr(&donor);
    donor.wait_status("the donor training", Duration::from_secs(60), |s| {
        step(s) > 50
    });
    let mut joiner = start(tmp.path(), "joiner", &cfg, Some(&addr), &[]);
    let kept = eventually(Duration::from_secs(60), "a chunk kept on disk", || {
        let n = kept_chunks(&joiner);
        (n > 0).then_some(n)
    });
    joiner.kill9();
    assert!(kept < 5, "the whole state was already down: {kept} chunks");
    let again = start(tmp.path(), "joiner", &cfg, Some(&addr), &[]);
    let s = again.wait_status("the download completed", Duration::from_secs(120), |s| {
        s["state_download"].is_object() && s["phase"] == "training"
    });
    let dl = &s["state_download"];
    eprintln!("kept {kept} chunks before the kill; after the restart: {dl}");
    let reused = dl["reused_chunks"].as_u64().unwrap_or(0);
    assert!(reused > 0, "nothing reused: {dl}");
    assert!(
        reused < dl["chunks"].as_u64().unwrap_or(0),
        "the rest was fetched: {dl}"
    );
    assert_eq!(
        kept_chunks(&again),
        0,
        "the finished download's chunks are removed"
    );
    again.wait_status("training on with its donor", Duration::from_secs(60), |t| {
        peers(t) == 1 && step(t) > dl["step"].as_u64().unwrap_or(0)
    });
}
