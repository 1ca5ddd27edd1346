//! Validation of a parsed `train.toml`: every field checked before anything starts, the
//! message naming the field and the accepted values.

use super::{DataFormat, TrainConfig, DEFAULT_DATA_PATH};
use crate::error::Error;
use crate::lora::Offload;
use crate::zero::partition::ZeroStage;

impl TrainConfig {
    /// Checks every field; the message names the field and the accepted values.
    pub fn validate(&self) -> crate::Result<()> {
        self.validate_model_source()?;
        if let Some((_, message)) = self.field_checks().into_iter().find(|(ok, _)| !ok) {
            return Err(Error::Config(message));
        }
        self.validate_checkpoint_and_resources()?;
        self.validate_lora_and_offload()?;
        self.validate_streaming()?;
        self.validate_eval()?;
        self.strategy
            .parse::<regatta_runtime::Strategy>()
            .map_err(|e| Error::Config(format!("strategy: {e}")))?;
        Ok(())
    }

    /// `model.path` and `model.config` exclude each other; an inline config must be a
    /// Hugging Face `config.json` of a supported architecture.
    fn validate_model_source(&self) -> crate::Result<()> {
        if !self.model.path.is_empty() && self.model.config.is_some() {
            return Err(Error::Config(
                "model.path and model.config are exclusive: load a model or initialise one from a config".into(),
            ));
        }
        if let Some(config) = &self.model.config {
            crate::hf::LlamaConfig::from_json(config, "model.config")?;
        }
        Ok(())
    }

    /// The ranges of the scalar fields, each with its message, in the order they are
    /// reported.
    fn field_checks(&self) -> [(bool, String); 16] {
        let m = &self.model;
        let o = &self.optimizer;
        [
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
        ]
    }

    fn validate_checkpoint_and_resources(&self) -> crate::Result<()> {
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
        Ok(())
    }

    fn validate_lora_and_offload(&self) -> crate::Result<()> {
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
        Ok(())
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
            // QLoRA asked without [lora]: the setting is named with where it goes.
            (
                "base_quantization = \"nf4\"",
                "base_quantization is a LoRA setting: QLoRA's base quantization goes in the [lora] section",
            ),
            (
                "[model]\npath = \"m\"\ndouble_quant = true",
                "model.double_quant is a LoRA setting",
            ),
        ];
        for (text, expected) in cases {
            let error = TrainConfig::from_toml(text).unwrap_err();
            assert!(matches!(error, crate::Error::Config(_)), "{text:?}: {error:?}");
            assert!(error.to_string().contains(expected), "{text:?}: {error}");
        }
    }
}
