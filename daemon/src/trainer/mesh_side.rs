//! What the mesh asks of the trainer: the delta since the last one (its own change, kept
//! apart from what came from elsewhere), neighbours' values applied with a weight, a full sync's
//! average within a bound, a round's mean taken (or DiLoCo's outer step towards it), and in
//! `ddp` the next batch's gradient kept for the round's mean gradient.

use super::*;

impl Loop {
    /// Takes the current parameters as the base of the next delta.
    pub(super) fn reset_anchor(&mut self) -> Result<(), TrainerError> {
        let flat = self.flat()?;
        self.stats.param_norm = l2_norm(&flat);
        if self.s.publishes {
            self.own.reset(&flat);
        } else {
            self.own.clear();
        }
        Ok(())
    }

    /// Adds `weight * values` to the parameters: a neighbour's update (positive), or part of
    /// this node's own published change given back (negative, mean mixing).
    pub(super) fn apply(&mut self, values: &[f32], weight: f32) -> Result<(), TrainerError> {
        let mut flat = self.flat()?;
        if values.len() != flat.len() {
            tracing::warn!(
                got = values.len(),
                expected = flat.len(),
                "update of the wrong size dropped"
            );
            return Ok(());
        }
        for (p, v) in flat.iter_mut().zip(values) {
            *p += weight * v;
        }
        if let Err(e) = self.s.model.params().write_back(&flat) {
            tracing::warn!("update not applied: {e}");
            return Ok(());
        }
        self.own.added(values, weight);
        // A negative weight is this node's own sent change given back (mean mixing), not a
        // neighbour's update.
        if weight > 0.0 {
            self.stats.updates_applied += 1;
        }
        Ok(())
    }

    /// Averages with a neighbour's parameters if they pass [`sync_guard::judge`] against
    /// `bound`: the outcome carries the relative distance measured before averaging, or why
    /// they were refused (nothing is changed then).
    pub(super) fn average(
        &mut self,
        theirs: &[f32],
        bound: f64,
    ) -> Result<AverageOutcome, TrainerError> {
        let mine = self.flat()?;
        let distance = match sync_guard::judge(&mine, theirs, bound) {
            Ok(d) => d,
            Err(refusal) => return Ok(AverageOutcome::Refused(refusal)),
        };
        let merged = replica::averaged(&mine, theirs);
        self.s.model.params().write_back(&merged)?;
        self.own.moved(&mine, &merged);
        Ok(AverageOutcome::Averaged(distance))
    }

    /// Takes a round's mean (an empty one keeps the parameters): as it is, or, with an outer
    /// optimizer (DiLoCo), by a Nesterov step along `round start - mean` from the round's
    /// start. A DiLoCo mean may carry the members' round start and outer velocity after the
    /// parameters (a member needed them): the step starts from them instead of this node's.
    /// Answers the parameters' digest, so members can show they hold the same bits.
    ///
    /// The mean is judged first ([`sync_guard::judge_round_mean`]; by distance when `judged`,
    /// this member holding the mesh's parameters): one a hostile member spoiled is refused
    /// and changes nothing, where a huge one made every member diverge and exit.
    ///
    /// Where the trainer `ran_on` past the parameters it gave the round (`sync.overlap_steps`),
    /// the mean is judged against those, and what it trained since is added to the round's
    /// result: the members share the result (the round start of the next round, and the
    /// digest), each keeps its own few steps on top.
    pub(super) fn combine(
        &mut self,
        mean: &[f32],
        judged: bool,
        ran_on: bool,
    ) -> Result<String, TrainerError> {
        let given = self.given.take();
        if mean.is_empty() {
            self.reset_round_anchor()?;
            return Ok(p2ptrain_models::params::params_digest(&self.flat()?));
        }
        let numel = self.s.model.params().numel();
        let state = if self.s.rounds_carry_state {
            self.s.optimizer.state_len()
        } else if self.s.outer.is_some() && mean.len() == 3 * numel {
            2 * numel
        } else {
            0
        };
        if mean.len() != numel + state {
            let expected = if self.s.rounds_carry_state {
                format!("{numel} parameters and {state} values of optimizer state")
            } else if self.s.outer.is_some() {
                format!(
                    "{numel} parameters, or {} with the round start and outer velocity",
                    3 * numel
                )
            } else {
                format!("{numel} parameters")
            };
            return Err(TrainerError::Refused(format!(
                "a round's mean of {} values, not {expected}",
                mean.len()
            )));
        }
        // Checked whole before anything is written: a bad mean changes nothing.
        if let Some(i) = mean.iter().position(|v| !v.is_finite()) {
            return Err(TrainerError::Refused(format!(
                "a round's mean with {} at index {i}",
                mean[i]
            )));
        }
        let (mean, mean_state) = mean.split_at(numel);
        let own = self.flat()?;
        let given = given.filter(|g| ran_on && g.len() == numel);
        let before_round = given.as_deref().unwrap_or(&own);
        let bound = judged.then_some(sync_guard::ROUND_MEAN_MAX_DISTANCE);
        sync_guard::judge_round_mean(before_round, mean, bound).map_err(TrainerError::Refused)?;
        // What the round leaves is worked out on copies and judged before anything is
        // written: a carried anchor, velocity or optimizer state could spoil it otherwise.
        let (next, velocity) = match self.s.outer {
            None => (mean.to_vec(), None),
            Some(outer) => {
                let (anchor, mut velocity) = if state > 0 {
                    let (anchor, velocity) = mean_state.split_at(numel);
                    (anchor, velocity.to_vec())
                } else if self.outer_velocity.len() == numel {
                    (self.round_anchor.as_slice(), self.outer_velocity.clone())
                } else {
                    (self.round_anchor.as_slice(), vec![0.0; numel])
                };
                let next = outer.step(anchor, mean, &mut velocity);
                // A carried anchor or velocity shows in the step's result: judged by norm, as
                // the outer momentum takes an honest step several times the mean's distance.
                if state > 0 {
                    sync_guard::judge_round_mean(before_round, &next, None)
                        .map_err(TrainerError::Refused)?;
                }
                (next, Some(velocity))
            }
        };
        let carried_optimizer = state > 0 && self.s.outer.is_none();
        if carried_optimizer {
            let own_state = self.s.optimizer.flatten_state()?;
            sync_guard::judge_carried_state(&own, &own_state, mean_state)
                .map_err(TrainerError::Refused)?;
        }
        // The steps trained since the parameters were given, on top of the round's result.
        let written = match &given {
            Some(given) => replica::steps_kept_onto(&next, given, &own),
            None => next.clone(),
        };
        // The parameters first: if they cannot be written, nothing else is.
        self.s.model.params().write_back(&written)?;
        if carried_optimizer {
            self.s.optimizer.write_state(mean_state)?;
        }
        if let Some(velocity) = velocity {
            self.outer_velocity = velocity;
        }
        self.stats.param_norm = l2_norm(&written);
        let digest = p2ptrain_models::params::params_digest(&next);
        if self.s.outer.is_some() {
            self.round_anchor = next;
        }
        Ok(digest)
    }

    /// A `ddp` round: the next batch's gradient at the current parameters, kept for the step
    /// and handed to the mesh. A non-finite loss or gradient is this node's divergence, never
    /// sent to the ring.
    ///
    /// (Computing the next batch's gradient while the round runs, and stepping with gradients
    /// one step old, was tried: on the GPT it stalled training at the unigram plateau where
    /// the same seed without the delay went on. So the step waits for its own round.)
    ///
    /// `batch` is the samples the mesh asks for (a `ddp` member slower than the others takes
    /// fewer, see `rounds::balanced_batch`); never more than the configured batch, never none.
    pub(super) fn take_gradient(&mut self, batch: usize) -> Result<(), TrainerError> {
        // Held since the last round: the wait for the ring ends with this step's work.
        self.released();
        let mut next = self.compute_gradient(batch.clamp(1, self.s.batch_size.max(1)))?;
        let values = std::mem::take(&mut next.values);
        let samples = next.samples;
        self.pending = Some(next);
        self.tell(TrainerEvent::Gradient {
            step: self.counters.step,
            values,
            samples,
        });
        Ok(())
    }

    /// The next batch's loss and gradient at the current parameters.
    pub(super) fn compute_gradient(&mut self, batch: usize) -> Result<PendingStep, TrainerError> {
        let started = Instant::now();
        let indices = self.sampler.next_batch(batch);
        let (xs, ys) = self.s.data.train().batch(&indices, &self.s.device)?;
        let step = self.counters.step;
        let span = timeline::span(Lane::Trainer, "forward_backward").at_step(step + 1);
        let (loss, grads) = forward_backward(&self.s.model, &xs, &ys)?;
        let loss = loss_value(&loss)?;
        let values = self.s.model.params().flatten_grads(&grads)?;
        self.throttle(indices.len());
        drop(span);
        self.note_speed(started.elapsed(), indices.len());
        if !loss.is_finite() || values.iter().any(|v| !v.is_finite()) {
            return Err(TrainerError::Diverged { step, loss });
        }
        Ok(PendingStep {
            loss,
            grads,
            samples: indices.len(),
            norm: l2_norm(&values),
            values,
        })
    }

    /// A `ddp` round's mean gradient: the optimizer steps with it from the kept gradient's
    /// batch (with the own gradient when `mean` is empty: no member of the ring was synced).
    /// Without a kept gradient (this node gave parameters, with weight 0, as one not yet
    /// synced) nothing changes. Answers the parameters' digest, or why the mean was refused.
    pub(super) fn step_with_mean_gradient(
        &mut self,
        round: u64,
        mean: &[f32],
    ) -> Result<Result<String, String>, TrainerError> {
        if let Some(mut p) = self.pending.take() {
            // Every kept gradient counts toward the scale, an empty mean's too.
            let scale = self.gradient_scale.with(p.norm);
            if !mean.is_empty() {
                if let Err(why) = sync_guard::judge_mean_gradient(scale, mean) {
                    return Ok(Err(why));
                }
                if let Err(e) = self.s.model.params().replace_grads(&mut p.grads, mean) {
                    return Ok(Err(format!("a round's mean gradient refused: {e}")));
                }
            }
            let span = timeline::span(Lane::Trainer, "optimizer").at_step(self.counters.step + 1);
            self.s.optimizer.step(self.s.model.params(), &p.grads)?;
            drop(span);
            self.after_step(p.loss, p.samples)?;
        }
        // Reading every parameter costs a few milliseconds a step: the digest (and the norm
        // status shows) only every `DIGEST_EVERY` rounds; an empty digest says none.
        if !round.is_multiple_of(crate::mesh_core::rounds::DIGEST_EVERY) {
            return Ok(Ok(String::new()));
        }
        let flat = self.flat()?;
        self.stats.param_norm = l2_norm(&flat);
        Ok(Ok(p2ptrain_models::params::params_digest(&flat)))
    }

    /// Takes the members' step with their parameters (this node was not synced): its step
    /// count and its optimizer's move forward by the same amount, so evaluations, checkpoints
    /// and the learning-rate schedule fall where the members' do. Never backwards, and never
    /// to a step no run reaches.
    pub(super) fn take_mesh_step(&mut self, step: u64) {
        if step > self.counters.step && step < super::state::COUNTER_LIMIT {
            let ahead = step - self.counters.step;
            tracing::info!(
                from = self.counters.step,
                to = step,
                "took the members' step with their parameters"
            );
            self.s.optimizer.skip_steps(ahead);
            self.counters.step = step;
            self.last_checkpoint_step = step;
            self.publish();
        }
    }

    /// Appends the round's start and the outer velocity (zeros before the first outer step)
    /// to `values`, the parameters: a DiLoCo member's contribution to a round, of which the
    /// ring carries the state only when a member needs it.
    pub(super) fn extend_with_outer_state(&self, values: &mut Vec<f32>) {
        let numel = self.s.model.params().numel();
        if self.round_anchor.len() == numel {
            values.extend_from_slice(&self.round_anchor);
        } else {
            values.extend_from_within(..numel);
        }
        if self.outer_velocity.len() == numel {
            values.extend_from_slice(&self.outer_velocity);
        } else {
            values.resize(3 * numel, 0.0);
        }
    }

    /// With an outer optimizer, takes the current parameters as the start of the round
    /// (DiLoCo's pseudo-gradient is measured from it); without one, keeps no copy.
    pub(super) fn reset_round_anchor(&mut self) -> Result<(), TrainerError> {
        if self.s.outer.is_some() {
            self.round_anchor = self.flat()?;
        }
        Ok(())
    }

    /// ‖own change since the last delta‖ / ‖parameters‖, for the policy's early-publish rule;
    /// measured only when that rule is on (it costs a copy of the parameters).
    pub(super) fn pending_ratio(&self) -> Result<f64, TrainerError> {
        if !self.s.measure_pending_ratio || !self.own.is_set_for(self.s.model.params().numel()) {
            return Ok(0.0);
        }
        Ok(self.own.ratio(&self.flat()?))
    }

    /// Hands the mesh this node's own change since the last delta (neighbours' updates and
    /// syncs excluded, so nothing echoes back through the mesh).
    pub(super) fn take_delta(&mut self) -> Result<(), TrainerError> {
        let now = self.flat()?;
        self.stats.param_norm = l2_norm(&now);
        let Some(delta) = self.own.delta(&now) else {
            self.own.reset(&now);
            return Ok(());
        };
        let step = self.counters.step;
        let sent = self.events_tx.try_send(TrainerEvent::Delta {
            base_step: self.last_delta_step,
            step,
            delta,
        });
        if sent.is_ok() {
            self.own.reset(&now);
            self.stats.updates_published += 1;
            self.last_delta_step = step;
        }
        Ok(())
    }
}
