//! The top-k codec's sections: the largest-magnitude values of a tensor, their indices
//! delta-coded and bit-packed, the values as `f32` or `f16`; decoding checks every count and
//! index against the tensor it belongs to.

use half::f16;

use super::bits::{bits_for, BitReader, BitWriter};
use super::{take, CodecError, ValueFormat};

pub(super) fn encode_topk(
    x: &[f32],
    y: &mut [f32],
    density: f64,
    format: ValueFormat,
    out: &mut Vec<u8>,
) {
    if x.is_empty() {
        out.extend_from_slice(&0u32.to_le_bytes());
        out.push(0);
        return;
    }
    let k = ((density * x.len() as f64).ceil() as usize).clamp(1, x.len());
    let idx = top_indices(x, k);
    let mut width = 0;
    let mut prev: Option<u32> = None;
    for &i in &idx {
        let gap = prev.map_or(i, |p| i - p - 1);
        width = width.max(bits_for(gap));
        prev = Some(i);
    }
    out.extend_from_slice(&(k as u32).to_le_bytes());
    out.push(width as u8);
    let mut w = BitWriter::new(out);
    let mut prev: Option<u32> = None;
    for &i in &idx {
        w.put(prev.map_or(i, |p| i - p - 1), width);
        prev = Some(i);
    }
    w.finish();
    for &i in &idx {
        let v = x[i as usize];
        let kept = match format {
            ValueFormat::F32 => {
                out.extend_from_slice(&v.to_le_bytes());
                v
            }
            ValueFormat::F16 => {
                let h = f16::from_f32(v);
                out.extend_from_slice(&h.to_le_bytes());
                h.to_f32()
            }
        };
        y[i as usize] = kept;
    }
}

/// The indices of the `k` largest magnitudes of `x` (ties broken towards lower indices),
/// ascending.
pub(super) fn top_indices(x: &[f32], k: usize) -> Vec<u32> {
    if k >= x.len() {
        return (0..x.len() as u32).collect();
    }
    // The k-th largest magnitude, found on a copy of the magnitudes (direct comparisons,
    // not through an index).
    let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let (_, kth, _) = mags.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let threshold = *kth;
    // One ascending pass takes every value at or above it; where more than k tie at it, the
    // highest-indexed ties go.
    let mut idx: Vec<u32> = Vec::with_capacity(k + 16);
    for (i, v) in x.iter().enumerate() {
        if v.abs().total_cmp(&threshold).is_ge() {
            idx.push(i as u32);
        }
    }
    if idx.len() > k {
        let ties = |i: u32| x[i as usize].abs().total_cmp(&threshold).is_eq();
        let tied = idx.iter().filter(|&&i| ties(i)).count();
        let mut keep = tied - (idx.len() - k);
        idx.retain(|&i| {
            if !ties(i) {
                return true;
            }
            let kept = keep > 0;
            keep = keep.saturating_sub(1);
            kept
        });
    }
    idx
}

pub(super) fn decode_topk(
    rest: &mut &[u8],
    y: &mut [f32],
    format: ValueFormat,
) -> Result<(), CodecError> {
    let head = take(rest, 5, "top-k section header")?;
    let k = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let width = u32::from(head[4]);
    if k > y.len() || (k == 0 && !y.is_empty()) {
        return Err(CodecError::Malformed(format!(
            "top-k keeps {k} of a tensor of {}",
            y.len()
        )));
    }
    if width > 32 {
        return Err(CodecError::Malformed(format!(
            "top-k index width {width} bits"
        )));
    }
    let index_bytes = (k * width as usize).div_ceil(8);
    let packed = take(rest, index_bytes, "top-k indices")?;
    let value_size = match format {
        ValueFormat::F32 => 4,
        ValueFormat::F16 => 2,
    };
    let vals = take(rest, k * value_size, "top-k values")?;
    let mut r = BitReader::new(packed);
    let mut prev: Option<u64> = None;
    for j in 0..k {
        let gap = u64::from(r.get(width));
        let i = match prev {
            None => gap,
            Some(p) => p + gap + 1,
        };
        if i >= y.len() as u64 {
            return Err(CodecError::Malformed(format!(
                "top-k index {i} outside a tensor of {}",
                y.len()
            )));
        }
        let c = &vals[j * value_size..(j + 1) * value_size];
        y[i as usize] = match format {
            ValueFormat::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            ValueFormat::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
        };
        prev = Some(i);
    }
    Ok(())
}
