//! TLS credentials for the QUIC data plane, derived from the cluster token.
//!
//! Every node derives the same certificate authority key from the token (Ed25519, seeded by
//! SHA-256 of the token), makes a fresh leaf certificate signed by it, and trusts only that
//! authority, both as server and as client (mutual TLS). A peer without the token cannot
//! produce a certificate the others accept, so the endpoint is never open.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
    PKCS_ECDSA_P256_SHA256, PKCS_ED25519,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
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

/// Builds this node's TLS identity from the cluster token.
pub fn identity_from_token(token: &str) -> Result<TlsIdentity> {
    let seed: [u8; 32] = Sha256::new()
        .chain_update(b"regatta quic certificate authority v1\0")
        .chain_update(token.as_bytes())
        .finalize()
        .into();
    let ca_der = PrivatePkcs8KeyDer::from(ed25519_pkcs8(&seed));
    let ca_key = KeyPair::from_pkcs8_der_and_sign_algo(&ca_der, &PKCS_ED25519).map_err(cert("cluster CA key"))?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(cert("cluster CA"))?;
    let mut ca_name = DistinguishedName::new();
    ca_name.push(DnType::CommonName, "regatta cluster CA");
    ca_params.distinguished_name = ca_name;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(cert("cluster CA certificate"))?;

    let leaf_key = KeyPair::generate_for(&PKCS_ED25519).map_err(cert("node key"))?;
    let mut leaf_params = CertificateParams::new(vec![SERVER_NAME.to_string()]).map_err(cert("node certificate"))?;
    let mut leaf_name = DistinguishedName::new();
    leaf_name.push(DnType::CommonName, "regatta node");
    leaf_params.distinguished_name = leaf_name;
    let leaf = leaf_params
        .clone()
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .map_err(cert("node certificate"))?;

    let mut roots = RootCertStore::empty();
    roots.add(ca_cert.der().clone()).map_err(tls("trust the cluster CA"))?;
    let roots = Arc::new(roots);
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

    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| Error::Tls(format!("client verifier: {e}")))?;
    let optional = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| Error::Tls(format!("client verifier: {e}")))?;
    // Browsers do not sign with Ed25519 in TLS (Chromium fails the handshake), so the
    // HTTPS leaf is ECDSA P-256, under the same authority.
    let web_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(cert("HTTPS key"))?;
    let web = leaf_params
        .signed_by(&web_key, &ca_cert, &ca_key)
        .map_err(cert("HTTPS certificate"))?;
    let mut https = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("server protocol versions"))?
        .with_client_cert_verifier(optional)
        .with_single_cert(
            vec![web.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(web_key.serialize_der())),
        )
        .map_err(tls("HTTPS certificate"))?;
    https.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut server = rustls::ServerConfig::builder_with_provider(cluster.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("server protocol versions"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key())
        .map_err(tls("server certificate"))?;
    server.alpn_protocols = vec![ALPN.to_vec()];

    let mut client = rustls::ClientConfig::builder_with_provider(cluster)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("client protocol versions"))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key())
        .map_err(tls("client certificate"))?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    Ok(TlsIdentity {
        server: Arc::new(server),
        client: Arc::new(client),
        https: Arc::new(https),
        ca: ca_cert.der().clone(),
    })
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
