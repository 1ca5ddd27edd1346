//! The worker's side of user actors: the [`Registry`] of kinds compiled into a worker
//! binary, and the host that runs one user actor inside the ractor system.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use ractor::{ActorProcessingErr, ActorRef};

use crate::client::{Actor, ActorContext};
use crate::net::wire::{self, Wire};
use regatta_proto::Failure;

/// A constructed user actor behind a byte interface.
pub(crate) trait Hosted: Send {
    fn handle<'a>(&'a mut self, request: Vec<u8>, ctx: &'a ActorContext) -> BoxFuture<'a, Result<Vec<u8>, Failure>>;
    fn max_concurrency(&self) -> usize;
    /// The message's handling beside others, or the request back for [`Hosted::handle`].
    #[allow(clippy::type_complexity)]
    fn handle_concurrently(
        &self,
        request: Vec<u8>,
        ctx: &ActorContext,
    ) -> Result<BoxFuture<'static, Result<Vec<u8>, Failure>>, Vec<u8>>;
}

struct Typed<A>(A);

impl<A: Actor> Hosted for Typed<A> {
    fn handle<'a>(&'a mut self, request: Vec<u8>, ctx: &'a ActorContext) -> BoxFuture<'a, Result<Vec<u8>, Failure>> {
        Box::pin(async move {
            let request: A::Request = wire::decode(&request, &format!("a request for actor kind '{}'", A::KIND))?;
            match self.0.handle(request, ctx).await {
                // The caller's whole answer, encoded once: `Result<A::Reply, Failure>`.
                Ok(reply) => Ok(wire::encode_ok(&reply)),
                Err(e) => Err(Failure::Handler(e.to_string())),
            }
        })
    }

    fn max_concurrency(&self) -> usize {
        self.0.max_concurrency().max(1)
    }

    fn handle_concurrently(
        &self,
        request: Vec<u8>,
        ctx: &ActorContext,
    ) -> Result<BoxFuture<'static, Result<Vec<u8>, Failure>>, Vec<u8>> {
        let decoded: A::Request = match wire::decode(&request, &format!("a request for actor kind '{}'", A::KIND)) {
            Ok(decoded) => decoded,
            Err(failure) => return Ok(Box::pin(async move { Err(failure) })),
        };
        match self.0.handle_concurrently(decoded, ctx) {
            Some(running) => Ok(Box::pin(async move {
                match running.await {
                    Ok(reply) => Ok(wire::encode_ok(&reply)),
                    Err(e) => Err(Failure::Handler(e.to_string())),
                }
            })),
            None => Err(request),
        }
    }
}

type Constructor =
    Arc<dyn Fn(Vec<u8>, ActorContext) -> BoxFuture<'static, Result<Box<dyn Hosted>, StartError>> + Send + Sync>;

/// Why a worker could not start an actor it was asked to.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    /// No kind of that name is compiled into this worker.
    #[error("unknown actor kind '{kind}' on this worker; it registers: {}", known.join(", "))]
    UnknownKind { kind: String, known: Vec<String> },
    /// The constructor's arguments do not decode as the kind's `Args`.
    #[error("{0}")]
    BadArguments(String),
    /// The kind's constructor returned an error.
    #[error("{0}")]
    Constructor(crate::client::ActorError),
    /// The kind's constructor panicked.
    #[error("the constructor of '{kind}' panicked")]
    Panicked { kind: &'static str },
    /// The actor was built but its host could not be started.
    #[error("could not start the actor's host: {0}")]
    Host(ractor::SpawnErr),
    /// The node's agent is stopping.
    #[error("the node agent is shutting down")]
    ShuttingDown,
}

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
                        Failure::BadMessage(m) => StartError::BadArguments(m),
                        other => StartError::BadArguments(format!("{other:?}")),
                    })?;
                let built = AssertUnwindSafe(A::create(args, &ctx)).catch_unwind().await;
                match built {
                    Ok(Ok(actor)) => Ok(Box::new(Typed(actor)) as Box<dyn Hosted>),
                    Ok(Err(e)) => Err(StartError::Constructor(e)),
                    Err(_) => Err(StartError::Panicked { kind: A::KIND }),
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
    ) -> Result<Box<dyn Hosted>, StartError> {
        let constructor = self.kinds.get(kind).ok_or_else(|| StartError::UnknownKind {
            kind: kind.to_string(),
            known: self.kinds(),
        })?;
        constructor(args, ctx).await
    }
}

/// The ractor actor that runs one user actor: it owns the actor's queue (the node's router
/// puts calls and casts in it), runs the actor over it on one task, and is what the agent
/// supervises. It takes no messages itself, so it is not remote-capable and peers never
/// mirror it (see `router.rs`).
pub(crate) struct Host;

/// The host of a user actor takes no messages: it exists to be supervised and stopped.
pub(crate) enum HostMessage {}

impl ractor::Message for HostMessage {}

pub(crate) struct HostArgs {
    pub(crate) actor: Box<dyn Hosted>,
    pub(crate) ctx: ActorContext,
    pub(crate) kind: String,
    /// The actor's queue: the host keeps its only strong sender, so the queue closes (and
    /// the router stops reaching it) when the host stops.
    pub(crate) queue: tokio::sync::mpsc::UnboundedSender<Wire>,
    pub(crate) inbox: tokio::sync::mpsc::UnboundedReceiver<Wire>,
}

pub(crate) struct HostState {
    _queue: tokio::sync::mpsc::UnboundedSender<Wire>,
    /// Dropped with the state when the host stops: tells the drain to stop.
    _running: tokio::sync::oneshot::Sender<()>,
}

impl ractor::Actor for Host {
    type Msg = HostMessage;
    type State = HostState;
    type Arguments = HostArgs;

    async fn pre_start(&self, myself: ActorRef<HostMessage>, args: HostArgs) -> Result<HostState, ActorProcessingErr> {
        let (running, stopped) = tokio::sync::oneshot::channel();
        tokio::spawn(drain(myself, args.inbox, stopped, args.actor, args.ctx, args.kind));
        Ok(HostState {
            _queue: args.queue,
            _running: running,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<HostMessage>,
        message: HostMessage,
        _state: &mut HostState,
    ) -> Result<(), ActorProcessingErr> {
        match message {}
    }
}

/// Runs the user actor over its queue until the host stops (or the handler panics, which
/// stops the host with the panic as the reason). Every call it takes gets an answer: a call
/// cut short by the host stopping, or still queued then, is answered [`Failure::Lost`] (a
/// dropped reply port would leave a remote caller waiting out its whole timeout).
///
/// An actor whose [`Hosted::max_concurrency`] is above 1 has up to that many messages in
/// [`Hosted::handle_concurrently`] at once, each answered as it ends; a message it hands
/// back goes to [`Hosted::handle`] once those running have ended.
async fn drain(
    host: ActorRef<HostMessage>,
    mut inbox: tokio::sync::mpsc::UnboundedReceiver<Wire>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
    mut actor: Box<dyn Hosted>,
    ctx: ActorContext,
    kind: String,
) {
    let depth = crate::metrics::metrics().mailbox_depth.with_label_values(&[&kind]);
    let limit = actor.max_concurrency();
    let mut beside = Beside::default();
    // Why it ends: `Some(reason)` when a message panicked, `None` when it was stopped.
    let panicked: Option<String> = loop {
        let message = tokio::select! {
            biased;
            _ = &mut stopped => break None,
            Some(ended) = beside.next(), if !beside.is_empty() => {
                match ended.finish(&ctx, &kind) {
                    Some(reason) => break Some(reason),
                    None => continue,
                }
            }
            message = inbox.recv(), if beside.len() < limit => match message {
                Some(message) => message,
                None => break None,
            },
        };
        depth.dec();
        let (mut request, port) = match message {
            Wire::Call(request, port) => (request, Some(port)),
            // The cast's hold is given back with the rest of `message`: its actor has
            // taken it off the queue.
            Wire::Cast(request, _) => (request, None),
            Wire::CallActor(..) | Wire::CastActor(..) | Wire::Local(_) => continue,
        };
        let started = std::time::Instant::now();
        if limit > 1 {
            match actor.handle_concurrently(request, &ctx) {
                Ok(handling) => {
                    beside.push(handling, port, started);
                    continue;
                }
                Err(back) => request = back,
            }
            // A message for `handle` waits for those running beside each other.
            if let Err(end) = beside.finish_all(&mut stopped, &ctx, &kind).await {
                break end;
            }
        }
        let outcome = tokio::select! {
            biased;
            outcome = AssertUnwindSafe(actor.handle(request, &ctx)).catch_unwind() => outcome,
            _ = &mut stopped => {
                if let Some(port) = port {
                    answer_lost(port, "the actor was stopped during the call");
                }
                break None;
            }
        };
        let ended = Ended { outcome, port, started };
        if let Some(reason) = ended.finish(&ctx, &kind) {
            break Some(reason);
        }
    };
    let why = match panicked {
        Some(reason) => {
            host.stop(Some(reason.clone()));
            reason
        }
        None => "the actor was stopped".to_string(),
    };
    for port in beside.ports() {
        answer_lost(port, &why);
    }
    inbox.close();
    while let Ok(message) = inbox.try_recv() {
        depth.dec();
        if let Wire::Call(_, port) = message {
            answer_lost(port, &why);
        }
    }
}

type Outcome = std::thread::Result<Result<Vec<u8>, Failure>>;

/// One message handled, to be answered.
struct Ended {
    outcome: Outcome,
    port: Option<ractor::RpcReplyPort<Vec<u8>>>,
    started: std::time::Instant,
}

impl Ended {
    /// Answers it; a panic's reason comes back, to stop the host with.
    fn finish(self, ctx: &ActorContext, kind: &str) -> Option<String> {
        finish(self.outcome, self.port, self.started, ctx, kind)
    }
}

/// The messages of an actor running beside each other, with their reply ports and start
/// times.
#[derive(Default)]
struct Beside {
    running: futures::stream::FuturesUnordered<futures::future::BoxFuture<'static, (u64, Outcome)>>,
    waiting: std::collections::HashMap<u64, (Port, std::time::Instant)>,
    next_key: u64,
}

/// Where a call's answer goes (`None` for a cast).
type Port = Option<ractor::RpcReplyPort<Vec<u8>>>;

impl Beside {
    fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    fn len(&self) -> usize {
        self.running.len()
    }

    /// Runs `handling` beside the others.
    fn push(
        &mut self,
        handling: BoxFuture<'static, Result<Vec<u8>, Failure>>,
        port: Option<ractor::RpcReplyPort<Vec<u8>>>,
        started: std::time::Instant,
    ) {
        let key = self.next_key;
        self.next_key += 1;
        self.waiting.insert(key, (port, started));
        self.running.push(Box::pin(async move {
            (key, AssertUnwindSafe(handling).catch_unwind().await)
        }));
    }

    /// The next one to end (pending while none runs).
    async fn next(&mut self) -> Option<Ended> {
        use futures::StreamExt;
        let (key, outcome) = self.running.next().await?;
        let (port, started) = self.waiting.remove(&key).unwrap_or((None, std::time::Instant::now()));
        Some(Ended { outcome, port, started })
    }

    /// Waits for every one running to end and answers each. `Err` when the actor must
    /// stop: with a panic's reason, or `None` when it was stopped meanwhile.
    async fn finish_all(
        &mut self,
        stopped: &mut tokio::sync::oneshot::Receiver<()>,
        ctx: &ActorContext,
        kind: &str,
    ) -> Result<(), Option<String>> {
        while !self.is_empty() {
            tokio::select! {
                biased;
                _ = &mut *stopped => return Err(None),
                Some(ended) = self.next() => {
                    if let Some(reason) = ended.finish(ctx, kind) {
                        return Err(Some(reason));
                    }
                }
            }
        }
        Ok(())
    }

    /// The reply ports of those still running (the actor stopped under them).
    fn ports(self) -> impl Iterator<Item = ractor::RpcReplyPort<Vec<u8>>> {
        self.waiting.into_values().filter_map(|(port, _)| port)
    }
}

/// Answers one handled message (or logs a cast's failure); a panic's reason comes back, to
/// stop the host with.
fn finish(
    outcome: std::thread::Result<Result<Vec<u8>, Failure>>,
    port: Option<ractor::RpcReplyPort<Vec<u8>>>,
    started: std::time::Instant,
    ctx: &ActorContext,
    kind: &str,
) -> Option<String> {
    crate::metrics::metrics().handled(kind, started.elapsed().as_secs_f64());
    if let Ok(Err(failure)) = &outcome {
        ctx.log(format!("a call failed: {failure:?}"));
    }
    match (outcome, port) {
        (Ok(result), Some(port)) => {
            if !port.is_closed() {
                let mut reply = match result {
                    Ok(answer) => answer,
                    Err(failure) => wire::encode_failure(failure),
                };
                if reply.len() > wire::MAX_MESSAGE_BYTES {
                    reply = wire::encode_failure(Failure::Handler(format!(
                        "the reply of {} bytes exceeds the {} byte limit of actor messages; return an ObjectRef instead",
                        reply.len(),
                        wire::MAX_MESSAGE_BYTES
                    )));
                }
                let _ = port.send(reply);
            }
            None
        }
        (Ok(Err(failure)), None) => {
            tracing::warn!(actor = %ctx.id, ?failure, "cast failed");
            None
        }
        (Ok(Ok(_)), None) => None,
        (Err(panic), port) => {
            let reason = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            ctx.log(format!("panicked: {reason}"));
            let why = format!("the actor panicked: {reason}");
            if let Some(port) = port {
                answer_lost(port, &why);
            }
            Some(why)
        }
    }
}

/// Answers a call that the actor will not handle.
fn answer_lost(port: ractor::RpcReplyPort<Vec<u8>>, cause: &str) {
    wire::reply::<()>(port, Err(Failure::Lost(cause.to_string())));
}
