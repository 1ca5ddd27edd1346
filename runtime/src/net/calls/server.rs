//! The serving side of the call channel: one per worker process, handing each request to
//! the hosted actor's queue and writing its reply back on the same connection.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use regatta_net::{HandshakeSlot, HandshakeSlots};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, WriteHalf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::{JoinHandle, JoinSet};

use super::frame::{
    wall_clock_ns, ReplyHeader, ReplyStatus, RequestHeader, RequestKind, ServerStamps, REQUEST_HEADER_BYTES,
};
use super::socket::{bind_local, keep_alive, this_host, CallAddress, LocalAddress, Socket};
use super::CallTls;
use super::Routes;
use crate::error::{Error, Result};
use crate::net::wire::{self, Hold, Wire};
use regatta_proto::Failure;

/// How long a connecting peer has to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A running call channel listener; dropping it stops accepting and closes every
/// connection it accepted.
pub(crate) struct CallServer {
    address: CallAddress,
    accept: JoinHandle<()>,
}

impl Drop for CallServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl CallServer {
    /// Listens on `bind:port` and serves the actors `routes` holds; peers reach it at
    /// `advertise_host` and the bound port.
    pub(crate) async fn start(
        bind: IpAddr,
        port: u16,
        advertise_host: &str,
        tls: &CallTls,
        node: String,
        routes: Routes,
        counters: CallCounters,
    ) -> Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(bind, port))
            .await
            .map_err(|cause| Error::Io {
                context: format!("cannot listen for actor calls on {bind}:{port} (--call-port)"),
                cause,
            })?;
        let bound = listener.local_addr().map_err(|cause| Error::Io {
            context: "the call channel's listening address".into(),
            cause,
        })?;
        // Same-host callers use an abstract Unix socket; without one they use TCP too.
        let local = match (this_host(), bind_local()) {
            (Some(host), Ok((listener, name))) => Some((listener, LocalAddress { host, name })),
            (_, Err(e)) => {
                tracing::warn!(error = %e, "no Unix socket for same-host actor calls; they use TCP");
                None
            }
            (None, Ok(_)) => None,
        };
        let address = CallAddress {
            tcp: format!("{advertise_host}:{}", bound.port()),
            local: local.as_ref().map(|(_, address)| address.clone()),
        };
        tracing::info!(address = %address.tcp, %node, "serving actor calls");
        let node = Arc::new(Node {
            name: node,
            routes,
            counters,
        });
        let accept = tokio::spawn(accept_loop(listener, local.map(|(l, _)| l), tls.clone(), node));
        Ok(Self { address, accept })
    }

    /// Where callers connect.
    pub(crate) fn address(&self) -> &CallAddress {
        &self.address
    }
}

/// What every connection of one node serves.
struct Node {
    name: String,
    routes: Routes,
    counters: CallCounters,
}

/// The counters a call server adds to: requests read, calls and casts apart (handed in by
/// the process, so the channel reads no global registry).
#[derive(Clone)]
pub(crate) struct CallCounters {
    /// Calls read.
    pub(crate) calls: prometheus::IntCounter,
    /// Casts read.
    pub(crate) casts: prometheus::IntCounter,
}

impl CallCounters {
    /// Counters of their own, counted nowhere else (tests).
    #[cfg(test)]
    pub(crate) fn unregistered() -> Self {
        let counter = |name: &str| prometheus::IntCounter::new(name, "test").expect("a counter");
        Self {
            calls: counter("calls"),
            casts: counter("casts"),
        }
    }
}

/// The next connection on either listener, with the peer's address (`None` for the Unix
/// socket, which only this host's processes reach).
async fn accept(tcp: &TcpListener, local: Option<&UnixListener>) -> std::io::Result<(Socket, String, Option<IpAddr>)> {
    let unix = async {
        match local {
            Some(listener) => listener.accept().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        accepted = tcp.accept() => accepted.map(|(stream, peer)| (Socket::Tcp(stream), peer.to_string(), Some(peer.ip()))),
        accepted = unix => accepted.map(|(stream, _)| (Socket::Unix(stream), "a same-host process".to_string(), None)),
    }
}

async fn accept_loop(listener: TcpListener, local: Option<UnixListener>, tls: CallTls, node: Arc<Node>) {
    // Owned here so that stopping the listener closes its connections too.
    let mut connections = JoinSet::new();
    // The Unix socket keeps slots of its own: connections piling up on the TCP port, from
    // any number of addresses, never shut this host's processes out of the socket.
    let (tcp_handshakes, unix_handshakes) = (HandshakeSlots::new(), HandshakeSlots::new());
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer, source) = match accept(&listener, local.as_ref()).await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors and the like: wait rather than spin.
                tracing::warn!(error = %e, "cannot accept a call channel connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Connections that never finish their handshake hold a slot each, and one address
        // only a quarter of them: silent ones cannot pile up without bound.
        let taken = match source {
            Some(address) => tcp_handshakes.take(address),
            None => unix_handshakes.take(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        };
        let slot = match taken {
            Ok(slot) => slot,
            Err(refusal) => {
                tracing::warn!(%peer, "closed a call channel connection at once: {refusal}");
                continue;
            }
        };
        let (tls, node) = (tls.clone(), node.clone());
        connections.spawn(async move {
            if let Err(e) = serve(stream, slot, &tls, node).await {
                tracing::debug!(%peer, error = %e, "call channel connection ended");
            }
        });
    }
}

type Writer<S> = Arc<Mutex<WriteHalf<S>>>;

/// A call handed to its actor: the sequence number, where the answer comes, and for a
/// timed call its stamps so far.
type Waiting = (u64, oneshot::Receiver<Vec<u8>>, Option<ServerStamps>);

/// Calls one connection may have waiting for their answers before this node stops
/// reading it (twice this, counting those handed over but not yet waited on), and casts it
/// may have waiting in actors' queues: a caller that sends faster than the actors answer or
/// take its casts is slowed by TCP, and the node's memory for one connection stays bounded.
pub(crate) const PENDING_CALLS: usize = 16_384;

/// Serves one connection until the peer closes it or sends something malformed. Reading
/// requests and writing replies run in this one task, so stopping it (the listener was
/// dropped) closes the connection even while actors still hold calls.
async fn serve(stream: Socket, slot: HandshakeSlot, tls: &CallTls, node: Arc<Node>) -> Result<()> {
    if let Socket::Tcp(tcp) = &stream {
        tcp.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
        keep_alive(tcp).map_err(io("set TCP keep-alives"))?;
    }
    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.acceptor.accept(stream)).await;
    drop(slot);
    let stream = handshake
        .map_err(|_| Error::Timeout {
            what: "a call channel TLS handshake".into(),
            timeout: HANDSHAKE_TIMEOUT,
        })?
        .map_err(io("call channel TLS handshake"))?;
    let (reader, writer) = tokio::io::split(stream);
    let writer = Arc::new(Mutex::new(writer));
    let (waiting, answers) = mpsc::channel(PENDING_CALLS);
    let cast_room = Arc::new(tokio::sync::Semaphore::new(PENDING_CALLS));
    tokio::select! {
        read = read_requests(reader, &node, &writer, waiting, cast_room) => read,
        () = write_answers(answers, &writer) => Ok(()),
    }
}

fn io(context: &str) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.to_string();
    move |cause| Error::Io { context, cause }
}

/// Reads requests and hands each to its actor's queue until the peer closes.
async fn read_requests<R: AsyncRead, W: AsyncWrite>(
    reader: R,
    node: &Node,
    writer: &Writer<W>,
    waiting: mpsc::Sender<Waiting>,
    cast_room: Arc<tokio::sync::Semaphore>,
) -> Result<()> {
    let mut reader = std::pin::pin!(reader);
    let CallCounters { calls, casts } = &node.counters;
    let mut header = [0u8; REQUEST_HEADER_BYTES];
    loop {
        match reader.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io("read a call request")(e)),
        }
        let request = RequestHeader::parse(&header)?;
        let mut payload = vec![0u8; request.len];
        reader
            .read_exact(&mut payload)
            .await
            .map_err(io("read a call request's payload"))?;
        match request.kind {
            RequestKind::Call | RequestKind::TimedCall => {
                let read = (request.kind == RequestKind::TimedCall).then(wall_clock_ns);
                calls.inc();
                let (port, answer) = oneshot::channel();
                if node
                    .routes
                    .deliver(request.actor, Wire::Call(payload, port.into()))
                    .is_ok()
                {
                    let stamps = read.map(|read| ServerStamps {
                        read,
                        queued: wall_clock_ns(),
                        ..ServerStamps::default()
                    });
                    // Past the bound, this waits, and so stops reading the connection:
                    // the caller's writes back up, not this node's memory.
                    if waiting.send((request.seq, answer, stamps)).await.is_err() {
                        return Ok(());
                    }
                } else {
                    let not_hosted = wire::encode_failure(Failure::NotHosted {
                        actor: request.actor,
                        node: node.name.clone(),
                    });
                    write_reply(writer, request.seq, ReplyStatus::Answered, &not_hosted).await?;
                }
            }
            RequestKind::Cast => {
                casts.inc();
                // Past the bound (casts of this connection still queued at their actors),
                // this waits, and so stops reading the connection, as calls do.
                let Ok(room) = cast_room.clone().acquire_owned().await else {
                    return Ok(());
                };
                if node
                    .routes
                    .deliver(request.actor, Wire::Cast(payload, Hold::of(room)))
                    .is_err()
                {
                    tracing::debug!(actor = %request.actor, node = %node.name, "dropped a cast to an actor this node does not host");
                }
            }
        }
    }
}

/// Writes each answer as its actor gives it, in whatever order they come.
async fn write_answers<W: AsyncWrite>(mut answers: mpsc::Receiver<Waiting>, writer: &Writer<W>) {
    let mut waiting = FuturesUnordered::new();
    loop {
        tokio::select! {
            handed = answers.recv(), if waiting.len() < PENDING_CALLS => match handed {
                Some((seq, answer, stamps)) => waiting.push(async move {
                    let answer = answer.await;
                    (seq, answer, stamps.map(|stamps| ServerStamps { answered: wall_clock_ns(), ..stamps }))
                }),
                // The reader ended; it returns first.
                None => std::future::pending().await,
            },
            Some((seq, answer, stamps)) = waiting.next(), if !waiting.is_empty() => {
                let written = match (answer, stamps) {
                    (Ok(reply), None) => write_reply(writer, seq, ReplyStatus::Answered, &reply).await,
                    (Ok(reply), Some(stamps)) => {
                        let timed = ServerStamps { writing: wall_clock_ns(), ..stamps }.prefix(&reply);
                        write_reply(writer, seq, ReplyStatus::AnsweredTimed, &timed).await
                    }
                    // The host dropped the call without answering (it stopped).
                    (Err(_), _) => write_reply(writer, seq, ReplyStatus::Lost, &[]).await,
                };
                // A failed write means the connection is gone: its reader ends it.
                if written.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }
}

async fn write_reply<S: AsyncWrite>(writer: &Writer<S>, seq: u64, status: ReplyStatus, payload: &[u8]) -> Result<()> {
    let frame = ReplyHeader::frame(seq, status, payload);
    let mut writer = writer.lock().await;
    let io = |cause| Error::Io {
        context: "write a call reply".into(),
        cause,
    };
    writer.write_all(&frame).await.map_err(io)?;
    writer.flush().await.map_err(io)
}
