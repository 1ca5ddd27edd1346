//! Serving an axum router in the background: the one place that binds HTTP listeners.
//! Each listener serves at most [`MAX_CONNECTIONS`] connections at once, at most
//! [`MAX_PER_SOURCE`] of them from one source (an IPv4 /24 or an IPv6 /64), and closes a
//! connection that has not sent a whole request head within [`HEADER_READ_TIMEOUT`] (its
//! first request, or the next one on a kept-alive connection): idle or trickling
//! connections cannot use up the head's file descriptors.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::rustls::ServerConfig;

use crate::error::{Error, Result};
use crate::net::https::TlsIncoming;
use regatta_net::HandshakeSlots;

/// Connections one listener serves at once; more wait in the kernel's backlog.
pub(crate) const MAX_CONNECTIONS: usize = regatta_net::MAX_HANDSHAKES;
/// Connections one source may hold on one listener.
pub(crate) const MAX_PER_SOURCE: usize = regatta_net::MAX_HANDSHAKES_PER_SOURCE;
/// How long a connection may take to send a whole request head, counted from when it is
/// accepted or from its last response.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Binds `bind`, serves `app` on a background task (over TLS with `tls`, else plain
/// HTTP), and returns the bound address; `what` names the service in errors and logs.
pub(crate) async fn serve(
    app: Router,
    bind: SocketAddr,
    what: &'static str,
    tls: Option<Arc<ServerConfig>>,
) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .map_err(|e| Error::io(format!("cannot listen for the {what} on {bind}"), e))?;
    let address = listener
        .local_addr()
        .map_err(|e| Error::io(format!("{what} address"), e))?;
    match tls {
        None => {
            tokio::spawn(serve_connections(listener, app, what, Limits::DEFAULT));
        }
        Some(config) => {
            let incoming = TlsIncoming::new(listener, config, what)?;
            tokio::spawn(serve_connections(incoming, app, what, Limits::DEFAULT));
        }
    }
    Ok(address)
}

/// What one listener allows its connections.
#[derive(Clone, Copy, Debug)]
struct Limits {
    connections: usize,
    per_source: usize,
    header_read_timeout: Duration,
}

impl Limits {
    const DEFAULT: Self = Self {
        connections: MAX_CONNECTIONS,
        per_source: MAX_PER_SOURCE,
        header_read_timeout: HEADER_READ_TIMEOUT,
    };
}

/// Accepts connections from `listener` for as long as it lasts and serves `app` on each,
/// within `limits`.
async fn serve_connections<L>(mut listener: L, app: Router, what: &'static str, limits: Limits)
where
    L: axum::serve::Listener<Addr = SocketAddr>,
    L::Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let slots = HandshakeSlots::with_limits(limits.connections, limits.per_source);
    loop {
        let (io, peer) = listener.accept().await;
        let slot = match slots.take(peer.ip()) {
            Ok(slot) => slot,
            Err(refusal) => {
                tracing::warn!(%peer, "closed a connection to the {what} at once: {refusal}");
                continue;
            }
        };
        let app = app.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let mut request = request.map(axum::body::Body::new);
                request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                tower_service::Service::call(&mut app.clone(), request)
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades()
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "a connection to the {what} ended");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Instant;

    const QUICK: Limits = Limits {
        connections: 8,
        per_source: 2,
        header_read_timeout: Duration::from_millis(300),
    };

    async fn listening() -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let app = Router::new().route("/", axum::routing::get(|| async { "hello" }));
        tokio::spawn(serve_connections(listener, app, "test endpoint", QUICK));
        address
    }

    /// Seconds until the server closes `stream` (reading whatever it sends first).
    fn closed_after(mut stream: std::net::TcpStream) -> f64 {
        let started = Instant::now();
        stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
        started.elapsed().as_secs_f64()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_and_trickling_connections_are_closed_and_one_source_holds_its_share() {
        let address = listening().await;
        tokio::task::spawn_blocking(move || {
            // A silent connection, and one that sends half a request head, are closed.
            let opened = Instant::now();
            let silent = std::net::TcpStream::connect(address).expect("connect");
            let mut trickling = std::net::TcpStream::connect(address).expect("connect");
            trickling.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").expect("write");
            // While both are open, this source holds its share: a third is closed at once.
            let third = std::net::TcpStream::connect(address).expect("connect");
            assert!(
                closed_after(third) < 0.25,
                "a third connection from one source is refused at once"
            );
            for (name, stream) in [("silent", silent), ("trickling", trickling)] {
                closed_after(stream);
                let after = opened.elapsed().as_secs_f64();
                assert!(
                    (0.25..4.0).contains(&after),
                    "{name}: closed {after:.2} s after it opened, not after the 0.3 s limit"
                );
            }
            // Once they are gone, a request is answered, and its kept-alive connection is
            // closed when no next request comes.
            let mut client = std::net::TcpStream::connect(address).expect("connect");
            client.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").expect("write");
            let mut answer = [0u8; 512];
            let n = client.read(&mut answer).expect("an answer");
            assert!(
                String::from_utf8_lossy(&answer[..n]).ends_with("hello"),
                "{}",
                String::from_utf8_lossy(&answer[..n])
            );
            let after = closed_after(client);
            assert!(after < 4.0, "an idle kept-alive connection stays open {after:.2} s");
        })
        .await
        .expect("the client side");
    }
}
