//! The one error type of `regatta-trainer`: what the driver, the rank actors, the ring and
//! the pure parts return. Detailed errors of one concern (a model's `config.json`, a
//! dataset row, a collective) are variants of it, so a caller matches on kinds, never on
//! message text.

use crate::collective::CollectiveError;
use crate::documents::DocumentError;
use crate::hf::HfConfigError;

/// What went wrong in training.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `train.toml` field is missing, mistyped or out of range; the text names it.
    #[error("train config: {0}")]
    Config(String),
    /// A Hugging Face `config.json` (or `[model.config]`) cannot be used.
    #[error(transparent)]
    ModelConfig(#[from] HfConfigError),
    /// A dataset row or chat template cannot be used.
    #[error(transparent)]
    Document(#[from] DocumentError),
    /// The dataset does not fit the run (too small for the ranks, say).
    #[error("dataset: {0}")]
    Dataset(String),
    /// A collective failed (a lost neighbour, wrong buffer sizes).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// The ring link between ranks could not be set up or broke.
    #[error("ring link: {0}")]
    Link(String),
    /// The rank executor binary cannot be found or started.
    #[error("{0}")]
    Executor(String),
    /// The operating system gave no randomness for the ring's secret.
    #[error("no OS randomness for the ring secret: {0}")]
    Secret(String),
    /// The configuration or the data cannot work; nothing was retried.
    #[error("training cannot run: {0}")]
    Fatal(String),
    /// Ranks kept failing.
    #[error("training failed after {failures} restart(s) (max_failures = {max}): rank {rank}: {reason}")]
    TooManyFailures {
        /// Restarts done.
        failures: u32,
        /// The limit.
        max: u32,
        /// The last rank to fail.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// The cluster refused something (placement, spawn).
    #[error(transparent)]
    Cluster(#[from] regatta_runtime::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// The name the driver's API has always used for [`Error`].
pub type TrainError = Error;
