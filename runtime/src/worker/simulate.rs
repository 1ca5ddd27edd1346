//! Simulated nodes for scale tests: many node agents in one process, each joining for a
//! certificate of its own, then registering, heartbeating and starting actors over the
//! process's one real session to the head,
//! exactly as a worker's agent does (the same [`Agent`] and membership loop), without an
//! object store or a metrics endpoint. `regatta bench scale` runs a few such processes.

use std::future::Future;

use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;

use super::{join_with_retry, keep_membership};
use crate::client::Cluster;
use crate::error::{Error, Result};
use crate::net::calls::CallPlane;
use crate::net::headlink::HeadLink;
use crate::net::node::{self, LocalNode};
use crate::net::trust::{self, JoinCredentials};
use crate::worker::agent::{start_agent, AgentArgs};
use crate::worker::registry::Registry;
use regatta_net::Role;
use regatta_proto::NodeInfo;
use regatta_proto::Resources;

/// How many simulated nodes one process runs, and what each declares.
#[derive(Clone, Debug)]
pub struct SimulatedNodes {
    /// The head's cluster address, `host:port`.
    pub head_address: String,
    /// The join token.
    pub token: String,
    /// Node names are `<prefix>-<index>` (index from `first`).
    pub prefix: String,
    /// The first index.
    pub first: usize,
    /// How many nodes.
    pub count: usize,
    /// What each node declares.
    pub resources: Resources,
    /// Interval between each node's heartbeats.
    pub heartbeat_interval_ms: u64,
}

/// Joins one simulator process runs at once (for its nodes' certificates).
const JOINS_AT_ONCE: usize = 8;

/// The name of simulated node `index`.
pub fn simulated_name(prefix: &str, index: usize) -> String {
    format!("{prefix}-{index:05}")
}

/// Runs the simulated nodes until `shutdown` resolves (or a node is refused).
pub async fn run_simulated_nodes(
    config: SimulatedNodes,
    registry: Registry,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    regatta_proto::validate_capacity(&config.resources).map_err(|why| Error::BadResources {
        input: config.resources.to_string(),
        reason: why.to_string(),
    })?;
    let host = "127.0.0.1".to_string();
    let session = format!("{}-{}-{}", config.prefix, config.first, node::random_hex(3));
    let credentials = JoinCredentials::parse(&config.token, None)?;
    let identity = trust::join_with_retry(&config.head_address, &credentials, &Role::Node(session.clone())).await?;
    let renewal = trust::keep_renewed(config.head_address.clone(), identity.clone());
    let local = LocalNode::start(&session, &identity, None, "127.0.0.1".parse().expect("an IP"), 0, &host).await?;
    let head = join_with_retry(&local, &config.head_address).await?;
    let link =
        Arc::new(HeadLink::new(local.scope().to_string(), head, config.head_address.clone()).with_peers(local.peers()));
    let cluster = Cluster::new(link, None, CallPlane::session_only());
    // Each simulated node joins for a certificate of its own, as a worker does (the head
    // checks a token and issues a certificate per node); they then share this process's
    // session. A few joins at once, as many workers starting together would.
    let names: Vec<String> = (config.first..config.first + config.count)
        .map(|index| simulated_name(&config.prefix, index))
        .collect();
    futures::stream::iter(names)
        .map(|name| {
            let (address, credentials) = (config.head_address.clone(), credentials.clone());
            async move { trust::join_with_retry(&address, &credentials, &Role::Node(name)).await }
        })
        .buffer_unordered(JOINS_AT_ONCE)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    let mut members = Vec::with_capacity(config.count);
    for index in config.first..config.first + config.count {
        let name = simulated_name(&config.prefix, index);
        let args = AgentArgs {
            node: name.clone(),
            host: host.clone(),
            registry: registry.clone(),
            cluster: cluster.clone(),
            routes: Default::default(),
            // Simulated nodes are reached through the sessions only.
            call_address: None,
        };
        let agent = start_agent(local.scope(), args).await?;
        let info = NodeInfo {
            name,
            address: local.address.clone(),
            resources: config.resources.clone(),
            kinds: registry.kinds(),
            pid: std::process::id(),
            metrics_address: None,
        };
        members.push((agent, info));
    }
    // Staggered like independent machines, not all heartbeating in the same instant.
    let (local, cluster, interval_ms) = (&local, &cluster, config.heartbeat_interval_ms);
    let trust = (&identity, &renewal);
    let count = members.len().max(1) as u64;
    let loops = members.iter().enumerate().map(|(i, (agent, info))| async move {
        tokio::time::sleep(std::time::Duration::from_millis(interval_ms * i as u64 / count)).await;
        keep_membership(local, cluster, agent, info, interval_ms, trust).await
    });
    tokio::select! {
        results = futures::future::join_all(loops) => results.into_iter().collect::<Result<Vec<()>>>().map(|_| ()),
        () = shutdown => {
            for (agent, _) in &members {
                agent.stop(None);
            }
            Ok(())
        }
    }
}
