//! Blockwise 4-bit quantization as bitsandbytes does it (QLoRA's frozen base), pure and
//! bit for bit: NF4 (the 16 NormalFloat levels of the QLoRA paper) and FP4, absmax per
//! block, optional double quantization (the absmax values less their mean, quantized to
//! bitsandbytes' dynamic 8-bit map in blocks of 256), two 4-bit codes a byte (the first
//! element in the high nibble). The arithmetic follows bitsandbytes 0.50's CPU paths step
//! for step (its default 4-bit kernel: reciprocal scaling, `bucketize` on the code's
//! midpoints; its C++ 8-bit kernel: a 65,536-entry lookup table), so the bytes equal
//! bitsandbytes' — checked on fixtures it made (torch/tests/qlora.rs). LLM.int8's
//! row-wise 8 bits are in `int8`.

mod dynamic_map;
mod int8;

use serde::{Deserialize, Serialize};

pub use dynamic_map::DYNAMIC_MAP_BITS;
pub use int8::{dequantize_int8_rows, quantize_int8_rows, Int8Rows};

/// The block the absmax values of double quantization are quantized in.
pub const NESTED_BLOCK: usize = 256;

/// A 4-bit data type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Quant4Type {
    /// NormalFloat 4 (QLoRA).
    Nf4,
    /// bitsandbytes' 4-bit float (1 sign, 2 exponent, 1 mantissa bit, scaled to [-1, 1]).
    Fp4,
}

const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// FP4's values in bit-pattern order: 0b000 0, 0b001 0.0625, then 8, 12, 4, 6, 2, 3, the
/// sign in the high bit, divided by 12 (code 8 is +0 as in bitsandbytes' table; its CPU
/// kernel gives -0 for it in a last, partial block).
const FP4_RAW: [f32; 16] = [
    0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0,
];

/// FP4's codes in ascending value (bitsandbytes' `argsort` of its table on the CPU; the two
/// zeros in index order).
const FP4_ORDER: [u8; 16] = [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3];

impl Quant4Type {
    /// The value each 4-bit code stands for (times the block's absmax).
    pub fn code(self) -> [f32; 16] {
        match self {
            Self::Nf4 => NF4,
            Self::Fp4 => FP4_RAW.map(|v| v / 12.0),
        }
    }

    /// Codes in ascending value.
    fn order(self) -> [u8; 16] {
        match self {
            Self::Nf4 => std::array::from_fn(|i| i as u8),
            Self::Fp4 => FP4_ORDER,
        }
    }

    /// The name bitsandbytes and `config.json` use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nf4 => "nf4",
            Self::Fp4 => "fp4",
        }
    }
}

/// The absmax values of the 4-bit blocks, kept as they are or quantized themselves.
#[derive(Clone, Debug, PartialEq)]
pub enum Absmax {
    /// One f32 a block.
    Plain(Vec<f32>),
    /// Double quantization: one byte a block, plus an f32 a [`NESTED_BLOCK`] of them and
    /// the mean taken out first.
    Double {
        /// The 8-bit code of each absmax less `offset`.
        codes: Vec<u8>,
        /// The absmax of each nested block.
        absmax: Vec<f32>,
        /// The mean of the absmax values.
        offset: f32,
    },
}

impl Absmax {
    /// The absmax of every 4-bit block (dequantized where double quantization holds them).
    pub fn values(&self) -> Vec<f32> {
        match self {
            Self::Plain(values) => values.clone(),
            Self::Double { codes, absmax, offset } => {
                let map = dynamic_map();
                codes
                    .iter()
                    .enumerate()
                    .map(|(i, code)| map[*code as usize] * absmax[i / NESTED_BLOCK] + offset)
                    .collect()
            }
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Plain(values) => values.len() * 4,
            Self::Double { codes, absmax, .. } => codes.len() + absmax.len() * 4 + 4,
        }
    }
}

/// A tensor quantized to 4 bits.
#[derive(Clone, Debug, PartialEq)]
pub struct Quant4 {
    /// The data type.
    pub kind: Quant4Type,
    /// Elements per absmax block.
    pub block: usize,
    /// Elements of the tensor.
    pub numel: usize,
    /// Two codes a byte, the first in the high nibble (`(numel + 1) / 2` bytes).
    pub packed: Vec<u8>,
    /// Per block.
    pub absmax: Absmax,
}

impl Quant4 {
    /// Bytes held (codes and absmax).
    pub fn bytes(&self) -> usize {
        self.packed.len() + self.absmax.bytes()
    }
}

/// A weight as a folder stores it quantized (bitsandbytes' 4-bit or 8-bit layout).
#[derive(Clone, Debug, PartialEq)]
pub enum Stored {
    /// NF4 or FP4 in blocks.
    Four(Quant4),
    /// LLM.int8's rows.
    Eight(Int8Rows),
}

/// Why a tensor cannot be quantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// Block sizes bitsandbytes takes: 32 to 4096, a power of two.
    #[error("quant_block_size must be a power of two from 32 to 4096, not {0}")]
    Block(usize),
    /// Nothing to quantize.
    #[error("an empty tensor cannot be quantized")]
    Empty,
    /// A row-wise quantization of a tensor whose length is not a whole number of rows.
    #[error("{len} elements are not whole rows of {cols}")]
    Ragged {
        /// Elements.
        len: usize,
        /// Elements a row.
        cols: usize,
    },
    /// NaN or infinity in the weights.
    #[error("the tensor holds a value that is not finite (at element {0})")]
    NotFinite(usize),
}

/// bitsandbytes' dynamic map as f32.
pub fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP_BITS.map(f32::from_bits)
}

/// Checks a block size (bitsandbytes: 32..=4096, a power of two).
pub fn check_block(block: usize) -> Result<(), QuantError> {
    if block.is_power_of_two() && (32..=4096).contains(&block) {
        Ok(())
    } else {
        Err(QuantError::Block(block))
    }
}

fn absmax_of(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Quantizes `values` (a tensor's elements in order) to 4 bits in blocks of `block`, with
/// the absmax values double-quantized when `double`.
pub fn quantize_4bit(values: &[f32], block: usize, kind: Quant4Type, double: bool) -> Result<Quant4, QuantError> {
    check_block(block)?;
    if values.is_empty() {
        return Err(QuantError::Empty);
    }
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NotFinite(at));
    }
    let code = kind.code();
    let order = kind.order();
    // Midpoints between neighbours in ascending order, in f32 as bitsandbytes computes them.
    let bounds: [f32; 15] = std::array::from_fn(|i| (code[order[i] as usize] + code[order[i + 1] as usize]) / 2.0);
    let index = |scaled: f32| {
        // torch.bucketize(right=False): how many bounds lie strictly below.
        let q = bounds.iter().take_while(|b| **b < scaled).count();
        order[q]
    };
    let full = values.len() - values.len() % block;
    let mut absmax = Vec::with_capacity(values.len().div_ceil(block));
    let mut codes = Vec::with_capacity(values.len() + 1);
    for chunk in values[..full].chunks(block) {
        let max = absmax_of(chunk);
        // Full blocks: times the reciprocal (torch: `A * (1.0 / absmax)`).
        let inverse = 1.0f32 / max.max(1e-38);
        absmax.push(max);
        codes.extend(chunk.iter().map(|v| index((v * inverse).clamp(-1.0, 1.0))));
    }
    if full < values.len() {
        let rest = &values[full..];
        let max = absmax_of(rest).max(1e-38);
        absmax.push(max);
        // The last, partial block: divided (torch: `A / am`).
        codes.extend(rest.iter().map(|v| index((v / max).clamp(-1.0, 1.0))));
    }
    if codes.len() % 2 == 1 {
        codes.push(index(0.0));
    }
    let packed = codes.chunks(2).map(|pair| (pair[0] << 4) | pair[1]).collect();
    let absmax = if double {
        double_quantize(&absmax)
    } else {
        Absmax::Plain(absmax)
    };
    Ok(Quant4 {
        kind,
        block,
        numel: values.len(),
        packed,
        absmax,
    })
}

/// The values a [`Quant4`] stands for (f32, as bitsandbytes dequantizes: code times absmax).
pub fn dequantize_4bit(q: &Quant4) -> Vec<f32> {
    let code = q.kind.code();
    let absmax = q.absmax.values();
    (0..q.numel)
        .map(|i| {
            let byte = q.packed[i / 2];
            let nibble = if i % 2 == 0 { byte >> 4 } else { byte & 0x0f };
            code[nibble as usize] * absmax[i / q.block]
        })
        .collect()
}

/// The mean of f32 values, accumulated in f64 and rounded once.
fn mean(values: &[f32]) -> f32 {
    (values.iter().map(|v| f64::from(*v)).sum::<f64>() / values.len() as f64) as f32
}

fn double_quantize(absmax: &[f32]) -> Absmax {
    double_quantize_around(absmax, mean(absmax))
}

/// Double quantization of `absmax` around `offset` (bitsandbytes takes torch's mean, whose
/// last bit depends on torch's summation order on the machine; [`quantize_4bit`] takes the
/// correctly rounded mean, at most an ulp away).
pub fn double_quantize_around(absmax: &[f32], offset: f32) -> Absmax {
    let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let (codes, nested) = quantize_8bit(&centred, NESTED_BLOCK);
    Absmax::Double {
        codes,
        absmax: nested,
        offset,
    }
}

const LUT_SIZE: usize = 65_536;

/// bitsandbytes' lookup table for the dynamic map: for 65,536 evenly spaced values of
/// [-1, 1], the nearest code (by the midpoints). Built once.
fn lookup_table() -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(build_lookup_table)
}

fn build_lookup_table() -> Vec<u8> {
    let map = dynamic_map();
    let midpoints: Vec<f32> = map.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
    let mut code = 0usize;
    (0..LUT_SIZE)
        .map(|i| {
            let value = -1.0f32 + (2.0f32 * i as f32) / (LUT_SIZE - 1) as f32;
            while code < midpoints.len() && midpoints[code] < value {
                code += 1;
            }
            code as u8
        })
        .collect()
}

/// Blockwise 8-bit quantization to the dynamic map (bitsandbytes' CPU kernel): returns the
/// codes and each block's absmax.
pub fn quantize_8bit(values: &[f32], block: usize) -> (Vec<u8>, Vec<f32>) {
    let lut = lookup_table();
    let mut codes = Vec::with_capacity(values.len());
    let mut absmax = Vec::with_capacity(values.len().div_ceil(block));
    for chunk in values.chunks(block) {
        let max = absmax_of(chunk);
        absmax.push(max);
        if max == 0.0 {
            codes.extend(std::iter::repeat_n(0u8, chunk.len()));
            continue;
        }
        let inverse = 1.0f32 / max;
        codes.extend(chunk.iter().map(|v| {
            let scaled = (v * inverse).clamp(-1.0, 1.0);
            let at = ((scaled + 1.0) * 0.5 * (LUT_SIZE - 1) as f32 + 0.5) as usize;
            lut[at.min(LUT_SIZE - 1)]
        }));
    }
    (codes, absmax)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    #[test]
    fn codes_pack_two_a_byte_high_nibble_first_and_come_back_within_a_level() {
        let values = sample(1000, 3);
        for kind in [Quant4Type::Nf4, Quant4Type::Fp4] {
            let q = quantize_4bit(&values, 64, kind, false).unwrap();
            assert_eq!(q.packed.len(), 500);
            let Absmax::Plain(absmax) = &q.absmax else {
                panic!("plain")
            };
            assert_eq!(absmax.len(), 16, "15 full blocks and the rest");
            let back = dequantize_4bit(&q);
            let code = kind.code();
            for (i, (v, b)) in values.iter().zip(&back).enumerate() {
                let a = absmax[i / 64];
                // The nearest level: no other level is closer to the scaled value.
                let scaled = v / a;
                let chosen = b / a;
                let best = code.iter().map(|c| (c - scaled).abs()).fold(f32::MAX, f32::min);
                assert!((chosen - scaled).abs() <= best + 1e-6, "{kind:?} element {i}");
            }
        }
        // The block's largest magnitude comes back exactly (code ±1).
        let q = quantize_4bit(&[0.5, -2.0, 0.1, 1.0], 32, Quant4Type::Nf4, false).unwrap();
        assert_eq!(dequantize_4bit(&q)[1], -2.0);
        assert_eq!(q.packed[0] & 0x0f, 0, "-2.0 / 2.0 = -1: NF4 code 0, in the low nibble");
    }

    #[test]
    fn double_quantization_keeps_the_absmax_close_and_takes_a_byte_a_block() {
        let values = sample(64 * 600, 9);
        let plain = quantize_4bit(&values, 64, Quant4Type::Nf4, false).unwrap();
        let double = quantize_4bit(&values, 64, Quant4Type::Nf4, true).unwrap();
        assert_eq!(plain.packed, double.packed, "the 4-bit codes do not depend on it");
        let (a, b) = (plain.absmax.values(), double.absmax.values());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 0.01 * x.abs().max(1e-3), "{x} vs {y}");
        }
        // 600 blocks: 600 code bytes, 3 nested absmax values and the offset.
        assert_eq!(double.absmax.bytes(), 600 + 3 * 4 + 4);
        assert_eq!(plain.absmax.bytes(), 600 * 4);
    }

    #[test]
    fn bad_blocks_empty_tensors_and_non_finite_values_are_refused() {
        assert_eq!(
            quantize_4bit(&[1.0], 48, Quant4Type::Nf4, false),
            Err(QuantError::Block(48))
        );
        assert_eq!(
            quantize_4bit(&[1.0], 8192, Quant4Type::Nf4, false),
            Err(QuantError::Block(8192))
        );
        assert_eq!(quantize_4bit(&[], 64, Quant4Type::Nf4, false), Err(QuantError::Empty));
        assert_eq!(
            quantize_4bit(&[1.0, f32::NAN], 64, Quant4Type::Fp4, true),
            Err(QuantError::NotFinite(1))
        );
        // An all-zero block quantizes to zeros, not NaN.
        let q = quantize_4bit(&[0.0; 64], 64, Quant4Type::Nf4, false).unwrap();
        assert!(dequantize_4bit(&q).iter().all(|v| *v == 0.0));
    }

    #[test]
    fn the_dynamic_map_is_ascending_from_minus_one_to_one() {
        let map = dynamic_map();
        assert!(map.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(map[255], 1.0);
        assert!(map[0] > -1.0 && map[0] < -0.99);
        assert!(map.contains(&0.0));
    }
}
