//! Who is in the run and who of them this node listens to: the members (connected peers of
//! the run), the `degree` neighbours drawn among them from a seeded RNG and re-chosen as
//! members come and go, the heartbeats this node publishes on the run's topic and the latest
//! one heard from each peer. A heartbeat numbered no higher than the last taken from its
//! author is ignored ([`REPLAY_MEMORY`]).
//!
//! It tells the core what changed ([`NeighbourChange`], [`HeartbeatNews`]) and leaves the
//! policy, the rounds and the update guard to the core, which routes the news to them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use libp2p::PeerId;
use rand::rngs::StdRng;
use rand::seq::IteratorRandom;
use rand::{Rng, SeedableRng};

use super::{heartbeat_topic, Output, Phase, Progress, PER_PEER_CAP};
use crate::guard::TokenBucket;
use crate::wire::{self, Heartbeat};

/// How often neighbours are re-chosen.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How often a node tells the mesh its progress.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// In a synchronous mode, a new member hears this node's heartbeat this soon after it
/// connects (time for gossip to learn its subscriptions), not up to [`HEARTBEAT_EVERY`] later:
/// a round waits for every member's word that it is ready.
pub const NEW_MEMBER_HEARTBEAT_AFTER: Duration = Duration::from_millis(300);
/// How long the number of an author's last heartbeat is remembered: one numbered no higher
/// within that time is old (replayed, or overtaken in gossip) and ignored. A live node
/// renews it every [`HEARTBEAT_EVERY`], so an old goodbye replayed cannot make the mesh
/// forget it; a node whose clock went back (its numbers start from its start time) is unheard
/// for at most this long.
pub const REPLAY_MEMORY: Duration = Duration::from_secs(60);
/// Heartbeats taken from one author per second, and in a burst: an honest node sends one
/// every [`HEARTBEAT_EVERY`] and a few sooner (a new member, news for the rounds). Beyond
/// them a heartbeat is ignored, not forwarded: a flood of valid heartbeats would otherwise
/// cost every node of the mesh the work of each.
pub const HEARTBEAT_RATE: f64 = 2.0;
/// See [`HEARTBEAT_RATE`].
pub const HEARTBEAT_BURST: f64 = 10.0;
/// This node's own heartbeats go out at most this many a second, and this many in a burst
/// ([`OWN_HEARTBEAT_BURST`]): strictly inside what every peer reads of one author
/// ([`HEARTBEAT_RATE`], [`HEARTBEAT_BURST`]), whatever pulls them forward (a peer that
/// reconnects every few hundred milliseconds is a new member each time; readiness that
/// flaps). A heartbeat held back goes out when the bucket allows, a fraction of a second
/// later.
pub const OWN_HEARTBEAT_RATE: f64 = 1.5;
/// See [`OWN_HEARTBEAT_RATE`].
pub const OWN_HEARTBEAT_BURST: f64 = 5.0;
/// Heartbeat numbers start at the node's start time in seconds shifted by this much, so a
/// restarted node's go on above its previous run's (which would need a million heartbeats a
/// second to catch up).
const SEQ_SHIFT: u32 = 20;

/// A change of neighbours, for the core to tell the network and the policy.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum NeighbourChange {
    /// No longer a neighbour.
    Gone(PeerId),
    /// A new neighbour, with the step of its last heartbeat when one was heard.
    New {
        /// The neighbour.
        peer: PeerId,
        /// Its step, as its last heartbeat told it.
        last_step: Option<u64>,
    },
}

/// What a heartbeat on the run's topic told.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum HeartbeatNews {
    /// The author is leaving: it is to be forgotten and dropped.
    Leaving {
        /// The author.
        peer: PeerId,
        /// The round its goodbye names (in the synchronous modes): one past the last whose
        /// ring it completed (see `Rounds::leaving_round`).
        round: Option<u64>,
    },
    /// The author's progress (kept as its latest heartbeat).
    Heard {
        /// The author.
        peer: PeerId,
        /// What it said.
        heartbeat: Heartbeat,
        /// Whether it is a member now.
        member: bool,
        /// Whether it is a neighbour now.
        neighbour: bool,
    },
    /// Not a heartbeat (an offence was named when the author is known).
    Malformed,
    /// A strange author's, while the table of authors' rates is full of recent others
    /// ([`PER_PEER_CAP`]): not read, nobody punished.
    Untracked,
    /// Beyond its author's [`HEARTBEAT_RATE`]: not read. `first` for the first of a run of
    /// them, so the author is named once, not once a message.
    OverRate {
        /// The author.
        peer: PeerId,
        /// Whether the heartbeat before it from this author was within the rate.
        first: bool,
    },
    /// A heartbeat numbered no higher than the last taken from its author: told nothing.
    Old,
}

/// What an author's heartbeat rate says of its latest heartbeat.
enum RateVerdict {
    /// Within [`HEARTBEAT_RATE`].
    Within,
    /// Beyond it; `first` for the first of a run of refusals.
    Over {
        /// Whether the heartbeat before it from this author was within the rate.
        first: bool,
    },
    /// The table of authors' rates is full of recent authors: not read, not punished.
    Untracked,
}

/// Members, neighbours and heartbeats; see the module docs.
pub(super) struct Membership {
    me: PeerId,
    run_id: String,
    topic: String,
    degree: usize,
    /// In a synchronous mode a round waits for heartbeats: they go out sooner.
    synchronous: bool,
    rng: StdRng,
    members: BTreeSet<PeerId>,
    neighbours: BTreeSet<PeerId>,
    /// The latest heartbeat of each peer heard from: members always, others up to
    /// [`PER_PEER_CAP`].
    heard: BTreeMap<PeerId, Heartbeat>,
    next_refresh: Option<Instant>,
    next_heartbeat: Option<Instant>,
    /// What this node's own heartbeats may still send (see [`OWN_HEARTBEAT_RATE`]); full at
    /// the first.
    own_bucket: Option<TokenBucket>,
    heartbeats_sent: u64,
    /// This node's heartbeats are numbered from here (see [`SEQ_SHIFT`]).
    seq_base: u64,
    /// The number of the last heartbeat taken from each author and when (see
    /// [`REPLAY_MEMORY`]): members always, others up to [`PER_PEER_CAP`].
    last_seq: HashMap<PeerId, (u64, Instant)>,
    /// Each heartbeat author's rate (see [`HEARTBEAT_RATE`]) and whether its last heartbeat
    /// was refused: members always, others up to [`PER_PEER_CAP`].
    heartbeat_rate: HashMap<PeerId, (TokenBucket, bool)>,
    /// What the last heartbeat told the rounds: whether this node is ready for them,
    /// whether it knew its speed, and whether it needs the members' state. When any of it
    /// changes, the next heartbeat goes out at once (a `ddp` member's batch depends on the
    /// others' speeds; a `diloco` ring's layout on who needs the state).
    announced: (bool, bool, bool),
}

/// What a heartbeat says of this node's rounds; the core reads it off `Rounds`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoundsNews {
    /// The round it works on, or in a goodbye one past the last whose ring it completed.
    pub round: Option<u64>,
    /// `diloco`: its round anchor and outer velocity are not the members'.
    pub needs_state: bool,
    /// It sits out of the rounds for a while (`rounds::lists`): not ready for them.
    pub sitting_out: bool,
    /// The peer it accuses, and how many times in a row (`Rounds::accusation`).
    pub accused: Option<(PeerId, u32)>,
}

impl Membership {
    /// Node `me` of run `run_id`, keeping `degree` neighbours drawn with `seed`.
    pub(super) fn new(
        me: PeerId,
        run_id: &str,
        degree: usize,
        synchronous: bool,
        seed: u64,
    ) -> Membership {
        Membership {
            me,
            run_id: run_id.to_string(),
            topic: heartbeat_topic(run_id),
            degree,
            synchronous,
            rng: StdRng::seed_from_u64(seed),
            members: BTreeSet::new(),
            neighbours: BTreeSet::new(),
            heard: BTreeMap::new(),
            next_refresh: None,
            next_heartbeat: None,
            own_bucket: None,
            heartbeats_sent: 0,
            seq_base: 0,
            last_seq: HashMap::new(),
            heartbeat_rate: HashMap::new(),
            announced: (false, false, false),
        }
    }

    /// Numbers this node's heartbeats from its start time, `unix_secs`, so that they rise
    /// across its restarts.
    pub(super) fn numbering_from(mut self, unix_secs: u64) -> Membership {
        self.seq_base = unix_secs << SEQ_SHIFT;
        self
    }

    /// The run's heartbeat topic.
    pub(super) fn topic(&self) -> &str {
        &self.topic
    }

    /// A peer of the run connected: it becomes a member (this node aside) and neighbours are
    /// re-chosen. In a synchronous mode a new member hears this node soon.
    ///
    /// Neighbours stay a uniform sample of the members (reservoir sampling): with all places
    /// taken, a new member replaces a random neighbour with probability `degree / members`.
    /// Filling only places left empty kept, after a partition healed, every neighbour on this
    /// node's own side for good: the simulator's 1,000 nodes never reconverged.
    pub(super) fn peer_up(&mut self, peer: PeerId, now: Instant) -> Vec<NeighbourChange> {
        if peer == self.me {
            return Vec::new();
        }
        let new = self.members.insert(peer);
        if new && self.synchronous {
            let soon = now + NEW_MEMBER_HEARTBEAT_AFTER;
            if self.next_heartbeat.is_none_or(|t| t > soon) {
                self.next_heartbeat = Some(soon);
            }
        }
        if new && self.neighbours.len() >= self.degree {
            let members = self.members.len() as u64;
            if self.rng.random_range(0..members) < self.degree as u64 {
                if let Some(out) = self.neighbours.iter().copied().choose(&mut self.rng) {
                    self.neighbours.remove(&out);
                    self.neighbours.insert(peer);
                    self.next_refresh = Some(now + REFRESH_EVERY);
                    return vec![
                        NeighbourChange::Gone(out),
                        NeighbourChange::New {
                            peer,
                            last_step: self.heard.get(&peer).and_then(Heartbeat::training_step),
                        },
                    ];
                }
            }
        }
        self.refresh(now)
    }

    /// A peer is gone (disconnected, left, or silent): it is no member, what it said is
    /// forgotten, and a neighbour is replaced.
    pub(super) fn drop(&mut self, peer: PeerId, now: Instant) -> Vec<NeighbourChange> {
        self.members.remove(&peer);
        self.heard.remove(&peer);
        if self.neighbours.contains(&peer) {
            self.refresh(now)
        } else {
            Vec::new()
        }
    }

    /// Whether neighbours are due to be re-chosen.
    pub(super) fn refresh_due(&self, now: Instant) -> bool {
        self.next_refresh.is_none_or(|t| now >= t)
    }

    /// Keeps `degree` neighbours among the members, replacing those gone with ones drawn from
    /// the seeded RNG: the gone ones first, then the new, each in the peers' order.
    pub(super) fn refresh(&mut self, now: Instant) -> Vec<NeighbourChange> {
        self.next_refresh = Some(now + REFRESH_EVERY);
        let members = &self.members;
        self.last_seq.retain(|p, (_, at)| {
            members.contains(p) || now.saturating_duration_since(*at) < REPLAY_MEMORY
        });
        let before = self.neighbours.clone();
        self.neighbours.retain(|p| self.members.contains(p));
        let want = self.degree.saturating_sub(self.neighbours.len());
        let extra: Vec<PeerId> = self
            .members
            .iter()
            .filter(|p| !self.neighbours.contains(p))
            .copied()
            .choose_multiple(&mut self.rng, want);
        self.neighbours.extend(extra);
        let gone = before.difference(&self.neighbours).copied();
        let new = self.neighbours.difference(&before).copied();
        gone.map(NeighbourChange::Gone)
            .chain(new.map(|peer| NeighbourChange::New {
                peer,
                // Its last heartbeat, heard while it was only a member, is what SSP knows of
                // its step until the next one: without it a new neighbour did not count for
                // up to a heartbeat period (the simulator caught a node running 76 steps
                // ahead so).
                last_step: self.heard.get(&peer).and_then(Heartbeat::training_step),
            }))
            .collect()
    }

    /// The heartbeat, when one is due at `now`: every [`HEARTBEAT_EVERY`], sooner for a new
    /// member, and at once when what it tells the rounds changed.
    pub(super) fn tick_heartbeat(
        &mut self,
        now: Instant,
        progress: &Progress,
        rounds: RoundsNews,
    ) -> Option<Output> {
        let due = self.next_heartbeat.is_none_or(|t| now >= t);
        if !due && self.readiness(progress, rounds) == self.announced {
            return None;
        }
        let bucket = self
            .own_bucket
            .get_or_insert_with(|| TokenBucket::full(OWN_HEARTBEAT_BURST, now));
        if !bucket.take(OWN_HEARTBEAT_RATE, OWN_HEARTBEAT_BURST, now) {
            // Still due (or still news): a later tick sends it.
            return None;
        }
        self.next_heartbeat = Some(now + HEARTBEAT_EVERY);
        Some(self.heartbeat(progress, rounds, false))
    }

    /// The heartbeat that tells the mesh this node leaves.
    pub(super) fn leaving_heartbeat(&mut self, progress: &Progress, rounds: RoundsNews) -> Output {
        self.heartbeat(progress, rounds, true)
    }

    /// What a heartbeat tells the rounds now: ready for them, speed known, state needed.
    fn readiness(&self, progress: &Progress, rounds: RoundsNews) -> (bool, bool, bool) {
        (
            self.synchronous && progress.phase == Phase::Training && !rounds.sitting_out,
            self.synchronous && progress.ms_per_sample.is_some(),
            self.synchronous && rounds.needs_state,
        )
    }

    fn heartbeat(&mut self, progress: &Progress, rounds: RoundsNews, leaving: bool) -> Output {
        self.heartbeats_sent += 1;
        let news = self.readiness(progress, rounds);
        self.announced = news;
        let hb = Heartbeat {
            step: progress.step,
            loss: progress.loss,
            samples_per_sec: progress.samples_per_sec,
            accuracy: progress.accuracy,
            ms_per_sample: progress.ms_per_sample,
            leaving,
            in_rounds: news.0 && !leaving,
            round: rounds.round,
            needs_state: news.2,
            starting: progress.phase == Phase::Starting,
            seq: self.seq_base.saturating_add(self.heartbeats_sent),
            accused: rounds.accused.map(|(p, _)| p.to_string()),
            accusations: rounds.accused.map_or(0, |(_, times)| times),
        };
        Output::Publish {
            topic: self.topic.clone(),
            data: wire::encode_heartbeat(&hb),
        }
    }

    /// Reads a heartbeat of `author`'s and keeps it. A malformed one with a known author is an
    /// offence (pushed onto `out`); an old one is ignored.
    pub(super) fn on_heartbeat(
        &mut self,
        author: Option<PeerId>,
        data: &[u8],
        now: Instant,
        out: &mut Vec<Output>,
    ) -> HeartbeatNews {
        let (a, hb) = match (author, wire::decode_heartbeat(data)) {
            (Some(a), Ok(hb)) => (a, hb),
            (Some(a), Err(e)) => {
                // Malformed heartbeats count towards the rate too (only the author can have
                // signed them): past it they are refused unread, the author named once.
                if let RateVerdict::Over { first } = self.over_rate(a, now) {
                    return HeartbeatNews::OverRate { peer: a, first };
                }
                let why = e.to_string();
                tracing::warn!(peer = %a, "rejected a heartbeat: {why}");
                out.push(Output::Offence { peer: a, why });
                return HeartbeatNews::Malformed;
            }
            (None, _) => return HeartbeatNews::Malformed,
        };
        if !self.take_seq(a, hb.seq, now) {
            return HeartbeatNews::Old;
        }
        // Counted only now: a replay of the author's old heartbeats (by anyone) must not use
        // up its rate, or its own next ones would be refused and it punished.
        match self.over_rate(a, now) {
            RateVerdict::Within => {}
            RateVerdict::Over { first } => return HeartbeatNews::OverRate { peer: a, first },
            RateVerdict::Untracked => return HeartbeatNews::Untracked,
        }
        if hb.leaving {
            return HeartbeatNews::Leaving {
                peer: a,
                round: hb.round,
            };
        }
        let member = self.members.contains(&a);
        if self.heard.len() < PER_PEER_CAP || member {
            self.heard.insert(a, hb.clone());
        }
        HeartbeatNews::Heard {
            peer: a,
            heartbeat: hb,
            member,
            neighbour: self.neighbours.contains(&a),
        }
    }

    /// Takes a token from `author`'s heartbeat bucket (see [`RateVerdict`]).
    fn over_rate(&mut self, author: PeerId, now: Instant) -> RateVerdict {
        let known = self.members.contains(&author) || self.heartbeat_rate.contains_key(&author);
        if !known && self.heartbeat_rate.len() >= PER_PEER_CAP {
            // Full: authors that are not members and have sent nothing for as long as their
            // bucket takes to refill make room (one coming back has a burst, as before).
            let members = &self.members;
            let refill = Duration::from_secs_f64(HEARTBEAT_BURST / HEARTBEAT_RATE);
            self.heartbeat_rate.retain(|p, (bucket, _)| {
                members.contains(p) || now.saturating_duration_since(bucket.last_taken()) < refill
            });
            if self.heartbeat_rate.len() >= PER_PEER_CAP {
                return RateVerdict::Untracked;
            }
        }
        let (bucket, refusing) = self
            .heartbeat_rate
            .entry(author)
            .or_insert_with(|| (TokenBucket::full(HEARTBEAT_BURST, now), false));
        if bucket.take(HEARTBEAT_RATE, HEARTBEAT_BURST, now) {
            *refusing = false;
            RateVerdict::Within
        } else {
            let first = !*refusing;
            *refusing = true;
            RateVerdict::Over { first }
        }
    }

    /// Whether heartbeat number `seq` of `author`'s is newer than the last taken from it
    /// within [`REPLAY_MEMORY`]; if so, it is the last taken now.
    fn take_seq(&mut self, author: PeerId, seq: u64, now: Instant) -> bool {
        let old = self.last_seq.get(&author).is_some_and(|&(last, at)| {
            seq <= last && now.saturating_duration_since(at) < REPLAY_MEMORY
        });
        if old {
            return false;
        }
        let member = self.members.contains(&author);
        if self.last_seq.len() < PER_PEER_CAP || member || self.last_seq.contains_key(&author) {
            self.last_seq.insert(author, (seq, now));
        }
        true
    }

    /// Whether `peer` is a member now.
    pub(super) fn is_member(&self, peer: &PeerId) -> bool {
        self.members.contains(peer)
    }

    /// Whether no other member of the run is known.
    pub(super) fn is_alone(&self) -> bool {
        self.members.is_empty()
    }

    /// The neighbours now.
    pub(super) fn neighbours(&self) -> &BTreeSet<PeerId> {
        &self.neighbours
    }

    /// The members now.
    pub(super) fn members(&self) -> &BTreeSet<PeerId> {
        &self.members
    }

    /// The update topic of the run for `peer`.
    pub(super) fn update_topic(&self, peer: &PeerId) -> String {
        super::update_topic(&self.run_id, peer)
    }

    /// Peers whose heartbeats are kept.
    pub(super) fn heard_len(&self) -> usize {
        self.heard.len()
    }

    /// Fills the members, neighbours and heard progress of `status`, peers named as strings.
    pub(super) fn render(&self, status: &mut super::MeshStatus) {
        status.members = self.members.iter().copied().collect();
        status.neighbours = self.neighbours.iter().map(|p| p.to_string()).collect();
        status.progress = self
            .heard
            .iter()
            .map(|(p, hb)| (p.to_string(), hb.clone()))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: usize) -> Vec<PeerId> {
        let mut v: Vec<PeerId> = (0..n).map(|_| PeerId::random()).collect();
        v.sort();
        v
    }

    fn membership(synchronous: bool) -> (Membership, PeerId) {
        let me = PeerId::random();
        (Membership::new(me, "00aa", 2, synchronous, 7), me)
    }

    fn training(step: u64) -> Progress {
        Progress {
            phase: Phase::Training,
            step,
            ..Progress::default()
        }
    }

    fn in_round(round: u64) -> RoundsNews {
        RoundsNews {
            round: Some(round),
            needs_state: false,
            sitting_out: false,
            accused: None,
        }
    }

    /// A heartbeat at `step`, numbered by it.
    fn beat(step: u64, leaving: bool) -> Vec<u8> {
        wire::encode_heartbeat(&Heartbeat {
            step,
            leaving,
            seq: step,
            ..Heartbeat::default()
        })
    }

    fn decode(out: Option<Output>) -> Heartbeat {
        match out {
            Some(Output::Publish { data, .. }) => {
                wire::decode_heartbeat(&data).expect("a heartbeat")
            }
            other => panic!("no heartbeat: {other:?}"),
        }
    }

    #[test]
    fn a_nodes_own_id_never_makes_it_a_member() {
        let (mut m, me) = membership(false);
        assert!(m.peer_up(me, Instant::now()).is_empty());
        assert!(m.is_alone());
    }

    #[test]
    fn neighbours_are_degree_members_drawn_reproducibly_from_the_seed() {
        let now = Instant::now();
        let ps = peers(6);
        let draw = || {
            let mut m = Membership::new(ps[0], "00aa", 2, false, 7);
            for p in &ps[1..] {
                m.peer_up(*p, now);
            }
            m.neighbours().clone()
        };
        let a = draw();
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|p| ps[1..].contains(p)));
        assert_eq!(a, draw(), "the same seed draws the same neighbours");
    }

    #[test]
    fn a_new_neighbour_comes_with_the_step_it_was_last_heard_at() {
        let (mut m, _) = membership(false);
        let p = PeerId::random();
        let mut out = Vec::new();
        // Heard while not yet a member.
        m.on_heartbeat(Some(p), &beat(42, false), Instant::now(), &mut out);
        let changes = m.peer_up(p, Instant::now());
        assert_eq!(
            changes,
            vec![NeighbourChange::New {
                peer: p,
                last_step: Some(42)
            }]
        );
    }

    #[test]
    fn changes_list_the_gone_neighbours_before_the_new() {
        let now = Instant::now();
        let (mut m, _) = membership(false);
        let ps = peers(3);
        for p in &ps {
            m.peer_up(*p, now);
        }
        // Two of the three members are neighbours; one of them goes.
        let gone = *m.neighbours().iter().next().expect("a neighbour");
        let other = *ps
            .iter()
            .find(|p| !m.neighbours().contains(p))
            .expect("a member that is no neighbour");
        assert_eq!(
            m.drop(gone, now),
            vec![
                NeighbourChange::Gone(gone),
                NeighbourChange::New {
                    peer: other,
                    last_step: None
                }
            ]
        );
    }

    /// Neighbours stay a uniform sample of the members: the fifth member of a node keeping two
    /// neighbours takes a place with probability 2/5, the gone one listed first. (A healed
    /// partition's members come back as new members, and so get their share of places.)
    #[test]
    fn a_new_member_takes_a_neighbours_place_with_probability_degree_over_members() {
        let now = Instant::now();
        let ps = peers(5);
        let mut taken = 0;
        for seed in 0..2_000 {
            let mut m = Membership::new(PeerId::random(), "00aa", 2, false, seed);
            for p in &ps[..4] {
                m.peer_up(*p, now);
            }
            let before = m.neighbours().clone();
            let changes = m.peer_up(ps[4], now);
            assert_eq!(m.neighbours().len(), 2);
            if let [NeighbourChange::Gone(g), NeighbourChange::New { peer, .. }] = &changes[..] {
                assert!(before.contains(g) && *peer == ps[4]);
                taken += 1;
            } else {
                assert!(changes.is_empty(), "{changes:?}");
            }
        }
        let share = f64::from(taken) / 2_000.0;
        assert!((0.36..0.44).contains(&share), "{share}");
    }

    #[test]
    fn dropping_a_neighbour_refreshes_and_dropping_another_member_does_not() {
        let now = Instant::now();
        let mut m = Membership::new(PeerId::random(), "00aa", 1, false, 3);
        let ps = peers(3);
        for p in &ps {
            m.peer_up(*p, now);
        }
        let neighbour = *m.neighbours().iter().next().expect("one neighbour");
        let other = *ps
            .iter()
            .find(|p| **p != neighbour)
            .expect("another member");
        assert!(m.drop(other, now).is_empty());
        assert!(!m.is_member(&other));
        let changes = m.drop(neighbour, now);
        assert_eq!(changes[0], NeighbourChange::Gone(neighbour));
        assert_eq!(changes.len(), 2, "a member left to replace it: {changes:?}");
    }

    #[test]
    fn a_dropped_peers_heartbeat_is_forgotten() {
        let now = Instant::now();
        let (mut m, _) = membership(false);
        let p = PeerId::random();
        m.peer_up(p, now);
        m.on_heartbeat(Some(p), &beat(5, false), Instant::now(), &mut Vec::new());
        assert_eq!(m.heard_len(), 1);
        m.drop(p, now);
        assert_eq!(m.heard_len(), 0);
    }

    #[test]
    fn the_heartbeat_goes_out_on_its_period_with_a_rising_sequence() {
        let t0 = Instant::now();
        let (mut m, _) = membership(false);
        let p = training(3);
        let first = decode(m.tick_heartbeat(t0, &p, RoundsNews::default()));
        assert_eq!((first.step, first.seq), (3, 1));
        assert!(!first.in_rounds, "gossip mode has no rounds");
        assert!(m
            .tick_heartbeat(t0 + HEARTBEAT_EVERY / 2, &p, RoundsNews::default())
            .is_none());
        let second = decode(m.tick_heartbeat(t0 + HEARTBEAT_EVERY, &p, RoundsNews::default()));
        assert_eq!(second.seq, 2);
    }

    /// A peer that reconnects every 300 ms, a new member each time, pulls this node's next
    /// heartbeat forward each time; and its readiness may flap as fast. Whatever drives it,
    /// this node sends no faster than every peer reads one author's heartbeats
    /// ([`HEARTBEAT_RATE`], [`HEARTBEAT_BURST`]), so no peer finds it flooding and punishes it.
    /// (Pulled forward every time, it sent 3.3 a second, past the 2 its peers read: their
    /// penalties, then a ban of an honest node.)
    #[test]
    fn no_reconnecting_peer_drives_the_heartbeats_past_what_peers_read() {
        let t0 = Instant::now();
        let (mut m, _) = membership(true);
        let p = training(3);
        let flapper = PeerId::random();
        let mut reader = TokenBucket::full(HEARTBEAT_BURST, t0);
        let (mut sent, mut unread) = (0, 0);
        for tick in 0..1_200u64 {
            let now = t0 + Duration::from_millis(50 * tick);
            if m.tick_heartbeat(now, &p, RoundsNews::default()).is_some() {
                sent += 1;
                if !reader.take(HEARTBEAT_RATE, HEARTBEAT_BURST, now) {
                    unread += 1;
                }
            }
            // It comes back right after each heartbeat it pulled forward.
            if tick % 6 == 0 {
                m.drop(flapper, now);
                m.peer_up(flapper, now);
            }
        }
        assert_eq!(
            unread, 0,
            "{sent} heartbeats in 60 s, {unread} past what a peer reads"
        );
        assert!(
            sent >= 30,
            "{sent} heartbeats in 60 s: fewer than its period"
        );
    }

    #[test]
    fn in_a_synchronous_mode_readiness_and_a_new_member_bring_the_heartbeat_forward() {
        let t0 = Instant::now();
        let (mut m, _) = membership(true);
        let starting = Progress::default();
        assert!(!decode(m.tick_heartbeat(t0, &starting, RoundsNews::default())).in_rounds);
        // Training now: told at once, not a period later.
        let ready =
            decode(m.tick_heartbeat(t0 + Duration::from_millis(10), &training(0), in_round(1)));
        assert!(ready.in_rounds);
        assert_eq!(ready.round, Some(1));
        let t1 = t0 + Duration::from_millis(20);
        assert!(m
            .tick_heartbeat(t1, &training(0), RoundsNews::default())
            .is_none());
        m.peer_up(PeerId::random(), t1);
        assert!(m
            .tick_heartbeat(
                t1 + NEW_MEMBER_HEARTBEAT_AFTER / 2,
                &training(0),
                RoundsNews::default()
            )
            .is_none());
        assert!(m
            .tick_heartbeat(
                t1 + NEW_MEMBER_HEARTBEAT_AFTER,
                &training(0),
                RoundsNews::default()
            )
            .is_some());
    }

    /// A member that sits out of the rounds says at once that it is not ready, and that it
    /// is again once it comes back.
    #[test]
    fn sitting_out_says_not_ready_at_once() {
        let t0 = Instant::now();
        let (mut m, _) = membership(true);
        let news = |sitting_out| RoundsNews {
            round: Some(2),
            sitting_out,
            ..RoundsNews::default()
        };
        assert!(decode(m.tick_heartbeat(t0, &training(0), news(false))).in_rounds);
        let soon = t0 + Duration::from_millis(10);
        assert!(!decode(m.tick_heartbeat(soon, &training(0), news(true))).in_rounds);
        assert!(m.tick_heartbeat(soon, &training(0), news(true)).is_none());
        assert!(decode(m.tick_heartbeat(soon, &training(0), news(false))).in_rounds);
    }

    /// A `diloco` node that needs the members' state says so at once, and again when it
    /// no longer does: its ring's layout waits on the word.
    #[test]
    fn a_need_for_the_members_state_brings_the_heartbeat_forward() {
        let t0 = Instant::now();
        let (mut m, _) = membership(true);
        let news = |needs_state| RoundsNews {
            round: Some(2),
            needs_state,
            sitting_out: false,
            accused: None,
        };
        assert!(!decode(m.tick_heartbeat(t0, &training(0), news(false))).needs_state);
        let soon = t0 + Duration::from_millis(10);
        assert!(decode(m.tick_heartbeat(soon, &training(0), news(true))).needs_state);
        assert!(m.tick_heartbeat(soon, &training(0), news(true)).is_none());
        assert!(!decode(m.tick_heartbeat(soon, &training(0), news(false))).needs_state);
    }

    #[test]
    fn in_gossip_mode_a_new_member_waits_for_the_period() {
        let t0 = Instant::now();
        let (mut m, _) = membership(false);
        m.tick_heartbeat(t0, &training(0), RoundsNews::default());
        m.peer_up(PeerId::random(), t0);
        assert!(m
            .tick_heartbeat(
                t0 + NEW_MEMBER_HEARTBEAT_AFTER,
                &training(0),
                RoundsNews::default()
            )
            .is_none());
    }

    #[test]
    fn a_leaving_heartbeat_says_so_and_is_in_no_round() {
        let (mut m, _) = membership(true);
        let leaving = m.leaving_heartbeat(&training(9), in_round(4));
        let Output::Publish { data, .. } = &leaving else {
            panic!("a heartbeat: {leaving:?}");
        };
        let data = data.clone();
        let hb = decode(Some(leaving));
        assert!(hb.leaving && !hb.in_rounds);
        let mut out = Vec::new();
        let p = PeerId::random();
        assert_eq!(
            m.on_heartbeat(Some(p), &data, Instant::now(), &mut out),
            HeartbeatNews::Leaving {
                peer: p,
                round: Some(4)
            }
        );
        assert!(out.is_empty());
    }

    #[test]
    fn a_malformed_heartbeat_is_an_offence_only_when_its_author_is_known() {
        let (mut m, _) = membership(false);
        let mut out = Vec::new();
        assert_eq!(
            m.on_heartbeat(None, b"junk", Instant::now(), &mut out),
            HeartbeatNews::Malformed
        );
        assert!(out.is_empty());
        let p = PeerId::random();
        assert_eq!(
            m.on_heartbeat(Some(p), b"junk", Instant::now(), &mut out),
            HeartbeatNews::Malformed
        );
        assert!(matches!(&out[..], [Output::Offence { peer, .. }] if *peer == p));
    }

    #[test]
    fn heartbeats_of_strangers_stop_at_the_cap_but_members_are_always_kept() {
        let now = Instant::now();
        let (mut m, _) = membership(false);
        let mut out = Vec::new();
        for _ in 0..PER_PEER_CAP + 10 {
            m.on_heartbeat(
                Some(PeerId::random()),
                &beat(1, false),
                Instant::now(),
                &mut out,
            );
        }
        assert_eq!(m.heard_len(), PER_PEER_CAP);
        let member = PeerId::random();
        m.peer_up(member, now);
        m.on_heartbeat(Some(member), &beat(1, false), Instant::now(), &mut out);
        assert_eq!(m.heard_len(), PER_PEER_CAP + 1);
    }

    #[test]
    fn heartbeats_beyond_their_authors_rate_are_refused_and_named_once_a_run() {
        let t0 = Instant::now();
        let (mut m, _) = membership(false);
        let p = PeerId::random();
        m.peer_up(p, t0);
        let mut out = Vec::new();
        let mut seq = 0;
        let mut next = |m: &mut Membership, at: Instant, out: &mut Vec<Output>| {
            seq += 1;
            m.on_heartbeat(Some(p), &beat(seq, false), at, out)
        };
        // An honest author for ten minutes: one every HEARTBEAT_EVERY, and every minute a
        // few at once (news for the rounds, new members). None is refused.
        for i in 0..300u32 {
            let at = t0 + HEARTBEAT_EVERY * i;
            let extra = if i % 30 == 0 { 5 } else { 0 };
            for _ in 0..=extra {
                assert!(
                    matches!(next(&mut m, at, &mut out), HeartbeatNews::Heard { .. }),
                    "an honest heartbeat refused at {i}"
                );
            }
        }
        // Its old heartbeats replayed by anyone, many at once, use up none of its rate.
        let replayed = t0 + HEARTBEAT_EVERY * 300;
        for old in 1..=100 {
            assert_eq!(
                m.on_heartbeat(Some(p), &beat(old, false), replayed, &mut out),
                HeartbeatNews::Old
            );
        }
        assert!(matches!(
            next(&mut m, replayed, &mut out),
            HeartbeatNews::Heard { .. }
        ));
        // A flood of 100 at once: the burst is read, the rest refused, the first says so.
        let flood = t0 + HEARTBEAT_EVERY * 301;
        let news: Vec<HeartbeatNews> = (0..100).map(|_| next(&mut m, flood, &mut out)).collect();
        let heard = news
            .iter()
            .filter(|n| matches!(n, HeartbeatNews::Heard { .. }))
            .count();
        assert_eq!(heard, HEARTBEAT_BURST as usize);
        let refused: Vec<bool> = news
            .iter()
            .filter_map(|n| match n {
                HeartbeatNews::OverRate { peer, first } if *peer == p => Some(*first),
                _ => None,
            })
            .collect();
        assert_eq!(refused.len(), 100 - HEARTBEAT_BURST as usize);
        assert_eq!(refused.iter().filter(|f| **f).count(), 1);
        assert!(refused[0]);
        // The rate refills: a heartbeat a few seconds later is read again.
        assert!(matches!(
            next(&mut m, flood + HEARTBEAT_EVERY * 2, &mut out),
            HeartbeatNews::Heard { .. }
        ));
        assert!(out.is_empty(), "membership names no offence itself");
    }

    #[test]
    fn an_old_heartbeat_replayed_tells_nothing_while_its_author_is_heard() {
        let now = Instant::now();
        let (mut m, _) = membership(false);
        let p = PeerId::random();
        m.peer_up(p, now);
        let mut out = Vec::new();
        let goodbye = beat(5, true);
        assert!(matches!(
            m.on_heartbeat(Some(p), &beat(10, false), now, &mut out),
            HeartbeatNews::Heard { .. }
        ));
        // An earlier goodbye replayed, and the last heartbeat again: nothing.
        for old in [&goodbye, &beat(10, false)] {
            assert_eq!(
                m.on_heartbeat(Some(p), old, now, &mut out),
                HeartbeatNews::Old
            );
        }
        assert!(
            out.is_empty(),
            "no offence: gossip may deliver out of order"
        );
        let later = now + REPLAY_MEMORY / 2;
        assert!(matches!(
            m.on_heartbeat(Some(p), &beat(11, false), later, &mut out),
            HeartbeatNews::Heard { .. }
        ));
        // Kept while p is a member; once it is gone and unheard for REPLAY_MEMORY, a
        // goodbye of its says what is true anyway.
        m.drop(p, later);
        m.refresh(later + REPLAY_MEMORY);
        assert!(matches!(
            m.on_heartbeat(Some(p), &goodbye, later + REPLAY_MEMORY, &mut out),
            HeartbeatNews::Leaving { .. }
        ));
    }

    #[test]
    fn a_restarted_nodes_heartbeats_number_on_above_its_previous_runs() {
        let me = PeerId::random();
        let seq_of = |out: Output| decode(Some(out)).seq;
        let mut first = Membership::new(me, "00aa", 2, false, 7).numbering_from(1_000);
        let mut last = 0;
        for _ in 0..10_000 {
            last = seq_of(first.leaving_heartbeat(&training(1), RoundsNews::default()));
        }
        let mut second = Membership::new(me, "00aa", 2, false, 7).numbering_from(1_001);
        let next = seq_of(second.leaving_heartbeat(&training(1), RoundsNews::default()));
        assert!(next > last, "{next} after {last}");
    }
}
