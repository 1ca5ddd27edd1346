//! The cluster sessions over mutual TLS: every `ractor_cluster` session (node to head,
//! client to head, node to node) is a TLS 1.3 connection whose both ends present a
//! certificate signed by the authority derived from the cluster token, as the object
//! transfer and the call channel do. Nothing a session carries (actor names, spawn
//! arguments, the trainer ring's secret, job environments) crosses the network in
//! cleartext, and a peer without the token is refused before it can send a frame.
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
use regatta_net::{TlsIdentity, SERVER_NAME};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

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
    /// The peer's certificate is not signed by this token's authority, or the peer
    /// refused ours: the two sides hold different tokens.
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
            Self::Refused(e) => write!(f, "the cluster tokens differ ({e})"),
            Self::Handshake(e) => write!(
                f,
                "the TLS handshake failed ({e}); is this a Regatta node's cluster port?"
            ),
            Self::Timeout => write!(f, "no TLS handshake within {} s", HANDSHAKE_TIMEOUT.as_secs()),
        }
    }
}

/// TLS for the sessions of one process, from the cluster token.
#[derive(Clone)]
pub(crate) struct SessionTls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl SessionTls {
    /// The token identity with the sessions' ALPN.
    pub(crate) fn new(identity: &TlsIdentity) -> Self {
        let (server, client) = identity.with_alpn(ALPN);
        Self {
            acceptor: TlsAcceptor::from(server),
            connector: TlsConnector::from(client),
        }
    }

    /// The acceptor, for `ractor_cluster`'s own (unused, loopback) listener.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.clone()
    }

    /// Opens a TLS session to the node listening at `address` and hands it to `server`.
    pub(crate) async fn dial(&self, server: &ActorRef<NodeServerMessage>, address: &str) -> Result<(), DialError> {
        let open = async {
            let stream = TcpStream::connect(address).await.map_err(DialError::Connect)?;
            let _ = stream.set_nodelay(true);
            let (peer, local) = labels(&stream);
            let name = ServerName::try_from(SERVER_NAME).expect("the node certificate's name is a valid DNS name");
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
            let acceptor = self.acceptor.clone();
            let server = server.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let _ = stream.set_nodelay(true);
                let (peer_label, local) = labels(&stream);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => {
                        let session = Session {
                            stream,
                            peer: peer_label,
                            local,
                        };
                        let _ = server.cast(NodeServerMessage::ConnectionOpenedExternal {
                            stream: Box::new(session),
                            is_server: true,
                        });
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(peer = %peer, error = %e, "closed a connection that did not prove the cluster token (its TLS handshake failed: a wrong token, or not a Regatta node)");
                    }
                    Err(_) => {
                        tracing::warn!(peer = %peer, "closed a connection that did not prove the cluster token (no TLS handshake within {} s)", HANDSHAKE_TIMEOUT.as_secs());
                    }
                }
            });
        }
    }
}

/// Sorts a failed client handshake: a certificate the other side does not trust means
/// the tokens differ.
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
