//! [`Cluster`], the handle drivers and actors share (spawn by spec, kill, look at actors,
//! reserve placement groups, ask the head), and [`ActorOptions`].

use std::sync::Arc;
use std::time::Duration;

use ractor::ActorCell;
use serde::de::DeserializeOwned;

use crate::error::{failure_to_error, Error, Result};
use crate::net::calls::{CallPath, CallPlane, Target};
use crate::net::headlink::HeadLink;
use crate::net::node;
use crate::net::wire::{self, CallError};
use crate::objects::ObjectService;
use regatta_proto::LogLine;
use regatta_proto::Resources;
use regatta_proto::RunPoint;
use regatta_proto::Strategy;
use regatta_proto::{
    ActorId, ActorView, AgentRequest, BundleRef, ClusterStatus, Failure, GroupId, GroupSpec, HeadRequest,
};
use regatta_proto::{View, ViewQuery};

/// Default time a call waits for its reply.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Options for spawning an actor.
#[derive(Clone, Debug, Default)]
pub struct ActorOptions {
    pub(super) resources: Resources,
    pub(super) name: Option<String>,
    pub(super) max_restarts: u32,
    pub(super) placement: Option<BundleRef>,
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

    /// Places the actor in bundle `bundle` of the group with id `group`.
    pub(crate) fn in_bundle(mut self, group: GroupId, bundle: usize) -> Self {
        self.placement = Some(BundleRef {
            group,
            bundle: Some(bundle),
        });
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
    pub(super) link: Arc<HeadLink>,
    objects: Option<Arc<ObjectService>>,
    /// How calls reach actors (shared by every clone).
    pub(super) calls: Arc<CallPlane>,
    pub(super) call_timeout: Duration,
    pub(super) job: Option<String>,
}

impl Cluster {
    pub(crate) fn new(link: Arc<HeadLink>, objects: Option<Arc<ObjectService>>, calls: CallPlane) -> Self {
        Self {
            link,
            objects,
            calls: Arc::new(calls),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            job: None,
        }
    }

    /// The same cluster, with actors and objects created through it belonging to `job`
    /// (they are cleaned up when the job ends).
    pub fn with_job(&self, job: Option<String>) -> Self {
        Self { job, ..self.clone() }
    }

    /// The same cluster, with actor calls through it sent by `path` whatever
    /// [`crate::CALL_PATH_ENV`] says (new connections; to compare the two paths in one
    /// process). A status-only client's handle keeps the session path.
    pub fn with_call_path(&self, path: CallPath) -> Self {
        Self {
            calls: Arc::new(self.calls.with_path(path)),
            ..self.clone()
        }
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

    /// The whole cluster's state, in one answer (see [`Cluster::status_page`] for large
    /// clusters).
    pub async fn status(&self) -> Result<ClusterStatus> {
        self.ask_head(&HeadRequest::Status, self.call_timeout).await
    }

    /// The cluster's state with at most `limit` actors of ids above `after`; nodes, groups
    /// and pending requests only on the first page (`after` = `None`). Fewer than `limit`
    /// actors means the last page.
    pub async fn status_page(&self, after: Option<ActorId>, limit: u32) -> Result<ClusterStatus> {
        self.ask_head(&HeadRequest::StatusPage { after, limit }, self.call_timeout)
            .await
    }

    /// A page of the cluster's state, as the dashboard reads it.
    pub async fn view(&self, query: ViewQuery) -> Result<View> {
        self.ask_head(&HeadRequest::View(query), self.call_timeout).await
    }

    /// Reports a point of a training or scoring run to the head's dashboard; never waits
    /// and never fails the caller (a lost point is a gap in a chart).
    pub fn report_run(&self, point: RunPoint) {
        self.link.tell(&HeadRequest::RunReport(point));
    }

    /// The first member of `node`'s process group `group` (`router/<node>`,
    /// `agent/<node>`), waiting up to `wait`; opens a session to the node at `address`
    /// first when this process has none (sessions between nodes are opened on first use).
    pub(crate) async fn node_member(
        &self,
        node: &str,
        group: &str,
        address: Option<&str>,
        wait: Duration,
    ) -> Option<ActorCell> {
        if node::first_member(self.scope(), group).is_none() {
            if let Some(address) = address {
                self.link.reach(node, address);
            }
        }
        node::wait_member(self.scope(), group, wait).await
    }

    /// `node`'s address from the head when this process sees no member of its `group`
    /// yet (no session to that node: [`Cluster::node_member`] opens one).
    async fn address_to_reach(&self, node: &str, group: &str) -> Result<Option<String>> {
        if node::first_member(self.scope(), group).is_some() {
            return Ok(None);
        }
        let status = self.status().await?;
        Ok(status.nodes.into_iter().find(|n| n.name == node).map(|n| n.address))
    }

    /// The node the actor runs (or last ran) on and its log lines there after line number
    /// `after` (0: all it keeps; numbers are the node's own), asked of that node's agent:
    /// what a driver follows of a long call. No node and no lines while the actor is not
    /// placed yet.
    pub async fn actor_logs(&self, id: ActorId, after: u64) -> Result<(Option<String>, Vec<LogLine>)> {
        const WAIT: Duration = Duration::from_secs(5);
        let row = match self.view(ViewQuery::Actor(id)).await? {
            View::Actor(Some(row)) => row,
            _ => {
                return Err(Error::Rejected(format!(
                    "no actor {id} (dead actors are kept for a while only)"
                )))
            }
        };
        let Some(node) = row.node.or(row.last_node) else {
            return Ok((None, Vec::new()));
        };
        let group = node::agent_group(&node);
        let address = self.address_to_reach(&node, &group).await?;
        let agent = self
            .node_member(&node, &group, address.as_deref(), WAIT)
            .await
            .ok_or_else(|| Error::Rejected(format!("node {node} is not reachable: its log lines went with it")))?;
        let reply = wire::call_raw(&agent, wire::encode(&AgentRequest::Logs(id)), WAIT)
            .await
            .map_err(|e| match e {
                CallError::Timeout => Error::Rejected(format!("node {node} did not answer in {WAIT:?}")),
                CallError::Unreachable(why) | CallError::NotSent(why) => Error::Rejected(why),
            })?;
        let lines = wire::decode::<std::result::Result<Vec<LogLine>, Failure>>(&reply, "actor log lines")
            .and_then(|lines| lines)
            .map_err(|failure| failure_to_error(failure, Some(id)))?;
        Ok((Some(node), lines.into_iter().filter(|line| line.seq > after).collect()))
    }

    /// Sends raw bytes as a call to `target` (`head`, `agent/<node>`, `router/<node>`, or
    /// `actor/<id>`: a user actor, through its node's router) and returns the raw reply, for
    /// protocol robustness tests.
    #[doc(hidden)]
    pub async fn send_raw(&self, target: &str, bytes: Vec<u8>) -> Result<Vec<u8>> {
        const TIMEOUT: Duration = Duration::from_secs(5);
        let outcome = if let Some(id) = target.strip_prefix("actor/") {
            let actor = ActorId(
                id.parse()
                    .map_err(|_| Error::Rejected(format!("'{target}' names no actor id")))?,
            );
            let view = self.actor_view(actor, TIMEOUT).await?;
            let node = view
                .node
                .ok_or_else(|| Error::Rejected(format!("actor {actor} is not placed")))?;
            let router = self
                .node_member(&node, &node::router_group(&node), view.address.as_deref(), TIMEOUT)
                .await
                .ok_or_else(|| Error::Rejected(format!("node {node}'s router is not visible")))?;
            let target = Target {
                node: &node,
                router: &router,
            };
            self.calls
                .call(target, actor, bytes, TIMEOUT, false, &mut None)
                .await
                .map(|(reply, _)| reply)
        } else {
            // The head through the link (its cached actor): a process-group entry can vanish
            // when a duplicate session to the head closes, while the link's actor still runs.
            let cell = match target {
                node::HEAD_GROUP => self.link.head()?,
                _ => {
                    // `agent/<node>` or `router/<node>`: a session to that node first, when
                    // this process has none (its address from the head).
                    let node = target.split_once('/').map(|(_, node)| node).unwrap_or_default();
                    let address = self.address_to_reach(node, target).await?;
                    self.node_member(node, target, address.as_deref(), TIMEOUT)
                        .await
                        .ok_or_else(|| Error::Rejected(format!("no actor in group {target}")))?
                }
            };
            wire::call_raw(&cell, bytes, TIMEOUT).await
        };
        outcome.map_err(|e| match e {
            CallError::Timeout => Error::Timeout {
                what: format!("a raw call to {target}"),
                timeout: TIMEOUT,
            },
            CallError::Unreachable(c) | CallError::NotSent(c) => Error::Rejected(c),
        })
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
