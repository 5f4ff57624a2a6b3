//! What p2ptrain nodes say to each other, byte for byte: the framing of update messages on a
//! node's gossip topic, the heartbeats every member publishes, and (re-exported) the bulk
//! requests and replies. Every format a peer parses is here, so a change to one is a change
//! to this file and to [`WIRE_VERSION`].

use serde::{Deserialize, Serialize};

pub use crate::network::{BulkRequest, BulkResponse, StateManifest};

/// Version of the formats in this module. Bumped when a message changes meaning: version 2
/// carries a full sync's parameters in the codec's dense format (header, checksum) instead of
/// raw little-endian floats.
pub const WIRE_VERSION: u32 = 2;

/// First byte of an update message that carries the encoded update itself.
const INLINE: u8 = b'U';
/// First byte of an update message that announces a large update by hash.
const ANNOUNCE: u8 = b'A';
/// Length of an announcement after its kind byte: hash, size, step.
const ANNOUNCE_LEN: usize = 32 + 8 + 8;

/// A message on a node's update topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateFrame<'a> {
    /// The encoded update (see `p2ptrain_models::codec`), small enough for gossip.
    Inline(&'a [u8]),
    /// A larger update, to be pulled from its author over the bulk channel by hash.
    Announce {
        /// SHA-256 of the encoded update.
        hash: [u8; 32],
        /// Its length in bytes.
        size: u64,
        /// The author's step.
        step: u64,
    },
}

/// Frames an update message.
pub fn encode_update_frame(frame: &UpdateFrame<'_>) -> Vec<u8> {
    match frame {
        UpdateFrame::Inline(bytes) => {
            let mut msg = Vec::with_capacity(bytes.len() + 1);
            msg.push(INLINE);
            msg.extend_from_slice(bytes);
            msg
        }
        UpdateFrame::Announce { hash, size, step } => {
            let mut msg = Vec::with_capacity(1 + ANNOUNCE_LEN);
            msg.push(ANNOUNCE);
            msg.extend_from_slice(hash);
            msg.extend_from_slice(&size.to_le_bytes());
            msg.extend_from_slice(&step.to_le_bytes());
            msg
        }
    }
}

/// Reads an update message's frame; the error says what is wrong, for the rejection.
pub fn decode_update_frame(data: &[u8]) -> Result<UpdateFrame<'_>, &'static str> {
    match data.split_first() {
        Some((&INLINE, bytes)) => Ok(UpdateFrame::Inline(bytes)),
        Some((&ANNOUNCE, rest)) if rest.len() == ANNOUNCE_LEN => {
            let mut hash = [0u8; 32];
            hash.copy_from_slice(&rest[..32]);
            let word = |r: &[u8]| u64::from_le_bytes(r.try_into().unwrap_or([0; 8]));
            Ok(UpdateFrame::Announce {
                hash,
                size: word(&rest[32..40]),
                step: word(&rest[40..48]),
            })
        }
        _ => Err("unknown update message kind"),
    }
}

/// What a peer last told the mesh about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Its step.
    pub step: u64,
    /// Its recent loss.
    pub loss: Option<f64>,
    /// Its throughput.
    pub samples_per_sec: f64,
    /// Its latest held-out accuracy.
    pub accuracy: Option<f64>,
    /// Set in the last heartbeat of a node that leaves gracefully.
    #[serde(default)]
    pub leaving: bool,
}

/// A heartbeat's bytes (JSON: small, rare, and readable in a packet capture).
pub fn encode_heartbeat(hb: &Heartbeat) -> Vec<u8> {
    serde_json::to_vec(hb).unwrap_or_default()
}

/// Reads a heartbeat.
pub fn decode_heartbeat(data: &[u8]) -> Result<Heartbeat, serde_json::Error> {
    serde_json::from_slice(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_frames_round_trip_and_odd_bytes_are_refused() {
        let inline = encode_update_frame(&UpdateFrame::Inline(b"abc"));
        assert_eq!(
            decode_update_frame(&inline),
            Ok(UpdateFrame::Inline(b"abc"))
        );
        let announce = UpdateFrame::Announce {
            hash: [7; 32],
            size: 1234,
            step: 99,
        };
        let bytes = encode_update_frame(&announce);
        assert_eq!(decode_update_frame(&bytes), Ok(announce));
        assert!(decode_update_frame(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode_update_frame(b"").is_err());
        assert!(decode_update_frame(b"Zxyz").is_err());
    }

    #[test]
    fn heartbeats_round_trip() {
        let hb = Heartbeat {
            step: 5,
            loss: Some(0.5),
            samples_per_sec: 10.0,
            accuracy: None,
            leaving: true,
        };
        assert_eq!(
            decode_heartbeat(&encode_heartbeat(&hb)).expect("round trip"),
            hb
        );
        assert!(decode_heartbeat(b"{not json").is_err());
    }
}
