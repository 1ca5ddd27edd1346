//! Folders bitsandbytes quantized to 4 bits (`transformers`' `save_pretrained` of a model
//! loaded with `BitsAndBytesConfig(load_in_4bit=True)`): `config.json` has a
//! `quantization_config` with `quant_method = "bitsandbytes"`, and each quantized weight
//! `W` is stored as its packed codes (`W`, uint8), `W.absmax` (f32, or uint8 codes with
//! double quantization beside `W.nested_absmax`), `W.quant_map`, `W.nested_quant_map` and
//! `W.quant_state.bitsandbytes__nf4|fp4` (a JSON of the type, block size, shape, dtype and
//! the nested offset). Opening folds those tensors into one entry per weight of the
//! weight's shape, read as bitsandbytes dequantizes it (code times absmax, f32): the model
//! is then the float model the 4-bit one stands for, and a QLoRA run over it quantizes it
//! again to the same codes.

use std::collections::HashMap;

use regatta_object_store::Place;
use regatta_trainer::quant::{check_block, dequantize_4bit, dynamic_map, Absmax, Quant4, Quant4Type, NESTED_BLOCK};
use serde_json::Value;

use super::Entry;
use crate::error::{Error, Result};

/// Where one piece of a quantized weight lies.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Piece {
    file: String,
    start: u64,
    end: u64,
}

/// A weight stored 4-bit by bitsandbytes.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct BnbTensor {
    kind: Quant4Type,
    block: usize,
    numel: usize,
    packed: Piece,
    /// f32 values, or with double quantization byte codes.
    absmax: Piece,
    /// Double quantization: the nested absmax (f32) and the offset.
    nested: Option<(Piece, f32)>,
}

const STATE: &str = ".quant_state.bitsandbytes__";
const COMPANIONS: [&str; 4] = [".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map"];

fn piece(entry: &Entry) -> Piece {
    Piece {
        file: entry.file.clone(),
        start: entry.start,
        end: entry.end,
    }
}

async fn bytes(place: &Place, piece: &Piece) -> Result<bytes::Bytes> {
    place
        .get_range(&piece.file, piece.start..piece.end)
        .await
        .map_err(Error::from)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Folds a bitsandbytes 4-bit folder's tensors into one entry per quantized weight; a
/// folder without `quantization_config` is left as it is.
pub(super) async fn fold(place: &Place, config: &Value, entries: &mut HashMap<String, Entry>) -> Result<()> {
    let Some(quantization) = config.get("quantization_config") else {
        return Ok(());
    };
    let folder = place.url().to_string();
    let refuse = |problem: String| Error::ModelFile {
        path: format!("{folder}/config.json"),
        problem,
    };
    let method = quantization
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("bitsandbytes");
    if method != "bitsandbytes" {
        return Err(refuse(format!(
            "has quantization_config.quant_method = {method:?}; Regatta reads bitsandbytes' 4-bit folders only"
        )));
    }
    let flag = |key: &str| quantization.get(key).and_then(Value::as_bool).unwrap_or(false);
    if flag("load_in_8bit") || flag("_load_in_8bit") {
        return Err(refuse(
            "is quantized with bitsandbytes' load_in_8bit (LLM.int8), which Regatta does not read yet; use the float model or a 4-bit (NF4/FP4) folder".into(),
        ));
    }
    let states: Vec<String> = entries.keys().filter(|n| n.contains(STATE)).cloned().collect();
    for state_name in states {
        let (weight, quant_type) = state_name.split_once(STATE).unwrap_or_default();
        let weight = weight.to_string();
        let bad = |problem: String| Error::Tensor {
            path: folder.clone(),
            name: weight.clone(),
            problem,
        };
        let state_entry = entries
            .remove(&state_name)
            .ok_or_else(|| bad("lost its quant_state".into()))?;
        let state: Value = serde_json::from_slice(&bytes(place, &piece(&state_entry)).await?)
            .map_err(|e| bad(format!("has a quant_state that is not JSON: {e}")))?;
        let kind = match state.get("quant_type").and_then(Value::as_str).unwrap_or(quant_type) {
            "nf4" => Quant4Type::Nf4,
            "fp4" => Quant4Type::Fp4,
            other => return Err(bad(format!("is quantized as {other:?}; Regatta reads nf4 and fp4"))),
        };
        let block = state.get("blocksize").and_then(Value::as_u64).unwrap_or(0) as usize;
        check_block(block).map_err(|e| bad(format!("quant_state blocksize: {e}")))?;
        let shape: Vec<i64> = state
            .get("shape")
            .and_then(Value::as_array)
            .map(|dims| dims.iter().filter_map(Value::as_i64).collect())
            .filter(|dims: &Vec<i64>| !dims.is_empty() && dims.iter().all(|d| *d > 0))
            .ok_or_else(|| bad("has a quant_state without a shape".into()))?;
        let numel = shape
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d as usize))
            .ok_or_else(|| bad(format!("has a quant_state shape {shape:?} too large to hold")))?;
        let blocks = numel.div_ceil(block);
        let mut take = |suffix: &str| entries.remove(&format!("{weight}{suffix}"));
        let (packed, absmax) = (take(""), take(".absmax"));
        let (quant_map, nested_absmax, nested_map) =
            (take(".quant_map"), take(".nested_absmax"), take(".nested_quant_map"));
        let packed = packed.ok_or_else(|| bad("has a quant_state but no packed weight".into()))?;
        let absmax = absmax.ok_or_else(|| bad(format!("has no {weight}.absmax")))?;
        let length = |e: &Entry| (e.end - e.start) as usize;
        if packed.dtype != "U8" || length(&packed) != numel.div_ceil(2) {
            return Err(bad(format!(
                "holds {} bytes of {} as packed codes; shape {shape:?} needs {} bytes of U8 (bnb_4bit_quant_storage = uint8)",
                length(&packed),
                packed.dtype,
                numel.div_ceil(2)
            )));
        }
        if let Some(map) = &quant_map {
            let values = f32s(&bytes(place, &piece(map)).await?);
            if values.len() != 16 || values.iter().zip(kind.code()).any(|(a, b)| a != &b) {
                return Err(bad(format!("has a quant_map other than bitsandbytes' {}", kind.name())));
            }
        }
        let nested = match (&nested_absmax, state.get("nested_offset").and_then(Value::as_f64)) {
            (Some(nested), Some(offset)) => {
                if !offset.is_finite() {
                    return Err(bad(format!("has a nested_offset of {offset}")));
                }
                let nested_block = state.get("nested_blocksize").and_then(Value::as_u64).unwrap_or(0) as usize;
                if nested_block != NESTED_BLOCK {
                    return Err(bad(format!(
                        "has nested_blocksize {nested_block}; bitsandbytes uses {NESTED_BLOCK}"
                    )));
                }
                if let Some(map) = &nested_map {
                    let values = f32s(&bytes(place, &piece(map)).await?);
                    if values.len() != 256
                        || values
                            .iter()
                            .zip(dynamic_map())
                            .any(|(a, b)| a.to_bits() != b.to_bits())
                    {
                        return Err(bad("has a nested_quant_map other than bitsandbytes' dynamic map".into()));
                    }
                }
                if absmax.dtype != "U8"
                    || length(&absmax) != blocks
                    || length(nested) != blocks.div_ceil(NESTED_BLOCK) * 4
                {
                    return Err(bad(format!(
                        "has {} absmax bytes and {} nested bytes; {blocks} blocks need {blocks} and {}",
                        length(&absmax),
                        length(nested),
                        blocks.div_ceil(NESTED_BLOCK) * 4
                    )));
                }
                Some((piece(nested), offset as f32))
            }
            (None, None) => {
                if absmax.dtype != "F32" || length(&absmax) != blocks * 4 {
                    return Err(bad(format!(
                        "has {} bytes of {} absmax; {blocks} blocks need {} bytes of F32",
                        length(&absmax),
                        absmax.dtype,
                        blocks * 4
                    )));
                }
                None
            }
            _ => {
                return Err(bad(
                    "has double quantization half stored (nested_absmax or nested_offset missing)".into(),
                ))
            }
        };
        let dtype = match state.get("dtype").and_then(Value::as_str) {
            Some("bfloat16") => "BF16",
            Some("float16") => "F16",
            _ => "F32",
        };
        entries.insert(
            weight.clone(),
            Entry {
                file: packed.file.clone(),
                dtype: dtype.to_string(),
                shape,
                start: packed.start,
                end: packed.end,
                gguf: None,
                bnb: Some(Box::new(BnbTensor {
                    kind,
                    block,
                    numel,
                    packed: piece(&packed),
                    absmax: piece(&absmax),
                    nested,
                })),
            },
        );
    }
    // Companions whose weight had no quant_state cannot be read as anything.
    if let Some(stray) = entries.keys().find(|n| COMPANIONS.iter().any(|c| n.ends_with(c))) {
        return Err(Error::Tensor {
            path: folder.clone(),
            name: stray.clone(),
            problem: "is a bitsandbytes quantization tensor without its weight's quant_state".into(),
        });
    }
    Ok(())
}

impl BnbTensor {
    /// The 4-bit type, the block size and whether the absmax values are quantized again.
    pub(super) fn settings(&self) -> (Quant4Type, usize, bool) {
        (self.kind, self.block, self.nested.is_some())
    }

    /// The weight's values as bitsandbytes dequantizes them (f32, flat).
    pub(super) async fn values(&self, place: &Place) -> Result<Vec<f32>> {
        Ok(dequantize_4bit(&self.quant4(place).await?))
    }

    /// The weight as stored: codes, absmax and double quantization, bit for bit.
    pub(super) async fn quant4(&self, place: &Place) -> Result<Quant4> {
        let packed = bytes(place, &self.packed).await?.to_vec();
        let absmax_bytes = bytes(place, &self.absmax).await?;
        let absmax = match &self.nested {
            Some((nested, offset)) => Absmax::Double {
                codes: absmax_bytes.to_vec(),
                absmax: f32s(&bytes(place, nested).await?),
                offset: *offset,
            },
            None => Absmax::Plain(f32s(&absmax_bytes)),
        };
        Ok(Quant4 {
            kind: self.kind,
            block: self.block,
            numel: self.numel,
            packed,
            absmax,
        })
    }
}
