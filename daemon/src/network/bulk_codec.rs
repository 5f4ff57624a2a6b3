//! The bulk channel's codec: CBOR (libp2p's), with a size limit per kind of request and one
//! sized by the model. A ring hop carries a share of the model, so it may be large; every other
//! request (a manifest, a chunk or an update by its hash, the parameters) is a few dozen bytes,
//! and a peer must not make a node buffer megabytes of it before anything is checked. The
//! kind is known from a request's first bytes, before the rest is read.

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
/// Room beyond a model's values in a ring hop (its header) and in a response (a state chunk,
/// a manifest's hashes, the layout's name, framing).
const RING_SLACK: u64 = 64 * 1024;
const RESPONSE_SLACK: u64 = 1024 * 1024;

/// The largest bulk messages a node reads, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BulkLimits {
    /// A ring hop's request.
    pub ring_request: u64,
    /// Any response.
    pub response: u64,
}

impl Default for BulkLimits {
    /// The wire's maxima, whatever the model: what a node reads before it knows its model
    /// (and the fuzz tests).
    fn default() -> BulkLimits {
        BulkLimits {
            ring_request: wire::BULK_REQUEST_MAX,
            response: wire::BULK_RESPONSE_MAX,
        }
    }
}

impl BulkLimits {
    /// The limits for a model of `params` values. A ring hop's request carries at most one
    /// piece of a hop ([`wire::RING_PIECE_BYTES`]: larger hops travel in pieces), and less
    /// for a model whose largest hop is smaller (a whole `diloco` contribution with its round
    /// anchor and outer velocity, and the weight, in `f32`: the digits MLP, 9,610 parameters,
    /// reads hops of at most ~177 KiB). A response holds at most that largest hop too (three
    /// times the model's values), which is more than the parameters a full sync asks for or a
    /// dense update and, with the slack, than a state chunk (256 KiB): so a model of any size
    /// can answer a sync, while a peer asked for a few bytes cannot make this node read more
    /// than three models' worth.
    pub fn for_model(params: usize) -> BulkLimits {
        let hop = (largest_hop_values(params) as u64).saturating_mul(4);
        BulkLimits {
            ring_request: hop
                .min(wire::RING_PIECE_BYTES as u64)
                .saturating_add(RING_SLACK),
            response: hop.saturating_add(RESPONSE_SLACK),
        }
    }
}

/// The codec; see the module docs.
#[derive(Clone)]
pub struct BulkCodec {
    /// Reads ring hops.
    ring: cbor::codec::Codec<BulkRequest, BulkResponse>,
    /// Reads every other request, and writes and reads responses.
    small: cbor::codec::Codec<BulkRequest, BulkResponse>,
}

impl BulkCodec {
    /// A codec that reads at most `limits`.
    pub fn new(limits: BulkLimits) -> BulkCodec {
        let with = |request: u64| {
            cbor::codec::Codec::default()
                .set_request_size_maximum(request)
                .set_response_size_maximum(limits.response)
        };
        BulkCodec {
            ring: with(limits.ring_request),
            small: with(SMALL_REQUEST_MAX),
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
        self.small.read_response(protocol, io).await
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

    /// A ring request never passes one piece, whatever the model, and a response holds a
    /// model's largest hop (so a full sync's parameters). The share of a `diloco` ring of
    /// two over a 12 M-parameter model, with its anchor and velocity (72 MB: past the 64 MiB
    /// that used to bound every request), is refused whole and read in pieces.
    #[test]
    fn a_large_models_hop_is_read_in_pieces() {
        let piece = wire::RING_PIECE_BYTES as u64;
        let huge = BulkLimits::for_model(usize::MAX / 8);
        assert_eq!(huge.ring_request, piece + RING_SLACK);
        let small = BulkLimits::for_model(0);
        assert_eq!(small.ring_request, 4 + RING_SLACK);
        assert_eq!(small.response, 4 + RESPONSE_SLACK);
        let params = 12_000_000;
        let limits = BulkLimits::for_model(params);
        assert_eq!(limits.ring_request, piece + RING_SLACK);
        assert!(limits.response > 4 * params as u64);
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
