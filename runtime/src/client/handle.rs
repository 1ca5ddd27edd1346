//! Typed actors from a driver's side: [`ActorHandle`] and the typed spawn and lookup on
//! [`Cluster`].

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::ActorCell;
use tokio::sync::oneshot;

use super::actor::Actor;
use super::cluster::{ActorOptions, Cluster, DEFAULT_CALL_TIMEOUT};
use super::timing::CallTiming;
use crate::error::{failure_to_error, Error, Result};
use crate::net::calls::{wall_clock_ns, Target};
use crate::net::node;
use crate::net::wire::{self, CallError};
use regatta_proto::{ActorId, ActorSpec, ActorState, ActorView, Failure, HeadRequest};

impl Cluster {
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
}

/// Where an actor was found: its node (shared, so a call copies no name) and the node's
/// router.
type Located = (Arc<str>, ActorCell);

/// A typed handle on an actor of kind `A`, valid across its restarts.
pub struct ActorHandle<A: Actor> {
    id: ActorId,
    cluster: Cluster,
    /// The node that hosted the actor when last looked up, and its router.
    cell: Arc<Mutex<Option<Located>>>,
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
        self.call_with(request, timeout, false, &mut None)
            .await
            .map(|(reply, _)| reply)
    }

    /// [`ActorHandle::call_timeout`] for a caller that keeps its calls in order without
    /// waiting for each answer: `sent` fires once the request is written to the actor's
    /// node over the call channel (requests written one after another reach the actor in
    /// that order), and is dropped unfired when the call ended another way (the session
    /// path, or an error), so the caller sends its next call after this one's end.
    pub async fn call_pipelined(
        &self,
        request: A::Request,
        timeout: Duration,
        sent: oneshot::Sender<()>,
    ) -> Result<A::Reply> {
        self.call_with(request, timeout, false, &mut Some(sent))
            .await
            .map(|(reply, _)| reply)
    }

    /// [`ActorHandle::call`], also saying where the call's time went hop by hop: the
    /// timing is `None` when the call did not go over the call channel (the session path,
    /// or a request over the channel's size). Meant for diagnosing latency: a timed call
    /// carries 32 bytes more each way and takes a few more clock readings.
    pub async fn call_timed(&self, request: A::Request) -> Result<(A::Reply, Option<CallTiming>)> {
        self.call_with(request, DEFAULT_CALL_TIMEOUT, true, &mut None).await
    }

    async fn call_with(
        &self,
        request: A::Request,
        timeout: Duration,
        timed: bool,
        sent: &mut Option<oneshot::Sender<()>>,
    ) -> Result<(A::Reply, Option<CallTiming>)> {
        let called = if timed { wall_clock_ns() } else { 0 };
        let deadline = Instant::now() + timeout;
        let (reply, hops) = loop {
            let (node, router) = self.resolve(deadline).await?;
            let remaining = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let target = Target {
                node: &node,
                router: &router,
            };
            let sent = self
                .cluster
                .calls
                .call(target, self.id, wire::encode(&request), remaining, timed, sent)
                .await;
            let (bytes, hops) = match sent {
                Ok(answered) => answered,
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
                // Nothing was delivered: find the route again (a fresh session) and resend.
                Err(CallError::NotSent(cause)) => {
                    self.forget();
                    if Instant::now() >= deadline {
                        return Err(self.explain_lost_call(cause).await);
                    }
                    tokio::time::sleep(NOT_HOSTED_BACKOFF).await;
                    continue;
                }
            };
            // The reply is encoded once by the host as `Result<A::Reply, Failure>` (a router
            // or a stopping host answers `Err` alone, which decodes the same way).
            let reply: std::result::Result<A::Reply, Failure> =
                wire::decode(&bytes, &format!("a reply of actor kind '{}'", A::KIND))
                    .map_err(|f| failure_to_error(f, Some(self.id)))?;
            match reply {
                // Its node no longer hosts it: the head says where it runs now (or that it
                // is dead); nothing was delivered, so asking again is safe.
                Err(Failure::NotHosted { node, .. }) => {
                    self.forget();
                    if Instant::now() >= deadline {
                        return Err(self
                            .explain_lost_call(format!("node {node} no longer hosts the actor"))
                            .await);
                    }
                    tokio::time::sleep(NOT_HOSTED_BACKOFF).await;
                }
                // It took the call and stopped before answering: say whether it is dead.
                Err(Failure::Lost(cause)) => {
                    self.forget();
                    return Err(self.explain_lost_call(cause).await);
                }
                other => break (other, hops),
            }
        };
        let reply = reply.map_err(|f| failure_to_error(f, Some(self.id)))?;
        let timing = hops.map(|hops| CallTiming::from_stamps(called, &hops, wall_clock_ns()));
        Ok((reply, timing))
    }

    /// Sends a message without waiting for it to be handled (a message to an actor that
    /// has just died is dropped, as any message in its queue would be).
    pub async fn cast(&self, request: A::Request) -> Result<()> {
        let (node, router) = self.resolve(Instant::now() + DEFAULT_CALL_TIMEOUT).await?;
        let target = Target {
            node: &node,
            router: &router,
        };
        let sent = self.cluster.calls.cast(target, self.id, wire::encode(&request)).await;
        sent.map_err(|e| {
            self.forget();
            let cause = match e {
                CallError::Unreachable(cause) | CallError::NotSent(cause) => cause,
                CallError::Timeout => "the message could not be sent in time".to_string(),
            };
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

    /// Finds the router of the node that hosts the actor: the cached one, else ask the head
    /// (waiting while it is placed or restarted) and then the local mirror of the router's
    /// process group. The head is asked first so that a killed or dead actor whose host is
    /// still stopping is reported dead rather than reached.
    async fn resolve(&self, deadline: Instant) -> Result<Located> {
        if let Some((node, cell)) = self.cell.lock().ok().and_then(|c| c.clone()) {
            if cell.get_status() == ractor::ActorStatus::Running {
                return Ok((node, cell));
            }
        }
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
            // The head says it is alive; wait for this process to see its node's router, a
            // little at a time: when its node has just died (this process already dropped
            // the node's router, the head has not yet declared it dead), the next look at
            // the head says so, instead of this call waiting out its whole timeout.
            let remaining = deadline.saturating_duration_since(Instant::now());
            if let Some(node) = &view.node {
                let group = node::router_group(node);
                let wait = remaining.min(REACH_RECHECK);
                if let Some(cell) = self
                    .cluster
                    .node_member(node, &group, view.address.as_deref(), wait)
                    .await
                {
                    return Ok(self.remember(node, cell));
                }
            }
            // Still not visible here although the head calls it alive: this process's
            // mirror may have missed the router's membership (seen under load); have the
            // actor's agent advertise it again.
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

    fn remember(&self, node: &str, cell: ActorCell) -> Located {
        let target = (Arc::from(node), cell);
        if let Ok(mut cached) = self.cell.lock() {
            *cached = Some(target.clone());
        }
        target
    }
}

/// How long a call waits to see an actor the head calls alive before asking the head again.
const REACH_RECHECK: Duration = Duration::from_secs(1);

/// How long a call waits before asking the head again after the node it was told of no
/// longer hosts the actor (the head learns of the exit a moment later).
const NOT_HOSTED_BACKOFF: Duration = Duration::from_millis(5);
