//! The core's tests: the seeded simulation of many nodes ([`super::sim`]) and a property test
//! that throws arbitrary inputs at one core.

use std::time::{Duration, Instant};

use libp2p::gossipsub::MessageId;
use libp2p::PeerId;
use p2ptrain_models::params::Layout;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_bytes::ByteBuf;

use super::sim::{Sim, SimParams, SimReport};
use super::*;
use crate::policy::{Mixing, PolicyConfig};
use crate::wire::{self, BulkResponse, Heartbeat};

/// Gossip's policy with `add` mixing, the rule `sim_figures.txt` was recorded with.
fn policy(full_sync_every: u64, staleness_bound: Option<u64>) -> PolicyConfig {
    PolicyConfig {
        publish_every: 20,
        full_sync_every,
        staleness_bound,
        mixing: Mixing::Add,
        ..PolicyConfig::default()
    }
}

fn params(seed: u64, policy: PolicyConfig) -> SimParams {
    SimParams {
        seed,
        nodes: 64,
        hostile: 2,
        secs: 60,
        dim: 32,
        policy,
        churn_every_ms: 5_000,
        quiet_from_ms: None,
        partition: Some((20_000, 30_000)),
        inline_max: 1 << 20,
        links: None,
        side_skew: 0.0,
        rounds: None,
        ring_attack: None,
    }
}

/// The simulator's reports for fixed seeds, recorded from the code as it was before a change
/// to the core: a restructuring that moves no decision leaves every one of them as it was.
const FIGURES: &str = include_str!("sim_figures.txt");

/// Fails when `r` differs from the report recorded under `name` in `sim_figures.txt`. A change
/// that means to alter the core's decisions re-records them (and says why in its commit):
/// `P2PTRAIN_RECORD_SIM_FIGURES=1 cargo test -p p2ptrain-daemon --lib mesh_core::tests -- --nocapture 2>&1 | sed -n 's/^FIGURE //p' | sort -u > daemon/src/mesh_core/sim_figures.txt`
fn check_figures(name: &str, r: &SimReport) {
    let line = format!("{name}: {r:?}");
    eprintln!("FIGURE {line}");
    if std::env::var_os("P2PTRAIN_RECORD_SIM_FIGURES").is_some() {
        return;
    }
    let recorded = FIGURES
        .lines()
        .find(|l| l.starts_with(&format!("{name}: ")))
        .unwrap_or_else(|| panic!("no figures recorded for {name} (see check_figures)"));
    if let Some(why) = figures_differ(recorded, &line) {
        panic!(
            "the simulator's figures for {name} changed: {why} (see check_figures to re-record them)"
        );
    }
}

/// Where two reports (as `{:?}` prints them) differ, if they do, field by field: integers and
/// everything that is not a number exactly, floating-point figures to a relative 1e-9 (a
/// change of summation order is no change of decision; a changed decision moves a figure far
/// more), and two figures both below 1e-12 in size alike (the consensus of members holding
/// the same bits is rounding, ~1e-16). Names the field, as the last name before the first
/// difference.
fn figures_differ(recorded: &str, now: &str) -> Option<String> {
    fn tokens(text: &str) -> Vec<&str> {
        let word = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '+');
        let mut out = Vec::new();
        let mut start = None;
        for (i, c) in text.char_indices() {
            match (word(c), start) {
                (true, None) => start = Some(i),
                (false, Some(s)) => {
                    out.push(&text[s..i]);
                    start = None;
                }
                _ => {}
            }
            if !word(c) && !c.is_whitespace() {
                out.push(&text[i..i + c.len_utf8()]);
            }
        }
        if let Some(s) = start {
            out.push(&text[s..]);
        }
        out
    }
    let is_integer = |t: &str| t.parse::<i128>().is_ok();
    let (a, b) = (tokens(recorded), tokens(now));
    let mut field = "";
    for (x, y) in a.iter().zip(&b) {
        let same = x == y
            || match (x.parse::<f64>(), y.parse::<f64>()) {
                _ if is_integer(x) && is_integer(y) => false,
                (Ok(p), Ok(q)) if p.is_finite() && q.is_finite() => {
                    let size = p.abs().max(q.abs());
                    size < 1e-12 || (p - q).abs() <= 1e-9 * size
                }
                _ => false,
            };
        if !same {
            return Some(format!("{field}: recorded {x}, now {y}"));
        }
        if x.starts_with(|c: char| c.is_ascii_alphabetic())
            && x.parse::<f64>().is_err()
            && !matches!(*x, "Some" | "None")
        {
            field = x;
        }
    }
    (a.len() != b.len()).then(|| format!("recorded {} tokens, now {}", a.len(), b.len()))
}

/// The figures' comparison: a float within 1e-9 is the same, an integer off by one or a float
/// off by 1e-6 is not, and the difference is named by its field.
#[test]
fn figures_are_compared_field_by_field_integers_exactly_floats_to_1e_9() {
    let report = |consensus: &str, applied: &str, heal: &str| {
        format!(
            "x: SimReport {{ consensus: {consensus}, applied: {applied}, consensus_at_heal: Some({heal}), counters: {{\"updates.sent\": 7}} }}"
        )
    };
    let recorded = report("0.19577748825851526", "3781", "1e-5");
    assert_eq!(figures_differ(&recorded, &recorded), None);
    assert_eq!(
        figures_differ(
            &recorded,
            &report("0.19577748825851530", "3781", "1.0000000000001e-5")
        ),
        None
    );
    let why = figures_differ(&recorded, &report("0.19577748825851526", "3782", "1e-5"));
    assert_eq!(why.as_deref(), Some("applied: recorded 3781, now 3782"));
    let why = figures_differ(&recorded, &report("0.1957784", "3781", "1e-5"));
    assert!(why.is_some_and(|w| w.starts_with("consensus:")));
    let why = figures_differ(&recorded, &report("0.19577748825851526", "3781", "2e-5"));
    assert_eq!(
        why.as_deref(),
        Some("consensus_at_heal: recorded 1e-5, now 2e-5")
    );
    // Relative below 1 too: 1e-5 against 1.00001e-5 differs; rounding-sized figures do not.
    assert!(figures_differ(
        &recorded,
        &report("0.19577748825851526", "3781", "1.00001e-5")
    )
    .is_some());
    assert_eq!(
        figures_differ(&report("2e-16", "1", "NaN"), &report("3e-16", "1", "NaN")),
        None
    );
    assert!(figures_differ(&report("2e-16", "1", "inf"), &report("2e-16", "1", "NaN")).is_some());
    assert!(figures_differ(&recorded, &recorded.replace("7}", "8}")).is_some());
    assert!(figures_differ(&recorded, &recorded.replace("Some(1e-5)", "None")).is_some());
}

fn run(p: SimParams) -> SimReport {
    let started = Instant::now();
    let label = format!(
        "sync every {}, bound {:?}",
        p.policy.full_sync_every, p.policy.staleness_bound
    );
    let r = Sim::new(p).run();
    eprintln!(
        "sim ({label}): consensus {:.4}, honest blamed {}, hostile blamed {}, ssp violations {}, held steps {}, syncs {}, applied {}, worst norm ratio {:.2}, largest map {}, largest queue {}, nodes started {}, {:.1} s",
        r.consensus,
        r.honest_blamed,
        r.hostile_blamed,
        r.ssp_violations,
        r.held_steps,
        r.syncs,
        r.applied,
        r.worst_norm_ratio,
        r.largest_map,
        r.largest_queue,
        r.nodes_started,
        started.elapsed().as_secs_f64()
    );
    r
}

#[test]
fn sixty_four_nodes_with_churn_a_partition_and_hostile_peers_stay_together() {
    let with = run(params(7, policy(50, None)));
    let without = run(params(7, policy(0, None)));
    check_figures("seed7-sync50", &with);
    check_figures("seed7-sync0", &without);
    for r in [&with, &without] {
        // Only the hostile peers were ever blamed, and they were.
        assert_eq!(r.honest_blamed, 0, "{r:?}");
        assert!(r.hostile_blamed > 0, "{r:?}");
        assert!(r.finite, "{r:?}");
        assert!(r.worst_norm_ratio < 3.0, "{r:?}");
        assert!(r.applied > 10_000, "updates flowed: {r:?}");
        assert!(r.largest_map <= 70 && r.largest_queue <= 8, "{r:?}");
        assert!(r.nodes_started > 70, "churn started joiners: {r:?}");
    }
    assert!(with.syncs > 100, "{with:?}");
    assert_eq!(without.syncs, 0, "{without:?}");
    // Syncs are what pull replicas with different data together.
    assert!(
        with.consensus < 0.8 * without.consensus,
        "with syncs {:.4}, without {:.4}",
        with.consensus,
        without.consensus
    );
}

/// Gossip's mean mixing keeps replicas closer than adding mixing where each member's change
/// reaches as many members as it takes changes from: in a 4-node mesh (every member a
/// neighbour of every other) under churn, with neighbour syncs every 50 steps and with none;
/// and in the 64-node mesh with churn, a partition and hostile peers, with syncs. Nothing
/// honest is blamed.
///
/// What it does not do: in the 64-node mesh without syncs it ends further apart than adding
/// (measured 0.39 against 0.20). Neighbours there are drawn one way (a node takes 3 members'
/// updates, and any number take its own), so giving back `3/4` of a change that more or fewer
/// members add does not keep the sum; and mixing changes never pulls apart replicas (a
/// joiner's, a healed partition's) together, where adding lets each one's own steps do it.
/// Neighbour syncs do both.
#[test]
fn mean_mixing_keeps_a_mesh_closer_together_than_adding() {
    let mean = |p: &SimParams| SimParams {
        policy: PolicyConfig {
            mixing: Mixing::Mean,
            ..p.policy.clone()
        },
        ..p.clone()
    };
    let small = |sync_every| SimParams {
        nodes: 4,
        hostile: 0,
        partition: None,
        ..params(7, policy(sync_every, None))
    };
    for p in [small(50), small(0), params(7, policy(50, None))] {
        let add = run(p.clone());
        let mean = run(mean(&p));
        for r in [&add, &mean] {
            assert_eq!(r.honest_blamed, 0, "{r:?}");
            assert!(r.finite, "{r:?}");
            assert!(r.applied > 1_000, "updates flowed: {r:?}");
        }
        assert!(
            mean.consensus < 0.7 * add.consensus,
            "{} nodes, syncs every {}: mean {:.4}, add {:.4}",
            p.nodes,
            p.policy.full_sync_every,
            mean.consensus,
            add.consensus
        );
    }
}

#[test]
fn the_staleness_bound_holds_in_a_sixty_four_node_mesh_with_slow_boxes() {
    let r = run(params(11, policy(50, Some(20))));
    check_figures("seed11-bound20", &r);
    assert_eq!(r.ssp_violations, 0, "{r:?}");
    assert!(
        r.held_steps > 0,
        "the fast boxes waited for the slow ones: {r:?}"
    );
    assert_eq!(r.honest_blamed, 0, "{r:?}");
}

#[test]
fn the_simulation_is_deterministic() {
    let small = |seed| SimParams {
        nodes: 12,
        secs: 15,
        ..params(seed, policy(50, Some(20)))
    };
    let a = Sim::new(small(3)).run();
    let b = Sim::new(small(3)).run();
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    check_figures("seed3-small", &a);
}

/// Small meshes over several seeds and policies, announced (pulled) updates included: cheap
/// figures that pin every rule of the core, for comparing before and after a restructuring.
#[test]
fn small_meshes_over_seeds_and_policies_match_their_recorded_figures() {
    for seed in 1..=4u64 {
        for (name, policy, inline_max) in [
            ("sync50", policy(50, None), 1 << 20),
            ("sync50-bound20", policy(50, Some(20)), 1 << 20),
            ("sync0-pulled", policy(0, None), 64),
        ] {
            let r = Sim::new(SimParams {
                nodes: 16,
                secs: 20,
                inline_max,
                ..params(seed, policy)
            })
            .run();
            assert_eq!(r.honest_blamed, 0, "{r:?}");
            check_figures(&format!("seed{seed}-16-{name}"), &r);
        }
    }
}

fn fuzz_core(seed: u64) -> MeshCore {
    MeshCore::new(fuzz_config(seed))
}

/// The fuzz core's parameter layout: one tensor of 8 values.
fn fuzz_layout() -> Layout {
    Layout {
        entries: vec![("w".into(), vec![8])],
    }
}

fn fuzz_config(seed: u64) -> CoreConfig {
    let me = PeerId::random();
    CoreConfig {
        me,
        run_id: "00aa".into(),
        layout: fuzz_layout(),
        mesh: MeshConfig::plain(64),
        policy: PolicyConfig {
            publish_every: 2,
            full_sync_every: 3,
            staleness_bound: Some(4),
            // Mean mixing's path (own updates kept until the network reports them) fuzzed too.
            mixing: Mixing::Mean,
            ..PolicyConfig::default()
        },
        update_weight: None,
        start_step: 0,
        seed,
        wall_clock: WallClock {
            unix_secs: 0,
            at: Instant::now(),
        },
        rounds: None,
    }
}

fn random_bytes(rng: &mut StdRng) -> Vec<u8> {
    let n = rng.random_range(0..200);
    (0..n).map(|_| rng.random()).collect()
}

fn random_values(rng: &mut StdRng) -> Vec<f32> {
    let n = [0, 7, 8, 9, 1000][rng.random_range(0..5)];
    (0..n)
        .map(|_| match rng.random_range(0..20) {
            0 => f32::NAN,
            1 => f32::INFINITY,
            _ => rng.random_range(-1e6..1e6),
        })
        .collect()
}

/// An update frame of `author`'s whose checksum holds (the fuzz core's run and layout, any
/// codec, values finite or not), half the time with one bit changed and the checksum made
/// right again: random bytes never pass the checksum, so without these the checks behind it
/// (header, counts, norms, replay) saw no hostile input.
fn sealed_update(rng: &mut StdRng, author: &PeerId) -> Vec<u8> {
    use p2ptrain_models::codec::{self, Codec, ScaleGroup, UpdateHeader, ValueFormat};
    let layout = fuzz_layout();
    let step: u64 = rng.random_range(0..1_000);
    let header = UpdateHeader {
        run_id: codec::id_bytes("00aa"),
        layout: codec::id_bytes(&layout.hash()),
        sender: codec::sender_bytes(&author.to_bytes()),
        base_step: step.saturating_sub(rng.random_range(0..3)),
        step,
        codec: [
            Codec::Dense,
            Codec::F16,
            Codec::Bf16,
            Codec::TopK(ValueFormat::F32),
            Codec::OneBit(ScaleGroup::Tensor),
        ][rng.random_range(0..5)],
        numel: layout.numel() as u32,
    };
    let values: Vec<f32> = (0..layout.numel())
        .map(|_| match rng.random_range(0..10) {
            0 => f32::NAN,
            1 => rng.random_range(-1e6..1e6),
            _ => rng.random_range(-0.1..0.1),
        })
        .collect();
    let Ok(encoded) = codec::encode(&header, &layout, &values, 0.5) else {
        return random_bytes(rng);
    };
    let mut bytes = encoded.bytes;
    if rng.random() && !bytes.is_empty() {
        let at = rng.random_range(0..bytes.len());
        bytes[at] ^= 1 << rng.random_range(0..8);
        codec::reseal(&mut bytes);
    }
    wire::encode_update_frame(&wire::UpdateFrame::Inline(&bytes))
}

/// A property test: whatever arrives in whatever order, at whatever instants (backwards
/// included), the core neither panics nor grows without bound. Gossip payloads are random
/// bytes or updates that pass the checksum ([`sealed_update`]): some of those are taken,
/// some rejected, and both are asserted to happen.
#[test]
fn arbitrary_inputs_never_panic_and_memory_stays_bounded() {
    let (mut taken, mut rejected) = (0u64, 0u64);
    for seed in 0..40u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut core = fuzz_core(seed);
        let pool: Vec<PeerId> = (0..300).map(|_| PeerId::random()).collect();
        let base = Instant::now() + Duration::from_secs(3600);
        let mut t: i64 = 0;
        for k in 0..3_000u64 {
            t += rng.random_range(-500..2_000);
            let now = base + Duration::from_millis(t.max(0) as u64);
            let now = if t < 0 {
                base - Duration::from_millis((-t) as u64)
            } else {
                now
            };
            let peer = pool[rng.random_range(0..pool.len())];
            let topic = match rng.random_range(0..4) {
                0 => heartbeat_topic("00aa"),
                1 => update_topic("00aa", &peer),
                2 => update_topic("00aa", &pool[0]),
                _ => "junk".into(),
            };
            let input = match rng.random_range(0..12) {
                0 => Input::PeerUp(peer),
                1 => Input::PeerDown(peer),
                2 | 3 => Input::Gossip {
                    source: peer,
                    author: if rng.random() { Some(peer) } else { None },
                    id: MessageId::from(k.to_le_bytes().to_vec()),
                    topic,
                    data: if rng.random() {
                        sealed_update(&mut rng, &peer)
                    } else {
                        random_bytes(&mut rng)
                    },
                },
                4 => Input::Fetched {
                    owner: peer,
                    source: peer,
                    id: MessageId::from(k.to_le_bytes().to_vec()),
                    hash: [0; 32],
                    answer: FetchAnswer::Bytes(random_bytes(&mut rng)),
                },
                5 => Input::ParamsReply {
                    peer,
                    answer: if rng.random() {
                        Ok(BulkResponse::Params {
                            step: rng.random(),
                            layout: "x".into(),
                            values: ByteBuf::from(random_bytes(&mut rng)),
                        })
                    } else {
                        Err(RequestFailed::Network("gone".into()))
                    },
                },
                6 => Input::Progress(Progress {
                    phase: Phase::Training,
                    step: rng.random_range(0..1_000),
                    param_norm: rng.random_range(0.0..10.0),
                    ..Progress::default()
                }),
                7 => Input::Trainer(TrainerEvent::Stepped {
                    step: rng.random_range(0..1_000),
                    pending_ratio: rng.random(),
                }),
                8 => Input::Trainer(TrainerEvent::Delta {
                    base_step: rng.random(),
                    step: rng.random(),
                    delta: random_values(&mut rng),
                }),
                9 => Input::Trainer(TrainerEvent::Averaged {
                    seq: rng.random_range(0..5),
                    outcome: AverageOutcome::Averaged(rng.random()),
                }),
                10 => Input::Trainer(TrainerEvent::Restored {
                    step: rng.random_range(0..1_000),
                }),
                _ => Input::Tick,
            };
            let _ = core.handle(input, now);
            if rng.random_range(0..4) == 0 {
                let _ = core.next_apply();
            }
            assert!(core.neighbours().len() <= 3);
            if k % 100 == 0 {
                // Rendered now and then: status is a view, built when asked for.
                let s = core.status(now);
                assert!(s.members.len() <= pool.len());
                assert!(s.rejected_by_peer.len() <= pool.len());
                assert!(s.progress.len() <= pool.len());
            }
            let sizes = core.sizes();
            assert!(sizes.per_peer_max <= pool.len());
            assert!(sizes.pending <= updates::PENDING_CAP);
            assert!(sizes.large <= updates::LARGE_UPDATE_CAP);
            assert!(sizes.seen_steps <= pool.len());
        }
        let updates = core.status(base).updates;
        taken += updates.received.saturating_sub(updates.rejected);
        rejected += updates.rejected;
    }
    assert!(
        taken > 0 && rejected > 0,
        "taken {taken}, rejected {rejected}"
    );
}

/// `values` with every non-finite value made 0.
fn finite(mut values: Vec<f32>) -> Vec<f32> {
    values
        .iter_mut()
        .filter(|v| !v.is_finite())
        .for_each(|v| *v = 0.0);
    values
}

/// The property above with rounds switched on: an `allreduce`, `ddp` or `diloco` member (by
/// seed, founder or joiner) takes ring hops of every shape (its ring's digest or not, this
/// round and attempt or any, past the limits, of every size, f32, bf16 or int8, with NaN now and
/// then, larger ones in pieces sent in any order, now and then changed on the way), heartbeats
/// of members ready for rounds (with their round), the trainer's
/// parameters (finite, as the trainer guarantees), gradients and combines, undelivered hops and
/// ticks: the core never panics, the hops it holds stay within their bounds, and no peer's hop
/// makes a mean it hands the trainer non-finite.
#[test]
fn arbitrary_round_inputs_never_panic_and_the_inbox_stays_bounded() {
    // Hops of more than four f32 values travel in pieces.
    const PIECE_BYTES: usize = 16;
    let mut combines = 0;
    for seed in 0..30u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let kind = seed % 3;
        let mut cfg = fuzz_config(seed);
        let me = cfg.me;
        cfg.rounds = Some((
            rounds::config::RoundConfig {
                steps: 3,
                weight: 1.0,
                gradients: (kind == 1).then_some(4),
                min_members: 1 + (seed % 2) as usize,
                batch: 4,
                balance: kind == 1,
                outer_state: kind == 2,
                stall_timeout: rounds::STALL_TIMEOUT,
                max_weight: 1.0,
                piece_bytes: PIECE_BYTES,
                outer_values: crate::wire::ValueEncoding::Bf16,
                overlap_steps: 0,
            },
            seed % 4 != 0,
        ));
        let mut core = MeshCore::new(cfg);
        let pool: Vec<PeerId> = (0..5).map(|_| PeerId::random()).collect();
        let mut seqs = vec![0u64; pool.len()];
        // Pieces of hops cut earlier, sent later in any order (some changed on the way).
        let mut pieces: Vec<(PeerId, wire::RingMessage)> = Vec::new();
        let base = Instant::now() + Duration::from_secs(3600);
        let mut t = 0u64;
        for k in 0..4_000u64 {
            t += rng.random_range(0..1_500);
            let now = base + Duration::from_millis(t);
            let i = rng.random_range(0..pool.len());
            let peer = pool[i];
            let choice = match rng.random_range(0..3) {
                0 if !pieces.is_empty() => 13,
                _ => rng.random_range(0..13),
            };
            let input = match choice {
                13 => {
                    let (peer, mut msg) = pieces.swap_remove(rng.random_range(0..pieces.len()));
                    if rng.random_range(0..8) == 0 {
                        msg.step += 1;
                    }
                    Input::Ring { peer, msg }
                }
                0 => Input::PeerUp(peer),
                1 => Input::PeerDown(peer),
                2 | 3 => {
                    seqs[i] += 1;
                    let beat = Heartbeat {
                        seq: seqs[i],
                        step: rng.random_range(0..200),
                        in_rounds: rng.random_range(0..5) > 0,
                        round: [None, Some(0), Some(1), Some(2)][rng.random_range(0..4)],
                        needs_state: kind == 2 && rng.random_range(0..4) == 0,
                        ..Heartbeat::default()
                    };
                    Input::Gossip {
                        source: peer,
                        author: Some(peer),
                        id: MessageId::from(k.to_le_bytes().to_vec()),
                        topic: heartbeat_topic("00aa"),
                        data: wire::encode_heartbeat(&beat),
                    }
                }
                4..=6 => {
                    let mut members: Vec<PeerId> =
                        pool.iter().copied().filter(|_| rng.random()).collect();
                    members.push(me);
                    members.sort();
                    let n = [0, 1, 2, 4, 5, 8, 9, 16, 24, 25][rng.random_range(0..10)];
                    let values: Vec<f32> = (0..n)
                        .map(|_| match rng.random_range(0..30) {
                            0 => f32::NAN,
                            _ => rng.random_range(-10.0..10.0),
                        })
                        .collect();
                    let encoding = [
                        wire::ValueEncoding::F32,
                        wire::ValueEncoding::F32,
                        wire::ValueEncoding::Bf16,
                        wire::ValueEncoding::Int8,
                    ][rng.random_range(0..4)];
                    let bytes: Vec<u8> = match encoding {
                        wire::ValueEncoding::Bf16 => values
                            .iter()
                            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                            .collect(),
                        wire::ValueEncoding::F32 => {
                            values.iter().flat_map(|v| v.to_le_bytes()).collect()
                        }
                        // As a sender encodes them (the weight last), or any bytes:
                        // exponents no sender names, blocks cut short.
                        wire::ValueEncoding::Int8 if rng.random() => match values.split_last() {
                            Some((last, body)) => encoding.encode(body, *last),
                            None => Vec::new(),
                        },
                        wire::ValueEncoding::Int8 => (0..n + rng.random_range(0..8))
                            .map(|_| rng.random())
                            .collect(),
                    };
                    let digest = if rng.random_range(0..3) > 0 {
                        rounds::members_digest(&members, kind == 2 && rng.random())
                    } else {
                        rng.random()
                    };
                    let msg = wire::RingMessage {
                        round: [0, 1, 2, 3, 1 << 48, u64::MAX][rng.random_range(0..6)],
                        attempt: [0, 1, 2, u32::MAX][rng.random_range(0..4)],
                        members: digest,
                        hop: rng.random_range(0..6),
                        step: rng.random_range(0..200),
                        encoding,
                        values: ByteBuf::from(bytes),
                        piece: wire::Piece::WHOLE,
                    };
                    let mut cut = msg.into_pieces(PIECE_BYTES);
                    if rng.random_range(0..6) == 0 {
                        let last = cut.len() - 1;
                        cut[last].piece = wire::Piece {
                            index: rng.random_range(0..4),
                            count: rng.random_range(0..6),
                        };
                    }
                    let msg = cut.swap_remove(0);
                    pieces.extend(cut.into_iter().map(|m| (peer, m)));
                    Input::Ring { peer, msg }
                }
                // The trainer hands over finite values only (non-finite ones are its
                // divergence, `TrainerError::Diverged`): of any length, though.
                7 => Input::Trainer(TrainerEvent::Params {
                    step: rng.random_range(0..200),
                    values: finite(random_values(&mut rng)),
                }),
                8 => Input::Trainer(TrainerEvent::Gradient {
                    step: rng.random_range(0..200),
                    values: finite(random_values(&mut rng)),
                    samples: rng.random_range(0..8),
                }),
                9 => Input::Trainer(TrainerEvent::Combined {
                    round: rng.random_range(0..4),
                    step: rng.random_range(0..200),
                    outcome: if rng.random() {
                        Ok("digest".into())
                    } else {
                        Err("refused".into())
                    },
                }),
                10 => Input::RingUndelivered {
                    peer,
                    round: rng.random_range(0..4),
                    attempt: rng.random_range(0..4),
                },
                11 => Input::Progress(Progress {
                    phase: Phase::Training,
                    step: rng.random_range(0..200),
                    param_norm: rng.random_range(0.0..10.0),
                    ..Progress::default()
                }),
                _ => Input::Tick,
            };
            for out in core.handle(input, now) {
                if let Output::Trainer(TrainerCommand::Combine { mean, .. }) = out {
                    combines += 1;
                    assert!(mean.iter().all(|v| v.is_finite()), "seed {seed}: {mean:?}");
                }
            }
            let rounds = core.rounds.as_ref().expect("rounds on");
            assert!(rounds.inbox_within_bounds(), "seed {seed}, input {k}");
        }
    }
    // The inputs reach the end of a round now and then, not only its checks.
    assert!(combines > 0, "no round ever combined");
}

/// Over-rate heartbeats are ignored, whoever delivered them (a rejection would also cost
/// every honest peer that relayed a copy within its own count), and their author is
/// penalised for each it sent itself, named once.
#[test]
fn heartbeats_over_their_rate_are_ignored_and_penalise_only_their_author_sending_them() {
    let mut core = fuzz_core(3);
    let (flooder, forwarder) = (PeerId::random(), PeerId::random());
    let now = Instant::now();
    core.handle(Input::PeerUp(flooder), now);
    core.handle(Input::PeerUp(forwarder), now);
    let topic = heartbeat_topic("00aa");
    let mut verdicts = Vec::new();
    let mut offences = 0;
    let mut penalised = Vec::new();
    for seq in 1..=40u64 {
        let source = if seq % 2 == 0 { flooder } else { forwarder };
        let data = wire::encode_heartbeat(&Heartbeat {
            seq,
            ..Heartbeat::default()
        });
        let out = core.handle(
            Input::Gossip {
                source,
                author: Some(flooder),
                id: MessageId::from(seq.to_le_bytes().to_vec()),
                topic: topic.clone(),
                data,
            },
            now,
        );
        for o in out {
            match o {
                Output::Validate {
                    source, acceptance, ..
                } => verdicts.push((source, acceptance)),
                Output::Offence { peer, .. } if peer == flooder => offences += 1,
                Output::Penalise(peer) => penalised.push(peer),
                _ => {}
            }
        }
    }
    let burst = HEARTBEAT_BURST as usize;
    assert!(verdicts[..burst]
        .iter()
        .all(|(_, a)| *a == MessageAcceptance::Accept));
    assert!(verdicts[burst..]
        .iter()
        .all(|(_, a)| *a == MessageAcceptance::Ignore));
    let from_flooder = verdicts[burst..]
        .iter()
        .filter(|(source, _)| *source == flooder)
        .count();
    assert!(from_flooder > 0);
    assert_eq!(penalised, vec![flooder; from_flooder]);
    assert_eq!(offences, 1);
}

/// A synchronous mesh's first round waits for every member's word that it is ready: that
/// word goes out as soon as the node trains, and a new member hears from it within
/// `NEW_MEMBER_HEARTBEAT_AFTER`, not a whole heartbeat period later.
#[test]
fn readiness_and_new_members_bring_the_next_heartbeat_forward() {
    let mut cfg = fuzz_config(7);
    cfg.rounds = Some((
        rounds::config::RoundConfig {
            steps: 1,
            weight: 1.0,
            gradients: Some(25),
            min_members: 2,
            batch: 32,
            balance: true,
            outer_state: false,
            stall_timeout: rounds::STALL_TIMEOUT,
            max_weight: f32::INFINITY,
            piece_bytes: wire::RING_PIECE_BYTES,
            outer_values: crate::wire::ValueEncoding::Bf16,
            overlap_steps: 0,
        },
        true,
    ));
    let topic = heartbeat_topic(&cfg.run_id);
    let mut core = MeshCore::new(cfg);
    let beats = |out: &[Output]| -> Vec<Heartbeat> {
        out.iter()
            .filter_map(|o| match o {
                Output::Publish { topic: t, data } if *t == topic => {
                    Some(wire::decode_heartbeat(data).expect("a heartbeat"))
                }
                _ => None,
            })
            .collect()
    };
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let first = beats(&core.handle(Input::Tick, at(0)));
    assert_eq!(first.len(), 1);
    assert!(!first[0].in_rounds, "not training yet");
    assert!(beats(&core.handle(Input::Tick, at(50))).is_empty());
    let training = |ms_per_sample| {
        Input::Progress(Progress {
            phase: Phase::Training,
            ms_per_sample,
            ..Progress::default()
        })
    };
    core.handle(training(None), at(100));
    let ready = beats(&core.handle(Input::Tick, at(150)));
    assert_eq!(ready.len(), 1, "readiness is told at once");
    assert!(ready[0].in_rounds);
    assert_eq!(ready[0].ms_per_sample, None, "no step measured yet");
    assert!(beats(&core.handle(Input::Tick, at(200))).is_empty());
    // The first measured speed is told at once too; a changed one waits for the period.
    core.handle(training(Some(4.0)), at(250));
    let speed = beats(&core.handle(Input::Tick, at(300)));
    assert_eq!(speed.len(), 1, "the speed is told at once");
    assert_eq!(speed[0].ms_per_sample, Some(4.0));
    core.handle(training(Some(5.0)), at(350));
    assert!(beats(&core.handle(Input::Tick, at(400))).is_empty());
    core.handle(Input::PeerUp(PeerId::random()), at(500));
    assert!(beats(&core.handle(Input::Tick, at(700))).is_empty());
    assert_eq!(beats(&core.handle(Input::Tick, at(850))).len(), 1);
    // Then the period again.
    assert!(beats(&core.handle(Input::Tick, at(1_000))).is_empty());
    assert_eq!(beats(&core.handle(Input::Tick, at(2_900))).len(), 1);
}

/// A joiner's step means nothing until it has a state to train from (it downloads the
/// donor's, steps and all): a neighbour with a staleness bound is not held to it, nor does
/// it report a lead over it. Once the joiner trains, its step counts. (A node ahead by 330
/// steps when a joiner appeared reported a lead of 330 against a bound of 150.)
#[test]
fn a_joiner_without_state_yet_holds_no_neighbour_to_its_step() {
    let fast_cfg = fuzz_config(1);
    let bound = fast_cfg.policy.staleness_bound.expect("a bound");
    let mut joiner_cfg = fuzz_config(2);
    let joiner = joiner_cfg.me;
    joiner_cfg.start_step = 0;
    let topic = heartbeat_topic(&fast_cfg.run_id);
    let mut fast = MeshCore::new(fast_cfg);
    let mut joining = MeshCore::new(joiner_cfg);
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let beat = |out: Vec<Output>| -> Vec<u8> {
        out.into_iter()
            .find_map(|o| match o {
                Output::Publish { topic: t, data } if t == topic => Some(data),
                _ => None,
            })
            .expect("a heartbeat")
    };
    fast.handle(
        Input::Progress(Progress {
            phase: Phase::Training,
            ..Progress::default()
        }),
        at(0),
    );
    fast.handle(
        Input::Trainer(TrainerEvent::Stepped {
            step: 330,
            pending_ratio: 0.0,
        }),
        at(0),
    );
    fast.handle(Input::PeerUp(joiner), at(0));
    let deliver = |fast: &mut MeshCore, data: Vec<u8>, seq: u64, now: Instant| {
        fast.handle(
            Input::Gossip {
                source: joiner,
                author: Some(joiner),
                id: MessageId::from(seq.to_le_bytes().to_vec()),
                topic: topic.clone(),
                data,
            },
            now,
        );
    };
    let starting = beat(joining.handle(Input::Tick, at(10)));
    deliver(&mut fast, starting, 1, at(20));
    assert_eq!(fast.status(at(30)).lead_over_slowest, None);
    assert_eq!(fast.step_limit(at(30)), None, "held to a joiner's step 0");
    // The joiner has its state (the donor's step) and trains.
    joining.handle(
        Input::Progress(Progress {
            phase: Phase::Training,
            step: 330,
            ..Progress::default()
        }),
        at(100),
    );
    let training = beat(joining.handle(Input::Tick, at(2_100)));
    deliver(&mut fast, training, 2, at(2_110));
    assert_eq!(fast.status(at(2_120)).lead_over_slowest, Some(0));
    assert_eq!(fast.step_limit(at(2_120)), Some(330 + bound));
}

/// The core is IO-less and sits below the daemon's other layers: no file of it (tests and
/// the simulator aside) names the trainer, the actors, the network, the store or the clock.
/// A core that reads the system clock, or reaches up into a module that uses it, could no
/// longer be replayed by the simulator in virtual time.
#[test]
fn the_core_reaches_neither_up_nor_out() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/mesh_core");
    let forbidden = [
        "crate::trainer",
        "crate::store",
        "crate::mesh::",
        "crate::node",
        "crate::network",
        "crate::control",
        "crate::transfer",
        "crate::checkpoint",
        "crate::status",
        "tokio",
        "std::fs",
        "std::net",
        "SystemTime",
        "Instant::now",
    ];
    let read = crate::import_scan::assert_names_none(dir.as_ref(), &["sim"], &forbidden);
    assert!(read >= 9, "read {read} files of the core");
}

/// The simulator's large scenario: 1,000 nodes, each dialing 8 others (about 16 members
/// each), 10 of them hostile; every second a node is killed and a joiner started; for 10 s the
/// mesh is split into two labs whose data pull apart. After the heal the replicas come back
/// together, as close as in the same run never split. (With neighbours that were only ever
/// refilled, never resampled, the healed mesh stayed 2.7 times farther apart.)
#[test]
fn a_thousand_nodes_reconverge_after_a_partition_heals() {
    // The two runs share nothing: each on a core of its own (this test is most of the daemon's
    // unit tests' wall time).
    let (split, whole) = std::thread::scope(|s| {
        let split = s.spawn(|| run(SimParams::large_mesh(1000, 5, true)));
        let whole = run(SimParams::large_mesh(1000, 5, false));
        (split.join().expect("the split run"), whole)
    });
    check_figures("seed5-1000-split", &split);
    check_figures("seed5-1000-whole", &whole);
    let at_heal = split.consensus_at_heal.expect("the partition healed");
    assert!(
        at_heal > 2.0 * whole.consensus,
        "the split drove the labs apart: {at_heal:.4} at the heal, {:.4} whole",
        whole.consensus
    );
    assert!(
        split.consensus < 0.5 * at_heal && split.consensus < 1.25 * whole.consensus,
        "healed {:.4}, at the heal {at_heal:.4}, never split {:.4}",
        split.consensus,
        whole.consensus
    );
    for r in [&split, &whole] {
        assert_eq!(r.honest_blamed, 0, "{:?}", r.honest_why);
        assert!(r.hostile_blamed > 0 && r.finite);
        assert!(r.nodes_started > 1_030, "churn started joiners: {r:?}");
    }
}

/// A synchronous mode's rounds as `config::sections` builds them: `steps` apart, summing
/// gradients between parameter rounds every `gradients` (`ddp`), none below `min_members`.
fn round_config(gradients: Option<u64>, steps: u64, min_members: usize) -> RoundConfig {
    RoundConfig {
        steps,
        weight: 1.0,
        gradients,
        min_members,
        batch: 32,
        balance: false,
        outer_state: false,
        stall_timeout: rounds::STALL_TIMEOUT,
        max_weight: f32::INFINITY,
        piece_bytes: wire::RING_PIECE_BYTES,
        outer_values: crate::wire::ValueEncoding::Bf16,
        overlap_steps: 0,
    }
}

/// The synchronous modes through churn: 12 nodes on the simulator's links (one box in eight
/// slow, behind 80-160 ms links), a node killed silently and a joiner started every 8 s until
/// 25 s, then 15 s of quiet, against the same run without churn. Every ring leaves its
/// members with bit-identical parameters (the ring's promise, checked on each member's digest
/// as it takes the mean); after the quiet every node is synced (joiners and members that the
/// mesh went on without brought in); nobody honest is blamed; the rounds go on at no less
/// than half the pace of the run without churn. `ddp` hops travel as bf16, so a sender that kept
/// unrounded values would break the first check.
#[test]
fn rounds_keep_their_members_identical_through_kills_and_joins() {
    for (name, rc) in [
        ("allreduce", round_config(None, 20, 2)),
        ("ddp", round_config(Some(4), 1, 2)),
    ] {
        let churned = Sim::new(SimParams {
            churn_every_ms: 8_000,
            ..SimParams::rounds(12, 9, rc)
        })
        .run();
        let calm = Sim::new(SimParams {
            churn_every_ms: 0,
            ..SimParams::rounds(12, 9, rc)
        })
        .run();
        check_figures(&format!("seed9-12-{name}-churn8s"), &churned);
        check_figures(&format!("seed9-12-{name}-calm"), &calm);
        let (with, without) = (
            churned.rounds.clone().expect("rounds ran"),
            calm.rounds.clone().expect("rounds ran"),
        );
        eprintln!("{name}: churn {with:?}, calm {without:?}");
        assert_eq!(churned.nodes_started, 15, "three joiners: {churned:?}");
        for (r, rounds) in [(&churned, &with), (&calm, &without)] {
            assert_eq!(rounds.split, 0, "{name}: {rounds:?}");
            assert_eq!(rounds.unsynced, 0, "{name}: {rounds:?}");
            // Honest parts are never refused, and rarely beyond the clipping radius (then
            // their chunk's aggregate is CenteredClip's, not the plain mean): at most one
            // part in a hundred rounds a member completes.
            assert_eq!(rounds.refused, 0, "{name}: {rounds:?}");
            assert!(
                rounds.clipped * 100 <= rounds.completed,
                "{name}: {rounds:?}"
            );
            assert_eq!(r.honest_blamed, 0, "{name}: {:?}", r.honest_why);
            assert!(r.finite && rounds.taken > 0, "{name}: {r:?}");
        }
        assert!(
            2 * with.highest >= without.highest && without.highest >= 10,
            "{name}: {} rounds through churn, {} without",
            with.highest,
            without.highest
        );
    }
}

/// `ddp` with the config's defaults (`min_members = 1`, a parameter round every 25) on four
/// nodes whose members die every 5 s: three times a ring formed of members none of which was
/// synced (seed 4; the seed was 18 until a joiner in a ring of three stopped finding a member
/// a round ahead contradicted, 10 until an attempt whose lists differ waited to judge its
/// parts, and 2 while rings were sequential: the case needs a pace that makes it).
/// Such a ring founds one state (`rounds::tests::a_ring_without_a_synced_member_founds_one_state`);
/// before that rule, its members kept their own parameters, called themselves synced, and
/// stepped from different parameters: 2 of 41 rings here ended split. Seed 1 too: a kill took
/// a parameter round's last hop from one member, which then took the next (gradient) round's
/// number on the word of the member that finished it and stayed synced; the two split three
/// rings (of 1,159; seeds 1-59 searched, no other split) until such a member gave up its
/// weight as one that skipped a gradient round always did.
#[test]
fn a_ring_of_unsynced_members_under_churn_ends_identical() {
    for seed in [4, 1] {
        ring_of_unsynced_members_under_churn(seed);
    }
}

fn ring_of_unsynced_members_under_churn(seed: u64) {
    let rc = RoundConfig {
        steps: 1,
        weight: 1.0,
        gradients: Some(25),
        min_members: 1,
        batch: 32,
        balance: true,
        outer_state: false,
        stall_timeout: rounds::STALL_TIMEOUT,
        max_weight: f32::INFINITY,
        piece_bytes: wire::RING_PIECE_BYTES,
        outer_values: crate::wire::ValueEncoding::Bf16,
        overlap_steps: 0,
    };
    let r = Sim::new(SimParams {
        churn_every_ms: 5_000,
        ..SimParams::rounds(4, seed, rc)
    })
    .run();
    let rounds = r.rounds.clone().expect("rounds ran");
    assert_eq!(rounds.split, 0, "seed {seed}: {rounds:?}");
    assert!(
        rounds
            .aborted
            .get("no member synced")
            .is_some_and(|n| *n > 0),
        "seed {seed}: the scenario formed a ring without a synced member: {rounds:?}"
    );
    assert_eq!(r.honest_blamed, 0, "seed {seed}: {:?}", r.honest_why);
}

/// Hops in pieces change nothing: each synchronous mode (`allreduce`, `ddp` with its bf16
/// gradient hops, `diloco` carrying the members' state) on 12 nodes through churn, and a
/// poisoning rogue, ends with the same report, to the bit, whether every hop travels whole or
/// in pieces of two values (8 bytes: every hop of the simulator's 32-value model cut in
/// 3-17 pieces, each delivered as its own request, as a large model's hops are). So a hop
/// put together from pieces is taken as the whole hop was, killed senders' partial hops
/// change no round, and pieces count no offence of an honest sender.
#[test]
fn hops_in_pieces_end_every_mode_as_whole_hops_do() {
    let diloco = RoundConfig {
        outer_state: true,
        ..round_config(None, 20, 2)
    };
    let runs = [
        ("allreduce", round_config(None, 20, 2), 0, None),
        ("ddp", round_config(Some(4), 1, 2), 0, None),
        ("diloco", diloco, 0, None),
        (
            "allreduce-poisoned",
            attacked_mode("allreduce"),
            1,
            Some(crate::ring_attack::RingAttack::Poison),
        ),
    ];
    for (name, rc, hostile, ring_attack) in runs {
        let run = |piece_bytes| {
            Sim::new(SimParams {
                churn_every_ms: 8_000,
                hostile,
                ring_attack,
                ..SimParams::rounds(12, 9, RoundConfig { piece_bytes, ..rc })
            })
            .run()
        };
        let (cut, whole) = (run(8), run(wire::RING_PIECE_BYTES));
        let rounds = whole.rounds.clone().expect("rounds ran");
        assert!(rounds.taken > 10 && rounds.split == 0, "{name}: {rounds:?}");
        assert_eq!(format!("{cut:?}"), format!("{whole:?}"), "{name}");
    }
}

/// `diloco` members that train on while their rounds run (`overlap_steps`) still leave every
/// round with one result, the next round's start, whatever steps each kept on top of it: on 8
/// nodes through churn, every ring's members report the same digest, no honest member is
/// blamed, and the trainers are held for fewer steps than members that wait for each round.
#[test]
fn diloco_members_that_train_on_through_their_rounds_share_each_rounds_bits() {
    let diloco = RoundConfig {
        outer_state: true,
        ..round_config(None, 20, 2)
    };
    let run = |overlap_steps| {
        Sim::new(SimParams {
            churn_every_ms: 8_000,
            ..SimParams::rounds(
                8,
                9,
                RoundConfig {
                    overlap_steps,
                    ..diloco
                },
            )
        })
        .run()
    };
    let (waiting, running_on) = (run(0), run(10));
    let rounds = running_on.rounds.clone().expect("rounds ran");
    assert!(rounds.taken > 10 && rounds.split == 0, "{rounds:?}");
    assert_eq!(running_on.honest_blamed, 0, "{:?}", running_on.honest_why);
    assert!(running_on.finite);
    assert!(
        running_on.held_steps < waiting.held_steps,
        "held {} steps training on, {} waiting",
        running_on.held_steps,
        waiting.held_steps
    );
    assert!(
        running_on.steps > waiting.steps,
        "{} steps training on, {} waiting",
        running_on.steps,
        waiting.steps
    );
}

/// A synchronous mode for the attack matrix, as `config::sections` builds it: `allreduce` (20
/// steps a round, weights at most 1), `diloco` (the same, with the outer state, its outer
/// changes in bf16) or `diloco-int8` (in int8), `ddp` (a parameter round every 4) or `fedavg`
/// (weights the members' sample counts, unbounded); attempts stall after 3 s.
fn attacked_mode(mode: &str) -> RoundConfig {
    let (steps, gradients, weight, max_weight) = match mode {
        "allreduce" | "diloco" | "diloco-int8" => (20, None, 1.0, 1.0),
        "ddp" => (1, Some(4), 1.0, 1.0),
        _ => (20, None, 100.0, f32::INFINITY),
    };
    RoundConfig {
        steps,
        weight,
        gradients,
        min_members: 2,
        batch: 32,
        balance: false,
        outer_state: mode.starts_with("diloco"),
        stall_timeout: Duration::from_secs(3),
        max_weight,
        piece_bytes: wire::RING_PIECE_BYTES,
        outer_values: if mode == "diloco-int8" {
            wire::ValueEncoding::Int8
        } else {
            wire::ValueEncoding::Bf16
        },
        overlap_steps: 0,
    }
}

/// The rounds an honest member may complete before it bans a rogue whose offences are proven
/// (its hops refused as they arrive, or its parts and aggregates refused): the bound the
/// attack matrix states, 20 rounds (of 20 steps each), and 40 in `ddp` (a round a step).
/// Measured (seed 9): 0 rounds for poison, kill and hops of the largest length in every mode
/// (banned within the attempts they spoil); for hops of round `u64::MAX`, 12-13 rounds, and
/// 30 in `ddp` (left out at the first, its offences then come one attempt of its own apart,
/// a time that holds more of `ddp`'s short rounds).
fn ban_within_rounds(mode: &str) -> u64 {
    if mode == "ddp" {
        40
    } else {
        20
    }
}

/// The attack matrix in the simulator: eight members on the simulator's links (one box in
/// eight slow), the last one hostile, 40 virtual seconds, beside the same run with the
/// hostile member honest (its control). Every attack runs in each of `allreduce`, `diloco`
/// (the members' outer state carried while one needs it; outer changes in bf16, and in int8
/// as `diloco-int8`), `fedavg` and `ddp`; a claimed
/// weight in `fedavg`, the one mode whose weights differ. (The simulator's `fedavg` members
/// weigh alike, so its other rows are `allreduce`'s at another scale.) Measured (seed 9,
/// 61 pairs): the honest members complete 72-100% of the control's rounds (the fewest: a
/// rogue naming the next round to the same members every round, in `ddp`), their mean's
/// loss is at most 2.12 x the control's (hops of round `u64::MAX`), no ring ever ends
/// split, nobody honest is blamed or banned. Poison, kill, hops of the model's largest
/// length and hops of round `u64::MAX` are offences, and every honest member bans the rogue
/// within [`ban_within_rounds`]; a claimed weight is bounded, and the rogue stays; a
/// staller, a rogue whose hops name a round a million ahead (a staller to the members,
/// which follow no single member that far), one whose hops name the next attempt, one whose
/// hops name the next round (to all, to a quarter of the members only, or to the same
/// members every round) are left out by every honest member, the last three as members most
/// honest members, or one member twice, accused (`Rounds::accuse`). The history of these
/// rows (what each attack did before its defence) is in the notes of the issue that built
/// them. The bounds asserted: at least half the control's rounds, at most 2.5 x its loss,
/// consensus no worse than 1.5 x its (or 0.005), and for a proven attack most honest members
/// ban it within [`ban_within_rounds`].
#[test]
fn one_hostile_member_of_eight_spoils_no_round_in_the_simulator() {
    use crate::ring_attack::RingAttack;
    // Every attack in each of the three modes (a claimed weight in `fedavg` only, the
    // one mode where members' weights differ), and in `ddp`.
    let matrix = [
        RingAttack::Poison,
        RingAttack::Kill,
        RingAttack::Stall,
        RingAttack::Hijack,
        RingAttack::NextRound,
        RingAttack::NextAttempt,
        RingAttack::Oversize,
        RingAttack::RoundMax,
        RingAttack::RelayNextRound,
        RingAttack::TargetedNextRound,
        RingAttack::Step,
        RingAttack::WrongDigest,
    ]
    .into_iter()
    .flat_map(|a| ["allreduce", "diloco", "diloco-int8", "fedavg", "ddp"].map(|m| (a, m)))
    .chain([(RingAttack::Weight, "fedavg")]);
    for (attack, mode) in matrix {
        let run = |ring_attack| {
            Sim::new(SimParams {
                churn_every_ms: 0,
                hostile: 1,
                ring_attack,
                ..SimParams::rounds(8, 9, attacked_mode(mode))
            })
            .run()
        };
        let (attacked, control) = (run(Some(attack)), run(None));
        let name = format!("{attack:?}/{mode}");
        check_figures(&format!("seed9-8-{mode}-{attack:?}"), &attacked);
        check_figures(&format!("seed9-8-{mode}-control"), &control);
        let (a, c) = (
            attacked.rounds.clone().expect("rounds ran"),
            control.rounds.clone().expect("rounds ran"),
        );
        eprintln!(
            "{name}: {} rounds completed against {}, loss {:.4} against {:.4}, bans {:?}, aborted {:?}",
            a.completed, c.completed, a.loss, c.loss, a.bans, a.aborted
        );
        assert!(attacked.finite, "{name}");
        assert_eq!((a.split, a.unsynced), (0, 0), "{name}: {a:?}");
        assert_eq!(
            attacked.honest_blamed, 0,
            "{name}: {:?}",
            attacked.honest_why
        );
        assert_eq!(a.bans.1, 0, "{name}: an honest member banned");
        assert!(
            2 * a.completed >= c.completed,
            "{name}: {a:?} against {c:?}"
        );
        assert!(a.loss <= 2.5 * c.loss, "{name}: {a:?} against {c:?}");
        // (A `ddp` control ends at 1e-16, bit-identical; an attacked run may end with one
        // member a step ahead of the others, 0.001 apart.)
        assert!(
            attacked.consensus <= (1.5 * control.consensus).max(0.005),
            "{name}: consensus {} against {}",
            attacked.consensus,
            control.consensus
        );
        match attack {
            RingAttack::Poison | RingAttack::Kill | RingAttack::Oversize | RingAttack::RoundMax => {
                assert!(attacked.hostile_blamed > 0, "{name}");
                assert!(a.bans.0 >= 4, "{name}: most of 7 ban it: {a:?}");
                assert!(
                    a.rounds_to_ban <= ban_within_rounds(mode),
                    "{name}: banned after {} rounds",
                    a.rounds_to_ban
                );
            }
            RingAttack::Weight => assert_eq!(a.bans, (0, 0), "{name}"),
            // Its claim is one member's word on the members' step, which no member takes
            // (`Ring::members_step`); the rest of its hops are honest, and nothing shows it
            // lying: no ban, no leave-out, and no honest member far past the control's steps.
            RingAttack::Step => {
                assert_eq!(a.bans, (0, 0), "{name}");
                assert!(
                    a.top_step <= 2 * c.top_step,
                    "{name}: an honest member at step {} against {}",
                    a.top_step,
                    c.top_step
                );
            }
            // Liveness without blame: a list nobody else names proves nothing, but every
            // honest member leaves its sender out after a while.
            RingAttack::WrongDigest => {
                assert_eq!(a.bans, (0, 0), "{name}");
                let left_out = a
                    .aborted
                    .get("left out a member whose list is nobody else's")
                    .copied()
                    .unwrap_or(0);
                assert!(
                    left_out >= 7,
                    "{name}: every honest member leaves it out: {a:?}"
                );
            }
            RingAttack::Stall
            | RingAttack::Hijack
            | RingAttack::NextRound
            | RingAttack::NextAttempt
            | RingAttack::RelayNextRound
            | RingAttack::TargetedNextRound => {
                assert_eq!(a.bans, (0, 0), "{name}");
                // As a staller, or (naming a later round its own hops of the attempt do not
                // back) as a member most members found contradicted.
                let left_out = [
                    "left a staller out",
                    "left out a member most accused",
                    "left out a member accused again",
                ]
                .iter()
                .filter_map(|why| a.aborted.get(*why))
                .sum::<u64>();
                assert!(
                    left_out >= 7,
                    "{name}: every honest member leaves it out: {a:?}"
                );
            }
        }
    }
}
