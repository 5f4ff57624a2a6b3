//! What the network counts for status: bytes through every connection, in all and per peer
//! (read from counters the transport itself increments), and gossip sent per topic (counted
//! when this node publishes). Each number is an atomic or a plain integer read directly;
//! libp2p's own Prometheus metrics live in the registry the control API serves.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::io::{IoSlice, IoSliceMut};
use futures::{AsyncRead, AsyncWrite};
use libp2p::core::muxing::{StreamMuxer, StreamMuxerBox, StreamMuxerEvent, SubstreamBox};
use libp2p::identity::Keypair;
use libp2p::PeerId;

/// Bytes sent and received over every connection, counted on the multiplexed substreams as
/// libp2p's bandwidth metrics count them (payload of every protocol, after noise and
/// yamux). Cloning shares the counters: the transport increments, the event loop reads.
#[derive(Debug, Clone, Default)]
pub struct Bandwidth {
    total: Counters,
    /// Each peer's bytes since this node started, over all its connections. A peer that
    /// leaves keeps its entry (a few bytes) so a reconnecting peer's counts keep growing, up
    /// to [`PEERS_KEPT`] peers.
    per_peer: Arc<Mutex<HashMap<PeerId, Counters>>>,
}

/// Peers whose byte counts are kept: past it, a new peer's entry makes room by dropping the
/// counts of every peer without a connection (a public mesh sees ever new peer ids).
const PEERS_KEPT: usize = 1024;

/// A pair of byte counters, shared between the substreams that add to them and the readers.
#[derive(Debug, Clone, Default)]
struct Counters {
    sent: Arc<AtomicU64>,
    received: Arc<AtomicU64>,
}

impl Counters {
    fn read(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.received.load(Ordering::Relaxed),
        )
    }
}

impl Bandwidth {
    /// Bytes written to substreams so far.
    pub fn sent(&self) -> u64 {
        self.total.sent.load(Ordering::Relaxed)
    }

    /// Bytes read from substreams so far.
    pub fn received(&self) -> u64 {
        self.total.received.load(Ordering::Relaxed)
    }

    /// `(sent, received)` bytes of `peer`'s connections so far.
    pub fn of_peer(&self, peer: &PeerId) -> Option<(u64, u64)> {
        let map = self.per_peer.lock().ok()?;
        map.get(peer).map(Counters::read)
    }

    /// Wraps the multiplexer of a connection to `peer` so that every substream it opens or
    /// accepts counts into the totals and the peer's counters.
    pub fn count(&self, peer: PeerId, muxer: StreamMuxerBox) -> StreamMuxerBox {
        StreamMuxerBox::new(CountingMuxer {
            inner: muxer,
            counters: [self.total.clone(), self.peer_counters(peer)],
        })
    }

    /// `peer`'s counters, shared with every connection to it that counts into them.
    fn peer_counters(&self, peer: PeerId) -> Counters {
        self.per_peer
            .lock()
            .map(|mut m| {
                if !m.contains_key(&peer) && m.len() >= PEERS_KEPT {
                    // Counters that only this map holds belong to no open connection.
                    m.retain(|_, c| Arc::strong_count(&c.sent) > 1);
                }
                m.entry(peer).or_default().clone()
            })
            .unwrap_or_default()
    }
}

/// A multiplexer whose substreams count their bytes, into the totals and its peer's.
struct CountingMuxer {
    inner: StreamMuxerBox,
    counters: [Counters; 2],
}

impl StreamMuxer for CountingMuxer {
    type Substream = CountingStream;
    type Error = io::Error;

    fn poll_inbound(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::Substream, Self::Error>> {
        let this = self.get_mut();
        Pin::new(&mut this.inner)
            .poll_inbound(cx)
            .map_ok(|inner| CountingStream {
                inner,
                counters: this.counters.clone(),
            })
    }

    fn poll_outbound(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::Substream, Self::Error>> {
        let this = self.get_mut();
        Pin::new(&mut this.inner)
            .poll_outbound(cx)
            .map_ok(|inner| CountingStream {
                inner,
                counters: this.counters.clone(),
            })
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<StreamMuxerEvent, Self::Error>> {
        Pin::new(&mut self.get_mut().inner).poll(cx)
    }
}

/// A substream that adds what passes through it to its connection's [`Bandwidth`].
struct CountingStream {
    inner: SubstreamBox,
    counters: [Counters; 2],
}

/// Adds `n` bytes to the counters `pick` chooses when an I/O call succeeded.
fn tally(
    counters: &[Counters; 2],
    pick: fn(&Counters) -> &AtomicU64,
    polled: Poll<io::Result<usize>>,
) -> Poll<io::Result<usize>> {
    if let Poll::Ready(Ok(n)) = &polled {
        for c in counters {
            pick(c).fetch_add(*n as u64, Ordering::Relaxed);
        }
    }
    polled
}

fn sent(c: &Counters) -> &AtomicU64 {
    &c.sent
}

fn received(c: &Counters) -> &AtomicU64 {
    &c.received
}

impl AsyncRead for CountingStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        tally(
            &this.counters,
            received,
            Pin::new(&mut this.inner).poll_read(cx, buf),
        )
    }

    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        tally(
            &this.counters,
            received,
            Pin::new(&mut this.inner).poll_read_vectored(cx, bufs),
        )
    }
}

impl AsyncWrite for CountingStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        tally(
            &this.counters,
            sent,
            Pin::new(&mut this.inner).poll_write(cx, buf),
        )
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        tally(
            &this.counters,
            sent,
            Pin::new(&mut this.inner).poll_write_vectored(cx, bufs),
        )
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

/// The size of this node's gossip messages on the wire: gossipsub's protobuf `Message`
/// (author, data, sequence number, topic, signature and, for keys too long to inline in the
/// peer id, the public key), which is what a copy sent to one peer weighs.
#[derive(Debug, Clone)]
pub struct Envelope {
    author_len: usize,
    signature_len: usize,
    key_len: Option<usize>,
}

/// Length of a protobuf varint holding `n`.
fn varint_len(mut n: usize) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
}

/// Length of a length-delimited protobuf field (one-byte tag) carrying `len` bytes.
fn field_len(len: usize) -> usize {
    1 + varint_len(len) + len
}

/// Bytes in a gossipsub sequence number (a big-endian `u64`).
const SEQNO_LEN: usize = 8;

impl Envelope {
    /// The envelope of messages signed by `key`, as gossipsub's strict signing builds them.
    pub fn of(key: &Keypair) -> Self {
        let key_enc = key.public().encode_protobuf();
        // Gossipsub leaves the key out when the peer id inlines it (ed25519, secp256k1).
        let key_len = (key_enc.len() > 42).then_some(key_enc.len());
        // Ed25519 signatures have a fixed length; measuring one covers other key types too.
        let signature_len = key
            .sign(b"p2ptrain envelope")
            .map(|s| s.len())
            .unwrap_or(64);
        Self {
            author_len: key.public().to_peer_id().to_bytes().len(),
            signature_len,
            key_len,
        }
    }

    /// Bytes of one copy of a message of `data_len` bytes on `topic`.
    pub fn len(&self, topic: &str, data_len: usize) -> usize {
        field_len(self.author_len)
            + field_len(data_len)
            + field_len(SEQNO_LEN)
            + field_len(topic.len())
            + field_len(self.signature_len)
            + self.key_len.map_or(0, field_len)
    }
}

/// Gossip this node published, per topic: `(copies, bytes)`, a message counted once per
/// peer it was sent to.
#[derive(Debug, Clone, Default)]
pub struct TopicSent {
    by_topic: BTreeMap<String, (u64, u64)>,
}

impl TopicSent {
    /// Counts a message of `bytes` (envelope included) sent to `copies` peers.
    pub fn record(&mut self, topic: &str, copies: u64, bytes: u64) {
        let e = self.by_topic.entry(topic.to_string()).or_default();
        e.0 += copies;
        e.1 += copies * bytes;
    }

    /// The counts so far, by topic.
    pub fn by_topic(&self) -> BTreeMap<String, (u64, u64)> {
        self.by_topic.clone()
    }
}

/// What the event loop counts of its traffic: the transport's byte counters, and gossip it
/// published per topic, each message at its wire size.
#[derive(Debug)]
pub struct Traffic {
    /// Bytes through every connection (shared with the transport, which increments them).
    pub bandwidth: Bandwidth,
    topic_sent: TopicSent,
    envelope: Envelope,
}

impl Traffic {
    /// Counts for a node whose transport adds to `bandwidth` and whose gossip carries
    /// `envelope`.
    pub fn new(bandwidth: Bandwidth, envelope: Envelope) -> Traffic {
        Traffic {
            bandwidth,
            topic_sent: TopicSent::default(),
            envelope,
        }
    }

    /// Counts a message of `data_len` bytes published on `topic` (the hash gossip carries,
    /// which is the topic's name: topics are identity-hashed) to `copies` peers, with its
    /// envelope.
    pub fn published(&mut self, topic: &str, data_len: usize, copies: u64) {
        let bytes = self.envelope.len(topic, data_len) as u64;
        self.topic_sent.record(topic, copies, bytes);
    }

    /// Gossip published so far, by topic: `(copies, bytes)`.
    pub fn by_topic(&self) -> BTreeMap<String, (u64, u64)> {
        self.topic_sent.by_topic()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::gossipsub::{RawMessage, TopicHash};

    #[test]
    fn envelope_matches_gossipsubs_own_length() {
        let key = Keypair::generate_ed25519();
        let env = Envelope::of(&key);
        for (topic, n) in [("t", 0), ("p2ptrain/run/updates/x", 100), ("u", 70_000)] {
            let raw = RawMessage {
                source: Some(key.public().to_peer_id()),
                data: vec![7; n],
                sequence_number: Some(u64::MAX),
                topic: TopicHash::from_raw(topic),
                signature: Some(vec![1; 64]),
                key: None,
                validated: false,
            };
            assert_eq!(env.len(topic, n), raw.raw_protobuf_len(), "{topic} {n}");
        }
    }

    #[test]
    fn topic_counts_add_copies_and_bytes() {
        let mut sent = TopicSent::default();
        sent.record("a", 3, 100);
        sent.record("a", 2, 50);
        sent.record("b", 0, 10);
        let got = sent.by_topic();
        assert_eq!(got["a"], (5, 400));
        assert_eq!(got["b"], (0, 0));
    }

    #[test]
    fn bandwidth_counts_in_all_and_per_peer() {
        let bw = Bandwidth::default();
        let (a, b) = (PeerId::random(), PeerId::random());
        let ca = bw
            .per_peer
            .lock()
            .expect("lock")
            .entry(a)
            .or_default()
            .clone();
        let counters = [bw.total.clone(), ca];
        let _ = tally(&counters, sent, Poll::Ready(Ok(10)));
        let _ = tally(&counters, received, Poll::Ready(Ok(3)));
        let _ = tally(
            &counters,
            sent,
            Poll::Ready(Err(io::ErrorKind::Other.into())),
        );
        assert_eq!((bw.sent(), bw.received()), (10, 3));
        assert_eq!(bw.of_peer(&a), Some((10, 3)));
        assert_eq!(bw.of_peer(&b), None);
    }

    #[test]
    fn a_full_map_drops_the_counts_of_peers_without_a_connection() {
        let bw = Bandwidth::default();
        let mut live = Vec::new();
        let mut gone = Vec::new();
        for i in 0..PEERS_KEPT {
            let p = PeerId::random();
            let c = bw.peer_counters(p);
            if i % 2 == 0 {
                live.push((p, c));
            } else {
                gone.push(p);
            }
        }
        let newcomer = PeerId::random();
        let _held = bw.peer_counters(newcomer);
        let map = bw.per_peer.lock().expect("lock");
        assert_eq!(map.len(), live.len() + 1);
        assert!(live.iter().all(|(p, _)| map.contains_key(p)));
        assert!(gone.iter().all(|p| !map.contains_key(p)));
    }

    #[test]
    fn varints() {
        assert_eq!(varint_len(0), 1);
        assert_eq!(varint_len(127), 1);
        assert_eq!(varint_len(128), 2);
        assert_eq!(varint_len(16_383), 2);
        assert_eq!(varint_len(16_384), 3);
    }
}
