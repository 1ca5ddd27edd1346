//! The training run's configuration: what `train.toml` holds, with defaults for every
//! field, checked before anything starts. Pure: parsing and validation only.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::eval::EvalConfig;
use crate::lora::{LoraConfig, Offload, ZeroConfig};
use crate::zero::partition::ZeroStage;

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

impl TrainConfig {
    /// Parses `train.toml` text; unknown keys are errors (a typo never silently falls back
    /// to a default).
    pub fn from_toml(text: &str) -> crate::Result<Self> {
        let config: Self = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every field; the message names the field and the accepted values.
    pub fn validate(&self) -> crate::Result<()> {
        let m = &self.model;
        let o = &self.optimizer;
        let checks: [(bool, String); 16] = [
            (
                (1..=4096).contains(&self.micro_batch_size),
                format!("micro_batch_size must be 1..=4096, not {}", self.micro_batch_size),
            ),
            (
                (1..=4096).contains(&self.gradient_accumulation),
                format!(
                    "gradient_accumulation must be 1..=4096, not {}",
                    self.gradient_accumulation
                ),
            ),
            (
                (1..=64).contains(&self.world_size),
                format!("world_size must be 1..=64, not {}", self.world_size),
            ),
            (self.steps >= 1, "steps must be at least 1".into()),
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
                o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr,
                format!("optimizer.min_lr must lie in [0, lr = {}], not {}", o.lr, o.min_lr),
            ),
            (
                o.max_grad_norm.is_finite() && o.max_grad_norm >= 0.0,
                format!(
                    "optimizer.max_grad_norm must be 0 (off) or positive, not {}",
                    o.max_grad_norm
                ),
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
                !self.data.path.is_empty() || self.streaming(),
                "data.path (or [[data.sources]]) must name the token dataset".into(),
            ),
        ];
        if !self.model.path.is_empty() && self.model.config.is_some() {
            return Err(Error::Config(
                "model.path and model.config are exclusive: load a model or initialise one from a config".into(),
            ));
        }
        if let Some(config) = &self.model.config {
            crate::hf::LlamaConfig::from_json(config, "model.config")?;
        }
        if let Some((_, message)) = checks.into_iter().find(|(ok, _)| !ok) {
            return Err(Error::Config(message));
        }
        if self.checkpoint.interval == 0 {
            return Err(Error::Config("checkpoint.interval must be at least 1".into()));
        }
        if self.checkpoint.resume && self.checkpoint.dir.is_empty() {
            return Err(Error::Config("checkpoint.resume needs checkpoint.dir".into()));
        }
        for (name, amount) in &self.resources {
            if !amount.is_finite() || *amount < 0.0 {
                return Err(Error::Config(format!(
                    "resources.{name} must be a non-negative number, not {amount}"
                )));
            }
        }
        if let Some(lora) = &self.lora {
            lora.validate()?;
            if self.model.path.is_empty() && self.model.config.is_none() {
                return Err(Error::Config(
                    "[lora] needs a Llama-family model (model.path or model.config); the built-in GPT has no adapters"
                        .into(),
                ));
            }
        }
        if self.zero.offload_params == Offload::Cpu
            && (self.zero_stage != ZeroStage::Three || self.zero.offload_optimizer != Offload::Cpu)
        {
            return Err(Error::Config(
                "zero.offload_params = \"cpu\" needs zero_stage = 3 and zero.offload_optimizer = \"cpu\" (the host's \
                 master weights are the parameters it fetches)"
                    .into(),
            ));
        }
        self.validate_streaming()?;
        self.validate_eval()?;
        self.strategy
            .parse::<regatta_runtime::Strategy>()
            .map_err(|e| Error::Config(format!("strategy: {e}")))?;
        Ok(())
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

    fn validate_eval(&self) -> crate::Result<()> {
        let fail = |m: &str| Err(Error::Config(m.into()));
        let Some(eval) = &self.eval else {
            if self.checkpoint.keep_best {
                return fail("checkpoint.keep_best needs an [eval] section: the best checkpoint is the one that validates lowest");
            }
            return Ok(());
        };
        eval.validate()?;
        if self.checkpoint.keep_best && self.checkpoint.dir.is_empty() {
            return fail("checkpoint.keep_best needs checkpoint.dir");
        }
        if eval.split > 0.0 {
            if self.streaming() {
                return fail(
                    "eval.split holds rows out of data.path; with [[data.sources]] name a validation set in eval.path",
                );
            }
            if !matches!(
                self.data.format.resolve(&self.data.path),
                DataFormat::Jsonl | DataFormat::Parquet
            ) {
                return fail("eval.split holds out rows of a JSONL or Parquet data.path; a text stream has no rows to hold out: name a validation file in eval.path");
            }
        }
        Ok(())
    }

    fn validate_streaming(&self) -> crate::Result<()> {
        let d = &self.data;
        let fail = |m: String| Err(Error::Config(m));
        if !self.streaming() {
            if self.scaling.is_some() {
                return fail(
                    "[scaling] needs the streaming loader ([[data.sources]]): data.path's fixed layout cannot change \
                     its number of ranks"
                        .into(),
                );
            }
            return Ok(());
        }
        if !d.path.is_empty() && d.path != DEFAULT_DATA_PATH {
            return fail("data.path and [[data.sources]] are exclusive: list the file as a source".into());
        }
        if d.format != DataFormat::Auto {
            return fail("data.format applies to data.path; sources go by their files' names".into());
        }
        for (i, source) in d.sources.iter().enumerate() {
            if source.path.is_empty() {
                return fail(format!("data.sources[{i}].path is empty"));
            }
            if !source.weight.is_finite() || source.weight <= 0.0 {
                return fail(format!(
                    "data.sources[{i}].weight must be positive, not {}",
                    source.weight
                ));
            }
        }
        if !(1..=65536).contains(&d.shards) {
            return fail(format!("data.shards must be 1..=65536, not {}", d.shards));
        }
        if d.epochs == Some(0) {
            return fail("data.epochs must be at least 1 (or absent: endless)".into());
        }
        if !(1..=65536).contains(&d.prefetch) {
            return fail(format!("data.prefetch must be 1..=65536 rows, not {}", d.prefetch));
        }
        if self.world_size > d.shards {
            return fail(format!(
                "world_size = {} exceeds data.shards = {}: every rank needs a logical shard",
                self.world_size, d.shards
            ));
        }
        if let Some(s) = &self.scaling {
            if s.min_workers < 1 || s.min_workers > s.max_workers {
                return fail(format!(
                    "scaling.min_workers ({}) must be 1..=max_workers ({})",
                    s.min_workers, s.max_workers
                ));
            }
            if s.max_workers > d.shards.min(64) {
                return fail(format!(
                    "scaling.max_workers = {} exceeds {} (data.shards, at most 64)",
                    s.max_workers,
                    d.shards.min(64)
                ));
            }
            for w in s.min_workers..=s.max_workers {
                self.rescale(w)?;
            }
        }
        Ok(())
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

    #[test]
    fn bad_values_and_typos_are_named() {
        let cases = [
            ("zero_stage = 4", "zero_stage"),
            ("batch_size = 8", "unknown field `batch_size`"),
            ("micro_batch_size = 0", "micro_batch_size must be"),
            ("[optimizer]\nmin_lr = 1.0", "optimizer.min_lr"),
            ("[optimizer]\nschedule = \"step\"", "unknown variant"),
            ("[model]\npath = \"m\"\n[model.config]\nvocab_size = 3", "exclusive"),
            ("[model]\nheads = 5", "model.heads (5) must divide"),
            ("strategy = \"EVERYWHERE\"", "unknown placement strategy"),
            ("zero_stag = 1", "unknown field"),
            ("steps = \"ten\"", "invalid type"),
            ("resources = { CPU = -1 }", "resources.CPU"),
            ("[checkpoint]\nresume = true", "checkpoint.resume needs checkpoint.dir"),
            ("[lora]\nrank = 4", "needs a Llama-family model"),
            ("[model]\npath = \"m\"\n[lora]\nrank = 0", "lora.rank"),
            (
                "[model]\npath = \"m\"\n[lora]\ntarget_modules = [\"c_attn\"]",
                "\"c_attn\" is not a projection",
            ),
            ("[model]\npath = \"m\"\n[lora]\ndropout = 1.5", "lora.dropout"),
            ("[zero]\noffload_optimizer = \"disk\"", "unknown variant"),
            (
                "zero_stage = 2\n[zero]\noffload_optimizer = \"cpu\"\noffload_params = \"cpu\"",
                "needs zero_stage = 3",
            ),
            ("zero_stage = 3\n[zero]\noffload_params = \"cpu\"", "offload_optimizer"),
            ("[eval]\ninterval = 5", "needs path"),
            ("[eval]\nsplit = 0.1", "JSONL or Parquet"),
            (
                "[data]\npath = \"d.jsonl\"\n[eval]\nsplit = 0.1\nmax_rows = 0",
                "eval.max_rows",
            ),
            ("[checkpoint]\ndir = \"c\"\nkeep_best = true", "needs an [eval] section"),
            (
                "[eval]\npath = \"v.jsonl\"\n[checkpoint]\nkeep_best = true",
                "needs checkpoint.dir",
            ),
            ("[logging]\ntensorbord = \"t\"", "unknown field"),
        ];
        for (text, expected) in cases {
            let error = TrainConfig::from_toml(text).unwrap_err();
            assert!(matches!(error, crate::Error::Config(_)), "{text:?}: {error:?}");
            assert!(error.to_string().contains(expected), "{text:?}: {error}");
        }
    }
}
