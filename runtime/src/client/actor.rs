//! What a user actor is: the [`Actor`] trait, its error type and the [`ActorContext`] it
//! runs with (where it is, and the [`Cluster`] it can use).

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::cluster::Cluster;
use regatta_proto::ActorId;
use regatta_proto::Resources;

/// The error a user actor returns; anything that converts into a boxed error works with `?`.
pub type ActorError = Box<dyn std::error::Error + Send + Sync>;

/// A kind of actor the cluster can spawn by name.
///
/// ```
/// use regatta_runtime::{Actor, ActorContext, ActorError};
///
/// struct Counter { total: i64 }
///
/// impl Actor for Counter {
///     const KIND: &'static str = "counter";
///     type Args = i64;
///     type Request = i64;
///     type Reply = i64;
///
///     async fn create(start: i64, _ctx: &ActorContext) -> Result<Self, ActorError> {
///         Ok(Counter { total: start })
///     }
///
///     async fn handle(&mut self, add: i64, _ctx: &ActorContext) -> Result<i64, ActorError> {
///         self.total += add;
///         Ok(self.total)
///     }
/// }
/// ```
pub trait Actor: Send + Sized + 'static {
    /// The name the kind is registered and spawned under.
    const KIND: &'static str;
    /// Constructor arguments.
    type Args: Serialize + DeserializeOwned + Send + 'static;
    /// Messages the actor handles.
    type Request: Serialize + DeserializeOwned + Send + 'static;
    /// Replies to calls.
    type Reply: Serialize + DeserializeOwned + Send + 'static;

    /// Builds the actor; runs again on every restart.
    fn create(args: Self::Args, ctx: &ActorContext) -> impl Future<Output = Result<Self, ActorError>> + Send;

    /// Handles one message; calls and casts both come here, one at a time.
    fn handle(
        &mut self,
        request: Self::Request,
        ctx: &ActorContext,
    ) -> impl Future<Output = Result<Self::Reply, ActorError>> + Send;

    /// How many messages may be in [`Actor::handle_concurrently`] at once (default 1: every
    /// message goes through [`Actor::handle`], in order).
    fn max_concurrency(&self) -> usize {
        1
    }

    /// For an actor with [`Actor::max_concurrency`] above 1: a message's handling that does
    /// not borrow the actor, run beside others (replies go out as each ends). `None` sends
    /// the message to [`Actor::handle`] (after those running end).
    #[allow(clippy::type_complexity)]
    fn handle_concurrently(
        &self,
        _request: Self::Request,
        _ctx: &ActorContext,
    ) -> Option<futures::future::BoxFuture<'static, Result<Self::Reply, ActorError>>> {
        None
    }
}

/// What an actor knows about where it runs.
#[derive(Clone)]
pub struct ActorContext {
    pub(crate) id: ActorId,
    pub(crate) node: String,
    pub(crate) host: String,
    pub(crate) gpu_ids: Vec<u32>,
    pub(crate) resources: Resources,
    pub(crate) name: Option<String>,
    pub(crate) cluster: Cluster,
    pub(crate) logs: LogBook,
}

/// A worker's recent log lines per actor, shared by its agent and the actors it hosts.
pub(crate) type LogBook = std::sync::Arc<std::sync::Mutex<regatta_proto::ActorLogBook>>;

/// Milliseconds since the Unix epoch.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl ActorContext {
    /// Writes `text` to this actor's log: kept on its node (the last 200 lines), shown on
    /// the dashboard's actor page, and logged by the worker process too.
    pub fn log(&self, text: impl AsRef<str>) {
        self.log_marked(text.as_ref(), false);
    }

    /// Writes `text` to this actor's log marked live: written while a call runs, for its
    /// caller to follow as it comes (what a Python driver prints of a long call).
    pub fn log_live(&self, text: impl AsRef<str>) {
        self.log_marked(text.as_ref(), true);
    }

    /// Marks this actor's last `count` log lines live (see [`ActorContext::log_live`]).
    pub fn mark_live(&self, count: usize) {
        if let Ok(mut book) = self.logs.lock() {
            book.mark_live(self.id, count);
        }
    }

    fn log_marked(&self, text: &str, live: bool) {
        tracing::info!(actor = %self.id, "{text}");
        if let Ok(mut book) = self.logs.lock() {
            book.push_marked(self.id, unix_ms(), text, live);
        }
    }

    /// This actor's id.
    pub fn id(&self) -> ActorId {
        self.id
    }

    /// The node it runs on.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The address (host name or IP) its node is reached at, for listeners the actor opens.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The GPU indices granted to it (empty without GPUs). Indices are the node's device
    /// numbers, to be used as `CUDA_VISIBLE_DEVICES` or device ordinals.
    pub fn gpu_ids(&self) -> &[u32] {
        &self.gpu_ids
    }

    /// The resources granted to it.
    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    /// Its name, if spawned with one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The cluster, to spawn, look up and call other actors from inside this one.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
}
