//! The calling side of the call channel: one connection per serving process, shared by
//! every caller in this process, with replies matched to calls by sequence number.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::ActorCell;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_rustls::client::TlsStream;

use super::frame::{
    wall_clock_ns, ReplyHeader, ReplyStatus, RequestHeader, RequestKind, ServerStamps, REPLY_HEADER_BYTES,
};
use super::socket::{connect_local, keep_alive, this_host, CallAddress, Socket, Transport};
use super::RouterQuery;
use super::{CallPath, CallTls};
use crate::error::{failure_to_error, Error, Result};
use crate::net::wire::{self, CallError};
use regatta_proto::{ActorId, Failure};

/// How long opening a connection (TCP and TLS) may take before the session path is used.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a node whose channel could not be opened is reached by the session path
/// before trying its channel again; doubled after each failure in a row, up to
/// [`RETRY_AFTER_MAX`] (an unreachable port costs a connect timeout per try).
const RETRY_AFTER: Duration = Duration::from_secs(10);
const RETRY_AFTER_MAX: Duration = Duration::from_secs(600);
/// How long a cast may wait for the connection to take its bytes.
const CAST_TIMEOUT: Duration = Duration::from_secs(30);

/// This process's call channel connections, by serving node.
pub(crate) struct CallPlane {
    /// How connections are secured; `None`: this plane cannot open any.
    tls: Option<CallTls>,
    path: CallPath,
    nodes: Mutex<HashMap<String, NodeChannel>>,
    /// One opener per node at a time.
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

enum NodeChannel {
    Open(Arc<Connection>),
    /// The channel could not be opened `failures` times in a row; use the session path
    /// until `until`.
    Unavailable {
        until: Instant,
        failures: u32,
    },
}

/// When to try a channel again after `failures` failed openings in a row.
fn retry_at(now: Instant, failures: u32) -> Instant {
    let wait = RETRY_AFTER.saturating_mul(1 << failures.saturating_sub(1).min(16));
    now + wait.min(RETRY_AFTER_MAX)
}

/// Where an actor lives: its node and the node's router (the session path, and the way
/// to learn the node's channel address).
pub(crate) struct Target<'a> {
    pub(crate) node: &'a str,
    pub(crate) router: &'a ActorCell,
}

impl CallPlane {
    /// A plane that opens channels with `tls`, as `path` says.
    pub(crate) fn new(tls: CallTls, path: CallPath) -> Self {
        Self {
            tls: Some(tls),
            path,
            nodes: Mutex::default(),
            gates: Mutex::default(),
        }
    }

    /// A plane that always uses the session path.
    pub(crate) fn session_only() -> Self {
        Self {
            tls: None,
            path: CallPath::Session,
            nodes: Mutex::default(),
            gates: Mutex::default(),
        }
    }

    /// A plane with the same credentials, sending by `path`, with no connections yet.
    pub(crate) fn with_path(&self, path: CallPath) -> Self {
        Self {
            tls: self.tls.clone(),
            path,
            nodes: Mutex::default(),
            gates: Mutex::default(),
        }
    }

    /// Calls `actor` at `target` and waits up to `timeout` for the raw reply; `timed` asks
    /// for every hop's stamps, which come back when the call went over the channel.
    pub(crate) async fn call(
        &self,
        target: Target<'_>,
        actor: ActorId,
        request: Vec<u8>,
        timeout: Duration,
        timed: bool,
        sent: &mut Option<oneshot::Sender<()>>,
    ) -> std::result::Result<(Vec<u8>, Option<Hops>), CallError> {
        let deadline = Instant::now() + timeout;
        if request.len() > wire::MAX_MESSAGE_BYTES {
            // The session path refuses it with the message users see.
            let reply = wire::call_actor_raw(target.router, actor, request, timeout).await?;
            return Ok((reply, None));
        }
        if let Some(connection) = self.connection(&target, deadline).await {
            match connection.send_call(actor, &request, deadline, timed, sent).await {
                Ok(answered) => return Ok(answered),
                Err(Unsent::Failed(e)) => return Err(e),
                // The connection broke before this call went out: nothing was delivered.
                Err(Unsent::NotSent) => {}
            }
        }
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let reply = wire::call_actor_raw(target.router, actor, request, remaining).await?;
        Ok((reply, None))
    }

    /// Sends `actor` a message without waiting for it to be handled.
    pub(crate) async fn cast(
        &self,
        target: Target<'_>,
        actor: ActorId,
        message: Vec<u8>,
    ) -> std::result::Result<(), CallError> {
        if message.len() <= wire::MAX_MESSAGE_BYTES {
            if let Some(connection) = self.connection(&target, Instant::now() + CAST_TIMEOUT).await {
                match connection.cast(actor, &message).await {
                    Ok(()) => return Ok(()),
                    Err(Unsent::Failed(e)) => return Err(e),
                    Err(Unsent::NotSent) => {}
                }
            }
        }
        wire::cast_actor_raw(target.router, actor, message)
    }

    /// The open connection to `target`'s node, opening one if needed; `None`: use the
    /// session path.
    async fn connection(&self, target: &Target<'_>, deadline: Instant) -> Option<Arc<Connection>> {
        if self.path == CallPath::Session {
            return None;
        }
        let tls = self.tls.as_ref()?;
        if let Some(found) = self.known(target.node) {
            return found;
        }
        let gate = {
            let mut gates = self.gates.lock().ok()?;
            gates.entry(target.node.to_string()).or_default().clone()
        };
        // Opening may take at most half of what the caller has left, so that the session
        // path still has the other half when the channel cannot be opened.
        let budget = deadline.saturating_duration_since(Instant::now()) / 2;
        let _opening = tokio::time::timeout(budget, gate.lock()).await.ok()?;
        if let Some(found) = self.known(target.node) {
            return found;
        }
        let failed_before = match self.nodes.lock().ok()?.get(target.node) {
            Some(NodeChannel::Unavailable { failures, .. }) => *failures,
            _ => 0,
        };
        let opened = tokio::time::timeout(budget.min(CONNECT_TIMEOUT), open(tls, target, self.path))
            .await
            .unwrap_or_else(|_| {
                Err(Error::Timeout {
                    what: format!("opening the call channel to node {}", target.node),
                    timeout: budget.min(CONNECT_TIMEOUT),
                })
            });
        let channel = match opened {
            Ok(connection) => {
                tracing::debug!(node = %target.node, transport = ?connection.transport(), "call channel open");
                NodeChannel::Open(Arc::new(connection))
            }
            Err(e) => {
                let failures = failed_before + 1;
                let until = retry_at(Instant::now(), failures);
                tracing::info!(node = %target.node, error = %e, retry_in = ?until.saturating_duration_since(Instant::now()), "no call channel to this node; calls go through the session");
                NodeChannel::Unavailable { until, failures }
            }
        };
        let connection = match &channel {
            NodeChannel::Open(connection) => Some(connection.clone()),
            NodeChannel::Unavailable { .. } => None,
        };
        if let Ok(mut nodes) = self.nodes.lock() {
            // Broken connections of nodes no longer called (dead, scaled away) are dropped
            // whenever a channel is opened, so their descriptors do not pile up.
            nodes.retain(|_, known| !matches!(known, NodeChannel::Open(c) if !c.is_open()));
            nodes.insert(target.node.to_string(), channel);
            if let Ok(mut gates) = self.gates.lock() {
                gates.retain(|node, gate| nodes.contains_key(node) || Arc::strong_count(gate) > 1);
            }
        }
        connection
    }

    /// What is known of `node`'s channel: `Some(Some(c))` open, `Some(None)` unavailable
    /// for now, `None` nothing usable (never tried, broken, or time to retry).
    fn known(&self, node: &str) -> Option<Option<Arc<Connection>>> {
        let mut nodes = self.nodes.lock().ok()?;
        match nodes.get(node)? {
            NodeChannel::Open(connection) if connection.is_open() => Some(Some(connection.clone())),
            // Broken: forgotten here, so its socket closes once no call holds it (a node
            // that died is never asked again and must not keep a descriptor).
            NodeChannel::Open(_) => {
                nodes.remove(node);
                None
            }
            NodeChannel::Unavailable { until, .. } if Instant::now() < *until => Some(None),
            NodeChannel::Unavailable { .. } => None,
        }
    }
}

/// Asks the node's router for its channel address and opens a connection to it.
async fn open(tls: &CallTls, target: &Target<'_>, path: CallPath) -> Result<Connection> {
    let reply = wire::call_raw(target.router, wire::encode(&RouterQuery::CallAddress), CONNECT_TIMEOUT)
        .await
        .map_err(|e| match e {
            CallError::Timeout => Error::Timeout {
                what: format!("node {}'s router naming its call channel", target.node),
                timeout: CONNECT_TIMEOUT,
            },
            CallError::Unreachable(cause) | CallError::NotSent(cause) => Error::Rejected(cause),
        })?;
    let address: std::result::Result<Option<CallAddress>, Failure> =
        wire::decode(&reply, "a router's call channel address").map_err(|f| failure_to_error(f, None))?;
    let address = address
        .map_err(|f| failure_to_error(f, None))?
        .ok_or_else(|| Error::Rejected(format!("node {} serves no call channel", target.node)))?;
    if path == CallPath::Tcp {
        let tcp_only = CallAddress { local: None, ..address };
        return connect(tls, &tcp_only, target.node).await;
    }
    connect(tls, &address, target.node).await
}

/// Opens a connection to the call channel at `address` (node `node`'s): by its Unix
/// socket when the node runs on this host, else (or when that fails) by TCP.
pub(super) async fn connect(tls: &CallTls, address: &CallAddress, node: &str) -> Result<Connection> {
    let local = address
        .local
        .as_ref()
        .filter(|local| this_host().is_some_and(|host| host == local.host));
    if let Some(local) = local {
        match connect_local(&local.name) {
            Ok(stream) => return secure(tls, Socket::Unix(stream), &address.tcp, node).await,
            Err(e) => tracing::debug!(%node, error = %e, "same-host call socket unreachable; using TCP"),
        }
    }
    let tcp = &address.tcp;
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(tcp))
        .await
        .map_err(|_| Error::Timeout {
            what: format!("connecting to the call channel at {tcp}"),
            timeout: CONNECT_TIMEOUT,
        })?
        .map_err(io(format!("connect to {tcp}")))?;
    stream.set_nodelay(true).map_err(io("set TCP_NODELAY".into()))?;
    keep_alive(&stream).map_err(io("set TCP keep-alives".into()))?;
    secure(tls, Socket::Tcp(stream), tcp, node).await
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |cause| Error::Io { context, cause }
}

/// Runs the TLS handshake over `socket` and starts the connection.
async fn secure(tls: &CallTls, socket: Socket, address: &str, node: &str) -> Result<Connection> {
    let transport = socket.transport();
    let handshake = tls.connector.connect(tls.server_name(node), socket);
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, handshake)
        .await
        .map_err(|_| Error::Timeout {
            what: format!("the TLS handshake with the call channel at {address}"),
            timeout: CONNECT_TIMEOUT,
        })?
        .map_err(io(format!("TLS handshake with {address}")))?;
    Ok(Connection::start(stream, node, transport))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_channel_is_retried_ever_less_often_up_to_a_bound() {
        let now = Instant::now();
        let waits: Vec<Duration> = (1..=12).map(|n| retry_at(now, n) - now).collect();
        assert_eq!(waits[0], RETRY_AFTER);
        assert_eq!(waits[1], RETRY_AFTER * 2);
        assert_eq!(waits[3], RETRY_AFTER * 8);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*waits.last().unwrap(), RETRY_AFTER_MAX);
        assert_eq!(retry_at(now, u32::MAX) - now, RETRY_AFTER_MAX);
    }
}

/// How one call ended, as its connection's reader saw it.
enum Outcome {
    /// The answer, and for a timed call the server's stamps and when the reader had it.
    Answered(Vec<u8>, Option<(ServerStamps, u64)>),
    Lost,
    Broken(String),
}

/// Every stamp of one timed call over the channel, in nanoseconds of the host's wall
/// clock (comparable across processes of one host only).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hops {
    /// The connection was asked to send the call.
    pub(crate) start: u64,
    /// The request frame was written and flushed.
    pub(crate) sent: u64,
    /// The serving side's stamps.
    pub(crate) server: ServerStamps,
    /// This process's connection reader had read the reply.
    pub(crate) received: u64,
    /// The calling task held the reply.
    pub(crate) woken: u64,
}

/// Calls waiting for replies, and why the connection broke once it has.
#[derive(Default)]
struct Pending {
    calls: HashMap<u64, oneshot::Sender<Outcome>>,
    broken: Option<String>,
}

type Stream = TlsStream<Socket>;

/// Why a call or cast on a connection did not complete.
pub(super) enum Unsent {
    /// Nothing of it was sent: the connection had broken before (another path may take it).
    NotSent,
    /// It was sent, or may have been in part.
    Failed(CallError),
}

/// Breaks the connection if dropped before [`MidFrame::done`]: a write abandoned part-way
/// (the caller's future was dropped: its timeout, a `select!`, a killed actor's handler)
/// leaves a partial frame on the stream, after which nothing more may be written on it.
struct MidFrame<'a> {
    connection: &'a Connection,
    done: bool,
}

impl Drop for MidFrame<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.connection
                .break_with("a message was abandoned part-way through being sent".into());
        }
    }
}

/// One connection to a serving process.
pub(super) struct Connection {
    transport: Transport,
    writer: tokio::sync::Mutex<WriteHalf<Stream>>,
    pending: Arc<Mutex<Pending>>,
    next_seq: AtomicU64,
    reader: JoinHandle<()>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Connection {
    fn start(stream: Stream, node: &str, transport: Transport) -> Self {
        let (reader, writer) = tokio::io::split(stream);
        let pending = Arc::new(Mutex::new(Pending::default()));
        let reader = tokio::spawn(read_replies(reader, pending.clone(), node.to_string()));
        Self {
            transport,
            writer: tokio::sync::Mutex::new(writer),
            pending,
            next_seq: AtomicU64::new(0),
            reader,
        }
    }

    /// Which socket the connection runs over.
    pub(super) fn transport(&self) -> Transport {
        self.transport
    }

    pub(super) fn is_open(&self) -> bool {
        self.pending.lock().map(|p| p.broken.is_none()).unwrap_or(false)
    }

    #[cfg(test)]
    pub(super) async fn call(
        &self,
        actor: ActorId,
        request: &[u8],
        deadline: Instant,
    ) -> std::result::Result<Vec<u8>, Unsent> {
        self.call_with(actor, request, deadline, false)
            .await
            .map(|(reply, _)| reply)
    }

    /// Sends one call and waits for its answer; `timed` asks the server for its stamps.
    #[cfg(test)]
    pub(super) async fn call_with(
        &self,
        actor: ActorId,
        request: &[u8],
        deadline: Instant,
        timed: bool,
    ) -> std::result::Result<(Vec<u8>, Option<Hops>), Unsent> {
        self.send_call(actor, request, deadline, timed, &mut None).await
    }

    /// Sends one call and waits for its answer, firing `sent` (when given) once the request
    /// is written; `timed` asks the server for its stamps.
    async fn send_call(
        &self,
        actor: ActorId,
        request: &[u8],
        deadline: Instant,
        timed: bool,
        sent: &mut Option<oneshot::Sender<()>>,
    ) -> std::result::Result<(Vec<u8>, Option<Hops>), Unsent> {
        let start = if timed { wall_clock_ns() } else { 0 };
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let (sender, answer) = oneshot::channel();
        {
            let mut pending = self.pending.lock().map_err(|_| Unsent::NotSent)?;
            if pending.broken.is_some() {
                return Err(Unsent::NotSent);
            }
            pending.calls.insert(seq, sender);
        }
        let kind = if timed {
            RequestKind::TimedCall
        } else {
            RequestKind::Call
        };
        let frame = RequestHeader::frame(kind, seq, actor, request);
        let written = tokio::time::timeout_at(deadline.into(), self.write(&frame)).await;
        let sent_at = if timed { wall_clock_ns() } else { 0 };
        let forget = || {
            if let Ok(mut pending) = self.pending.lock() {
                pending.calls.remove(&seq);
            }
        };
        match written {
            Ok(Ok(())) => {
                if let Some(sent) = sent.take() {
                    let _ = sent.send(());
                }
            }
            Ok(Err(unsent)) => {
                forget();
                return Err(unsent);
            }
            // Still waiting for the writer (nothing sent), or cut off part-way (then the
            // guard in `write` broke the connection).
            Err(_) => {
                forget();
                return Err(Unsent::Failed(CallError::Timeout));
            }
        }
        match tokio::time::timeout_at(deadline.into(), answer).await {
            Ok(Ok(Outcome::Answered(reply, stamps))) => {
                let hops = stamps.map(|(server, received)| Hops {
                    start,
                    sent: sent_at,
                    server,
                    received,
                    woken: wall_clock_ns(),
                });
                Ok((reply, hops))
            }
            Ok(Ok(Outcome::Lost)) => Err(Unsent::Failed(CallError::Unreachable(
                "the actor stopped or its node was lost before replying".into(),
            ))),
            Ok(Ok(Outcome::Broken(why))) => Err(Unsent::Failed(CallError::Unreachable(why))),
            Ok(Err(_)) => Err(Unsent::Failed(CallError::Unreachable("the call channel closed".into()))),
            Err(_) => {
                forget();
                Err(Unsent::Failed(CallError::Timeout))
            }
        }
    }

    pub(super) async fn cast(&self, actor: ActorId, message: &[u8]) -> std::result::Result<(), Unsent> {
        let frame = RequestHeader::frame(RequestKind::Cast, 0, actor, message);
        match tokio::time::timeout(CAST_TIMEOUT, self.write(&frame)).await {
            Ok(written) => written,
            Err(_) => Err(Unsent::Failed(CallError::Timeout)),
        }
    }

    /// Writes one whole frame, or breaks the connection: on a write error, or when this
    /// future is dropped part-way. Cancelling it while it waits for the writer is harmless.
    async fn write(&self, frame: &[u8]) -> std::result::Result<(), Unsent> {
        let mut writer = self.writer.lock().await;
        // Another writer may have broken the connection, part-way through its frame.
        if !self.is_open() {
            return Err(Unsent::NotSent);
        }
        let mut guard = MidFrame {
            connection: self,
            done: false,
        };
        let written = match writer.write_all(frame).await {
            Ok(()) => writer.flush().await,
            Err(e) => Err(e),
        };
        guard.done = true;
        written.map_err(|e| {
            let why = format!("the call channel broke: {e}");
            self.break_with(why.clone());
            Unsent::Failed(CallError::Unreachable(why))
        })
    }

    fn break_with(&self, why: String) {
        fail_all(&self.pending, why);
        self.reader.abort();
    }
}

/// Marks the connection broken and fails every call waiting on it.
fn fail_all(pending: &Mutex<Pending>, why: String) {
    let waiting = match pending.lock() {
        Ok(mut pending) => {
            pending.broken.get_or_insert(why.clone());
            std::mem::take(&mut pending.calls)
        }
        Err(_) => return,
    };
    for (_, call) in waiting {
        let _ = call.send(Outcome::Broken(why.clone()));
    }
}

/// Hands each reply to its call until the connection ends.
async fn read_replies(mut reader: ReadHalf<Stream>, pending: Arc<Mutex<Pending>>, node: String) {
    let why = loop {
        let mut header = [0u8; REPLY_HEADER_BYTES];
        if let Err(e) = reader.read_exact(&mut header).await {
            break format!("the call channel to node {node} closed: {e}");
        }
        let reply = match ReplyHeader::parse(&header) {
            Ok(reply) => reply,
            Err(e) => break format!("node {node} sent a bad reply: {e}"),
        };
        // A timed reply's stamps are read apart, so the answer is never copied.
        let (stamps, answer_len) = if reply.status == ReplyStatus::AnsweredTimed {
            let Some(answer_len) = reply.len.checked_sub(ServerStamps::BYTES) else {
                break format!(
                    "node {node} sent a bad reply: a timed reply of {} bytes cannot hold its {} bytes of stamps",
                    reply.len,
                    ServerStamps::BYTES
                );
            };
            let mut stamps = [0u8; ServerStamps::BYTES];
            if let Err(e) = reader.read_exact(&mut stamps).await {
                break format!("the call channel to node {node} closed mid-reply: {e}");
            }
            (Some(ServerStamps::parse(&stamps)), answer_len)
        } else {
            (None, reply.len)
        };
        let mut payload = vec![0u8; answer_len];
        if let Err(e) = reader.read_exact(&mut payload).await {
            break format!("the call channel to node {node} closed mid-reply: {e}");
        }
        let outcome = match reply.status {
            ReplyStatus::Answered | ReplyStatus::AnsweredTimed => {
                Outcome::Answered(payload, stamps.map(|stamps| (stamps, wall_clock_ns())))
            }
            ReplyStatus::Lost => Outcome::Lost,
        };
        let call = pending.lock().ok().and_then(|mut p| p.calls.remove(&reply.seq));
        // A call that timed out meanwhile is no longer waiting.
        if let Some(call) = call {
            let _ = call.send(outcome);
        }
    };
    fail_all(&pending, why);
}
