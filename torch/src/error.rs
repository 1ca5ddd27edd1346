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
    Config(#[from] regatta_trainer::HfConfigError),
    /// Reading or writing through `object_store` failed.
    #[error("storage: {0}")]
    Storage(String),
    /// libtorch refused an operation.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A collective with the other ranks failed (a lost peer).
    #[error("collective: {0}")]
    Collective(String),
    /// A training or checkpoint invariant does not hold.
    #[error("{0}")]
    Invalid(String),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Whether a retry with the same inputs may succeed (a lost peer or storage hiccup).
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Collective(_) | Self::Storage(_))
    }
}
