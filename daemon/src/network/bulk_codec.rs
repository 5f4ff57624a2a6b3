//! The bulk channel's codec: CBOR (libp2p's), with a size limit per kind of message, sized by
//! the model. A ring hop carries a share of the model, so it may be large; every other request
//! (a manifest, a chunk or an update by its hash, the parameters) is a few dozen bytes, and a
//! peer must not make a node buffer megabytes of it before anything is checked. A request's
//! kind is known from its first bytes, before the rest is read. An answer is read to what its
//! request asked for (libp2p reads it on the codec clone that wrote the request): a model's
//! parameters answer a full sync, but a peer asked for a state chunk cannot send one.

use std::io;

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

/// The codec; see the module docs.
#[derive(Clone)]
pub struct BulkCodec {
    limits: BulkLimits,
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
        BulkCodec {
            limits,
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
            self.ring.read_request(protocol, &mut whole).await
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
