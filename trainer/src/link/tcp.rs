//! The TCP transport between hosts: a port whose connections finish a mutual TLS 1.3
//! handshake (the cluster's TLS, derived from the ring's secret) and then speak the object
//! store's sealed frames, AES-128-GCM frames of up to 1 MiB sealed straight from the
//! caller's values and opened in place in the receiving ones.

use std::net::SocketAddr;

use futures::StreamExt;
use regatta_net::{
    keep_alive, receive_frame_into, send_frame, tls_for_frames, Opener, SealedStream, Sealer, CHUNK_BYTES, SERVER_NAME,
};

use super::{as_bytes_mut, check_count, Outgoing, HANDSHAKE_TIMEOUT};
use crate::collective::LinkError;

/// ALPN protocol id of the ring's TCP links.
const RING_ALPN: &[u8] = b"regatta-ring/1";

/// The TCP listener of sealed-frame links and the TLS both ends of one use.
pub(super) struct TcpSide {
    pub(super) listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    connector: tokio_rustls::TlsConnector,
}

impl TcpSide {
    pub(super) fn bind(ip: std::net::IpAddr, identity: &regatta_net::TlsIdentity) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(SocketAddr::new(ip, 0))?;
        listener.set_nonblocking(true)?;
        let (acceptor, connector) = tls_for_frames(identity, RING_ALPN);
        Ok(Self {
            listener: tokio::net::TcpListener::from_std(listener)?,
            acceptor,
            connector,
        })
    }

    /// The TLS handshake and the switch to sealed frames on a connected TCP stream. A
    /// failure here is the link's failure: the next rank may already have taken this
    /// connection as its link, so falling back to QUIC could leave both waiting.
    pub(super) async fn open(&self, stream: tokio::net::TcpStream, peer: SocketAddr) -> Result<Outgoing, LinkError> {
        let opening = async {
            stream.set_nodelay(true)?;
            keep_alive(&stream)?;
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(SERVER_NAME)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            SealedStream::client(self.connector.connect(name, stream).await?).await
        };
        let sealed = tokio::time::timeout(HANDSHAKE_TIMEOUT, opening)
            .await
            .map_err(|_| LinkError(format!("the next rank {peer} did not finish the TLS handshake")))?
            .map_err(|e| LinkError(format!("TLS handshake with the next rank {peer} failed: {e}")))?;
        let (tcp, keys) = sealed.into_blocking().map_err(|e| LinkError(e.to_string()))?;
        Ok(Outgoing::Sealed(Box::new(SealedSend {
            tcp,
            sealer: keys.send,
            frame: Vec::new(),
        })))
    }

    /// The previous rank's connection on this port, once its TLS handshake is done;
    /// a peer that fails it is refused and the port listens on.
    pub(super) async fn accept(&self) -> Result<Box<SealedRecv>, LinkError> {
        // Handshakes run side by side: a connection that opens and stays silent (a
        // scanner, a stale rank) must not hold the real previous rank past its timeout.
        let mut handshakes = futures::stream::FuturesUnordered::new();
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => handshakes.push(async move {
                        let opening = async {
                            stream.set_nodelay(true)?;
                            keep_alive(&stream)?;
                            SealedStream::server(self.acceptor.accept(stream).await?).await?.into_blocking()
                        };
                        (peer, tokio::time::timeout(HANDSHAKE_TIMEOUT, opening).await)
                    }),
                    Err(e) => {
                        tracing::warn!("ring: the TCP port stopped accepting ({e}); waiting on the others");
                        return std::future::pending().await;
                    }
                },
                Some((peer, opened)) = handshakes.next(), if !handshakes.is_empty() => match opened {
                    Ok(Ok((stream, keys))) => {
                        return Ok(Box::new(SealedRecv {
                            tcp: stream,
                            opener: keys.receive,
                        }))
                    }
                    Ok(Err(e)) => tracing::warn!(%peer, "ring: refused a TCP peer: {e}"),
                    Err(_) => tracing::warn!(%peer, "ring: a TCP peer did not finish the TLS handshake"),
                },
            }
        }
    }
}

/// A TCP link's sending half: frames sealed from the caller's values.
pub(super) struct SealedSend {
    pub(super) tcp: std::net::TcpStream,
    sealer: Sealer,
    /// The frame being sent, reused.
    frame: Vec<u8>,
}

/// A TCP link's receiving half: frames opened in the caller's values.
pub(super) struct SealedRecv {
    pub(super) tcp: std::net::TcpStream,
    opener: Opener,
}

impl SealedSend {
    /// Writes a message as sealed frames: its value count, then the values' bytes in
    /// frames of at most [`CHUNK_BYTES`].
    pub(super) fn send(&mut self, header: &[u8; 8], payload: &[u8]) -> Result<(), LinkError> {
        let failed = |e: std::io::Error| LinkError(format!("send to the next rank failed: {e}"));
        let SealedSend { tcp, sealer, frame } = self;
        send_frame(tcp, sealer, frame, 0, header).map_err(failed)?;
        for chunk in payload.chunks(CHUNK_BYTES) {
            send_frame(tcp, sealer, frame, 0, chunk).map_err(failed)?;
        }
        Ok(())
    }
}

impl SealedRecv {
    /// Reads a message of exactly `out.len()` values, opening each frame in place in `out`.
    pub(super) fn recv(&mut self, out: &mut [f32]) -> Result<(), LinkError> {
        let mut header = [0u8; 8];
        let failed = |e: std::io::Error| LinkError(format!("receive from the previous rank failed: {e}"));
        let SealedRecv { tcp, opener } = self;
        let (_, len) = receive_frame_into(tcp, opener, &mut header).map_err(failed)?;
        if len != header.len() {
            return Err(LinkError(format!(
                "a message header of {len} bytes from the previous rank"
            )));
        }
        check_count(header, out.len())?;
        let bytes = as_bytes_mut(out);
        let mut filled = 0;
        while filled < bytes.len() {
            let end = (filled + CHUNK_BYTES).min(bytes.len());
            let (_, len) = receive_frame_into(tcp, opener, &mut bytes[filled..end]).map_err(failed)?;
            if len == 0 {
                return Err(LinkError("an empty frame from the previous rank".into()));
            }
            filled += len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;

    use crate::link::tests::{runtime, tcp_only};
    use crate::link::{Incoming, RingLinkBuilder};

    #[test]
    fn a_tcp_peer_without_the_token_is_refused_and_the_real_previous_rank_still_joins() {
        let runtime = runtime();
        let bind = || "127.0.0.1:0".parse().unwrap();
        let (incoming, mut outgoing) = runtime.block_on(async {
            let member = RingLinkBuilder::bind(bind(), "ring-token", tcp_only()).unwrap();
            let port = member.address().unwrap().tcp.expect("a TCP port is offered");
            let previous = RingLinkBuilder::bind(bind(), "ring-token", tcp_only()).unwrap();
            let stranger = RingLinkBuilder::bind(bind(), "other-token", tcp_only()).unwrap();
            let others = async {
                // A connection that stays silent, held open for the whole test: handshakes run
                // side by side, so it holds nobody up (one at a time it would hold the port
                // for the 10 s handshake deadline, past the 8 s this test allows).
                let silent = tokio::net::TcpStream::connect(port).await.unwrap();
                // Garbage next, held open: refused without holding the port up.
                let mut garbage = tokio::net::TcpStream::connect(port).await.unwrap();
                garbage.write_all(&[7u8; 512]).await.unwrap();
                let stream = tokio::net::TcpStream::connect(port).await.unwrap();
                let refused = stranger.tcp.as_ref().unwrap().open(stream, port).await;
                assert!(refused.is_err(), "a rank of another token must not get a link");
                let stream = tokio::net::TcpStream::connect(port).await.unwrap();
                let link = previous.tcp.as_ref().unwrap().open(stream, port).await;
                (link.expect("the real previous rank gets its link"), (garbage, silent))
            };
            let (accepted, (outgoing, _held)) = tokio::time::timeout(Duration::from_secs(8), async {
                tokio::join!(member.accept_previous(), others)
            })
            .await
            .expect("the handshakes finish");
            let Ok(incoming @ Incoming::Sealed(_)) = accepted else {
                panic!("the real previous rank was not accepted on the TCP port");
            };
            (incoming, outgoing)
        });
        // The link taken is the real rank's: what it sends arrives.
        let mut incoming = incoming;
        let sender = std::thread::spawn(move || outgoing.send(&[1.5, -2.0, 3.25]));
        let mut out = [0f32; 3];
        incoming.recv(&mut out).unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!(out, [1.5, -2.0, 3.25]);
    }
}
