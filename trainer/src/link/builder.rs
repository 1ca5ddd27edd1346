//! Forming a rank's link: [`LinkOptions`] (which transports a rank offers and uses), and
//! [`RingLinkBuilder`], a bound rank that connects to the next rank by the best transport
//! the two share while it accepts the previous rank on whichever of its own arrives first.

use std::net::SocketAddr;

use regatta_net::{endpoint, identity_from_secret};
use tokio::runtime::Handle;

use super::quic::{QuicRecv, QuicSend};
use super::tcp::TcpSide;
use super::unix::{self, LocalListener};
use super::{Incoming, LocalAddress, Outgoing, RingAddress, StreamLink, HANDSHAKE_TIMEOUT, RING_TRANSPORT_ENV};
use crate::collective::LinkError;

/// Which transports a rank offers and uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkOptions {
    /// Offer and use a Unix socket between ranks on one host.
    pub local: bool,
    /// Offer and use TCP with sealed frames between hosts (else QUIC).
    pub tcp: bool,
}

impl LinkOptions {
    /// The default (a Unix socket on one host, TCP with sealed frames between hosts),
    /// unless [`RING_TRANSPORT_ENV`] says `quic` (QUIC everywhere) or `tcp` (TCP everywhere).
    pub fn from_env() -> Self {
        let chosen = std::env::var(RING_TRANSPORT_ENV).map(|v| v.trim().to_ascii_lowercase());
        match chosen.as_deref() {
            Ok("quic") => Self {
                local: false,
                tcp: false,
            },
            Ok("tcp") => Self {
                local: false,
                tcp: true,
            },
            _ => Self { local: true, tcp: true },
        }
    }
}

/// A bound rank waiting for its ring neighbours.
pub struct RingLinkBuilder {
    pub(super) endpoint: quinn::Endpoint,
    pub(super) runtime: Handle,
    pub(super) local: Option<LocalListener>,
    pub(super) tcp: Option<TcpSide>,
    pub(super) secret: Vec<u8>,
}

impl RingLinkBuilder {
    /// Binds this rank's QUIC endpoint (port 0 picks one) and, with `options.local`, its Unix
    /// socket; call from inside a tokio runtime.
    pub fn bind(bind: SocketAddr, secret: &str, options: LinkOptions) -> Result<Self, LinkError> {
        let identity = identity_from_secret(secret).map_err(|e| e.to_string())?;
        let endpoint = endpoint(bind, &identity).map_err(|e| e.to_string())?;
        let runtime = Handle::try_current().map_err(|e| format!("no tokio runtime: {e}"))?;
        let tcp = if options.tcp {
            match TcpSide::bind(bind.ip(), &identity) {
                Ok(tcp) => Some(tcp),
                Err(e) => {
                    tracing::warn!("ring: no TCP port for ranks on other hosts ({e}); they will use QUIC");
                    None
                }
            }
        } else {
            None
        };
        let local = if options.local {
            match LocalListener::bind() {
                Ok(local) => local,
                Err(e) => {
                    tracing::warn!("ring: no Unix socket for ranks on this host ({e}); they will use QUIC");
                    None
                }
            }
        } else {
            None
        };
        Ok(Self {
            endpoint,
            runtime,
            local,
            tcp,
            secret: secret.as_bytes().to_vec(),
        })
    }

    /// Where the previous rank connects to (its [`Display`](std::fmt::Display) form travels
    /// through the driver).
    pub fn address(&self) -> Result<RingAddress, LinkError> {
        let quic = self.endpoint.local_addr().map_err(|e| LinkError(e.to_string()))?;
        let tcp = match &self.tcp {
            Some(tcp) => Some(tcp.listener.local_addr().map_err(|e| LinkError(e.to_string()))?),
            None => None,
        };
        let local = self.local.as_ref().map(|l| LocalAddress {
            host: l.host,
            path: l.path.clone(),
        });
        Ok(RingAddress { quic, tcp, local })
    }

    /// Connects to the next rank at `next` (a [`RingAddress`] in text) and accepts the
    /// previous one, by whichever transport each pair shares.
    pub async fn connect(self, next: &str) -> Result<StreamLink, LinkError> {
        let next: RingAddress = next.parse()?;
        let (incoming, outgoing) = tokio::join!(self.accept_previous(), self.open_next(&next));
        let (incoming, outgoing) = (incoming?, outgoing?);
        // The socket file is not needed once the previous rank is in; the directory goes now.
        drop(self.local);
        Ok(StreamLink {
            outgoing,
            incoming,
            sent: 0,
            broken: None,
        })
    }

    async fn open_next(&self, next: &RingAddress) -> Result<Outgoing, LinkError> {
        if let (Some(mine), Some(theirs)) = (&self.local, &next.local) {
            if mine.host == theirs.host {
                match unix::connect(&theirs.path, &self.secret).await {
                    Ok(stream) => return Ok(Outgoing::Local(stream)),
                    Err(e) => tracing::warn!(
                        "ring: the next rank's Unix socket {} failed ({e}); using the network",
                        theirs.path.display()
                    ),
                }
            }
        }
        if let (Some(mine), Some(theirs)) = (&self.tcp, next.tcp) {
            // A port behind a firewall that drops packets would hold the connect for minutes.
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, tokio::net::TcpStream::connect(theirs)).await {
                Ok(Ok(stream)) => return mine.open(stream, theirs).await,
                Ok(Err(e)) => tracing::warn!("ring: the next rank's TCP port {theirs} failed ({e}); using QUIC"),
                Err(_) => tracing::warn!("ring: the next rank's TCP port {theirs} did not answer; using QUIC"),
            }
        }
        Ok(Outgoing::Quic(
            QuicSend::open(&self.endpoint, &self.runtime, next.quic).await?,
        ))
    }

    /// The previous rank's link, by whichever transport it arrives on first.
    pub(super) async fn accept_previous(&self) -> Result<Incoming, LinkError> {
        // A transport this rank does not offer never brings the previous rank in.
        let local = async {
            let Some(local) = &self.local else {
                return std::future::pending().await;
            };
            local.accept(&self.secret).await
        };
        let tcp = async {
            let Some(tcp) = &self.tcp else {
                return std::future::pending().await;
            };
            tcp.accept().await
        };
        tokio::select! {
            stream = QuicRecv::accept(&self.endpoint, &self.runtime) => Ok(Incoming::Quic(stream?)),
            stream = local => Ok(Incoming::Local(stream?)),
            stream = tcp => Ok(Incoming::Sealed(stream?)),
        }
    }
}
