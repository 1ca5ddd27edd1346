//! The one error type of `regatta-scorer`.

/// What went wrong while scoring a dataset.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `score.toml` field or a CLI option is missing or out of range; the text names it.
    #[error("score config: {0}")]
    Config(String),
    /// The input file cannot be read as JSONL or Parquet rows.
    #[error("{0}")]
    Input(String),
    /// The output folder cannot be written, or holds another run's outputs.
    #[error("{0}")]
    Output(String),
    /// The scorer executor process could not start, load its model or answer.
    #[error("{0}")]
    Executor(String),
    /// A file or directory (local or S3) could not be opened, read or written.
    #[error("storage: {0}")]
    Place(#[from] regatta_object_store::PlaceError),
    /// The run could not finish: partitions kept failing or every actor died.
    #[error("{0}")]
    Run(String),
    /// A Parquet file could not be written or read.
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    /// A record could not be encoded as JSON.
    #[error("cannot encode JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The cluster refused something (spawn, status).
    #[error(transparent)]
    Cluster(#[from] regatta_runtime::Error),
    /// A sampling setting (the run's, or a row's `params`) asks for more tokens than a row
    /// may generate, or none.
    #[error("max_new_tokens must be 1..={limit}, not {asked}")]
    MaxNewTokens {
        /// The count asked for.
        asked: usize,
        /// The most a row may generate.
        limit: usize,
    },
    /// A sampling temperature is negative, above 100 or not a number.
    #[error("temperature must be 0..=100 (0: greedy), not {0}")]
    Temperature(f64),
    /// A nucleus sampling mass is not in (0, 1].
    #[error("top_p must be in (0, 1], not {0}")]
    TopP(f64),
    /// More stop strings than a row may give.
    #[error("at most {limit} stop strings, not {given}")]
    TooManyStops {
        /// The stop strings given.
        given: usize,
        /// The most a row may give.
        limit: usize,
    },
    /// A stop string is empty (it would end every text at once).
    #[error("a stop string is empty")]
    EmptyStop,
    /// A row's `params` names a setting there is none of.
    #[error(
        "`params` has an unknown key `{0}` (known: max_new_tokens, temperature, top_p, top_k, seed, stop, logprobs)"
    )]
    UnknownParam(String),
    /// A row's `params` gives a setting a value of the wrong type.
    #[error("`params`: {0}")]
    ParamType(#[source] serde_json::Error),
    /// A row's `params` is not a JSON object.
    #[error("`params` must be an object, not {0}")]
    ParamsNotObject(serde_json::Value),
    /// A prompt to generate for has no tokens.
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    /// A prompt fills the model's context: no token could be generated after it.
    #[error("the prompt has {length} tokens; the model's context is {context}, so nothing is left to generate")]
    PromptFillsContext {
        /// The prompt's tokens.
        length: usize,
        /// The model's context.
        context: usize,
    },
    /// A sequence at its whole length needs more KV cache blocks than the cache can hold.
    #[error(
        "the sequence needs {tokens} tokens of KV cache ({needed} blocks of {block_tokens}); the cache holds {blocks} blocks: \
         raise the KV cache budget or lower max_new_tokens"
    )]
    CacheTooSmall {
        /// The sequence's whole length, prompt and generation.
        tokens: usize,
        /// The blocks that takes.
        needed: usize,
        /// Token slots per block.
        block_tokens: usize,
        /// The cache's blocks.
        blocks: usize,
    },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
