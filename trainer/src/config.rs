//! The training run's configuration: what `train.toml` holds, with defaults for every
//! field, checked before anything starts. Pure: parsing and validation only.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A whole training run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// The built-in GPT model.
    pub model: ModelConfig,
    /// The token dataset.
    pub data: DataConfig,
    /// AdamW.
    pub optimizer: OptimizerConfig,
    /// Checkpoints.
    pub checkpoint: CheckpointConfig,
    /// ZeRO stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
    pub zero_stage: u8,
    /// Ranks.
    pub world_size: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Sequences per step over all ranks (a multiple of `world_size`).
    pub batch_size: usize,
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
}

/// The built-in GPT-style decoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Embedding width.
    pub width: usize,
    /// Attention heads (must divide `width`).
    pub heads: usize,
    /// Context length in tokens.
    pub context: usize,
}

/// The token dataset: a text file, tokenized byte by byte or by a Hugging Face tokenizer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// A local path or an object-store URL (`file://`, `s3://bucket/key`).
    pub path: String,
    /// A Hugging Face `tokenizer.json` (path or URL); empty: bytes are tokens (vocab 256).
    pub tokenizer: String,
}

/// AdamW with decoupled weight decay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Steps over which the learning rate rises linearly from lr/warmup_steps to lr.
    pub warmup_steps: u64,
}

/// Where and how often checkpoints are written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// A local directory or an object-store URL (`s3://bucket/prefix`); empty: no checkpoints.
    pub dir: String,
    /// Steps between checkpoints (the last step always writes one).
    pub interval: u64,
    /// Resume from the newest checkpoint in `dir` when the run starts.
    pub resume: bool,
    /// Also write the initial weights as step 0 when a run starts from scratch (to score
    /// the model before and after training).
    pub initial: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            model: ModelConfig::default(),
            data: DataConfig::default(),
            optimizer: OptimizerConfig::default(),
            checkpoint: CheckpointConfig::default(),
            zero_stage: 2,
            world_size: 2,
            steps: 100,
            batch_size: 8,
            seed: 1234,
            resources: BTreeMap::from([("CPU".to_string(), 1.0)]),
            strategy: "SPREAD".into(),
            max_failures: 2,
            device: "auto".into(),
            threads: 1,
            stall_timeout_secs: 300,
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            layers: 2,
            width: 64,
            heads: 4,
            context: 64,
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            path: "data/corpus.txt".into(),
            tokenizer: String::new(),
        }
    }
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            warmup_steps: 10,
        }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: String::new(),
            interval: 50,
            resume: false,
            initial: false,
        }
    }
}

/// The vocabulary of the byte-level tokenizer.
pub const BYTE_VOCAB: usize = 256;

impl OptimizerConfig {
    /// The learning rate of step `step` (1 for the first).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step >= self.warmup_steps {
            self.lr
        } else {
            self.lr * step.max(1) as f64 / self.warmup_steps as f64
        }
    }
}

impl TrainConfig {
    /// Parses `train.toml` text; unknown keys are errors (a typo never silently falls back
    /// to a default).
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let config: Self = toml::from_str(text).map_err(|e| format!("train config: {e}"))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every field; the message names the field and the accepted values.
    pub fn validate(&self) -> Result<(), String> {
        let m = &self.model;
        let o = &self.optimizer;
        let checks: [(bool, String); 14] = [
            (
                (1..=3).contains(&self.zero_stage),
                format!("zero_stage must be 1, 2 or 3, not {}", self.zero_stage),
            ),
            (
                (1..=64).contains(&self.world_size),
                format!("world_size must be 1..=64, not {}", self.world_size),
            ),
            (self.steps >= 1, "steps must be at least 1".into()),
            (
                self.batch_size >= self.world_size && self.batch_size.is_multiple_of(self.world_size),
                format!(
                    "batch_size ({}) must be a positive multiple of world_size ({})",
                    self.batch_size, self.world_size
                ),
            ),
            (
                (1..=128).contains(&m.layers),
                format!("model.layers must be 1..=128, not {}", m.layers),
            ),
            (
                (1..=65536).contains(&m.width),
                format!("model.width must be 1..=65536, not {}", m.width),
            ),
            (
                m.heads >= 1 && m.width.is_multiple_of(m.heads),
                format!("model.heads ({}) must divide model.width ({})", m.heads, m.width),
            ),
            (
                (2..=65536).contains(&m.context),
                format!("model.context must be 2..=65536, not {}", m.context),
            ),
            (
                o.lr.is_finite() && o.lr > 0.0,
                format!("optimizer.lr must be positive, not {}", o.lr),
            ),
            (
                (0.0..1.0).contains(&o.beta1) && (0.0..1.0).contains(&o.beta2),
                "optimizer.beta1 and beta2 must lie in [0, 1)".into(),
            ),
            (
                o.eps.is_finite() && o.eps > 0.0 && o.weight_decay.is_finite() && o.weight_decay >= 0.0,
                "optimizer.eps must be positive and weight_decay non-negative".into(),
            ),
            (
                matches!(self.device.as_str(), "auto" | "cpu" | "cuda"),
                format!("device must be auto, cpu or cuda, not {:?}", self.device),
            ),
            (
                (1..=256).contains(&self.threads),
                format!("threads must be 1..=256, not {}", self.threads),
            ),
            (
                !self.data.path.is_empty(),
                "data.path must name the token dataset".into(),
            ),
        ];
        if let Some((_, message)) = checks.into_iter().find(|(ok, _)| !ok) {
            return Err(message);
        }
        if self.checkpoint.interval == 0 {
            return Err("checkpoint.interval must be at least 1".into());
        }
        if self.checkpoint.resume && self.checkpoint.dir.is_empty() {
            return Err("checkpoint.resume needs checkpoint.dir".into());
        }
        for (name, amount) in &self.resources {
            if !amount.is_finite() || *amount < 0.0 {
                return Err(format!("resources.{name} must be a non-negative number, not {amount}"));
            }
        }
        self.strategy.parse::<regatta_runtime::Strategy>()?;
        Ok(())
    }

    /// Makes relative local paths (data, checkpoints) absolute against `base`, so ranks on
    /// any node resolve them the same way. URLs are left alone.
    pub fn resolve_paths(&mut self, base: &std::path::Path) {
        for path in [&mut self.data.path, &mut self.data.tokenizer, &mut self.checkpoint.dir] {
            *path = regatta_object_store::absolute(path, base);
        }
    }

    /// Sequences each rank takes per step.
    pub fn per_rank_batch(&self) -> usize {
        self.batch_size / self.world_size.max(1)
    }

    /// Tokens one step trains on, over all ranks.
    pub fn tokens_per_step(&self) -> u64 {
        (self.batch_size * self.model.context) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_gives_the_defaults() {
        assert_eq!(TrainConfig::from_toml("").unwrap(), TrainConfig::default());
    }

    #[test]
    fn fields_and_sections_parse() {
        let text = r#"
            zero_stage = 3
            world_size = 3
            batch_size = 6
            resources = { GPU = 1, "accelerator_type:H100" = 1 }
            [model]
            layers = 4
            [checkpoint]
            dir = "s3://bucket/run"
            interval = 10
        "#;
        let config = TrainConfig::from_toml(text).unwrap();
        assert_eq!((config.zero_stage, config.world_size, config.model.layers), (3, 3, 4));
        assert_eq!(config.resources["accelerator_type:H100"], 1.0);
        assert_eq!(config.checkpoint.dir, "s3://bucket/run");
        assert_eq!(config.per_rank_batch(), 2);
    }

    #[test]
    fn warmup_rises_linearly_to_the_learning_rate() {
        let o = OptimizerConfig {
            lr: 1.0,
            warmup_steps: 4,
            ..OptimizerConfig::default()
        };
        let rates: Vec<f64> = (1..=6).map(|s| o.lr_at(s)).collect();
        assert_eq!(rates, vec![0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
        assert_eq!(OptimizerConfig { warmup_steps: 0, ..o }.lr_at(1), 1.0);
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
    fn bad_values_and_typos_are_named() {
        let cases = [
            ("zero_stage = 4", "zero_stage"),
            (
                "world_size = 3\nbatch_size = 8",
                "batch_size (8) must be a positive multiple of world_size (3)",
            ),
            ("[model]\nheads = 5", "model.heads (5) must divide"),
            ("strategy = \"EVERYWHERE\"", "unknown placement strategy"),
            ("zero_stag = 1", "unknown field"),
            ("steps = \"ten\"", "invalid type"),
            ("resources = { CPU = -1 }", "resources.CPU"),
            ("[checkpoint]\nresume = true", "checkpoint.resume needs checkpoint.dir"),
        ];
        for (text, expected) in cases {
            let error = TrainConfig::from_toml(text).unwrap_err();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }
}
