//! The simulated replicas: each node's "trainer" (a quadratic objective towards a target of
//! its own), its steps under the core's limit, what it makes of the core's commands, and the
//! consensus distance between the honest ones.

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
        let mut noise = StdRng::seed_from_u64(self.p.seed ^ n.step ^ (i as u64) << 32);
        for (x, t) in n.x.iter_mut().zip(&n.target) {
            *x -= 0.002 * (*x - t) + 0.0005 * noise.random_range(-1.0f32..1.0);
        }
        n.step += 1;
        n.last_advanced = self.t;
        if !n.hostile {
            self.report.steps += 1;
        }
        let progress = Progress {
            phase: Phase::Training,
            step: n.step,
            param_norm: l2_norm(&n.x),
            loss: None,
            samples_per_sec: 0.0,
            accuracy: None,
            ms_per_sample: None,
        };
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

    /// The node's trainer, as `trainer.rs` does it.
    pub(super) fn train(&mut self, i: usize, cmd: TrainerCommand) -> Option<Input> {
        let n = &mut self.nodes[i];
        match cmd {
            TrainerCommand::TakeDelta => {
                let delta = n.own.delta(&n.x)?;
                n.own.reset(&n.x);
                let base_step = n.last_delta_step;
                n.last_delta_step = n.step;
                Some(Input::Trainer(TrainerEvent::Delta {
                    base_step,
                    step: n.step,
                    delta,
                }))
            }
            TrainerCommand::Apply { values, weight } => {
                for (x, v) in n.x.iter_mut().zip(&values) {
                    *x += weight * v;
                }
                n.own.added(&values, weight);
                self.report.applied += 1;
                None
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
                Some(Input::Trainer(TrainerEvent::Averaged { seq, outcome }))
            }
            // Only the synchronous modes ask for these; the simulated nodes gossip.
            TrainerCommand::TakeParams
            | TrainerCommand::TakeGradient { .. }
            | TrainerCommand::Combine { .. } => None,
        }
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
