//! Moving objects between nodes over QUIC (quinn), with mutual TLS from the cluster token,
//! and between processes on one host through shared memory.
//!
//! Protocol, one bidirectional stream per object:
//! - request: the 16-byte object id, a flags byte (bit 0: the caller can map shared memory)
//!   and the caller's 24-byte [`HostKey`];
//! - reply: one status byte:
//!   - 0: not held;
//!   - 2 (only to a caller on the same host and PID namespace): a 32-byte shared-memory
//!     [`Handle`]; the caller answers one byte, 1 when it mapped the segment (done) or 0
//!     when it could not (the reply goes on as a stream, status byte first);
//!   - 1: the object streamed: its size (u64 LE), then chunks of
//!     `[len u32 LE][crc u32 LE][len bytes]`.
//!
//! The receiver checks every chunk's CRC and combines them into the whole object's, which
//! must equal the directory's: one CRC pass per byte on each side. A shared-memory segment
//! is checked for identity, length and seals instead (its bytes never left the host).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, VarInt};

use crate::checksum::crc32;
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::identity::TlsIdentity;
pub use crate::identity::SERVER_NAME;
use crate::shm::{Handle, HostKey, Segment};

/// Bytes per chunk on the wire.
pub const CHUNK_BYTES: usize = 1 << 20;

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

fn transport() -> Arc<quinn::TransportConfig> {
    let mut config = quinn::TransportConfig::default();
    config.stream_receive_window(VarInt::from_u32(64 << 20));
    config.receive_window(VarInt::from_u32(256 << 20));
    config.send_window(256 << 20);
    config.max_concurrent_bidi_streams(VarInt::from_u32(1024));
    // A peer that stops answering (killed, cut off) fails its transfers within 10 s; the
    // keep-alives hold idle connections open meanwhile.
    config.keep_alive_interval(Some(Duration::from_secs(2)));
    config.max_idle_timeout(Some(VarInt::from_u32(10_000).into()));
    config.initial_mtu(1452);
    Arc::new(config)
}

/// A QUIC endpoint that accepts and opens connections only with holders of the cluster
/// token (mutual TLS), tuned for bulk transfers. Also used by the trainer's ring links.
pub fn endpoint(bind: SocketAddr, identity: &TlsIdentity) -> Result<Endpoint> {
    let server_crypto = QuicServerConfig::try_from(identity.server.clone())
        .map_err(|e| Error::Transfer(format!("server TLS config: {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport());
    let client_crypto = QuicClientConfig::try_from(identity.client.clone())
        .map_err(|e| Error::Transfer(format!("client TLS config: {e}")))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport());
    let mut endpoint =
        Endpoint::server(server, bind).map_err(|e| Error::Transfer(format!("cannot bind UDP {bind}: {e}")))?;
    endpoint.set_default_client_config(client);
    Ok(endpoint)
}

/// A node's QUIC endpoint: serves its objects and fetches from peers.
#[derive(Clone)]
pub struct Transfer {
    endpoint: Endpoint,
    connections: Arc<Mutex<HashMap<SocketAddr, quinn::Connection>>>,
    corrupt: bool,
    /// This process's host key when the shared-memory path is on.
    host: Option<HostKey>,
}

impl Transfer {
    /// Binds a UDP endpoint at `bind` (port 0 picks one).
    pub fn bind(bind: SocketAddr, identity: &TlsIdentity) -> Result<Self> {
        let endpoint = endpoint(bind, identity)?;
        let corrupt = std::env::var_os(FAULT_CORRUPT_ENV).is_some();
        Ok(Self {
            endpoint,
            connections: Arc::new(Mutex::new(HashMap::new())),
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
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.endpoint
            .local_addr()
            .map_err(|e| Error::Transfer(format!("no local address: {e}")))
    }

    /// Serves objects from `source` until the endpoint closes.
    pub fn serve(&self, source: Arc<dyn ObjectSource>) {
        let endpoint = self.endpoint.clone();
        let corrupt = self.corrupt;
        let host = self.host;
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let source = source.clone();
                tokio::spawn(async move {
                    let connection = match incoming.await {
                        Ok(connection) => connection,
                        Err(e) => {
                            tracing::warn!(error = %e, "refused an object-transfer connection");
                            return;
                        }
                    };
                    while let Ok((send, recv)) = connection.accept_bi().await {
                        let source = source.clone();
                        tokio::spawn(async move {
                            if let Err(e) = serve_one(send, recv, source, corrupt, host).await {
                                tracing::debug!(error = %e, "object transfer stream ended early");
                            }
                        });
                    }
                });
            }
        });
    }

    async fn connection(&self, peer: SocketAddr) -> Result<quinn::Connection> {
        if let Some(existing) = self.connections.lock().ok().and_then(|c| c.get(&peer).cloned()) {
            if existing.close_reason().is_none() {
                return Ok(existing);
            }
        }
        let connecting = self
            .endpoint
            .connect(peer, SERVER_NAME)
            .map_err(|e| Error::Transfer(format!("cannot connect to {peer}: {e}")))?;
        let connection = connecting
            .await
            .map_err(|e| Error::Transfer(format!("handshake with {peer} failed: {e}")))?;
        if let Ok(mut cache) = self.connections.lock() {
            cache.insert(peer, connection.clone());
        }
        Ok(connection)
    }

    /// Fetches an object from `peer`, checking its size and CRC-32 against the directory's
    /// (a same-host segment: its identity, size and seals).
    pub async fn fetch(&self, peer: SocketAddr, id: ObjectId, size: u64, checksum: u32) -> Result<Fetched> {
        let connection = self.connection(peer).await?;
        let (mut send, mut recv) = connection
            .open_bi()
            .await
            .map_err(|e| Error::Transfer(format!("cannot open a stream to {peer}: {e}")))?;
        let io = |e: &dyn std::fmt::Display| Error::Transfer(format!("transfer of {id} from {peer}: {e}"));
        let mut request = [0u8; REQUEST_LEN];
        request[..16].copy_from_slice(&id.to_bytes());
        if let Some(host) = self.host {
            request[16] = WANTS_SHARED;
            request[17..].copy_from_slice(&host.to_bytes());
        }
        send.write_all(&request).await.map_err(|e| io(&e))?;
        if self.host.is_none() {
            send.finish().map_err(|e| io(&e))?;
        }
        let mut status = [0u8; 1];
        recv.read_exact(&mut status).await.map_err(|e| io(&e))?;
        if status[0] == STATUS_SHARED {
            let mut raw = [0u8; Handle::LEN];
            recv.read_exact(&mut raw).await.map_err(|e| io(&e))?;
            let handle = Handle::from_bytes(&raw);
            let mapped = if handle.len == size {
                tokio::task::spawn_blocking(move || {
                    let segment = Arc::new(Segment::open(&handle)?);
                    let bytes = segment.map()?;
                    Ok::<_, std::io::Error>((segment, bytes))
                })
                .await
                .map_err(|e| io(&e))?
                .map_err(|e| e.to_string())
            } else {
                Err(format!("segment of {} bytes, the directory says {size}", handle.len))
            };
            match mapped {
                Ok((segment, bytes)) => {
                    send.write_all(&[1]).await.map_err(|e| io(&e))?;
                    let _ = send.finish();
                    return Ok(Fetched {
                        bytes,
                        segment: Some(segment),
                    });
                }
                Err(reason) => {
                    tracing::debug!(%id, %peer, %reason, "cannot map the peer's segment; streaming instead");
                    send.write_all(&[0]).await.map_err(|e| io(&e))?;
                    send.finish().map_err(|e| io(&e))?;
                    recv.read_exact(&mut status).await.map_err(|e| io(&e))?;
                }
            }
        }
        if status[0] != STATUS_STREAM {
            return Err(Error::NotHeld {
                id,
                peer: peer.to_string(),
            });
        }
        let mut header = [0u8; 8];
        recv.read_exact(&mut header).await.map_err(|e| io(&e))?;
        let their_size = u64::from_le_bytes(header);
        if their_size != size {
            return Err(Error::Corrupt {
                id,
                detail: format!("{peer} announced {their_size} bytes, the directory says {size}"),
            });
        }
        let length = usize::try_from(size).map_err(|_| io(&"object too large for this platform"))?;
        let mut buffer = vec![0u8; length];
        let mut whole = crc32fast::Hasher::new();
        let mut filled = 0usize;
        while filled < length {
            let mut chunk_header = [0u8; 8];
            recv.read_exact(&mut chunk_header).await.map_err(|e| io(&e))?;
            let chunk_len =
                u32::from_le_bytes([chunk_header[0], chunk_header[1], chunk_header[2], chunk_header[3]]) as usize;
            let chunk_crc = u32::from_le_bytes([chunk_header[4], chunk_header[5], chunk_header[6], chunk_header[7]]);
            if chunk_len == 0 || chunk_len > CHUNK_BYTES || filled + chunk_len > length {
                return Err(Error::Corrupt {
                    id,
                    detail: format!("bad chunk length {chunk_len} at offset {filled}"),
                });
            }
            let slot = &mut buffer[filled..filled + chunk_len];
            recv.read_exact(slot).await.map_err(|e| io(&e))?;
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(slot);
            if hasher.clone().finalize() != chunk_crc {
                return Err(Error::Corrupt {
                    id,
                    detail: format!("chunk at offset {filled} from {peer} fails its CRC"),
                });
            }
            whole.combine(&hasher);
            filled += chunk_len;
        }
        if whole.finalize() != checksum {
            return Err(Error::Corrupt {
                id,
                detail: format!("whole-object CRC mismatch from {peer}"),
            });
        }
        Ok(Fetched {
            bytes: Bytes::from(buffer),
            segment: None,
        })
    }
}

async fn serve_one(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    source: Arc<dyn ObjectSource>,
    corrupt: bool,
    host: Option<HostKey>,
) -> std::result::Result<(), String> {
    let mut request = [0u8; REQUEST_LEN];
    recv.read_exact(&mut request).await.map_err(|e| e.to_string())?;
    let mut raw = [0u8; 16];
    raw.copy_from_slice(&request[..16]);
    let id = ObjectId::from_bytes(raw);
    let mut key = [0u8; HostKey::LEN];
    key.copy_from_slice(&request[17..]);
    let same_host = request[16] & WANTS_SHARED != 0 && host == Some(HostKey::from_bytes(&key));
    if same_host {
        let shared = {
            let source = source.clone();
            tokio::task::spawn_blocking(move || source.share(id))
                .await
                .map_err(|e| e.to_string())?
        };
        if let Some(segment) = shared {
            let mut reply = vec![STATUS_SHARED];
            reply.extend_from_slice(&segment.handle().to_bytes());
            send.write_all(&reply).await.map_err(|e| e.to_string())?;
            // The caller answers once it has mapped the segment (populating a large one takes
            // a while); a caller that never answers does not hold this task for ever.
            let mut answer = [0u8; 1];
            tokio::time::timeout(SHARED_ANSWER_TIMEOUT, recv.read_exact(&mut answer))
                .await
                .map_err(|_| "no answer to a shared-memory handle".to_string())?
                .map_err(|e| e.to_string())?;
            if answer[0] == 1 {
                source.sent(segment.len());
                let _ = send.finish();
                return Ok(());
            }
            // The caller could not map it (another user, say): stream it after all.
        }
    }
    let Some(bytes) = source.open(id) else {
        send.write_all(&[STATUS_MISSING]).await.map_err(|e| e.to_string())?;
        let _ = send.finish();
        return Ok(());
    };
    let outcome = stream_object(&mut send, &bytes, corrupt).await;
    source.release(id);
    if outcome.is_ok() {
        source.sent(bytes.len() as u64);
    }
    outcome
}

async fn stream_object(send: &mut quinn::SendStream, bytes: &Bytes, corrupt: bool) -> std::result::Result<(), String> {
    let mut header = vec![STATUS_STREAM];
    header.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    send.write_all(&header).await.map_err(|e| e.to_string())?;
    let mut offset = 0;
    while offset < bytes.len() {
        let end = (offset + CHUNK_BYTES).min(bytes.len());
        let mut chunk = bytes.slice(offset..end);
        let mut chunk_header = Vec::with_capacity(8);
        chunk_header.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
        chunk_header.extend_from_slice(&crc32(&chunk).to_le_bytes());
        if corrupt && offset == 0 {
            let mut damaged = chunk.to_vec();
            damaged[0] ^= 0xff;
            chunk = Bytes::from(damaged);
        }
        send.write_all_chunks(&mut [Bytes::from(chunk_header), chunk])
            .await
            .map_err(|e| e.to_string())?;
        offset = end;
    }
    send.finish().map_err(|e| e.to_string())?;
    // Wait until the peer has everything, so the pin is held for the whole transfer.
    let _ = send.stopped().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::identity_from_token;

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
            Some(Arc::new(Segment::from_file(file, None).unwrap()))
        }
    }

    #[tokio::test]
    async fn same_host_peers_map_one_shared_segment() {
        let server = node("t");
        assert!(server.shared_memory(), "on by default on Linux");
        let id = ObjectId(5);
        let bytes = object(2 * CHUNK_BYTES + 3);
        server.serve(Arc::new(Shares(id, bytes.clone(), Mutex::new(None))));
        let addr = server.local_addr().unwrap();
        let (one, two) = (node("t"), node("t"));
        let first = one.fetch(addr, id, bytes.len() as u64, crc32(&bytes)).await.unwrap();
        let second = two.fetch(addr, id, bytes.len() as u64, crc32(&bytes)).await.unwrap();
        assert_eq!(first.bytes, bytes);
        assert_eq!(second.bytes, bytes);
        let (a, b) = (first.segment.unwrap().handle(), second.segment.unwrap().handle());
        assert_eq!((a.dev, a.inode), (b.dev, b.inode), "both map the same pages");

        // A caller with the path off gets the same bytes over the network.
        let mut plain = node("t");
        plain.set_shared_memory(false);
        let streamed = plain.fetch(addr, id, bytes.len() as u64, crc32(&bytes)).await.unwrap();
        assert_eq!(streamed.bytes, bytes);
        assert!(streamed.segment.is_none());
        // A wrong directory size is refused on this path too.
        let wrong = one.fetch(addr, id, bytes.len() as u64 + 1, 0).await.unwrap_err();
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
            .fetch(server.local_addr().unwrap(), id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap();
        assert_eq!(got.bytes, bytes);
        assert!(got.segment.is_none(), "streamed, not mapped");
        let _ = std::fs::remove_file(path);
    }

    fn node(token: &str) -> Transfer {
        let identity = identity_from_token(token).unwrap();
        Transfer::bind("127.0.0.1:0".parse().unwrap(), &identity).unwrap()
    }

    fn object(size: usize) -> Bytes {
        Bytes::from((0..size).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>())
    }

    #[tokio::test]
    async fn members_fetch_byte_exact_and_strangers_are_refused() {
        let server = node("cluster-token");
        let id = ObjectId(9);
        let bytes = object(3 * CHUNK_BYTES + 17);
        server.serve(Arc::new(One(id, bytes.clone())));
        let addr = server.local_addr().unwrap();

        let member = node("cluster-token");
        let got = member.fetch(addr, id, bytes.len() as u64, crc32(&bytes)).await.unwrap();
        assert_eq!(got.bytes, bytes);
        assert!(got.segment.is_none(), "a source without segments streams");
        let missing = member.fetch(addr, ObjectId(10), 1, 0).await.unwrap_err();
        assert!(matches!(missing, Error::NotHeld { .. }), "{missing}");

        let stranger = node("another-token");
        let refused = stranger
            .fetch(addr, id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("handshake"), "{refused}");
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
            .fetch(server.local_addr().unwrap(), id, bytes.len() as u64, crc32(&bytes))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("fails its CRC"), "{err}");
    }
}
