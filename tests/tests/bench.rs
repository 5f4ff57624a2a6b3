//! The benchmarks as a user runs them: a short run whose report parses and holds what the
//! README says it does. No timing is asserted; the figures belong to the benchmarks' JSON.

use std::time::Duration;

use serde_json::Value;

use crate::harness::{cli, repo_root, skip_or_fail};

/// `bench scaling` on the digits, two pinned nodes in `ddp`, PyTorch left out (CI has no
/// torch): every kind of run reaches the target, the summary holds the ideal, speedups and
/// efficiency, and the mesh's members saw each other and nothing hostile.
#[test]
fn bench_scaling_reports_each_kind_to_the_target_with_a_clean_mesh() {
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
}
