//! The safetensors format: a header's entries read with their byte ranges, and tensors
//! encoded as a file in F32, BF16 or F16.

use bytes::Bytes;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use super::Entry;
use crate::error::{Error, Result};

/// Parses a safetensors header (the JSON after the 8-byte length) of a file of
/// `file_size` bytes into entries with absolute byte ranges.
pub(super) fn parse_header(file: &str, header: &[u8], file_size: u64) -> Result<Vec<(String, Entry)>> {
    let bad = |problem: String| Error::ModelFile {
        path: file.to_string(),
        problem,
    };
    let value: Value =
        serde_json::from_slice(header).map_err(|e| bad(format!("the safetensors header is not JSON: {e}")))?;
    let object = value
        .as_object()
        .ok_or_else(|| bad("the safetensors header is not an object".into()))?;
    let base = 8 + header.len() as u64;
    let mut out = Vec::new();
    for (name, info) in object {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info
            .get("dtype")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let shape: Option<Vec<i64>> = info
            .get("shape")
            .and_then(Value::as_array)
            .map(|dims| dims.iter().filter_map(Value::as_i64).collect());
        let offsets: Vec<u64> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|o| o.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let (Some(shape), &[start, end]) = (shape, offsets.as_slice()) else {
            return Err(bad(format!("the header entry of {name} lacks a shape or data_offsets")));
        };
        let (start, end) = (base.saturating_add(start), base.saturating_add(end));
        if start > end || end > file_size {
            return Err(bad(format!(
                "tensor {name}'s bytes {start}..{end} run past the end of the file ({file_size} bytes)"
            )));
        }
        out.push((
            name.clone(),
            Entry {
                file: file.to_string(),
                dtype,
                shape,
                start,
                end,
                gguf: None,
                bnb: None,
            },
        ));
    }
    Ok(out)
}

pub(super) fn element_kind(dtype: &str) -> Option<(Kind, u64)> {
    match dtype {
        "F32" => Some((Kind::Float, 4)),
        "BF16" => Some((Kind::BFloat16, 2)),
        "F16" => Some((Kind::Half, 2)),
        _ => None,
    }
}

/// Float32 tensors as the bytes of a safetensors file.
pub fn encode_safetensors(tensors: &[(String, Tensor)]) -> Result<Bytes> {
    encode_safetensors_as(tensors, Kind::Float)
}

/// The safetensors name and element width of a kind weights are written in.
pub fn stored_dtype(kind: Kind) -> (&'static str, u64) {
    match kind {
        Kind::BFloat16 => ("BF16", 2),
        Kind::Half => ("F16", 2),
        _ => ("F32", 4),
    }
}

/// `config.json`'s name of a kind weights are written in (`torch_dtype` / `dtype`).
pub fn config_dtype(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Tensors as the bytes of a safetensors file with every tensor in `kind` (F32, BF16 or
/// F16; any other kind is written as F32).
pub fn encode_safetensors_as(tensors: &[(String, Tensor)], kind: Kind) -> Result<Bytes> {
    let (dtype, width) = stored_dtype(kind);
    let kind = match dtype {
        "BF16" => Kind::BFloat16,
        "F16" => Kind::Half,
        _ => Kind::Float,
    };
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, tensor) in tensors {
        let bytes = width * tensor.numel() as u64;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": tensor.size(), "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut text = serde_json::to_vec(&Value::Object(header)).map_err(|e| Error::Invalid(e.to_string()))?;
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset as usize);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    for (_, tensor) in tensors {
        // libtorch's bytes are little-endian on every host Regatta builds for (x86-64,
        // aarch64), as safetensors wants them.
        let values = tensor.to_kind(kind).to_device(Device::Cpu).contiguous();
        let numel = values.numel();
        let start = out.len();
        out.resize(start + numel * width as usize, 0);
        values.f_copy_data_u8(&mut out[start..], numel)?;
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_that_points_past_the_file_is_an_error() {
        let header = br#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}"#;
        let ok = parse_header("f", header, 8 + header.len() as u64 + 16).unwrap();
        assert_eq!(ok[0].1.end - ok[0].1.start, 16);
        let error = parse_header("f", header, 8 + header.len() as u64 + 15).unwrap_err();
        assert!(error.to_string().contains("run past the end"), "{error}");
        assert!(parse_header("f", b"{\"w\": {}}", 100).is_err());
    }
}
