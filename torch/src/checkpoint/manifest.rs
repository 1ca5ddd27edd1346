//! A checkpoint's manifest and naming (what a step directory holds, which one is newest)
//! and tensors to and from safetensors bytes: what the checkpoint writer, the resume path
//! and LoRA adapters share.

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::{DataConfig, ModelConfig};
use regatta_trainer::{LoraConfig, ZeroStage};
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{Error, Result};
use crate::hf::encode_safetensors;

/// What a checkpoint holds, besides the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Steps done.
    pub step: u64,
    /// Ranks that wrote it.
    pub world: usize,
    /// ZeRO stage.
    pub zero_stage: ZeroStage,
    /// Model shape.
    pub model: ModelConfig,
    /// Vocabulary.
    pub vocab: usize,
    /// The `tokenizer.json` the run used; empty: bytes.
    #[serde(default)]
    pub tokenizer: String,
    /// Real parameters.
    pub params: u64,
    /// Each rank's loader position (sequences taken from its partition; `data.path` runs).
    pub positions: Vec<u64>,
    /// A streaming run's loader states, one file per rank (its shards' cursors).
    #[serde(default)]
    pub loader_files: Vec<String>,
    /// Files, relative to the step directory.
    pub files: Vec<String>,
    /// The dataset the positions index into.
    pub data: DataConfig,
    /// The run's adapters, for a LoRA run (its step directories hold the adapter, not
    /// the base).
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    /// Sequences per rank and micro-batch.
    pub micro_batch_size: usize,
    /// Micro-batches per step.
    pub gradient_accumulation: usize,
    /// The validation loss at this step (`[eval]`, when it validated here).
    #[serde(default)]
    pub eval_loss: Option<f64>,
}

impl Manifest {
    /// Why resuming this checkpoint with `config` would skip or repeat data or fail, if it
    /// would.
    pub fn resume_conflict(&self, config: &regatta_trainer::TrainConfig, vocab: usize) -> Option<String> {
        self.adapters_conflict(config)
            .or_else(|| self.global_batch_conflict(config))
            .or_else(|| self.setting_conflict(config, vocab))
    }

    /// The adapters' shapes and scale: what the saved adapter and optimizer state fit
    /// (dropout and merge_on_save may change).
    fn adapters_conflict(&self, config: &regatta_trainer::TrainConfig) -> Option<String> {
        let adapters = |l: &Option<LoraConfig>| {
            l.as_ref()
                .map(|l| format!("r {}, scale {}, on {}", l.rank, l.scale(), l.targeted().join(", ")))
        };
        let (then, now) = (adapters(&self.lora), adapters(&config.lora));
        if then == now {
            return None;
        }
        let describe = |a: Option<String>| {
            a.map_or("no adapters (full fine-tuning)".to_string(), |a| {
                format!("adapters {a}")
            })
        };
        Some(format!(
            "the checkpoint at step {} holds {}, this run asks for {}: its state would not fit; start a new \
             checkpoint.dir or restore [lora]",
            self.step,
            describe(then),
            describe(now)
        ))
    }

    /// The streaming loader's state is the same on any number of ranks: only the global
    /// batch must stay, or the steps would mean other amounts of data.
    fn global_batch_conflict(&self, config: &regatta_trainer::TrainConfig) -> Option<String> {
        if !config.streaming() {
            return None;
        }
        let global = self.micro_batch_size * self.gradient_accumulation * self.world;
        if global == config.global_batch() {
            return None;
        }
        let allowed = regatta_trainer::stream::allowed_worlds(config.data.shards, global, config.micro_batch_size);
        Some(format!(
            "the checkpoint at step {} trained on global batches of {global} sequences, this run's is {} \
             ({} ranks x {} micro-batches of {}); at micro_batch_size {} the world sizes that keep it are \
             {allowed:?}",
            self.step,
            config.global_batch(),
            config.world_size,
            config.gradient_accumulation,
            config.micro_batch_size,
            config.micro_batch_size
        ))
    }

    /// The first setting that decides what a step trains on and differs (world size and
    /// batch shape only without streaming, whose loader re-splits its shards).
    fn setting_conflict(&self, config: &regatta_trainer::TrainConfig, vocab: usize) -> Option<String> {
        fn differs<T: PartialEq + std::fmt::Debug>(
            what: &'static str,
            then: &T,
            now: &T,
        ) -> Option<(&'static str, String, String)> {
            (then != now).then(|| (what, format!("{then:?}"), format!("{now:?}")))
        }
        let world = if config.streaming() {
            None
        } else {
            differs("world_size", &self.world, &config.world_size)
        };
        let batch = |then: usize, now: usize, what: &'static str| {
            if config.streaming() {
                None
            } else {
                differs(what, &then, &now)
            }
        };
        world
            .or_else(|| differs("zero_stage", &u8::from(self.zero_stage), &u8::from(config.zero_stage)))
            .or_else(|| differs("model", &self.model, &config.model))
            .or_else(|| differs("the vocabulary", &self.vocab, &vocab))
            .or_else(|| differs("data", &order_of(&self.data), &order_of(&config.data)))
            .or_else(|| batch(self.micro_batch_size, config.micro_batch_size, "micro_batch_size"))
            .or_else(|| {
                batch(
                    self.gradient_accumulation,
                    config.gradient_accumulation,
                    "gradient_accumulation",
                )
            })
            .map(|(what, then, now)| {
                format!(
                    "the checkpoint at step {} was written with {what} = {then}, this run has {now}: resuming would \
                 skip or repeat data; start a new checkpoint.dir or restore the setting",
                    self.step
                )
            })
    }
}

/// The data settings that decide what a step trains on (not how far ahead the loader
/// reads, where its ledger goes or how many epochs the run lasts).
fn order_of(data: &DataConfig) -> DataConfig {
    DataConfig {
        prefetch: 0,
        ledger: String::new(),
        epochs: None,
        ..data.clone()
    }
}

/// Where a LoRA checkpoint's merged weights go inside its step directory (`merge_on_save`).
pub const MERGED: &str = "merged";

/// The directory name of a step.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

fn temp_path(tag: &str) -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("regatta-{}-{n}-{tag}", std::process::id()))
}

/// Tensors as safetensors bytes.
pub fn to_safetensors(tensors: &[(String, Tensor)]) -> Result<Bytes> {
    encode_safetensors(tensors)
}

/// Tensors from safetensors bytes (an error, never a panic, on bad bytes).
pub fn from_safetensors(bytes: &[u8], what: &str) -> Result<Vec<(String, Tensor)>> {
    let path = temp_path("read.safetensors");
    std::fs::write(&path, bytes).map_err(|e| Error::Storage(format!("cannot stage {what}: {e}")))?;
    let result = Tensor::read_safetensors(&path).map_err(|e| Error::ModelFile {
        path: what.to_string(),
        problem: format!("is not a valid safetensors file: {e}"),
    });
    let _ = std::fs::remove_file(&path);
    result
}

/// The newest complete checkpoint in `place`, if any.
pub async fn latest(place: &Place) -> Result<Option<Manifest>> {
    pointed(place, "latest").await
}

/// The checkpoint in `place` that validated lowest (`keep_best`), if any.
pub async fn best(place: &Place) -> Result<Option<Manifest>> {
    pointed(place, BEST).await
}

/// The pointer file naming the best checkpoint's step directory (`keep_best`).
pub const BEST: &str = "best";

/// The manifest of the step directory the pointer file `pointer` names.
async fn pointed(place: &Place, pointer: &str) -> Result<Option<Manifest>> {
    let Some(name) = place.get_opt(pointer).await? else {
        return Ok(None);
    };
    let name = String::from_utf8_lossy(&name).trim().to_string();
    let bytes = place.child(&name).get("manifest.json").await?;
    let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
        path: format!("{}/{name}/manifest.json", place.url()),
        problem: format!("is not a valid manifest: {e}"),
    })?;
    Ok(Some(manifest))
}
