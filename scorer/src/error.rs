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
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
