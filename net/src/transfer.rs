//! Moving objects between nodes over TCP with TLS 1.3 (mutual, from the cluster token),
//! and between processes on one host through shared memory.
//!
//! A connection starts with a TLS 1.3 handshake (mutual, from the cluster token, ALPN
//! [`TRANSFER_ALPN`]); the holder then says hello through TLS, and from there on both ends
//! speak sealed frames keyed from that handshake ([`crate::sealed`]: AES-128-GCM frames of
//! up to a whole chunk, sealed straight from the object and opened in place in the
//! receiver's buffer, where TLS records would be 16 KiB each and copied through rustls's
//! buffers on both sides).
//!
//! Protocol, in frames, on a connection reused for one object after another:
//! - request: the 16-byte object id, a flags byte (bit 0: the caller can map shared memory)
//!   and the caller's 24-byte [`HostKey`];
//! - reply: a message whose first byte is a status:
//!   - 0: not held;
//!   - 2 (only to a caller on the same host and PID namespace): followed by a 32-byte
//!     shared-memory [`Handle`]; the caller answers one byte, 1 when it mapped the segment
//!     (done) or 0 when it could not (the reply goes on as a stream, status message first);
//!   - 1: the object streamed: followed by its size (u64 LE); then one frame per chunk of
//!     up to [`CHUNK_BYTES`], the frame's word 0; the caller answers one byte once it has
//!     every chunk, and the holder keeps the object pinned until then.
//!
//! The receiver reads each chunk straight into the object's buffer, opens it there (AES-GCM
//! has checked it was not changed on the way) and runs the CRC over it; the whole object's
//! CRC must equal the directory's: one CRC pass per byte on the receiving side. A chunk's
//! CRC does not travel: a frame's header is authenticated but not encrypted, and a CRC of
//! a small object's bytes gives them away (a 4-byte object is recovered exactly from it). A shared-memory segment is checked for
//! identity, length and seals instead (its bytes never left the host).
//!
//! Why TCP and not QUIC: on the machines measured (docs/NOTES.md), quinn's per-packet work
//! in user space held one QUIC connection to 0.26-0.35 GB/s, while the kernel's TCP with
//! rustls moved 0.38-0.70 GB/s on the same cores. A peer that stops answering fails the
//! transfer after [`IO_TIMEOUT`] without progress.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

pub use crate::ca::SERVER_NAME;
use crate::error::{Error, Result};
use crate::handshake_slots::{HandshakeSlots, MAX_HANDSHAKES_PER_SOURCE};
use crate::identity::TlsIdentity;
use crate::idle_pool::{IdlePool, IDLE_LIMIT};
use crate::sealed::SealedStream;
use regatta_object_store::ObjectId;
use regatta_object_store::{HostKey, Segment, SharedHandle as Handle};

mod serve;

use serve::serve_connection;

/// Bytes per chunk on the wire.
pub const CHUNK_BYTES: usize = 1 << 20;

/// ALPN protocol id of the object transfer: a peer of another version fails the handshake
/// with "no application protocol" instead of misreading frames.
pub const TRANSFER_ALPN: &[u8] = b"regatta-objects/3";

/// Environment variable that makes a serving node corrupt one byte of the first chunk it
/// sends (and offer no shared memory, so the network path runs): a fault-injection hook for
/// the integrity tests, never set in production.
pub const FAULT_CORRUPT_ENV: &str = "REGATTA_FAULT_CORRUPT_TRANSFER";

/// Environment variable that turns the same-host shared-memory path off (any value but
/// `0`): every transfer then goes over the network stack, as between hosts.
pub const NO_SHARED_MEMORY_ENV: &str = "REGATTA_NO_SHARED_MEMORY";

const REQUEST_LEN: usize = 16 + 1 + HostKey::LEN;
const WANTS_SHARED: u8 = 1;
const STATUS_MISSING: u8 = 0;
const STATUS_STREAM: u8 = 1;
const STATUS_SHARED: u8 = 2;

/// How long a holder waits for a same-host caller to say whether it mapped a segment.
const SHARED_ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// How long any read or write of a transfer may make no progress before the transfer
/// fails (a killed or cut-off peer).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// How long connecting and the TLS handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Idle connections kept per peer for the next transfers.
const IDLE_PER_PEER: usize = 8;

/// New connections one transfer endpoint (a process has one) opens at once, all peers
/// together: a burst of gets (two
/// hundred actors of one worker reading one object) waits here rather than crowding a
/// holder's handshake slots, of which one address holds at most
/// [`MAX_HANDSHAKES_PER_SOURCE`]; four processes of one host bursting together still fit.
const CONNECTING_AT_ONCE: usize = MAX_HANDSHAKES_PER_SOURCE / 4;

/// What a node serves: pinned bytes of objects it holds.
pub trait ObjectSource: Send + Sync + 'static {
    /// The object's bytes, pinned until [`ObjectSource::release`].
    fn open(&self, id: ObjectId) -> Option<Bytes>;
    /// Unpins an object opened with [`ObjectSource::open`].
    fn release(&self, id: ObjectId);
    /// Counts bytes sent to peers (for metrics).
    fn sent(&self, _bytes: u64) {}
    /// The object in a shared-memory segment, made on first use and kept while the object
    /// is held (so every same-host reader maps the same pages). Called on a blocking
    /// thread: making one copies the object. `None`: not held, or no segment can be made.
    fn share(&self, _id: ObjectId) -> Option<Arc<Segment>> {
        None
    }
}

/// An object pulled from a peer: its bytes, and the shared-memory segment they are mapped
/// from when it came by the same-host path (the mapping alone keeps the pages; the segment
/// is an open descriptor).
#[derive(Debug)]
pub struct Fetched {
    /// The object's bytes.
    pub bytes: Bytes,
    /// The segment mapped, for a same-host transfer.
    pub segment: Option<Arc<Segment>>,
}

fn shared_memory_allowed() -> bool {
    std::env::var_os(NO_SHARED_MEMORY_ENV).is_none_or(|v| v == "0")
}

/// What one node shares between its clones: the listener (until served), TLS, idle
/// connections.
struct Shared {
    local: SocketAddr,
    listener: Mutex<Option<std::net::TcpListener>>,
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    /// Idle connections by peer, each with the holder whose certificate it checked.
    idle: Mutex<IdlePool<(String, SealedStream)>>,
    /// Whether certificates name their holders (a cluster authority's do): a fetch then
    /// checks that the peer is the holder the directory named.
    names_holders: bool,
    connecting: tokio::sync::Semaphore,
}

/// A node's object transfer endpoint: serves its objects and fetches from peers.
#[derive(Clone)]
pub struct Transfer {
    shared: Arc<Shared>,
    corrupt: bool,
    /// This process's host key when the shared-memory path is on.
    host: Option<HostKey>,
}

/// Turns TCP keep-alives on with short intervals (10 s idle, then 3 probes 5 s apart): a
/// connection whose peer vanished without a word (a host gone, a NAT that forgot it)
/// fails within about 25 s instead of looking open. Used by the runtime's call channel too.
pub fn keep_alive(stream: &TcpStream) -> io::Result<()> {
    let probes = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    socket2::SockRef::from(stream).set_tcp_keepalive(&probes)
}

/// Runs `operation` with [`IO_TIMEOUT`]: a stalled peer becomes an error.
async fn timed<T>(operation: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    match tokio::time::timeout(IO_TIMEOUT, operation).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no progress in {IO_TIMEOUT:?}"),
        )),
    }
}

/// How an attempt on one connection failed.
enum Attempt {
    /// Before any answer: the connection may have been closed while idle (or the peer
    /// refused this node at its handshake).
    NoAnswer(io::Error),
    /// After the peer answered: the transfer itself failed.
    Failed(Error),
}

impl Transfer {
    /// Binds a TCP listener at `bind` (port 0 picks one); it accepts once
    /// [`Transfer::serve`] runs.
    pub fn bind(bind: SocketAddr, identity: &TlsIdentity) -> Result<Self> {
        let listener =
            std::net::TcpListener::bind(bind).map_err(|e| Error::Transfer(format!("cannot bind TCP {bind}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Transfer(format!("cannot set up the listener on {bind}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Transfer(format!("no local address: {e}")))?;
        let corrupt = std::env::var_os(FAULT_CORRUPT_ENV).is_some();
        let (acceptor, connector) = crate::sealed::tls_for_frames(identity, TRANSFER_ALPN);
        Ok(Self {
            shared: Arc::new(Shared {
                local,
                listener: Mutex::new(Some(listener)),
                acceptor,
                connector,
                idle: Mutex::new(IdlePool::new(IDLE_PER_PEER, IDLE_LIMIT)),
                names_holders: identity.names_nodes,
                connecting: tokio::sync::Semaphore::new(CONNECTING_AT_ONCE),
            }),
            corrupt,
            host: (shared_memory_allowed() && !corrupt)
                .then(HostKey::this_process)
                .flatten(),
        })
    }

    /// Turns the same-host shared-memory path off (or back on) for this endpoint, both for
    /// what it serves and what it fetches.
    pub fn set_shared_memory(&mut self, on: bool) {
        self.host = if on && !self.corrupt {
            HostKey::this_process()
        } else {
            None
        };
    }

    /// Whether this endpoint offers and uses the shared-memory path.
    pub fn shared_memory(&self) -> bool {
        self.host.is_some()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local
    }

    /// Serves objects from `source` for as long as the process runs (once per endpoint; a
    /// second call does nothing).
    pub fn serve(&self, source: Arc<dyn ObjectSource>) {
        let Some(listener) = self.shared.listener.lock().ok().and_then(|mut l| l.take()) else {
            return;
        };
        let listener = match TcpListener::from_std(listener) {
            Ok(listener) => listener,
            Err(e) => {
                tracing::error!(error = %e, "cannot serve objects");
                return;
            }
        };
        let (acceptor, corrupt, host) = (self.shared.acceptor.clone(), self.corrupt, self.host);
        tokio::spawn(async move {
            let handshakes = HandshakeSlots::new();
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot accept an object-transfer connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                // Connections that never finish their handshake hold a slot each, and one
                // address only a quarter of them: silent ones cannot pile up without bound.
                let slot = match handshakes.take(peer.ip()) {
                    Ok(slot) => slot,
                    Err(refusal) => {
                        tracing::warn!(%peer, "closed an object-transfer connection at once: {refusal}");
                        continue;
                    }
                };
                let (acceptor, source) = (acceptor.clone(), source.clone());
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    let _ = keep_alive(&stream);
                    let opening = async { SealedStream::server(acceptor.accept(stream).await?).await };
                    let handshake = tokio::time::timeout(CONNECT_TIMEOUT, opening).await;
                    drop(slot);
                    let stream = match handshake {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(e)) => {
                            tracing::warn!(%peer, error = %e, "refused an object-transfer connection");
                            return;
                        }
                        Err(_) => {
                            tracing::warn!(%peer, "an object-transfer handshake timed out");
                            return;
                        }
                    };
                    if let Err(e) = serve_connection(stream, source, corrupt, host).await {
                        tracing::debug!(%peer, error = %e, "object transfer connection ended early");
                    }
                });
            }
        });
    }

    async fn connect(&self, peer: SocketAddr, holder: &str) -> Result<SealedStream> {
        let handshake = async {
            let stream = TcpStream::connect(peer).await?;
            stream.set_nodelay(true)?;
            keep_alive(&stream)?;
            let name = ServerName::try_from(SERVER_NAME).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let tls = self.shared.connector.connect(name, stream).await?;
            if self.shared.names_holders {
                let leaf = tls.get_ref().1.peer_certificates().and_then(|chain| chain.first());
                if !leaf.is_some_and(|leaf| certifies_holder(leaf.as_ref(), holder)) {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("its certificate is not {holder}'s"),
                    ));
                }
            }
            SealedStream::client(tls).await
        };
        // Never closed, so acquiring only waits; the wait is not part of the timeout.
        let _turn = self.shared.connecting.acquire().await;
        match tokio::time::timeout(CONNECT_TIMEOUT, handshake).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(Error::Transfer(format!(
                "cannot connect to {peer} (TCP connect or TLS handshake): {e}"
            ))),
            Err(_) => Err(Error::Transfer(format!(
                "connecting to {peer} (TCP and TLS handshake) took over {CONNECT_TIMEOUT:?}"
            ))),
        }
    }

    /// An idle connection to `peer` checked to be `holder`'s (one checked for another
    /// holder, a process since gone from that address, is closed).
    fn take_idle(&self, peer: SocketAddr, holder: &str) -> Option<SealedStream> {
        let (checked, stream) = self.shared.idle.lock().ok()?.take(peer, std::time::Instant::now())?;
        (checked == holder).then_some(stream)
    }

    fn put_idle(&self, peer: SocketAddr, holder: &str, stream: SealedStream) {
        if let Ok(mut idle) = self.shared.idle.lock() {
            idle.put(peer, (holder.to_string(), stream), std::time::Instant::now());
        }
    }

    /// Fetches an object from `peer`, the process the directory names `holder` (a node's
    /// name, a client's, or the head's `head`), checking its size and CRC-32 against the
    /// directory's (a same-host segment: its identity, size and seals). Under the cluster's
    /// authority the peer's certificate must be the holder's: a process at that address
    /// holding another certificate of the cluster is refused.
    pub async fn fetch(
        &self,
        peer: SocketAddr,
        holder: &str,
        id: ObjectId,
        size: u64,
        checksum: u32,
    ) -> Result<Fetched> {
        // An idle connection may have been closed by the peer since: a fresh one is tried
        // when it gives no answer.
        if let Some(stream) = self.take_idle(peer, holder) {
            match self.fetch_on(stream, peer, id, size, checksum).await {
                Ok((fetched, stream)) => {
                    self.put_idle(peer, holder, stream);
                    return Ok(fetched);
                }
                Err(Attempt::Failed(e)) => return Err(e),
                Err(Attempt::NoAnswer(_)) => {}
            }
        }
        let stream = self.connect(peer, holder).await?;
        match self.fetch_on(stream, peer, id, size, checksum).await {
            Ok((fetched, stream)) => {
                self.put_idle(peer, holder, stream);
                Ok(fetched)
            }
            Err(Attempt::Failed(e)) => Err(e),
            // TLS 1.3 finishes the caller's side of the handshake before the holder checks
            // the caller's certificate: a refusal shows here.
            Err(Attempt::NoAnswer(e)) => Err(Error::Transfer(format!(
                "no answer from {peer} for {id} (refused at the TLS handshake, or the connection dropped): {e}"
            ))),
        }
    }

    /// One fetch on one connection; gives the connection back when it ended cleanly.
    async fn fetch_on(
        &self,
        mut stream: SealedStream,
        peer: SocketAddr,
        id: ObjectId,
        size: u64,
        checksum: u32,
    ) -> std::result::Result<(Fetched, SealedStream), Attempt> {
        let mut reply = self.ask(&mut stream, id).await.map_err(Attempt::NoAnswer)?;
        let failed = |e: &dyn std::fmt::Display| transfer_failed(id, peer, e);
        if reply.first() == Some(&STATUS_SHARED) {
            match map_segment(&mut stream, &reply, peer, id, size).await? {
                Ok(fetched) => return Ok((fetched, stream)),
                Err(reason) => {
                    tracing::debug!(%id, %peer, %reason, "cannot map the peer's segment; streaming instead");
                    reply = timed(stream.receive_message()).await.map_err(|e| failed(&e))?.1;
                }
            }
        }
        let their_size = streamed_size(&reply, peer, id)?;
        let bytes = receive_stream(&mut stream, peer, id, their_size, size, checksum).await?;
        // Tell the holder it may unpin the object.
        timed(stream.send(0, &[1])).await.map_err(|e| failed(&e))?;
        Ok((Fetched { bytes, segment: None }, stream))
    }

    /// Sends the request for `id` (offering this host's key when the shared-memory path is
    /// on) and waits for the holder's first answer.
    async fn ask(&self, stream: &mut SealedStream, id: ObjectId) -> io::Result<Vec<u8>> {
        let mut request = [0u8; REQUEST_LEN];
        request[..16].copy_from_slice(&id.to_bytes());
        if let Some(host) = self.host {
            request[16] = WANTS_SHARED;
            request[17..].copy_from_slice(&host.to_bytes());
        }
        // A holder asked for shared memory first copies the object into a segment (or
        // waits for another pull's copy): that answer may take longer than a stream's.
        let first_answer = if self.host.is_some() {
            SHARED_ANSWER_TIMEOUT
        } else {
            IO_TIMEOUT
        };
        timed(stream.send(0, &request)).await?;
        match tokio::time::timeout(first_answer, stream.receive_message()).await {
            Ok(read) => Ok(read?.1),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer in {first_answer:?}"),
            )),
        }
    }
}

/// Why a same-host holder's segment was not mapped: not a failure, the holder then
/// streams the object.
#[derive(Debug, thiserror::Error)]
enum Unmapped {
    /// The handle names a segment of another size than the directory's.
    #[error("segment of {segment} bytes, the directory says {size}")]
    Size {
        /// The segment's bytes.
        segment: u64,
        /// The object's bytes, as the directory has them.
        size: u64,
    },
    /// Opening or mapping the segment failed.
    #[error(transparent)]
    Map(#[from] io::Error),
}

/// Maps the segment a same-host holder's `reply` hands over and tells the holder whether
/// it could; the inner error says why not (the holder then streams the object).
async fn map_segment(
    stream: &mut SealedStream,
    reply: &[u8],
    peer: SocketAddr,
    id: ObjectId,
    size: u64,
) -> std::result::Result<std::result::Result<Fetched, Unmapped>, Attempt> {
    let failed = |e: &dyn std::fmt::Display| transfer_failed(id, peer, e);
    let handle = <[u8; Handle::LEN]>::try_from(&reply[1..])
        .map(|raw| Handle::from_bytes(&raw))
        .map_err(|_| failed(&format!("a shared-memory handle of {} bytes", reply.len() - 1)))?;
    let mapped = if handle.len == size {
        tokio::task::spawn_blocking(move || {
            let segment = Arc::new(Segment::open(&handle)?);
            let bytes = segment.map()?;
            Ok::<_, io::Error>((segment, bytes))
        })
        .await
        .map_err(|e| failed(&e))?
        .map_err(Unmapped::Map)
    } else {
        Err(Unmapped::Size {
            segment: handle.len,
            size,
        })
    };
    let answer = u8::from(mapped.is_ok());
    timed(stream.send(0, &[answer])).await.map_err(|e| failed(&e))?;
    Ok(mapped.map(|(segment, bytes)| Fetched {
        bytes,
        segment: Some(segment),
    }))
}

/// The size a holder's stream `reply` announces; a holder without the object fails the
/// pull with [`Error::NotHeld`].
fn streamed_size(reply: &[u8], peer: SocketAddr, id: ObjectId) -> std::result::Result<u64, Attempt> {
    let failed = |e: &dyn std::fmt::Display| transfer_failed(id, peer, e);
    match reply.first() {
        Some(&STATUS_STREAM) => {}
        Some(&STATUS_MISSING) => {
            return Err(Attempt::Failed(Error::NotHeld {
                id,
                peer: peer.to_string(),
            }))
        }
        other => return Err(failed(&format!("unknown status {other:?}"))),
    }
    <[u8; 8]>::try_from(&reply[1..])
        .map(u64::from_le_bytes)
        .map_err(|_| failed(&format!("a stream header of {} bytes", reply.len())))
}

/// A pull that failed on its connection, naming the object and the peer.
fn transfer_failed(id: ObjectId, peer: SocketAddr, e: &dyn std::fmt::Display) -> Attempt {
    Attempt::Failed(Error::Transfer(format!("transfer of {id} from {peer}: {e}")))
}

/// Reads a streamed object of `their_size` bytes straight into its buffer, checking its
/// size against the directory's, every chunk's CRC and the whole object's.
async fn receive_stream(
    stream: &mut SealedStream,
    peer: SocketAddr,
    id: ObjectId,
    their_size: u64,
    size: u64,
    checksum: u32,
) -> std::result::Result<Bytes, Attempt> {
    let failed = |e: &dyn std::fmt::Display| transfer_failed(id, peer, e);
    let corrupt = |detail: String| Attempt::Failed(Error::Corrupt { id, detail });
    if their_size != size {
        return Err(corrupt(format!(
            "{peer} announced {their_size} bytes, the directory says {size}"
        )));
    }
    let length = usize::try_from(size).map_err(|_| failed(&"object too large for this platform"))?;
    let mut buffer = crate::receive_pool::take(length);
    // Large objects: the buffer's pages are faulted in beside the transfer, not inside it.
    let prefault = (length >= crate::receive_pool::MIN_POOLED)
        .then(|| regatta_object_store::Prefault::start(&mut buffer))
        .flatten();
    let filled = fill(stream, &mut buffer, peer, id, checksum).await;
    drop(prefault);
    match filled {
        Ok(()) => Ok(crate::receive_pool::into_bytes(buffer)),
        Err(e) => {
            crate::receive_pool::give_back(buffer);
            Err(e)
        }
    }
}

/// Fills `buffer` from the stream's chunk frames, checking the whole object's CRC.
async fn fill(
    stream: &mut SealedStream,
    buffer: &mut [u8],
    peer: SocketAddr,
    id: ObjectId,
    checksum: u32,
) -> std::result::Result<(), Attempt> {
    let failed = |e: &dyn std::fmt::Display| transfer_failed(id, peer, e);
    let corrupt = |detail: String| Attempt::Failed(Error::Corrupt { id, detail });
    let length = buffer.len();
    let mut whole = crc32fast::Hasher::new();
    let mut filled = 0usize;
    while filled < length {
        let room = (length - filled).min(CHUNK_BYTES);
        let slot = &mut buffer[filled..filled + room];
        let (_, chunk_len) = timed(stream.receive_into(slot)).await.map_err(|e| failed(&e))?;
        if chunk_len == 0 {
            return Err(corrupt(format!("an empty chunk at offset {filled}")));
        }
        whole.update(&slot[..chunk_len]);
        filled += chunk_len;
    }
    if whole.finalize() != checksum {
        return Err(corrupt(format!("whole-object CRC mismatch from {peer}")));
    }
    Ok(())
}

/// Whether `leaf` (a certificate of the cluster's authority) is the one of the process the
/// directory names `holder`: the head's for `head`, else the node's or client's of that name.
fn certifies_holder(leaf: &[u8], holder: &str) -> bool {
    match crate::ca::role_of(leaf) {
        Some(crate::ca::Role::Head) => holder == "head",
        Some(crate::ca::Role::Node(name) | crate::ca::Role::Client(name)) => name == holder,
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::identity_from_secret;
    use regatta_object_store::crc32;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct One(ObjectId, Bytes);

    impl ObjectSource for One {
        fn open(&self, id: ObjectId) -> Option<Bytes> {
            (id == self.0).then(|| self.1.clone())
        }
        fn release(&self, _id: ObjectId) {}
    }

    /// A source that hands out a segment for its object (as the runtime's store does).
    struct Shares(ObjectId, Bytes, Mutex<Option<Arc<Segment>>>);

    impl ObjectSource for Shares {
        fn open(&self, id: ObjectId) -> Option<Bytes> {
            (id == self.0).then(|| self.1.clone())
        }
        fn release(&self, _id: ObjectId) {}
        fn share(&self, id: ObjectId) -> Option<Arc<Segment>> {
            if id != self.0 {
                return None;
            }
            let mut made = self.2.lock().unwrap();
            Some(
                made.get_or_insert_with(|| Arc::new(Segment::create(&self.1).unwrap()))
                    .clone(),
            )
        }
    }

    /// A source whose "segment" is a plain file no peer may map (unsealed).
    struct Unsealed(ObjectId, Bytes, std::path::PathBuf);

    impl ObjectSource for Unsealed {
        fn open(&self, id: ObjectId) -> Option<Bytes> {
            (id == self.0).then(|| self.1.clone())
        }
        fn release(&self, _id: ObjectId) {}
        fn share(&self, _id: ObjectId) -> Option<Arc<Segment>> {
            std::fs::write(&self.2, &self.1).unwrap();
            let file = std::fs::File::open(&self.2).unwrap();
            Some(Arc::new(Segment::unsealed(file).unwrap()))
        }
    }

    #[tokio::test]
    async fn same_host_peers_map_one_shared_segment() {
        let server = node("t");
        assert!(server.shared_memory(), "on by default on Linux");
        let id = ObjectId(5);
        let bytes = object(2 * CHUNK_BYTES + 3);
        server.serve(Arc::new(Shares(id, bytes.clone(), Mutex::new(None))));
        let addr = server.local_addr();
        let (one, two) = (node("t"), node("t"));
        let first = one
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        let second = two
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(first.bytes, bytes);
        assert_eq!(second.bytes, bytes);
        let (a, b) = (first.segment.unwrap().handle(), second.segment.unwrap().handle());
        assert_eq!((a.dev, a.inode), (b.dev, b.inode), "both map the same pages");

        // A caller with the path off gets the same bytes over the network.
        let mut plain = node("t");
        plain.set_shared_memory(false);
        let streamed = plain
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(streamed.bytes, bytes);
        assert!(streamed.segment.is_none());
        // A wrong directory size is refused on this path too.
        let wrong = one
            .fetch(addr, "peer", id, bytes.len() as u64 + 1, 0)
            .await
            .unwrap_err();
        assert!(matches!(wrong, Error::Corrupt { .. }), "{wrong}");
    }

    #[tokio::test]
    async fn a_segment_the_caller_cannot_map_falls_back_to_streaming() {
        let server = node("t");
        let id = ObjectId(6);
        let bytes = object(CHUNK_BYTES + 9);
        let path = std::env::temp_dir().join(format!("regatta-unsealed-{}", std::process::id()));
        server.serve(Arc::new(Unsealed(id, bytes.clone(), path.clone())));
        let got = node("t")
            .fetch(server.local_addr(), "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(got.bytes, bytes);
        assert!(got.segment.is_none(), "streamed, not mapped");
        let _ = std::fs::remove_file(path);
    }

    fn node(token: &str) -> Transfer {
        let identity = identity_from_secret(token).unwrap();
        Transfer::bind("127.0.0.1:0".parse().unwrap(), &identity).unwrap()
    }

    fn object(size: usize) -> Bytes {
        Bytes::from((0..size).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>())
    }

    #[tokio::test]
    async fn a_fetch_reaches_the_holder_the_directory_names_and_no_other() {
        let ca = crate::ClusterCa::generate().unwrap();
        let bound = |role: crate::Role| {
            let identity = TlsIdentity::issued_by(&ca, &role).unwrap();
            Transfer::bind("127.0.0.1:0".parse().unwrap(), &identity).unwrap()
        };
        let w1 = bound(crate::Role::Node("w1".into()));
        let id = ObjectId(3);
        let bytes = object(1000);
        w1.serve(Arc::new(One(id, bytes.clone())));
        let addr = w1.local_addr();
        let reader = bound(crate::Role::Client("driver".into()));
        let got = reader.fetch(addr, "w1", id, 1000, crc32(&bytes)).await.unwrap();
        assert_eq!(got.bytes, bytes);
        // The same process named as another holder (a stale or forged directory entry): the
        // idle connection is not reused for it, and a fresh one is refused.
        let refused = reader.fetch(addr, "w2", id, 1000, crc32(&bytes)).await.unwrap_err();
        assert!(refused.to_string().contains("not w2's"), "{refused}");
        assert!(reader.fetch(addr, "head", id, 1000, crc32(&bytes)).await.is_err());
        // The head's objects come from the head's certificate; a client's from the client's.
        let head = bound(crate::Role::Head);
        head.serve(Arc::new(One(id, bytes.clone())));
        reader
            .fetch(head.local_addr(), "head", id, 1000, crc32(&bytes))
            .await
            .unwrap();
        let driver = bound(crate::Role::Client("d2".into()));
        driver.serve(Arc::new(One(id, bytes.clone())));
        reader
            .fetch(driver.local_addr(), "d2", id, 1000, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(
            reader.fetch(addr, "w1", id, 1000, crc32(&bytes)).await.unwrap().bytes,
            bytes
        );
    }

    #[tokio::test]
    async fn members_fetch_byte_exact_and_strangers_are_refused() {
        let server = node("cluster-token");
        let id = ObjectId(9);
        let bytes = object(3 * CHUNK_BYTES + 17);
        server.serve(Arc::new(One(id, bytes.clone())));
        let addr = server.local_addr();

        let member = node("cluster-token");
        let got = member
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(got.bytes, bytes);
        assert!(got.segment.is_none(), "a source without segments streams");
        let missing = member.fetch(addr, "peer", ObjectId(10), 1, 0).await.unwrap_err();
        assert!(matches!(missing, Error::NotHeld { .. }), "{missing}");

        let stranger = node("another-token");
        let refused = stranger
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("handshake"), "{refused}");
        // The holder serves on after refusing the stranger.
        let again = member
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(again.bytes, bytes);
    }

    /// A source of two objects.
    struct Two([(ObjectId, Bytes); 2]);

    impl ObjectSource for Two {
        fn open(&self, id: ObjectId) -> Option<Bytes> {
            self.0.iter().find(|(i, _)| *i == id).map(|(_, b)| b.clone())
        }
        fn release(&self, _id: ObjectId) {}
    }

    #[tokio::test]
    async fn a_reused_receive_buffer_holds_only_the_new_objects_bytes() {
        use crate::receive_pool::pooled_capacities;
        // A size no other test receives, more than an eighth away from the pool's own test.
        let len = 3 * crate::receive_pool::MIN_POOLED + 3 * CHUNK_BYTES + 4099;
        let first = object(len);
        let second: Bytes = first
            .iter()
            .map(|b| b.wrapping_mul(7).wrapping_add(1))
            .collect::<Vec<u8>>()
            .into();
        assert_ne!(first, second);
        let server = node("cluster-token");
        server.serve(Arc::new(Two([
            (ObjectId(1), first.clone()),
            (ObjectId(2), second.clone()),
        ])));
        let addr = server.local_addr();
        let member = node("cluster-token");
        let got = member
            .fetch(addr, "peer", ObjectId(1), len as u64, crc32(&first))
            .await
            .unwrap();
        assert_eq!(got.bytes, first);
        assert!(!pooled_capacities().contains(&len), "held by the object");
        drop(got);
        assert!(
            pooled_capacities().contains(&len),
            "given back when the object was dropped"
        );
        let got = member
            .fetch(addr, "peer", ObjectId(2), len as u64, crc32(&second))
            .await
            .unwrap();
        assert!(!pooled_capacities().contains(&len), "the kept buffer was taken");
        assert_eq!(got.bytes, second, "byte-exact: nothing of the first object left");
        // A transfer that fails (a wrong whole-object CRC) gives its buffer back unseen.
        drop(got);
        let failed = member
            .fetch(addr, "peer", ObjectId(1), len as u64, crc32(&first) ^ 1)
            .await
            .unwrap_err();
        assert!(matches!(failed, Error::Corrupt { .. }), "{failed}");
        assert!(
            pooled_capacities().contains(&len),
            "the failed transfer gave the buffer back"
        );
        let got = member
            .fetch(addr, "peer", ObjectId(1), len as u64, crc32(&first))
            .await
            .unwrap();
        assert_eq!(got.bytes, first);
    }

    #[tokio::test]
    async fn silent_connections_from_one_address_hold_at_most_its_share_of_handshakes() {
        use crate::handshake_slots::MAX_HANDSHAKES_PER_SOURCE;
        let server = node("t");
        let id = ObjectId(3);
        let bytes = object(1000);
        server.serve(Arc::new(One(id, bytes.clone())));
        let addr = server.local_addr();
        let mut silent = Vec::new();
        for _ in 0..MAX_HANDSHAKES_PER_SOURCE {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut byte = [0u8; 1];
        // One more from the same address is closed at once, not held to a deadline.
        let mut extra = TcpStream::connect(addr).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(5), extra.read(&mut byte))
            .await
            .expect("the connection over the share is closed at once");
        assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
        // Those within the share are held open, waiting for their handshake.
        let held = tokio::time::timeout(Duration::from_millis(300), silent[0].read(&mut byte)).await;
        assert!(held.is_err(), "a connection within the share is held: {held:?}");
        // Their slots come back when they close, and members fetch again.
        drop(silent);
        let member = node("t");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match member.fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes)).await {
                Ok(got) => {
                    assert_eq!(got.bytes, bytes);
                    break;
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    tracing::debug!(error = %e, "slots not back yet");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("the slots never came back: {e}"),
            }
        }
    }

    /// A source that counts how often its object was opened for a reader.
    struct Counted(ObjectId, Bytes, std::sync::atomic::AtomicUsize);

    impl ObjectSource for Counted {
        fn open(&self, id: ObjectId) -> Option<Bytes> {
            self.2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (id == self.0).then(|| self.1.clone())
        }
        fn release(&self, _id: ObjectId) {}
    }

    /// A relay on loopback to `target` that records what its one client sends.
    async fn recording_relay(target: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let record = recorded.clone();
        tokio::spawn(async move {
            let (inbound, _) = listener.accept().await.unwrap();
            let outbound = TcpStream::connect(target).await.unwrap();
            let (mut from_client, mut to_client) = inbound.into_split();
            let (mut from_server, mut to_server) = outbound.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut from_server, &mut to_client).await });
            let mut buffer = vec![0u8; 64 * 1024];
            while let Ok(n @ 1..) = from_client.read(&mut buffer).await {
                record.lock().unwrap().extend_from_slice(&buffer[..n]);
                if to_server.write_all(&buffer[..n]).await.is_err() {
                    break;
                }
            }
        });
        (address, recorded)
    }

    /// Sends `bytes` on a fresh connection to `addr` (then ends the sending side when
    /// `then_eof`); true when the holder closed the connection within 3 s, well inside its
    /// 10 s handshake deadline: without the end of stream, only a refusal closes it so soon.
    async fn closed_after_sending(addr: SocketAddr, bytes: &[u8], then_eof: bool) -> bool {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        // The holder may close before reading everything: a failed write is fine.
        let _ = stream.write_all(bytes).await;
        if then_eof {
            let _ = stream.shutdown().await;
        }
        let mut sink = vec![0u8; 64 * 1024];
        let drained = async {
            while let Ok(n @ 1..) = stream.read(&mut sink).await {
                let _ = n;
            }
        };
        tokio::time::timeout(Duration::from_secs(3), drained).await.is_ok()
    }

    #[tokio::test]
    async fn garbage_truncated_records_and_a_replayed_session_get_nothing_and_the_holder_serves_on() {
        let server = node("t");
        let id = ObjectId(12);
        let bytes = object(2 * CHUNK_BYTES + 5);
        let source = Arc::new(Counted(id, bytes.clone(), std::sync::atomic::AtomicUsize::new(0)));
        server.serve(source.clone());
        let addr = server.local_addr();
        let opened = || source.2.load(std::sync::atomic::Ordering::SeqCst);

        let garbage: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        assert!(
            closed_after_sending(addr, &garbage, false).await,
            "garbage is refused at once"
        );
        // A TLS handshake record that announces 16 KiB and ends after 100 bytes.
        let mut truncated = vec![0x16, 0x03, 0x01, 0x40, 0x00];
        truncated.extend_from_slice(&[1u8; 100]);
        assert!(
            closed_after_sending(addr, &truncated, true).await,
            "a truncated record cut off by the end of the stream is dropped"
        );

        // A member's whole fetch through a recording relay, then sent again as it was.
        let (relay, recorded) = recording_relay(addr).await;
        let mut member = node("t");
        member.set_shared_memory(false);
        let got = member
            .fetch(relay, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(got.bytes, bytes);
        assert_eq!(opened(), 1);
        let session = recorded.lock().unwrap().clone();
        assert!(
            session.len() > 100,
            "the relay recorded the fetch ({} bytes)",
            session.len()
        );
        assert!(
            closed_after_sending(addr, &session, false).await,
            "the replay is refused at once"
        );
        assert_eq!(opened(), 1, "a replayed request is never served");

        let again = node("t")
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(again.bytes, bytes, "the holder serves on");
        assert_eq!(opened(), 2);
    }

    /// A relay on loopback to `target` that flips one bit of what the holder sends, at
    /// `offset` bytes into the connection.
    async fn tampering_relay(target: SocketAddr, offset: usize) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (inbound, _) = listener.accept().await.unwrap();
            let outbound = TcpStream::connect(target).await.unwrap();
            let (mut from_client, mut to_client) = inbound.into_split();
            let (mut from_server, mut to_server) = outbound.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut from_client, &mut to_server).await });
            let (mut buffer, mut passed) = (vec![0u8; 64 * 1024], 0usize);
            while let Ok(n @ 1..) = from_server.read(&mut buffer).await {
                if (passed..passed + n).contains(&offset) {
                    buffer[offset - passed] ^= 0x10;
                }
                passed += n;
                if to_client.write_all(&buffer[..n]).await.is_err() {
                    break;
                }
            }
        });
        address
    }

    #[tokio::test]
    async fn a_bit_flipped_on_the_wire_fails_the_transfer_and_the_holder_serves_on() {
        let server = node("t");
        let id = ObjectId(13);
        let bytes = object(2 * CHUNK_BYTES + 7);
        server.serve(Arc::new(One(id, bytes.clone())));
        let addr = server.local_addr();
        // Past the handshake (a few KiB) and the stream's header, inside the first chunk.
        let relay = tampering_relay(addr, 256 * 1024).await;
        let mut member = node("t");
        member.set_shared_memory(false);
        let err = member
            .fetch(relay, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Transfer(_)), "{err}");
        assert!(err.to_string().contains("authentication"), "{err}");
        let again = member
            .fetch(addr, "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(again.bytes, bytes, "the holder serves on");
    }

    #[tokio::test]
    async fn a_peer_of_the_earlier_transfer_protocol_is_told_at_the_handshake() {
        let server = node("t");
        server.serve(Arc::new(One(ObjectId(14), object(10))));
        // A client of the version before frames offers ALPN regatta-objects/1.
        let identity = identity_from_secret("t").unwrap();
        let connector = TlsConnector::from(identity.client.clone());
        let tcp = TcpStream::connect(server.local_addr()).await.unwrap();
        let name = ServerName::try_from(SERVER_NAME).unwrap();
        let refused = connector.connect(name, tcp).await.unwrap_err();
        let alert = refused.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>());
        assert_eq!(
            alert,
            Some(&rustls::Error::AlertReceived(
                rustls::AlertDescription::NoApplicationProtocol
            )),
            "{refused}"
        );
    }

    #[tokio::test]
    async fn chunk_frames_carry_no_crc_of_their_bytes() {
        // A 4-byte object: the CRC-32 of its bytes in a frame's header (authenticated, not
        // encrypted) would give them away to anyone on the path.
        let server = node("t");
        let (id, secret) = (ObjectId(3), Bytes::from_static(b"pin!"));
        server.serve(Arc::new(One(id, secret.clone())));
        let mut client = node("t");
        client.set_shared_memory(false);
        let mut stream = client.connect(server.local_addr(), "peer").await.unwrap();
        let reply = client.ask(&mut stream, id).await.unwrap();
        assert_eq!(reply.first(), Some(&STATUS_STREAM));
        let mut chunk = [0u8; 4];
        let (word, len) = stream.receive_into(&mut chunk).await.unwrap();
        assert_eq!((len, &chunk[..]), (4, &secret[..]));
        assert_eq!(
            word,
            0,
            "the header word is {word:#x}; the bytes' CRC is {:#x}",
            crc32(&secret)
        );
    }

    #[tokio::test]
    async fn a_corrupted_chunk_is_detected() {
        let mut server = node("t");
        server.corrupt = true;
        let id = ObjectId(1);
        let bytes = object(100_000);
        server.serve(Arc::new(One(id, bytes.clone())));
        let client = node("t");
        let err = client
            .fetch(server.local_addr(), "peer", id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("whole-object CRC mismatch"), "{err}");
    }
}
