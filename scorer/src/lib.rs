//! Regatta's scorer: an actor pool that partitions datasets by rank and scores them in
//! batches, exactly once.
//!
//! Not built yet: see the scorer issue.
