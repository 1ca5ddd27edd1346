//! Regatta's decisions without I/O, as `quinn-proto` is to `quinn`: everything the runtime
//! decides that needs no socket, actor, process or clock — ids, resources, placement, the
//! typed protocol messages, job records and their lifecycle, the object directory and a
//! node's memory store bookkeeping, the actor pool's bookkeeping, the head's scheduler and
//! the head itself as a state machine ([`HeadCore`]). Time comes in as arguments.
//! Its tests are its own and run in seconds; `regatta-runtime` wraps it in actors.
//!
//! ```
//! use regatta_proto::{Resources, Strategy};
//! let need = Resources::parse_request("CPU=1,GPU=1").unwrap();
//! assert_eq!(need.to_string(), "CPU=1,GPU=1");
//! assert_ne!(Strategy::Pack, Strategy::StrictSpread);
//! ```

mod actor_log;
mod error;
mod fixed;
mod head;
pub mod hex;
mod job;
mod object;
mod placement;
mod pool;
mod protocol;
mod resources;
mod runs;
mod scheduler;
mod view;

// The one door: modules are private and this list is everything the crate offers.

pub use error::{Error, Result};
// Resources and placement.
pub use placement::{validate_capacity, Allocation, Decision, Ledger, Strategy};
pub use resources::{format_fixed, Resources, GPU, UNIT};
// The wire between head, agents and clients.
pub use protocol::{
    ActorId, ActorLine, ActorSpec, ActorState, ActorView, AgentRequest, Beat, BundleRef, ClusterStatus, DeathCause,
    Failure, GroupId, GroupSpec, GroupStatus, HeadRequest, HeldObject, Loss, NodeInfo, NodeStatus, ObjectCommand,
    PendingLine, Registration, RunningActor, StartActor, StartFailure, RESTART_FOREVER,
};
// The head as a state machine, what it keeps, and its scheduler's effects.
pub use head::{Answer, Change, ChangeRef, HeadCore, Notice, Output, ReplyTo, Saved, Snapshot};
pub use scheduler::Effect;
// Jobs (Ray's job API records).
pub use job::{
    error_type as job_error_type, finished_beyond, validate_id as validate_job_id, JobRecord, JobStatus, JobSubmission,
    ProcessIdentity, RuntimeEnv, HIDDEN_ENV_VALUE, JOB_ID_ENV, MAX_FINISHED_JOBS, PACKAGE_SCHEME,
};
// Objects: ids, the head's directory, a node's memory store, fan-out of pulls.
pub use object::fanout::DEFAULT_PER_SOURCE as DEFAULT_FANOUT_PER_SOURCE;
pub use object::{Directory, DirectoryStats, Location, MemoryStats, MemoryStore, Missing, NoRoom, ObjectId, Release};
// The actor pool, run metrics, actor logs and the dashboard's views.
pub use actor_log::{ActorLogBook, LogLine};
pub use pool::{PoolBook, Seq};
pub use runs::{RunBook, RunDetail, RunPoint, RunSample, RunSummary};
pub use view::{ActorFilter, ActorRow, NodeRow, Overview, Page, PageRequest, ResourceUse, View, ViewQuery, MAX_PAGE};
