//! NAT traversal on test hosts in network namespaces (see `netlab`): two hosts behind
//! masquerading home routers join a mesh of two reachable hosts. Skips with a printed reason
//! where namespaces or iptables are missing.

use std::time::Duration;

use serde_json::Value;

use crate::harness::Node;
use crate::mesh::{config, peers, step};
use crate::netlab::{lab_or_skip, Firewall, Lab};
use crate::partition::lab_addr;

/// Seconds the failed-punch test watches for relayed connections after the punch failed:
/// three of its Kademlia walks.
const WATCH_SECS: u64 = 16;

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

/// Two reachable nodes (hosts 0 and 1) and two NAT routers (hosts 2 and 3) with a private
/// host behind each, where the tests start NATed nodes.
struct NatMesh {
    lab: Lab,
    behind: [String; 2],
    tmp: tempfile::TempDir,
    cfg: String,
    bootstrap: String,
    reachable: [Node; 2],
}

impl NatMesh {
    /// The mesh, or `None` after printing why the test is skipped.
    fn start(test: &str, firewall: Firewall) -> Option<NatMesh> {
        let mut lab = lab_or_skip(test, 4)?;
        let behind = match (lab.behind_nat(2, firewall), lab.behind_nat(3, firewall)) {
            (Ok(a), Ok(b)) => [a, b],
            (Err(why), _) | (_, Err(why)) => {
                crate::harness::skip_or_fail(test, &why.to_string());
                return None;
            }
        };
        let tmp = tempfile::tempdir().expect("tmp");
        // Kademlia walks every 5 s, not 30 (`config` ends inside its `[debug]` section), so the
        // failed-punch test sees several walks in a short wait.
        let cfg = config(tmp.path(), "c.toml", &[], "kad_walk_secs = 5\n")
            .to_str()
            .expect("utf8")
            .to_string();
        let a = start(lab.ns(0), &lab.listen(0), &tmp.path().join("a"), &cfg, None);
        let bootstrap = lab_addr(&a, &lab.addr(0));
        let b = start(
            lab.ns(1),
            &lab.listen(1),
            &tmp.path().join("b"),
            &cfg,
            Some(&bootstrap),
        );
        Some(NatMesh {
            lab,
            behind,
            tmp,
            cfg,
            bootstrap,
            reachable: [a, b],
        })
    }

    /// A node behind the NAT of host `host` (2 or 3), joining through host 0.
    fn start_behind(&self, host: usize) -> Node {
        start(
            &self.behind[host - 2],
            &format!("/ip4/{}/tcp/0", self.lab.private_addr(host)),
            &self.tmp.path().join(format!("nat{host}")),
            &self.cfg,
            Some(&self.bootstrap),
        )
    }
}

fn count(nodes: &[&Node], key: &str) -> u64 {
    nodes
        .iter()
        .map(|n| {
            n.status()
                .map(|s| nat(&s)[key].as_u64().unwrap_or(0))
                .unwrap_or(0)
        })
        .sum()
}

fn applied(n: &Node) -> u64 {
    n.status()
        .map(|s| s["updates"]["applied"].as_u64().unwrap_or(0))
        .unwrap_or(0)
}

/// Hosts 0 and 1 are reachable; hosts 2 and 3 sit behind NATs whose routers drop strangers'
/// connections, as home routers do (see the module docs).
#[test]
fn nodes_behind_nats_join_learn_they_are_private_listen_through_a_relay_and_train() {
    let Some(mesh) = NatMesh::start("NAT traversal", Firewall::Drop) else {
        return;
    };
    let lab = &mesh.lab;
    let [a, b] = &mesh.reachable;
    let behind = mesh.start_behind(2);
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
    for n in [a, b] {
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
    let second = mesh.start_behind(3);
    let second_id = id(&second);
    let both = [&behind, &second];
    second.wait_status("the reachable peers", Duration::from_secs(60), |s| {
        peers(s) >= 2
    });
    crate::harness::eventually(
        Duration::from_secs(90),
        "a relayed connection between the NATed nodes",
        || (count(&both, "relayed_connections") > 0).then_some(()),
    );

    // Both NATed nodes train with the mesh: their steps advance and they apply the others'
    // updates, which reach them over their direct connections to the reachable nodes.
    for n in both {
        let s0 = n.status().expect("status");
        let (step0, applied0) = (step(&s0), applied(n));
        n.wait_status("training with the mesh", Duration::from_secs(90), |s| {
            step(s) > step0 + 100 && s["updates"]["applied"].as_u64().unwrap_or(0) > applied0
        });
    }
    // Hole punching (DCUtR) ran over the relayed connection: where it succeeded, `peers`
    // shows the other NATed node as direct; where it failed, the failure is counted (the two
    // then reach each other through the reachable nodes' gossip). A failed punch is
    // reported after three dials, each of which may wait out a timeout.
    let punched =
        crate::harness::eventually(Duration::from_secs(90), "a hole punch attempted", || {
            let punched = count(&both, "hole_punches");
            (punched + count(&both, "hole_punch_failures") > 0).then_some(punched)
        });
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
    }
}

/// Where hole punching cannot work (routers that answer strangers with a reset), the two
/// NATed nodes give up on each other's direct path without connecting through the relay
/// again and again, and both still train with the mesh through the reachable nodes.
#[test]
fn when_hole_punching_fails_nated_nodes_stop_using_the_relay_and_still_train() {
    let Some(mesh) = NatMesh::start("NAT traversal, failed punch", Firewall::Reset) else {
        return;
    };
    let first = mesh.start_behind(2);
    first.wait_status("a relay address", Duration::from_secs(90), |s| {
        nat(s)["relay_addrs"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    });
    let second = mesh.start_behind(3);
    let second_id = id(&second);
    let both = [&first, &second];
    crate::harness::eventually(Duration::from_secs(90), "a failed hole punch", || {
        (count(&both, "hole_punch_failures") > 0).then_some(())
    });
    let relayed_then = count(&both, "relayed_connections");
    let applied_then = [applied(&first), applied(&second)];
    // Three Kademlia walks (every 5 s here), any of which would otherwise connect through a
    // relay.
    std::thread::sleep(Duration::from_secs(WATCH_SECS));
    let relayed_now = count(&both, "relayed_connections");
    eprintln!(
        "relayed connections (both NATed nodes): {relayed_then} when the punch failed, {relayed_now} {WATCH_SECS} s later; punch failures {}",
        count(&both, "hole_punch_failures")
    );
    if std::env::var("P2PTRAIN_TEST_NAT_LOG").is_ok() {
        eprintln!(
            "FIRST:\n{}\nSECOND:\n{}",
            first.log_text(),
            second.log_text()
        );
    }
    let s = first.status().expect("status");
    assert!(
        peer(&s, &second_id).is_none_or(|p| p["path"] != "direct"),
        "no direct path can exist through these routers: {s}"
    );
    // One connection is counted on both sides; allow one that was already under way.
    // Before the relay gate, every walk reopened one or two and redials more.
    assert!(
        relayed_now <= relayed_then + 2,
        "relayed connections go on: {relayed_then} -> {relayed_now}"
    );
    for (n, before) in [(&first, applied_then[0]), (&second, applied_then[1])] {
        assert!(applied(n) > before, "a NATed node stopped applying updates");
    }
}
