//! Folders bitsandbytes quantized to 4 bits (`transformers`' `save_pretrained` of a model
//! loaded with `BitsAndBytesConfig(load_in_4bit=True)`): `config.json` has a
//! `quantization_config` with `quant_method = "bitsandbytes"`, and each quantized weight
//! `W` is stored as its packed codes (`W`, uint8), `W.absmax` (f32, or uint8 codes with
//! double quantization beside `W.nested_absmax`), `W.quant_map`, `W.nested_quant_map` and
//! `W.quant_state.bitsandbytes__nf4|fp4` (a JSON of the type, block size, shape, dtype and
//! the nested offset). Opening folds those tensors into one entry per weight of the
//! weight's shape, read as bitsandbytes dequantizes it (code times absmax, f32): the model
//! is then the float model the 4-bit one stands for, and a QLoRA run over it quantizes it
//! again to the same codes (or, its settings matching, takes them as stored).
//!
//! 8-bit folders (`load_in_8bit`, LLM.int8) store each quantized weight as `W` (int8 codes,
//! row-major), `W.SCB` (each row's absmax, f32) beside the module's `weight_format` (0:
//! row-major); they fold the same way and read as `int8_vectorwise_dequant` gives them.

use std::collections::HashMap;

use regatta_object_store::Place;
use regatta_trainer::quant::{
    check_block, dequantize_4bit, dequantize_int8_rows, dynamic_map, Absmax, Int8Rows, Quant4, Quant4Type, Stored,
    NESTED_BLOCK,
};
use regatta_trainer::BaseQuantization;
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

/// A weight stored quantized by bitsandbytes.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum BnbTensor {
    /// NF4 or FP4 (`load_in_4bit`).
    Four(Bnb4),
    /// LLM.int8 (`load_in_8bit`).
    Eight(Bnb8),
}

/// A weight stored in 8 bits: codes row by row and each row's absmax.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Bnb8 {
    cols: usize,
    codes: Piece,
    scales: Piece,
}

/// A weight stored 4-bit by bitsandbytes.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Bnb4 {
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

/// Folds a bitsandbytes 4-bit or 8-bit folder's tensors into one entry per quantized weight; a
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
            "has quantization_config.quant_method = {method:?}; Regatta reads bitsandbytes' 4-bit and 8-bit folders only"
        )));
    }
    let flag = |key: &str| quantization.get(key).and_then(Value::as_bool).unwrap_or(false);
    if flag("load_in_8bit") || flag("_load_in_8bit") {
        if let Some(state) = entries.keys().find(|n| n.contains(STATE)) {
            return Err(refuse(format!(
                "says load_in_8bit (LLM.int8) but holds 4-bit tensors ({state}): the folder is not one transformers wrote"
            )));
        }
        return fold_int8(place, &folder, entries).await;
    }
    fold_4bit(place, &folder, entries).await
}

/// Folds a 4-bit folder's weights, each named by its `quant_state` tensor, and refuses
/// the companions left over.
async fn fold_4bit(place: &Place, folder: &str, entries: &mut HashMap<String, Entry>) -> Result<()> {
    let states: Vec<String> = entries.keys().filter(|n| n.contains(STATE)).cloned().collect();
    for state_name in states {
        let (weight, quant_type) = state_name.split_once(STATE).unwrap_or_default();
        let weight = Weight4 {
            place,
            folder,
            name: weight.to_string(),
        };
        let entry = weight.fold(&state_name, quant_type, entries).await?;
        entries.insert(weight.name, entry);
    }
    // Companions whose weight had no quant_state cannot be read as anything.
    if let Some(stray) = entries.keys().find(|n| COMPANIONS.iter().any(|c| n.ends_with(c))) {
        return Err(Error::Tensor {
            path: folder.to_string(),
            name: stray.clone(),
            problem: "is a bitsandbytes quantization tensor without its weight's quant_state".into(),
        });
    }
    Ok(())
}

/// One 4-bit weight being folded: where it is and what it is called, for its errors.
struct Weight4<'a> {
    place: &'a Place,
    folder: &'a str,
    name: String,
}

/// What a 4-bit weight's `quant_state` says of its codes.
struct Layout4 {
    kind: Quant4Type,
    block: usize,
    shape: Vec<i64>,
    numel: usize,
}

/// The tensors stored beside a 4-bit weight's `quant_state`.
struct Pieces4 {
    packed: Entry,
    absmax: Entry,
    quant_map: Option<Entry>,
    nested_absmax: Option<Entry>,
    nested_map: Option<Entry>,
}

fn length(entry: &Entry) -> usize {
    (entry.end - entry.start) as usize
}

impl Weight4<'_> {
    fn bad(&self, problem: String) -> Error {
        Error::Tensor {
            path: self.folder.to_string(),
            name: self.name.clone(),
            problem,
        }
    }

    /// Reads the weight's `quant_state`, takes its companions out of `entries`, checks
    /// them against each other, and gives the weight's one entry.
    async fn fold(&self, state_name: &str, quant_type: &str, entries: &mut HashMap<String, Entry>) -> Result<Entry> {
        let state_entry = entries
            .remove(state_name)
            .ok_or_else(|| self.bad("lost its quant_state".into()))?;
        let state: Value = serde_json::from_slice(&bytes(self.place, &piece(&state_entry)).await?)
            .map_err(|e| self.bad(format!("has a quant_state that is not JSON: {e}")))?;
        let layout = self.layout(&state, quant_type)?;
        let pieces = self.take(entries)?;
        self.check_packed(&pieces.packed, &layout)?;
        if let Some(map) = &pieces.quant_map {
            self.check_quant_map(map, layout.kind).await?;
        }
        let nested = self
            .nested(&state, &pieces, layout.numel.div_ceil(layout.block))
            .await?;
        let dtype = self.dtype(&state)?;
        let Pieces4 { packed, absmax, .. } = pieces;
        let Layout4 {
            kind,
            block,
            shape,
            numel,
        } = layout;
        Ok(Entry {
            file: packed.file.clone(),
            dtype: dtype.to_string(),
            shape,
            start: packed.start,
            end: packed.end,
            gguf: None,
            bnb: Some(Box::new(BnbTensor::Four(Bnb4 {
                kind,
                block,
                numel,
                packed: piece(&packed),
                absmax: piece(&absmax),
                nested,
            }))),
        })
    }

    /// The quantization, block size and shape the `quant_state` gives.
    fn layout(&self, state: &Value, quant_type: &str) -> Result<Layout4> {
        let kind = match state.get("quant_type").and_then(Value::as_str).unwrap_or(quant_type) {
            "nf4" => Quant4Type::Nf4,
            "fp4" => Quant4Type::Fp4,
            other => return Err(self.bad(format!("is quantized as {other:?}; Regatta reads nf4 and fp4"))),
        };
        let block = state.get("blocksize").and_then(Value::as_u64).unwrap_or(0) as usize;
        check_block(block).map_err(|e| self.bad(format!("quant_state blocksize: {e}")))?;
        let shape: Vec<i64> = state
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|dims| dims.iter().map(Value::as_i64).collect::<Option<Vec<i64>>>())
            .filter(|dims| !dims.is_empty() && dims.iter().all(|d| *d > 0))
            .ok_or_else(|| self.bad("has a quant_state without a shape of positive whole dimensions".into()))?;
        let numel = shape
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d as usize))
            .ok_or_else(|| self.bad(format!("has a quant_state shape {shape:?} too large to hold")))?;
        Ok(Layout4 {
            kind,
            block,
            shape,
            numel,
        })
    }

    /// Takes the packed codes and their companions out of `entries`.
    fn take(&self, entries: &mut HashMap<String, Entry>) -> Result<Pieces4> {
        let mut take = |suffix: &str| entries.remove(&format!("{}{suffix}", self.name));
        let (packed, absmax) = (take(""), take(".absmax"));
        let (quant_map, nested_absmax, nested_map) =
            (take(".quant_map"), take(".nested_absmax"), take(".nested_quant_map"));
        Ok(Pieces4 {
            packed: packed.ok_or_else(|| self.bad("has a quant_state but no packed weight".into()))?,
            absmax: absmax.ok_or_else(|| self.bad(format!("has no {}.absmax", self.name)))?,
            quant_map,
            nested_absmax,
            nested_map,
        })
    }

    fn check_packed(&self, packed: &Entry, layout: &Layout4) -> Result<()> {
        let needed = layout.numel.div_ceil(2);
        if packed.dtype != "U8" || length(packed) != needed {
            return Err(self.bad(format!(
                "holds {} bytes of {} as packed codes; shape {:?} needs {needed} bytes of U8 (bnb_4bit_quant_storage = uint8)",
                length(packed),
                packed.dtype,
                layout.shape,
            )));
        }
        Ok(())
    }

    async fn check_quant_map(&self, map: &Entry, kind: Quant4Type) -> Result<()> {
        let values = f32s(&bytes(self.place, &piece(map)).await?);
        if values.len() != 16 || values.iter().zip(kind.code()).any(|(a, b)| a != &b) {
            return Err(self.bad(format!("has a quant_map other than bitsandbytes' {}", kind.name())));
        }
        Ok(())
    }

    /// The double quantization's nested absmax and offset, or none when the absmax is
    /// stored plain; either way the absmax bytes are checked against the `blocks`.
    async fn nested(&self, state: &Value, pieces: &Pieces4, blocks: usize) -> Result<Option<(Piece, f32)>> {
        let absmax = &pieces.absmax;
        match (
            &pieces.nested_absmax,
            state.get("nested_offset").and_then(Value::as_f64),
        ) {
            (Some(nested), Some(wide)) => {
                // Held as f32: a finite f64 beyond f32's range would become infinite.
                let offset = wide as f32;
                if !offset.is_finite() {
                    return Err(self.bad(format!("has a nested_offset of {wide:e}, which f32 cannot hold")));
                }
                self.check_nested_map(state, pieces.nested_map.as_ref()).await?;
                if absmax.dtype != "U8"
                    || length(absmax) != blocks
                    || length(nested) != blocks.div_ceil(NESTED_BLOCK) * 4
                {
                    return Err(self.bad(format!(
                        "has {} absmax bytes and {} nested bytes; {blocks} blocks need {blocks} and {}",
                        length(absmax),
                        length(nested),
                        blocks.div_ceil(NESTED_BLOCK) * 4
                    )));
                }
                Ok(Some((piece(nested), offset)))
            }
            (None, None) => {
                if absmax.dtype != "F32" || length(absmax) != blocks * 4 {
                    return Err(self.bad(format!(
                        "has {} bytes of {} absmax; {blocks} blocks need {} bytes of F32",
                        length(absmax),
                        absmax.dtype,
                        blocks * 4
                    )));
                }
                Ok(None)
            }
            _ => Err(self.bad("has double quantization half stored (nested_absmax or nested_offset missing)".into())),
        }
    }

    /// Double quantization's block size and, when stored, its code map are bitsandbytes' own.
    async fn check_nested_map(&self, state: &Value, map: Option<&Entry>) -> Result<()> {
        let nested_block = state.get("nested_blocksize").and_then(Value::as_u64).unwrap_or(0) as usize;
        if nested_block != NESTED_BLOCK {
            return Err(self.bad(format!(
                "has nested_blocksize {nested_block}; bitsandbytes uses {NESTED_BLOCK}"
            )));
        }
        if let Some(map) = map {
            let values = f32s(&bytes(self.place, &piece(map)).await?);
            if values.len() != 256
                || values
                    .iter()
                    .zip(dynamic_map())
                    .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                return Err(self.bad("has a nested_quant_map other than bitsandbytes' dynamic map".into()));
            }
        }
        Ok(())
    }

    /// The dtype bitsandbytes dequantizes the weight to.
    fn dtype(&self, state: &Value) -> Result<&'static str> {
        match state.get("dtype").and_then(Value::as_str) {
            Some("bfloat16") => Ok("BF16"),
            Some("float16") => Ok("F16"),
            Some("float32") | None => Ok("F32"),
            Some(other) => Err(self.bad(format!(
                "has a quant_state dtype {other:?}; bitsandbytes writes bfloat16, float16 or float32"
            ))),
        }
    }
}

/// Folds an 8-bit folder's `W.SCB` and `W.weight_format` into `W`'s entry.
async fn fold_int8(place: &Place, folder: &str, entries: &mut HashMap<String, Entry>) -> Result<()> {
    let scales: Vec<String> = entries.keys().filter(|n| n.ends_with(".SCB")).cloned().collect();
    for scale_name in scales {
        let module = scale_name.trim_end_matches(".SCB");
        let weight = format!("{module}.weight");
        let bad = |problem: String| Error::Tensor {
            path: folder.to_string(),
            name: weight.clone(),
            problem,
        };
        let scale = entries.remove(&scale_name).ok_or_else(|| bad("lost its SCB".into()))?;
        if let Some(format) = entries.remove(&format!("{module}.weight_format")) {
            let value = bytes(place, &piece(&format)).await?;
            if format.dtype != "U8" || value.as_ref() != [0] {
                return Err(bad(format!(
                    "has weight_format {value:?} ({}); Regatta reads row-major codes (0)",
                    format.dtype
                )));
            }
        }
        let entry = entries
            .get_mut(&weight)
            .ok_or_else(|| bad(format!("is missing beside its {scale_name}")))?;
        let [rows, cols] = entry.shape[..] else {
            return Err(bad(format!("has shape {:?}; 8-bit weights are 2-D", entry.shape)));
        };
        let (rows, cols) = (rows.max(0) as u64, cols.max(0) as u64);
        let length = |e: &Entry| e.end - e.start;
        if entry.dtype != "I8" || length(entry) != rows * cols || scale.dtype != "F32" || length(&scale) != rows * 4 {
            return Err(bad(format!(
                "holds {} bytes of {} codes and {} bytes of {} row scales; shape [{rows}, {cols}] needs {} bytes of I8 and {} of F32",
                length(entry),
                entry.dtype,
                length(&scale),
                scale.dtype,
                rows * cols,
                rows * 4
            )));
        }
        entry.dtype = "F32".into();
        entry.bnb = Some(Box::new(BnbTensor::Eight(Bnb8 {
            cols: cols as usize,
            codes: piece(entry),
            scales: piece(&scale),
        })));
    }
    if let Some(stray) = entries.keys().find(|n| n.ends_with(".weight_format")) {
        return Err(Error::Tensor {
            path: folder.to_string(),
            name: stray.clone(),
            problem: "is a bitsandbytes 8-bit format tensor without its weight's SCB".into(),
        });
    }
    Ok(())
}

impl BnbTensor {
    /// How the weight is stored: the quantization, its block size (0 for int8) and
    /// whether the absmax values are quantized again.
    pub(super) fn settings(&self) -> (BaseQuantization, usize, bool) {
        match self {
            Self::Four(four) => (
                match four.kind {
                    Quant4Type::Nf4 => BaseQuantization::Nf4,
                    Quant4Type::Fp4 => BaseQuantization::Fp4,
                },
                four.block,
                four.nested.is_some(),
            ),
            Self::Eight(_) => (BaseQuantization::Int8, 0, false),
        }
    }

    /// The weight's values as bitsandbytes dequantizes them (f32, flat).
    pub(super) async fn values(&self, place: &Place) -> Result<Vec<f32>> {
        Ok(match self.stored(place).await? {
            Stored::Four(q) => dequantize_4bit(&q),
            Stored::Eight(q) => dequantize_int8_rows(&q),
        })
    }

    /// The weight as stored, bit for bit.
    pub(super) async fn stored(&self, place: &Place) -> Result<Stored> {
        Ok(match self {
            Self::Four(four) => Stored::Four(four.quant4(place).await?),
            Self::Eight(eight) => Stored::Eight(Int8Rows {
                cols: eight.cols,
                codes: bytes(place, &eight.codes).await?.iter().map(|b| *b as i8).collect(),
                scales: f32s(&bytes(place, &eight.scales).await?),
            }),
        })
    }
}

impl Bnb4 {
    /// The weight as stored: codes, absmax and double quantization, bit for bit.
    async fn quant4(&self, place: &Place) -> Result<Quant4> {
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
