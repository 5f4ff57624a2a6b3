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
//! * **Mix** ([`Mixing`]): with `Mean`, a node that published its change takes back
//!   `live / (live + 1)` of what it sent, so its own change weighs what each neighbour's
//!   does and the neighbourhood moves by the mean of its members' changes; with `Add` it
//!   keeps its whole change and adds its neighbours' on top.
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
    /// How a published change and the neighbours' combine; see [`Mixing`].
    pub mixing: Mixing,
    /// Neighbours this node must have heard training (live at once, a step known: not still
    /// downloading their state) before its first step in this process; 0 never waits. A node
    /// founding a mesh would otherwise train alone until the others have joined (on the
    /// digits, 3,000 steps in about 2 s), and its work would reach them only as its
    /// parameters. Once that many were heard it never waits again: a neighbour that dies
    /// later must not stop the rest.
    pub wait_for_neighbours: usize,
}

/// How gossip combines a node's own change with its neighbours' (`sync.mix`). Every member
/// of a run must use the same rule: it is one of the sync terms the handshake compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mixing {
    /// Each node keeps its own change and adds `1 / (live + 1)` of each neighbour's: with two
    /// nodes, `own + 0.5 × other`, a longer and noisier step than either, and the two models
    /// drift apart until a full sync averages them. The default: what every existing run and
    /// the integration tests' bounds were measured with.
    #[default]
    Add,
    /// Each node takes back `live / (live + 1)` of the change it published and adds
    /// `1 / (live + 1)` of each neighbour's: the neighbourhood moves by the mean of its
    /// members' changes, as a larger batch would. The exchange keeps the neighbourhood's sum
    /// only where every member is a neighbour of every other (a node's `live` is then how many
    /// take its change); it averages changes, never parameters, so replicas already apart
    /// come together only through full syncs.
    Mean,
}

impl Mixing {
    /// The name used in configs and in the sync terms.
    pub fn name(self) -> &'static str {
        match self {
            Mixing::Add => "add",
            Mixing::Mean => "mean",
        }
    }
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
            mixing: Mixing::default(),
            wait_for_neighbours: 0,
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

/// How long a neighbour whose full sync did not average (it declined, failed, or its reply
/// was refused) is not asked again; the policy picks another meanwhile. Without it a lone
/// neighbour that declines (a joiner still downloading) was asked ~300 times a second, and a
/// joiner whose state lay far behind its two neighbours refused their replies 173 times in one
/// second, lowering both honest peers' scores at each. Per neighbour: a hostile one does not
/// hold up the syncs with the others.
pub const SYNC_RETRY_PAUSE: Duration = Duration::from_millis(500);

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
    /// Not asked for a full sync again before this, after one with it did not average.
    retry_after: Option<Instant>,
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
    /// Whether [`PolicyConfig::wait_for_neighbours`] neighbours were heard at once (so the
    /// first step may come).
    gathered: bool,
}

impl<P: Ord + Clone + Debug> SyncPolicy<P> {
    /// Starts a policy for a node at `step` (0 for a fresh model, the checkpoint's step
    /// after a restore) with no neighbours, so the daemon and a test build it alike.
    pub fn new(config: PolicyConfig, step: u64) -> Self {
        Self {
            gathered: config.wait_for_neighbours == 0,
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
                        retry_after: None,
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
                    } else if let Some(n) = self.neighbours.get_mut(&peer) {
                        n.retry_after = Some(now + SYNC_RETRY_PAUSE);
                    }
                }
            }
            PolicyEvent::Tick => {}
        }
        if !self.gathered && self.training_count(now) >= self.config.wait_for_neighbours {
            self.gathered = true;
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
        if !self.gathered {
            return Some(self.step);
        }
        let bound = self.config.staleness_bound?.max(1);
        self.slowest_live(now)
            .map(|slowest| slowest.saturating_add(bound))
    }

    fn is_live(&self, n: &Neighbour, now: Instant) -> bool {
        now.saturating_duration_since(n.last_heard) <= self.config.peer_timeout
    }

    /// The weight of this node's own published change once it is sent: with
    /// [`Mixing::Mean`] minus `live / (live + 1)` of it (so what stays weighs what each live
    /// neighbour's change will), with [`Mixing::Add`] nothing (`None`). Alone, nothing either:
    /// nobody takes the change that would be given back.
    pub fn own_change_weight(&self, now: Instant) -> Option<f32> {
        let live = self.live_count(now);
        (self.config.mixing == Mixing::Mean && live > 0)
            .then(|| -(live as f64 / (live as f64 + 1.0)) as f32)
    }

    /// Live neighbours that train: heard with a step (a joiner still downloading its state
    /// says none).
    fn training_count(&self, now: Instant) -> usize {
        self.neighbours
            .values()
            .filter(|n| n.known_step.is_some() && self.is_live(n, now))
            .count()
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
            .filter(|(_, n)| self.is_live(n, now) && n.retry_after.is_none_or(|t| now >= t))
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
        if !self.gathered {
            return true;
        }
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
mod tests;
