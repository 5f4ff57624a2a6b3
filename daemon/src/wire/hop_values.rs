//! A ring hop's values, byte for byte: little-endian `f32`, bf16, or int8 in blocks of
//! [`INT8_BLOCK`] values that share a power-of-two scale. The sender rounds its own copy
//! exactly as its receivers decode it ([`ValueEncoding::round_as_sent`]), so the members of a
//! ring still end with the same bits. The weight a hop ends with travels as the encoding's
//! trailer: bf16 in a bf16 hop, `f32` otherwise.
//!
//! Int8's scale is a power of two, sent as its exponent in one byte: a value times it is
//! exact, so rounding values that were already rounded changes none of them (a block whose
//! largest value shrank takes a finer scale, on which the old grid lies). That is what lets a
//! member round its contribution chunk by chunk once and send it unchanged, and an owner round
//! its aggregate of such parts. Each block costs one byte more than its values: 65 bytes for
//! 64 values, a little over a quarter of `f32`'s.

use serde::{Deserialize, Serialize};

/// Values that share one scale in an int8 hop.
pub const INT8_BLOCK: usize = 64;

/// The exponent byte of a block that held a NaN or an infinity: it decodes to NaNs, which the
/// receiver refuses as it refuses a non-finite `f32`.
const NOT_FINITE: i8 = i8::MIN;
/// The smallest exponent of a scale (2^-126, `f32`'s smallest normal): a block whose largest
/// value is below 127 times it rounds to zeros and small multiples of it.
const MIN_EXPONENT: i32 = -126;
/// The largest exponent a byte may name (`f32`'s largest); an honest sender names at most
/// 122 (`f32::MAX` / 127 < 2^122).
const MAX_EXPONENT: i32 = 127;

/// How a ring hop's values travel ([`crate::wire::RingMessage::encoding`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueEncoding {
    /// Four bytes a value: parameters, and anything a member must keep bit for bit.
    #[default]
    F32,
    /// Two bytes a value, 2^-8 of each: gradients, and `diloco`'s outer changes.
    Bf16,
    /// A little over one byte a value, each within 1/127 of the largest in its block of
    /// [`INT8_BLOCK`]: `diloco`'s outer changes on a slow link.
    Int8,
}

impl ValueEncoding {
    /// The name in configs (`sync.outer_values`).
    pub fn name(self) -> &'static str {
        match self {
            ValueEncoding::F32 => "f32",
            ValueEncoding::Bf16 => "bf16",
            ValueEncoding::Int8 => "int8",
        }
    }

    /// Every value of `values` as it arrives where it is sent as one hop (the blocks of an
    /// int8 hop start at its first value), in place.
    pub fn round_as_sent(self, values: &mut [f32]) {
        match self {
            ValueEncoding::F32 => {}
            ValueEncoding::Bf16 => {
                for v in values.iter_mut() {
                    *v = f32::from_bits(u32::from(bf16_bits(*v)) << 16);
                }
            }
            ValueEncoding::Int8 => {
                for block in values.chunks_mut(INT8_BLOCK) {
                    let exponent = block_exponent(block);
                    let scale = scale_of(exponent);
                    for v in block.iter_mut() {
                        *v = f32::from(quantize(*v, exponent)) * scale;
                    }
                }
            }
        }
    }

    /// The weight after a hop's values as it arrives: bf16 in a bf16 hop.
    pub fn round_weight(self, weight: f32) -> f32 {
        match self {
            ValueEncoding::Bf16 => f32::from_bits(u32::from(bf16_bits(weight)) << 16),
            ValueEncoding::F32 | ValueEncoding::Int8 => weight,
        }
    }

    /// `values` and then `last` (the hop's weight), as this encoding sends them. `f32` and
    /// bf16 loop over pre-sized slices, not `extend`, so that they vectorise: on the critical
    /// path of every `ddp` step.
    pub fn encode(self, values: &[f32], last: f32) -> Vec<u8> {
        match self {
            ValueEncoding::F32 => {
                let mut bytes = vec![0u8; (values.len() + 1) * 4];
                let (body, tail) = bytes.split_at_mut(values.len() * 4);
                for (v, out) in values.iter().zip(body.chunks_exact_mut(4)) {
                    out.copy_from_slice(&v.to_le_bytes());
                }
                tail.copy_from_slice(&last.to_le_bytes());
                bytes
            }
            ValueEncoding::Bf16 => {
                let mut bytes = vec![0u8; (values.len() + 1) * 2];
                let (body, tail) = bytes.split_at_mut(values.len() * 2);
                for (v, out) in values.iter().zip(body.chunks_exact_mut(2)) {
                    out.copy_from_slice(&bf16_bits(*v).to_le_bytes());
                }
                tail.copy_from_slice(&bf16_bits(last).to_le_bytes());
                bytes
            }
            ValueEncoding::Int8 => {
                let blocks = values.len().div_ceil(INT8_BLOCK);
                let mut bytes = Vec::with_capacity(values.len() + blocks + 4);
                for block in values.chunks(INT8_BLOCK) {
                    let exponent = block_exponent(block);
                    bytes.push(exponent as u8);
                    bytes.extend(block.iter().map(|v| quantize(*v, exponent) as u8));
                }
                bytes.extend_from_slice(&last.to_le_bytes());
                bytes
            }
        }
    }

    /// A hop's values with its weight last; `None` when the bytes are not whole values of
    /// this encoding (an int8 hop's length says how many values its last block holds: one
    /// byte of exponent and at least one value). One pass into a pre-sized vector.
    pub fn decode(self, bytes: &[u8]) -> Option<Vec<f32>> {
        match self {
            ValueEncoding::F32 => {
                if !bytes.len().is_multiple_of(4) {
                    return None;
                }
                let mut values = vec![0f32; bytes.len() / 4];
                for (v, b) in values.iter_mut().zip(bytes.chunks_exact(4)) {
                    *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                Some(values)
            }
            ValueEncoding::Bf16 => {
                if !bytes.len().is_multiple_of(2) {
                    return None;
                }
                let mut values = vec![0f32; bytes.len() / 2];
                for (v, b) in values.iter_mut().zip(bytes.chunks_exact(2)) {
                    *v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
                Some(values)
            }
            ValueEncoding::Int8 => {
                let (body, tail) = bytes.split_at_checked(bytes.len().checked_sub(4)?)?;
                let last = f32::from_le_bytes(tail.try_into().ok()?);
                let stride = INT8_BLOCK + 1;
                let partial = body.len() % stride;
                if partial == 1 {
                    return None;
                }
                let count = body.len() / stride * INT8_BLOCK + partial.saturating_sub(1);
                let mut values = Vec::with_capacity(count + 1);
                for block in body.chunks(stride) {
                    let (exponent, qs) = block.split_first()?;
                    let scale = scale_of(*exponent as i8);
                    values.extend(qs.iter().map(|q| f32::from(*q as i8) * scale));
                }
                values.push(last);
                Some(values)
            }
        }
    }
}

impl std::str::FromStr for ValueEncoding {
    type Err = String;

    fn from_str(s: &str) -> Result<ValueEncoding, String> {
        [ValueEncoding::F32, ValueEncoding::Bf16, ValueEncoding::Int8]
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| format!("unknown value encoding {s:?}: one of f32, bf16, int8"))
    }
}

/// The exponent of the smallest power-of-two scale at which every value of `block` is at most
/// 127 steps from zero, or [`NOT_FINITE`].
fn block_exponent(block: &[f32]) -> i8 {
    let mut largest = 0f32;
    for v in block {
        if !v.is_finite() {
            return NOT_FINITE;
        }
        largest = largest.max(v.abs());
    }
    // Start below the exponent of largest / 127 (the division rounds) and step up until 127
    // times the scale (exact: 127 has 7 bits) covers the largest value.
    let guess = ((largest / 127.0).to_bits() >> 23) as i32 - 128;
    let mut exponent = guess.clamp(MIN_EXPONENT, MAX_EXPONENT);
    while exponent < MAX_EXPONENT && 127.0 * scale_of(exponent as i8) < largest {
        exponent += 1;
    }
    exponent as i8
}

/// 2^exponent; NaN for an exponent no honest sender names (below [`MIN_EXPONENT`]).
fn scale_of(exponent: i8) -> f32 {
    let e = i32::from(exponent);
    if e < MIN_EXPONENT {
        f32::NAN
    } else {
        f32::from_bits(((e + 127) as u32) << 23)
    }
}

/// `v` in steps of 2^exponent, to the nearest (ties away from zero), within ±127.
fn quantize(v: f32, exponent: i8) -> i8 {
    if exponent == NOT_FINITE {
        return 0;
    }
    (v / scale_of(exponent)).round().clamp(-127.0, 127.0) as i8
}

/// `v` rounded to the nearest bf16 (ties to even), as its bits: what `half::bf16::from_f32`
/// gives, bit for bit (a NaN stays a NaN, a finite value past bf16's range becomes infinite),
/// written so that a loop of it vectorises.
#[inline(always)]
pub fn bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let nearest_even = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((x >> 16) | 0x0040) as u16;
    if x & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        nearest_even
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) as f32;
                (x * 1e-9).sin() * 10f32.powi((i % 9) as i32 - 6)
            })
            .collect()
    }

    /// What a sender keeps is what its receiver decodes, bit for bit, for every length around
    /// a block's; rounding again changes nothing (a member rounds its chunks once and an owner
    /// its aggregate of rounded parts); and each value is within half a step of its block.
    #[test]
    fn int8_hops_decode_to_what_their_sender_kept_and_rounding_twice_changes_nothing() {
        for n in [0usize, 1, 2, 63, 64, 65, 127, 128, 129, 1000] {
            let values = sample(n, n as u32);
            let mut kept = values.clone();
            ValueEncoding::Int8.round_as_sent(&mut kept);
            let bytes = ValueEncoding::Int8.encode(&values, 0.375);
            assert_eq!(bytes.len(), n + n.div_ceil(INT8_BLOCK) + 4, "n = {n}");
            let decoded = ValueEncoding::Int8.decode(&bytes).expect("whole values");
            assert_eq!(decoded.len(), n + 1, "n = {n}");
            assert_eq!(decoded[n], 0.375);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&decoded[..n]), bits(&kept), "n = {n}");
            let mut again = kept.clone();
            ValueEncoding::Int8.round_as_sent(&mut again);
            assert_eq!(bits(&again), bits(&kept), "n = {n}: rounded twice");
            for (block, got) in values.chunks(INT8_BLOCK).zip(kept.chunks(INT8_BLOCK)) {
                let largest = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (v, g) in block.iter().zip(got) {
                    assert!(
                        (v - g).abs() <= largest / 127.0 + f32::MIN_POSITIVE,
                        "{v} -> {g}"
                    );
                }
            }
        }
    }

    /// A block with a NaN or an infinity arrives as NaNs (refused as any non-finite hop); so
    /// does a block whose exponent byte no sender names; bytes that are not whole blocks are
    /// refused; no input panics.
    #[test]
    fn int8_hops_carry_no_infinity_and_refuse_what_no_sender_writes() {
        let mut values = sample(130, 7);
        values[70] = f32::INFINITY;
        let decoded = ValueEncoding::Int8
            .decode(&ValueEncoding::Int8.encode(&values, 1.0))
            .expect("whole values");
        assert!(decoded[..64].iter().all(|v| v.is_finite()));
        assert!(decoded[64..128].iter().all(|v| v.is_nan()));
        assert!(decoded[128..130].iter().all(|v| v.is_finite()));
        let mut rounded = values.clone();
        ValueEncoding::Int8.round_as_sent(&mut rounded);
        assert!(rounded[64..128].iter().all(|v| v.is_nan()));
        for exponent in [-127i8, -128] {
            let mut bytes = vec![exponent as u8, 1, 2];
            bytes.extend_from_slice(&1f32.to_le_bytes());
            let decoded = ValueEncoding::Int8.decode(&bytes).expect("two values");
            assert!(decoded[..2].iter().all(|v| v.is_nan()), "{exponent}");
        }
        // 127 steps of 2^127: past f32's range.
        let mut bytes = vec![127u8, 127];
        bytes.extend_from_slice(&1f32.to_le_bytes());
        assert!(ValueEncoding::Int8.decode(&bytes).expect("one value")[0].is_infinite());
        // An exponent and no value, or no weight.
        assert!(ValueEncoding::Int8.decode(&[0, 0, 0, 0, 0]).is_none());
        assert!(ValueEncoding::Int8.decode(&[0, 0, 0]).is_none());
        assert_eq!(
            ValueEncoding::Int8.decode(&[0, 0, 128, 63]),
            Some(vec![1.0])
        );
        for len in 0..300usize {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 % 256) as u8).collect();
            if let Some(v) = ValueEncoding::Int8.decode(&bytes) {
                assert!(!v.is_empty(), "{len} bytes");
            }
            for encoding in [ValueEncoding::F32, ValueEncoding::Bf16] {
                encoding.decode(&bytes);
            }
        }
    }

    /// The config names parse back to their encodings, and nothing else does.
    #[test]
    fn encodings_parse_from_their_names() {
        for e in [ValueEncoding::F32, ValueEncoding::Bf16, ValueEncoding::Int8] {
            assert_eq!(e.name().parse::<ValueEncoding>(), Ok(e));
        }
        assert!("int4".parse::<ValueEncoding>().is_err());
    }
}
