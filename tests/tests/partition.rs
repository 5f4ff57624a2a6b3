//! Faults of the network itself, on test hosts in network namespaces (see `netlab`): a
//! partition that splits the mesh and heals, and links slowed to 10 Mbit/s. Where namespaces
//! cannot be made each test skips with a printed reason, or fails in CI (`CI=true`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{eventually, Node};
use crate::mesh::{config, params, peers, relative_distance, step};
use crate::netlab::{lab_or_skip, Lab};
use crate::soak::watch_honest_mesh;

fn start_in(lab: &Lab, i: usize, root: &Path, cfg: &Path, bootstrap: Option<&str>) -> Node {
    let mut args = vec!["--config", cfg.to_str().expect("utf8")];
    if let Some(b) = bootstrap {
        args.extend(["--bootstrap", b]);
    }
    let mut node = Node::start_in(
        Some(lab.ns(i)),
        &lab.listen(i),
        &root.join(format!("n{i}")),
        &args,
    );
    node.wait_api();
    node
}

/// The node's address inside the lab (not its loopback).
pub(crate) fn lab_addr(node: &Node, lab_ip: &str) -> String {
    let s = node.wait_status("a lab address", Duration::from_secs(30), |s| {
        s["listen_addrs"].as_array().is_some_and(|a| {
            a.iter()
                .any(|x| x.as_str().is_some_and(|x| x.contains(lab_ip)))
        })
    });
    s["listen_addrs"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .find(|x| x.contains(lab_ip))
        })
        .expect("lab address")
        .to_string()
}

/// Starts one node per config, node `i` on lab host `i`, all bootstrapping from host 0; waits
/// until each sees all the others.
fn mesh_in(lab: &Lab, root: &Path, cfgs: &[&Path]) -> Vec<Node> {
    let n = cfgs.len();
    let first = start_in(lab, 0, root, cfgs[0], None);
    let addr = lab_addr(&first, &lab.addr(0));
    let mut nodes = vec![first];
    for (i, cfg) in cfgs.iter().enumerate().skip(1) {
        nodes.push(start_in(lab, i, root, cfg, Some(&addr)));
    }
    for node in &nodes {
        node.wait_status("all peers", Duration::from_secs(60), |s| {
            peers(s) == n as u64 - 1
        });
    }
    nodes
}

/// The node's log lines about what peers did wrong (rejections, refusals, bans), for a
/// failure message.
fn offences(node: &Node) -> String {
    let lines: Vec<String> = node
        .log_text()
        .lines()
        .filter(|l| {
            l.contains("rejected update")
                || l.contains("refused neighbour sync")
                || l.contains("banned")
        })
        .map(String::from)
        .collect();
    let skip = lines.len().saturating_sub(20);
    lines[skip..].join("\n")
}

/// Flat parameters of a checkpoint the node writes now.
pub(crate) fn params_now(node: &Node) -> Vec<f32> {
    let (st, out, err) = node.cli(&["checkpoint", "save", "--json"], Duration::from_secs(30));
    assert!(st.success(), "checkpoint save: {err}");
    let v: Value = serde_json::from_str(&out).expect("checkpoint json");
    params(&PathBuf::from(v["path"].as_str().expect("path")))
}

/// Largest relative L2 distance between any two nodes' parameters.
fn consensus_distance(nodes: &[Node]) -> f64 {
    let p: Vec<Vec<f32>> = nodes.iter().map(params_now).collect();
    let mut worst: f64 = 0.0;
    for i in 0..p.len() {
        for j in (i + 1)..p.len() {
            worst = worst.max(relative_distance(&p[i], &p[j]));
        }
    }
    worst
}

const FULL_SYNC_EVERY: u64 = 1000;

/// Four nodes split 2|2 for 30 s, then healed. Both halves must keep training apart; once
/// healed, the halves must find each other again (lost members are redialled) and, from then
/// on, the mesh's consensus distance must lose three quarters of what the split added (or fall
/// below its level before the split, if that is higher) within three full-sync intervals,
/// counted in steps of the node that trained most.
#[test]
fn a_mesh_split_in_two_trains_on_and_reconverges_after_healing() {
    let Some(lab) = lab_or_skip("partition and heal", 4) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tmp");
    // Each half owns half of the data (shard 0/2 on hosts 0 and 1, 1/2 on hosts 2 and 3), as
    // boxes with their own data would: apart, each half fits its own shard and the halves
    // drift measurably (with the same data everywhere, 30 s apart on this small convex-ish
    // problem moved them no further apart than the mesh's own noise).
    let cfgs: Vec<PathBuf> = (0..2)
        .map(|k| {
            config(
                tmp.path(),
                &format!("shard{k}.toml"),
                &[("threads = 1", &format!("threads = 1\nshard = \"{k}/2\""))],
                &format!(
                    "\n[sync]\ndegree = 3\npublish_every = 10\nfull_sync_every = {FULL_SYNC_EVERY}\n"
                ),
            )
        })
        .collect();
    let nodes = mesh_in(&lab, tmp.path(), &[&cfgs[0], &cfgs[0], &cfgs[1], &cfgs[1]]);
    // Split early, while the model still moves fast: a converged model barely drifts apart.
    for n in &nodes {
        n.wait_status("a training mesh", Duration::from_secs(120), |s| {
            step(s) > 200 && s["updates"]["applied"].as_u64().unwrap_or(0) > 3
        });
    }
    // The mesh's own fluctuation: between full syncs each node drifts towards its shard, so
    // the distance is a sawtooth whose period is one full-sync interval. Its level is the
    // highest sample over a whole period: a shorter window (six samples in 1.8 s, about 500
    // steps, was the first version) can miss the peak and then call the healed mesh's
    // ordinary sawtooth a failure to reconverge.
    let steps_now = |nodes: &[Node]| -> Vec<u64> {
        nodes
            .iter()
            .map(|n| step(&n.status().expect("status")))
            .collect()
    };
    let start = steps_now(&nodes);
    let mut before = Vec::new();
    while before.len() < 60
        && steps_now(&nodes)
            .iter()
            .zip(&start)
            .any(|(s, s0)| *s < s0 + FULL_SYNC_EVERY)
    {
        std::thread::sleep(Duration::from_millis(300));
        before.push(consensus_distance(&nodes));
    }
    let level = before.iter().cloned().fold(0.0, f64::max);
    eprintln!(
        "consensus distance over one full-sync interval before the split ({} samples): {before:?}",
        before.len()
    );

    let t_split = Instant::now();
    lab.partition(&[2, 3]).expect("partition");
    let steps_at_split: Vec<u64> = nodes
        .iter()
        .map(|n| step(&n.status().expect("status")))
        .collect();
    for n in &nodes {
        n.wait_status("only its own half left", Duration::from_secs(20), |s| {
            peers(s) == 1
        });
    }
    eprintln!(
        "every node saw the split after {:.1} s",
        t_split.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(30).saturating_sub(t_split.elapsed()));
    let apart = consensus_distance(&nodes);
    let statuses: Vec<Value> = nodes.iter().map(|n| n.status().expect("status")).collect();
    for (s, s0) in statuses.iter().zip(&steps_at_split) {
        assert!(step(s) > s0 + 1000, "a half stopped training: {s}");
        assert_eq!(peers(s), 1, "{s}");
    }
    eprintln!("consensus distance after 30 s apart: {apart:.4}");
    assert!(
        apart > level,
        "the split made no difference: {apart} vs {level}"
    );

    let t_heal = Instant::now();
    lab.heal().expect("heal");
    // Each node is polled until it sees the three others; the mesh is whole only once the
    // last does, so the steps counted from then are read after the loop (read per node as it
    // reconnected, a node that did so early counted the seconds it then waited for the
    // others: CI saw 5,190 "steps to reconverge" when consensus was back at the first sample,
    // 0.4 s after the last node reconnected 8.8 s after the heal).
    for n in &nodes {
        eventually(Duration::from_secs(30), "the halves reconnected", || {
            let s = n.status()?;
            assert!(
                s["banned_peers"].as_array().is_none_or(|b| b.is_empty()),
                "an honest peer was banned: {}; sync refusals {}; why, by the log:\n{}",
                s["banned_peers"],
                s["sync_refusals"],
                offences(n)
            );
            (peers(&s) == 3).then_some(s)
        });
    }
    let reconnected = t_heal.elapsed().as_secs_f64();
    let steps_at_reconnect: Vec<u64> = nodes
        .iter()
        .map(|n| {
            step(&eventually(Duration::from_secs(10), "a status", || {
                n.status()
            }))
        })
        .collect();
    // Gossiped deltas add each node's progress to the others but do not pull two replicas
    // together: the offset the split left is removed only by full syncs, which average one
    // pair at a time, halving that pair's offset. Removing three quarters of it takes about
    // seven such pairings among four nodes (random pairwise averaging shrinks the spread by
    // about sqrt(2/3) per pairing); three intervals give twelve. The level before the split
    // is no target on its own: late in training the shards' gradients disagree more than
    // early on, so the healed mesh's own sawtooth peaks higher (0.10-0.14 against 0.06 in
    // the runs that first set this bound) and the distance dips below the early level only
    // by chance (after 3.2k to 9.2k steps in three runs).
    let target = level.max(apart / 4.0);
    let mut trace = Vec::new();
    let (recovered, steps_after) = eventually(
        Duration::from_secs(90),
        "consensus back below a quarter of its level apart",
        || {
            let d = consensus_distance(&nodes);
            let steps: Vec<u64> = nodes
                .iter()
                .filter_map(|n| n.status().map(|s| step(&s)))
                .collect();
            trace.push((t_heal.elapsed().as_secs_f64(), d));
            (d < target).then(|| {
                // The most any node has trained since the mesh was whole again.
                let since = steps
                    .iter()
                    .zip(&steps_at_reconnect)
                    .map(|(s, r)| s.saturating_sub(*r))
                    .max()
                    .unwrap_or(0);
                (t_heal.elapsed().as_secs_f64(), since)
            })
        },
    );
    eprintln!(
        "healed: all reconnected after {reconnected:.1} s; consensus below {target:.4} after {recovered:.1} s \
         and {steps_after} steps (full sync every {FULL_SYNC_EVERY}); trace {trace:?}"
    );
    assert!(
        steps_after <= 3 * FULL_SYNC_EVERY,
        "took {steps_after} steps to reconverge, more than three full-sync intervals"
    );
    // The healed halves are the most divergent honest replicas there are: every full sync
    // between them must have been judged within the bound and averaged, none refused (a
    // refusal would also have cost an honest peer its score).
    let mut largest: f64 = 0.0;
    for n in &nodes {
        let s = n.status().expect("status");
        let fs = &s["full_syncs"];
        eprintln!("full syncs: {fs}");
        assert_eq!(
            fs["refused"].as_u64(),
            Some(0),
            "an honest sync was refused: {}; {}",
            fs["last_refusal"],
            s["sync_refusals"]
        );
        assert!(
            s["sync_refusals"].as_object().is_some_and(|m| m.is_empty()),
            "{}",
            s["sync_refusals"]
        );
        assert!(fs["accepted"].as_u64().unwrap_or(0) > 0, "{fs}");
        largest = largest.max(fs["largest_accepted"].as_f64().unwrap_or(0.0));
    }
    // ... and the healed case was exercised: some accepted sync was further apart than the
    // whole mesh ever was before the split.
    eprintln!("largest accepted sync distance {largest:.4} (level before the split {level:.4}, apart {apart:.4})");
    assert!(largest > level, "{largest} vs {level}");
}

/// Seconds from `start` until every node has evaluated at ≥ 95% held-out accuracy, polling.
fn time_to_95(nodes: &[Node], start: Instant) -> f64 {
    eventually(
        Duration::from_secs(180),
        "every node at 95% accuracy",
        || {
            let all = nodes.iter().all(|n| {
                n.status()
                    .is_some_and(|s| s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= 0.95)
            });
            all.then(|| start.elapsed().as_secs_f64())
        },
    )
}

/// Three nodes with dense updates, first on unconstrained links, then with every host's link
/// limited to 10 Mbit/s (tbf; netem delay and loss too where the kernel has netem). Dense
/// digits updates every 10 steps to two neighbours need several times 10 Mbit/s, so the limit
/// binds, and the test checks that it does: over the watch, some node sends more than
/// 10 Mbit/s unshaped and none does shaped. Training must go on, and the mesh must stay
/// whole: after every node reached 95%, for the watch every node keeps both peers, loses no
/// member, rejects nothing and bans nobody (a slow link is no offence). The times to 95% are
/// reported, not asserted (timings belong in benchmarks).
#[test]
fn training_goes_on_over_10_mbit_links() {
    let _cores = crate::harness::cpu_sensitive();
    let mut times = Vec::new();
    let mut shaping = String::from("none");
    for shaped in [false, true] {
        let Some(lab) = lab_or_skip("slow links", 3) else {
            return;
        };
        if shaped {
            shaping = lab.shape("10mbit", "20ms", "0.5%").expect("tc");
        }
        let tmp = tempfile::tempdir().expect("tmp");
        let cfg = config(
            tmp.path(),
            "c.toml",
            &[],
            "\n[sync]\ndegree = 2\npublish_every = 10\n",
        );
        let start = Instant::now();
        let nodes = mesh_in(&lab, tmp.path(), &[&cfg, &cfg, &cfg]);
        let secs = time_to_95(&nodes, start);
        for (i, n) in nodes.iter().enumerate() {
            n.wait_status(
                &format!("node {i} with 2 peers"),
                Duration::from_secs(60),
                |s| peers(s) == 2,
            );
        }
        let secs_watched = if shaped {
            WATCH_SLOW_SECS
        } else {
            WATCH_FAST_SECS
        };
        let watch = watch_honest_mesh(&nodes, secs_watched, Node::status);
        watch.assert_honest(if shaped { "10 Mbit/s" } else { "unshaped" }, &nodes);
        // libp2p's counters see payload only: below what crosses the wire, so a working
        // limit keeps them under it (5% for the token bucket's burst).
        let sent_mbit: Vec<f64> = watch
            .first
            .iter()
            .zip(&watch.last)
            .map(|(a, b)| {
                let sent = b["bytes_sent"].as_f64().unwrap_or(0.0)
                    - a["bytes_sent"].as_f64().unwrap_or(0.0);
                sent * 8.0 / watch.secs / 1e6
            })
            .collect();
        eprintln!("shaped={shaped}: sent {sent_mbit:.2?} Mbit/s over the watch");
        if shaped {
            assert!(
                sent_mbit.iter().all(|&r| r <= 10.0 * 1.05),
                "a node sent more than the 10 Mbit/s limit ({shaping}): {sent_mbit:?}"
            );
        } else {
            assert!(
                sent_mbit.iter().any(|&r| r > 10.0),
                "unshaped, no node sends over 10 Mbit/s ({sent_mbit:?}): the limit would not bind"
            );
        }
        for s in &watch.last {
            let secs_up = s["uptime_s"].as_f64().unwrap_or(1.0);
            eprintln!(
                "shaped={shaped}: step {} sent {:.1} Mbit/s on average, accuracy {}, rtt {}",
                step(s),
                s["bytes_sent"].as_f64().unwrap_or(0.0) * 8.0 / secs_up / 1e6,
                s["eval"]["accuracy"],
                s["peers"]["list"]
                    .as_array()
                    .map(|l| l
                        .iter()
                        .map(|p| p["rtt_ms"].to_string())
                        .collect::<Vec<_>>()
                        .join(","))
                    .unwrap_or_default()
            );
        }
        times.push(secs);
    }
    eprintln!(
        "time to 95% (start to every node): unconstrained {:.1} s, {shaping}: {:.1} s ({:.2}x)",
        times[0],
        times[1],
        times[1] / times[0]
    );
}

/// How long the slow-links test watches the shaped mesh after it reached 95%.
const WATCH_SLOW_SECS: u64 = 30;
/// How long it watches the unshaped mesh: long enough to measure what it sends.
const WATCH_FAST_SECS: u64 = 15;

/// mDNS is opt-in and, in tests, only ever runs inside the lab's namespaces: two hosts with
/// `--mdns` and no bootstrap address find each other on the lab's LAN; a third without it is
/// neither found nor finds anyone.
#[test]
fn mdns_finds_peers_on_a_lab_lan_only_when_asked() {
    let Some(lab) = lab_or_skip("mDNS discovery", 3) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(tmp.path(), "c.toml", &[], "");
    let c = cfg.to_str().expect("utf8");
    let start_host = |i: usize, extra: &[&str]| {
        let mut args = vec!["--config", c];
        args.extend_from_slice(extra);
        let mut n = Node::start_in(
            Some(lab.ns(i)),
            &lab.listen(i),
            &tmp.path().join(format!("m{i}")),
            &args,
        );
        n.wait_api();
        n
    };
    let a = start_host(0, &["--mdns"]);
    let b = start_host(1, &["--mdns"]);
    let quiet = start_host(2, &[]);
    for n in [&a, &b] {
        n.wait_status("found by mDNS", Duration::from_secs(60), |s| peers(s) == 1);
    }
    assert!(
        a.log_text().contains("mDNS") || b.log_text().contains("mDNS"),
        "{}",
        a.log_text()
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(peers(&quiet.status().expect("status")), 0);
    for n in [&a, &b] {
        assert_eq!(
            peers(&n.status().expect("status")),
            1,
            "the quiet host was found"
        );
    }
}

/// A suite stopped by SIGTERM (Ctrl-C, a CI timeout) mid-test leaves nothing behind: the
/// integration binary runs the partition test as a child, which is stopped once its lab and
/// nodes are up; its namespaces are gone and its nodes dead.
#[test]
fn a_suite_stopped_by_sigterm_leaves_no_node_or_namespace_behind() {
    let test = "a_suite_stopped_by_sigterm_leaves_no_node_or_namespace_behind";
    // Only to learn that labs can be built here (root, `ip netns`).
    if lab_or_skip(test, 1).is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "partition::a_mesh_split_in_two_trains_on_and_reconverges_after_healing",
        ])
        .env("P2PTRAIN_BIN", crate::harness::bin())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the suite");
    let pid = child.id();
    let namespaces = || p2ptrain_netlab::labs_of(pid).expect("ip netns list");
    let node = eventually(
        Duration::from_secs(60),
        "the child's lab and a node",
        || {
            let up = !namespaces().is_empty();
            up.then(|| crate::harness::child_with_arg(pid, "join"))
                .flatten()
        },
    );
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(st.success());
    let status = child.wait().expect("wait");
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    assert_eq!(status.code(), Some(143), "exit as SIGTERM would: {err}");
    assert!(err.contains("stopped by a signal"), "{err}");
    assert!(namespaces().is_empty(), "left behind: {:?}", namespaces());
    eventually(Duration::from_secs(10), "the child's node gone", || {
        let stat = std::fs::read_to_string(format!("/proc/{node}/stat")).unwrap_or_default();
        // Gone, or a zombie waiting for init to reap it.
        (stat.is_empty()
            || stat
                .rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
        .then_some(())
    });
}
