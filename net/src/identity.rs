//! TLS credentials for the QUIC data plane, derived from the cluster token.
//!
//! Every node derives the same certificate authority key from the token (Ed25519, seeded by
//! SHA-256 of the token), makes a fresh leaf certificate signed by it, and trusts only that
//! authority, both as server and as client (mutual TLS). A peer without the token cannot
//! produce a certificate the others accept, so the endpoint is never open.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
    PKCS_ECDSA_P256_SHA256, PKCS_ED25519,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The name every node's certificate carries and every client checks.
pub const SERVER_NAME: &str = "regatta-node";

/// ALPN protocol id of the object transfer protocol.
pub const ALPN: &[u8] = b"regatta-objects/1";

/// rustls configurations for one node.
#[derive(Clone)]
pub struct TlsIdentity {
    /// For accepting connections.
    pub server: Arc<rustls::ServerConfig>,
    /// For opening connections.
    pub client: Arc<rustls::ClientConfig>,
    /// For serving HTTPS (the job API): the same certificate, ALPN `http/1.1`, and a
    /// client certificate optional (browsers have none; one that is presented must come
    /// from the token's authority).
    pub https: Arc<rustls::ServerConfig>,
    /// The token's certificate authority, for clients that trust it.
    pub ca: CertificateDer<'static>,
}

impl TlsIdentity {
    /// The mutual-TLS configurations (server, client) speaking the ALPN protocol `alpn`:
    /// each service has its own, so a connection meant for one is never taken by another.
    pub fn with_alpn(&self, alpn: &[u8]) -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
        let mut server = (*self.server).clone();
        server.alpn_protocols = vec![alpn.to_vec()];
        let mut client = (*self.client).clone();
        client.alpn_protocols = vec![alpn.to_vec()];
        (Arc::new(server), Arc::new(client))
    }
}

/// PKCS#8 v1 wrapping of a raw Ed25519 seed (RFC 8410).
fn ed25519_pkcs8(seed: &[u8; 32]) -> Vec<u8> {
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
    ];
    der.extend_from_slice(seed);
    der
}

fn tls(what: &str) -> impl Fn(rustls::Error) -> Error + '_ {
    move |e| Error::Tls(format!("{what}: {e}"))
}

fn cert(what: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::Tls(format!("{what}: {e}"))
}

/// The cluster's certificate authority: the same key on every node, derived from the token.
struct Authority {
    key: KeyPair,
    cert: Certificate,
}

impl Authority {
    /// The authority of `token`: an Ed25519 key seeded by SHA-256 of the token, and its
    /// self-signed certificate.
    fn from_token(token: &str) -> Result<Self> {
        let seed: [u8; 32] = Sha256::new()
            .chain_update(b"regatta quic certificate authority v1\0")
            .chain_update(token.as_bytes())
            .finalize()
            .into();
        let der = PrivatePkcs8KeyDer::from(ed25519_pkcs8(&seed));
        let key = KeyPair::from_pkcs8_der_and_sign_algo(&der, &PKCS_ED25519).map_err(cert("cluster CA key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert("cluster CA"))?;
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, "regatta cluster CA");
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let cert = params.self_signed(&key).map_err(cert("cluster CA certificate"))?;
        Ok(Self { key, cert })
    }

    /// A certificate of `params` for `key`, signed by the authority; `what` names it in errors.
    fn sign(&self, params: CertificateParams, key: &KeyPair, what: &str) -> Result<Certificate> {
        params.signed_by(key, &self.cert, &self.key).map_err(cert(what))
    }

    /// A root store that trusts this authority alone.
    fn roots(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.cert.der().clone())
            .map_err(tls("trust the cluster CA"))?;
        Ok(Arc::new(roots))
    }
}

/// What a node's certificates say: the name [`SERVER_NAME`], common name `regatta node`.
fn node_params() -> Result<CertificateParams> {
    let mut params = CertificateParams::new(vec![SERVER_NAME.to_string()]).map_err(cert("node certificate"))?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, "regatta node");
    params.distinguished_name = name;
    Ok(params)
}

/// Builds this node's TLS identity from the cluster token.
pub fn identity_from_token(token: &str) -> Result<TlsIdentity> {
    let authority = Authority::from_token(token)?;
    let leaf_key = KeyPair::generate_for(&PKCS_ED25519).map_err(cert("node key"))?;
    let leaf_params = node_params()?;
    let leaf = authority.sign(leaf_params.clone(), &leaf_key, "node certificate")?;
    let roots = authority.roots()?;
    let chain: Vec<CertificateDer<'static>> = vec![leaf.der().clone()];
    let key = || PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    // Between the cluster's own processes AES-128-GCM goes first: a TLS 1.3 suite like the
    // others, and ~15% less CPU per byte than AES-256-GCM (`openssl speed -evp` on the CI
    // kind: 6.5 against 5.7 GB/s), which bounds the object and ring transfers. Browsers
    // keep the default order.
    let cluster = Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: cluster_cipher_suites(),
        ..rustls::crypto::aws_lc_rs::default_provider()
    });
    let (required, optional) = client_verifiers(&roots, &provider)?;
    let https = https_config(&authority, leaf_params, provider, optional)?;
    let server = cluster_server(cluster.clone(), required, chain.clone(), key())?;
    let client = cluster_client(cluster, roots, chain, key())?;
    Ok(TlsIdentity {
        server: Arc::new(server),
        client: Arc::new(client),
        https: Arc::new(https),
        ca: authority.cert.der().clone(),
    })
}

/// Client verifiers trusting `roots`: one that requires a certificate (the cluster's own
/// connections), one that lets a client without one in (browsers on the job API).
fn client_verifiers(
    roots: &Arc<RootCertStore>,
    provider: &Arc<CryptoProvider>,
) -> Result<(Arc<dyn ClientCertVerifier>, Arc<dyn ClientCertVerifier>)> {
    let required = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| Error::Tls(format!("client verifier: {e}")))?;
    let optional = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| Error::Tls(format!("client verifier: {e}")))?;
    Ok((required, optional))
}

/// The HTTPS server configuration: a certificate of `params` for a fresh key, ALPN
/// `http/1.1`, a client certificate optional.
fn https_config(
    authority: &Authority,
    params: CertificateParams,
    provider: Arc<CryptoProvider>,
    verifier: Arc<dyn ClientCertVerifier>,
) -> Result<rustls::ServerConfig> {
    // Browsers do not sign with Ed25519 in TLS (Chromium fails the handshake), so the
    // HTTPS leaf is ECDSA P-256, under the same authority.
    let web_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(cert("HTTPS key"))?;
    let web = authority.sign(params, &web_key, "HTTPS certificate")?;
    let mut https = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("server protocol versions"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![web.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(web_key.serialize_der())),
        )
        .map_err(tls("HTTPS certificate"))?;
    https.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(https)
}

/// The server side of the cluster's own connections: mutual TLS 1.3, ALPN [`ALPN`].
fn cluster_server(
    provider: Arc<CryptoProvider>,
    verifier: Arc<dyn ClientCertVerifier>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<rustls::ServerConfig> {
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("server protocol versions"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(tls("server certificate"))?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    Ok(server)
}

/// The client side of the cluster's own connections: trusts `roots` alone and presents
/// `chain`, ALPN [`ALPN`].
fn cluster_client(
    provider: Arc<CryptoProvider>,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<rustls::ClientConfig> {
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("client protocol versions"))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(tls("client certificate"))?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    Ok(client)
}

/// The TLS 1.3 suites of the cluster's own connections, fastest first.
fn cluster_cipher_suites() -> Vec<rustls::SupportedCipherSuite> {
    use rustls::crypto::aws_lc_rs::cipher_suite;
    vec![
        cipher_suite::TLS13_AES_128_GCM_SHA256,
        cipher_suite::TLS13_AES_256_GCM_SHA384,
        cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::{ClientConnection, Connection, ServerConnection};

    /// Moves what `from` has to send into `to`.
    fn pump(from: &mut Connection, to: &mut Connection) {
        let mut wire = Vec::new();
        while from.wants_write() {
            from.write_tls(&mut wire).expect("write");
        }
        let mut rest = &wire[..];
        while !rest.is_empty() {
            to.read_tls(&mut rest).expect("read");
            to.process_new_packets().expect("process");
        }
    }

    #[test]
    fn the_clusters_own_connections_negotiate_aes_128_gcm() {
        let identity = identity_from_token("cipher-suite-test").expect("identity");
        let name = rustls::pki_types::ServerName::try_from(crate::SERVER_NAME).expect("name");
        let mut client = Connection::Client(ClientConnection::new(identity.client.clone(), name).expect("client"));
        let mut server = Connection::Server(ServerConnection::new(identity.server.clone()).expect("server"));
        for _ in 0..8 {
            pump(&mut client, &mut server);
            pump(&mut server, &mut client);
        }
        assert!(!client.is_handshaking() && !server.is_handshaking(), "handshake done");
        let suite = client.negotiated_cipher_suite().expect("a suite").suite();
        assert_eq!(suite, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    }
}
