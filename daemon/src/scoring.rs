//! Gossipsub v1.1 peer scoring tuned for p2ptrain's topics, and the ban that follows a
//! graylisting.
//!
//! Our topics are unlike a blockchain's: every node publishes its updates on a topic of its
//! own, a few times a second at most and far less on a slow box, and heartbeats once a second.
//! So the scores that reward or punish delivery *rates* (gossipsub's P3 and P3b) would punish an
//! honest slow box and are off. What counts is invalid messages (P4): every update the node
//! rejects costs its sender, quadratically in the (slowly decaying) count, so one honest
//! mistake barely shows while a peer that keeps sending garbage is graylisted within a handful
//! of messages. Small positive terms (time in the mesh, first deliveries) are capped well
//! below what a single rejection burst takes away. IP colocation is not penalised: a home lab
//! often sits behind one address. Nor is what the network does to a peer (expired sends on a
//! slow or cut link), and a reconnect's burst of grafts is tolerated: the partition test
//! showed libp2p's defaults banning every honest peer when a split healed.
//!
//! What the node itself finds wrong outside gossip's own rejections, refused full-sync replies
//! (see [`crate::sync_guard`]), ring hops that break a round's rules and heartbeats past their
//! author's rate (which only this node's count makes wrong: rejected, they would cost every
//! honest peer that relayed one), is punished through the application-specific score (P5),
//! which this module also shapes: a decaying count of such penalties per peer ([`Penalties`]),
//! squared like P4, so repeated penalties lead to the same graylisting and ban.

use std::time::Duration;

use libp2p::gossipsub::{PeerScoreParams, PeerScoreThresholds, TopicScoreParams};

/// Below this score gossipsub ignores everything a peer sends (its graylist); the node also
/// disconnects and bans such a peer for [`BAN_FOR`].
pub const GRAYLIST_THRESHOLD: f64 = -80.0;
/// Below this score no gossip about messages is exchanged with the peer.
pub const GOSSIP_THRESHOLD: f64 = -10.0;
/// Below this score the node does not publish to the peer.
pub const PUBLISH_THRESHOLD: f64 = -40.0;
/// How long a graylisted peer is refused after it is disconnected.
pub const BAN_FOR: Duration = Duration::from_secs(600);

/// Weight of the squared count of invalid messages (P4).
const INVALID_WEIGHT: f64 = -1.0;
/// Per-second decay of the invalid-message count: a half-life of about 69 s, so a peer must
/// keep behaving for minutes to undo a burst of rejections.
const INVALID_DECAY: f64 = 0.99;
/// Weight of each first delivery of a valid message (P2) and its cap: at most +5.
const FIRST_DELIVERY_WEIGHT: f64 = 0.5;
const FIRST_DELIVERY_CAP: f64 = 10.0;
/// Behaviour penalty (P7: grafting during a prune backoff, broken gossip promises): its
/// weight, the count tolerated, and its per-second decay. A node that reconnects after a
/// partition or a restart regrafts every topic it shares with us at once (heartbeats plus one
/// update topic per neighbour), all within gossipsub's prune backoff. libp2p's default
/// (weight -10, nothing tolerated) took honest peers to -320 and got them banned when a
/// partition healed; a burst that size is tolerated here, a peer that keeps at it is not.
const BEHAVIOUR_WEIGHT: f64 = -1.0;
const BEHAVIOUR_TOLERATED: f64 = 8.0;
const BEHAVIOUR_DECAY: f64 = 0.9;
/// Weight of seconds spent in the topic's mesh (P1) and its cap: at most +3.
const TIME_IN_MESH_WEIGHT: f64 = 0.01;
const TIME_IN_MESH_CAP: f64 = 300.0;
/// Weight of the application-specific score (P5), which is the squared (decaying) count of a
/// peer's penalties, refused full-sync replies, bad ring hops and over-rate heartbeats it
/// sent (see [`Penalties`]): one
/// costs 2, so an honest outlier refused once or twice stays above the gossip threshold (-8
/// at two); seven within a minute take even a peer with the best positive score on two topics
/// below the graylist threshold, and it is banned like a peer whose messages are rejected.
/// Syncs and rounds are rarer than updates, so fewer penalties are needed than rejections.
pub const PENALTY_WEIGHT: f64 = -2.0;
/// Per-second decay of the penalty count: the same half-life (about 69 s) as rejections.
pub const PENALTY_DECAY: f64 = 0.99;
/// Below this a decayed penalty count is forgotten.
const PENALTY_FORGET: f64 = 0.01;

/// The most a well-behaved peer can score on one topic: what rejections must outweigh.
pub fn max_positive_topic_score() -> f64 {
    FIRST_DELIVERY_WEIGHT * FIRST_DELIVERY_CAP + TIME_IN_MESH_WEIGHT * TIME_IN_MESH_CAP
}

/// Rejections within a short time that take even a peer with the best positive score below
/// the graylist threshold.
pub fn rejections_to_graylist() -> u32 {
    let needed = (max_positive_topic_score() - GRAYLIST_THRESHOLD) / -INVALID_WEIGHT;
    needed.sqrt().floor() as u32 + 1
}

/// Penalties (refused full syncs, bad ring hops, over-rate heartbeats) in a short time that take
/// a peer with the best positive score on two topics (heartbeats and its own updates) below the
/// graylist threshold.
pub fn penalties_to_graylist() -> u32 {
    let needed = (2.0 * max_positive_topic_score() - GRAYLIST_THRESHOLD) / -PENALTY_WEIGHT;
    needed.sqrt().floor() as u32 + 1
}

/// The decaying count of penalties per peer (refused full-sync replies, ring hops that break
/// a round's rules, over-rate heartbeats), turned into gossipsub's application-specific score
/// (P5, weighted by [`PENALTY_WEIGHT`]). gossipsub keeps P5 as the application sets it and
/// never decays it, so the decay lives here; the network's event loop owns one and calls
/// [`Penalties::decay`] once a second.
#[derive(Debug, Clone)]
pub struct Penalties<K> {
    counts: std::collections::HashMap<K, f64>,
}

impl<K> Default for Penalties<K> {
    fn default() -> Self {
        Penalties {
            counts: std::collections::HashMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone> Penalties<K> {
    /// Counts one penalty of `peer`; answers its new application score.
    pub fn add(&mut self, peer: K) -> f64 {
        let c = self.counts.entry(peer).or_insert(0.0);
        *c += 1.0;
        *c * *c
    }

    /// Decays every count by one second's worth; answers each peer's new application score
    /// (0 for a count just forgotten).
    pub fn decay(&mut self) -> Vec<(K, f64)> {
        let mut out = Vec::with_capacity(self.counts.len());
        self.counts.retain(|peer, c| {
            *c *= PENALTY_DECAY;
            let keep = *c >= PENALTY_FORGET;
            out.push((peer.clone(), if keep { *c * *c } else { 0.0 }));
            keep
        });
        out
    }
}

/// Parameters for every topic a node subscribes to (updates and heartbeats alike).
pub fn topic_params() -> TopicScoreParams {
    TopicScoreParams {
        topic_weight: 1.0,
        time_in_mesh_weight: TIME_IN_MESH_WEIGHT,
        time_in_mesh_quantum: Duration::from_secs(1),
        time_in_mesh_cap: TIME_IN_MESH_CAP,
        first_message_deliveries_weight: FIRST_DELIVERY_WEIGHT,
        first_message_deliveries_decay: 0.9,
        first_message_deliveries_cap: FIRST_DELIVERY_CAP,
        // Delivery-rate penalties (P3, P3b) would punish an honest slow publisher: off.
        mesh_message_deliveries_weight: 0.0,
        mesh_message_deliveries_decay: 0.5,
        mesh_message_deliveries_cap: 100.0,
        mesh_message_deliveries_threshold: 1.0,
        mesh_message_deliveries_window: Duration::from_millis(10),
        mesh_message_deliveries_activation: Duration::from_secs(5),
        mesh_failure_penalty_weight: 0.0,
        mesh_failure_penalty_decay: 0.5,
        invalid_message_deliveries_weight: INVALID_WEIGHT,
        invalid_message_deliveries_decay: INVALID_DECAY,
    }
}

/// Peer-level parameters; topic parameters are added as the node subscribes.
pub fn peer_params() -> PeerScoreParams {
    PeerScoreParams {
        // Home labs often share one public address; colocation says nothing about honesty.
        ip_colocation_factor_weight: 0.0,
        decay_interval: Duration::from_secs(1),
        // Scores of disconnected peers are kept for the ban's length, so a banned peer that
        // comes back is still known for what it did.
        retain_score: BAN_FOR,
        behaviour_penalty_weight: BEHAVIOUR_WEIGHT,
        behaviour_penalty_threshold: BEHAVIOUR_TOLERATED,
        behaviour_penalty_decay: BEHAVIOUR_DECAY,
        // gossipsub's slow-peer penalty counts messages that expired in our own send queue to
        // the peer. A partition or a slow link fills that queue through no fault of the
        // peer's: with libp2p's default weight, 30 s of partition left ~1,000 expired messages
        // and got honest peers banned the moment the partition healed. Off.
        slow_peer_weight: 0.0,
        // P5 carries refused full syncs, bad ring hops and over-rate heartbeats (see
        // [`Penalties`]); nothing else
        // sets it.
        app_specific_weight: PENALTY_WEIGHT,
        ..PeerScoreParams::default()
    }
}

/// The thresholds that go with [`peer_params`].
pub fn thresholds() -> PeerScoreThresholds {
    PeerScoreThresholds {
        gossip_threshold: GOSSIP_THRESHOLD,
        publish_threshold: PUBLISH_THRESHOLD,
        graylist_threshold: GRAYLIST_THRESHOLD,
        accept_px_threshold: 10.0,
        opportunistic_graft_threshold: 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid_score(rejections: f64) -> f64 {
        INVALID_WEIGHT * rejections * rejections
    }

    #[test]
    fn parameters_are_valid() {
        topic_params().validate().expect("topic params");
        peer_params().validate().expect("peer params");
        thresholds().validate().expect("thresholds");
    }

    #[test]
    fn a_few_honest_mistakes_stay_above_the_gossip_threshold() {
        // Three rejections in quick succession, no positive score at all.
        assert!(invalid_score(3.0) > GOSSIP_THRESHOLD);
    }

    fn behaviour_score(count: f64) -> f64 {
        let excess = (count - BEHAVIOUR_TOLERATED).max(0.0);
        BEHAVIOUR_WEIGHT * excess * excess
    }

    #[test]
    fn a_reconnect_regrafting_many_topics_costs_little() {
        // Heartbeats plus one update topic per neighbour, degree 4 each way: up to 9 grafts,
        // and one more for a retry, stay above the gossip threshold.
        assert_eq!(behaviour_score(8.0), 0.0);
        assert!(behaviour_score(11.0) > GOSSIP_THRESHOLD);
        assert!(behaviour_score(12.0) < GOSSIP_THRESHOLD);
    }

    #[test]
    fn a_peer_that_keeps_misbehaving_is_graylisted() {
        assert!(behaviour_score(18.0) < GRAYLIST_THRESHOLD);
    }

    #[test]
    fn a_burst_of_rejections_graylists_even_the_best_scored_peer() {
        let n = rejections_to_graylist();
        assert!(
            invalid_score(f64::from(n)) + max_positive_topic_score() < GRAYLIST_THRESHOLD,
            "{n}"
        );
        assert!(
            invalid_score(f64::from(n - 1)) + max_positive_topic_score() >= GRAYLIST_THRESHOLD,
            "{n} is not the least"
        );
        // A rogue is cut off within a dozen messages.
        assert!(n <= 12, "{n}");
    }

    /// What an application score adds to the peer's score (P5).
    fn p5(app_score: f64) -> f64 {
        PENALTY_WEIGHT * app_score
    }

    #[test]
    fn one_or_two_refused_syncs_of_an_honest_outlier_cost_little() {
        let mut r = Penalties::default();
        assert_eq!(p5(r.add(1u8)), -2.0);
        assert!(p5(r.add(1u8)) > GOSSIP_THRESHOLD);
        assert!(p5(r.add(1u8)) < GOSSIP_THRESHOLD);
    }

    #[test]
    fn repeated_refused_syncs_graylist_even_the_best_scored_peer() {
        let n = penalties_to_graylist();
        let best = 2.0 * max_positive_topic_score();
        let mut r = Penalties::default();
        let mut score = 0.0;
        for _ in 0..n {
            score = r.add("rogue");
        }
        assert!(p5(score) + best < GRAYLIST_THRESHOLD, "{n}");
        assert!(
            p5(f64::from((n - 1) * (n - 1))) + best >= GRAYLIST_THRESHOLD,
            "{n} is not the least"
        );
        assert!(n <= 8, "{n}");
    }

    #[test]
    fn refusal_counts_decay_per_peer_and_are_forgotten() {
        let mut r = Penalties::default();
        r.add(1u8);
        r.add(1u8);
        r.add(2u8);
        let mut scores: Vec<(u8, f64)> = r.decay();
        scores.sort_by_key(|(p, _)| *p);
        assert!((scores[0].1 - (2.0 * PENALTY_DECAY).powi(2)).abs() < 1e-9);
        assert!((scores[1].1 - PENALTY_DECAY.powi(2)).abs() < 1e-9);
        // Half-life of about 69 s; after ten minutes a single refusal is forgotten.
        for _ in 0..600 {
            r.decay();
        }
        assert!(r.decay().is_empty());
    }

    #[test]
    fn the_score_recovers_slowly_and_the_ban_outlasts_it() {
        // From the graylisting count, decayed once a second, how long until the peer would be
        // above the graylist threshold again (with no positive score).
        let mut count = f64::from(rejections_to_graylist());
        let mut secs = 0;
        while invalid_score(count) < GRAYLIST_THRESHOLD {
            count *= INVALID_DECAY;
            secs += 1;
        }
        assert!(secs >= 10, "{secs}");
        assert!(BAN_FOR.as_secs() > 10 * secs, "{secs}");
    }
}
