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

pub mod actor_log;
mod error;
mod fixed;
pub mod head;
pub mod job;
pub mod object;
pub mod placement;
pub mod pool;
pub mod protocol;
pub mod resources;
pub mod runs;
pub mod scheduler;
pub mod view;

pub use error::{Error, Result};
pub use head::{Answer, Change, ChangeRef, HeadCore, Notice, Output, ReplyTo, Saved, Snapshot};
pub use job::{JobRecord, JobStatus, JobSubmission, RuntimeEnv};
pub use object::{Directory, DirectoryStats, Location, MemoryStats, MemoryStore, Missing, NoRoom, ObjectId, Release};
pub use placement::{Allocation, Decision, Ledger, Strategy};
pub use pool::{PoolBook, Seq};
pub use protocol::{
    ActorId, ActorLine, ActorSpec, ActorState, ActorView, BundleRef, ClusterStatus, GroupId, GroupStatus, NodeStatus,
    PendingLine, Registration, RunningActor, StartFailure, RESTART_FOREVER,
};
pub use resources::{format_fixed, Resources, GPU, UNIT};
pub use runs::{RunBook, RunDetail, RunPoint, RunSample, RunSummary};
pub use view::{ActorFilter, ActorRow, NodeRow, Overview, Page, PageRequest, ResourceUse, View, ViewQuery};
