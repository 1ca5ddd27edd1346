//! Regatta's cluster runtime: a head and workers that form a cluster over `ractor_cluster`,
//! spawn actors remotely by kind name against resource tags, and survive node loss.
//!
//! Main types:
//! - [`Client`] / [`Cluster`]: a driver's connection; spawn, call, look up and kill actors,
//!   reserve [`PlacementGroup`]s, read the [`ClusterStatus`].
//! - [`Actor`], [`Registry`], [`ActorContext`]: user actor kinds compiled into workers.
//! - [`start_head`] / [`run_worker`]: the two node roles.
//! - [`Resources`], [`Strategy`]: what actors ask for and how bundles spread.
//!
//! ```no_run
//! use regatta_runtime::{ActorOptions, Client, Resources};
//! # use regatta_runtime::{Actor, ActorContext, ActorError};
//! # struct Echo;
//! # impl Actor for Echo {
//! #     const KIND: &'static str = "echo";
//! #     type Args = (); type Request = String; type Reply = String;
//! #     async fn create(_: (), _: &ActorContext) -> Result<Self, ActorError> { Ok(Echo) }
//! #     async fn handle(&mut self, r: String, _: &ActorContext) -> Result<String, ActorError> { Ok(r) }
//! # }
//! # async fn run() -> regatta_runtime::Result<()> {
//! let client = Client::connect("127.0.0.1:6380", "abcdef.0123456789abcdefghijklmnopqrstuv").await?;
//! let options = ActorOptions::new().resources(Resources::parse_request("CPU=1")?);
//! let echo = client.spawn::<Echo>((), options).await?;
//! assert_eq!(echo.call("hi".to_string()).await?, "hi");
//! # Ok(()) }
//! ```

mod client;
pub mod environment;
mod error;
pub mod executor;
mod head;
mod jobs;
mod metrics;
mod net;
mod objects;
mod worker;

pub use client::job_client::{AuthorityView, JobClient, DEFAULT_JOB_ADDRESS};
pub use client::pool::ActorPool;
pub use client::{Actor, ActorContext, ActorError};
pub use client::{ActorHandle, ActorOptions, Client, Cluster, PlacementGroup, DEFAULT_CALL_TIMEOUT};
pub use client::{CallTiming, ObjectRef, RunReporter};
pub use error::{Error, Result};
pub use head::job_manager::{JobConfig, ADDRESS_ENV};
pub use head::{start_head, HeadConfig, RunningHead, HEAD_NODE};
pub use jobs::shim::{supervise_job, ShimArgs, ShimOutcome};
pub use metrics::{metrics, Metrics, SdTarget};
pub use net::calls::{CallPath, CALL_PATH_ENV};
pub use net::https::{fetch_cluster_authority, job_api_client_tls, ApiTls};
pub use net::token::{default_token_file, resolve_token, TokenSource, TOKEN_ENV};
pub use net::trust::{JoinCredentials, CA_HASH_ENV};
/// The node protocol's encoding (for benchmarks and robustness tests).
#[doc(hidden)]
pub use net::wire::{decode as wire_decode, encode as wire_encode};
pub use objects::{ObjectConfig, ObjectStats};
pub use regatta_net::{CaHash, JoinToken};
pub use regatta_net::{FAULT_CORRUPT_ENV, NO_SHARED_MEMORY_ENV};
pub use regatta_object_store::{DirectoryStats, ObjectId};
/// Network pulls of one large object a holder serves at once by default (`--object-fanout`).
pub use regatta_proto::DEFAULT_FANOUT_PER_SOURCE as DEFAULT_OBJECT_FANOUT;
pub use regatta_proto::JOB_ID_ENV;
pub use regatta_proto::{format_fixed, Resources, GPU, UNIT};
pub use regatta_proto::{
    ActorFilter, ActorRow, NodeRow, Overview, Page, PageRequest, ResourceUse, View, ViewQuery, MAX_PAGE,
};
pub use regatta_proto::{
    ActorId, ActorLine, ActorSpec, ActorState, ActorView, BundleRef, ClusterStatus, DeathCause, GroupId, GroupStatus,
    Loss, NodeStatus, PendingLine, RESTART_FOREVER,
};
pub use regatta_proto::{Allocation, Decision, Ledger, Strategy};
pub use regatta_proto::{JobRecord, JobStatus, JobSubmission, ProcessIdentity, RuntimeEnv};
pub use regatta_proto::{PoolBook, Seq};
pub use regatta_proto::{RunDetail, RunPoint, RunSample, RunSummary};
pub use worker::detect::{
    accelerator_tag, accelerator_type, detect_gpus, detect_resources, parse_nvidia_smi, visible_devices, GpuDevice,
    GpuInventory,
};
pub use worker::python::{PythonActor, PythonArgs, MAX_FRAME as PYTHON_MAX_FRAME};
pub use worker::registry::Registry;
pub use worker::simulate::{run_simulated_nodes, simulated_name, SimulatedNodes};
pub use worker::{run_worker, WorkerConfig};

/// The bounded fuzzing's configuration (the `fuzz` test modules): `cases` cases from a fixed
/// seed unless `PROPTEST_RNG_SEED` names one, so that CI runs the same cases every time (a
/// flaky fuzz is a failing test); a developer widens the search with `PROPTEST_RNG_SEED` and
/// `PROPTEST_CASES`.
#[cfg(test)]
pub(crate) fn fuzz_config(cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    let mut config = proptest::test_runner::Config::with_cases(cases);
    if matches!(config.rng_seed, proptest::test_runner::RngSeed::Random) {
        config.rng_seed = proptest::test_runner::RngSeed::Fixed(0x5eed_1e55);
    }
    config
}
