//! Checks on neighbours' updates beyond "well-formed and finite": a per-author rate limit, a
//! robust norm bound (an update whose norm is far beyond the median of recently accepted ones
//! is an outlier), and the memory of which steps each author already delivered, which tells a
//! duplicate from an update that merely arrived late. Pure and clock-injected, like the sync
//! policy, so its rules are unit tested without a network.
//!
//! Why both: the mesh already bounds an update's norm by a multiple of the parameters' norm,
//! which stops a NaN-sized or exploding update but lets through one a hundred times larger
//! than any honest update (the parameters' norm is much larger than a 20-step delta). The
//! median of what honest neighbours actually send is the tighter, self-tuning bound. The rate
//! limit keeps a flooding peer from making the node decode and apply without end.
//!
//! The median is one no author can move alone: each author's updates are remembered in a
//! window of their own, at the norm they were applied at (scaled down where they were beyond
//! the bound), and the median is the median of the authors' medians, this node's own updates
//! one author among them. (Remembered unscaled in one window shared by every author, a
//! neighbour whose updates grew by 50 times the bound each time lifted the median thousands of
//! times within about 40 updates, after which its updates near the parameters' bound were
//! applied whole.)
//!
//! Under that bound an author still chooses its direction and its rate, and nothing in a
//! median stops a neighbour from pushing every update the same way at the bound's size: so
//! each author also has a budget, a credit of norm that this node's own updates refill
//! ([`BUDGET_PER_OWN`] times each own update's norm, up to [`BUDGET_CAP`] own medians); an
//! update beyond its author's credit is scaled down to it, unpunished (a faster honest box
//! merely counts for less while it outpaces this one). An author whose updates keep needing
//! the outlier bound ([`SCALED_IN_A_ROW`]) is refused from then on, an offence each: honest
//! updates come back under it within a few. (Without the budget, a neighbour that grew its
//! updates by 5% each, in one direction, 50 a second, took a digits model's held-out loss
//! from 0.06 to 1.7e10 within seconds: the damaged model's own updates grew, and with them
//! the bound.)

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hash::Hash;
use std::time::Instant;

/// Accepted update norms remembered per author for the median.
pub const NORM_WINDOW: usize = 64;
/// Authors whose norms are remembered at most (the one that recorded least recently goes
/// first): a bound on a public mesh.
pub const AUTHORS_KEPT: usize = 64;
/// Accepted updates needed before the outlier bound applies (before that, only the
/// parameter-norm bound does), every author's and this node's own counted.
pub const MIN_SAMPLES: usize = 16;
/// The most an update's age widens the outlier bound, as a multiple of the median span (the
/// steps an update usually covers). Two honest reasons make an update larger than the median
/// of recent ones: it covers more steps than usual (its box could not publish for a while, on
/// a saturated link or core), or it arrives late, computed when training was younger and
/// updates were larger (early in training norms shrink several-fold within seconds, while
/// gossip on a saturated link delivered updates seconds late). Both are measured in the
/// author's steps. A hostile claim of either gains at most this factor; the bound by the
/// parameters' norm (`sync.max_update_ratio`) still holds, and a late update is applied
/// with the sync policy's staleness discount.
pub const SPAN_LEEWAY: f64 = 8.0;
/// Beyond the outlier bound an update is scaled down to it and applied, unpunished: honest
/// norms spread wider than any fixed factor of the median (a joiner that downloaded a
/// seconds-old state sends early-training-sized updates to a mesh that has moved on; right
/// after a healed partition's syncs a node's own updates measured 20 to 40 times the median),
/// and the scaled update can do no more than an honest one. Only an update this many times
/// beyond the bound (1,000 times the median by default) is taken as proof of hostility and
/// rejected. Why so far: in the first seconds of a skewed mesh (the demo, one node at half
/// the CPU) every node's own updates burst at once to ~100 times the median its neighbours
/// had learned, decaying over ten updates as each re-fits its classes; at 10 times beyond the
/// bound three demo runs in six rejected an honest update (10.4, 12.5 and 13.6 times beyond;
/// CI saw 11.1), each one an offence against an honest peer.
pub const REJECT_BEYOND: f64 = 100.0;
/// Credit each of this node's own updates adds to every author's budget, in multiples of that
/// update's norm: an honest neighbour as fast as this node spends about one own update's norm
/// per own update, one four times as fast all of its credit.
pub const BUDGET_PER_OWN: f64 = 4.0;
/// The most credit an author may hold, in this node's own median update norms: a burst of
/// honest updates beyond the bound (a skewed mesh's first seconds, a healed partition) is
/// scaled by the bound before the budget, which holds a few dozen of them.
pub const BUDGET_CAP: f64 = 64.0;
/// Updates in a row an author may send beyond the outlier bound (each scaled down to it)
/// before each further one is refused as an offence. In a skewed mesh's first seconds every
/// node's updates were beyond it for about ten in a row.
pub const SCALED_IN_A_ROW: u32 = 32;

/// Settings; zero turns a check off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardConfig {
    /// Reject an update whose norm exceeds this times the median of recent accepted norms.
    pub outlier_factor: f64,
    /// Sustained updates per second accepted from one author.
    pub max_updates_per_sec: f64,
    /// Updates one author may send in a burst above that rate.
    pub burst: f64,
    /// Clamp every value of an accepted update to `[-clip_value, clip_value]`, so no single
    /// coordinate can move far in one update, whatever the norm.
    pub clip_value: f32,
}

/// Clamps `values` to `[-limit, limit]` (nothing if `limit` is 0); returns how many changed.
pub fn clip(values: &mut [f32], limit: f32) -> usize {
    if limit <= 0.0 {
        return 0;
    }
    let mut changed = 0;
    for v in values.iter_mut() {
        if v.abs() > limit {
            *v = v.clamp(-limit, limit);
            changed += 1;
        }
    }
    changed
}

/// Why an update was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The author sends faster than the limit.
    RateLimited,
    /// The author's last [`SCALED_IN_A_ROW`] updates were all beyond the outlier bound, and
    /// so is this one.
    KeepsBeyondBound {
        /// The update's norm.
        norm: f64,
        /// The bound it broke.
        bound: f64,
    },
    /// The norm is more than [`REJECT_BEYOND`] times the outlier bound.
    Outlier {
        /// The update's norm.
        norm: f64,
        /// The bound it broke.
        bound: f64,
        /// Steps the update covers.
        span: u64,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::RateLimited => write!(f, "update rate above the per-peer limit"),
            Refusal::KeepsBeyondBound { norm, bound } => write!(
                f,
                "update norm {norm:.3e} beyond the outlier bound {bound:.3e} after {SCALED_IN_A_ROW} updates in a row beyond it"
            ),
            Refusal::Outlier { norm, bound, span } => write!(
                f,
                "update norm {norm:.3e} over {span} steps is an outlier (beyond {bound:.3e}: {REJECT_BEYOND} x the bound, a multiple of the median of recent updates widened for long or late updates)"
            ),
        }
    }
}

/// A token bucket: `rate` tokens a second up to `burst`, one taken per message. The update
/// guard keeps one per author, and membership one per heartbeat author.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens at `now`.
    pub fn full(burst: f64, now: Instant) -> TokenBucket {
        TokenBucket {
            tokens: burst.max(1.0),
            at: now,
        }
    }

    /// When a token was last asked of it.
    pub fn last_taken(&self) -> Instant {
        self.at
    }

    /// Refills for the time since the last call, then takes a token if one is there.
    pub fn take(&mut self, rate: f64, burst: f64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(burst.max(1.0));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// One author's recently applied norms and spans, newest last.
#[derive(Debug, Clone, Default)]
struct Window {
    entries: VecDeque<(f64, u64)>,
    /// When it was last added to, in records made by the guard: the oldest goes first.
    last: u64,
}

impl Window {
    fn push(&mut self, norm: f64, span: u64, at: u64) {
        if self.entries.len() == NORM_WINDOW {
            self.entries.pop_front();
        }
        self.entries.push_back((norm, span));
        self.last = at;
    }

    fn median_norm(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.entries.iter().map(|(n, _)| *n).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }

    fn median_span(&self) -> Option<u64> {
        let mut v: Vec<u64> = self.entries.iter().map(|(_, s)| *s).collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    }
}

/// What one author may still move this node by, and how its recent updates fared.
#[derive(Debug, Clone, Copy, Default)]
struct Budget {
    /// Norm its next updates may be applied at, all together.
    credit: f64,
    /// Its updates in a row that were beyond the outlier bound.
    beyond_in_a_row: u32,
}

/// How an update is to be applied: scaled by `scale`, for the reasons given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Judgement {
    /// The factor to scale the update by (1 for most).
    pub scale: f64,
    /// Its norm scaled down to the outlier bound, not to the budget: what its author's
    /// window remembers ([`UpdateGuard::record`]), so a budget spent does not make the
    /// author's updates look small and the next ones outliers.
    pub bounded_norm: f64,
    /// It was beyond the outlier bound (scaled down to it).
    pub beyond_bound: bool,
    /// It was beyond its author's budget (scaled down to the credit left).
    pub beyond_budget: bool,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct UpdateGuard<K> {
    cfg: GuardConfig,
    /// Each author's recently applied norms and spans.
    authors: HashMap<K, Window>,
    /// This node's own updates' norms and spans, as its neighbours decode them.
    own: Window,
    /// Records made so far (the order of [`Window::last`]).
    records: u64,
    buckets: HashMap<K, TokenBucket>,
    /// Each author's budget, kept while its window is.
    budgets: HashMap<K, Budget>,
}

impl<K: Hash + Eq + Clone> UpdateGuard<K> {
    /// A guard that has seen nothing yet.
    pub fn new(cfg: GuardConfig) -> Self {
        UpdateGuard {
            cfg,
            authors: HashMap::new(),
            own: Window::default(),
            records: 0,
            buckets: HashMap::new(),
            budgets: HashMap::new(),
        }
    }

    /// Takes one token from the author's bucket: call before decoding, so a flood costs
    /// little.
    pub fn admit(&mut self, author: &K, now: Instant) -> Result<(), Refusal> {
        let rate = self.cfg.max_updates_per_sec;
        if rate <= 0.0 {
            return Ok(());
        }
        let burst = self.cfg.burst;
        let bucket = self
            .buckets
            .entry(author.clone())
            .or_insert_with(|| TokenBucket::full(burst, now));
        if bucket.take(rate, burst, now) {
            Ok(())
        } else {
            Err(Refusal::RateLimited)
        }
    }

    /// Judges a decoded update's norm against the recent median; answers the factor to
    /// scale it by (1 for most, less for one beyond the bound; see [`REJECT_BEYOND`]). `span`
    /// is the number of steps it covers (its header's step minus base step) and `lateness`
    /// how many steps it is behind its author's newest update; together, against the usual
    /// span, they widen the bound up to [`SPAN_LEEWAY`] times.
    pub fn judge_norm(&self, norm: f64, span: u64, lateness: u64) -> Result<f64, Refusal> {
        match (self.cfg.outlier_factor > 0.0, self.median()) {
            (true, Some(m)) if self.samples() >= MIN_SAMPLES && norm > 0.0 => {
                let usual = self.median_span().unwrap_or(1).max(1) as f64;
                let age = span.max(1).saturating_add(lateness) as f64;
                let leeway = (age / usual).clamp(1.0, SPAN_LEEWAY);
                let bound = self.cfg.outlier_factor * m * leeway;
                if norm > REJECT_BEYOND * bound {
                    Err(Refusal::Outlier {
                        norm,
                        bound: REJECT_BEYOND * bound,
                        span,
                    })
                } else {
                    Ok((bound / norm).min(1.0))
                }
            }
            _ => Ok(1.0),
        }
    }

    /// Judges a decoded update of `author`'s, to be applied if it passes: its norm against the
    /// outlier bound ([`UpdateGuard::judge_norm`]), then against the author's budget, which it
    /// spends; counts the updates in a row it sent beyond the bound and refuses one beyond it
    /// after [`SCALED_IN_A_ROW`].
    pub fn judge(
        &mut self,
        author: &K,
        norm: f64,
        span: u64,
        lateness: u64,
    ) -> Result<Judgement, Refusal> {
        let scale = self.judge_norm(norm, span, lateness)?;
        if self.cfg.outlier_factor <= 0.0 {
            return Ok(Judgement {
                scale,
                bounded_norm: norm * scale,
                beyond_bound: false,
                beyond_budget: false,
            });
        }
        let fresh = self.fresh_budget();
        let budget = self.budgets.entry(author.clone()).or_insert(fresh);
        let beyond_bound = scale < 1.0;
        if beyond_bound {
            budget.beyond_in_a_row = budget.beyond_in_a_row.saturating_add(1);
            if budget.beyond_in_a_row > SCALED_IN_A_ROW {
                return Err(Refusal::KeepsBeyondBound {
                    norm,
                    bound: norm * scale,
                });
            }
        } else {
            budget.beyond_in_a_row = 0;
        }
        let bounded_norm = norm * scale;
        if self.own.entries.is_empty() {
            // Nothing to measure a budget against before this node's first update of its
            // own (as the outlier bound waits for MIN_SAMPLES): the parameters' bound holds.
            return Ok(Judgement {
                scale,
                bounded_norm,
                beyond_bound,
                beyond_budget: false,
            });
        }
        let beyond_budget = bounded_norm > budget.credit;
        let applied = bounded_norm.min(budget.credit);
        budget.credit -= applied;
        Ok(Judgement {
            scale: if norm > 0.0 { applied / norm } else { 1.0 },
            bounded_norm,
            beyond_bound,
            beyond_budget,
        })
    }

    /// The credit a new author starts with: one own update's worth, as [`BUDGET_PER_OWN`]
    /// counts it (nothing before this node has made an update of its own).
    fn fresh_budget(&self) -> Budget {
        Budget {
            credit: self.own.median_norm().unwrap_or(0.0) * BUDGET_PER_OWN,
            beyond_in_a_row: 0,
        }
    }

    /// Remembers an accepted update of `author`'s: the norm it was applied at (scaled down
    /// where it was beyond the bound, so that an author's updates never stand for more than
    /// the bound they met) and its span.
    pub fn record(&mut self, author: &K, applied_norm: f64, span: u64) {
        if !applied_norm.is_finite() {
            return;
        }
        self.records += 1;
        if !self.authors.contains_key(author) && self.authors.len() >= AUTHORS_KEPT {
            let oldest = self
                .authors
                .iter()
                .min_by_key(|(_, w)| w.last)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.authors.remove(&oldest);
                self.budgets.remove(&oldest);
            }
        }
        let at = self.records;
        self.authors
            .entry(author.clone())
            .or_default()
            .push(applied_norm, span, at);
    }

    /// Remembers this node's own update's norm (as its neighbours decode it) and span: the
    /// one author among those the median is taken over that no neighbour can speak for.
    /// Each own update refills every author's budget by [`BUDGET_PER_OWN`] times its norm, up
    /// to [`BUDGET_CAP`] own medians.
    pub fn record_own(&mut self, norm: f64, span: u64) {
        if norm.is_finite() {
            self.records += 1;
            let at = self.records;
            self.own.push(norm, span, at);
            let cap = BUDGET_CAP * self.own.median_norm().unwrap_or(norm);
            for budget in self.budgets.values_mut() {
                budget.credit = (budget.credit + BUDGET_PER_OWN * norm).min(cap);
            }
        }
    }

    /// The windows the median is taken over: each author's and this node's own, where they
    /// hold anything.
    fn windows(&self) -> impl Iterator<Item = &Window> {
        self.authors
            .values()
            .chain(std::iter::once(&self.own))
            .filter(|w| !w.entries.is_empty())
    }

    fn samples(&self) -> usize {
        self.windows().map(|w| w.entries.len()).sum()
    }

    /// The median of the authors' median norms (the lower of the two middle ones), for the
    /// bound and for status: one author's updates, however many, are one word among the
    /// authors', this node's own among them.
    pub fn median(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.windows().filter_map(Window::median_norm).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len().saturating_sub(1) / 2).copied()
    }

    /// The median of the authors' median spans, as [`UpdateGuard::median`].
    fn median_span(&self) -> Option<u64> {
        let mut v: Vec<u64> = self.windows().filter_map(Window::median_span).collect();
        v.sort_unstable();
        v.get(v.len().saturating_sub(1) / 2).copied()
    }

    /// Forgets an author's bucket (it left).
    pub fn forget(&mut self, author: &K) {
        self.buckets.remove(author);
    }
}

/// Steps remembered per author to spot duplicates among late arrivals.
pub const SEEN_STEPS: usize = 64;

/// How an update's step relates to what its author already delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Newer than anything seen from this author.
    Fresh,
    /// Older than the newest seen but not seen before: gossip delivered it late (a message
    /// pulled through IHAVE/IWANT lands after the next one pushed eagerly). Honest, and still
    /// news: the sync policy discounts it by its staleness.
    Late,
    /// This exact step was delivered already (a replay, or a copy through another path).
    Duplicate,
    /// Older than every step still remembered: it cannot be told from a replay, so it is
    /// dropped, but without blaming anyone.
    TooOld,
}

/// The steps one author's updates carried recently; see [`Arrival`]. Gossipsub guarantees no
/// order, so order is never taken as proof of anything: only a repeated step is refused, and
/// that without penalty (the message id is the author's and the content's, so a copy from another path is
/// already filtered; what remains is a replay, which costs the mesh nothing to drop).
#[derive(Debug, Clone, Default)]
pub struct SeenSteps {
    steps: BTreeSet<u64>,
}

impl SeenSteps {
    /// Classifies `step` and remembers it when it is news.
    pub fn note(&mut self, step: u64) -> Arrival {
        let arrival = self.classify(step);
        if matches!(arrival, Arrival::Fresh | Arrival::Late) {
            self.remember(step);
        }
        arrival
    }

    /// How `step` relates to what was seen, without remembering it (an update may still be
    /// refused for other reasons).
    pub fn classify(&self, step: u64) -> Arrival {
        let newest = self.steps.last().copied();
        let oldest = self.steps.first().copied();
        match newest {
            None => Arrival::Fresh,
            Some(n) if step > n => Arrival::Fresh,
            _ if self.steps.contains(&step) => Arrival::Duplicate,
            // The window is full and the step is older than all of it: unknown territory.
            _ if self.steps.len() >= SEEN_STEPS && oldest.is_some_and(|o| step < o) => {
                Arrival::TooOld
            }
            _ => Arrival::Late,
        }
    }

    /// Remembers a step that was accepted.
    pub fn remember(&mut self, step: u64) {
        self.steps.insert(step);
        while self.steps.len() > SEEN_STEPS {
            self.steps.pop_first();
        }
    }

    /// The newest step seen, if any.
    pub fn newest(&self) -> Option<u64> {
        self.steps.last().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn cfg() -> GuardConfig {
        GuardConfig {
            outlier_factor: 10.0,
            max_updates_per_sec: 10.0,
            burst: 5.0,
            clip_value: 0.0,
        }
    }

    #[test]
    fn clipping_bounds_every_coordinate_and_counts_them() {
        let mut v = vec![0.5, -3.0, 2.0, -0.1, f32::MAX];
        assert_eq!(clip(&mut v, 1.0), 3);
        assert_eq!(v, vec![0.5, -1.0, 1.0, -0.1, 1.0]);
        let mut w = vec![5.0, -5.0];
        assert_eq!(clip(&mut w, 0.0), 0, "0 is off");
        assert_eq!(w, vec![5.0, -5.0]);
    }

    #[test]
    fn the_outlier_bound_waits_for_enough_samples_then_follows_the_median() {
        let mut g = UpdateGuard::<u8>::new(cfg());
        for _ in 0..MIN_SAMPLES - 1 {
            g.record(&1, 1.0, 20);
        }
        assert_eq!(
            g.judge_norm(1000.0, 20, 0),
            Ok(1.0),
            "too few samples to judge"
        );
        g.record(&1, 1.0, 20);
        assert_eq!(g.judge_norm(9.9, 20, 0), Ok(1.0));
        // Beyond the bound: scaled down to it, not refused...
        assert_eq!(g.judge_norm(20.0, 20, 0), Ok(0.5));
        assert_eq!(g.judge_norm(100.0, 20, 0), Ok(0.1));
        assert_eq!(g.judge_norm(1000.0, 20, 0), Ok(0.01));
        // ...until it is REJECT_BEYOND times beyond.
        assert!(matches!(
            g.judge_norm(10.0 * REJECT_BEYOND + 0.1, 20, 0),
            Err(Refusal::Outlier { .. })
        ));
        // Honest updates shrink as training converges: the bound follows.
        for _ in 0..NORM_WINDOW {
            g.record(&1, 0.1, 20);
        }
        assert_eq!(g.median(), Some(0.1));
        assert!(g.judge_norm(REJECT_BEYOND + 0.1, 20, 0).is_err());
        assert_eq!(g.judge_norm(0.9, 20, 0), Ok(1.0));
        assert!(g
            .judge_norm(2.0, 20, 0)
            .is_ok_and(|s| (s - 0.5).abs() < 1e-9));
    }

    #[test]
    fn an_update_covering_more_steps_or_arriving_late_gets_a_wider_bound_up_to_the_leeway() {
        let mut g = UpdateGuard::<u8>::new(cfg());
        for _ in 0..MIN_SAMPLES {
            g.record(&1, 1.0, 20);
        }
        // Three intervals' worth of steps that could not go out: three times the bound.
        assert_eq!(g.judge_norm(30.0, 60, 0), Ok(1.0));
        assert_eq!(g.judge_norm(60.0, 60, 0), Ok(0.5));
        assert!(g.judge_norm(30.0 * REJECT_BEYOND + 1.0, 60, 0).is_err());
        // A shorter span than usual does not tighten it; a huge claimed span gains at most
        // the leeway.
        assert_eq!(g.judge_norm(9.0, 1, 0), Ok(1.0));
        let widest = 10.0 * SPAN_LEEWAY;
        assert_eq!(g.judge_norm(widest, u64::MAX, 0), Ok(1.0));
        assert!(g
            .judge_norm(REJECT_BEYOND * widest + 1.0, u64::MAX, 0)
            .is_err());
        // An update 40 steps behind its author's newest, computed on a younger model.
        assert_eq!(g.judge_norm(30.0, 20, 40), Ok(1.0));
        assert!(g.judge_norm(30.0 * REJECT_BEYOND + 1.0, 20, 40).is_err());
        assert!(g
            .judge_norm(REJECT_BEYOND * widest + 1.0, 20, u64::MAX)
            .is_err());
    }

    #[test]
    fn a_few_large_accepted_norms_do_not_move_the_median() {
        let mut g = UpdateGuard::<u8>::new(cfg());
        for i in 0..40 {
            g.record(&1, if i % 10 == 0 { 9.0 } else { 1.0 }, 20);
        }
        assert_eq!(g.median(), Some(1.0));
        g.record(&1, f64::NAN, 20);
        assert_eq!(g.median(), Some(1.0));
    }

    /// One author's updates, however many, are one word in the median, this node's own
    /// updates another: a neighbour flooding tiny norms (so that an honest neighbour's
    /// updates are refused as outliers and it is blamed) or huge ones (to widen the bound)
    /// moves it no further than the honest authors' medians.
    #[test]
    fn one_author_is_one_word_in_the_median() {
        let mut g = UpdateGuard::<u8>::new(cfg());
        for _ in 0..20 {
            g.record_own(1.0, 20);
            g.record(&1, 2.0, 20);
        }
        for _ in 0..1000 {
            g.record(&9, 1e-9, 20);
        }
        assert_eq!(g.median(), Some(1.0));
        assert_eq!(g.judge_norm(2.0, 20, 0), Ok(1.0));
        for _ in 0..1000 {
            g.record(&9, 1e9, 20);
        }
        assert_eq!(g.median(), Some(2.0));
        assert!(g.judge_norm(1e5, 20, 0).is_err());
        // A bounded memory: the author that recorded least recently goes first.
        for k in 0..AUTHORS_KEPT as u8 + 10 {
            g.record(&(100 + k), 1.0, 20);
        }
        assert_eq!(g.authors.len(), AUTHORS_KEPT);
        assert!(!g.authors.contains_key(&1));
    }

    #[test]
    fn off_means_off() {
        let mut g = UpdateGuard::<u8>::new(GuardConfig {
            outlier_factor: 0.0,
            max_updates_per_sec: 0.0,
            burst: 0.0,
            clip_value: 0.0,
        });
        for _ in 0..100 {
            g.record(&1, 1.0, 20);
        }
        assert_eq!(g.judge_norm(1e9, 20, 0), Ok(1.0));
        let t = Instant::now();
        assert!((0..1000).all(|_| g.admit(&1, t).is_ok()));
    }

    #[test]
    fn the_rate_limit_allows_a_burst_then_the_sustained_rate_per_author() {
        let mut g = UpdateGuard::<u8>::new(cfg());
        let t = Instant::now();
        let admitted = (0..20).filter(|_| g.admit(&1, t).is_ok()).count();
        assert_eq!(admitted, 5, "the burst");
        // Another author has its own bucket.
        assert!(g.admit(&2, t).is_ok());
        // One second later: ten more.
        let t1 = t + Duration::from_secs(1);
        let admitted = (0..20).filter(|_| g.admit(&1, t1).is_ok()).count();
        assert_eq!(admitted, 5, "refilled up to the burst, not beyond");
        let t2 = t1 + Duration::from_millis(300);
        assert_eq!((0..20).filter(|_| g.admit(&1, t2).is_ok()).count(), 3);
        g.forget(&1);
        assert!(g.admit(&1, t2).is_ok());
    }

    #[test]
    fn late_updates_are_news_repeats_are_duplicates() {
        let mut seen = SeenSteps::default();
        assert_eq!(seen.note(40), Arrival::Fresh);
        assert_eq!(seen.note(60), Arrival::Fresh);
        // Pulled late through gossip: older than the newest, never seen.
        assert_eq!(seen.note(20), Arrival::Late);
        assert_eq!(seen.note(20), Arrival::Duplicate);
        assert_eq!(seen.note(60), Arrival::Duplicate);
        assert_eq!(seen.note(80), Arrival::Fresh);
        assert_eq!(seen.newest(), Some(80));
    }

    #[test]
    fn steps_older_than_the_window_are_too_old_not_late() {
        let mut seen = SeenSteps::default();
        for s in 1..=(SEEN_STEPS as u64 + 10) {
            assert_eq!(seen.note(s * 10), Arrival::Fresh);
        }
        // 10..100 fell out of the window: a replay of one of them cannot be recognised.
        assert_eq!(seen.note(50), Arrival::TooOld);
        assert_eq!(seen.note(5), Arrival::TooOld);
        // Inside the window, a gap is still a late arrival.
        assert_eq!(seen.note(205), Arrival::Late);
        assert_eq!(seen.note(210), Arrival::Duplicate);
    }
}
