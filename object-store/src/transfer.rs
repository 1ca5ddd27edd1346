//! Moving objects between nodes over QUIC (quinn), with mutual TLS from the cluster token.
//!
//! Protocol, one bidirectional stream per object:
//! - request: the 16-byte object id;
//! - reply: one status byte (1 = found, 0 = not held), then for a found object its size
//!   (u64 LE) and CRC-32 (u32 LE), then chunks of `[len u32 LE][crc u32 LE][len bytes]`.
//!
//! The receiver checks every chunk and the whole object before handing it out.

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

/// Bytes per chunk on the wire.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Environment variable that makes a serving node corrupt one byte of the first chunk it
/// sends: a fault-injection hook for the integrity tests, never set in production.
pub const FAULT_CORRUPT_ENV: &str = "REGATTA_FAULT_CORRUPT_TRANSFER";

/// What a node serves: pinned bytes of objects it holds.
pub trait ObjectSource: Send + Sync + 'static {
    /// The object's bytes, pinned until [`ObjectSource::release`].
    fn open(&self, id: ObjectId) -> Option<Bytes>;
    /// Unpins an object opened with [`ObjectSource::open`].
    fn release(&self, id: ObjectId);
    /// Counts bytes sent to peers (for metrics).
    fn sent(&self, _bytes: u64) {}
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut config = quinn::TransportConfig::default();
    config.stream_receive_window(VarInt::from_u32(64 << 20));
    config.receive_window(VarInt::from_u32(256 << 20));
    config.send_window(256 << 20);
    config.max_concurrent_bidi_streams(VarInt::from_u32(1024));
    config.keep_alive_interval(Some(Duration::from_secs(5)));
    config.max_idle_timeout(Some(VarInt::from_u32(60_000).into()));
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
}

impl Transfer {
    /// Binds a UDP endpoint at `bind` (port 0 picks one).
    pub fn bind(bind: SocketAddr, identity: &TlsIdentity) -> Result<Self> {
        let endpoint = endpoint(bind, identity)?;
        Ok(Self {
            endpoint,
            connections: Arc::new(Mutex::new(HashMap::new())),
            corrupt: std::env::var_os(FAULT_CORRUPT_ENV).is_some(),
        })
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
                            if let Err(e) = serve_one(send, recv, source, corrupt).await {
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

    /// Fetches an object from `peer`, checking its size and CRC-32 against the directory's.
    pub async fn fetch(&self, peer: SocketAddr, id: ObjectId, size: u64, checksum: u32) -> Result<Bytes> {
        let connection = self.connection(peer).await?;
        let (mut send, mut recv) = connection
            .open_bi()
            .await
            .map_err(|e| Error::Transfer(format!("cannot open a stream to {peer}: {e}")))?;
        let io = |e: &dyn std::fmt::Display| Error::Transfer(format!("transfer of {id} from {peer}: {e}"));
        send.write_all(&id.to_bytes()).await.map_err(|e| io(&e))?;
        send.finish().map_err(|e| io(&e))?;
        let mut status = [0u8; 1];
        recv.read_exact(&mut status).await.map_err(|e| io(&e))?;
        if status[0] != 1 {
            return Err(Error::NotHeld {
                id,
                peer: peer.to_string(),
            });
        }
        let mut header = [0u8; 12];
        recv.read_exact(&mut header).await.map_err(|e| io(&e))?;
        let (their_size, their_crc) = parse_header(&header);
        if their_size != size || their_crc != checksum {
            return Err(Error::Corrupt {
                id,
                detail: format!("{peer} announced {their_size} bytes / crc {their_crc:08x}, the directory says {size} / {checksum:08x}"),
            });
        }
        let length = usize::try_from(size).map_err(|_| io(&"object too large for this platform"))?;
        let mut buffer = vec![0u8; length];
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
            if crc32(slot) != chunk_crc {
                return Err(Error::Corrupt {
                    id,
                    detail: format!("chunk at offset {filled} from {peer} fails its CRC"),
                });
            }
            filled += chunk_len;
        }
        if crc32(&buffer) != checksum {
            return Err(Error::Corrupt {
                id,
                detail: format!("whole-object CRC mismatch from {peer}"),
            });
        }
        Ok(Bytes::from(buffer))
    }
}

fn parse_header(header: &[u8; 12]) -> (u64, u32) {
    let mut size = [0u8; 8];
    size.copy_from_slice(&header[..8]);
    let mut crc = [0u8; 4];
    crc.copy_from_slice(&header[8..]);
    (u64::from_le_bytes(size), u32::from_le_bytes(crc))
}

async fn serve_one(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    source: Arc<dyn ObjectSource>,
    corrupt: bool,
) -> std::result::Result<(), String> {
    let mut raw = [0u8; 16];
    recv.read_exact(&mut raw).await.map_err(|e| e.to_string())?;
    let id = ObjectId::from_bytes(raw);
    let Some(bytes) = source.open(id) else {
        send.write_all(&[0]).await.map_err(|e| e.to_string())?;
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
    let mut header = vec![1u8];
    header.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    header.extend_from_slice(&crc32(bytes).to_le_bytes());
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
        assert_eq!(got, bytes);
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
