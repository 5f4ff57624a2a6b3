//! Hops in pieces: a hop whose values are larger than a request may carry
//! ([`crate::wire::RING_PIECE_BYTES`]) is cut into pieces by its sender ([`split`]) and put
//! together by its receiver ([`Pieces`]) before the round sees it, so a share of a model of
//! any size travels in requests of a bounded size. Only the pieces themselves are checked
//! here (their place and length, and that the pieces of one hop agree on everything but their
//! bytes); the whole hop is judged as any other. Pure: the core feeds it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use libp2p::PeerId;
use serde_bytes::ByteBuf;

use super::HopKey;
use crate::wire::{Piece, RingMessage};

/// Pieces of a hop still missing this long after its first came are dropped: an honest
/// sender sends a hop's pieces one after the other, each within a request's timeout, and
/// one that died part way will not send the rest.
pub const PIECES_KEPT: Duration = Duration::from_secs(120);
/// Hops being put together at once, at most: a member receives a part from each other
/// member and an aggregate from each owner, a round or two at a time.
const PARTIAL_CAP: usize = 256;

/// Cuts `msg` into messages of at most `piece_bytes` bytes of values each (a multiple of 4),
/// in order; a hop that fits one is sent whole, as it is.
pub fn split(msg: RingMessage, piece_bytes: usize) -> Vec<RingMessage> {
    let piece_bytes = piece_bytes.max(4) / 4 * 4;
    if msg.values.len() <= piece_bytes {
        return vec![msg];
    }
    let count = msg.values.len().div_ceil(piece_bytes) as u32;
    msg.values
        .chunks(piece_bytes)
        .enumerate()
        .map(|(index, bytes)| RingMessage {
            values: ByteBuf::from(bytes.to_vec()),
            piece: Piece {
                index: index as u32,
                count,
            },
            ..head(&msg)
        })
        .collect()
}

/// What every piece of a hop says alike: the message without its values, as piece 0.
fn head(msg: &RingMessage) -> RingMessage {
    RingMessage {
        round: msg.round,
        attempt: msg.attempt,
        members: msg.members,
        hop: msg.hop,
        values: ByteBuf::new(),
        step: msg.step,
        bf16: msg.bf16,
        piece: Piece {
            index: 0,
            count: msg.piece.count,
        },
    }
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
    /// When the first piece came.
    since: Instant,
}

/// Hops being put together, bounded in count and in bytes; see the module docs.
#[derive(Debug)]
pub struct Pieces {
    /// Bytes every piece but a hop's last holds (the senders' [`split`] size).
    piece_bytes: usize,
    /// The most bytes of values an honest hop holds, and the most all partial hops together
    /// may hold.
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
    /// honest sender's (a place or length [`split`] never gives, pieces of one hop that
    /// disagree): an offence of its sender. A piece that the bounds leave no room for is
    /// dropped (the attempt then stalls, and is retried), as the inbox drops its oldest hops.
    pub fn take(
        &mut self,
        from: PeerId,
        msg: RingMessage,
        now: Instant,
    ) -> Result<Option<RingMessage>, String> {
        let Piece { index, count } = msg.piece;
        if count == 1 && index == 0 {
            return Ok(Some(msg));
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
        let head = head(&msg);
        match self.partial.get(&key) {
            Some(partial) if partial.head != head => {
                let dropped = self.partial.remove(&key).map_or(0, |p| p.bytes);
                self.held_bytes -= dropped;
                return Err(format!(
                    "pieces of one ring hop (round {} attempt {} hop {}) that disagree",
                    msg.round, msg.attempt, msg.hop
                ));
            }
            // Sent twice: the first copy stands.
            Some(partial) if partial.got[index as usize].is_some() => return Ok(None),
            _ => {}
        }
        if !self.make_room(key, len) {
            return Ok(None);
        }
        let partial = self.partial.entry(key).or_insert_with(|| Partial {
            head,
            got: vec![None; count as usize],
            bytes: 0,
            since: now,
        });
        partial.bytes += len;
        self.held_bytes += len;
        partial.got[index as usize] = Some(msg.values);
        if partial.got.iter().any(Option::is_none) {
            return Ok(None);
        }
        let Some(partial) = self.partial.remove(&key) else {
            return Ok(None);
        };
        self.held_bytes -= partial.bytes;
        let mut values = Vec::with_capacity(partial.bytes);
        for bytes in partial.got.into_iter().flatten() {
            values.extend_from_slice(&bytes);
        }
        Ok(Some(RingMessage {
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

    /// Makes room for `len` more bytes of hop `key` (and for the hop itself, if new): the
    /// partial hops of the oldest rounds and attempts give way, never `key`'s own. `false`
    /// where even then there is none.
    fn make_room(&mut self, key: HopKey, len: usize) -> bool {
        let new = !self.partial.contains_key(&key);
        let own = self.partial.get(&key).map_or(0, |p| p.bytes);
        if own + len > self.hop_bytes {
            return false;
        }
        loop {
            let full = new && self.partial.len() >= PARTIAL_CAP;
            if !full && self.held_bytes + len <= self.hop_bytes {
                return true;
            }
            let Some(oldest) = self.partial.keys().find(|k| **k != key).copied() else {
                return false;
            };
            let dropped = self.partial.remove(&oldest).map_or(0, |p| p.bytes);
            self.held_bytes -= dropped;
        }
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
            bf16: false,
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
        let pieces = split(whole.clone(), 64);
        assert_eq!(pieces.len(), 16);
        assert!(pieces[..15].iter().all(|p| p.values.len() == 64));
        assert_eq!(pieces[15].values.len(), 1000 - 15 * 64);
        let (from, now) = (peer(), Instant::now());
        let mut pieces_in = Pieces::new(64, 4096);
        let mut back = Vec::new();
        for p in pieces.into_iter().rev() {
            if let Some(m) = pieces_in.take(from, p, now).expect("honest pieces") {
                back.push(m);
            }
        }
        assert_eq!(back, vec![whole.clone()]);
        assert_eq!(pieces_in.held_bytes(), 0);
        assert_eq!(split(whole.clone(), 1000), vec![whole]);
    }

    /// Places, lengths and headers no honest sender gives are offences; a piece sent twice
    /// is taken once.
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
        ] {
            assert!(pieces_in.take(from, bad, now).is_err());
        }
        assert_eq!(pieces_in.take(from, piece(0, 3, 64), now), Ok(None));
        assert_eq!(pieces_in.take(from, piece(0, 3, 64), now), Ok(None));
        assert_eq!(pieces_in.held_bytes(), 64);
        let other_step = RingMessage {
            step: 701,
            ..piece(1, 3, 64)
        };
        assert!(pieces_in.take(from, other_step, now).is_err());
        assert_eq!(
            pieces_in.held_bytes(),
            0,
            "a hop whose pieces disagree is dropped"
        );
    }

    /// Partial hops hold at most a hop's bytes together: the oldest rounds' give way, and
    /// those kept too long go.
    #[test]
    fn partial_hops_stay_within_a_hops_bytes() {
        let now = Instant::now();
        let mut pieces_in = Pieces::new(64, 256);
        for round in 0..10u64 {
            let msg = RingMessage {
                round,
                piece: Piece { index: 0, count: 4 },
                ..hop(64)
            };
            assert_eq!(pieces_in.take(peer(), msg, now), Ok(None));
            assert!(pieces_in.held_bytes() <= 256);
        }
        assert_eq!(pieces_in.partial.len(), 4);
        assert_eq!(pieces_in.partial.keys().next().map(|k| k.0), Some(6));
        let later = now + PIECES_KEPT;
        let msg = RingMessage {
            round: 20,
            piece: Piece { index: 0, count: 2 },
            ..hop(64)
        };
        assert_eq!(pieces_in.take(peer(), msg, later), Ok(None));
        assert_eq!(
            pieces_in.held_bytes(),
            64,
            "pieces kept too long are dropped"
        );
    }
}
