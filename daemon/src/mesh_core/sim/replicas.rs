//! The simulated replicas: each node's "trainer" (a quadratic objective towards a target of
//! its own), its steps under the core's limit, what it makes of the core's commands (the
//! gossip mode's deltas, applies and averages, and a round's parameters, gradients and mean),
//! and the consensus distance between the honest ones.

use super::*;

impl Sim {
    pub(super) fn step(&mut self, i: usize) {
        if !self.nodes[i].alive {
            return;
        }
        let ms = self.nodes[i].step_ms;
        self.at(ms, Ev::Step(i));
        let now = self.now();
        let limit = self.nodes[i].core.step_limit(now);
        if limit.is_some_and(|l| self.nodes[i].step >= l) {
            self.report.held_steps += 1;
            return;
        }
        // The staleness bound, checked against the truth: neighbours this node has heard of
        // and can reach.
        if let Some(bound) = self.p.policy.staleness_bound {
            let me = self.nodes[i].step;
            let neighbours: Vec<usize> = self.nodes[i]
                .core
                .neighbours()
                .iter()
                .filter_map(|p| self.index.get(p).copied())
                .filter(|&j| self.connected(i, j) && self.nodes[i].heard.contains(&j))
                .collect();
            for &j in &neighbours {
                if me >= self.nodes[j].step + bound.max(1) + self.lag_allowance(j) {
                    self.report.ssp_violations += 1;
                    break;
                }
            }
        }
        let n = &mut self.nodes[i];
        // A step of `LR` down [`SimNode::gradient`], written out as recorded figures have it.
        let mut noise = StdRng::seed_from_u64(self.p.seed ^ n.step ^ (i as u64) << 32);
        for (x, t) in n.x.iter_mut().zip(&n.target) {
            *x -= 0.002 * (*x - t) + 0.0005 * noise.random_range(-1.0f32..1.0);
        }
        n.step += 1;
        n.last_advanced = self.t;
        if !n.hostile {
            self.report.steps += 1;
        }
        let progress = n.progress();
        let step = n.step;
        self.input(i, Input::Progress(progress));
        self.input(
            i,
            Input::Trainer(TrainerEvent::Stepped {
                step,
                pending_ratio: 0.0,
            }),
        );
    }

    /// Keeps, for the staleness check, which peers' heartbeats reached node `i` since it last
    /// lost them.
    pub(super) fn note_heard(&mut self, i: usize, input: &Input) {
        match input {
            Input::Gossip {
                author: Some(a),
                topic,
                ..
            } if topic.ends_with("heartbeat") => {
                if let Some(&j) = self.index.get(a) {
                    self.nodes[i].heard.insert(j);
                }
            }
            Input::PeerDown(p) => {
                if let Some(&j) = self.index.get(p) {
                    self.nodes[i].heard.remove(&j);
                }
            }
            _ => {}
        }
    }

    /// Steps a neighbour may have taken since its last heartbeat reached us: the bound is
    /// enforced against what the node knows, which lags the truth by one heartbeat period and
    /// a link's delay.
    pub(super) fn lag_allowance(&self, j: usize) -> u64 {
        (HEARTBEAT_EVERY.as_millis() as u64 + 200) / self.nodes[j].step_ms + 1
    }

    /// The node's trainer, as `trainer/` does it; what it tells the core, to be handled last
    /// first.
    pub(super) fn train(&mut self, i: usize, cmd: TrainerCommand) -> Vec<Input> {
        let seed = self.p.seed;
        let n = &mut self.nodes[i];
        let event = match cmd {
            TrainerCommand::TakeDelta => {
                let Some(delta) = n.own.delta(&n.x) else {
                    return Vec::new();
                };
                n.own.reset(&n.x);
                let base_step = n.last_delta_step;
                n.last_delta_step = n.step;
                TrainerEvent::Delta {
                    base_step,
                    step: n.step,
                    delta,
                }
            }
            TrainerCommand::Apply { values, weight } => {
                for (x, v) in n.x.iter_mut().zip(&values) {
                    *x += weight * v;
                }
                n.own.added(&values, weight);
                // As the trainer counts: an own change given back is no neighbour's update.
                if weight > 0.0 {
                    self.report.applied += 1;
                }
                return Vec::new();
            }
            TrainerCommand::Average { seq, theirs, bound } => {
                let outcome = match sync_guard::judge(&n.x, &theirs, bound) {
                    Ok(d) => {
                        let merged = replica::averaged(&n.x, &theirs);
                        n.own.moved(&n.x, &merged);
                        n.x = merged;
                        if !n.hostile {
                            self.report.syncs += 1;
                        }
                        AverageOutcome::Averaged(d)
                    }
                    Err(r) => AverageOutcome::Refused(r),
                };
                TrainerEvent::Averaged { seq, outcome }
            }
            // In `diloco`, followed by the round's start and the outer velocity.
            TrainerCommand::TakeParams => {
                let mut values = n.x.clone();
                if let Some(outer) = &mut n.outer {
                    outer.given = n.x.clone();
                    values.extend_from_slice(&outer.anchor);
                    values.extend_from_slice(&outer.velocity);
                }
                TrainerEvent::Params {
                    step: n.step,
                    values,
                }
            }
            // A gradient takes a step's time to compute (a lone `ddp` node's rounds are its
            // steps, one after the other).
            TrainerCommand::TakeGradient { batch } => {
                let values = n.gradient(seed, i);
                n.kept_gradient = Some(values.clone());
                let event = TrainerEvent::Gradient {
                    step: n.step,
                    values,
                    samples: batch,
                };
                n.trainer_free_at = n.trainer_free_at.max(self.t) + n.step_ms;
                let ms = n.trainer_free_at - self.t;
                self.at(ms, Ev::Deliver(i, Box::new(Input::Trainer(event))));
                return Vec::new();
            }
            TrainerCommand::Combine {
                round,
                mean,
                gradient,
                step,
                ran_on,
                ..
            } => {
                let kept = n.kept_gradient.take();
                // A member whose parameters are the mesh's: after a parameter round every
                // member is; after a gradient round, those that were before it.
                let synced = !gradient
                    || n.core
                        .status(self.base + Duration::from_millis(self.t))
                        .rounds
                        .is_some_and(|r| r.synced);
                let carries_state = n.outer.is_some() && mean.len() == 3 * n.x.len();
                if mean.len() != n.x.len() && !mean.is_empty() && !carries_state {
                    let outcome = Err(format!("a mean of {} values", mean.len()));
                    return vec![Input::Trainer(TrainerEvent::Combined {
                        round,
                        step: n.step,
                        outcome,
                    })];
                }
                match (gradient, kept) {
                    // A gradient round: the step is made with the members' mean gradient
                    // (the own one where no member was synced); without a kept gradient
                    // (this node gave parameters) nothing changes.
                    (true, Some(own)) => {
                        let g = if mean.is_empty() { &own } else { &mean };
                        for (x, g) in n.x.iter_mut().zip(g) {
                            *x -= LR * g;
                        }
                        n.step += 1;
                        if !n.hostile {
                            self.report.steps += 1;
                        }
                    }
                    (true, None) => {}
                    (false, _) => {
                        let d = n.x.len();
                        match &mut n.outer {
                            // DiLoCo's outer step from the round's start (the members', where
                            // the mean carries it) towards the mean, as the trainer takes it.
                            Some(outer) if !mean.is_empty() => {
                                if carries_state {
                                    outer.anchor = mean[d..2 * d].to_vec();
                                    outer.velocity = mean[2 * d..].to_vec();
                                }
                                let next =
                                    OUTER.step(&outer.anchor, &mean[..d], &mut outer.velocity);
                                n.x = if ran_on && outer.given.len() == d {
                                    replica::steps_kept_onto(&next, &outer.given, &n.x)
                                } else {
                                    next.clone()
                                };
                                outer.anchor = next;
                            }
                            // An empty mean: the parameters are kept, and the next round
                            // starts from them.
                            Some(outer) => outer.anchor = n.x.clone(),
                            None if !mean.is_empty() => n.x = mean.clone(),
                            None => {}
                        }
                        // The trainer moves its step forward only.
                        if let Some(step) = step.filter(|s| *s > n.step) {
                            n.step = step;
                        }
                    }
                }
                n.last_advanced = self.t;
                // The members' shared bits: a `diloco` member's round result (its next round's
                // start), whatever steps it kept on top.
                let digest = match &n.outer {
                    Some(outer) if !gradient => params_digest(&outer.anchor),
                    _ => params_digest(&n.x),
                };
                // Filed under the ring of this round's last hop sent, forgotten with it: a ring
                // of one sends no hop and makes no promise.
                let ring = n.last_ring.take().filter(|(r, _)| *r == round);
                if let Some(ring) = ring.filter(|_| synced && !mean.is_empty() && !n.hostile) {
                    self.round_digests
                        .entry(ring)
                        .or_default()
                        .insert(digest.clone());
                }
                let (progress, step) = (n.progress(), n.step);
                // Handled last first: the mean's answer, then the trainer's news.
                return vec![
                    Input::Trainer(TrainerEvent::Stepped {
                        step,
                        pending_ratio: 0.0,
                    }),
                    Input::Progress(progress),
                    Input::Trainer(TrainerEvent::Combined {
                        round,
                        step,
                        outcome: Ok(digest),
                    }),
                ];
            }
        };
        vec![Input::Trainer(event)]
    }

    /// The trainer's `answers` (as [`Sim::train`] gives them, last first) now, or, while it
    /// still computes a gradient, delivered in order once it is done.
    pub(super) fn when_trainer_free(&mut self, i: usize, answers: Vec<Input>) -> Vec<Input> {
        let free_at = self.nodes[i].trainer_free_at;
        if free_at <= self.t {
            return answers;
        }
        for answer in answers.into_iter().rev() {
            self.at(free_at - self.t, Ev::Deliver(i, Box::new(answer)));
        }
        Vec::new()
    }

    /// Mean relative distance of the live honest nodes from their mean.
    pub(super) fn consensus(&self) -> f64 {
        let honest: Vec<&SimNode> = self
            .nodes
            .iter()
            .filter(|n| n.alive && !n.hostile)
            .collect();
        let mut mean = vec![0.0f64; self.p.dim];
        for n in &honest {
            for (m, x) in mean.iter_mut().zip(&n.x) {
                *m += f64::from(*x) / honest.len() as f64;
            }
        }
        let mean_norm = mean.iter().map(|m| m * m).sum::<f64>().sqrt().max(1e-9);
        honest
            .iter()
            .map(|n| {
                n.x.iter()
                    .zip(&mean)
                    .map(|(x, m)| (f64::from(*x) - m).powi(2))
                    .sum::<f64>()
                    .sqrt()
                    / mean_norm
            })
            .sum::<f64>()
            / honest.len().max(1) as f64
    }
}

/// The simulated trainers' learning rate.
const LR: f32 = 0.002;

impl SimNode {
    /// Its objective's gradient at its parameters, with noise seeded by the node and step
    /// (a batch's noise): the same call at the same state gives the same values.
    fn gradient(&self, seed: u64, i: usize) -> Vec<f32> {
        let mut noise = StdRng::seed_from_u64(seed ^ self.step ^ (i as u64) << 32);
        self.x
            .iter()
            .zip(&self.target)
            .map(|(x, t)| (x - t) + 0.25 * noise.random_range(-1.0f32..1.0))
            .collect()
    }

    /// What its trainer publishes about itself.
    pub(super) fn progress(&self) -> Progress {
        Progress {
            phase: Phase::Training,
            step: self.step,
            param_norm: l2_norm(&self.x),
            loss: None,
            samples_per_sec: 0.0,
            accuracy: None,
            ms_per_sample: None,
        }
    }
}
