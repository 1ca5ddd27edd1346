//! Regatta: the cluster runtime ML teams pick over Ray.
//!
//! This facade crate re-exports what a user of the client library needs from the runtime
//! ([`regatta_runtime`]: connecting, actors and their options, objects, placement groups,
//! jobs, the cluster's views; nothing of the head's or a worker's insides) and adds what the
//! `regatta` binary is made of: the built-in actor kinds ([`kinds`]), a local cluster of
//! head and worker processes ([`local::LocalCluster`]) and the command line ([`cli`]).
//!
//! A team with its own actor kinds builds its own worker binary in three lines:
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     let registry = regatta::kinds::builtin(); // .register::<MyActor>()
//!     regatta::cli::main_with(registry)
//! }
//! ```

pub mod bench;
pub mod cli;
pub mod finetune;
pub mod kinds;
pub mod local;
pub mod pipeline;
mod signal;

// The client library: connect, spawn and call actors, move objects, reserve resources.
pub use regatta_runtime::{
    Actor, ActorContext, ActorError, ActorHandle, ActorOptions, ActorPool, CallTiming, Client, Cluster, ObjectId,
    ObjectRef, ObjectStats, PlacementGroup, Registry, Resources, RunReporter, Strategy, DEFAULT_CALL_TIMEOUT,
};
pub use regatta_runtime::{Error, Result};
// What the cluster reports about its actors and nodes.
pub use regatta_runtime::{
    ActorId, ActorLine, ActorState, ActorView, ClusterStatus, DeathCause, GroupStatus, Loss, NodeStatus, View,
    ViewQuery,
};
// Jobs (Ray's job API) and the cluster's trust: join tokens and the authority's hash.
pub use regatta_runtime::{
    default_token_file, fetch_cluster_authority, resolve_token, CaHash, JobClient, JobRecord, JobStatus, JobSubmission,
    JoinCredentials, JoinToken, RuntimeEnv, TokenSource, ADDRESS_ENV, CA_HASH_ENV, DEFAULT_JOB_ADDRESS, TOKEN_ENV,
};
// Python actors (the `regatta` Python package's workers) and the call channel's knobs.
pub use regatta_runtime::{
    CallPath, PythonActor, PythonArgs, CALL_PATH_ENV, FAULT_CORRUPT_ENV, NO_SHARED_MEMORY_ENV, PYTHON_MAX_FRAME,
};
