//! The ring link between neighbouring ranks. Each rank listens three ways: on a TCP port
//! whose connections speak the object store's sealed frames after a mutual TLS 1.3
//! handshake (the cluster's TLS, derived from the ring's secret; AES-128-GCM frames of up to
//! 1 MiB sealed straight from the tensor and opened in place in the receiving tensor), on a
//! QUIC endpoint (the same TLS), and on a Unix socket in a private directory. A rank connects
//! to the next rank over the Unix socket when both run on one host (same kernel boot and PID
//! namespace: the object store's [`HostKey`]), proving the ring's secret with an HMAC
//! challenge each way; otherwise over TCP with sealed frames, or over QUIC when the next rank
//! offers no TCP port or its port cannot be reached (`REGATTA_RING_TRANSPORT=quic` makes
//! every link QUIC, for comparisons).
//!
//! Either way the link moves the tensors' own bytes: a send writes straight from the caller's
//! `f32` slice and a receive reads straight into the caller's slice, with no encoding pass and
//! no intermediate buffer. In an exchange (send to the next rank while receiving from the
//! previous one, every ring step) the send runs on a scoped thread so it overlaps the receive:
//! every rank sends before it receives, and blocking sends alone would deadlock the ring once
//! a chunk outgrows the socket's buffer.

use std::fmt;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use futures::StreamExt;
use hmac::{Hmac, Mac};
use regatta_object_store::{
    endpoint, identity_from_token, keep_alive, receive_frame_into, send_frame, tls_for_frames, HostKey, Opener,
    SealedStream, Sealer, CHUNK_BYTES, SERVER_NAME,
};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Handle;

use crate::collective::{LinkError, RingLink};

/// Set to `quic` to make every ring link use QUIC, or to `tcp` to make every link TCP with
/// sealed frames, even between ranks on one host (for comparisons and for hosts whose
/// temporary directory cannot hold a socket).
pub const RING_TRANSPORT_ENV: &str = "REGATTA_RING_TRANSPORT";

/// ALPN protocol id of the ring's TCP links.
const RING_ALPN: &[u8] = b"regatta-ring/1";

/// How long a Unix-socket peer has to finish the secret handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Length of each side's challenge and of an HMAC-SHA256 tag.
const NONCE_LEN: usize = 32;

// The wire form of the values is little-endian `f32`, which is the memory form here.
#[cfg(not(target_endian = "little"))]
compile_error!("the ring link sends f32 values in memory order, which must be little-endian");

/// Where a rank's previous neighbour reaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingAddress {
    /// The QUIC endpoint.
    pub quic: SocketAddr,
    /// The TCP port of sealed-frame links, when the rank offers one.
    pub tcp: Option<SocketAddr>,
    /// The Unix socket, for ranks on the same host.
    pub local: Option<LocalAddress>,
}

/// A rank's Unix socket and the host it is valid on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalAddress {
    /// The kernel and PID namespace the socket lives in.
    pub host: HostKey,
    /// The socket's path.
    pub path: PathBuf,
}

impl fmt::Display for RingAddress {
    /// `quic=<addr>;tcp=<addr>;host=<hex>;unix=<path>` (the path last: it may hold any
    /// character); `tcp` and `host`/`unix` only when offered.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quic={}", self.quic)?;
        if let Some(tcp) = self.tcp {
            write!(f, ";tcp={tcp}")?;
        }
        if let Some(local) = &self.local {
            write!(
                f,
                ";host={};unix={}",
                crate::hex::encode(&local.host.to_bytes()),
                local.path.display()
            )?;
        }
        Ok(())
    }
}

impl FromStr for RingAddress {
    type Err = LinkError;

    /// Reads the [`Display`](fmt::Display) form back; a bare socket address is a QUIC-only
    /// address.
    fn from_str(text: &str) -> Result<Self, LinkError> {
        let bad = |why: &str| LinkError(format!("bad ring address {text:?}: {why}"));
        let Some(rest) = text.strip_prefix("quic=") else {
            let quic = text.parse().map_err(|e| bad(&format!("{e}")))?;
            return Ok(Self {
                quic,
                tcp: None,
                local: None,
            });
        };
        let (network, local) = match rest.split_once(";host=") {
            None => (rest, None),
            Some((network, local)) => (network, Some(local)),
        };
        let (quic, tcp) = match network.split_once(";tcp=") {
            None => (network, None),
            Some((quic, tcp)) => (quic, Some(tcp.parse().map_err(|e| bad(&format!("{e}")))?)),
        };
        let quic = quic.parse().map_err(|e| bad(&format!("{e}")))?;
        let local = match local {
            None => None,
            Some(local) => {
                let (host, path) = local
                    .split_once(";unix=")
                    .ok_or_else(|| bad("a host without a socket path"))?;
                let host: [u8; HostKey::LEN] = crate::hex::decode(host)
                    .and_then(|bytes| bytes.try_into().ok())
                    .ok_or_else(|| bad("the host key is not 24 hex bytes"))?;
                if path.is_empty() {
                    return Err(bad("an empty socket path"));
                }
                Some(LocalAddress {
                    host: HostKey::from_bytes(&host),
                    path: PathBuf::from(path),
                })
            }
        };
        Ok(Self { quic, tcp, local })
    }
}

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
    endpoint: quinn::Endpoint,
    runtime: Handle,
    local: Option<LocalListener>,
    tcp: Option<TcpSide>,
    secret: Vec<u8>,
}

/// The TCP listener of sealed-frame links and the TLS both ends of one use.
struct TcpSide {
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    connector: tokio_rustls::TlsConnector,
}

impl TcpSide {
    fn bind(ip: std::net::IpAddr, identity: &regatta_object_store::TlsIdentity) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(SocketAddr::new(ip, 0))?;
        listener.set_nonblocking(true)?;
        let (acceptor, connector) = tls_for_frames(identity, RING_ALPN);
        Ok(Self {
            listener: tokio::net::TcpListener::from_std(listener)?,
            acceptor,
            connector,
        })
    }
}

/// A Unix listener in a directory only this user can enter; the directory goes with it.
struct LocalListener {
    listener: tokio::net::UnixListener,
    host: HostKey,
    dir: PathBuf,
    path: PathBuf,
}

impl LocalListener {
    fn bind() -> std::io::Result<Option<Self>> {
        let Some(host) = HostKey::this_process() else {
            return Ok(None);
        };
        let mut suffix = [0u8; 8];
        getrandom::getrandom(&mut suffix).map_err(|e| std::io::Error::other(e.to_string()))?;
        let dir = std::env::temp_dir().join(format!("regatta-ring-{}", crate::hex::encode(&suffix)));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let path = dir.join("ring.sock");
        let listener = match tokio::net::UnixListener::bind(&path) {
            Ok(listener) => listener,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(Some(Self {
            listener,
            host,
            dir,
            path,
        }))
    }
}

impl Drop for LocalListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl RingLinkBuilder {
    /// Binds this rank's QUIC endpoint (port 0 picks one) and, with `options.local`, its Unix
    /// socket; call from inside a tokio runtime.
    pub fn bind(bind: SocketAddr, secret: &str, options: LinkOptions) -> Result<Self, LinkError> {
        let identity = identity_from_token(secret).map_err(|e| e.to_string())?;
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

    /// Where the previous rank connects to (its [`Display`](fmt::Display) form travels
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
                match self.connect_local(&theirs.path).await {
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
                Ok(Ok(stream)) => return Self::open_tcp(mine, stream, theirs).await,
                Ok(Err(e)) => tracing::warn!("ring: the next rank's TCP port {theirs} failed ({e}); using QUIC"),
                Err(_) => tracing::warn!("ring: the next rank's TCP port {theirs} did not answer; using QUIC"),
            }
        }
        let connection = self
            .endpoint
            .connect(next.quic, SERVER_NAME)
            .map_err(|e| format!("cannot connect to {}: {e}", next.quic))?
            .await
            .map_err(|e| format!("handshake with the next rank {} failed: {e}", next.quic))?;
        let mut stream = connection
            .open_uni()
            .await
            .map_err(|e| format!("cannot open a stream to {}: {e}", next.quic))?;
        // A stream becomes visible to the peer only once something is written.
        stream.write_all(&[1]).await.map_err(|e| e.to_string())?;
        Ok(Outgoing::Quic(QuicSend {
            runtime: self.runtime.clone(),
            stream: Some(stream),
            endpoint: self.endpoint.clone(),
        }))
    }

    /// The TLS handshake and the switch to sealed frames on a connected TCP stream. A
    /// failure here is the link's failure: the next rank may already have taken this
    /// connection as its link, so falling back to QUIC could leave both waiting.
    async fn open_tcp(side: &TcpSide, stream: tokio::net::TcpStream, peer: SocketAddr) -> Result<Outgoing, LinkError> {
        let opening = async {
            stream.set_nodelay(true)?;
            keep_alive(&stream)?;
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(SERVER_NAME)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            SealedStream::client(side.connector.connect(name, stream).await?).await
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

    async fn connect_local(&self, path: &std::path::Path) -> Result<UnixStream, LinkError> {
        let mut stream = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|e| LinkError(e.to_string()))?;
        tokio::time::timeout(HANDSHAKE_TIMEOUT, prove_as_connector(&mut stream, &self.secret))
            .await
            .map_err(|_| LinkError("the next rank did not finish the handshake".into()))??;
        into_blocking(stream)
    }

    async fn accept_previous(&self) -> Result<Incoming, LinkError> {
        let quic = async {
            let incoming = self.endpoint.accept().await.ok_or("the endpoint closed")?;
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
            Ok::<_, LinkError>(stream)
        };
        let local = async {
            let Some(local) = &self.local else {
                return std::future::pending().await;
            };
            loop {
                let mut stream = match local.listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // QUIC may still bring the previous rank in.
                        tracing::warn!("ring: the Unix socket stopped accepting ({e}); waiting on QUIC");
                        return std::future::pending().await;
                    }
                };
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, prove_as_listener(&mut stream, &self.secret)).await {
                    Ok(Ok(())) => return into_blocking(stream),
                    Ok(Err(e)) => tracing::warn!("ring: refused a Unix-socket peer: {e}"),
                    Err(_) => tracing::warn!("ring: a Unix-socket peer did not finish the handshake"),
                }
            }
        };
        let tcp = async {
            let Some(tcp) = &self.tcp else {
                return std::future::pending().await;
            };
            // Handshakes run side by side: a connection that opens and stays silent (a
            // scanner, a stale rank) must not hold the real previous rank past its timeout.
            let mut handshakes = futures::stream::FuturesUnordered::new();
            loop {
                tokio::select! {
                    accepted = tcp.listener.accept() => match accepted {
                        Ok((stream, peer)) => handshakes.push(async move {
                            let opening = async {
                                stream.set_nodelay(true)?;
                                keep_alive(&stream)?;
                                SealedStream::server(tcp.acceptor.accept(stream).await?).await?.into_blocking()
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
                            return Ok::<_, LinkError>(Box::new(SealedRecv {
                                tcp: stream,
                                opener: keys.receive,
                            }))
                        }
                        Ok(Err(e)) => tracing::warn!(%peer, "ring: refused a TCP peer: {e}"),
                        Err(_) => tracing::warn!(%peer, "ring: a TCP peer did not finish the TLS handshake"),
                    },
                }
            }
        };
        tokio::select! {
            stream = quic => Ok(Incoming::Quic(QuicRecv { runtime: self.runtime.clone(), stream: stream?, _endpoint: self.endpoint.clone() })),
            stream = local => Ok(Incoming::Local(stream?)),
            stream = tcp => Ok(Incoming::Sealed(stream?)),
        }
    }
}

type HmacSha256 = Hmac<Sha256>;

fn tag(secret: &[u8], role: &[u8], nonce: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(b"regatta ring link v1 ");
    mac.update(role);
    mac.update(nonce);
    mac
}

fn nonce() -> Result<[u8; NONCE_LEN], LinkError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce).map_err(|e| LinkError(format!("no randomness: {e}")))?;
    Ok(nonce)
}

/// The listener's side: challenge, check the connector's answer, answer its challenge, wait
/// for its confirmation.
async fn prove_as_listener(stream: &mut tokio::net::UnixStream, secret: &[u8]) -> Result<(), LinkError> {
    let io = |e: std::io::Error| LinkError(e.to_string());
    let challenge = nonce()?;
    stream.write_all(&challenge).await.map_err(io)?;
    let mut answer = [0u8; 2 * NONCE_LEN];
    stream.read_exact(&mut answer).await.map_err(io)?;
    let (their_challenge, their_tag) = answer.split_at(NONCE_LEN);
    tag(secret, b"connect", &challenge)
        .verify_slice(their_tag)
        .map_err(|_| LinkError("the peer does not hold the ring's secret".into()))?;
    let ours = tag(secret, b"accept", their_challenge).finalize().into_bytes();
    stream.write_all(&ours).await.map_err(io)?;
    // The connector confirms it took the answer: only then is the stream the link (a
    // connector that gave up in between goes to QUIC, which is still being accepted).
    let mut confirmed = [0u8; 1];
    stream.read_exact(&mut confirmed).await.map_err(io)?;
    if confirmed != [1] {
        return Err(LinkError("the peer did not confirm the handshake".into()));
    }
    Ok(())
}

/// The connector's side: answer the listener's challenge with one of its own, check its
/// answer, confirm.
async fn prove_as_connector(stream: &mut tokio::net::UnixStream, secret: &[u8]) -> Result<(), LinkError> {
    let io = |e: std::io::Error| LinkError(e.to_string());
    let mut challenge = [0u8; NONCE_LEN];
    stream.read_exact(&mut challenge).await.map_err(io)?;
    let ours = nonce()?;
    let mut answer = [0u8; 2 * NONCE_LEN];
    answer[..NONCE_LEN].copy_from_slice(&ours);
    answer[NONCE_LEN..].copy_from_slice(&tag(secret, b"connect", &challenge).finalize().into_bytes());
    stream.write_all(&answer).await.map_err(io)?;
    let mut their_tag = [0u8; NONCE_LEN];
    stream.read_exact(&mut their_tag).await.map_err(io)?;
    tag(secret, b"accept", &ours)
        .verify_slice(&their_tag)
        .map_err(|_| LinkError("the next rank does not hold the ring's secret".into()))?;
    stream.write_all(&[1]).await.map_err(io)
}

fn into_blocking(stream: tokio::net::UnixStream) -> Result<UnixStream, LinkError> {
    let stream = stream.into_std().map_err(|e| LinkError(e.to_string()))?;
    stream.set_nonblocking(false).map_err(|e| LinkError(e.to_string()))?;
    Ok(stream)
}

/// The sending half of a link.
enum Outgoing {
    Local(UnixStream),
    Sealed(Box<SealedSend>),
    Quic(QuicSend),
}

/// The receiving half of a link.
enum Incoming {
    Local(UnixStream),
    Sealed(Box<SealedRecv>),
    Quic(QuicRecv),
}

/// A TCP link's sending half: frames sealed from the caller's values.
struct SealedSend {
    tcp: std::net::TcpStream,
    sealer: Sealer,
    /// The frame being sent, reused.
    frame: Vec<u8>,
}

/// A TCP link's receiving half: frames opened in the caller's values.
struct SealedRecv {
    tcp: std::net::TcpStream,
    opener: Opener,
}

/// What shuts a link's sending half down from another thread, so a blocked write returns.
enum Unblock {
    Unix(UnixStream),
    Tcp(std::net::TcpStream),
}

impl Unblock {
    fn shutdown(&self) {
        let _ = match self {
            Unblock::Unix(stream) => stream.shutdown(std::net::Shutdown::Both),
            Unblock::Tcp(stream) => stream.shutdown(std::net::Shutdown::Both),
        };
    }
}

struct QuicSend {
    runtime: Handle,
    stream: Option<quinn::SendStream>,
    endpoint: quinn::Endpoint,
}

struct QuicRecv {
    runtime: Handle,
    stream: quinn::RecvStream,
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

impl Outgoing {
    fn close(&mut self) {
        match self {
            Outgoing::Local(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Outgoing::Sealed(sealed) => {
                let _ = sealed.tcp.shutdown(std::net::Shutdown::Both);
            }
            Outgoing::Quic(quic) => {
                if let Some(stream) = quic.stream.as_mut() {
                    let _ = stream.reset(quinn::VarInt::from_u32(0));
                }
            }
        }
    }

    /// Writes a message: its value count, then the values' bytes from the caller's slice.
    fn send(&mut self, values: &[f32]) -> Result<(), LinkError> {
        let header = (values.len() as u64).to_le_bytes();
        let payload = as_bytes(values);
        match self {
            Outgoing::Local(stream) => {
                let failed = |e: std::io::Error| LinkError(format!("send to the next rank failed: {e}"));
                stream.write_all(&header).map_err(failed)?;
                stream.write_all(payload).map_err(failed)
            }
            Outgoing::Sealed(sealed) => {
                let failed = |e: std::io::Error| LinkError(format!("send to the next rank failed: {e}"));
                let SealedSend { tcp, sealer, frame } = &mut **sealed;
                send_frame(tcp, sealer, frame, 0, &header).map_err(failed)?;
                for chunk in payload.chunks(CHUNK_BYTES) {
                    send_frame(tcp, sealer, frame, 0, chunk).map_err(failed)?;
                }
                Ok(())
            }
            Outgoing::Quic(quic) => {
                let stream = quic.stream.as_mut().ok_or("the link to the next rank is closed")?;
                quic.runtime
                    .block_on(async {
                        stream.write_all(&header).await?;
                        stream.write_all(payload).await
                    })
                    .map_err(|e| LinkError(format!("send to the next rank failed: {e}")))
            }
        }
    }
}

impl Incoming {
    fn close(&mut self) {
        match self {
            Incoming::Local(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Incoming::Sealed(sealed) => {
                let _ = sealed.tcp.shutdown(std::net::Shutdown::Both);
            }
            Incoming::Quic(quic) => {
                let _ = quic.stream.stop(quinn::VarInt::from_u32(0));
            }
        }
    }

    /// Reads a message of exactly `out.len()` values straight into `out`.
    fn recv(&mut self, out: &mut [f32]) -> Result<(), LinkError> {
        let expected = out.len();
        let check = |header: [u8; 8]| {
            let count = u64::from_le_bytes(header);
            if count == expected as u64 {
                Ok(())
            } else {
                Err(LinkError(format!(
                    "expected {expected} values from the previous rank, it sent {count}"
                )))
            }
        };
        let mut header = [0u8; 8];
        match self {
            Incoming::Local(stream) => {
                let failed = |e: std::io::Error| LinkError(format!("receive from the previous rank failed: {e}"));
                stream.read_exact(&mut header).map_err(failed)?;
                check(header)?;
                stream.read_exact(as_bytes_mut(out)).map_err(failed)
            }
            Incoming::Sealed(sealed) => {
                let failed = |e: std::io::Error| LinkError(format!("receive from the previous rank failed: {e}"));
                let SealedRecv { tcp, opener } = &mut **sealed;
                let (_, len) = receive_frame_into(tcp, opener, &mut header).map_err(failed)?;
                if len != header.len() {
                    return Err(LinkError(format!(
                        "a message header of {len} bytes from the previous rank"
                    )));
                }
                check(header)?;
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
            Incoming::Quic(quic) => {
                let stream = &mut quic.stream;
                quic.runtime.block_on(async {
                    let failed =
                        |e: quinn::ReadExactError| LinkError(format!("receive from the previous rank failed: {e}"));
                    stream.read_exact(&mut header).await.map_err(failed)?;
                    check(header)?;
                    stream.read_exact(as_bytes_mut(out)).await.map_err(failed)
                })
            }
        }
    }
}

/// A rank's link to its two ring neighbours. Its calls block: run them on a plain thread
/// (the executor's, or `spawn_blocking`), never on an async task.
pub struct StreamLink {
    outgoing: Outgoing,
    incoming: Incoming,
    sent: u64,
    /// Why the link broke, once a send or receive failed: the streams may be out of step
    /// (a half-read message), so every later call fails at once.
    broken: Option<String>,
}

impl StreamLink {
    /// Which transport each half uses: `(to the next rank, from the previous rank)`, each
    /// `"unix"`, `"tcp"` or `"quic"`.
    pub fn transports(&self) -> (&'static str, &'static str) {
        let out = match self.outgoing {
            Outgoing::Local(_) => "unix",
            Outgoing::Sealed(_) => "tcp",
            Outgoing::Quic(_) => "quic",
        };
        let inc = match self.incoming {
            Incoming::Local(_) => "unix",
            Incoming::Sealed(_) => "tcp",
            Incoming::Quic(_) => "quic",
        };
        (out, inc)
    }

    /// Value bytes sent so far.
    pub fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

impl StreamLink {
    fn usable(&self) -> Result<(), LinkError> {
        match &self.broken {
            None => Ok(()),
            Some(cause) => Err(LinkError(format!("the ring link broke earlier: {cause}"))),
        }
    }

    /// Records the failure and closes both halves, so the neighbours see it too rather than
    /// read a stream that is out of step.
    fn broke(&mut self, error: LinkError) -> LinkError {
        self.outgoing.close();
        self.incoming.close();
        self.broken = Some(error.0.clone());
        error
    }
}

impl RingLink for StreamLink {
    fn send(&mut self, data: &[f32]) -> Result<(), LinkError> {
        self.usable()?;
        if let Err(e) = self.outgoing.send(data) {
            return Err(self.broke(e));
        }
        self.sent += 4 * data.len() as u64;
        Ok(())
    }

    fn recv(&mut self, out: &mut [f32]) -> Result<(), LinkError> {
        self.usable()?;
        self.incoming.recv(out).map_err(|e| self.broke(e))
    }

    fn exchange(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), LinkError> {
        self.usable()?;
        // A failed receive must not leave the send blocked on a neighbour that stopped
        // reading: shutting the socket down makes the blocked write return.
        let unblock = match &self.outgoing {
            Outgoing::Local(stream) => stream.try_clone().ok().map(Unblock::Unix),
            Outgoing::Sealed(sealed) => sealed.tcp.try_clone().ok().map(Unblock::Tcp),
            Outgoing::Quic(_) => None,
        };
        let (outgoing, incoming) = (&mut self.outgoing, &mut self.incoming);
        let (sent, received) = std::thread::scope(|scope| {
            let writer = scope.spawn(move || outgoing.send(send));
            let received = incoming.recv(recv);
            if received.is_err() {
                if let Some(unblock) = &unblock {
                    unblock.shutdown();
                }
            }
            let sent = writer
                .join()
                .unwrap_or_else(|_| Err(LinkError("the ring's send thread panicked".into())));
            (sent, received)
        });
        if let Err(e) = received {
            return Err(self.broke(e));
        }
        if let Err(e) = sent {
            return Err(self.broke(e));
        }
        self.sent += 4 * send.len() as u64;
        Ok(())
    }
}

/// The bytes of `values` in memory (little-endian `f32`, checked at compile time above).
#[allow(unsafe_code)]
fn as_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: `f32` has no padding and every byte of it is initialised; `u8` has alignment 1;
    // the length covers exactly the same memory, borrowed for the same lifetime.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// The bytes of `values` in memory, writable: any bit pattern is a valid `f32`.
#[allow(unsafe_code)]
fn as_bytes_mut(values: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern written through the result is a valid
    // `f32`, and the exclusive borrow is carried over.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{Collective, RingCollective};
    use std::os::unix::fs::PermissionsExt;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    /// Forms a ring of `world` ranks in this process with one option set per rank.
    fn ring(runtime: &tokio::runtime::Runtime, options: &[LinkOptions]) -> Vec<StreamLink> {
        let world = options.len();
        let builders: Vec<RingLinkBuilder> = runtime.block_on(async {
            options
                .iter()
                .map(|o| RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", *o).unwrap())
                .collect()
        });
        let addresses: Vec<String> = builders.iter().map(|b| b.address().unwrap().to_string()).collect();
        runtime.block_on(async {
            let connects = builders
                .into_iter()
                .enumerate()
                .map(|(rank, b)| b.connect(&addresses[(rank + 1) % world]));
            futures::future::try_join_all(connects).await.unwrap()
        })
    }

    /// All-reduces `len` values on every rank of `links`, checking every element.
    fn all_reduce_on(links: Vec<StreamLink>, len: usize) {
        let world = links.len();
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
        let ranks_sum = (world * (world - 1) / 2) as f32;
        for thread in threads {
            let buffer = thread.join().unwrap();
            for (i, value) in buffer.iter().enumerate() {
                assert_eq!(*value, world as f32 * (i % 7) as f32 + ranks_sum, "element {i}");
            }
        }
    }

    fn quic_only() -> LinkOptions {
        LinkOptions {
            local: false,
            tcp: false,
        }
    }

    fn tcp_only() -> LinkOptions {
        LinkOptions {
            local: false,
            tcp: true,
        }
    }

    fn local() -> LinkOptions {
        LinkOptions { local: true, tcp: true }
    }

    // 3,000,001 values = 12 MB per rank: far beyond one flow-control window or socket buffer.
    const LARGE: usize = 3_000_001;

    #[test]
    fn a_ring_over_quic_all_reduces_large_buffers_without_deadlock() {
        let runtime = runtime();
        let links = ring(&runtime, &[quic_only(); 3]);
        assert!(links.iter().all(|l| l.transports() == ("quic", "quic")));
        all_reduce_on(links, LARGE);
    }

    #[test]
    fn a_ring_over_tcp_with_sealed_frames_all_reduces_large_buffers_without_deadlock() {
        let runtime = runtime();
        let links = ring(&runtime, &[tcp_only(); 3]);
        assert!(
            links.iter().all(|l| l.transports() == ("tcp", "tcp")),
            "{:?}",
            links.iter().map(StreamLink::transports).collect::<Vec<_>>()
        );
        all_reduce_on(links, LARGE);
    }

    #[test]
    fn a_ring_mixing_tcp_and_quic_links_agrees() {
        // Rank 1 offers no TCP port: rank 0 reaches it by QUIC, and it reaches rank 2 by QUIC.
        let runtime = runtime();
        let links = ring(&runtime, &[tcp_only(), quic_only(), tcp_only()]);
        let transports: Vec<_> = links.iter().map(StreamLink::transports).collect();
        assert_eq!(transports, vec![("quic", "tcp"), ("quic", "quic"), ("tcp", "quic")]);
        all_reduce_on(links, 100_003);
    }

    #[test]
    fn ranks_on_one_host_use_unix_sockets_and_all_reduce_large_buffers() {
        let runtime = runtime();
        let links = ring(&runtime, &[local(); 3]);
        assert!(
            links.iter().all(|l| l.transports() == ("unix", "unix")),
            "{:?}",
            links.iter().map(StreamLink::transports).collect::<Vec<_>>()
        );
        all_reduce_on(links, LARGE);
    }

    #[test]
    fn a_ring_mixing_unix_and_quic_links_agrees() {
        // Rank 1 offers no Unix socket: rank 0 reaches it by QUIC, rank 1 reaches rank 2 by
        // its Unix socket, rank 2 reaches rank 0 by its Unix socket.
        let runtime = runtime();
        let links = ring(&runtime, &[local(), quic_only(), local()]);
        let transports: Vec<_> = links.iter().map(StreamLink::transports).collect();
        assert_eq!(transports, vec![("quic", "unix"), ("quic", "quic"), ("unix", "quic")]);
        all_reduce_on(links, 100_003);
    }

    #[test]
    fn a_rank_without_the_token_cannot_join_the_ring() {
        let runtime = runtime();
        for options in [quic_only(), tcp_only(), local()] {
            runtime.block_on(async {
                let member = RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", options).unwrap();
                let stranger = RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "other-token", options).unwrap();
                let member_addr = member.address().unwrap().to_string();
                let stranger_addr = stranger.address().unwrap().to_string();
                let outcome = tokio::time::timeout(Duration::from_secs(10), async {
                    tokio::join!(member.connect(&stranger_addr), stranger.connect(&member_addr))
                })
                .await;
                // Neither side completing a handshake (a timeout) is refused by waiting, not joined.
                if let Ok((a, b)) = outcome {
                    assert!(a.is_err() && b.is_err(), "a ring across two tokens must not form");
                }
            });
        }
    }

    #[test]
    fn a_unix_peer_without_the_secret_is_refused_by_the_listener() {
        let runtime = runtime();
        runtime.block_on(async {
            let member = RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", local()).unwrap();
            let address = member.address().unwrap();
            let path = address.local.unwrap().path;
            let strangers = async {
                let mut stranger = tokio::net::UnixStream::connect(&path).await.unwrap();
                let refused = prove_as_connector(&mut stranger, b"other-token").await;
                assert!(refused.is_err(), "a wrong secret must not pass the handshake");
                // Garbage gets no answer either, and the listener goes on listening.
                let mut garbage = tokio::net::UnixStream::connect(&path).await.unwrap();
                let mut challenge = [0u8; NONCE_LEN];
                garbage.read_exact(&mut challenge).await.unwrap();
                garbage.write_all(&[7u8; 2 * NONCE_LEN]).await.unwrap();
                let mut reply = Vec::new();
                let n = garbage.read_to_end(&mut reply).await.unwrap_or(0);
                assert_eq!(n, 0, "the listener answered a peer with a wrong tag");
                // A peer with the secret that leaves before confirming is not taken either.
                let mut quitter = tokio::net::UnixStream::connect(&path).await.unwrap();
                quitter.read_exact(&mut challenge).await.unwrap();
                let mut answer = [0u8; 2 * NONCE_LEN];
                answer[NONCE_LEN..]
                    .copy_from_slice(&tag(b"ring-token", b"connect", &challenge).finalize().into_bytes());
                quitter.write_all(&answer).await.unwrap();
                let mut their_tag = [0u8; NONCE_LEN];
                quitter.read_exact(&mut their_tag).await.unwrap();
                drop(quitter);
                // The member still accepts the real previous rank afterwards.
                let mut friend = tokio::net::UnixStream::connect(&path).await.unwrap();
                prove_as_connector(&mut friend, b"ring-token").await.unwrap();
                friend
            };
            let (accepted, friend) = tokio::time::timeout(Duration::from_secs(30), async {
                tokio::join!(member.accept_previous(), strangers)
            })
            .await
            .expect("the handshakes finish");
            let Ok(Incoming::Local(mut accepted)) = accepted else {
                panic!("the real previous rank was not accepted by its Unix socket");
            };
            // The stream taken is the friend's, not the quitter's.
            let mut friend = friend;
            friend.write_all(&[42]).await.unwrap();
            let mut byte = [0u8; 1];
            accepted.read_exact(&mut byte).unwrap();
            assert_eq!(byte, [42]);
        });
    }

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
                let refused = RingLinkBuilder::open_tcp(stranger.tcp.as_ref().unwrap(), stream, port).await;
                assert!(refused.is_err(), "a rank of another token must not get a link");
                let stream = tokio::net::TcpStream::connect(port).await.unwrap();
                let link = RingLinkBuilder::open_tcp(previous.tcp.as_ref().unwrap(), stream, port).await;
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

    #[test]
    fn the_listeners_directory_is_private_and_removed_once_connected() {
        let runtime = runtime();
        let builders: Vec<RingLinkBuilder> = runtime.block_on(async {
            (0..2)
                .map(|_| RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", local()).unwrap())
                .collect()
        });
        let paths: Vec<PathBuf> = builders
            .iter()
            .map(|b| b.address().unwrap().local.unwrap().path)
            .collect();
        for path in &paths {
            let mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        let addresses: Vec<String> = builders.iter().map(|b| b.address().unwrap().to_string()).collect();
        let links = runtime.block_on(async {
            let mut builders = builders.into_iter();
            let (a, b) = (builders.next().unwrap(), builders.next().unwrap());
            tokio::try_join!(a.connect(&addresses[1]), b.connect(&addresses[0])).unwrap()
        });
        for path in &paths {
            assert!(!path.parent().unwrap().exists(), "{} is left behind", path.display());
        }
        drop(links);
    }

    #[test]
    fn ring_addresses_round_trip_and_bad_ones_are_refused() {
        let local = RingAddress {
            quic: "10.0.0.2:4711".parse().unwrap(),
            tcp: Some("10.0.0.2:4712".parse().unwrap()),
            local: Some(LocalAddress {
                host: HostKey::from_bytes(&[9; HostKey::LEN]),
                path: PathBuf::from("/tmp/a dir;with=odd chars/ring.sock"),
            }),
        };
        assert_eq!(local.to_string().parse::<RingAddress>().unwrap(), local);
        let quic = RingAddress {
            quic: "[::1]:9".parse().unwrap(),
            tcp: None,
            local: None,
        };
        assert_eq!(quic.to_string(), "quic=[::1]:9");
        assert_eq!(quic.to_string().parse::<RingAddress>().unwrap(), quic);
        // A bare socket address, as older ranks reported it.
        assert_eq!("[::1]:9".parse::<RingAddress>().unwrap(), quic);
        for bad in [
            "",
            "quic=nowhere",
            "quic=1.2.3.4:5;tcp=nowhere",
            "quic=1.2.3.4:5;host=zz;unix=/x",
            "quic=1.2.3.4:5;host=0909;unix=/x",
            "quic=1.2.3.4:5;host=090909090909090909090909090909090909090909090909",
            "quic=1.2.3.4:5;host=090909090909090909090909090909090909090909090909;unix=",
        ] {
            let err = bad.parse::<RingAddress>().unwrap_err();
            assert!(err.0.contains("bad ring address"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_message_of_the_wrong_length_is_refused() {
        for options in [local(), tcp_only()] {
            a_message_of_the_wrong_length_is_refused_on(options);
        }
    }

    fn a_message_of_the_wrong_length_is_refused_on(options: LinkOptions) {
        let runtime = runtime();
        let mut links = ring(&runtime, &[options; 2]);
        let mut second = links.pop().unwrap();
        let mut first = links.pop().unwrap();
        let sender = std::thread::spawn(move || {
            // The receiver may close its end after the header, before the payload is
            // written: then this send fails too, and the link on this side is broken as well.
            let _ = first.send(&[1.0, 2.0, 3.0]);
            first
        });
        let mut out = [0f32; 2];
        let err = second.recv(&mut out).unwrap_err();
        assert!(err.0.contains("expected 2 values"), "{err}");
        // The stream is out of step now: later calls fail at once, never read garbage.
        let again = second.recv(&mut out).unwrap_err();
        assert!(again.0.contains("broke earlier"), "{again}");
        let mut first = sender.join().unwrap();
        // The neighbour sees the link closed rather than waiting on it.
        assert!(first.exchange(&[1.0; 4], &mut [0.0; 4]).is_err());
    }
}
