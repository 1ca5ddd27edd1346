//! Checkpoints through `object_store`: a directory per step that is a Hugging Face model
//! folder (`config.json`, weights in `model.safetensors` or shards with
//! `model.safetensors.index.json`, the tokenizer files), plus each rank's optimizer slice
//! (`optim-rank-R-of-N.safetensors`) and `manifest.json`; then `latest` names the
//! directory. Weight shards hold whole blocks; shard i is written by rank i mod N, which
//! gathers its blocks one at a time, so no rank ever holds the whole model (ZeRO-3
//! included). Every rank writes before a barrier, and rank 0 writes the manifest and
//! `latest` after it, so `latest` only ever names a complete checkpoint.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tch::Tensor;
use tokio::runtime::Runtime;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::hf::{encode_safetensors_as, HfModel, ShardPlan, INDEX};
use crate::model::ParamSpec;
use regatta_object_store::Place;
use regatta_trainer::LoraConfig;
use regatta_trainer::{is_adapter, peft_name, ADAPTER_CONFIG, ADAPTER_WEIGHTS};

mod manifest;

pub use manifest::{best, from_safetensors, latest, step_dir, to_safetensors, Manifest, BEST, MERGED};

/// What a checkpoint writes besides the engine's state.
pub struct SaveSpec<'a> {
    /// The manifest (its step names the directory).
    pub manifest: Manifest,
    /// Tokenizer and generation files copied into the folder.
    pub side_files: &'a [(String, Bytes)],
    /// Largest weight shard.
    pub shard_bytes: u64,
    /// This rank's loader state file (streaming runs): name and bytes.
    pub loader: Option<(String, Bytes)>,
    /// The kind the model's weights are written in: the source folder's (a bf16 model's
    /// checkpoint stays bf16; master weights stay f32 in the optimizer shards).
    pub weights_kind: tch::Kind,
}

/// Writes this rank's part of a checkpoint at the engine's current step (a collective:
/// every rank calls it). Returns the step directory's URL. Synchronous: the collectives
/// block on the ring's own runtime, so only the uploads run on `runtime`.
pub fn save(
    runtime: &Runtime,
    place: &Place,
    engine: &mut Engine,
    rank: usize,
    world: usize,
    spec: SaveSpec,
) -> Result<String> {
    let dir = place.child(&step_dir(spec.manifest.step));
    let shard = format!("optim-rank-{rank}-of-{world}.safetensors");
    runtime.block_on(dir.put(&shard, to_safetensors(&engine.optimizer_state())?))?;
    if let Some((name, bytes)) = &spec.loader {
        runtime.block_on(dir.put(name, bytes.clone()))?;
    }
    let lora = engine.model().lora().cloned();
    if let Some(lora) = &lora {
        // The adapter: small, gathered whole; rank 0 writes it in PEFT's layout.
        let adapter = engine.consolidated()?;
        if rank == 0 {
            let base = spec.manifest.model.path.clone();
            for (name, bytes) in adapter_files(lora, &base, &adapter)? {
                runtime.block_on(dir.put(&name, bytes))?;
            }
        }
    }
    let write_weights = lora.as_ref().is_none_or(|l| l.merge_on_save);
    let weights = WeightFiles::new(engine, &dir, lora.is_some(), &spec);
    if write_weights {
        weights.write_shards(runtime, engine, rank, world)?;
    }
    if rank == 0 {
        let weights = write_weights.then_some(&weights);
        if let Some(weights) = weights {
            weights.write_index_and_config(runtime, engine)?;
        }
        for (name, bytes) in spec.side_files {
            runtime.block_on(dir.put(name, bytes.clone()))?;
            if let Some(weights) = weights.filter(|w| w.merged) {
                runtime.block_on(weights.dir.put(name, bytes.clone()))?;
            }
        }
    }
    engine.barrier()?;
    if rank == 0 {
        runtime.block_on(dir.put("manifest.json", json(&spec.manifest)?))?;
        runtime.block_on(place.put("latest", Bytes::from(step_dir(spec.manifest.step))))?;
    }
    Ok(dir.url().to_string())
}

/// Pretty JSON for a checkpoint's files.
fn json(value: &impl Serialize) -> Result<Bytes> {
    serde_json::to_vec_pretty(value)
        .map(Bytes::from)
        .map_err(|e| Error::Invalid(e.to_string()))
}

/// The model's weights as a checkpoint writes them: the folder, the base's blocks and
/// the shard files they go to, and the kind they are written in.
struct WeightFiles {
    dir: Place,
    /// The base's own blocks (a LoRA run's merged weights carry no adapter tensors; a
    /// QLoRA base's projections, which the model holds itself, are in them).
    specs: Vec<Vec<ParamSpec>>,
    plan: ShardPlan,
    kind: tch::Kind,
    /// A LoRA run's: the adapters merged into the base, in a folder of their own.
    merged: bool,
}

impl WeightFiles {
    fn new(engine: &Engine, dir: &Place, merged: bool, spec: &SaveSpec) -> Self {
        let specs: Vec<Vec<ParamSpec>> = engine
            .specs()
            .iter()
            .enumerate()
            .map(|(b, block)| {
                block
                    .iter()
                    .filter(|s| !is_adapter(&s.name))
                    .cloned()
                    .chain(engine.model().quantized_block(b))
                    .collect()
            })
            .collect();
        Self {
            // `transformers` would apply an adapter_config.json beside merged weights a
            // second time.
            dir: if merged { dir.child(MERGED) } else { dir.clone() },
            plan: ShardPlan::new(&specs, spec.shard_bytes),
            specs,
            kind: spec.weights_kind,
            merged,
        }
    }

    /// Gathers every block (a collective) and writes the shards this rank owns (shard i:
    /// rank i mod `world`), holding one shard's blocks at a time.
    fn write_shards(&self, runtime: &Runtime, engine: &mut Engine, rank: usize, world: usize) -> Result<()> {
        for (i, (file, blocks)) in self.plan.files.iter().enumerate() {
            let owner = i % world;
            let mut tensors = Vec::new();
            for &block in blocks {
                let gathered = if self.merged {
                    engine.merged_block(block)?
                } else {
                    engine.gather_block(block)?
                };
                if rank == owner {
                    tensors.extend(gathered);
                }
            }
            if rank == owner {
                runtime.block_on(self.dir.put(file, encode_safetensors_as(&tensors, self.kind)?))?;
            }
        }
        Ok(())
    }

    /// Rank 0's part: the shards' index (when there are several) and `config.json`.
    fn write_index_and_config(&self, runtime: &Runtime, engine: &Engine) -> Result<()> {
        if self.plan.files.len() > 1 {
            runtime.block_on(self.dir.put(INDEX, json(&self.plan.index_as(&self.specs, self.kind))?))?;
        }
        runtime.block_on(
            self.dir
                .put("config.json", json(&with_dtype(engine.model().hf_config(), self.kind))?),
        )?;
        Ok(())
    }
}

/// `config.json` naming the dtype its weights are written in (where it names one: the
/// Llama family's does, the built-in GPT's has no such key).
pub fn with_dtype(mut config: serde_json::Value, kind: tch::Kind) -> serde_json::Value {
    if let Some(object) = config.as_object_mut() {
        for key in ["torch_dtype", "dtype"] {
            if let Some(value) = object.get_mut(key) {
                *value = crate::hf::config_dtype(kind).into();
            }
        }
    }
    config
}

/// Loads this rank's optimizer slice from the checkpoint `manifest` describes (a
/// collective: every rank calls it). A checkpoint written by another number of ranks is
/// resharded: each block's flat state is cut from the slices of the ranks that held it.
pub fn restore(
    runtime: &Runtime,
    place: &Place,
    engine: &mut Engine,
    rank: usize,
    world: usize,
    manifest: &Manifest,
) -> Result<()> {
    let dir = place.child(&step_dir(manifest.step));
    let read = |old: usize| -> Result<std::collections::HashMap<String, Tensor>> {
        let name = format!("optim-rank-{old}-of-{}.safetensors", manifest.world);
        let bytes = runtime.block_on(dir.get(&name))?;
        Ok(from_safetensors(&bytes, &format!("{}/{name}", dir.url()))?
            .into_iter()
            .collect())
    };
    if manifest.world == world {
        return engine.load_optimizer_state(read(rank)?.into_iter().collect(), manifest.step);
    }
    let mut slices: std::collections::BTreeMap<usize, std::collections::HashMap<String, Tensor>> = Default::default();
    let mut tensors = Vec::new();
    for (block, numel) in engine.trained_numels().into_iter().enumerate().filter(|(_, n)| *n > 0) {
        let pieces = regatta_trainer::reshard(numel, manifest.world, world, rank);
        let len = regatta_trainer::FlatLayout::new(&[(String::new(), numel)], world).shard_len();
        for name in ["master", "exp_avg", "exp_avg_sq"] {
            let key = format!("block{block}.{name}");
            let out = Tensor::zeros([len as i64], (tch::Kind::Float, tch::Device::Cpu));
            for (old, from, to) in &pieces {
                if !slices.contains_key(old) {
                    slices.insert(*old, read(*old)?);
                }
                let source = slices[old]
                    .get(&key)
                    .ok_or_else(|| Error::Invalid(format!("optim-rank-{old}-of-{} has no {key}", manifest.world)))?;
                if (source.size()[0] as usize) < from.end {
                    return Err(Error::Invalid(format!(
                        "{key} of optim-rank-{old}-of-{} holds {} elements, the model needs {}",
                        manifest.world,
                        source.size()[0],
                        from.end
                    )));
                }
                out.narrow(0, to.start as i64, to.len() as i64).copy_(
                    &source
                        .narrow(0, from.start as i64, from.len() as i64)
                        .to_kind(tch::Kind::Float),
                );
            }
            tensors.push((key, out));
        }
    }
    engine.load_optimizer_state(tensors, manifest.step)
}

/// The loader state of a streaming run's checkpoint: every rank's shards joined, and
/// the shard each rank took its last row from (by the rank that wrote it).
pub fn loader_state(
    runtime: &Runtime,
    place: &Place,
    manifest: &Manifest,
    plan: &regatta_trainer::stream::DataPlan,
) -> Result<(regatta_trainer::stream::LoaderState, Vec<Option<usize>>)> {
    let dir = place.child(&step_dir(manifest.step));
    if manifest.loader_files.is_empty() {
        return Err(Error::Dataset(format!(
            "the checkpoint at step {} holds no streaming loader state (it was written by a data.path run)",
            manifest.step
        )));
    }
    let mut parts = Vec::with_capacity(manifest.loader_files.len());
    let mut lasts = Vec::with_capacity(manifest.loader_files.len());
    let mut fingerprint = None;
    for name in &manifest.loader_files {
        let bytes = runtime.block_on(dir.get(name))?;
        let saved: SavedShards = serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
            path: format!("{}/{name}", dir.url()),
            problem: format!("is not a loader state: {e}"),
        })?;
        fingerprint.get_or_insert(saved.fingerprint);
        parts.push(saved.shards);
        lasts.push(saved.last_shard);
    }
    let state = regatta_trainer::stream::merge_states(fingerprint.unwrap_or(plan.fingerprint), plan.shards, parts)?;
    Ok((state, lasts))
}

/// What one rank of a streaming run saves: its shards' states.
#[derive(Serialize, Deserialize)]
pub struct SavedShards {
    /// The dataset's fingerprint.
    pub fingerprint: u64,
    /// Shard index and state.
    pub shards: Vec<(usize, regatta_trainer::stream::ShardState)>,
    /// The shard the rank took its last row from.
    #[serde(default)]
    pub last_shard: Option<usize>,
}

/// The file a rank's loader state goes to.
pub fn loader_file(rank: usize, world: usize) -> String {
    format!("loader-rank-{rank}-of-{world}.json")
}

/// Opens a model folder: a Hugging Face folder, a checkpoint's step directory, or a
/// checkpoint directory (its newest step); or a GGUF file. Returns the manifest when there
/// is one.
pub async fn open_model(url: &str) -> Result<(Option<Manifest>, HfModel)> {
    if crate::hf::is_gguf(url) {
        return Ok((None, HfModel::open(url).await?));
    }
    let mut place = Place::dir(url)?;
    let mut manifest = latest(&place).await?;
    match &manifest {
        Some(m) => place = place.child(&step_dir(m.step)),
        None => {
            manifest = match place.get_opt("manifest.json").await? {
                Some(bytes) => serde_json::from_slice(&bytes).ok(),
                None => None,
            }
        }
    }
    let has_config = |place: Place| async move { place.get_opt("config.json").await.map_err(Error::from) };
    if has_config(place.clone()).await?.is_none() && has_config(place.child(MERGED)).await?.is_some() {
        // A LoRA checkpoint with merged weights.
        place = place.child(MERGED);
    }
    if has_config(place.clone()).await?.is_none() && place.get_opt(ADAPTER_CONFIG).await?.is_some() {
        return Err(Error::ModelFile {
            path: place.url().to_string(),
            problem: "holds a LoRA adapter, not a model: score it with --model BASE --adapter THIS_FOLDER, or write \
                      merged weights with `regatta-torch-rank merge BASE THIS_FOLDER OUT` (or [lora] merge_on_save)"
                .into(),
        });
    }
    Ok((manifest, HfModel::open(place.url()).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use regatta_trainer::{LoraConfig, TrainConfig};

    fn manifest(config: &TrainConfig) -> Manifest {
        Manifest {
            step: 7,
            world: config.world_size,
            zero_stage: config.zero_stage,
            model: config.model.clone(),
            vocab: 256,
            tokenizer: String::new(),
            params: 1,
            positions: vec![28; config.world_size],
            loader_files: Vec::new(),
            files: Vec::new(),
            data: config.data.clone(),
            lora: None,
            micro_batch_size: config.micro_batch_size,
            gradient_accumulation: config.gradient_accumulation,
            eval_loss: None,
        }
    }

    #[test]
    fn a_resume_that_would_skip_or_repeat_data_is_refused_with_the_setting() {
        let config = TrainConfig::default();
        let written = manifest(&config);
        assert_eq!(written.resume_conflict(&config, 256), None);
        type Change = (&'static str, fn(&mut TrainConfig));
        let changes: [Change; 6] = [
            (
                "holds no adapters (full fine-tuning), this run asks for adapters r 16",
                |c| c.lora = Some(LoraConfig::default()),
            ),
            ("world_size = 2, this run has 3", |c| c.world_size = 3),
            ("micro_batch_size = 4, this run has 8", |c| c.micro_batch_size = 8),
            ("gradient_accumulation", |c| c.gradient_accumulation = 2),
            ("data", |c| c.data.path = "other.txt".into()),
            ("zero_stage = 2, this run has 3", |c| {
                c.zero_stage = regatta_trainer::ZeroStage::Three
            }),
        ];
        for (expected, change) in changes {
            let mut changed = config.clone();
            change(&mut changed);
            let reason = written.resume_conflict(&changed, 256).unwrap();
            assert!(reason.contains(expected) && reason.contains("step 7"), "{reason}");
        }
        assert!(written
            .resume_conflict(&config, 512)
            .unwrap()
            .contains("the vocabulary"));
    }
}

/// The adapter's tensors in PEFT's names, with `adapter_config.json`, as bytes to write.
pub fn adapter_files(config: &LoraConfig, base: &str, tensors: &[(String, Tensor)]) -> Result<Vec<(String, Bytes)>> {
    let renamed: Vec<(String, Tensor)> = tensors
        .iter()
        .filter(|(name, _)| is_adapter(name))
        .map(|(name, t)| (peft_name(name), t.shallow_clone()))
        .collect();
    let json = serde_json::to_vec_pretty(&config.peft_json(base)).map_err(|e| Error::Invalid(e.to_string()))?;
    Ok(vec![
        (ADAPTER_CONFIG.to_string(), Bytes::from(json)),
        (ADAPTER_WEIGHTS.to_string(), to_safetensors(&renamed)?),
    ])
}
