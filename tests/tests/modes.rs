//! The synchronous sync modes (`allreduce`, `ddp`, `diloco`, `fedavg`) with real daemons:
//! members of an all-reduce, of `ddp` and of federated averaging hold bit-identical
//! parameters, survive a member's death and take in a newcomer; DiLoCo and federated averaging
//! train a mesh of nodes that each hold only four of the ten digits to an accuracy no lone node
//! on such a part reaches.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{eventually, skip_or_fail, Node};
use crate::mesh::{config, listen_addr, peers, start};
use crate::observe::{have_parser, named_sample, parse_metrics};

/// The digits config in sync mode `mode`, node `k` of 3 holding its own third of the data
/// (`partition` says how it is cut), plus `sync` lines for the `[sync]` table.
fn mode_config(dir: &Path, mode: &str, k: usize, partition: &str, sync: &str) -> PathBuf {
    config(
        dir,
        &format!("{mode}-{partition}-{k}.toml"),
        &[
            ("threads = 1", &format!("threads = 1\nshard = \"{k}/3\"")),
            (
                "split_seed = 1",
                &format!("split_seed = 1\npartition = \"{partition}\""),
            ),
            ("eval_every = 500", "eval_every = 100"),
        ],
        &format!("\n[sync]\nmode = \"{mode}\"\n{sync}\n"),
    )
}

fn rounds(s: &Value) -> &Value {
    &s["rounds"]
}

fn completed(s: &Value) -> u64 {
    rounds(s)["completed"].as_u64().unwrap_or(0)
}

fn accuracy(s: &Value) -> f64 {
    s["eval"]["accuracy"].as_f64().unwrap_or(0.0)
}

/// Each node's parameter digests by round, from status: the parameters' digest and the
/// digest of the ring's member list.
pub(crate) fn digests(s: &Value) -> BTreeMap<u64, (String, String)> {
    rounds(s)["digests"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| {
                    let params = d[1].as_str()?.to_string();
                    Some((d[0].as_u64()?, (params, d[2].as_str()?.to_string())))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until the nodes have a recent round they all completed in one ring (the same
/// member list) and asserts they hold the same bits after it, the ring's promise; returns
/// that round. (Members that sat apart for a while, each in a ring of its own or with
/// others, digest the same round in different rings, which promise each other nothing.)
pub(crate) fn assert_identical(nodes: &[&Node]) -> u64 {
    let (round, by_node) = eventually(
        Duration::from_secs(60),
        "a recent round every node completed in one ring",
        || {
            let all: Vec<BTreeMap<u64, (String, String)>> = nodes
                .iter()
                .map(|n| n.status().map(|s| digests(&s)))
                .collect::<Option<_>>()?;
            let common = all[0].iter().rev().find_map(|(r, (_, ring))| {
                all.iter()
                    .all(|d| d.get(r).is_some_and(|(_, other)| other == ring))
                    .then_some(*r)
            })?;
            Some((common, all))
        },
    );
    let at: Vec<&String> = by_node.iter().map(|d| &d[&round].0).collect();
    eprintln!("round {round}: parameter digests {at:?}");
    assert!(
        at.iter().all(|d| *d == at[0]),
        "members of an all-reduce differ after round {round}: {at:?}"
    );
    round
}

/// Three `allreduce` nodes: after every round all hold the very same parameters (digests of
/// their bits agree, so the consensus distance is 0). Killing one makes the other two abort
/// the round under way and go on without it, no attempt waiting the stall timeout for it (the
/// connection closes at once on a kill; retry after 0.2 s); a newcomer then joins at a round boundary with the
/// current state and holds the same bits as the others from its first round on.
#[test]
fn allreduce_members_hold_identical_parameters_through_a_kill_and_a_join() {
    members_hold_identical_parameters_through_a_kill_and_a_join("allreduce");
}

/// The same for `ddp`: the members sum gradients each step and take the same optimizer step,
/// so they hold the same bits (digested every 10th round); a newcomer takes the members'
/// parameters and optimizer state at the next parameter round (every 25) and the same bits
/// from then on.
#[test]
fn ddp_members_hold_identical_parameters_through_a_kill_and_a_join() {
    members_hold_identical_parameters_through_a_kill_and_a_join("ddp");
}

/// The same for `fedavg`: the sample-weighted mean after each local epoch leaves every member
/// the same bits, through a kill and a join.
#[test]
fn fedavg_members_hold_identical_parameters_through_a_kill_and_a_join() {
    members_hold_identical_parameters_through_a_kill_and_a_join("fedavg");
}

/// The same for `diloco`: every member takes its outer step from the same round start and
/// velocity, so all hold the same bits after each round; a newcomer (and the two nodes that
/// join the founder at the start) gets the members' round start and velocity in the first
/// round it takes part in, which carries them because it says it needs them.
#[test]
fn diloco_members_hold_identical_parameters_through_a_kill_and_a_join() {
    members_hold_identical_parameters_through_a_kill_and_a_join("diloco");
}

fn members_hold_identical_parameters_through_a_kill_and_a_join(mode: &str) {
    // Three nodes at full speed load both cores; nothing asserted hangs on the CPU they get
    // (rounds and stall counts, not seconds), so they may run beside other such tests.
    let _cores = crate::harness::cpu_hog();
    let tmp = tempfile::tempdir().expect("tmp");
    // Every node the same config but its own third of the data.
    let cfgs: Vec<PathBuf> = (0..3)
        .map(|k| mode_config(tmp.path(), mode, k, "iid", ""))
        .collect();
    let a = start(tmp.path(), "a", &cfgs[0], None, &[]);
    let addr = listen_addr(&a);
    let b = start(tmp.path(), "b", &cfgs[1], Some(&addr), &[]);
    let mut c = start(tmp.path(), "c", &cfgs[2], Some(&addr), &[]);
    for n in [&a, &b, &c] {
        n.wait_status("rounds of three", Duration::from_secs(90), |s| {
            rounds(s)["ring_size"].as_u64() == Some(3) && completed(s) > 20
        });
    }
    let round = assert_identical(&[&a, &b, &c]);
    eprintln!("three members agree at round {round}");
    for n in [&a, &b, &c] {
        let s = n.status().expect("status");
        assert_eq!(s["sync"]["mode"], mode, "{s}");
        // No gossip in this mode: the rounds carry everything.
        assert_eq!(s["updates"]["sent"].as_u64(), Some(0), "{s}");
        assert!(rounds(&s)["bytes_sent"].as_u64().unwrap_or(0) > 0, "{s}");
    }

    // A member dies mid-run.
    let stalls = |s: &Value| rounds(s)["aborted"]["stalled"].as_u64().unwrap_or(0);
    let (before, stalls_before): (Vec<u64>, Vec<u64>) = [&a, &b]
        .iter()
        .map(|n| {
            let s = n.status().expect("status");
            (completed(&s), stalls(&s))
        })
        .unzip();
    c.kill9();
    let killed = Instant::now();
    for (n, done) in [&a, &b].iter().zip(&before) {
        n.wait_status(
            "rounds of two after the kill",
            Duration::from_secs(30),
            |s| rounds(s)["ring_size"].as_u64() == Some(2) && completed(s) > done + 20,
        );
    }
    eprintln!(
        "two members went on {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    );
    for (n, stalls_before) in [&a, &b].iter().zip(&stalls_before) {
        let s = n.status().expect("status");
        // The round under way aborts when the dead member's connection closes, and the retry
        // leaves it out: no attempt waited the stall timeout for it.
        assert_eq!(
            stalls(&s),
            *stalls_before,
            "an attempt stalled on the dead member instead of aborting as its connection closed: {}",
            rounds(&s)["aborted"]
        );
        assert_eq!(peers(&s), 1, "{s}");
        let aborted: u64 = rounds(&s)["aborted"]
            .as_object()
            .map(|m| m.values().filter_map(Value::as_u64).sum())
            .unwrap_or(0);
        eprintln!("aborted attempts: {}", rounds(&s)["aborted"]);
        assert!(aborted <= 50, "the kill cost {aborted} attempts: {s}");
    }
    assert_identical(&[&a, &b]);

    // A newcomer joins through a survivor.
    // The newcomer takes the dead member's third.
    let d = start(tmp.path(), "d", &cfgs[2], Some(&listen_addr(&b)), &[]);
    // Synced, and well past the round that synced it, so that the newest round every node
    // digested is one it took part in as a member.
    d.wait_status("the newcomer in the rounds", Duration::from_secs(60), |s| {
        completed(s) > 60
            && rounds(s)["ring_size"].as_u64() == Some(3)
            && rounds(s)["synced"].as_bool() == Some(true)
    });
    let s = d.status().expect("status");
    assert!(
        s["state_download"]["bytes"].as_u64().unwrap_or(0) > 0,
        "the newcomer did not download the state: {s}"
    );
    assert_identical(&[&a, &b, &d]);
}

/// `ddp` with one box that computes far slower than the other (a per-sample throttle inside
/// its forward-backward pass): it takes a smaller batch, the fast one keeps the whole batch,
/// and both still hold the same bits, with nothing rejected and nobody banned.
#[test]
fn a_slow_ddp_member_takes_a_smaller_batch_and_the_members_stay_identical() {
    let tmp = tempfile::tempdir().expect("tmp");
    let sync = "\n[sync]\nmode = \"ddp\"\nmin_members = 2\n";
    let every = [("eval_every = 500", "eval_every = 100")];
    let fast = config(tmp.path(), "fast.toml", &every, sync);
    // About 300 µs a sample on top of a few: tens of times the fast member's.
    let slow = config(
        tmp.path(),
        "slow.toml",
        &every,
        &format!("sample_delay_us = 300\n{sync}"),
    );
    let a = start(tmp.path(), "a", &fast, None, &[]);
    let b = start(tmp.path(), "b", &slow, Some(&listen_addr(&a)), &[]);
    let batch = |s: &Value| rounds(s)["batch"].as_u64().unwrap_or(0);
    let sb = b.wait_status(
        "the slow member on a smaller batch",
        Duration::from_secs(90),
        |s| completed(s) > 50 && (1..32).contains(&batch(s)),
    );
    let sa = a.wait_status(
        "the fast member in the same rounds",
        Duration::from_secs(30),
        |s| completed(s) > 50,
    );
    eprintln!(
        "batches: fast {} ({} ms a sample), slow {} ({} ms a sample)",
        batch(&sa),
        sa["ms_per_sample"],
        batch(&sb),
        sb["ms_per_sample"]
    );
    assert_eq!(
        batch(&sa),
        32,
        "the fastest member keeps the whole batch: {sa}"
    );
    // Never below an eighth of the batch, whatever the speeds (`rounds::MAX_SHRINK`).
    assert!(batch(&sb) >= 4, "{sb}");
    let ms = |s: &Value| s["ms_per_sample"].as_f64().unwrap_or(0.0);
    assert!(
        ms(&sb) > 2.0 * ms(&sa),
        "the throttle shows in the pass's timing: {sb}"
    );
    assert_identical(&[&a, &b]);
    for n in [&a, &b] {
        let s = n.status().expect("status");
        assert_eq!(peers(&s), 1, "{s}");
        assert_eq!(s["updates"]["rejected"].as_u64(), Some(0), "{s}");
        assert_eq!(s["banned_peers"].as_array().map_or(0, Vec::len), 0, "{s}");
    }
    // `/metrics` shows the rounds: the counter, and a histogram of their durations that
    // counts each of them once, read by a real OpenMetrics parser.
    if !have_parser() {
        skip_or_fail(
            "a_slow_ddp_member_takes_a_smaller_batch (metrics)",
            "the Python Prometheus client is not installed (pip install prometheus-client)",
        );
        return;
    }
    let text = b.http_get("/metrics").expect("GET /metrics");
    let metrics = parse_metrics(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let rounds_total = named_sample(
        &metrics,
        "p2ptrain_rounds_completed",
        "p2ptrain_rounds_completed_total",
    );
    let histogram_count = named_sample(
        &metrics,
        "p2ptrain_round_duration_seconds",
        "p2ptrain_round_duration_seconds_count",
    );
    assert!(
        rounds_total.is_some_and(|n| n > 50.0),
        "rounds counter {rounds_total:?}"
    );
    assert_eq!(
        rounds_total, histogram_count,
        "the round histogram counts every completed round once"
    );
    assert_eq!(
        metrics["p2ptrain_round_duration_seconds"]["type"], "histogram",
        "{text}"
    );
    assert!(
        named_sample(
            &metrics,
            "p2ptrain_training_learning_rate",
            "p2ptrain_training_learning_rate"
        )
        .is_some_and(|lr| lr > 0.0),
        "no learning rate in\n{text}"
    );
}

/// A `diloco` ring of two over a 17 M-parameter MLP (widths 64-4096-4096-10). The newcomer
/// needs the members' round start and velocity, so the round it joins carries each member's
/// state: a share of 25.5 M values, 102 MB, past the 64 MiB that once bounded every request
/// (a receiver refused each such hop, and no round of two could complete). The hops travel
/// in pieces of 16 MiB (`wire::RING_PIECE_BYTES`); the two complete rounds together and hold
/// the same bits, and nobody is blamed for a piece.
#[test]
fn a_diloco_ring_carries_a_large_models_state_in_pieces() {
    let _cores = crate::harness::cpu_sensitive();
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(
        tmp.path(),
        "large.toml",
        // At the digits' learning rate (0.05) a lone node of this width diverges within a
        // few hundred steps.
        &[
            ("widths = [64, 128, 10]", "widths = [64, 4096, 4096, 10]"),
            ("lr = 0.05", "lr = 0.005"),
        ],
        "\n[sync]\nmode = \"diloco\"\ninner_steps = 10\n",
    );
    let a = start(tmp.path(), "a", &cfg, None, &[]);
    let b = start(tmp.path(), "b", &cfg, Some(&listen_addr(&a)), &[]);
    let joined = Instant::now();
    let sb = b.wait_status(
        "the newcomer in rounds of two",
        Duration::from_secs(120),
        |s| {
            rounds(s)["ring_size"].as_u64() == Some(2)
                && rounds(s)["synced"].as_bool() == Some(true)
                && completed(s) >= 3
        },
    );
    eprintln!(
        "the newcomer completed {} rounds of two {:.1} s after it started; sent {} bytes of hops",
        completed(&sb),
        joined.elapsed().as_secs_f64(),
        rounds(&sb)["bytes_sent"]
    );
    assert_identical(&[&a, &b]);
    for n in [&a, &b] {
        let s = n.status().expect("status");
        assert_eq!(
            s["model"]["params"].as_u64(),
            Some(17_088_522),
            "{}",
            s["model"]
        );
        // At least the round that carried the state: a share of three times half the model.
        assert!(
            rounds(&s)["bytes_sent"].as_u64().unwrap_or(0) > 100_000_000,
            "{}",
            rounds(&s)
        );
        assert_no_offences(&s);
    }
}

/// Starts three nodes of `mode` on their parts of the digits and waits until each has
/// evaluated at `target` or better; returns their statuses.
fn three_reach(mode: &str, partition: &str, sync: &str, target: f64) -> Vec<Value> {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfgs: Vec<PathBuf> = (0..3)
        .map(|k| mode_config(tmp.path(), mode, k, partition, sync))
        .collect();
    let a = start(tmp.path(), "a", &cfgs[0], None, &[]);
    let addr = listen_addr(&a);
    let b = start(tmp.path(), "b", &cfgs[1], Some(&addr), &[]);
    let c = start(tmp.path(), "c", &cfgs[2], Some(&addr), &[]);
    let nodes = [&a, &b, &c];
    let t0 = Instant::now();
    let statuses = eventually(
        Duration::from_secs(180),
        &format!("every {mode} node at {target} held-out accuracy after a round of three"),
        || {
            let st: Vec<Value> = nodes.iter().map(|n| n.status()).collect::<Option<_>>()?;
            st.iter()
                .all(|s| {
                    accuracy(s) >= target
                        && completed(s) > 0
                        && rounds(s)["ring_size"].as_u64() == Some(3)
                })
                .then_some(st)
        },
    );
    eprintln!(
        "{mode} on {partition} data: after {:.1} s (step, rounds, accuracy) {:?}",
        t0.elapsed().as_secs_f64(),
        statuses
            .iter()
            .map(|s| (s["step"].clone(), completed(s), accuracy(s)))
            .collect::<Vec<_>>()
    );
    eprintln!(
        "{mode} on {partition} data: parts beyond the clipping radius {:?}",
        statuses
            .iter()
            .map(|s| rounds(s)["parts_clipped"].clone())
            .collect::<Vec<_>>()
    );
    for s in &statuses {
        assert_eq!(s["sync"]["mode"], mode, "{s}");
        assert_eq!(peers(s), 2, "{s}");
        // Members that each hold other classes are far apart, and still honest: none of
        // their parts is refused, none of them blamed.
        assert_eq!(rounds(s)["parts_refused"], 0, "{s}");
        assert_no_offences(s);
    }
    statuses
}

/// DiLoCo: 50 local steps, then an outer Nesterov step on the members' mean change, where each
/// node holds only four of the ten digits (the lone-node control, below 60%, is in `skewed`):
/// every node of the mesh reaches 90%, which it can only with what the others learned.
#[test]
fn diloco_on_a_few_classes_per_node_reaches_90_percent_everywhere() {
    let statuses = three_reach("diloco", "by_label", "inner_steps = 50", 0.9);
    assert_four_classes_each(&statuses);
}

/// Federated averaging where each node holds only four of the ten digits (the lone-node
/// control, below 60%, is in `skewed`): every node of the mesh reaches 90%.
#[test]
fn fedavg_on_a_few_classes_per_node_reaches_90_percent_everywhere() {
    let statuses = three_reach("fedavg", "by_label", "", 0.9);
    assert_four_classes_each(&statuses);
}

/// No peer in `s`'s list has an offence to its name.
fn assert_no_offences(s: &Value) {
    for p in s["peers"]["list"].as_array().into_iter().flatten() {
        assert_eq!(p["offences"].as_u64().unwrap_or(0), 0, "{p}");
    }
}

/// Each node trained on four of the ten digits only.
fn assert_four_classes_each(statuses: &[Value]) {
    for s in statuses {
        let held = s["train_classes"]
            .as_array()
            .map(|c| c.iter().filter(|n| n.as_u64().unwrap_or(0) > 0).count())
            .unwrap_or(0);
        assert_eq!(held, 4, "{}", s["train_classes"]);
    }
}
