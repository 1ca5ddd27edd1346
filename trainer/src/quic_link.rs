//! The ring link between ranks on different nodes: QUIC (quinn) with the cluster's mutual
//! TLS. Each rank listens on its own endpoint, opens one unidirectional stream to the next
//! rank and accepts one from the previous rank. A send is written by a background task so
//! it overlaps the matching receive (every rank sends before it receives; blocking writes
//! would deadlock the ring once a chunk exceeds the flow-control window).

use std::net::SocketAddr;

use regatta_object_store::{endpoint, identity_from_token, SERVER_NAME};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::collective::{LinkError, RingLink};

/// A rank's QUIC ring link.
pub struct QuicLink {
    runtime: Handle,
    outgoing: Option<quinn::SendStream>,
    pending: Option<JoinHandle<std::result::Result<quinn::SendStream, LinkError>>>,
    incoming: quinn::RecvStream,
    endpoint: Option<quinn::Endpoint>,
}

/// A bound endpoint waiting for its ring neighbours.
pub struct QuicLinkBuilder {
    endpoint: quinn::Endpoint,
    runtime: Handle,
}

impl QuicLinkBuilder {
    /// Binds this rank's endpoint (port 0 picks one); call from inside a tokio runtime.
    pub fn bind(bind: SocketAddr, token: &str) -> std::result::Result<Self, LinkError> {
        let identity = identity_from_token(token).map_err(|e| e.to_string())?;
        let endpoint = endpoint(bind, &identity).map_err(|e| e.to_string())?;
        let runtime = Handle::try_current().map_err(|e| format!("no tokio runtime: {e}"))?;
        Ok(Self { endpoint, runtime })
    }

    /// The address the previous rank connects to.
    pub fn local_addr(&self) -> std::result::Result<SocketAddr, LinkError> {
        self.endpoint.local_addr().map_err(|e| LinkError(e.to_string()))
    }

    /// Connects to the next rank and accepts the previous one.
    pub async fn connect(self, next: SocketAddr) -> std::result::Result<QuicLink, LinkError> {
        let accept = async {
            let incoming = self.endpoint.accept().await.ok_or("the endpoint closed")?;
            let connection = incoming
                .await
                .map_err(|e| format!("previous rank's handshake failed: {e}"))?;
            connection
                .accept_uni()
                .await
                .map_err(|e| format!("previous rank opened no stream: {e}"))
        };
        let open = async {
            let connecting = self
                .endpoint
                .connect(next, SERVER_NAME)
                .map_err(|e| format!("cannot connect to {next}: {e}"))?;
            let connection = connecting
                .await
                .map_err(|e| format!("handshake with the next rank {next} failed: {e}"))?;
            let mut stream = connection
                .open_uni()
                .await
                .map_err(|e| format!("cannot open a stream to {next}: {e}"))?;
            // A stream becomes visible to the peer only once something is written.
            stream.write_all(&[1]).await.map_err(|e| e.to_string())?;
            Ok::<_, LinkError>(stream)
        };
        let (incoming, outgoing) = tokio::join!(accept, open);
        let mut incoming = incoming?;
        let mut hello = [0u8; 1];
        incoming
            .read_exact(&mut hello)
            .await
            .map_err(|e| format!("previous rank's hello: {e}"))?;
        Ok(QuicLink {
            runtime: self.runtime,
            outgoing: Some(outgoing?),
            pending: None,
            incoming,
            endpoint: Some(self.endpoint),
        })
    }
}

impl QuicLink {
    fn finish_pending(&mut self) -> std::result::Result<(), LinkError> {
        if let Some(task) = self.pending.take() {
            let stream = self
                .runtime
                .block_on(task)
                .map_err(|e| format!("send task failed: {e}"))??;
            self.outgoing = Some(stream);
        }
        Ok(())
    }
}

impl Drop for QuicLink {
    /// Keeps the endpoint alive in the background until the next rank has acknowledged
    /// everything sent: dropping it at once would discard data still in flight.
    fn drop(&mut self) {
        let pending = self.pending.take();
        let outgoing = self.outgoing.take();
        let endpoint = self.endpoint.take();
        self.runtime.spawn(async move {
            let stream = match pending {
                Some(task) => task.await.ok().and_then(Result::ok),
                None => outgoing,
            };
            if let Some(mut stream) = stream {
                let _ = stream.finish();
                let _ = tokio::time::timeout(std::time::Duration::from_secs(30), stream.stopped()).await;
            }
            if let Some(endpoint) = endpoint {
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), endpoint.wait_idle()).await;
            }
        });
    }
}

impl RingLink for QuicLink {
    fn send(&mut self, data: &[f32]) -> std::result::Result<(), LinkError> {
        self.finish_pending()?;
        let mut stream = self.outgoing.take().ok_or("the link to the next rank is closed")?;
        let mut bytes = Vec::with_capacity(8 + data.len() * 4);
        bytes.extend_from_slice(&(data.len() as u64).to_le_bytes());
        for value in data {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        self.pending = Some(self.runtime.spawn(async move {
            stream
                .write_all(&bytes)
                .await
                .map_err(|e| format!("send to the next rank failed: {e}"))?;
            Ok(stream)
        }));
        Ok(())
    }

    fn recv(&mut self, out: &mut [f32]) -> std::result::Result<(), LinkError> {
        let incoming = &mut self.incoming;
        let runtime = self.runtime.clone();
        let bytes = runtime.block_on(async {
            let mut header = [0u8; 8];
            incoming
                .read_exact(&mut header)
                .await
                .map_err(|e| format!("receive from the previous rank failed: {e}"))?;
            let count = u64::from_le_bytes(header) as usize;
            if count != out.len() {
                return Err(format!(
                    "expected {} values from the previous rank, it sent {count}",
                    out.len()
                ));
            }
            let mut bytes = vec![0u8; count * 4];
            incoming
                .read_exact(&mut bytes)
                .await
                .map_err(|e| format!("receive from the previous rank failed: {e}"))?;
            Ok(bytes)
        })?;
        for (value, raw) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *value = f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
        }
        self.finish_pending()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{Collective, RingCollective};

    #[test]
    fn a_ring_over_quic_all_reduces_large_buffers_without_deadlock() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let world = 3;
        let len: usize = std::env::var("RING_TEST_LEN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3_000_001); // 12 MB per rank: far beyond one flow-control window.
        let builders: Vec<QuicLinkBuilder> = runtime.block_on(async {
            (0..world)
                .map(|_| QuicLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token").unwrap())
                .collect()
        });
        let addrs: Vec<SocketAddr> = builders.iter().map(|b| b.local_addr().unwrap()).collect();
        let links: Vec<QuicLink> = runtime.block_on(async {
            let connects = builders
                .into_iter()
                .enumerate()
                .map(|(rank, b)| b.connect(addrs[(rank + 1) % world]));
            futures::future::try_join_all(connects).await.unwrap()
        });
        let threads: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, link)| {
                std::thread::spawn(move || {
                    let mut ring = RingCollective::new(rank, world, link);
                    let mut buffer: Vec<f32> = (0..len).map(|i| (rank + i % 7) as f32).collect();
                    ring.all_reduce(&mut buffer).unwrap();
                    buffer
                })
            })
            .collect();
        for thread in threads {
            let buffer = thread.join().unwrap();
            for (i, value) in buffer.iter().enumerate().step_by(99_991) {
                assert_eq!(*value, (3 * (i % 7) + 3) as f32, "element {i}");
            }
        }
    }

    #[test]
    fn a_rank_without_the_token_cannot_join_the_ring() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let member = QuicLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token").unwrap();
            let stranger = QuicLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "other-token").unwrap();
            let member_addr = member.local_addr().unwrap();
            let stranger_addr = stranger.local_addr().unwrap();
            let outcome = tokio::time::timeout(std::time::Duration::from_secs(10), async {
                tokio::join!(member.connect(stranger_addr), stranger.connect(member_addr))
            })
            .await;
            match outcome {
                Ok((a, b)) => assert!(a.is_err() && b.is_err(), "a ring across two tokens must not form"),
                Err(_) => {} // Neither side completes a handshake: refused by waiting, not joined.
            }
        });
    }
}
