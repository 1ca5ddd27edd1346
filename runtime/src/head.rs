//! The head node: a thin actor shell around the [`Scheduler`]. It answers head requests,
//! runs the liveness timer, and carries out the scheduler's effects by talking to node
//! agents.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::error::{Error, Result};
use crate::node::{self, LocalNode};
use crate::protocol::{ActorId, ActorState, AgentRequest, Failure, GroupId, HeadRequest};
use crate::scheduler::{Effect, Scheduler};
use crate::wire::{self, LocalSignal, Wire};

/// How a head runs.
#[derive(Clone, Debug)]
pub struct HeadConfig {
    /// Address to listen on.
    pub bind: IpAddr,
    /// Cluster port.
    pub port: u16,
    /// Host name or IP that others use to reach this head.
    pub advertise_host: String,
    /// The cluster token.
    pub token: String,
    /// A worker silent this long is declared dead.
    pub heartbeat_timeout_ms: u64,
}

impl HeadConfig {
    /// Defaults: all interfaces, port 6380, 3 s heartbeat timeout.
    pub fn new(token: impl Into<String>) -> Self {
        Self {
            bind: IpAddr::from([0, 0, 0, 0]),
            port: 6380,
            advertise_host: "127.0.0.1".into(),
            token: token.into(),
            heartbeat_timeout_ms: 3_000,
        }
    }
}

/// A running head; dropping it does not stop it, [`RunningHead::stop`] does.
pub struct RunningHead {
    actor: ActorRef<Wire>,
    _node: LocalNode,
    /// The head's cluster address.
    pub address: String,
}

impl RunningHead {
    /// Stops the head actor.
    pub fn stop(&self) {
        self.actor.stop(None);
    }
}

/// Starts a head in this process.
pub async fn start_head(config: HeadConfig) -> Result<RunningHead> {
    let name = format!("head-{}", node::random_hex(4));
    let local = LocalNode::start(&name, &config.token, config.bind, config.port, &config.advertise_host, true).await?;
    let (actor, _) = Actor::spawn(
        None,
        Head,
        HeadArgs {
            scope: local.scope().to_string(),
            heartbeat_timeout_ms: config.heartbeat_timeout_ms,
        },
    )
    .await
    .map_err(|e| Error::Actor(format!("cannot start the head actor: {e}")))?;
    node::join_group(local.scope(), node::HEAD_GROUP, actor.get_cell());
    let ticker = actor.clone();
    let tick_every = Duration::from_millis((config.heartbeat_timeout_ms / 10).clamp(20, 250));
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(tick_every);
        loop {
            interval.tick().await;
            if ticker.send_message(Wire::Local(LocalSignal::Tick)).is_err() {
                break;
            }
        }
    });
    tracing::info!(address = %local.address, "head is up");
    Ok(RunningHead {
        address: local.address.clone(),
        actor,
        _node: local,
    })
}

struct Head;

struct HeadArgs {
    scope: String,
    heartbeat_timeout_ms: u64,
}

struct HeadState {
    scope: String,
    heartbeat_timeout_ms: u64,
    scheduler: Scheduler,
    epoch: Instant,
    actor_waiters: BTreeMap<ActorId, Vec<RpcReplyPort<Vec<u8>>>>,
    group_waiters: BTreeMap<GroupId, Vec<RpcReplyPort<Vec<u8>>>>,
}

impl HeadState {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

impl Actor for Head {
    type Msg = Wire;
    type State = HeadState;
    type Arguments = HeadArgs;

    async fn pre_start(&self, _myself: ActorRef<Wire>, args: HeadArgs) -> std::result::Result<HeadState, ActorProcessingErr> {
        Ok(HeadState {
            scope: args.scope,
            heartbeat_timeout_ms: args.heartbeat_timeout_ms,
            scheduler: Scheduler::new(),
            epoch: Instant::now(),
            actor_waiters: BTreeMap::new(),
            group_waiters: BTreeMap::new(),
        })
    }

    async fn handle(&self, myself: ActorRef<Wire>, message: Wire, state: &mut HeadState) -> std::result::Result<(), ActorProcessingErr> {
        let effects = match message {
            Wire::Call(bytes, port) => match wire::decode::<HeadRequest>(&bytes, "a head request") {
                Ok(request) => handle_request(state, request, Some(port)),
                Err(failure) => {
                    tracing::warn!(?failure, "ignored a malformed head request");
                    wire::reply::<()>(port, Err(failure));
                    Vec::new()
                }
            },
            Wire::Cast(bytes) | Wire::Local(LocalSignal::Deferred(bytes)) => {
                match wire::decode::<HeadRequest>(&bytes, "a head request") {
                    Ok(request) => handle_request(state, request, None),
                    Err(failure) => {
                        tracing::warn!(?failure, "ignored a malformed head message");
                        Vec::new()
                    }
                }
            }
            Wire::Local(LocalSignal::Tick) => {
                let now = state.now_ms();
                for (node, cause) in state.scheduler.expire(now, state.heartbeat_timeout_ms) {
                    tracing::warn!(node = %node, cause = %cause, "node declared dead; its actors restart elsewhere or are reported dead");
                }
                prune_waiters(state);
                Vec::new()
            }
            Wire::Local(_) => Vec::new(),
        };
        let now = state.now_ms();
        let mut all = effects;
        all.extend(state.scheduler.schedule(now));
        for effect in all {
            carry_out(&myself, &state.scope, effect);
        }
        answer_waiters(state);
        Ok(())
    }
}

/// Handles one request; `port` is `None` for casts (no reply wanted).
fn handle_request(state: &mut HeadState, request: HeadRequest, port: Option<RpcReplyPort<Vec<u8>>>) -> Vec<Effect> {
    let now = state.now_ms();
    let send = |port: Option<RpcReplyPort<Vec<u8>>>, bytes: Vec<u8>| {
        if let Some(port) = port {
            let _ = port.send(bytes);
        }
    };
    match request {
        HeadRequest::Register(info) => {
            let name = info.name.clone();
            tracing::info!(node = %name, address = %info.address, resources = %info.resources, kinds = ?info.kinds, "node joined");
            let incarnation = state.scheduler.register(info, now);
            send(port, wire::encode(&Ok::<u64, Failure>(incarnation)));
            Vec::new()
        }
        HeadRequest::Heartbeat { node, incarnation } => {
            let known = state.scheduler.heartbeat(&node, incarnation, now);
            send(port, wire::encode(&Ok::<bool, Failure>(known)));
            Vec::new()
        }
        HeadRequest::Spawn(spec) => {
            let result = state.scheduler.submit(spec, now);
            send(port, wire::encode(&result));
            Vec::new()
        }
        HeadRequest::WaitActor(id) => {
            match (state.scheduler.actor_view(id), port) {
                (None, Some(port)) => wire::reply::<()>(port, Err(Failure::Rejected(format!("actor {id} does not exist")))),
                (Some(_), Some(port)) => state.actor_waiters.entry(id).or_default().push(port),
                (_, None) => {}
            }
            Vec::new()
        }
        HeadRequest::Named(name) => {
            send(port, wire::encode(&Ok::<_, Failure>(state.scheduler.named(&name))));
            Vec::new()
        }
        HeadRequest::Kill(id) => {
            let result = state.scheduler.kill(id);
            let effects = result.as_ref().cloned().unwrap_or_default();
            send(port, wire::encode(&result.map(|_| ())));
            effects
        }
        HeadRequest::CreateGroup(spec) => {
            let result = state.scheduler.create_group(spec, now);
            send(port, wire::encode(&result));
            Vec::new()
        }
        HeadRequest::WaitGroup(id) => {
            if let Some(port) = port {
                state.group_waiters.entry(id).or_default().push(port);
            }
            Vec::new()
        }
        HeadRequest::RemoveGroup(id) => {
            let result = state.scheduler.remove_group(id);
            let effects = result.as_ref().cloned().unwrap_or_default();
            send(port, wire::encode(&result.map(|_| ())));
            effects
        }
        HeadRequest::Status => {
            send(port, wire::encode(&Ok::<_, Failure>(state.scheduler.status(now))));
            Vec::new()
        }
        HeadRequest::Started { actor, attempt, outcome } => {
            if let Err(cause) = &outcome {
                tracing::warn!(%actor, cause = %cause, "actor failed to start");
            }
            state.scheduler.started(actor, attempt, outcome);
            send(port, wire::encode(&Ok::<(), Failure>(())));
            Vec::new()
        }
        HeadRequest::Exited { actor, attempt, cause } => {
            tracing::warn!(%actor, cause = %cause, "actor exited");
            state.scheduler.exited(actor, attempt, &cause, now);
            send(port, wire::encode(&Ok::<(), Failure>(())));
            Vec::new()
        }
    }
}

/// Replies to everyone waiting on an actor or group whose wait is over.
fn answer_waiters(state: &mut HeadState) {
    let ids: Vec<ActorId> = state.actor_waiters.keys().copied().collect();
    for id in ids {
        let Some(view) = state.scheduler.actor_view(id) else { continue };
        if matches!(view.state, ActorState::Alive | ActorState::Dead { .. }) {
            for port in state.actor_waiters.remove(&id).unwrap_or_default() {
                wire::reply(port, Ok::<_, Failure>(view.clone()));
            }
        }
    }
    let groups: Vec<GroupId> = state.group_waiters.keys().copied().collect();
    for id in groups {
        let outcome = match state.scheduler.group_nodes(id) {
            Ok(Some(nodes)) => Ok(nodes),
            Ok(None) => continue,
            Err(failure) => Err(failure),
        };
        for port in state.group_waiters.remove(&id).unwrap_or_default() {
            wire::reply(port, outcome.clone());
        }
    }
}

/// Drops waiters whose callers gave up, so abandoned waits do not pile up.
fn prune_waiters(state: &mut HeadState) {
    for ports in state.actor_waiters.values_mut().chain(state.group_waiters.values_mut()) {
        ports.retain(|port| !port.is_closed());
    }
    state.actor_waiters.retain(|_, ports| !ports.is_empty());
    state.group_waiters.retain(|_, ports| !ports.is_empty());
}

/// Sends a start or stop to the node's agent without blocking the head.
fn carry_out(head: &ActorRef<Wire>, scope: &str, effect: Effect) {
    let (node, request, start) = match effect {
        Effect::Start(start) => (start.node.clone(), AgentRequest::Start(start.clone()), Some(start)),
        Effect::Stop { node, actor } => (node, AgentRequest::Stop(actor), None),
    };
    let Some(agent) = node::first_member(scope, &node::agent_group(&node)) else {
        if let Some(start) = start {
            report_undeliverable(head, &start, format!("node {node}'s agent is not reachable"));
        }
        return;
    };
    let head = head.clone();
    tokio::spawn(async move {
        let delivered = wire::call_raw(&agent, wire::encode(&request), Duration::from_secs(10)).await;
        if let (Err(_), Some(start)) = (delivered, start) {
            report_undeliverable(&head, &start, format!("node {}'s agent did not accept the start", start.node));
        }
    });
}

fn report_undeliverable(head: &ActorRef<Wire>, start: &crate::protocol::StartActor, cause: String) {
    let report = HeadRequest::Exited {
        actor: start.actor,
        attempt: start.attempt,
        cause,
    };
    let _ = head.send_message(Wire::Local(LocalSignal::Deferred(wire::encode(&report))));
}
