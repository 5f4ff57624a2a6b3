//! Skewed data: nodes that each hold only a few classes (`data.partition = "by_label"`).
//! Alone such a node can never pass the held-out set; in a mesh it must, which shows that
//! knowledge really flows between replicas and is not just each node fitting its own data.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{evals, Node};
use crate::mesh::{config, listen_addr, peers, start, step};

/// The digits config with node `k` of 3 holding its own classes, applying neighbours'
/// updates whole (`update_weight = 1`: Hogwild's sum, what docs/modes.md advises for skewed data).
/// With the default weight, 1/(neighbours + 1), each node's own classes outweigh the others'
/// and the mesh hovers at 70-80% held-out accuracy (measured: 0.68-0.84 over 60 s); whole
/// updates give 0.98 within 5 s.
///
/// And bounded staleness (`staleness_bound = 100`, as `configs/digits-skewed.toml` has): on a
/// loaded box a node whose neighbours are descheduled for half a second trains a few hundred
/// steps on its own four digits and forgets the rest for an evaluation or two. Without the
/// bound, CI once read a node at 0.84 just when the final check looked (its neighbours at
/// 0.98 and 0.96); here, with two busy loops beside the test, 2 of 22 runs had such a dip past
/// step 3000 (0.84-0.88), and none of 10 with the bound.
fn by_label(dir: &Path, k: usize) -> PathBuf {
    config(
        dir,
        &format!("by_label{k}.toml"),
        &[
            ("threads = 1", &format!("threads = 1\nshard = \"{k}/3\"")),
            ("split_seed = 1", "split_seed = 1\npartition = \"by_label\""),
            ("eval_every = 500", "eval_every = 200"),
        ],
        "\n[sync]\nmix = \"add\"\nupdate_weight = 1.0\nstaleness_bound = 100\n",
    )
}

fn accuracy(s: &Value) -> f64 {
    s["eval"]["accuracy"].as_f64().unwrap_or(0.0)
}

/// The classes a node trains on, from its status.
fn classes_held(s: &Value) -> Vec<usize> {
    let counts = s["train_classes"].as_array().expect("train_classes");
    (0..counts.len())
        .filter(|&c| counts[c].as_u64().unwrap_or(0) > 0)
        .collect()
}

/// Three nodes of four classes each (0-3, 4-7, 8 9 0 1): a lone node with one of those
/// parts stays below 60% on the held-out set (it has never seen six of the ten digits), while
/// every node of a three-node gossip mesh reaches 90%.
#[test]
fn nodes_that_each_hold_a_few_classes_learn_all_of_them_only_in_a_mesh() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfgs: Vec<PathBuf> = (0..3).map(|k| by_label(tmp.path(), k)).collect();
    let a = start(tmp.path(), "a", &cfgs[0], None, &[]);
    let addr = listen_addr(&a);
    let b = start(tmp.path(), "b", &cfgs[1], Some(&addr), &[]);
    let c = start(tmp.path(), "c", &cfgs[2], Some(&addr), &[]);
    // The control: the same part as `a`, trained alone.
    let lone = start(tmp.path(), "lone", &cfgs[0], None, &[]);
    let mesh: Vec<&Node> = vec![&a, &b, &c];

    let expected = [vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![0, 1, 8, 9]];
    for (node, want) in mesh
        .iter()
        .chain([&&lone])
        .zip(expected.iter().chain([&expected[0]]))
    {
        let s = node.status().expect("status");
        assert_eq!(&classes_held(&s), want, "{}", s["train_classes"]);
    }

    let t0 = Instant::now();
    let statuses = crate::harness::eventually(
        Duration::from_secs(180),
        "every mesh node at 90% held-out accuracy at once, each with a full sync accepted",
        || {
            // Both at once: updates alone can lift a fast mesh to 90% within its first full
            // sync's period (CI saw it at step 838, 1.3 s in, the first two sync attempts
            // failed while the neighbours were still starting), and a sync must still come.
            let statuses: Vec<Value> = mesh.iter().map(|n| n.status()).collect::<Option<_>>()?;
            statuses
                .iter()
                .all(|s| {
                    accuracy(s) >= 0.9 && s["full_syncs"]["accepted"].as_u64().unwrap_or(0) > 0
                })
                .then_some(statuses)
        },
    );
    eprintln!(
        "after {:.1} s the mesh nodes are at (step, accuracy) {:?}",
        t0.elapsed().as_secs_f64(),
        statuses
            .iter()
            .map(|s| (step(s), accuracy(s)))
            .collect::<Vec<_>>()
    );
    for s in &statuses {
        assert_eq!(peers(s), 2, "{s}");
        assert!(
            s["updates"]["applied"].as_u64().unwrap_or(0) > 0,
            "no neighbour update applied: {s}"
        );
        assert!(
            s["full_syncs"]["accepted"].as_u64().unwrap_or(0) > 0,
            "no full sync accepted: {s}"
        );
        assert!(
            s["sync_refusals"].as_object().is_none_or(|m| m.is_empty()),
            "an honest skewed neighbour was refused: {s}"
        );
    }

    // The lone node, given ten thousand steps and at least as many as the mesh took.
    let steps_needed = statuses.iter().map(step).max().unwrap_or(0).max(10_000);
    let s = lone.wait_status(
        "the lone node past the mesh's steps, evaluated",
        Duration::from_secs(180),
        |s| s["eval"]["step"].as_u64().unwrap_or(0) >= steps_needed,
    );
    eprintln!(
        "lone node: step {}, accuracy {:.4}, peers {}",
        step(&s),
        accuracy(&s),
        peers(&s)
    );
    assert_eq!(peers(&s), 0, "the control must train alone: {s}");
    assert!(
        accuracy(&s) < 0.6,
        "a node with four of ten classes cannot pass 60% alone: {s}"
    );
    // Meanwhile the mesh kept what it learnt: each node's own classes did not crowd the
    // others out again.
    let later: Vec<f64> = mesh
        .iter()
        .map(|n| accuracy(&n.status().expect("status")))
        .collect();
    eprintln!("mesh accuracies once the lone node is done: {later:?}");
    for (node, reached) in mesh.iter().zip(&statuses) {
        let since: Vec<f64> = evals(&node.data_dir)
            .iter()
            .filter(|e| e["step"].as_u64().unwrap_or(0) > step(reached))
            .filter_map(|e| e["accuracy"].as_f64())
            .collect();
        eprintln!(
            "{}: {} evaluations since 90%, {} below 90%, lowest {:.3}",
            node.data_dir.display(),
            since.len(),
            since.iter().filter(|&&a| a < 0.9).count(),
            since.iter().copied().fold(1.0, f64::min)
        );
    }
    assert!(later.iter().all(|&a| a >= 0.9), "{later:?}");
}
