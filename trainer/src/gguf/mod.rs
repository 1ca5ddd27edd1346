//! GGUF files (llama.cpp's model format), read without I/O: [`GgufHeader::parse`] takes the
//! first bytes of a file and its size and returns the metadata and where each tensor's
//! bytes lie (or how many more bytes it needs); [`quant`] dequantizes tensor bytes to f32;
//! [`model`] turns a header into what a Hugging Face folder holds (`config.json`, tensor
//! names and shapes) and, with the private `tokenizer` module, the tokenizer files
//! (`tokenizer.json` from a byte-level BPE or SentencePiece-style vocabulary,
//! `tokenizer_config.json`).
//!
//! The format (version 2 and 3, little-endian): `GGUF`, version, tensor count, metadata
//! count; metadata as key, type, value; tensor infos as name, dimensions (innermost
//! first), type, offset; then the data, aligned to `general.alignment` (32 by default).

mod model;
mod quant;
mod tokenizer;

use std::collections::BTreeMap;

pub use model::{GgufModel, GgufTensor};
pub use quant::{dequantize, GgmlType};

/// Why a GGUF file cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    /// The bytes read so far end inside the header: read at least this many and parse again.
    #[error("the GGUF header needs at least {needed} bytes")]
    Truncated {
        /// Bytes from the start of the file.
        needed: u64,
    },
    /// Not a GGUF file, or a version Regatta does not read.
    #[error("{0}")]
    NotGguf(String),
    /// The header contradicts itself or the file.
    #[error("malformed GGUF: {0}")]
    Malformed(String),
    /// A tensor's element type is not one Regatta reads.
    #[error("tensor {tensor} is {type_name}; Regatta reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and Q8_K")]
    UnsupportedType {
        /// The tensor.
        tensor: String,
        /// GGML's name of its type.
        type_name: String,
    },
    /// The model described is not one Regatta runs (architecture, a tensor, a setting).
    #[error("{0}")]
    Unsupported(String),
    /// A metadata key is missing or has the wrong type.
    #[error("metadata `{key}` {problem}")]
    Metadata {
        /// The key.
        key: String,
        /// What is wrong.
        problem: String,
    },
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    Uint(u64),
    /// Any signed integer type.
    Int(i64),
    /// `f32` or `f64`.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of one type.
    Array(Vec<Value>),
}

impl Value {
    /// The value as a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::Uint(v) => Some(v),
            Self::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::Uint(v) => Some(v as f64),
            Self::Int(v) => Some(v as f64),
            Self::Float(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Self::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// One tensor's place in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// GGUF's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost first (GGML's order: the reverse of PyTorch's).
    pub dims: Vec<u64>,
    /// Element type.
    pub kind: GgmlType,
    /// First byte, from the start of the file.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

impl TensorInfo {
    /// The shape in PyTorch's order (outermost first).
    pub fn shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|d| *d as i64).collect()
    }

    /// Values the tensor holds.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    /// 2 or 3.
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
}

/// The alignment of the data section when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML's most dimensions.
const MAX_DIMS: u32 = 4;

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], GgufError> {
        let end = (self.at as u64).checked_add(n).ok_or_else(overflow)?;
        if end > self.bytes.len() as u64 {
            return Err(GgufError::Truncated { needed: end });
        }
        let out = &self.bytes[self.at..end as usize];
        self.at = end as usize;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let length = self.u64()?;
        let bytes = self.take(length)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Malformed("a string is not UTF-8".into()))
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.at) as u64
    }

    fn value(&mut self, kind: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match kind {
            0 => Value::Uint(u64::from(self.array::<1>()?[0])),
            1 => Value::Int(i64::from(self.array::<1>()?[0] as i8)),
            2 => Value::Uint(u64::from(u16::from_le_bytes(self.array()?))),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.array()?))),
            4 => Value::Uint(u64::from(self.u32()?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.array()?))),
            6 => Value::Float(f64::from(f32::from_le_bytes(self.array()?))),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return Err(GgufError::Malformed(format!("a boolean is {other}"))),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth > 0 {
                    return Err(GgufError::Malformed("arrays nest too deep".into()));
                }
                let item = self.u32()?;
                let count = self.u64()?;
                // Every item takes at least one byte: a count beyond what is left means
                // the header goes on past what was read (or lies), not a huge allocation.
                let mut items = Vec::with_capacity(count.min(self.remaining()) as usize);
                for _ in 0..count {
                    items.push(self.value(item, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Uint(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(GgufError::Malformed(format!("metadata value type {other} is unknown"))),
        })
    }
}

fn overflow() -> GgufError {
    GgufError::Malformed("a length overflows".into())
}

/// A tensor's entry in the header, before its bytes are placed in the data section.
struct TensorEntry {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

impl TensorEntry {
    /// Where the tensor's bytes lie in a file of `file_size` bytes whose data section
    /// starts at `data_start`; errors when its type is unknown or its bytes do not fit.
    fn place(self, data_start: u64, file_size: u64) -> Result<TensorInfo, GgufError> {
        let Self {
            name,
            dims,
            type_id,
            offset,
        } = self;
        let kind = GgmlType::from_id(type_id).map_err(|type_name| GgufError::UnsupportedType {
            tensor: name.clone(),
            type_name: type_name.to_string(),
        })?;
        let numel = dims
            .iter()
            .try_fold(1u64, |n, d| n.checked_mul(*d))
            .ok_or_else(overflow)?;
        let length = kind.bytes_for(dims[0], numel).ok_or_else(|| {
            GgufError::Malformed(format!(
                "tensor {name}'s rows of {} values are not whole {} blocks of {}",
                dims[0],
                kind.name(),
                kind.block_size()
            ))
        })?;
        let start = data_start.checked_add(offset).ok_or_else(overflow)?;
        let end = start.checked_add(length).ok_or_else(overflow)?;
        if end > file_size {
            return Err(GgufError::Malformed(format!(
                "tensor {name}'s bytes {start}..{end} run past the end of the file ({file_size} bytes)"
            )));
        }
        Ok(TensorInfo {
            name,
            dims,
            kind,
            start,
            end,
        })
    }
}

impl Cursor<'_> {
    /// The magic and the version (2 or 3).
    fn preamble(&mut self) -> Result<u32, GgufError> {
        let magic = self.array::<4>()?;
        if &magic != b"GGUF" {
            return Err(GgufError::NotGguf(
                "the file does not start with GGUF: not a GGUF file".into(),
            ));
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::NotGguf(format!(
                "GGUF version {version} is not read (versions 2 and 3 are)"
            )));
        }
        Ok(version)
    }

    /// `count` metadata entries: key, type, value.
    fn metadata(&mut self, count: u64) -> Result<BTreeMap<String, Value>, GgufError> {
        let mut metadata = BTreeMap::new();
        for _ in 0..count {
            let key = self.string()?;
            let kind = self.u32()?;
            let value = self.value(kind, 0)?;
            metadata.insert(key, value);
        }
        Ok(metadata)
    }

    /// `count` tensor entries: name, dimensions, type, offset.
    fn tensor_entries(&mut self, count: u64) -> Result<Vec<TensorEntry>, GgufError> {
        let mut entries = Vec::with_capacity(count.min(self.remaining()) as usize);
        for _ in 0..count {
            let name = self.string()?;
            let n_dims = self.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::Malformed(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| self.u64()).collect::<Result<Vec<_>, _>>()?;
            let type_id = self.u32()?;
            let offset = self.u64()?;
            entries.push(TensorEntry {
                name,
                dims,
                type_id,
                offset,
            });
        }
        Ok(entries)
    }
}

/// The data section's alignment: `general.alignment`, a power of two, or the default.
fn alignment(metadata: &BTreeMap<String, Value>) -> Result<u64, GgufError> {
    match metadata.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => Ok(a),
            _ => Err(GgufError::Metadata {
                key: "general.alignment".into(),
                problem: format!("must be a power of two, not {v:?}"),
            }),
        },
    }
}

impl GgufHeader {
    /// Parses the header from the first bytes of a file of `file_size` bytes. When the
    /// header goes on past `bytes`, the error is [`GgufError::Truncated`] with how many bytes
    /// to read before trying again.
    pub fn parse(bytes: &[u8], file_size: u64) -> Result<Self, GgufError> {
        let mut cursor = Cursor { bytes, at: 0 };
        let version = cursor.preamble()?;
        let tensor_count = cursor.u64()?;
        let metadata_count = cursor.u64()?;
        let metadata = cursor.metadata(metadata_count)?;
        let alignment = alignment(&metadata)?;
        let entries = cursor.tensor_entries(tensor_count)?;
        let data_start = (cursor.at as u64).next_multiple_of(alignment);
        let tensors = entries
            .into_iter()
            .map(|entry| entry.place(data_start, file_size))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            version,
            metadata,
            tensors,
        })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A GGUF file with the given metadata and one F32 tensor `t` of 2x32 values.
    pub(crate) fn file(metadata: &[(&str, Value)]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(1u64.to_le_bytes());
        out.extend((metadata.len() as u64).to_le_bytes());
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        fn value(out: &mut Vec<u8>, v: &Value, tag: bool) {
            let put_tag = |out: &mut Vec<u8>, t: u32| {
                if tag {
                    out.extend(t.to_le_bytes())
                }
            };
            match v {
                Value::Uint(x) => {
                    put_tag(out, 4);
                    out.extend((*x as u32).to_le_bytes());
                }
                Value::Int(x) => {
                    put_tag(out, 5);
                    out.extend((*x as i32).to_le_bytes());
                }
                Value::Float(x) => {
                    put_tag(out, 6);
                    out.extend((*x as f32).to_le_bytes());
                }
                Value::Bool(b) => {
                    put_tag(out, 7);
                    out.push(u8::from(*b));
                }
                Value::String(s) => {
                    put_tag(out, 8);
                    out.extend((s.len() as u64).to_le_bytes());
                    out.extend(s.as_bytes());
                }
                Value::Array(items) => {
                    put_tag(out, 9);
                    let item = match items.first() {
                        Some(Value::String(_)) => 8u32,
                        Some(Value::Float(_)) => 6,
                        Some(Value::Int(_)) => 5,
                        _ => 4,
                    };
                    out.extend(item.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    for i in items {
                        value(out, i, false);
                    }
                }
            }
        }
        for (key, v) in metadata {
            string(&mut out, key);
            value(&mut out, v, true);
        }
        string(&mut out, "t");
        out.extend(2u32.to_le_bytes());
        out.extend(32u64.to_le_bytes());
        out.extend(2u64.to_le_bytes());
        out.extend(0u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        for i in 0..64 {
            out.extend((i as f32).to_le_bytes());
        }
        out
    }

    #[test]
    fn a_header_parses_and_places_its_tensor() {
        let bytes = file(&[
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", Value::Uint(2)),
            (
                "list",
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            ),
        ]);
        let header = GgufHeader::parse(&bytes, bytes.len() as u64).expect("parse");
        assert_eq!(
            header.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        assert_eq!(header.get("llama.block_count").and_then(Value::as_u64), Some(2));
        let t = &header.tensors[0];
        assert_eq!((t.shape(), t.kind), (vec![2, 32], GgmlType::F32));
        assert_eq!(t.end as usize, bytes.len());
        assert_eq!(t.start % 32, 0);
    }

    #[test]
    fn a_short_read_says_how_much_more_to_read() {
        let bytes = file(&[("general.name", Value::String("x".repeat(5000)))]);
        let err = GgufHeader::parse(&bytes[..1000], bytes.len() as u64).expect_err("truncated");
        let GgufError::Truncated { needed } = err else {
            panic!("{err:?}")
        };
        assert!(needed > 1000 && needed <= bytes.len() as u64);
        assert!(GgufHeader::parse(&bytes[..needed as usize], bytes.len() as u64).is_err());
        GgufHeader::parse(&bytes, bytes.len() as u64).expect("whole");
    }

    #[test]
    fn bad_files_are_refused_with_a_reason() {
        let bytes = file(&[]);
        let mut other = bytes.clone();
        other[..4].copy_from_slice(b"GGML");
        assert!(matches!(
            GgufHeader::parse(&other, other.len() as u64),
            Err(GgufError::NotGguf(_))
        ));
        let mut version = bytes.clone();
        version[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            GgufHeader::parse(&version, version.len() as u64),
            Err(GgufError::NotGguf(_))
        ));
        // Cut the data: the tensor runs past the end.
        let cut = &bytes[..bytes.len() - 4];
        let err = GgufHeader::parse(cut, cut.len() as u64).expect_err("past the end");
        assert!(err.to_string().contains("past the end"), "{err}");
        // A huge array count in a short file is a truncation, never a huge allocation.
        let mut huge = b"GGUF".to_vec();
        huge.extend(3u32.to_le_bytes());
        huge.extend(0u64.to_le_bytes());
        huge.extend(1u64.to_le_bytes());
        huge.extend(1u64.to_le_bytes());
        huge.push(b'k');
        huge.extend(9u32.to_le_bytes());
        huge.extend(4u32.to_le_bytes());
        huge.extend(u64::MAX.to_le_bytes());
        assert!(matches!(
            GgufHeader::parse(&huge, huge.len() as u64),
            Err(GgufError::Truncated { .. })
        ));
        // An unread tensor type is named.
        let mut q3 = bytes.clone();
        let type_at = q3.windows(8).rposition(|w| w == 2u64.to_le_bytes()).expect("dims") + 8;
        q3[type_at..type_at + 4].copy_from_slice(&11u32.to_le_bytes());
        let err = GgufHeader::parse(&q3, q3.len() as u64).expect_err("Q3_K");
        assert!(err.to_string().contains("Q3_K"), "{err}");
    }
}
