//! The one error type of the pure core: input that does not parse into its typed value.

/// What the pure core refuses, each with the input that caused it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A resource string could not be parsed.
    #[error("bad resource list '{input}': {reason}")]
    BadResources {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A view query (page, filter) that cannot be answered as asked.
    #[error("bad query: {0}")]
    BadQuery(String),
}

/// The pure core's result type.
pub type Result<T> = std::result::Result<T, Error>;
