//! What passes between a scorer actor (inside a node's agent) and its executor process
//! (`regatta-torch-rank score`, which links libtorch): one JSON object per line on the
//! executor's stdin and stdout. Enums are externally tagged (see docs/NOTES.md).

use serde::{Deserialize, Serialize};

use crate::generate::{GenRequest, GenStats, Generation, GenerationSetup};

/// Whether a model location names a TorchScript file (`.pt`, `.ts` or `.torchscript`)
/// rather than a trainer checkpoint directory.
pub fn is_torchscript(model: &str) -> bool {
    let name = model
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(model)
        .to_ascii_lowercase();
    [".pt", ".ts", ".torchscript"].iter().any(|ext| name.ends_with(ext))
}

/// How the base model under an adapter is held while scoring and generating (QLoRA).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdapterBase {
    /// As the adapter was trained: quantized as a QLoRA run's checkpoint records, else as
    /// a bitsandbytes 4-bit or 8-bit base folder stores it, else in the compute dtype.
    #[default]
    Auto,
    /// In the compute dtype (a 4-bit folder is dequantized once as it is read).
    None,
    /// NormalFloat 4, blocks of 64 (bitsandbytes' `load_in_4bit` defaults).
    Nf4,
    /// bitsandbytes' 4-bit float, blocks of 64.
    Fp4,
    /// LLM.int8's layout: a byte per weight, each row scaled by its absmax.
    Int8,
}

impl AdapterBase {
    /// The setting's value as written in `score.toml`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::None => "none",
            Self::Nf4 => "nf4",
            Self::Fp4 => "fp4",
            Self::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for AdapterBase {
    type Err = crate::Error;

    fn from_str(text: &str) -> crate::Result<Self> {
        [Self::Auto, Self::None, Self::Nf4, Self::Fp4, Self::Int8]
            .into_iter()
            .find(|b| b.name() == text)
            .ok_or_else(|| {
                crate::Error::Config(format!(
                    "adapter_base must be auto, none, nf4, fp4 or int8, not {text:?}"
                ))
            })
    }
}

/// How the executor loads its model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScorerSetup {
    /// A trainer checkpoint directory (its newest step) or one step's directory, or a
    /// TorchScript file (see [`is_torchscript`]).
    pub checkpoint: String,
    /// A LoRA adapter folder applied to the model unmerged; empty: none.
    #[serde(default)]
    pub adapter: String,
    /// How the base under the adapter is held.
    #[serde(default)]
    pub adapter_base: AdapterBase,
    /// With `adapter_base` nf4 or fp4: the absmax values quantized again (8 bits).
    #[serde(default)]
    pub double_quant: bool,
    /// Longest token sequence a TorchScript model takes (checkpoints carry their own).
    pub context: usize,
    /// A `tokenizer.json` overriding the checkpoint's; empty: the checkpoint's own.
    pub tokenizer: String,
    /// `auto`, `cpu` or `cuda`.
    pub device: String,
    /// libtorch threads on CPU.
    pub threads: usize,
    /// Greedy tokens generated per row (0: none).
    pub max_new_tokens: usize,
    /// GPUs granted to the actor.
    pub gpus: Vec<u32>,
    /// Set for a generating run: the KV cache and batch limits.
    #[serde(default)]
    pub generation: Option<GenerationSetup>,
}

/// Agent to executor.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToScorer {
    /// The first line.
    Setup(ScorerSetup),
    /// Rows to score as one batch: (id, text).
    Batch(Vec<(String, String)>),
    /// Rows to generate for, queued behind (and batched with) every row still running;
    /// answered by a [`FromScorer::Generated`] with the same tag once all of them end.
    Generate {
        /// Names the rows' answer (the scorer actor uses the partition's index).
        tag: u64,
        /// The rows.
        rows: Vec<GenRequest>,
    },
}

/// A scored row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowScore {
    /// Tokens scored.
    pub tokens: u64,
    /// Whether the text was cut to the model's context.
    pub truncated: bool,
    /// Sum of token log-probabilities after the first.
    pub log_likelihood: f64,
    /// exp(-log_likelihood / (tokens - 1)).
    pub perplexity: f64,
    /// Greedy continuation.
    pub generated: String,
}

/// Why the executor could not score or generate for one row: the row goes to the
/// partition's errors file with this reason, and the other rows go on. On the wire it is
/// the message alone (a JSON string).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(transparent)]
#[error("{message}")]
pub struct RowFailure {
    /// What is wrong with the row, for people.
    pub message: String,
}

impl RowFailure {
    /// A row's failure, saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// Executor to agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FromScorer {
    /// The model is loaded.
    Ready {
        /// Parameters.
        params: u64,
        /// `cpu` or `cuda`.
        device: String,
        /// Generating: the KV cache budget in bytes (the set one, or what the executor
        /// decided from the memory it found free).
        #[serde(default)]
        kv_cache_bytes: Option<u64>,
    },
    /// One result per row of the batch, in order: a score or why the row cannot be scored.
    Scored(Vec<Result<RowScore, RowFailure>>),
    /// One result per row of the [`ToScorer::Generate`] with this tag, in order: a
    /// generation or why the row cannot be generated for.
    Generated {
        /// The request's tag.
        tag: u64,
        /// Its rows' results.
        results: Vec<Result<Generation, RowFailure>>,
    },
    /// Figures while generating (sent about twice a second).
    Stats(GenStats),
    /// The executor gave up: while loading, or (generating) the model failed a step, and
    /// every request then in flight is lost (the executor starts afresh for the next).
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_failure_travels_as_its_message_alone() {
        let scored = FromScorer::Scored(vec![Err(RowFailure::new("the text has no tokens"))]);
        let line = serde_json::to_string(&scored).unwrap();
        assert_eq!(line, r#"{"scored":[{"Err":"the text has no tokens"}]}"#);
        assert_eq!(serde_json::from_str::<FromScorer>(&line).unwrap(), scored);
    }
}
