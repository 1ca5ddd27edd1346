//! The cluster's own certificate authority, and the certificates it issues.
//!
//! A head makes a random Ed25519 key the first time it starts (kept in its CA folder, files
//! created 0600, never derived from any token) and issues every process that joins a
//! certificate naming it: the head `head.regatta`, a worker `<name>.node.regatta`, a client
//! `<name>.client.regatta`. Every certificate also names [`SERVER_NAME`], the name a
//! connection between peers checks when it does not know whom it reaches; connections to
//! the head check [`HEAD_NAME`], which only the head's certificate carries, so a worker
//! holding a valid certificate cannot pose as the head.
//!
//! The cluster is known by its [`CaHash`] (SHA-256 of the authority's public key info, as
//! `kubeadm join --discovery-token-ca-cert-hash` pins it): joiners may pin it, and the head
//! keys its state and process groups by it.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
    PublicKeyData, SignatureAlgorithm, PKCS_ED25519,
};
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The name every Regatta certificate carries and peer connections check.
pub const SERVER_NAME: &str = "regatta-node";

/// The name only the head's certificate carries: what joiners, workers and clients check
/// when they reach the head.
pub const HEAD_NAME: &str = "head.regatta";

/// How long a certificate issued at a join or a renewal is valid by default (each process
/// renews its own when two thirds of that have passed; `regatta head --cert-lifetime-secs`).
pub const CERT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// How long the head's own certificates are valid (it holds the authority itself).
pub const HEAD_CERT_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The first authority's file names in its folder (later ones, made by a rotation, are
/// `ca-<8 hex digits>.key` and `.crt`: [`crate::authorities`]).
const KEY_FILE: &str = "ca.key";
const CERT_FILE: &str = "ca.crt";

/// The first authority's file stem and common name.
pub(crate) const FIRST_STEM: &str = "ca";
const FIRST_NAME: &str = "regatta cluster CA";

/// What an issued certificate stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// The head.
    Head,
    /// A worker node, by name.
    Node(String),
    /// A client (a driver, the CLI, a Python program), by name.
    Client(String),
}

impl Role {
    /// The DNS name only this role's certificate carries.
    pub fn dns_name(&self) -> String {
        match self {
            Self::Head => HEAD_NAME.to_string(),
            Self::Node(name) => format!("{}.node.regatta", dns_label(name)),
            Self::Client(name) => format!("{}.client.regatta", dns_label(name)),
        }
    }

    /// The role's one-word kind and name, as the join request carries them.
    pub fn parts(&self) -> (&'static str, &str) {
        match self {
            Self::Head => ("head", ""),
            Self::Node(name) => ("node", name),
            Self::Client(name) => ("client", name),
        }
    }

    /// The role of a join request's kind and name; a joiner may not ask to be the head.
    pub fn joining(kind: &str, name: &str) -> Result<Self> {
        if name.is_empty() || name.len() > 200 || name.chars().any(char::is_control) {
            return Err(Error::Join(format!(
                "a joiner's name must be 1-200 printable characters, not {name:?}"
            )));
        }
        match kind {
            "node" => Ok(Self::Node(name.to_string())),
            "client" => Ok(Self::Client(name.to_string())),
            other => Err(Error::Join(format!("a joiner is a node or a client, not {other:?}"))),
        }
    }
}

/// `name` as one DNS label, one to one: a name that already is a label (`[a-z0-9-]`, at
/// most 63 characters, no `-` at either end) as it is; any other as its nearest label (lower
/// case, other characters as `-`) and eight hex digits of its hash, so that two names that
/// differ only in what a label cannot hold (`gpu_1`, `GPU-1`, `gpu-1`) get distinct names.
fn dns_label(name: &str) -> String {
    let is_label = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if is_label {
        return name.to_string();
    }
    let near: String = name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' })
        .take(54)
        .collect();
    let near = near.trim_matches('-');
    let hash: [u8; 32] = Sha256::digest(name.as_bytes()).into();
    let suffix = hex(&hash[..4]);
    if near.is_empty() {
        format!("x-{suffix}")
    } else {
        format!("{near}-{suffix}")
    }
}

/// The SHA-256 of a CA certificate's public key info: the cluster's identity.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CaHash(pub [u8; 32]);

impl CaHash {
    /// The hash of the CA certificate `der`.
    pub fn of_certificate(der: &CertificateDer<'_>) -> Result<Self> {
        let spki = spki_of(der)?;
        Ok(Self(Sha256::digest(spki).into()))
    }

    /// Hex without the prefix (for names and state keys).
    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Display for CaHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for CaHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl FromStr for CaHash {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let hex = text.trim().strip_prefix("sha256:").unwrap_or(text.trim());
        let bad = || Error::Join(format!("a CA hash is sha256: and 64 hex digits, not {text:?}"));
        // Checked as ASCII hex first: slicing by byte below must not cut a character.
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

/// The SubjectPublicKeyInfo of a DER certificate (found by walking its DER: certificate
/// SEQUENCE, tbsCertificate SEQUENCE, then version, serial, signature, issuer, validity,
/// subject, and the key info).
pub(crate) fn spki_of<'a>(der: &'a CertificateDer<'_>) -> Result<&'a [u8]> {
    let bad = || Error::Tls("a certificate that is not valid DER".into());
    let (_, cert, _) = der_element(der.as_ref()).ok_or_else(bad)?;
    let (_, tbs, _) = der_element(cert).ok_or_else(bad)?;
    let mut rest = tbs;
    // Version is an explicit [0] tag, present in v3 certificates.
    if rest.first() == Some(&0xa0) {
        rest = der_element(rest).ok_or_else(bad)?.2;
    }
    for _ in 0..5 {
        rest = der_element(rest).ok_or_else(bad)?.2;
    }
    let (whole, _, _) = der_element(rest).ok_or_else(bad)?;
    Ok(whole)
}

/// The name a certificate this crate issued stands for: `Some(name)` for a node's
/// (`regatta node <name>` in its subject's common name), `None` for any other.
pub(crate) fn node_name_of(der: &[u8]) -> Option<String> {
    match role_of(der)? {
        Role::Node(name) => Some(name),
        _ => None,
    }
}

/// The role a certificate this crate issued stands for, from its subject's common name.
pub(crate) fn role_of(der: &[u8]) -> Option<Role> {
    let (_, cert, _) = der_element(der)?;
    let (_, tbs, _) = der_element(cert)?;
    let mut rest = tbs;
    if rest.first() == Some(&0xa0) {
        rest = der_element(rest)?.2;
    }
    // serial, signature algorithm, issuer, validity; then the subject.
    for _ in 0..4 {
        rest = der_element(rest)?.2;
    }
    let (_, subject, _) = der_element(rest)?;
    // Common name: OID 2.5.4.3.
    const CN: &[u8] = &[0x06, 0x03, 0x55, 0x04, 0x03];
    let mut sets = subject;
    while !sets.is_empty() {
        let (_, set, next) = der_element(sets)?;
        sets = next;
        let (_, pair, _) = der_element(set)?;
        if let Some(value) = pair.strip_prefix(CN) {
            let (_, text, _) = der_element(value)?;
            let text = std::str::from_utf8(text).ok()?;
            if text == "regatta head" {
                return Some(Role::Head);
            }
            if let Some(name) = text.strip_prefix("regatta node ") {
                return Some(Role::Node(name.to_string()));
            }
            return text
                .strip_prefix("regatta client ")
                .map(|name| Role::Client(name.to_string()));
        }
    }
    None
}

/// One DER element at the start of `bytes`: (the whole element, its contents, the rest).
fn der_element(bytes: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let first = *bytes.get(1)?;
    let (len, header) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 {
            return None;
        }
        let mut len = 0usize;
        for i in 0..count {
            len = (len << 8) | usize::from(*bytes.get(2 + i)?);
        }
        (len, 2 + count)
    };
    let end = header.checked_add(len)?;
    if end > bytes.len() {
        return None;
    }
    Some((&bytes[..end], &bytes[header..end], &bytes[end..]))
}

fn cert(what: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::Tls(format!("{what}: {e}"))
}

/// A raw Ed25519 public key, for issuing a certificate to a key held elsewhere.
struct RawEd25519<'a>(&'a [u8]);

impl PublicKeyData for RawEd25519<'_> {
    fn der_bytes(&self) -> &[u8] {
        self.0
    }

    fn algorithm(&self) -> &SignatureAlgorithm {
        &PKCS_ED25519
    }
}

/// The cluster's certificate authority: its key and certificate.
pub struct ClusterCa {
    key: KeyPair,
    cert: Certificate,
    /// The certificate as first made (and saved): the one every node trusts.
    der: CertificateDer<'static>,
    /// Its file stem in the CA folder (`ca` for the first; `ca-<8 hex>` for later ones).
    stem: String,
}

impl ClusterCa {
    /// A new authority with a random key (a cluster's first).
    pub fn generate() -> Result<Self> {
        let key = KeyPair::generate_for(&PKCS_ED25519).map_err(cert("cluster CA key"))?;
        let cert = Self::certificate(&key, FIRST_STEM)?;
        let der = cert.der().clone();
        Ok(Self {
            key,
            cert,
            der,
            stem: FIRST_STEM.to_string(),
        })
    }

    /// A new authority to rotate to: a random key, named (and filed) by its hash's first
    /// eight hex digits, so that its certificates' issuer differs from every earlier
    /// authority's.
    pub(crate) fn generate_next() -> Result<Self> {
        let key = KeyPair::generate_for(&PKCS_ED25519).map_err(cert("cluster CA key"))?;
        let hash: [u8; 32] = Sha256::digest(key.public_key_der()).into();
        let stem = format!("ca-{}", hex(&hash[..4]));
        let cert = Self::certificate(&key, &stem)?;
        let der = cert.der().clone();
        Ok(Self { key, cert, der, stem })
    }

    /// The file stem this authority is kept under.
    pub(crate) fn stem(&self) -> &str {
        &self.stem
    }

    /// This authority's certificate signed by `older` (a cross-certificate): a process that
    /// trusts only `older` accepts a certificate this one issued when it comes with it.
    pub(crate) fn cross_signed_by(&self, older: &ClusterCa) -> Result<CertificateDer<'static>> {
        let params = Self::params(&self.stem)?;
        Ok(params
            .signed_by(&self.key, &older.cert, &older.key)
            .map_err(cert("cross-certificate"))?
            .der()
            .clone())
    }

    /// Saves this authority in `dir` under its stem (files made 0600, never overwritten).
    pub(crate) fn save(&self, dir: &Path) -> Result<()> {
        write_private(&dir.join(format!("{}.key", self.stem)), &self.key.serialize_der())?;
        write_private(&dir.join(format!("{}.crt", self.stem)), self.der.as_ref())
    }

    /// The authority saved in `dir`, or a new one saved there (the folder made 0700 and
    /// the files 0600 from their first byte; refused if either is open to others).
    pub fn load_or_create(dir: &Path) -> Result<Self> {
        make_private_dir(dir)?;
        match Self::load(dir, FIRST_STEM) {
            Err(Error::NotFound(_)) => {
                let ca = Self::generate()?;
                write_private(&dir.join(KEY_FILE), &ca.key.serialize_der())?;
                write_private(&dir.join(CERT_FILE), ca.der.as_ref())?;
                Ok(ca)
            }
            other => other,
        }
    }

    /// The authority saved in `dir` under `stem` (`Error::NotFound` when its key is not
    /// there; refused if the key is open to others or the certificate is another key's).
    pub(crate) fn load(dir: &Path, stem: &str) -> Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let io = |what: String| move |e: std::io::Error| Error::Tls(format!("{what}: {e}"));
        let key_path = dir.join(format!("{stem}.key"));
        let cert_path = dir.join(format!("{stem}.crt"));
        match std::fs::read(&key_path) {
            Ok(pkcs8) => {
                let meta = std::fs::metadata(&key_path).map_err(io(format!("cannot stat {}", key_path.display())))?;
                if meta.mode() & 0o077 != 0 {
                    return Err(Error::Tls(format!(
                        "the CA key {} is open to other users (mode {:o}); make it 0600 or move it aside",
                        key_path.display(),
                        meta.mode() & 0o777
                    )));
                }
                let der = PrivatePkcs8KeyDer::from(pkcs8);
                let key = KeyPair::from_pkcs8_der_and_sign_algo(&der, &PKCS_ED25519)
                    .map_err(|e| Error::Tls(format!("the CA key {} is not an Ed25519 key: {e}", key_path.display())))?;
                let saved = std::fs::read(&cert_path).map_err(io(format!("cannot read {}", cert_path.display())))?;
                let cert = Self::certificate(&key, stem)?;
                let der = CertificateDer::from(saved);
                if spki_of(&der)? != key.public_key_der().as_slice() {
                    return Err(Error::Tls(format!(
                        "the CA certificate {} is not the key {}'s",
                        cert_path.display(),
                        key_path.display()
                    )));
                }
                Ok(Self {
                    key,
                    cert,
                    der,
                    stem: stem.to_string(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::NotFound(format!("no CA key {}", key_path.display())))
            }
            Err(e) => Err(io(format!("cannot read the CA key {}", key_path.display()))(e)),
        }
    }

    /// The common name of the authority filed under `stem`.
    fn common_name(stem: &str) -> String {
        match stem.strip_prefix("ca-") {
            Some(suffix) => format!("{FIRST_NAME} {suffix}"),
            None => FIRST_NAME.to_string(),
        }
    }

    /// What the authority filed under `stem` certifies about itself.
    fn params(stem: &str) -> Result<CertificateParams> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert("cluster CA"))?;
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, Self::common_name(stem));
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        Ok(params)
    }

    /// The authority's self-signed certificate for `key` (the same subject and key
    /// identifier every time, so certificates issued after a restart chain to the saved one).
    fn certificate(key: &KeyPair, stem: &str) -> Result<Certificate> {
        Self::params(stem)?
            .self_signed(key)
            .map_err(cert("cluster CA certificate"))
    }

    /// The certificate every node trusts.
    pub fn certificate_der(&self) -> &CertificateDer<'static> {
        &self.der
    }

    /// The cluster's identity.
    pub fn hash(&self) -> CaHash {
        CaHash(Sha256::digest(self.key.public_key_der()).into())
    }

    /// A certificate for `role` on the Ed25519 public key `public_key` (32 raw bytes).
    pub fn issue(&self, role: &Role, public_key: &[u8], lifetime: Duration) -> Result<CertificateDer<'static>> {
        if public_key.len() != 32 {
            return Err(Error::Join(format!(
                "an Ed25519 public key is 32 bytes, not {}",
                public_key.len()
            )));
        }
        let params = self.params_for(role, lifetime)?;
        let leaf = params
            .signed_by(&RawEd25519(public_key), &self.cert, &self.key)
            .map_err(cert("node certificate"))?;
        Ok(leaf.der().clone())
    }

    /// A certificate for `role` on `key` (a key made here: the head's own, or its HTTPS one).
    pub fn issue_for_key(&self, role: &Role, key: &KeyPair) -> Result<CertificateDer<'static>> {
        let params = self.params_for(role, HEAD_CERT_LIFETIME)?;
        Ok(params
            .signed_by(key, &self.cert, &self.key)
            .map_err(cert("node certificate"))?
            .der()
            .clone())
    }

    /// The head's HTTPS certificate on `key`: the head's names, and `names` (host names
    /// or IP addresses browsers reach the dashboard by), so that a browser trusting the
    /// authority (`regatta ca`) accepts it as it is.
    pub fn issue_https(&self, key: &KeyPair, names: &[String]) -> Result<CertificateDer<'static>> {
        let mut params = self.params_for(&Role::Head, HEAD_CERT_LIFETIME)?;
        for name in names {
            if rustls::pki_types::ServerName::try_from(name.as_str()).is_err() {
                return Err(Error::Tls(format!(
                    "{name:?} is neither a host name nor an IP address for the HTTPS certificate"
                )));
            }
            let san =
                match name.parse::<std::net::IpAddr>() {
                    Ok(ip) => rcgen::SanType::IpAddress(ip),
                    Err(_) => rcgen::SanType::DnsName(name.as_str().try_into().map_err(|e| {
                        Error::Tls(format!("{name:?} is not a host name for the HTTPS certificate: {e}"))
                    })?),
                };
            if !params.subject_alt_names.contains(&san) {
                params.subject_alt_names.push(san);
            }
        }
        Ok(params
            .signed_by(key, &self.cert, &self.key)
            .map_err(cert("HTTPS certificate"))?
            .der()
            .clone())
    }

    fn params_for(&self, role: &Role, lifetime: Duration) -> Result<CertificateParams> {
        let mut params =
            CertificateParams::new(vec![SERVER_NAME.to_string(), role.dns_name()]).map_err(cert("node certificate"))?;
        let mut name = DistinguishedName::new();
        let common = match role {
            Role::Head => "regatta head".to_string(),
            Role::Node(name) => format!("regatta node {name}"),
            Role::Client(name) => format!("regatta client {name}"),
        };
        name.push(DnType::CommonName, common);
        params.distinguished_name = name;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + lifetime;
        let mut serial = [0u8; 16];
        aws_lc_rs::rand::fill(&mut serial).map_err(|_| Error::Tls("no random serial number".into()))?;
        serial[0] &= 0x7f;
        params.serial_number = Some(serial.to_vec().into());
        Ok(params)
    }
}

/// A certificate as PEM text (`-----BEGIN CERTIFICATE-----`, base64 in lines of 64).
pub fn certificate_pem(der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut text = String::with_capacity(der.len() * 4 / 3 + 4);
    for chunk in der.chunks(3) {
        let bits = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                text.push(char::from(ALPHABET[(bits >> (18 - 6 * i) & 0x3f) as usize]));
            } else {
                text.push('=');
            }
        }
    }
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in text.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).unwrap_or_default());
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

/// `bytes` as lower-case hex digits (this crate's one spelling of hashes, keys and names).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Makes `dir` (and its parents) with mode 0700 when it is not there.
pub(crate) fn make_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| Error::Tls(format!("cannot create the CA folder {}: {e}", dir.display())))
}

/// Writes `bytes` to a new file at `path` made 0600 (never overwriting one).
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::Tls(format!("cannot create {}: {e}", path.display())))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::Tls(format!("cannot write {}: {e}", path.display())))
}

/// Replaces the file at `path` with `bytes`, whole: written to a private (0600) temporary
/// file beside it, synced, and renamed over it.
pub(crate) fn replace_private(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    let _ = std::fs::remove_file(&partial);
    write_private(&partial, bytes)?;
    std::fs::rename(&partial, path).map_err(|e| Error::Tls(format!("cannot replace {}: {e}", path.display())))
}

/// A fresh Ed25519 key for a node's certificate.
pub fn node_key() -> Result<KeyPair> {
    KeyPair::generate_for(&PKCS_ED25519).map_err(cert("node key"))
}

/// The raw 32-byte public key of an Ed25519 key pair (what a join request carries).
pub fn raw_public_key(key: &KeyPair) -> Vec<u8> {
    key.public_key_raw().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_print_as_pem_that_reads_back_whole() {
        use rustls::pki_types::pem::PemObject;
        let body = |pem: &str| pem.lines().filter(|l| !l.starts_with("-----")).collect::<String>();
        // RFC 4648's vectors.
        for (bytes, text) in [
            (&b"f"[..], "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(body(&certificate_pem(bytes)), text);
        }
        let ca = ClusterCa::generate().unwrap();
        let der = ca.certificate_der();
        let pem = certificate_pem(der.as_ref());
        assert!(pem.lines().all(|l| l.len() <= 64), "{pem}");
        let back = CertificateDer::from_pem_slice(pem.as_bytes()).expect("PEM reads back");
        assert_eq!(back.as_ref(), der.as_ref());
    }

    #[test]
    fn the_https_certificate_names_the_hosts_browsers_use() {
        use rustls::client::danger::ServerCertVerifier;
        let ca = ClusterCa::generate().unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let names = [
            "head.example.org".to_string(),
            "10.0.0.7".to_string(),
            "::1".to_string(),
        ];
        let der = ca.issue_https(&key, &names).unwrap();
        // A plain WebPKI client trusting the authority, as a browser that imported it.
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.certificate_der().clone()).unwrap();
        let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(std::sync::Arc::new(roots), provider)
                .build()
                .unwrap();
        let check = |name: &str| {
            let server = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
            verifier.verify_server_cert(&der, &[], &server, &[], rustls::pki_types::UnixTime::now())
        };
        for name in ["head.example.org", "10.0.0.7", "::1", HEAD_NAME] {
            assert!(check(name).is_ok(), "{name}: {:?}", check(name));
        }
        assert!(check("other.example.org").is_err());
        let err = ca.issue_https(&key, &["bad name!".to_string()]).unwrap_err();
        assert!(err.to_string().contains("bad name!"), "{err}");
    }

    #[test]
    fn a_saved_authority_comes_back_the_same_and_private() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("regatta-ca-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = ClusterCa::load_or_create(&dir).expect("create");
        let again = ClusterCa::load_or_create(&dir).expect("load");
        assert_eq!(first.hash(), again.hash());
        assert_eq!(first.certificate_der(), again.certificate_der());
        for file in [KEY_FILE, CERT_FILE] {
            assert_eq!(
                std::fs::metadata(dir.join(file)).unwrap().mode() & 0o777,
                0o600,
                "{file}"
            );
        }
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        // The hash is of the certificate's key info, whichever way it is read.
        assert_eq!(CaHash::of_certificate(first.certificate_der()).unwrap(), first.hash());
        assert_ne!(ClusterCa::generate().unwrap().hash(), first.hash(), "keys are random");
        // A key others can read is refused, not used.
        std::fs::set_permissions(dir.join(KEY_FILE), std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let refused = ClusterCa::load_or_create(&dir).err().expect("refused");
        assert!(refused.to_string().contains("open to other users"), "{refused}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hashes_read_back_and_bad_ones_are_refused() {
        let hash = ClusterCa::generate().unwrap().hash();
        assert_eq!(hash.to_string().parse::<CaHash>().unwrap(), hash);
        assert_eq!(hash.hex().parse::<CaHash>().unwrap(), hash);
        // The last: 64 bytes, not 64 characters (found by the fuzzing in join.rs).
        let wide = format!("§{}", "0".repeat(62));
        for bad in ["", "sha256:", "sha256:zz", &"0".repeat(63), &wide] {
            assert!(bad.parse::<CaHash>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_node_certificate_names_its_node_and_no_other_does() {
        let ca = ClusterCa::generate().unwrap();
        let key = node_key().unwrap();
        let node = ca
            .issue(&Role::Node("gpu-7".into()), &raw_public_key(&key), CERT_LIFETIME)
            .unwrap();
        assert_eq!(node_name_of(node.as_ref()).as_deref(), Some("gpu-7"));
        let client = ca
            .issue(&Role::Client("c".into()), &raw_public_key(&key), CERT_LIFETIME)
            .unwrap();
        assert_eq!(node_name_of(client.as_ref()), None);
        assert_eq!(role_of(client.as_ref()), Some(Role::Client("c".into())));
        assert_eq!(
            role_of(ca.issue_for_key(&Role::Head, &key).unwrap().as_ref()),
            Some(Role::Head)
        );
        assert_eq!(node_name_of(ca.certificate_der().as_ref()), None);
        assert_eq!(node_name_of(b"not a certificate"), None);
        for cut in 0..node.len() {
            let _ = node_name_of(&node[..cut]);
        }
    }

    #[test]
    fn names_become_dns_labels_one_to_one() {
        assert_eq!(
            Role::Node("w1".into()).dns_name(),
            "w1.node.regatta",
            "a label stays as it is"
        );
        let odd = Role::Node("W_1.x".into()).dns_name();
        assert!(odd.starts_with("w-1-x-") && odd.ends_with(".node.regatta"), "{odd}");
        assert!(Role::Client("--".into()).dns_name().starts_with("x-"));
        // Names that differ only where a label cannot hold them get distinct names.
        let names = ["gpu_1", "gpu-1", "GPU-1", "gpu.1", "-gpu-1", "gpu-1-"];
        let labels: std::collections::BTreeSet<String> =
            names.iter().map(|n| Role::Node((*n).into()).dns_name()).collect();
        assert_eq!(labels.len(), names.len(), "{labels:?}");
        for label in &labels {
            let first = label.split('.').next().unwrap();
            assert!(
                first.len() <= 63 && !first.starts_with('-') && !first.ends_with('-'),
                "{label}"
            );
            assert!(
                rustls::pki_types::ServerName::try_from(label.as_str()).is_ok(),
                "{label}"
            );
        }
        let long = Role::Node("n".repeat(200)).dns_name();
        assert!(long.split('.').next().unwrap().len() <= 63, "{long}");
        assert_eq!(Role::Head.dns_name(), HEAD_NAME);
        assert!(Role::joining("head", "h").is_err(), "no one joins as the head");
        assert!(Role::joining("node", "").is_err());
        assert!(Role::joining("node", "a\nb").is_err());
    }
}
