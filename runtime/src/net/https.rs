//! HTTPS for the job API (and the dashboard it serves): the server's certificate, the
//! listener that runs TLS handshakes beside axum, and the clients' trust.
//!
//! By default the head presents a certificate its cluster authority issued (the one every
//! node trusts), and `JobClient` and the CLI trust exactly that authority: they fetch it
//! from `GET /api/cluster-ca` with the join token's proof of it ([`fetch_cluster_authority`])
//! and check the proof before they trust it or send the token, so whoever holds the token
//! can check the head, no file to hand around. The certificate names the head
//! (`head.regatta`), not a host, so these clients check the chain and that name. A browser
//! does not know that authority: `regatta ca` prints it for the browser's trust store, or
//! the operator gives the head a certificate of their own (`--tls-cert`/`--tls-key`),
//! which clients then check the usual way, name included (`--ca-cert` when their
//! authority is not a public one). `--insecure` serves plain HTTP.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use regatta_net::{TlsIdentity, HEAD_NAME};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::error::{Error, Result};
use regatta_net::{HandshakeSlots, MAX_HANDSHAKES};

/// How the head serves its job API.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ApiTls {
    /// HTTPS with a certificate from the cluster's own authority (the default).
    #[default]
    Token,
    /// HTTPS with the operator's own certificate chain and key (PEM files).
    Files {
        /// The certificate chain, leaf first.
        cert: PathBuf,
        /// The private key (PKCS#8, PKCS#1 or SEC1).
        key: PathBuf,
    },
    /// Plain HTTP: the token and everything else in cleartext.
    Off,
}

/// How long a connection may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The first byte of a TLS record carrying a handshake.
const TLS_HANDSHAKE: u8 = 0x16;

/// The server configuration `tls` asks for, or `None` for plain HTTP.
pub(crate) fn server_config(tls: &ApiTls, identity: &TlsIdentity) -> Result<Option<Arc<rustls::ServerConfig>>> {
    match tls {
        ApiTls::Off => Ok(None),
        ApiTls::Token => identity
            .https
            .clone()
            .map(Some)
            .ok_or_else(|| Error::Rejected("only the head serves HTTPS with the cluster's authority".into())),
        ApiTls::Files { cert, key } => {
            let bad = |what: &str, path: &PathBuf, e: &dyn std::fmt::Display| {
                Error::Rejected(format!("cannot use {what} {}: {e}", path.display()))
            };
            let chain = CertificateDer::pem_file_iter(cert)
                .map_err(|e| bad("the certificate file", cert, &e))?
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| bad("the certificate file", cert, &e))?;
            if chain.is_empty() {
                return Err(bad("the certificate file", cert, &"it holds no PEM certificate"));
            }
            let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("the key file", key, &e))?;
            let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
            let mut config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| Error::Rejected(format!("TLS versions: {e}")))?
                .with_no_client_auth()
                .with_single_cert(chain, key_der)
                .map_err(|e| bad("the certificate and key", cert, &e))?;
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok(Some(Arc::new(config)))
        }
    }
}

/// Accepted TLS connections, for `axum::serve`: a task accepts TCP connections and runs
/// each handshake in its own task (one silent connection never holds up the others).
pub(crate) struct TlsIncoming {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl TlsIncoming {
    /// Starts accepting on `listener` with `config`; `what` names the service in logs.
    pub(crate) fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>, what: &'static str) -> Result<Self> {
        let local = listener
            .local_addr()
            .map_err(|e| Error::io(format!("{what} address"), e))?;
        let (done, ready) = mpsc::channel(MAX_HANDSHAKES);
        let acceptor = TlsAcceptor::from(config);
        let accepting = tokio::spawn(async move {
            let handshakes = HandshakeSlots::new();
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot accept a connection on the {what}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let permit = match handshakes.take(peer.ip()) {
                    Ok(slot) => slot,
                    Err(refusal) => {
                        tracing::warn!(%peer, "closed a connection to the {what} at once: {refusal}");
                        continue;
                    }
                };
                let (acceptor, done) = (acceptor.clone(), done.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&acceptor, stream, local)).await {
                        Ok(Ok(Some(tls))) => {
                            let _ = done.send((tls, peer)).await;
                        }
                        Ok(Ok(None)) => {
                            tracing::debug!(%peer, "answered plain HTTP on the {what}, which speaks HTTPS");
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "a TLS handshake on the {what} failed"),
                        Err(_) => {
                            tracing::debug!(%peer, "no TLS handshake on the {what} within {} s", HANDSHAKE_TIMEOUT.as_secs())
                        }
                    }
                });
            }
        });
        Ok(Self {
            ready,
            local,
            accepting,
        })
    }
}

/// The TLS handshake, or `None` after telling a plain HTTP client to use HTTPS.
async fn handshake(
    acceptor: &TlsAcceptor,
    mut stream: TcpStream,
    local: SocketAddr,
) -> std::io::Result<Option<TlsStream<TcpStream>>> {
    let _ = stream.set_nodelay(true);
    let mut first = [0u8; 1];
    let n = stream.peek(&mut first).await?;
    if n == 1 && first[0] != TLS_HANDSHAKE && first[0].is_ascii_uppercase() {
        // Read what the client sent (a request head, briefly) so that closing does not
        // reset the connection under the answer.
        let mut request = [0u8; 8192];
        let _ = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut request)).await;
        let body = format!(
            "this port speaks HTTPS: use https://{local}/ (the CLI and JobClient trust the cluster's certificate authority)\n"
        );
        let reply = format!(
            "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = stream.write_all(reply.as_bytes()).await;
        let _ = stream.shutdown().await;
        return Ok(None);
    }
    acceptor.accept(stream).await.map(Some)
}

impl axum::serve::Listener for TlsIncoming {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The accepting task never ends on its own; if it was aborted, serve nothing.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// The largest `/api/cluster-ca` answer read (an authority's certificate is a few hundred
/// bytes, hex-encoded twice that).
const MAX_AUTHORITY_REPLY: usize = 64 * 1024;

/// The cluster authorities the job API at `base` (`https://host:port`) serves (the issuing
/// one first; during a rotation, the retiring one after it), believed only with the join
/// token's proof of each: fetched over a connection that checks nothing and sends nothing
/// secret (the token's id only).
pub async fn fetch_cluster_authority(base: &str, token: &str) -> Result<Vec<CertificateDer<'static>>> {
    let token: regatta_net::JoinToken = token
        .parse()
        .map_err(|e: regatta_net::Error| Error::Token(e.to_string()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Rejected(format!("TLS versions: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(regatta_net::signatures_only_verifier())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(30))
        .use_preconfigured_tls(config)
        .build()
        .map_err(|e| Error::Connect {
            address: base.to_string(),
            reason: e.to_string(),
        })?;
    let url = format!("{base}/api/cluster-ca?token_id={}", token.id);
    let unreachable = |e: reqwest::Error| {
        Error::Connect {
        address: base.to_string(),
        reason: format!(
            "cannot fetch the cluster's authority ({}); is the head running with its job API on this address (https: a head started with --insecure needs http://)?",
            error_chain(&e)
        ),
    }
    };
    let mut reply = http.get(&url).send().await.map_err(unreachable)?;
    let status = reply.status();
    // Read with a cap: the server is not trusted yet, and an authority is a few hundred bytes.
    let mut bytes = Vec::new();
    while let Some(chunk) = reply.chunk().await.map_err(unreachable)? {
        bytes.extend_from_slice(&chunk);
        if bytes.len() > MAX_AUTHORITY_REPLY {
            return Err(Error::Rejected(format!(
                "the job API at {base} answered /api/cluster-ca with more than {MAX_AUTHORITY_REPLY} bytes"
            )));
        }
    }
    let body: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        Error::Rejected(format!(
            "the job API at {base} answered /api/cluster-ca with no JSON: {e}"
        ))
    })?;
    if !status.is_success() {
        return Err(Error::Rejected(format!(
            "the job API at {base} does not vouch for its authority with join token {}: {}",
            token.id,
            body.get("error").and_then(|e| e.as_str()).unwrap_or("no reason given")
        )));
    }
    let missing =
        |name: &str| Error::Rejected(format!("the job API at {base} answered /api/cluster-ca without {name}"));
    let listed = body
        .get("authorities")
        .and_then(|v| v.as_array())
        .filter(|list| !list.is_empty())
        .ok_or_else(|| missing("authorities"))?;
    let mut authorities = Vec::with_capacity(listed.len());
    for entry in listed {
        let field = |name: &str| {
            entry
                .get(name)
                .and_then(|v| v.as_str())
                .and_then(regatta_proto::hex::decode)
                .ok_or_else(|| missing(name))
        };
        let (ca, proof) = (field("ca")?, field("proof")?);
        if !token.key().verify_authority(&ca, &proof) {
            return Err(Error::Rejected(format!(
                "the job API at {base} could not prove join token {}'s secret: it is not this cluster's head",
                token.id
            )));
        }
        authorities.push(CertificateDer::from(ca));
    }
    Ok(authorities)
}

/// The TLS configuration of a job API client: trusts the cluster authorities `cluster` (the
/// head's own certificate, checked under the head's name) or, when given, the PEM
/// certificates of `extra_roots` (checked the usual way, host name included).
pub fn job_api_client_tls(
    cluster: Option<Vec<CertificateDer<'static>>>,
    extra_roots: Option<&[u8]>,
) -> Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = |roots: RootCertStore| {
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| Error::Rejected(format!("TLS verifier: {e}")))
    };
    let cluster = match cluster {
        Some(authorities) => {
            let mut roots = RootCertStore::empty();
            for ca in authorities {
                roots
                    .add(ca)
                    .map_err(|e| Error::Rejected(format!("the cluster's certificate authority: {e}")))?;
            }
            Some(verifier(roots)?)
        }
        None => None,
    };
    let extra = match extra_roots {
        None => None,
        Some(pem) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| Error::Rejected(format!("the CA certificate file: {e}")))?;
                roots
                    .add(cert)
                    .map_err(|e| Error::Rejected(format!("the CA certificate file: {e}")))?;
            }
            if roots.is_empty() {
                return Err(Error::Rejected(
                    "the CA certificate file holds no PEM certificate".into(),
                ));
            }
            Some(verifier(roots)?)
        }
    };
    let trust = Arc::new(ClusterOrRoots {
        cluster,
        extra,
        provider: provider.clone(),
    });
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Rejected(format!("TLS versions: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(trust)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// Trusts a server whose chain the cluster's authority signed (under the head's name),
/// else one the extra roots vouch for under the name asked for.
#[derive(Debug)]
struct ClusterOrRoots {
    cluster: Option<Arc<WebPkiServerVerifier>>,
    extra: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for ClusterOrRoots {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let head = ServerName::try_from(HEAD_NAME).expect("the head's name is a valid DNS name");
        let by_cluster = match &self.cluster {
            Some(cluster) => cluster.verify_server_cert(end_entity, intermediates, &head, ocsp_response, now),
            None => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            )),
        };
        match by_cluster {
            Ok(verified) => Ok(verified),
            Err(e) => match &self.extra {
                Some(extra) => extra.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now),
                None => Err(e),
            },
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// An error and its causes on one line (reqwest's own message omits the TLS reason).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
