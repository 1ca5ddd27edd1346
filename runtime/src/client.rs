//! The client library: connect to a head, spawn and call actors, reserve placement groups.
//!
//! A [`Client`] makes this process a member of the cluster (drivers talk to actors
//! directly, not through the head). [`Cluster`] is the handle drivers and actors share.

use std::marker::PhantomData;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::ActorCell;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::headlink::HeadLink;
use crate::node::{self, LocalNode};
use crate::objects::{ObjectConfig, ObjectService};
use crate::placement::Strategy;
use crate::protocol::{
    ActorId, ActorSpec, ActorState, ActorView, BundleRef, ClusterStatus, Failure, GroupId, GroupSpec, HeadRequest,
};
use crate::registry::Actor;
use crate::resources::Resources;
use crate::wire::{self, CallError};

/// Default time a call waits for its reply.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Options for spawning an actor.
#[derive(Clone, Debug, Default)]
pub struct ActorOptions {
    resources: Resources,
    name: Option<String>,
    max_restarts: u32,
    placement: Option<BundleRef>,
}

impl ActorOptions {
    /// No resources, no name, no restarts.
    pub fn new() -> Self {
        Self::default()
    }

    /// Resources the actor holds, e.g. `Resources::parse_request("GPU=1,accelerator_type:H100")`.
    pub fn resources(mut self, resources: Resources) -> Self {
        self.resources = resources;
        self
    }

    /// A cluster-unique name for [`Cluster::named`].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Restarts after its node or process dies ([`crate::RESTART_FOREVER`] for no limit).
    pub fn max_restarts(mut self, restarts: u32) -> Self {
        self.max_restarts = restarts;
        self
    }

    /// Places the actor in a bundle of a placement group (`None`: any bundle with room).
    pub fn in_group(mut self, group: &PlacementGroup, bundle: Option<usize>) -> Self {
        self.placement = Some(BundleRef {
            group: group.id,
            bundle,
        });
        self
    }
}

/// A handle on the cluster, shared by drivers and by actors (through their context).
#[derive(Clone)]
pub struct Cluster {
    link: Arc<HeadLink>,
    objects: Option<Arc<ObjectService>>,
    call_timeout: Duration,
    job: Option<String>,
}

impl Cluster {
    pub(crate) fn new(link: Arc<HeadLink>, objects: Option<Arc<ObjectService>>) -> Self {
        Self {
            link,
            objects,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            job: None,
        }
    }

    /// The same cluster, with actors and objects created through it belonging to `job`
    /// (they are cleaned up when the job ends).
    pub fn with_job(&self, job: Option<String>) -> Self {
        Self { job, ..self.clone() }
    }

    /// The job actors and objects created through this handle belong to.
    pub fn job(&self) -> Option<&str> {
        self.job.as_deref()
    }

    /// The head's cluster address.
    pub fn head_address(&self) -> &str {
        self.link.address()
    }

    pub(crate) fn scope(&self) -> &str {
        self.link.scope()
    }

    pub(crate) fn object_service(&self) -> Result<&Arc<ObjectService>> {
        self.objects
            .as_ref()
            .ok_or_else(|| Error::Rejected("this connection has no object store (status-only client)".into()))
    }

    /// Sends a request to the head and decodes its reply.
    pub(crate) async fn ask_head<T: DeserializeOwned>(&self, request: &HeadRequest, timeout: Duration) -> Result<T> {
        self.link.ask(request, timeout).await
    }

    /// Spawns an actor of kind `A`. Returns once the head accepted it: an unknown kind or a
    /// request no node could ever hold fails here; a busy cluster makes it wait for resources
    /// (calls wait too, see [`ActorHandle::wait_ready`]).
    pub async fn spawn<A: Actor>(&self, args: A::Args, options: ActorOptions) -> Result<ActorHandle<A>> {
        let spec = ActorSpec {
            kind: A::KIND.to_string(),
            args: wire::encode(&args),
            resources: options.resources,
            name: options.name,
            max_restarts: options.max_restarts,
            placement: options.placement,
            job: self.job.clone(),
        };
        let id: ActorId = self.ask_head(&HeadRequest::Spawn(spec), self.call_timeout).await?;
        Ok(self.handle(id))
    }

    /// Spawns from a raw [`ActorSpec`] (arguments already encoded with bincode), for callers
    /// without the kind's Rust type.
    pub async fn spawn_spec(&self, spec: ActorSpec) -> Result<ActorId> {
        self.ask_head(&HeadRequest::Spawn(spec), self.call_timeout).await
    }

    /// A handle on an existing actor by id (no check until it is used).
    pub fn handle<A: Actor>(&self, id: ActorId) -> ActorHandle<A> {
        ActorHandle {
            id,
            cluster: self.clone(),
            cell: Arc::new(Mutex::new(None)),
            _kind: PhantomData,
        }
    }

    /// Looks up a live named actor.
    pub async fn named<A: Actor>(&self, name: &str) -> Result<Option<ActorHandle<A>>> {
        let view: Option<ActorView> = self
            .ask_head(&HeadRequest::Named(name.to_string()), self.call_timeout)
            .await?;
        match view {
            None => Ok(None),
            Some(view) if view.kind != A::KIND => Err(Error::Rejected(format!(
                "actor '{name}' is of kind '{}', not '{}'",
                view.kind,
                A::KIND
            ))),
            Some(view) => Ok(Some(self.handle(view.id))),
        }
    }

    /// Kills an actor for good (no restart).
    pub async fn kill(&self, id: ActorId) -> Result<()> {
        self.ask_head(&HeadRequest::Kill(id), self.call_timeout).await
    }

    /// Where an actor is and how it is doing.
    pub async fn actor_view(&self, id: ActorId, wait: Duration) -> Result<ActorView> {
        self.ask_head(&HeadRequest::WaitActor(id), wait).await
    }

    /// Reserves bundles of resources, all or nothing. Fails at once if no arrangement could
    /// ever fit; otherwise returns a group that [`PlacementGroup::ready`] waits on.
    pub async fn create_placement_group(&self, bundles: Vec<Resources>, strategy: Strategy) -> Result<PlacementGroup> {
        let spec = GroupSpec {
            bundles,
            strategy,
            name: None,
        };
        let id: GroupId = self
            .ask_head(&HeadRequest::CreateGroup(spec), self.call_timeout)
            .await?;
        Ok(PlacementGroup {
            id,
            cluster: self.clone(),
        })
    }

    /// The whole cluster's state.
    pub async fn status(&self) -> Result<ClusterStatus> {
        self.ask_head(&HeadRequest::Status, self.call_timeout).await
    }

    /// Sends raw bytes as a call to the actor in process group `group` (`head`,
    /// `agent/<node>`, `actor/<id>`) and returns the raw reply, for protocol robustness tests.
    #[doc(hidden)]
    pub async fn send_raw(&self, group: &str, bytes: Vec<u8>) -> std::result::Result<Vec<u8>, String> {
        // The head through the link (its cached actor): a process-group entry can vanish
        // when a duplicate session to the head closes, while the link's actor still runs.
        let target = match group {
            node::HEAD_GROUP => self.link.head().map_err(|e| e.to_string())?,
            _ => node::wait_member(self.scope(), group, Duration::from_secs(5))
                .await
                .ok_or_else(|| format!("no actor in group {group}"))?,
        };
        wire::call_raw(&target, bytes, Duration::from_secs(5))
            .await
            .map_err(|e| match e {
                CallError::Timeout => "timeout".to_string(),
                CallError::Unreachable(c) => c,
            })
    }
}

pub(crate) fn failure_to_error(failure: Failure, actor: Option<ActorId>) -> Error {
    match failure {
        Failure::Infeasible(m) => Error::Infeasible(m),
        Failure::UnknownKind { kind, detail } => Error::UnknownKind { kind, detail },
        Failure::Rejected(m) => Error::Rejected(m),
        Failure::Dead { kind, cause } => Error::ActorDead {
            actor: actor.unwrap_or(ActorId(0)),
            kind,
            cause,
        },
        Failure::Handler(message) => Error::Remote {
            actor: actor.unwrap_or(ActorId(0)),
            message,
        },
        Failure::BadMessage(m) => Error::Decode {
            what: "a message".into(),
            reason: m,
        },
        Failure::ObjectMissing {
            id,
            lost_with: Some(node),
        } => Error::ObjectLost { id, node },
        Failure::ObjectMissing { id, lost_with: None } => Error::ObjectUnknown { id },
    }
}

/// A reserved placement group.
#[derive(Clone)]
pub struct PlacementGroup {
    id: GroupId,
    cluster: Cluster,
}

impl PlacementGroup {
    /// The group's id.
    pub fn id(&self) -> GroupId {
        self.id
    }

    /// Waits until every bundle is reserved; returns the node of each bundle.
    pub async fn ready(&self, timeout: Duration) -> Result<Vec<String>> {
        self.cluster.ask_head(&HeadRequest::WaitGroup(self.id), timeout).await
    }

    /// Removes the group, killing the actors placed in it and freeing its resources.
    pub async fn remove(&self) -> Result<()> {
        self.cluster
            .ask_head(&HeadRequest::RemoveGroup(self.id), self.cluster.call_timeout)
            .await
    }
}

/// A typed handle on an actor of kind `A`, valid across its restarts.
pub struct ActorHandle<A: Actor> {
    id: ActorId,
    cluster: Cluster,
    cell: Arc<Mutex<Option<ActorCell>>>,
    _kind: PhantomData<fn() -> A>,
}

impl<A: Actor> Clone for ActorHandle<A> {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            cluster: self.cluster.clone(),
            cell: self.cell.clone(),
            _kind: PhantomData,
        }
    }
}

impl<A: Actor> ActorHandle<A> {
    /// The actor's id.
    pub fn id(&self) -> ActorId {
        self.id
    }

    /// Calls the actor and waits for its reply (default timeout 30 s). A call in flight when
    /// the actor or its node dies fails with an error; the next call reaches the restarted
    /// actor.
    pub async fn call(&self, request: A::Request) -> Result<A::Reply> {
        self.call_timeout(request, DEFAULT_CALL_TIMEOUT).await
    }

    /// [`ActorHandle::call`] with an explicit timeout covering placement and the reply.
    pub async fn call_timeout(&self, request: A::Request, timeout: Duration) -> Result<A::Reply> {
        let deadline = Instant::now() + timeout;
        let cell = self.resolve(deadline).await?;
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let bytes = match wire::call_raw(&cell, wire::encode(&request), remaining).await {
            Ok(bytes) => bytes,
            Err(CallError::Timeout) => {
                return Err(Error::Timeout {
                    what: format!("call to actor {} ({})", self.id, A::KIND),
                    timeout,
                })
            }
            Err(CallError::Unreachable(cause)) => {
                self.forget();
                return Err(self.explain_lost_call(cause).await);
            }
        };
        let reply: std::result::Result<Vec<u8>, Failure> =
            wire::decode(&bytes, "an actor reply").map_err(|f| failure_to_error(f, Some(self.id)))?;
        let reply = reply.map_err(|f| failure_to_error(f, Some(self.id)))?;
        wire::decode(&reply, &format!("a reply of actor kind '{}'", A::KIND))
            .map_err(|f| failure_to_error(f, Some(self.id)))
    }

    /// Sends a message without waiting for it to be handled.
    pub async fn cast(&self, request: A::Request) -> Result<()> {
        let cell = self.resolve(Instant::now() + DEFAULT_CALL_TIMEOUT).await?;
        wire::cast_raw(&cell, wire::encode(&request)).map_err(|cause| {
            self.forget();
            Error::CallFailed { actor: self.id, cause }
        })
    }

    /// Waits until the actor is alive (placed and constructed).
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        self.resolve(Instant::now() + timeout).await.map(|_| ())
    }

    /// Kills the actor for good.
    pub async fn kill(&self) -> Result<()> {
        self.forget();
        self.cluster.kill(self.id).await
    }

    /// A call that could not complete: say that the actor is dead when it is, else report
    /// the transport failure (the actor may be restarting).
    async fn explain_lost_call(&self, cause: String) -> Error {
        match self
            .cluster
            .ask_head::<ActorView>(&HeadRequest::WaitActor(self.id), Duration::from_millis(200))
            .await
        {
            Ok(ActorView {
                state: ActorState::Dead { cause },
                kind,
                ..
            }) => Error::ActorDead {
                actor: self.id,
                kind,
                cause,
            },
            _ => Error::CallFailed { actor: self.id, cause },
        }
    }

    fn forget(&self) {
        if let Ok(mut cached) = self.cell.lock() {
            *cached = None;
        }
    }

    /// Finds a live cell for the actor: the cached one, else ask the head (waiting while it
    /// is placed or restarted) and then the local mirror of its process group. The head is
    /// asked first so that a killed or dead actor whose host is still stopping is reported
    /// dead rather than reached.
    async fn resolve(&self, deadline: Instant) -> Result<ActorCell> {
        if let Some(cell) = self.cell.lock().ok().and_then(|c| c.clone()) {
            if cell.get_status() == ractor::ActorStatus::Running {
                return Ok(cell);
            }
        }
        let group = node::actor_group(self.id);
        loop {
            let timeout = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let view: ActorView = match self.cluster.actor_view(self.id, timeout).await {
                Ok(view) => view,
                Err(Error::Timeout { .. }) => {
                    return Err(Error::Timeout {
                        what: format!("actor {} ({}) becoming ready", self.id, A::KIND),
                        timeout,
                    })
                }
                Err(e) => return Err(e),
            };
            if view.kind != A::KIND {
                return Err(Error::Rejected(format!(
                    "actor {} is of kind '{}', not '{}'",
                    self.id,
                    view.kind,
                    A::KIND
                )));
            }
            if let ActorState::Dead { cause } = view.state {
                return Err(Error::ActorDead {
                    actor: self.id,
                    kind: view.kind,
                    cause,
                });
            }
            // The head says it is alive; wait for this process to see it, a little at a time:
            // when its node has just died (this process already dropped the node's actors,
            // the head has not yet declared it dead), the next look at the head says so,
            // instead of this call waiting out its whole timeout.
            let remaining = deadline.saturating_duration_since(Instant::now());
            if let Some(cell) = node::wait_member(self.cluster.scope(), &group, remaining.min(REACH_RECHECK)).await {
                return Ok(self.remember(cell));
            }
            // Still not visible here although the head calls it alive: this process's
            // mirror may have missed its membership (seen under load); have its agent
            // advertise it again.
            let _ = self
                .cluster
                .ask_head::<()>(&HeadRequest::Announce(self.id), Duration::from_secs(1))
                .await;
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "actor {} ({}) on node {:?} to become reachable",
                        self.id,
                        A::KIND,
                        view.node
                    ),
                    timeout,
                });
            }
        }
    }

    fn remember(&self, cell: ActorCell) -> ActorCell {
        if let Ok(mut cached) = self.cell.lock() {
            *cached = Some(cell.clone());
        }
        cell
    }
}

/// How long a call waits to see an actor the head calls alive before asking the head again.
const REACH_RECHECK: Duration = Duration::from_secs(1);

/// A driver's connection to a cluster: this process joins as a client node.
pub struct Client {
    cluster: Cluster,
    _node: LocalNode,
}

impl Client {
    /// Connects to the head at `address` (`host:port`) with the cluster token.
    pub async fn connect(address: &str, token: &str) -> Result<Self> {
        Self::connect_with(address, token, true).await
    }

    /// Like [`Client::connect`]; `direct` false makes a lighter client that talks only to
    /// the head (enough for status and spawning, not for calling actors on workers).
    pub async fn connect_with(address: &str, token: &str, direct: bool) -> Result<Self> {
        let host = node::route_to(address);
        let bind: IpAddr = "0.0.0.0".parse().map_err(|_| Error::Actor("bad bind address".into()))?;
        let name = format!("client-{}", node::random_hex(6));
        let local = LocalNode::start(&name, token, bind, 0, &host, direct).await?;
        let head = local.join(address).await?;
        let link = Arc::new(HeadLink::new(local.scope().to_string(), head, address.to_string()));
        let objects = if direct {
            let config = ObjectConfig::for_client(&host);
            Some(ObjectService::start(&name, token, config, link.clone()).await?)
        } else {
            None
        };
        // A driver started by the job manager belongs to its job.
        let job = std::env::var(crate::job_manager::JOB_ID_ENV)
            .ok()
            .filter(|j| !j.is_empty());
        Ok(Self {
            cluster: Cluster::new(link, objects).with_job(job),
            _node: local,
        })
    }

    /// The cluster handle.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
}

impl std::ops::Deref for Client {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}
