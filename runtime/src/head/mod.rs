//! The head node: a thin actor shell around [`HeadCore`], the state machine that decides.
//! It decodes requests, holds the reply ports of those the core parks, runs the liveness
//! timer, and carries out the core's outputs: answers, starts and stops sent to node
//! agents, object releases, log lines.

mod actor;
mod api;
mod dashboard;
pub(crate) mod job_api;
pub(crate) mod job_manager;
pub(crate) mod job_store;
mod login;
mod outputs;
mod persist;
mod state_file;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ractor::{Actor, ActorRef};
use regatta_proto::HeadRequest;

use crate::error::{Error, Result};
use crate::head::job_manager::{JobConfig, JobManager};
use crate::metrics::{SdTarget, TargetSource};
use crate::net::headlink::HeadLink;
use crate::net::node::{self, LocalNode, SessionEvent};
use crate::net::trust::HeadTrust;
use crate::net::wire::{self, LocalSignal, Wire};
use crate::objects::{ObjectConfig, ObjectService};
use actor::{Head, HeadArgs};

/// How a head runs.
#[derive(Clone, Debug)]
pub struct HeadConfig {
    /// Address to listen on.
    pub bind: IpAddr,
    /// Cluster port.
    pub port: u16,
    /// Host name or IP that others use to reach this head.
    pub advertise_host: String,
    /// The bootstrap join token (`<id>.<secret>`): joiners holding it are issued a
    /// certificate; also the job API's admin credential.
    pub token: String,
    /// Where the cluster's certificate authority is kept (`None`: `<state_dir>/ca` when
    /// there is a state directory, else an authority for this run alone, so a restarted
    /// head is a new cluster whose nodes must join again).
    pub ca_dir: Option<PathBuf>,
    /// How long the certificates issued at joins and renewals are valid (each process
    /// renews its own when two thirds of that have passed).
    pub cert_lifetime: Duration,
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
            ca_dir: None,
            cert_lifetime: regatta_net::CERT_LIFETIME,
            heartbeat_timeout_ms: 3_000,
            object_grace_ms: 10_000,
            object_fanout: regatta_proto::DEFAULT_FANOUT_PER_SOURCE,
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
    /// The cluster's identity: its authority's hash, which joiners may pin.
    pub cluster: regatta_net::CaHash,
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

/// The names the head's HTTPS certificate carries besides its own, so that a browser
/// trusting the cluster's authority (`regatta ca`) reaches the dashboard without a warning:
/// the advertised host, the job API's address when it is a specific one, and this
/// machine's loopback names (for port forwards and tunnels).
fn web_names(config: &HeadConfig) -> Vec<String> {
    let mut names = vec![config.advertise_host.clone()];
    if let Some(bind) = config.jobs.as_ref().and_then(|jobs| jobs.http_bind) {
        if !bind.is_unspecified() {
            names.push(bind.to_string());
        }
    }
    names.extend(["localhost", "127.0.0.1", "::1"].map(str::to_string));
    names.retain(|name| {
        let usable = tokio_rustls::rustls::pki_types::ServerName::try_from(name.as_str()).is_ok();
        if !usable {
            tracing::warn!(name = %name, "the HTTPS certificate cannot name this host (not a host name or an IP address)");
        }
        usable
    });
    // (A name given twice is issued once: `issue_https` skips repeats.)
    names
}

/// Starts a head in this process.
///
/// Everything else (head actor, object store, job API, metrics) is up before the cluster
/// port opens, so a worker or client that can join finds a complete head.
pub async fn start_head(config: HeadConfig) -> Result<RunningHead> {
    let name = format!("{}{}", node::HEAD_NAME_PREFIX, node::random_hex(4));
    let bootstrap = config
        .token
        .parse::<regatta_net::JoinToken>()
        .map_err(|e| Error::Token(e.to_string()))?;
    let ca_dir = config
        .ca_dir
        .clone()
        .or_else(|| config.state_dir.as_ref().map(|dir| dir.join("ca")));
    let trust = HeadTrust::open(ca_dir.as_deref(), &bootstrap, config.cert_lifetime, &web_names(&config))?;
    let identity = trust.identity.clone();
    let scope = node::scope_for(&identity.cluster);
    let port = if config.port == 0 {
        node::free_port(config.bind)?
    } else {
        config.port
    };
    let address = format!("{}:{port}", config.advertise_host);
    let targets: Arc<Mutex<Vec<SdTarget>>> = Arc::new(Mutex::new(Vec::new()));
    let sources: Arc<OnceLock<Sources>> = Arc::new(OnceLock::new());
    let metrics = serve_metrics(&config, &targets, &sources).await?;
    let head_target = metrics.map(|m| format!("{}:{}", config.advertise_host, m.port()));
    let (state, lock) = match &config.state_dir {
        Some(dir) => {
            let (recovery, lock) = persist::open(dir, &scope, &config)?;
            // The nodes removed before the restart stay refused at the handshake.
            trust
                .desk
                .removed
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(recovery.core.scheduler().removed_nodes().map(str::to_string));
            (Some(recovery), Some(lock))
        }
        None => (None, None),
    };
    let args = HeadArgs {
        scope: scope.clone(),
        heartbeat_timeout_ms: config.heartbeat_timeout_ms,
        object_grace_ms: config.object_grace_ms,
        object_fanout: config.object_fanout,
        targets,
        head_target,
        state,
    };
    let (actor, _) = Actor::spawn(None, Head, args)
        .await
        .map_err(|e| Error::Actor(format!("cannot start the head actor: {e}")))?;
    node::join_group(&scope, node::HEAD_GROUP, actor.get_cell());
    start_ticker(actor.clone(), config.heartbeat_timeout_ms);
    let link = Arc::new(HeadLink::new(scope.clone(), actor.get_cell(), address.clone()));
    // Heartbeats of nodes that trust other authorities (a rotation under way across a
    // restart) are answered with a request to renew.
    link.ask::<()>(
        &regatta_proto::HeadRequest::Trust(trust.desk.authorities().fingerprint()),
        Duration::from_secs(10),
    )
    .await?;
    let objects = ObjectService::start(HEAD_NODE, &identity, config.objects.clone(), link.clone()).await?;
    let (job_api, manager) = match &config.jobs {
        Some(jobs) => {
            let (bound, manager) = start_jobs(&config, jobs, &address, link, &identity, trust.desk.clone()).await?;
            (Some(bound), Some(manager))
        }
        None => (None, None),
    };
    let manager_for_stop = manager.clone();
    let _ = sources.set((objects.clone(), manager));
    // Isolated: the head never dials the peers its peers name. Workers and clients dial it and
    // each other; a head that dialed them too raced their own connection, and `ractor_cluster`
    // then closed one of two authenticated sessions with requests in flight on it.
    let local = LocalNode::start(
        &name,
        &identity,
        Some(trust.desk.clone()),
        config.bind,
        port,
        &config.advertise_host,
    )
    .await?;
    forward_client_departures(&local, actor.clone());
    tracing::info!(address = %local.address, cluster = %identity.cluster, "head is up");
    Ok(RunningHead {
        job_api,
        jobs: manager_for_stop,
        metrics,
        address: local.address.clone(),
        cluster: identity.cluster,
        actor,
        _node: local,
        _objects: objects,
        _state_lock: lock,
    })
}

/// What the head's metrics endpoint reads its per-process figures from, once they exist.
type Sources = (Arc<ObjectService>, Option<JobManager>);

/// Serves `/metrics` and the discovery targets when the head has a metrics port.
async fn serve_metrics(
    config: &HeadConfig,
    targets: &Arc<Mutex<Vec<SdTarget>>>,
    sources: &Arc<OnceLock<Sources>>,
) -> Result<Option<SocketAddr>> {
    let Some(port) = config.metrics_port else {
        return Ok(None);
    };
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
    let bound = crate::metrics::serve(SocketAddr::new(config.bind, port), Some(refresh), Some(source)).await?;
    Ok(Some(bound))
}

/// Opens the job manager (taking back the jobs a previous head left running) and serves
/// the job API; returns its bound address.
async fn start_jobs(
    config: &HeadConfig,
    jobs: &JobConfig,
    address: &str,
    link: Arc<HeadLink>,
    identity: &regatta_net::TlsIdentity,
    desk: Arc<regatta_net::JoinDesk>,
) -> Result<(SocketAddr, JobManager)> {
    let manager = JobManager::open(jobs.clone(), address.to_string(), desk.clone(), link.clone())?;
    manager.resume();
    let bind = SocketAddr::new(jobs.http_bind.unwrap_or(config.bind), jobs.http_port);
    let tls = crate::net::https::server_config(&jobs.tls, identity)?;
    if tls.is_none() {
        tracing::warn!("THE JOB API SERVES PLAIN HTTP (--insecure): the cluster token, job environments and logs cross the network in cleartext");
    }
    let bound = job_api::serve(manager.clone(), link, config.token.clone(), bind, tls, desk).await?;
    Ok((bound, manager))
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
