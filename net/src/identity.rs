//! TLS credentials: the rustls configurations of one process.
//!
//! A cluster's processes hold certificates its own authority issued at join ([`crate::ca`],
//! [`crate::join`]): [`TlsIdentity::issued`] builds their configurations (mutual TLS, the
//! authority alone trusted, both as server and as client). [`identity_from_secret`] builds
//! a self-contained identity from a random shared secret instead: the trainer's ring, whose
//! ranks share a per-group secret the head hands out, and loopback probes.

use std::sync::{Arc, RwLock};
use std::time::SystemTime;

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

use crate::authorities::Authorities;
use crate::ca::{CaHash, ClusterCa, Role, SERVER_NAME};
use crate::error::{Error, Result};

/// ALPN protocol id of the object transfer protocol.
pub const ALPN: &[u8] = b"regatta-objects/1";

/// rustls configurations for one process.
#[derive(Clone)]
pub struct TlsIdentity {
    /// For accepting connections.
    pub server: Arc<rustls::ServerConfig>,
    /// For opening connections.
    pub client: Arc<rustls::ClientConfig>,
    /// For serving HTTPS (the job API): a certificate browsers can use (ECDSA P-256), ALPN
    /// `http/1.1`, and a client certificate optional (browsers have none; one that is
    /// presented must come from the cluster's authority). Only the head has one.
    pub https: Option<Arc<rustls::ServerConfig>>,
    /// The authorities this process trusts now, which every configuration above checks
    /// peers against: a renewal after a rotation swaps them in place.
    pub trust: Arc<TrustSlot>,
    /// The cluster's identity (its first authority's hash: it stays across rotations).
    pub cluster: CaHash,
    /// The process's current certificate and key, which every configuration above
    /// presents: renewal swaps it in place ([`crate::renew`]).
    pub slot: Arc<CertSlot>,
    /// The head's HTTPS certificate, swapped in place by a rotation. Only the head has one.
    pub https_slot: Option<Arc<CertSlot>>,
    /// For answering joins on the cluster port ([`crate::join`]): the head's certificate
    /// with the authority's beside it (so a pinned joiner can check the chain), no client
    /// certificate asked. Only the head has one.
    pub join: Option<Arc<rustls::ServerConfig>>,
    /// Whether the authority names each node in its certificate (a cluster authority's
    /// do; a secret's, [`identity_from_secret`], name every holder alike).
    pub names_nodes: bool,
    /// The nodes removed from the cluster: a connection presenting one's certificate is
    /// refused at the handshake. The head fills it as nodes are removed; every other
    /// process from the head's heartbeat answers.
    pub removed: RemovedNodes,
}

/// A process's current certificate and key, shared by every TLS configuration it made, so
/// that a renewed certificate is presented from the next handshake on, everywhere.
pub struct CertSlot {
    current: RwLock<(Arc<rustls::sign::CertifiedKey>, SystemTime)>,
}

impl std::fmt::Debug for CertSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CertSlot(expires {:?})", self.expires())
    }
}

impl CertSlot {
    fn new(chain: Vec<CertificateDer<'static>>, key: &KeyPair, expires: SystemTime) -> Result<Self> {
        Ok(Self {
            current: RwLock::new((Arc::new(certified(chain, key)?), expires)),
        })
    }

    pub(crate) fn get(&self) -> Arc<rustls::sign::CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .clone()
    }

    /// When the current certificate stops being valid.
    pub fn expires(&self) -> SystemTime {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).1
    }

    /// Presents `chain` (a leaf for `key`, valid until `expires`, then what vouches for it)
    /// from the next handshake on.
    pub fn replace(&self, chain: Vec<CertificateDer<'static>>, key: &KeyPair, expires: SystemTime) -> Result<()> {
        let next = (Arc::new(certified(chain, key)?), expires);
        *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        Ok(())
    }
}

impl rustls::server::ResolvesServerCert for CertSlot {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.get())
    }
}

impl rustls::client::ResolvesClientCert for CertSlot {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.get())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The name a connection to the node named `node` must find in the peer's certificate,
/// under an authority that names its nodes (`names_nodes`) or one that does not
/// ([`TlsIdentity::peer_name`]).
pub fn peer_name(names_nodes: bool, node: &str) -> String {
    if names_nodes {
        Role::Node(node.to_string()).dns_name()
    } else {
        SERVER_NAME.to_string()
    }
}

/// `chain` (a leaf and what vouches for it) and `key` as rustls presents them.
fn certified(chain: Vec<CertificateDer<'static>>, key: &KeyPair) -> Result<rustls::sign::CertifiedKey> {
    let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let signer = rustls::crypto::aws_lc_rs::default_provider()
        .key_provider
        .load_private_key(der)
        .map_err(tls("node key"))?;
    Ok(rustls::sign::CertifiedKey::new(chain, signer))
}

/// The authorities a process trusts, and the verifiers made from them, shared by every TLS
/// configuration it made, so that a rotation's new set is checked from the next handshake
/// on, everywhere.
pub struct TrustSlot {
    current: RwLock<Arc<Trust>>,
}

/// One set of trusted authorities and its verifiers.
struct Trust {
    authorities: Vec<CertificateDer<'static>>,
    /// Their hashes and [`crate::trust_fingerprint`] of them, worked out once (a worker's
    /// heartbeat carries the fingerprint twice a second).
    hashes: Vec<CaHash>,
    fingerprint: u64,
    server: Arc<rustls::client::WebPkiServerVerifier>,
    required: Arc<dyn ClientCertVerifier>,
    optional: Arc<dyn ClientCertVerifier>,
}

impl std::fmt::Debug for TrustSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TrustSlot({:?})", self.hashes())
    }
}

impl TrustSlot {
    fn new(authorities: Vec<CertificateDer<'static>>) -> Result<Self> {
        Ok(Self {
            current: RwLock::new(Arc::new(Trust::of(authorities)?)),
        })
    }

    fn get(&self) -> Arc<Trust> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The authorities trusted now (the issuing one first).
    pub fn authorities(&self) -> Vec<CertificateDer<'static>> {
        self.get().authorities.clone()
    }

    /// Their hashes.
    pub fn hashes(&self) -> Vec<CaHash> {
        self.get().hashes.clone()
    }

    /// [`crate::trust_fingerprint`] of the authorities trusted now.
    pub fn fingerprint(&self) -> u64 {
        self.get().fingerprint
    }

    /// Trusts `authorities` (and only them) from the next handshake on.
    pub fn set(&self, authorities: Vec<CertificateDer<'static>>) -> Result<()> {
        let next = Arc::new(Trust::of(authorities)?);
        *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        Ok(())
    }
}

impl Trust {
    fn of(authorities: Vec<CertificateDer<'static>>) -> Result<Self> {
        if authorities.is_empty() {
            return Err(Error::Tls("no certificate authority to trust".into()));
        }
        let mut roots = RootCertStore::empty();
        let mut hashes = Vec::with_capacity(authorities.len());
        for authority in &authorities {
            roots.add(authority.clone()).map_err(tls("trust the cluster CA"))?;
            hashes.push(CaHash::of_certificate(authority)?);
        }
        let fingerprint = crate::authorities::trust_fingerprint(&hashes);
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let (required, optional) = client_verifiers(&roots, &provider)?;
        let server = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider)
            .build()
            .map_err(|e| Error::Tls(format!("server verifier: {e}")))?;
        Ok(Self {
            authorities,
            hashes,
            fingerprint,
            server,
            required,
            optional,
        })
    }
}

/// Checks servers against the trust slot's current authorities.
#[derive(Debug)]
struct TrustedServers(Arc<TrustSlot>);

impl rustls::client::danger::ServerCertVerifier for TrustedServers {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.0
            .get()
            .server
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.get().server.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.get().server.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.get().server.supported_verify_schemes()
    }
}

/// The head's answer to joins: its current certificate chain, then every authority it
/// trusts, so that a joiner that pinned any of them can check the chain.
#[derive(Debug)]
struct JoinChain {
    slot: Arc<CertSlot>,
    trust: Arc<TrustSlot>,
}

impl rustls::server::ResolvesServerCert for JoinChain {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let current = self.slot.get();
        let mut cert = current.cert.clone();
        cert.extend(self.trust.authorities());
        Some(Arc::new(rustls::sign::CertifiedKey::new(cert, current.key.clone())))
    }
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsIdentity(cluster {})", self.cluster)
    }
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

    /// The configurations of a process holding `leaf` (issued by the authority `ca` for
    /// `key`); `https` adds the head's HTTPS certificate.
    pub fn issued(
        ca: CertificateDer<'static>,
        leaf: CertificateDer<'static>,
        key: &KeyPair,
        https: Option<(CertificateDer<'static>, &KeyPair)>,
    ) -> Result<Self> {
        let cluster = CaHash::of_certificate(&ca)?;
        Self::build(Held {
            authorities: vec![ca],
            chain: vec![leaf],
            cluster,
            key,
            https: https.map(|(cert, key)| (vec![cert], key)),
            removed: None,
            expires: SystemTime::now() + crate::ca::CERT_LIFETIME,
        })
    }

    /// The configurations of a process that joined cluster `cluster`: it trusts
    /// `authorities` and presents `chain` (its certificate for `key`, valid until `expires`,
    /// then what vouches for it).
    pub fn joined(
        authorities: Vec<CertificateDer<'static>>,
        chain: Vec<CertificateDer<'static>>,
        cluster: CaHash,
        key: &KeyPair,
        expires: SystemTime,
    ) -> Result<Self> {
        Self::build(Held {
            authorities,
            chain,
            cluster,
            key,
            https: None,
            removed: None,
            expires,
        })
    }

    fn build(held: Held<'_>) -> Result<Self> {
        let Held {
            authorities,
            chain,
            cluster,
            key,
            https,
            removed,
            expires,
        } = held;
        let slot = Arc::new(CertSlot::new(chain, key, expires)?);
        let trust = Arc::new(TrustSlot::new(authorities)?);
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let cluster_provider = cluster_provider();
        let head = removed.is_some();
        let removed = removed.unwrap_or_default();
        let verifier = |optional: bool| {
            Arc::new(NotRemoved {
                trust: trust.clone(),
                optional,
                removed: removed.clone(),
                hints: trust.get().required.root_hint_subjects().to_vec(),
            }) as Arc<dyn ClientCertVerifier>
        };
        let (required, optional) = (verifier(false), verifier(true));
        // The head answers joins (no certificate yet) and renewals (the current one) on
        // its cluster port: its chain with the authorities beside it (so that a pinned
        // joiner can check the chain).
        let join = if head {
            let mut join = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map_err(tls("join protocol versions"))?
                .with_client_cert_verifier(optional.clone())
                .with_cert_resolver(Arc::new(JoinChain {
                    slot: slot.clone(),
                    trust: trust.clone(),
                }));
            join.alpn_protocols = vec![crate::join::JOIN_ALPN.to_vec()];
            no_resumption(&mut join);
            Some(Arc::new(join))
        } else {
            None
        };
        let (https, https_slot) = match https {
            Some((chain, web_key)) => {
                let web = Arc::new(CertSlot::new(
                    chain,
                    web_key,
                    SystemTime::now() + crate::ca::HEAD_CERT_LIFETIME,
                )?);
                (
                    Some(Arc::new(https_config(web.clone(), provider, optional)?)),
                    Some(web),
                )
            }
            None => (None, None),
        };
        let server = cluster_server(cluster_provider.clone(), required, slot.clone())?;
        let client = cluster_client(cluster_provider, trust.clone(), slot.clone())?;
        Ok(Self {
            server: Arc::new(server),
            client: Arc::new(client),
            https,
            trust,
            cluster,
            slot,
            https_slot,
            join,
            names_nodes: true,
            removed,
        })
    }

    /// The name a connection to the node named `node` must find in the peer's
    /// certificate: under the cluster's authority, the node's own (`<node>.node.regatta`),
    /// so that a call meant for w3 is answered by w3 and no other holder of a certificate;
    /// under a secret's authority, [`SERVER_NAME`], which every holder carries.
    pub fn peer_name(&self, node: &str) -> String {
        peer_name(self.names_nodes, node)
    }

    /// The identity of a process whose certificate for `role` `ca` issues here, without a
    /// join (tests, and processes that hold the authority).
    pub fn issued_by(ca: &ClusterCa, role: &Role) -> Result<Self> {
        let key = crate::ca::node_key()?;
        let leaf = ca.issue_for_key(role, &key)?;
        Self::issued(ca.certificate_der().clone(), leaf, &key, None)
    }

    /// The head's identity: its own certificate and its HTTPS one (also naming
    /// `web_names`, the hosts browsers reach it by), issued here by the issuing authority
    /// of `authorities`; a connection presenting the certificate of a node named in
    /// `removed` is refused.
    pub fn for_head(authorities: &Authorities, removed: RemovedNodes, web_names: &[String]) -> Result<Self> {
        let (key, chain) = head_chain(authorities)?;
        let (web_key, web_chain) = https_chain(authorities, web_names)?;
        Self::build(Held {
            authorities: authorities.trusted(),
            chain,
            cluster: authorities.cluster(),
            key: &key,
            https: Some((web_chain, &web_key)),
            removed: Some(removed),
            expires: SystemTime::now() + crate::ca::HEAD_CERT_LIFETIME,
        })
    }

    /// Moves the head's identity to `authorities` (after a rotation or its finish): it trusts
    /// them from the next handshake on and presents certificates of the issuing one.
    pub fn rotate_head(&self, authorities: &Authorities, web_names: &[String]) -> Result<()> {
        let (key, chain) = head_chain(authorities)?;
        let (web_key, web_chain) = https_chain(authorities, web_names)?;
        // Trusted first: a process holding a certificate of the new authority may connect
        // as soon as the head presents one.
        self.trust.set(authorities.trusted())?;
        self.slot
            .replace(chain, &key, SystemTime::now() + crate::ca::HEAD_CERT_LIFETIME)?;
        if let Some(web) = &self.https_slot {
            web.replace(web_chain, &web_key, SystemTime::now() + crate::ca::HEAD_CERT_LIFETIME)?;
        }
        Ok(())
    }
}

/// What a [`TlsIdentity`] is built from.
struct Held<'a> {
    authorities: Vec<CertificateDer<'static>>,
    chain: Vec<CertificateDer<'static>>,
    cluster: CaHash,
    key: &'a KeyPair,
    https: Option<(Vec<CertificateDer<'static>>, &'a KeyPair)>,
    removed: Option<RemovedNodes>,
    expires: SystemTime,
}

/// A fresh key for the head and its certificate chain under the issuing authority.
fn head_chain(authorities: &Authorities) -> Result<(KeyPair, Vec<CertificateDer<'static>>)> {
    let key = crate::ca::node_key()?;
    let mut chain = vec![authorities.issuing().issue_for_key(&Role::Head, &key)?];
    chain.extend(authorities.chain());
    Ok((key, chain))
}

/// A fresh key for the head's HTTPS port and its certificate chain (naming `web_names`).
fn https_chain(authorities: &Authorities, web_names: &[String]) -> Result<(KeyPair, Vec<CertificateDer<'static>>)> {
    // Browsers do not sign with Ed25519 in TLS (Chromium fails the handshake), so the
    // HTTPS leaf is ECDSA P-256, under the same authority.
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(cert("HTTPS key"))?;
    let mut chain = vec![authorities.issuing().issue_https(&key, web_names)?];
    chain.extend(authorities.chain());
    Ok((key, chain))
}

/// The node names removed from the cluster, shared between a process's verifiers (and on
/// the head, its join desk and its job API).
pub type RemovedNodes = Arc<std::sync::RwLock<std::collections::BTreeSet<String>>>;

/// A client verifier of the trust slot's current authorities (a certificate required, or
/// optional for browsers) that also refuses the certificate of a removed node.
#[derive(Debug)]
struct NotRemoved {
    trust: Arc<TrustSlot>,
    optional: bool,
    removed: RemovedNodes,
    /// The authorities' names a server hints with when it asks for a certificate, as they
    /// were when this verifier was made: only a hint (the cluster's processes present theirs
    /// whatever it says; browsers hold none of the cluster's), so a rotation leaves it be.
    hints: Vec<rustls::DistinguishedName>,
}

impl NotRemoved {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let trust = self.trust.get();
        if self.optional {
            trust.optional.clone()
        } else {
            trust.required.clone()
        }
    }
}

impl ClientCertVerifier for NotRemoved {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        !self.optional
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self.inner().verify_client_cert(end_entity, intermediates, now)?;
        if let Some(name) = crate::ca::node_name_of(end_entity.as_ref()) {
            let removed = self.removed.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if removed.contains(&name) {
                return Err(rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked));
            }
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner().supported_verify_schemes()
    }
}

/// The TLS 1.3 provider of the cluster's own connections.
fn cluster_provider() -> Arc<CryptoProvider> {
    // Between the cluster's own processes AES-128-GCM goes first: a TLS 1.3 suite like the
    // others, and ~15% less CPU per byte than AES-256-GCM (`openssl speed -evp` on the CI
    // kind: 6.5 against 5.7 GB/s), which bounds the object and ring transfers. Browsers
    // keep the default order.
    Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: cluster_cipher_suites(),
        ..rustls::crypto::aws_lc_rs::default_provider()
    })
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

/// The authority of a shared random secret: an Ed25519 key seeded by SHA-256 of it, and
/// its self-signed certificate. Only for secrets made at random (the ring's per-group
/// secret): a guessable secret gives the key away.
fn secret_authority(secret: &str) -> Result<(KeyPair, Certificate)> {
    let seed: [u8; 32] = Sha256::new()
        .chain_update(b"regatta quic certificate authority v1\0")
        .chain_update(secret.as_bytes())
        .finalize()
        .into();
    let der = PrivatePkcs8KeyDer::from(ed25519_pkcs8(&seed));
    let key = KeyPair::from_pkcs8_der_and_sign_algo(&der, &PKCS_ED25519).map_err(cert("CA key"))?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert("CA"))?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, "regatta ring CA");
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let cert = params.self_signed(&key).map_err(cert("CA certificate"))?;
    Ok((key, cert))
}

/// A self-contained identity from a random shared secret (see the module's notes): every
/// holder makes a fresh leaf named [`SERVER_NAME`] under the authority the secret seeds.
pub fn identity_from_secret(secret: &str) -> Result<TlsIdentity> {
    let (ca_key, ca_cert) = secret_authority(secret)?;
    let leaf_key = crate::ca::node_key()?;
    let mut params = CertificateParams::new(vec![SERVER_NAME.to_string()]).map_err(cert("node certificate"))?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, "regatta node");
    params.distinguished_name = name;
    let leaf = params
        .clone()
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .map_err(cert("node certificate"))?;
    let web_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(cert("HTTPS key"))?;
    let web = params
        .signed_by(&web_key, &ca_cert, &ca_key)
        .map_err(cert("HTTPS certificate"))?;
    let mut identity = TlsIdentity::issued(
        ca_cert.der().clone(),
        leaf.der().clone(),
        &leaf_key,
        Some((web.der().clone(), &web_key)),
    )?;
    identity.names_nodes = false;
    Ok(identity)
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

/// The HTTPS server configuration: the slot's certificate, ALPN `http/1.1`, a client
/// certificate optional.
fn https_config(
    slot: Arc<CertSlot>,
    provider: Arc<CryptoProvider>,
    verifier: Arc<dyn ClientCertVerifier>,
) -> Result<rustls::ServerConfig> {
    let mut https = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("server protocol versions"))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(slot);
    https.alpn_protocols = vec![b"http/1.1".to_vec()];
    no_resumption(&mut https);
    Ok(https)
}

/// The server side of the cluster's own connections: mutual TLS 1.3, ALPN [`ALPN`].
fn cluster_server(
    provider: Arc<CryptoProvider>,
    verifier: Arc<dyn ClientCertVerifier>,
    slot: Arc<CertSlot>,
) -> Result<rustls::ServerConfig> {
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("server protocol versions"))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(slot);
    server.alpn_protocols = vec![ALPN.to_vec()];
    no_resumption(&mut server);
    Ok(server)
}

/// Turns off TLS session resumption on `server`: a resumed session skips the client
/// certificate's check, so a removed node (or one whose certificate has expired) could come
/// back on a ticket or a cached session from before. Every connection runs the full
/// handshake instead (the cluster's connections are long-lived; a handshake is a fraction
/// of a millisecond).
fn no_resumption(server: &mut rustls::ServerConfig) {
    server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    server.send_tls13_tickets = 0;
}

/// The client side of the cluster's own connections: trusts the trust slot's authorities
/// alone and presents the slot's certificate, ALPN [`ALPN`].
fn cluster_client(
    provider: Arc<CryptoProvider>,
    trust: Arc<TrustSlot>,
    slot: Arc<CertSlot>,
) -> Result<rustls::ClientConfig> {
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls("client protocol versions"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(TrustedServers(trust)))
        .with_client_cert_resolver(slot);
    client.alpn_protocols = vec![ALPN.to_vec()];
    client.resumption = rustls::client::Resumption::disabled();
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
        let identity = identity_from_secret("cipher-suite-test").expect("identity");
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
