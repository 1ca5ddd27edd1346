//! LoRA adapters, the pure half: the `[lora]` settings, which projections they target,
//! the names PEFT gives adapter tensors, and `adapter_config.json` in PEFT's layout (written
//! with every key `peft` writes; read back with the settings checked, so an adapter this
//! runtime cannot apply is refused by name rather than misapplied).
//!
//! A targeted projection `y = x W^T + b` becomes `y = x W^T + b + (alpha / r) * B(A(dropout(x)))`
//! with `A: [r, in]` and `B: [out, r]`; the base weights are frozen.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The projections of a Llama-family decoder layer an adapter can target, as PEFT names
/// them (the last part of the module's name).
pub const PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// PEFT's prefix of every adapter tensor name in `adapter_model.safetensors`.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The file holding the adapter's settings.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// The file holding the adapter's tensors.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// `[lora]` in `train.toml`: low-rank adapters on the chosen projections; everything else
/// is frozen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// The adapters' rank `r`.
    pub rank: usize,
    /// The scale's numerator: the update is `alpha / r * B A` (`alpha / sqrt(r)` with `use_rslora`).
    pub alpha: f64,
    /// Dropout on the adapter's input while training (0: none).
    pub dropout: f64,
    /// Projections that get adapters: names from [`PROJECTIONS`], or `"all-linear"`.
    pub target_modules: Vec<String>,
    /// Rank-stabilised scaling, `alpha / sqrt(r)` (PEFT's `use_rslora`).
    pub use_rslora: bool,
    /// Also write merged weights (a plain Hugging Face model) beside each checkpoint's adapter.
    pub merge_on_save: bool,
    /// QLoRA: the frozen base's projection weights held in 4 bits (`nf4` or `fp4`,
    /// quantized as bitsandbytes does at load), or `none` (the compute dtype).
    pub base_quantization: BaseQuantization,
    /// Quantize the 4-bit blocks' absmax values too (bitsandbytes' double quantization,
    /// `bnb_4bit_use_double_quant`): about 0.37 bits a parameter less.
    pub double_quant: bool,
    /// Elements per absmax block (bitsandbytes: 64).
    pub quant_block_size: usize,
}

/// How a LoRA run holds the frozen base's projection weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseQuantization {
    /// In the compute dtype.
    #[default]
    None,
    /// NormalFloat 4 (QLoRA).
    Nf4,
    /// bitsandbytes' 4-bit float.
    Fp4,
    /// LLM.int8's layout: a signed byte per element, each row scaled by its absmax.
    Int8,
}

impl BaseQuantization {
    /// The 4-bit type, where 4-bit.
    pub fn four_bit(self) -> Option<crate::quant::Quant4Type> {
        match self {
            Self::Nf4 => Some(crate::quant::Quant4Type::Nf4),
            Self::Fp4 => Some(crate::quant::Quant4Type::Fp4),
            Self::None | Self::Int8 => None,
        }
    }
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            target_modules: PROJECTIONS.iter().map(|p| p.to_string()).collect(),
            use_rslora: false,
            merge_on_save: false,
            base_quantization: BaseQuantization::None,
            double_quant: false,
            quant_block_size: 64,
        }
    }
}

impl LoraConfig {
    /// Checks every field; the message names the field.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |message: String| Err(Error::Config(message));
        if !(1..=4096).contains(&self.rank) {
            return bad(format!("lora.rank must be 1..=4096, not {}", self.rank));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return bad(format!("lora.alpha must be positive, not {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("lora.dropout must lie in [0, 1), not {}", self.dropout));
        }
        match self.base_quantization {
            BaseQuantization::Nf4 | BaseQuantization::Fp4 => {
                if let Err(e) = crate::quant::check_block(self.quant_block_size) {
                    return bad(format!("lora.{e}"));
                }
            }
            // Row-wise: no block.
            BaseQuantization::Int8 | BaseQuantization::None => {}
        }
        if self.target_modules.is_empty() {
            return bad("lora.target_modules must name at least one projection".into());
        }
        for name in &self.target_modules {
            if name != "all-linear" && !PROJECTIONS.contains(&name.as_str()) {
                return bad(format!(
                    "lora.target_modules: {name:?} is not a projection of a Llama-family layer; use \"all-linear\" or some of {}",
                    PROJECTIONS.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// The scale of the adapters' output.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Whether the projection `name` (for example `q_proj`) gets an adapter.
    pub fn targets(&self, name: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| t == name || (t == "all-linear" && PROJECTIONS.contains(&name)))
    }

    /// The targeted projections, in [`PROJECTIONS`] order.
    pub fn targeted(&self) -> Vec<&'static str> {
        PROJECTIONS.iter().copied().filter(|p| self.targets(p)).collect()
    }

    /// `adapter_config.json` as PEFT writes it for these settings; `base` is the base
    /// model's path or name.
    pub fn peft_json(&self, base: &str) -> serde_json::Value {
        serde_json::json!({
            "alora_invocation_tokens": null,
            "alpha_pattern": {},
            "arrow_config": null,
            "auto_mapping": null,
            "base_model_name_or_path": base,
            "bias": "none",
            "corda_config": null,
            "ensure_weight_tying": false,
            "eva_config": null,
            "exclude_modules": null,
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "kasa_config": null,
            "layer_replication": null,
            "layers_pattern": null,
            "layers_to_transform": null,
            "loftq_config": {},
            "lora_alpha": self.alpha,
            "lora_bias": false,
            "lora_dropout": self.dropout,
            "lora_ga_config": null,
            "megatron_config": null,
            "megatron_core": "megatron.core",
            "modules_to_save": null,
            "monteclora_config": null,
            "peft_type": "LORA",
            "qalora_group_size": 16,
            "r": self.rank,
            "rank_pattern": {},
            "revision": null,
            "target_modules": self.targeted(),
            "target_parameters": null,
            "task_type": "CAUSAL_LM",
            "trainable_token_indices": null,
            "use_bdlora": null,
            "use_dora": false,
            "use_qalora": false,
            "use_rslora": self.use_rslora,
            "velora_config": null
        })
    }

    /// The settings an `adapter_config.json` (from PEFT or from Regatta) describes. Keys
    /// this runtime cannot honour (DoRA, per-layer ranks, biases, extra trained modules)
    /// are refused by name; `source` names the file in errors.
    pub fn from_peft_json(json: &serde_json::Value, source: &str) -> crate::Result<Self> {
        let bad = |problem: String| Error::Config(format!("{source}: {problem}"));
        let object = json.as_object().ok_or_else(|| bad("is not a JSON object".into()))?;
        let get = |key: &str| object.get(key).filter(|v| !v.is_null());
        match get("peft_type").and_then(|v| v.as_str()) {
            Some("LORA") => {}
            other => return Err(bad(format!("peft_type is {other:?}; only LORA adapters are supported"))),
        }
        let rank = get("r")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| bad("has no integer \"r\" (the adapter rank)".into()))? as usize;
        let alpha = get("lora_alpha")
            .and_then(|v| v.as_f64())
            .ok_or_else(|| bad("has no number \"lora_alpha\"".into()))?;
        let flag = |key: &str| get(key).and_then(|v| v.as_bool()).unwrap_or(false);
        for key in ["use_dora", "fan_in_fan_out", "lora_bias", "use_qalora"] {
            if flag(key) {
                return Err(bad(format!("sets {key}, which Regatta's LoRA does not implement")));
            }
        }
        for key in ["rank_pattern", "alpha_pattern"] {
            if get(key).and_then(|v| v.as_object()).is_some_and(|o| !o.is_empty()) {
                return Err(bad(format!(
                    "sets {key} (per-module ranks), which Regatta's LoRA does not implement"
                )));
            }
        }
        for key in [
            "modules_to_save",
            "layers_to_transform",
            "trainable_token_indices",
            "target_parameters",
            "exclude_modules",
        ] {
            if get(key).is_some_and(|v| !v.as_array().is_some_and(|a| a.is_empty())) {
                return Err(bad(format!("sets {key}, which Regatta's LoRA does not implement")));
            }
        }
        if let Some(bias) = get("bias").and_then(|v| v.as_str()) {
            if bias != "none" {
                return Err(bad(format!("has bias = {bias:?}; only \"none\" is supported")));
            }
        }
        let target_modules = match get("target_modules") {
            Some(serde_json::Value::String(one)) => vec![one.clone()],
            Some(serde_json::Value::Array(many)) => many
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("target_modules must be strings".into()))?,
            _ => return Err(bad("has no target_modules".into())),
        };
        let config = Self {
            rank,
            alpha,
            dropout: get("lora_dropout").and_then(|v| v.as_f64()).unwrap_or(0.0),
            target_modules,
            use_rslora: flag("use_rslora"),
            // How the base is held is the run's choice, not the adapter's.
            ..Self::default()
        };
        config.validate().map_err(|e| bad(e.to_string()))?;
        Ok(config)
    }
}

/// The PEFT name of an adapter tensor Regatta calls `name` (`model.layers.0.self_attn.q_proj.lora_A.weight`).
pub fn peft_name(name: &str) -> String {
    format!("{PEFT_PREFIX}{name}")
}

/// Regatta's name of a PEFT adapter tensor, or `None` when `name` is not one: PEFT's
/// prefix removed, and the adapter name PEFT inserts in memory (`lora_A.default.weight`)
/// dropped.
pub fn from_peft_name(name: &str) -> Option<String> {
    let rest = name.strip_prefix(PEFT_PREFIX)?;
    Some(
        rest.replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B."),
    )
}

/// Whether a parameter name is an adapter's (`...lora_A.weight` or `...lora_B.weight`).
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// Where a ZeRO rank keeps a kind of state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// On the compute device.
    #[default]
    None,
    /// In host memory.
    Cpu,
}

/// `[zero]` in `train.toml`: where each rank's state lives (ZeRO-Offload).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ZeroConfig {
    /// `cpu`: AdamW moments and fp32 master weights in host memory; gradient shards go
    /// to the host as they are reduced and the update runs there.
    pub offload_optimizer: Offload,
    /// `cpu` (ZeRO-3 with `offload_optimizer = "cpu"`): the parameter shards stay on the
    /// host too and are fetched to the device per block.
    pub offload_params: Offload,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qlora_settings_parse_and_bad_ones_name_the_setting() {
        let config: LoraConfig =
            toml::from_str("base_quantization = \"nf4\"\ndouble_quant = true\nquant_block_size = 128").unwrap();
        assert_eq!(config.base_quantization, BaseQuantization::Nf4);
        assert_eq!(config.base_quantization.four_bit(), Some(crate::quant::Quant4Type::Nf4));
        assert!(config.double_quant && config.quant_block_size == 128);
        config.validate().unwrap();
        assert_eq!(LoraConfig::default().base_quantization, BaseQuantization::None);
        let refused = |config: LoraConfig| config.validate().unwrap_err().to_string();
        // int8 is row-wise: it has no block to check.
        let int8 = LoraConfig {
            base_quantization: BaseQuantization::Int8,
            quant_block_size: 100,
            ..LoraConfig::default()
        };
        int8.validate().unwrap();
        assert_eq!(int8.base_quantization.four_bit(), None);
        let block = refused(LoraConfig {
            base_quantization: BaseQuantization::Fp4,
            quant_block_size: 100,
            ..LoraConfig::default()
        });
        assert!(
            block.contains("lora.quant_block_size must be a power of two"),
            "{block}"
        );
        // Merged weights of a quantized base are its dequantized weights plus B A.
        LoraConfig {
            base_quantization: BaseQuantization::Nf4,
            merge_on_save: true,
            ..LoraConfig::default()
        }
        .validate()
        .unwrap();
        // A block size is only checked where it is used.
        LoraConfig {
            quant_block_size: 100,
            ..LoraConfig::default()
        }
        .validate()
        .unwrap();
        let unknown = toml::from_str::<LoraConfig>("base_quantization = \"nf5\"")
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("nf4"), "{unknown}");
    }

    #[test]
    fn targets_and_scale() {
        let config = LoraConfig {
            rank: 4,
            alpha: 8.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            ..LoraConfig::default()
        };
        assert!(config.targets("q_proj") && !config.targets("k_proj"));
        assert_eq!(config.targeted(), vec!["q_proj", "v_proj"]);
        assert_eq!(config.scale(), 2.0);
        assert_eq!(
            LoraConfig {
                use_rslora: true,
                ..config
            }
            .scale(),
            4.0
        );
        let all = LoraConfig {
            target_modules: vec!["all-linear".into()],
            ..LoraConfig::default()
        };
        assert_eq!(all.targeted(), PROJECTIONS.to_vec());
    }

    #[test]
    fn peft_json_round_trips_and_unsupported_settings_are_named() {
        let config = LoraConfig {
            rank: 8,
            alpha: 16.0,
            dropout: 0.05,
            target_modules: vec!["q_proj".into(), "down_proj".into()],
            ..LoraConfig::default()
        };
        let json = config.peft_json("meta-llama/Llama-3.2-1B");
        assert_eq!(LoraConfig::from_peft_json(&json, "a").unwrap(), config);
        for (key, value, expected) in [
            ("use_dora", serde_json::json!(true), "use_dora"),
            ("rank_pattern", serde_json::json!({"q_proj": 4}), "rank_pattern"),
            ("bias", serde_json::json!("all"), "bias"),
            ("modules_to_save", serde_json::json!(["lm_head"]), "modules_to_save"),
            (
                "exclude_modules",
                serde_json::json!(["layers.0.self_attn.q_proj"]),
                "exclude_modules",
            ),
            ("peft_type", serde_json::json!("IA3"), "only LORA"),
            ("r", serde_json::json!(0), "lora.rank"),
            ("target_modules", serde_json::json!(["wq"]), "\"wq\""),
        ] {
            let mut changed = json.clone();
            changed[key] = value;
            let error = LoraConfig::from_peft_json(&changed, "dir/adapter_config.json").unwrap_err();
            let text = error.to_string();
            assert!(
                text.contains(expected) && text.contains("dir/adapter_config.json"),
                "{key}: {text}"
            );
        }
    }

    #[test]
    fn peft_names_map_both_ways() {
        let ours = "model.layers.0.self_attn.q_proj.lora_A.weight";
        assert!(is_adapter(ours) && !is_adapter("model.layers.0.self_attn.q_proj.weight"));
        assert_eq!(from_peft_name(&peft_name(ours)).unwrap(), ours);
        assert_eq!(
            from_peft_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight").unwrap(),
            "model.layers.0.mlp.up_proj.lora_B.weight"
        );
        assert_eq!(from_peft_name("model.layers.0.mlp.up_proj.weight"), None);
    }
}
