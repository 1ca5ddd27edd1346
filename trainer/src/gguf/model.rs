//! A GGUF header seen as a Hugging Face folder: the `config.json` its metadata says, each
//! tensor under its `transformers` name and shape, and the tokenizer files built from the
//! vocabulary it carries. llama.cpp's converter reorders the rows of a Llama model's query
//! and key projections for its RoPE kernel; [`GgufTensor::values`] puts them back.

use serde_json::{json, Map, Value as Json};

use super::tokenizer::{tokenizer_config, tokenizer_json};
use super::{dequantize, GgufError, GgufHeader, TensorInfo, Value};

/// One tensor of the model under its Hugging Face name.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensor {
    /// The `transformers` parameter name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Where its bytes are and how they are stored.
    pub info: TensorInfo,
    /// Heads whose rows llama.cpp reordered for its RoPE (Llama q and k projections).
    pub permuted_heads: Option<usize>,
}

impl GgufTensor {
    /// The tensor's values in PyTorch's layout, from the bytes `info` points at.
    pub fn values(&self, bytes: &[u8]) -> Result<Vec<f32>, GgufError> {
        let mut out = vec![0f32; self.info.numel() as usize];
        dequantize(self.info.kind, bytes, &mut out)?;
        match self.permuted_heads {
            Some(heads) => {
                let rows = self.info.dims.last().copied().unwrap_or(0) as usize;
                unpermute(&out, rows, heads, &self.info.name)
            }
            None => Ok(out),
        }
    }
}

/// Undoes llama.cpp's `permute(w, n_head)`, which writes row `h·d + t·d/2 + j` of a head of
/// `d` rows at `h·d + 2j + t` (the halves of each head interleaved). `rows` is the outer
/// dimension: a weight's output features, or a bias's length.
fn unpermute(values: &[f32], rows: usize, heads: usize, name: &str) -> Result<Vec<f32>, GgufError> {
    let fits = heads > 0 && rows.is_multiple_of(heads) && (rows / heads).is_multiple_of(2);
    if !fits || rows == 0 || !values.len().is_multiple_of(rows) {
        return Err(GgufError::Malformed(format!(
            "tensor {name} has {rows} rows, not a whole number of heads ({heads}) of even size"
        )));
    }
    let (d, cols) = (rows / heads, values.len() / rows);
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for t in 0..2 {
            for j in 0..d / 2 {
                let from = (h * d + 2 * j + t) * cols;
                let to = (h * d + t * d / 2 + j) * cols;
                out[to..to + cols].copy_from_slice(&values[from..from + cols]);
            }
        }
    }
    Ok(out)
}

/// A GGUF model as a Hugging Face folder would hold it.
#[derive(Clone, Debug)]
pub struct GgufModel {
    /// What `config.json` would say.
    pub config: Json,
    /// Every tensor, under its `transformers` name.
    pub tensors: Vec<GgufTensor>,
    /// `tokenizer.json`, or why the file's vocabulary cannot make one.
    pub tokenizer: Result<Json, GgufError>,
    /// `tokenizer_config.json`: special tokens and the chat template.
    pub tokenizer_config: Json,
}

/// Reads typed metadata of one architecture.
struct Meta<'a> {
    header: &'a GgufHeader,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.arch)
    }

    fn count(&self, name: &str) -> Result<Option<u64>, GgufError> {
        let key = self.key(name);
        match self.header.get(&key) {
            None => Ok(None),
            Some(Value::Array(_)) => Err(GgufError::Unsupported(format!(
                "metadata `{key}` differs per layer; Regatta runs models whose layers are alike"
            ))),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| GgufError::Metadata {
                key,
                problem: format!("must be a non-negative integer, not {v:?}"),
            }),
        }
    }

    fn need(&self, name: &str) -> Result<u64, GgufError> {
        self.count(name)?.ok_or_else(|| GgufError::Metadata {
            key: self.key(name),
            problem: "is missing".into(),
        })
    }

    fn number(&self, name: &str) -> Result<Option<f64>, GgufError> {
        let key = self.key(name);
        match self.header.get(&key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| GgufError::Metadata {
                key,
                problem: format!("must be a number, not {v:?}"),
            }),
        }
    }
}

/// The `transformers` name of a GGUF tensor of a Llama-family model.
fn hf_name(gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = top {
        return Some(name.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let module = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}.{suffix}"))
}

/// What `transformers` calls a GGUF architecture.
struct Architecture {
    /// GGUF's name (`llama`), the prefix of its metadata keys.
    name: &'static str,
    /// The model class in `config.json`'s `architectures`.
    class: &'static str,
    /// Whether llama.cpp's converter reordered the rows of the q and k projections.
    permutes: bool,
}

impl Architecture {
    /// The architecture `general.architecture` names, or why Regatta cannot run it.
    fn of(header: &GgufHeader) -> Result<Self, GgufError> {
        let arch = header
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| GgufError::Metadata {
                key: "general.architecture".into(),
                problem: "is missing".into(),
            })?;
        match arch {
            "llama" => Ok(Self {
                name: "llama",
                class: "LlamaForCausalLM",
                permutes: true,
            }),
            "qwen2" => Ok(Self {
                name: "qwen2",
                class: "Qwen2ForCausalLM",
                permutes: false,
            }),
            other => Err(GgufError::Unsupported(format!(
                "architecture {other:?} is not supported; Regatta reads GGUF models of architecture llama (Llama, Mistral, SmolLM) and qwen2"
            ))),
        }
    }
}

/// The attention's shape.
struct Attention {
    heads: u64,
    kv_heads: u64,
    hidden: u64,
    head_dim: u64,
}

impl Meta<'_> {
    /// The attention's shape; refuses rotary embeddings Regatta does not compute (partial
    /// RoPE, per-frequency factors).
    fn attention(&self) -> Result<Attention, GgufError> {
        let heads = self.need("attention.head_count")?;
        let kv_heads = self.count("attention.head_count_kv")?.unwrap_or(heads);
        let hidden = self.need("embedding_length")?;
        if heads == 0 || kv_heads == 0 {
            return Err(GgufError::Metadata {
                key: self.key("attention.head_count"),
                problem: "must be positive".into(),
            });
        }
        let head_dim = match self.count("attention.key_length")? {
            Some(d) => d,
            None => hidden / heads,
        };
        if let Some(rope) = self.count("rope.dimension_count")? {
            if rope != head_dim {
                return Err(GgufError::Unsupported(format!(
                    "rotary embeddings over {rope} of {head_dim} head dimensions (partial RoPE) are not supported"
                )));
            }
        }
        if self.header.tensors.iter().any(|t| t.name == "rope_freqs.weight") {
            return Err(GgufError::Unsupported(
                "per-frequency RoPE factors (rope_freqs.weight, Llama 3.1's rope scaling) are not read yet; use the model's Hugging Face folder"
                    .into(),
            ));
        }
        Ok(Attention {
            heads,
            kv_heads,
            hidden,
            head_dim,
        })
    }

    /// `config.json`'s `rope_scaling`, if the model scales its positions.
    fn rope_scaling(&self) -> Result<Option<Json>, GgufError> {
        match self.header.get(&self.key("rope.scaling.type")).and_then(Value::as_str) {
            None | Some("none") => Ok(None),
            Some("linear") => {
                let factor = self.number("rope.scaling.factor")?.ok_or_else(|| GgufError::Metadata {
                    key: self.key("rope.scaling.factor"),
                    problem: "is missing (rope.scaling.type is linear)".into(),
                })?;
                Ok(Some(json!({"rope_type": "linear", "factor": factor})))
            }
            Some(other) => Err(GgufError::Unsupported(format!(
                "RoPE scaling {other:?} is not supported (none or linear)"
            ))),
        }
    }

    /// The vocabulary's size: said, or the tokens listed, or the embedding's rows.
    fn vocab_size(&self) -> Result<u64, GgufError> {
        let tokens = self.header.get("tokenizer.ggml.tokens").and_then(Value::as_array);
        let embedding = self.header.tensors.iter().find(|t| t.name == "token_embd.weight");
        match (self.count("vocab_size")?, tokens, embedding) {
            (Some(v), _, _) => Ok(v),
            (None, Some(tokens), _) => Ok(tokens.len() as u64),
            (None, None, Some(e)) => Ok(e.dims.get(1).copied().unwrap_or(0)),
            (None, None, None) => Err(GgufError::Unsupported("the file has no token_embd.weight".into())),
        }
    }

    /// What `config.json` would say.
    fn config(&self, arch: &Architecture, attention: &Attention) -> Result<Map<String, Json>, GgufError> {
        let header = self.header;
        let mut config = Map::new();
        config.insert("architectures".into(), json!([arch.class]));
        config.insert("model_type".into(), json!(arch.name));
        config.insert("hidden_size".into(), json!(attention.hidden));
        config.insert("intermediate_size".into(), json!(self.need("feed_forward_length")?));
        config.insert("num_hidden_layers".into(), json!(self.need("block_count")?));
        config.insert("num_attention_heads".into(), json!(attention.heads));
        config.insert("num_key_value_heads".into(), json!(attention.kv_heads));
        config.insert("head_dim".into(), json!(attention.head_dim));
        config.insert("hidden_act".into(), json!("silu"));
        config.insert(
            "rms_norm_eps".into(),
            json!(self.number("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6)),
        );
        config.insert(
            "rope_theta".into(),
            json!(self.number("rope.freq_base")?.unwrap_or(10000.0)),
        );
        if let Some(context) = self.count("context_length")? {
            config.insert("max_position_embeddings".into(), json!(context));
        }
        if let Some(scaling) = self.rope_scaling()? {
            config.insert("rope_scaling".into(), scaling);
        }
        config.insert("vocab_size".into(), json!(self.vocab_size()?));
        let tied = !header.tensors.iter().any(|t| t.name == "output.weight");
        config.insert("tie_word_embeddings".into(), json!(tied));
        let token_id = |key: &str| header.get(key).and_then(Value::as_u64);
        if let Some(id) = token_id("tokenizer.ggml.bos_token_id") {
            config.insert("bos_token_id".into(), json!(id));
        }
        if let Some(id) = token_id("tokenizer.ggml.eos_token_id") {
            config.insert("eos_token_id".into(), json!(id));
        }
        if arch.name == "llama" && header.tensors.iter().any(|t| t.name.ends_with("attn_q.bias")) {
            config.insert("attention_bias".into(), json!(true));
        }
        Ok(config)
    }
}

/// Every tensor of `header` under its `transformers` name, with the heads to unpermute
/// where llama.cpp reordered them.
fn hf_tensors(header: &GgufHeader, arch: &Architecture, attention: &Attention) -> Result<Vec<GgufTensor>, GgufError> {
    let mut tensors = Vec::with_capacity(header.tensors.len());
    for info in &header.tensors {
        let name = hf_name(&info.name).ok_or_else(|| {
            GgufError::Unsupported(format!("tensor {} has no counterpart in {}", info.name, arch.class))
        })?;
        let permuted_heads = match (arch.permutes, info.name.rsplit('.').nth(1)) {
            (true, Some("attn_q")) => Some(attention.heads as usize),
            (true, Some("attn_k")) => Some(attention.kv_heads as usize),
            _ => None,
        };
        tensors.push(GgufTensor {
            name,
            info: info.clone(),
            permuted_heads,
        });
    }
    Ok(tensors)
}

impl GgufModel {
    /// The model `header` describes (errors do not name the file: the caller knows it).
    pub fn from_header(header: &GgufHeader) -> Result<Self, GgufError> {
        let arch = Architecture::of(header)?;
        let meta = Meta {
            header,
            arch: arch.name,
        };
        let attention = meta.attention()?;
        let config = meta.config(&arch, &attention)?;
        Ok(Self {
            config: Json::Object(config),
            tensors: hf_tensors(header, &arch, &attention)?,
            tokenizer: tokenizer_json(header),
            tokenizer_config: tokenizer_config(header),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::file;
    use super::*;

    fn llama_meta() -> Vec<(&'static str, Value)> {
        vec![
            ("general.architecture", Value::String("llama".into())),
            ("llama.embedding_length", Value::Uint(64)),
            ("llama.feed_forward_length", Value::Uint(160)),
            ("llama.block_count", Value::Uint(2)),
            ("llama.attention.head_count", Value::Uint(4)),
            ("llama.attention.head_count_kv", Value::Uint(2)),
            ("llama.rope.freq_base", Value::Float(10000.0)),
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(
                    ["<s>", "a", "b", "ab"]
                        .iter()
                        .map(|s| Value::String(s.to_string()))
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.merges", Value::Array(vec![Value::String("a b".into())])),
            (
                "tokenizer.ggml.token_type",
                Value::Array(vec![Value::Int(3), Value::Int(1), Value::Int(1), Value::Int(1)]),
            ),
            ("tokenizer.ggml.bos_token_id", Value::Uint(0)),
            ("tokenizer.chat_template", Value::String("{{ messages }}".into())),
        ]
    }

    #[test]
    fn unpermuting_inverts_llama_cpps_permutation() {
        // llama.cpp: w.reshape(heads, 2, d/2, cols).swapaxes(1, 2).reshape(rows, cols).
        let (heads, d, cols) = (2usize, 4usize, 3usize);
        let original: Vec<f32> = (0..heads * d * cols).map(|v| v as f32).collect();
        let mut permuted = vec![0f32; original.len()];
        for h in 0..heads {
            for j in 0..d / 2 {
                for t in 0..2 {
                    let src = (h * d + t * d / 2 + j) * cols;
                    let dst = (h * d + j * 2 + t) * cols;
                    permuted[dst..dst + cols].copy_from_slice(&original[src..src + cols]);
                }
            }
        }
        assert_ne!(permuted, original);
        assert_eq!(
            unpermute(&permuted, heads * d, heads, "q").expect("unpermute"),
            original
        );
        assert!(unpermute(&permuted, heads * d, 3, "q").is_err());
    }

    #[test]
    fn a_llama_header_becomes_a_config_and_tokenizer() {
        let bytes = file(&llama_meta());
        let header = GgufHeader::parse(&bytes, bytes.len() as u64).expect("parse");
        // The test file's one tensor is `t`, which no Llama has.
        let err = GgufModel::from_header(&header).expect_err("t");
        assert!(err.to_string().contains("tensor t has no counterpart"), "{err}");
        let mut header = header;
        header.tensors[0].name = "token_embd.weight".into();
        let model = GgufModel::from_header(&header).expect("model");
        let config = crate::LlamaConfig::from_json(&model.config, "m.gguf").expect("config");
        assert_eq!(
            (config.num_key_value_heads, config.head_dim, config.vocab_size),
            (2, 16, 4)
        );
        assert!(config.tie_word_embeddings);
        assert_eq!(model.tensors[0].name, "model.embed_tokens.weight");
        assert_eq!(model.tokenizer_config["bos_token"], "<s>");
        assert_eq!(model.tokenizer_config["chat_template"], "{{ messages }}");
        let tokenizer = model.tokenizer.expect("tokenizer");
        assert_eq!(tokenizer["added_tokens"][0]["content"], "<s>");
        assert_eq!(tokenizer["model"]["vocab"]["ab"], 3);
    }

    #[test]
    fn unsupported_models_are_refused_by_name() {
        let mut meta = llama_meta();
        meta[0].1 = Value::String("gemma2".into());
        let bytes = file(&meta);
        let header = GgufHeader::parse(&bytes, bytes.len() as u64).expect("parse");
        let err = GgufModel::from_header(&header).expect_err("gemma2");
        assert!(err.to_string().contains("\"gemma2\" is not supported"), "{err}");

        let mut meta = llama_meta();
        meta[7].1 = Value::String("t5".into());
        let bytes = file(&meta);
        let mut header = GgufHeader::parse(&bytes, bytes.len() as u64).expect("parse");
        header.tensors[0].name = "token_embd.weight".into();
        let model = GgufModel::from_header(&header).expect("model");
        let err = model.tokenizer.expect_err("unigram");
        assert!(err.to_string().contains("\"t5\" is not read"), "{err}");
    }

    #[test]
    fn names_map_to_transformers() {
        assert_eq!(
            hf_name("blk.12.ffn_down.weight").as_deref(),
            Some("model.layers.12.mlp.down_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.attn_q.bias").as_deref(),
            Some("model.layers.0.self_attn.q_proj.bias")
        );
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("blk.0.attn_qkv.weight"), None);
    }
}
