//! What running a job's driver takes, wherever it runs: its supervisor process (`shim.rs`:
//! `regatta job-shim`, the driver's parent, which keeps its log and records how it ended),
//! capped and rotated logs (`log.rs`), `working_dir`/`py_modules` packages checked against
//! their content address and unpacked (`packages.rs`), and the actor kind that runs a
//! driver on a worker in its reserved resources (`driver.rs`). The head's job manager and
//! the worker both build on it.

pub(crate) mod driver;
pub(crate) mod log;
pub(crate) mod packages;
pub(crate) mod shim;

/// Why a job request was refused, mapped to an HTTP status by the API.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JobError {
    /// 400.
    #[error("{0}")]
    Invalid(String),
    /// 404.
    #[error("{0}")]
    Unknown(String),
    /// 413.
    #[error("{0}")]
    TooLarge(String),
    /// 500.
    #[error("{0}")]
    Internal(String),
}
