//! Seeing the mesh: `/metrics` read by a real Prometheus parser, the timeline as a trace
//! viewer reads it, the live page in a real headless browser, and the demo's alone-against-mesh
//! summary.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::harness::{
    child_with_arg, cli_with, eventually, recent_median_accuracy, skip_or_fail, Node, Throttle,
};
use crate::mesh::{config, listen_addr, peers, start};

/// Parses an OpenMetrics exposition with the Python Prometheus client's parser; returns
/// `{family: {"type": .., "samples": [[name, labels, value], ..]}}`, or why it could not.
pub(crate) fn parse_metrics(text: &str) -> Result<BTreeMap<String, Value>, String> {
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    out[fam.name] = {"type": fam.type, "samples": [[s.name, s.labels, s.value] for s in fam.samples]}
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("python3: {e}"))?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().ok_or("no stdin")?;
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| e.to_string())?;
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

/// Whether the Python Prometheus client is installed (`.ci/run` installs it).
pub(crate) fn have_parser() -> bool {
    Command::new("python3")
        .args(["-c", "import prometheus_client.openmetrics.parser"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The value of the first sample of `family` whose labels include `labels`.
pub(crate) fn sample(
    metrics: &BTreeMap<String, Value>,
    family: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    metrics.get(family)?["samples"]
        .as_array()?
        .iter()
        .find(|s| labels.iter().all(|(k, v)| s[1][*k].as_str() == Some(*v)))
        .and_then(|s| s[2].as_f64())
}

/// The value of the sample named `name` (a counter's `_total`, a histogram's `_count`) in
/// `family`.
pub(crate) fn named_sample(
    metrics: &BTreeMap<String, Value>,
    family: &str,
    name: &str,
) -> Option<f64> {
    metrics.get(family)?["samples"]
        .as_array()?
        .iter()
        .find(|s| s[0].as_str() == Some(name))
        .and_then(|s| s[2].as_f64())
}

/// Two nodes, one writing a timeline with a small bound: `/metrics` parses with a real parser
/// and its key series move with the mesh; the timeline is valid trace JSON with the spans of
/// training, updates and checkpoints, and stays within its bound.
#[test]
fn metrics_parse_and_move_and_the_timeline_stays_valid_and_bounded() {
    if !have_parser() {
        skip_or_fail(
            "metrics_parse_and_move",
            "the Python Prometheus client is not installed (pip install prometheus-client)",
        );
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let began_unix_us = unix_us();
    let cfg = config(
        tmp.path(),
        "observe.toml",
        &[
            ("every_steps = 0", "every_steps = 300"),
            ("eval_every = 500", "eval_every = 200"),
        ],
        "\n[sync]\nfull_sync_every = 100\ncodec = \"onebit\"\n",
    );
    // The joiner writes the timeline: it downloads the state, then trains.
    let timeline = tmp.path().join("b-timeline.json");
    let a = start(tmp.path(), "a", &cfg, None, &[]);
    let addr = listen_addr(&a);
    let mut b = start(
        tmp.path(),
        "b",
        &cfg,
        Some(&addr),
        &[
            "--timeline",
            timeline.to_str().expect("utf8"),
            "--timeline-max-mib",
            "1",
        ],
    );
    a.wait_status(
        "a peer, applied updates and a full sync",
        Duration::from_secs(60),
        |s| {
            peers(s) == 1
                && s["updates"]["applied"].as_u64() > Some(0)
                && s["full_syncs"]["accepted"].as_u64() > Some(0)
        },
    );

    let scrape = |n: &Node| -> BTreeMap<String, Value> {
        let text = n.http_get("/metrics").expect("GET /metrics");
        parse_metrics(&text).unwrap_or_else(|e| panic!("{e}\n--- exposition ---\n{text}"))
    };
    let first = scrape(&a);
    std::thread::sleep(Duration::from_secs(3));
    let second = scrape(&a);
    let b_id = b.status_http().expect("b status")["peer_id"]
        .as_str()
        .expect("id")
        .to_string();
    for (family, labels) in [
        ("p2ptrain_training_steps", vec![]),
        ("p2ptrain_training_samples", vec![]),
        ("p2ptrain_updates_sent", vec![]),
        ("p2ptrain_updates_received", vec![]),
        ("p2ptrain_network_sent_bytes", vec![]),
        (
            "p2ptrain_sent_bytes",
            vec![("kind", "updates"), ("codec", "onebit")],
        ),
        ("p2ptrain_peer_sent_bytes", vec![("peer", b_id.as_str())]),
    ] {
        let (x, y) = (
            sample(&first, family, &labels),
            sample(&second, family, &labels),
        );
        assert!(
            matches!((x, y), (Some(x), Some(y)) if y > x),
            "{family}{labels:?} must be present and rising: {x:?} then {y:?}"
        );
        assert_eq!(first[family]["type"], "counter", "{family}");
    }
    for (family, labels) in [
        ("p2ptrain_peers", vec![]),
        ("p2ptrain_neighbours", vec![]),
        ("p2ptrain_consensus_distance_ratio", vec![]),
        ("p2ptrain_full_syncs", vec![("outcome", "accepted")]),
        ("p2ptrain_full_sync_duration_seconds", vec![]),
        ("p2ptrain_updates_rejected", vec![("reason", "invalid")]),
        ("p2ptrain_eval_accuracy_ratio", vec![]),
        ("p2ptrain_node", vec![("codec", "onebit")]),
        ("p2ptrain_peer_rtt_seconds", vec![("peer", b_id.as_str())]),
        ("p2ptrain_training_learning_rate", vec![]),
        ("p2ptrain_training_gradient_norm", vec![]),
        ("p2ptrain_training_staleness_held", vec![]),
    ] {
        assert!(
            sample(&second, family, &labels).is_some(),
            "{family}{labels:?} missing"
        );
    }
    assert_eq!(sample(&second, "p2ptrain_peers", &[]), Some(1.0));
    assert_eq!(
        sample(
            &second,
            "p2ptrain_updates_rejected",
            &[("reason", "invalid")]
        ),
        Some(0.0),
        "an honest pair rejects nothing"
    );
    // libp2p's and gossipsub's own series are there too.
    for prefix in ["libp2p_swarm_", "libp2p_identify_", "gossipsub_"] {
        assert!(
            second.keys().any(|k| k.starts_with(prefix)),
            "no {prefix}* family in {:?}",
            second.keys().collect::<Vec<_>>()
        );
    }

    // The timeline: once it has been rotated (a node at full speed fills 1 MiB in seconds),
    // stop gracefully, then read both files as a trace viewer would.
    let rotated = p2ptrain_daemon::timeline::rotated_path(&timeline);
    eventually(
        Duration::from_secs(120),
        "the timeline to reach its 1 MiB bound and rotate",
        || rotated.exists().then_some(()),
    );
    std::thread::sleep(Duration::from_secs(1));
    let (st, _, err) = b.cli(&["stop"], Duration::from_secs(20));
    assert!(st.success(), "stop: {err}");
    b.wait_exit(Duration::from_secs(60));
    let ended_unix_us = unix_us();
    let mut names: BTreeMap<String, usize> = BTreeMap::new();
    for file in [&rotated, &timeline] {
        let text = std::fs::read_to_string(file).expect("timeline written");
        assert!(
            text.len() as u64 <= 1024 * 1024,
            "{} passed its 1 MiB bound: {} bytes",
            file.display(),
            text.len()
        );
        let events: Vec<Value> =
            serde_json::from_str(&text).expect("each timeline file is valid JSON");
        for e in &events {
            if e["ph"] == "X" {
                assert!(
                    e["ts"].is_u64() && e["dur"].is_u64() && e["tid"].is_u64(),
                    "{e}"
                );
                // Wall-clock time, so that two nodes' traces line up.
                let ts = e["ts"].as_u64().unwrap_or(0);
                assert!(
                    (began_unix_us..=ended_unix_us).contains(&ts),
                    "a span at {ts} µs, outside the test's wall-clock time {began_unix_us}..{ended_unix_us}: {e}"
                );
                *names
                    .entry(e["name"].as_str().expect("name").to_string())
                    .or_default() += 1;
            }
        }
    }
    for span in [
        "forward_backward",
        "optimizer",
        "encode",
        "publish",
        "receive_validate",
        "apply",
        "full_sync",
        "checkpoint",
        "state_download",
    ] {
        assert!(names.contains_key(span), "no {span} span in {names:?}");
    }
    let log = b.log_text();
    assert!(
        log.contains("it reached its limit"),
        "the log must say the timeline rotated:\n{log}"
    );
}

/// Microseconds since the Unix epoch.
fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Headless Chromium, or why there is none.
fn chromium() -> Result<&'static str, String> {
    for c in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(c)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            return Ok(c);
        }
    }
    Err("no chromium on PATH (apt-get install chromium)".into())
}

/// Runs headless Chromium on `url` for a few seconds of the page's time with `extra` flags;
/// returns (stdout, stderr).
fn browse(browser: &str, url: &str, extra: &[&str]) -> (String, String) {
    let profile = tempfile::tempdir().expect("profile");
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,1300",
            "--virtual-time-budget=6000",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .output()
        .expect("run chromium");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The live page, from a running node of a two-node mesh, in a real headless browser: the
/// peer appears in the table and the graph, this node's loss curve is drawn, the run's
/// evaluations logged before the page opened are drawn too (what a reload keeps, served by
/// `/v1/evals`), and the page logs nothing to the console (no error, no exception). The
/// screenshot is kept in `target/tmp/p2ptrain-page.png`.
#[test]
fn the_live_page_shows_the_peer_and_the_curves_in_a_real_browser() {
    let browser = match chromium() {
        Ok(b) => b,
        Err(why) => {
            skip_or_fail("the_live_page", &why);
            return;
        }
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(tmp.path(), "page.toml", &[], "");
    let a = start(tmp.path(), "a", &cfg, None, &[]);
    let addr = listen_addr(&a);
    let b = start(tmp.path(), "b", &cfg, Some(&addr), &[]);
    let s = a.wait_status("a peer with a loss", Duration::from_secs(60), |s| {
        peers(s) == 1 && s["peers"]["list"][0]["loss"].is_f64()
    });
    let b_id = b.status_http().expect("b")["peer_id"]
        .as_str()
        .expect("id")
        .to_string();
    assert_eq!(s["peers"]["list"][0]["peer_id"], b_id.as_str());
    // A few evaluations logged (every 500 steps), each with the training loss before it.
    let logged = || -> usize {
        std::fs::read_to_string(a.data_dir.join(p2ptrain_daemon::node::EVAL_LOG))
            .map_or(0, |t| t.lines().count())
    };
    eventually(Duration::from_secs(60), "three logged evaluations", || {
        (logged() >= 3).then_some(())
    });
    let served: Value =
        serde_json::from_str(&a.http_get("/v1/evals").expect("GET /v1/evals")).expect("json");
    let evals = served["evals"].as_array().expect("evals");
    assert!(evals.len() >= 3 && served["more"] == false, "{served}");
    assert!(evals[0]["train_loss"].is_f64(), "{served}");
    let since = evals[0]["step"].as_u64().expect("step");
    let after: Value = serde_json::from_str(
        &a.http_get(&format!("/v1/evals?since={since}"))
            .expect("GET /v1/evals?since"),
    )
    .expect("json");
    assert!(
        after["evals"]
            .as_array()
            .is_some_and(|e| !e.is_empty() && e.iter().all(|e| e["step"].as_u64() > Some(since))),
        "{after}"
    );
    let before_page = logged();
    let url = format!(
        "http://{}/?token={}",
        a.api.as_deref().expect("api"),
        a.api_token().expect("the node's token")
    );
    let html = a.http_get("/").expect("GET /");
    // Self-contained: nothing loaded from elsewhere (the SVG namespace URI is a name, not a
    // fetch).
    assert!(html.contains("<html"));
    for external in [
        "src=\"http",
        "href=\"http",
        "url(http",
        "@import",
        "fetch('http",
    ] {
        assert!(!html.contains(external), "the page loads {external}...");
    }

    let (dom, log) = browse(browser, &url, &["--dump-dom"]);
    let console: Vec<&str> = log.lines().filter(|l| l.contains("CONSOLE")).collect();
    assert!(console.is_empty(), "console output: {console:#?}");
    assert!(
        dom.contains(&format!("<tr data-peer=\"{b_id}\"")),
        "no row for the peer in:\n{dom}"
    );
    assert!(
        dom.contains(&format!("data-peer=\"{b_id}\"")) && dom.contains("<circle"),
        "no graph node for the peer"
    );
    assert!(
        dom.contains("data-node=\"self\""),
        "no loss curve for this node in:\n{dom}"
    );
    assert!(dom.contains(">live<"), "the page did not say it is live");
    // The evaluations logged before the page opened: counted, and drawn in this node's curve.
    let shown: usize = dom
        .split("id=\"run-log\" data-evals=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|n| n.parse().ok())
        .expect("the run log's count in the page");
    assert!(
        shown >= before_page,
        "the page drew {shown} logged evaluations, {before_page} were logged before it opened"
    );
    let acc_chart = dom
        .split("id=\"acc-chart\"")
        .nth(1)
        .and_then(|rest| rest.split("</svg>").next())
        .expect("the evaluation chart");
    let points: usize = acc_chart
        .split("data-node=\"self\" data-points=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no curve for this node in the evaluation chart:\n{acc_chart}"));
    assert!(
        points >= shown,
        "this node's evaluation curve has {points} points, {shown} logged before the page opened"
    );

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("p2ptrain-page.png");
    let _ = std::fs::remove_file(&shot);
    browse(
        browser,
        &url,
        &[&format!("--screenshot={}", shot.display())],
    );
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "screenshot"
    );
    eprintln!("screenshot of the live page: {}", shot.display());
}

/// The README's first command: `local` without a config runs the demo, where each node holds
/// a few digits. Each node's part alone stays far below what the node reaches in the mesh,
/// the mesh stays whole (every node sees the others, no drops, no bans), and 1-bit updates
/// keep its traffic small. One node is starved of CPU throughout: the staleness bound keeps
/// the others' steps near its own, so its classes stay in everyone's model.
#[test]
fn the_demo_shows_each_node_alone_against_the_mesh() {
    let _cores = crate::harness::cpu_sensitive();
    // Node 1 gets half the CPU, as one box of a busy lab (or this one under a loaded test
    // suite) does: without SSP its classes fall out of everyone's model (CI saw a node finish
    // at 70%, loss 1.48; at a fifth of the CPU all three fell to ~60%), and its steps fall
    // behind the others'; the demo's staleness bound makes the others wait for it. (At a
    // fifth, the bounded mesh of a loaded CI box took only 12.6k steps in 25 s, 83-86%.)
    let throttled = std::cell::Cell::new(false);
    let data = tempfile::tempdir().expect("data dir");
    let data_arg = data.path().to_string_lossy().into_owned();
    let (st, out, err) = cli_with(
        None,
        &[
            "local",
            "--nodes",
            "3",
            "--duration",
            "25",
            "--json",
            "--data-dir",
            &data_arg,
        ],
        Duration::from_secs(240),
        |local| {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while std::time::Instant::now() < deadline {
                if let Some(node) = child_with_arg(local, "/node-1") {
                    throttled.set(true);
                    let period = Duration::from_millis(100);
                    return Some(Throttle::start(node, period / 2, period));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            None
        },
    );
    assert!(st.success(), "local failed: {err}");
    assert!(throttled.get(), "node 1 never started");
    let s: Value = serde_json::from_str(&out).expect("summary JSON");
    let nodes = s["per_node"].as_array().expect("per_node");
    assert_eq!(nodes.len(), 3);
    for n in nodes {
        eprintln!("demo node: {n}");
    }
    let mut all_classes = std::collections::BTreeSet::new();
    for n in nodes {
        let classes: Vec<u64> = n["classes"]
            .as_array()
            .expect("classes")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert!(
            classes.len() <= 4,
            "node {} holds {classes:?}: a few classes each",
            n["index"]
        );
        all_classes.extend(classes);
        let alone = n["alone"]["accuracy"].as_f64().expect("alone accuracy");
        let last = n["accuracy"].as_f64().expect("mesh accuracy");
        assert!(
            alone < 0.6,
            "node {}: a part of the data alone cannot pass the held-out set ({alone})",
            n["index"]
        );
        // A skewed node's model leans to its own classes by an amount that swings from moment
        // to moment: its held-out accuracy, evaluated every 200 steps, spans 0.55-0.98 in the
        // second half of one run, and CI saw a final checkpoint at 0.74 beside evaluations
        // mostly above 0.9. So what the mesh taught is the median of the node's evaluations
        // over the last 10 s (about 40 of them), held to the level the single final figure
        // was; the final checkpoint must still beat the lone part by as much.
        let index = n["index"].as_u64().expect("index");
        let recent = recent_median_accuracy(
            &data.path().join(format!("node-{index}")),
            Duration::from_secs(10),
        );
        assert!(
            recent > alone + 0.3 && recent > 0.8,
            "node {index}: the mesh must teach it the other classes: {alone} alone, \
             {recent} in the mesh (median of the last 10 s; the final checkpoint {last})"
        );
        assert!(
            last > alone + 0.3,
            "node {index}: its final checkpoint ({last}) must beat its part alone ({alone})"
        );
        assert_eq!(
            n["peers"], 2,
            "node {} saw {} peers",
            n["index"], n["peers"]
        );
        assert_eq!(n["peer_drops"], 0);
        assert_eq!(n["banned"].as_array().map(Vec::len), Some(0));
        assert_eq!(
            n["updates"]["rejected"], 0,
            "node {} rejected an honest update: {}",
            n["index"], n["last_rejection"]
        );
        let rate = n["sent_bytes_per_sec"].as_f64().expect("rate");
        assert!(
            rate > 0.0 && rate < 2_000_000.0,
            "node {} sent {rate} B/s",
            n["index"]
        );
    }
    assert_eq!(all_classes.len(), 10, "the parts together hold every class");
    // SSP holds every node within `staleness_bound` (100 steps in the demo's config) of its
    // slowest neighbour as it last heard of it (an update every 20 steps); the final steps
    // are those of the nodes' final checkpoints, each written when the stop reached it, and
    // the starved node may take a few more steps alone while its stop waits out a pause. So
    // twice the bound: the old check (the slowest at least 80% of the fastest) allowed some
    // 2,500 steps, 25 times the bound, in a run of 12k.
    const STALENESS_BOUND: u64 = 100;
    let steps: Vec<u64> = nodes.iter().filter_map(|n| n["step"].as_u64()).collect();
    let (slowest, fastest) = (steps.iter().min(), steps.iter().max());
    eprintln!("demo: final steps {steps:?}");
    assert!(
        matches!((slowest, fastest), (Some(&lo), Some(&hi)) if hi - lo <= 2 * STALENESS_BOUND),
        "SSP keeps the starved node's steps within twice the bound ({STALENESS_BOUND}) of the \
         others': {steps:?}"
    );
    eprintln!(
        "demo: alone {:.3}, in the mesh {:.3}",
        s["mean_alone_accuracy"], s["mean_accuracy"]
    );
}
