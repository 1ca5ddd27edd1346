//! `regatta-torch-rank merge BASE ADAPTER OUT`: a base model and a LoRA adapter written
//! as one Hugging Face folder.

use bytes::Bytes;
use regatta_object_store::Place;

use crate::error::{Error, Result};
use crate::hf::{HfModel, ShardPlan, INDEX};
use crate::lora::{merged_weight, Adapter};

/// Writes `base` + `adapter` merged (each targeted weight plus `scale * B A`, computed in
/// float32 and written in the base's dtype: a bf16 base gives a bf16 folder) as a Hugging
/// Face folder at `out`, with the base's tokenizer and generation files; one weight shard
/// in memory at a time. An adapter a QLoRA run trained (its manifest records the base's
/// quantization) merges onto the base's dequantized weights, what the run trained against.
/// Returns the files written.
pub async fn merge(base: &HfModel, adapter: &Adapter, out: &str, shard_bytes: u64) -> Result<Vec<String>> {
    let mut model = base.model()?;
    base.check(model.as_ref())?;
    model.set_lora(&adapter.config)?;
    adapter.check(model.as_ref())?;
    // A QLoRA run's adapter merges onto the base as the run held it: dequantized.
    crate::executor::load_quantized(model.as_mut(), base, tch::Device::Cpu).await?;
    let scale = adapter.config.scale();
    let plain = base.model()?;
    let blocks = plain.blocks();
    let place = Place::dir(out)?;
    let plan = ShardPlan::new(&blocks, shard_bytes);
    let kind = base.weights_kind();
    let mut written = Vec::new();
    for (file, members) in &plan.files {
        let mut tensors = Vec::new();
        for &block in members {
            for spec in blocks[block].iter().filter(|s| s.tied_to.is_none()) {
                // Any dtype: merging trains nothing (a bf16 base merges in float32).
                let weight = match model.dequantized(&spec.name) {
                    Some(weight) => weight,
                    None => base.read(spec).await?,
                };
                tensors.push((
                    spec.name.clone(),
                    merged_weight(&spec.name, weight, &adapter.tensors, scale),
                ));
            }
        }
        place
            .put(file, crate::hf::encode_safetensors_as(&tensors, kind)?)
            .await?;
        written.push(file.clone());
    }
    let json = |value: &serde_json::Value| -> Result<Bytes> {
        serde_json::to_vec_pretty(value)
            .map(Bytes::from)
            .map_err(|e| Error::Invalid(e.to_string()))
    };
    if plan.files.len() > 1 {
        place.put(INDEX, json(&plan.index_as(&blocks, kind))?).await?;
        written.push(INDEX.to_string());
    }
    place
        .put(
            "config.json",
            json(&crate::checkpoint::with_dtype(plain.hf_config(), kind))?,
        )
        .await?;
    written.push("config.json".to_string());
    for (name, bytes) in base.side_files().await? {
        place.put(&name, bytes).await?;
        written.push(name);
    }
    Ok(written)
}
