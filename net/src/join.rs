//! Joining a cluster: a join token traded at the head for a certificate of the cluster's
//! own authority.
//!
//! A join token is `<id>.<secret>` (kubeadm's bootstrap tokens' shape): the id names it in
//! lists and logs, the secret (at least 128 bits) never crosses the network. The joiner
//! opens TLS to the head's cluster port with ALPN [`JOIN_ALPN`], then both sides prove the
//! secret over that connection's exported keying material (RFC 5705/8446 exporters):
//!
//! - the joiner sends `HMAC(K, "client" ‖ exporter ‖ role ‖ name ‖ public key)`, with `K`
//!   the SHA-256 of the secret under a label, and its fresh Ed25519 public key;
//! - the head checks it (constant time), spends one use of the token, issues a certificate
//!   for that key, and answers with the authority, the certificate and
//!   `HMAC(K, "head" ‖ exporter ‖ SHA-256(authority) ‖ SHA-256(certificate))`.
//!
//! An eavesdropper sees TLS records only. A man in the middle holds two TLS connections
//! with two different exporters, so a proof relayed from one is worthless on the other. A
//! fake head receives one HMAC of a 128-bit-or-more secret, which no dictionary reaches,
//! and cannot answer with a valid proof, so the joiner trusts nothing it sends. A joiner
//! that also pins the authority's hash (`--ca-hash`, printed by the head) refuses any head
//! whose certificate does not chain to it before it sends a byte.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use aws_lc_rs::{constant_time, hmac};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::authorities::{Authorities, AuthorityStore};
use crate::ca::{node_key, raw_public_key, spki_of, CaHash, ClusterCa, Role, HEAD_NAME};
use crate::error::{Error, Result};
use crate::identity::TlsIdentity;

/// ALPN protocol id of a join on the head's cluster port.
pub const JOIN_ALPN: &[u8] = b"regatta-join/1";

/// The exporter label both sides derive the proofs' channel binding with.
const EXPORTER_LABEL: &[u8] = b"EXPORTER-regatta-join-v1";

/// The largest join frame either side reads.
const MAX_FRAME: usize = 64 * 1024;

/// How long a join may take, connection to certificate.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The fewest secret characters a join token may have (`[a-z0-9]`: 32 give 165 bits;
/// 32 hex digits, the least accepted, 128).
pub const MIN_SECRET_CHARS: usize = 32;

/// A join token, `<id>.<secret>`.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    /// Six characters `[a-z0-9]`: the token's public name.
    pub id: String,
    secret: String,
}

impl JoinToken {
    /// A new random token: a 6-character id and a 32-character secret, `[a-z0-9]`.
    pub fn generate() -> Self {
        Self {
            id: random_chars(6),
            secret: random_chars(32),
        }
    }

    /// The key both sides' proofs are made with (what a head keeps of the token).
    pub fn key(&self) -> JoinKey {
        JoinKey(
            Sha256::new()
                .chain_update(b"regatta join token v1\0")
                .chain_update(self.secret.as_bytes())
                .finalize()
                .into(),
        )
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.id, self.secret)
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JoinToken({}.<secret>)", self.id)
    }
}

impl FromStr for JoinToken {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let text = text.trim();
        let why = |what: &str| {
            Error::Join(format!(
                "a cluster token is a join token <id>.<secret>: 6 characters [a-z0-9], a dot, and at least {MIN_SECRET_CHARS} [a-z0-9] ({what}); `regatta token generate` makes one. A token from an older Regatta (one random string) is no longer accepted: the cluster now has a certificate authority of its own"
            ))
        };
        let Some((id, secret)) = text.split_once('.') else {
            return Err(why("no dot"));
        };
        let class = |s: &str| s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if id.len() != 6 || !class(id) {
            return Err(why("the id is not 6 characters [a-z0-9]"));
        }
        if secret.len() < MIN_SECRET_CHARS || secret.len() > 256 || !class(secret) {
            return Err(why("the secret is too short or has other characters"));
        }
        Ok(Self {
            id: id.to_string(),
            secret: secret.to_string(),
        })
    }
}

/// `count` random characters `[a-z0-9]` (rejection-sampled, so uniform).
fn random_chars(count: usize) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(count);
    let mut buf = [0u8; 64];
    while out.len() < count {
        // The OS random source failing is not recoverable and not input-driven.
        aws_lc_rs::rand::fill(&mut buf).expect("the OS random source is available");
        for &b in &buf {
            // 252 = 7 x 36: the bytes above it would bias the draw.
            if b < 252 && out.len() < count {
                out.push(char::from(ALPHABET[usize::from(b % 36)]));
            }
        }
    }
    out
}

/// The proof key of a join token.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct JoinKey([u8; 32]);

impl fmt::Debug for JoinKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JoinKey(..)")
    }
}

impl JoinKey {
    fn tag<P: AsRef<[u8]>>(&self, side: &[u8], exporter: &[u8], parts: &[P]) -> hmac::Tag {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &self.0);
        let mut context = hmac::Context::with_key(&key);
        context.update(side);
        context.update(exporter);
        for part in parts {
            let part = part.as_ref();
            context.update(&(part.len() as u32).to_be_bytes());
            context.update(part);
        }
        context.sign()
    }

    fn verify<P: AsRef<[u8]>>(&self, side: &[u8], exporter: &[u8], parts: &[P], proof: &[u8]) -> bool {
        constant_time::verify_slices_are_equal(self.tag(side, exporter, parts).as_ref(), proof).is_ok()
    }

    /// The proof of the job API's certificate authority a head serves (so a job client
    /// that holds the token can trust the authority before it sends the token).
    pub fn authority_proof(&self, ca: &[u8]) -> Vec<u8> {
        self.tag(b"authority", b"", &[&Sha256::digest(ca)]).as_ref().to_vec()
    }

    /// Whether `proof` is this key's proof of `ca`.
    pub fn verify_authority(&self, ca: &[u8], proof: &[u8]) -> bool {
        self.verify(b"authority", b"", &[&Sha256::digest(ca)], proof)
    }
}

/// One join token as a head holds it.
#[derive(Clone)]
pub struct TokenEntry {
    /// The proof key (the secret is not kept).
    pub key: JoinKey,
    /// When it stops working; `None` never.
    pub expires: Option<SystemTime>,
    /// Joins left; `None` unlimited.
    pub uses_left: Option<u32>,
    /// What it was made for.
    pub description: String,
}

/// Why a join was refused (the joiner is told which).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No token of that id.
    Unknown,
    /// Past its expiry.
    Expired,
    /// Every use spent.
    UsedUp,
    /// The node's name was removed from the cluster.
    Removed(String),
    /// The proof does not match the token's secret.
    WrongSecret,
    /// The request was malformed.
    Malformed(String),
    /// Its source has spent its share of failed joins: seconds until it may try again.
    Throttled(u64),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unknown => write!(
                f,
                "the head knows no join token of this id (revoked, or another cluster's)"
            ),
            Self::Expired => write!(f, "the join token has expired"),
            Self::UsedUp => write!(f, "the join token has no uses left"),
            Self::Removed(name) => write!(
                f,
                "node {name} was removed from the cluster (regatta node remove): it cannot join again under this name"
            ),
            Self::WrongSecret => write!(f, "the join token's secret is wrong"),
            Self::Malformed(why) => write!(f, "a malformed join request: {why}"),
            Self::Throttled(secs) => write!(f, "too many failed joins from this network: try again in {secs} s"),
        }
    }
}

/// The join tokens a head accepts: the logic that decides, free of I/O.
#[derive(Clone, Default)]
pub struct JoinTokens {
    tokens: Vec<(String, TokenEntry)>,
}

impl JoinTokens {
    /// Accepts `token` from now on, replacing one of the same id.
    pub fn insert(&mut self, token: &JoinToken, expires: Option<SystemTime>, uses: Option<u32>, description: &str) {
        self.tokens.retain(|(id, _)| id != &token.id);
        self.tokens.push((
            token.id.clone(),
            TokenEntry {
                key: token.key(),
                expires,
                uses_left: uses,
                description: description.to_string(),
            },
        ));
    }

    /// Stops accepting the token `id`; whether there was one.
    pub fn revoke(&mut self, id: &str) -> bool {
        let before = self.tokens.len();
        self.tokens.retain(|(known, _)| known != id);
        before != self.tokens.len()
    }

    /// The tokens, by id.
    pub fn list(&self) -> impl Iterator<Item = (&str, &TokenEntry)> {
        self.tokens.iter().map(|(id, entry)| (id.as_str(), entry))
    }

    /// The key of token `id` if it may be used at `now`.
    pub fn usable(&self, id: &str, now: SystemTime) -> std::result::Result<JoinKey, Refusal> {
        let (_, entry) = self
            .tokens
            .iter()
            .find(|(known, _)| known == id)
            .ok_or(Refusal::Unknown)?;
        if entry.expires.is_some_and(|at| now >= at) {
            return Err(Refusal::Expired);
        }
        if entry.uses_left == Some(0) {
            return Err(Refusal::UsedUp);
        }
        Ok(entry.key)
    }

    /// Spends one use of token `id` (after its proof was checked).
    pub fn spend(&mut self, id: &str) {
        if let Some((_, entry)) = self.tokens.iter_mut().find(|(known, _)| known == id) {
            if let Some(left) = entry.uses_left.as_mut() {
                *left = left.saturating_sub(1);
            }
        }
    }
}

impl JoinTokens {
    /// The tokens as lines `id key-hex expires-unix|- uses|- description` (what a head
    /// keeps on disk; the bootstrap token is not among them: it comes from the head's
    /// configuration at each start).
    pub fn to_lines(&self) -> String {
        let mut out = String::new();
        for (id, entry) in &self.tokens {
            let expires = entry
                .expires
                .and_then(|at| at.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map_or("-".to_string(), |d| d.as_secs().to_string());
            let uses = entry.uses_left.map_or("-".to_string(), |n| n.to_string());
            let key = crate::ca::hex(&entry.key.0);
            let description = entry.description.replace(['\n', '\r'], " ");
            out.push_str(&format!("{id} {key} {expires} {uses} {description}\n"));
        }
        out
    }

    /// Reads [`Self::to_lines`]'s text; a bad line is an error naming it.
    pub fn from_lines(text: &str) -> Result<Self> {
        let mut tokens = Self::default();
        for (number, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad = |what: &str| Error::Join(format!("join token list, line {}: {what}", number + 1));
            let mut parts = line.splitn(5, ' ');
            let mut next = |what: &str| parts.next().ok_or_else(|| bad(what));
            let id = next("no id")?.to_string();
            let key = next("no key")?;
            let expires = next("no expiry")?;
            let uses = next("no use count")?;
            let description = parts.next().unwrap_or_default().to_string();
            if key.len() != 64 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad("a key that is not 64 hex digits"));
            }
            let mut bytes = [0u8; 32];
            for (i, byte) in bytes.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&key[2 * i..2 * i + 2], 16).map_err(|_| bad("a key that is not hex"))?;
            }
            let expires = match expires {
                "-" => None,
                // Checked: a time past what SystemTime holds would panic an addition.
                secs => Some(
                    secs.parse::<u64>()
                        .ok()
                        .and_then(|secs| SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs)))
                        .ok_or_else(|| bad("an expiry that is not a time"))?,
                ),
            };
            let uses_left = match uses {
                "-" => None,
                n => Some(n.parse().map_err(|_| bad("a use count that is not a number"))?),
            };
            tokens.tokens.push((
                id,
                TokenEntry {
                    key: JoinKey(bytes),
                    expires,
                    uses_left,
                    description,
                },
            ));
        }
        Ok(tokens)
    }
}

/// What a head answers joins with.
pub struct JoinDesk {
    /// The authorities: the issuing one issues the certificates, all are trusted.
    authorities: std::sync::RwLock<Authorities>,
    /// Where the authorities are kept (`None`: in memory only).
    pub store: Option<AuthorityStore>,
    /// The head's own identity, moved along by a rotation.
    head: TlsIdentity,
    /// The names the head's HTTPS certificate carries besides its own.
    pub web_names: Vec<String>,
    /// The tokens it accepts.
    pub tokens: Arc<Mutex<JoinTokens>>,
    /// Where the tokens made after start are kept (`None`: in memory only).
    pub file: Option<std::path::PathBuf>,
    /// The bootstrap token's id (it comes from the head's configuration, and is not kept).
    pub bootstrap: String,
    /// Node names removed from the cluster: refused a certificate.
    pub removed: crate::identity::RemovedNodes,
    /// How long the certificates it issues are valid.
    pub lifetime: Duration,
    /// Failed joins (an unknown token id, a wrong secret) per source: past its share, a
    /// source's joins are refused before their proof is checked.
    pub throttle: Mutex<crate::Throttle>,
}

impl JoinDesk {
    /// The desk of the head whose identity is `head` (made by [`TlsIdentity::for_head`] from
    /// `authorities`), accepting `tokens`, the bootstrap one's id `bootstrap`; nothing kept
    /// on disk and certificates of [`crate::CERT_LIFETIME`] until the fields say otherwise.
    pub fn new(authorities: Authorities, head: TlsIdentity, tokens: JoinTokens, bootstrap: &str) -> Self {
        Self {
            authorities: std::sync::RwLock::new(authorities),
            store: None,
            removed: head.removed.clone(),
            head,
            web_names: Vec::new(),
            tokens: Arc::new(Mutex::new(tokens)),
            file: None,
            bootstrap: bootstrap.to_string(),
            lifetime: crate::ca::CERT_LIFETIME,
            throttle: Default::default(),
        }
    }

    /// The authorities now.
    pub fn authorities(&self) -> Authorities {
        self.authorities
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The authority that issues certificates now.
    pub fn issuing_hash(&self) -> CaHash {
        self.authorities
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .issuing()
            .hash()
    }

    /// Starts a rotation: a new authority issues from now on, the current one retires
    /// (trusted until every certificate it issued has expired). Kept before it takes
    /// effect; the head presents certificates of the new authority from its next handshake.
    pub fn rotate(&self) -> Result<Authorities> {
        self.change(|current, now| current.rotate(ClusterCa::generate_next()?, now, self.lifetime))
    }

    /// Finishes a rotation: the retiring authority is trusted no more (refused before every
    /// certificate it issued has expired, unless `force`).
    pub fn finish(&self, force: bool) -> Result<Authorities> {
        self.change(|current, now| current.finish(now, force))
    }

    /// Moves to the authorities `next` makes of the current ones: kept, then the head's
    /// identity moved, then answered with; one change at a time.
    fn change(&self, next: impl FnOnce(&Authorities, SystemTime) -> Result<Authorities>) -> Result<Authorities> {
        let mut current = self
            .authorities
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let next = next(&current, SystemTime::now())?;
        if let Some(store) = &self.store {
            store.save(&current, &next)?;
        }
        self.head.rotate_head(&next, &self.web_names)?;
        *current = next.clone();
        Ok(next)
    }

    /// Writes the tokens other than the bootstrap one to the desk's file (whole, through a
    /// private temporary file and a rename).
    pub fn save(&self, tokens: &JoinTokens) -> Result<()> {
        let Some(path) = &self.file else { return Ok(()) };
        let mut kept = tokens.clone();
        kept.revoke(&self.bootstrap);
        crate::ca::replace_private(path, kept.to_lines().as_bytes())
    }
}

/// Certificates as one field: each as a length-prefixed field (what [`decode`] reads).
fn encode_certs(certs: &[CertificateDer<'_>]) -> Vec<u8> {
    let fields: Vec<&[u8]> = certs.iter().map(|c| c.as_ref()).collect();
    encode(&fields)[4..].to_vec()
}

/// Reads [`encode_certs`]'s field.
fn decode_certs(field: &[u8]) -> std::result::Result<Vec<CertificateDer<'static>>, String> {
    Ok(decode(field)?
        .into_iter()
        .map(|cert| CertificateDer::from(cert.to_vec()))
        .collect())
}

/// Frames of length-prefixed fields: `u32` total length, then each field as `u32` length
/// and bytes.
fn encode(fields: &[&[u8]]) -> Vec<u8> {
    let mut body = Vec::new();
    for field in fields {
        body.extend_from_slice(&(field.len() as u32).to_be_bytes());
        body.extend_from_slice(field);
    }
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

fn decode(body: &[u8]) -> std::result::Result<Vec<&[u8]>, String> {
    let mut fields = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        if rest.len() < 4 || fields.len() >= 16 {
            return Err("a cut or overlong field list".into());
        }
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        rest = &rest[4..];
        if len > rest.len() {
            return Err("a field longer than its frame".into());
        }
        fields.push(&rest[..len]);
        rest = &rest[len..];
    }
    Ok(fields)
}

async fn read_frame<S: AsyncRead + Unpin>(stream: &mut S) -> std::io::Result<Vec<u8>> {
    let len = stream.read_u32().await? as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a join frame of {len} bytes (at most {MAX_FRAME})"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Ok(body)
}

fn exporter(conn: &rustls::ConnectionCommon<impl Sized>) -> Result<[u8; 32]> {
    conn.export_keying_material([0u8; 32], EXPORTER_LABEL, None)
        .map_err(|e| Error::Join(format!("no keying material to bind the join to: {e}")))
}

/// Answers one join on `stream` (a TLS connection the head accepted with ALPN
/// [`JOIN_ALPN`]); returns the role it issued a certificate to, or why it refused.
pub async fn answer_join<S>(
    stream: &mut tokio_rustls::server::TlsStream<S>,
    desk: &JoinDesk,
    source: std::net::IpAddr,
) -> std::result::Result<Role, Refusal>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let exporter = exporter(stream.get_ref().1).map_err(|e| Refusal::Malformed(e.to_string()))?;
    // A renewal presents the certificate it renews (checked by the handshake, a removed
    // node's refused there): the role comes from it.
    let presented = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(|leaf| crate::ca::role_of(leaf.as_ref()));
    let body = read_frame(stream)
        .await
        .map_err(|e| Refusal::Malformed(format!("cannot read the request: {e}")))?;
    let outcome = match presented {
        Some(role) => renewal(&body, role, desk),
        None => throttled_grant(&body, &exporter, desk, source),
    };
    let lifetime = desk.lifetime.as_secs().to_be_bytes();
    let reply = match &outcome {
        Ok(grant) => encode(&[
            b"ok",
            &grant.trusted,
            &grant.cert,
            &grant.proof,
            &lifetime,
            &grant.cluster,
            &grant.chain,
        ]),
        Err(refusal) => encode(&[b"refused", refusal.to_string().as_bytes()]),
    };
    let _ = stream.write_all(&reply).await;
    let _ = stream.flush().await;
    let _ = stream.shutdown().await;
    outcome.map(|grant| grant.role)
}

/// What a join or a renewal is answered with.
struct Grant {
    role: Role,
    /// The authorities to trust ([`encode_certs`]).
    trusted: Vec<u8>,
    /// The certificate issued.
    cert: Vec<u8>,
    /// The head's proof of the token's secret over all of it (a join's; a renewal has none).
    proof: Vec<u8>,
    /// The cluster's id.
    cluster: [u8; 32],
    /// What vouches for the certificate besides it ([`encode_certs`]).
    chain: Vec<u8>,
}

impl Grant {
    /// A grant of `cert` to `role` under `authorities`, proven with `key` over `exporter`
    /// when given.
    fn new(role: Role, authorities: &Authorities, cert: Vec<u8>, proven: Option<(&JoinKey, &[u8])>) -> Self {
        let trusted = encode_certs(&authorities.trusted());
        let chain = encode_certs(&authorities.chain());
        let cluster = authorities.cluster().0;
        let proof = proven.map_or_else(Vec::new, |(key, exporter)| {
            key.tag(b"head", exporter, &head_proof_parts(&trusted, &cert, &cluster, &chain))
                .as_ref()
                .to_vec()
        });
        Self {
            role,
            trusted,
            cert,
            proof,
            cluster,
            chain,
        }
    }
}

/// What the head's proof covers: digests of the authorities, the certificate and the
/// chain, and the cluster's id.
fn head_proof_parts(trusted: &[u8], cert: &[u8], cluster: &[u8], chain: &[u8]) -> [Vec<u8>; 4] {
    [
        Sha256::digest(trusted).to_vec(),
        Sha256::digest(cert).to_vec(),
        cluster.to_vec(),
        Sha256::digest(chain).to_vec(),
    ]
}

/// [`grant`] within the source's share of failed joins: a source past it is refused before
/// its proof is checked; an unknown id or a wrong secret counts against it, a join forgets
/// it.
fn throttled_grant(
    body: &[u8],
    exporter: &[u8],
    desk: &JoinDesk,
    source: std::net::IpAddr,
) -> std::result::Result<Grant, Refusal> {
    let now = std::time::Instant::now();
    let throttle = || desk.throttle.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Err(wait) = throttle().admit(source, now) {
        return Err(Refusal::Throttled(wait.as_secs().max(1)));
    }
    let outcome = grant(body, exporter, desk);
    match &outcome {
        Ok(_) => throttle().succeeded(source),
        Err(Refusal::Unknown | Refusal::WrongSecret) => throttle().failed(source, now),
        Err(_) => {}
    }
    outcome
}

/// Checks a join request and issues its certificate under the issuing authority.
fn grant(body: &[u8], exporter: &[u8], desk: &JoinDesk) -> std::result::Result<Grant, Refusal> {
    let fields = decode(body).map_err(Refusal::Malformed)?;
    let [version, id, proof, kind, name, public_key] = fields[..] else {
        return Err(Refusal::Malformed(format!("{} fields, not 6", fields.len())));
    };
    if version != JOIN_ALPN {
        return Err(Refusal::Malformed("another join version".into()));
    }
    let text =
        |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| Refusal::Malformed("a name that is not UTF-8".into()));
    let (id, kind, name) = (text(id)?, text(kind)?, text(name)?);
    let role = Role::joining(&kind, &name).map_err(|e| Refusal::Malformed(e.to_string()))?;
    if let Role::Node(node) = &role {
        let removed = desk.removed.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if removed.contains(node) {
            return Err(Refusal::Removed(node.clone()));
        }
    }
    let mut tokens = desk.tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let key = tokens.usable(&id, SystemTime::now())?;
    if !key.verify(
        b"client",
        exporter,
        &[kind.as_bytes(), name.as_bytes(), public_key],
        proof,
    ) {
        return Err(Refusal::WrongSecret);
    }
    let authorities = desk.authorities();
    let cert = authorities
        .issuing()
        .issue(&role, public_key, desk.lifetime)
        .map_err(|e| Refusal::Malformed(e.to_string()))?;
    let limited = tokens
        .list()
        .any(|(known, entry)| known == id && entry.uses_left.is_some());
    tokens.spend(&id);
    if limited {
        if let Err(e) = desk.save(&tokens) {
            // A use not written could be spent again after a restart: refuse rather.
            return Err(Refusal::Malformed(format!(
                "the head could not record the token's use: {e}"
            )));
        }
    }
    drop(tokens);
    Ok(Grant::new(role, &authorities, cert.to_vec(), Some((&key, exporter))))
}

/// The version tag of a renewal request.
const RENEW: &[u8] = b"regatta-renew/1";

/// Checks a renewal (a process presenting its current certificate, `role`'s) and issues
/// its next certificate under the issuing authority, with the authorities to trust now (no
/// proof: the head was checked by the renewer's own handshake).
fn renewal(body: &[u8], role: Role, desk: &JoinDesk) -> std::result::Result<Grant, Refusal> {
    let fields = decode(body).map_err(Refusal::Malformed)?;
    let [version, public_key] = fields[..] else {
        return Err(Refusal::Malformed(format!("{} fields, not 2", fields.len())));
    };
    if version != RENEW {
        return Err(Refusal::Malformed("a renewal of another version".into()));
    }
    match &role {
        Role::Head => return Err(Refusal::Malformed("the head renews its own certificate".into())),
        Role::Node(name) => {
            let removed = desk.removed.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if removed.contains(name) {
                return Err(Refusal::Removed(name.clone()));
            }
        }
        Role::Client(_) => {}
    }
    let authorities = desk.authorities();
    let cert = authorities
        .issuing()
        .issue(&role, public_key, desk.lifetime)
        .map_err(|e| Refusal::Malformed(e.to_string()))?;
    Ok(Grant::new(role, &authorities, cert.to_vec(), None))
}

/// Renews `identity`'s certificate at the head at `address`: a fresh key, a certificate for
/// it (the same role) asked for over mutual TLS with the current one, swapped in for every
/// later handshake. Returns when the new one expires.
pub async fn renew(address: &str, identity: &TlsIdentity) -> Result<SystemTime> {
    tokio::time::timeout(JOIN_TIMEOUT, renew_inner(address, identity))
        .await
        .map_err(|_| Error::JoinUnreachable(format!("no answer from {address} within {} s", JOIN_TIMEOUT.as_secs())))?
}

async fn renew_inner(address: &str, identity: &TlsIdentity) -> Result<SystemTime> {
    let (_, config) = identity.with_alpn(JOIN_ALPN);
    let tcp = TcpStream::connect(address)
        .await
        .map_err(|e| Error::JoinUnreachable(format!("cannot reach the head at {address}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from(HEAD_NAME).expect("the head's name is a valid DNS name");
    let mut stream = TlsConnector::from(config).connect(name, tcp).await.map_err(|e| {
        if is_certificate_error(&e) {
            Error::JoinRefused(format!("the head at {address} refused the renewal's handshake: {e}"))
        } else {
            Error::JoinUnreachable(format!("the renewal's handshake with {address} failed: {e}"))
        }
    })?;
    let key = node_key()?;
    let public_key = raw_public_key(&key);
    // TLS 1.3 finishes the client's handshake before the server has checked the client's
    // certificate: a refused one comes back as an alert on the first read.
    let io = |e: std::io::Error| {
        if refused_by_alert(&e) {
            Error::JoinRefused(format!("the head at {address} refused this process's certificate: {e}"))
        } else {
            Error::JoinUnreachable(format!("the renewal with {address} broke off: {e}"))
        }
    };
    let body = exchange(&mut stream, &encode(&[RENEW, &public_key]), io).await?;
    let fields =
        decode(&body).map_err(|why| Error::JoinRefused(format!("a malformed answer from {address}: {why}")))?;
    match fields[..] {
        [b"refused", reason] => Err(Error::JoinRefused(format!(
            "the head at {address} refused to renew this process's certificate: {}",
            String::from_utf8_lossy(reason)
        ))),
        [b"ok", trusted, cert, _, lifetime, cluster, chain] => {
            let cert = CertificateDer::from(cert.to_vec());
            if spki_of(&cert)? != key.public_key_der().as_slice() {
                return Err(Error::JoinRefused(format!(
                    "{address} renewed a certificate for another key"
                )));
            }
            if cluster != identity.cluster.0.as_slice() {
                return Err(Error::JoinRefused(format!(
                    "{address} answered for another cluster than {}",
                    identity.cluster
                )));
            }
            let malformed = |why: String| Error::JoinRefused(format!("a malformed answer from {address}: {why}"));
            let authorities = decode_certs(trusted).map_err(malformed)?;
            let mut presented = vec![cert];
            presented.extend(decode_certs(chain).map_err(malformed)?);
            let expires = SystemTime::now() + lifetime_of(lifetime)?;
            // The authorities first: the new certificate may come from one this process
            // did not trust yet, and its peers may present such certificates from now on.
            identity.trust.set(authorities)?;
            identity.slot.replace(presented, &key, expires)?;
            Ok(expires)
        }
        _ => Err(Error::JoinRefused(format!("a malformed answer from {address}"))),
    }
}

/// A lifetime field: seconds, big-endian u64.
fn lifetime_of(field: &[u8]) -> Result<Duration> {
    let bytes: [u8; 8] = field
        .try_into()
        .map_err(|_| Error::JoinRefused("a certificate lifetime that is not 8 bytes".into()))?;
    Ok(Duration::from_secs(u64::from_be_bytes(bytes)))
}

/// A verifier that checks only the handshake's signatures, for fetching what is proven
/// another way (the job API's authority, proven by the join token: `fetch_cluster_authority`
/// in the runtime). The join itself uses it when no authority is pinned.
pub fn signatures_only_verifier() -> Arc<dyn ServerCertVerifier> {
    Arc::new(JoinVerifier {
        pin: None,
        provider: Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
    })
}

/// Sends `request` on a join or renewal connection and reads the answer's fields'
/// frame; `io` names what broke off.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    request: &[u8],
    io: impl Fn(std::io::Error) -> Error,
) -> Result<Vec<u8>> {
    stream.write_all(request).await.map_err(&io)?;
    stream.flush().await.map_err(&io)?;
    read_frame(stream).await.map_err(&io)
}

/// Accepts the head's certificate for the join: with a pin, only one chaining to the
/// pinned authority and naming the head; without, any (the head then proves the secret).
#[derive(Debug)]
struct JoinVerifier {
    pin: Option<CaHash>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for JoinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(pin) = self.pin else {
            return Ok(ServerCertVerified::assertion());
        };
        let anchor = intermediates
            .iter()
            .find(|cert| CaHash::of_certificate(cert).is_ok_and(|hash| hash == pin))
            .ok_or(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ))?;
        let mut roots = RootCertStore::empty();
        roots.add(anchor.clone().into_owned())?;
        let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        // The head's chain may lead to the pinned authority through a cross-certificate
        // (while an older authority retires): every certificate it sent may be a link.
        verifier.verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
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

/// Joins the cluster whose head listens at `address` as `role`, with `token` (and, when
/// given, only if its authority is `pin`): the identity the head issued.
pub async fn join(address: &str, token: &JoinToken, pin: Option<CaHash>, role: &Role) -> Result<TlsIdentity> {
    tokio::time::timeout(JOIN_TIMEOUT, join_inner(address, token, pin, role))
        .await
        .map_err(|_| Error::JoinUnreachable(format!("no answer from {address} within {} s", JOIN_TIMEOUT.as_secs())))?
}

async fn join_inner(address: &str, token: &JoinToken, pin: Option<CaHash>, role: &Role) -> Result<TlsIdentity> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| Error::Tls(format!("join protocol versions: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(JoinVerifier { pin, provider }))
        .with_no_client_auth();
    config.alpn_protocols = vec![JOIN_ALPN.to_vec()];
    let tcp = TcpStream::connect(address)
        .await
        .map_err(|e| Error::JoinUnreachable(format!("cannot reach the head at {address}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from(HEAD_NAME).expect("the head's name is a valid DNS name");
    let mut stream = TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| match pin {
            Some(pin) if is_certificate_error(&e) => Error::JoinRefused(format!(
                "the head at {address} does not hold the pinned authority {pin} (another cluster's, or rotated away: `regatta token create` prints the current one): {e}"
            )),
            _ => Error::JoinUnreachable(format!(
                "the TLS handshake with {address} failed ({e}); is it a Regatta head's cluster port?"
            )),
        })?;
    if stream.get_ref().1.alpn_protocol() != Some(JOIN_ALPN) {
        return Err(Error::JoinRefused(format!(
            "{address} does not take joins (not a head, or an older Regatta)"
        )));
    }
    let exporter = exporter(stream.get_ref().1)?;
    let key = node_key()?;
    let public_key = raw_public_key(&key);
    let (kind, name) = role.parts();
    let proof = token
        .key()
        .tag(b"client", &exporter, &[kind.as_bytes(), name.as_bytes(), &public_key]);
    let request = encode(&[
        JOIN_ALPN,
        token.id.as_bytes(),
        proof.as_ref(),
        kind.as_bytes(),
        name.as_bytes(),
        &public_key,
    ]);
    let io = |e: std::io::Error| Error::JoinUnreachable(format!("the join with {address} broke off: {e}"));
    let body = exchange(&mut stream, &request, io).await?;
    let fields =
        decode(&body).map_err(|why| Error::JoinRefused(format!("a malformed answer from {address}: {why}")))?;
    match fields[..] {
        [b"refused", reason] => Err(Error::JoinRefused(format!(
            "the head at {address} refused the join token {}: {}",
            token.id,
            String::from_utf8_lossy(reason)
        ))),
        [b"ok", trusted, cert, head_proof, lifetime, cluster, chain] => {
            let parts = head_proof_parts(trusted, cert, cluster, chain);
            if !token.key().verify(b"head", &exporter, &parts, head_proof) {
                return Err(Error::JoinRefused(format!(
                    "{address} answered without proving the join token's secret: not this cluster's head"
                )));
            }
            let malformed = |why: String| Error::JoinRefused(format!("a malformed answer from {address}: {why}"));
            let authorities = decode_certs(trusted).map_err(malformed)?;
            let cluster: [u8; 32] = cluster
                .try_into()
                .map_err(|_| malformed("a cluster id that is not 32 bytes".into()))?;
            let hashes = authorities
                .iter()
                .map(CaHash::of_certificate)
                .collect::<Result<Vec<_>>>()?;
            if let Some(pin) = pin {
                if !hashes.contains(&pin) {
                    let held: Vec<String> = hashes.iter().map(ToString::to_string).collect();
                    return Err(Error::JoinRefused(format!(
                        "the head at {address} handed out the authorities {}, not the pinned {pin}",
                        held.join(", ")
                    )));
                }
            }
            let cert = CertificateDer::from(cert.to_vec());
            if spki_of(&cert)? != key.public_key_der().as_slice() {
                return Err(Error::JoinRefused(format!(
                    "{address} issued a certificate for another key"
                )));
            }
            let mut presented = vec![cert];
            presented.extend(decode_certs(chain).map_err(malformed)?);
            let expires = SystemTime::now() + lifetime_of(lifetime)?;
            TlsIdentity::joined(authorities, presented, CaHash(cluster), &key, expires)
        }
        _ => Err(Error::JoinRefused(format!("a malformed answer from {address}"))),
    }
}

/// Whether the peer ended the connection with an alert that refuses this side's certificate.
fn refused_by_alert(e: &std::io::Error) -> bool {
    use rustls::AlertDescription as A;
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|tls| {
            matches!(
                tls,
                rustls::Error::AlertReceived(
                    A::CertificateRevoked
                        | A::BadCertificate
                        | A::CertificateExpired
                        | A::CertificateUnknown
                        | A::UnknownCA
                        | A::AccessDenied
                )
            )
        })
}

fn is_certificate_error(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|tls| matches!(tls, rustls::Error::InvalidCertificate(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_read_back_and_bad_ones_say_why() {
        let token = JoinToken::generate();
        assert_eq!(token.id.len(), 6);
        assert_eq!(token.to_string().parse::<JoinToken>().unwrap(), token);
        assert_ne!(JoinToken::generate(), token, "random");
        assert!(!format!("{token:?}").contains(&token.secret), "Debug hides the secret");
        let hex = "abcdef.0123456789abcdef0123456789abcdef";
        assert!(hex.parse::<JoinToken>().is_ok(), "128 bits of hex pass");
        for bad in [
            "",
            "local-token",
            "abcdef.short",
            "ABCDEF.0123456789abcdef0123456789abcdef",
            "abcde.0123456789abcdef0123456789abcdef",
            "abcdef.0123456789abcdef0123456789abcdeX",
            "abcdef.0123456789abcdef0123456789abcde",
        ] {
            let err = bad.parse::<JoinToken>().expect_err(bad);
            assert!(err.to_string().contains("regatta token generate"), "{err}");
        }
    }

    #[test]
    fn the_registry_refuses_unknown_expired_used_up_and_revoked_tokens() {
        let now = SystemTime::now();
        let mut tokens = JoinTokens::default();
        let once = JoinToken::generate();
        let old = JoinToken::generate();
        let open = JoinToken::generate();
        tokens.insert(&once, None, Some(1), "one use");
        tokens.insert(&old, Some(now - Duration::from_secs(1)), None, "expired");
        tokens.insert(&open, None, None, "bootstrap");
        assert_eq!(tokens.usable("nosuch", now), Err(Refusal::Unknown));
        assert_eq!(tokens.usable(&old.id, now), Err(Refusal::Expired));
        assert_eq!(tokens.usable(&once.id, now), Ok(once.key()));
        tokens.spend(&once.id);
        assert_eq!(tokens.usable(&once.id, now), Err(Refusal::UsedUp));
        for _ in 0..3 {
            tokens.spend(&open.id);
        }
        assert_eq!(tokens.usable(&open.id, now), Ok(open.key()), "unlimited");
        assert!(tokens.revoke(&open.id));
        assert_eq!(tokens.usable(&open.id, now), Err(Refusal::Unknown));
        assert!(!tokens.revoke(&open.id));
    }

    #[test]
    fn the_kept_list_reads_back_and_bad_lines_are_named() {
        let mut tokens = JoinTokens::default();
        let (a, b) = (JoinToken::generate(), JoinToken::generate());
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
        tokens.insert(&a, Some(at), Some(3), "for the GPU pool");
        tokens.insert(&b, None, None, "");
        let back = JoinTokens::from_lines(&tokens.to_lines()).expect("read back");
        let listed: Vec<_> = back
            .list()
            .map(|(id, e)| (id.to_string(), e.expires, e.uses_left, e.description.clone()))
            .collect();
        assert_eq!(
            listed,
            vec![
                (a.id.clone(), Some(at), Some(3), "for the GPU pool".to_string()),
                (b.id.clone(), None, None, String::new())
            ]
        );
        assert_eq!(back.usable(&a.id, SystemTime::UNIX_EPOCH), Ok(a.key()));
        let wide_key = format!("abcdef §{} - -", "0".repeat(62));
        // An expiry past what SystemTime holds: refused, not a panicking addition.
        let far = format!("abcdef {} {} -", "0".repeat(64), u64::MAX);
        for bad in [
            "abcdef",
            "abcdef zz - -",
            &format!("abcdef {} soon -", "0".repeat(64)),
            &wide_key,
            &far,
        ] {
            let err = JoinTokens::from_lines(&format!("\n{bad}\n")).err().expect(bad);
            assert!(err.to_string().contains("line 2"), "{err}");
        }
    }

    #[test]
    fn frames_decode_what_they_encode_and_refuse_cut_ones() {
        let frame = encode(&[b"a", b"", b"ccc"]);
        let fields = decode(&frame[4..]).unwrap();
        assert_eq!(fields, vec![&b"a"[..], b"", b"ccc"]);
        assert!(decode(&frame[4..frame.len() - 1]).is_err());
        assert!(decode(&[0, 0, 0]).is_err());
        assert!(decode(&[0, 0, 0, 9, 1]).is_err());
    }

    #[test]
    fn proofs_bind_the_side_the_channel_and_every_part() {
        let key = JoinToken::generate().key();
        let tag = key.tag(b"client", b"x", &[&b"node"[..], b"w1"]);
        assert!(key.verify(b"client", b"x", &[&b"node"[..], b"w1"], tag.as_ref()));
        assert!(!key.verify(b"head", b"x", &[&b"node"[..], b"w1"], tag.as_ref()));
        assert!(!key.verify(b"client", b"y", &[&b"node"[..], b"w1"], tag.as_ref()));
        assert!(!key.verify(b"client", b"x", &[&b"node"[..], b"w2"], tag.as_ref()));
        // Lengths are framed: moving a byte between parts changes the proof.
        assert!(!key.verify(b"client", b"x", &[&b"nodew"[..], b"1"], tag.as_ref()));
        assert!(!JoinToken::generate()
            .key()
            .verify(b"client", b"x", &[&b"node"[..], b"w1"], tag.as_ref()));
        let ca = b"authority";
        assert!(key.verify_authority(ca, &key.authority_proof(ca)));
        assert!(!key.verify_authority(b"another", &key.authority_proof(ca)));
    }

    /// A head answering joins on a loopback port: its address, identity and token desk.
    async fn head() -> (String, TlsIdentity, Arc<Mutex<JoinTokens>>, JoinToken) {
        head_with(Default::default()).await
    }

    /// [`head`] with the removed node names `removed`.
    async fn head_with(
        removed: crate::identity::RemovedNodes,
    ) -> (String, TlsIdentity, Arc<Mutex<JoinTokens>>, JoinToken) {
        let (address, identity, desk, token) = desk_with(removed).await;
        (address, identity, desk.tokens.clone(), token)
    }

    /// A head answering joins on a loopback port: its address, identity, desk and token.
    async fn desk_with(removed: crate::identity::RemovedNodes) -> (String, TlsIdentity, Arc<JoinDesk>, JoinToken) {
        let authorities = Authorities::first(ClusterCa::generate().unwrap());
        let identity = TlsIdentity::for_head(&authorities, removed, &[]).unwrap();
        let token = JoinToken::generate();
        let mut tokens = JoinTokens::default();
        tokens.insert(&token, None, None, "test");
        let desk = Arc::new(JoinDesk::new(authorities, identity.clone(), tokens, &token.id));
        let served = desk.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let acceptor = tokio_rustls::TlsAcceptor::from(identity.join.clone().unwrap());
        tokio::spawn(async move {
            while let Ok((tcp, peer)) = listener.accept().await {
                let (acceptor, desk) = (acceptor.clone(), served.clone());
                tokio::spawn(async move {
                    if let Ok(mut stream) = acceptor.accept(tcp).await {
                        let _ = answer_join(&mut stream, &desk, peer.ip()).await;
                    }
                });
            }
        });
        (address, identity, desk, token)
    }

    /// Runs a handshake between `client` and `server` over memory; the client's error.
    fn handshake(
        client: Arc<rustls::ClientConfig>,
        server: Arc<rustls::ServerConfig>,
        name: &'static str,
    ) -> std::result::Result<(), rustls::Error> {
        use rustls::{ClientConnection, Connection, ServerConnection};
        let name = ServerName::try_from(name).unwrap();
        let mut client = Connection::Client(ClientConnection::new(client, name).unwrap());
        let mut server = Connection::Server(ServerConnection::new(server).unwrap());
        fn pump(from: &mut Connection, to: &mut Connection) -> std::result::Result<(), rustls::Error> {
            let mut wire = Vec::new();
            while from.wants_write() {
                from.write_tls(&mut wire).unwrap();
            }
            let mut rest = &wire[..];
            while !rest.is_empty() {
                to.read_tls(&mut rest).unwrap();
                to.process_new_packets()?;
            }
            Ok(())
        }
        for _ in 0..8 {
            pump(&mut client, &mut server)?;
            pump(&mut server, &mut client)?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn a_joined_node_talks_to_the_head_but_cannot_pose_as_it() {
        let (address, head_identity, _, token) = head().await;
        let head = head_identity;
        let node = join(&address, &token, Some(head.cluster), &Role::Node("w1".into()))
            .await
            .expect("join");
        assert_eq!(node.cluster, head.cluster);
        assert!(node.https.is_none() && node.join.is_none());
        // The node reaches the head under the head's name, and the head the node.
        handshake(node.client.clone(), head.server.clone(), HEAD_NAME).expect("node to head");
        handshake(head.client.clone(), node.server.clone(), crate::ca::SERVER_NAME).expect("head to node");
        handshake(head.client.clone(), node.server.clone(), "w1.node.regatta").expect("by its own name");
        // A second node's connection to "the head" that reaches the first node fails.
        let other = join(&address, &token, None, &Role::Node("w2".into()))
            .await
            .expect("unpinned join");
        let posing = handshake(other.client.clone(), node.server.clone(), HEAD_NAME).expect_err("not the head");
        assert!(matches!(posing, rustls::Error::InvalidCertificate(_)), "{posing:?}");
        let wrong_node = handshake(other.client.clone(), node.server.clone(), "w3.node.regatta").expect_err("not w3");
        assert!(
            matches!(wrong_node, rustls::Error::InvalidCertificate(_)),
            "{wrong_node:?}"
        );
        // Another cluster's certificates are not accepted.
        let (_, stranger, _, _) = self::head().await;
        let refused = handshake(stranger.client.clone(), head.server.clone(), HEAD_NAME).expect_err("another CA");
        assert!(matches!(refused, rustls::Error::InvalidCertificate(_)), "{refused:?}");
    }

    #[test]
    fn a_worker_refuses_a_removed_nodes_certificate_once_told() {
        let ca = ClusterCa::generate().unwrap();
        let w1 = TlsIdentity::issued_by(&ca, &Role::Node("w1".into())).unwrap();
        let w2 = TlsIdentity::issued_by(&ca, &Role::Node("w2".into())).unwrap();
        handshake(w2.client.clone(), w1.server.clone(), "w1.node.regatta").expect("before the removal");
        w1.removed.write().unwrap().insert("w2".into());
        let refused = handshake(w2.client.clone(), w1.server.clone(), "w1.node.regatta").expect_err("after");
        assert!(
            matches!(
                refused,
                rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked)
            ),
            "{refused:?}"
        );
        // Other nodes are not touched.
        let w3 = TlsIdentity::issued_by(&ca, &Role::Node("w3".into())).unwrap();
        handshake(w3.client.clone(), w1.server.clone(), "w1.node.regatta").expect("w3");
    }

    #[tokio::test]
    async fn a_source_that_keeps_failing_to_join_is_throttled_even_with_the_right_token() {
        let (address, _, _, token) = head().await;
        let role = Role::Node("w9".into());
        let forged: JoinToken = format!("{}.{}", token.id, "0".repeat(32)).parse().unwrap();
        let unknown: JoinToken = format!("zzzzzz.{}", "0".repeat(32)).parse().unwrap();
        let mut refusals = Vec::new();
        for i in 0..=crate::FAILURE_BURST {
            let guess = if i % 2 == 0 { &forged } else { &unknown };
            let err = join(&address, guess, None, &role).await.expect_err("a guess");
            refusals.push(err.to_string());
        }
        let (burst, past) = refusals.split_at(crate::FAILURE_BURST as usize);
        assert!(
            burst
                .iter()
                .all(|e| e.contains("secret is wrong") || e.contains("knows no join token")),
            "{burst:?}"
        );
        assert!(past[0].contains("too many failed joins"), "{past:?}");
        // Past its share, the source is refused before its proof is looked at: the right
        // token too, until the bucket refills.
        let err = join(&address, &token, None, &role).await.expect_err("throttled");
        assert!(err.to_string().contains("too many failed joins"), "{err}");
    }

    #[tokio::test]
    async fn wrong_revoked_and_used_up_tokens_and_a_wrong_pin_are_refused() {
        let (address, head, tokens, token) = head().await;
        let role = Role::Client("c".into());
        let forged: JoinToken = format!("{}.{}", token.id, "0".repeat(32)).parse().unwrap();
        let err = join(&address, &forged, None, &role).await.expect_err("wrong secret");
        assert!(err.to_string().contains("secret is wrong"), "{err}");
        let other_pin = ClusterCa::generate().unwrap().hash();
        let err = join(&address, &token, Some(other_pin), &role)
            .await
            .expect_err("wrong pin");
        assert!(matches!(err, Error::JoinRefused(_)), "{err}");
        assert!(err.to_string().contains("pinned authority"), "{err}");
        let once = JoinToken::generate();
        tokens.lock().unwrap().insert(&once, None, Some(1), "once");
        join(&address, &once, Some(head.cluster), &role)
            .await
            .expect("first use");
        let err = join(&address, &once, None, &role).await.expect_err("second use");
        assert!(err.to_string().contains("no uses left"), "{err}");
        assert!(tokens.lock().unwrap().revoke(&token.id));
        let err = join(&address, &token, None, &role).await.expect_err("revoked");
        assert!(err.to_string().contains("knows no join token"), "{err}");
    }

    #[tokio::test]
    async fn a_process_renews_its_certificate_with_the_current_one_unless_removed() {
        let (address, head, _, token) = head().await;
        let node = join(&address, &token, Some(head.cluster), &Role::Node("w1".into()))
            .await
            .expect("join");
        let before = node.slot.expires();
        let old = node.slot.get();
        let after = renew(&address, &node).await.expect("renew");
        assert!(after >= before);
        let new = node.slot.get();
        assert_ne!(old.cert[0], new.cert[0], "a new certificate");
        assert_eq!(
            crate::ca::node_name_of(new.cert[0].as_ref()).as_deref(),
            Some("w1"),
            "the same name"
        );
        // Every configuration presents the new one: the head accepts it, and the node's
        // server side is reached under its own name still.
        handshake(node.client.clone(), head.server.clone(), HEAD_NAME).expect("node to head");
        handshake(head.client.clone(), node.server.clone(), "w1.node.regatta").expect("head to node");
        // A client renews as a client.
        let client = join(&address, &token, None, &Role::Client("c1".into()))
            .await
            .expect("join");
        renew(&address, &client).await.expect("a client renews");
        assert_eq!(
            crate::ca::role_of(client.slot.get().cert[0].as_ref()),
            Some(Role::Client("c1".into()))
        );
    }

    #[tokio::test]
    async fn a_rotation_moves_every_process_to_the_new_authority_without_a_restart() {
        let (address, head, desk, token) = desk_with(Default::default()).await;
        let old = desk.issuing_hash();
        let node = |name: &str| Role::Node(name.into());
        let w0 = join(&address, &token, Some(old), &node("w0")).await.expect("join");
        let w1 = join(&address, &token, Some(old), &node("w1")).await.expect("join");
        desk.rotate().expect("rotate");
        let new = desk.issuing_hash();
        assert_ne!(new, old);
        assert!(desk.rotate().is_err(), "one rotation at a time");
        // During the overlap a joiner pinning either authority joins, into the same cluster.
        let w2 = join(&address, &token, Some(old), &node("w2"))
            .await
            .expect("the old pin");
        let w3 = join(&address, &token, Some(new), &node("w3"))
            .await
            .expect("the new pin");
        for joined in [&w0, &w2, &w3] {
            assert_eq!(joined.cluster, head.cluster, "the cluster's id stays");
        }
        assert_eq!(w3.trust.hashes(), vec![new, old]);
        // w0 and w1 still trust only the old authority, and still accept the head's and the
        // newcomers' certificates of the new one (the cross-certificate goes with them),
        // as the newcomers accept theirs.
        handshake(w0.client.clone(), head.server.clone(), HEAD_NAME).expect("old to head");
        handshake(w0.client.clone(), w3.server.clone(), "w3.node.regatta").expect("old to new");
        handshake(w3.client.clone(), w0.server.clone(), "w0.node.regatta").expect("new to old");
        handshake(w2.client.clone(), w1.server.clone(), "w1.node.regatta").expect("new to old");
        // A renewal brings the new authority's certificate and trust.
        renew(&address, &w1).await.expect("renew");
        assert_eq!(w1.trust.hashes(), vec![new, old]);
        let presented = w1.slot.get();
        assert_eq!(presented.cert.len(), 2, "the certificate and the cross-certificate");
        // Finishing before the old certificates have expired is refused unless forced.
        let early = desk.finish(false).expect_err("too early");
        assert!(early.to_string().contains("--force"), "{early}");
        desk.finish(true).expect("forced");
        assert_eq!(desk.authorities().hashes(), vec![new]);
        // The head refuses a certificate of the old authority at once; a renewed process
        // does from its next renewal on.
        let refused = handshake(w0.client.clone(), head.server.clone(), HEAD_NAME).expect_err("old refused");
        assert!(
            matches!(
                refused,
                rustls::Error::InvalidCertificate(_) | rustls::Error::AlertReceived(_)
            ),
            "{refused:?}"
        );
        handshake(w1.client.clone(), head.server.clone(), HEAD_NAME).expect("renewed");
        renew(&address, &w1).await.expect("renew again");
        assert_eq!(w1.trust.hashes(), vec![new]);
        assert_eq!(w1.slot.get().cert.len(), 1);
        assert!(handshake(w0.client.clone(), w1.server.clone(), "w1.node.regatta").is_err());
        handshake(w3.client.clone(), w1.server.clone(), "w1.node.regatta").expect("new to new");
        assert!(renew(&address, &w0).await.is_err(), "an old certificate cannot renew");
        // A join pinned to the old authority is refused and says why.
        let gone = join(&address, &token, Some(old), &node("w4"))
            .await
            .expect_err("old pin");
        assert!(gone.to_string().contains("rotated away"), "{gone}");
        join(&address, &token, Some(new), &node("w4"))
            .await
            .expect("the new pin");
    }

    #[tokio::test]
    async fn a_removed_node_cannot_renew() {
        let removed = crate::identity::RemovedNodes::default();
        let (address, _, _, token) = head_with(removed.clone()).await;
        let node = join(&address, &token, None, &Role::Node("w2".into()))
            .await
            .expect("join");
        removed.write().unwrap().insert("w2".into());
        let err = renew(&address, &node).await.expect_err("removed");
        assert!(matches!(err, Error::JoinRefused(_)), "{err}");
        let err = join(&address, &token, None, &Role::Node("w2".into()))
            .await
            .expect_err("removed");
        assert!(err.to_string().contains("was removed"), "{err}");
    }

    #[tokio::test]
    async fn a_fake_head_without_the_secret_is_not_believed() {
        // A fake head: real TLS, an authority of its own, and it answers "ok" to anything
        // with a certificate for the joiner's key, but it does not know the secret.
        let ca = Arc::new(ClusterCa::generate().unwrap());
        let identity = TlsIdentity::for_head(
            &Authorities::first(ClusterCa::generate().unwrap()),
            Default::default(),
            &[],
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let acceptor = tokio_rustls::TlsAcceptor::from(identity.join.clone().unwrap());
        let guess = JoinToken::generate().key();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut stream = acceptor.accept(tcp).await.unwrap();
            let exporter = exporter(stream.get_ref().1).unwrap();
            let body = read_frame(&mut stream).await.unwrap();
            kept.lock().unwrap().push(body.clone());
            let fields = decode(&body).unwrap();
            let cert = ca
                .issue(&Role::Node("w".into()), fields[5], crate::ca::CERT_LIFETIME)
                .unwrap();
            let trusted = encode_certs(&[ca.certificate_der().clone()]);
            let cluster = ca.hash().0;
            let parts = head_proof_parts(&trusted, &cert, &cluster, &[]);
            let proof = guess.tag(b"head", &exporter, &parts);
            let reply = encode(&[
                b"ok",
                &trusted,
                &cert,
                proof.as_ref(),
                &60u64.to_be_bytes(),
                &cluster,
                &[],
            ]);
            stream.write_all(&reply).await.unwrap();
            stream.flush().await.unwrap();
        });
        let token = JoinToken::generate();
        let err = join(&address, &token, None, &Role::Node("w".into()))
            .await
            .expect_err("not believed");
        assert!(
            err.to_string().contains("without proving the join token's secret"),
            "{err}"
        );
        // What the fake head received holds the token's id, never its secret.
        let received = seen.lock().unwrap().concat();
        assert!(!received
            .windows(token.secret.len())
            .any(|w| w == token.secret.as_bytes()));
    }

    /// Bounded fuzzing (a fixed number of cases each run): the join's decoders and the
    /// desk never panic on any bytes, and a request changed anywhere is refused.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn desk() -> (JoinDesk, JoinToken) {
            let token = JoinToken::generate();
            let mut tokens = JoinTokens::default();
            tokens.insert(&token, None, None, "fuzz");
            let authorities = Authorities::first(ClusterCa::generate().unwrap());
            let head = TlsIdentity::for_head(&authorities, Default::default(), &[]).unwrap();
            let desk = JoinDesk::new(authorities, head, tokens, &token.id);
            (desk, token)
        }

        fn request(token: &JoinToken, exporter: &[u8], public_key: &[u8]) -> Vec<u8> {
            let proof = token.key().tag(b"client", exporter, &[&b"node"[..], b"w1", public_key]);
            encode(&[
                JOIN_ALPN,
                token.id.as_bytes(),
                proof.as_ref(),
                b"node",
                b"w1",
                public_key,
            ])[4..]
                .to_vec()
        }

        fn text() -> impl Strategy<Value = String> {
            proptest::collection::vec(any::<char>(), 0..120).prop_map(String::from_iter)
        }

        proptest! {
            #![proptest_config(crate::fuzz_config(256))]

            #[test]
            fn any_bytes_are_refused_without_a_panic(
                bytes in proptest::collection::vec(any::<u8>(), 0..600),
                exporter in any::<[u8; 32]>(),
            ) {
                let _ = decode(&bytes);
                let (desk, _) = desk();
                prop_assert!(grant(&bytes, &exporter, &desk).is_err());
            }

            #[test]
            fn a_request_changed_anywhere_is_refused(
                exporter in any::<[u8; 32]>(),
                public_key in any::<[u8; 32]>(),
                at in any::<prop::sample::Index>(),
                flip in 1u8..=255,
            ) {
                let (desk, token) = desk();
                let good = request(&token, &exporter, &public_key);
                let mut bad = good.clone();
                let i = at.index(bad.len());
                bad[i] ^= flip;
                prop_assert!(grant(&bad, &exporter, &desk).is_err(), "byte {} changed and accepted", i);
                // The same request on another connection (a relayed proof) is refused too.
                let mut elsewhere = exporter;
                elsewhere[0] ^= 1;
                prop_assert!(matches!(grant(&good, &elsewhere, &desk), Err(Refusal::WrongSecret)));
                // And the request itself passes (the check above is not vacuous); an
                // Ed25519 key of random bytes may not be a valid point: then the refusal
                // names the key.
                match grant(&good, &exporter, &desk) {
                    Ok(granted) => prop_assert_eq!(granted.role, Role::Node("w1".into())),
                    Err(Refusal::Malformed(why)) => prop_assert!(why.contains("certificate"), "{}", why),
                    Err(other) => prop_assert!(false, "{}", other),
                }
            }

            #[test]
            fn any_text_parses_or_is_refused_without_a_panic(text in text()) {
                let _ = text.parse::<JoinToken>();
                let _ = text.parse::<CaHash>();
                let _ = JoinTokens::from_lines(&text);
                let _ = Role::joining("node", &text);
            }
        }
    }
}
