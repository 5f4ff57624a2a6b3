//! The aggregate a chunk's owner makes of the members' parts of that chunk, robust to one bad
//! part among three or more: the weights bounded first (in `fedavg`, where weights are sample
//! counts that nothing proves, none counts for more than [`WEIGHT_SPREAD`] times the median),
//! then CenteredClip (Karimireddy, He and Jaggi, 2021; BTARD-SGD aggregates each part of a
//! butterfly all-reduce with it): from the coordinate-wise median, steps of the weighted mean
//! of each part's difference clipped to a radius of [`CLIP_SPREAD`] times the parts' median
//! distance. Where no part lies beyond that radius of the plain weighted mean, the mean is
//! CenteredClip's fixed point and is returned as is: an honest round's result is the plain
//! mean, bit for bit. Arithmetic only: [`super::Rounds`] decides whose parts count.

use p2ptrain_models::params::l2_norm;

/// In `fedavg`, no weight counts for more than this many times the (lower) median of the
/// members' positive weights: a member claiming a weight of 1e9 weighs 4 times the median
/// member, and honest members whose data differ in size by more than this lose some of their
/// say. (Elsewhere weights are bounded by what one member weighs, 1, and a `ddp` member's
/// smaller share is an honest one: they are left as they are.)
pub const WEIGHT_SPREAD: f32 = 4.0;
/// The clipping radius, in medians of the parts' distances from their coordinate-wise
/// median. A bad part moves the aggregate by at most this radius times its weight's share.
pub const CLIP_SPREAD: f64 = 4.0;
/// The clipping radius is never below this fraction of the parts' median's norm: `f32`
/// rounding, which the plain mean of equal parts differs from them by.
pub const ROUNDING: f64 = 1e-5;
/// CenteredClip steps taken when some part lies beyond the radius (each reads every part
/// once).
pub const CLIP_STEPS: usize = 4;

/// What the aggregate of one chunk is.
#[derive(Debug, Clone, PartialEq)]
pub struct Aggregate {
    /// The robust weighted mean of the parts (zeros where no part weighs anything).
    pub mean: Vec<f32>,
    /// The parts' bounded weights, summed.
    pub total: f32,
    /// Parts that lay beyond the clipping radius of the plain mean (0 in an honest round):
    /// then the mean is CenteredClip's, not the plain one.
    pub clipped: usize,
}

/// The aggregate of `parts` (values of one length, each with its weight; a weight that is not
/// a positive finite number counts for nothing); `bound_weights`: weights are claims nothing
/// proves (`fedavg`), bounded by [`WEIGHT_SPREAD`] times their median.
pub fn aggregate(parts: &[(&[f32], f32)], len: usize, bound_weights: bool) -> Aggregate {
    let weights = valid_weights(parts.iter().map(|(_, w)| *w), bound_weights);
    let counted: Vec<(&[f32], f64)> = parts
        .iter()
        .zip(&weights)
        .filter(|(_, w)| **w > 0.0)
        .map(|((v, _), w)| (*v, f64::from(*w)))
        .collect();
    let total: f64 = counted.iter().map(|(_, w)| w).sum();
    if counted.is_empty() || total <= 0.0 {
        return Aggregate {
            mean: vec![0.0; len],
            total: 0.0,
            clipped: 0,
        };
    }
    let plain = weighted_mean(&counted, len, total);
    if counted.len() <= 2 {
        // Two parts have no majority: nothing can tell the bad one.
        return Aggregate {
            mean: plain,
            total: total as f32,
            clipped: 0,
        };
    }
    let start = coordinate_median(&counted, len);
    let radius = clip_radius(&counted, &start);
    let clipped = counted
        .iter()
        .filter(|(v, _)| distance(v, &plain) > radius)
        .count();
    if clipped == 0 {
        return Aggregate {
            mean: plain,
            total: total as f32,
            clipped,
        };
    }
    let mut centre: Vec<f64> = start.iter().map(|v| f64::from(*v)).collect();
    let mut step = vec![0f64; len];
    for _ in 0..CLIP_STEPS {
        step.iter_mut().for_each(|s| *s = 0.0);
        for (v, w) in &counted {
            let d = v
                .iter()
                .zip(&centre)
                .map(|(x, c)| (f64::from(*x) - c).powi(2))
                .sum::<f64>()
                .sqrt();
            let keep = if d > radius { radius / d } else { 1.0 };
            let scale = w * keep / total;
            for ((s, x), c) in step.iter_mut().zip(v.iter()).zip(&centre) {
                *s += scale * (f64::from(*x) - c);
            }
        }
        centre.iter_mut().zip(&step).for_each(|(c, s)| *c += s);
    }
    Aggregate {
        mean: centre.iter().map(|v| *v as f32).collect(),
        total: total as f32,
        clipped,
    }
}

/// [`CLIP_SPREAD`] times the median of the parts' distances from `start`, their
/// coordinate-wise median; never below the rounding of a mean: parts that agree bit for bit
/// (a `ddp` ring's parameters) are no spread, and their plain mean is a rounding away.
fn clip_radius(parts: &[(&[f32], f64)], start: &[f32]) -> f64 {
    let mut distances: Vec<f64> = parts.iter().map(|(v, _)| distance(v, start)).collect();
    distances.sort_by(f64::total_cmp);
    (CLIP_SPREAD * median_of_sorted(&distances)).max(ROUNDING * l2_norm(start))
}

/// Each weight, or 0 where it is not a positive finite number; with `bound`, none above
/// [`WEIGHT_SPREAD`] times the lower median of the positive ones (of two, the smaller: one of
/// two members cannot outweigh the other fourfold).
fn valid_weights(weights: impl Iterator<Item = f32>, bound: bool) -> Vec<f32> {
    let weights: Vec<f32> = weights
        .map(|w| if w.is_finite() && w > 0.0 { w } else { 0.0 })
        .collect();
    let mut positive: Vec<f32> = weights.iter().copied().filter(|w| *w > 0.0).collect();
    if !bound || positive.is_empty() {
        return weights;
    }
    positive.sort_by(f32::total_cmp);
    let cap = WEIGHT_SPREAD * positive[(positive.len() - 1) / 2];
    weights.into_iter().map(|w| w.min(cap)).collect()
}

/// The weighted mean, summed in the parts' order (every member that computes it from the
/// same parts gets the same bits).
fn weighted_mean(parts: &[(&[f32], f64)], len: usize, total: f64) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for (v, w) in parts {
        let w = *w as f32;
        for (s, x) in sum.iter_mut().zip(v.iter()) {
            *s += w * x;
        }
    }
    let total = total as f32;
    sum.iter_mut().for_each(|s| *s /= total);
    sum
}

/// The median of each coordinate over the parts (the mean of the two middle values for an
/// even count).
fn coordinate_median(parts: &[(&[f32], f64)], len: usize) -> Vec<f32> {
    let mut column = vec![0f64; parts.len()];
    (0..len)
        .map(|k| {
            for (c, (v, _)) in column.iter_mut().zip(parts) {
                *c = f64::from(v[k]);
            }
            column.sort_unstable_by(f64::total_cmp);
            median_of_sorted(&column) as f32
        })
        .collect()
}

fn median_of_sorted(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The L2 distance of two vectors of one length, in `f64`.
pub(super) fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum::<f64>()
        .sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four honest parts: a base with small differences, as members' parameters after a round.
    fn honest(n: usize, len: usize) -> Vec<Vec<f32>> {
        (0..n)
            .map(|i| {
                (0..len)
                    .map(|j| (j as f32 * 0.37).sin() + 0.01 * ((i * 31 + j * 7) % 13) as f32)
                    .collect()
            })
            .collect()
    }

    fn plain(parts: &[Vec<f32>], weights: &[f32]) -> Vec<f32> {
        let total: f32 = weights.iter().sum();
        (0..parts[0].len())
            .map(|j| {
                parts
                    .iter()
                    .zip(weights)
                    .map(|(p, w)| w * p[j])
                    .sum::<f32>()
                    / total
            })
            .collect()
    }

    /// Equal parts (a `ddp` ring's parameters) are clipped nowhere: their plain mean, a
    /// rounding away from each, is taken.
    #[test]
    fn equal_parts_aggregate_to_their_plain_mean() {
        let part: Vec<f32> = (0..100).map(|j| (j as f32 * 0.37).sin() + 0.1).collect();
        let refs: Vec<(&[f32], f32)> = vec![(part.as_slice(), 1.0); 3];
        let got = aggregate(&refs, 100, true);
        assert_eq!(got.clipped, 0);
        assert_eq!(
            got.mean,
            plain(&[part.clone(), part.clone(), part], &[1.0; 3])
        );
    }

    #[test]
    fn honest_parts_aggregate_to_their_plain_weighted_mean_bit_for_bit() {
        for n in [1, 2, 3, 4, 7] {
            let parts = honest(n, 257);
            let weights: Vec<f32> = (0..n).map(|i| 1.0 + (i % 2) as f32).collect();
            let refs: Vec<(&[f32], f32)> = parts
                .iter()
                .zip(&weights)
                .map(|(p, w)| (p.as_slice(), *w))
                .collect();
            let got = aggregate(&refs, 257, true);
            assert_eq!(got.clipped, 0, "n = {n}");
            assert_eq!(got.total, weights.iter().sum::<f32>());
            let want = plain(&parts, &weights);
            assert_eq!(got.mean, want, "n = {n}");
        }
    }

    /// One bad part among three or more (shifted by 1e6, or a mean of 1e30 each) moves the
    /// aggregate from the honest parts' mean by about what CenteredClip's fixed point allows:
    /// the clipping radius over the honest parts' count (the clipped part pulls with the
    /// radius, the honest ones pull back with their distances).
    #[test]
    fn one_bad_part_among_three_or_more_moves_the_aggregate_by_a_bounded_amount() {
        for n in [3, 4, 7] {
            for bad in [1e6f32, -1e6, 1e30] {
                let mut parts = honest(n, 100);
                let honest_mean = plain(&parts[1..], &vec![1.0; n - 1]);
                parts[0].iter_mut().for_each(|v| *v += bad);
                let refs: Vec<(&[f32], f32)> = parts.iter().map(|p| (p.as_slice(), 1.0)).collect();
                let counted: Vec<(&[f32], f64)> = refs.iter().map(|(v, _)| (*v, 1.0)).collect();
                let radius = clip_radius(&counted, &coordinate_median(&counted, 100));
                let got = aggregate(&refs, 100, true);
                assert!(got.clipped >= 1, "n = {n}, {bad}");
                let moved = distance(&got.mean, &honest_mean);
                let fixed_point = radius / (n - 1) as f64;
                assert!(
                    moved <= 1.05 * fixed_point,
                    "n = {n}, {bad}: moved {moved}, the fixed point's {fixed_point}"
                );
            }
        }
    }

    /// A claimed weight of 1e9 among honest weights of ~600 counts as [`WEIGHT_SPREAD`] times
    /// the lower median (in a ring of two, the other's), where weights are bounded at all;
    /// weights that are not positive finite numbers count for nothing.
    #[test]
    fn weights_are_bounded_by_a_multiple_of_the_median() {
        let bounded = valid_weights([600.0, 700.0, 1e9, 650.0].into_iter(), true);
        assert_eq!(bounded, vec![600.0, 700.0, 4.0 * 650.0, 650.0]);
        let two = valid_weights([600.0, 1e9].into_iter(), true);
        assert_eq!(two, vec![600.0, 2400.0]);
        let left = valid_weights([600.0, 1e9].into_iter(), false);
        assert_eq!(left, vec![600.0, 1e9]);
        let odd = valid_weights([1.0, f32::NAN, -3.0, f32::INFINITY, 0.0].into_iter(), true);
        assert_eq!(odd, vec![1.0, 0.0, 0.0, 0.0, 0.0]);
        let none = aggregate(&[(&[1.0, 2.0][..], 0.0), (&[3.0, 4.0][..], 0.0)], 2, true);
        assert_eq!((none.mean, none.total), (vec![0.0, 0.0], 0.0));
    }
}
