//! The head node: a thin actor shell around [`HeadCore`], the state machine that decides.
//! It decodes requests, holds the reply ports of those the core parks, runs the liveness
//! timer, and carries out the core's outputs: answers, starts and stops sent to node
//! agents, object releases, log lines.

mod dashboard;
pub(crate) mod job_api;
pub(crate) mod job_log;
pub(crate) mod job_manager;
pub(crate) mod job_packages;
pub(crate) mod job_shim;
pub(crate) mod job_store;
mod state_file;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use regatta_object_store::Release;
use regatta_proto::head::{Answer, ChangeRef, HeadCore, Notice, Output, ReplyTo, Saved};
use state_file::StateFile;

use crate::error::{Error, Result};
use crate::headlink::HeadLink;
use crate::job_manager::{JobConfig, JobManager};
use crate::metrics::{SdTarget, TargetSource};
use crate::node::{self, LocalNode, SessionEvent};
use crate::objects::{objects_group, ObjectConfig, ObjectService};
use crate::protocol::{AgentRequest, Failure, HeadRequest, ObjectCommand};
use crate::scheduler::Effect;
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
    /// Network pulls of one large object a holder serves at once; the other pullers wait
    /// for a copy, so a broadcast spreads as a tree (0: no limit).
    pub object_fanout: usize,
    /// The head's own object store.
    pub objects: ObjectConfig,
    /// The job API and job manager (`None`: no job API).
    pub jobs: Option<JobConfig>,
    /// Port of the head's `/metrics` and Prometheus service discovery (`None`: off).
    pub metrics_port: Option<u16>,
    /// Where the head keeps the cluster's state (`cluster.state`), so that a head started
    /// again on it takes back every node, actor, group and object (`None`: in memory
    /// only; a restarted head starts an empty cluster and workers stop their actors).
    pub state_dir: Option<PathBuf>,
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
            object_fanout: regatta_proto::object::fanout::DEFAULT_PER_SOURCE,
            objects: ObjectConfig::new("127.0.0.1"),
            jobs: Some(JobConfig::new()),
            metrics_port: Some(9180),
            state_dir: None,
        }
    }
}

/// A running head; dropping it does not stop it, [`RunningHead::stop`] does.
pub struct RunningHead {
    actor: ActorRef<Wire>,
    _node: LocalNode,
    _objects: Arc<ObjectService>,
    /// Held while the head runs: one head per state directory.
    _state_lock: Option<std::fs::File>,
    /// The head's cluster address.
    pub address: String,
    /// The job API's address, when it runs.
    pub job_api: Option<SocketAddr>,
    /// The metrics and service-discovery endpoint's address, when it runs.
    pub metrics: Option<SocketAddr>,
    jobs: Option<JobManager>,
}

impl RunningHead {
    /// Stops the head actor.
    pub fn stop(&self) {
        self.actor.stop(None);
    }

    /// Stops every running job: each supervisor is asked to stop its driver (and finishes
    /// that even if this head exits first); waits up to the grace period for their ends.
    pub async fn stop_jobs(&self) {
        if let Some(jobs) = &self.jobs {
            jobs.stop_all().await;
        }
    }
}

/// Starts a head in this process.
///
/// Everything else (head actor, object store, job API, metrics) is up before the cluster
/// port opens, so a worker or client that can join finds a complete head.
pub async fn start_head(config: HeadConfig) -> Result<RunningHead> {
    let name = format!("{}{}", node::HEAD_NAME_PREFIX, node::random_hex(4));
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
    let (state, lock) = match &config.state_dir {
        Some(dir) => {
            let file = StateFile::open(dir, &scope)?;
            let lock = state_file::lock(dir)?;
            let (core, now, seq) = recover(&file, config.heartbeat_timeout_ms, config.object_grace_ms)?;
            // A snapshot of everything recovered, so the log starts empty.
            let encoding = Instant::now();
            let snapshot = file.encode(&core.snapshot(now), seq)?;
            observe_snapshot("recovery", encoding.elapsed(), snapshot.len());
            file.write(&snapshot)?;
            let log = file.start_log()?;
            (
                Some(Recovery {
                    file,
                    log,
                    core,
                    now,
                    seq,
                }),
                Some(lock),
            )
        }
        None => (None, None),
    };
    let (actor, _) = Actor::spawn(
        None,
        Head,
        HeadArgs {
            scope: scope.clone(),
            heartbeat_timeout_ms: config.heartbeat_timeout_ms,
            object_grace_ms: config.object_grace_ms,
            object_fanout: config.object_fanout,
            targets,
            head_target,
            state,
        },
    )
    .await
    .map_err(|e| Error::Actor(format!("cannot start the head actor: {e}")))?;
    node::join_group(&scope, node::HEAD_GROUP, actor.get_cell());
    start_ticker(actor.clone(), config.heartbeat_timeout_ms);
    let link = Arc::new(HeadLink::new(scope.clone(), actor.get_cell(), address.clone()));
    let identity = regatta_object_store::identity_from_token(&config.token)?;
    let objects = ObjectService::start(HEAD_NODE, &identity, config.objects.clone(), link.clone()).await?;
    let (job_api, manager) = match &config.jobs {
        Some(jobs) => {
            let manager = JobManager::open(jobs.clone(), address.clone(), config.token.clone(), link.clone())?;
            manager.resume();
            let bind = SocketAddr::new(config.bind, jobs.http_port);
            let tls = crate::https::server_config(&jobs.tls, &identity)?;
            if tls.is_none() {
                tracing::warn!("THE JOB API SERVES PLAIN HTTP (--insecure): the cluster token, job environments and logs cross the network in cleartext");
            }
            (
                Some(job_api::serve(manager.clone(), link, config.token.clone(), bind, tls).await?),
                Some(manager),
            )
        }
        None => (None, None),
    };
    let manager_for_stop = manager.clone();
    let _ = sources.set((objects.clone(), manager));
    // Isolated: the head never dials the peers its peers name. Workers and clients dial it and
    // each other; a head that dialed them too raced their own connection, and `ractor_cluster`
    // then closed one of two authenticated sessions with requests in flight on it.
    let local = LocalNode::start(&name, &config.token, config.bind, port, &config.advertise_host).await?;
    forward_client_departures(&local, actor.clone());
    tracing::info!(address = %local.address, "head is up");
    Ok(RunningHead {
        job_api,
        jobs: manager_for_stop,
        metrics,
        address: local.address.clone(),
        actor,
        _node: local,
        _objects: objects,
        _state_lock: lock,
    })
}

/// Records how long encoding a snapshot held the head's loop.
fn observe_snapshot(when: &str, took: Duration, bytes: usize) {
    crate::metrics::metrics()
        .head_snapshot_seconds
        .with_label_values(&[when])
        .observe(took.as_secs_f64());
    tracing::info!(
        when,
        bytes,
        millis = took.as_millis() as u64,
        "encoded a snapshot of the cluster's state"
    );
}

/// Sends the head actor its liveness tick, a tenth of the heartbeat timeout apart.
fn start_ticker(head: ActorRef<Wire>, heartbeat_timeout_ms: u64) {
    let tick_every = Duration::from_millis((heartbeat_timeout_ms / 10).clamp(20, 250));
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(tick_every);
        loop {
            interval.tick().await;
            if head.send_message(Wire::Local(LocalSignal::Tick)).is_err() {
                break;
            }
        }
    });
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
    object_fanout: usize,
    targets: Arc<Mutex<Vec<SdTarget>>>,
    head_target: Option<String>,
    /// The state files and what they held at start, when the head keeps its state.
    state: Option<Recovery>,
}

/// A head's state read back at start, and its files, ready to log the next change.
struct Recovery {
    file: StateFile,
    log: state_file::LogWriter,
    core: HeadCore,
    /// The clock to go on from.
    now: u64,
    /// The sequence number of the last change in the snapshot.
    seq: u64,
}

/// The actor's state: the core that decides, and the reply ports of the requests it holds.
struct HeadState {
    scope: String,
    core: HeadCore,
    epoch: Instant,
    ports: BTreeMap<ReplyTo, RpcReplyPort<Vec<u8>>>,
    next_port: u64,
    targets: Arc<Mutex<Vec<SdTarget>>>,
    head_target: Option<String>,
    published_ms: Option<u64>,
    /// The clock of a restored head goes on from the saved one.
    clock_offset_ms: u64,
    persist: Option<Persist>,
}

/// Writing the state down, as a group commit: each change is encoded as a log record,
/// and the records are handed to the writer thread at once, unless a write is under way,
/// in which case the records made meanwhile go together in the next write, when that one
/// is done. Answers to requests that changed the state are held until a write that
/// includes their change is on disk: whatever the head acknowledged, a restarted head
/// knows. Past [`state_file::CHECKPOINT_BYTES`] of log, a snapshot follows the records.
struct Persist {
    file: StateFile,
    writer: tokio::sync::mpsc::UnboundedSender<Write>,
    /// An append is under way.
    writing: bool,
    /// Records not handed to the writer yet.
    pending: Vec<u8>,
    /// Answers waiting for those records.
    held: Vec<(RpcReplyPort<Vec<u8>>, Vec<u8>)>,
    /// The sequence number of the last change recorded.
    seq: u64,
    /// Log bytes handed over since the last snapshot.
    since_checkpoint: u64,
}

/// Work for the writer thread.
enum Write {
    /// Records to append, and the answers to send once they are on disk.
    Append {
        bytes: Vec<u8>,
        answers: Vec<(RpcReplyPort<Vec<u8>>, Vec<u8>)>,
    },
    /// A snapshot including every record appended before it; the log starts afresh.
    Checkpoint(Vec<u8>),
}

impl HeadState {
    fn now_ms(&self) -> u64 {
        self.clock_offset_ms + self.epoch.elapsed().as_millis() as u64
    }

    /// Keeps a reply port until the core answers through its token.
    fn hold(&mut self, port: RpcReplyPort<Vec<u8>>) -> ReplyTo {
        self.next_port += 1;
        let to = ReplyTo(self.next_port);
        self.ports.insert(to, port);
        to
    }

    /// Logs a change (written with the next append).
    fn record(&mut self, change: &ChangeRef<'_>) {
        let Some(persist) = &mut self.persist else { return };
        match persist.file.record(change, persist.seq + 1) {
            Ok(bytes) => {
                persist.seq += 1;
                persist.pending.extend_from_slice(&bytes);
            }
            Err(e) => {
                tracing::error!(error = %e, "could not encode a change of the head's state; a restarted head would miss it")
            }
        }
    }

    /// Sends an answer now, or holds it for the write of the change that made it.
    fn answer(&mut self, port: RpcReplyPort<Vec<u8>>, bytes: Vec<u8>, changed: bool) {
        match &mut self.persist {
            Some(persist) if changed => persist.held.push((port, bytes)),
            _ => {
                let _ = port.send(bytes);
            }
        }
    }

    /// After a change: hands the records to the writer now, or after the write under way.
    fn commit(&mut self) {
        if self.persist.as_ref().is_some_and(|p| !p.writing) {
            self.send_records();
        }
    }

    fn send_records(&mut self) {
        let now = self.now_ms();
        let Some(persist) = &mut self.persist else { return };
        if persist.pending.is_empty() && persist.held.is_empty() {
            return;
        }
        let bytes = std::mem::take(&mut persist.pending);
        persist.since_checkpoint += bytes.len() as u64;
        let answers = std::mem::take(&mut persist.held);
        persist.writing = persist.writer.send(Write::Append { bytes, answers }).is_ok();
        if persist.since_checkpoint >= state_file::CHECKPOINT_BYTES {
            persist.since_checkpoint = 0;
            let encoding = Instant::now();
            match persist.file.encode(&self.core.snapshot(now), persist.seq) {
                Ok(snapshot) => {
                    observe_snapshot("log-full", encoding.elapsed(), snapshot.len());
                    let _ = persist.writer.send(Write::Checkpoint(snapshot));
                }
                Err(e) => tracing::error!(error = %e, "could not encode the head's state; its log keeps growing"),
            }
        }
    }

    /// The writer finished an append: the records made meanwhile go next.
    fn written(&mut self) {
        if let Some(persist) = &mut self.persist {
            persist.writing = false;
        }
        self.send_records();
    }
}

impl Actor for Head {
    type Msg = Wire;
    type State = HeadState;
    type Arguments = HeadArgs;

    async fn post_stop(
        &self,
        _myself: ActorRef<Wire>,
        state: &mut HeadState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        // The writer thread finishes what it was handed; hand it the last records too.
        if let Some(persist) = &mut state.persist {
            let bytes = std::mem::take(&mut persist.pending);
            let answers = std::mem::take(&mut persist.held);
            if !bytes.is_empty() || !answers.is_empty() {
                let _ = persist.writer.send(Write::Append { bytes, answers });
            }
        }
        Ok(())
    }

    async fn pre_start(
        &self,
        myself: ActorRef<Wire>,
        args: HeadArgs,
    ) -> std::result::Result<HeadState, ActorProcessingErr> {
        let (core, clock_offset_ms, persist) = match args.state {
            None => (HeadCore::new(args.heartbeat_timeout_ms, args.object_grace_ms), 0, None),
            Some(Recovery {
                file,
                log,
                core,
                now,
                seq,
            }) => {
                let (writer, writes) = tokio::sync::mpsc::unbounded_channel();
                start_writer(file.clone(), log, writes, myself.clone())?;
                let persist = Persist {
                    file,
                    writer,
                    writing: false,
                    pending: Vec::new(),
                    held: Vec::new(),
                    seq,
                    since_checkpoint: 0,
                };
                (core, now, Some(persist))
            }
        };
        let core = core.with_object_fanout(args.object_fanout);
        Ok(HeadState {
            scope: args.scope,
            core,
            clock_offset_ms,
            persist,
            epoch: Instant::now(),
            ports: BTreeMap::new(),
            next_port: 0,
            targets: args.targets,
            head_target: args.head_target,
            published_ms: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Wire>,
        message: Wire,
        state: &mut HeadState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let now = state.now_ms();
        let mut changed = false;
        let outputs = match message {
            Wire::Call(bytes, port) => match wire::decode::<HeadRequest>(&bytes, "a head request") {
                Ok(request) => {
                    let to = state.hold(port);
                    if let Some(change) = ChangeRef::of(&request, Some(to), now) {
                        state.record(&change);
                        changed = true;
                    }
                    let (kind, started) = (request.name(), std::time::Instant::now());
                    let outputs = state.core.handle(request, Some(to), now);
                    observe_request(kind, started);
                    outputs
                }
                Err(failure) => {
                    tracing::warn!(?failure, "ignored a malformed head request");
                    wire::reply::<()>(port, Err(failure));
                    Vec::new()
                }
            },
            Wire::Cast(bytes) | Wire::Local(LocalSignal::Deferred(bytes)) => {
                match wire::decode::<HeadRequest>(&bytes, "a head request") {
                    Ok(request) => {
                        if let Some(change) = ChangeRef::of(&request, None, now) {
                            state.record(&change);
                            changed = true;
                        }
                        let (kind, started) = (request.name(), std::time::Instant::now());
                        let outputs = state.core.handle(request, None, now);
                        observe_request(kind, started);
                        outputs
                    }
                    Err(failure) => {
                        tracing::warn!(?failure, "ignored a malformed head message");
                        Vec::new()
                    }
                }
            }
            Wire::CallActor(actor, _, port) => {
                let failure = Failure::BadMessage(format!("could not decode a head request: the message is addressed to actor {actor}, which the head does not host"));
                wire::reply::<()>(port, Err(failure));
                Vec::new()
            }
            Wire::CastActor(..) => Vec::new(),
            Wire::Local(LocalSignal::Tick) => {
                // Callers that gave up leave no waiter behind.
                let closed: BTreeSet<ReplyTo> = state
                    .ports
                    .iter()
                    .filter(|(_, port)| port.is_closed())
                    .map(|(to, _)| *to)
                    .collect();
                state.ports.retain(|to, _| !closed.contains(to));
                state.core.forget(|to| closed.contains(&to));
                let (outputs, logged) = state.core.tick_logged(now);
                if let Some(change) = &logged {
                    state.record(&change.as_ref());
                    changed = true;
                }
                publish_metrics(state, now);
                outputs
            }
            Wire::Local(LocalSignal::Written) => {
                state.written();
                Vec::new()
            }
            Wire::Local(_) => Vec::new(),
        };
        for output in outputs {
            match output {
                Output::Reply(to, answer) => {
                    if let Some(port) = state.ports.remove(&to) {
                        state.answer(port, encode_answer(answer), changed);
                    }
                }
                Output::Effect(effect) => carry_out(&myself, &state.scope, effect),
                Output::Release(release) => carry_out_release(&state.scope, release),
                Output::Notice(notice) => log_notice(notice),
            }
        }
        if changed {
            state.commit();
        }
        Ok(())
    }
}

/// The head's core read back from its state files: the snapshot, then the changes logged
/// after it. Returns the core, the clock to go on from and the last change's number.
fn recover(file: &StateFile, heartbeat_timeout_ms: u64, object_grace_ms: u64) -> Result<(HeadCore, u64, u64)> {
    let started = Instant::now();
    let recovered = file.recover()?;
    let restored = recovered.saved.is_some() || !recovered.changes.is_empty();
    let mut clock = recovered.saved.as_ref().map_or(0, Saved::saved_at_ms);
    let mut core = match recovered.saved {
        Some(saved) => HeadCore::restore(saved, heartbeat_timeout_ms, object_grace_ms),
        None => HeadCore::new(heartbeat_timeout_ms, object_grace_ms),
    };
    let replayed = recovered.changes.len();
    for change in recovered.changes {
        clock = clock.max(change.now_ms());
        core.replay(change);
    }
    // One millisecond on, so that nothing restored reads as happening "now".
    let now = clock + 1;
    if recovered.dropped_bytes > 0 {
        tracing::warn!(
            bytes = recovered.dropped_bytes,
            "the head's change log ends in a record cut short (the head stopped while writing it); its request was never answered, and it is dropped"
        );
    }
    if !restored {
        tracing::info!(file = %file.path().display(), "keeping the cluster's state; a head started again on it takes the cluster back");
        return Ok((core, now, recovered.last_seq));
    }
    // The head's own store held its copies in memory: they went with the old process.
    let lost = core.objects_lost_with(HEAD_NODE, now);
    core.await_rejoin(now);
    let status = core.status(now);
    tracing::info!(
        file = %file.path().display(),
        replayed,
        nodes = status.nodes.iter().filter(|n| n.state != "dead").count(),
        actors = status.actors.len(),
        groups = status.groups.len(),
        objects = status.objects.objects,
        millis = started.elapsed().as_millis() as u64,
        "took the cluster's state back; its nodes register again with the actors they run, and nothing new is placed until they have (or time out)"
    );
    if lost > 0 {
        tracing::warn!(objects = lost, "objects held only in the old head's own store are lost");
    }
    Ok((core, now, recovered.last_seq))
}

/// Starts the thread that writes the head's state: appends records and flushes them, then
/// sends the answers they made durable and tells the head it is done; writes snapshots
/// and empties the log. A failed write is logged loudly and the answers go out anyway:
/// the head keeps serving, at the risk the log names.
fn start_writer(
    file: StateFile,
    mut log: state_file::LogWriter,
    mut writes: tokio::sync::mpsc::UnboundedReceiver<Write>,
    head: ActorRef<Wire>,
) -> std::result::Result<(), ActorProcessingErr> {
    std::thread::Builder::new()
        .name("regatta-head-state".into())
        .spawn(move || {
            let mut failing = false;
            while let Some(write) = writes.blocking_recv() {
                match write {
                    Write::Append { bytes, answers } => {
                        match log.append(&bytes) {
                            Ok(()) if failing => {
                                tracing::info!(file = %file.path().display(), "the head's state is written again");
                                failing = false;
                            }
                            Ok(()) => {}
                            Err(e) if !failing => {
                                tracing::error!(error = %e, "could not write the head's state; a restarted head would miss the latest changes (tried again with the next)");
                                failing = true;
                            }
                            Err(_) => {}
                        }
                        for (port, answer) in answers {
                            let _ = port.send(answer);
                        }
                        if head.send_message(Wire::Local(LocalSignal::Written)).is_err() {
                            break;
                        }
                    }
                    Write::Checkpoint(snapshot) => match file.write(&snapshot) {
                        Ok(()) => {
                            if let Err(e) = log.truncate() {
                                tracing::error!(error = %e, "could not empty the head's change log after a snapshot");
                            }
                        }
                        // The log still holds everything: keep it.
                        Err(e) => tracing::error!(error = %e, "could not write a snapshot of the head's state; its log keeps growing"),
                    },
                }
            }
        })
        .map(|_| ())
        .map_err(|e| ActorProcessingErr::from(format!("cannot start the head's state writer: {e}")))
}

/// Encodes an answer as the `Result<T, Failure>` its caller decodes.
fn encode_answer(answer: Answer) -> Vec<u8> {
    match answer {
        Answer::Registered(r) => wire::encode(&r),
        Answer::Heartbeat(known) => wire::encode(&Ok::<bool, Failure>(known)),
        Answer::Spawned(r) => wire::encode(&r),
        Answer::Actor(r) => wire::encode(&r),
        Answer::Named(view) => wire::encode(&Ok::<_, Failure>(view)),
        Answer::GroupCreated(r) => wire::encode(&r),
        Answer::GroupPlaced(r) => wire::encode(&r),
        Answer::Status(status) => wire::encode(&Ok::<_, Failure>(*status)),
        Answer::View(view) => wire::encode(&Ok::<_, Failure>(*view)),
        Answer::Location(r) => wire::encode(&r),
        Answer::Done(r) => wire::encode(&r),
    }
}

fn log_notice(notice: Notice) {
    match notice {
        Notice::NodeJoined {
            node,
            address,
            resources,
            kinds,
            kept,
            stopped,
        } => {
            tracing::info!(node = %node, address = %address, resources = %resources, kinds = ?kinds, kept, stopped, "node joined")
        }
        Notice::RegistrationRefused(failure) => tracing::warn!(?failure, "refused a node's registration"),
        Notice::NodeDead {
            node,
            cause,
            objects_lost,
        } => {
            tracing::warn!(node = %node, cause = %cause, "node declared dead; its actors restart elsewhere or are reported dead");
            if objects_lost > 0 {
                tracing::warn!(node = %node, objects = objects_lost, "objects lost with their node");
            }
        }
        Notice::StartFailed { actor, cause } => tracing::warn!(%actor, cause = %cause, "actor failed to start"),
        Notice::Exited { actor, cause } => tracing::warn!(%actor, cause = %cause, "actor exited"),
        Notice::ObjectRefused(failure) => tracing::warn!(?failure, "refused an object registration"),
        Notice::ObjectsGone { node, objects } => {
            tracing::warn!(node = %node, objects, "the node registered without objects whose only copy it held; they are lost")
        }
    }
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
            // No session to the node: it is lost, and the actor never ran there.
            let report = HeadRequest::Undelivered {
                actor: start.actor,
                attempt: start.attempt,
                cause: format!("node {node}'s agent is not reachable"),
            };
            let _ = head.send_message(Wire::Local(LocalSignal::Deferred(wire::encode(&report))));
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
    let status = state.core.status(now);
    crate::metrics::metrics().publish_cluster(&status, &state.core.scheduler().heartbeat_ages(now));
    let mut targets: Vec<SdTarget> = state
        .core
        .scheduler()
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

/// Records how long the head's core took for one request.
fn observe_request(kind: &str, started: std::time::Instant) {
    crate::metrics::metrics()
        .head_request_seconds
        .with_label_values(&[kind])
        .observe(started.elapsed().as_secs_f64());
}
