//! Shared scaffolding for the integration tests: start a head and workers as real
//! processes of the `regatta` binary on loopback, connect a client, kill a worker.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use regatta::local::{LocalCluster, LocalOptions, WorkerSpec};
use regatta::Client;

pub mod browser;

/// Heartbeat timeout the tests run with, so node loss is seen quickly. Four heartbeat
/// intervals (500 ms): at two, one late heartbeat on a busy 2-core machine (a 2 GiB object
/// moving between workers) declared a live worker dead in a clean-clone CI run.
pub const HEARTBEAT_TIMEOUT_MS: u64 = 2_000;

/// A cluster under test plus a connected client. Its processes' logs are removed when a
/// test passes and kept (and named in the failure) when it fails.
pub struct TestCluster {
    pub local: LocalCluster,
    pub client: Client,
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.local.shutdown();
        let logs = self.local.log_path("head");
        let Some(dir) = logs.parent() else { return };
        if std::thread::panicking() {
            eprintln!("cluster logs kept in {}", dir.display());
        } else {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl TestCluster {
    /// Starts a head and one worker per `(name, resources)` and waits for all to register.
    pub async fn start(workers: &[(&str, &str)]) -> TestCluster {
        let specs = workers.iter().map(|(n, r)| WorkerSpec::new(n, r)).collect();
        Self::start_specs(specs, &[]).await
    }

    /// Starts a head with extra `head_args` and the given workers.
    pub async fn start_specs(specs: Vec<WorkerSpec>, head_args: &[&str]) -> TestCluster {
        let mut options = LocalOptions::new(specs).expect("local cluster options");
        options.binary = PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
        options.heartbeat_timeout_ms = HEARTBEAT_TIMEOUT_MS;
        options.head_args = head_args.iter().map(|a| a.to_string()).collect();
        let local = LocalCluster::start(options).expect("start head and workers");
        let client = match local.connect(Duration::from_secs(30)).await {
            Ok(client) => client,
            Err(e) => panic!("cluster did not come up: {e:#}\nhead log:\n{}", local.log("head")),
        };
        TestCluster { local, client }
    }

    /// Waits until `node` has the given state in the head's status.
    pub async fn wait_node_state(&self, node: &str, state: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.client.status().await.expect("status");
            if status.nodes.iter().any(|n| n.name == node && n.state == state) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {node} never became {state}: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Polls `check` until it returns `Some`, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Resident memory of a process in bytes (Linux).
#[allow(unused_imports)]
pub use regatta::bench::{peak_rss_bytes, rss_bytes};

/// A fresh empty directory under the system temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("regatta-test-{name}-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// The clock and a counter: the clock alone can repeat for two tests started at once.
fn rand_suffix() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let count = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{nanos}-{count}")
}

/// The `host:port` of an `http://` or `https://` base address.
pub fn host_of(base: &str) -> &str {
    base.trim_start_matches("https://")
        .trim_start_matches("http://")
        .trim_end_matches('/')
}

/// A raw HTTP/1.1 request: (status, body).
pub fn http(base: &str, method: &str, path: &str, token: Option<&str>, body: &[u8]) -> (u16, String) {
    let host = host_of(base);
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    let text = exchange(base, &request);
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, text)
}

/// Writes `request` to `base` (`http://` or `https://host:port`) and returns the whole
/// reply as text ("" when nothing answers). Over HTTPS this does not check the server's
/// certificate: these are tests of what the HTTP endpoints do; the job API's trust is
/// tested through `JobClient` and in tests/encryption.rs.
pub fn exchange(base: &str, request: &[u8]) -> String {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(host_of(base)) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let mut reply = Vec::new();
    if base.starts_with("https://") {
        let name = rustls::pki_types::ServerName::try_from("regatta-node").expect("a DNS name");
        let connection = rustls::ClientConnection::new(any_server_tls(), name).expect("TLS client");
        let mut tls = rustls::StreamOwned::new(connection, stream);
        // A server may answer and close before reading a whole (too large) request: read
        // the answer even when the write failed. An error after the reply (a close without
        // close_notify) keeps what was read.
        let _ = tls.write_all(request).and_then(|_| tls.flush());
        let _ = tls.read_to_end(&mut reply);
    } else {
        let _ = stream.write_all(request);
        let _ = stream.read_to_end(&mut reply);
    }
    String::from_utf8_lossy(&reply).to_string()
}

/// A TLS client configuration that accepts any server certificate (see [`exchange`]).
pub fn any_server_tls() -> std::sync::Arc<rustls::ClientConfig> {
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(AnyServer(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    std::sync::Arc::new(config)
}

/// Accepts any server certificate, still checking the handshake's signatures.
#[derive(Debug)]
pub struct AnyServer(pub std::sync::Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// An HTTP/1.1 GET over `http://` or `https://`: (status, body).
pub fn http_get(base: &str, path: &str) -> (u16, String) {
    let host = host_of(base);
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let text = exchange(base, request.as_bytes());
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, dechunk(&text, body))
}

fn dechunk(head: &str, body: String) -> String {
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return body;
    }
    let mut out = String::new();
    let mut rest = body.as_str();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// Percent-encodes a query parameter.
pub fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Runs the `regatta` binary with `args` (which include `--json`), asserts it succeeded
/// and returns the JSON summary it printed last.
pub fn run_json(args: &[&str]) -> serde_json::Value {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(args)
        .output()
        .expect("run regatta");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "regatta {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .expect("a JSON summary");
    serde_json::from_str(line).expect("the summary is JSON")
}

/// Starts moto's S3-compatible server on a free port and creates a bucket.
pub struct Moto {
    pub child: std::process::Child,
    pub endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn moto_server() -> std::path::PathBuf {
    let candidates = [
        std::env::var("REGATTA_MOTO_SERVER").ok(),
        std::env::var("HOME")
            .ok()
            .map(|h| format!("{h}/.cache/regatta/test-venv/bin/moto_server")),
    ];
    for candidate in candidates.into_iter().flatten() {
        if std::path::Path::new(&candidate).is_file() {
            return candidate.into();
        }
    }
    panic!("moto_server (S3-compatible test server) not found: run ./scripts/test.sh, which installs it, or set REGATTA_MOTO_SERVER");
}

pub async fn start_moto(bucket: &str) -> Moto {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    let child = std::process::Command::new(moto_server())
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start moto_server");
    let endpoint = format!("http://127.0.0.1:{port}");
    let moto = Moto { child, endpoint };
    let address = format!("127.0.0.1:{port}");
    let request =
        format!("PUT /{bucket} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    // moto is a Python server: under a loaded 2-core machine its start took over 30 s once.
    eventually("moto to create the bucket", Duration::from_secs(90), || {
        let (address, request) = (address.clone(), request.clone());
        async move {
            use std::io::{Read, Write};
            let mut stream = std::net::TcpStream::connect(&address).ok()?;
            stream.write_all(request.as_bytes()).ok()?;
            let mut reply = String::new();
            stream.read_to_string(&mut reply).ok()?;
            reply.starts_with("HTTP/1.1 200").then_some(())
        }
    })
    .await;
    moto
}

/// The text of every `*.errors.jsonl` file of a scoring or generating run's output.
pub fn errors_text(dir: &Path) -> String {
    let mut all = String::new();
    for entry in std::fs::read_dir(dir).expect("the output folder").flatten() {
        if entry.file_name().to_string_lossy().ends_with(".errors.jsonl") {
            all.push_str(&std::fs::read_to_string(entry.path()).expect("an errors file"));
        }
    }
    all
}

/// The numbers of the `tick N` lines of a log, which must run 0, 1, 2, ... with no gap.
pub fn ticks(log: &str) -> Vec<u64> {
    let numbers: Vec<u64> = log
        .lines()
        .filter_map(|l| l.strip_prefix("tick "))
        .map(|n| n.trim().parse().expect("a tick number"))
        .collect();
    for (i, n) in numbers.iter().enumerate() {
        assert_eq!(*n, i as u64, "the log lost or repeated a line around tick {i}: {log}");
    }
    numbers
}

/// An operator's own certificate authority and a leaf for `127.0.0.1` and `localhost`
/// signed by it, as PEM files in `dir`: (leaf, its key, the authority).
pub fn own_certificate(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, PKCS_ECDSA_P256_SHA256,
    };
    // Distinct names: OpenSSL (Python's clients) takes a leaf whose subject equals its
    // issuer's for a self-signed certificate.
    let named = |name: &str| {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        dn
    };
    let ca_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name = named("Regatta test authority");
    let ca = ca_params.self_signed(&ca_key).expect("CA");
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("key");
    let mut leaf_params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).expect("params");
    leaf_params.distinguished_name = named("regatta head");
    let leaf = leaf_params.signed_by(&key, &ca, &ca_key).expect("leaf");
    let (cert_file, key_file, ca_file) = (dir.join("cert.pem"), dir.join("key.pem"), dir.join("ca.pem"));
    std::fs::write(&cert_file, leaf.pem()).expect("write cert");
    std::fs::write(&key_file, key.serialize_pem()).expect("write key");
    std::fs::write(&ca_file, ca.pem()).expect("write CA");
    (cert_file, key_file, ca_file)
}
