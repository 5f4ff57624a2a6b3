//! What `local` reports: each node's line, the lone controls, a race to a target, and the
//! summary printed for people (JSON is the same structs, serialized).

use super::*;

/// One node's status at one moment, for curves over time.
#[derive(Debug, Clone, Serialize)]
pub struct TracePoint {
    /// Seconds since the first node started.
    pub t: f64,
    /// Node index.
    pub node: usize,
    /// Its step.
    pub step: u64,
    /// Samples it has trained on.
    pub samples_seen: u64,
    /// Its latest held-out accuracy.
    pub accuracy: Option<f64>,
    /// Its latest held-out bits per byte (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
    /// Bytes it has sent.
    pub bytes_sent: u64,
    /// Its distance to the neighbour it last synced with, before averaging.
    pub consensus_distance: Option<f64>,
}

/// One node's line in the summary.
#[derive(Debug, Serialize)]
pub struct NodeSummary {
    /// Index in start order (0 founded the mesh).
    pub index: usize,
    /// Peer id.
    pub peer_id: String,
    /// Step at the end.
    pub step: u64,
    /// Held-out accuracy of its final checkpoint.
    pub accuracy: Option<f64>,
    /// Held-out loss of its final checkpoint.
    pub loss: Option<f64>,
    /// Held-out bits per byte of its final checkpoint (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
    /// Peers it saw at its last status (none once it said goodbye and they let it go).
    pub peers: usize,
    /// Bytes sent (libp2p counters).
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Updates sent, received, applied, rejected.
    pub updates: p2ptrain_daemon::mesh::UpdateCounters,
    /// Why it last rejected an update, if it did ("author: why").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_rejection: Option<String>,
    /// Samples per second (recent).
    pub samples_per_sec: f64,
    /// The state download it joined with (not the founder).
    pub state_download_secs: Option<f64>,
    /// Members it lost without a goodbye during the run: an honest mesh loses none.
    pub peer_drops: u64,
    /// Peers it had banned at the end, with why.
    pub banned: Vec<p2ptrain_daemon::network::BannedPeer>,
    /// The classes its part of the training set holds.
    pub classes: Vec<usize>,
    /// Bytes it sent per second of its life.
    pub sent_bytes_per_sec: f64,
    /// What a node with the same part of the data reaches alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alone: Option<Alone>,
    /// With a target: when its evaluations first reached it (none: never did).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_target: Option<Reached>,
}

/// When a node's evaluation first reached the target: its step and the seconds since its run
/// (the mesh, or the lone control) started.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Reached {
    /// The evaluated step.
    pub step: u64,
    /// Seconds since the run started, from the node's own evaluation log.
    pub secs: f64,
}

/// One node alone on the whole data, trained to the target: the control of a race.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LoneControl {
    /// When it reached the target (none: not within `cap` steps or the time limit).
    pub reached: Option<Reached>,
    /// The most steps it could train.
    pub cap: u64,
    /// Its last evaluated step and figure.
    pub last: Option<(u64, f64)>,
}

/// A run to a target: each mesh node's steps beside one node alone on the whole data.
#[derive(Debug, Serialize)]
pub struct TargetSummary {
    /// The held-out figure: bits per byte (at or below) for a language model, else accuracy
    /// (at or above).
    pub target: f64,
    /// `"bits_per_byte"` or `"accuracy"`.
    pub metric: &'static str,
    /// Cores each node was pinned to (none: not pinned, so times do not compare).
    pub cores_per_node: Option<usize>,
    /// The lone control (none with `--no-alone`).
    pub alone: Option<LoneControl>,
    /// The lone control's steps ÷ the slowest mesh node's: steps per node the mesh saved.
    pub steps_ratio: Option<f64>,
    /// The lone control's seconds ÷ the mesh's (every node there): the speed-up, when pinned.
    pub speedup: Option<f64>,
}

/// A node's part of the data trained alone, outside any mesh: the control for what the mesh
/// adds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Alone {
    /// Steps it trained (the most any node with this part took, up to [`ALONE_MAX_STEPS`]).
    pub steps: u64,
    /// Held-out accuracy after them.
    pub accuracy: f64,
    /// Held-out bits per byte (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
}

/// The most steps a lone control trains: on the demo a lone node's accuracy has levelled
/// off after a few thousand (it cannot learn the classes it never sees).
pub const ALONE_MAX_STEPS: u64 = 20_000;

/// The summary of a local run.
#[derive(Debug, Serialize)]
pub struct LocalSummary {
    /// Nodes started.
    pub nodes: usize,
    /// Seconds from the first start to the last exit.
    pub wall_secs: f64,
    /// Each node.
    pub per_node: Vec<NodeSummary>,
    /// Largest relative L2 distance between two nodes' final parameters.
    pub consensus_distance_max: f64,
    /// Mean over pairs.
    pub consensus_distance_mean: f64,
    /// Mean final accuracy.
    pub mean_accuracy: f64,
    /// Mean final bits per byte (a language model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_bits_per_byte: Option<f64>,
    /// Mean accuracy of the lone controls (when they ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_alone_accuracy: Option<f64>,
    /// Every node's status every half second (only when asked for).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub trace: Vec<TracePoint>,
    /// With a target: the mesh's steps and times to it beside a lone node's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<TargetSummary>,
    /// The final status of each node.
    #[serde(skip)]
    pub final_status: Vec<Status>,
}

/// Prints a summary for people: what each node reached in the mesh beside what its part of
/// the data reaches alone, and the mesh's health (peers, rejections, drops, bans), since a
/// split mesh still shows a good accuracy on small data.
pub fn print_summary(s: &LocalSummary) {
    println!("{} nodes, {:.1} s", s.nodes, s.wall_secs);
    println!(
        "{:>4} {:>10} {:>8} {:>9} {:>9} {:>6} {:>10} {:>13} {:>8} {:>6} {:>5}",
        "node",
        "classes",
        "step",
        "alone",
        "in mesh",
        "peers",
        "sent/s",
        "updates in/out",
        "rejected",
        "drops",
        "bans"
    );
    let figure = |bpb: Option<f64>, acc: Option<f64>| match (bpb, acc) {
        (Some(bpb), _) => format!("{bpb:.3} bpb"),
        (None, Some(a)) => format!("{:.2}%", a * 100.0),
        (None, None) => "-".into(),
    };
    for n in &s.per_node {
        let classes = if n.classes.len() > 6 {
            format!("{} classes", n.classes.len())
        } else {
            n.classes
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        println!(
            "{:>4} {:>10} {:>8} {:>9} {:>9} {:>6} {:>10} {:>6}/{:<6} {:>8} {:>6} {:>5}",
            n.index,
            classes,
            n.step,
            n.alone
                .map(|a| figure(a.bits_per_byte, Some(a.accuracy)))
                .unwrap_or_else(|| "-".into()),
            figure(n.bits_per_byte, n.accuracy),
            n.peers,
            format!("{}/s", crate::output::human_bytes(n.sent_bytes_per_sec)),
            n.updates.applied,
            n.updates.sent,
            n.updates.rejected,
            n.peer_drops,
            n.banned.len()
        );
        for b in &n.banned {
            println!("     banned {}: {}", b.peer_id, b.reason);
        }
        if let Some(why) = &n.last_rejection {
            println!("     last rejected {why}");
        }
    }
    if let (Some(alone), None) = (s.mean_alone_accuracy, s.mean_bits_per_byte) {
        let steps = s
            .per_node
            .iter()
            .filter_map(|n| n.alone.map(|a| a.steps))
            .max();
        println!(
            "held-out accuracy: {:.2}% alone (each node's part of the data, trained by itself for up to {} steps), {:.2}% in the mesh",
            alone * 100.0,
            steps.unwrap_or(0),
            s.mean_accuracy * 100.0
        );
    }
    let quality = match s.mean_bits_per_byte {
        Some(bpb) => format!("mean {bpb:.3} bits per byte"),
        None => format!("mean accuracy {:.2}%", s.mean_accuracy * 100.0),
    };
    println!(
        "{quality}, consensus distance max {:.3}% mean {:.3}%",
        s.consensus_distance_max * 100.0,
        s.consensus_distance_mean * 100.0
    );
    if let Some(t) = &s.target {
        print_target(s, t);
    }
}

/// The race to the target in a few lines: each mesh node's steps (and, pinned, seconds)
/// beside the lone control's, and the ratios.
pub(super) fn print_target(s: &LocalSummary, t: &TargetSummary) {
    let language = t.metric == "bits_per_byte";
    let figure = |v: f64| {
        if language {
            format!("{v:.3} bits per byte")
        } else {
            format!("{:.2}% held-out accuracy", v * 100.0)
        }
    };
    let at = |r: Option<Reached>| match r {
        Some(r) => format!("step {} ({:.1} s)", r.step, r.secs),
        None => "not reached".into(),
    };
    println!("target {}:", figure(t.target));
    let mesh: Vec<String> = s
        .per_node
        .iter()
        .map(|n| format!("node {} {}", n.index, at(n.at_target)))
        .collect();
    println!("  in the mesh: {}", mesh.join(", "));
    if let Some(a) = &t.alone {
        let last = a
            .last
            .map(|(step, v)| format!(", last evaluated step {step} at {}", figure(v)))
            .unwrap_or_default();
        println!(
            "  one node alone on the whole data: {} (at most {} steps{last})",
            at(a.reached),
            a.cap
        );
    }
    if let Some(r) = t.steps_ratio {
        println!("  the lone node needed {r:.2}x the steps each mesh node needed");
    }
    match (t.speedup, t.cores_per_node) {
        (Some(x), Some(k)) => println!(
            "  the mesh got there {x:.2}x as fast (each node pinned to {k} core{})",
            if k == 1 { "" } else { "s" }
        ),
        (None, None) if t.alone.is_some() => println!(
            "  times do not compare unpinned: --cores-per-node K gives each node cores of its own"
        ),
        _ => {}
    }
}
