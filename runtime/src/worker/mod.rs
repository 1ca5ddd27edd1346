//! A worker process: joins the head (retrying until it is up), runs the node agent,
//! registers its resources and kinds, and keeps the head informed with heartbeats.

pub(crate) mod agent;
pub(crate) mod detect;
pub mod python;
pub(crate) mod registry;
pub(crate) mod router;
pub(crate) mod simulate;

use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

use ractor::ActorRef;

use crate::worker::agent::{start_agent, AgentArgs};
use std::sync::Arc;

use crate::client::Cluster;
use crate::error::{Error, Result};
use crate::net::calls::Routes;
use crate::net::calls::{CallCounters, CallPath, CallPlane, CallServer, CallTls};
use crate::net::headlink::HeadLink;
use crate::net::node::{self, LocalNode};
use crate::net::trust::{self, JoinCredentials};
use crate::net::wire::{self, LocalSignal, Wire};
use crate::objects::{ObjectConfig, ObjectService};
use crate::worker::registry::Registry;
use regatta_net::Role;
use regatta_proto::Resources;
use regatta_proto::{AgentRequest, Beat, Failure, HeadRequest, NodeInfo, Registration, RunningActor};

/// How a worker runs.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// The head's cluster address, `host:port`.
    pub head_address: String,
    /// This node's name (default: `worker-<random>`).
    pub name: Option<String>,
    /// Address to listen on.
    pub bind: IpAddr,
    /// Cluster port (0: any free port).
    pub port: u16,
    /// Host others use to reach this worker (default: this machine's address towards the head).
    pub advertise_host: Option<String>,
    /// The join token (`<id>.<secret>`), traded at the head for this node's certificate.
    pub token: String,
    /// The cluster authority's hash the head must hold (`None`: [`crate::CA_HASH_ENV`]
    /// when set, else the head proves the token's secret only).
    pub ca_hash: Option<String>,
    /// Declared resources; each overrides the detected amount of the same name.
    pub resources: Resources,
    /// Interval between heartbeats.
    pub heartbeat_interval_ms: u64,
    /// Object store settings (capacity, spill location, UDP port); its advertised host is
    /// the worker's.
    pub objects: ObjectConfig,
    /// Port of this worker's `/metrics` (0: any free port; `None`: no endpoint).
    pub metrics_port: Option<u16>,
    /// TCP port of this worker's actor call channel (0: any free port; `None`: no
    /// channel, callers go through the cluster sessions).
    pub call_port: Option<u16>,
}

impl WorkerConfig {
    /// Defaults for joining `head_address`.
    pub fn new(head_address: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            head_address: head_address.into(),
            name: None,
            bind: IpAddr::from([0, 0, 0, 0]),
            port: 0,
            advertise_host: None,
            token: token.into(),
            ca_hash: None,
            resources: Resources::new(),
            heartbeat_interval_ms: 500,
            objects: ObjectConfig::new("127.0.0.1"),
            metrics_port: Some(0),
            call_port: Some(0),
        }
    }
}

/// Serves the node's call channel when the worker has a call port, counting into this
/// process's metrics.
async fn serve_calls(
    config: &WorkerConfig,
    host: &str,
    tls: &CallTls,
    name: &str,
    routes: &Routes,
) -> Result<Option<CallServer>> {
    let Some(port) = config.call_port else {
        return Ok(None);
    };
    let messages = &crate::metrics::metrics().call_channel_messages;
    let counters = CallCounters {
        calls: messages.with_label_values(&["call"]),
        casts: messages.with_label_values(&["cast"]),
    };
    let server = CallServer::start(config.bind, port, host, tls, name.to_string(), routes.clone(), counters).await?;
    Ok(Some(server))
}

/// Serves `/metrics` when the worker has a metrics port; returns where Prometheus reaches it.
async fn serve_metrics(
    config: &WorkerConfig,
    host: &str,
    name: &str,
    store: Arc<ObjectService>,
) -> Result<Option<String>> {
    let Some(port) = config.metrics_port else {
        return Ok(None);
    };
    let node = name.to_string();
    let refresh: Arc<dyn Fn() + Send + Sync> =
        Arc::new(move || crate::metrics::metrics().publish_objects(&node, &store.stats()));
    let bound = crate::metrics::serve(std::net::SocketAddr::new(config.bind, port), Some(refresh), None).await?;
    Ok(Some(format!("{host}:{}", bound.port())))
}

/// Runs a worker until `shutdown` resolves. Fails at once on a refused token; an
/// unreachable head is retried.
pub async fn run_worker(config: WorkerConfig, registry: Registry, shutdown: impl Future<Output = ()>) -> Result<()> {
    // Every worker can host a job's driver placed by its entrypoint resources.
    let registry = registry.register::<crate::jobs::driver::JobDriver>();
    // And Python actors and tasks (the `regatta` Python package).
    let registry = registry.register::<python::PythonActor>();
    let mut resources = detect::detect_resources();
    resources.override_with(&config.resources);
    regatta_proto::validate_capacity(&resources).map_err(|why| Error::BadResources {
        input: resources.to_string(),
        reason: why.to_string(),
    })?;
    let name = config
        .name
        .clone()
        .unwrap_or_else(|| format!("worker-{}", node::random_hex(3)));
    let host = config
        .advertise_host
        .clone()
        .unwrap_or_else(|| node::route_to(&config.head_address));
    // The session name is unique per process so a restarted worker is never mistaken for
    // the old session the head may still hold open.
    // `node::node_of_session` reads the node back from this name: keep them in step.
    let session = format!("{name}-{}", node::random_hex(3));
    // How fast large objects go into shared memory here is the host's choice: say which.
    let huge = regatta_object_store::SharedHugePages::of_this_host();
    tracing::info!(
        node = %name,
        shmem_huge_pages = huge.name(),
        "shared memory huge pages: {}",
        match huge {
            regatta_object_store::SharedHugePages::Never =>
                "none (transparent_hugepage/shmem_enabled); large objects are written into 4 KiB pages, several times slower than a copy; `advise` lets Regatta use huge pages (docs/PYTHON.md)",
            _ => "in use for large objects",
        }
    );
    let credentials = JoinCredentials::parse(&config.token, config.ca_hash.as_deref())?;
    let identity = trust::join_with_retry(&config.head_address, &credentials, &Role::Node(name.clone())).await?;
    let renewal = trust::keep_renewed(config.head_address.clone(), identity.clone());
    let local = LocalNode::start(&session, &identity, None, config.bind, config.port, &host).await?;
    let head = join_with_retry(&local, &config.head_address).await?;
    let link =
        Arc::new(HeadLink::new(local.scope().to_string(), head, config.head_address.clone()).with_peers(local.peers()));
    let mut objects = config.objects.clone();
    objects.advertise_host = host.clone();
    objects.bind = config.bind;
    let store = ObjectService::start(&name, &identity, objects, link.clone()).await?;
    let tls = CallTls::new(&identity);
    let cluster = Cluster::new(
        link,
        Some(store.clone()),
        CallPlane::new(tls.clone(), CallPath::from_env()?),
    );
    let routes = Routes::default();
    let calls = serve_calls(&config, &host, &tls, &name, &routes).await?;
    let metrics_address = serve_metrics(&config, &host, &name, store).await?;
    let info = NodeInfo {
        name: name.clone(),
        address: local.address.clone(),
        resources,
        kinds: registry.kinds(),
        pid: std::process::id(),
        metrics_address,
    };
    let args = AgentArgs {
        node: name.clone(),
        host: host.clone(),
        registry,
        cluster: cluster.clone(),
        routes,
        call_address: calls.as_ref().map(|server| server.address().clone()),
    };
    let agent = start_agent(local.scope(), args).await?;

    tokio::select! {
        result = keep_membership(&local, &cluster, &agent, &info, config.heartbeat_interval_ms, (&identity, &renewal)) => result,
        () = shutdown => {
            tracing::info!(node = %name, "worker shutting down");
            agent.stop(None);
            Ok(())
        }
    }
}

async fn join_with_retry(local: &LocalNode, head_address: &str) -> Result<ractor::ActorCell> {
    let mut warned = false;
    let mut backoff = Duration::from_millis(50);
    loop {
        match local.join(head_address).await {
            Ok(head) => return Ok(head),
            Err(refused @ Error::TokenRefused { .. }) => return Err(refused),
            Err(e) => {
                if !warned {
                    tracing::warn!(error = %e, "head not reachable yet; retrying");
                    warned = true;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Registers, then heartbeats forever; registers again, reporting the actors it runs,
/// when the head does not know this node (it restarted, or declared the node dead), and
/// reconnects when the session to the head is lost. Actors keep running meanwhile: only
/// those the head's answer names are stopped.
async fn keep_membership(
    local: &LocalNode,
    cluster: &Cluster,
    agent: &ActorRef<Wire>,
    info: &NodeInfo,
    interval_ms: u64,
    (identity, renewal): (&regatta_net::TlsIdentity, &trust::RenewalGuard),
) -> Result<()> {
    let interval = Duration::from_millis(interval_ms.max(10));
    let mut incarnation: Option<u64> = None;
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        if node::first_member(cluster.scope(), node::HEAD_GROUP).is_none() {
            match local.rejoin(cluster.head_address()).await {
                Ok(_) => tracing::info!("reconnected to the head"),
                Err(refused @ Error::TokenRefused { .. }) => return Err(refused),
                Err(_) => continue,
            }
        }
        let Some(current) = incarnation else {
            match register(cluster, agent, info, interval * 4).await {
                Ok(number) => incarnation = Some(number),
                Err(refused @ Error::Rejected(_)) => return Err(refused),
                Err(e) => tracing::warn!(error = %e, "registration failed; retrying"),
            }
            continue;
        };
        let removed_known = local
            .removed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        let beat = HeadRequest::Heartbeat {
            node: info.name.clone(),
            incarnation: current,
            removed_known,
            trust: identity.trust.fingerprint(),
        };
        match cluster.ask_head::<Beat>(&beat, interval * 4).await {
            Ok(beat) => {
                if let Some(names) = beat.removed {
                    refuse_removed(&local.removed, names);
                }
                if beat.renew {
                    // Asked at each beat until the head sees the new trust (a failed
                    // renewal is tried again at the next).
                    tracing::info!("the cluster's authorities changed: renewing this node's certificate now");
                    renewal.renew_now();
                }
                if !beat.known {
                    tracing::warn!(node = %info.name, "the head does not know this node (it restarted, or lost this node for a while); registering again with the actors it runs");
                    incarnation = None;
                }
            }
            Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
        }
    }
}

/// Adds the nodes the head names as removed to those whose certificates this process's
/// TLS listeners refuse (sessions, calls, object transfers).
fn refuse_removed(removed: &regatta_net::RemovedNodes, names: Vec<String>) {
    let mut removed = removed.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    for name in names {
        if removed.insert(name.clone()) {
            tracing::warn!(node = %name, "node removed from the cluster: its certificate is refused here from now on");
        }
    }
}

/// One registration: reports what the agent runs and stops what the head does not want.
async fn register(cluster: &Cluster, agent: &ActorRef<Wire>, info: &NodeInfo, timeout: Duration) -> Result<u64> {
    let running: Vec<RunningActor> =
        match wire::call_raw(&agent.get_cell(), wire::encode(&AgentRequest::Running), timeout).await {
            Ok(bytes) => {
                wire::decode::<std::result::Result<Vec<RunningActor>, Failure>>(&bytes, "the agent's actor list")
                    .and_then(|r| r)
                    .map_err(|f| Error::Actor(format!("the node agent did not list its actors: {f:?}")))?
            }
            Err(wire::CallError::Unreachable(why) | wire::CallError::NotSent(why)) => {
                return Err(Error::Actor(format!("the node agent did not list its actors: {why}")))
            }
            Err(wire::CallError::Timeout) => {
                return Err(Error::Actor(format!(
                    "the node agent did not list its actors within {timeout:?}"
                )))
            }
        };
    let registration: Registration = cluster
        .ask_head(&HeadRequest::Register(info.clone(), running.clone()), timeout)
        .await?;
    if !registration.stop.is_empty() {
        tracing::warn!(node = %info.name, stopped = registration.stop.len(), "the head does not want some reported actors running here; stopping them");
        let _ = agent.send_message(Wire::Local(LocalSignal::Unwanted(registration.stop.clone())));
    }
    // The object copies held here, so that the directory knows where objects are
    // (simulated nodes have no object store).
    if let Ok(store) = cluster.object_service() {
        let store = store.clone();
        let (node, address) = store.location();
        let (node, address) = (node.to_string(), address.to_string());
        // Checksums of a full store take a while: off the async threads.
        let objects = tokio::task::spawn_blocking(move || store.held())
            .await
            .map_err(|e| Error::Actor(format!("could not list the objects held here: {e}")))?;
        let held = HeadRequest::ObjectsHeld { node, address, objects };
        // Not fatal like a refused registration: the next attempt registers again.
        cluster
            .ask_head::<()>(&held, timeout)
            .await
            .map_err(|e| Error::Actor(format!("could not report the objects held here: {e}")))?;
    }
    tracing::info!(
        node = %info.name,
        resources = %info.resources,
        kept = running.len() - registration.stop.len(),
        "registered with the head"
    );
    Ok(registration.incarnation)
}
