//! The training run's configuration: what `train.toml` holds, with defaults for every
//! field, checked before anything starts. Pure: parsing and validation only.
//!
//! The sections below the run itself are in `sections.rs`, the checks in `validate.rs`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::eval::EvalConfig;
use crate::lora::{LoraConfig, ZeroConfig};
use crate::zero::partition::ZeroStage;

mod sections;
mod validate;

pub use sections::{
    CheckpointConfig, DataConfig, DataFormat, ModelConfig, OptimizerConfig, ScalingConfig, Schedule, SourceConfig,
    BYTE_VOCAB, DEFAULT_DATA_PATH,
};

/// A whole training run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// The model: a Hugging Face Llama-family folder, a config to initialise one from, or
    /// the built-in GPT.
    pub model: ModelConfig,
    /// The token dataset.
    pub data: DataConfig,
    /// AdamW.
    pub optimizer: OptimizerConfig,
    /// Checkpoints.
    pub checkpoint: CheckpointConfig,
    /// ZeRO stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
    pub zero_stage: ZeroStage,
    /// Ranks.
    pub world_size: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Sequences each rank runs through forward and backward at once.
    pub micro_batch_size: usize,
    /// Micro-batches whose gradients are summed before each optimizer step; the global
    /// batch is `micro_batch_size * gradient_accumulation * world_size` sequences.
    pub gradient_accumulation: usize,
    /// Recompute each block's activations in backward instead of keeping them (always so
    /// at ZeRO stage 3).
    pub activation_checkpointing: bool,
    /// Seed of the initial weights.
    pub seed: u64,
    /// Resources each rank reserves, for example `{ CPU = 1 }` or `{ GPU = 1, "accelerator_type:H100" = 1 }`.
    pub resources: BTreeMap<String, f64>,
    /// Placement of the ranks: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
    pub strategy: String,
    /// Restarts from the last checkpoint after a lost rank before the run fails.
    pub max_failures: u32,
    /// `auto` (CUDA when a GPU was granted), `cpu` or `cuda`.
    pub device: String,
    /// Intra-op threads per rank on CPU.
    pub threads: usize,
    /// Seconds without progress after which a rank counts as failed.
    pub stall_timeout_secs: u64,
    /// `[lora]`: train low-rank adapters on a frozen base; absent: every weight trains.
    pub lora: Option<LoraConfig>,
    /// `[zero]`: optimizer state and parameters offloaded to host memory.
    pub zero: ZeroConfig,
    /// `[scaling]`: an elastic run; absent: exactly `world_size` ranks.
    pub scaling: Option<ScalingConfig>,
    /// `[eval]`: validation during training; absent: none.
    pub eval: Option<EvalConfig>,
    /// `[logging]`: TensorBoard event files.
    pub logging: crate::tensorboard::LoggingConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            model: ModelConfig::default(),
            data: DataConfig::default(),
            optimizer: OptimizerConfig::default(),
            checkpoint: CheckpointConfig::default(),
            zero_stage: ZeroStage::Two,
            world_size: 2,
            steps: 100,
            micro_batch_size: 4,
            gradient_accumulation: 1,
            activation_checkpointing: false,
            seed: 1234,
            resources: BTreeMap::from([("CPU".to_string(), 1.0)]),
            strategy: "SPREAD".into(),
            max_failures: 2,
            device: "auto".into(),
            threads: 1,
            stall_timeout_secs: 300,
            lora: None,
            zero: ZeroConfig::default(),
            scaling: None,
            eval: None,
            logging: Default::default(),
        }
    }
}

/// A QLoRA setting written outside `[lora]` (at the top or in `[model]`), by its place.
fn misplaced_qlora_key(text: &str) -> Option<String> {
    let table: toml::Table = toml::from_str(text).ok()?;
    let keys = ["base_quantization", "double_quant", "quant_block_size"];
    let model = table.get("model").and_then(toml::Value::as_table);
    keys.iter().find_map(|key| {
        if table.contains_key(*key) {
            Some(key.to_string())
        } else {
            model.filter(|m| m.contains_key(*key)).map(|_| format!("model.{key}"))
        }
    })
}

impl TrainConfig {
    /// Parses `train.toml` text; unknown keys are errors (a typo never silently falls back
    /// to a default).
    pub fn from_toml(text: &str) -> crate::Result<Self> {
        let config: Self = toml::from_str(text).map_err(|e| match misplaced_qlora_key(text) {
            Some(key) => Error::Config(format!(
                "{key} is a LoRA setting: QLoRA's base quantization goes in the [lora] section \
                 (base_quantization, double_quant, quant_block_size), with the adapters it trains ({e})"
            )),
            None => Error::Config(e.to_string()),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Makes relative local paths (data, checkpoints) absolute against `base`, so ranks on
    /// any node resolve them the same way. URLs are left alone.
    pub fn resolve_paths(&mut self, base: &std::path::Path) {
        for path in [
            &mut self.data.path,
            &mut self.data.tokenizer,
            &mut self.checkpoint.dir,
            &mut self.model.path,
            &mut self.data.ledger,
            &mut self.logging.tensorboard,
        ] {
            *path = regatta_object_store::absolute(path, base);
        }
        if let Some(path) = self.eval.as_mut().map(|e| &mut e.path) {
            *path = regatta_object_store::absolute(path, base);
        }
        for source in &mut self.data.sources {
            source.path = regatta_object_store::absolute(&source.path, base);
        }
    }

    /// Whether the data comes from the streaming loader (`[[data.sources]]`).
    pub fn streaming(&self) -> bool {
        !self.data.sources.is_empty()
    }

    /// This run on `world` ranks with the same global batch (gradient accumulation
    /// adapts); errors with the world sizes that can keep it.
    pub fn rescale(&self, world: usize) -> crate::Result<Self> {
        if world == self.world_size {
            return Ok(self.clone());
        }
        if !self.streaming() {
            return Err(Error::Config(format!(
                "the run has {} ranks and data.path's layout is fixed by them; use [[data.sources]] (the streaming \
                 loader) to change the number of ranks",
                self.world_size
            )));
        }
        let global = self.global_batch();
        let allowed = crate::stream::allowed_worlds(self.data.shards, global, self.micro_batch_size);
        if !allowed.contains(&world) {
            return Err(Error::Config(format!(
                "{world} ranks cannot keep the global batch of {global} sequences at micro_batch_size {} over \
                 data.shards = {}; allowed world sizes: {allowed:?}",
                self.micro_batch_size, self.data.shards
            )));
        }
        let mut config = self.clone();
        config.gradient_accumulation = global / (self.micro_batch_size * world);
        config.world_size = world;
        Ok(config)
    }

    /// Sequences each rank takes per optimizer step (every micro-batch).
    pub fn per_rank_batch(&self) -> usize {
        self.micro_batch_size * self.gradient_accumulation
    }

    /// Sequences one optimizer step trains on, over all ranks.
    pub fn global_batch(&self) -> usize {
        self.per_rank_batch() * self.world_size
    }

    /// Tokens one step trains on, over all ranks.
    pub fn tokens_per_step(&self) -> u64 {
        (self.global_batch() * self.model.context) as u64
    }

    /// The learning rate of step `step` (1 for the first).
    pub fn lr_at(&self, step: u64) -> f64 {
        self.optimizer.lr_at(step, self.steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::HfConfigError;
    use crate::lora::Offload;

    #[test]
    fn streaming_sources_and_scaling_parse_and_rescale_keeps_the_global_batch() {
        let text = r#"
            world_size = 2
            micro_batch_size = 1
            gradient_accumulation = 3
            [data]
            shards = 12
            epochs = 1
            [[data.sources]]
            path = "s3://corpus/web/"
            weight = 0.7
            [[data.sources]]
            path = "code"
            [scaling]
            min_workers = 1
            max_workers = 3
        "#;
        let mut config = TrainConfig::from_toml(text).unwrap();
        assert!(config.streaming());
        assert_eq!(config.data.sources[1].weight, 1.0);
        assert_eq!(config.scaling.as_ref().unwrap().max_workers, 3);
        config.resolve_paths(std::path::Path::new("/runs"));
        assert_eq!(config.data.sources[1].path, "/runs/code");
        let three = config.rescale(3).unwrap();
        assert_eq!(
            (three.world_size, three.gradient_accumulation, three.global_batch()),
            (3, 2, 6)
        );
        let err = config.rescale(4).unwrap_err().to_string();
        assert!(err.contains("allowed world sizes: [1, 2, 3, 6]"), "{err}");
        let legacy = TrainConfig::default().rescale(3).unwrap_err().to_string();
        assert!(legacy.contains("[[data.sources]]"), "{legacy}");
        let bad = [
            ("[scaling]\nmax_workers = 2", "needs the streaming loader"),
            ("[data]\npath = \"a.txt\"\n[[data.sources]]\npath = \"b\"", "exclusive"),
            ("[[data.sources]]\npath = \"b\"\nweight = 0", "weight must be positive"),
            ("world_size = 5\n[data]\nshards = 4\n[[data.sources]]\npath = \"b\"", "exceeds data.shards = 4"),
            (
                "micro_batch_size = 1\ngradient_accumulation = 2\n[[data.sources]]\npath = \"b\"\n[scaling]\nmin_workers = 2\nmax_workers = 3",
                "allowed world sizes",
            ),
        ];
        for (text, expected) in bad {
            let err = TrainConfig::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn an_empty_file_gives_the_defaults() {
        assert_eq!(TrainConfig::from_toml("").unwrap(), TrainConfig::default());
    }

    #[test]
    fn fields_and_sections_parse() {
        let text = r#"
            zero_stage = 3
            world_size = 3
            micro_batch_size = 2
            resources = { GPU = 1, "accelerator_type:H100" = 1 }
            [model]
            layers = 4
            [checkpoint]
            dir = "s3://bucket/run"
            interval = 10
        "#;
        let config = TrainConfig::from_toml(text).unwrap();
        assert_eq!(
            (config.zero_stage, config.world_size, config.model.layers),
            (ZeroStage::Three, 3, 4)
        );
        assert_eq!(config.resources["accelerator_type:H100"], 1.0);
        assert_eq!(config.checkpoint.dir, "s3://bucket/run");
        assert_eq!((config.per_rank_batch(), config.global_batch()), (2, 6));
    }

    #[test]
    fn every_world_size_works_with_the_defaults() {
        for world in 1..=8 {
            let config = TrainConfig::from_toml(&format!("world_size = {world}")).unwrap();
            assert_eq!(config.global_batch(), 4 * world);
        }
        let config = TrainConfig::from_toml("world_size = 3\ngradient_accumulation = 4").unwrap();
        assert_eq!(config.global_batch(), 48);
    }

    #[test]
    fn a_hugging_face_model_is_named_by_path_or_config() {
        let config = TrainConfig::from_toml("[model]\npath = \"s3://models/llama\"").unwrap();
        assert_eq!(config.model.path, "s3://models/llama");
        let text = r#"
            [model.config]
            architectures = ["Qwen2ForCausalLM"]
            hidden_size = 64
            intermediate_size = 96
            num_hidden_layers = 2
            num_attention_heads = 4
            vocab_size = 300
        "#;
        let config = TrainConfig::from_toml(text).unwrap();
        assert_eq!(config.model.config.as_ref().unwrap()["hidden_size"], 64);
        // Spawn arguments travel as bincode: the inline config must survive it.
        let bytes = bincode::serialize(&config).unwrap();
        assert_eq!(bincode::deserialize::<TrainConfig>(&bytes).unwrap(), config);
        let error = TrainConfig::from_toml(&text.replace("Qwen2", "Gemma")).unwrap_err();
        assert!(
            matches!(&error, crate::Error::ModelConfig(HfConfigError::Architecture { found, .. }) if found == "GemmaForCausalLM"),
            "{error:?}"
        );
        assert!(error.to_string().contains("model.config"), "{error}");
    }

    #[test]
    fn lora_and_offload_sections_parse() {
        let text = r#"
            zero_stage = 3
            [model]
            path = "s3://models/llama"
            [lora]
            rank = 16
            alpha = 32
            dropout = 0.05
            target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            [zero]
            offload_optimizer = "cpu"
            offload_params = "cpu"
        "#;
        let config = TrainConfig::from_toml(text).unwrap();
        let lora = config.lora.as_ref().unwrap();
        assert_eq!((lora.rank, lora.alpha, lora.dropout), (16, 32.0, 0.05));
        assert_eq!(lora.targeted().len(), 7);
        assert_eq!(config.zero.offload_params, Offload::Cpu);
        let bytes = bincode::serialize(&config).unwrap();
        assert_eq!(bincode::deserialize::<TrainConfig>(&bytes).unwrap(), config);
        assert_eq!(TrainConfig::from_toml("").unwrap().lora, None);
    }

    #[test]
    fn relative_paths_become_absolute_and_urls_stay() {
        let mut config = TrainConfig::default();
        config.checkpoint.dir = "s3://bucket/run".into();
        config.resolve_paths(std::path::Path::new("/work"));
        assert_eq!(config.data.path, "/work/data/corpus.txt");
        assert_eq!(config.checkpoint.dir, "s3://bucket/run");
    }

    #[test]
    fn eval_and_logging_sections_parse() {
        let config = TrainConfig::from_toml(
            "[data]\npath = \"d.jsonl\"\n[eval]\nsplit = 0.25\ninterval = 4\n\
             [checkpoint]\ndir = \"c\"\nkeep_best = true\n[logging]\ntensorboard = \"s3://b/tb\"",
        )
        .unwrap();
        let eval = config.eval.clone().unwrap();
        assert_eq!((eval.split, eval.interval, eval.max_rows), (0.25, 4, 256));
        assert!(config.checkpoint.keep_best);
        assert_eq!(config.logging.tensorboard, "s3://b/tb");
        let mut config = TrainConfig::from_toml("[eval]\npath = \"v.jsonl\"\n[logging]\ntensorboard = \"tb\"").unwrap();
        config.resolve_paths(std::path::Path::new("/work"));
        assert_eq!(config.eval.unwrap().path, "/work/v.jsonl");
        assert_eq!(config.logging.tensorboard, "/work/tb");
    }
}
