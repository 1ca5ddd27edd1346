//! LoRA adapters in PEFT's layout, through `object_store`: a folder with
//! `adapter_config.json` and `adapter_model.safetensors` (tensors named
//! `base_model.model.<module>.lora_A.weight` / `lora_B.weight`). Opened adapters are
//! checked against the base model tensor by tensor; [`save`] writes what `peft` loads;
//! [`merge`] writes base + `scale * B A` as a plain Hugging Face folder, one weight shard
//! at a time. The settings themselves (and the name mapping) are pure, in
//! `regatta_trainer::lora`.

use std::collections::HashMap;

use regatta_object_store::Place;
use regatta_scorer::AdapterBase;
use regatta_trainer::LoraConfig;
use regatta_trainer::{from_peft_name, is_adapter, peft_name, BaseQuantization, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use tch::{Kind, Tensor};

use crate::checkpoint::{from_safetensors, latest, step_dir};
use crate::error::{Error, Result};

use crate::model::{Model, ParamSpec};

/// An adapter read from a folder.
pub struct Adapter {
    /// Its settings, from `adapter_config.json`.
    pub config: LoraConfig,
    /// Its tensors by Regatta's names (`model.layers.0.self_attn.q_proj.lora_A.weight`).
    pub tensors: HashMap<String, Tensor>,
    /// The folder.
    pub url: String,
}

impl Adapter {
    /// Opens the adapter at `url`: a PEFT folder, a LoRA checkpoint's step directory, or
    /// a checkpoint directory (its newest step).
    pub async fn open(url: &str) -> Result<Self> {
        let mut place = Place::dir(url)?;
        if let Some(manifest) = latest(&place).await? {
            place = place.child(&step_dir(manifest.step));
        }
        let url = place.url().to_string();
        let config_path = format!("{url}/{ADAPTER_CONFIG}");
        let bytes = place.get_opt(ADAPTER_CONFIG).await?.ok_or_else(|| Error::ModelFile {
            path: url.clone(),
            problem: format!("has no {ADAPTER_CONFIG}: not a LoRA adapter folder (PEFT's save_pretrained layout)"),
        })?;
        let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
            path: config_path.clone(),
            problem: format!("is not valid JSON: {e}"),
        })?;
        let mut config = LoraConfig::from_peft_json(&json, &config_path)?;
        // A LoRA run's step directory records how the run held its base (QLoRA).
        if let Some(bytes) = place.get_opt("manifest.json").await? {
            let manifest: crate::checkpoint::Manifest =
                serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
                    path: format!("{url}/manifest.json"),
                    problem: format!("is not a valid manifest: {e}"),
                })?;
            if let Some(trained) = manifest.lora {
                config.base_quantization = trained.base_quantization;
                config.double_quant = trained.double_quant;
                config.quant_block_size = trained.quant_block_size;
            }
        }
        let weights_path = format!("{url}/{ADAPTER_WEIGHTS}");
        let bytes = place.get_opt(ADAPTER_WEIGHTS).await?.ok_or_else(|| Error::ModelFile {
            path: url.clone(),
            problem: format!("has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}"),
        })?;
        let mut tensors = HashMap::new();
        for (name, tensor) in from_safetensors(&bytes, &weights_path)? {
            let ours = from_peft_name(&name)
                .filter(|n| is_adapter(n))
                .ok_or_else(|| Error::Tensor {
                    path: weights_path.clone(),
                    name: name.clone(),
                    problem: "is not a LoRA tensor (base_model.model.<module>.lora_A.weight or lora_B.weight)".into(),
                })?;
            tensors.insert(ours, tensor.to_kind(Kind::Float));
        }
        Ok(Self { config, tensors, url })
    }

    /// Checks that the adapter holds exactly the tensors `model` (with these adapters set)
    /// expects, with their shapes; the error names the tensor and the expected shape.
    pub fn check(&self, model: &dyn Model) -> Result<()> {
        let path = format!("{}/{ADAPTER_WEIGHTS}", self.url);
        let specs: Vec<ParamSpec> = model
            .blocks()
            .into_iter()
            .flatten()
            .filter(|s| is_adapter(&s.name))
            .collect();
        for spec in &specs {
            let tensor = self.tensors.get(&spec.name).ok_or_else(|| Error::Tensor {
                path: path.clone(),
                name: peft_name(&spec.name),
                problem: format!(
                    "is missing: adapter_config.json targets this module, so shape {:?} is expected (is the adapter for another base model?)",
                    spec.shape
                ),
            })?;
            if tensor.size() != spec.shape {
                return Err(Error::Tensor {
                    path: path.clone(),
                    name: peft_name(&spec.name),
                    problem: format!(
                        "has shape {:?}; r = {} and the base model's projection imply {:?} (wrong rank, or an adapter for another base model)",
                        tensor.size(),
                        self.config.rank,
                        spec.shape
                    ),
                });
            }
        }
        let known: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let mut extra: Vec<&String> = self.tensors.keys().filter(|n| !known.contains(n.as_str())).collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(Error::Tensor {
                path,
                name: peft_name(name),
                problem: format!(
                    "targets a module the base model does not have or adapter_config.json does not list ({} unexpected tensor(s))",
                    extra.len()
                ),
            });
        }
        Ok(())
    }
}

/// Sets how the base under an adapter is held for scoring and generation: `asked`, or
/// with `auto` as the adapter's run held it (its checkpoint's manifest, already in
/// `config`), else as a bitsandbytes base folder stores it (`stored`: the quantization,
/// block size and double quantization, whose codes are then taken as stored), else in the
/// compute dtype.
pub fn hold_base(
    config: &mut LoraConfig,
    asked: AdapterBase,
    double_quant: bool,
    stored: Option<(BaseQuantization, usize, bool)>,
) {
    let explicit = |kind: BaseQuantization, config: &mut LoraConfig| {
        config.base_quantization = kind;
        config.double_quant = double_quant;
        config.quant_block_size = LoraConfig::default().quant_block_size;
    };
    match asked {
        AdapterBase::None => config.base_quantization = BaseQuantization::None,
        AdapterBase::Nf4 => explicit(BaseQuantization::Nf4, config),
        AdapterBase::Fp4 => explicit(BaseQuantization::Fp4, config),
        AdapterBase::Int8 => explicit(BaseQuantization::Int8, config),
        AdapterBase::Auto if config.base_quantization != BaseQuantization::None => {}
        AdapterBase::Auto => {
            if let Some((kind, block, double)) = stored {
                config.base_quantization = kind;
                if kind != BaseQuantization::Int8 {
                    config.quant_block_size = block;
                }
                config.double_quant = double;
            }
        }
    }
}

/// A base weight `name` (`<module>.weight`) plus `scale * B A` when `adapters` (by
/// Regatta's names) hold that module's A and B; other parameters as they are.
pub fn merged_weight(name: &str, mut weight: Tensor, adapters: &HashMap<String, Tensor>, scale: f64) -> Tensor {
    if let Some(module) = name.strip_suffix(".weight") {
        let a = adapters.get(&format!("{module}.lora_A.weight"));
        let b = adapters.get(&format!("{module}.lora_B.weight"));
        if let (Some(a), Some(b)) = (a, b) {
            weight += b.matmul(a) * scale;
        }
    }
    weight
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trained(kind: BaseQuantization, double: bool, block: usize) -> LoraConfig {
        LoraConfig {
            base_quantization: kind,
            double_quant: double,
            quant_block_size: block,
            ..LoraConfig::default()
        }
    }

    fn held(config: &LoraConfig) -> (BaseQuantization, bool, usize) {
        (config.base_quantization, config.double_quant, config.quant_block_size)
    }

    #[test]
    fn the_base_under_an_adapter_is_held_as_asked_or_as_it_was_trained_or_stored() {
        let nf4_folder = Some((BaseQuantization::Nf4, 64, true));
        let fp4_folder = Some((BaseQuantization::Fp4, 128, false));
        let int8_folder = Some((BaseQuantization::Int8, 0, false));
        let cases = [
            // auto: a QLoRA checkpoint's own settings win over the folder's.
            (
                trained(BaseQuantization::Fp4, false, 128),
                AdapterBase::Auto,
                false,
                nf4_folder,
                (BaseQuantization::Fp4, false, 128),
            ),
            // auto on a plain adapter: as the folder stores the base, or float.
            (
                LoraConfig::default(),
                AdapterBase::Auto,
                false,
                fp4_folder,
                (BaseQuantization::Fp4, false, 128),
            ),
            (
                LoraConfig::default(),
                AdapterBase::Auto,
                false,
                int8_folder,
                (BaseQuantization::Int8, false, 64),
            ),
            (
                LoraConfig::default(),
                AdapterBase::Auto,
                true,
                None,
                (BaseQuantization::None, false, 64),
            ),
            // asked: bitsandbytes' block of 64 and the double quantization asked for.
            (
                trained(BaseQuantization::Fp4, false, 128),
                AdapterBase::Nf4,
                true,
                None,
                (BaseQuantization::Nf4, true, 64),
            ),
            (
                LoraConfig::default(),
                AdapterBase::Fp4,
                false,
                nf4_folder,
                (BaseQuantization::Fp4, false, 64),
            ),
            (
                trained(BaseQuantization::Nf4, true, 64),
                AdapterBase::None,
                false,
                nf4_folder,
                (BaseQuantization::None, true, 64),
            ),
        ];
        for (i, (mut config, asked, double, stored, want)) in cases.into_iter().enumerate() {
            hold_base(&mut config, asked, double, stored);
            assert_eq!(held(&config), want, "case {i}");
        }
    }
}
