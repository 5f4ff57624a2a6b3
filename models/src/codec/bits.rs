//! Fixed-width unsigned integers packed into bytes, least significant bit first: the top-k
//! codec's delta-coded indices.

/// Packs unsigned integers of a fixed bit width, least significant bit first.
pub(super) struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    bits: u32,
}

impl<'a> BitWriter<'a> {
    pub(super) fn new(out: &'a mut Vec<u8>) -> Self {
        BitWriter {
            out,
            acc: 0,
            bits: 0,
        }
    }

    pub(super) fn put(&mut self, value: u32, width: u32) {
        if width == 0 {
            return;
        }
        self.acc |= u64::from(value) << self.bits;
        self.bits += width;
        while self.bits >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.bits -= 8;
        }
    }

    pub(super) fn finish(self) {
        if self.bits > 0 {
            self.out.push(self.acc as u8);
        }
    }
}

/// Reads what [`BitWriter`] wrote; the caller has checked there are enough bytes.
pub(super) struct BitReader<'a> {
    bytes: &'a [u8],
    at: usize,
    acc: u64,
    bits: u32,
}

impl<'a> BitReader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        BitReader {
            bytes,
            at: 0,
            acc: 0,
            bits: 0,
        }
    }

    pub(super) fn get(&mut self, width: u32) -> u32 {
        if width == 0 {
            return 0;
        }
        while self.bits < width {
            let b = self.bytes.get(self.at).copied().unwrap_or(0);
            self.at += 1;
            self.acc |= u64::from(b) << self.bits;
            self.bits += 8;
        }
        let mask = if width == 32 {
            u64::from(u32::MAX)
        } else {
            (1u64 << width) - 1
        };
        let v = (self.acc & mask) as u32;
        self.acc >>= width;
        self.bits -= width;
        v
    }
}

pub(super) fn bits_for(v: u32) -> u32 {
    32 - v.leading_zeros()
}
