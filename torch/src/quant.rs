//! A QLoRA base weight held in 4 bits (or LLM.int8's 8) on the device, dequantized to the
//! compute dtype where a projection uses it (forward, and backward's input gradient) and
//! dropped after: the whole base is never held dequantized. The codes and scales are made
//! by `regatta_trainer::quant` (bitsandbytes' arithmetic, bit for bit); dequantizing here
//! is bitsandbytes' too (code times absmax in f32, then the compute dtype).

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use regatta_trainer::quant::{
    dynamic_map, quantize_4bit, quantize_int8_rows, Absmax, Int8Rows, Quant4, Quant4Type, NESTED_BLOCK,
};

/// bitsandbytes' `1 / 127` (`int8_vectorwise_dequant`).
const INVERSE_127: f64 = 7.874015718698502e-3;

/// The absmax values, as held.
#[derive(Debug)]
enum HeldAbsmax {
    Plain(Tensor),
    Double { codes: Tensor, absmax: Tensor, offset: f64 },
}

/// One weight in 4 bits.
#[derive(Debug)]
struct Four {
    block: i64,
    /// `[numel / 2]` bytes, two codes each (the first in the high nibble).
    packed: Tensor,
    absmax: HeldAbsmax,
    /// The 16 values of the data type (f32).
    code: Tensor,
    /// bitsandbytes' dynamic map (f32), for double quantization.
    map: Option<Tensor>,
}

/// One weight in LLM.int8's layout.
#[derive(Debug)]
struct Eight {
    /// `[rows, cols]` signed bytes.
    codes: Tensor,
    /// `[rows]` f32: each row's absmax.
    scales: Tensor,
}

#[derive(Debug)]
enum Held {
    Four(Four),
    Eight(Eight),
}

/// One weight held quantized.
#[derive(Debug)]
pub struct QuantWeight {
    shape: Vec<i64>,
    held: Held,
}

/// A clone shares the tensors (they are never written after quantization).
impl Clone for QuantWeight {
    fn clone(&self) -> Self {
        self.with_parts(&self.parts())
    }
}

impl QuantWeight {
    /// Quantizes `weight` (any float kind, any device) in blocks of `block`, held on `device`.
    pub fn new(weight: &Tensor, kind: Quant4Type, block: usize, double: bool, device: Device) -> Result<Self> {
        let values = crate::collective::to_vec(weight);
        let q = quantize_4bit(&values, block, kind, double)
            .map_err(|e| Error::Invalid(format!("cannot quantize a weight of shape {:?}: {e}", weight.size())))?;
        Ok(Self::from_quant(&q, weight.size(), device))
    }

    /// Quantizes a 2-D `weight` row by row to LLM.int8's layout as bitsandbytes'
    /// `Int8Params` does (the weight rounded to f16 first), held on `device`.
    pub fn new_int8(weight: &Tensor, device: Device) -> Result<Self> {
        let shape = weight.size();
        let [_, cols] = shape[..] else {
            return Err(Error::Invalid(format!(
                "int8 quantizes 2-D weights row by row, not one of shape {shape:?}"
            )));
        };
        let values = crate::collective::to_vec(&weight.to_kind(Kind::Half));
        let q = quantize_int8_rows(&values, cols as usize)
            .map_err(|e| Error::Invalid(format!("cannot quantize a weight of shape {shape:?}: {e}")))?;
        Ok(Self::from_int8(&q, shape, device))
    }

    /// Holds `q` (a tensor of `shape`, rows of `q.cols`) on `device`.
    pub fn from_int8(q: &Int8Rows, shape: Vec<i64>, device: Device) -> Self {
        let codes = Tensor::from_slice(&q.codes).view([-1, q.cols as i64]).to_device(device);
        let scales = Tensor::from_slice(&q.scales).to_device(device);
        Self {
            shape,
            held: Held::Eight(Eight { codes, scales }),
        }
    }

    /// Holds `q` (a tensor of `shape`) on `device`.
    pub fn from_quant(q: &Quant4, shape: Vec<i64>, device: Device) -> Self {
        let bytes = |v: &[u8]| Tensor::from_slice(v).to_device(device);
        let floats = |v: &[f32]| Tensor::from_slice(v).to_device(device);
        let (absmax, map) = match &q.absmax {
            Absmax::Plain(values) => (HeldAbsmax::Plain(floats(values)), None),
            Absmax::Double { codes, absmax, offset } => (
                HeldAbsmax::Double {
                    codes: bytes(codes),
                    absmax: floats(absmax),
                    offset: f64::from(*offset),
                },
                Some(floats(&dynamic_map())),
            ),
        };
        let four = Four {
            block: q.block as i64,
            packed: bytes(&q.packed),
            absmax,
            code: floats(&q.kind.code()),
            map,
        };
        Self {
            shape,
            held: Held::Four(four),
        }
    }

    /// The weight in `kind`, its shape.
    pub fn dequantize(&self, kind: Kind) -> Tensor {
        let numel = self.shape.iter().product();
        let values = match &self.held {
            Held::Four(four) => four.dequantize(numel),
            // (code * absmax) * (1/127) in f32, as bitsandbytes' int8_vectorwise_dequant.
            Held::Eight(eight) => (eight.codes.to_kind(Kind::Float) * eight.scales.unsqueeze(1)) * INVERSE_127,
        };
        values.to_kind(kind).view(self.shape.as_slice())
    }

    /// Bytes held: the codes and the absmax values (with double quantization, their codes,
    /// the nested absmax and the offset), or int8's codes and row scales.
    pub fn bytes(&self) -> u64 {
        let bytes = match &self.held {
            Held::Four(four) => four.bytes(),
            Held::Eight(eight) => eight.codes.numel() + eight.scales.numel() * 4,
        };
        bytes as u64
    }
}

impl Four {
    /// Each block's absmax, f32.
    fn absmax_values(&self) -> Tensor {
        match (&self.absmax, &self.map) {
            (HeldAbsmax::Plain(values), _) => values.shallow_clone(),
            (HeldAbsmax::Double { codes, absmax, offset }, Some(map)) => {
                let blocks = codes.size()[0];
                let nested = absmax
                    .repeat_interleave_self_int(NESTED_BLOCK as i64, 0, None)
                    .narrow(0, 0, blocks);
                map.index_select(0, &codes.to_kind(Kind::Int64)) * nested + *offset
            }
            (HeldAbsmax::Double { .. }, None) => unreachable!("double quantization holds its map"),
        }
    }

    /// The `numel` values, f32 and flat.
    fn dequantize(&self, numel: i64) -> Tensor {
        let high = self.packed.bitwise_right_shift_tensor_scalar(4);
        let low = self.packed.bitwise_and(15);
        let codes = Tensor::stack(&[high, low], 1).view([-1]).narrow(0, 0, numel);
        let values = self.code.index_select(0, &codes.to_kind(Kind::Int64));
        let absmax = self.absmax_values();
        let full = numel - numel % self.block;
        if full == numel {
            (values.view([-1, self.block]) * absmax.unsqueeze(1)).view([-1])
        } else {
            let blocks = full / self.block;
            Tensor::cat(
                &[
                    (values.narrow(0, 0, full).view([-1, self.block]) * absmax.narrow(0, 0, blocks).unsqueeze(1))
                        .view([-1]),
                    values.narrow(0, full, numel - full) * absmax.narrow(0, blocks, 1),
                ],
                0,
            )
        }
    }

    fn bytes(&self) -> usize {
        let absmax = match &self.absmax {
            HeldAbsmax::Plain(values) => values.numel() * 4,
            HeldAbsmax::Double { codes, absmax, .. } => codes.numel() + absmax.numel() * 4 + 4,
        };
        self.packed.numel() + absmax
    }
}

impl QuantWeight {
    /// The tensors holding the weight's values, in a fixed order: what a ZeRO-3 shard
    /// slices (the codes and the absmax or row scales; the data type's 16 levels, the
    /// dynamic map and the double quantization's offset are constants kept whole).
    fn parts(&self) -> Vec<Tensor> {
        match &self.held {
            Held::Four(four) => {
                let mut parts = vec![four.packed.shallow_clone()];
                match &four.absmax {
                    HeldAbsmax::Plain(values) => parts.push(values.shallow_clone()),
                    HeldAbsmax::Double { codes, absmax, .. } => {
                        parts.extend([codes.shallow_clone(), absmax.shallow_clone()])
                    }
                }
                parts
            }
            Held::Eight(eight) => vec![eight.codes.shallow_clone(), eight.scales.shallow_clone()],
        }
    }

    /// This weight with its [`QuantWeight::parts`] replaced by `parts` (same order).
    fn with_parts(&self, parts: &[Tensor]) -> Self {
        let part = |i: usize| parts[i].shallow_clone();
        let held = match &self.held {
            Held::Four(four) => Held::Four(Four {
                block: four.block,
                packed: part(0),
                absmax: match &four.absmax {
                    HeldAbsmax::Plain(_) => HeldAbsmax::Plain(part(1)),
                    HeldAbsmax::Double { offset, .. } => HeldAbsmax::Double {
                        codes: part(1),
                        absmax: part(2),
                        offset: *offset,
                    },
                },
                code: four.code.shallow_clone(),
                map: four.map.as_ref().map(Tensor::shallow_clone),
            }),
            Held::Eight(_) => Held::Eight(Eight {
                codes: part(0),
                scales: part(1),
            }),
        };
        Self {
            shape: self.shape.clone(),
            held,
        }
    }
}

/// Where one part of a packed weight lies in the byte buffer.
#[derive(Debug)]
struct PartPlace {
    offset: i64,
    bytes: i64,
    kind: Kind,
    shape: Vec<i64>,
}

/// Several quantized weights as one byte buffer, each part at a 4-byte boundary and the
/// whole a multiple of the alignment asked for: a ZeRO-3 rank keeps one slice of it and
/// gathers the rest when the weights' block runs.
#[derive(Debug)]
pub struct PackedWeights {
    /// Each weight's name, its skeleton (parts emptied) and where its parts lie.
    weights: Vec<(String, QuantWeight, Vec<PartPlace>)>,
    /// The buffer's bytes.
    len: i64,
    /// Bytes of the constants each weight keeps whole (the double quantization's offset).
    whole: u64,
}

impl PackedWeights {
    /// Packs `weights` into one `Uint8` buffer on their device, its length a multiple of
    /// `align` (a multiple of 4). `None` for no weights.
    pub fn pack(weights: Vec<(String, QuantWeight)>, align: i64) -> Option<(Self, Tensor)> {
        let device = weights.first()?.1.parts()[0].device();
        let mut pieces = Vec::new();
        let mut placed = Vec::new();
        let mut offset = 0i64;
        let mut whole = 0u64;
        let pad = |n: i64, to: i64| (to - n % to) % to;
        for (name, weight) in weights {
            let mut places = Vec::new();
            let mut empty = Vec::new();
            for part in weight.parts() {
                let bytes = part.contiguous().view([-1]).view_dtype(Kind::Uint8);
                let len = bytes.numel() as i64;
                places.push(PartPlace {
                    offset,
                    bytes: len,
                    kind: part.kind(),
                    shape: part.size(),
                });
                empty.push(Tensor::empty([0], (part.kind(), device)));
                pieces.push(bytes);
                let gap = pad(len, 4);
                if gap > 0 {
                    pieces.push(Tensor::zeros([gap], (Kind::Uint8, device)));
                }
                offset += len + gap;
            }
            whole += weight.bytes() - places.iter().map(|p| p.bytes as u64).sum::<u64>();
            placed.push((name, weight.with_parts(&empty), places));
        }
        let gap = pad(offset, align);
        if gap > 0 {
            pieces.push(Tensor::zeros([gap], (Kind::Uint8, device)));
        }
        let buffer = Tensor::cat(&pieces, 0);
        Some((
            Self {
                weights: placed,
                len: offset + gap,
                whole,
            },
            buffer,
        ))
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> i64 {
        self.len
    }

    /// Bytes of the constants each weight keeps whole beside its slice.
    pub fn whole_bytes(&self) -> u64 {
        self.whole
    }

    /// The weights back from the whole buffer (`Uint8`, [`PackedWeights::len`] bytes):
    /// views of it, no copy.
    pub fn unpack(&self, buffer: &Tensor) -> Vec<(String, QuantWeight)> {
        self.weights
            .iter()
            .map(|(name, skeleton, places)| {
                let parts: Vec<Tensor> = places
                    .iter()
                    .map(|p| {
                        buffer
                            .narrow(0, p.offset, p.bytes)
                            .view_dtype(p.kind)
                            .view(p.shape.as_slice())
                    })
                    .collect();
                (name.clone(), skeleton.with_parts(&parts))
            })
            .collect()
    }
}
