//! How much one peer may ask of this node's bulk service: at most [`SERVING_PER_PEER`] of its
//! requests served at once, and the costly kinds (a state manifest freezes a snapshot, a
//! parameter request copies and encodes the whole model) at most [`COSTLY_PER_SEC`] a second
//! with a burst of [`COSTLY_BURST`]. The mesh actor asks before it serves; a request over a
//! limit is declined ("busy"), which no honest asker punishes (a sync is skipped, a fetch
//! is unavailable, a joiner drops that donor for the rest of its download: an honest one
//! keeps at most its window of 4 chunk requests open, half the share).
//!
//! Why per peer: the actor's task set ([`crate::mesh::TASK_CAP`]) bounds the node's work as a
//! whole, but one member asking as fast as it can held every slot of it, so the joiners'
//! chunks, the neighbours' syncs and this node's own fetches were declined as busy for as long
//! as it went on. With a share per peer, a flooding member holds at most its share.
//!
//! The limits sit above what honest members ask: a joiner keeps
//! [`crate::transfer::WINDOW_PER_SOURCE`] chunk requests open at a donor, a neighbour has one
//! sync under way at a time, and a manifest is asked once per download. Remembered peers are
//! bounded ([`PEERS_KEPT`]): a peer with nothing being served and a full bucket again is
//! forgotten first, and one past a full map is served untracked (the task set still bounds it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::PeerId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::guard::TokenBucket;
use crate::wire::BulkRequest;

/// Requests of one peer served at once, at most: a joiner's window of chunk requests at a
/// donor, with room for a manifest, a sync and fetches of large updates beside it.
pub const SERVING_PER_PEER: usize = 2 * crate::transfer::WINDOW_PER_SOURCE;
/// Costly requests (manifests, parameters) of one peer served per second, sustained.
pub const COSTLY_PER_SEC: f64 = 10.0;
/// Costly requests one peer may ask in a burst above [`COSTLY_PER_SEC`].
pub const COSTLY_BURST: f64 = 20.0;
/// Peers whose limits are remembered, at most.
pub const PEERS_KEPT: usize = 1024;

/// Why a request was declined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverLimit {
    /// The peer has [`SERVING_PER_PEER`] requests being served already.
    Concurrent,
    /// The peer asks for manifests or parameters faster than [`COSTLY_PER_SEC`].
    Rate,
}

impl std::fmt::Display for OverLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OverLimit::Concurrent => write!(
                f,
                "busy: {SERVING_PER_PEER} of your requests are being served already"
            ),
            OverLimit::Rate => write!(
                f,
                "busy: you ask for states or parameters faster than {COSTLY_PER_SEC} a second"
            ),
        }
    }
}

/// A request allowed to be served: its slot of the peer's share, given back when dropped
/// (the serving task holds it until its answer is sent). `None` for an untracked peer.
#[derive(Debug)]
pub struct ServeSlot(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// One peer's share: its slots, and its bucket of costly requests.
#[derive(Debug)]
struct Share {
    slots: Arc<Semaphore>,
    costly: TokenBucket,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct ServeLimits {
    peers: HashMap<PeerId, Share>,
    /// Requests declined over a limit, all peers together.
    declined: u64,
}

/// Whether `request` is of a costly kind (see the module docs).
pub fn is_costly(request: &BulkRequest) -> bool {
    matches!(request, BulkRequest::Params | BulkRequest::StateManifest)
}

impl ServeLimits {
    /// Whether `peer` may have a request (`costly` or not) served at `now`: its slot, or why
    /// not. A decline is counted; answers, beside it, whether it is worth a log line (the
    /// node's first decline, then each time its count of them doubles).
    pub fn admit(
        &mut self,
        peer: PeerId,
        costly: bool,
        now: Instant,
    ) -> Result<ServeSlot, (OverLimit, bool)> {
        if !self.peers.contains_key(&peer) && self.peers.len() >= PEERS_KEPT {
            let refill = Duration::from_secs_f64(COSTLY_BURST / COSTLY_PER_SEC);
            self.peers.retain(|_, share| {
                share.slots.available_permits() < SERVING_PER_PEER
                    || now.saturating_duration_since(share.costly.last_taken()) < refill
            });
            if self.peers.len() >= PEERS_KEPT {
                return Ok(ServeSlot(None));
            }
        }
        let share = self.peers.entry(peer).or_insert_with(|| Share {
            slots: Arc::new(Semaphore::new(SERVING_PER_PEER)),
            costly: TokenBucket::full(COSTLY_BURST, now),
        });
        let verdict = match share.slots.clone().try_acquire_owned() {
            Err(_) => Err(OverLimit::Concurrent),
            Ok(permit) => {
                if costly && !share.costly.take(COSTLY_PER_SEC, COSTLY_BURST, now) {
                    Err(OverLimit::Rate)
                } else {
                    Ok(ServeSlot(Some(permit)))
                }
            }
        };
        verdict.map_err(|why| {
            self.declined += 1;
            (why, self.declined.is_power_of_two())
        })
    }

    /// Requests declined over a limit so far, all peers together.
    pub fn declined(&self) -> u64 {
        self.declined
    }

    /// Peers remembered now.
    pub fn tracked(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_gets_its_share_of_slots_and_each_comes_back_when_dropped() {
        let mut limits = ServeLimits::default();
        let (a, b) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        let mut held: Vec<ServeSlot> = (0..SERVING_PER_PEER)
            .map(|_| limits.admit(a, false, now).expect("within the share"))
            .collect();
        let over = limits.admit(a, false, now).expect_err("over the share");
        assert_eq!(over, (OverLimit::Concurrent, true));
        // Another peer is not held up by the first one's flood.
        let other = limits.admit(b, false, now).expect("another peer is served");
        drop(other);
        held.pop();
        limits.admit(a, false, now).expect("a slot came back");
        assert_eq!(limits.declined(), 1);
    }

    #[test]
    fn costly_requests_are_limited_in_rate_and_refill_with_time() {
        let mut limits = ServeLimits::default();
        let a = PeerId::random();
        let start = Instant::now();
        for _ in 0..COSTLY_BURST as usize {
            drop(limits.admit(a, true, start).expect("within the burst"));
        }
        assert_eq!(
            limits.admit(a, true, start).map(drop),
            Err((OverLimit::Rate, true))
        );
        // Cheap requests are not counted against the rate.
        drop(limits.admit(a, false, start).expect("a chunk is served"));
        let later = start + Duration::from_secs_f64(1.0 / COSTLY_PER_SEC);
        drop(limits.admit(a, true, later).expect("one token refilled"));
        assert_eq!(
            limits.admit(a, true, later).map(drop),
            Err((OverLimit::Rate, true)),
            "only one"
        );
        assert_eq!(limits.declined(), 2);
    }

    #[test]
    fn remembered_peers_are_bounded_and_idle_ones_are_forgotten_first() {
        let mut limits = ServeLimits::default();
        let start = Instant::now();
        let busy = PeerId::random();
        let _held = limits.admit(busy, false, start).expect("served");
        for _ in 1..PEERS_KEPT {
            drop(limits.admit(PeerId::random(), true, start).expect("served"));
        }
        assert_eq!(limits.tracked(), PEERS_KEPT);
        // Full, nobody idle long enough: a newcomer is served untracked.
        let slot = limits.admit(PeerId::random(), true, start).expect("served");
        assert!(slot.0.is_none());
        assert_eq!(limits.tracked(), PEERS_KEPT);
        // Once the buckets have refilled, the idle peers make room; the busy one stays.
        let later = start + Duration::from_secs_f64(COSTLY_BURST / COSTLY_PER_SEC);
        let slot = limits.admit(PeerId::random(), true, later).expect("served");
        assert!(slot.0.is_some());
        assert_eq!(limits.tracked(), 2);
        assert!(limits.peers.contains_key(&busy));
    }

    #[test]
    fn the_decline_says_which_limit() {
        assert!(OverLimit::Concurrent.to_string().starts_with("busy"));
        assert!(OverLimit::Rate.to_string().contains("a second"));
    }
}
