//! GGML tensor types and their dequantization to f32, value for value what
//! `gguf.quants.dequantize` (llama.cpp's `gguf-py`) computes: the same block layouts and
//! the same f32 operations in the same order, so results are equal bit for bit.

use super::GgufError;

/// Values in one K-quant super-block.
const QK_K: usize = 256;

/// A tensor element type of a GGUF file that Regatta reads (named as GGML names them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of 32: an f16 scale, 4-bit values offset by 8.
    Q4_0,
    /// Blocks of 32: an f16 scale and minimum, 4-bit values.
    Q4_1,
    /// Blocks of 32: an f16 scale, 5-bit values offset by 16.
    Q5_0,
    /// Blocks of 32: an f16 scale and minimum, 5-bit values.
    Q5_1,
    /// Blocks of 32: an f16 scale, 8-bit values.
    Q8_0,
    /// Super-blocks of 256: eight sub-blocks with 6-bit scales and minimums, 4-bit values.
    Q4_K,
    /// Super-blocks of 256: as Q4_K with a fifth bit.
    Q5_K,
    /// Super-blocks of 256: sixteen 8-bit scales, 6-bit values.
    Q6_K,
    /// Super-blocks of 256: an f32 scale, 8-bit values (and sums llama.cpp keeps beside them).
    Q8_K,
}

impl GgmlType {
    /// The type with GGML's numeric id, or the id's name when Regatta does not read it.
    pub fn from_id(id: u32) -> Result<Self, &'static str> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            15 => Self::Q8_K,
            30 => Self::BF16,
            other => return Err(unsupported_name(other)),
        })
    }

    /// GGML's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Q8_K => "Q8_K",
        }
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4_K | Self::Q5_K | Self::Q6_K | Self::Q8_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 2 + 16,
            Self::Q4_1 => 2 + 2 + 16,
            Self::Q5_0 => 2 + 4 + 16,
            Self::Q5_1 => 2 + 2 + 4 + 16,
            Self::Q8_0 => 2 + 32,
            Self::Q4_K => 2 + 2 + 12 + QK_K / 2,
            Self::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            Self::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            Self::Q8_K => 4 + QK_K + QK_K / 8,
        }
    }

    /// Bytes `values` values take, or `None` when `row` (the innermost dimension) is not a
    /// whole number of blocks.
    pub fn bytes_for(self, row: u64, values: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if row == 0 || !row.is_multiple_of(block) {
            return None;
        }
        (values / block).checked_mul(self.type_size() as u64)
    }
}

/// GGML's names of the types Regatta does not read, so a refusal names what it met.
fn unsupported_name(id: u32) -> &'static str {
    match id {
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        _ => "an unknown type",
    }
}

/// IEEE half to f32, exactly (every half is an f32).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exponent = u32::from((h >> 10) & 0x1f);
    let mantissa = u32::from(h & 0x3ff);
    let bits = match (exponent, mantissa) {
        (0, 0) => sign,
        (0, _) => {
            // A subnormal half is a normal f32: shift the mantissa up to its leading one.
            let mut e = 127 - 15 + 1;
            let mut m = mantissa;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, _) => sign | 0x7f80_0000 | (mantissa << 13),
        _ => sign | ((exponent + 127 - 15) << 23) | (mantissa << 13),
    };
    f32::from_bits(bits)
}

fn half(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Dequantizes `bytes` of type `kind` into `out`, which must hold exactly the values the
/// bytes encode.
pub fn dequantize(kind: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    let (block, size) = (kind.block_size(), kind.type_size());
    if !out.len().is_multiple_of(block) || bytes.len() != out.len() / block * size {
        return Err(GgufError::Malformed(format!(
            "{} bytes of {} cannot hold {} values",
            bytes.len(),
            kind.name(),
            out.len()
        )));
    }
    let blocks = bytes.chunks_exact(size).zip(out.chunks_exact_mut(block));
    match kind {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => blocks.for_each(|(b, o)| o[0] = half(b, 0)),
        GgmlType::BF16 => {
            for (b, o) in blocks {
                o[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, o)| q4_0(b, o)),
        GgmlType::Q4_1 => blocks.for_each(|(b, o)| q4_1(b, o)),
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| q5_0(b, o)),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| q5_1(b, o)),
        GgmlType::Q8_0 => {
            for (b, o) in blocks {
                let d = half(b, 0);
                for (v, q) in o.iter_mut().zip(&b[2..34]) {
                    *v = f32::from(*q as i8) * d;
                }
            }
        }
        GgmlType::Q4_K => blocks.for_each(|(b, o)| q4_k(b, o)),
        GgmlType::Q5_K => blocks.for_each(|(b, o)| q5_k(b, o)),
        GgmlType::Q6_K => blocks.for_each(|(b, o)| q6_k(b, o)),
        GgmlType::Q8_K => {
            for (b, o) in blocks {
                let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                for (v, q) in o.iter_mut().zip(&b[4..4 + QK_K]) {
                    *v = d * f32::from(*q as i8);
                }
            }
        }
    }
    Ok(())
}

/// The 4-bit value `j` (0..32) of a 32-value block: low nibbles first, then high ones.
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < 16 {
        qs[j] & 0x0f
    } else {
        qs[j - 16] >> 4
    }
}

fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    for (j, v) in o.iter_mut().enumerate() {
        *v = d * f32::from(nibble(&b[2..18], j) as i8 - 8);
    }
}

fn q4_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for (j, v) in o.iter_mut().enumerate() {
        *v = d * f32::from(nibble(&b[4..20], j)) + m;
    }
}

/// The 5-bit value `j` of a Q5 block: its nibble and bit `j` of the 32-bit high mask.
fn five_bits(qh: u32, qs: &[u8], j: usize) -> u8 {
    nibble(qs, j) | ((((qh >> j) & 1) as u8) << 4)
}

fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, v) in o.iter_mut().enumerate() {
        *v = d * f32::from(five_bits(qh, &b[6..22], j) as i8 - 16);
    }
}

fn q5_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, v) in o.iter_mut().enumerate() {
        *v = d * f32::from(five_bits(qh, &b[8..24], j)) + m;
    }
}

/// The eight 6-bit scales and minimums packed in a K-quant's 12 bytes.
fn scales_and_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut scale, mut min) = ([0u8; 8], [0u8; 8]);
    for i in 0..4 {
        scale[i] = s[i] & 0x3f;
        min[i] = s[4 + i] & 0x3f;
        scale[4 + i] = (s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30);
        min[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
    (scale, min)
}

/// The 4-bit value `l` (0..32) of sub-block `j` (0..8) of a K-quant: 32 bytes hold two
/// sub-blocks, the even one in the low nibbles.
fn k_nibble(qs: &[u8], j: usize, l: usize) -> u8 {
    (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f
}

fn q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (scale, min) = scales_and_mins(&b[4..16]);
    let qs = &b[16..16 + QK_K / 2];
    for (j, sub) in o.chunks_exact_mut(32).enumerate() {
        let (dl, ml) = (d * f32::from(scale[j]), dmin * f32::from(min[j]));
        for (l, v) in sub.iter_mut().enumerate() {
            *v = dl * f32::from(k_nibble(qs, j, l)) - ml;
        }
    }
}

fn q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (scale, min) = scales_and_mins(&b[4..16]);
    let qh = &b[16..16 + QK_K / 8];
    let qs = &b[16 + QK_K / 8..16 + QK_K / 8 + QK_K / 2];
    for (j, sub) in o.chunks_exact_mut(32).enumerate() {
        let (dl, ml) = (d * f32::from(scale[j]), dmin * f32::from(min[j]));
        for (l, v) in sub.iter_mut().enumerate() {
            let q = k_nibble(qs, j, l) | (((qh[l] >> j) & 1) << 4);
            *v = dl * f32::from(q) - ml;
        }
    }
}

fn q6_k(b: &[u8], o: &mut [f32]) {
    let ql = &b[..QK_K / 2];
    let qh = &b[QK_K / 2..QK_K / 2 + QK_K / 4];
    let scales = &b[QK_K / 2 + QK_K / 4..QK_K / 2 + QK_K / 4 + QK_K / 16];
    let d = half(b, QK_K / 2 + QK_K / 4 + QK_K / 16);
    for (p, v) in o.iter_mut().enumerate() {
        // Two halves of 128 values; in each, the low 4 bits come from 64 bytes (low
        // nibbles, then high ones) and the high 2 bits from 32 bytes (four shifts).
        let (h, within) = (p / 128, p % 128);
        let low = (ql[h * 64 + within % 64] >> (4 * (within / 64))) & 0x0f;
        let high = (qh[h * 32 + within % 32] >> (2 * (within / 32))) & 0x03;
        let q = (low | (high << 4)) as i8 - 32;
        *v = (d * f32::from(scales[p / 16] as i8)) * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_convert_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x0200), 2f32.powi(-15));
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert!(f16_to_f32(0x7c00).is_infinite());
        assert!(f16_to_f32(0x7e00).is_nan());
    }

    #[test]
    fn a_q8_k_block_is_its_scale_times_its_values() {
        // Q8_K has no quantizer in gguf-py to make a fixture with: a hand-made block.
        let mut block = vec![0u8; GgmlType::Q8_K.type_size()];
        block[..4].copy_from_slice(&0.5f32.to_le_bytes());
        for (i, q) in block[4..4 + QK_K].iter_mut().enumerate() {
            *q = (i as i32 - 128) as i8 as u8;
        }
        let mut out = vec![0f32; QK_K];
        dequantize(GgmlType::Q8_K, &block, &mut out).expect("dequantize");
        assert_eq!(out[0], -64.0);
        assert_eq!(out[128], 0.0);
        assert_eq!(out[255], 63.5);
    }

    #[test]
    fn a_q4_0_block_reads_low_nibbles_then_high_ones() {
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&0x4000u16.to_le_bytes()); // 2.0
        block[2] = 0xf0; // value 0 = 0 - 8, value 16 = 15 - 8
        let mut out = vec![0f32; 32];
        dequantize(GgmlType::Q4_0, &block, &mut out).expect("dequantize");
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
        assert_eq!(out[1], -16.0);
    }

    #[test]
    fn a_wrong_byte_count_is_an_error() {
        let mut out = vec![0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out[..31]).is_err());
    }

    #[test]
    fn types_are_named_by_their_ids() {
        assert_eq!(GgmlType::from_id(14), Ok(GgmlType::Q6_K));
        assert_eq!(GgmlType::from_id(11), Err("Q3_K"));
        assert_eq!(GgmlType::from_id(999), Err("an unknown type"));
        assert_eq!(GgmlType::Q4_1.bytes_for(64, 128), Some(4 * 20));
        assert_eq!(GgmlType::Q6_K.bytes_for(64, 64), None);
    }
}
