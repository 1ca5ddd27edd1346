//! How an attempt of a training group ends early, for the run to decide what comes next.

/// Why an attempt ended before the run finished.
pub(super) enum AttemptError {
    Lost {
        rank: usize,
        reason: String,
    },
    /// Capacity for more ranks returned (an elastic run restarts larger).
    Grow {
        to: usize,
    },
    Fatal(String),
    Cluster(regatta_runtime::Error),
}
