//! The client library: connect to a head, spawn and call actors, reserve placement groups.
//!
//! A [`Client`] makes this process a member of the cluster (drivers talk to actors
//! directly, not through the head). [`Cluster`] is the handle drivers and actors share.

pub(crate) mod actor;
mod cluster;
mod handle;
pub(crate) mod job_client;
mod objects;
pub(crate) mod pool;
mod runs;
mod timing;

use std::net::IpAddr;
use std::sync::Arc;

pub use actor::{Actor, ActorContext, ActorError};
pub use cluster::{ActorOptions, Cluster, PlacementGroup, DEFAULT_CALL_TIMEOUT};
pub use handle::ActorHandle;
pub use objects::ObjectRef;
pub use runs::RunReporter;
pub use timing::CallTiming;

use crate::error::{Error, Result};
use crate::net::calls::{CallPath, CallPlane, CallTls};
use crate::net::headlink::HeadLink;
use crate::net::node::{self, LocalNode, SessionEvent};
use crate::net::trust::{self, JoinCredentials};
use crate::objects::{ObjectConfig, ObjectService};
use regatta_net::Role;
use regatta_proto::HeadRequest;

/// How long a client waits between attempts to join a head that went away.
const REJOIN_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// Joins the head again whenever the session to it closes (the head restarted), for as
/// long as the client lives. Calls to actors do not need the head; requests that do wait
/// for it within their timeout. Only a closed session to the head starts a rejoin: a
/// second connection to a head that is there would make `ractor_cluster` close one of the
/// two, with requests in flight on it.
fn keep_joined(
    local: std::sync::Weak<LocalNode>,
    mut events: tokio::sync::broadcast::Receiver<SessionEvent>,
    address: String,
    rejoined: tokio::sync::watch::Sender<u64>,
) {
    use tokio::sync::broadcast::error::RecvError;
    tokio::spawn(async move {
        loop {
            let head_gone = match events.recv().await {
                Ok(SessionEvent::Closed {
                    authenticated: true,
                    name: Some(name),
                }) => name.starts_with(node::HEAD_NAME_PREFIX),
                Ok(_) => false,
                // Missed events: the membership tells.
                Err(RecvError::Lagged(_)) => local
                    .upgrade()
                    .is_some_and(|l| node::first_member(l.scope(), node::HEAD_GROUP).is_none()),
                Err(RecvError::Closed) => break,
            };
            if !head_gone {
                continue;
            }
            // The old head may still be listed for a moment: join until a new session is
            // up rather than trusting the membership.
            loop {
                let Some(local) = local.upgrade() else { return };
                match local.join(&address).await {
                    Ok(_) => {
                        tracing::info!(head = %address, "joined the head again");
                        rejoined.send_modify(|n| *n += 1);
                        break;
                    }
                    Err(Error::TokenRefused { .. }) => {
                        tracing::error!(head = %address, "the head at this address now refuses the cluster token; this client stops rejoining");
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "the head is not back yet");
                        tokio::time::sleep(REJOIN_EVERY).await;
                    }
                }
            }
        }
    });
}

/// Registers again, with each head this client joins again, the objects it holds: a put's
/// registration is sent without waiting, so a head killed just after it may not have it on
/// disk. Only adds (a put of the same bytes is idempotent at the head, a copy is one more
/// source): a put made while this runs is never dropped, as a whole-list report could.
fn report_objects_on_rejoin(
    objects: std::sync::Weak<ObjectService>,
    link: Arc<HeadLink>,
    job: Option<String>,
    mut rejoined: tokio::sync::watch::Receiver<u64>,
) {
    tokio::spawn(async move {
        while rejoined.changed().await.is_ok() {
            let Some(store) = objects.upgrade() else { return };
            let (node, address) = store.location();
            let (node, address) = (node.to_string(), address.to_string());
            let Ok(held) = tokio::task::spawn_blocking(move || store.held()).await else {
                continue;
            };
            for object in held {
                let request = if object.referenced {
                    HeadRequest::ObjectPut {
                        id: object.id,
                        size: object.size,
                        checksum: object.checksum,
                        node: node.clone(),
                        address: address.clone(),
                        job: job.clone(),
                    }
                } else {
                    HeadRequest::ObjectAddSource {
                        id: object.id,
                        node: node.clone(),
                        address: address.clone(),
                    }
                };
                if let Err(e) = link.send(&request) {
                    tracing::warn!(error = %e, "could not register this client's objects with the restarted head");
                    break;
                }
            }
        }
    });
}

/// A driver's connection to a cluster: this process joins as a client node.
pub struct Client {
    cluster: Cluster,
    _node: Arc<LocalNode>,
    _renewal: trust::RenewalGuard,
}

impl Client {
    /// Connects to the head at `address` (`host:port`) with a join token (`<id>.<secret>`):
    /// the head issues this client a certificate, pinned to [`crate::CA_HASH_ENV`]'s
    /// authority when that is set.
    pub async fn connect(address: &str, token: &str) -> Result<Self> {
        Self::connect_with(address, token, true).await
    }

    /// Like [`Client::connect`] with the token and pin given as [`JoinCredentials`].
    pub async fn connect_credentials(address: &str, credentials: &JoinCredentials) -> Result<Self> {
        Self::open(address, credentials, Some(CallPath::from_env()?)).await
    }

    /// Like [`Client::connect`]; `direct` false makes a lighter client with no object store
    /// and no call channel (enough for status and spawning; its calls, if any, go through
    /// the sessions).
    pub async fn connect_with(address: &str, token: &str, direct: bool) -> Result<Self> {
        let path = if direct { Some(CallPath::from_env()?) } else { None };
        Self::open(address, &JoinCredentials::parse(token, None)?, path).await
    }

    /// Joins the cluster; `path` `None` makes a status-only client.
    async fn open(address: &str, credentials: &JoinCredentials, path: Option<CallPath>) -> Result<Self> {
        let host = node::route_to(address);
        let bind: IpAddr = "0.0.0.0".parse().map_err(|_| Error::Actor("bad bind address".into()))?;
        let name = format!("client-{}", node::random_hex(6));
        let identity = trust::join_once(address, credentials, &Role::Client(name.clone())).await?;
        let renewal = trust::keep_renewed(address.to_string(), identity.clone());
        let local = LocalNode::start(&name, &identity, None, bind, 0, &host).await?;
        let events = local.events();
        let head = local.join(address).await?;
        let local = Arc::new(local);
        let (rejoined, on_rejoin) = tokio::sync::watch::channel(0);
        keep_joined(Arc::downgrade(&local), events, address.to_string(), rejoined);
        let link =
            Arc::new(HeadLink::new(local.scope().to_string(), head, address.to_string()).with_peers(local.peers()));
        // One identity serves the sessions, the object transfer and the call channel.
        let (objects, calls) = match path {
            Some(path) => {
                let config = ObjectConfig::for_client(&host);
                let objects = ObjectService::start(&name, &identity, config, link.clone()).await?;
                let job = std::env::var(regatta_proto::JOB_ID_ENV).ok().filter(|j| !j.is_empty());
                report_objects_on_rejoin(Arc::downgrade(&objects), link.clone(), job, on_rejoin);
                (Some(objects), CallPlane::new(CallTls::new(&identity), path))
            }
            None => (None, CallPlane::session_only()),
        };
        // A driver started by the job manager belongs to its job.
        let job = std::env::var(regatta_proto::JOB_ID_ENV).ok().filter(|j| !j.is_empty());
        Ok(Self {
            cluster: Cluster::new(link, objects, calls).with_job(job),
            _node: local,
            _renewal: renewal,
        })
    }

    /// The cluster handle.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
}

impl std::ops::Deref for Client {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}
