//! The protocol string a node speaks in identify, and what differs between two of them.
//!
//! Two nodes train together only when their strings are equal: the same wire version, run id
//! (model, optimizer, data spec, init seed), sync mode with its shared settings, and gossip
//! size limit. The run id is a hash, so beside it the string carries each of its parts hashed
//! on its own; a node refused for another run can then tell its user which part to fix
//! ([`what_differs`]) instead of only that two hashes differ.

use super::MAX_TRANSMIT_SIZE;
use crate::wire::WIRE_VERSION;

/// Longest value of a peer's string that [`what_differs`] repeats: a hostile peer's identify
/// may carry kilobytes, a log line should not.
const SHOWN_MAX: usize = 64;

/// The identify protocol version of a node of run `run_id` (whose parts are `run_parts`, as
/// [`crate::config::Config::run_parts`] writes them) syncing on `sync_terms`: equal strings, and
/// only equal strings, can train together. The sync terms are not part of the run id, so a
/// checkpoint stays valid when a run changes mode; but a gossip node and an allreduce node (or
/// two diloco nodes with different inner steps) would each wait for rounds or updates the
/// other never sends.
pub fn protocol_version(run_id: &str, run_parts: &str, sync_terms: &str) -> String {
    format!(
        "/p2ptrain/{WIRE_VERSION}/run/{run_id}/{run_parts}/sync/{sync_terms}/gossip-max/{MAX_TRANSMIT_SIZE}"
    )
}

/// What a user reads for each named part of the string.
const LABELS: [(&str, &str); 8] = [
    ("wire", "wire version (p2ptrain release)"),
    ("model", "model"),
    ("optimizer", "optimizer and its schedule"),
    ("data", "data spec"),
    ("seed", "init seed"),
    ("sync", "sync mode and its shared settings"),
    ("gossip-max", "gossip size limit (p2ptrain release)"),
    ("run", "run id"),
];

/// The named parts of a protocol string, in order; `None` for a string that is not one.
fn parts(spoken: &str) -> Option<Vec<(&str, &str)>> {
    let rest = spoken.strip_prefix("/p2ptrain/")?;
    let (head, tail) = rest.split_once("/sync/")?;
    let (sync, gossip_max) = tail.rsplit_once("/gossip-max/")?;
    let mut head = head.split('/');
    let mut named = vec![("wire", head.next()?)];
    while let (Some(key), Some(value)) = (head.next(), head.next()) {
        named.push((key, value));
    }
    named.push(("sync", sync));
    named.push(("gossip-max", gossip_max));
    Some(named)
}

/// At most [`SHOWN_MAX`] characters of a peer's value, for one log line: letters, digits and
/// `/._:-` (all a hash, a seed or sync terms hold) kept, anything else shown as `?`, so a
/// hostile value can neither grow the line by escapes nor fake more entries.
fn shown(value: &str) -> String {
    let mut text: String = value
        .chars()
        .take(SHOWN_MAX)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "/._:-".contains(c) {
                c
            } else {
                '?'
            }
        })
        .collect();
    if value.chars().count() > SHOWN_MAX {
        text.push('…');
    }
    text
}

/// The run id's parts, which a release before them does not send.
const RUN_PARTS: [&str; 4] = ["model", "optimizer", "data", "seed"];

/// Which parts of this node's protocol string `ours` differ from a peer's `theirs`, each with
/// both values ("model (here 1a2b…, there 3c4d…)"), joined by "; ". The run id is named only
/// when none of its parts is; a peer of an older release, which sends no parts, is said to be
/// one. `theirs` comes from the network: what is repeated of it is bounded and sanitised.
pub fn what_differs(ours: &str, theirs: &str) -> String {
    let (Some(mine), Some(peer)) = (parts(ours), parts(theirs)) else {
        return format!(
            "it speaks \"{}\", not a p2ptrain protocol of this release",
            shown(theirs)
        );
    };
    let value_of = |named: &[(&str, &str)], key: &str| {
        named
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
    };
    let older = RUN_PARTS.iter().all(|k| value_of(&peer, k).is_none());
    let mut differing = Vec::new();
    if older {
        differing.push("a p2ptrain release that does not send the run's parts".to_string());
    }
    let mut parts_named = false;
    for (key, label) in LABELS {
        let here = value_of(&mine, key);
        let there = value_of(&peer, key);
        let is_part = RUN_PARTS.contains(&key);
        if here == there || (older && is_part) || (key == "run" && parts_named) {
            continue;
        }
        parts_named |= is_part;
        let say = |v: Option<String>| v.map_or_else(|| "none".to_string(), |v| shown(&v));
        differing.push(format!(
            "{label} (here {}, there {})",
            say(here),
            say(there)
        ));
    }
    if differing.is_empty() {
        "nothing this node can name".into()
    } else {
        differing.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spoken(parts: &str, sync: &str) -> String {
        protocol_version("abc", parts, sync)
    }

    const PARTS: &str = "model/m1/optimizer/o1/data/d1/seed/42";

    #[test]
    fn protocol_version_names_wire_version_run_its_parts_sync_terms_and_gossip_limit() {
        // Nodes compare exactly this string: a node of another wire version is refused at
        // identify.
        assert_eq!(
            spoken(PARTS, "allreduce/every/4"),
            format!("/p2ptrain/{WIRE_VERSION}/run/abc/model/m1/optimizer/o1/data/d1/seed/42/sync/allreduce/every/4/gossip-max/2097152")
        );
    }

    #[test]
    fn what_differs_names_each_differing_part_with_both_values() {
        let ours = spoken(PARTS, "gossip/mix/mean");
        let theirs = protocol_version(
            "xyz",
            "model/m2/optimizer/o1/data/d1/seed/43",
            "diloco/inner/25",
        );
        assert_eq!(
            what_differs(&ours, &theirs),
            "model (here m1, there m2); init seed (here 42, there 43); sync mode and its shared settings (here gossip/mix/mean, there diloco/inner/25)"
        );
        assert_eq!(what_differs(&ours, &ours), "nothing this node can name");
    }

    #[test]
    fn what_differs_names_the_run_id_only_when_no_part_is_named() {
        let ours = spoken(PARTS, "gossip");
        let older = format!("/p2ptrain/{WIRE_VERSION}/run/xyz/sync/gossip/gossip-max/2097152");
        assert_eq!(
            what_differs(&ours, &older),
            "a p2ptrain release that does not send the run's parts; run id (here abc, there xyz)"
        );
        let same_parts_other_id = protocol_version("xyz", PARTS, "gossip");
        assert_eq!(
            what_differs(&ours, &same_parts_other_id),
            "run id (here abc, there xyz)"
        );
    }

    #[test]
    fn a_hostile_string_is_bounded_and_escaped() {
        let ours = spoken(PARTS, "gossip");
        let long = format!(
            "/p2ptrain/11/run/abc/model/{}\n/sync/gossip/gossip-max/1",
            "x".repeat(5000)
        );
        let said = what_differs(&ours, &long);
        assert!(said.len() < 400, "{} bytes: {said}", said.len());
        assert!(!said.contains('\n'), "{said}");
        let garbage = what_differs(&ours, "\u{7}ring\u{7}");
        assert!(garbage.starts_with("it speaks \"?ring?\""), "{garbage}");
        // A value cannot pose as more entries.
        let posing = spoken(
            "model/x); wire version (here 11, there 12/optimizer/o1/data/d1/seed/42",
            "gossip",
        );
        let said = what_differs(&ours, &posing);
        assert!(said.starts_with("model (here m1, there x??"), "{said}");
        assert_eq!(said.matches("(here").count(), 1, "{said}");
    }
}
