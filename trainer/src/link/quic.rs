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
    /// The previous rank's stream on `endpoint`, once its hello byte arrived.
    pub(super) async fn accept(endpoint: &quinn::Endpoint, runtime: &Handle) -> Result<Self, LinkError> {
        let incoming = endpoint.accept().await.ok_or("the endpoint closed")?;
        let connection = incoming
            .await
            .map_err(|e| format!("previous rank's handshake failed: {e}"))?;
        let mut stream = connection
            .accept_uni()
            .await
            .map_err(|e| format!("previous rank opened no stream: {e}"))?;
        let mut hello = [0u8; 1];
        stream
            .read_exact(&mut hello)
            .await
            .map_err(|e| format!("previous rank's hello: {e}"))?;
        Ok(Self {
            runtime: runtime.clone(),
            stream,
            _endpoint: endpoint.clone(),
        })
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
