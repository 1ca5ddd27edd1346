//! The cluster sessions over mutual TLS: every `ractor_cluster` session (node to head,
//! client to head, node to node) is a TLS 1.3 connection whose both ends present a
//! certificate the cluster's own authority issued, as the object transfer and the call
//! channel do. A head's cluster port also answers joins (ALPN `regatta-join/1`, told apart
//! from sessions by the ClientHello before any certificate is asked for). Nothing a session carries (actor names, spawn
//! arguments, the trainer ring's secret, job environments) crosses the network in
//! cleartext, and a peer without a certificate of the cluster is refused before it can send a frame.
//!
//! Why not `ractor_cluster`'s own `IncomingEncryptionMode::Tls`: its listener runs each
//! TLS handshake inline in the accept loop, so one connection that opens and stays silent
//! stops every later connection from being accepted; and in its transitive mode it opens
//! peer connections in cleartext whatever the listener does. So this module runs the
//! listener itself (each handshake in its own task, under a deadline and a cap on how
//! many run at once) and hands finished TLS streams to the NodeServer as external
//! streams; every node runs `NodeConnectionMode::Isolated`, and a process connects to a
//! peer node when it first needs one ([`super::node::Peers::reach`]).

use std::net::SocketAddr;
use std::time::Duration;

use ractor::ActorRef;
use ractor_cluster::{BoxRead, BoxWrite, ClusterBidiStream, NodeServerMessage};
use regatta_net::HandshakeSlots;
use regatta_net::{JoinDesk, TlsIdentity, JOIN_ALPN};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{LazyConfigAcceptor, TlsAcceptor, TlsConnector};

/// ALPN protocol id of the cluster sessions (the call channel and the object transfer
/// have their own, so a connection meant for one is never taken by another).
const ALPN: &[u8] = b"regatta-sessions/1";

/// How long a connection may take to finish its TLS handshake, either way (milliseconds
/// between nodes, even on a loaded machine).
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why an outgoing session could not be opened.
#[derive(Debug)]
pub(crate) enum DialError {
    /// No TCP connection (refused, unreachable, timed out).
    Connect(std::io::Error),
    /// The peer's certificate is not signed by this cluster's authority or does not name
    /// whom this process expected, or the peer refused ours.
    Refused(std::io::Error),
    /// The TLS handshake failed otherwise (not a Regatta node, or it went away).
    Handshake(std::io::Error),
    /// The handshake did not finish within [`HANDSHAKE_TIMEOUT`].
    Timeout,
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(e) => write!(f, "cannot open a connection ({e})"),
            Self::Refused(e) => write!(
                f,
                "the peer is not of this cluster, or not whom this process expected ({e})"
            ),
            Self::Handshake(e) => write!(
                f,
                "the TLS handshake failed ({e}); is this a Regatta node's cluster port?"
            ),
            Self::Timeout => write!(f, "no TLS handshake within {} s", HANDSHAKE_TIMEOUT.as_secs()),
        }
    }
}

/// TLS for the sessions of one process, from its certificate; a head's also answers joins.
#[derive(Clone)]
pub(crate) struct SessionTls {
    acceptor: TlsAcceptor,
    server: std::sync::Arc<rustls::ServerConfig>,
    connector: TlsConnector,
    /// The head's: the join configuration and the desk that answers joins.
    joins: Option<(std::sync::Arc<rustls::ServerConfig>, std::sync::Arc<JoinDesk>)>,
    /// Whether peers' certificates name their nodes ([`TlsIdentity::peer_name`]).
    names_nodes: bool,
}

impl SessionTls {
    /// The process's identity with the sessions' ALPN; `desk` (the head's) answers joins
    /// on the same port.
    pub(crate) fn new(identity: &TlsIdentity, desk: Option<std::sync::Arc<JoinDesk>>) -> Self {
        let (server, client) = identity.with_alpn(ALPN);
        Self {
            acceptor: TlsAcceptor::from(server.clone()),
            server,
            connector: TlsConnector::from(client),
            joins: desk.and_then(|desk| identity.join.clone().map(|config| (config, desk))),
            names_nodes: identity.names_nodes,
        }
    }

    /// The name node `node`'s certificate must carry for a session to it.
    pub(crate) fn peer_name(&self, node: &str) -> String {
        regatta_net::peer_name(self.names_nodes, node)
    }

    /// The acceptor, for `ractor_cluster`'s own (unused, loopback) listener.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.clone()
    }

    /// Opens a TLS session to the node listening at `address`, whose certificate must name
    /// `expected` (the head's name for the head), and hands it to `server`.
    pub(crate) async fn dial(
        &self,
        server: &ActorRef<NodeServerMessage>,
        address: &str,
        expected: &str,
    ) -> Result<(), DialError> {
        let open = async {
            let stream = TcpStream::connect(address).await.map_err(DialError::Connect)?;
            let _ = stream.set_nodelay(true);
            let (peer, local) = labels(&stream);
            let name = ServerName::try_from(expected.to_string())
                .map_err(|e| DialError::Handshake(std::io::Error::other(e.to_string())))?;
            let stream = self.connector.connect(name, stream).await.map_err(classify)?;
            Ok::<_, DialError>(Session { stream, peer, local })
        };
        let session = tokio::time::timeout(HANDSHAKE_TIMEOUT, open)
            .await
            .map_err(|_| DialError::Timeout)??;
        ractor_cluster::client_connect_external(server, Box::new(session))
            .await
            .map_err(|e| DialError::Connect(std::io::Error::other(e.to_string())))
    }

    /// Accepts connections on `listener` for ever, each handshake in its own task, and
    /// hands every finished one to `server` as an incoming session. Returns when the
    /// server has stopped.
    pub(crate) async fn serve(self, listener: TcpListener, server: ActorRef<NodeServerMessage>) {
        let handshakes = HandshakeSlots::new();
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: wait a
                    // little rather than spin, and go on.
                    tracing::warn!(error = %e, "cannot accept a connection on the cluster port");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !matches!(server.get_status(), ractor::ActorStatus::Running) {
                return;
            }
            let permit = match handshakes.take(peer.ip()) {
                Ok(slot) => slot,
                Err(refusal) => {
                    tracing::warn!(peer = %peer, "closed a connection at once: {refusal} on the cluster port");
                    continue;
                }
            };
            let tls = self.clone();
            let server = server.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let _ = stream.set_nodelay(true);
                let (peer_label, local) = labels(&stream);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                    Ok(Ok(Accepted::Session(stream))) => {
                        let session = Session {
                            stream: *stream,
                            peer: peer_label,
                            local,
                        };
                        let _ = server.cast(NodeServerMessage::ConnectionOpenedExternal {
                            stream: Box::new(session),
                            is_server: true,
                        });
                    }
                    Ok(Ok(Accepted::Joined(role))) => {
                        tracing::info!(peer = %peer, role = ?role, "issued a certificate to a joiner");
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(peer = %peer, error = %e, "closed a connection that did not prove it belongs to the cluster (its TLS handshake or join failed: another cluster's certificate, a bad join token, or not a Regatta node)");
                    }
                    Err(_) => {
                        tracing::warn!(peer = %peer, "closed a connection that did not prove it belongs to the cluster (no TLS handshake or join within {} s)", HANDSHAKE_TIMEOUT.as_secs());
                    }
                }
            });
        }
    }

    /// One accepted connection: a join (on a head, by ALPN) answered here, or a session.
    async fn accept(&self, stream: TcpStream) -> std::io::Result<Accepted> {
        let Some((join_config, desk)) = &self.joins else {
            return Ok(Accepted::Session(Box::new(self.acceptor.accept(stream).await?)));
        };
        let source = stream.peer_addr()?.ip();
        let start = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream).await?;
        let joining = start
            .client_hello()
            .alpn()
            .is_some_and(|mut offered| offered.any(|p| p == JOIN_ALPN));
        if !joining {
            return Ok(Accepted::Session(Box::new(
                start.into_stream(self.server.clone()).await?,
            )));
        }
        let mut stream = start.into_stream(join_config.clone()).await?;
        regatta_net::answer_join(&mut stream, desk, source)
            .await
            .map(Accepted::Joined)
            .map_err(|refusal| std::io::Error::new(std::io::ErrorKind::PermissionDenied, refusal.to_string()))
    }
}

/// What an accepted connection became.
enum Accepted {
    Session(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Joined(regatta_net::Role),
}

/// Sorts a failed client handshake: a certificate the other side does not trust means
/// the two are not of one cluster (or not whom the dialer expected).
fn classify(e: std::io::Error) -> DialError {
    let refused = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|tls| {
            matches!(
                tls,
                rustls::Error::InvalidCertificate(_)
                    | rustls::Error::AlertReceived(
                        rustls::AlertDescription::BadCertificate
                            | rustls::AlertDescription::UnknownCA
                            | rustls::AlertDescription::CertificateUnknown
                            | rustls::AlertDescription::DecryptError
                    )
            )
        });
    if refused {
        DialError::Refused(e)
    } else {
        DialError::Handshake(e)
    }
}

fn labels(stream: &TcpStream) -> (String, String) {
    let show = |a: std::io::Result<SocketAddr>| a.map(|a| a.to_string()).unwrap_or_else(|_| "unknown".into());
    (show(stream.peer_addr()), show(stream.local_addr()))
}

/// A TLS stream as `ractor_cluster` takes external transports.
struct Session<S> {
    stream: S,
    peer: String,
    local: String,
}

impl<S> ClusterBidiStream for Session<S>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        let (read, write) = tokio::io::split(self.stream);
        (Box::new(read), Box::new(write))
    }

    fn peer_label(&self) -> Option<String> {
        Some(self.peer.clone())
    }

    fn local_label(&self) -> Option<String> {
        Some(self.local.clone())
    }
}
