//! Models in Hugging Face layout, through `object_store`: a folder (local or by URL) with
//! `config.json`, weights in `model.safetensors` or in shards listed by
//! `model.safetensors.index.json`, and tokenizer files. Opening reads only `config.json`,
//! the index and each weight file's header; tensors are then read one at a time by byte
//! range, so a rank never holds more of the model than it asks for. Writing plans shards
//! of bounded size from the parameter specs alone ([`ShardPlan`], pure) and encodes each
//! shard as safetensors.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::gguf::{GgufError, GgufHeader, GgufModel, GgufTensor};
use regatta_trainer::hf::LlamaConfig;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::llama::Llama;
use crate::model::{Gpt, Model, ParamSpec, GPT_ARCHITECTURE};

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

/// Whether a model path names a GGUF file rather than a folder.
pub fn is_gguf(path: &str) -> bool {
    path.to_ascii_lowercase().ends_with(".gguf")
}

/// The first bytes read of a GGUF file; more are read while its header goes on.
const GGUF_FIRST_READ: u64 = 4 << 20;

fn storage(e: String) -> Error {
    Error::Storage(e)
}

/// Parses a safetensors header (the JSON after the 8-byte length) of a file of
/// `file_size` bytes into entries with absolute byte ranges.
fn parse_header(file: &str, header: &[u8], file_size: u64) -> Result<Vec<(String, Entry)>> {
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
            },
        ));
    }
    Ok(out)
}

fn element_kind(dtype: &str) -> Option<(Kind, u64)> {
    match dtype {
        "F32" => Some((Kind::Float, 4)),
        "BF16" => Some((Kind::BFloat16, 2)),
        "F16" => Some((Kind::Half, 2)),
        _ => None,
    }
}

impl HfModel {
    /// Opens the folder at `url` (a path or an object-store URL).
    pub async fn open(url: &str) -> Result<Self> {
        if is_gguf(url) {
            return Self::open_gguf(url).await;
        }
        let place = Place::dir(url).map_err(storage)?;
        let config_bytes = place.get_opt("config.json").await.map_err(storage)?.ok_or_else(|| Error::ModelFile {
            path: url.to_string(),
            problem: "has no config.json: a Hugging Face model folder holds config.json, model.safetensors (or shards with model.safetensors.index.json) and tokenizer.json".into(),
        })?;
        let config_path = format!("{}/config.json", place.url());
        let config_json: Value = serde_json::from_slice(&config_bytes).map_err(|e| Error::ModelFile {
            path: config_path.clone(),
            problem: format!("is not valid JSON: {e}"),
        })?;
        let files = match place.get_opt(INDEX).await.map_err(storage)? {
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
            let head = place.get_range(file, 0..8).await.map_err(storage)?;
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
            let header = place.get_range(file, 8..8 + length).await.map_err(storage)?;
            for (name, mut entry) in parse_header(&path, &header, size)? {
                entry.file = file.clone();
                entries.insert(name, entry);
            }
        }
        Ok(Self {
            url: place.url().to_string(),
            place,
            config_json,
            entries,
            gguf_files: None,
        })
    }

    /// Opens a GGUF file: its header only (read in growing pieces until it parses), its
    /// metadata turned into `config.json`, tokenizer files and tensor names as
    /// `transformers` has them.
    async fn open_gguf(url: &str) -> Result<Self> {
        let (place, file) = Place::file(url).map_err(storage)?;
        let path = format!("{}/{file}", place.url());
        let size = place.size(&file).await.map_err(|e| Error::ModelFile {
            path: path.clone(),
            problem: format!("cannot be read: {e}"),
        })?;
        let bad = |e: GgufError| Error::ModelFile {
            path: path.clone(),
            problem: e.to_string(),
        };
        let mut read = GGUF_FIRST_READ.min(size);
        let header = loop {
            let bytes = place.get_range(&file, 0..read).await.map_err(storage)?;
            match GgufHeader::parse(&bytes, size) {
                Ok(header) => break header,
                Err(GgufError::Truncated { needed }) if read < size => {
                    read = needed.max(read.saturating_mul(2)).min(size);
                }
                Err(GgufError::Truncated { .. }) => {
                    return Err(bad(GgufError::Malformed(
                        "the header runs past the end of the file".into(),
                    )))
                }
                Err(e) => return Err(bad(e)),
            }
        };
        let model = GgufModel::from_header(&header).map_err(bad)?;
        let entries = model
            .tensors
            .into_iter()
            .map(|tensor| {
                let entry = Entry {
                    file: file.clone(),
                    dtype: tensor.info.kind.name().to_string(),
                    shape: tensor.info.shape(),
                    start: tensor.info.start,
                    end: tensor.info.end,
                    gguf: Some(tensor.clone()),
                };
                (tensor.name, entry)
            })
            .collect();
        let json_bytes = |value: &Value| Bytes::from(serde_json::to_vec(value).unwrap_or_default());
        let mut files = HashMap::new();
        files.insert("tokenizer.json", model.tokenizer.map(|t| json_bytes(&t)));
        files.insert("tokenizer_config.json", Ok(json_bytes(&model.tokenizer_config)));
        Ok(Self {
            url: path,
            place,
            config_json: model.config,
            entries,
            gguf_files: Some(files),
        })
    }

    /// `config.json` as read.
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
        let base = |s: &&ParamSpec| s.tied_to.is_none() && !regatta_trainer::lora::is_adapter(&s.name);
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
        if entry.gguf.is_some() {
            // The header's parse checked the byte count of its type; values come out as f32.
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

    /// One parameter's values as float32 on the CPU, whatever its dtype in the file
    /// (bf16 and f16 weights are upcast: a CPU run computes in float32).
    pub async fn read(&self, spec: &ParamSpec) -> Result<Tensor> {
        self.read_as(spec, Kind::Float).await
    }

    /// One parameter's values on the CPU in `kind`, converted straight from the file's
    /// dtype (a bf16 file read as bf16 is never widened on the way).
    pub async fn read_as(&self, spec: &ParamSpec, kind: Kind) -> Result<Tensor> {
        let (entry, stored) = self.entry(spec)?;
        let bytes = self
            .place
            .get_range(&entry.file, entry.start..entry.end)
            .await
            .map_err(storage)?;
        let tensor = match &entry.gguf {
            Some(gguf) => {
                let values = gguf.values(&bytes).map_err(|e| Error::Tensor {
                    path: format!("{}/{}", self.place.url(), entry.file),
                    name: spec.name.clone(),
                    problem: e.to_string(),
                })?;
                Tensor::f_from_slice(&values)?.f_reshape(&entry.shape)?
            }
            None => Tensor::f_from_data_size(&bytes, &entry.shape, stored)?,
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
        self.place.get_opt(name).await.map_err(storage)
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
            if let Some(bytes) = self.place.get_opt(name).await.map_err(storage)? {
                out.push((name.to_string(), bytes));
            }
        }
        Ok(out)
    }
}

fn index_files(index: &[u8], path: &str) -> Result<Vec<String>> {
    let bad = |problem: &str| Error::ModelFile {
        path: path.to_string(),
        problem: problem.to_string(),
    };
    let value: Value = serde_json::from_slice(index).map_err(|e| bad(&format!("is not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("has no weight_map object"))?;
    let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(str::to_string).collect();
    files.sort();
    files.dedup();
    if files.is_empty() || files.iter().any(|f| f.contains('/') || f.contains("..")) {
        return Err(bad("weight_map must name shard files in the same folder"));
    }
    Ok(files)
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

/// How a model's parameters are cut into weight files: whole blocks, in order, each file
/// up to `max_bytes` (a larger block gets a file of its own).
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPlan {
    /// Each file's name and the blocks it holds.
    pub files: Vec<(String, Vec<usize>)>,
}

impl ShardPlan {
    /// Plans files for `blocks` (tied parameters take no space) at 4 bytes an element.
    pub fn new(blocks: &[Vec<ParamSpec>], max_bytes: u64) -> Self {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut current = 0u64;
        for (block, specs) in blocks.iter().enumerate() {
            let bytes: u64 = specs
                .iter()
                .filter(|s| s.tied_to.is_none())
                .map(|s| 4 * s.numel() as u64)
                .sum();
            match groups.last_mut() {
                Some(group) if current + bytes <= max_bytes => {
                    group.push(block);
                    current += bytes;
                }
                _ => {
                    groups.push(vec![block]);
                    current = bytes;
                }
            }
        }
        let n = groups.len();
        let files = groups
            .into_iter()
            .enumerate()
            .map(|(i, blocks)| {
                let name = if n == 1 {
                    WEIGHTS.to_string()
                } else {
                    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
                };
                (name, blocks)
            })
            .collect();
        Self { files }
    }

    /// `model.safetensors.index.json` for the plan (only needed with several files).
    pub fn index(&self, blocks: &[Vec<ParamSpec>]) -> Value {
        self.index_as(blocks, Kind::Float)
    }

    /// The index of the files with every tensor written in `kind`.
    pub fn index_as(&self, blocks: &[Vec<ParamSpec>], kind: Kind) -> Value {
        let width = stored_dtype(kind).1;
        let mut weight_map = BTreeMap::new();
        let mut total = 0u64;
        for (file, members) in &self.files {
            for &block in members {
                for spec in blocks[block].iter().filter(|s| s.tied_to.is_none()) {
                    weight_map.insert(spec.name.clone(), file.clone());
                    total += width * spec.numel() as u64;
                }
            }
        }
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map })
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
    use crate::model::Init;

    fn block(sizes: &[i64]) -> Vec<ParamSpec> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, n)| ParamSpec::new(format!("p{n}.{i}"), &[*n], Init::Zeros))
            .collect()
    }

    #[test]
    fn shards_hold_whole_blocks_up_to_the_limit() {
        let blocks = vec![block(&[10]), block(&[5, 5]), block(&[30]), block(&[1])];
        let plan = ShardPlan::new(&blocks, 80);
        let groups: Vec<Vec<usize>> = plan.files.iter().map(|(_, b)| b.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(plan.files[0].0, "model-00001-of-00003.safetensors");
        let index = plan.index(&blocks);
        assert_eq!(index["metadata"]["total_size"], 4 * 51);
        assert_eq!(index["weight_map"]["p30.0"], "model-00002-of-00003.safetensors");
        assert_eq!(ShardPlan::new(&blocks, 1 << 20).files[0].0, WEIGHTS);
    }

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
