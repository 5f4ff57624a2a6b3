//! Joins checked as strictly as gossip: a joiner refuses hostile donors (an oversized manifest,
//! chunks of the wrong length, chunks that fail their hash) with bounded memory and joins from
//! an honest one; and a joiner killed in the middle of its state download and started again on
//! the same data directory fetches only the chunks it lacks; and a state three peers hold is
//! fetched from several of them at once; a donor that drips its chunks holds a joiner no
//! longer than its join deadline.

use std::time::Duration;

use crate::harness::{eventually, Node};
use crate::mesh::{config, listen_addr, peers, start, step};
use crate::rogue::{DonorAnswer, Rogue};

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

/// A founder of a digits run whose state is about 1.2 MB (five chunks), with `debug` settings
/// added, and its address once it trains.
fn wide_donor(dir: &std::path::Path, debug: &str) -> (std::path::PathBuf, Node, String) {
    let cfg = config(
        dir,
        "wide.toml",
        &[("widths = [64, 128, 10]", "widths = [64, 2048, 10]")],
        debug,
    );
    let donor = start(dir, "donor", &cfg, None, &[]);
    let addr = listen_addr(&donor);
    donor.wait_status("the donor training", Duration::from_secs(60), |s| {
        step(s) > 50
    });
    (cfg, donor, addr)
}

#[test]
fn a_joiner_killed_mid_download_resumes_with_the_chunks_it_kept() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Served one chunk per second per request, so the download lasts seconds and the kill
    // lands in its middle.
    let (cfg, _donor, addr) = wide_donor(tmp.path(), "serve_chunk_delay_ms = 1000\n");
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

/// A donor that answers each chunk after a minute (past the 30 s request timeout, so every
/// request fails and is tried again) would hold a joiner for ever; with
/// `network.join_deadline_secs = 3` the joiner gives up on the state and trains from the
/// run's initial weights, on the mesh with its donor. Without the deadline it is still
/// downloading after 30 s (the first chunk requests have not even failed yet).
#[test]
fn a_donor_that_drips_its_chunks_holds_a_joiner_no_longer_than_its_join_deadline() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (_, donor, addr) = wide_donor(tmp.path(), "serve_chunk_delay_ms = 60000\n");
    let joiner_cfg = config(
        tmp.path(),
        "joiner.toml",
        &[("widths = [64, 128, 10]", "widths = [64, 2048, 10]")],
        "\n[network]\njoin_deadline_secs = 3\n",
    );
    let joiner = start(tmp.path(), "joiner", &joiner_cfg, Some(&addr), &[]);
    let s = joiner.wait_status(
        "the joiner training without the state",
        Duration::from_secs(30),
        |s| s["phase"] == "training" && step(s) > 0,
    );
    assert!(s["state_download"].is_null(), "a state came: {s}");
    let log = joiner.log_text();
    assert!(
        log.contains("join deadline"),
        "no deadline in the log: {log}"
    );
    // Still in the mesh: the donor is its peer, and it is not banned for being slow.
    joiner.wait_status("its donor a peer", Duration::from_secs(30), |s| {
        peers(s) == 1
    });
    let d = donor.status().expect("donor status");
    assert!(
        d["banned_peers"].as_array().is_none_or(Vec::is_empty),
        "{d}"
    );
}

/// Five liars and one honest donor. Every liar claims the highest step (a billion), so a
/// joiner, which orders donors by the median of the claims it hears, tries them first: a
/// 1 GiB manifest, chunks of the wrong length, chunks that fail their hash, a state that
/// verifies but counts 2^48 optimizer steps, and chunks dripped just under the joiner's
/// request timeout (then failing their hash). The joiner refuses each in its own way and
/// joins from the honest donor, and holds an offence against the donor whose whole state it
/// refused.
#[test]
fn a_joiner_refuses_hostile_donors_and_joins_from_an_honest_one() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(tmp.path(), "c.toml", &[], "");
    let honest = start(tmp.path(), "honest", &cfg, None, &[]);
    let addr = listen_addr(&honest);
    let rogues: Vec<Rogue> = [
        DonorAnswer::Oversized,
        DonorAnswer::WrongLength,
        DonorAnswer::BadHash,
        DonorAnswer::MaxCounters,
        DonorAnswer::Drip,
    ]
    .into_iter()
    .map(|d| Rogue::join_donor(&cfg, &addr, d))
    .collect();
    honest.wait_status("the rogues connected", Duration::from_secs(60), |s| {
        peers(s) == 5
    });
    // A request timeout a second past the drip's delay: each dripped chunk comes in time.
    let joiner_cfg = config(
        tmp.path(),
        "joiner.toml",
        &[],
        &format!(
            "\n[network]\nrequest_timeout_secs = {}\n",
            crate::rogue::DRIP_DELAY.as_secs_f64() + 1.0
        ),
    );
    let joiner = start(tmp.path(), "joiner", &joiner_cfg, Some(&addr), &[]);
    let s = joiner.wait_status("the joiner training", Duration::from_secs(120), |s| {
        s["state_download"].is_object() && s["phase"] == "training"
    });
    let dl = &s["state_download"];
    let honest_id = honest.status().expect("status")["peer_id"].clone();
    let rss_kib = joiner.rss_kib().unwrap_or(0);
    eprintln!("download: {dl}; joiner RSS {rss_kib} KiB");
    assert_eq!(dl["donor"], honest_id, "joined from a rogue: {dl}");
    assert_eq!(dl["refused_manifests"].as_u64(), Some(1), "{dl}");
    // Both plausible hostile states were tried first (they claim the highest step) and
    // abandoned when their only source failed.
    assert!(dl["restarts"].as_u64().unwrap_or(0) >= 2, "{dl}");
    assert!(dl["failed_sources"].as_u64().unwrap_or(0) >= 2, "{dl}");
    // The drip was waited for (its chunks came within the request timeout), then refused.
    assert!(
        dl["secs"].as_f64().unwrap_or(0.0) >= crate::rogue::DRIP_DELAY.as_secs_f64(),
        "{dl}"
    );
    let log = joiner.log_text();
    for why in [
        "largest checkpoint",
        "chunk of 1000 bytes",
        "chunk failed verification",
        "past what any run reaches",
    ] {
        assert!(log.contains(why), "no \"{why}\" in the log: {log}");
    }
    // The 1 GiB claim was never allocated: the whole process stays far below it (a digits
    // node runs in well under 1 GiB).
    assert!(rss_kib < 1024 * 1024, "joiner RSS {rss_kib} KiB");
    let ids: Vec<String> = rogues.iter().map(|r| r.id.to_string()).collect();
    let after = joiner.wait_status("training on", Duration::from_secs(30), |t| {
        step(t) > dl["step"].as_u64().unwrap_or(0) + 100
    });
    assert!(
        after["loss"].as_f64().is_some_and(f64::is_finite),
        "{after}"
    );
    eprintln!("rogues: {ids:?}");
    // The donor whose whole state verified but was refused (its counters) is reported: an
    // offence the joiner holds against it, naming why, as a ban would. The honest donor has
    // none.
    let offences = |id: &str| {
        after["peers"]["list"]
            .as_array()
            .and_then(|l| l.iter().find(|p| p["peer_id"] == id))
            .map(|p| {
                (
                    p["offences"].as_u64().unwrap_or(0),
                    p["last_offence"].as_str().unwrap_or("").to_string(),
                )
            })
    };
    let (count, why) = offences(&ids[3]).expect("the counters' rogue is still a peer");
    assert!(
        count >= 1 && why.contains("served a state a joiner refused"),
        "no offence of the rogue whose state was refused: {count}, {why:?}"
    );
    let honest_id = honest_id.as_str().expect("peer id");
    assert_eq!(offences(honest_id).map(|o| o.0), Some(0), "{after}");
}

#[test]
fn a_state_three_peers_hold_is_fetched_from_several_of_them() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Five chunks to spread over the holders. A donor reuses a freeze only while it has not
    // trained 10% of its steps past it (a joiner would pass over an older state), so the
    // donor first trains fast to thousands of steps, then goes on at 20 ms a step: the
    // window is then hundreds of steps, seconds long, and every joiner below arrives within
    // it. (Before, a freeze was reused for 15 s whatever the steps, and the digits model's
    // joiners took states 1500 steps behind their neighbours.)
    let (fast, mut donor, _) = wide_donor(tmp.path(), "");
    donor.wait_status("the donor past 2500 steps", Duration::from_secs(120), |s| {
        step(s) > 2500
    });
    let (st, _, err) = donor.cli(&["stop"], Duration::from_secs(30));
    assert!(st.success(), "stop: {err}");
    assert!(donor.wait_exit(Duration::from_secs(30)).success());
    let slow = tmp.path().join("slow.toml");
    let text = std::fs::read_to_string(&fast).expect("config");
    assert!(text.contains("step_delay_ms = 1\n"), "{text}");
    std::fs::write(
        &slow,
        text.replace("step_delay_ms = 1\n", "step_delay_ms = 20\n"),
    )
    .expect("write config");
    let donor = start(tmp.path(), "donor", &slow, None, &[]);
    let addr = listen_addr(&donor);
    let resumed = step(&donor.status().expect("status"));
    assert!(resumed > 2500, "the donor resumed at step {resumed}");

    // A joiner that has just restored a state offers that state, not a fresh freeze of its
    // own: the second and third joiners get the first one's state from both holders. (CI
    // once saw two joiners on steps 237 and 284, when a joiner's request reached the first
    // one half a second after its restore.)
    let first = start(tmp.path(), "b", &slow, Some(&addr), &[]);
    let downloaded = download_step(&first, "the first joiner's download");
    let second = start(tmp.path(), "c", &slow, Some(&addr), &[]);
    let third = start(tmp.path(), "d", &slow, Some(&addr), &[]);
    for (node, name) in [(&second, "second"), (&third, "third")] {
        let s = node.wait_status(
            &format!("the {name} joiner's download"),
            Duration::from_secs(120),
            |s| s["state_download"].is_object(),
        );
        let dl = &s["state_download"];
        eprintln!("{name} joiner: {dl}");
        assert_eq!(
            dl["step"].as_u64(),
            Some(downloaded),
            "the {name} joiner took another state: {dl}"
        );
        let sources = dl["sources"].as_array().map_or(0, Vec::len);
        assert!(sources >= 2, "fetched from {sources} source(s): {dl}");
    }
    // For the log: how far the donor went meanwhile (the window is 10% of its steps).
    let now = step(&donor.status().expect("status"));
    eprintln!("state at step {downloaded}, the donor now at {now}");
}

/// The step of the state `node` downloaded when it joined, once it has.
fn download_step(node: &Node, what: &str) -> u64 {
    let s = node.wait_status(what, Duration::from_secs(120), |s| {
        s["state_download"].is_object()
    });
    s["state_download"]["step"]
        .as_u64()
        .unwrap_or_else(|| panic!("no step in the download report: {s}"))
}
