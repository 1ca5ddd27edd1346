//! `score.toml`: what a scoring run is asked to do, checked field by field, and the
//! sampling defaults and executor setup derived from it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::generate::{GenerationSetup, SamplingParams};
use crate::protocol::AdapterBase;

/// A scoring run: what `score.toml` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoreConfig {
    /// The input (path or URL): JSONL, one `{"id": ..., "text": ...}` per line, or a
    /// Parquet file (name ending in `.parquet`) with `id` and `text` columns.
    pub input: String,
    /// A Hugging Face model folder (Llama, Mistral, Qwen2; local or by URL), a trainer
    /// checkpoint directory (its newest step is used) or one step's directory, or a
    /// TorchScript file (`.pt`, `.ts`, `.torchscript`) mapping token ids
    /// `[batch, time]` to logits `[batch, time, vocab]`.
    pub model: String,
    /// A LoRA adapter applied to `model` without merging: a PEFT folder
    /// (`adapter_config.json` + `adapter_model.safetensors`) or a LoRA training run's
    /// checkpoint directory (its newest step) or step directory. Empty: none.
    pub adapter: String,
    /// How the base under `adapter` is held: `auto` (as the adapter was trained: quantized
    /// for a QLoRA run's checkpoint, or as a base folder bitsandbytes stored in 4 or 8 bits),
    /// `none` (the compute dtype), `nf4` or `fp4` (4 bits in blocks of 64) or `int8`
    /// (LLM.int8's row-wise bytes), dequantized per projection as it is used.
    pub adapter_base: AdapterBase,
    /// With `adapter_base` nf4 or fp4: quantize the absmax values again (8 bits).
    pub double_quant: bool,
    /// Longest token sequence a TorchScript model takes (required for one; a checkpoint
    /// carries its own).
    pub context: usize,
    /// Output directory (path or URL): `part-NNNNN.parquet` per partition, errors files,
    /// `_manifest.json`.
    pub output: String,
    /// A `tokenizer.json` overriding the checkpoint's.
    pub tokenizer: String,
    /// Scorer actors.
    pub actors: usize,
    /// Rows per batch.
    pub batch_size: usize,
    /// Partitions (0: four per actor).
    pub partitions: usize,
    /// Greedy tokens generated per row.
    pub max_new_tokens: usize,
    /// Resources per actor, for example `{ GPU = 1, "accelerator_type:A100" = 1 }`.
    pub resources: BTreeMap<String, f64>,
    /// Attempts per partition before the run fails.
    pub max_attempts: u32,
    /// `auto`, `cpu` or `cuda`.
    pub device: String,
    /// libtorch threads per actor on CPU.
    pub threads: usize,
    /// Generate a continuation of each row's `prompt`, `text` or chat `messages` (with the
    /// KV cache and continuous batching) instead of scoring `text`.
    pub generate: bool,
    /// Generation: 0 is greedy; above 0 samples with the logits divided by it.
    pub temperature: f64,
    /// Generation: nucleus sampling's probability mass (1: off).
    pub top_p: f64,
    /// Generation: only the k most likely tokens (0: off).
    pub top_k: usize,
    /// Generation: the seed of every row's random stream (mixed with the row's id).
    pub seed: u64,
    /// Generation: strings that end a row's text.
    pub stop: Vec<String>,
    /// Generation: return each token's log-probability.
    pub logprobs: bool,
    /// Generation: sequences decoded together per actor.
    pub max_batch: usize,
    /// Generation: the KV cache's budget per actor, in MiB; unset: each executor takes a
    /// share of the memory it finds free ([`crate::generate::auto_kv_cache_bytes`]).
    pub kv_cache_mb: Option<u64>,
    /// Generation: prompt tokens prefilled per step (longer prompts take several steps).
    pub prefill_tokens: usize,
    /// Generation: rows share the KV cache blocks of a common prefix (a system prompt, a
    /// few-shot header) instead of computing them again.
    pub prefix_caching: bool,
    /// Generation: on CUDA, each decode step's batch shape is captured once as a CUDA graph
    /// and replayed; off, every step launches its kernels one by one.
    pub cuda_graphs: bool,
    /// Generation: on the CPU, float32 weights are reordered once into oneDNN's blocked
    /// layout and multiplied by oneDNN (a second copy of the weights in memory); off,
    /// libtorch's own `linear`.
    pub packed_weights: bool,
}

/// Tokens generated per row when generating and `max_new_tokens` is not set.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 256;

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            input: String::new(),
            model: String::new(),
            adapter: String::new(),
            adapter_base: AdapterBase::Auto,
            double_quant: false,
            context: 0,
            output: String::new(),
            tokenizer: String::new(),
            actors: 2,
            batch_size: 32,
            partitions: 0,
            max_new_tokens: 0,
            resources: BTreeMap::from([("CPU".to_string(), 1.0)]),
            max_attempts: 3,
            device: "auto".into(),
            threads: 1,
            generate: false,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            stop: Vec::new(),
            logprobs: false,
            max_batch: 32,
            kv_cache_mb: None,
            prefill_tokens: 512,
            prefix_caching: true,
            cuda_graphs: true,
            packed_weights: true,
        }
    }
}

impl ScoreConfig {
    /// Parses `score.toml`; unknown keys are errors.
    pub fn from_toml(text: &str) -> Result<Self> {
        let config: Self = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        Ok(config)
    }

    /// The model, and the adapter applied to it when there is one (what the output's
    /// plan and manifest record).
    pub fn model_and_adapter(&self) -> String {
        if self.adapter.is_empty() {
            self.model.clone()
        } else {
            format!("{} + adapter {}", self.model, self.adapter)
        }
    }

    /// Checks the fields.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in [("input", &self.input), ("model", &self.model), ("output", &self.output)] {
            if value.is_empty() {
                return Err(Error::Config(format!("{name} must be set")));
            }
        }
        if !(1..=1024).contains(&self.actors) {
            return Err(Error::Config(format!("actors must be 1..=1024, not {}", self.actors)));
        }
        if !(1..=65536).contains(&self.batch_size) {
            return Err(Error::Config(format!(
                "batch_size must be 1..=65536, not {}",
                self.batch_size
            )));
        }
        if self.partitions != 0 && self.partitions < self.actors {
            return Err(Error::Config(format!(
                "partitions ({}) must be at least the number of actors ({})",
                self.partitions, self.actors
            )));
        }
        if self.generate && crate::protocol::is_torchscript(&self.model) {
            return Err(Error::Config(
                "generate needs a model folder or checkpoint: a TorchScript module has no KV cache".into(),
            ));
        }
        if !self.adapter.is_empty() && crate::protocol::is_torchscript(&self.model) {
            return Err(Error::Config(
                "adapter needs a Hugging Face model folder or checkpoint as model, not a TorchScript module".into(),
            ));
        }
        if !matches!(self.adapter_base, AdapterBase::Auto | AdapterBase::None) && self.adapter.is_empty() {
            return Err(Error::Config(format!(
                "adapter_base = \"{}\" holds the base under an adapter quantized (QLoRA) and needs `adapter`",
                self.adapter_base.name()
            )));
        }
        if crate::protocol::is_torchscript(&self.model) && !(2..=1 << 20).contains(&self.context) {
            return Err(Error::Config(format!(
                "a TorchScript model needs `context`, the longest token sequence it takes (2 or more; \
                 `regatta-torch-rank export` prints it), not {}",
                self.context
            )));
        }
        if !matches!(self.device.as_str(), "auto" | "cpu" | "cuda") {
            return Err(Error::Config(format!(
                "device must be auto, cpu or cuda, not {:?}",
                self.device
            )));
        }
        if !self.generate {
            if self.max_new_tokens > 4096 {
                return Err(Error::Config("max_new_tokens must be at most 4096".into()));
            }
            return Ok(());
        }
        self.sampling().validate().map_err(|e| Error::Config(e.to_string()))?;
        if !(1..=4096).contains(&self.max_batch) {
            return Err(Error::Config(format!(
                "max_batch must be 1..=4096, not {}",
                self.max_batch
            )));
        }
        if let Some(mb) = self.kv_cache_mb.filter(|mb| !(1..=1 << 20).contains(mb)) {
            return Err(Error::Config(format!("kv_cache_mb must be 1..=1048576, not {mb}")));
        }
        if !(1..=1 << 20).contains(&self.prefill_tokens) {
            return Err(Error::Config(format!(
                "prefill_tokens must be 1..=1048576, not {}",
                self.prefill_tokens
            )));
        }
        Ok(())
    }

    /// The run's sampling defaults (rows may override them with `params`).
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            max_new_tokens: if self.max_new_tokens == 0 {
                DEFAULT_MAX_NEW_TOKENS
            } else {
                self.max_new_tokens
            },
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: self.stop.clone(),
            logprobs: self.logprobs,
        }
    }

    /// The executor's KV cache and batch limits.
    pub fn generation_setup(&self) -> GenerationSetup {
        GenerationSetup {
            kv_cache_bytes: self.kv_cache_mb.map(|mb| mb << 20),
            max_batch: self.max_batch,
            prefill_tokens: self.prefill_tokens,
            prefix_caching: self.prefix_caching,
            cuda_graphs: self.cuda_graphs,
            packed_weights: self.packed_weights,
            ..GenerationSetup::default()
        }
    }

    /// Makes relative local paths absolute against `base`.
    pub fn resolve_paths(&mut self, base: &std::path::Path) {
        for path in [
            &mut self.input,
            &mut self.model,
            &mut self.adapter,
            &mut self.output,
            &mut self.tokenizer,
        ] {
            *path = regatta_object_store::absolute(path, base);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generating_configs_are_checked_with_the_field_named() {
        let base = ScoreConfig {
            input: "rows.jsonl".into(),
            model: "/models/llama".into(),
            output: "/tmp/out".into(),
            generate: true,
            ..ScoreConfig::default()
        };
        base.validate().unwrap();
        assert_eq!(base.sampling().max_new_tokens, DEFAULT_MAX_NEW_TOKENS);
        let parsed = ScoreConfig::from_toml(
            "input = \"a\"\nmodel = \"m\"\noutput = \"o\"\ngenerate = true\ntemperature = 0.7\nstop = [\"\\n\"]\nkv_cache_mb = 64",
        )
        .unwrap();
        assert_eq!(
            (parsed.temperature, parsed.stop.clone(), parsed.kv_cache_mb),
            (0.7, vec!["\n".to_string()], Some(64))
        );
        assert_eq!(parsed.generation_setup().kv_cache_bytes, Some(64 << 20));
        assert_eq!(ScoreConfig::default().generation_setup().kv_cache_bytes, None);
        type Change = fn(&mut ScoreConfig);
        let cases: [(Change, &str); 5] = [
            (|c| c.model = "/m/model.pt".into(), "TorchScript module has no KV cache"),
            (|c| c.temperature = -0.5, "temperature must be"),
            (|c| c.top_p = 2.0, "top_p must be"),
            (|c| c.max_batch = 0, "max_batch must be"),
            (|c| c.kv_cache_mb = Some(0), "kv_cache_mb must be"),
        ];
        for (change, expected) in cases {
            let mut config = base.clone();
            change(&mut config);
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn a_4bit_base_is_asked_by_name_and_only_under_an_adapter() {
        let parsed = ScoreConfig::from_toml(
            "input = \"a\"\nmodel = \"m\"\noutput = \"o\"\nadapter = \"run/ckpt\"\nadapter_base = \"nf4\"\ndouble_quant = true",
        )
        .unwrap();
        assert_eq!((parsed.adapter_base, parsed.double_quant), (AdapterBase::Nf4, true));
        parsed.validate().unwrap();
        assert_eq!(ScoreConfig::default().adapter_base, AdapterBase::Auto);
        let without = ScoreConfig {
            adapter: String::new(),
            ..parsed.clone()
        };
        let error = without.validate().unwrap_err().to_string();
        assert!(
            error.contains("adapter_base = \"nf4\"") && error.contains("needs `adapter`"),
            "{error}"
        );
        let unknown = ScoreConfig::from_toml("adapter_base = \"nf5\"")
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("adapter_base") || unknown.contains("nf5"), "{unknown}");
        assert_eq!("fp4".parse::<AdapterBase>().unwrap(), AdapterBase::Fp4);
        let flag = "int4".parse::<AdapterBase>().unwrap_err().to_string();
        assert!(flag.contains("auto, none, nf4, fp4 or int8, not \"int4\""), "{flag}");
    }
}
