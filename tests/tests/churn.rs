//! Churn and faults (issue 5, first scenarios): how fast the mesh routes around a node that
//! leaves politely and one that dies without a word.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{cli, eventually, recent_median_accuracy, Node};
use crate::mesh::{config, listen_addr, peers, start, step};

fn neighbours(s: &Value) -> Vec<String> {
    s["neighbours"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn peer_id(n: &Node) -> String {
    n.status().expect("status")["peer_id"]
        .as_str()
        .expect("peer id")
        .to_string()
}

/// Seconds until every node in `nodes` has exactly `want` neighbours, none of them `gone`
/// (reported, not asserted: how a peer went is asserted instead, see [`losses`]).
fn time_to_replace(nodes: &[&Node], gone: &str, want: usize, since: Instant) -> f64 {
    eventually(
        Duration::from_secs(20),
        "neighbour sets without the lost node",
        || {
            let ok = nodes.iter().all(|n| {
                n.status().is_some_and(|s| {
                    let nb = neighbours(&s);
                    nb.len() == want && !nb.iter().any(|p| p == gone)
                })
            });
            ok.then(|| since.elapsed().as_secs_f64())
        },
    )
}

/// A node's members lost so far, by how it learnt each was gone (status `peer_losses`):
/// `[goodbyes, silent, closed, banned]`.
/// A status whose network section went unanswered (`unanswered`: its figures read 0) is
/// asked again.
fn losses(n: &Node) -> [u64; 4] {
    let s = eventually(Duration::from_secs(20), "a status with its network", || {
        n.status().filter(|s| s["unanswered"] != true)
    });
    ["goodbyes", "silent", "closed", "banned"].map(|k| s["peer_losses"][k].as_u64().unwrap_or(0))
}

/// What each of `nodes` counted as lost since `before` (their [`losses`] then, in order),
/// waiting until every one of them has counted its loss of one member.
fn lost_since(nodes: &[&Node], before: &[[u64; 4]]) -> Vec<[u64; 4]> {
    eventually(
        Duration::from_secs(20),
        "each node counting its loss",
        || {
            let now: Vec<[u64; 4]> = nodes.iter().map(|n| losses(n)).collect();
            let delta: Vec<[u64; 4]> = now
                .iter()
                .zip(before)
                .map(|(a, b)| std::array::from_fn(|i| a[i].saturating_sub(b[i])))
                .collect();
            delta
                .iter()
                .all(|d| d.iter().sum::<u64>() >= 1)
                .then_some(delta)
        },
    )
}

/// Degree 2 in a mesh of five: every node has spare members to replace a lost neighbour with.
/// How fast a lost neighbour is replaced follows from how each node learns it is gone, so that
/// is what is asserted, not seconds: a node that leaves (`p2ptrain leave`) says so on the
/// heartbeat topic, and every other node lets it go on that goodbye (at once), none of them
/// on a closed connection or silence; one killed with SIGKILL has its connections reset, and
/// every survivor drops it on the closed connection (at once), none by waiting out the
/// silence; one frozen with SIGSTOP keeps its connections open and answers nothing, and every
/// survivor drops it for silence (`SILENT_AFTER`, 4 s without a ping answer or any message).
/// Nobody is banned. The seconds each took are printed beside.
#[test]
fn a_leaving_node_is_replaced_at_once_a_crashed_or_hung_one_within_the_ping_timeout() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(tmp.path(), "c.toml", &[], "\n[sync]\ndegree = 2\n");
    let a = start(tmp.path(), "a", &cfg, None, &[]);
    let addr = listen_addr(&a);
    let mut nodes = vec![a];
    for name in ["b", "c", "d", "e"] {
        nodes.push(start(tmp.path(), name, &cfg, Some(&addr), &[]));
    }
    for n in &nodes {
        n.wait_status(
            "four peers and two neighbours",
            Duration::from_secs(60),
            |s| peers(s) == 4 && neighbours(s).len() == 2,
        );
    }
    let mut ids: Vec<String> = nodes.iter().map(peer_id).collect();
    // [goodbyes, silent, closed, banned] each survivor must count for each way of going.
    const GOODBYE: [u64; 4] = [1, 0, 0, 0];
    const SILENCE: [u64; 4] = [0, 1, 0, 0];
    const CLOSED: [u64; 4] = [0, 0, 1, 0];

    // The leaver: the node most others hold as a neighbour, so that its going empties the
    // most neighbour slots (10 slots over 5 nodes: at least two, by counting alone, so there
    // is nothing to assert about it).
    let (leaver, held_by) = most_held(&nodes, &ids);
    let others = all_but(&nodes, leaver);
    let before: Vec<[u64; 4]> = others.iter().map(|n| losses(n)).collect();
    let t0 = Instant::now();
    let (st, _, err) = cli(
        &["leave", "--api", nodes[leaver].api.as_deref().expect("api")],
        Duration::from_secs(30),
    );
    assert!(st.success(), "{err}");
    let leave_secs = time_to_replace(&others, &ids[leaver], 2, t0);
    let leave_losses = lost_since(&others, &before);
    let mut gone = nodes.remove(leaver);
    ids.remove(leaver);
    assert!(
        gone.wait_exit(Duration::from_secs(60)).success(),
        "{}",
        gone.log_text()
    );

    // A crash: SIGKILL resets the victim's connections at once.
    let (victim, victim_held_by) = most_held(&nodes, &ids);
    let before: Vec<[u64; 4]> = all_but(&nodes, victim).iter().map(|n| losses(n)).collect();
    let t1 = Instant::now();
    nodes[victim].kill9();
    let rest = all_but(&nodes, victim);
    let crash_secs = time_to_replace(&rest, &ids[victim], 2, t1);
    let crash_losses = lost_since(&rest, &before);
    nodes.remove(victim);
    ids.remove(victim);

    // A hang: of the three left each holds both others; a frozen one is only noticed by the
    // ping timeout.
    let (frozen, frozen_held_by) = most_held(&nodes, &ids);
    let survivors = all_but(&nodes, frozen);
    let before: Vec<[u64; 4]> = survivors.iter().map(|n| losses(n)).collect();
    let t2 = Instant::now();
    nodes[frozen].freeze();
    let hang_secs = time_to_replace(&survivors, &ids[frozen], 1, t2);
    let hang_losses = lost_since(&survivors, &before);
    eprintln!(
        "leave: out of {held_by} neighbour sets in {leave_secs:.2} s, counted \
         [goodbyes, silent, closed, banned] {leave_losses:?}; \
         crash (SIGKILL): out of {victim_held_by} in {crash_secs:.2} s, {crash_losses:?}; \
         hang (SIGSTOP): out of {frozen_held_by} in {hang_secs:.2} s, {hang_losses:?}"
    );
    for (what, counted, want) in [
        ("the leaver", &leave_losses, GOODBYE),
        ("the crashed node", &crash_losses, CLOSED),
        ("the hung node", &hang_losses, SILENCE),
    ] {
        assert!(
            counted.iter().all(|c| *c == want),
            "every other node must have let {what} go as {want:?} \
             ([goodbyes, silent, closed, banned]); they counted {counted:?}"
        );
    }
    // The survivors keep training.
    for n in survivors {
        let s0 = n.status().expect("status")["step"].as_u64().unwrap_or(0);
        n.wait_status("training on", Duration::from_secs(30), |s| {
            s["step"].as_u64().unwrap_or(0) > s0 + 200
        });
    }
}

/// Every node but the one at `skip`.
fn all_but(nodes: &[Node], skip: usize) -> Vec<&Node> {
    nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != skip)
        .map(|(_, n)| n)
        .collect()
}

/// The index of the node held as a neighbour by the most others, and by how many. Every node
/// must answer: one that does not would count as holding nobody.
fn most_held(nodes: &[Node], ids: &[String]) -> (usize, usize) {
    let sets: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| neighbours(&n.status().expect("a live node's status")))
        .collect();
    (0..ids.len())
        .map(|i| (i, sets.iter().filter(|s| s.contains(&ids[i])).count()))
        .max_by_key(|&(i, held)| (held, std::cmp::Reverse(i)))
        .unwrap_or((0, 0))
}

/// Crash safety: one node killed with SIGKILL at 30 moments of a fixed pseudo-random schedule
/// (some fall inside a checkpoint write: one is written every 100 steps, several a second) and
/// restarted on the same data directory each time. Every restart must resume from a checkpoint
/// at least as new as the newest one the node had reported before the kill, never meet a
/// corrupt file (writes are atomic), and lose at most two checkpoint intervals of steps
/// against the last step it reported: the checkpoint of the newest boundary may still be on
/// its way to disk when the kill lands (the trainer goes on while it is written), and then the
/// one before it is the newest complete one. CI once lost 101 steps with an interval of 100:
/// a kill one step after a boundary, on a box loaded by other tests.
#[test]
fn thirty_kills_at_random_moments_always_resume_from_a_valid_checkpoint() {
    const EVERY: u64 = 100;
    const KILLS: usize = 30;
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = config(tmp.path(), "c.toml", &[("keep = 5", "keep = 3")], "");
    let text = std::fs::read_to_string(&cfg)
        .expect("read")
        .replace("every_steps = 0", &format!("every_steps = {EVERY}"));
    std::fs::write(&cfg, text).expect("write");
    let data = tmp.path().join("node");
    // A fixed pseudo-random schedule: reproducible, spread over 0-700 ms.
    let mut schedule = Lcg(0x9e37_79b9_7f4a_7c15);
    // The step last reported before a kill, and the newest checkpoint the node had reported
    // (or resumed from) by then, if any.
    let mut before: Option<(u64, Option<u64>)> = None;
    let mut lost = Vec::new();
    for round in 0..=KILLS {
        let mut node = Node::start(&data, &["--config", cfg.to_str().expect("utf8")]);
        node.wait_api();
        let s = node.wait_status("training", Duration::from_secs(60), |s| {
            s["phase"] == "training"
        });
        let log = node.log_text();
        assert!(!log.contains("corrupt"), "round {round}: {log}");
        let resumed_now = s["resumed_from"]["step"].as_u64();
        if let Some((reported_step, Some(reported_checkpoint))) = before {
            let resumed = s["resumed_from"]["step"]
                .as_u64()
                .unwrap_or_else(|| panic!("round {round}: not resumed: {s}"));
            assert!(
                resumed >= reported_checkpoint,
                "round {round}: resumed at {resumed}, older than checkpoint {reported_checkpoint}"
            );
            lost.push(reported_step.saturating_sub(resumed));
        }
        if round == KILLS {
            break;
        }
        std::thread::sleep(Duration::from_millis(schedule.below(700) as u64));
        let s = node.status().expect("status");
        let step = s["step"].as_u64().unwrap_or(0);
        // None: no checkpoint reported yet, in this round or before (a loaded box can take
        // longer than the first sleep to reach step EVERY: two full-suite runs here were
        // killed so in round 0 and failed in round 1, 1.5 s in), so the restart has nothing
        // it must resume from.
        let checkpoint = s["last_checkpoint"]["step"]
            .as_u64()
            .max(resumed_now)
            .max(before.and_then(|(_, c)| c));
        before = Some((step, checkpoint));
        node.kill9();
    }
    assert!(
        !lost.is_empty(),
        "no restart had a checkpoint to resume from"
    );
    lost.sort_unstable();
    eprintln!(
        "{KILLS} kills: steps lost against the last reported step: median {}, max {} (interval {EVERY})",
        lost[lost.len() / 2],
        lost[lost.len() - 1]
    );
    assert!(
        lost.iter().all(|&l| l <= 2 * EVERY),
        "lost more than two intervals: {lost:?}"
    );
    let corrupt = std::fs::read_dir(data.join("checkpoints"))
        .expect("checkpoints dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".corrupt"))
        .count();
    assert_eq!(corrupt, 0, "checkpoints set aside as corrupt");
}

/// Full syncs in the churn scenario, every this many steps.
const CHURN_SYNC_EVERY: u64 = 500;
/// Nodes in the churn scenario.
const CHURN_NODES: usize = 6;
/// Seconds the mesh trains before the churned run's measured phase. A node's memory grows for
/// its first two minutes as gossipsub's time caches fill (the duplicate cache and peer
/// scoring's delivery records keep 120 s of message ids; the latter's 120 s is a constant of
/// libp2p's, not a setting) and then stays flat but for a step when a cache's table doubles
/// (see [`HeapSteps`]): measured on a 6-node mesh, 39.0 MB at 10 s, 45.5 MB at 130 s, 47.4 MB
/// at 160 s, and within 0.2 MB of that to 250 s. Memory growth under churn is only
/// meaningful from that steady state on: against the churn-free run's growth over the same
/// first minute instead (its control, without the wait), CI saw +13.2% under churn and +7.1%
/// without, and this machine +15.0% and +14.3%: the caches' filling varies by more than the
/// 5% a leak must stay under.
const WARM_UP_SECS: f64 = 130.0;

/// A reproducible pseudo-random sequence (a linear congruential generator).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// The churn scenario's config for part `k` of 3 of the digits, cut by label as in
/// `skewed.rs` (four classes each): a node alone on a part stays near 40% on the held-out
/// set, so a node above that has learnt digits it never trained on, from the mesh (on IID
/// digits a node alone reaches the mesh's 98% in seconds, and churn could not show).
///
/// Neighbours' updates weigh the default 1/(neighbours + 1), not `skewed.rs`'s whole updates:
/// in this mesh of six with three neighbours each, whole updates (and four contributions to
/// every step) left the nodes at 0.08-0.38 after 60 s churn-free, and at chance (0.08-0.11)
/// with all five as neighbours; with the default weight they were at 0.57-0.69. Nor is the
/// staleness bound on: a killed neighbour held its neighbours for up to 6 s, which the stall
/// bound below rightly counts.
fn churn_config(dir: &Path, k: usize) -> PathBuf {
    config(
        dir,
        &format!("c{k}.toml"),
        &[
            ("every_steps = 0", "every_steps = 1000"),
            // Neither a divisor nor a multiple of the full-sync interval (see [`EVAL_EVERY`]).
            ("eval_every = 500", &format!("eval_every = {EVAL_EVERY}")),
            ("threads = 1", &format!("threads = 1\nshard = \"{k}/3\"")),
            ("split_seed = 1", "split_seed = 1\npartition = \"by_label\""),
        ],
        &format!("\n[sync]\ndegree = 3\nfull_sync_every = {CHURN_SYNC_EVERY}\n"),
    )
}

/// Steps between a churn node's evaluations. A skewed node drifts towards its own classes
/// between two full syncs and is pulled back at each, so its accuracy may rise and fall with
/// the sync interval ([`CHURN_SYNC_EVERY`] steps). Evaluated every 500 steps, the evaluations
/// of a node's window could all fall at one phase of that cycle (its syncs start from its
/// last one, not at multiples of 500); at 170 steps its ~30 evaluations fall at 50 phases of
/// the cycle, 10 steps apart (170 and 500 share only the factor 10). Measured on this scenario, one run each: evaluations every 500
/// steps, nodes at 0.51-0.70; every 170, 0.54-0.68 (CI's failed run, at 500 and with
/// unbalanced parts, 0.45-0.62).
const EVAL_EVERY: u64 = 170;

/// What each node's accuracy is taken over: the median of its evaluations in this window
/// before its last (about thirty of them), since one evaluation of a skewed node is a noisy
/// sample (see [`recent_median_accuracy`]).
const ACCURACY_WINDOW: Duration = Duration::from_secs(10);

/// What one run of the churn scenario measured.
struct ChurnRun {
    /// Held-out accuracy of every node alive at the end, by name (over [`ACCURACY_WINDOW`]).
    accuracies: Vec<(String, f64)>,
    /// Held-out accuracy of the lone control: a node on the first part, alone, beside the
    /// mesh for the whole run (over the same window).
    lone_accuracy: f64,
    /// The longest time any node alive across it went without its step advancing, seconds
    /// (reported beside [`ChurnRun::worst_stall_steps`]).
    worst_stall: f64,
    /// The same stall counted in the mesh's steps: how many steps the mean node polled took
    /// while that node's step stood still. The mesh's own clock, so no wall-clock bound.
    worst_stall_steps: f64,
    /// The longest time no node's step advanced, seconds.
    mesh_stall: f64,
    /// The longest round of status polls, seconds: stalls shorter than this go unseen.
    poll_round: f64,
    /// Steps per second of the node that is never killed.
    anchor_steps_per_sec: f64,
    /// That node's resident memory at the start and end of the churn, KiB.
    anchor_rss: (u64, u64),
    /// The floor of its live heap over the last [`HEAP_WINDOW`] before each 10 s mark (each
    /// kill and join in the churned run) and before the end, bytes: one more than the events.
    anchor_heap_floors: Vec<u64>,
    /// Kills and joins done.
    events: Vec<String>,
    /// The nodes that joined during the churn: name, how ("restarted" on its data directory
    /// or "fresh") and the anchor's step when it was started; a name that joined twice, twice.
    joins: Vec<(String, &'static str, u64)>,
    /// The status of every node alive at the end, by name, once it has evaluated after the
    /// last event and sees all the others.
    finals: Vec<(String, Value)>,
}

/// The churn scenario's processes: six nodes, node `i` on part `i mod 3` of the digits
/// ([`churn_config`]), beside a lone control on part 0. [`ChurnMesh::measure`] watches them
/// for a while, churn-free or churned: after [`WARM_UP_SECS`] and every 10 s one random node
/// but the anchor (node 0) is killed with SIGKILL and another joins: alternately the victim
/// restarted on its data directory (resuming from its checkpoint, on its part) or a fresh node
/// (on the victim's part: a dead box replaced by one holding the same data), each
/// bootstrapping through a random live node. Every part is thus held by two nodes in both
/// measures, so the churned mesh's gain over the lone control is comparable with the
/// churn-free one's: when a fresh node took the next part in turn instead, CI's churned run
/// ended with part 1 on one node (joined 40 s before the end) and part 2 on three, and the
/// anchor (part 0) 0.045 above the control against 0.21 in the churn-free run.
struct ChurnMesh {
    /// The mesh's nodes alive now, by name; the anchor first.
    nodes: Vec<(String, Node)>,
    /// The lone control.
    lone: Node,
    /// Each node's part, by name.
    part_of: std::collections::HashMap<String, usize>,
    /// The config of each part.
    cfgs: Vec<PathBuf>,
    /// How many fresh nodes have joined, to name the next one.
    fresh: usize,
    /// Which node dies, and through whom its successor joins.
    rng: Lcg,
    /// Whether the next joiner is the victim restarted (or a fresh node).
    restart_next: bool,
    /// The nodes' data directories; dropped after them.
    tmp: tempfile::TempDir,
}

impl ChurnMesh {
    /// Starts the mesh and the lone control and waits until every node trains with all the
    /// others as peers.
    fn start() -> ChurnMesh {
        let tmp = tempfile::tempdir().expect("tmp");
        let cfgs: Vec<PathBuf> = (0..3).map(|k| churn_config(tmp.path(), k)).collect();
        // Node `i` of the first six on part `i mod 3`.
        let part_of: std::collections::HashMap<String, usize> =
            (0..CHURN_NODES).map(|i| (format!("n{i}"), i % 3)).collect();
        let mut nodes: Vec<(String, Node)> = Vec::new();
        let anchor = start(tmp.path(), "n0", &cfgs[0], None, &[]);
        let addr = listen_addr(&anchor);
        nodes.push(("n0".into(), anchor));
        for i in 1..CHURN_NODES {
            let name = format!("n{i}");
            let node = start(tmp.path(), &name, &cfgs[part_of[&name]], Some(&addr), &[]);
            nodes.push((name, node));
        }
        let lone = start(tmp.path(), "lone", &cfgs[0], None, &[]);
        for (_, n) in &nodes {
            n.wait_status("a trained mesh", Duration::from_secs(120), |s| {
                peers(s) == CHURN_NODES as u64 - 1 && step(s) > 1000
            });
        }
        ChurnMesh {
            nodes,
            lone,
            part_of,
            cfgs,
            fresh: CHURN_NODES,
            rng: Lcg(0x2545_f491_4f6c_dd1d),
            restart_next: true,
            tmp,
        }
    }

    /// Waits until the anchor has been up for `secs`.
    fn wait_for_anchor_uptime(&self, secs: f64) {
        let up = self.nodes[0].1.status().expect("status")["uptime_s"]
            .as_f64()
            .unwrap_or(0.0);
        std::thread::sleep(Duration::from_secs_f64((secs - up).max(0.0)));
    }

    /// Watches the mesh for `secs` (with `churn`, killing and joining a node every 10 s),
    /// then waits for every node's evaluation after it and measures.
    fn measure(&mut self, churn: bool, secs: u64) -> ChurnRun {
        let ChurnMesh {
            nodes,
            lone,
            part_of,
            cfgs,
            fresh,
            rng,
            restart_next,
            tmp,
        } = self;
        let mut events = Vec::new();
        let mut joins = Vec::new();
        // Per node name: (time of the last poll where its step advanced, that step).
        let mut last_advance: std::collections::HashMap<String, (Instant, u64)> =
            Default::default();
        let mut worst_stall: f64 = 0.0;
        // The mesh's clock: the steps the mean polled node took, summed over polling rounds;
        // per node, the step of its last poll and the clock at its last advance.
        let mut clock: f64 = 0.0;
        let mut polled_step: std::collections::HashMap<String, u64> = Default::default();
        let mut advanced_at_clock: std::collections::HashMap<String, f64> = Default::default();
        let mut worst_stall_steps: f64 = 0.0;
        let mut mesh_last_advance = Instant::now();
        let mut mesh_stall: f64 = 0.0;
        let t0 = Instant::now();
        let rss_start = nodes[0].1.rss_kib().expect("rss");
        let mut heap_floors = Vec::new();
        let mut heap_window: Option<u64> = None;
        let anchor_step0 = step(&nodes[0].1.status().expect("status"));
        let mut next_event = Duration::from_secs(10);
        let mut poll_round: f64 = 0.0;
        while t0.elapsed() < Duration::from_secs(secs) {
            let round = Instant::now();
            let mut any_advanced = false;
            let (mut round_steps, mut round_nodes) = (0u64, 0u64);
            let mut stalled: Vec<&String> = Vec::new();
            for (i, (name, n)) in nodes.iter().enumerate() {
                // A node that does not answer (hung, its API stuck) is not advancing: it counts
                // towards the stall from its last advance. Only a joiner not yet training (still
                // downloading its state) has no clock yet.
                let status = n.status();
                let mark = next_event.min(Duration::from_secs(secs));
                if i == 0 && t0.elapsed() + HEAP_WINDOW >= mark {
                    if let Some(h) = status.as_ref().and_then(heap_bytes) {
                        heap_window = Some(heap_window.map_or(h, |m| m.min(h)));
                    }
                }
                let training = status.as_ref().is_some_and(|s| s["phase"] == "training");
                if !training && !last_advance.contains_key(name) {
                    continue;
                }
                let now = Instant::now();
                let st = status.as_ref().map_or(0, step);
                // Only an answer moves the clock: a poll left unanswered would otherwise read
                // as step 0, and the next answer as a node's whole run taken at once.
                if status.is_some() {
                    if let Some(prev) = polled_step.insert(name.clone(), st) {
                        round_steps += st.saturating_sub(prev);
                        round_nodes += 1;
                    }
                }
                match last_advance.get(name) {
                    Some(&(at, prev)) if st <= prev => {
                        worst_stall = worst_stall.max(now.duration_since(at).as_secs_f64());
                        stalled.push(name);
                    }
                    _ => {
                        any_advanced = true;
                        last_advance.insert(name.clone(), (now, st));
                        advanced_at_clock.insert(name.clone(), clock);
                    }
                }
            }
            if round_nodes > 0 {
                clock += round_steps as f64 / round_nodes as f64;
            }
            for name in stalled {
                let since = advanced_at_clock.get(name).copied().unwrap_or(clock);
                worst_stall_steps = worst_stall_steps.max(clock - since);
            }
            let now = Instant::now();
            poll_round = poll_round.max(now.duration_since(round).as_secs_f64());
            if any_advanced {
                mesh_last_advance = now;
            } else {
                mesh_stall = mesh_stall.max(now.duration_since(mesh_last_advance).as_secs_f64());
            }
            // A 10 s mark: the heap window before it closes, and in the churned run a node is
            // killed and another joins.
            let mark_due = t0.elapsed() >= next_event
                && t0.elapsed() + Duration::from_secs(5) < Duration::from_secs(secs);
            if mark_due {
                next_event += Duration::from_secs(10);
                // A round of polls longer than the window may have left it without a sample.
                let floor = heap_window.take().or_else(|| anchor_heap(&nodes[0].1));
                heap_floors.extend(floor);
            }
            if mark_due && churn {
                let victim = 1 + rng.below(nodes.len() - 1);
                let (name, mut node) = nodes.remove(victim);
                node.kill9();
                last_advance.remove(&name);
                polled_step.remove(&name);
                advanced_at_clock.remove(&name);
                let via = listen_addr(&nodes[rng.below(nodes.len())].1);
                let (new_name, how) = if *restart_next {
                    (name.clone(), "restarted")
                } else {
                    *fresh += 1;
                    let new_name = format!("n{fresh}");
                    part_of.insert(new_name.clone(), part_of[&name]);
                    (new_name, "fresh")
                };
                *restart_next = !*restart_next;
                let joined = start(
                    tmp.path(),
                    &new_name,
                    &cfgs[part_of[&new_name]],
                    Some(&via),
                    &[],
                );
                events.push(format!(
                    "{:.1} s: killed {name}, {how} {new_name} joined on part {}",
                    t0.elapsed().as_secs_f64(),
                    part_of[&new_name]
                ));
                let anchor_step = last_advance.get("n0").map_or(0, |&(_, st)| st);
                joins.push((new_name.clone(), how, anchor_step));
                nodes.push((new_name, joined));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let anchor_status = nodes[0].1.status().expect("status");
        let anchor_steps_per_sec =
            (step(&anchor_status) - anchor_step0) as f64 / t0.elapsed().as_secs_f64();
        let rss_end = nodes[0].1.rss_kib().expect("rss");
        heap_floors.extend(heap_window.take().or_else(|| anchor_heap(&nodes[0].1)));
        // Let every node finish an evaluation after the last event.
        let finals: Vec<(String, Value)> = nodes
            .iter()
            .map(|(name, n)| {
                let s0 = step(&n.status().expect("status"));
                let s = n.wait_status(
                    "a fresh evaluation, every other node a peer",
                    Duration::from_secs(60),
                    |s| {
                        s["eval"]["step"].as_u64().unwrap_or(0) > s0
                            && peers(s) == CHURN_NODES as u64 - 1
                    },
                );
                (name.clone(), s)
            })
            .collect();
        let accuracies = nodes
            .iter()
            .map(|(name, n)| {
                (
                    name.clone(),
                    recent_median_accuracy(&n.data_dir, ACCURACY_WINDOW),
                )
            })
            .collect();
        let lone_status = lone.status().expect("status");
        assert_eq!(
            peers(&lone_status),
            0,
            "the control trains alone: {lone_status}"
        );
        ChurnRun {
            accuracies,
            lone_accuracy: recent_median_accuracy(&lone.data_dir, ACCURACY_WINDOW),
            worst_stall,
            worst_stall_steps,
            mesh_stall,
            poll_round,
            anchor_steps_per_sec,
            anchor_rss: (rss_start, rss_end),
            anchor_heap_floors: heap_floors,
            events,
            joins,
            finals,
        }
    }
}

/// One mesh measured twice over the same length: churn-free over its first minute of
/// training (inside the warm-up that only the heap measure needs), then churned from the end
/// of the warm-up. No node stops training for longer than two full-sync intervals, counted in
/// the mesh's steps, not seconds (see [`ChurnRun::worst_stall_steps`]; a node that stops
/// answering counts as stopped), each node holds four of the ten digits
/// ([`churn_config`]) and the mesh teaches every node of either measure the others (above the
/// lone control beside it: see [`MESH_TAUGHT`]), churn costs at most half of what the mesh
/// teaches ([`CHURN_KEEPS`]), every node that joined took up the mesh's progress (a restarted
/// one from its checkpoint, a fresh one from a donor: at least 90% of the anchor's step when
/// it started), no node rejects an update, and the longest-lived node's live heap (its
/// allocator's count, status `memory.heap_bytes`) grows by at most 1% per kill and join from
/// the steady state, its largest single step aside (see [`HeapSteps`]). Resident memory is
/// reported beside it, not asserted on: it cannot tell a leak from what the allocator keeps
/// after a peak.
#[test]
fn six_nodes_with_a_kill_and_a_join_every_ten_seconds_train_as_well_as_without() {
    let _cores = crate::harness::cpu_hog();
    const SECS: u64 = 60;
    let mut mesh = ChurnMesh::start();
    let calm = mesh.measure(false, SECS);
    // Only the churned measure's heap growth is asserted, from the steady state on.
    mesh.wait_for_anchor_uptime(WARM_UP_SECS);
    let churned = mesh.measure(true, SECS);
    drop(mesh);
    let mean = |v: &[(String, f64)]| v.iter().map(|a| a.1).sum::<f64>() / v.len() as f64;
    let interval_secs = CHURN_SYNC_EVERY as f64 / churned.anchor_steps_per_sec;
    let (rss0, rss1) = churned.anchor_rss;
    let heap = HeapSteps::of(&churned.anchor_heap_floors);
    eprintln!(
        "churn events: {:?}, joins (name, how, anchor step) {:?}\n\
         churn-free: accuracies {:?} (mean {:.4}), lone control {:.4}, worst stall {:.2} s ({:.0} steps), anchor {:.0} steps/s\n\
         churn: accuracies {:?} (mean {:.4}), lone control {:.4}, worst stall of a node {:.2} s ({:.0} of the mean node's steps), of the mesh {:.2} s \
         (status polled in rounds of up to {:.2} s), full-sync interval {:.2} s, anchor {:.0} steps/s\n\
         anchor heap floors before each event and at the end {:?} bytes: {:+.1}% in all, \
         {:+.1}% without its largest step; RSS {} KiB -> {} KiB ({:+.1}%)\n\
         churn-free measure's heap floors (its first minute, before the steady state) {:?}, RSS {} -> {} KiB",
        churned.events,
        churned.joins,
        calm.accuracies,
        mean(&calm.accuracies),
        calm.lone_accuracy,
        calm.worst_stall,
        calm.worst_stall_steps,
        calm.anchor_steps_per_sec,
        churned.accuracies,
        mean(&churned.accuracies),
        churned.lone_accuracy,
        churned.worst_stall,
        churned.worst_stall_steps,
        churned.mesh_stall,
        churned.poll_round,
        interval_secs,
        churned.anchor_steps_per_sec,
        churned.anchor_heap_floors,
        heap.total * 100.0,
        heap.without_largest * 100.0,
        rss0,
        rss1,
        (rss1 as f64 / rss0 as f64 - 1.0) * 100.0,
        calm.anchor_heap_floors,
        calm.anchor_rss.0,
        calm.anchor_rss.1,
    );
    assert_eq!(churned.events.len(), 5, "{:?}", churned.events);
    assert!(
        churned.worst_stall_steps <= 2.0 * CHURN_SYNC_EVERY as f64,
        "a node stood still while the mean node took {:.0} steps, more than two sync \
         intervals ({} steps)",
        churned.worst_stall_steps,
        2 * CHURN_SYNC_EVERY
    );
    for (run, what) in [(&calm, "churn-free"), (&churned, "churned")] {
        assert!(
            run.lone_accuracy < 0.45,
            "a node alone on four of ten classes reached {:.4}: the parts are not skewed",
            run.lone_accuracy
        );
        for (name, a) in &run.accuracies {
            assert!(
                *a > run.lone_accuracy + MESH_TAUGHT,
                "{what} run: {name} at {a:.4}, not above the lone control's {:.4} by \
                 {MESH_TAUGHT}: it learnt too little from the mesh ({:?})",
                run.lone_accuracy,
                run.accuracies
            );
        }
    }
    let gain = |run: &ChurnRun| mean(&run.accuracies) - run.lone_accuracy;
    assert!(
        gain(&churned) >= CHURN_KEEPS * gain(&calm),
        "the churned mesh taught {:.4} over its lone control, the churn-free one {:.4}: churn \
         cost more than {:.0}% of it",
        gain(&churned),
        gain(&calm),
        (1.0 - CHURN_KEEPS) * 100.0
    );
    // The mesh, not only the model: every node that joined took up the mesh's progress, a restarted one from its own checkpoint
    // and a fresh one from a donor, and no node rejected an honest update.
    for (name, s) in &churned.finals {
        let Some((_, how, anchor_step)) = churned.joins.iter().rev().find(|(n, ..)| n == name)
        else {
            continue;
        };
        // A restarted node killed before its first checkpoint was on disk joins as a fresh
        // one does.
        let resumed = s["resumed_from"]["step"].as_u64();
        let downloaded = s["state_download"]["step"].as_u64();
        let started_at = match *how {
            "restarted" => resumed.or(downloaded),
            _ => downloaded,
        }
        .unwrap_or(0);
        assert!(
            started_at as f64 >= 0.9 * *anchor_step as f64,
            "{name} ({how}) started from step {started_at}; the anchor was at {anchor_step}"
        );
    }
    for (name, s) in calm.finals.iter().chain(&churned.finals) {
        assert_eq!(
            s["updates"]["rejected"].as_u64(),
            Some(0),
            "{name} rejected updates: {}",
            s["last_rejection"]
        );
    }
    assert_eq!(
        churned.anchor_heap_floors.len(),
        churned.events.len() + 1,
        "a heap floor before each event and at the end"
    );
    let bound = HEAP_GROWTH_PER_EVENT * (churned.events.len() - 1) as f64;
    assert!(
        heap.without_largest <= bound,
        "the anchor's live heap grew {:.1}% over the {} kills and joins besides its largest \
         step (at most {:.0}%): floors {:?}",
        heap.without_largest * 100.0,
        churned.events.len() - 1,
        bound * 100.0,
        churned.anchor_heap_floors
    );
}

/// How far above the lone control every node of the mesh must be, each taken as the median
/// of its last 10 s of evaluations. Measured here: the lone control at 0.407, churn-free nodes
/// 0.53-0.64, churned ones 0.55-0.69 (so the least taught node 0.12 above it). A single
/// final evaluation per node, as this test first took, is noisier: CI saw one node at 0.454
/// against a bound of 0.457 where this machine's runs had 0.53 and more.
const MESH_TAUGHT: f64 = 0.05;

/// How much of what the mesh teaches churn may cost: the survivors' mean gain over the lone
/// control must be at least this share of the churn-free mesh's (measured: churn-free gain
/// 0.178, churned 0.219; nodes of one churn-free run spread 0.53-0.64).
const CHURN_KEEPS: f64 = 0.5;

/// A node's live heap as its status counts it.
fn heap_bytes(status: &Value) -> Option<u64> {
    status["memory"]["heap_bytes"].as_u64()
}

/// The anchor's live heap now, from one status poll.
fn anchor_heap(anchor: &Node) -> Option<u64> {
    anchor.status().as_ref().and_then(heap_bytes)
}

/// The most the anchor's live heap may grow per kill and join, as a fraction of its floor
/// before the first: 1% (a leak of 0.46 MB per event at the 46 MB a node holds here).
const HEAP_GROWTH_PER_EVENT: f64 = 0.01;

/// How much of the anchor's live heap [`HEAP_WINDOW`]s before the marks sample: a floor is the
/// least heap count the status polls saw in it, so a state served or messages queued at one
/// instant do not count.
const HEAP_WINDOW: Duration = Duration::from_secs(2);

/// The growth of a series of heap floors, as fractions of the first.
struct HeapSteps {
    /// From the first floor to the last.
    total: f64,
    /// The same without the largest single step between two floors. Gossipsub's time caches
    /// (see [`WARM_UP_SECS`]) are hash tables that double when the message ids of their last
    /// 120 s first pass a power of two and never shrink: one such step of 1-2 MB can come at
    /// any mark once the message rate peaks (a churn-free mesh's anchor: +1.8 MB, 3.9%,
    /// between 150 s and 160 s, then within 0.2 MB to 250 s). A leak grows at every event.
    without_largest: f64,
}

impl HeapSteps {
    fn of(floors: &[u64]) -> HeapSteps {
        let first = floors.first().copied().unwrap_or(1).max(1) as f64;
        let steps: Vec<f64> = floors
            .windows(2)
            .map(|w| w[1] as f64 - w[0] as f64)
            .collect();
        let largest = steps.iter().copied().fold(0.0, f64::max);
        let total: f64 = steps.iter().sum();
        HeapSteps {
            total: total / first,
            without_largest: (total - largest) / first,
        }
    }
}
