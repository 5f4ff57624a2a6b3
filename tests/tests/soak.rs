//! The honest soak: six honest nodes (three publishing dense updates, three 1-bit ones) train at full speed on this box for a minute (three with
//! `P2PTRAIN_SOAK_SECS=180`), as users run them. Accuracy cannot show a split mesh (a lone node reaches ~98% on digits in a second), so
//! the test watches the mesh itself, every second: after formation no member is ever lost,
//! every node keeps N-1 peers, no update is rejected and no peer is banned, while updates keep
//! flowing and being applied.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{repo_root, Node};
use crate::mesh::{listen_addr, peers, start, step};

/// Nodes in the soak mesh.
const NODES: usize = 6;
/// How long the mesh is watched after it formed, in CI. `P2PTRAIN_SOAK_SECS=180` (or more)
/// runs the long soak, past gossipsub's 120 s caches (docs/benchmarks.md).
const SOAK_SECS: u64 = 60;

/// The bundled digits config at full speed (no step delay), checkpoints off, with `codec`.
fn soak_config(dir: &Path, codec: &str) -> PathBuf {
    let text = std::fs::read_to_string(repo_root().join("configs/digits-mlp.toml"))
        .expect("config")
        .replace("every_steps = 5000", "every_steps = 0")
        .replace("every_secs = 30", "every_secs = 0");
    let path = dir.join(format!("{codec}.toml"));
    std::fs::write(&path, format!("{text}\n[sync]\ncodec = \"{codec}\"\n")).expect("write");
    path
}

fn counter(s: &Value, key: &str) -> u64 {
    s["updates"][key].as_u64().unwrap_or(0)
}

/// What watching an honest mesh saw: each node's status when the watch began and at its last
/// answer, and every moment the mesh fell short of honest behaviour.
pub(crate) struct Watch {
    /// Statuses when the watch began.
    pub first: Vec<Value>,
    /// The last status each node answered.
    pub last: Vec<Value>,
    /// What went wrong, and when.
    pub violations: Vec<String>,
    /// Seconds watched.
    pub secs: f64,
}

/// Connections a node may hold to one honest peer: one, a second where both dialled each
/// other at once, and for a few seconds a third (an AutoNAT dial-back, closed
/// `nat::DIAL_BACK_GRACE` after its probe is answered). AutoNAT's dial-backs once stayed
/// open: a pair held 8 connections after 45 s (the per-peer limit), and the next probes,
/// refused by that limit, turned loopback nodes "private".
const HONEST_CONNECTIONS_MAX: u64 = 3;

/// Polls every node once a second for `secs` (with `poll`, which reads one node's status) and
/// records every moment a node has fewer or more than N-1 peers, lost a member (its
/// `peer_drops` grew), has rejected any update, has banned anyone, or holds more than
/// [`HONEST_CONNECTIONS_MAX`] connections to a peer. The mesh must already be formed.
pub(crate) fn watch_honest_mesh(
    nodes: &[Node],
    secs: u64,
    poll: impl Fn(&Node) -> Option<Value>,
) -> Watch {
    let want = (nodes.len() - 1) as u64;
    let first: Vec<Value> = nodes
        .iter()
        .map(|n| poll(n).expect("status when the watch begins"))
        .collect();
    let drops_at_start: Vec<u64> = first
        .iter()
        .map(|s| s["peer_drops"].as_u64().unwrap_or(0))
        .collect();
    let mut violations: Vec<String> = Vec::new();
    let mut unanswered = vec![0u32; nodes.len()];
    let mut last = first.clone();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(secs) && violations.len() <= 50 {
        let round = Instant::now();
        let t = started.elapsed().as_secs_f64();
        for (i, n) in nodes.iter().enumerate() {
            let Some(s) = poll(n) else {
                unanswered[i] += 1;
                // A node whose API stays silent for many seconds is as good as gone.
                if unanswered[i] == 10 {
                    violations.push(format!("{t:.0}s: node {i} stopped answering status"));
                }
                continue;
            };
            unanswered[i] = 0;
            let mut bad = Vec::new();
            if peers(&s) != want {
                bad.push(format!("{} peers", peers(&s)));
            }
            let drops = s["peer_drops"].as_u64().unwrap_or(0);
            if drops > drops_at_start[i] {
                bad.push(format!("{} members dropped", drops - drops_at_start[i]));
            }
            if counter(&s, "rejected") > 0 {
                bad.push(format!(
                    "{} updates rejected: {}",
                    counter(&s, "rejected"),
                    s["rejected_by_peer"]
                ));
            }
            if s["banned_peers"].as_array().is_some_and(|b| !b.is_empty()) {
                bad.push(format!("banned {}", s["banned_peers"]));
            }
            for p in s["peers"]["list"].as_array().into_iter().flatten() {
                let connections = p["connections"].as_u64().unwrap_or(0);
                if connections > HONEST_CONNECTIONS_MAX {
                    bad.push(format!("{connections} connections to {}", p["peer_id"]));
                }
            }
            if !bad.is_empty() {
                violations.push(format!("{t:.0}s: node {i}: {}", bad.join("; ")));
            }
            last[i] = s;
        }
        std::thread::sleep(Duration::from_secs(1).saturating_sub(round.elapsed()));
    }
    Watch {
        first,
        last,
        violations,
        secs: started.elapsed().as_secs_f64(),
    }
}

impl Watch {
    /// Prints each node's traffic figures, then fails with every violation (and the nodes'
    /// warnings) if there was any, or if a node stopped training or applying updates.
    pub(crate) fn assert_honest(&self, what: &str, nodes: &[Node]) {
        for (i, (a, b)) in self.first.iter().zip(&self.last).enumerate() {
            eprintln!(
                "{what} node {i}: {:.0} steps/s, applied {}, late {}, duplicates {}, too old {}, rate-limited {}, scaled down {}, outliers {}, peer drops {}",
                (step(b) - step(a)) as f64 / self.secs,
                counter(b, "applied") - counter(a, "applied"),
                counter(b, "late"),
                counter(b, "duplicates"),
                counter(b, "too_old"),
                counter(b, "rate_limited"),
                counter(b, "scaled_down"),
                counter(b, "outliers"),
                b["peer_drops"]
            );
        }
        if !self.violations.is_empty() {
            for (i, n) in nodes.iter().enumerate() {
                let log = n.log_text();
                let warnings: Vec<&str> = log
                    .lines()
                    .filter(|l| l.contains("WARN") || l.contains("dropping") || l.contains("gone"))
                    .take(40)
                    .collect();
                eprintln!("--- node {i} warnings:\n{}", warnings.join("\n"));
            }
        }
        assert!(
            self.violations.is_empty(),
            "{what}: the honest mesh lost members, rejected or banned:\n{}",
            self.violations.join("\n")
        );
        for (i, (a, b)) in self.first.iter().zip(&self.last).enumerate() {
            assert!(
                counter(b, "applied") > counter(a, "applied") && step(b) > step(a),
                "{what}: node {i} stopped training or stopped applying updates: {a} -> {b}"
            );
        }
    }
}

/// Six nodes, alternately publishing dense and 1-bit updates (codecs are a node's own choice,
/// so each node takes both kinds from its neighbours), watched for [`SOAK_SECS`].
#[test]
fn six_honest_nodes_at_full_speed_with_dense_and_onebit_updates_never_lose_a_peer() {
    let _cores = crate::harness::cpu_hog();
    let secs = std::env::var("P2PTRAIN_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SOAK_SECS);
    let tmp = tempfile::tempdir().expect("tmp");
    let codecs = ["dense", "onebit"];
    let cfgs = codecs.map(|codec| soak_config(tmp.path(), codec));
    let founder = start(tmp.path(), "n0", &cfgs[0], None, &[]);
    let addr = listen_addr(&founder);
    let mut nodes = vec![founder];
    for i in 1..NODES {
        nodes.push(start(
            tmp.path(),
            &format!("n{i}"),
            &cfgs[i % 2],
            Some(&addr),
            &[],
        ));
    }
    let want = (NODES - 1) as u64;
    for (i, n) in nodes.iter().enumerate() {
        n.wait_status(
            &format!("node {i} training with {want} peers"),
            Duration::from_secs(180),
            |s| peers(s) == want && s["phase"] == "training",
        );
    }
    for (i, n) in nodes.iter().enumerate() {
        let status = n.status().expect("status");
        assert_eq!(
            status["sync"]["codec"],
            codecs[i % 2],
            "node {i} publishes with the codec it was given: {status}"
        );
    }
    let watch = watch_honest_mesh(&nodes, secs, Node::status_http);
    watch.assert_honest("dense and onebit soak", &nodes);
    // On loopback every member reaches every other: AutoNAT must find each one public.
    for (i, s) in watch.last.iter().enumerate() {
        assert_eq!(
            s["nat"]["reachability"], "public",
            "node {i} after the soak: {}",
            s["nat"]
        );
    }
}
