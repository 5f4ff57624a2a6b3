//! The arithmetic a replica does with the mesh on its flat parameters, free of tensors and IO:
//! keeping its own change since the last published delta apart from what came from elsewhere
//! (so nothing echoes back through the mesh), averaging with a neighbour, and DiLoCo's outer
//! step. The trainer runs it on its model's parameters; the mesh core's simulator runs the
//! very same code on its simulated nodes.

/// This replica's own change since its last delta. `anchor` holds the parameters when the
/// last delta was taken, `foreign` what neighbours' updates and syncs added since; the own
/// change is `now - anchor - foreign`. Empty (unset) until [`OwnChange::reset`], and kept
/// empty by a node that never publishes.
#[derive(Debug, Clone, Default)]
pub struct OwnChange {
    anchor: Vec<f32>,
    foreign: Vec<f32>,
}

impl OwnChange {
    /// Takes `now` as the base of the next delta, with nothing foreign yet.
    pub fn reset(&mut self, now: &[f32]) {
        self.anchor = now.to_vec();
        self.foreign = vec![0.0; now.len()];
    }

    /// Forgets the base: no delta can be taken until the next reset.
    pub fn clear(&mut self) {
        self.anchor.clear();
        self.foreign.clear();
    }

    /// Whether a base of `numel` parameters is set.
    pub fn is_set_for(&self, numel: usize) -> bool {
        !self.anchor.is_empty() && self.anchor.len() == numel
    }

    /// A neighbour's update of `weight * values` was added to the parameters.
    pub fn added(&mut self, values: &[f32], weight: f32) {
        if self.foreign.len() == values.len() {
            for (f, v) in self.foreign.iter_mut().zip(values) {
                *f += weight * v;
            }
        }
    }

    /// The parameters moved from `before` to `after` for a reason not this replica's own
    /// (an average with a neighbour).
    pub fn moved(&mut self, before: &[f32], after: &[f32]) {
        if self.foreign.len() == after.len() {
            for ((f, a), b) in self.foreign.iter_mut().zip(after).zip(before) {
                *f += a - b;
            }
        }
    }

    /// The own change from the base to `now`; `None` when no base of that size is set.
    pub fn delta(&self, now: &[f32]) -> Option<Vec<f32>> {
        self.is_set_for(now.len()).then(|| {
            now.iter()
                .zip(&self.anchor)
                .zip(&self.foreign)
                .map(|((n, a), f)| n - a - f)
                .collect()
        })
    }

    /// ‖own change‖ / ‖now‖ (0 when no base is set).
    pub fn ratio(&self, now: &[f32]) -> f64 {
        if !self.is_set_for(now.len()) {
            return 0.0;
        }
        let (mut d, mut n) = (0.0f64, 0.0f64);
        for ((x, a), f) in now.iter().zip(&self.anchor).zip(&self.foreign) {
            d += f64::from(x - a - f).powi(2);
            n += f64::from(*x).powi(2);
        }
        d.sqrt() / n.sqrt().max(f64::MIN_POSITIVE)
    }
}

/// `mine` averaged with `theirs`, value by value (equal lengths).
pub fn averaged(mine: &[f32], theirs: &[f32]) -> Vec<f32> {
    mine.iter()
        .zip(theirs)
        .map(|(a, b)| 0.5 * (a + b))
        .collect()
}

/// `result` with the steps a replica took from `given` to `now` on top: a DiLoCo member
/// that trained on while its round ran (overlap) keeps those steps after the round's outer
/// step, which the members share (equal lengths).
pub fn steps_kept_onto(result: &[f32], given: &[f32], now: &[f32]) -> Vec<f32> {
    result
        .iter()
        .zip(given.iter().zip(now))
        .map(|(r, (g, n))| r + (n - g))
        .collect()
}

/// DiLoCo's outer optimizer: Nesterov SGD on the pseudo-gradient `start of round - mean`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterSgd {
    /// Outer learning rate (DiLoCo uses 0.7).
    pub lr: f32,
    /// Nesterov momentum (DiLoCo uses 0.9).
    pub momentum: f32,
}

impl OuterSgd {
    /// The outer step from the round's `start` along `start - mean`, with `velocity` (as long
    /// as `start`) carried from round to round.
    pub fn step(&self, start: &[f32], mean: &[f32], velocity: &mut [f32]) -> Vec<f32> {
        let mut next = Vec::with_capacity(start.len());
        for ((s, m), v) in start.iter().zip(mean).zip(velocity.iter_mut()) {
            let g = s - m;
            *v = self.momentum * *v + g;
            next.push(s - self.lr * (g + self.momentum * *v));
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_change_leaves_out_what_came_from_elsewhere() {
        let mut c = OwnChange::default();
        assert_eq!(c.delta(&[1.0, 1.0]), None, "no base yet");
        c.reset(&[1.0, 1.0]);
        // Own steps moved the parameters by +1, a neighbour's update by 0.5 * [2, 0].
        c.added(&[2.0, 0.0], 0.5);
        assert_eq!(c.delta(&[3.0, 2.0]), Some(vec![1.0, 1.0]));
        // An average moved them from [3, 2] to [2, 2]: still not own.
        c.moved(&[3.0, 2.0], &[2.0, 2.0]);
        assert_eq!(c.delta(&[2.0, 2.0]), Some(vec![1.0, 1.0]));
        assert_eq!(c.delta(&[2.0]), None, "another size");
        c.clear();
        assert_eq!(c.ratio(&[2.0, 2.0]), 0.0);
    }

    #[test]
    fn an_outer_step_without_momentum_moves_lr_of_the_way_to_the_mean() {
        let mut v = vec![0.0; 2];
        let outer = OuterSgd {
            lr: 0.5,
            momentum: 0.0,
        };
        let next = outer.step(&[1.0, 0.0], &[0.0, 2.0], &mut v);
        assert_eq!(next, vec![0.5, 1.0]);
        assert_eq!(averaged(&[1.0, 0.0], &[0.0, 2.0]), vec![0.5, 1.0]);
    }

    /// Nesterov momentum, by hand: the velocity sums the pseudo-gradients with decay
    /// `momentum`, the step looks one velocity ahead; a round whose mean did not move still
    /// steps on along the velocity; and a pseudo-gradient that stays the same round after round
    /// ends up stepped `1 / (1 - momentum)` times as far as without momentum (10x at 0.9).
    #[test]
    fn the_outer_step_carries_nesterov_momentum_from_round_to_round() {
        let outer = OuterSgd {
            lr: 0.7,
            momentum: 0.9,
        };
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
        let mut v = vec![0.0; 2];
        // Round 1: pseudo-gradient [1, -2]; v = g; step = lr * (g + 0.9 g).
        let next = outer.step(&[1.0, 0.0], &[0.0, 2.0], &mut v);
        assert!(close(&v, &[1.0, -2.0]), "{v:?}");
        assert!(
            close(&next, &[1.0 - 0.7 * 1.9, 0.7 * 2.0 * 1.9]),
            "{next:?}"
        );
        // Round 2: the same pseudo-gradient again; v = 0.9 v + g = 1.9 g.
        let start = next.clone();
        let mean: Vec<f32> = start.iter().zip([1.0, -2.0]).map(|(s, g)| s - g).collect();
        let next = outer.step(&start, &mean, &mut v);
        assert!(close(&v, &[1.9, -3.8]), "{v:?}");
        let want: Vec<f32> = start
            .iter()
            .zip([1.0f32, -2.0])
            .map(|(s, g)| s - 0.7 * (g + 0.9 * 1.9 * g))
            .collect();
        assert!(close(&next, &want), "{next:?} against {want:?}");
        // A round whose members did not move: the velocity alone steps, decayed.
        let still = outer.step(&next, &next, &mut v);
        assert!(close(&v, &[1.71, -3.42]), "{v:?}");
        let want: Vec<f32> = next
            .iter()
            .zip([1.71f32, -3.42])
            .map(|(s, v)| s - 0.7 * 0.9 * v)
            .collect();
        assert!(close(&still, &want), "{still:?} against {want:?}");
        // The same pseudo-gradient for many rounds: each step tends to lr * g / (1 - 0.9).
        let mut v = vec![0.0];
        let mut at = vec![0.0f32];
        let mut last = 0.0;
        for _ in 0..300 {
            let next = outer.step(&at, &[at[0] - 1.0], &mut v);
            last = at[0] - next[0];
            at = next;
        }
        assert!((last - 7.0).abs() < 1e-3, "{last}");
    }

    #[test]
    fn steps_taken_since_the_round_was_given_land_on_its_result() {
        // Given [1, 1] to the round, trained on to [0.5, 2]; the round left [3, 0].
        let kept = steps_kept_onto(&[3.0, 0.0], &[1.0, 1.0], &[0.5, 2.0]);
        assert_eq!(kept, vec![2.5, 1.0]);
        // No step since: the round's result as it is.
        assert_eq!(
            steps_kept_onto(&[3.0, 0.0], &[1.0, 1.0], &[1.0, 1.0]),
            vec![3.0, 0.0]
        );
    }
}
