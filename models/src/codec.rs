//! The wire format of a parameter update, and its codecs.
//!
//! An update is the change of a node's parameters over some local steps, flattened in the
//! canonical (name-sorted) order. On the wire it is a fixed header, a codec-specific payload
//! and a checksum. Decoding trusts nothing: every size is checked against the layout the
//! receiver already knows before anything is allocated, so hostile bytes cannot make a node
//! panic or allocate without bound.

use sha2::{Digest, Sha256};

/// First bytes of every update message.
pub const MAGIC: &[u8; 4] = b"P2PU";
/// Wire format version; a receiver rejects any other.
pub const VERSION: u8 = 1;
/// Header bytes before the payload.
pub const HEADER_LEN: usize = 4 + 1 + 1 + 2 + 8 + 8 + 8 + 4 + 4;
/// Checksum bytes after the payload.
pub const CHECKSUM_LEN: usize = 8;

/// How the values of an update are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Every value as a little-endian `f32`.
    Dense,
}

impl Codec {
    fn id(self) -> u8 {
        match self {
            Codec::Dense => 0,
        }
    }

    fn from_id(id: u8) -> Option<Codec> {
        match id {
            0 => Some(Codec::Dense),
            _ => None,
        }
    }
}

/// What a receiver checks before it looks at the values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdateHeader {
    /// The run the update belongs to (first 8 bytes of the run id).
    pub run_id: [u8; 8],
    /// The parameter layout it was computed on (first 8 bytes of the layout hash).
    pub layout: [u8; 8],
    /// The sender's training step when it published.
    pub step: u64,
    /// How the payload is encoded.
    pub codec: Codec,
    /// Number of parameters the update covers.
    pub numel: u32,
}

/// Why an update was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// Too short, wrong magic, unknown version or codec, or sizes that disagree.
    #[error("malformed update: {0}")]
    Malformed(String),
    /// The checksum does not match.
    #[error("update checksum mismatch")]
    Checksum,
    /// It covers another number of parameters than this model has.
    #[error("update covers {got} parameters, the model has {expected}")]
    WrongLayout {
        /// Parameters in the update.
        got: u32,
        /// Parameters in the receiver's model.
        expected: usize,
    },
}

/// The first 8 bytes of a hex id (run id, layout hash), as carried in headers.
pub fn id_bytes(hex_id: &str) -> [u8; 8] {
    let mut out = [0u8; 8];
    if let Ok(bytes) = hex::decode(hex_id) {
        for (o, b) in out.iter_mut().zip(bytes) {
            *o = b;
        }
    }
    out
}

fn checksum(bytes: &[u8]) -> [u8; CHECKSUM_LEN] {
    let d = Sha256::digest(bytes);
    let mut out = [0u8; CHECKSUM_LEN];
    out.copy_from_slice(&d[..CHECKSUM_LEN]);
    out
}

/// Encodes an update.
pub fn encode(header: &UpdateHeader, values: &[f32]) -> Vec<u8> {
    let payload_len = values.len() * 4;
    let mut out = Vec::with_capacity(HEADER_LEN + payload_len + CHECKSUM_LEN);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(header.codec.id());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&header.run_id);
    out.extend_from_slice(&header.layout);
    out.extend_from_slice(&header.step.to_le_bytes());
    out.extend_from_slice(&(values.len() as u32).to_le_bytes());
    out.extend_from_slice(&(payload_len as u32).to_le_bytes());
    match header.codec {
        Codec::Dense => {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    let sum = checksum(&out);
    out.extend_from_slice(&sum);
    out
}

/// Reads just the header, checking magic, version, codec and the checksum.
pub fn decode_header(bytes: &[u8]) -> Result<UpdateHeader, CodecError> {
    let bad = |m: &str| CodecError::Malformed(m.to_string());
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(bad("shorter than a header"));
    }
    if &bytes[..4] != MAGIC {
        return Err(bad("not an update (bad magic)"));
    }
    if bytes[4] != VERSION {
        return Err(CodecError::Malformed(format!(
            "wire version {} (this node speaks {VERSION})",
            bytes[4]
        )));
    }
    let codec = Codec::from_id(bytes[5])
        .ok_or_else(|| CodecError::Malformed(format!("unknown codec {}", bytes[5])))?;
    let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if checksum(body) != sum {
        return Err(CodecError::Checksum);
    }
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let u32_at = |at: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&bytes[at..at + 4]);
        u32::from_le_bytes(b)
    };
    let mut run_id = [0u8; 8];
    run_id.copy_from_slice(&bytes[8..16]);
    let mut layout = [0u8; 8];
    layout.copy_from_slice(&bytes[16..24]);
    let numel = u32_at(32);
    let payload_len = u32_at(36) as usize;
    if HEADER_LEN + payload_len + CHECKSUM_LEN != bytes.len() {
        return Err(bad("payload length disagrees with the message size"));
    }
    Ok(UpdateHeader {
        run_id,
        layout,
        step: u64_at(24),
        codec,
        numel,
    })
}

/// Decodes an update for a model of `expected_numel` parameters.
pub fn decode(bytes: &[u8], expected_numel: usize) -> Result<(UpdateHeader, Vec<f32>), CodecError> {
    let header = decode_header(bytes)?;
    if header.numel as usize != expected_numel {
        return Err(CodecError::WrongLayout {
            got: header.numel,
            expected: expected_numel,
        });
    }
    let payload = &bytes[HEADER_LEN..bytes.len() - CHECKSUM_LEN];
    let values = match header.codec {
        Codec::Dense => {
            if payload.len() != expected_numel * 4 {
                return Err(CodecError::Malformed(
                    "dense payload size disagrees with numel".into(),
                ));
            }
            payload
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        }
    };
    Ok((header, values))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(numel: u32) -> UpdateHeader {
        UpdateHeader {
            run_id: id_bytes("0123456789abcdef"),
            layout: id_bytes("fedcba9876543210"),
            step: 77,
            codec: Codec::Dense,
            numel,
        }
    }

    #[test]
    fn dense_round_trip_and_layout_check() {
        let values = vec![1.0, -2.5, 0.0, 3.25];
        let bytes = encode(&header(4), &values);
        let (h, back) = decode(&bytes, 4).expect("decode");
        assert_eq!(h, header(4));
        assert_eq!(back, values);
        assert!(matches!(
            decode(&bytes, 5),
            Err(CodecError::WrongLayout { .. })
        ));
        let mut flipped = bytes.clone();
        flipped[HEADER_LEN + 1] ^= 1;
        assert_eq!(decode(&flipped, 4), Err(CodecError::Checksum));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), numel in 0usize..64) {
            let _ = decode(&bytes, numel);
        }

        #[test]
        fn dense_round_trips(values in proptest::collection::vec(-1e6f32..1e6, 0..300)) {
            let bytes = encode(&header(values.len() as u32), &values);
            let (_, back) = decode(&bytes, values.len()).expect("decode");
            prop_assert_eq!(back, values);
        }
    }
}
