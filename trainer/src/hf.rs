//! Hugging Face model configurations (`config.json`) of the Llama family, parsed into typed
//! values at the edge: `LlamaForCausalLM` (with Llama 3 `rope_scaling`),
//! `MistralForCausalLM` and `Qwen2ForCausalLM` (q/k/v biases). Pure: JSON in, a
//! [`LlamaConfig`] or an [`HfConfigError`] that names the field out.

use serde_json::Value;

/// Why a `config.json` cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HfConfigError {
    /// The text is not JSON.
    #[error("{source_name} is not valid JSON: {reason}")]
    NotJson {
        /// The file.
        source_name: String,
        /// The parser's words.
        reason: String,
    },
    /// An architecture Regatta does not implement.
    #[error("{source_name}: architecture {found:?} is not supported; Regatta trains LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM")]
    Architecture {
        /// The file.
        source_name: String,
        /// What `architectures` (or `model_type`) says.
        found: String,
    },
    /// A field is missing or has the wrong type or value.
    #[error("{source_name}: field `{field}` {problem}")]
    Field {
        /// The file.
        source_name: String,
        /// The field.
        field: String,
        /// What is wrong and what was expected.
        problem: String,
    },
}

/// Which member of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM`.
    Qwen2,
}

impl Architecture {
    /// The class name `transformers` uses.
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
        }
    }
}

/// How rotary position frequencies are scaled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Positions divided by `factor` (frequencies too).
    Linear {
        /// The factor.
        factor: f64,
    },
    /// Llama 3's frequency-dependent scaling.
    Llama3 {
        /// Scale of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are scaled fully.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
}

/// A Llama-family decoder's shape, typed.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Which family member.
    pub architecture: Architecture,
    /// Token ids embedded.
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (divides the query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Whether the LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// Longest position the model supports.
    pub max_position_embeddings: usize,
    /// Attention window (Mistral), when one applies.
    pub sliding_window: Option<usize>,
}

struct Fields<'a> {
    object: &'a serde_json::Map<String, Value>,
    source: &'a str,
}

impl<'a> Fields<'a> {
    fn error(&self, field: &str, problem: impl Into<String>) -> HfConfigError {
        HfConfigError::Field {
            source_name: self.source.to_string(),
            field: field.to_string(),
            problem: problem.into(),
        }
    }

    fn present(&self, field: &str) -> Option<&'a Value> {
        self.object.get(field).filter(|v| !v.is_null())
    }

    fn count(&self, field: &str) -> Result<usize, HfConfigError> {
        let value = self.present(field).ok_or_else(|| self.error(field, "is missing"))?;
        match value.as_u64() {
            Some(n) if n >= 1 => usize::try_from(n).map_err(|_| self.error(field, "is too large")),
            _ => Err(self.error(field, format!("must be a positive integer, not {value}"))),
        }
    }

    fn count_or(&self, field: &str, default: usize) -> Result<usize, HfConfigError> {
        match self.present(field) {
            None => Ok(default),
            Some(_) => self.count(field),
        }
    }

    fn number_or(&self, field: &str, default: f64) -> Result<f64, HfConfigError> {
        match self.present(field) {
            None => Ok(default),
            Some(value) => match value.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(self.error(field, format!("must be a positive number, not {value}"))),
            },
        }
    }

    fn flag_or(&self, field: &str, default: bool) -> Result<bool, HfConfigError> {
        match self.present(field) {
            None => Ok(default),
            Some(value) => value
                .as_bool()
                .ok_or_else(|| self.error(field, format!("must be true or false, not {value}"))),
        }
    }
}

fn architecture(fields: &Fields) -> Result<Architecture, HfConfigError> {
    let named = |name: &str| match name {
        "LlamaForCausalLM" | "llama" => Some(Architecture::Llama),
        "MistralForCausalLM" | "mistral" => Some(Architecture::Mistral),
        "Qwen2ForCausalLM" | "qwen2" => Some(Architecture::Qwen2),
        _ => None,
    };
    let unsupported = |found: String| HfConfigError::Architecture {
        source_name: fields.source.to_string(),
        found,
    };
    if let Some(list) = fields.present("architectures") {
        let names: Vec<&str> = list
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        return match names.as_slice() {
            [one] => named(one).ok_or_else(|| unsupported(one.to_string())),
            _ => Err(fields.error("architectures", format!("must list one class name, not {list}"))),
        };
    }
    match fields.present("model_type").and_then(Value::as_str) {
        Some(kind) => named(kind).ok_or_else(|| unsupported(kind.to_string())),
        None => Err(fields.error("architectures", "is missing (and so is model_type)")),
    }
}

fn rope_scaling(fields: &Fields, theta: f64) -> Result<(RopeScaling, f64), HfConfigError> {
    // transformers 4.x writes `rope_scaling` + `rope_theta`; 5.x writes `rope_parameters`
    // holding both.
    let (field, value) = match (fields.present("rope_parameters"), fields.present("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", p),
        (None, Some(s)) => ("rope_scaling", s),
        (None, None) => return Ok((RopeScaling::Default, theta)),
    };
    let object = value
        .as_object()
        .ok_or_else(|| fields.error(field, format!("must be an object, not {value}")))?;
    let inner = Fields {
        object,
        source: fields.source,
    };
    let theta = inner.number_or("rope_theta", theta)?;
    let kind = object
        .get("rope_type")
        .or_else(|| object.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |name: &str| -> Result<f64, HfConfigError> {
        match object.get(name).and_then(Value::as_f64) {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(fields.error(&format!("{field}.{name}"), "must be a positive number")),
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "llama3" => {
            let scaling = RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: need("original_max_position_embeddings")?,
            };
            if let RopeScaling::Llama3 {
                low_freq_factor,
                high_freq_factor,
                ..
            } = scaling
            {
                if high_freq_factor <= low_freq_factor {
                    return Err(fields.error(
                        &format!("{field}.high_freq_factor"),
                        "must be larger than low_freq_factor",
                    ));
                }
            }
            scaling
        }
        other => {
            return Err(fields.error(
                &format!("{field}.rope_type"),
                format!("{other:?} is not supported (default, linear or llama3)"),
            ))
        }
    };
    Ok((scaling, theta))
}

impl LlamaConfig {
    /// Parses the text of a `config.json`; `source` names it in errors.
    pub fn from_json_text(text: &str, source: &str) -> Result<Self, HfConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| HfConfigError::NotJson {
            source_name: source.to_string(),
            reason: e.to_string(),
        })?;
        Self::from_json(&value, source)
    }

    /// Parses a `config.json` already read as JSON.
    pub fn from_json(value: &Value, source: &str) -> Result<Self, HfConfigError> {
        let object = value.as_object().ok_or_else(|| HfConfigError::NotJson {
            source_name: source.to_string(),
            reason: "the top level is not an object".into(),
        })?;
        let f = Fields { object, source };
        let architecture = architecture(&f)?;
        let hidden_size = f.count("hidden_size")?;
        let num_attention_heads = f.count("num_attention_heads")?;
        let num_key_value_heads = f.count_or("num_key_value_heads", num_attention_heads)?;
        if !num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(f.error(
                "num_key_value_heads",
                format!("({num_key_value_heads}) must divide num_attention_heads ({num_attention_heads})"),
            ));
        }
        let default_head_dim = hidden_size / num_attention_heads;
        let head_dim = f.count_or("head_dim", default_head_dim.max(1))?;
        if !f.object.contains_key("head_dim") && !hidden_size.is_multiple_of(num_attention_heads) {
            return Err(f.error(
                "num_attention_heads",
                format!("({num_attention_heads}) must divide hidden_size ({hidden_size}) when head_dim is not given"),
            ));
        }
        if !head_dim.is_multiple_of(2) {
            return Err(f.error("head_dim", format!("({head_dim}) must be even for rotary embeddings")));
        }
        let (rope_scaling, rope_theta) = rope_scaling(&f, f.number_or("rope_theta", 10000.0)?)?;
        let act = f.present("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            return Err(f.error("hidden_act", format!("{act:?} is not supported (silu)")));
        }
        let qkv_bias = match architecture {
            Architecture::Qwen2 => true,
            _ => f.flag_or("attention_bias", false)?,
        };
        if f.flag_or("mlp_bias", false)? {
            return Err(f.error("mlp_bias", "true is not supported"));
        }
        let sliding_window = match architecture {
            Architecture::Mistral => f
                .present("sliding_window")
                .map(|_| f.count("sliding_window"))
                .transpose()?,
            Architecture::Qwen2 if f.flag_or("use_sliding_window", false)? => Some(f.count("sliding_window")?),
            _ => None,
        };
        Ok(Self {
            architecture,
            vocab_size: f.count("vocab_size")?,
            hidden_size,
            intermediate_size: f.count("intermediate_size")?,
            num_hidden_layers: f.count("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f.number_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: f.flag_or("tie_word_embeddings", false)?,
            qkv_bias,
            max_position_embeddings: f.count_or("max_position_embeddings", 2048)?,
            sliding_window,
        })
    }

    /// Parameters of the model.
    pub fn parameter_count(&self) -> u64 {
        let (v, d, i) = (
            self.vocab_size as u64,
            self.hidden_size as u64,
            self.intermediate_size as u64,
        );
        let (q, kv) = (
            (self.num_attention_heads * self.head_dim) as u64,
            (self.num_key_value_heads * self.head_dim) as u64,
        );
        let bias = if self.qkv_bias { q + 2 * kv } else { 0 };
        let layer = d * q + 2 * d * kv + q * d + bias + 3 * d * i + 2 * d;
        let head = if self.tie_word_embeddings { 0 } else { v * d };
        v * d + self.num_hidden_layers as u64 * layer + d + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA3: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": false, "max_position_embeddings": 131072 }"#;

    #[test]
    fn a_llama3_config_parses_into_typed_fields() {
        let c = LlamaConfig::from_json_text(LLAMA3, "config.json").unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!((c.head_dim, c.num_key_value_heads, c.rope_theta), (16, 2, 500000.0));
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert!(!c.qkv_bias && !c.tie_word_embeddings);
    }

    #[test]
    fn transformers_5_rope_parameters_are_read() {
        let text = r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}"#;
        let c = LlamaConfig::from_json_text(text, "c").unwrap();
        assert_eq!(
            (c.architecture, c.rope_theta, c.qkv_bias),
            (Architecture::Qwen2, 1e6, true)
        );
        assert_eq!(c.rope_scaling, RopeScaling::Default);
    }

    #[test]
    fn the_parameter_count_matches_llama_3_8b() {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256}"#;
        assert_eq!(
            LlamaConfig::from_json_text(text, "c").unwrap().parameter_count(),
            8_030_261_248
        );
    }

    #[test]
    fn bad_configs_name_the_field() {
        let cases = [
            (r#"{"architectures": ["GPT2LMHeadModel"]}"#, "GPT2LMHeadModel"),
            (
                r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}"#,
                "field `num_attention_heads` is missing",
            ),
            (
                &LLAMA3.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
                "num_key_value_heads",
            ),
            (&LLAMA3.replace("\"llama3\"", "\"yarn\""), "rope_scaling.rope_type"),
            (
                &LLAMA3.replace("\"hidden_size\": 64", "\"hidden_size\": -1"),
                "hidden_size",
            ),
            ("[1]", "not an object"),
            ("{", "not valid JSON"),
        ];
        for (text, expected) in cases {
            let error = LlamaConfig::from_json_text(text, "m/config.json")
                .unwrap_err()
                .to_string();
            assert!(error.contains(expected), "{text}: {error}");
            assert!(error.contains("m/config.json"), "{error}");
        }
    }
}
