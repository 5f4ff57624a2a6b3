//! NAT traversal on test hosts in network namespaces (see `netlab`): two hosts behind
//! masquerading home routers join a mesh of two reachable hosts. Skips with a printed reason
//! where namespaces or iptables are missing.

use std::time::Duration;

use serde_json::Value;

use crate::harness::Node;
use crate::mesh::{config, peers, step};
use crate::netlab::{lab_or_skip, Lab};
use crate::partition::lab_addr;

fn nat(s: &Value) -> &Value {
    &s["nat"]
}

fn reachability(s: &Value) -> &str {
    nat(s)["reachability"].as_str().unwrap_or("")
}

/// The peer entry for `id` in a status, if connected.
fn peer<'a>(s: &'a Value, id: &str) -> Option<&'a Value> {
    s["peers"]["list"]
        .as_array()?
        .iter()
        .find(|p| p["peer_id"] == id)
}

fn start(
    ns: &str,
    listen: &str,
    dir: &std::path::Path,
    cfg: &str,
    bootstrap: Option<&str>,
) -> Node {
    let mut args = vec!["--config", cfg];
    if let Some(b) = bootstrap {
        args.extend(["--bootstrap", b]);
    }
    let mut node = Node::start_in(Some(ns), listen, dir, &args);
    node.wait_api();
    node
}

fn id(node: &Node) -> String {
    node.status().expect("status")["peer_id"]
        .as_str()
        .expect("peer id")
        .to_string()
}

/// Hosts 0 and 1 are reachable; hosts 2 and 3 sit behind NATs (see the module docs).
#[test]
fn nodes_behind_nats_join_learn_they_are_private_listen_through_a_relay_and_train() {
    let Some(mut lab) = lab_or_skip("NAT traversal", 4) else {
        return;
    };
    let (nat2, nat3) = match (lab.behind_nat(2), lab.behind_nat(3)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(why), _) | (_, Err(why)) => {
            eprintln!("SKIPPED NAT traversal: {why}");
            return;
        }
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(tmp.path(), "c.toml", &[], "");
    let c = cfg.to_str().expect("utf8");
    let lab: &Lab = &lab;
    let a = start(lab.ns(0), &lab.listen(0), &tmp.path().join("a"), c, None);
    let bootstrap = lab_addr(&a, &lab.addr(0));
    let b = start(
        lab.ns(1),
        &lab.listen(1),
        &tmp.path().join("b"),
        c,
        Some(&bootstrap),
    );
    let behind = start(
        &nat2,
        &format!("/ip4/{}/tcp/0", lab.private_addr(2)),
        &tmp.path().join("c"),
        c,
        Some(&bootstrap),
    );
    let behind_id = id(&behind);

    // It joins: every connection it has, it dialled out through its router.
    behind.wait_status("both reachable peers", Duration::from_secs(60), |s| {
        peers(s) == 2
    });
    let seen = a.wait_status("the NATed peer", Duration::from_secs(30), |s| {
        peer(s, &behind_id).is_some()
    });
    let entry = peer(&seen, &behind_id).expect("entry");
    assert_eq!(entry["path"], "direct", "{entry}");
    let remote = entry["remote"].as_str().unwrap_or("");
    assert!(
        remote.starts_with(&format!("/ip4/{}/tcp/", lab.addr(2))),
        "the reachable node sees the router's address, not {}: {entry}",
        lab.private_addr(2)
    );

    // AutoNAT: the reachable ones learn so by being dialled back; the NATed one cannot be.
    let s = behind.wait_status("AutoNAT: private", Duration::from_secs(90), |s| {
        reachability(s) == "private"
    });
    eprintln!("NATed node: {}", nat(&s));
    for n in [&a, &b] {
        let s = n.wait_status("AutoNAT: public", Duration::from_secs(90), |s| {
            reachability(s) == "public"
        });
        eprintln!("reachable node: {}", nat(&s));
    }

    // The private node listens through a relay (one of the reachable members).
    let s = behind.wait_status("a relay address", Duration::from_secs(90), |s| {
        nat(s)["relay_addrs"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    });
    let relay_addr = nat(&s)["relay_addrs"][0]
        .as_str()
        .expect("addr")
        .to_string();
    assert!(relay_addr.contains("/p2p-circuit/"), "{relay_addr}");

    // A second NATed node cannot dial the first directly: it reaches it through the relay
    // address the mesh learned, and hole punching may make the path direct.
    let second = start(
        &nat3,
        &format!("/ip4/{}/tcp/0", lab.private_addr(3)),
        &tmp.path().join("d"),
        c,
        Some(&bootstrap),
    );
    let second_id = id(&second);
    let relayed = |n: &Node| {
        n.status()
            .map(|s| nat(&s)["relayed_connections"].as_u64().unwrap_or(0))
            .unwrap_or(0)
    };
    second.wait_status("the reachable peers", Duration::from_secs(60), |s| {
        peers(s) >= 2
    });
    crate::harness::eventually(
        Duration::from_secs(90),
        "a relayed connection between the NATed nodes",
        || (relayed(&behind) + relayed(&second) > 0).then_some(()),
    );

    // Both NATed nodes train with the mesh: their steps advance and they apply the others'
    // updates, which reach them over their direct connections to the reachable nodes.
    for n in [&behind, &second] {
        let s0 = n.status().expect("status");
        let (step0, applied0) = (step(&s0), s0["updates"]["applied"].as_u64().unwrap_or(0));
        n.wait_status("training with the mesh", Duration::from_secs(90), |s| {
            step(s) > step0 + 100 && s["updates"]["applied"].as_u64().unwrap_or(0) > applied0
        });
    }
    // Hole punching (DCUtR) ran over the relayed connection: where it succeeded, `peers`
    // shows the other NATed node as direct; where it failed, the failure is counted (the two
    // then reach each other through the reachable nodes' gossip).
    let (mut punched, mut failed) = (0, 0);
    for n in [&behind, &second] {
        let s = n.status().expect("status");
        punched += nat(&s)["hole_punches"].as_u64().unwrap_or(0);
        failed += nat(&s)["hole_punch_failures"].as_u64().unwrap_or(0);
    }
    assert!(punched + failed > 0, "no hole punch was attempted");
    if punched > 0 {
        behind.wait_status(
            "a direct path after hole punching",
            Duration::from_secs(30),
            |s| peer(s, &second_id).is_some_and(|p| p["path"] == "direct"),
        );
    }
    for (n, other) in [(&behind, &second_id), (&second, &behind_id)] {
        let s = n.status().expect("status");
        eprintln!(
            "NATed node sees the other NATed node as {}; nat {}",
            peer(&s, other).map_or("not connected".into(), |p| p["path"].to_string()),
            nat(&s)
        );
        // No full sync or state chunk went through a relay.
        assert_eq!(nat(&s)["relayed_requests_refused"], 0, "{}", nat(&s));
    }
    eprintln!("NAT log:\n{}", behind.log_text());
}
