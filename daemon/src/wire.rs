//! The bulk channel's wire format: what one p2ptrain node asks another for (a state to join
//! from, parameters to sync with, a large update) and what comes back, with the size limits
//! both sides enforce. It owns the types and their version, not the transport: the network
//! carries them as CBOR over request-response and never looks inside.
//!
//! [`WIRE_VERSION`] is part of the bulk protocol name and of the identify protocol version
//! (see `network::protocol_version`), so nodes whose wire formats differ refuse each other
//! at the handshake instead of failing to decode each other's messages. Bump it whenever a
//! type here changes in a way an older node cannot read.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

/// Version of this wire format. Peers compare it through the protocol names below, so it
/// changes only together with an incompatible change to these types.
pub const WIRE_VERSION: u32 = 1;

/// Largest request on the bulk channel: requests are small (a hash and an index at most).
pub const BULK_REQUEST_MAX: u64 = 64 * 1024;
/// Largest response on the bulk channel (a state chunk or a full model).
pub const BULK_RESPONSE_MAX: u64 = 64 * 1024 * 1024;

/// The bulk channel's protocol name; peers negotiate it, so it carries [`WIRE_VERSION`].
pub fn bulk_protocol() -> String {
    format!("/p2ptrain/bulk/{WIRE_VERSION}")
}

/// A request on the bulk channel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum BulkRequest {
    /// Freeze your current state for download and describe it.
    StateManifest,
    /// One chunk of a frozen state.
    StateChunk {
        /// SHA-256 of the whole state.
        state: ByteBuf,
        /// Chunk index.
        index: u32,
    },
    /// Your current parameters, for a neighbour sync.
    Params,
    /// A large update you announced.
    Update {
        /// Its content hash, from the announcement.
        hash: ByteBuf,
    },
}

/// A frozen state on offer to a joiner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateManifest {
    /// SHA-256 of the whole state (a checkpoint file's bytes).
    pub hash: ByteBuf,
    /// The donor's step when it froze the state.
    pub step: u64,
    /// Total bytes.
    pub total: u64,
    /// Bytes per chunk (the last may be shorter).
    pub chunk_size: u32,
    /// SHA-256 of each chunk.
    pub chunk_hashes: Vec<ByteBuf>,
    /// Transfers the donor is serving now: joiners prefer less loaded donors.
    pub load: u32,
    /// Other states (by hash) the donor can serve chunks of, e.g. one it downloaded itself.
    #[serde(default)]
    pub cached: Vec<ByteBuf>,
}

/// An answer on the bulk channel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum BulkResponse {
    /// See [`BulkRequest::StateManifest`].
    StateManifest(StateManifest),
    /// See [`BulkRequest::StateChunk`].
    StateChunk(ByteBuf),
    /// See [`BulkRequest::Params`]: the step and the flat parameters (little-endian `f32`).
    Params {
        /// The donor's step.
        step: u64,
        /// Its parameter layout hash.
        layout: String,
        /// Flat parameters.
        values: ByteBuf,
    },
    /// See [`BulkRequest::Update`]: the encoded update.
    Update(ByteBuf),
    /// The peer cannot or will not answer.
    Refused(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_protocol_name_is_unchanged_for_version_1() {
        // Nodes of earlier builds negotiate exactly this name.
        assert_eq!(WIRE_VERSION, 1);
        assert_eq!(bulk_protocol(), "/p2ptrain/bulk/1");
    }
}
