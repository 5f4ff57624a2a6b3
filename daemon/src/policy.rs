//! Neighbour-sync policy: when to publish, how much to trust what arrives, when to
//! fully sync, and when to wait for slow neighbours.
//!
//! The policy is a pure state machine, one part of the mesh core ([`crate::mesh_core`]),
//! which feeds it [`PolicyEvent`]s together with the current [`Instant`] and turns the
//! returned [`Action`]s into outputs. It owns no sockets, threads or clocks, so every rule is
//! unit tested here with a fake clock, and the core's seeded simulator runs it inside 64
//! simulated nodes exactly as the daemon does.
//!
//! The rules, in short:
//!
//! * **Publish** the accumulated local update every `publish_every` steps, or earlier
//!   when it has grown large relative to the parameters.
//! * **Weight** an arriving update by `1 / (live neighbours + 1)` times a staleness
//!   discount `1 / (1 + τ / stale_after)`, and drop it once `τ > drop_after`. τ is how
//!   many of the sender's own steps the update is behind the sender's latest known
//!   progress (heartbeats and newer updates), so a late or reordered update counts as
//!   stale, but a slower box's fresh update does not.
//! * **Full sync** with one neighbour every `full_sync_every` steps, least recently
//!   synced first, at most one in flight. Full syncs are what pull drifting replicas
//!   back together; published updates only spread progress.
//! * **Stale-synchronous parallel (SSP)**: with a staleness bound `s`, hold local steps
//!   while this node is `s` or more steps ahead of its slowest live neighbour whose step
//!   it knows. Neighbours that fall silent for `peer_timeout` stop counting, so a dead
//!   box cannot stall the mesh; nor do neighbours whose step has not advanced for
//!   `peer_timeout`, so a peer that claims step 0 forever (or a frozen one that still
//!   answers) cannot either. A claimed step never moves backwards: an update's header
//!   that contradicts a lower heartbeat raises the known step.
//!
//! Nothing in here panics, whatever the events and instants it is given.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::{Duration, Instant};

/// Tuning of the sync policy, kept apart from the policy state so the daemon's config
/// file and the core's simulator can build it the same way.
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    /// Publish the accumulated local update every this many local steps (H), so that
    /// neighbours see progress often enough without flooding the network; 0 disables
    /// publishing entirely (the early rule included).
    pub publish_every: u64,
    /// Publish before H steps once ‖pending update‖ / ‖params‖ exceeds this, because a
    /// large update held back makes neighbours drift apart for longer; 0.0 disables it.
    pub publish_early_ratio: f64,
    /// Local steps between full neighbour syncs: published updates alone do not bring
    /// replicas together, so a periodic parameter exchange bounds their drift; 0 never.
    pub full_sync_every: u64,
    /// SSP bound `s`: when set, a node stops stepping while it is `s` or more steps ahead
    /// of its slowest live neighbour, so no model trains on a view more than `s` steps
    /// out of date. `Some(0)` is treated as `Some(1)`: with 0, neighbours at the same
    /// step would each wait for the other forever.
    pub staleness_bound: Option<u64>,
    /// A neighbour not heard from for this long no longer counts for SSP, for update
    /// weights or for full sync, so a dead or partitioned box cannot stall the mesh.
    pub peer_timeout: Duration,
    /// Staleness scale: an update τ of the sender's steps behind the sender's latest
    /// known progress is weighted by `1 / (1 + τ / stale_after)`, because old changes
    /// point at where the model used to be; 0 disables the discount.
    pub stale_after: u64,
    /// Updates more than this many steps stale are dropped instead of applied, because
    /// past some age they do more harm than good; `None` keeps every update.
    pub drop_after: Option<u64>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            publish_every: 20,
            publish_early_ratio: 0.0,
            full_sync_every: 500,
            staleness_bound: None,
            peer_timeout: Duration::from_secs(6),
            stale_after: 100,
            drop_after: None,
        }
    }
}

/// Something that happened to the node; the only way the policy learns about the world,
/// which keeps it free of I/O and clocks.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyEvent<P> {
    /// The node finished a local step; drives publishing, full syncs and SSP holds.
    Stepped {
        /// The step just finished (the node's new step count).
        step: u64,
        /// ‖pending own update‖ / ‖params‖ for the early-publish rule; 0.0 if unmeasured.
        pending_ratio: f64,
    },
    /// The caller handed the pending update to the network after [`Action::Publish`];
    /// without it the policy keeps asking, so a failed publish is retried.
    Published {
        /// The step at which the update was published.
        step: u64,
    },
    /// A neighbour joined this node's neighbour set; it counts as heard from now.
    NeighbourUp {
        /// The new neighbour.
        peer: P,
    },
    /// A neighbour left the set; it stops counting immediately, which may release a hold.
    NeighbourDown {
        /// The neighbour that left.
        peer: P,
    },
    /// Progress news about a neighbour (heartbeat or an update header); keeps it live
    /// and feeds SSP. News about peers outside the neighbour set is ignored.
    Heard {
        /// Who the news is about.
        peer: P,
        /// The step that peer has reached.
        step: u64,
    },
    /// A validated update arrived; the policy answers with [`Action::Apply`] or
    /// [`Action::Drop`]. Also counts as [`PolicyEvent::Heard`].
    UpdateArrived {
        /// The sender.
        peer: P,
        /// The sender's step when it published the update.
        step: u64,
    },
    /// A full sync the policy asked for ended; the caller must always report this
    /// (successful or not), since no new full sync starts while one is in flight.
    SyncFinished {
        /// The peer that was synced with.
        peer: P,
        /// Whether the sync succeeded; a failure makes the policy retry with another peer.
        ok: bool,
    },
    /// Time passed; lets the policy notice silent neighbours and release holds even
    /// when nothing else happens.
    Tick,
}

/// Work the policy asks the caller to do; the caller owns every side effect.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<P> {
    /// Hand the pending update to the network now, then report [`PolicyEvent::Published`].
    Publish,
    /// Apply the update that just arrived from `peer`, scaled by `weight`.
    Apply {
        /// The sender of the update.
        peer: P,
        /// Scale for the update: neighbourhood share times staleness discount.
        weight: f32,
    },
    /// Discard the update that just arrived from `peer`: it is too stale to help.
    Drop {
        /// The sender of the update.
        peer: P,
        /// How many steps behind this node the update was.
        staleness: u64,
    },
    /// Start a full sync with `peer`, then report [`PolicyEvent::SyncFinished`].
    FullSync {
        /// The neighbour to sync with.
        peer: P,
    },
    /// SSP: stop taking local steps until [`Action::Resume`].
    Hold,
    /// SSP: local steps may continue.
    Resume,
}

/// What the policy knows about one neighbour.
#[derive(Debug, Clone)]
struct Neighbour {
    /// Highest step heard from it; `None` until its first news.
    known_step: Option<u64>,
    /// When it was last heard from (or came up).
    last_heard: Instant,
    /// When its known step last went up (or it came up): SSP waits only for neighbours
    /// that make progress.
    last_advanced: Instant,
    /// Sequence number of the last full sync started with it; `None` if never.
    last_sync: Option<u64>,
}

/// The neighbour-sync state of one node. The daemon's trainer thread owns one instance
/// and is the only writer, so no locking is needed.
#[derive(Debug, Clone)]
pub struct SyncPolicy<P> {
    config: PolicyConfig,
    step: u64,
    last_publish_step: u64,
    last_sync_step: u64,
    neighbours: BTreeMap<P, Neighbour>,
    sync_in_flight: Option<P>,
    sync_seq: u64,
    held: bool,
}

impl<P: Ord + Clone + Debug> SyncPolicy<P> {
    /// Starts a policy for a node at `step` (0 for a fresh model, the checkpoint's step
    /// after a restore) with no neighbours, so the daemon and a test build it alike.
    pub fn new(config: PolicyConfig, step: u64) -> Self {
        Self {
            config,
            step,
            last_publish_step: step,
            last_sync_step: step,
            neighbours: BTreeMap::new(),
            sync_in_flight: None,
            sync_seq: 0,
            held: false,
        }
    }

    /// The configuration in force, for status reports.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// Feeds one event at time `now` and returns what the caller should do, in order.
    /// This is the single entry point so that the policy's state only ever changes in
    /// response to an event the caller can log and replay.
    pub fn handle(&mut self, event: PolicyEvent<P>, now: Instant) -> Vec<Action<P>> {
        let mut out = Vec::new();
        match event {
            PolicyEvent::Stepped {
                step,
                pending_ratio,
            } => {
                if step < self.step {
                    // Went backwards (restore): restart the counters from here.
                    self.last_publish_step = self.last_publish_step.min(step);
                    self.last_sync_step = self.last_sync_step.min(step);
                }
                self.step = step;
                if self.publish_due(pending_ratio) {
                    out.push(Action::Publish);
                }
                if let Some(peer) = self.sync_due(now) {
                    out.push(Action::FullSync { peer });
                }
            }
            PolicyEvent::Published { step } => {
                self.last_publish_step = self.last_publish_step.max(step.min(self.step));
            }
            PolicyEvent::NeighbourUp { peer } => {
                self.neighbours
                    .entry(peer)
                    .and_modify(|n| n.last_heard = now)
                    .or_insert(Neighbour {
                        known_step: None,
                        last_heard: now,
                        last_advanced: now,
                        last_sync: None,
                    });
            }
            PolicyEvent::NeighbourDown { peer } => {
                self.neighbours.remove(&peer);
            }
            PolicyEvent::Heard { peer, step } => self.hear(&peer, step, now),
            PolicyEvent::UpdateArrived { peer, step } => {
                self.hear(&peer, step, now);
                out.push(self.judge_update(peer, step, now));
            }
            PolicyEvent::SyncFinished { peer, ok } => {
                if self.sync_in_flight.as_ref() == Some(&peer) {
                    self.sync_in_flight = None;
                    if ok {
                        self.last_sync_step = self.step;
                    }
                }
            }
            PolicyEvent::Tick => {}
        }
        self.update_hold(now, &mut out);
        out
    }

    /// Whether SSP currently forbids local steps; the trainer checks it before each step.
    pub fn is_held(&self) -> bool {
        self.held
    }

    /// This node's step as last reported, for status and logs.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The neighbour whose full sync is in flight, so status can show it.
    pub fn sync_in_flight(&self) -> Option<&P> {
        self.sync_in_flight.as_ref()
    }

    /// The highest step heard from `peer`, if it is a neighbour and has been heard from;
    /// lets status (and tests) compare the policy's view with reality.
    pub fn known_step(&self, peer: &P) -> Option<u64> {
        self.neighbours.get(peer).and_then(|n| n.known_step)
    }

    /// Neighbours heard from within `peer_timeout` of `now`, in key order: the ones that
    /// count for weights, SSP and full sync.
    pub fn live_neighbours(&self, now: Instant) -> Vec<P> {
        self.neighbours
            .iter()
            .filter(|(_, n)| self.is_live(n, now))
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// This node's step minus the slowest known step among live neighbours (0 if this
    /// node is behind), or `None` if no live neighbour's step is known: the quantity SSP
    /// bounds, exposed for status and tests.
    pub fn lead_over_slowest(&self, now: Instant) -> Option<u64> {
        self.slowest_live(now)
            .map(|slowest| self.step.saturating_sub(slowest))
    }

    /// SSP as a limit the trainer can check without asking: it may take a step while its
    /// step is below `slowest live neighbour + bound`. `None` when no bound is set or no live
    /// neighbour's step is known. Equivalent to [`Action::Hold`] and [`Action::Resume`], but
    /// exact however late the trainer's own steps reach the policy.
    pub fn step_limit(&self, now: Instant) -> Option<u64> {
        let bound = self.config.staleness_bound?.max(1);
        self.slowest_live(now)
            .map(|slowest| slowest.saturating_add(bound))
    }

    fn is_live(&self, n: &Neighbour, now: Instant) -> bool {
        now.saturating_duration_since(n.last_heard) <= self.config.peer_timeout
    }

    fn live_count(&self, now: Instant) -> usize {
        self.neighbours
            .values()
            .filter(|n| self.is_live(n, now))
            .count()
    }

    /// Slowest known step among live neighbours that are making progress; neighbours not
    /// heard from yet are unknown and ignored, so a freshly connected peer cannot hold this
    /// node on a guess, and neither can one whose step stood still for `peer_timeout` (the
    /// slowest honest node is never held itself, so it always advances).
    fn slowest_live(&self, now: Instant) -> Option<u64> {
        self.neighbours
            .values()
            .filter(|n| self.is_live(n, now))
            .filter(|n| now.saturating_duration_since(n.last_advanced) <= self.config.peer_timeout)
            .filter_map(|n| n.known_step)
            .min()
    }

    fn hear(&mut self, peer: &P, step: u64, now: Instant) {
        if let Some(n) = self.neighbours.get_mut(peer) {
            // Messages may be reordered: keep the highest step seen.
            if n.known_step.is_none_or(|k| step > k) {
                n.known_step = Some(step);
                if now > n.last_advanced {
                    n.last_advanced = now;
                }
            }
            if now > n.last_heard {
                n.last_heard = now;
            }
        }
    }

    fn publish_due(&self, pending_ratio: f64) -> bool {
        let h = self.config.publish_every;
        if h == 0 {
            return false;
        }
        let since = self.step.saturating_sub(self.last_publish_step);
        if since >= h {
            return true;
        }
        let r = self.config.publish_early_ratio;
        since >= 1 && r > 0.0 && pending_ratio > r
    }

    /// Starts a full sync if one is due: the live neighbour least recently synced with
    /// (never-synced first, ties by key order), so syncs rotate through the neighbourhood.
    /// A live neighbour never synced with (new, or back after a partition or a restart: the
    /// most divergent replica there is) makes a sync due after a quarter of the interval
    /// already. With the full interval, a healed 2|2 split took three to four intervals to
    /// get back to its old consensus distance; the quarter keeps churn from causing a storm.
    fn sync_due(&mut self, now: Instant) -> Option<P> {
        let every = self.config.full_sync_every;
        if every == 0 || self.sync_in_flight.is_some() {
            return None;
        }
        let since = self.step.saturating_sub(self.last_sync_step);
        let unsynced_live = self
            .neighbours
            .values()
            .any(|n| n.last_sync.is_none() && self.is_live(n, now));
        if since < every && !(unsynced_live && since >= (every / 4).max(1)) {
            return None;
        }
        let peer = self
            .neighbours
            .iter()
            .filter(|(_, n)| self.is_live(n, now))
            .min_by_key(|(p, n)| (n.last_sync, *p))
            .map(|(p, _)| p.clone())?;
        self.sync_seq = self.sync_seq.wrapping_add(1);
        let seq = self.sync_seq;
        if let Some(n) = self.neighbours.get_mut(&peer) {
            n.last_sync = Some(seq);
        }
        self.sync_in_flight = Some(peer.clone());
        Some(peer)
    }

    fn judge_update(&self, peer: P, their_step: u64, now: Instant) -> Action<P> {
        // Staleness in the sender's own steps: how far behind the sender's latest known
        // progress this update is (a late or reordered message). Not our step minus theirs:
        // nodes run at different speeds, so step counters drift apart even when every update
        // is fresh, and that would discount a slower box's work more and more.
        let staleness = self
            .known_step(&peer)
            .map_or(0, |k| k.saturating_sub(their_step));
        if let Some(limit) = self.config.drop_after {
            if staleness > limit {
                return Action::Drop { peer, staleness };
            }
        }
        let live = self.live_count(now).max(1);
        let base = 1.0 / (live as f64 + 1.0);
        let discount = match self.config.stale_after {
            0 => 1.0,
            scale => 1.0 / (1.0 + staleness as f64 / scale as f64),
        };
        Action::Apply {
            peer,
            weight: (base * discount) as f32,
        }
    }

    fn should_hold(&self, now: Instant) -> bool {
        let Some(bound) = self.config.staleness_bound else {
            return false;
        };
        let bound = bound.max(1);
        match self.slowest_live(now) {
            Some(slowest) => self.step >= slowest.saturating_add(bound),
            None => false,
        }
    }

    fn update_hold(&mut self, now: Instant, out: &mut Vec<Action<P>>) {
        let hold = self.should_hold(now);
        if hold != self.held {
            self.held = hold;
            out.push(if hold { Action::Hold } else { Action::Resume });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PolicyConfig {
        PolicyConfig {
            publish_every: 0,
            publish_early_ratio: 0.0,
            full_sync_every: 0,
            staleness_bound: None,
            peer_timeout: Duration::from_millis(100),
            stale_after: 0,
            drop_after: None,
        }
    }

    fn ms(base: Instant, t: u64) -> Instant {
        base + Duration::from_millis(t)
    }

    fn step(p: &mut SyncPolicy<u32>, s: u64, now: Instant) -> Vec<Action<u32>> {
        p.handle(
            PolicyEvent::Stepped {
                step: s,
                pending_ratio: 0.0,
            },
            now,
        )
    }

    fn up(p: &mut SyncPolicy<u32>, peer: u32, now: Instant) {
        assert!(p.handle(PolicyEvent::NeighbourUp { peer }, now).is_empty());
    }

    fn heard(p: &mut SyncPolicy<u32>, peer: u32, s: u64, now: Instant) -> Vec<Action<u32>> {
        p.handle(PolicyEvent::Heard { peer, step: s }, now)
    }

    fn weight(p: &mut SyncPolicy<u32>, peer: u32, s: u64, now: Instant) -> Action<u32> {
        let out = p.handle(PolicyEvent::UpdateArrived { peer, step: s }, now);
        assert_eq!(out.len(), 1, "{out:?}");
        out[0].clone()
    }

    fn apply_weight(a: &Action<u32>) -> f32 {
        match a {
            Action::Apply { weight, .. } => *weight,
            other => panic!("expected Apply, got {other:?}"),
        }
    }

    #[test]
    fn default_config_is_as_documented() {
        let c = PolicyConfig::default();
        assert_eq!(c.publish_every, 20);
        assert_eq!(c.publish_early_ratio, 0.0);
        assert_eq!(c.full_sync_every, 500);
        assert_eq!(c.staleness_bound, None);
        assert_eq!(c.peer_timeout, Duration::from_secs(6));
        assert_eq!(c.stale_after, 100);
        assert_eq!(c.drop_after, None);
    }

    #[test]
    fn publishes_every_h_steps_and_retries_until_published() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                publish_every: 3,
                ..cfg()
            },
            0,
        );
        assert!(step(&mut p, 1, t).is_empty());
        assert!(step(&mut p, 2, t).is_empty());
        assert_eq!(step(&mut p, 3, t), vec![Action::Publish]);
        // Not confirmed: ask again.
        assert_eq!(step(&mut p, 4, t), vec![Action::Publish]);
        assert!(p.handle(PolicyEvent::Published { step: 4 }, t).is_empty());
        assert!(step(&mut p, 5, t).is_empty());
        assert!(step(&mut p, 6, t).is_empty());
        assert_eq!(step(&mut p, 7, t), vec![Action::Publish]);
        assert_eq!(p.step(), 7);
    }

    #[test]
    fn publishes_early_when_pending_update_is_large() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                publish_every: 100,
                publish_early_ratio: 0.1,
                ..cfg()
            },
            10,
        );
        let ev = |s, r| PolicyEvent::Stepped {
            step: s,
            pending_ratio: r,
        };
        assert!(p.handle(ev(11, 0.05), t).is_empty());
        assert!(
            p.handle(ev(12, 0.1), t).is_empty(),
            "must exceed, not equal"
        );
        assert_eq!(p.handle(ev(13, 0.2), t), vec![Action::Publish]);
        assert!(p.handle(PolicyEvent::Published { step: 13 }, t).is_empty());
        assert!(p.handle(ev(14, f64::NAN), t).is_empty());
        // Ratio 0.0 switches the early rule off.
        let mut q = SyncPolicy::<u32>::new(
            PolicyConfig {
                publish_every: 100,
                ..cfg()
            },
            0,
        );
        assert!(q.handle(ev(1, 5.0), t).is_empty());
    }

    #[test]
    fn never_publishes_with_h_zero() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                publish_every: 0,
                publish_early_ratio: 0.01,
                ..cfg()
            },
            0,
        );
        for s in 1..=1000 {
            let out = p.handle(
                PolicyEvent::Stepped {
                    step: s,
                    pending_ratio: 10.0,
                },
                t,
            );
            assert!(!out.contains(&Action::Publish));
        }
    }

    #[test]
    fn weights_updates_by_neighbourhood_and_staleness() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                stale_after: 10,
                drop_after: Some(20),
                ..cfg()
            },
            0,
        );
        // Empty neighbour set: 1 / (max(0, 1) + 1).
        assert_eq!(apply_weight(&weight(&mut p, 9, 0, t)), 0.5);
        for n in 1..=3 {
            up(&mut p, n, t);
        }
        step(&mut p, 50, t);
        assert_eq!(apply_weight(&weight(&mut p, 1, 50, t)), 0.25);
        assert_eq!(apply_weight(&weight(&mut p, 1, 60, t)), 0.25, "in order");
        assert_eq!(apply_weight(&weight(&mut p, 1, 50, t)), 0.125, "τ = 10");
        let w = apply_weight(&weight(&mut p, 1, 40, t));
        assert!((w - 0.25 / 3.0).abs() < 1e-7, "τ = 20 kept: {w}");
        assert_eq!(
            weight(&mut p, 1, 39, t),
            Action::Drop {
                peer: 1,
                staleness: 21
            }
        );
        // A slower (or faster) sender is not stale: only its own newer news makes it so.
        step(&mut p, 1000, t);
        assert_eq!(
            apply_weight(&weight(&mut p, 1, 61, t)),
            0.25,
            "slower sender"
        );
        // Timed-out neighbours do not count: only 1 (just heard) is live.
        let later = ms(t, 150);
        assert_eq!(p.live_neighbours(later), Vec::<u32>::new());
        assert_eq!(apply_weight(&weight(&mut p, 1, 70, later)), 0.5);
        assert_eq!(p.live_neighbours(later), vec![1]);
        // stale_after 0: no discount.
        let mut q = SyncPolicy::<u32>::new(cfg(), 1000);
        assert_eq!(apply_weight(&weight(&mut q, 1, 0, t)), 0.5);
    }

    #[test]
    fn full_sync_rotates_least_recent_one_at_a_time() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                full_sync_every: 5,
                ..cfg()
            },
            0,
        );
        // No live neighbour: due but nothing to sync with.
        for s in 1..=5 {
            assert!(step(&mut p, s, t).is_empty());
        }
        for n in [3, 1, 2] {
            up(&mut p, n, t);
        }
        assert_eq!(step(&mut p, 6, t), vec![Action::FullSync { peer: 1 }]);
        assert_eq!(p.sync_in_flight(), Some(&1));
        for s in 7..=12 {
            assert!(step(&mut p, s, t).is_empty(), "one in flight");
        }
        // A report about another peer is ignored.
        p.handle(PolicyEvent::SyncFinished { peer: 2, ok: true }, t);
        assert!(step(&mut p, 13, t).is_empty());
        p.handle(PolicyEvent::SyncFinished { peer: 1, ok: true }, t);
        assert_eq!(p.sync_in_flight(), None);
        // 2 and 3 were never synced with: due after a quarter interval (one step), not five.
        assert_eq!(step(&mut p, 14, t), vec![Action::FullSync { peer: 2 }]);
        // Failure: retry on the next step with the next peer.
        p.handle(PolicyEvent::SyncFinished { peer: 2, ok: false }, t);
        assert_eq!(step(&mut p, 15, t), vec![Action::FullSync { peer: 3 }]);
        p.handle(PolicyEvent::SyncFinished { peer: 3, ok: true }, t);
        // Everyone synced once: back to the full interval.
        for s in 16..=19 {
            assert!(step(&mut p, s, t).is_empty());
        }
        // Peer 1 (least recent) has timed out; 2 and 3 are fresh: choose 2.
        let later = ms(t, 200);
        heard(&mut p, 2, 0, later);
        heard(&mut p, 3, 0, later);
        assert_eq!(step(&mut p, 20, later), vec![Action::FullSync { peer: 2 }]);
    }

    #[test]
    fn a_returning_neighbour_is_synced_after_a_quarter_interval() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                full_sync_every: 100,
                ..cfg()
            },
            0,
        );
        up(&mut p, 1, t);
        assert_eq!(step(&mut p, 25, t), vec![Action::FullSync { peer: 1 }]);
        p.handle(PolicyEvent::SyncFinished { peer: 1, ok: true }, t);
        for s in 26..=124 {
            assert!(step(&mut p, s, t).is_empty(), "{s}");
        }
        assert_eq!(step(&mut p, 125, t), vec![Action::FullSync { peer: 1 }]);
        p.handle(PolicyEvent::SyncFinished { peer: 1, ok: true }, t);
        // Lost (a partition) and back: its sync history is gone with it.
        p.handle(PolicyEvent::NeighbourDown { peer: 1 }, t);
        up(&mut p, 1, t);
        for s in 126..=149 {
            assert!(step(&mut p, s, t).is_empty(), "{s}");
        }
        assert_eq!(step(&mut p, 150, t), vec![Action::FullSync { peer: 1 }]);
    }

    #[test]
    fn ssp_holds_once_and_resumes_when_slowest_catches_up() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                staleness_bound: Some(5),
                ..cfg()
            },
            10,
        );
        up(&mut p, 1, t);
        up(&mut p, 2, t);
        up(&mut p, 3, t); // never heard: unknown, must not hold us.
        assert!(heard(&mut p, 1, 10, t).is_empty());
        assert!(heard(&mut p, 2, 12, t).is_empty());
        assert_eq!(p.lead_over_slowest(t), Some(0));
        for s in 11..=14 {
            assert!(step(&mut p, s, t).is_empty());
            assert!(!p.is_held());
        }
        assert_eq!(step(&mut p, 15, t), vec![Action::Hold]);
        assert!(p.is_held());
        assert_eq!(p.lead_over_slowest(t), Some(5));
        assert!(p.handle(PolicyEvent::Tick, t).is_empty(), "Hold only once");
        assert!(heard(&mut p, 2, 30, t).is_empty(), "2 was not the slowest");
        assert!(heard(&mut p, 1, 9, t).is_empty(), "reordered old news");
        assert_eq!(heard(&mut p, 1, 11, t), vec![Action::Resume]);
        assert!(!p.is_held());
        assert!(heard(&mut p, 1, 12, t).is_empty(), "Resume only once");
    }

    #[test]
    fn ssp_hold_released_by_neighbour_down() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                staleness_bound: Some(3),
                ..cfg()
            },
            0,
        );
        up(&mut p, 1, t);
        up(&mut p, 2, t);
        heard(&mut p, 1, 0, t);
        heard(&mut p, 2, 2, t);
        step(&mut p, 1, t);
        step(&mut p, 2, t);
        assert_eq!(step(&mut p, 3, t), vec![Action::Hold]);
        assert_eq!(
            p.handle(PolicyEvent::NeighbourDown { peer: 1 }, t),
            vec![Action::Resume]
        );
        assert_eq!(p.lead_over_slowest(t), Some(1));
        // A new slow neighbour holds us as soon as its step is known.
        up(&mut p, 4, t);
        assert!(!p.is_held());
        assert_eq!(heard(&mut p, 4, 0, t), vec![Action::Hold]);
    }

    #[test]
    fn ssp_hold_released_by_timeout() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                staleness_bound: Some(2),
                ..cfg()
            },
            0,
        );
        up(&mut p, 1, t);
        up(&mut p, 2, t);
        heard(&mut p, 1, 0, t);
        heard(&mut p, 2, 1, t);
        step(&mut p, 1, t);
        assert_eq!(step(&mut p, 2, t), vec![Action::Hold]);
        // 2 keeps talking and stepping, 1 falls silent.
        assert!(heard(&mut p, 2, 2, ms(t, 60)).is_empty());
        assert!(p.handle(PolicyEvent::Tick, ms(t, 100)).is_empty());
        assert_eq!(
            p.handle(PolicyEvent::Tick, ms(t, 101)),
            vec![Action::Resume]
        );
        assert_eq!(p.live_neighbours(ms(t, 101)), vec![2]);
        assert!(step(&mut p, 3, ms(t, 101)).is_empty());
        // 1 comes back, a step further but still slow: hold again.
        assert_eq!(heard(&mut p, 1, 1, ms(t, 102)), vec![Action::Hold]);
        // Everyone silent: nobody known and live, so no hold.
        assert_eq!(
            p.handle(PolicyEvent::Tick, ms(t, 500)),
            vec![Action::Resume]
        );
        assert_eq!(p.lead_over_slowest(ms(t, 500)), None);
    }

    #[test]
    fn a_neighbour_claiming_the_same_step_forever_stops_holding_after_the_timeout() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                staleness_bound: Some(2),
                ..cfg()
            },
            0,
        );
        up(&mut p, 1, t);
        up(&mut p, 2, t);
        heard(&mut p, 1, 0, t);
        heard(&mut p, 2, 0, t);
        step(&mut p, 1, t);
        assert_eq!(step(&mut p, 2, t), vec![Action::Hold]);
        // 1 keeps heart-beating step 0 (alive, but no progress); 2 advances with us.
        let mut now = t;
        for i in 1..=10u64 {
            now = ms(t, i * 11);
            heard(&mut p, 1, 0, now);
            heard(&mut p, 2, 2, now);
        }
        assert!(p.live_neighbours(now).contains(&1), "still heard from");
        assert!(!p.is_held(), "a claim that never advances holds nobody");
        assert_eq!(p.lead_over_slowest(now), Some(0));
        // Once it advances it counts again.
        assert!(step(&mut p, 3, now).is_empty());
        assert_eq!(heard(&mut p, 1, 1, ms(t, 111)), vec![Action::Hold]);
    }

    #[test]
    fn an_update_header_beyond_a_heartbeat_raises_the_known_step_never_lowers_it() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                staleness_bound: Some(5),
                ..cfg()
            },
            10,
        );
        up(&mut p, 1, t);
        // A heartbeat says 0, its update says 40: the update proves the progress.
        heard(&mut p, 1, 0, t);
        assert!(p.is_held());
        p.handle(PolicyEvent::UpdateArrived { peer: 1, step: 40 }, t);
        assert_eq!(p.known_step(&1), Some(40));
        assert!(!p.is_held());
        // A later heartbeat claiming less does not pull it back.
        heard(&mut p, 1, 3, ms(t, 5));
        assert_eq!(p.known_step(&1), Some(40));
        assert!(!p.is_held());
    }

    #[test]
    fn ssp_bound_zero_acts_as_one() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                staleness_bound: Some(0),
                ..cfg()
            },
            5,
        );
        up(&mut p, 1, t);
        assert!(heard(&mut p, 1, 5, t).is_empty(), "equal steps: may step");
        assert_eq!(step(&mut p, 6, t), vec![Action::Hold]);
        assert_eq!(heard(&mut p, 1, 6, t), vec![Action::Resume]);
    }

    #[test]
    fn odd_inputs_do_not_panic() {
        let t = Instant::now();
        let mut p = SyncPolicy::<u32>::new(
            PolicyConfig {
                publish_every: 1,
                publish_early_ratio: f64::INFINITY,
                full_sync_every: 1,
                staleness_bound: Some(u64::MAX),
                peer_timeout: Duration::ZERO,
                stale_after: 1,
                drop_after: Some(0),
            },
            u64::MAX,
        );
        up(&mut p, 1, t);
        heard(&mut p, 1, u64::MAX, t);
        p.handle(PolicyEvent::UpdateArrived { peer: 1, step: 0 }, t);
        p.handle(PolicyEvent::Published { step: u64::MAX }, t);
        step(&mut p, 0, t - Duration::from_millis(1));
        step(&mut p, u64::MAX, t);
        p.handle(PolicyEvent::NeighbourDown { peer: 7 }, t);
        p.handle(PolicyEvent::SyncFinished { peer: 7, ok: true }, t);
        p.handle(PolicyEvent::Tick, t);
    }
}
