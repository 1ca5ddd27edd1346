//! This process as a cluster node: its `ractor_cluster` NodeServer, the session events it
//! sees (joins, refusals, losses) and the process groups through which actors find each
//! other across nodes.
//!
//! Every Regatta actor that others reach over the network joins a process group in the
//! cluster's scope: `head`, `agent/<node>` or `actor/<id>`. `ractor_cluster` mirrors group
//! membership to every connected node, so a lookup is a local read.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorRef};
use ractor_cluster::node::NodeConnectionMode;
use ractor_cluster::node::NodeServerSessionInformation;
use ractor_cluster::{IncomingEncryptionMode, NodeEventSubscription, NodeServer, NodeServerMessage};
use regatta_net::{CaHash, JoinDesk, TlsIdentity, HEAD_NAME};
use tokio::sync::broadcast;

use super::session_tls::{DialError, SessionTls};
use crate::error::{Error, Result};

/// Sessions closed before authenticating, in a row, before a join reports a refused token.
pub(crate) const REFUSALS_BEFORE_GIVING_UP: u32 = 3;

/// How soon [`Peers::reach`] tries an address again (a dial, its TLS handshake and the
/// session's authentication take milliseconds; a peer that is down is tried again).
const REDIAL_AFTER: Duration = Duration::from_secs(3);

/// How long a node waits for the head to authenticate it before giving up on that attempt.
const JOIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A session event this node observed.
#[derive(Clone, Debug)]
pub(crate) enum SessionEvent {
    /// A peer proved it holds the cluster token.
    Authenticated,
    /// A session closed; `authenticated` says whether it had ever proven the token.
    Closed {
        /// Whether the peer had proven the token.
        authenticated: bool,
        /// The peer's node name (without `@host`), when it had said it.
        name: Option<String>,
    },
}

/// How the last [`LocalNode::rejoin`] failed, for the callers that waited on it.
struct FailedJoin {
    at: Instant,
    refused: bool,
    reason: String,
}

impl FailedJoin {
    fn error(&self, head_address: &str) -> Error {
        if self.refused {
            Error::TokenRefused {
                address: head_address.to_string(),
                reason: self.reason.clone(),
            }
        } else {
            Error::Connect {
                address: head_address.to_string(),
                reason: format!("another agent of this process just tried: {}", self.reason),
            }
        }
    }
}

/// This process's membership in a cluster.
pub(crate) struct LocalNode {
    server: ActorRef<NodeServerMessage>,
    scope: String,
    events: broadcast::Sender<SessionEvent>,
    tls: SessionTls,
    peers: Peers,
    listener: tokio::task::JoinHandle<()>,
    /// Held by the one [`LocalNode::rejoin`] under way, with how the last one failed.
    rejoining: tokio::sync::Mutex<Option<FailedJoin>>,
    /// `host:port` others use to reach this node.
    pub(crate) address: String,
    /// The nodes removed from the cluster, whose certificates this process refuses.
    pub(crate) removed: regatta_net::RemovedNodes,
}

impl Drop for LocalNode {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl LocalNode {
    /// Starts this process's cluster listener on `bind:port` (0 picks a free port). Every
    /// session, either way, is mutual TLS with the token's certificates
    /// ([`super::session_tls`]).
    pub(crate) async fn start(
        name: &str,
        identity: &TlsIdentity,
        desk: Option<Arc<JoinDesk>>,
        bind: IpAddr,
        port: u16,
        advertise_host: &str,
    ) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(SocketAddr::new(bind, port))
            .await
            .map_err(|e| Error::io(format!("cannot listen for the cluster on {bind}:{port}"), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io("cannot read the cluster listener's address", e))?
            .port();
        let address = format!("{advertise_host}:{port}");
        let tls = SessionTls::new(identity, desk);
        // ractor_cluster's own cookie check runs inside mutual TLS, which is what
        // authenticates; the cookie is the cluster's public identity, not a secret.
        let cookie = identity.cluster.hex();
        // ractor_cluster always runs a listener of its own: bound to loopback on a free
        // port, behind TLS, and never advertised, it takes no session; ours above does.
        let server = NodeServer::new(
            0,
            cookie,
            name.to_string(),
            advertise_host.to_string(),
            Some(IncomingEncryptionMode::Tls(tls.acceptor())),
            Some(NodeConnectionMode::Isolated),
        )
        .with_listen_addr(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let (server, _) = Actor::spawn(None, server, ())
            .await
            .map_err(|e| Error::Actor(format!("cannot start the cluster node server: {e}")))?;
        let listener = tokio::spawn(tls.clone().serve(listener, server.clone()));
        let (events, _) = broadcast::channel(256);
        let watcher = SessionWatcher {
            events: events.clone(),
            authenticated: Arc::new(Mutex::new(HashSet::new())),
        };
        server
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "regatta".to_string(),
                subscription: Box::new(watcher),
            })
            .map_err(|e| Error::Actor(format!("cannot watch cluster sessions: {e}")))?;
        Ok(Self {
            peers: Peers {
                tls: tls.clone(),
                server: server.clone(),
                dialed: Arc::default(),
            },
            server,
            scope: scope_for(&identity.cluster),
            events,
            tls,
            listener,
            rejoining: tokio::sync::Mutex::new(None),
            address,
            removed: identity.removed.clone(),
        })
    }

    /// The process-group scope of this cluster (derived from its authority, so that clients of
    /// different clusters in one process never see each other's actors).
    pub(crate) fn scope(&self) -> &str {
        &self.scope
    }

    /// Opens sessions to peer nodes on demand.
    pub(crate) fn peers(&self) -> Peers {
        self.peers.clone()
    }

    /// Subscribes to session events.
    pub(crate) fn events(&self) -> broadcast::Receiver<SessionEvent> {
        self.events.subscribe()
    }

    /// Connects to the head and waits until the head's actor is visible. A session closed
    /// before authenticating usually means a wrong token, but a connection race can close
    /// one too: only [`REFUSALS_BEFORE_GIVING_UP`] refusals in a row count as a refused token.
    pub(crate) async fn join(&self, head_address: &str) -> Result<ActorCell> {
        let mut refusals = 0;
        loop {
            match self.join_once(head_address).await {
                Err(Error::TokenRefused { address, reason }) => {
                    refusals += 1;
                    if refusals >= REFUSALS_BEFORE_GIVING_UP {
                        return Err(Error::TokenRefused { address, reason });
                    }
                    tokio::time::sleep(Duration::from_millis(200 * refusals as u64)).await;
                }
                other => return other,
            }
        }
    }

    /// The head's actor if this node sees one; otherwise [`Self::join`], one at a time:
    /// the callers that waited meanwhile get the outcome of the attempt that ended while
    /// they waited (the head it reached, or its failure) rather than dialling again. Many
    /// agents sharing one process (the scale simulator runs a hundred) would otherwise each
    /// dial their own session to a restarted head at once, a storm of TLS handshakes that
    /// a loaded head could not finish within their timeout, round after round.
    pub(crate) async fn rejoin(&self, head_address: &str) -> Result<ActorCell> {
        let asked = Instant::now();
        let mut last_failure = self.rejoining.lock().await;
        if let Some(head) = first_member(&self.scope, HEAD_GROUP) {
            return Ok(head);
        }
        if let Some(failed) = last_failure.as_ref().filter(|f| f.at >= asked) {
            return Err(failed.error(head_address));
        }
        let outcome = self.join(head_address).await;
        *last_failure = outcome.as_ref().err().map(|e| FailedJoin {
            at: Instant::now(),
            refused: matches!(e, Error::TokenRefused { .. }),
            reason: e.to_string(),
        });
        outcome
    }

    async fn join_once(&self, head_address: &str) -> Result<ActorCell> {
        let mut events = self.events();
        self.tls.dial(&self.server, head_address, HEAD_NAME).await.map_err(|e| match e {
            DialError::Refused(_) => Error::TokenRefused {
                address: head_address.to_string(),
                reason: format!("{e} (this process's certificate is another cluster's: was the head started again without its CA folder? join again with the join token)"),
            },
            DialError::Connect(_) => Error::Connect {
                address: head_address.to_string(),
                reason: format!("{e}; is the head running and the address right?"),
            },
            DialError::Handshake(_) | DialError::Timeout => Error::Connect {
                address: head_address.to_string(),
                reason: e.to_string(),
            },
        })?;
        let deadline = Instant::now() + JOIN_TIMEOUT;
        loop {
            if let Some(head) = first_member(&self.scope, HEAD_GROUP) {
                return Ok(head);
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(Error::Connect {
                    address: head_address.to_string(),
                    reason: "connected, but no Regatta head answered within 10 s (is this a head's cluster port?)"
                        .into(),
                });
            }
            match tokio::time::timeout(remaining.min(Duration::from_millis(5)), events.recv()).await {
                Ok(Ok(SessionEvent::Closed {
                    authenticated: false, ..
                })) => {
                    return Err(Error::TokenRefused {
                        address: head_address.to_string(),
                        reason: "the head closed the session before it was authenticated".into(),
                    });
                }
                _ => continue,
            }
        }
    }
}

/// Opens sessions from this process to peer nodes (cheap to clone).
#[derive(Clone)]
pub(crate) struct Peers {
    tls: SessionTls,
    server: ActorRef<NodeServerMessage>,
    /// When a session to each address was last tried.
    dialed: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Peers {
    /// Opens a session to `node` at `address`, in the background: called when this
    /// process needs a peer's actors and does not see them (nodes connect to the head when
    /// they join, and to other nodes only when they first call into them). The peer's
    /// process groups appear here once its session is up. Never dials a node this process
    /// already has a session with (a second session makes ractor_cluster close one of the
    /// two, failing the calls in flight on it), and tries an address at most once per
    /// [`REDIAL_AFTER`]: callers ask again while they wait.
    pub(crate) fn reach(&self, node: &str, address: &str) {
        let Ok(mut dialed) = self.dialed.lock() else { return };
        let now = Instant::now();
        dialed.retain(|_, at| now.duration_since(*at) < REDIAL_AFTER);
        if dialed.contains_key(address) {
            return;
        }
        dialed.insert(address.to_string(), now);
        drop(dialed);
        let (tls, server) = (self.tls.clone(), self.server.clone());
        let (node, address) = (node.to_string(), address.to_string());
        tokio::spawn(async move {
            if let Ok(sessions) = ractor::call_t!(server, NodeServerMessage::GetSessions, 2_000) {
                let connected = sessions
                    .values()
                    .filter_map(|s| s.peer_name.as_ref())
                    .any(|peer| node_of_session(&peer.name) == node);
                if connected {
                    return;
                }
            }
            // The peer must hold `node`'s own certificate: another node's cannot answer
            // for it, even from its address.
            if let Err(e) = tls.dial(&server, &address, &tls.peer_name(&node)).await {
                tracing::debug!(peer = %address, error = %e, "cannot open a session to a peer node");
            }
        });
    }
}

/// The node a session name belongs to: a worker's session is named
/// `<node>-<6 hex digits>@<host>` (see `worker::run`); other names are returned whole,
/// without the host.
pub(crate) fn node_of_session(name: &str) -> &str {
    let name = name.split('@').next().unwrap_or_default();
    match name.rsplit_once('-') {
        Some((node, suffix)) if suffix.len() == 6 && suffix.bytes().all(|b| b.is_ascii_hexdigit()) => node,
        _ => name,
    }
}

/// Watches NodeServer sessions and logs refusals: the one place both sides of a failed
/// token check say so.
struct SessionWatcher {
    events: broadcast::Sender<SessionEvent>,
    authenticated: Arc<Mutex<HashSet<ractor::ActorId>>>,
}

impl SessionWatcher {
    fn peer(ses: &NodeServerSessionInformation) -> String {
        match &ses.peer_name {
            Some(name) => format!("{} ({})", name.name, ses.peer_addr),
            None => ses.peer_addr.clone(),
        }
    }
}

impl NodeEventSubscription for SessionWatcher {
    fn node_session_opened(&self, _ses: NodeServerSessionInformation) {}

    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        if let Ok(mut set) = self.authenticated.lock() {
            set.insert(ses.actor.get_id());
        }
        let _ = self.events.send(SessionEvent::Authenticated);
    }

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        let authenticated = self
            .authenticated
            .lock()
            .map(|mut set| set.remove(&ses.actor.get_id()))
            .unwrap_or(false);
        let peer = Self::peer(&ses);
        if authenticated {
            if peer.starts_with("client-") {
                tracing::debug!(peer = %peer, "client session closed");
            } else {
                tracing::info!(peer = %peer, "cluster session closed");
            }
        } else if ses.is_server {
            tracing::warn!(peer = %peer, "closed a session that did not prove it belongs to the cluster (not a node of this cluster, or a duplicate of another connection)");
        } else {
            // Joins report a refused token themselves; transitive connections between
            // peers race and ractor_cluster closes the duplicate before authenticating.
            tracing::debug!(peer = %peer, "an outgoing session closed before authenticating");
        }
        let name = ses
            .peer_name
            .as_ref()
            .map(|n| n.name.split('@').next().unwrap_or_default().to_string());
        let _ = self.events.send(SessionEvent::Closed { authenticated, name });
    }
}

/// The head's process group.
pub(crate) const HEAD_GROUP: &str = "head";

/// How a head's node name starts (`head-<random>`): a session of that name closing means
/// the head went away.
pub(crate) const HEAD_NAME_PREFIX: &str = "head-";

/// The process group of the agent on `node`.
pub(crate) fn agent_group(node: &str) -> String {
    format!("agent/{node}")
}

/// The process group of the router on `node`, through which its user actors are called.
pub(crate) fn router_group(node: &str) -> String {
    format!("router/{node}")
}

/// Adds a local actor to a group in `scope`.
pub(crate) fn join_group(scope: &str, group: &str, cell: ActorCell) {
    ractor::pg::join_scoped(scope.to_string(), group.to_string(), vec![cell]);
}

/// The first running member of a group, local or remote.
pub(crate) fn first_member(scope: &str, group: &str) -> Option<ActorCell> {
    ractor::pg::get_scoped_members(&scope.to_string(), &group.to_string())
        .into_iter()
        .find(|cell| {
            matches!(
                cell.get_status(),
                ractor::ActorStatus::Running | ractor::ActorStatus::Starting | ractor::ActorStatus::Upgrading
            )
        })
}

/// Waits (polling the local mirror) until a group has a running member.
pub(crate) async fn wait_member(scope: &str, group: &str, timeout: Duration) -> Option<ActorCell> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(cell) = first_member(scope, group) {
            return Some(cell);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The process-group scope (and the state files' key) of the cluster whose authority has
/// this hash.
pub(crate) fn scope_for(cluster: &CaHash) -> String {
    format!("regatta-{}", &cluster.hex()[..16])
}

/// A free TCP port on `bind` (released at once: bind it soon).
pub(crate) fn free_port(bind: IpAddr) -> Result<u16> {
    let listener = TcpListener::bind(SocketAddr::new(bind, 0))
        .map_err(|e| Error::io(format!("cannot find a free port on {bind}"), e))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io("cannot read the local address", e))
}

/// The local address this machine uses to reach `peer` (no packet is sent), for
/// advertising; falls back to loopback.
pub(crate) fn route_to(peer: &str) -> String {
    let attempt = || -> Option<String> {
        let socket = UdpSocket::bind("0.0.0.0:0").ok()?;
        socket.connect(peer).ok()?;
        Some(socket.local_addr().ok()?.ip().to_string())
    };
    attempt().unwrap_or_else(|| "127.0.0.1".to_string())
}

/// A short random hex id.
pub(crate) fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    // The OS random source failing is not recoverable and not input-driven.
    getrandom::getrandom(&mut buf).expect("the OS random source is available");
    regatta_proto::hex::encode(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_name_gives_its_node() {
        assert_eq!(node_of_session("w1-0a1b2c@10.0.0.2"), "w1");
        assert_eq!(node_of_session("gpu-node-3-ffffff@host"), "gpu-node-3");
        assert_eq!(node_of_session("client-0a1b2c3d4e5f@h"), "client-0a1b2c3d4e5f");
        assert_eq!(node_of_session("head-xyz"), "head-xyz");
        assert_eq!(node_of_session("w1-abcdeg@h"), "w1-abcdeg");
    }

    #[test]
    fn scopes_differ_by_cluster() {
        let (a, b) = (CaHash([1; 32]), CaHash([2; 32]));
        assert_ne!(scope_for(&a), scope_for(&b));
        assert_eq!(scope_for(&a), scope_for(&CaHash([1; 32])));
    }
}
