//! Rounds' rules, one test each, on rings of simulated members carried in order.

use std::collections::VecDeque;

use serde_bytes::ByteBuf;

use super::ring::*;
use super::*;
use crate::sync_guard::GradientScale;
use crate::wire::hop_values::bf16_bits;
use crate::wire::{Heartbeat, RingMessage, ValueEncoding};

/// A member's heartbeat saying it is ready for rounds, at `round`, computing at `ms` per
/// sample.
fn ready_in(round: Option<u64>, ms: Option<f64>) -> Heartbeat {
    Heartbeat {
        in_rounds: true,
        round,
        ms_per_sample: ms,
        ..Heartbeat::default()
    }
}

/// The hops' own bf16 rounding is `half`'s, bit for bit, on edge cases and on a sweep of
/// bit patterns; and a compact hop decodes to exactly the values its sender kept.
#[test]
fn bf16_rounding_matches_half_and_round_trips() {
    let edges = [
        0.0f32,
        -0.0,
        1.0,
        -1.5,
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x3f80_8000), // a tie, even below: stays
        f32::from_bits(0x3f81_8000), // a tie, odd below: rounds up
        f32::from_bits(0x7f7f_ffff),
        f32::from_bits(0x0000_0001),
    ];
    let sweep = (0..200_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)));
    for v in edges.into_iter().chain(sweep) {
        let want = half::bf16::from_f32(v);
        let got = bf16_bits(v);
        if v.is_nan() {
            assert!(half::bf16::from_bits(got).is_nan(), "{v}");
        } else {
            assert_eq!(got, want.to_bits(), "{v} ({:#x})", v.to_bits());
        }
    }
    let values: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.0137).collect();
    let members = vec![PeerId::random(), PeerId::random()];
    let r = super::Ring::new(
        members,
        0,
        values,
        1.0,
        Judge::GradientNorm { norm: 1.0 },
        false,
        ValueEncoding::Bf16,
        0,
        Instant::now(),
    );
    let [(_, msg)] = &r.part_messages(0, 0)[..] else {
        panic!("one part for the other member");
    };
    let sent = ValueEncoding::Bf16
        .decode(&msg.values)
        .expect("whole values");
    // A direct ring's part is the whole contribution, then the weight.
    assert_eq!(sent.len(), r.acc.len() + 1);
    assert_eq!(&sent[..r.acc.len()], &r.acc[..]);
    assert_eq!(sent[r.acc.len()], 1.0);
    assert!(all_finite(&sent));
    assert!(!all_finite(&[1.0, f32::NAN, 2.0]));
    assert!(ValueEncoding::Bf16.decode(&[1, 2, 3]).is_none());
}

/// Nodes of one mesh, their outputs carried in order (a perfect network).
struct Ring {
    ids: Vec<PeerId>,
    nodes: Vec<Rounds>,
    params: Vec<Vec<f32>>,
    /// Each node's trainer step, handed over with its parameters.
    steps: Vec<u64>,
    means: Vec<Option<Vec<f32>>>,
    /// The members' step each node's last `Combine` handed it.
    mean_steps: Vec<Option<u64>>,
    /// Whether each node's last `Combine` said its trainer trained on through the round.
    ran_on: Vec<bool>,
    offences: usize,
    /// Offences, by the member blamed.
    blamed: Vec<usize>,
    /// A hostile member and what it does to each hop it sends (given the receiver's index).
    rogue: Option<(usize, Rogue)>,
    /// Links (sender, receiver) whose hops are lost (a ban closed the connection).
    cut: Vec<(usize, usize)>,
}

/// What a hostile member does to a hop it sends to member `to`.
type Rogue = Box<dyn Fn(&mut RingMessage, usize)>;

/// Rewrites each value of a hop (and leaves its last one, the weight, alone).
fn each_value(msg: &mut RingMessage, f: impl Fn(f32) -> f32) {
    crate::ring_attack::rewrite(msg, |values| {
        let n = values.len() - 1;
        values[..n].iter_mut().for_each(|v| *v = f(*v));
    });
}

/// Sets a hop's last value: a part's weight, an aggregate's weight total.
fn set_weight(msg: &mut RingMessage, w: f32) {
    crate::ring_attack::rewrite(msg, |values| {
        if let Some(last) = values.last_mut() {
            *last = w;
        }
    });
}

impl Ring {
    fn new(n: usize, weights: &[f32], synced: &[bool]) -> Ring {
        Ring::with_gradients(n, weights, synced, None)
    }

    fn with_gradients(n: usize, weights: &[f32], synced: &[bool], gradients: Option<u64>) -> Ring {
        let ids: Vec<PeerId> = (0..n).map(|_| PeerId::random()).collect();
        let nodes = (0..n)
            .map(|i| {
                Rounds::new(
                    RoundConfig {
                        steps: 5,
                        weight: weights[i],
                        gradients,
                        min_members: 1,
                        batch: 4,
                        balance: false,
                        outer_state: false,
                        stall_timeout: STALL_TIMEOUT,
                        max_weight: f32::INFINITY,
                        piece_bytes: crate::wire::RING_PIECE_BYTES,
                        outer_values: crate::wire::ValueEncoding::Bf16,
                        overlap_steps: 0,
                    },
                    ids[i],
                    0,
                    synced[i],
                )
            })
            .collect();
        // Members' parameters as after a round's steps: one model, apart by a little each.
        let params = (0..n)
            .map(|i| {
                (0..10)
                    .map(|j| 1.0 + (j as f32 * 0.37).sin() + 0.03 * i as f32)
                    .collect()
            })
            .collect();
        Ring {
            ids,
            nodes,
            params,
            steps: vec![0; n],
            means: vec![None; n],
            mean_steps: vec![None; n],
            ran_on: vec![false; n],
            offences: 0,
            blamed: Vec::new(),
            rogue: None,
            cut: Vec::new(),
        }
    }

    fn hear_all(&mut self, now: Instant) {
        for i in 0..self.nodes.len() {
            for j in 0..self.nodes.len() {
                if i != j {
                    let round = self.nodes[j].status(Instant::now()).round;
                    let needs_state = self.nodes[j].needs_state();
                    let word = Heartbeat {
                        needs_state,
                        ..ready_in(round, None)
                    };
                    self.nodes[i].heard(self.ids[j], &word, now);
                }
            }
        }
    }

    /// Brings node `i` to its boundary with its parameters handed over, outputs dropped.
    fn bring_to_boundary(&mut self, i: usize, now: Instant) {
        let mut out = Vec::new();
        let step = self.nodes[i].step_limit();
        self.nodes[i].tick(step, true, now, &mut out);
        self.nodes[i].params(self.params[i].clone(), 0, now, &mut out);
    }

    /// Every member's trainer took round 0's mean at step 1; answers what that asked for
    /// (the next round's contribution), to carry.
    fn combine_round_zero(&mut self) -> VecDeque<(usize, Output)> {
        let mut queue = VecDeque::new();
        for i in 0..self.nodes.len() {
            let mut out = Vec::new();
            self.means[i] = None;
            self.nodes[i].combined(0, 1, "d0".into(), &mut out);
            queue.extend(out.into_iter().map(|o| (i, o)));
        }
        queue
    }

    /// The members' sorted list and its digest, as every node builds them.
    fn sorted(&self) -> (Vec<PeerId>, u64) {
        let mut ids = self.ids.clone();
        ids.sort();
        let digest = members_digest(&ids, false);
        (ids, digest)
    }

    /// Runs every node to its boundary and carries messages until none is left.
    fn run(&mut self, now: Instant, alive: &[bool]) {
        let mut queue: VecDeque<(usize, Output)> = VecDeque::new();
        for (i, _) in alive.iter().enumerate().filter(|(_, a)| **a) {
            let mut out = Vec::new();
            let step = self.nodes[i].step_limit();
            self.nodes[i].tick(step, true, now, &mut out);
            queue.extend(out.into_iter().map(|o| (i, o)));
        }
        self.carry(queue, now, alive);
    }

    /// Carries outputs (node, output) until none is left; a trainer asked for a gradient
    /// answers with its `params` vector.
    fn carry(&mut self, queue: VecDeque<(usize, Output)>, now: Instant, alive: &[bool]) {
        self.carry_until(queue, now, alive, |_| false);
    }

    /// [`Ring::carry`] until `stop` holds after an output was carried; answers what is
    /// left to carry.
    fn carry_until(
        &mut self,
        mut queue: VecDeque<(usize, Output)>,
        now: Instant,
        alive: &[bool],
        stop: impl Fn(&Ring) -> bool,
    ) -> VecDeque<(usize, Output)> {
        while let Some((i, o)) = queue.pop_front() {
            let mut out = Vec::new();
            match o {
                Output::Trainer(TrainerCommand::TakeParams) => {
                    self.nodes[i].params(self.params[i].clone(), self.steps[i], now, &mut out)
                }
                Output::Trainer(TrainerCommand::TakeGradient { batch }) => {
                    let step = self.steps[i];
                    self.nodes[i].gradient(self.params[i].clone(), batch, step, now, &mut out)
                }
                Output::Trainer(TrainerCommand::Combine {
                    mean, step, ran_on, ..
                }) => {
                    self.means[i] = Some(mean);
                    self.mean_steps[i] = step;
                    self.ran_on[i] = ran_on;
                }
                Output::SendRing { peer, mut msg } => {
                    let j = self.ids.iter().position(|p| *p == peer).expect("peer");
                    if let Some((r, rogue)) = &self.rogue {
                        if *r == i {
                            rogue(&mut msg, j);
                        }
                    }
                    if alive[j] && !self.cut.contains(&(i, j)) {
                        self.nodes[j].message(self.ids[i], msg, now, &mut out);
                        queue.extend(out.drain(..).map(|o| (j, o)));
                    }
                }
                Output::Offence { peer, .. } => {
                    self.offences += 1;
                    self.blamed
                        .push(self.ids.iter().position(|p| *p == peer).expect("member"));
                }
                _ => {}
            }
            queue.extend(out.into_iter().map(|o| (i, o)));
            if stop(self) {
                break;
            }
        }
        queue
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Members 0 to 2 completed the round, each with the same bits of the mean.
fn assert_the_three_took_one_mean(ring: &Ring) {
    assert!(
        ring.means[..3].iter().all(Option::is_some),
        "the three completed no round"
    );
    let first = bits(ring.means[0].as_ref().expect("mean"));
    assert!(ring.means[..3]
        .iter()
        .all(|m| bits(m.as_ref().expect("mean")) == first));
}

#[test]
fn every_member_ends_a_round_with_the_same_bits_of_the_weighted_mean() {
    for n in [2, 3, 4, 7] {
        let weights: Vec<f32> = (0..n).map(|i| 1.0 + i as f32).collect();
        let mut ring = Ring::new(n, &weights, &vec![true; n]);
        let now = Instant::now();
        ring.hear_all(now);
        ring.run(now, &vec![true; n]);
        let first = ring.means[0].clone().expect("a mean");
        for m in &ring.means {
            assert_eq!(bits(m.as_ref().expect("a mean")), bits(&first), "n = {n}");
        }
        // It is the weighted mean.
        let total: f32 = weights.iter().sum();
        for (j, got) in first.iter().enumerate() {
            let want: f32 = (0..n).map(|i| weights[i] * ring.params[i][j]).sum::<f32>() / total;
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
        // Each member sent 2(N-1)/N of the model (and a weight with each hop), no more.
        let per_member = ring.nodes[0].status(Instant::now()).bytes_sent as f64;
        let model = 11.0 * 4.0;
        let optimal = 2.0 * (n as f64 - 1.0) / n as f64 * model;
        assert!(
            per_member <= optimal + 8.0 * n as f64,
            "{per_member} vs {optimal}"
        );
        assert_eq!(ring.offences, 0);
    }
}

/// A member that claims more weight than any member has (here 5, where each weighs at most
/// one) would shrink the mean towards zero, by an amount a distance judge may admit: its parts
/// are refused by their owners (an offence each) and count for nothing, and its aggregate,
/// whose total is past the ring's weights, is refused by every member (an offence, and the
/// attempt aborts); honest weights pass the same bounds.
#[test]
fn a_weight_past_what_a_member_weighs_is_refused() {
    for (weights, refused) in [([1.0, 1.0, 5.0], true), ([1.0; 3], false)] {
        let mut ring = Ring::new(3, &weights, &[true; 3]);
        for node in &mut ring.nodes {
            node.cfg.max_weight = 1.0;
        }
        let now = Instant::now();
        ring.hear_all(now);
        ring.run(now, &[true; 3]);
        for (i, node) in ring.nodes.iter().enumerate().take(2) {
            let st = node.status(Instant::now());
            let aborted = st
                .aborted
                .get("weight total past the members' weights")
                .copied();
            assert_eq!(ring.means[i].is_none(), refused, "{weights:?}: node {i}");
            assert_eq!(aborted, refused.then_some(1), "{weights:?}: node {i}");
            assert_eq!(
                st.parts_refused,
                u64::from(refused),
                "{weights:?}: node {i}"
            );
        }
        // Two owners refused its part, two members its aggregate.
        assert_eq!(ring.offences, if refused { 4 } else { 0 });
    }
}

/// `ddp`: round 0 sums parameters, the next ones gradients (each asked for as soon as
/// the last round is combined, in bf16 on the wire) until the next multiple of
/// `resync_every`; every member ends each with the same bits, the bf16-rounded mean.
#[test]
fn gradient_rounds_follow_a_parameter_round_and_end_identical_in_bf16() {
    for n in [2, 3] {
        gradient_rounds_of(n);
    }
}

#[test]
fn a_slower_member_takes_the_batch_it_computes_while_the_fastest_computes_its_own() {
    let batch = |own: Option<f64>, others: &[f64]| balanced_batch(32, own, others.iter().copied());
    // Unknown, equal or within the slack: the whole batch.
    assert_eq!(batch(None, &[1.0]), 32);
    assert_eq!(batch(Some(4.0), &[4.0]), 32);
    assert_eq!(batch(Some(4.3), &[4.0]), 32);
    assert_eq!(batch(Some(4.0), &[]), 32);
    // The fastest never shrinks; the one at half speed takes half.
    assert_eq!(batch(Some(4.0), &[8.0]), 32);
    assert_eq!(batch(Some(8.0), &[4.0, 6.0]), 16);
    assert_eq!(batch(Some(6.0), &[4.0]), 21);
    // Claims that are no number are passed over; a claim of great speed costs at most
    // MAX_SHRINK, and a batch is never empty.
    assert_eq!(batch(Some(4.0), &[0.0, -1.0, f64::NAN, f64::INFINITY]), 32);
    assert_eq!(batch(Some(4.0), &[1e-9]), 32 / MAX_SHRINK);
    assert_eq!(balanced_batch(3, Some(4.0), [1e-9].into_iter()), 1);
    assert_eq!(batch(Some(f64::NAN), &[1.0]), 32);
}

/// With `balance`, a member that computes at half the other's speed is asked for half
/// the batch, and its gradient weighs half: the mean is that of the samples computed.
#[test]
fn a_balanced_gradient_round_weighs_each_member_by_its_samples() {
    let alive = vec![true; 2];
    let mut ring = Ring::with_gradients(2, &[1.0, 1.0], &alive, Some(3));
    for node in &mut ring.nodes {
        node.cfg.balance = true;
    }
    ring.nodes[0].own_speed(Some(1.0));
    ring.nodes[1].own_speed(Some(2.0));
    let now = Instant::now();
    for (i, j, ms) in [(0, 1, 2.0), (1, 0, 1.0)] {
        let round = ring.nodes[j].status(Instant::now()).round;
        ring.nodes[i].heard(ring.ids[j], &ready_in(round, Some(ms)), now);
    }
    // Round 0 sums parameters; round 1 is the first gradient round.
    ring.run(now, &alive);
    assert!(ring.means.iter().all(Option::is_some));
    let queue = ring.combine_round_zero();
    let asked: Vec<usize> = queue
        .iter()
        .filter_map(|(_, o)| match o {
            Output::Trainer(TrainerCommand::TakeGradient { batch }) => Some(*batch),
            _ => None,
        })
        .collect();
    assert_eq!(asked, vec![4, 2]);
    ring.carry(queue, now, &alive);
    let mean = ring.means[0].clone().expect("a mean");
    assert_eq!(bits(&mean), bits(ring.means[1].as_ref().expect("a mean")));
    for (j, got) in mean.iter().enumerate() {
        let want = (ring.params[0][j] + 0.5 * ring.params[1][j]) / 1.5;
        assert!(
            (got - want).abs() <= 1e-2 * want.abs().max(1.0),
            "{got} vs {want}"
        );
    }
    assert_eq!(ring.nodes[1].status(Instant::now()).batch, 2);
    assert_eq!(ring.nodes[0].status(Instant::now()).batch, 4);
}

fn gradient_rounds_of(n: usize) {
    let alive = vec![true; n];
    let mut ring = Ring::with_gradients(n, &vec![1.0; n], &alive, Some(3));
    let now = Instant::now();
    ring.hear_all(now);
    ring.run(now, &alive);
    for round in 0..4u64 {
        let means: Vec<Vec<f32>> = ring
            .means
            .iter_mut()
            .map(|m| m.take().expect("mean"))
            .collect();
        let gradient = round % 3 != 0;
        for m in &means {
            assert_eq!(bits(m), bits(&means[0]), "round {round}");
        }
        for (j, got) in means[0].iter().enumerate() {
            let want: f32 = (0..n).map(|i| ring.params[i][j]).sum::<f32>() / n as f32;
            let tolerance = if gradient { 1e-2 } else { 1e-5 };
            assert!(
                (got - want).abs() <= tolerance * want.abs().max(1.0),
                "round {round}: {got} vs {want}"
            );
            let bf = |v: f32| half::bf16::from_f32(v).to_f32();
            if gradient && n == 2 {
                // Two swap whole contributions, each rounded to bf16, and add them.
                let sum = bf(ring.params[0][j]) + bf(ring.params[1][j]);
                assert_eq!(got * 2.0, sum);
            } else if gradient {
                // Each chunk's aggregate went through bf16 on its way to the members.
                assert_eq!(bf(*got), *got);
            }
        }
        // The trainers take the means; the next round is asked for at once, by kind.
        let mut queue = VecDeque::new();
        for i in 0..n {
            let mut out = Vec::new();
            ring.nodes[i].combined(round, round + 1, format!("d{round}"), &mut out);
            let next_is_gradient = (round + 1) % 3 != 0;
            assert!(
                out.iter().any(|o| matches!(
                    o,
                    Output::Trainer(TrainerCommand::TakeGradient { .. }) if next_is_gradient
                ) || matches!(
                    o,
                    Output::Trainer(TrainerCommand::TakeParams) if !next_is_gradient
                )),
                "after round {round}: {out:?}"
            );
            // The trainer takes no step of its own.
            assert_eq!(ring.nodes[i].step_limit(), round + 1);
            queue.extend(out.into_iter().map(|o| (i, o)));
        }
        ring.carry(queue, now, &alive);
    }
    assert_eq!(ring.offences, 0);
    // Each member sent 2(N-1)/N of the model per round, with a weight in each of its
    // 2(N-1) hops: for two in gradient rounds, one whole contribution each way (in bf16,
    // half the bytes).
    let model = 10.0 * 4.0;
    let per_round = |n: f64, hops: f64| 2.0 * (n - 1.0) / n * model + hops * 4.0;
    let gradient_round = if n == 2 {
        per_round(2.0, 1.0) / 2.0
    } else {
        per_round(n as f64, 2.0 * (n as f64 - 1.0)) / 2.0
    };
    let sent = ring.nodes[0].status(Instant::now()).bytes_sent as f64;
    // Rounds 0 and 3 of parameters in f32, rounds 1, 2 and 4 of gradients in bf16.
    let want = 2.0 * per_round(n as f64, 2.0 * (n as f64 - 1.0)) + 3.0 * gradient_round;
    // Chunks of 10 values among 3 are uneven: 4 of them at most, a value apart.
    assert!(
        (sent - want).abs() <= 5.0 * 4.0 * (n - 1) as f64,
        "n = {n}: {sent} vs {want}"
    );
}

/// With `min_members`, no round starts until that many members are ready; then it runs.
#[test]
fn rounds_wait_for_the_minimum_of_members() {
    let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
    for node in &mut ring.nodes {
        node.cfg.min_members = 3;
    }
    let now = Instant::now();
    // Nodes 0 and 1 know each other only.
    for (i, j) in [(0, 1), (1, 0)] {
        ring.nodes[i].heard(ring.ids[j], &ready_in(Some(0), None), now);
    }
    ring.run(now, &[true, true, false]);
    assert!(
        ring.means.iter().all(Option::is_none),
        "a round of two started"
    );
    assert_eq!(ring.nodes[0].status(Instant::now()).ring_size, 0);
    // The third is heard: the next tick starts the round, with all three.
    ring.hear_all(now);
    let mut queue = VecDeque::new();
    for i in 0..3 {
        let mut out = Vec::new();
        let step = ring.nodes[i].step_limit();
        ring.nodes[i].tick(step, true, now, &mut out);
        queue.extend(out.into_iter().map(|o| (i, o)));
    }
    ring.carry(queue, now, &[true; 3]);
    assert!(ring.means.iter().all(Option::is_some), "{:?}", ring.means);
    assert_eq!(ring.nodes[0].status(Instant::now()).ring_size, 3);
}

#[test]
fn a_member_that_dies_aborts_the_round_and_the_retry_leaves_it_out() {
    let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
    let now = Instant::now();
    ring.hear_all(now);
    // The third never answers: the others wait, then learn it is gone.
    ring.run(now, &[true, true, false]);
    assert!(ring.means.iter().all(Option::is_none));
    let dead = ring.ids[2];
    for node in &mut ring.nodes[..2] {
        node.peer_down(dead, now);
        assert_eq!(
            node.status(Instant::now()).aborted.get("member left"),
            Some(&1)
        );
    }
    // After the pause the retry, without it, completes.
    let later = now + RETRY_PAUSE;
    ring.run(later, &[true, true, false]);
    let (a, b) = (ring.means[0].clone(), ring.means[1].clone());
    let a = a.expect("a mean after the retry");
    assert_eq!(bits(&a), bits(&b.expect("a mean")));
    let want: Vec<f32> = (0..10)
        .map(|j| (ring.params[0][j] + ring.params[1][j]) / 2.0)
        .collect();
    assert_eq!(bits(&a), bits(&want));
    assert_eq!(ring.nodes[0].status(Instant::now()).ring_size, 2);
}

/// A member that completed the round and left at once (at `max_steps`) took nothing the
/// others still need: they finish the attempt with the hops under way, with its mean. A
/// member that leaves without having completed it still aborts it.
#[test]
fn a_member_that_leaves_after_completing_the_round_does_not_abort_it() {
    for completed in [true, false] {
        let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
        let now = Instant::now();
        ring.hear_all(now);
        let mut queue = VecDeque::new();
        for i in 0..3 {
            let mut out = Vec::new();
            let step = ring.nodes[i].step_limit();
            ring.nodes[i].tick(step, true, now, &mut out);
            queue.extend(out.into_iter().map(|o| (i, o)));
        }
        let combining = |n: &Rounds| matches!(n.attempt.stage, Stage::Combining { .. });
        let rest = ring.carry_until(queue, now, &[true; 3], |r| r.nodes.iter().any(combining));
        let first = ring.nodes.iter().position(combining).expect("a mean");
        assert_eq!(ring.nodes.iter().filter(|n| combining(n)).count(), 1);
        let leaver = ring.ids[first];
        // Its mean went to its trainer, which stopped before answering: its goodbye names
        // the next round all the same.
        let their_round = if completed {
            ring.nodes[first].leaving_round()
        } else {
            Some(0)
        };
        assert_eq!(their_round, Some(u64::from(completed)));
        let mut alive = [true; 3];
        alive[first] = false;
        for j in (0..3).filter(|j| *j != first) {
            ring.nodes[j].peer_leaving(leaver, their_round);
            ring.nodes[j].peer_down(leaver, now);
        }
        ring.carry(rest, now, &alive);
        let want = ring.means[first].clone().expect("the leaver's mean");
        for j in (0..3).filter(|j| *j != first) {
            let aborted = ring.nodes[j]
                .status(Instant::now())
                .aborted
                .get("member left")
                .copied();
            if completed {
                assert_eq!(aborted, None, "node {j}");
                let got = ring.means[j].clone().expect("a mean without the leaver");
                assert_eq!(bits(&got), bits(&want), "node {j}");
            } else {
                assert_eq!(aborted, Some(1), "node {j}");
                assert!(ring.means[j].is_none(), "node {j}");
            }
        }
    }
}

/// A ring with no synced member (joiners only, or members whose synced peers died) found one
/// state together: the attempt whose weights sum to 0 is tried again with every member's
/// parameters at full weight, and all leave the round synced, with the same bits of the
/// plain mean and the highest step two of them reach. (They used to keep their own parameters,
/// which differ, and call themselves synced: the simulator found `ddp` members of one ring
/// stepping from different parameters for up to `resync_every` rounds.)
#[test]
fn a_ring_without_a_synced_member_founds_one_state() {
    let mut ring = Ring::new(3, &[1.0; 3], &[false; 3]);
    let now = Instant::now();
    for node in &mut ring.nodes {
        node.attempt.round = Some(4);
    }
    // The members' steps differ; each hands over its parameters at its own.
    ring.steps = vec![10, 11, 12];
    ring.hear_all(now);
    ring.run(now, &[true; 3]);
    let want: Vec<f32> = (0..10)
        .map(|j| (0..3).map(|i| ring.params[i][j]).sum::<f32>() / 3.0)
        .collect();
    for i in 0..3 {
        let mean = ring.means[i].clone().expect("a mean");
        assert_eq!(mean.len(), 10, "node {i} keeps its own parameters");
        assert_eq!(bits(&mean), bits(&ring.means[0].clone().expect("a mean")));
        for (got, want) in mean.iter().zip(&want) {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
        // The highest step two of them reach: the one at 12 keeps its own.
        assert_eq!(ring.mean_steps[i], Some(11), "node {i}");
        let st = ring.nodes[i].status(Instant::now());
        assert!(st.synced, "node {i}: {st:?}");
        assert_eq!(st.aborted.get("no member synced"), Some(&1), "node {i}");
        ring.nodes[i].combined(4, 12, "founded".into(), &mut Vec::new());
        assert_eq!(
            ring.nodes[i].status(Instant::now()).digests,
            vec![(
                4,
                "founded".to_string(),
                format!("{:016x}", ring.sorted().1)
            )]
        );
    }
}

/// A round's step is the members', never one hop's: a member whose hops name a step far
/// past the others' (`STEP_LIMIT - 1`, under the bound a hop is refused at) moves neither a
/// joiner nor the founders of a state there. (Taken as the highest step any hop named, it
/// moved every joiner and founder to the end of any schedule, where its next hops were
/// offences and its next checkpoint one its own restore refuses.) Each takes the highest step
/// two members' counted parts reach.
#[test]
fn one_members_step_moves_no_joiner_or_founder_past_the_others() {
    for founding in [false, true] {
        let synced = if founding {
            [false; 4]
        } else {
            [true, true, true, false]
        };
        let mut ring = Ring::new(4, &[1.0; 4], &synced);
        for node in &mut ring.nodes {
            node.attempt.round = Some(4);
        }
        ring.steps = vec![100, 120, 110, if founding { 90 } else { 0 }];
        ring.rogue = Some((
            1,
            Box::new(|msg: &mut RingMessage, _| msg.step = STEP_LIMIT - 1),
        ));
        let now = Instant::now();
        ring.hear_all(now);
        ring.run(now, &[true; 4]);
        for i in [0, 2, 3] {
            assert!(
                ring.means[i].is_some(),
                "founding {founding}: node {i} took no mean"
            );
            let expected = if founding || i == 3 { Some(110) } else { None };
            assert_eq!(
                ring.mean_steps[i], expected,
                "founding {founding}: node {i} took another step"
            );
        }
    }
}

#[test]
fn a_joiner_adopts_the_round_and_leaves_it_with_the_members_mean() {
    let mut ring = Ring::new(3, &[1.0; 3], &[true, true, false]);
    let now = Instant::now();
    assert_eq!(ring.nodes[2].step_limit(), 0, "a joiner holds at once");
    ring.hear_all(now);
    ring.run(now, &[true; 3]);
    let means: Vec<Vec<f32>> = ring
        .means
        .iter()
        .map(|m| m.clone().expect("mean"))
        .collect();
    assert_eq!(bits(&means[2]), bits(&means[0]));
    // Weight 0: its own parameters are not in the mean.
    let want: Vec<f32> = (0..10)
        .map(|j| (ring.params[0][j] + ring.params[1][j]) / 2.0)
        .collect();
    assert_eq!(bits(&means[0]), bits(&want));
    assert_eq!(ring.nodes[2].status(Instant::now()).round, Some(0));
    ring.nodes[2].combined(0, 0, "x".into(), &mut Vec::new());
    assert!(ring.nodes[2].status(Instant::now()).synced);
    assert_eq!(ring.nodes[2].status(Instant::now()).round, Some(1));
    assert_eq!(ring.nodes[2].step_limit(), 5);
}

/// An unsynced member (here a joiner in `ddp`) holds parameters that are not the mesh's:
/// the gradient rounds it takes part in leave no digest in its status until a parameter
/// round syncs it, so members' digests of one round can be compared as they are.
#[test]
fn an_unsynced_member_claims_no_digest_until_a_parameter_round_syncs_it() {
    let mut ring = Ring::with_gradients(2, &[1.0; 2], &[true, false], Some(4));
    let node = &mut ring.nodes[1];
    node.attempt.round = Some(1);
    node.attempt.stage = Stage::Combining {
        carried_state: false,
        ran_on_from: None,
        ring: Some(7),
    };
    node.combined(1, 1, "gradient".into(), &mut Vec::new());
    assert!(!node.status(Instant::now()).synced);
    assert!(
        node.status(Instant::now()).digests.is_empty(),
        "{:?}",
        node.status(Instant::now()).digests
    );
    // Round 4 sums parameters: the node leaves it with the members' mean.
    node.attempt.round = Some(4);
    node.attempt.stage = Stage::Combining {
        carried_state: false,
        ran_on_from: None,
        ring: Some(7),
    };
    node.combined(4, 4, "params".into(), &mut Vec::new());
    assert!(node.status(Instant::now()).synced);
    assert_eq!(
        node.status(Instant::now()).digests,
        vec![(4, "params".to_string(), format!("{:016x}", 7))]
    );
}

#[test]
fn a_member_the_mesh_went_on_without_takes_its_round_with_weight_zero() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let now = Instant::now();
    ring.hear_all(now);
    // Node 0 reaches its boundary and its attempt is aborted (a hop failed) ...
    ring.bring_to_boundary(0, now);
    ring.nodes[0].undelivered(ring.ids[1], 0, 0, now);
    assert_eq!(
        ring.nodes[0]
            .status(Instant::now())
            .aborted
            .get("hop undelivered"),
        Some(&1)
    );
    // ... while the mesh went on: node 1 is at round 3 and sends it its first hop.
    let (sorted, digest) = ring.sorted();
    let _ = sorted;
    let msg = RingMessage {
        step: 0,
        encoding: crate::wire::ValueEncoding::F32,
        round: 3,
        attempt: 2,
        members: digest,
        hop: 0,
        values: ByteBuf::from(0.5f32.to_le_bytes().repeat(6)),
        piece: crate::wire::Piece::WHOLE,
    };
    let mut out = Vec::new();
    // Its heartbeat says so too: the only other member is past node 0's round.
    ring.nodes[0].heard(ring.ids[1], &ready_in(Some(3), None), now);
    ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!((st.round, st.attempt, st.synced), (Some(3), 2, false));
    // It joined that attempt at once, contributing nothing of its own.
    let sent: Vec<&RingMessage> = out
        .iter()
        .filter_map(|o| match o {
            Output::SendRing { msg, .. } => Some(msg),
            _ => None,
        })
        .collect();
    assert!(!sent.is_empty(), "{out:?}");
    assert!(sent.iter().all(|m| m.round == 3 && m.attempt == 2));
    let own = sent.iter().find(|m| m.hop == 0).expect("its own part");
    let values = ValueEncoding::F32.decode(&own.values).expect("values");
    assert_eq!(values.last(), Some(&0.0), "weight 0");
}

/// A hop naming a round, attempt or step no mesh reaches (`u64::MAX` would wrap the round
/// counter at the next round, or an unsynced member's step) is an offence and changes
/// nothing: no round adopted, no attempt restarted, nothing kept.
#[test]
fn a_hop_past_any_meshs_round_attempt_or_step_is_an_offence_and_changes_nothing() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    let mut before = ring.nodes[0].status(Instant::now());
    // The first comes from a member the running attempt waits for: the attempt is retried
    // without it, which is left out as a staller is (`Rounds::refuse`). Nothing else moves.
    before.attempt += 1;
    for (round, attempt, step) in [
        (u64::MAX, 0, 0),
        (ROUND_LIMIT, 0, 0),
        (0, u32::MAX, 0),
        (1, 0, u64::MAX),
    ] {
        let msg = RingMessage {
            attempt,
            step,
            ..next_round_hop(&ring, round)
        };
        let mut out = Vec::new();
        ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
        assert!(
            matches!(&out[..], [Output::Offence { peer, .. }, Output::Penalise(p)]
                if *peer == ring.ids[1] && *p == ring.ids[1]),
            "round {round} attempt {attempt}: {out:?}"
        );
        let st = ring.nodes[0].status(Instant::now());
        assert_eq!((st.round, st.attempt), (before.round, before.attempt));
        assert!(ring.nodes[0].inbox.is_empty());
    }
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!(st.aborted.get("left an offender out"), Some(&1), "{st:?}");
    assert_eq!(st.left_out, vec![ring.ids[1].to_string()], "{st:?}");
    // Between the limits a member follows and those of offences, a hop is dropped: no
    // offence, nothing taken (a fresh pair, in which node 1 is not left out).
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    let before = ring.nodes[0].status(Instant::now());
    ring.nodes[0].heard(ring.ids[1], &ready_in(Some(ROUND_LIMIT - 1), None), now);
    for (round, attempt) in [
        (ROUND_LIMIT - 1, 0),
        (FOLLOWED_ROUND_LIMIT, 0),
        (1, FOLLOWED_ATTEMPT_LIMIT),
    ] {
        let mut out = Vec::new();
        let msg = RingMessage {
            attempt,
            ..next_round_hop(&ring, round)
        };
        ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
        assert!(out.is_empty(), "{out:?}");
        let st = ring.nodes[0].status(Instant::now());
        assert_eq!((st.round, st.attempt), (before.round, before.attempt));
        assert!(ring.nodes[0].inbox.is_empty());
    }
    // The last round and attempt below those are taken as any later ones are (once the
    // other member says it is past this node's round).
    let mut out = Vec::new();
    let msg = RingMessage {
        attempt: FOLLOWED_ATTEMPT_LIMIT - 1,
        ..next_round_hop(&ring, FOLLOWED_ROUND_LIMIT - 1)
    };
    ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!(
        (st.round, st.attempt),
        (Some(FOLLOWED_ROUND_LIMIT - 1), FOLLOWED_ATTEMPT_LIMIT - 1)
    );
}

/// Node 1's part of node 0's chunk in a ring of two (five values and the weight), of the next
/// round, as the members' list makes it.
fn next_round_hop(ring: &Ring, round: u64) -> RingMessage {
    let (_, digest) = ring.sorted();
    let len = 6;
    RingMessage {
        step: 0,
        encoding: crate::wire::ValueEncoding::F32,
        round,
        attempt: 0,
        members: digest,
        hop: 0,
        values: ByteBuf::from(0.5f32.to_le_bytes().repeat(len)),
        piece: crate::wire::Piece::WHOLE,
    }
}

#[test]
fn an_attempt_without_hops_gives_way_to_a_member_already_in_the_next_round() {
    // The CI case: a third member died after node 1 had its last hop of round 0 and
    // before node 0 had its own; node 0 retried round 0 while node 1 went on to round 1.
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    assert_eq!(ring.nodes[0].status(Instant::now()).ring_size, 2);
    let msg = next_round_hop(&ring, 1);
    let mut out = Vec::new();
    // Node 1's heartbeat says it is past round 0: node 0's parameters are not the mesh's.
    ring.nodes[0].heard(ring.ids[1], &ready_in(Some(1), None), now);
    ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!((st.round, st.synced), (Some(1), false), "{st:?}");
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::SendRing { msg, .. } if msg.round == 1 && msg.hop == 0)));
}

/// One member's hop of a far later round is no proof that the mesh went on: taken at its
/// word, every member that got it would drop its own weight, and the sender's alone would
/// make the mean (a hijack by one hop); followed every time, a rogue whose hops name the
/// round after its own drags the members on and no round completes. A member that hears it
/// before the boundary stays at its round: the round completes there, bit-identical, with
/// the plain mean; a member gives its weight up only when most of the others say they are
/// past its round.
#[test]
fn one_members_hop_of_a_later_round_hijacks_nothing() {
    let n = 4;
    let mut ring = Ring::new(n, &[1.0; 4], &[true; 4]);
    let now = Instant::now();
    ring.hear_all(now);
    // Node 1 tells the three others, in a heartbeat and a hop, that the mesh is at round 40.
    let fake = next_round_hop(&ring, 40);
    for i in [0, 2, 3] {
        let mut out = Vec::new();
        ring.nodes[i].heard(ring.ids[1], &ready_in(Some(40), None), now);
        ring.nodes[i].message(ring.ids[1], fake.clone(), now, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }
    ring.run(now, &[true; 4]);
    assert_eq!(ring.offences, 0);
    let first = ring.means[0].clone().expect("a mean");
    for (i, m) in ring.means.iter().enumerate() {
        assert_eq!(
            bits(m.as_ref().expect("a mean")),
            bits(&first),
            "member {i}"
        );
        ring.nodes[i].combined(0, 0, "params".into(), &mut Vec::new());
        let st = ring.nodes[i].status(Instant::now());
        assert_eq!((st.round, st.synced), (Some(1), true), "member {i}: {st:?}");
    }
    // Every member's parameters at weight 1, not node 1's alone.
    for (j, got) in first.iter().enumerate() {
        let want: f32 = (0..n).map(|i| ring.params[i][j]).sum::<f32>() / n as f32;
        assert!(
            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
            "{got} vs {want}"
        );
    }
    // Most members past this node's round: it takes the later round with weight 0.
    ring.bring_to_boundary(0, now);
    for i in [2, 3] {
        ring.nodes[0].heard(ring.ids[i], &ready_in(Some(1005), None), now);
    }
    let mut out = Vec::new();
    let later = next_round_hop(&ring, 1005);
    ring.nodes[0].message(ring.ids[2], later, now, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!((st.round, st.synced), (Some(1005), false), "{st:?}");
}

/// A member the mesh went past takes the round most members' heartbeats name (a hop names
/// a later one), not the newest one member's hop names: a rogue that named the next round to
/// it alone carried it one past the others, whose hops then contradicted its own.
#[test]
fn a_member_behind_takes_the_round_most_heartbeats_name_not_one_hops_newer_one() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    for i in 1..4 {
        ring.nodes[0].heard(ring.ids[i], &ready_in(Some(5), None), now);
    }
    let mut out = Vec::new();
    let lie = next_round_hop(&ring, 6);
    ring.nodes[0].message(ring.ids[3], lie, now, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!((st.round, st.synced), (Some(5), false), "{st:?}");
}

#[test]
fn a_last_hop_that_never_comes_gives_way_to_the_next_round_soon() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    // Node 0 had node 1's part of this attempt, so it sent its aggregate (and node 1 may
    // have finished it with node 0)...
    let (_, digest) = ring.sorted();
    let msg = RingMessage {
        step: 0,
        encoding: crate::wire::ValueEncoding::F32,
        round: 0,
        attempt: 0,
        members: digest,
        hop: 0,
        values: ByteBuf::from(0.5f32.to_le_bytes().repeat(6)),
        piece: crate::wire::Piece::WHOLE,
    };
    let mut out = Vec::new();
    ring.nodes[0].message(ring.ids[1], msg, now, &mut out);
    // ... and a hop of the next round waits for the last hop of this one ...
    let next = next_round_hop(&ring, 1);
    ring.nodes[0].message(ring.ids[1], next, now, &mut out);
    assert_eq!(ring.nodes[0].status(Instant::now()).round, Some(0));
    // ... but not for long.
    ring.nodes[0].tick(5, true, now + LATE_ROUND_WAIT / 2, &mut out);
    assert_eq!(ring.nodes[0].status(Instant::now()).round, Some(0));
    let later = now + LATE_ROUND_WAIT;
    ring.nodes[0].tick(5, true, later, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!(st.aborted.get("the mesh went on"), Some(&1), "{st:?}");
    // The retry takes the mesh's round, with weight 0: node 1's heartbeat (every 2 s, as
    // long as the wait) says it is past round 0.
    ring.nodes[0].heard(ring.ids[1], &ready_in(Some(1), None), later);
    ring.nodes[0].tick(5, true, later + RETRY_PAUSE, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!((st.round, st.synced), (Some(1), false), "{st:?}");
}

#[test]
fn a_last_hop_that_comes_after_the_next_rounds_first_still_completes_the_round() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    let (_, digest) = ring.sorted();
    let hop = |h: u32| RingMessage {
        step: 0,
        encoding: crate::wire::ValueEncoding::F32,
        round: 0,
        attempt: 0,
        members: digest,
        hop: h,
        values: ByteBuf::from(0.5f32.to_le_bytes().repeat(6)),
        piece: crate::wire::Piece::WHOLE,
    };
    let mut out = Vec::new();
    // Hop 0 brings node 1's part of node 0's chunk, hop 1 node 1's aggregate of its own.
    ring.nodes[0].message(ring.ids[1], hop(0), now, &mut out);
    let next = next_round_hop(&ring, 1);
    ring.nodes[0].message(ring.ids[1], next, now, &mut out);
    ring.nodes[0].tick(5, true, now + LATE_ROUND_WAIT / 2, &mut out);
    ring.nodes[0].message(ring.ids[1], hop(1), now + LATE_ROUND_WAIT / 2, &mut out);
    let st = ring.nodes[0].status(Instant::now());
    assert!(st.aborted.is_empty(), "{st:?}");
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Trainer(TrainerCommand::Combine { round: 0, .. }))),
        "{out:?}"
    );
}

#[test]
fn hostile_hops_are_offences_and_never_reach_the_mean() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    let (_, digest) = ring.sorted();
    let from = ring.ids[1];
    for values in [vec![1, 2, 3], f32::NAN.to_le_bytes().repeat(5)] {
        let mut out = Vec::new();
        let msg = RingMessage {
            step: 0,
            encoding: crate::wire::ValueEncoding::F32,
            round: 0,
            attempt: 0,
            members: digest,
            hop: 0,
            values: ByteBuf::from(values),
            piece: crate::wire::Piece::WHOLE,
        };
        ring.nodes[0].message(from, msg, now, &mut out);
        assert!(
            out.iter().any(|o| matches!(o, Output::Offence { .. })),
            "{out:?}"
        );
        // Penalised too: hops travel outside gossip, whose rejections alone lower a score.
        assert!(
            out.iter()
                .any(|o| matches!(o, Output::Penalise(p) if *p == from)),
            "{out:?}"
        );
        assert!(!out
            .iter()
            .any(|o| matches!(o, Output::Trainer(TrainerCommand::Combine { .. }))));
    }
    // A hop of the wrong size aborts the attempt (a fresh pair: the first hop above, refused
    // as it came from a member the attempt waited for, aborted that attempt and left node 1
    // out).
    assert_eq!(
        ring.nodes[0]
            .status(Instant::now())
            .aborted
            .get("a member's hop was an offence"),
        Some(&1)
    );
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    let (_, digest) = ring.sorted();
    let from = ring.ids[1];
    let mut out = Vec::new();
    let msg = RingMessage {
        step: 0,
        encoding: crate::wire::ValueEncoding::F32,
        round: 0,
        attempt: 0,
        members: digest,
        hop: 0,
        values: ByteBuf::from(1.0f32.to_le_bytes().repeat(2)),
        piece: crate::wire::Piece::WHOLE,
    };
    ring.nodes[0].message(from, msg, now, &mut out);
    assert!(out.iter().any(|o| matches!(o, Output::Offence { .. })));
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Penalise(p) if *p == from)));
    assert_eq!(
        ring.nodes[0]
            .status(Instant::now())
            .aborted
            .get("hop of the wrong size"),
        Some(&1)
    );
}

/// `diloco`: a member that needs the state (here a joiner) makes its ring carry the members'
/// round anchors and outer velocities beside their parameters, at weight 0 for its own, so
/// that it leaves the round synced with theirs; once no member needs it, a round carries the
/// parameters alone. A member that has not heard the need builds another ring (its digest
/// differs), and the attempt aborts instead of summing contributions of two layouts.
#[test]
fn a_diloco_ring_carries_the_state_only_while_a_member_needs_it() {
    let mut ring = Ring::new(3, &[1.0; 3], &[true, true, false]);
    for node in &mut ring.nodes {
        node.cfg.outer_state = true;
    }
    // Parameters, round anchor and outer velocity: three parts of ten values each.
    for (i, p) in ring.params.iter_mut().enumerate() {
        *p = (0..30).map(|j| 8.0 + (i + j) as f32 * 0.25).collect();
    }
    let now = Instant::now();
    assert!(ring.nodes[2].needs_state() && !ring.nodes[0].needs_state());

    // Node 0 has not heard node 2's need yet: its digest differs, nothing is summed.
    ring.hear_all(now);
    ring.nodes[0].heard(ring.ids[2], &ready_in(None, None), now);
    ring.run(now, &[true; 3]);
    assert!(ring.means.iter().all(Option::is_none), "{:?}", ring.means);
    assert!(ring.nodes.iter().any(|n| n
        .status(Instant::now())
        .aborted
        .contains_key("member lists differ")));

    // Everyone heard it: the state travels, the synced members' parts make the mean.
    let later = now + RETRY_PAUSE;
    ring.hear_all(later);
    for i in 0..3 {
        let mut out = Vec::new();
        ring.nodes[i].tick(0, true, later, &mut out);
        let queue = out.into_iter().map(|o| (i, o)).collect();
        ring.carry(queue, later, &[true; 3]);
    }
    let expected: Vec<f32> = (0..30)
        .map(|j| (ring.params[0][j] + ring.params[1][j]) / 2.0)
        .collect();
    for (i, mean) in ring.means.iter().enumerate() {
        assert_eq!(
            mean.as_deref(),
            Some(&expected[..]),
            "node {i}: {:?}",
            ring.nodes[i].status(Instant::now())
        );
    }
    for i in 0..3 {
        ring.nodes[i].combined(0, 5, format!("d{i}"), &mut Vec::new());
        assert!(ring.nodes[i].status(Instant::now()).synced && !ring.nodes[i].needs_state());
    }

    // Round 1: nobody needs the state. The carried round left the members one round start
    // and velocity (the trainer's outer step from the carried ones); the ring sums their
    // outer changes alone, and each leaves with the start minus the mean change.
    let start: Vec<f32> = (0..10).map(|j| 9.0 + j as f32 * 0.25).collect();
    for p in &mut ring.params {
        p[10..20].copy_from_slice(&start);
        p[20..].fill(0.5);
    }
    ring.means = vec![None; 3];
    let next = later + Duration::from_secs(1);
    ring.hear_all(next);
    ring.run(next, &[true; 3]);
    let first = bits(ring.means[0].as_deref().expect("node 0 took no mean"));
    for (i, mean) in ring.means.iter().enumerate() {
        let mean = mean
            .as_deref()
            .unwrap_or_else(|| panic!("node {i} took no mean"));
        assert_eq!(bits(mean), first, "node {i}");
        for (j, got) in mean.iter().enumerate() {
            let exact = (ring.params[0][j] + ring.params[1][j] + ring.params[2][j]) / 3.0;
            let change = start[j] - exact;
            assert!(
                (got - exact).abs() <= change.abs() / 256.0 + 1e-5,
                "node {i}, value {j}: {got} against {exact}"
            );
        }
    }
}

/// `diloco` members that share a round start (no member needs the state) sum their outer
/// changes (round start minus parameters), not their parameters, and the changes travel as
/// `sync.outer_values` says. In bf16: half the bytes of `f32` parameters, at 2^-8 of the
/// largest change, where rounding the parameters themselves would cost 2^-8 of each weight
/// (more than a round's steps move it). In int8: a byte a value and one per block of 64, each
/// value within 2/127 of the largest change (rounded once in the part, once in the
/// aggregate). Either way
/// every member leaves with the same bits, the round start minus the mean change, whichever
/// chunks the ring cuts (the blocks start at each chunk's first value).
#[test]
fn diloco_members_sharing_a_round_start_sum_their_outer_changes_compactly() {
    for (encoding, n) in [ValueEncoding::Bf16, ValueEncoding::Int8]
        .into_iter()
        .flat_map(|e| [2usize, 3, 4].map(|n| (e, n)))
    {
        check_outer_changes_summed(encoding, n);
    }
}

fn check_outer_changes_summed(encoding: ValueEncoding, n: usize) {
    // Three int8 blocks and a part of one; chunks of 50, 51 or 150 values.
    const P: usize = 150;
    {
        let mut ring = Ring::new(n, &vec![1.0; n], &vec![true; n]);
        for node in &mut ring.nodes {
            node.cfg.outer_state = true;
            node.cfg.outer_values = encoding;
        }
        // The shared round start and velocity; each member's parameters a little way off.
        let start: Vec<f32> = (0..P).map(|j| 3.0 + (j as f32 * 0.61).cos()).collect();
        let velocity: Vec<f32> = (0..P).map(|j| 0.01 * j as f32).collect();
        for (i, p) in ring.params.iter_mut().enumerate() {
            let own: Vec<f32> = (0..P)
                .map(|j| start[j] - 0.02 * (1.0 + ((i * P + j) as f32 * 0.77).sin()))
                .collect();
            *p = [own, start.clone(), velocity.clone()].concat();
        }
        let now = Instant::now();
        ring.hear_all(now);
        ring.run(now, &vec![true; n]);
        let first = bits(ring.means[0].as_ref().expect("node 0 took no mean"));
        for (i, mean) in ring.means.iter().enumerate() {
            let mean = mean
                .as_ref()
                .unwrap_or_else(|| panic!("{encoding:?}, n = {n}: node {i} took no mean"));
            assert_eq!(
                bits(mean),
                first,
                "{encoding:?}, n = {n}: node {i} holds other bits"
            );
        }
        let mean = ring.means[0].as_ref().expect("mean");
        assert_eq!(mean.len(), P, "n = {n}: the parameters only");
        let largest_change = ring
            .params
            .iter()
            .flat_map(|p| (0..P).map(|j| (start[j] - p[j]).abs()))
            .fold(0f32, f32::max);
        for j in 0..P {
            let exact = ring.params.iter().map(|p| p[j]).sum::<f32>() / n as f32;
            let change = start[j] - exact;
            // Each rounding (a member's part, then the chunk's aggregate) is within 2^-9 of
            // the value in bf16, half a step of its block in int8 (under 1/127 of its
            // largest value).
            let within = match encoding {
                ValueEncoding::Int8 => largest_change * 2.0 / 127.0,
                _ => largest_change / 256.0,
            };
            assert!(
                (mean[j] - exact).abs() <= within + 1e-6,
                "{encoding:?}, n = {n}, value {j}: {} against {exact} (a change of {change})",
                mean[j]
            );
        }
        // Each member sends its parts of the others' chunks and its chunk's aggregate to
        // each other member (a direct ring of two: its whole contribution, once), each a
        // weight after its values: 2 bytes a value and 2 of weight in bf16, a byte a value,
        // one per block begun and 4 of weight in int8.
        let chunk = P.div_ceil(n);
        let hop = match encoding {
            ValueEncoding::Int8 => chunk + chunk.div_ceil(64) + 4,
            _ => 2 * (chunk + 1),
        };
        let most = 2 * (n - 1) * hop;
        for i in 0..n {
            let sent = ring.nodes[i].status(Instant::now()).bytes_sent as usize;
            assert!(
                sent <= most,
                "{encoding:?}, n = {n}: {sent} bytes sent, against {most}"
            );
        }
    }
}

/// With `sync.overlap_steps`, a synced `diloco` member's trainer trains on past its boundary
/// while its round runs, up to that many steps, and is told to keep those steps on top of the
/// round's result; its next boundary is `steps` after the one it gave its parameters at, as
/// without overlap. A member that is not synced (a joiner, which takes the members'
/// parameters whole) stays held at its boundary.
#[test]
fn a_synced_diloco_member_trains_on_through_its_round_up_to_the_overlap() {
    const P: usize = 20;
    let overlapping = |synced: &[bool]| {
        let mut ring = Ring::new(2, &[1.0; 2], synced);
        for node in &mut ring.nodes {
            node.cfg.outer_state = true;
            node.cfg.overlap_steps = 2;
        }
        let start: Vec<f32> = (0..P).map(|j| 1.0 + 0.1 * j as f32).collect();
        for (i, p) in ring.params.iter_mut().enumerate() {
            let own: Vec<f32> = start.iter().map(|s| s - 0.01 * (i + 1) as f32).collect();
            *p = [own, start.clone(), vec![0.0; P]].concat();
        }
        ring
    };
    // Two founders reach their boundary at step 5.
    let mut ring = overlapping(&[true, true]);
    ring.steps = vec![5, 5];
    let now = Instant::now();
    ring.hear_all(now);
    let mut queue = VecDeque::new();
    for i in 0..2 {
        let mut out = Vec::new();
        ring.nodes[i].tick(5, true, now, &mut out);
        queue.extend(out.into_iter().map(|o| (i, o)));
    }
    // Each founder's parameters are given: its trainer may go two steps on.
    let queue = ring.carry_until(queue, now, &[true, true], |r| {
        r.nodes
            .iter()
            .all(|n| matches!(n.attempt.stage, Stage::Reducing { .. }))
    });
    for i in 0..2 {
        assert_eq!(
            ring.nodes[i].step_limit(),
            7,
            "founder {i} while its round runs"
        );
    }
    ring.carry(queue, now, &[true, true]);
    for i in 0..2 {
        assert!(ring.means[i].is_some(), "founder {i} took no mean");
        assert!(ring.ran_on[i], "founder {i} was not told to keep its steps");
        // Still allowed on while its trainer takes the mean.
        assert_eq!(
            ring.nodes[i].step_limit(),
            7,
            "founder {i} while it combines"
        );
        let mut out = Vec::new();
        ring.nodes[i].combined(0, 6, "d0".into(), &mut out);
        assert_eq!(
            ring.nodes[i].step_limit(),
            10,
            "founder {i}: the next boundary counts from step 5"
        );
    }
    // A member whose parameters are not the mesh's gives them and waits.
    let mut ring = overlapping(&[true, false]);
    let mut out = Vec::new();
    ring.nodes[1].tick(0, true, now, &mut out);
    ring.nodes[1].params(ring.params[1].clone(), 0, now, &mut out);
    assert!(matches!(
        ring.nodes[1].attempt.stage,
        Stage::Reducing { .. }
    ));
    assert_eq!(ring.nodes[1].step_limit(), 0, "the joiner ran on");
}

/// A `diloco` member that heard a need named at an earlier round does not carry the state
/// for it: that round's ring gave it (a heartbeat sent before it completed arrives late).
#[test]
fn a_need_for_the_state_named_at_an_earlier_round_is_stale() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    ring.nodes[0].cfg.outer_state = true;
    ring.nodes[0].attempt.round = Some(4);
    let members = ring.sorted().0;
    let stale = Heartbeat {
        needs_state: true,
        ..ready_in(Some(3), None)
    };
    ring.nodes[0].heard(ring.ids[1], &stale, Instant::now());
    assert!(!ring.nodes[0].carries_state(4, &members));
    let current = Heartbeat {
        needs_state: true,
        ..ready_in(Some(4), None)
    };
    ring.nodes[0].heard(ring.ids[1], &current, Instant::now());
    assert!(ring.nodes[0].carries_state(4, &members));
    let unknown_round = Heartbeat {
        needs_state: true,
        ..ready_in(None, None)
    };
    ring.nodes[0].heard(ring.ids[1], &unknown_round, Instant::now());
    assert!(ring.nodes[0].carries_state(4, &members));
}

/// A need said before its node had a round (a joiner's first heartbeats) names no round to go
/// stale by: the carried round that completes meets it, and only a later heartbeat renews it.
#[test]
fn a_carried_round_meets_the_needs_heard_before_it() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    ring.nodes[0].cfg.outer_state = true;
    ring.nodes[0].attempt.round = Some(4);
    let members = ring.sorted().0;
    let joiner = Heartbeat {
        needs_state: true,
        ..ready_in(None, None)
    };
    ring.nodes[0].heard(ring.ids[1], &joiner, Instant::now());
    assert!(ring.nodes[0].carries_state(4, &members));
    ring.nodes[0].attempt.stage = Stage::Combining {
        carried_state: true,
        ran_on_from: None,
        ring: Some(7),
    };
    let mut out = Vec::new();
    ring.nodes[0].combined(4, 100, String::new(), &mut out);
    assert_eq!(ring.nodes[0].round(), Some(5));
    assert!(!ring.nodes[0].carries_state(5, &members));
    let still = Heartbeat {
        needs_state: true,
        ..ready_in(Some(5), None)
    };
    ring.nodes[0].heard(ring.ids[1], &still, Instant::now());
    assert!(ring.nodes[0].carries_state(5, &members));
}

/// A `diloco` node that starts the rounds itself after resuming (no ring heard) still needs
/// the members' state: others may have started from their own checkpoints at the same time.
#[test]
fn a_diloco_node_that_starts_the_rounds_itself_still_needs_the_state() {
    let mut ring = Ring::new(1, &[1.0], &[false]);
    ring.nodes[0].cfg.outer_state = true;
    let t0 = Instant::now();
    let mut out = Vec::new();
    ring.nodes[0].tick(0, true, t0, &mut out);
    ring.nodes[0].params(ring.params[0].repeat(3), 0, t0, &mut out);
    ring.nodes[0].tick(0, true, t0, &mut out);
    ring.nodes[0].tick(0, true, t0 + ADOPT_WAIT, &mut out);
    assert_eq!(ring.nodes[0].round(), Some(0));
    assert!(ring.nodes[0].needs_state());
}

/// In `diloco`, a member that took a later round's number on one member's word (keeping its
/// weight) may have missed that round's outer steps: it asks for the members' round start
/// and velocity, and claims no digest, until a ring carried them.
#[test]
fn a_diloco_member_that_took_a_later_rounds_number_unproven_asks_for_the_state() {
    let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
    for node in &mut ring.nodes {
        node.cfg.outer_state = true;
    }
    let now = Instant::now();
    ring.hear_all(now);
    let mut out = Vec::new();
    let step = ring.nodes[0].step_limit();
    ring.nodes[0].tick(step, true, now, &mut out);
    ring.nodes[0].params(ring.params[0].repeat(3), 0, now, &mut out);
    assert!(!ring.nodes[0].needs_state());
    let hop = next_round_hop(&ring, 7);
    ring.nodes[0].message(ring.ids[1], hop, now, &mut out);
    assert_eq!(ring.nodes[0].round(), Some(0), "one member's word waits");
    follow_lone_claim(&mut ring, 0, now);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!((st.round, st.synced), (Some(7), true), "{st:?}");
    assert!(ring.nodes[0].needs_state());
    // A restore resets it with the rest.
    ring.nodes[0].restored(0);
    assert!(!ring.nodes[0].status(Instant::now()).synced);
}

/// The inbox is bounded in values as well as in hops: the oldest rounds give way to newer
/// ones, and a hop larger than the whole bound is never kept. (Zeroed vectors: the pages are
/// never touched.)
#[test]
fn the_inbox_keeps_at_most_its_bound_in_values_oldest_out_first() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let node = &mut ring.nodes[0];
    let from = PeerId::random();
    let quarter = INBOX_VALUES / 4;
    for round in 10..15u64 {
        node.inbox
            .keep((round, 0, 0, from), (0, vec![0.0; quarter], 0));
    }
    let rounds: Vec<u64> = node.inbox.keys().map(|k| k.0).collect();
    assert_eq!(rounds, vec![11, 12, 13, 14]);
    node.inbox
        .keep((20, 0, 0, from), (0, vec![0.0; INBOX_VALUES + 1], 0));
    assert!(!node.inbox.contains_key(&(20, 0, 0, from)));
    assert_eq!(node.inbox.len(), 4);
    // Small hops are bounded by count.
    for hop in 0..(INBOX_CAP as u32 + 5) {
        node.inbox.keep((30, 0, hop, from), (0, vec![0.0; 4], 0));
    }
    assert_eq!(node.inbox.len(), INBOX_CAP);
}

/// One sender's hops crowd out no other's: a peer that floods the inbox with tiny hops of
/// later rounds, or with hops as large as the bound allows, loses its own oldest hops, and an
/// honest member's part waiting for the next round stays (before, the oldest rounds gave way
/// whoever sent them, so the honest part went and its sender was then blamed for the stall).
#[test]
fn a_flooding_sender_evicts_only_its_own_hops_from_the_inbox() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let node = &mut ring.nodes[0];
    let (honest, flooder) = (PeerId::random(), PeerId::random());
    let waiting = (11, 0, 0, honest);
    node.inbox.keep(waiting, (0, vec![1.0; 8], 0));
    for hop in 0..(2 * INBOX_CAP as u32) {
        node.inbox
            .keep((12 + u64::from(hop), 0, 0, flooder), (0, vec![0.0; 4], 0));
    }
    assert!(node.inbox.contains_key(&waiting), "counted out");
    assert_eq!(node.inbox.len(), INBOX_CAP);
    let newest = 12 + 2 * INBOX_CAP as u64 - 1;
    assert!(node.inbox.contains_key(&(newest, 0, 0, flooder)));
    // Bounded in values: hops a third of the bound each, from the same flooder.
    let third = INBOX_VALUES / 3;
    for round in 1_000..1_010u64 {
        node.inbox
            .keep((round, 0, 0, flooder), (0, vec![0.0; third], 0));
    }
    assert!(node.inbox.contains_key(&waiting), "crowded out by size");
    let held: usize = node.inbox.values().map(|h| h.1.len()).sum();
    assert!(held <= INBOX_VALUES, "{held}");
}

/// Members that refused a round's mean (as every honest member refuses a spoiled one) keep
/// the mesh's parameters they had, so they stay synced, judging the retry's mean by
/// distance and not by norm alone, until they have refused `REFUSALS_BEFORE_UNSYNCED` in a
/// row.
#[test]
fn a_refused_mean_leaves_members_synced_until_they_refused_several_in_a_row() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true; 2]);
    let now = Instant::now();
    ring.hear_all(now);
    // The founding round: taken by both.
    ring.run(now, &[true; 2]);
    for i in 0..2 {
        let round = ring.nodes[i].status(Instant::now()).round.expect("round");
        ring.nodes[i].combined(round, 0, "d".into(), &mut Vec::new());
    }
    ring.means = vec![None, None];
    let round = ring.nodes[0].status(Instant::now()).round;
    for refusals in 1..=REFUSALS_BEFORE_UNSYNCED {
        ring.run(now + Duration::from_secs(u64::from(refusals)), &[true; 2]);
        for i in 0..2 {
            assert!(ring.means[i].take().is_some(), "a mean to refuse");
            ring.nodes[i].combine_failed();
        }
        let st = ring.nodes[0].status(Instant::now());
        assert_eq!(st.round, round, "the same round is retried");
        assert_eq!(
            st.synced,
            refusals < REFUSALS_BEFORE_UNSYNCED,
            "after {refusals} refusals"
        );
    }
}

/// The honest members' plain mean (member `rogue` left out), by the parameters they hold.
fn honest_mean(ring: &Ring, rogue: usize) -> Vec<f32> {
    let honest: Vec<usize> = (0..ring.ids.len()).filter(|i| *i != rogue).collect();
    (0..ring.params[0].len())
        .map(|j| honest.iter().map(|i| ring.params[*i][j]).sum::<f32>() / honest.len() as f32)
        .collect()
}

/// The values of the chunk member `i` owns in a parameter ring of all the members.
fn chunk_owned_by(ring: &Ring, i: usize) -> std::ops::Range<usize> {
    let (sorted, _) = ring.sorted();
    let at = sorted
        .iter()
        .position(|p| *p == ring.ids[i])
        .expect("member");
    let (n, len) = (sorted.len(), ring.params[0].len());
    (at * len / n)..((at + 1) * len / n)
}

/// `mean` is `want` outside the rogue's chunk (which the rogue aggregated itself, here
/// honestly), but for the order of the sums.
fn equal_outside(mean: &[f32], want: &[f32], rogue: std::ops::Range<usize>) -> bool {
    (0..mean.len()).all(|j| rogue.contains(&j) || (mean[j] - want[j]).abs() <= 1e-6 * want[j].abs())
}

fn distance(a: &[f32], b: &[f32]) -> f64 {
    robust::distance(a, b)
}

/// One round of 4 members, the rogue (member 3) doing `rogue` to its hops, weights `weights`
/// (at most `max_weight` each); answers the ring after the round.
fn round_with_a_rogue(rogue: Rogue, weights: [f32; 4], max_weight: f32) -> Ring {
    let mut ring = Ring::new(4, &weights, &[true; 4]);
    for node in &mut ring.nodes {
        node.cfg.max_weight = max_weight;
    }
    ring.rogue = Some((3, rogue));
    let now = Instant::now();
    ring.hear_all(now);
    ring.run(now, &[true; 4]);
    ring
}

/// `diloco` with a joiner that needs the state: the ring carries every member's parameters,
/// round start and outer velocity, and a rogue that shifts all three by 1e6 (or makes them
/// 1e30) poisons none of it: each honest owner refuses its part, an offence, and the honest
/// members end bit-identical at the synced honest members' mean, state included, outside
/// the chunk the rogue owns.
#[test]
fn a_rogue_poisons_no_part_of_a_diloco_round_that_carries_the_state() {
    for (name, shift) in [("poison", 1e6f32), ("kill", 1e30)] {
        let mut ring = Ring::new(4, &[1.0; 4], &[true, true, false, true]);
        for node in &mut ring.nodes {
            node.cfg.outer_state = true;
        }
        // Parameters, round start and outer velocity: three parts of ten values each.
        for (i, p) in ring.params.iter_mut().enumerate() {
            *p = (0..30).map(|j| 8.0 + (i + j) as f32 * 0.25).collect();
        }
        ring.rogue = Some((
            3,
            Box::new(move |m, _| {
                if m.hop == 0 {
                    each_value(m, |v| v + shift)
                }
            }),
        ));
        let now = Instant::now();
        assert!(ring.nodes[2].needs_state(), "{name}");
        ring.hear_all(now);
        ring.run(now, &[true; 4]);
        // The joiner weighs nothing: the mean is members 0 and 1's.
        let want: Vec<f32> = (0..30)
            .map(|j| (ring.params[0][j] + ring.params[1][j]) / 2.0)
            .collect();
        let first = ring.means[0].clone().expect(name);
        assert_eq!(first.len(), 30, "{name}: the state travelled");
        let (sorted, _) = ring.sorted();
        let at = sorted
            .iter()
            .position(|p| *p == ring.ids[3])
            .expect("rogue");
        let rogue_chunk = (at * 30 / 4)..((at + 1) * 30 / 4);
        for i in [0, 1, 2] {
            let got = ring.means[i].clone().expect(name);
            assert_eq!(bits(&got), bits(&first), "{name}: member {i}");
            assert!(
                equal_outside(&got, &want, rogue_chunk.clone()),
                "{name}: {got:?} {want:?}"
            );
        }
        assert!(first.iter().all(|v| v.abs() < 100.0), "{name}: {first:?}");
        assert_eq!(ring.blamed, vec![3; 3], "{name}");
    }
}

/// The attack matrix against the rounds' core, one member of four hostile. Poison (its parts
/// shifted by 1e6) and kill (parts of 1e30): each honest owner refuses its part, an offence,
/// and the round completes without it: the honest members end bit-identical at the honest
/// members' plain mean. A hostile aggregate (1e30, or shifted by 1e6): every member refuses
/// it, an offence each, and the attempt aborts (nothing adopted). A weight past a member's
/// (5 where members weigh 1): refused as a part, an offence; in `fedavg` (1e9 samples, no
/// cap): bounded at 4 times the median, so the subtle shift it carries moves the mean less
/// than the plain mean would.
#[test]
fn one_hostile_member_of_four_poisons_no_round() {
    let honest = [0, 1, 2];
    for (name, shift) in [("poison", 1e6f32), ("kill", 1e30)] {
        let ring = round_with_a_rogue(
            Box::new(move |m, _| {
                if m.hop == 0 {
                    each_value(m, |v| v + shift)
                }
            }),
            [1.0; 4],
            1.0,
        );
        let want = honest_mean(&ring, 3);
        let first = ring.means[0].clone().expect(name);
        for i in honest {
            let got = ring.means[i].clone().expect(name);
            assert_eq!(bits(&got), bits(&first), "{name}: member {i}");
            assert!(
                equal_outside(&got, &want, chunk_owned_by(&ring, 3)),
                "{name}: {got:?} {want:?}"
            );
            assert_eq!(
                ring.nodes[i].status(Instant::now()).parts_refused,
                1,
                "{name}: member {i}"
            );
        }
        assert_eq!(ring.blamed, vec![3; 3], "{name}");
    }
    for (name, f) in [
        ("aggregate of 1e30", (|_| 1e30) as fn(f32) -> f32),
        ("aggregate shifted by 1e6", |v| v + 1e6),
    ] {
        let ring = round_with_a_rogue(
            Box::new(move |m, _| {
                if m.hop == 1 {
                    each_value(m, f)
                }
            }),
            [1.0; 4],
            1.0,
        );
        for i in honest {
            assert!(ring.means[i].is_none(), "{name}: member {i} adopted it");
            let st = ring.nodes[i].status(Instant::now());
            assert_eq!(
                st.aborted.get("aggregate refused"),
                Some(&1),
                "{name}: {st:?}"
            );
        }
        assert_eq!(ring.blamed, vec![3; 3], "{name}");
    }
    // A weight past what a member weighs: refused as a part; the round goes on without it.
    let ring = round_with_a_rogue(
        Box::new(|m, _| {
            if m.hop == 0 {
                set_weight(m, 5.0)
            }
        }),
        [1.0; 4],
        1.0,
    );
    let want = honest_mean(&ring, 3);
    for i in honest {
        let got = ring.means[i].as_ref().expect("a mean");
        assert!(equal_outside(got, &want, chunk_owned_by(&ring, 3)));
    }
    assert_eq!(ring.blamed, vec![3; 3]);
    // `fedavg`: 1e9 samples against ~600 each, with parameters moved within the distance
    // bound (by 0.5 a value, some 20 times the honest spread).
    let shifted = |m: &mut RingMessage, _: usize| {
        if m.hop == 0 {
            each_value(m, |v| v + 0.5);
            set_weight(m, 1e9);
        }
    };
    let ring = round_with_a_rogue(
        Box::new(shifted),
        [600.0, 650.0, 700.0, 600.0],
        f32::INFINITY,
    );
    let want = honest_mean(&ring, 3);
    let got = ring.means[0].clone().expect("a mean");
    for i in honest {
        assert_eq!(bits(ring.means[i].as_ref().expect("a mean")), bits(&got));
    }
    assert!(
        ring.blamed.is_empty(),
        "a large weight is no proof: {:?}",
        ring.blamed
    );
    // The plain weighted mean would sit at the rogue's parameters (1e9 of ~1e9 + 2000); at
    // the bounded weight (4 x the median, 675) it would still move by 58% of the way there.
    // CenteredClip moves it less than that.
    let rogue_at: Vec<f32> = ring.params[3].iter().map(|v| v + 0.5).collect();
    let plain_moved = distance(&rogue_at, &want);
    let capped_share = 4.0 * 675.0 / (4.0 * 675.0 + 1950.0);
    let moved = distance(&got, &want);
    assert!(
        moved < capped_share * plain_moved,
        "moved {moved}; the plain mean {plain_moved}, at the bounded weight {}",
        capped_share * plain_moved
    );
    let clipped: u64 = honest
        .iter()
        .map(|i| ring.nodes[*i].status(Instant::now()).parts_clipped)
        .sum();
    assert!(clipped > 0);
}

/// An owner whose aggregate counts nothing (a weight total of 0) makes the honest members'
/// totals differ, which aborts the attempt; since no honest owner refuses an honest part,
/// every member whose part weighed something blames it (unpunished, it could abort every
/// attempt it owns a chunk in). A member whose part weighed nothing cannot tell.
#[test]
fn an_aggregate_that_counts_nothing_is_an_offence() {
    let zero_total = || -> Rogue {
        Box::new(|m, _| {
            if m.hop == 1 {
                set_weight(m, 0.0)
            }
        })
    };
    let ring = round_with_a_rogue(zero_total(), [1.0; 4], 1.0);
    for i in [0, 1, 2] {
        assert!(ring.means[i].is_none(), "member {i} adopted a mean");
        let st = ring.nodes[i].status(Instant::now());
        assert_eq!(st.aborted.get("weight total of 0"), Some(&1), "{st:?}");
    }
    assert_eq!(ring.blamed, vec![3; 3]);
    // Member 0 a joiner (its part weighs nothing): only the two synced members blame.
    let ring = round_with_a_rogue(zero_total(), [0.0, 1.0, 1.0, 1.0], 1.0);
    assert_eq!(ring.blamed, vec![3; 2]);
}

/// A rogue that sends each member a different part, or each member a different aggregate,
/// within the distance bound: the parts' owners aggregate each chunk once, so the honest
/// members still end bit-identical; different aggregates leave them apart, by no more than
/// the shift the rogue's chunk carries, and every one of them judged what it took.
#[test]
fn a_rogue_that_tells_each_member_something_else_moves_them_a_bounded_amount() {
    // Shifts hop `hop` by 0.3 times the receiver's index.
    let tell_each_else = |hop: u32| -> Rogue {
        Box::new(move |m, to| {
            if m.hop == hop {
                each_value(m, |v| v + 0.3 * to as f32)
            }
        })
    };
    let ring = round_with_a_rogue(tell_each_else(0), [1.0; 4], 1.0);
    let first = ring.means[0].clone().expect("a mean");
    for i in [1, 2] {
        assert_eq!(bits(ring.means[i].as_ref().expect("a mean")), bits(&first));
    }
    let ring = round_with_a_rogue(tell_each_else(1), [1.0; 4], 1.0);
    let means: Vec<Vec<f32>> = (0..3)
        .map(|i| ring.means[i].clone().expect("a mean"))
        .collect();
    assert_ne!(bits(&means[0]), bits(&means[1]));
    let chunk = chunk_owned_by(&ring, 3);
    let apart = distance(&means[0], &means[2]);
    let shift = 0.6 * (chunk.len() as f64).sqrt();
    assert!(apart <= shift * 1.0001, "{apart} vs {shift}");
}

/// A member whose parameters are not the mesh's (a joiner, at weight 0) judges by norm alone,
/// as its trainer would: an aggregate of 1e30 is refused there too, an offence of its owner,
/// and never reaches the trainer (a rogue in `diloco` kept honest members that had taken a
/// later round unsynced, and so unjudged, refusing its 1e30 means in the trainer, unpunished,
/// for good).
#[test]
fn a_member_that_is_not_synced_refuses_a_huge_aggregate_too() {
    let mut ring = Ring::new(4, &[1.0; 4], &[false, true, true, true]);
    ring.rogue = Some((
        3,
        Box::new(|m: &mut RingMessage, _| {
            if m.hop == 1 {
                each_value(m, |_| 1e30)
            }
        }),
    ));
    let now = Instant::now();
    ring.hear_all(now);
    ring.run(now, &[true; 4]);
    assert!(ring.means.iter().take(3).all(Option::is_none));
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!(st.aborted.get("aggregate refused"), Some(&1), "{st:?}");
    assert_eq!(ring.blamed, vec![3; 3]);
}

/// In a direct ring of two (`ddp`'s gradient rounds), each member aggregates the whole: a part
/// one refuses would leave the two apart (one stepping with its own gradient, the other with
/// the mean), so a refused part aborts the attempt there, an offence of its sender.
#[test]
fn a_direct_ring_aborts_on_a_refused_part() {
    let alive = vec![true; 2];
    let mut ring = Ring::with_gradients(2, &[1.0; 2], &alive, Some(3));
    let now = Instant::now();
    ring.hear_all(now);
    // Round 0 sums parameters; round 1, a gradient round, is the rogue's.
    ring.run(now, &alive);
    assert!(ring.means.iter().all(Option::is_some));
    ring.rogue = Some((
        1,
        Box::new(|m: &mut RingMessage, _| {
            if m.encoding == ValueEncoding::Bf16 {
                each_value(m, |v| v * 1e6);
            }
        }),
    ));
    let queue = ring.combine_round_zero();
    ring.carry(queue, now, &alive);
    assert!(ring.means[0].is_none(), "member 0 took a mean");
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!(st.aborted.get("part refused"), Some(&1), "{st:?}");
    assert_eq!(ring.blamed, vec![1]);
}

/// A member that banned the rogue (member 0 no longer hears member 3) names a list without
/// it, so no attempt of the four can finish; the members that still list the rogue judge its
/// parts all the same, before they abort for lists that differ, so each blames it (and bans
/// it in time, as member 0 did). Its hops come first here: aborted at once, the members
/// dropped the rogue's parts that came after as stale, and never blamed it. A member of the
/// list that sends nothing holds the attempt [`LISTS_DIFFER_WAIT`] at most.
#[test]
fn parts_are_judged_before_an_attempt_aborts_on_lists_that_differ() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    for node in &mut ring.nodes {
        node.cfg.max_weight = 1.0;
    }
    ring.rogue = Some((
        3,
        Box::new(|m: &mut RingMessage, _| {
            if m.hop == PART {
                each_value(m, |v| v + 1e6)
            }
        }),
    ));
    let now = Instant::now();
    ring.hear_all(now);
    let gone = Heartbeat {
        in_rounds: false,
        ..Heartbeat::default()
    };
    ring.nodes[0].heard(ring.ids[3], &gone, now);
    ring.run(now, &[true; 4]);
    assert!(ring.means.iter().all(Option::is_none), "a mean was taken");
    let mut blamed = ring.blamed.clone();
    blamed.sort();
    assert_eq!(blamed, vec![3, 3], "members 1 and 2 each blame the rogue");
    for i in 0..3 {
        let st = ring.nodes[i].status(Instant::now());
        assert_eq!(
            st.aborted.get("member lists differ"),
            Some(&1),
            "{i}: {st:?}"
        );
        assert_eq!(st.parts_refused, u64::from(i != 0), "{i}: {st:?}");
    }

    // The rogue silent: member 1's attempt waits for its part, then aborts.
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    ring.hear_all(now);
    ring.nodes[0].heard(ring.ids[3], &gone, now);
    let alive = [true, true, true, false];
    ring.run(now, &alive);
    let aborts = |ring: &Ring| {
        ring.nodes[1]
            .status(Instant::now())
            .aborted
            .get("member lists differ")
            .copied()
    };
    assert_eq!(aborts(&ring), None);
    let mut out = Vec::new();
    let step = ring.nodes[1].step_limit();
    ring.nodes[1].tick(step, true, now + LISTS_DIFFER_WAIT / 2, &mut out);
    assert_eq!(aborts(&ring), None);
    ring.nodes[1].tick(step, true, now + LISTS_DIFFER_WAIT, &mut out);
    assert_eq!(aborts(&ring), Some(1));
    assert_eq!(ring.offences, 0);
}

/// A part that weighs nothing (an unsynced member's) changes no mean, but one that no honest
/// member sends (values of 1e30) is still an offence, judged by norm: a rogue that joined is
/// blamed by every owner for its parts, not only for the aggregates it makes when every
/// member sends it a part. An honest member's weightless part is no offence.
#[test]
fn a_weightless_part_no_honest_member_sends_is_an_offence() {
    let synced = [true, true, true, false];
    for hostile in [false, true] {
        let mut ring = Ring::new(4, &[1.0; 4], &synced);
        if hostile {
            ring.rogue = Some((
                3,
                Box::new(|m: &mut RingMessage, _| {
                    if m.hop == PART {
                        each_value(m, |_| 1e30)
                    }
                }),
            ));
        }
        let now = Instant::now();
        ring.hear_all(now);
        ring.run(now, &[true; 4]);
        let want = if hostile { vec![3, 3, 3] } else { vec![] };
        assert_eq!(ring.blamed, want, "hostile {hostile}");
        // The part weighed nothing either way: every member takes the honest members' mean.
        assert!(ring.means.iter().all(Option::is_some), "hostile {hostile}");
        let first = bits(ring.means[0].as_ref().expect("mean"));
        assert!(ring
            .means
            .iter()
            .all(|m| bits(m.as_ref().expect("mean")) == first));
    }
}

/// Member 0 gets its own proof against member 3 (a hop of NaN), as behind a ban, and loses
/// it (its connection closed, nothing passes between them); answers member 0's outputs.
fn member_0_bans_member_3(ring: &mut Ring, t0: Instant) -> Vec<Output> {
    let mut out = Vec::new();
    let nan = RingMessage {
        values: ByteBuf::from(f32::NAN.to_le_bytes().repeat(2)),
        ..next_round_hop(ring, 0)
    };
    ring.nodes[0].message(ring.ids[3], nan, t0, &mut out);
    ring.nodes[0].peer_down(ring.ids[3], t0);
    ring.cut = vec![(3, 0), (0, 3)];
    out
}

/// Member 0 banned member 3 (it blamed it, its connection closed, and member 0 no longer
/// hears it); the others still list it, so no attempt can finish. (Member 3, which only
/// lost member 0, never sits out for it: see `Rounds::blamed`.) Most of member 0's members list a peer
/// it left out: after [`lists::OUTVOTED_FOR`] of that, member 0 sits out for [`lists::SIT_OUT`] (its
/// heartbeats say it is not ready), and the other three complete the round without it. A
/// peer that went away from one member only briefly (the others not yet noticing) is no
/// reason: before [`lists::OUTVOTED_FOR`], member 0 keeps trying.
#[test]
fn a_member_outvoted_on_a_peer_it_left_out_sits_out_and_the_rest_go_on() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let alive = [true; 4];
    let t0 = Instant::now();
    let not_ready = Heartbeat {
        in_rounds: false,
        ..Heartbeat::default()
    };
    let out = member_0_bans_member_3(&mut ring, t0);
    assert_eq!(
        out.iter()
            .filter(|o| matches!(o, Output::Offence { .. }))
            .count(),
        1
    );
    let mut sat_out_at = None;
    for k in 0..40u32 {
        let now = t0 + RETRY_PAUSE * k;
        for i in 0..4 {
            for j in 0..4 {
                let word = match (i, j) {
                    _ if i == j => continue,
                    (0, 3) => continue,
                    (_, 0) if ring.nodes[0].sitting_out(now) => not_ready.clone(),
                    _ => ready_in(ring.nodes[j].status(Instant::now()).round, None),
                };
                let id = ring.ids[j];
                ring.nodes[i].heard(id, &word, now);
            }
        }
        if ring.nodes[0].sitting_out(now) {
            sat_out_at.get_or_insert(now);
        }
        ring.run(now, &alive);
        if ring.means[1..].iter().all(Option::is_some) {
            break;
        }
    }
    let sat_out_at = sat_out_at.expect("member 0 sat out");
    assert!(
        sat_out_at.duration_since(t0) >= lists::OUTVOTED_FOR,
        "{:?}",
        sat_out_at - t0
    );
    assert!(ring.nodes[0].sitting_out(sat_out_at + lists::SIT_OUT / 2));
    assert!(!ring.nodes[0].sitting_out(sat_out_at + lists::SIT_OUT));
    assert!(ring.means[0].is_none(), "member 0 took a mean");
    assert!(
        ring.means[1..].iter().all(Option::is_some),
        "the three completed no round"
    );
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!(st.aborted.get("sat out"), Some(&1), "{st:?}");
    assert_eq!(st.round, None, "member 0 comes back as a joiner");
    assert_eq!(ring.offences, 0);
}

/// Member 0 banned member 3 (its own proof, its connection closed); member 1 still lists
/// it; member 2 says it is not in rounds (it sat out over member 3 before, as member 0 would
/// have), and sends no hops. Member 0's ring is itself and member 1, whose word alone would
/// be most of a ring of two; counting member 2 among the members, it is not, and member 0
/// keeps trying, in rounds member 1 can join once it leaves member 3 out too. Answers when
/// member 0 sat out, if it did, within 40 retries; `hear_member_2` says whether member 0
/// hears member 2's heartbeats, `was_ready` whether member 2 was in rounds before (a joiner
/// never yet ready is not counted: it may download a large state for minutes).
fn sits_out_with_a_fellow_sitting_out(hear_member_2: bool, was_ready: bool) -> Option<Duration> {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let alive = [true, true, false, true];
    let t0 = Instant::now();
    let not_ready = Heartbeat {
        in_rounds: false,
        ..Heartbeat::default()
    };
    member_0_bans_member_3(&mut ring, t0);
    if was_ready {
        for i in [0, 1, 3] {
            ring.nodes[i].heard(ring.ids[2], &ready_in(Some(0), None), t0);
        }
    }
    for k in 0..40u32 {
        let now = t0 + RETRY_PAUSE * k;
        for i in [0, 1, 3] {
            for j in 0..4 {
                let word = match (i, j) {
                    _ if i == j => continue,
                    (0, 3) => continue,
                    (0, 2) if !hear_member_2 => continue,
                    (_, 2) => not_ready.clone(),
                    _ => ready_in(ring.nodes[j].status(Instant::now()).round, None),
                };
                let id = ring.ids[j];
                ring.nodes[i].heard(id, &word, now);
            }
        }
        if ring.nodes[0].sitting_out(now) {
            return Some(now - t0);
        }
        ring.run(now, &alive);
    }
    None
}

#[test]
fn a_member_heard_sitting_out_counts_among_the_members_a_sit_out_needs_most_of() {
    assert_eq!(sits_out_with_a_fellow_sitting_out(true, true), None);
    // The same without member 2's word, or with member 2 a joiner never yet ready: member 1
    // alone is most, and member 0 sits out.
    for (heard, was_ready) in [(false, false), (true, false)] {
        let sat_out_after =
            sits_out_with_a_fellow_sitting_out(heard, was_ready).expect("member 0 sat out");
        assert!(sat_out_after >= lists::OUTVOTED_FOR, "{sat_out_after:?}");
    }
}

/// Members 1 and 2 banned member 3; member 0 still hears it. Most of member 0's members
/// leave member 3 out, so member 0 does too, and the three complete the round. One member
/// leaving a peer out is no majority (the test above).
#[test]
fn a_member_most_others_left_out_is_left_out() {
    let ring = members_1_and_2_left_out_member_3(None);
    assert_the_three_took_one_mean(&ring);
    assert_eq!(ring.nodes[0].status(Instant::now()).ring_size, 3);
    assert_eq!(ring.offences, 0);
}

/// As above, but member 3 stops sending to member 0 just before member 0's verdict is due
/// (it left member 0 out in turn: a rogue's own verdict on the honest member that still
/// lists it, due at the same moment). Members 1 and 2 abort each attempt as soon as member
/// 0's part names member 3, and their next attempt moves member 0 on before it would weigh
/// an attempt that waits for member 3's part. Moving on, it weighed nothing, so it never left
/// member 3 out, and the three aborted attempt after attempt (`ring_rogue`'s `diloco` kill
/// test, in CI and in 2 runs of 9 beside a busy core: 60 s without a round).
#[test]
fn a_member_moved_on_while_its_lists_differ_still_weighs_them() {
    let ring = members_1_and_2_left_out_member_3(Some(lists::OUTVOTED_FOR - RETRY_PAUSE));
    assert_the_three_took_one_mean(&ring);
    let st = ring.nodes[0].status(Instant::now());
    assert_eq!(st.ring_size, 3, "{st:?}");
    assert_eq!(st.aborted.get("left a member out"), Some(&1), "{st:?}");
    assert_eq!(ring.offences, 0);
}

/// Four members; 1 and 2 lost member 3 (and it them), member 0 still lists it. Member 3's
/// hops stop reaching member 0 from `silent_to_0_from` on, if given; its heartbeats, gossiped,
/// still do. Runs up to 40 retries, until members 0 to 2 took a mean.
fn members_1_and_2_left_out_member_3(silent_to_0_from: Option<Duration>) -> Ring {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let alive = [true; 4];
    let t0 = Instant::now();
    for i in [1, 2] {
        ring.nodes[i].peer_down(ring.ids[3], t0);
        ring.cut.extend([(3, i), (i, 3)]);
    }
    for k in 0..40u32 {
        let now = t0 + RETRY_PAUSE * k;
        if silent_to_0_from.is_some_and(|t| now.duration_since(t0) >= t)
            && !ring.cut.contains(&(3, 0))
        {
            ring.cut.push((3, 0));
        }
        for i in 0..4 {
            for j in 0..4 {
                if i != j && !matches!((i, j), (1 | 2, 3) | (3, 1 | 2)) {
                    let word = ready_in(ring.nodes[j].status(Instant::now()).round, None);
                    let id = ring.ids[j];
                    ring.nodes[i].heard(id, &word, now);
                }
            }
        }
        ring.run(now, &alive);
        if ring.means[..3].iter().all(Option::is_some) {
            break;
        }
    }
    ring
}

/// Members 0 to 2 left member 3 out for a stall: it sends no hop of round 0, and then
/// says it is in round 1 (`ring_rogue`'s rogue, which names the next round and waits
/// there). Member 4 comes back fresh (restarted from its checkpoint: not synced, no verdict
/// pending) while that leave-out runs, and lists member 3. The three abort each attempt at
/// member 4's part (every part of their list is in at once), and their next attempt moves
/// member 4 on within the [`LISTS_DIFFER_WAIT`] it waits for member 3's part, so it weighs
/// no attempt whole; moving on confirmed only a verdict weighed whole before, so it never
/// followed the others, and no round completed until their leave-out ended and the next
/// stall (`ring_rogue`'s `allreduce` joiner test: 69 s without a round, one run in 15).
/// Member 3's hops, the only ones missing, are not coming: member 4 leaves it out once its
/// attempts named that for [`lists::OUTVOTED_FOR`], and the four complete the round well
/// within the leave-out.
#[test]
fn a_member_back_fresh_follows_a_leave_out_it_never_weighed_a_whole_attempt_of() {
    let mut ring = Ring::new(5, &[1.0; 5], &[true, true, true, true, false]);
    // Member 3 sends nothing in this round; its heartbeats say it is at its boundary.
    ring.cut = (0..5).map(|j| (3, j)).collect();
    let hear = |ring: &mut Ring, among: &[usize], went_on: bool, now: Instant| {
        for &i in among {
            for &j in among.iter().filter(|j| **j != i) {
                let round = if j == 3 && went_on {
                    Some(1)
                } else {
                    ring.nodes[j].status(now).round
                };
                let word = Heartbeat {
                    step: if j == 3 { 5 } else { 0 },
                    ..ready_in(round, None)
                };
                let id = ring.ids[j];
                ring.nodes[i].heard(id, &word, now);
            }
        }
    };
    // Member 4 away: the attempt of 0 to 3 stalls on member 3, which 0 to 2 leave out.
    let (before, all) = ([true, true, true, true, false], [true; 5]);
    let t0 = Instant::now();
    hear(&mut ring, &[0, 1, 2, 3], false, t0);
    ring.run(t0, &before);
    let stalled = t0 + STALL_TIMEOUT;
    hear(&mut ring, &[0, 1, 2, 3], false, stalled);
    // Member 4 is back, heard ready, as the stall leaves member 3 out.
    hear(&mut ring, &[0, 1, 2, 3, 4], false, stalled);
    ring.run(stalled, &before);
    for i in 0..3 {
        let st = ring.nodes[i].status(stalled);
        assert_eq!(
            st.left_out,
            vec![ring.ids[3].to_string()],
            "node {i}: {st:?}"
        );
    }
    let took = |ring: &Ring| [0, 1, 2, 4].iter().all(|i| ring.means[*i].is_some());
    let mut rounds_at = None;
    for k in 1..=40u32 {
        let now = stalled + RETRY_PAUSE * k;
        hear(&mut ring, &[0, 1, 2, 3, 4], true, now);
        ring.run(now, &all);
        if took(&ring) {
            rounds_at = Some(now.duration_since(stalled));
            break;
        }
    }
    let st = ring.nodes[4].status(stalled + RETRY_PAUSE * 40);
    let waited = rounds_at
        .unwrap_or_else(|| panic!("no round in 8 s of the others' leave-out; member 4: {st:?}"));
    assert!(
        waited <= lists::OUTVOTED_FOR + Duration::from_secs(1),
        "{waited:?}: {st:?}"
    );
    assert_eq!(st.left_out, vec![ring.ids[3].to_string()], "{st:?}");
    assert_eq!(st.aborted.get("left a member out"), Some(&1), "{st:?}");
    let mean = ring.means[0].clone();
    assert!([1, 2, 4].iter().all(|i| ring.means[*i] == mean));
    assert_eq!(ring.offences, 0);
}

/// Member 3's hops name a member list nobody has (a random digest): no leave-out or sit-out
/// explains it, so without a verdict of its own every attempt with it aborted on lists that
/// differ, and the retry listed it again, forever. The others leave it out once their
/// attempts named it for `OUTVOTED_FOR`, without blame (a list proves nothing), and the three
/// complete the round.
#[test]
fn a_member_whose_list_is_nobody_elses_is_left_out_without_blame() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    ring.rogue = Some((
        3,
        Box::new(|msg: &mut RingMessage, _| msg.members ^= 0xabcdef),
    ));
    let alive = [true; 4];
    let t0 = Instant::now();
    for k in 0..40u32 {
        let now = t0 + RETRY_PAUSE * k;
        ring.hear_all(now);
        ring.run(now, &alive);
        if ring.means[..3].iter().all(Option::is_some) {
            break;
        }
    }
    assert_the_three_took_one_mean(&ring);
    for i in 0..3 {
        let st = ring.nodes[i].status(Instant::now());
        assert_eq!(st.ring_size, 3, "node {i}");
        assert_eq!(
            st.aborted
                .get("left out a member whose list is nobody else's")
                .copied(),
            Some(1),
            "node {i}: {st:?}"
        );
    }
    assert_eq!(ring.offences, 0);
}

/// Every member hears every other ready, member `k` saying it is at `k_step` (the others at
/// step 0).
fn hear_all_with_step(ring: &mut Ring, k: usize, k_step: u64, now: Instant) {
    for i in 0..ring.nodes.len() {
        for j in (0..ring.nodes.len()).filter(|j| *j != i) {
            let word = Heartbeat {
                step: if j == k { k_step } else { 0 },
                ..ready_in(ring.nodes[j].status(now).round, None)
            };
            let id = ring.ids[j];
            ring.nodes[i].heard(id, &word, now);
        }
    }
}

/// Member 3 takes every hop and sends none, while its heartbeats say it is at the boundary
/// (its step does not move): each honest member's attempt stalls, leaves it out at once
/// (no offence: a stall proves nothing), and the three complete the round without it. When
/// the leave-out ends, the next stall leaves it out for twice as long.
#[test]
fn a_member_an_attempt_stalls_on_at_the_boundary_is_left_out_for_longer_each_time() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let alive = [true; 4];
    ring.cut = (0..3).map(|j| (3, j)).collect();
    let t0 = Instant::now();
    hear_all_with_step(&mut ring, 3, 5, t0);
    ring.run(t0, &alive);
    assert!(ring.means.iter().all(Option::is_none));
    let stalled = t0 + STALL_TIMEOUT;
    hear_all_with_step(&mut ring, 3, 5, stalled);
    ring.run(stalled, &alive);
    for node in &ring.nodes[..3] {
        let st = node.status(stalled);
        assert_eq!(st.aborted.get("stalled"), Some(&1), "{st:?}");
        assert_eq!(st.aborted.get("left a staller out"), Some(&1), "{st:?}");
        assert_eq!(st.left_out, vec![ring.ids[3].to_string()]);
    }
    let retry = stalled + RETRY_PAUSE;
    hear_all_with_step(&mut ring, 3, 5, retry);
    ring.run(retry, &alive);
    assert_the_three_took_one_mean(&ring);
    assert_eq!(ring.offences, 0, "a stall is no offence");
    // The next round, after the leave-out ended: it stalls once more, and is left out for
    // twice as long.
    let back = stalled + lists::SIT_OUT;
    let queue = ring.combine_round_zero();
    hear_all_with_step(&mut ring, 3, 5, back);
    ring.carry(queue, back, &alive);
    ring.run(back, &alive);
    assert!(ring.nodes[0].status(back).left_out.is_empty());
    assert_eq!(ring.nodes[0].status(back).ring_size, 4);
    let again = back + STALL_TIMEOUT;
    hear_all_with_step(&mut ring, 3, 5, again);
    ring.run(again, &alive);
    for node in &ring.nodes[..3] {
        let st = node.status(again);
        assert_eq!(st.aborted.get("left a staller out"), Some(&2), "{st:?}");
        assert!(!st.left_out.is_empty(), "{st:?}");
        assert!(!node
            .status(again + lists::SIT_OUT * 3 / 2)
            .left_out
            .is_empty());
        assert!(node.status(again + lists::SIT_OUT * 2).left_out.is_empty());
    }
}

/// Member 3 is slower: still training towards the boundary (it takes hops, and keeps them
/// for when it gets there), its heartbeats' steps moving. The attempt that waited for it
/// stalls and is retried with it, never leaving it out; once it reaches the boundary the
/// round completes with all four.
#[test]
fn a_member_still_training_towards_the_boundary_is_waited_for_not_left_out() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let alive = [true; 4];
    // The three at the boundary tick; member 3 only takes hops.
    let tick_three = |ring: &mut Ring, now: Instant| {
        let mut queue = VecDeque::new();
        for i in 0..3 {
            let mut out = Vec::new();
            let step = ring.nodes[i].step_limit();
            ring.nodes[i].tick(step, true, now, &mut out);
            queue.extend(out.into_iter().map(|o| (i, o)));
        }
        ring.carry(queue, now, &alive);
    };
    let t0 = Instant::now();
    hear_all_with_step(&mut ring, 3, 1, t0);
    tick_three(&mut ring, t0);
    let stalled = t0 + STALL_TIMEOUT;
    hear_all_with_step(&mut ring, 3, 4, stalled);
    tick_three(&mut ring, stalled);
    let retry = stalled + RETRY_PAUSE;
    tick_three(&mut ring, retry);
    for node in &ring.nodes[..3] {
        let st = node.status(retry);
        assert_eq!(st.aborted.get("stalled"), Some(&1), "{st:?}");
        assert_eq!(st.aborted.get("left a staller out"), None, "{st:?}");
        assert!(st.left_out.is_empty(), "{st:?}");
        assert_eq!(st.ring_size, 4, "{st:?}");
    }
    assert!(ring.means.iter().all(Option::is_none));
    // It reaches the boundary and the round completes with all four.
    ring.run(retry, &alive);
    assert!(
        ring.means.iter().all(Option::is_some),
        "no round with all four"
    );
    assert_eq!(ring.offences, 0);
}

/// A rogue whose hops name a round or an attempt past half the limits (where hops become
/// offences): no member follows it there (followed, one member's hops would carry every
/// member's counters to the limit, and then the honest members' own hops would be offences
/// to each other). Its hops reach nothing, the attempt stalls, it is left out, and the three
/// complete round 0.
#[test]
fn no_member_follows_a_hop_to_counters_near_their_limits() {
    for (name, far) in [
        ("round", (ROUND_LIMIT / 2, 0)),
        ("attempt", (0, ATTEMPT_LIMIT / 2)),
    ] {
        let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
        ring.rogue = Some((
            3,
            Box::new(move |m: &mut RingMessage, _| {
                m.round += far.0;
                m.attempt += far.1;
            }),
        ));
        let t0 = Instant::now();
        hear_all_with_step(&mut ring, 3, 5, t0);
        ring.run(t0, &[true; 4]);
        for node in &ring.nodes[..3] {
            let st = node.status(t0);
            assert_eq!((st.round, st.attempt), (Some(0), 0), "{name}: {st:?}");
        }
        let stalled = t0 + STALL_TIMEOUT;
        hear_all_with_step(&mut ring, 3, 5, stalled);
        ring.run(stalled, &[true; 4]);
        let retry = stalled + RETRY_PAUSE;
        ring.run(retry, &[true; 4]);
        assert!(
            ring.means[..3].iter().all(Option::is_some),
            "{name}: the three completed no round"
        );
        for node in &ring.nodes[..3] {
            let st = node.status(retry);
            assert_eq!(st.round, Some(0), "{name}: {st:?}");
            assert_eq!(st.left_out, vec![ring.ids[3].to_string()], "{name}");
        }
        assert_eq!(ring.offences, 0, "{name}");
    }
}

/// Member 3 says its steps move (1, 2, 3, 4: still training towards the boundary at 5) and
/// never sends a hop: the first two stalls of the round are excused, the third leaves it out.
#[test]
fn a_member_that_says_it_trains_is_excused_only_twice_a_round() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    ring.cut = (0..3).map(|j| (3, j)).collect();
    let alive = [true, true, true, false];
    let mut t = Instant::now();
    hear_all_with_step(&mut ring, 3, 1, t);
    ring.run(t, &alive);
    for (stall, step) in [(1u64, 2), (2, 3), (3, 4)] {
        t += STALL_TIMEOUT;
        hear_all_with_step(&mut ring, 3, step, t);
        ring.run(t, &alive);
        for node in &ring.nodes[..3] {
            let st = node.status(t);
            assert_eq!(st.aborted.get("stalled"), Some(&stall), "{st:?}");
            let left_out = stall > u64::from(STALL_EXCUSES);
            assert_eq!(!st.left_out.is_empty(), left_out, "stall {stall}: {st:?}");
        }
        t += RETRY_PAUSE;
        ring.run(t, &alive);
    }
    assert!(
        ring.means[..3].iter().all(Option::is_some),
        "no round of three"
    );
    assert_eq!(ring.offences, 0);
}

/// Member 3 withholds its parts from members 0 and 1 only. They leave it out; member 2,
/// which got every part and misses the aggregates of two owners (each waiting for member
/// 3's part), leaves out nobody: blaming every owner missing would have made it leave out
/// the two honest ones and go on with the rogue alone.
#[test]
fn a_member_missing_several_owners_aggregates_leaves_out_none_of_them() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    ring.cut = vec![(3, 0), (3, 1)];
    let t0 = Instant::now();
    hear_all_with_step(&mut ring, 3, 5, t0);
    ring.run(t0, &[true; 4]);
    let stalled = t0 + STALL_TIMEOUT;
    hear_all_with_step(&mut ring, 3, 5, stalled);
    ring.run(stalled, &[true; 4]);
    for i in 0..2 {
        let st = ring.nodes[i].status(stalled);
        assert_eq!(st.left_out, vec![ring.ids[3].to_string()], "{i}: {st:?}");
    }
    let st = ring.nodes[2].status(stalled);
    assert_eq!(st.aborted.get("stalled"), Some(&1), "{st:?}");
    assert!(st.left_out.is_empty(), "{st:?}");
    // The two it withheld from name it in their heartbeats; member 2 names no one.
    for i in 0..2 {
        assert_eq!(ring.nodes[i].accusation(stalled), Some((ring.ids[3], 1)));
    }
    assert_eq!(ring.nodes[2].accusation(stalled), None);
}

/// A member that one member's heartbeats accuse twice in a row is left out by a member that
/// hears them, once for each new accusation however many heartbeats repeat it; an
/// accusation heard once, or a first one heard at count 2, leaves it in.
#[test]
fn a_member_one_member_accuses_again_is_left_out() {
    let mut ring = Ring::new(5, &[1.0; 5], &[true; 5]);
    let t0 = Instant::now();
    ring.hear_all(t0);
    let x = ring.ids[4];
    let accusing = |times: u32| Heartbeat {
        accused: Some(x.to_string()),
        accusations: times,
        ..ready_in(Some(0), None)
    };
    let left_out = |ring: &Ring, t| ring.nodes[0].status(t).left_out.contains(&x.to_string());
    let again = |ring: &Ring, t| {
        ring.nodes[0]
            .status(t)
            .aborted
            .get("left out a member accused again")
            .copied()
    };
    ring.nodes[0].heard(ring.ids[1], &accusing(1), t0);
    ring.nodes[0].heard(ring.ids[1], &accusing(1), t0);
    ring.nodes[0].heard(PeerId::random(), &accusing(2), t0);
    assert!(!left_out(&ring, t0));
    ring.nodes[0].heard(ring.ids[1], &accusing(2), t0);
    assert!(left_out(&ring, t0));
    assert_eq!(again(&ring, t0), Some(1));
    // After its leave-out, the same accusation repeated is no news; the next one is.
    let t1 = t0 + super::lists::SIT_OUT;
    ring.hear_all(t1);
    ring.nodes[0].heard(ring.ids[1], &accusing(2), t1);
    assert!(!left_out(&ring, t1));
    ring.nodes[0].heard(ring.ids[1], &accusing(3), t1);
    assert!(left_out(&ring, t1));
    assert_eq!(again(&ring, t1), Some(2));
}

/// One member's hops move a member at most `ROUND_JUMP` past the round most members'
/// heartbeats name, however many it sends (measured from the member's own round, a second
/// hop would carry it on, and the others would drop its hops as too far ahead while it drops
/// theirs as stale); a member that is that far past them anyway gives way at their next hop,
/// to take their round as a joiner.
#[test]
fn hops_carry_a_member_no_further_than_a_jump_past_what_most_members_say() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    let mut out = Vec::new();
    for round in [ROUND_JUMP, 2 * ROUND_JUMP] {
        let hop = next_round_hop(&ring, round);
        ring.nodes[0].message(ring.ids[1], hop, now, &mut out);
    }
    follow_lone_claim(&mut ring, 0, now);
    assert_eq!(ring.nodes[0].status(now).round, Some(ROUND_JUMP));
    // Made to think it is far past the others (as after a long split), it gives way.
    ring.nodes[0].attempt.round = Some(3 * ROUND_JUMP);
    let hop = next_round_hop(&ring, 0);
    out.clear();
    ring.nodes[0].message(ring.ids[2], hop, now, &mut out);
    let st = ring.nodes[0].status(now);
    // Round `None`: it takes the mesh's round from the hops at its next contribution.
    assert_eq!((st.round, st.synced), (None, false), "{st:?}");
    assert!(
        out.iter().all(|o| !matches!(o, Output::Offence { .. })),
        "{out:?}"
    );
}

/// The gradient judge's scale is the largest of a member's last own gradients, not its own
/// now alone: a small balanced batch it predicts well gives a gradient of almost nothing,
/// and judged by that, an honest member's part was refused (1.5e4 x, past the 1e4 x bound).
#[test]
fn a_tiny_own_gradient_does_not_shrink_the_scale_others_are_judged_by() {
    let mut scale = GradientScale::default();
    scale.with(5.0);
    let judge = Judge::GradientNorm {
        norm: scale.with(3.4e-4),
    };
    let honest_part = vec![5.0f32 / 3.0; 9];
    assert!(judge.beyond(&honest_part, &[0.0; 9]).is_none());
    assert!(Judge::GradientNorm { norm: 3.4e-4 }
        .beyond(&honest_part, &[0.0; 9])
        .is_some());
}

/// A member that most members' heartbeats say named them a later round their attempt's hops
/// contradicted is left out, by every member that hears them; fewer accusers leave it in,
/// and a member that names a new stranger in every heartbeat crowds out no one's
/// accusation (each accuser has one).
#[test]
fn a_member_most_found_contradicted_is_left_out_and_fewer_accusers_are_not_enough() {
    let mut ring = Ring::new(5, &[1.0; 5], &[true; 5]);
    let now = Instant::now();
    ring.hear_all(now);
    let x = ring.ids[4];
    let naming = |peer: PeerId| Heartbeat {
        accused: Some(peer.to_string()),
        accusations: 1,
        ..ready_in(Some(0), None)
    };
    let left_out = |ring: &Ring| ring.nodes[0].status(now).left_out.contains(&x.to_string());
    for _ in 0..200 {
        ring.nodes[0].heard(ring.ids[3], &naming(PeerId::random()), now);
    }
    ring.nodes[0].heard(ring.ids[1], &naming(x), now);
    ring.nodes[0].heard(ring.ids[2], &naming(x), now);
    // Two of the four voters (this member, 1, 2 and 3; not x) are not most.
    assert!(!left_out(&ring));
    ring.nodes[0].heard(ring.ids[3], &naming(x), now);
    assert!(left_out(&ring));
    assert_eq!(
        ring.nodes[0]
            .status(now)
            .aborted
            .get("left out a member most accused"),
        Some(&1)
    );
}

/// A member whose heartbeat says it is not in rounds while an attempt waits for its hops ends
/// that attempt at once, and counts as a stall: excused twice a round, then left out (saying
/// so just before each stall timeout, it would otherwise never be).
#[test]
fn a_member_that_sits_out_while_awaited_is_excused_as_a_staller_is() {
    let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
    let mut now = Instant::now();
    ring.hear_all(now);
    ring.bring_to_boundary(0, now);
    let mut not_ready = ready_in(Some(0), None);
    not_ready.in_rounds = false;
    for sat_out in 1..=STALL_EXCUSES + 1 {
        ring.nodes[0].heard(ring.ids[2], &not_ready, now);
        let st = ring.nodes[0].status(now);
        assert_eq!(
            st.aborted.get("a member sat out").copied(),
            Some(u64::from(sat_out)),
            "{st:?}"
        );
        let left_out = st.left_out.contains(&ring.ids[2].to_string());
        assert_eq!(left_out, sat_out > STALL_EXCUSES, "{st:?}");
        // Back in rounds; the retry waits for it again.
        now += RETRY_PAUSE;
        ring.hear_all(now);
        let step = ring.nodes[0].step_limit();
        ring.nodes[0].tick(step, true, now, &mut Vec::new());
    }
}

/// Node `i`, at its boundary with one member's hop of a later round waiting and nothing
/// contradicting it, takes that round: its attempt ends [`LATE_ROUND_WAIT`] after the hop
/// without progress, and the retry after [`RETRY_PAUSE`] takes the round.
fn follow_lone_claim(ring: &mut Ring, i: usize, now: Instant) {
    let mut out = Vec::new();
    let step = ring.nodes[i].step_limit();
    let went_on = now + LATE_ROUND_WAIT;
    ring.nodes[i].tick(step, true, went_on, &mut out);
    ring.nodes[i].tick(step, true, went_on + RETRY_PAUSE, &mut out);
}

/// A member that got one member's hop of the next round, where most of the others' hops of
/// its attempt show them still in this round, does not follow it: it sits out for
/// [`CONTRADICTED_SIT_OUT`] (saying so, and naming the member, in its heartbeats) and leaves
/// the rest of its state as it was; an attempt of the others that waits for its hops ends at
/// once when they hear it is not in rounds.
#[test]
fn a_later_round_most_members_contradict_is_not_followed() {
    let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
    let now = Instant::now();
    ring.hear_all(now);
    for i in 0..4 {
        ring.bring_to_boundary(i, now);
    }
    // Member 3 names the next round to member 0 instead of sending its part.
    let mut out = Vec::new();
    let lie = next_round_hop(&ring, 1);
    ring.nodes[0].message(ring.ids[3], lie, now, &mut out);
    assert!(ring.nodes[0].accusation(now).is_none(), "not yet");
    // Members 1 and 2 send their parts of this attempt (of member 0's chunk, its weight
    // after it).
    let (sorted, _) = ring.sorted();
    let k = sorted
        .iter()
        .position(|p| *p == ring.ids[0])
        .expect("listed");
    let chunk = (k + 1) * 10 / 4 - k * 10 / 4;
    for j in [1, 2] {
        let mut part = next_round_hop(&ring, 0);
        part.values = ByteBuf::from(1.0f32.to_le_bytes().repeat(chunk + 1));
        ring.nodes[0].message(ring.ids[j], part, now, &mut out);
    }
    let st = ring.nodes[0].status(now);
    assert_eq!(st.round, Some(0), "{st:?}");
    assert!(ring.nodes[0].sitting_out(now), "{st:?}");
    assert!(!ring.nodes[0].sitting_out(now + CONTRADICTED_SIT_OUT));
    assert_eq!(ring.nodes[0].accusation(now), Some((ring.ids[3], 1)));
    assert_eq!(
        st.aborted
            .get("a member's later round contradicts the others'"),
        Some(&1)
    );
    // Member 1, in an attempt that waits for member 0's hops, hears it sit out.
    let mut sits_out = ready_in(Some(0), None);
    sits_out.in_rounds = false;
    ring.nodes[1].heard(ring.ids[0], &sits_out, now);
    let st = ring.nodes[1].status(now);
    assert_eq!(st.aborted.get("a member sat out"), Some(&1), "{st:?}");
    // Member 1 accuses member 3 too: with member 0's own accusation that is most of the
    // three voters, so member 0 leaves it out, and its sit-out over member 3 ends at once
    // (sitting on, every member that contradicted it came back to a mesh none of them was
    // in).
    let accusing = Heartbeat {
        accused: Some(ring.ids[3].to_string()),
        accusations: 1,
        ..ready_in(Some(0), None)
    };
    let later = now + CONTRADICTED_SIT_OUT / 4;
    assert!(ring.nodes[0].sitting_out(later));
    ring.nodes[0].heard(ring.ids[1], &accusing, later);
    let st = ring.nodes[0].status(later);
    assert_eq!(st.left_out, vec![ring.ids[3].to_string()], "{st:?}");
    assert!(!ring.nodes[0].sitting_out(later), "{st:?}");
}

/// A ring of three: members 1 and 2 joined (not synced, no round completed here) and took
/// round 0 on the members' word; member 0 finished round 0 before they were ready and names
/// round 1 to member 1, while member 2's part of round 0 shows it in this attempt. A joiner
/// with one fellow joiner as its witness has no proof: member 1 neither sits out nor
/// accuses member 0, and follows the claim once the wait for a late round is over. The same
/// with member 1 synced: it finds the claim contradicted. Answers member 1's status and
/// accusation.
fn joiner_hears_the_next_round(member_1_synced: bool) -> (RoundStatus, Option<(PeerId, u32)>) {
    let mut ring = Ring::new(3, &[1.0, 0.0, 0.0], &[true, member_1_synced, false]);
    let now = Instant::now();
    for _ in 0..2 {
        ring.hear_all(now);
        for i in 0..3 {
            ring.bring_to_boundary(i, now);
        }
    }
    // Member 2's part of round 0 comes first: a joiner without a round takes it.
    let mut out = Vec::new();
    let (sorted, _) = ring.sorted();
    let k = sorted
        .iter()
        .position(|p| *p == ring.ids[1])
        .expect("listed");
    let chunk = (k + 1) * 10 / 3 - k * 10 / 3;
    let mut part = next_round_hop(&ring, 0);
    part.values = ByteBuf::from(0.0f32.to_le_bytes().repeat(chunk + 1));
    ring.nodes[1].message(ring.ids[2], part, now, &mut out);
    let step = ring.nodes[1].step_limit();
    ring.nodes[1].tick(step, true, now, &mut out);
    let st = ring.nodes[1].status(now);
    assert_eq!((st.round, st.ring_size), (Some(0), 3), "{st:?}");
    let claim = next_round_hop(&ring, 1);
    ring.nodes[1].message(ring.ids[0], claim, now, &mut out);
    if !member_1_synced {
        assert!(!ring.nodes[1].sitting_out(now));
        follow_lone_claim(&mut ring, 1, now);
    }
    let later = now + LATE_ROUND_WAIT + RETRY_PAUSE;
    (ring.nodes[1].status(later), ring.nodes[1].accusation(later))
}

#[test]
fn a_joiner_in_a_ring_of_three_is_no_witness_against_a_member_a_round_ahead() {
    let (st, accusation) = joiner_hears_the_next_round(false);
    assert_eq!(accusation, None, "{st:?}");
    assert_eq!(st.round, Some(1), "{st:?}");
    let (st, accusation) = joiner_hears_the_next_round(true);
    assert!(accusation.is_some(), "{st:?}");
    assert_eq!(st.round, Some(0), "{st:?}");
}

/// A member whose stalled attempt waited for every other member it hears, and would now
/// leave them all out, is the one out of step: it leaves none out and holds as a joiner
/// (no round), to take the members' round and parameters; where it waited for only some of
/// them, they are left out as before.
#[test]
fn a_member_that_would_leave_out_every_other_member_holds_instead() {
    for all in [true, false] {
        let mut ring = Ring::new(4, &[1.0; 4], &[true; 4]);
        let alive = [true; 4];
        // Nothing reaches member 0 from the members it waits for (all three, or member 3
        // alone), while their heartbeats say they are at the boundary.
        let silent: Vec<usize> = if all { vec![1, 2, 3] } else { vec![3] };
        ring.cut = silent.iter().map(|j| (*j, 0)).collect();
        let t0 = Instant::now();
        for k in &silent {
            hear_all_with_step(&mut ring, *k, 5, t0);
        }
        ring.run(t0, &alive);
        let stalled = t0 + STALL_TIMEOUT;
        for k in &silent {
            hear_all_with_step(&mut ring, *k, 5, stalled);
        }
        ring.run(stalled, &alive);
        let st = ring.nodes[0].status(stalled);
        assert_eq!(st.aborted.get("stalled"), Some(&1), "{st:?}");
        if all {
            assert!(st.left_out.is_empty(), "{st:?}");
            assert_eq!(
                st.aborted.get("out of step with every member"),
                Some(&1),
                "{st:?}"
            );
            assert_eq!(st.round, None, "{st:?}");
        } else {
            assert_eq!(st.left_out, vec![ring.ids[3].to_string()], "{st:?}");
            assert_eq!(st.aborted.get("out of step with every member"), None);
        }
    }
}

/// A member alone (`min_members` 1, nobody else ready) completes its rounds as a ring of
/// one: its parameters are its own, a promise to nobody, so its status claims no digest for
/// them. (It did: an honest member that sat a few seconds apart from two others that went on
/// together showed a digest of its own for a round the two had digested together, and a test
/// comparing members' digests of one round found them apart.) A ring of two or more names its
/// members' list beside the digest, so digests of one round compare within one ring.
#[test]
fn a_lone_members_round_claims_no_digest_and_a_rings_names_its_members() {
    let mut alone = Ring::new(1, &[1.0], &[true]);
    let now = Instant::now();
    alone.run(now, &[true]);
    assert!(
        alone.means[0].is_some(),
        "the lone member completed no round"
    );
    alone.nodes[0].combined(0, 5, "alone".into(), &mut Vec::new());
    let st = alone.nodes[0].status(Instant::now());
    assert_eq!(st.completed, 1);
    assert!(st.digests.is_empty(), "{:?}", st.digests);

    let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
    ring.hear_all(now);
    ring.run(now, &[true; 3]);
    let (_, members) = ring.sorted();
    for i in 0..3 {
        ring.nodes[i].combined(0, 5, "together".into(), &mut Vec::new());
        assert_eq!(
            ring.nodes[i].status(Instant::now()).digests,
            vec![(0, "together".to_string(), format!("{members:016x}"))]
        );
    }
}

/// Members 1 and 2 of three sit out (their heartbeats say they are not in rounds) while
/// member 0's sit-out already ended: member 0 completes no round alone, for a round it
/// raced to alone would be contradicted by both when they come back, and they would accuse
/// it (`ring_rogue`'s `relay_next_round` test in CI: the member whose sit-out over a rogue
/// ended first went from round 693 to 725 in 0.1 s, and the two others, still at 695, left
/// it out). Once they are heard ready again the three complete the round together. A pair
/// is not held so: one member sitting out leaves the other half of the members.
#[test]
fn a_member_completes_no_round_alone_while_most_members_sit_out() {
    let sitting_out = Heartbeat {
        in_rounds: false,
        ..ready_in(Some(0), None)
    };
    let mut ring = Ring::new(3, &[1.0; 3], &[true; 3]);
    let now = Instant::now();
    ring.hear_all(now);
    for j in [1, 2] {
        ring.nodes[0].heard(ring.ids[j], &sitting_out, now);
    }
    ring.run(now, &[true, false, false]);
    let st = ring.nodes[0].status(now);
    assert!(ring.means[0].is_none(), "a round alone: {st:?}");
    assert_eq!((st.round, st.ring_size), (Some(0), 0), "{st:?}");
    // They come back: the next tick starts the round with all three.
    let later = now + RETRY_PAUSE;
    ring.hear_all(later);
    ring.run(later, &[true; 3]);
    assert!(ring.means.iter().all(Option::is_some), "{:?}", ring.means);
    assert_eq!(ring.nodes[0].status(later).ring_size, 3);

    // Two members, one sitting out: the other goes on alone.
    let mut pair = Ring::new(2, &[1.0; 2], &[true; 2]);
    pair.hear_all(now);
    pair.nodes[0].heard(pair.ids[1], &sitting_out, now);
    pair.run(now, &[true, false]);
    assert!(pair.means[0].is_some(), "{:?}", pair.nodes[0].status(now));
}

/// A joiner whose hop to the mesh's one synced member could not be delivered retries
/// without it, alone. It founds no state of its own there while that member is merely
/// unreachable (its connection up): their next ring would sum outer changes from two round
/// starts, and their bits would differ (CI: `modes::a_diloco_ring_carries_a_large_models_state_in_pieces`,
/// a hop of its 102 MB state round undelivered, the joiner founding alone, and the two
/// members' digests apart after round 4). Heard again, the member takes it back into a ring
/// of two; gone (its connection closed), it leaves the joiner free to found alone.
#[test]
fn a_joiner_founds_no_state_alone_beside_a_member_it_could_not_reach() {
    let mut ring = Ring::new(2, &[1.0; 2], &[true, false]);
    let now = Instant::now();
    ring.nodes[1].attempt.round = Some(4);
    ring.hear_all(now);
    ring.bring_to_boundary(1, now);
    assert_eq!(ring.nodes[1].status(now).ring_size, 2);
    ring.nodes[1].undelivered(ring.ids[0], 4, 0, now);
    let later = now + RETRY_PAUSE;
    let step = ring.nodes[1].step_limit();
    ring.nodes[1].tick(step, true, later, &mut Vec::new());
    let st = ring.nodes[1].status(later);
    assert!(!st.synced, "founded a state alone: {st:?}");
    assert_eq!(st.aborted.get("no member synced"), None, "{st:?}");
    // Heard again: a ring of two.
    ring.nodes[1].heard(ring.ids[0], &ready_in(Some(4), None), later);
    ring.nodes[1].tick(step, true, later + RETRY_PAUSE, &mut Vec::new());
    assert_eq!(ring.nodes[1].status(later).ring_size, 2);
    // Gone: alone, it founds.
    let even_later = later + RETRY_PAUSE * 2;
    ring.nodes[1].peer_down(ring.ids[0], even_later);
    ring.nodes[1].tick(step, true, even_later + RETRY_PAUSE, &mut Vec::new());
    let st = ring.nodes[1].status(even_later);
    assert!(st.synced, "{st:?}");
}

/// The module docs' rules name every test here, and no name there that looks like a test
/// is missing here: the list is the map from each rule to what shows it.
#[test]
fn the_module_docs_rules_name_every_test_here() {
    let docs = include_str!("mod.rs");
    let start = docs.find("//! # Rules").expect("a Rules section");
    let end = docs[start..]
        .find("//! Pure state")
        .expect("the docs' last line")
        + start;
    let named: Vec<&str> = docs[start..end]
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|n| {
            n.matches('_').count() >= 2
                && n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .collect();
    let tests: Vec<&str> = include_str!("tests.rs")
        .split("#[test]\nfn ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .collect();
    assert!(tests.len() > 50, "{} tests found", tests.len());
    for t in &tests {
        assert!(
            named.contains(t),
            "test {t} is in no rule of the module docs"
        );
    }
    for n in &named {
        assert!(
            tests.contains(n),
            "the module docs name {n}: no such test here"
        );
    }
}
