//! The QUIC transport, the fallback between hosts when the next rank offers no TCP port or
//! its port cannot be reached (and every link's with `REGATTA_RING_TRANSPORT=quic`): one
//! unidirectional stream each way over the cluster's TLS, driven from the link's blocking
//! calls on the tokio runtime the ring was bound in.

use std::net::SocketAddr;
use std::time::Duration;

use regatta_net::SERVER_NAME;
use tokio::runtime::Handle;

use super::{as_bytes_mut, check_count};
use crate::collective::LinkError;

/// An incoming connection's handshake, then its stream and hello byte.
async fn hello(incoming: quinn::Incoming) -> Result<quinn::RecvStream, String> {
    let connection = incoming.await.map_err(|e| format!("handshake failed: {e}"))?;
    let mut stream = connection
        .accept_uni()
        .await
        .map_err(|e| format!("opened no stream: {e}"))?;
    let mut hello = [0u8; 1];
    stream
        .read_exact(&mut hello)
        .await
        .map_err(|e| format!("no hello: {e}"))?;
    Ok(stream)
}

/// A QUIC link's sending half.
pub(super) struct QuicSend {
    runtime: Handle,
    pub(super) stream: Option<quinn::SendStream>,
    endpoint: quinn::Endpoint,
}

/// A QUIC link's receiving half.
pub(super) struct QuicRecv {
    runtime: Handle,
    pub(super) stream: quinn::RecvStream,
    /// The endpoint the stream arrived on, alive as long as the stream.
    _endpoint: quinn::Endpoint,
}

impl Drop for QuicSend {
    /// Keeps the endpoint alive in the background until the next rank has acknowledged
    /// everything sent: dropping it at once would discard data still in flight.
    fn drop(&mut self) {
        let stream = self.stream.take();
        let endpoint = self.endpoint.clone();
        self.runtime.spawn(async move {
            if let Some(mut stream) = stream {
                let _ = stream.finish();
                let _ = tokio::time::timeout(Duration::from_secs(30), stream.stopped()).await;
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), endpoint.wait_idle()).await;
        });
    }
}

impl QuicSend {
    /// Connects to the next rank's endpoint at `next` and opens the link's stream.
    pub(super) async fn open(
        endpoint: &quinn::Endpoint,
        runtime: &Handle,
        next: SocketAddr,
    ) -> Result<Self, LinkError> {
        let connection = endpoint
            .connect(next, SERVER_NAME)
            .map_err(|e| format!("cannot connect to {next}: {e}"))?
            .await
            .map_err(|e| format!("handshake with the next rank {next} failed: {e}"))?;
        let mut stream = connection
            .open_uni()
            .await
            .map_err(|e| format!("cannot open a stream to {next}: {e}"))?;
        // A stream becomes visible to the peer only once something is written.
        stream.write_all(&[1]).await.map_err(|e| e.to_string())?;
        Ok(Self {
            runtime: runtime.clone(),
            stream: Some(stream),
            endpoint: endpoint.clone(),
        })
    }

    /// Writes a message: its value count, then the values' bytes.
    pub(super) fn send(&mut self, header: &[u8; 8], payload: &[u8]) -> Result<(), LinkError> {
        let stream = self.stream.as_mut().ok_or("the link to the next rank is closed")?;
        self.runtime
            .block_on(async {
                stream.write_all(header).await?;
                stream.write_all(payload).await
            })
            .map_err(|e| LinkError(format!("send to the next rank failed: {e}")))
    }
}

impl QuicRecv {
    /// The previous rank's stream on `endpoint`, once its hello byte arrived. Handshakes
    /// run side by side, each within [`super::HANDSHAKE_TIMEOUT`]: a stranger's packet, a
    /// peer without the ring's certificate or one that opens nothing is logged and the
    /// endpoint listens on, so none of them can end the ring's accept.
    pub(super) async fn accept(endpoint: &quinn::Endpoint, runtime: &Handle) -> Result<Self, LinkError> {
        use futures::StreamExt;
        let mut handshakes = futures::stream::FuturesUnordered::new();
        loop {
            tokio::select! {
                incoming = endpoint.accept() => {
                    let incoming = incoming.ok_or("the endpoint closed")?;
                    let peer = incoming.remote_address();
                    handshakes.push(async move {
                        (peer, tokio::time::timeout(super::HANDSHAKE_TIMEOUT, hello(incoming)).await)
                    });
                }
                Some((peer, opened)) = handshakes.next(), if !handshakes.is_empty() => match opened {
                    Ok(Ok(stream)) => {
                        return Ok(Self {
                            runtime: runtime.clone(),
                            stream,
                            _endpoint: endpoint.clone(),
                        })
                    }
                    Ok(Err(e)) => tracing::warn!(%peer, "ring: refused a QUIC peer: {e}"),
                    Err(_) => tracing::warn!(%peer, "ring: a QUIC peer did not open its stream in time"),
                },
            }
        }
    }

    /// Reads a message of exactly `out.len()` values straight into `out`.
    pub(super) fn recv(&mut self, out: &mut [f32]) -> Result<(), LinkError> {
        let mut header = [0u8; 8];
        let stream = &mut self.stream;
        self.runtime.block_on(async {
            let failed = |e: quinn::ReadExactError| LinkError(format!("receive from the previous rank failed: {e}"));
            stream.read_exact(&mut header).await.map_err(failed)?;
            check_count(header, out.len())?;
            stream.read_exact(as_bytes_mut(out)).await.map_err(failed)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{QuicRecv, QuicSend};
    use crate::link::tests::{quic_only, runtime};
    use crate::link::RingLinkBuilder;

    #[test]
    fn a_stranger_on_the_quic_port_does_not_end_the_accept_and_the_real_previous_rank_joins() {
        let runtime = runtime();
        let bind = || "127.0.0.1:0".parse().unwrap();
        let (mut incoming, mut outgoing) = runtime.block_on(async {
            let member = RingLinkBuilder::bind(bind(), "ring-token", quic_only()).unwrap();
            let port = member.address().unwrap().quic;
            let previous = RingLinkBuilder::bind(bind(), "ring-token", quic_only()).unwrap();
            let stranger = RingLinkBuilder::bind(bind(), "other-token", quic_only()).unwrap();
            let others = async {
                // A datagram of garbage, then a peer of another ring's authority.
                let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
                udp.send_to(&[0xc3; 1200], port).await.unwrap();
                let refused = QuicSend::open(&stranger.endpoint, &stranger.runtime, port).await;
                assert!(refused.is_err(), "a rank of another ring must not get a link");
                QuicSend::open(&previous.endpoint, &previous.runtime, port)
                    .await
                    .expect("the real previous rank opens its link")
            };
            tokio::time::timeout(Duration::from_secs(8), async {
                tokio::join!(QuicRecv::accept(&member.endpoint, &member.runtime), others)
            })
            .await
            .map(|(accepted, outgoing)| (accepted.expect("the real previous rank is accepted"), outgoing))
            .expect("the accept finishes")
        });
        // The stream taken is the real rank's: what it sends arrives.
        let sender = std::thread::spawn(move || {
            let values = [1.5f32, -2.0, 3.25];
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            outgoing
                .send(&(values.len() as u64).to_le_bytes(), &bytes)
                .map(|()| outgoing)
        });
        let mut out = [0f32; 3];
        incoming.recv(&mut out).unwrap();
        let _outgoing = sender.join().unwrap().unwrap();
        assert_eq!(out, [1.5, -2.0, 3.25]);
    }
}
