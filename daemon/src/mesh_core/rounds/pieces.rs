//! Hops in pieces: a hop whose values are larger than a request may carry
//! ([`crate::wire::RING_PIECE_BYTES`]) is cut into pieces by its sender
//! ([`RingMessage::into_pieces`]) and put together by its receiver ([`Pieces`]) before the
//! round sees it, so a share of a model of
//! any size travels in requests of a bounded size. Only the pieces themselves are checked
//! here (their place and length, and that the pieces of one hop agree on everything but their
//! bytes); the whole hop is judged as any other. Pure: the core feeds it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use libp2p::PeerId;
use serde_bytes::ByteBuf;

use super::ring::{AGGREGATE, PART};
use super::HopKey;
use crate::wire::{Piece, RingMessage};

/// A hop none of whose pieces came for this long is dropped: an honest sender sends a hop's
/// pieces one after the other, each within a request's timeout, and one that died part way
/// will not send the rest.
pub const PIECES_KEPT: Duration = Duration::from_secs(120);
/// Hops being put together at once, at most: a member receives a part from each other
/// member and an aggregate from each owner, a round or two at a time.
const PARTIAL_CAP: usize = 256;
/// Hops one sender may have under way to this node at once: an honest one sends it a part
/// and an aggregate an attempt, and may be an attempt or a round ahead.
const PARTIAL_PER_SENDER: usize = 4;

/// What became of a piece ([`Pieces::take`]).
#[derive(Debug, PartialEq)]
pub enum Taken {
    /// The hop is whole: the message was one, or its last piece came.
    Whole(RingMessage),
    /// A new piece of a hop, kept.
    Kept,
    /// Sent before, or no room for it: dropped.
    Dropped,
}

/// A hop some of whose pieces came.
#[derive(Debug)]
struct Partial {
    /// The first piece's [`head`]: every later piece must agree with it.
    head: RingMessage,
    /// The pieces' bytes, by index.
    got: Vec<Option<ByteBuf>>,
    /// Bytes held.
    bytes: usize,
    /// When its last piece came.
    since: Instant,
}

/// Hops being put together, bounded in count and in bytes, in all and for each sender (so
/// that one sender's pieces that never complete push out only its own); see the module docs.
#[derive(Debug)]
pub struct Pieces {
    /// Bytes every piece but a hop's last holds (the senders' [`RingMessage::into_pieces`] size).
    piece_bytes: usize,
    /// The most bytes of values an honest hop holds, and the most one sender's partial hops
    /// may hold together; all senders' together may hold twice that.
    hop_bytes: usize,
    held_bytes: usize,
    partial: BTreeMap<HopKey, Partial>,
}

impl Pieces {
    /// Pieces of `piece_bytes` bytes, of hops of at most `hop_bytes` bytes.
    pub fn new(piece_bytes: usize, hop_bytes: usize) -> Pieces {
        Pieces {
            piece_bytes: piece_bytes.max(4) / 4 * 4,
            hop_bytes,
            held_bytes: 0,
            partial: BTreeMap::new(),
        }
    }

    /// Bytes held in hops not complete yet.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Takes a message from `from`: a whole hop comes back as it is; a piece is kept, and the
    /// hop comes back whole once its last piece is in. `Err` says why a piece cannot be an
    /// honest sender's (a hop no ring has, a place or length [`RingMessage::into_pieces`] never gives): an
    /// offence of its sender. A piece whose header differs from the earlier pieces' of its
    /// hop starts the hop again (a sender that restarted into the same attempt sends another
    /// step). Room is made by dropping the sender's own oldest partial hops first, then the
    /// oldest of the sender holding the most; a piece there is still no room for is dropped
    /// (the attempt then stalls, and is retried), as the inbox drops its oldest hops.
    pub fn take(&mut self, from: PeerId, msg: RingMessage, now: Instant) -> Result<Taken, String> {
        let Piece { index, count } = msg.piece;
        if count == 1 && index == 0 {
            return Ok(Taken::Whole(msg));
        }
        if msg.hop != PART && msg.hop != AGGREGATE {
            return Err(format!(
                "ring hop piece of hop {}, which no ring has",
                msg.hop
            ));
        }
        let most = self.hop_bytes.div_ceil(self.piece_bytes).max(1);
        if count < 2 || index >= count || count as usize > most {
            return Err(format!(
                "ring hop piece {index} of {count}, where a hop has at most {most}"
            ));
        }
        let last = index + 1 == count;
        let len = msg.values.len();
        if (!last && len != self.piece_bytes) || (last && !(1..=self.piece_bytes).contains(&len)) {
            return Err(format!(
                "ring hop piece {index} of {count} of {len} bytes, where pieces are {} bytes",
                self.piece_bytes
            ));
        }
        self.drop_older_than(now);
        let key = (msg.round, msg.attempt, msg.hop, from);
        let head = msg.piece_head();
        match self.partial.get(&key) {
            Some(partial) if partial.head != head => self.remove(&key),
            // Sent twice: the first copy stands.
            Some(partial) if partial.got[index as usize].is_some() => return Ok(Taken::Dropped),
            _ => {}
        }
        if !self.make_room(key, len) {
            return Ok(Taken::Dropped);
        }
        let partial = self.partial.entry(key).or_insert_with(|| Partial {
            head,
            got: vec![None; count as usize],
            bytes: 0,
            since: now,
        });
        partial.bytes += len;
        partial.since = now;
        self.held_bytes += len;
        partial.got[index as usize] = Some(msg.values);
        if partial.got.iter().any(Option::is_none) {
            return Ok(Taken::Kept);
        }
        let Some(partial) = self.partial.remove(&key) else {
            return Ok(Taken::Dropped);
        };
        self.held_bytes -= partial.bytes;
        let mut values = Vec::with_capacity(partial.bytes);
        for bytes in partial.got.into_iter().flatten() {
            values.extend_from_slice(&bytes);
        }
        Ok(Taken::Whole(RingMessage {
            values: ByteBuf::from(values),
            piece: Piece::WHOLE,
            ..partial.head
        }))
    }

    fn drop_older_than(&mut self, now: Instant) {
        let mut freed = 0;
        self.partial.retain(|_, p| {
            let keep = now.saturating_duration_since(p.since) < PIECES_KEPT;
            if !keep {
                freed += p.bytes;
            }
            keep
        });
        self.held_bytes -= freed;
    }

    fn remove(&mut self, key: &HopKey) {
        let dropped = self.partial.remove(key).map_or(0, |p| p.bytes);
        self.held_bytes -= dropped;
    }

    /// Makes room for `len` more bytes of hop `key` (and for the hop itself, if new), never
    /// by dropping `key`: first the sender's own oldest partial hops give way, until it holds
    /// at most [`PARTIAL_PER_SENDER`] and one hop's bytes; then, while all hold more than
    /// twice that or [`PARTIAL_CAP`] hops, the oldest of the sender holding the most bytes.
    /// `false` where even then there is none.
    fn make_room(&mut self, key: HopKey, len: usize) -> bool {
        let from = key.3;
        let new = !self.partial.contains_key(&key);
        let own = self.partial.get(&key).map_or(0, |p| p.bytes);
        if own + len > self.hop_bytes {
            return false;
        }
        loop {
            let (count, bytes) = self.held_by(from);
            let over = (new && count >= PARTIAL_PER_SENDER) || bytes + len > self.hop_bytes;
            if !over {
                break;
            }
            let Some(oldest) = self.oldest_of(from, key) else {
                return false;
            };
            self.remove(&oldest);
        }
        loop {
            let full = new && self.partial.len() >= PARTIAL_CAP;
            if !full && self.held_bytes + len <= 2 * self.hop_bytes {
                return true;
            }
            let Some(largest) = self
                .partial
                .keys()
                .filter(|k| **k != key)
                .map(|k| k.3)
                .max_by_key(|peer| self.held_by(*peer).1)
            else {
                return false;
            };
            let Some(oldest) = self.oldest_of(largest, key) else {
                return false;
            };
            self.remove(&oldest);
        }
    }

    /// `sender`'s partial hop of the oldest round and attempt, other than `key`.
    fn oldest_of(&self, sender: PeerId, key: HopKey) -> Option<HopKey> {
        self.partial
            .keys()
            .find(|k| k.3 == sender && **k != key)
            .copied()
    }

    /// Partial hops from `from`, and their bytes.
    fn held_by(&self, from: PeerId) -> (usize, usize) {
        self.partial
            .iter()
            .filter(|(k, _)| k.3 == from)
            .fold((0, 0), |(n, b), (_, p)| (n + 1, b + p.bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hop(bytes: usize) -> RingMessage {
        RingMessage {
            round: 5,
            attempt: 2,
            members: 99,
            hop: 0,
            values: ByteBuf::from((0..bytes).map(|i| (i % 251) as u8).collect::<Vec<u8>>()),
            step: 700,
            encoding: crate::wire::ValueEncoding::F32,
            piece: Piece::WHOLE,
        }
    }

    fn peer() -> PeerId {
        PeerId::random()
    }

    /// Cut into pieces and taken in any order, a hop comes back bit for bit, once, when its
    /// last piece is in; a hop that fits one request is not cut.
    #[test]
    fn a_hop_cut_into_pieces_comes_back_whole_in_any_order() {
        let whole = hop(1000);
        let pieces = whole.clone().into_pieces(64);
        assert_eq!(pieces.len(), 16);
        assert!(pieces[..15].iter().all(|p| p.values.len() == 64));
        assert_eq!(pieces[15].values.len(), 1000 - 15 * 64);
        let (from, now) = (peer(), Instant::now());
        let mut pieces_in = Pieces::new(64, 4096);
        let mut back = Vec::new();
        for p in pieces.into_iter().rev() {
            if let Taken::Whole(m) = pieces_in.take(from, p, now).expect("honest pieces") {
                back.push(m);
            }
        }
        assert_eq!(back, vec![whole.clone()]);
        assert_eq!(pieces_in.held_bytes(), 0);
        assert_eq!(whole.clone().into_pieces(1000), vec![whole]);
    }

    /// Places, lengths and hops no honest sender gives are offences; a piece sent twice is
    /// taken once; a piece whose header differs from its hop's earlier pieces' starts the hop
    /// again (a sender restarted into the same attempt), and the hop then completes with it.
    #[test]
    fn pieces_no_honest_sender_cuts_are_refused() {
        let (from, now) = (peer(), Instant::now());
        let mut pieces_in = Pieces::new(64, 4096);
        let piece = |index: u32, count: u32, len: usize| RingMessage {
            piece: Piece { index, count },
            ..hop(len)
        };
        for bad in [
            piece(3, 3, 64),
            piece(0, 0, 64),
            piece(0, 65, 64),
            piece(0, 3, 63),
            piece(2, 3, 65),
            piece(2, 3, 0),
            RingMessage {
                hop: 2,
                ..piece(0, 3, 64)
            },
        ] {
            assert!(pieces_in.take(from, bad, now).is_err());
        }
        assert_eq!(pieces_in.take(from, piece(0, 3, 64), now), Ok(Taken::Kept));
        assert_eq!(
            pieces_in.take(from, piece(0, 3, 64), now),
            Ok(Taken::Dropped)
        );
        assert_eq!(pieces_in.held_bytes(), 64);
        let restarted = |index| RingMessage {
            step: 701,
            ..piece(index, 3, 64)
        };
        assert_eq!(pieces_in.take(from, restarted(1), now), Ok(Taken::Kept));
        assert_eq!(pieces_in.held_bytes(), 64, "the earlier pieces are dropped");
        assert_eq!(pieces_in.take(from, restarted(0), now), Ok(Taken::Kept));
        let Ok(Taken::Whole(whole)) = pieces_in.take(from, restarted(2), now) else {
            panic!("the restarted hop completes");
        };
        assert_eq!((whole.step, whole.values.len()), (701, 192));
    }

    /// One sender's pieces that never complete push out only its own partial hops (at most
    /// four, and one hop's bytes); all senders' together hold at most twice a hop's bytes,
    /// the largest holder giving way; hops none of whose pieces came for a while go.
    #[test]
    fn partial_hops_stay_within_their_bounds_and_one_sender_pushes_out_only_its_own() {
        let now = Instant::now();
        let mut pieces_in = Pieces::new(64, 256);
        let fragment = |round: u64| RingMessage {
            round,
            piece: Piece { index: 0, count: 4 },
            ..hop(64)
        };
        let (honest, rogue) = (peer(), peer());
        assert_eq!(pieces_in.take(honest, fragment(3), now), Ok(Taken::Kept));
        for round in 0..100u64 {
            assert_eq!(pieces_in.take(rogue, fragment(round), now), Ok(Taken::Kept));
            assert!(pieces_in.held_bytes() <= 512);
        }
        assert_eq!(pieces_in.held_by(rogue), (4, 256));
        assert_eq!(pieces_in.held_by(honest), (1, 64));
        for _ in 0..3 {
            for round in 0..4 {
                assert_eq!(
                    pieces_in.take(peer(), fragment(round), now),
                    Ok(Taken::Kept)
                );
            }
        }
        assert!(pieces_in.held_bytes() <= 512);
        assert!(
            pieces_in.held_by(rogue).0 < 4,
            "the largest holder gave way"
        );
        let later = now + PIECES_KEPT;
        assert_eq!(pieces_in.take(peer(), fragment(20), later), Ok(Taken::Kept));
        assert_eq!(
            pieces_in.held_bytes(),
            64,
            "pieces kept too long are dropped"
        );
    }
}
