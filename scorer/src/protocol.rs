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

/// How the executor loads its model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScorerSetup {
    /// A trainer checkpoint directory (its newest step) or one step's directory, or a
    /// TorchScript file (see [`is_torchscript`]).
    pub checkpoint: String,
    /// A LoRA adapter folder applied to the model unmerged; empty: none.
    #[serde(default)]
    pub adapter: String,
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
    Scored(Vec<Result<RowScore, String>>),
    /// One result per row of the [`ToScorer::Generate`] with this tag, in order: a
    /// generation or why the row cannot be generated for.
    Generated {
        /// The request's tag.
        tag: u64,
        /// Its rows' results.
        results: Vec<Result<Generation, String>>,
    },
    /// Figures while generating (sent about twice a second).
    Stats(GenStats),
    /// The executor gave up: while loading, or (generating) the model failed a step, and
    /// every request then in flight is lost (the executor starts afresh for the next).
    Failed(String),
}
