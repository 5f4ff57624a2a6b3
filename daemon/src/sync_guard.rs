//! Judging a neighbour's full-sync reply before it is averaged into the model: it must fit the
//! layout, be finite, and lie within a bound of this node's own parameters. A round's mean
//! (of parameters or of gradients) is judged alike before a member takes it
//! ([`judge_round_mean`], [`judge_mean_gradient`]). Pure (no clock, no
//! network, no model), like the update guard, so its rules are unit tested on plain vectors.
//! It owns the window of recent accepted distances and the bound derived from it; it does
//! not own the averaging (the trainer) nor the punishment of a refused peer (the mesh and
//! [`crate::scoring`]).
//!
//! Why a distance bound: a full sync replaces half of the model with the neighbour's copy, so
//! a hostile neighbour that answers with scaled or random parameters would undo the mesh's
//! training at every sync. Honest replicas are close to each other (they start from the same
//! state and keep exchanging updates); the most divergent honest replica is one back from a
//! partition, and the floor below is chosen so that it still passes (see the constants).
//!
//! Distance: `d = |mine - theirs| / |mine|`, the relative L2 distance measured against this
//! node's own parameters, which a neighbour cannot inflate. Parameters scaled by `k` are at
//! `|k - 1|`; zeros are at 1; random parameters of any scale are at 1 or more.

use std::collections::VecDeque;

use p2ptrain_models::params::l2_norm;

/// Accepted sync distances remembered for the bound.
pub const DISTANCE_WINDOW: usize = 32;
/// The bound is this multiple of the largest recent accepted distance (then clamped).
pub const BOUND_FACTOR: f64 = 4.0;
/// The bound never falls below this fraction of the cap. Measured on the partition test (4
/// digits nodes split 2|2 for 30 s early in training, each half on its own data shard): while
/// the mesh was whole, replicas were 0.04-0.10 apart (0.01 in the 3-node test on shared data);
/// the first syncs after healing were at 0.46-0.48, and those healed halves, the most
/// divergent honest replicas, must pass, as must the half-way replicas their first syncs leave
/// behind. A bound derived from the whole mesh's syncs alone (4 x 0.1) refused the healed
/// halves and the mesh never reconverged; with a floor of 0.6 they passed with a margin of
/// only 1.24. A floor tied to the cap lets a user who expects longer partitions raise both.
pub const BOUND_FLOOR_SHARE: f64 = 0.8;
/// Default of `sync.max_sync_distance`, the cap on the bound (and the bound itself before any
/// sync was accepted). With it the floor is 0.68 (1.4 x the healed partition's 0.48), and the
/// cap stays well below the 1 of zeros, random parameters or a reply scaled by 2.
pub const DEFAULT_MAX_SYNC_DISTANCE: f64 = 0.85;

/// Why a sync reply was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum SyncRefusal {
    /// The reply names another layout or holds the wrong number of values.
    Layout(String),
    /// The reply holds NaN or infinite values.
    NotFinite,
    /// The reply is further from this node's parameters than the bound.
    TooFar {
        /// Its relative distance.
        distance: f64,
        /// The bound it broke.
        bound: f64,
    },
    /// The peer answered a parameter request with something else.
    WrongAnswer(String),
}

impl SyncRefusal {
    /// The distance, where one was measured.
    pub fn distance(&self) -> Option<f64> {
        match self {
            SyncRefusal::TooFar { distance, .. } => Some(*distance),
            _ => None,
        }
    }

    /// The bound it broke, where it broke one.
    pub fn bound(&self) -> Option<f64> {
        match self {
            SyncRefusal::TooFar { bound, .. } => Some(*bound),
            _ => None,
        }
    }
}

impl std::fmt::Display for SyncRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SyncRefusal::Layout(why) => write!(f, "parameters do not fit our layout: {why}"),
            SyncRefusal::NotFinite => write!(f, "parameters hold NaN or infinite values"),
            SyncRefusal::TooFar { distance, bound } => write!(
                f,
                "parameters at relative distance {distance:.4} from ours, beyond the bound {bound:.4}"
            ),
            SyncRefusal::WrongAnswer(what) => write!(f, "answered with {what}"),
        }
    }
}

/// A mean an unsynced round member takes (it has no parameters of the mesh's to measure a
/// distance from: a joiner's are freshly initialised) may have at most this many times the
/// norm of its own parameters. Trained and initial parameters of one model are within a
/// small factor of each other; a mean a hostile member made huge (1e30, so that every member
/// diverges at its next step and exits) is not.
pub const UNSYNCED_MEAN_NORM_FACTOR: f64 = 100.0;
/// A round's mean gradient may have at most this many times the norm of the member's
/// [`GradientScale`]. Honest ratios to the own gradient of the same step spread wide, since a
/// slow `ddp` member's small batch can have a gradient of almost nothing: up to 314 in the
/// modes and text tests (median 0.93, 99th percentile 17), and 1.5e4 once in `ring_rogue`,
/// which is why the scale is the largest of the last few. A poisoned or exploding mean is
/// beyond it by orders.
pub const MEAN_GRADIENT_NORM_FACTOR: f64 = 1e4;
/// Own gradient norms a [`GradientScale`] keeps (a few rounds' worth).
pub const GRADIENT_NORMS_KEPT: usize = 16;

/// The scale a member judges gradients by (others' parts and aggregates in a round, the
/// round's mean before the optimizer steps with it): the largest norm of its last
/// [`GRADIENT_NORMS_KEPT`] own gradients. Its own gradient now alone is no scale: a slow
/// member's small balanced batch of samples it already predicts well has a gradient of almost
/// nothing (3.4e-4 against an honest member's 5.0 in `ring_rogue`'s `ddp` test, 1.5e4 x, past
/// the bound), and by it an honest mean was refused.
#[derive(Debug, Clone, Default)]
pub struct GradientScale {
    kept: VecDeque<f64>,
}

impl GradientScale {
    /// Adds this member's own gradient norm of now and answers the scale (the largest kept).
    pub fn with(&mut self, norm: f64) -> f64 {
        if self.kept.len() == GRADIENT_NORMS_KEPT {
            self.kept.pop_front();
        }
        self.kept.push_back(norm);
        self.kept.iter().copied().fold(norm, f64::max)
    }
}
/// A synced member refuses a round's mean of parameters further than this from its own
/// (relative L2, as full syncs are judged). Honest means measured up to 0.56 in the modes
/// and text tests (median 0.0008, 99th percentile 0.06: `fedavg` and `diloco` on skewed
/// data drift most between rounds); parameters scaled by -1 are at 2, and a sum shifted by
/// 1e6 or a mean of 1e30 at many orders more. Above `sync.max_sync_distance` (under 1): a
/// round's mean is the members' together, a full sync's reply one neighbour's. A refusal
/// costs an honest member a retry, never a ban.
pub const ROUND_MEAN_MAX_DISTANCE: f64 = 2.0;

/// Judges a round's mean of parameters before the trainer takes it: finite, and for a synced
/// member (`bound`: [`ROUND_MEAN_MAX_DISTANCE`]) within the bound of its own parameters, as
/// a full sync's reply is judged; for an unsynced one, of a norm within
/// [`UNSYNCED_MEAN_NORM_FACTOR`] of its own. Answers why it is refused.
pub fn judge_round_mean(mine: &[f32], mean: &[f32], bound: Option<f64>) -> Result<(), String> {
    if let Some(i) = mean.iter().position(|v| !v.is_finite()) {
        return Err(format!("a round's mean with {} at index {i}", mean[i]));
    }
    match bound {
        Some(bound) => {
            let distance = relative_distance(mine, mean);
            tracing::debug!(distance, bound, "a round's mean judged");
            if distance <= bound {
                Ok(())
            } else {
                Err(format!(
                    "a round's mean at relative distance {distance:.4} from this member's parameters, beyond the bound {bound:.4}"
                ))
            }
        }
        None => {
            let (norm, own) = (l2_norm(mean), l2_norm(mine));
            if norm <= UNSYNCED_MEAN_NORM_FACTOR * own.max(f64::MIN_POSITIVE) {
                Ok(())
            } else {
                Err(format!(
                    "a round's mean of norm {norm:.3e}, beyond {UNSYNCED_MEAN_NORM_FACTOR} x this member's {own:.3e}"
                ))
            }
        }
    }
}

/// Judges optimizer state a round carries beside its mean (`ddp`: the members' moments, for
/// a joiner): at most [`UNSYNCED_MEAN_NORM_FACTOR`] times the norm of this member's own state
/// or, when that is smaller (a joiner's is zeros), of its parameters. (Finiteness is judged
/// with the mean.) A second moment made negative within that bound is not caught.
pub fn judge_carried_state(params: &[f32], own: &[f32], carried: &[f32]) -> Result<(), String> {
    let reference = l2_norm(own).max(l2_norm(params)).max(f64::MIN_POSITIVE);
    let norm = l2_norm(carried);
    if norm <= UNSYNCED_MEAN_NORM_FACTOR * reference {
        Ok(())
    } else {
        Err(format!(
            "optimizer state carried by a round of norm {norm:.3e}, beyond {UNSYNCED_MEAN_NORM_FACTOR} x this member's {reference:.3e}"
        ))
    }
}

/// Judges a round's mean gradient against the member's scale (`scale`, from its
/// [`GradientScale`]): finite, and at most [`MEAN_GRADIENT_NORM_FACTOR`] times as long.
/// Answers why it is refused.
pub fn judge_mean_gradient(scale: f64, mean: &[f32]) -> Result<(), String> {
    if let Some(i) = mean.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "a round's mean gradient with {} at index {i}",
            mean[i]
        ));
    }
    let norm = l2_norm(mean);
    if norm <= MEAN_GRADIENT_NORM_FACTOR * scale.max(f64::MIN_POSITIVE) {
        Ok(())
    } else {
        Err(format!(
            "a round's mean gradient of norm {norm:.3e}, beyond {MEAN_GRADIENT_NORM_FACTOR} x this member's gradient scale {scale:.3e}"
        ))
    }
}

/// `|mine - theirs| / |mine|` (see the module docs); both of the same length.
pub fn relative_distance(mine: &[f32], theirs: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (a, b) in mine.iter().zip(theirs) {
        diff += (f64::from(*a) - f64::from(*b)).powi(2);
        norm += f64::from(*a).powi(2);
    }
    diff.sqrt() / norm.sqrt().max(f64::MIN_POSITIVE)
}

/// Judges a reply against this node's parameters and a bound; answers its distance when it
/// may be averaged.
pub fn judge(mine: &[f32], theirs: &[f32], bound: f64) -> Result<f64, SyncRefusal> {
    if theirs.len() != mine.len() {
        return Err(SyncRefusal::Layout(format!(
            "{} values, the model has {}",
            theirs.len(),
            mine.len()
        )));
    }
    if theirs.iter().any(|v| !v.is_finite()) {
        return Err(SyncRefusal::NotFinite);
    }
    let distance = relative_distance(mine, theirs);
    // Written so that a NaN distance (it cannot be, with finite values, but cheaply) refuses.
    if distance <= bound {
        Ok(distance)
    } else {
        Err(SyncRefusal::TooFar { distance, bound })
    }
}

/// The bound on sync distances, from recent accepted ones; see the module docs.
#[derive(Debug, Clone)]
pub struct SyncGuard {
    cap: f64,
    recent: VecDeque<f64>,
    largest: Option<f64>,
}

impl SyncGuard {
    /// A guard with the configured cap (`sync.max_sync_distance`), that has accepted nothing.
    pub fn new(cap: f64) -> SyncGuard {
        SyncGuard {
            cap,
            recent: VecDeque::with_capacity(DISTANCE_WINDOW),
            largest: None,
        }
    }

    /// The bound a reply must meet now: `BOUND_FACTOR` x the largest recent accepted distance,
    /// clamped to `[BOUND_FLOOR_SHARE x cap, cap]`; the cap itself before any sync was accepted (a node
    /// restarted from an old checkpoint knows nothing about the mesh yet).
    pub fn bound(&self) -> f64 {
        let floor = BOUND_FLOOR_SHARE * self.cap;
        match self.recent.iter().copied().reduce(f64::max) {
            Some(m) => (BOUND_FACTOR * m).clamp(floor, self.cap),
            None => self.cap,
        }
    }

    /// Remembers the distance of a sync that was accepted and averaged.
    pub fn record(&mut self, distance: f64) {
        if !distance.is_finite() {
            return;
        }
        if self.recent.len() == DISTANCE_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(distance);
        self.largest = Some(self.largest.map_or(distance, |l| l.max(distance)));
    }

    /// The largest distance ever accepted, for status: what the cap must leave room for.
    pub fn largest_accepted(&self) -> Option<f64> {
        self.largest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn model(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-0.3f32..0.3)).collect()
    }

    /// The attacks on a round's mean: sums shifted by 1e6, a finite 1e30, NaN. A synced
    /// member refuses them by distance, an unsynced one by norm; an honest mean near its
    /// own parameters, or a joiner's first mean of trained parameters, passes.
    #[test]
    fn spoiled_round_means_are_refused_and_honest_ones_taken() {
        let mine = model(10_000, 1);
        let honest: Vec<f32> = mine.iter().map(|v| v * 1.01 + 0.001).collect();
        let shifted: Vec<f32> = mine.iter().map(|v| v + 1e6).collect();
        let huge = vec![1e30f32; mine.len()];
        let mut nan = honest.clone();
        nan[7] = f32::NAN;
        let bound = Some(ROUND_MEAN_MAX_DISTANCE);
        assert!(judge_round_mean(&mine, &honest, bound).is_ok());
        for spoiled in [&shifted, &huge, &nan] {
            assert!(judge_round_mean(&mine, spoiled, bound).is_err());
            assert!(judge_round_mean(&mine, spoiled, None).is_err());
        }
        // An unsynced joiner's fresh parameters against the mesh's trained ones: far in
        // distance, near in norm.
        let trained: Vec<f32> = model(10_000, 2).iter().map(|v| v * 4.0).collect();
        assert!(judge_round_mean(&mine, &trained, bound).is_err());
        assert!(judge_round_mean(&mine, &trained, None).is_ok());
        let why = judge_round_mean(&mine, &huge, None).expect_err("huge");
        assert!(why.contains("norm"), "{why}");
    }

    #[test]
    fn spoiled_carried_state_is_refused() {
        let params = model(1000, 5);
        let zeros = vec![0.0f32; 2000];
        let honest: Vec<f32> = model(2000, 6).iter().map(|v| v * 0.01).collect();
        assert!(judge_carried_state(&params, &zeros, &honest).is_ok());
        assert!(judge_carried_state(&params, &honest, &honest).is_ok());
        assert!(judge_carried_state(&params, &zeros, &vec![1e30; 2000]).is_err());
    }

    #[test]
    fn a_spoiled_mean_gradient_is_refused() {
        let own = model(1000, 3);
        let own_norm = l2_norm(&own);
        let mean: Vec<f32> = model(1000, 4);
        assert!(judge_mean_gradient(own_norm, &mean).is_ok());
        let shifted: Vec<f32> = mean.iter().map(|v| v + 1e6).collect();
        assert!(judge_mean_gradient(own_norm, &shifted).is_err());
        assert!(judge_mean_gradient(own_norm, &[f32::INFINITY; 1000]).is_err());
        assert!(judge_mean_gradient(own_norm, &vec![1e30; 1000]).is_err());
    }

    /// The scale is the largest of the last own gradients, so a tiny one now does not make an
    /// honest mean look huge; only the last [`GRADIENT_NORMS_KEPT`] count.
    #[test]
    fn a_tiny_own_gradient_does_not_shrink_the_scale() {
        let mut scale = GradientScale::default();
        assert_eq!(scale.with(5.0), 5.0);
        assert_eq!(scale.with(3.4e-4), 5.0);
        let honest_mean = vec![5.0f32 / 3.0; 9];
        assert!(judge_mean_gradient(scale.with(3.4e-4), &honest_mean).is_ok());
        assert!(judge_mean_gradient(3.4e-4, &honest_mean).is_err());
        for _ in 0..GRADIENT_NORMS_KEPT {
            scale.with(1.0);
        }
        assert_eq!(scale.with(0.5), 1.0, "5.0 is forgotten");
    }

    #[test]
    fn distance_is_relative_to_our_own_parameters() {
        let mine = vec![3.0, 4.0];
        assert_eq!(relative_distance(&mine, &mine), 0.0);
        assert!((relative_distance(&mine, &[0.0, 0.0]) - 1.0).abs() < 1e-12);
        // Scaled by k: |k - 1|, whatever the scale of the reply.
        assert!((relative_distance(&mine, &[6.0, 8.0]) - 1.0).abs() < 1e-12);
        assert!((relative_distance(&mine, &[30.0, 40.0]) - 9.0).abs() < 1e-12);
        assert!((relative_distance(&mine, &[-3.0, -4.0]) - 2.0).abs() < 1e-12);
    }

    #[test]
    fn scaled_random_and_broken_replies_are_refused_under_the_default_cap() {
        let mine = model(10_000, 1);
        let g = SyncGuard::new(DEFAULT_MAX_SYNC_DISTANCE);
        let bound = g.bound();
        for k in [2.0f32, 10.0, 0.0, -1.0] {
            let theirs: Vec<f32> = mine.iter().map(|v| v * k).collect();
            assert!(
                matches!(
                    judge(&mine, &theirs, bound),
                    Err(SyncRefusal::TooFar { .. })
                ),
                "scaled by {k}"
            );
        }
        // Random parameters of the same scale, or much smaller ones.
        for (seed, scale) in [(2u64, 1.0f32), (3, 0.01)] {
            let theirs: Vec<f32> = model(10_000, seed).iter().map(|v| v * scale).collect();
            let d = relative_distance(&mine, &theirs);
            assert!(d >= 0.99, "{d}");
            assert!(judge(&mine, &theirs, bound).is_err());
        }
        let mut nan = mine.clone();
        nan[17] = f32::NAN;
        assert_eq!(judge(&mine, &nan, bound), Err(SyncRefusal::NotFinite));
        let mut inf = mine.clone();
        inf[3] = f32::INFINITY;
        assert_eq!(judge(&mine, &inf, bound), Err(SyncRefusal::NotFinite));
        assert!(matches!(
            judge(&mine, &mine[1..], bound),
            Err(SyncRefusal::Layout(_))
        ));
    }

    #[test]
    fn an_honest_replica_passes() {
        let mine = model(10_000, 1);
        // 10% noise relative to each value: a replica further apart than any honest one seen.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let theirs: Vec<f32> = mine
            .iter()
            .map(|v| v * (1.0 + rng.random_range(-0.17f32..0.17)))
            .collect();
        let d = judge(
            &mine,
            &theirs,
            SyncGuard::new(DEFAULT_MAX_SYNC_DISTANCE).bound(),
        )
        .expect("an honest replica");
        assert!(d > 0.05 && d < 0.15, "{d}");
    }

    #[test]
    fn the_bound_follows_recent_syncs_between_the_floor_and_the_cap() {
        let mut g = SyncGuard::new(0.9);
        let floor = BOUND_FLOOR_SHARE * 0.9;
        assert_eq!(g.bound(), 0.9, "nothing accepted yet: the cap");
        g.record(0.01);
        assert_eq!(g.bound(), floor, "small distances: the floor");
        g.record(0.2);
        assert!((g.bound() - 0.8).abs() < 1e-12, "{}", g.bound());
        g.record(0.3);
        assert_eq!(g.bound(), 0.9, "large distances: the cap");
        // The large ones leave the window; the largest ever stays in status.
        for _ in 0..DISTANCE_WINDOW {
            g.record(0.02);
        }
        assert_eq!(g.bound(), floor);
        assert_eq!(g.largest_accepted(), Some(0.3));
        g.record(f64::NAN);
        assert_eq!(g.bound(), floor);
    }

    #[test]
    fn the_measured_healed_partition_passes_and_a_doubled_reply_does_not() {
        let mut g = SyncGuard::new(DEFAULT_MAX_SYNC_DISTANCE);
        // Whole-mesh syncs, then the first sync after healing (measured 0.46-0.48).
        for d in [0.04, 0.1, 0.06] {
            g.record(d);
        }
        assert!(g.bound() >= 1.4 * 0.484, "{}", g.bound());
        // A reply scaled by 2 (or zeros) is at 1.
        assert!(g.bound() < 0.9, "{}", g.bound());
    }

    #[test]
    fn a_lower_cap_lowers_the_floor_too() {
        let mut g = SyncGuard::new(0.1);
        g.record(0.001);
        assert!((g.bound() - 0.08).abs() < 1e-12, "{}", g.bound());
        assert!(judge(&[1.0, 1.0], &[1.0, 1.2], g.bound()).is_err());
        assert!(judge(&[1.0, 1.0], &[1.0, 1.1], g.bound()).is_ok());
    }
}
