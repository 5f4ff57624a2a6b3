//! A hostile sync partner: a rogue neighbour that answers full-sync requests with scaled or
//! random parameters of the right layout. The honest nodes must judge each reply before it is
//! averaged, refuse it, count it per peer, lower the rogue's score until it is banned, and keep
//! syncing with each other. (The honest-outlier side, a healed partition whose syncs must all
//! pass, is checked in `partition`.)

use std::collections::BTreeMap;
use std::time::Duration;

use p2ptrain_daemon::scoring;
use serde_json::Value;

use crate::harness::eventually;
use crate::mesh::rogue::rogue_score;
use crate::mesh::{config, listen_addr, peers, relative_distance, start, step};
use crate::partition::params_now;
use crate::rogue::{Rogue, SyncAnswer};

fn refusals(s: &Value) -> BTreeMap<String, u64> {
    serde_json::from_value(s["sync_refusals"].clone()).unwrap_or_default()
}

fn banned(s: &Value, peer: &str) -> Option<f64> {
    s["banned_peers"]
        .as_array()?
        .iter()
        .find(|b| b["peer_id"] == peer)
        .and_then(|b| b["score"].as_f64())
}

#[test]
fn a_hostile_sync_partner_is_refused_punished_and_syncs_go_on_with_the_honest_peer() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Frequent full syncs: with two neighbours each node tries the rogue about every other
    // sync, so the refusals add up within seconds.
    let cfg = config(
        tmp.path(),
        "c.toml",
        &[],
        "\n[sync]\nfull_sync_every = 200\n",
    );
    let a = start(tmp.path(), "a", &cfg, None, &[]);
    let addr = listen_addr(&a);
    let b = start(tmp.path(), "b", &cfg, Some(&addr), &[]);
    let honest = [&a, &b];
    let ids: Vec<String> = honest
        .iter()
        .map(|n| {
            n.status().expect("status")["peer_id"]
                .as_str()
                .expect("id")
                .to_string()
        })
        .collect();
    for n in honest {
        n.wait_status("an honest sync", Duration::from_secs(60), |s| {
            peers(s) == 1 && s["full_syncs"]["accepted"].as_u64().unwrap_or(0) >= 2
        });
    }
    let r = Rogue::join_serving(
        &cfg,
        &addr,
        &[
            SyncAnswer::Scaled(2.0),
            SyncAnswer::Random,
            SyncAnswer::Scaled(10.0),
            SyncAnswer::Scaled(0.0),
        ],
    );
    let rogue = r.id.to_string();
    // Watch the rogue's score as each honest node sees it, until both have banned it.
    let mut scores: Vec<Vec<f64>> = vec![Vec::new(); 2];
    let mut at_ban: Vec<Option<Value>> = vec![None, None];
    eventually(Duration::from_secs(90), "the rogue banned by both", || {
        for (i, n) in honest.iter().enumerate() {
            if at_ban[i].is_some() {
                continue;
            }
            let s = n.status()?;
            if let Some(score) = rogue_score(&s, &rogue) {
                scores[i].push(score);
            }
            if banned(&s, &rogue).is_some() {
                at_ban[i] = Some(s);
            }
        }
        at_ban.iter().all(Option::is_some).then_some(())
    });
    let at_ban: Vec<Value> = at_ban.into_iter().flatten().collect();
    for (i, s) in at_ban.iter().enumerate() {
        let by_peer = refusals(s);
        let fs = &s["full_syncs"];
        eprintln!(
            "node {i}: rogue scores seen {:?}; banned at {:?}; refusals {by_peer:?}; full syncs {fs}",
            scores[i],
            banned(s, &rogue)
        );
        // Only the rogue was refused, and the count is the total.
        assert_eq!(
            by_peer.keys().collect::<Vec<_>>(),
            vec![&rogue],
            "{by_peer:?}"
        );
        let n = by_peer[&rogue];
        assert!(n >= 2, "{n}");
        assert_eq!(fs["refused"].as_u64(), Some(n), "{fs}");
        // Every answer was beyond the bound: scaled by 2, 10 or 0, or random, is at >= 1.
        let last = &fs["last_refusal"];
        assert_eq!(last["peer"], rogue.as_str(), "{last}");
        let (d, bound) = (
            last["distance"].as_f64().expect("distance"),
            last["bound"].as_f64().expect("bound"),
        );
        assert!(d >= 0.9 && d > bound, "{last}");
        // Its score fell with the refusals (it sent nothing else to reject) until the ban.
        let at = banned(s, &rogue).expect("ban score");
        if let (Some(first), Some(low)) = (
            scores[i].first(),
            scores[i].iter().copied().reduce(f64::min),
        ) {
            assert!(low < *first || low < 0.0, "{:?}", scores[i]);
        }
        assert!(at < scoring::GRAYLIST_THRESHOLD, "{at}");
        assert!(
            s["rejected_by_peer"].get(&rogue).is_none(),
            "the rogue published no update: {}",
            s["rejected_by_peer"]
        );
        assert!(
            n <= 2 * u64::from(scoring::penalties_to_graylist()),
            "the ban came late: {by_peer:?}"
        );
    }
    for n in honest {
        assert!(
            n.log_text().contains("refused neighbour sync"),
            "{}",
            n.log_text()
        );
    }
    // Syncs go on with the honest peer: each node's last sync moves on, with the other.
    for (i, n) in honest.iter().enumerate() {
        let before = at_ban[i]["full_syncs"]["accepted"].as_u64().unwrap_or(0);
        let s0 = step(&at_ban[i]);
        let other = &ids[1 - i];
        let s = n.wait_status(
            "syncs with the honest peer after the ban",
            Duration::from_secs(60),
            |s| {
                s["full_syncs"]["accepted"].as_u64().unwrap_or(0) >= before + 3
                    && s["last_sync"]["peer"] == other.as_str()
                    && s["last_sync"]["step"].as_u64().unwrap_or(0) > s0
            },
        );
        let d = s["consensus_distance"].as_f64().expect("distance");
        let bound = s["full_syncs"]["bound"].as_f64().expect("bound");
        eprintln!(
            "node {i}: consensus distance {d:.4}, bound {bound:.4}, largest accepted {}",
            s["full_syncs"]["largest_accepted"]
        );
        assert!(d < 0.1 && d < bound, "{s}");
        assert_eq!(peers(&s), 1, "{}", s["peers"]);
        assert!(
            s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= 0.9,
            "{}",
            s["eval"]
        );
    }
    // The honest replicas stayed within the bound of each other: none averaged the rogue in.
    let p: Vec<Vec<f32>> = honest.iter().map(|n| params_now(n)).collect();
    let d = relative_distance(&p[0], &p[1]);
    eprintln!("honest nodes {d:.4} apart");
    assert!(d < 0.1, "the honest nodes are {d} apart");
    drop(r);
}
