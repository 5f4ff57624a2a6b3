//! The benchmarks as a user runs them: a short run whose report parses and holds what the
//! docs/benchmarks.md says it does. No timing is asserted; the figures belong to the benchmarks' JSON.

use std::time::Duration;

use serde_json::Value;

use crate::harness::{cli, repo_root, skip_or_fail};

/// `bench scaling` on the digits, two pinned nodes in `ddp`, PyTorch left out (CI has no
/// torch): every kind of run reaches the target, the summary holds the ideal, speedups and
/// efficiency, and the mesh's members saw each other and nothing hostile.
#[test]
fn bench_scaling_reports_each_kind_to_the_target_with_a_clean_mesh() {
    let _cores = crate::harness::cpu_sensitive();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if cores < 2 {
        skip_or_fail(
            "bench_scaling_reports_each_kind_to_the_target_with_a_clean_mesh",
            "two nodes pinned to a core each need two cores",
        );
        return;
    }
    let out = tempfile::tempdir().expect("tempdir");
    let config = repo_root().join("configs/digits-mlp.toml");
    let (st, _, err) = cli(
        &[
            "bench",
            "scaling",
            "--out",
            out.path().to_str().expect("utf8"),
            "--config",
            config.to_str().expect("utf8"),
            "--modes",
            "ddp",
            "--seeds",
            "1",
            "--targets",
            "0.9",
            "--eval-every",
            "10",
            "--timeout",
            "60",
            "--no-torch",
        ],
        Duration::from_secs(240),
    );
    assert!(st.success(), "{err}");
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("report.json")).expect("report.json"),
    )
    .expect("report json");
    assert_eq!(report["benchmark"], "scaling");
    assert_eq!(report["links"], "loopback");
    assert_eq!(report["metric"], "accuracy");
    assert!(
        report["ideal_speedup"]["0.9"]
            .as_f64()
            .is_some_and(|v| v > 0.0),
        "{}",
        report["ideal_speedup"]
    );
    let summary = report["summary"].as_array().expect("summary");
    let kinds: Vec<&str> = summary.iter().filter_map(|s| s["kind"].as_str()).collect();
    assert_eq!(kinds, ["alone", "alone_x2", "ddp"], "{kinds:?}");
    for s in summary {
        assert_eq!(s["steps_to_target"]["0.9"]["reached"], 1, "{s}");
        assert!(s["speedup"]["0.9"].as_f64().is_some_and(|v| v > 0.0), "{s}");
        assert!(s["scaling_efficiency"]["0.9"].as_f64().is_some(), "{s}");
    }
    let runs = report["runs"].as_array().expect("runs");
    let ddp = runs.iter().find(|r| r["kind"] == "ddp").expect("a ddp run");
    let members = ddp["mesh"].as_array().expect("mesh");
    assert_eq!(members.len(), 2, "{ddp}");
    for m in members {
        assert_eq!(m["peers"], 1, "{m}");
        assert_eq!(m["rejected"], 0, "{m}");
        assert_eq!(m["banned"], 0, "{m}");
        assert!(m["rounds"].as_u64().is_some_and(|r| r > 0), "{m}");
    }
    assert!(ddp["bytes_sent_per_node"].as_f64().is_some_and(|b| b > 0.0));
    let svg = std::fs::read_to_string(out.path().join("report.svg")).expect("report.svg");
    assert!(svg.contains("<svg"), "not an SVG");
    // Each node's folder holds its key and checkpoints: made 0700, never open for the node to
    // narrow (it warned once per node when the benchmark made them with `create_dir_all`).
    let mut node_dirs = 0;
    for run in std::fs::read_dir(out.path().join("runs"))
        .expect("runs")
        .flatten()
    {
        let nodes = std::fs::read_dir(run.path())
            .expect("a run's nodes")
            .flatten();
        for node in nodes.filter(|e| e.file_name().to_string_lossy().starts_with('n')) {
            let mode = std::os::unix::fs::PermissionsExt::mode(
                &node.metadata().expect("metadata").permissions(),
            );
            assert_eq!(mode & 0o777, 0o700, "{}: {mode:o}", node.path().display());
            let log = std::fs::read_to_string(node.path().join("node.log")).unwrap_or_default();
            assert!(!log.contains("open to others"), "{}", node.path().display());
            node_dirs += 1;
        }
    }
    assert!(node_dirs >= 4, "{node_dirs} node folders");
}

/// A benchmark process that is killed, and its lab's namespaces deleted, when the test ends
/// any other way than the one it checks.
struct Benchmark {
    child: std::process::Child,
}

impl Drop for Benchmark {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for ns in p2ptrain_netlab::labs_of(self.child.id()).unwrap_or_default() {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &ns])
                .status();
        }
    }
}

/// `bench scaling --link` stopped by SIGTERM in the middle of a mesh run: it kills its nodes
/// and deletes its lab's namespaces on the way out, where dying by the signal left them.
#[test]
fn bench_scaling_stopped_by_sigterm_leaves_no_namespace_behind() {
    let test = "bench_scaling_stopped_by_sigterm_leaves_no_namespace_behind";
    let Some(lab) = crate::netlab::lab_or_skip(test, 1) else {
        return;
    };
    drop(lab);
    let out = tempfile::tempdir().expect("tempdir");
    let config = repo_root().join("configs/digits-mlp.toml");
    let child = std::process::Command::new(crate::harness::bin())
        .args(["bench", "scaling", "--out"])
        .arg(out.path())
        .arg("--config")
        .arg(&config)
        // The mesh run steps slowly (the lone one does not), so it is under way for long
        // enough to be interrupted.
        .args([
            "--modes",
            "gossip",
            "--seeds",
            "1",
            "--no-ideal",
            "--no-torch",
        ])
        .args(["--targets", "0.9", "--eval-every", "10", "--timeout", "120"])
        .args(["--set", "debug.step_delay_ms=300", "--link", "10mbit"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn bench scaling");
    let pid = child.id();
    let mut bench = Benchmark { child };
    let runs = out.path().join("runs");
    crate::harness::eventually(
        Duration::from_secs(120),
        "the mesh run's second node serving its API on its lab host",
        || {
            let mesh_run = std::fs::read_dir(&runs)
                .ok()?
                .filter_map(Result::ok)
                .find(|e| e.file_name().to_string_lossy().contains("gossip"))?;
            mesh_run.path().join("n1/api.addr").exists().then_some(())
        },
    );
    assert!(
        !p2ptrain_netlab::labs_of(pid)
            .expect("ip netns list")
            .is_empty(),
        "the lab's namespaces should exist while it runs"
    );
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status =
        crate::harness::eventually(Duration::from_secs(30), "the benchmark's exit", || {
            bench.child.try_wait().ok().flatten()
        });
    assert!(
        !status.success(),
        "an interrupted benchmark reports failure"
    );
    let left = p2ptrain_netlab::labs_of(pid).expect("ip netns list");
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

/// Runs `bench sim` with `args` and answers the report it wrote.
fn bench_sim(args: &[&str]) -> Value {
    let out = tempfile::tempdir().expect("tempdir");
    let file = out.path().join("sim.json");
    let mut all = vec!["bench", "sim"];
    all.extend_from_slice(args);
    all.extend(["--out", file.to_str().expect("utf8")]);
    let (st, _, err) = cli(&all, Duration::from_secs(120));
    assert!(st.success(), "{err}");
    serde_json::from_str(&std::fs::read_to_string(&file).expect("report")).expect("json")
}

/// `bench sim` at a small size: the report parses and holds, per run, the traffic per node per
/// step, the consensus at the heal, at the end and never split, and the wall time; honest
/// nodes blamed nobody honest, and the healed mesh ended closer than it was at the heal.
#[test]
fn bench_sim_reports_traffic_and_consensus_per_size() {
    let report = bench_sim(&["--nodes", "24"]);
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1, "{report}");
    let run = &runs[0];
    for key in [
        "bytes_per_node_per_step",
        "consensus_at_heal",
        "consensus_end",
        "consensus_never_split",
        "wall_secs",
        "syncs",
        "updates_applied",
    ] {
        assert!(run[key].as_f64().is_some(), "{key} in {run}");
    }
    assert_eq!(run["nodes"], 24);
    assert_eq!(run["honest_blamed"], 0, "{run}");
    assert!(run["bytes_per_node_per_step"].as_f64().unwrap_or(0.0) > 0.0);
    let (heal, end) = (
        run["consensus_at_heal"].as_f64(),
        run["consensus_end"].as_f64(),
    );
    assert!(end < heal, "the healed mesh came together: {run}");
    assert!(report["scenario"].is_string());
}

/// `bench sim --sync-mode ddp` at a small size: the rounds' report parses and holds, per run,
/// the rounds' pace, splits, unsynced nodes, ring traffic and wall time; every ring kept its
/// members identical, nobody honest was blamed, and rounds were completed.
#[test]
fn bench_sim_reports_the_rounds_of_a_synchronous_mode() {
    let report = bench_sim(&[
        "--sync-mode",
        "ddp",
        "--nodes",
        "6",
        "--churn-every-ms",
        "0,8000",
    ]);
    assert_eq!(report["sync_mode"], "ddp", "{report}");
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{report}");
    for run in runs {
        for key in [
            "rounds_per_minute",
            "ring_bytes_per_node_per_round",
            "consensus_end",
            "wall_secs",
        ] {
            assert!(run[key].as_f64().is_some(), "{key} in {run}");
        }
        assert_eq!(run["nodes"], 6);
        assert_eq!(run["rounds_split"], 0, "{run}");
        assert_eq!(run["honest_blamed"], 0, "{run}");
        assert!(run["rounds"].as_u64().unwrap_or(0) > 0, "{run}");
    }
    assert_eq!(runs[1]["churn_every_ms"], 8000);
    assert!(
        runs[1]["nodes_started"].as_u64().unwrap_or(0) > 6,
        "{report}"
    );
    let (st, _, err) = cli(
        &["bench", "sim", "--sync-mode", "diloco", "--nodes", "6"],
        Duration::from_secs(30),
    );
    assert!(!st.success() && err.contains("diloco"), "{err}");
}

/// `bench trainer` for one short run: the report parses, holds one timing of each side, and
/// the real node (trainer thread, control API, evaluations) took its steps.
#[test]
fn bench_trainer_reports_a_bare_loop_beside_a_real_node() {
    let out = tempfile::tempdir().expect("tempdir");
    let file = out.path().join("trainer.json");
    let (st, _, err) = cli(
        &[
            "bench",
            "trainer",
            "--steps",
            "300",
            "--runs",
            "2",
            "--out",
            file.to_str().expect("utf8"),
        ],
        Duration::from_secs(120),
    );
    assert!(st.success(), "{err}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("report")).expect("json");
    assert_eq!(
        report["benchmark"], "trainer-in-daemon-vs-bare-loop",
        "{report}"
    );
    assert_eq!(report["steps_per_run"], 300, "{report}");
    for key in [
        "bare_steps_per_sec",
        "daemon_steps_per_sec",
        "daemon_steps_per_sec_with_eval",
    ] {
        let runs = report[key].as_array().expect(key);
        assert_eq!(runs.len(), 2, "{key}: {report}");
        assert!(
            runs.iter().all(|r| r.as_f64().is_some_and(|v| v > 0.0)),
            "{key}: {report}"
        );
    }
    for key in ["ratio_of_medians", "median_of_paired_ratios"] {
        assert!(
            report[key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {report}"
        );
    }
}

/// `bench step` on the digits MLP without PyTorch: one case per optimizer, each timed, no
/// ratio where there is no PyTorch side, and each codec's update smaller than the dense one
/// (4 bytes a parameter) it compresses.
#[test]
fn bench_step_reports_each_optimizer_and_what_the_codecs_save() {
    let out = tempfile::tempdir().expect("tempdir");
    let file = out.path().join("step.json");
    let configs = repo_root().join("configs");
    let (st, _, err) = cli(
        &[
            "bench",
            "step",
            "--models",
            "digits-mlp",
            "--optimizers",
            "sgd,adamw",
            "--seconds",
            "0.3",
            "--runs",
            "1",
            "--no-torch",
            "--device",
            "cpu",
            "--configs",
            configs.to_str().expect("utf8"),
            "--out",
            file.to_str().expect("utf8"),
        ],
        Duration::from_secs(120),
    );
    assert!(st.success(), "{err}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("report")).expect("json");
    assert_eq!(
        report["benchmark"], "train-step-vs-pytorch-eager",
        "{report}"
    );
    assert_eq!(report["device"], "cpu", "{report}");
    assert_eq!(report["gpu_levers"], "none", "{report}");
    let cases = report["cases"].as_array().expect("cases");
    let optimizers: Vec<&str> = cases
        .iter()
        .filter_map(|c| c["optimizer"].as_str())
        .collect();
    assert_eq!(optimizers, ["sgd", "adamw"], "{report}");
    for c in cases {
        assert_eq!(c["config"], "digits-mlp", "{c}");
        assert!(
            c["p2ptrain_median"].as_f64().is_some_and(|v| v > 0.0),
            "{c}"
        );
        assert!(c["torch_median"].is_null() && c["ratio"].is_null(), "{c}");
        assert!(c["gpu_wait_fraction"].is_null(), "{c}");
    }
    let params = cases[0]["params"].as_u64().expect("params");
    let codecs = report["codecs"].as_array().expect("codecs");
    assert!(!codecs.is_empty(), "{report}");
    for c in codecs {
        let bytes = c["bytes"].as_u64().expect("bytes");
        assert!(bytes > 0 && bytes < 4 * params, "{c}: {params} parameters");
        assert!(c["encode_us"].as_f64().is_some_and(|v| v > 0.0), "{c}");
    }
    // A GPU asked of a build without CUDA: one line that says how to get it, no report.
    let gpu_file = out.path().join("gpu.json");
    let (st, _, err) = cli(
        &[
            "bench",
            "step",
            "--models",
            "digits-mlp",
            "--no-torch",
            "--device",
            "cuda",
            "--configs",
            configs.to_str().expect("utf8"),
            "--out",
            gpu_file.to_str().expect("utf8"),
        ],
        Duration::from_secs(60),
    );
    assert!(
        !st.success() && err.contains("without CUDA support"),
        "{err}"
    );
    assert!(!gpu_file.exists());
}

/// `bench mesh` with two nodes and two codecs: a run per codec, each node's updates sent and
/// applied by the other, and 1-bit updates at least eight times smaller than dense ones as
/// gossipsub counted them on the wire.
#[test]
fn bench_mesh_reports_a_run_per_codec_with_updates_flowing() {
    let _cores = crate::harness::cpu_hog();
    let out = tempfile::tempdir().expect("tempdir");
    let (st, _, err) = cli(
        &[
            "bench",
            "mesh",
            "--nodes",
            "2",
            "--codec",
            "dense,onebit",
            "--duration",
            "6",
            "--step-delay-ms",
            "1",
            "--out",
            out.path().to_str().expect("utf8"),
        ],
        Duration::from_secs(180),
    );
    assert!(st.success(), "{err}");
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("report.json")).expect("report.json"),
    )
    .expect("json");
    assert_eq!(report["benchmark"], "mesh", "{report}");
    let runs = report["runs"].as_array().expect("runs");
    let codecs: Vec<&str> = runs.iter().filter_map(|r| r["codec"].as_str()).collect();
    assert_eq!(codecs, ["dense", "onebit"], "{report}");
    let bytes_per_update = |r: &Value| r["bytes_per_update"].as_f64().expect("bytes_per_update");
    for r in runs {
        assert_eq!(r["nodes"], 2, "{r}");
        for key in ["updates_sent", "updates_applied"] {
            let per_node = r[key].as_array().expect(key);
            assert_eq!(per_node.len(), 2, "{key}: {r}");
            assert!(
                per_node.iter().all(|n| n.as_u64().is_some_and(|v| v > 0)),
                "{key}: every node's updates flow: {r}"
            );
        }
        assert!(r["final_accuracy"]["mean"].as_f64().is_some(), "{r}");
        assert!(bytes_per_update(r) > 0.0, "{r}");
    }
    assert!(
        bytes_per_update(&runs[1]) * 8.0 < bytes_per_update(&runs[0]),
        "1-bit updates of {} bytes against dense ones of {}",
        bytes_per_update(&runs[1]),
        bytes_per_update(&runs[0])
    );
    let svg = std::fs::read_to_string(out.path().join("report.svg")).expect("report.svg");
    assert!(svg.contains("<svg"), "not an SVG");
}
