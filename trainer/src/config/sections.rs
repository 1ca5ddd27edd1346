//! The sections of `train.toml` below the run itself: the model, the dataset (a file or
//! weighted streaming sources), elastic scaling, the optimizer and its learning-rate
//! schedule, checkpoints; each with its defaults.

use serde::{Deserialize, Serialize};

/// The model. `path` (a Hugging Face folder, local or by URL) or `config` (a Hugging Face
/// `config.json` as a table: a randomly initialised Llama-family model) choose a
/// Llama-family model; with neither, `layers`, `width` and `heads` shape the built-in GPT.
/// `context` is the training sequence length for every model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// A Hugging Face model folder: `config.json`, `model.safetensors` or shards with
    /// `model.safetensors.index.json`, `tokenizer.json`. Local path or URL (`s3://...`).
    pub path: String,
    /// A Hugging Face `config.json` inline: the model starts from seeded random weights.
    #[serde(with = "inline_json")]
    pub config: Option<serde_json::Value>,
    /// Transformer blocks.
    pub layers: usize,
    /// Embedding width.
    pub width: usize,
    /// Attention heads (must divide `width`).
    pub heads: usize,
    /// Context length in tokens.
    pub context: usize,
}

/// The dataset: a text file (one token stream), or rows of JSONL or Parquet holding
/// `text`, `prompt` + `response`, or chat `messages`, packed into sequences with
/// attention kept inside each row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// A local path or an object-store URL (`file://`, `s3://bucket/key`).
    pub path: String,
    /// A Hugging Face `tokenizer.json` (path or URL); empty: the model folder's, or bytes
    /// are tokens (vocab 256) for the built-in GPT.
    pub tokenizer: String,
    /// How the file is read; `auto` goes by its name (`.jsonl`, `.json`, `.parquet`, else text).
    pub format: DataFormat,
    /// `[[data.sources]]`: the streaming loader over folders or prefixes of JSONL
    /// (plain, `.zst`, `.gz`) and Parquet files, weighted; instead of `path`. Its state is
    /// independent of the world size: a run resumes on any allowed number of ranks.
    pub sources: Vec<SourceConfig>,
    /// Logical shards of the streaming loader (the most ranks a run can have).
    pub shards: usize,
    /// Passes over each source after which the run ends (streaming only); none: sources
    /// repeat, reshuffled, and `steps` ends the run.
    pub epochs: Option<u32>,
    /// Training rows each rank's loader reads ahead in its background thread.
    pub prefetch: usize,
    /// A local folder where each rank appends which documents it trained on at which step
    /// (`step<TAB>document`), for audits of what a run saw.
    pub ledger: String,
}

/// One source of a streaming dataset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceConfig {
    /// A folder, an object-store prefix (`s3://bucket/corpus/web/`) or one file.
    pub path: String,
    /// Its share of the training tokens, relative to the other sources' weights.
    pub weight: f64,
}

impl Default for SourceConfig {
    fn default() -> Self {
        Self {
            path: String::new(),
            weight: 1.0,
        }
    }
}

/// `[scaling]`: an elastic run's range of ranks (as Ray Train's `ScalingConfig`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScalingConfig {
    /// The run starts once this many ranks can be placed, and continues with at least
    /// this many after a loss.
    pub min_workers: usize,
    /// It grows back to at most this many at a checkpoint when capacity returns.
    pub max_workers: usize,
    /// How long a restart waits for a lost rank's replacement before it continues with
    /// fewer ranks.
    pub replacement_timeout_secs: u64,
}

impl Default for ScalingConfig {
    fn default() -> Self {
        Self {
            min_workers: 1,
            max_workers: 1,
            replacement_timeout_secs: 30,
        }
    }
}

/// The default `data.path`, which `[[data.sources]]` replaces.
pub const DEFAULT_DATA_PATH: &str = "data/corpus.txt";

/// How a dataset file is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// By the file's name.
    #[default]
    Auto,
    /// One stream of text, cut into sequences.
    Text,
    /// One JSON object a line.
    Jsonl,
    /// A Parquet file with `text`, `prompt`/`response` or `messages` columns.
    Parquet,
}

impl DataFormat {
    /// The format `path` is read in: `auto` resolved by the name.
    pub fn resolve(self, path: &str) -> Self {
        if self != Self::Auto {
            return self;
        }
        let name = path.rsplit('/').next().unwrap_or(path).to_ascii_lowercase();
        if name.ends_with(".jsonl") || name.ends_with(".json") || name.ends_with(".ndjson") {
            Self::Jsonl
        } else if name.ends_with(".parquet") {
            Self::Parquet
        } else {
            Self::Text
        }
    }
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
    /// After warm-up: `constant`, or `linear` / `cosine` decay to `min_lr` at the last step.
    pub schedule: Schedule,
    /// The floor the schedule decays to.
    pub min_lr: f64,
    /// Gradients are scaled so their global L2 norm (over every rank's shard) is at most
    /// this, as `torch.nn.utils.clip_grad_norm_` defines it; 0 turns clipping off.
    pub max_grad_norm: f64,
}

/// An inline JSON document in a config: a table in TOML and JSON, its JSON text in
/// binary encodings (bincode carries spawn arguments to the ranks and cannot decode a
/// self-describing `serde_json::Value`).
mod inline_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<serde_json::Value>, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            value.serialize(s)
        } else {
            value.as_ref().map(|v| v.to_string()).serialize(s)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
        if d.is_human_readable() {
            Option::<serde_json::Value>::deserialize(d)
        } else {
            Option::<String>::deserialize(d)?
                .map(|text| serde_json::from_str(&text).map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

/// The learning rate after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Stays at `lr`.
    Constant,
    /// Falls linearly to `min_lr`.
    Linear,
    /// Falls along a half cosine to `min_lr`.
    Cosine,
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
    /// Validate at every checkpoint too and keep a `best` pointer (beside `latest`) to the
    /// checkpoint with the lowest validation loss (needs `[eval]`).
    pub keep_best: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: String::new(),
            config: None,
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
            path: DEFAULT_DATA_PATH.into(),
            tokenizer: String::new(),
            format: DataFormat::Auto,
            sources: Vec::new(),
            shards: 64,
            epochs: None,
            prefetch: 64,
            ledger: String::new(),
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
            schedule: Schedule::Cosine,
            min_lr: 3e-4,
            max_grad_norm: 1.0,
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
            keep_best: false,
        }
    }
}

/// The vocabulary of the byte-level tokenizer.
pub const BYTE_VOCAB: usize = 256;

impl OptimizerConfig {
    /// The learning rate of step `step` (1 for the first) of a run of `steps` steps.
    pub fn lr_at(&self, step: u64, steps: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * step.max(1) as f64 / self.warmup_steps as f64;
        }
        let span = steps.saturating_sub(self.warmup_steps);
        if span == 0 {
            return self.lr;
        }
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        let drop = self.lr - self.min_lr;
        match self.schedule {
            Schedule::Constant => self.lr,
            Schedule::Linear => self.lr - drop * progress,
            Schedule::Cosine => self.min_lr + drop * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_rises_linearly_then_decays_to_the_floor() {
        let o = OptimizerConfig {
            lr: 1.0,
            warmup_steps: 4,
            schedule: Schedule::Constant,
            min_lr: 0.0,
            ..OptimizerConfig::default()
        };
        let rates: Vec<f64> = (1..=6).map(|s| o.lr_at(s, 6)).collect();
        assert_eq!(rates, vec![0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
        let linear = OptimizerConfig {
            schedule: Schedule::Linear,
            min_lr: 0.2,
            ..o.clone()
        };
        let rates: Vec<f64> = (4..=8).map(|s| linear.lr_at(s, 8)).collect();
        for (got, want) in rates.iter().zip([1.0, 0.8, 0.6, 0.4, 0.2]) {
            assert!((got - want).abs() < 1e-12, "{rates:?}");
        }
        let cosine = OptimizerConfig {
            schedule: Schedule::Cosine,
            ..linear
        };
        assert!((cosine.lr_at(6, 8) - 0.6).abs() < 1e-12, "halfway is the mean");
        assert!((cosine.lr_at(8, 8) - 0.2).abs() < 1e-12 && cosine.lr_at(9, 8) >= 0.2);
        assert_eq!(OptimizerConfig { warmup_steps: 0, ..o }.lr_at(1, 6), 1.0);
    }
}
