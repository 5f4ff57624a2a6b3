//! The hops this node holds before it takes them: those of attempts it has not reached yet
//! and those of the running attempt not taken yet, within a count and a size in values, and
//! the hops still coming in pieces ([`super::pieces`]). When full, the sender holding the most gives
//! way, its oldest hop first: a peer flooding hops of later rounds evicts only its own, and an
//! honest member's part waiting for the next round stays. What a hop means is `Rounds`'
//! business (`hops`); this holds them.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use libp2p::PeerId;

use super::pieces::{Pieces, Taken};
use super::{Hop, HopKey, INBOX_CAP, INBOX_VALUES};
use crate::wire::RingMessage;

/// See the module docs.
#[derive(Debug)]
pub(super) struct Inbox {
    hops: BTreeMap<HopKey, Hop>,
    /// The most values the hops hold together ([`INBOX_VALUES`], or the model's largest hop).
    max_values: usize,
    /// Hops whose pieces are still coming.
    pieces: Pieces,
}

impl Inbox {
    /// An inbox holding at most `max_values` values, its pieces cut at `piece_bytes`.
    pub(super) fn new(piece_bytes: usize, max_values: usize) -> Inbox {
        Inbox {
            hops: BTreeMap::new(),
            max_values,
            pieces: Pieces::new(piece_bytes, max_values.saturating_mul(4)),
        }
    }

    /// The default bound, [`INBOX_VALUES`].
    pub(super) fn with_default_bound(piece_bytes: usize) -> Inbox {
        Inbox::new(piece_bytes, INBOX_VALUES)
    }

    /// A piece of a hop: kept, or the whole hop once its last piece came.
    pub(super) fn take_piece(
        &mut self,
        from: PeerId,
        msg: RingMessage,
        now: Instant,
    ) -> Result<Taken, String> {
        self.pieces.take(from, msg, now)
    }

    /// Keeps a hop, within [`INBOX_CAP`] hops and the bound in values: when full, a hop of
    /// the sender holding the most gives way ([`Inbox::crowding_hop`]); one larger than the
    /// whole bound is not kept.
    pub(super) fn keep(&mut self, key: HopKey, hop: Hop) {
        if hop.1.len() > self.max_values {
            return;
        }
        self.hops.remove(&key);
        let mut held: usize = self.hops.values().map(|h| h.1.len()).sum();
        while self.hops.len() >= INBOX_CAP || held + hop.1.len() > self.max_values {
            match self.crowding_hop(key.3).and_then(|k| self.hops.remove(&k)) {
                Some(old) => held -= old.1.len(),
                None => break,
            }
        }
        self.hops.insert(key, hop);
    }

    /// The hop that gives way for one `sender` adds to a full inbox: the oldest (round, then
    /// attempt) of the sender holding the most hops, `sender` counted with the one it adds;
    /// among senders holding as many, the oldest hop of theirs. A node left behind still keeps
    /// each sender's newest rounds, which it needs to catch up.
    fn crowding_hop(&self, sender: PeerId) -> Option<HopKey> {
        let mut held: HashMap<PeerId, usize> = HashMap::new();
        for k in self.hops.keys() {
            *held.entry(k.3).or_default() += 1;
        }
        *held.entry(sender).or_default() += 1;
        let most = held.values().copied().max()?;
        self.hops.keys().find(|k| held[&k.3] == most).copied()
    }

    /// Takes a hop out.
    pub(super) fn remove(&mut self, key: &HopKey) -> Option<Hop> {
        self.hops.remove(key)
    }

    /// The hops' places, in order (round, attempt, hop, sender).
    pub(super) fn keys(&self) -> impl DoubleEndedIterator<Item = &HopKey> + Clone {
        self.hops.keys()
    }

    /// Keeps only the hops whose places `keep` accepts.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&HopKey) -> bool) {
        self.hops.retain(|k, _| keep(k));
    }

    /// Drops every hop held.
    pub(super) fn clear(&mut self) {
        self.hops.clear();
    }

    /// Whether a hop is held at `key`.
    #[cfg(test)]
    pub(super) fn contains_key(&self, key: &HopKey) -> bool {
        self.hops.contains_key(key)
    }

    /// The hops held.
    #[cfg(test)]
    pub(super) fn values(&self) -> impl Iterator<Item = &Hop> {
        self.hops.values()
    }

    /// Hops held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.hops.len()
    }

    /// Whether none is held.
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.hops.is_empty()
    }

    /// Whether the hops and pieces held are within their bounds, in count and in values.
    #[cfg(test)]
    pub(super) fn within_bounds(&self) -> bool {
        let values: usize = self.hops.values().map(|(_, v, _)| v.len()).sum();
        self.hops.len() <= INBOX_CAP
            && values <= self.max_values
            && self.pieces.held_bytes() <= self.max_values * 4
    }
}
