//! The bulk channel's codec: CBOR (libp2p's), with a size limit per kind of message, sized by
//! the model. A ring hop carries a share of the model, so it may be large; every other request
//! (a manifest, a chunk or an update by its hash, the parameters) is a few dozen bytes, and a
//! peer must not make a node buffer megabytes of it before anything is checked. A request's
//! kind is known from its first bytes, before the rest is read. An answer is read to what its
//! request asked for (libp2p reads it on the codec clone that wrote the request): a model's
//! parameters answer a full sync, but a peer asked for a state chunk cannot send one.
//!
//! A ring hop is read whole before the node can check who sent it (libp2p decodes a request
//! before handing it on, and membership is the node's to judge), over as many streams as
//! peers open. So the bytes of ring requests being read at once are held to one budget shared
//! by every connection's clone of the codec ([`RingBudget`]), charged as the bytes arrive:
//! a stranger opening 100 streams on each of many connections, each declaring a piece of a
//! large model, gets its streams reset once the budget is spent, and the node's memory stays
//! bounded (it was connections x 100 x 16 MiB: 1.6 GB a connection).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, Cursor};
use libp2p::request_response::{self, cbor};
use libp2p::StreamProtocol;

use crate::wire::largest_hop_values;
use crate::wire::{self, BulkRequest, BulkResponse};

/// How a ring hop's request begins in CBOR: a map of one entry whose key is the variant's
/// name (serde's external tagging), `{"Ring": ...}`. Checked against the encoder in the tests.
const RING_TAG: &[u8] = b"\xa1\x64Ring";
/// The most a request other than a ring hop may take: a 32-byte hash and an index in CBOR.
pub const SMALL_REQUEST_MAX: u64 = 4 * 1024;
/// Room beyond a model's values in a ring hop (its header) and in a model-sized answer (the
/// layout's name, an update's sections, framing).
const RING_SLACK: u64 = 64 * 1024;
const RESPONSE_SLACK: u64 = 1024 * 1024;
/// Room in a small answer: a ring hop's acknowledgement or refusal, a chunk's framing, a
/// manifest's fields and the other states its donor caches.
const SMALL_RESPONSE_MAX: u64 = 64 * 1024;
/// CBOR bytes of one SHA-256 in a manifest's list (a 2-byte header and the hash), rounded up.
const MANIFEST_BYTES_PER_CHUNK: u64 = 40;

/// The largest bulk messages a node reads, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BulkLimits {
    /// A ring hop's request.
    pub ring_request: u64,
    /// The answer to a full sync: the parameters as one dense message.
    pub params_response: u64,
    /// An update pulled by hash: the largest message any codec makes for the model.
    pub update_response: u64,
    /// A state manifest: a hash for each chunk of the model's largest state.
    pub manifest_response: u64,
}

impl Default for BulkLimits {
    /// The wire's maxima, whatever the model: what a node reads before it knows its model
    /// (and the fuzz tests).
    fn default() -> BulkLimits {
        BulkLimits {
            ring_request: wire::BULK_REQUEST_MAX,
            params_response: wire::BULK_RESPONSE_MAX,
            update_response: wire::BULK_RESPONSE_MAX,
            manifest_response: wire::BULK_RESPONSE_MAX,
        }
    }
}

impl BulkLimits {
    /// The limits for a model of `params` values. A ring hop's request carries at most one
    /// piece of a hop ([`wire::RING_PIECE_BYTES`]: larger hops travel in pieces), and less
    /// for a model whose largest hop is smaller (a whole `diloco` contribution with its round
    /// anchor and outer velocity, and the weight, in `f32`: the digits MLP, 9,610 parameters,
    /// reads hops of at most ~177 KiB). A full sync's answer holds the parameters in `f32`, an
    /// update at most 8 bytes a value (top-k at full density, an index beside each `f32`).
    pub fn for_model(params: usize) -> BulkLimits {
        let hop = (largest_hop_values(params) as u64).saturating_mul(4);
        let values = params as u64;
        let chunks = wire::largest_state_bytes(params).div_ceil(wire::STATE_CHUNK_BYTES as u64);
        BulkLimits {
            ring_request: hop
                .min(wire::RING_PIECE_BYTES as u64)
                .saturating_add(RING_SLACK),
            params_response: values.saturating_mul(4).saturating_add(RESPONSE_SLACK),
            update_response: values.saturating_mul(8).saturating_add(RESPONSE_SLACK),
            manifest_response: chunks
                .saturating_mul(MANIFEST_BYTES_PER_CHUNK)
                .saturating_add(SMALL_RESPONSE_MAX),
        }
    }

    /// The most an answer to `request` may take.
    fn response_to(&self, request: &BulkRequest) -> u64 {
        match request {
            BulkRequest::StateManifest => self.manifest_response,
            BulkRequest::StateChunk { .. } => wire::STATE_CHUNK_BYTES as u64 + SMALL_RESPONSE_MAX,
            BulkRequest::Params => self.params_response,
            BulkRequest::Update { .. } => self.update_response,
            BulkRequest::Ring(_) => SMALL_RESPONSE_MAX,
        }
    }
}

/// A CBOR codec reading requests of at most `request` bytes and answers of at most `response`.
fn cbor_codec(request: u64, response: u64) -> cbor::codec::Codec<BulkRequest, BulkResponse> {
    cbor::codec::Codec::default()
        .set_request_size_maximum(request)
        .set_response_size_maximum(response)
}

/// Ring hops whose largest piece may be read at once before the budget refuses more (see
/// [`RingBudget`]): a member receives about two hops from each other member an attempt (its
/// part and an aggregate), each sent piece after piece, so rings of up to ~16 members never
/// meet it with pieces of the largest size.
const RING_BUDGET_HOPS: u64 = 32;
/// The least budget, whatever the model: for a small model's hops (a few hundred KiB) it
/// leaves room for rings of hundreds of members, and bounds what strangers make a node hold.
const RING_BUDGET_FLOOR: u64 = 256 * 1024 * 1024;

/// The bytes of ring requests a node is reading at once, over all its connections and
/// streams, and the most it reads at once. Shared by every clone of one node's codec.
#[derive(Debug)]
pub struct RingBudget {
    /// Bytes read of ring requests not yet finished (decoded, refused or dropped).
    used: AtomicU64,
    /// The most `used` may reach.
    cap: u64,
}

impl RingBudget {
    /// A budget of `cap` bytes.
    fn new(cap: u64) -> RingBudget {
        RingBudget {
            used: AtomicU64::new(0),
            cap,
        }
    }

    /// The budget for `limits`: [`RING_BUDGET_HOPS`] requests of the largest size, at least
    /// [`RING_BUDGET_FLOOR`].
    fn for_limits(limits: &BulkLimits) -> RingBudget {
        RingBudget::new(
            limits
                .ring_request
                .saturating_mul(RING_BUDGET_HOPS)
                .max(RING_BUDGET_FLOOR),
        )
    }

    /// Takes `bytes` from the budget, or nothing if they would pass its cap.
    fn charge(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.cap)
            })
            .is_ok()
    }

    /// Gives `bytes` back.
    fn release(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// A reader of one ring request that charges what it reads to the node's [`RingBudget`] and
/// gives it all back when dropped: when the request is decoded, refused, timed out or its
/// connection closes (libp2p drops the read's future). Past the budget, a read fails and the
/// stream is reset; the sender of an honest hop sees it undelivered and tries again.
struct Metered<R> {
    inner: R,
    budget: Arc<RingBudget>,
    held: u64,
}

impl<R: AsyncRead + Unpin> AsyncRead for Metered<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let read = match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(read)) => read,
            other => return other,
        };
        if !this.budget.charge(read as u64) {
            return Poll::Ready(Err(io::Error::other(format!(
                "ring requests being read would pass the budget of {} bytes",
                this.budget.cap
            ))));
        }
        this.held += read as u64;
        Poll::Ready(Ok(read))
    }
}

impl<R> Drop for Metered<R> {
    fn drop(&mut self) {
        self.budget.release(self.held);
    }
}

/// The codec; see the module docs.
#[derive(Clone)]
pub struct BulkCodec {
    limits: BulkLimits,
    /// The bytes of ring requests this node reads at once, shared by all its clones.
    ring_budget: Arc<RingBudget>,
    /// Reads ring hops.
    ring: cbor::codec::Codec<BulkRequest, BulkResponse>,
    /// Reads every other request, and writes requests and responses.
    small: cbor::codec::Codec<BulkRequest, BulkResponse>,
    /// The most the answer to the request this clone wrote may take; `None` before it wrote
    /// one (a clone that answers, or the fuzz tests' reader): the smallest answer's bound.
    answer_max: Option<u64>,
}

impl BulkCodec {
    /// A codec that reads at most `limits`.
    pub fn new(limits: BulkLimits) -> BulkCodec {
        BulkCodec::with_ring_budget(limits, RingBudget::for_limits(&limits))
    }

    /// A codec that reads at most `limits`, and ring requests within `ring_budget` at once.
    fn with_ring_budget(limits: BulkLimits, ring_budget: RingBudget) -> BulkCodec {
        BulkCodec {
            limits,
            ring_budget: Arc::new(ring_budget),
            ring: cbor_codec(limits.ring_request, SMALL_RESPONSE_MAX),
            small: cbor_codec(SMALL_REQUEST_MAX, SMALL_RESPONSE_MAX),
            answer_max: None,
        }
    }
}

impl request_response::Codec for BulkCodec {
    type Protocol = StreamProtocol;
    type Request = BulkRequest;
    type Response = BulkResponse;

    async fn read_request<T>(
        &mut self,
        protocol: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<BulkRequest>
    where
        T: AsyncRead + Unpin + Send,
    {
        let mut head = [0u8; RING_TAG.len()];
        let mut read = 0;
        while read < head.len() {
            match io.read(&mut head[read..]).await? {
                0 => break,
                n => read += n,
            }
        }
        let head = &head[..read];
        let mut whole = Cursor::new(head.to_vec()).chain(io);
        if head == RING_TAG {
            let mut metered = Metered {
                inner: whole,
                budget: Arc::clone(&self.ring_budget),
                held: 0,
            };
            self.ring.read_request(protocol, &mut metered).await
        } else {
            self.small.read_request(protocol, &mut whole).await
        }
    }

    async fn read_response<T>(
        &mut self,
        protocol: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<BulkResponse>
    where
        T: AsyncRead + Unpin + Send,
    {
        let most = self.answer_max.unwrap_or(SMALL_RESPONSE_MAX);
        cbor_codec(SMALL_REQUEST_MAX, most)
            .read_response(protocol, io)
            .await
    }

    async fn write_request<T>(
        &mut self,
        protocol: &StreamProtocol,
        io: &mut T,
        request: BulkRequest,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        self.answer_max = Some(self.limits.response_to(&request));
        self.small.write_request(protocol, io, request).await
    }

    async fn write_response<T>(
        &mut self,
        protocol: &StreamProtocol,
        io: &mut T,
        response: BulkResponse,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        self.small.write_response(protocol, io, response).await
    }
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;
    use request_response::Codec as _;
    use serde_bytes::ByteBuf;

    use super::*;
    use crate::wire::RingMessage;

    fn protocol() -> StreamProtocol {
        StreamProtocol::new("/p2ptrain/bulk/test")
    }

    fn hop(values: usize) -> BulkRequest {
        BulkRequest::Ring(RingMessage {
            round: 3,
            attempt: 1,
            members: 7,
            hop: 0,
            step: 40,
            encoding: crate::wire::ValueEncoding::F32,
            values: ByteBuf::from(vec![0u8; values * 4]),
            piece: crate::wire::Piece::WHOLE,
        })
    }

    fn encode(request: BulkRequest) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        block_on(BulkCodec::new(BulkLimits::default()).write_request(
            &protocol(),
            &mut out,
            request,
        ))
        .expect("encode");
        out.into_inner()
    }

    fn read(codec: &mut BulkCodec, bytes: &[u8]) -> io::Result<BulkRequest> {
        block_on(codec.read_request(&protocol(), &mut Cursor::new(bytes.to_vec())))
    }

    /// Only a ring hop begins with the tag, so only a ring hop is read to the ring's limit.
    #[test]
    fn a_ring_hop_and_only_a_ring_hop_begins_with_the_tag() {
        assert!(encode(hop(1)).starts_with(RING_TAG));
        for small in [
            BulkRequest::StateManifest,
            BulkRequest::Params,
            BulkRequest::StateChunk {
                state: ByteBuf::from(vec![1u8; 32]),
                index: 9,
            },
            BulkRequest::Update {
                hash: ByteBuf::from(vec![2u8; 32]),
            },
        ] {
            let bytes = encode(small.clone());
            assert!(!bytes.starts_with(RING_TAG), "{small:?}");
            assert!(bytes.len() as u64 <= SMALL_REQUEST_MAX / 16, "{small:?}");
            let mut codec = BulkCodec::new(BulkLimits::for_model(10));
            let back = read(&mut codec, &bytes).expect("reads back");
            assert_eq!(format!("{back:?}"), format!("{small:?}"));
        }
    }

    /// A model's largest honest hop (a whole `diloco` contribution) reads; a larger one, or a
    /// small kind padded past its limit, is cut at the limit and refused.
    #[test]
    fn requests_are_read_to_their_kinds_limit_and_no_further() {
        let params = 10_000;
        let limits = BulkLimits::for_model(params);
        assert!(limits.ring_request < wire::BULK_REQUEST_MAX / 100);
        let mut codec = BulkCodec::new(limits);
        let largest = hop(3 * params + 1);
        let back = read(&mut codec, &encode(largest.clone())).expect("reads");
        assert_eq!(format!("{back:?}"), format!("{largest:?}"));
        let too_large = encode(hop(3 * params + 1 + RING_SLACK as usize / 4 + 1));
        assert!(read(&mut codec, &too_large).is_err());
        let mut padded = encode(BulkRequest::Update {
            hash: ByteBuf::from(vec![0u8; SMALL_REQUEST_MAX as usize]),
        });
        assert!(read(&mut codec, &padded).is_err());
        // Fewer bytes than the tag: read as a small kind, and refused.
        padded.truncate(2);
        assert!(read(&mut codec, &padded).is_err());
        assert!(read(&mut codec, &[]).is_err());
    }

    /// Encodes `response` as a peer would and reads it as the answer to `request`, on the
    /// codec that wrote the request (libp2p reads each answer on the clone that asked).
    fn answer(
        limits: BulkLimits,
        request: BulkRequest,
        response: BulkResponse,
    ) -> io::Result<BulkResponse> {
        let mut codec = BulkCodec::new(limits);
        let mut sink = Cursor::new(Vec::new());
        block_on(codec.write_request(&protocol(), &mut sink, request))?;
        let mut bytes = Cursor::new(Vec::new());
        block_on(BulkCodec::new(BulkLimits::default()).write_response(
            &protocol(),
            &mut bytes,
            response,
        ))?;
        block_on(codec.read_response(&protocol(), &mut Cursor::new(bytes.into_inner())))
    }

    /// An answer is read only as far as its request's kind allows: a model's parameters
    /// answer a full sync, but a peer asked for a state chunk, a manifest or a ring hop's
    /// acknowledgement cannot make this node read a model's worth of bytes (before, every
    /// answer could hold three models' values: ~1.6 GB for a 135 M-parameter model).
    #[test]
    fn answers_are_read_to_their_requests_kind_and_no_further() {
        let params = 1_000_000;
        let limits = BulkLimits::for_model(params);
        let parameters = || BulkResponse::Params {
            step: 7,
            layout: "layout".into(),
            values: ByteBuf::from(vec![1u8; 4 * params + 64]),
        };
        let chunk_request = || BulkRequest::StateChunk {
            state: ByteBuf::from(vec![1u8; 32]),
            index: 3,
        };
        let update_request = || BulkRequest::Update {
            hash: ByteBuf::from(vec![2u8; 32]),
        };
        // What each kind honestly holds, read back.
        assert!(answer(limits, BulkRequest::Params, parameters()).is_ok());
        let largest_update = BulkResponse::Update(ByteBuf::from(vec![3u8; 8 * params + 64]));
        assert!(answer(limits, update_request(), largest_update).is_ok());
        let chunk = BulkResponse::StateChunk(ByteBuf::from(vec![4u8; wire::STATE_CHUNK_BYTES]));
        assert!(answer(limits, chunk_request(), chunk.clone()).is_ok());
        let chunks = wire::largest_state_bytes(params).div_ceil(wire::STATE_CHUNK_BYTES as u64);
        let manifest = BulkResponse::StateManifest(wire::StateManifest {
            hash: ByteBuf::from(vec![5u8; 32]),
            step: 9,
            total: wire::largest_state_bytes(params),
            chunk_size: wire::STATE_CHUNK_BYTES as u32,
            chunk_hashes: vec![ByteBuf::from(vec![6u8; 32]); chunks as usize],
            load: 1,
            cached: vec![ByteBuf::from(vec![7u8; 32]); 16],
        });
        assert!(answer(limits, BulkRequest::StateManifest, manifest).is_ok());
        assert!(answer(limits, hop(1), BulkResponse::RingTaken).is_ok());
        let refused = BulkResponse::Refused("not a member of this round".into());
        assert!(answer(limits, hop(1), refused).is_ok());
        // A model's worth where something small was asked for: refused.
        assert!(answer(limits, chunk_request(), parameters()).is_err());
        assert!(answer(limits, BulkRequest::StateManifest, parameters()).is_err());
        assert!(answer(limits, hop(1), parameters()).is_err());
        assert!(answer(limits, hop(1), chunk).is_err());
        // Past a kind's own bound: refused too.
        let padded =
            BulkResponse::StateChunk(ByteBuf::from(vec![4u8; 2 * wire::STATE_CHUNK_BYTES]));
        assert!(answer(limits, chunk_request(), padded).is_err());
        let too_many = BulkResponse::Update(ByteBuf::from(vec![
            3u8;
            8 * params
                + 2 * RESPONSE_SLACK as usize
        ]));
        assert!(answer(limits, update_request(), too_many).is_err());
    }

    /// A reader whose bytes come from the test, and which waits (as a slow or hostile peer's
    /// stream does) while the test holds its sender open.
    fn stalled(
        bytes: Vec<u8>,
    ) -> (
        impl AsyncRead + Unpin,
        futures::channel::mpsc::UnboundedSender<io::Result<Vec<u8>>>,
    ) {
        use futures::TryStreamExt;
        let (tx, rx) = futures::channel::mpsc::unbounded::<io::Result<Vec<u8>>>();
        tx.unbounded_send(Ok(bytes)).expect("send");
        (rx.into_async_read(), tx)
    }

    /// Ring requests being read at once share one budget over all the codec's clones (one per
    /// connection, one per stream): a peer holding streams open with most of a piece each
    /// cannot make the node hold more than the budget; past it, a read fails at once (before,
    /// it waited, holding its bytes: 100 streams a connection, each up to a piece). Small
    /// requests are not charged, and a finished or dropped read gives its bytes back.
    #[test]
    fn ring_requests_read_at_once_share_one_budget() {
        use std::future::Future;
        let limits = BulkLimits::for_model(10_000);
        let piece = limits.ring_request;
        let codec = BulkCodec::with_ring_budget(limits, RingBudget::new(2 * piece));
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        // Most of a piece, tag first, whose end never comes.
        let most_of_a_piece = || {
            let mut bytes = RING_TAG.to_vec();
            bytes.resize((piece * 9 / 10) as usize, 0x55);
            stalled(bytes)
        };
        let (mut a_io, _a_tx) = most_of_a_piece();
        let (mut b_io, _b_tx) = most_of_a_piece();
        let (mut c_io, _c_tx) = most_of_a_piece();
        let (mut a_codec, mut b_codec, mut c_codec) = (codec.clone(), codec.clone(), codec.clone());
        let proto = protocol();
        let mut a = Box::pin(a_codec.read_request(&proto, &mut a_io));
        let mut b = Box::pin(b_codec.read_request(&proto, &mut b_io));
        assert!(a.as_mut().poll(&mut cx).is_pending());
        assert!(b.as_mut().poll(&mut cx).is_pending());
        let used = || codec.ring_budget.used.load(Ordering::Acquire);
        assert_eq!(used(), 2 * (piece * 9 / 10));
        let mut c = Box::pin(c_codec.read_request(&proto, &mut c_io));
        match c.as_mut().poll(&mut cx) {
            Poll::Ready(Err(e)) => assert!(e.to_string().contains("budget"), "{e}"),
            other => panic!("a third stream past the budget: {other:?}"),
        }
        drop(c);
        assert_eq!(
            used(),
            2 * (piece * 9 / 10),
            "the refused read gave back its bytes"
        );
        // Small requests are not charged.
        let mut small = codec.clone();
        assert!(read(&mut small, &encode(BulkRequest::StateManifest)).is_ok());
        // A dropped read gives its bytes back: an honest hop reads again.
        drop(a);
        let mut honest = codec.clone();
        let largest = hop(3 * 10_000 + 1);
        let back = read(&mut honest, &encode(largest.clone())).expect("an honest hop reads");
        assert_eq!(format!("{back:?}"), format!("{largest:?}"));
        drop(b);
        assert_eq!(used(), 0);
    }

    /// A ring request never passes one piece, whatever the model, and a full sync's answer
    /// holds the model's parameters. The share of a `diloco` ring of
    /// two over a 12 M-parameter model, with its anchor and velocity (72 MB: past the 64 MiB
    /// that used to bound every request), is refused whole and read in pieces.
    #[test]
    fn a_large_models_hop_is_read_in_pieces() {
        let piece = wire::RING_PIECE_BYTES as u64;
        let huge = BulkLimits::for_model(usize::MAX / 8);
        assert_eq!(huge.ring_request, piece + RING_SLACK);
        let small = BulkLimits::for_model(0);
        assert_eq!(small.ring_request, 4 + RING_SLACK);
        assert_eq!(small.params_response, RESPONSE_SLACK);
        let params = 12_000_000;
        let limits = BulkLimits::for_model(params);
        assert_eq!(limits.ring_request, piece + RING_SLACK);
        assert!(limits.params_response > 4 * params as u64);
        let mut codec = BulkCodec::new(limits);
        let BulkRequest::Ring(share) = hop(3 * params / 2 + 1) else {
            unreachable!()
        };
        assert!(read(&mut codec, &encode(BulkRequest::Ring(share.clone()))).is_err());
        let pieces = share.into_pieces(wire::RING_PIECE_BYTES);
        assert_eq!(pieces.len(), 5);
        for piece in pieces {
            let back = read(&mut codec, &encode(BulkRequest::Ring(piece.clone())));
            assert!(matches!(back, Ok(BulkRequest::Ring(m)) if m == piece));
        }
    }
}
