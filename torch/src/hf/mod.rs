//! Models in Hugging Face layout, through `object_store`: a folder (local or by URL) with
//! `config.json`, weights in `model.safetensors` or in shards listed by
//! `model.safetensors.index.json`, and tokenizer files. Opening reads only `config.json`,
//! the index and each weight file's header; tensors are then read one at a time by byte
//! range, so a rank never holds more of the model than it asks for. Writing plans shards
//! of bounded size from the parameter specs alone ([`ShardPlan`], pure) and encodes each
//! shard as safetensors.
//!
//! Its parts: opening a GGUF file as a folder (`gguf`), a folder bitsandbytes quantized to
//! 4 bits read as the float model it stands for (`bnb`), the safetensors format read and
//! written (`safetensors`), and weight files' shards and index (`shards`).

mod bnb;
mod gguf;
mod safetensors;
mod shards;

use std::collections::HashMap;

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::gguf::{GgufError, GgufTensor};
use regatta_trainer::LlamaConfig;
use serde_json::Value;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::gpt::{Gpt, GPT_ARCHITECTURE};
use crate::llama::Llama;
use crate::model::{Model, ParamSpec};

pub use gguf::is_gguf;
pub use safetensors::{config_dtype, encode_safetensors, encode_safetensors_as, stored_dtype};
pub use shards::ShardPlan;

use safetensors::{element_kind, parse_header};
use shards::index_files;

/// The single-file weights' name.
pub const WEIGHTS: &str = "model.safetensors";
/// The shard index's name.
pub const INDEX: &str = "model.safetensors.index.json";
/// Files copied next to the weights when present (tokenizer and generation settings).
pub const SIDE_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];

/// Where one tensor's bytes lie.
#[derive(Clone, Debug, PartialEq)]
struct Entry {
    file: String,
    dtype: String,
    shape: Vec<i64>,
    start: u64,
    end: u64,
    /// How a GGUF file stores it (dequantized, and un-permuted, as it is read).
    gguf: Option<GgufTensor>,
    /// How bitsandbytes stored it in 4 bits (dequantized as it is read).
    bnb: Option<Box<bnb::BnbTensor>>,
}

/// An opened model folder, or a GGUF file seen as one.
pub struct HfModel {
    place: Place,
    /// The folder's URL, or the GGUF file's.
    url: String,
    config_json: Value,
    entries: HashMap<String, Entry>,
    /// The files a GGUF file's metadata makes (`tokenizer.json`, `tokenizer_config.json`),
    /// or why one cannot be made.
    gguf_files: Option<HashMap<&'static str, std::result::Result<Bytes, GgufError>>>,
}

impl HfModel {
    /// Opens the folder at `url` (a path or an object-store URL).
    pub async fn open(url: &str) -> Result<Self> {
        if is_gguf(url) {
            return Self::open_gguf(url).await;
        }
        let place = Place::dir(url)?;
        let config_bytes = place.get_opt("config.json").await?.ok_or_else(|| Error::ModelFile {
            path: url.to_string(),
            problem: "has no config.json: a Hugging Face model folder holds config.json, model.safetensors (or shards with model.safetensors.index.json) and tokenizer.json".into(),
        })?;
        let config_path = format!("{}/config.json", place.url());
        let config_json: Value = serde_json::from_slice(&config_bytes).map_err(|e| Error::ModelFile {
            path: config_path.clone(),
            problem: format!("is not valid JSON: {e}"),
        })?;
        let files = match place.get_opt(INDEX).await? {
            Some(index) => index_files(&index, &format!("{}/{INDEX}", place.url()))?,
            None => vec![WEIGHTS.to_string()],
        };
        let mut entries = HashMap::new();
        for file in &files {
            let path = format!("{}/{file}", place.url());
            let size = match place.size(file).await {
                Ok(size) => size,
                Err(e) => {
                    return Err(Error::ModelFile {
                        path,
                        problem: format!(
                            "cannot be read ({e}); a model folder needs {WEIGHTS} or {INDEX} with its shards"
                        ),
                    })
                }
            };
            let too_short = || Error::ModelFile {
                path: path.clone(),
                problem: "is too short for a safetensors file".into(),
            };
            if size < 8 {
                return Err(too_short());
            }
            let head = place.get_range(file, 0..8).await?;
            let length = head
                .get(..8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_le_bytes)
                .ok_or_else(too_short)?;
            if length > 100 << 20 || 8 + length > size {
                return Err(Error::ModelFile {
                    path,
                    problem: format!("declares a {length}-byte header in a {size}-byte file: not a safetensors file"),
                });
            }
            let header = place.get_range(file, 8..8 + length).await?;
            for (name, mut entry) in parse_header(&path, &header, size)? {
                entry.file = file.clone();
                entries.insert(name, entry);
            }
        }
        bnb::fold(&place, &config_json, &mut entries).await?;
        Ok(Self {
            url: place.url().to_string(),
            place,
            config_json,
            entries,
            gguf_files: None,
        })
    }

    /// The kind the folder's weights are stored in: BF16 or F16 when every tensor is, else
    /// F32 (what a checkpoint of a run from this folder writes its weights in).
    pub fn weights_kind(&self) -> Kind {
        let mut dtypes = self.entries.values().map(|e| e.dtype.as_str());
        match dtypes.next() {
            Some(first @ ("BF16" | "F16")) if dtypes.all(|d| d == first) => {
                if first == "BF16" {
                    Kind::BFloat16
                } else {
                    Kind::Half
                }
            }
            _ => Kind::Float,
        }
    }

    /// `config.json` as read.
    pub fn config_json(&self) -> &Value {
        &self.config_json
    }

    /// The folder's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The model `config.json` describes.
    pub fn model(&self) -> Result<Box<dyn Model>> {
        let source = if self.is_gguf() {
            format!("{} (its metadata)", self.url)
        } else {
            format!("{}/config.json", self.place.url())
        };
        model_from_config(&self.config_json, &source)
    }

    /// Checks that the weight files hold exactly the model's tensors with their shapes.
    pub fn check(&self, model: &dyn Model) -> Result<()> {
        let specs: Vec<ParamSpec> = model.blocks().into_iter().flatten().collect();
        let base = |s: &&ParamSpec| s.tied_to.is_none() && !regatta_trainer::is_adapter(&s.name);
        for spec in specs.iter().filter(base) {
            self.entry(spec)?;
        }
        let known: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let mut extra: Vec<&String> = self
            .entries
            .keys()
            .filter(|name| !known.contains(name.as_str()) && !name.ends_with("rotary_emb.inv_freq"))
            .collect();
        extra.sort();
        if let Some(name) = extra.first() {
            let entry = &self.entries[*name];
            return Err(Error::Tensor {
                path: format!("{}/{}", self.place.url(), entry.file),
                name: (*name).clone(),
                problem: format!(
                    "is not a parameter of the model config.json describes ({} unexpected tensor(s)); is config.json from another model?",
                    extra.len()
                ),
            });
        }
        Ok(())
    }

    /// Where `spec`'s bytes lie and their element type, once they are checked to fit it.
    fn entry(&self, spec: &ParamSpec) -> Result<(&Entry, Kind)> {
        let entry = self.entries.get(&spec.name).ok_or_else(|| Error::ModelFile {
            path: self.place.url().to_string(),
            problem: format!("no weight file holds tensor {} (shape {:?})", spec.name, spec.shape),
        })?;
        let path = format!("{}/{}", self.place.url(), entry.file);
        if entry.shape != spec.shape {
            return Err(Error::Tensor {
                path,
                name: spec.name.clone(),
                problem: format!("has shape {:?}; config.json implies {:?}", entry.shape, spec.shape),
            });
        }
        if entry.gguf.is_some() || entry.bnb.is_some() {
            // Opening checked the byte counts of its pieces; values come out as f32.
            return Ok((entry, Kind::Float));
        }
        let (kind, width) = element_kind(&entry.dtype).ok_or_else(|| Error::Tensor {
            path: path.clone(),
            name: spec.name.clone(),
            problem: format!("has dtype {}; weights must be F32, BF16 or F16", entry.dtype),
        })?;
        if entry.end - entry.start != spec.numel() as u64 * width {
            return Err(Error::Tensor {
                path,
                name: spec.name.clone(),
                problem: format!(
                    "holds {} bytes; shape {:?} in {} needs {}",
                    entry.end - entry.start,
                    spec.shape,
                    entry.dtype,
                    spec.numel() as u64 * width
                ),
            });
        }
        Ok((entry, kind))
    }

    /// How the folder stores its quantized weights (bitsandbytes): the quantization, the
    /// block size (0 for int8) and whether double quantization was used; `None` for a
    /// folder holding none (the settings of the first such weight by name when they
    /// differ, which transformers never writes).
    pub fn stored_quantization(&self) -> Option<(regatta_trainer::BaseQuantization, usize, bool)> {
        self.entries
            .iter()
            .filter_map(|(name, entry)| entry.bnb.as_ref().map(|b| (name, b)))
            .min_by_key(|(name, _)| *name)
            .map(|(_, b)| b.settings())
    }

    /// A weight the folder stores quantized (bitsandbytes), as stored; `None` for any other.
    pub async fn read_stored(&self, spec: &ParamSpec) -> Result<Option<regatta_trainer::quant::Stored>> {
        let (entry, _) = self.entry(spec)?;
        match &entry.bnb {
            Some(bnb) => Ok(Some(bnb.stored(&self.place).await?)),
            None => Ok(None),
        }
    }

    /// One parameter's values as float32 on the CPU, whatever its dtype in the file
    /// (bf16 and f16 weights are upcast: a CPU run computes in float32).
    pub async fn read(&self, spec: &ParamSpec) -> Result<Tensor> {
        self.read_as(spec, Kind::Float).await
    }

    /// One parameter's values on the CPU in `kind`, converted straight from the file's
    /// dtype (a bf16 file read as bf16 is never widened on the way).
    pub async fn read_as(&self, spec: &ParamSpec, kind: Kind) -> Result<Tensor> {
        let (entry, stored) = self.entry(spec)?;
        if let Some(bnb) = &entry.bnb {
            let values = bnb.values(&self.place).await?;
            let tensor = Tensor::f_from_slice(&values)?.f_reshape(&entry.shape)?;
            return Ok(tensor.to_kind(kind));
        }
        let bytes = self.place.get_range(&entry.file, entry.start..entry.end).await?;
        let tensor = match &entry.gguf {
            Some(gguf) => {
                let values = gguf.values(&bytes).map_err(|e| Error::Tensor {
                    path: format!("{}/{}", self.place.url(), entry.file),
                    name: spec.name.clone(),
                    problem: e.to_string(),
                })?;
                Tensor::f_from_slice(&values)?.f_reshape(&entry.shape)?
            }
            None => crate::shim::tensor_from_bytes(bytes, &entry.shape, stored)?,
        };
        Ok(if stored == kind { tensor } else { tensor.to_kind(kind) })
    }

    /// One file of the folder, if it exists. A GGUF file has the tokenizer files its
    /// metadata makes, and no others.
    pub async fn file(&self, name: &str) -> Result<Option<Bytes>> {
        if let Some(files) = &self.gguf_files {
            return match files.get(name) {
                Some(Ok(bytes)) => Ok(Some(bytes.clone())),
                Some(Err(e)) => Err(Error::ModelFile {
                    path: self.url().to_string(),
                    problem: e.to_string(),
                }),
                None => Ok(None),
            };
        }
        self.place.get_opt(name).await.map_err(Error::from)
    }

    /// Whether this is a GGUF file.
    pub fn is_gguf(&self) -> bool {
        self.gguf_files.is_some()
    }

    /// The folder's tokenizer and generation files that exist, with their bytes (for a
    /// GGUF file, the tokenizer files it can make).
    pub async fn side_files(&self) -> Result<Vec<(String, Bytes)>> {
        if let Some(files) = &self.gguf_files {
            let mut out: Vec<(String, Bytes)> = files
                .iter()
                .filter_map(|(name, bytes)| Some((name.to_string(), bytes.as_ref().ok()?.clone())))
                .collect();
            out.sort();
            return Ok(out);
        }
        let mut out = Vec::new();
        for name in SIDE_FILES {
            if let Some(bytes) = self.place.get_opt(name).await? {
                out.push((name.to_string(), bytes));
            }
        }
        Ok(out)
    }
}

/// The model a `config.json` describes: the Llama family, or the built-in GPT of a
/// Regatta checkpoint.
pub fn model_from_config(json: &Value, source: &str) -> Result<Box<dyn Model>> {
    let is_gpt = json
        .get("architectures")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|n| n.as_str() == Some(GPT_ARCHITECTURE)));
    if is_gpt {
        let gpt = Gpt::from_hf_config(json).ok_or_else(|| Error::ModelFile {
            path: source.to_string(),
            problem: format!("a {GPT_ARCHITECTURE} config needs layers, width, heads, context and vocab_size"),
        })?;
        return Ok(Box::new(gpt));
    }
    let config = LlamaConfig::from_json(json, source)?;
    Ok(Box::new(Llama::new(config, json.clone())))
}
