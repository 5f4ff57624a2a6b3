//! A flood: one peer of the run sends subscriptions and bulk requests, then heartbeats too,
//! as fast as it can at one node of a three-node mesh whose third node gets a fifth of the CPU. The
//! flooded node keeps training, answers status, keeps its honest peers and stops when asked;
//! nobody bans the starved honest node, and the flooder is banned for its heartbeats. The
//! flooded node declines the requests beyond the flooder's share of its service; no honest
//! node declines any.
//! Latencies, rates, the time to the ban, the lowest score the flooded node gave the starved
//! one and the gossip score penalties it handed out go to `flood.json` beside the test
//! binary's scratch files, not into asserts. `FLOOD_KEEP_LOGS=DIR` copies the three nodes'
//! logs there (with `P2PTRAIN_TEST_LOG=info,libp2p_gossipsub::peer_score=debug` they name
//! each penalty and its peer).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{Node, Throttle};
use crate::mesh::{config, listen_addr, peers, start, step};
use crate::rogue::Rogue;

/// How long the rogue floods, in CI. `P2PTRAIN_FLOOD_SECS=60` (or more) runs the longer
/// variant.
const FLOOD_SECS: u64 = 30;
/// How long before the flood's end its heartbeats join it: they get the rogue banned within
/// a second, so the requests and subscriptions go first, alone.
const HEARTBEATS_LAST: Duration = Duration::from_secs(10);

/// How long the rogue floods: [`FLOOD_SECS`], or `P2PTRAIN_FLOOD_SECS`.
fn flood_for() -> Duration {
    let secs = std::env::var("P2PTRAIN_FLOOD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FLOOD_SECS);
    Duration::from_secs(secs.max(HEARTBEATS_LAST.as_secs() + 1))
}

/// The flooded node's resident memory must stay under this (it trains the digits MLP in
/// about 60 MB unflooded): a flood must not make it buffer without bound.
const RSS_BOUND_KIB: u64 = 512 * 1024;

fn peer_id(n: &Node) -> String {
    n.status().expect("status")["peer_id"]
        .as_str()
        .expect("peer id")
        .to_string()
}

/// The gossip score `s`'s node gives `peer`, if it lists it.
fn score_of(s: &Value, peer: &str) -> Option<f64> {
    s["peers"]["list"]
        .as_array()?
        .iter()
        .find(|p| p["peer_id"] == peer)?["score"]
        .as_f64()
}

/// Gossipsub's count of each kind of score penalty the node has handed out (grafts during a
/// backoff, broken promises, ...), read from its `/metrics`: what a ban without a rejected
/// message was for.
fn score_penalties(n: &Node) -> Value {
    let text = n.http_get("/metrics").unwrap_or_default();
    let counts: serde_json::Map<String, Value> = text
        .lines()
        .filter(|l| l.contains("scoring_penalties") && !l.starts_with('#'))
        .filter_map(|l| {
            let (name, count) = l.rsplit_once(' ')?;
            Some((name.to_string(), json!(count.parse::<f64>().ok()?)))
        })
        .collect();
    Value::Object(counts)
}

/// Bulk requests the node declined because their peer asked beyond its share.
fn declined(s: &Value) -> u64 {
    s["requests_declined"]
        .as_u64()
        .expect("requests_declined in status")
}

fn lists(s: &Value, list: &str, peer: &str) -> bool {
    s[list]
        .as_array()
        .is_some_and(|l| l.iter().any(|p| p["peer_id"] == peer))
}

#[test]
fn a_flooded_node_keeps_training_answering_and_its_peers_and_stops_when_asked() {
    let _cores = crate::harness::cpu_sensitive();
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(tmp.path(), "c.toml", &[], "");
    let mut a = start(tmp.path(), "a", &cfg, None, &[]);
    let addr = listen_addr(&a);
    let b = start(tmp.path(), "b", &cfg, Some(&addr), &[]);
    let c = start(tmp.path(), "c", &cfg, Some(&addr), &[]);
    let period = Duration::from_millis(100);
    let _starved = Throttle::start(c.pid().expect("c runs"), period * 4 / 5, period);
    let (b_id, c_id) = (peer_id(&b), peer_id(&c));
    a.wait_status("a sees b and c", Duration::from_secs(60), |s| peers(s) >= 2);
    let rogue = Rogue::join(&cfg, &addr);
    let rogue_id = rogue.id.to_string();
    let target: libp2p::PeerId = peer_id(&a).parse().expect("peer id");
    let before = a.wait_status("a takes the rogue in", Duration::from_secs(60), |s| {
        peers(s) >= 3
    });

    let flood_for = flood_for();
    let heartbeats_after = flood_for - HEARTBEATS_LAST;
    let flood = rogue.flood(target, flood_for, heartbeats_after);
    let started = Instant::now();
    let mut polls = Vec::new();
    let mut unanswered = 0;
    let mut rss_max = 0;
    let mut banned_after = None;
    // The lowest score the flooded node gives the starved honest node, and when.
    let mut c_lowest: Option<(f64, f64)> = None;
    let mut last = before.clone();
    while started.elapsed() < flood_for {
        let asked = Instant::now();
        match a.status_http() {
            Some(s) => {
                polls.push(asked.elapsed().as_secs_f64());
                if banned_after.is_none() && lists(&s, "banned_peers", &rogue_id) {
                    // From the start of the heartbeat flood.
                    banned_after = Some(
                        (started.elapsed() - heartbeats_after.min(started.elapsed())).as_secs_f64(),
                    );
                }
                if let Some(score) = score_of(&s, &c_id) {
                    if c_lowest.is_none_or(|(low, _)| score < low) {
                        c_lowest = Some((score, started.elapsed().as_secs_f64()));
                    }
                }
                last = s;
            }
            None => unanswered += 1,
        }
        rss_max = rss_max.max(a.rss_kib().unwrap_or(0));
        std::thread::sleep(Duration::from_millis(500));
    }
    let flooded_for = started.elapsed().as_secs_f64();
    let sent = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    let (heartbeats, subscriptions, requests) = (
        sent(&flood.heartbeats),
        sent(&flood.subscriptions),
        sent(&flood.requests),
    );
    polls.sort_by(f64::total_cmp);
    let steps = step(&last).saturating_sub(step(&before));
    let report = json!({
        "flood_secs": flooded_for,
        "heartbeats": heartbeats,
        "subscriptions": subscriptions,
        "requests_answered": requests,
        "requests_declined_by_a": declined(&last),
        "status_polls": polls.len(),
        "status_unanswered": unanswered,
        "status_median_secs": polls.get(polls.len() / 2),
        "status_max_secs": polls.last(),
        "steps_during_flood": steps,
        "rss_max_kib": rss_max,
        "rogue_banned_after_secs": banned_after,
        "c_lowest_score_at_a": c_lowest.map(|(score, _)| score),
        "c_lowest_score_at_a_secs": c_lowest.map(|(_, at)| at),
        "score_penalties_at_a": score_penalties(&a),
    });
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("flood.json");
    std::fs::write(&out, report.to_string()).expect("flood.json");
    eprintln!("flood: {report}");
    if let Ok(keep) = std::env::var("FLOOD_KEEP_LOGS") {
        for (name, node) in [("a", &a), ("b", &b), ("c", &c)] {
            let _ = std::fs::copy(&node.log, format!("{keep}/{name}.log"));
        }
    }

    assert!(
        heartbeats + subscriptions + requests > 1000,
        "the rogue flooded: {report}"
    );
    assert_eq!(
        unanswered, 0,
        "status went unanswered under the flood: {report}"
    );
    assert!(
        steps >= 1000,
        "the flooded node kept training: {steps} steps in {flooded_for:.0} s"
    );
    assert!(rss_max < RSS_BOUND_KIB, "resident memory: {report}");
    // Heartbeats beyond their author's rate, sent by the author itself, are penalised: the
    // score falls and the rogue is banned, the reason in status.
    let ban = last["banned_peers"]
        .as_array()
        .and_then(|l| l.iter().find(|b| b["peer_id"] == rogue_id.as_str()))
        .unwrap_or_else(|| panic!("the rogue was not banned: {report}"));
    assert!(
        ban["reason"]
            .as_str()
            .is_some_and(|r| r.contains("heartbeats above")),
        "the ban names the heartbeat flood: {ban}"
    );
    for (name, node) in [("a", &a), ("b", &b)] {
        let s = node.status().expect("status");
        assert!(
            !lists(&s, "banned_peers", &c_id),
            "{name} banned the starved honest node: {s}"
        );
    }
    // The flooder asked beyond its share of the flooded node's service and was declined;
    // the honest nodes, which ask each other for syncs, never were.
    assert!(
        declined(&last) > 0,
        "the flooded node declined none of the flood's requests: {report}"
    );
    for (name, node) in [("b", &b), ("c", &c)] {
        let s = node.status().expect("status");
        assert_eq!(
            declined(&s),
            0,
            "{name} declined an honest member's request: {s}"
        );
    }
    let s = a.wait_status("a with both honest peers", Duration::from_secs(30), |s| {
        let listed = |id: &str| {
            s["peers"]["list"]
                .as_array()
                .is_some_and(|l| l.iter().any(|p| p["peer_id"] == id))
        };
        listed(&b_id) && listed(&c_id)
    });
    assert!(!lists(&s, "banned_peers", &b_id), "{s}");
    let (st, _, err) = a.cli(&["stop"], Duration::from_secs(30));
    assert!(st.success(), "stop: {err}");
    let exit = a.wait_exit(Duration::from_secs(30));
    assert!(exit.success(), "the flooded node's exit: {exit}");
}
