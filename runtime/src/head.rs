//! The head node: a thin actor shell around the [`Scheduler`]. It answers head requests,
//! runs the liveness timer, and carries out the scheduler's effects by talking to node
//! agents.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use regatta_object_store::{Directory, Missing, ObjectId, Release};

use crate::error::{Error, Result};
use crate::headlink::HeadLink;
use crate::job_api;
use crate::job_manager::{JobConfig, JobManager};
use crate::metrics::{SdTarget, TargetSource};
use crate::node::{self, LocalNode, SessionEvent};
use crate::objects::{objects_group, ObjectConfig, ObjectService};
use crate::protocol::{ActorId, ActorState, ActorView, AgentRequest, Failure, GroupId, HeadRequest, ObjectCommand};
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
    /// Unreferenced objects are released this long after their last reference drops.
    pub object_grace_ms: u64,
    /// The head's own object store.
    pub objects: ObjectConfig,
    /// The job API and job manager (`None`: no job API).
    pub jobs: Option<JobConfig>,
    /// Port of the head's `/metrics` and Prometheus service discovery (`None`: off).
    pub metrics_port: Option<u16>,
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
            object_grace_ms: 10_000,
            objects: ObjectConfig::new("127.0.0.1"),
            jobs: Some(JobConfig::new()),
            metrics_port: Some(9180),
        }
    }
}

/// A running head; dropping it does not stop it, [`RunningHead::stop`] does.
pub struct RunningHead {
    actor: ActorRef<Wire>,
    _node: LocalNode,
    _objects: Arc<ObjectService>,
    /// The head's cluster address.
    pub address: String,
    /// The job API's address, when it runs.
    pub job_api: Option<SocketAddr>,
    /// The metrics and service-discovery endpoint's address, when it runs.
    pub metrics: Option<SocketAddr>,
}

impl RunningHead {
    /// Stops the head actor.
    pub fn stop(&self) {
        self.actor.stop(None);
    }
}

/// Starts a head in this process.
///
/// Everything else (head actor, object store, job API, metrics) is up before the cluster
/// port opens, so a worker or client that can join finds a complete head.
pub async fn start_head(config: HeadConfig) -> Result<RunningHead> {
    let name = format!("head-{}", node::random_hex(4));
    let scope = node::scope_for(&config.token);
    let port = if config.port == 0 {
        node::free_port(config.bind)?
    } else {
        config.port
    };
    let address = format!("{}:{port}", config.advertise_host);
    let targets: Arc<Mutex<Vec<SdTarget>>> = Arc::new(Mutex::new(Vec::new()));
    let sources: Arc<OnceLock<(Arc<ObjectService>, Option<JobManager>)>> = Arc::new(OnceLock::new());
    let metrics = match config.metrics_port {
        Some(port) => {
            let from = sources.clone();
            let refresh: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
                if let Some((objects, jobs)) = from.get() {
                    crate::metrics::metrics().publish_objects(HEAD_NODE, &objects.stats());
                    if let Some(jobs) = jobs {
                        jobs.publish_metrics();
                    }
                }
            });
            let list = targets.clone();
            let source: TargetSource = Arc::new(move || list.lock().map(|t| t.clone()).unwrap_or_default());
            Some(crate::metrics::serve(SocketAddr::new(config.bind, port), Some(refresh), Some(source)).await?)
        }
        None => None,
    };
    let head_target = metrics.map(|m| format!("{}:{}", config.advertise_host, m.port()));
    let (actor, _) = Actor::spawn(
        None,
        Head,
        HeadArgs {
            scope: scope.clone(),
            heartbeat_timeout_ms: config.heartbeat_timeout_ms,
            object_grace_ms: config.object_grace_ms,
            targets,
            head_target,
        },
    )
    .await
    .map_err(|e| Error::Actor(format!("cannot start the head actor: {e}")))?;
    node::join_group(&scope, node::HEAD_GROUP, actor.get_cell());
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
    let link = Arc::new(HeadLink::new(scope.clone(), actor.get_cell(), address.clone()));
    let objects = ObjectService::start(HEAD_NODE, &config.token, config.objects.clone(), link.clone()).await?;
    let (job_api, manager) = match &config.jobs {
        Some(jobs) => {
            let manager = JobManager::open(jobs.clone(), address.clone(), config.token.clone(), link)?;
            let bind = SocketAddr::new(config.bind, jobs.http_port);
            (
                Some(job_api::serve(manager.clone(), config.token.clone(), bind).await?),
                Some(manager),
            )
        }
        None => (None, None),
    };
    let _ = sources.set((objects.clone(), manager));
    // Isolated: the head never dials the peers its peers name. Workers and clients dial it and
    // each other; a head that dialed them too raced their own connection, and `ractor_cluster`
    // then closed one of two authenticated sessions with requests in flight on it.
    let local = LocalNode::start(&name, &config.token, config.bind, port, &config.advertise_host, false).await?;
    forward_client_departures(&local, actor.clone());
    tracing::info!(address = %local.address, "head is up");
    Ok(RunningHead {
        job_api,
        metrics,
        address: local.address.clone(),
        actor,
        _node: local,
        _objects: objects,
    })
}

/// The head's own name as an object holder.
pub const HEAD_NODE: &str = "head";

/// Tells the head when a client disconnects, so the references it held are dropped.
fn forward_client_departures(local: &LocalNode, head: ActorRef<Wire>) {
    let mut events = local.events();
    tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(SessionEvent::Closed {
                    authenticated: true,
                    name: Some(name),
                }) if name.starts_with("client-") => {
                    let gone = HeadRequest::HolderGone(name);
                    if head
                        .send_message(Wire::Local(LocalSignal::Deferred(wire::encode(&gone))))
                        .is_err()
                    {
                        break;
                    }
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(_) => break,
            }
        }
    });
}

struct Head;

struct HeadArgs {
    scope: String,
    heartbeat_timeout_ms: u64,
    object_grace_ms: u64,
    targets: Arc<Mutex<Vec<SdTarget>>>,
    head_target: Option<String>,
}

struct HeadState {
    scope: String,
    heartbeat_timeout_ms: u64,
    scheduler: Scheduler,
    directory: Directory,
    epoch: Instant,
    actor_waiters: BTreeMap<ActorId, Vec<RpcReplyPort<Vec<u8>>>>,
    group_waiters: BTreeMap<GroupId, Vec<RpcReplyPort<Vec<u8>>>>,
    targets: Arc<Mutex<Vec<SdTarget>>>,
    head_target: Option<String>,
    published_ms: Option<u64>,
    /// Object requests for ids not registered yet, retried when the id arrives.
    object_waiters: BTreeMap<ObjectId, Vec<ParkedRequest>>,
}

/// An object request waiting for its id to be registered: request, reply port, deadline.
type ParkedRequest = (HeadRequest, RpcReplyPort<Vec<u8>>, u64);

/// How long the head holds a lookup of an object id it has not heard of: registration of
/// a put is asynchronous, so a reference can overtake it.
const UNKNOWN_OBJECT_WAIT_MS: u64 = 2_000;

impl HeadState {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

impl Actor for Head {
    type Msg = Wire;
    type State = HeadState;
    type Arguments = HeadArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Wire>,
        args: HeadArgs,
    ) -> std::result::Result<HeadState, ActorProcessingErr> {
        Ok(HeadState {
            scope: args.scope,
            heartbeat_timeout_ms: args.heartbeat_timeout_ms,
            scheduler: Scheduler::new(),
            directory: Directory::new(args.object_grace_ms),
            epoch: Instant::now(),
            actor_waiters: BTreeMap::new(),
            group_waiters: BTreeMap::new(),
            targets: args.targets,
            head_target: args.head_target,
            published_ms: None,
            object_waiters: BTreeMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Wire>,
        message: Wire,
        state: &mut HeadState,
    ) -> std::result::Result<(), ActorProcessingErr> {
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
                    let lost = state.directory.node_lost(&node, now);
                    if !lost.is_empty() {
                        tracing::warn!(node = %node, objects = lost.len(), "objects lost with their node");
                    }
                }
                for release in state.directory.collect(now) {
                    carry_out_release(&state.scope, release);
                }
                prune_waiters(state);
                expire_object_waiters(state, now);
                publish_metrics(state, now);
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
            let result = state.scheduler.register(info, now);
            if let Err(failure) = &result {
                tracing::warn!(?failure, "refused a node's registration");
            }
            send(port, wire::encode(&result));
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
                (None, Some(port)) => {
                    wire::reply::<()>(port, Err(Failure::Rejected(format!("actor {id} does not exist"))))
                }
                (Some(_), Some(port)) => state.actor_waiters.entry(id).or_default().push(port),
                (_, None) => {}
            }
            Vec::new()
        }
        HeadRequest::Announce(id) => {
            send(port, wire::encode(&Ok::<(), Failure>(())));
            match state.scheduler.actor_view(id) {
                Some(ActorView {
                    state: ActorState::Alive,
                    node: Some(node),
                    ..
                }) => vec![Effect::Announce { node, actor: id }],
                _ => Vec::new(),
            }
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
            let mut status = state.scheduler.status(now);
            status.objects = state.directory.stats();
            send(port, wire::encode(&Ok::<_, Failure>(status)));
            Vec::new()
        }
        HeadRequest::ObjectPut {
            id,
            size,
            checksum,
            node,
            address,
            job,
        } => {
            let result = state
                .directory
                .put(id, size, checksum, &node, &node, &address, job)
                .map_err(Failure::Rejected);
            if let Err(failure) = &result {
                tracing::warn!(?failure, "refused an object registration");
            }
            send(port, wire::encode(&result));
            let mut effects = Vec::new();
            for (request, port, _) in state.object_waiters.remove(&id).unwrap_or_default() {
                effects.extend(handle_request(state, request, Some(port)));
            }
            effects
        }
        HeadRequest::ObjectLocate(id) => {
            match (state.directory.locate(id), port) {
                (Err(Missing::Unknown), Some(port)) => {
                    park_object_request(state, id, HeadRequest::ObjectLocate(id), port, now)
                }
                (result, port) => send(
                    port,
                    wire::encode(&result.map_err(|missing| object_missing(id, missing))),
                ),
            }
            Vec::new()
        }
        HeadRequest::ObjectAddSource { id, node, address } => {
            state.directory.add_source(id, &node, &address);
            Vec::new()
        }
        HeadRequest::ObjectRemoveSource { id, node, spilled_to } => {
            if let Some(url) = &spilled_to {
                state.directory.spilled(id, &node, url);
            }
            state.directory.remove_source(id, &node);
            Vec::new()
        }
        HeadRequest::ObjectAddRef { id, holder } => {
            match (state.directory.add_ref(id, &holder), port) {
                (Err(Missing::Unknown), Some(port)) => {
                    park_object_request(state, id, HeadRequest::ObjectAddRef { id, holder }, port, now)
                }
                (result, port) => send(
                    port,
                    wire::encode(&result.map_err(|missing| object_missing(id, missing))),
                ),
            }
            Vec::new()
        }
        HeadRequest::ObjectDropRef { id, holder } => {
            state.directory.drop_ref(id, &holder, now);
            Vec::new()
        }
        HeadRequest::ObjectFree(id) => {
            if let Some(release) = state.directory.free(id) {
                carry_out_release(&state.scope, release);
            }
            send(port, wire::encode(&Ok::<(), Failure>(())));
            Vec::new()
        }
        HeadRequest::EndJob(job) => {
            let effects = state.scheduler.end_job(&job);
            for release in state.directory.end_job(&job) {
                carry_out_release(&state.scope, release);
            }
            send(port, wire::encode(&Ok::<(), Failure>(())));
            effects
        }
        HeadRequest::HolderGone(holder) => {
            state.directory.holder_gone(&holder, now);
            Vec::new()
        }
        HeadRequest::Started {
            actor,
            attempt,
            outcome,
        } => {
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
        let Some(view) = state.scheduler.actor_view(id) else {
            continue;
        };
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
        Effect::Announce { node, actor } => (node, AgentRequest::Announce(actor), None),
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
            report_undeliverable(
                &head,
                &start,
                format!("node {}'s agent did not accept the start", start.node),
            );
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

fn object_missing(id: regatta_object_store::ObjectId, missing: Missing) -> Failure {
    Failure::ObjectMissing {
        id,
        lost_with: match missing {
            Missing::Unknown => None,
            Missing::Lost { node } => Some(node),
        },
    }
}

/// Tells every holder to drop its copy, and deletes the spilled copy.
fn carry_out_release(scope: &str, release: Release) {
    let command = ObjectCommand::Release {
        id: release.id,
        spilled: None,
    };
    for node in &release.nodes {
        if let Some(target) = node::first_member(scope, &objects_group(node)) {
            let _ = wire::cast_raw(&target, wire::encode(&command));
        }
    }
    if let Some((_, url)) = release.spilled {
        tokio::spawn(async move {
            if let Err(e) = regatta_object_store::delete_spilled(&url).await {
                tracing::warn!(error = %e, "could not delete a spilled copy");
            }
        });
    }
}

/// Publishes the cluster's figures and the discovery targets, at most once a second.
/// Target labels are `regatta_node` and `regatta_role`: a target label named `node` would
/// clash with the `node` label of the series themselves (Prometheus renames clashing
/// scraped labels to `exported_node`).
fn publish_metrics(state: &mut HeadState, now: u64) {
    if state.published_ms.is_some_and(|last| now.saturating_sub(last) < 1_000) {
        return;
    }
    state.published_ms = Some(now);
    let mut status = state.scheduler.status(now);
    status.objects = state.directory.stats();
    crate::metrics::metrics().publish_cluster(&status, &state.scheduler.heartbeat_ages(now));
    let mut targets: Vec<SdTarget> = state
        .scheduler
        .metrics_targets()
        .into_iter()
        .map(|(node, address)| SdTarget {
            targets: vec![address],
            labels: BTreeMap::from([
                ("regatta_node".to_string(), node),
                ("regatta_role".to_string(), "worker".to_string()),
            ]),
        })
        .collect();
    if let Some(head) = &state.head_target {
        targets.push(SdTarget {
            targets: vec![head.clone()],
            labels: BTreeMap::from([
                ("regatta_node".to_string(), HEAD_NODE.to_string()),
                ("regatta_role".to_string(), "head".to_string()),
            ]),
        });
    }
    if let Ok(mut shared) = state.targets.lock() {
        *shared = targets;
    }
}

/// Holds an object request until the id is registered or the wait runs out.
fn park_object_request(
    state: &mut HeadState,
    id: ObjectId,
    request: HeadRequest,
    port: RpcReplyPort<Vec<u8>>,
    now: u64,
) {
    state
        .object_waiters
        .entry(id)
        .or_default()
        .push((request, port, now + UNKNOWN_OBJECT_WAIT_MS));
}

/// Answers "unknown" to object requests whose id never arrived.
fn expire_object_waiters(state: &mut HeadState, now: u64) {
    let ids: Vec<ObjectId> = state.object_waiters.keys().copied().collect();
    for id in ids {
        let Some(waiters) = state.object_waiters.remove(&id) else {
            continue;
        };
        let (due, keep): (Vec<_>, Vec<_>) = waiters
            .into_iter()
            .partition(|(_, port, deadline)| *deadline <= now || port.is_closed());
        for (_, port, _) in due {
            wire::reply::<()>(port, Err(object_missing(id, Missing::Unknown)));
        }
        if !keep.is_empty() {
            state.object_waiters.insert(id, keep);
        }
    }
}
