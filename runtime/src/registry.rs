//! User actors: the [`Actor`] trait, the [`Registry`] of kinds compiled into a worker
//! binary, and the host that runs one user actor inside the ractor system.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use ractor::{ActorProcessingErr, ActorRef};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::client::Cluster;
use crate::protocol::{ActorId, Failure};
use crate::resources::Resources;
use crate::wire::{self, Wire};

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
}

impl ActorContext {
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

/// A constructed user actor behind a byte interface.
pub(crate) trait Hosted: Send {
    fn handle<'a>(&'a mut self, request: Vec<u8>, ctx: &'a ActorContext) -> BoxFuture<'a, Result<Vec<u8>, Failure>>;
}

struct Typed<A>(A);

impl<A: Actor> Hosted for Typed<A> {
    fn handle<'a>(&'a mut self, request: Vec<u8>, ctx: &'a ActorContext) -> BoxFuture<'a, Result<Vec<u8>, Failure>> {
        Box::pin(async move {
            let request: A::Request = wire::decode(&request, &format!("a request for actor kind '{}'", A::KIND))?;
            match self.0.handle(request, ctx).await {
                Ok(reply) => Ok(wire::encode(&reply)),
                Err(e) => Err(Failure::Handler(e.to_string())),
            }
        })
    }
}

type Constructor =
    Arc<dyn Fn(Vec<u8>, ActorContext) -> BoxFuture<'static, Result<Box<dyn Hosted>, String>> + Send + Sync>;

/// The actor kinds a worker binary can construct, by name.
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<String, Constructor>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds kind `A` under [`Actor::KIND`].
    pub fn register<A: Actor>(mut self) -> Self {
        let constructor: Constructor = Arc::new(|args: Vec<u8>, ctx: ActorContext| {
            Box::pin(async move {
                let args: A::Args = wire::decode(&args, &format!("constructor arguments for actor kind '{}'", A::KIND))
                    .map_err(|f| match f {
                        Failure::BadMessage(m) => m,
                        other => format!("{other:?}"),
                    })?;
                let built = AssertUnwindSafe(A::create(args, &ctx)).catch_unwind().await;
                match built {
                    Ok(Ok(actor)) => Ok(Box::new(Typed(actor)) as Box<dyn Hosted>),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("the constructor of '{}' panicked", A::KIND)),
                }
            })
        });
        self.kinds.insert(A::KIND.to_string(), constructor);
        self
    }

    /// Registered kind names.
    pub fn kinds(&self) -> Vec<String> {
        self.kinds.keys().cloned().collect()
    }

    /// Constructs an actor of `kind` from encoded arguments.
    pub(crate) async fn construct(
        &self,
        kind: &str,
        args: Vec<u8>,
        ctx: ActorContext,
    ) -> Result<Box<dyn Hosted>, String> {
        let constructor = self.kinds.get(kind).ok_or_else(|| {
            format!(
                "unknown actor kind '{kind}' on this worker; it registers: {}",
                self.kinds().join(", ")
            )
        })?;
        constructor(args, ctx).await
    }
}

/// The ractor actor that runs one user actor. Its ractor mailbox only forwards into a
/// queue drained by one task, so the queue's length is a true mailbox depth for metrics
/// and the user's handler runs one message at a time, as before.
pub(crate) struct Host;

pub(crate) struct HostArgs {
    pub(crate) actor: Box<dyn Hosted>,
    pub(crate) ctx: ActorContext,
    pub(crate) kind: String,
}

pub(crate) struct HostState {
    queue: tokio::sync::mpsc::UnboundedSender<Wire>,
    kind: String,
}

impl ractor::Actor for Host {
    type Msg = Wire;
    type State = HostState;
    type Arguments = HostArgs;

    async fn pre_start(&self, myself: ActorRef<Wire>, args: HostArgs) -> Result<HostState, ActorProcessingErr> {
        let (queue, inbox) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(drain(myself, inbox, args.actor, args.ctx, args.kind.clone()));
        Ok(HostState { queue, kind: args.kind })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Wire>,
        message: Wire,
        state: &mut HostState,
    ) -> Result<(), ActorProcessingErr> {
        if matches!(message, Wire::Local(_)) {
            return Ok(());
        }
        let depth = crate::metrics::metrics()
            .mailbox_depth
            .with_label_values(&[&state.kind]);
        if state.queue.send(message).is_ok() {
            depth.inc();
        }
        Ok(())
    }
}

/// Runs the user actor over its queue until the host stops (or the handler panics, which
/// stops the host with the panic as the reason).
async fn drain(
    host: ActorRef<Wire>,
    mut inbox: tokio::sync::mpsc::UnboundedReceiver<Wire>,
    mut actor: Box<dyn Hosted>,
    ctx: ActorContext,
    kind: String,
) {
    let metrics = crate::metrics::metrics();
    let depth = metrics.mailbox_depth.with_label_values(&[&kind]);
    while let Some(message) = inbox.recv().await {
        depth.dec();
        let (request, port) = match message {
            Wire::Call(request, port) => (request, Some(port)),
            Wire::Cast(request) => (request, None),
            Wire::Local(_) => continue,
        };
        let started = std::time::Instant::now();
        let outcome = AssertUnwindSafe(actor.handle(request, &ctx)).catch_unwind().await;
        metrics.handled(&kind, started.elapsed().as_secs_f64());
        match (outcome, port) {
            (Ok(result), Some(port)) => {
                if !port.is_closed() {
                    let mut reply = wire::encode(&result);
                    if reply.len() > wire::MAX_MESSAGE_BYTES {
                        let failure: Result<Vec<u8>, Failure> = Err(Failure::Handler(format!(
                            "the reply of {} bytes exceeds the {} byte limit of actor messages; return an ObjectRef instead",
                            reply.len(),
                            wire::MAX_MESSAGE_BYTES
                        )));
                        reply = wire::encode(&failure);
                    }
                    let _ = port.send(reply);
                }
            }
            (Ok(Err(failure)), None) => tracing::warn!(actor = %ctx.id, ?failure, "cast failed"),
            (Ok(Ok(_)), None) => {}
            (Err(panic), _) => {
                let reason = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                host.stop(Some(format!("the actor panicked: {reason}")));
                break;
            }
        }
    }
    inbox.close();
    let left = inbox.len() as i64;
    depth.sub(left);
}
