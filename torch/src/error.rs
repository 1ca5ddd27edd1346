//! The one error type of `regatta-torch`.

/// What went wrong in the part of Regatta that links libtorch.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model folder or one of its files cannot be used.
    #[error("{path}: {problem}")]
    ModelFile {
        /// The file (or folder) at fault.
        path: String,
        /// What is wrong with it and what was expected.
        problem: String,
    },
    /// A tensor in a weight file does not fit the model.
    #[error("{path}: tensor {name} {problem}")]
    Tensor {
        /// The weight file.
        path: String,
        /// The tensor.
        name: String,
        /// What is wrong with it and what was expected.
        problem: String,
    },
    /// `config.json` cannot be used.
    #[error(transparent)]
    Config(regatta_trainer::HfConfigError),
    /// Reading or writing through `object_store` failed.
    #[error("storage: {0}")]
    Storage(String),
    /// A file or directory (local or S3) could not be opened, read or written.
    #[error("storage: {0}")]
    Place(#[from] regatta_object_store::PlaceError),
    /// libtorch refused an operation.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A collective with the other ranks failed (a lost peer).
    #[error("collective: {0}")]
    Collective(String),
    /// A collective (or joining the group) was still running past its limit: a rank is
    /// lost, stuck or never started. `text` says which rank and operation.
    #[error("collective: {text}")]
    CollectiveTimeout {
        /// The rank, the operation and the limit, for people.
        text: String,
        /// The limit it ran past.
        limit: std::time::Duration,
    },
    /// A dataset cannot be read or does not fit the run; the text names the file and row.
    #[error("{0}")]
    Dataset(String),
    /// A training setting, model config or dataset row was refused by the trainer's rules.
    #[error(transparent)]
    Trainer(regatta_trainer::Error),
    /// A local file or the async runtime failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A training or checkpoint invariant does not hold.
    #[error("{0}")]
    Invalid(String),
    /// CUDA graphs cannot be loaded, captured or replayed (the engine then decodes eagerly).
    #[error("CUDA graph: {0}")]
    CudaGraph(String),
}

impl From<regatta_trainer::HfConfigError> for Error {
    fn from(error: regatta_trainer::HfConfigError) -> Self {
        Self::Config(error)
    }
}

impl From<regatta_trainer::Error> for Error {
    fn from(error: regatta_trainer::Error) -> Self {
        match error {
            regatta_trainer::Error::ModelConfig(config) => Self::Config(config),
            other => Self::Trainer(other),
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Whether a retry with the same inputs may succeed (a lost peer or storage hiccup).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Collective(_) | Self::CollectiveTimeout { .. } | Self::Storage(_) => true,
            Self::Place(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// What a caught panic said (its `String` or `&str` payload).
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
