//! Nothing the cluster's processes say to each other crosses the network in cleartext: a
//! capture of all loopback traffic (tcpdump, installed by `scripts/test.sh`) while a head
//! and two workers spawn a named actor with marked arguments, call it, move an object
//! between processes and call from one worker into the other holds none of the markers
//! nor the cluster token. A marker sent in cleartext on purpose proves the capture sees.
//!
//! And the cluster port refuses what does not prove the token at the TLS handshake: a
//! node of another cluster, plain bytes, a silent connection, a recorded session sent
//! again; the job API's HTTPS port answers plain HTTP with a pointer to HTTPS, refuses
//! another cluster's certificate, and a recorded submission sent again submits nothing.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use regatta::kinds::{Caller, Echo, Fanout, Noop, Store, StoreOp, StoreReply};
use regatta::{ActorOptions, CallPath, Client, Error, JobClient, JobStatus, JobSubmission, Resources};
use support::TestCluster;

fn pinned(node: &str) -> ActorOptions {
    ActorOptions::new().resources(Resources::parse_request(&format!("pin:{node}")).expect("resources"))
}

/// tcpdump writing every loopback TCP packet, whole, to `file`.
fn capture(file: &Path) -> Child {
    let tcpdump = ["/usr/bin/tcpdump", "/usr/sbin/tcpdump", "/sbin/tcpdump"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("tcpdump is installed (scripts/test.sh installs Debian's tcpdump)");
    let log = file.with_extension("log");
    let mut child = Command::new(tcpdump)
        // --immediate-mode: without it, packets on this sandbox's loopback were counted
        // "received by filter" and never written. -B: a 64 MiB kernel buffer (the test's
        // traffic is a few MB); with the default one, a loaded machine dropped packets.
        .args([
            "-i",
            "lo",
            "--immediate-mode",
            "-B",
            "65536",
            "-U",
            "-Z",
            "root",
            "-n",
            "-s",
            "0",
            "-w",
        ])
        .arg(file)
        .arg("tcp")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("tcpdump log"))
        .spawn()
        .expect("start tcpdump");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("listening on")
    {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "tcpdump exited ({status}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "tcpdump did not start capturing");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Stops tcpdump and returns its closing statistics.
fn stop(mut tcpdump: Child, log: &Path) -> String {
    let _ = Command::new("kill").args(["-INT", &tcpdump.id().to_string()]).status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while tcpdump.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = tcpdump.kill();
    let _ = tcpdump.wait();
    std::fs::read_to_string(log).unwrap_or_default()
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Bytes of TCP payload a pcap file (Ethernet framing, as tcpdump writes `lo`) holds in
/// IPv4 segments sent to `port`.
fn payload_to_port(pcap: &[u8], port: u16) -> usize {
    let u32_at = |at: usize| u32::from_le_bytes(pcap[at..at + 4].try_into().expect("4 bytes"));
    assert!(pcap.len() >= 24, "a pcap file has a 24-byte header");
    // Little-endian pcap (microsecond or nanosecond stamps) of link type 1, Ethernet.
    assert!(
        [0xa1b2_c3d4, 0xa1b2_3c4d].contains(&u32_at(0)) && u32_at(20) == 1,
        "not a little-endian Ethernet pcap: magic {:x}, link type {}",
        u32_at(0),
        u32_at(20)
    );
    let mut total = 0;
    let mut at = 24; // the file's header
    while at + 16 <= pcap.len() {
        let captured = u32_at(at + 8) as usize;
        let packet = &pcap[at + 16..(at + 16 + captured).min(pcap.len())];
        at += 16 + captured;
        // Ethernet (14 bytes) carrying IPv4 (0x0800) carrying TCP (6).
        if packet.len() < 14 + 20 || packet[12..14] != [0x08, 0x00] || packet[14 + 9] != 6 {
            continue;
        }
        let ip = &packet[14..];
        let ip_header = usize::from(ip[0] & 0x0f) * 4;
        let ip_total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        if ip.len() < ip_header + 20 {
            continue;
        }
        let tcp = &ip[ip_header..];
        let tcp_header = usize::from(tcp[12] >> 4) * 4;
        if u16::from_be_bytes([tcp[2], tcp[3]]) == port {
            total += ip_total.saturating_sub(ip_header + tcp_header);
        }
    }
    total
}

/// The TCP port of `node`'s call channel, from its log.
fn call_port(cluster: &TestCluster, node: &str) -> u16 {
    let log = cluster.local.log(node);
    let line = log
        .lines()
        .find(|l| l.contains("serving actor calls"))
        .unwrap_or_else(|| panic!("{node} serves actor calls: {log}"));
    let address = line
        .split_whitespace()
        .find_map(|word| word.strip_prefix("address="))
        .unwrap_or_else(|| panic!("no address in {line}"));
    address
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {address}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_marker_nor_the_token_crosses_loopback_in_cleartext() {
    let suffix = format!("{:x}", std::process::id() as u64 * 7919 + 0x5eed);
    let marker = |what: &str| format!("regatta-marker-{what}-{suffix}");
    let dir = std::env::temp_dir().join(format!("regatta-capture-{suffix}"));
    std::fs::create_dir_all(&dir).expect("capture dir");
    let pcap = dir.join("loopback.pcap");
    let tcpdump = capture(&pcap);

    // Objects between processes of one host go through shared memory, which no capture
    // sees: the processes started here (and this one) use the network path instead.
    std::env::set_var(regatta::NO_SHARED_MEMORY_ENV, "1");
    // Likewise calls between processes of one host ride a Unix socket, which no capture
    // sees either: here they take the call channel's TCP port.
    std::env::set_var(regatta::CALL_PATH_ENV, "tcp");
    let cluster = TestCluster::start(&[("w1", "CPU=4,pin:w1=1"), ("w2", "CPU=4,pin:w2=1")]).await;
    // A named actor with a marked argument on w1, called with a marked request, found by
    // its marked name.
    let echo = cluster
        .client
        .spawn::<Echo>(marker("argument"), pinned("w1").name(marker("name")))
        .await
        .expect("spawn the marked echo");
    // Over 96 KiB, so that the check below tells the call's bytes from a handshake's.
    let request = marker("request").repeat(4096);
    let reply = echo.call(request.clone()).await.expect("call the echo");
    assert_eq!(reply.text, format!("{}{request}", marker("argument")));
    // The same through the sessions (the path a caller falls back to).
    let by_session = cluster
        .client
        .with_call_path(CallPath::Session)
        .handle::<Echo>(echo.id());
    let reply = by_session
        .call(marker("session"))
        .await
        .expect("call through the sessions");
    assert_eq!(reply.text, format!("{}{}", marker("argument"), marker("session")));
    let found = cluster
        .client
        .named::<Echo>(&marker("name"))
        .await
        .expect("named lookup")
        .expect("the name resolves");
    assert_eq!(found.id(), echo.id());

    // An object put by the client and read on w2: the transfer between processes.
    let body = marker("object").repeat(4096);
    let reference = cluster
        .client
        .put_bytes(Bytes::from(body.clone()))
        .await
        .expect("put the marked object");
    let store = cluster
        .client
        .spawn::<Store>((), pinned("w2"))
        .await
        .expect("spawn a store on w2");
    match store.call(StoreOp::Get(reference.clone())).await.expect("get on w2") {
        StoreReply::Got { len, digest } => {
            assert_eq!(len, body.len() as u64);
            assert_eq!(digest, regatta::kinds::digest(body.as_bytes()));
        }
        other => panic!("get on w2: {other:?}"),
    }

    // An actor on w1 calling one on w2: the workers open a session to each other on first use.
    let noop = cluster
        .client
        .spawn::<Noop>((), pinned("w2"))
        .await
        .expect("spawn noop on w2");
    let caller = cluster
        .client
        .spawn::<Caller>((), pinned("w1"))
        .await
        .expect("spawn caller on w1");
    let calls = caller
        .call(Fanout {
            targets: vec![noop.id()],
            calls_per_target: 3,
            arg_bytes: 64 * 1024,
        })
        .await
        .expect("w1 calls into w2");
    assert_eq!(calls, 3);

    // A job submitted over the job API, with a marked environment value and the token.
    let jobs = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("job client");
    let mut submission = JobSubmission {
        entrypoint: "printenv REGATTA_TEST_MARKER".into(),
        ..Default::default()
    };
    submission
        .runtime_env
        .env_vars
        .insert("REGATTA_TEST_MARKER".into(), marker("environment"));
    let id = jobs.submit(&submission).await.expect("submit over HTTPS");
    let record = jobs
        .wait(&id, Duration::from_millis(100))
        .await
        .expect("wait for the job");
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    let logs = jobs.logs(&id).await.expect("logs over HTTPS");
    assert!(
        logs.contains(&marker("environment")),
        "the job saw its environment: {logs}"
    );

    // The control: one marker sent in cleartext over loopback, on purpose.
    let control = marker("control");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let mut plain = std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
    plain.write_all(control.as_bytes()).expect("write");
    plain.flush().expect("flush");
    drop(listener.accept().expect("accept"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let statistics = stop(tcpdump, &pcap.with_extension("log"));
    // An absence means something only in a whole capture.
    assert!(
        statistics.lines().any(|l| l.trim() == "0 packets dropped by kernel"),
        "tcpdump dropped packets: {statistics}"
    );

    let captured = std::fs::read(&pcap).expect("read the capture");
    assert!(
        contains(&captured, &control),
        "the capture holds the cleartext control marker ({} bytes captured)",
        captured.len()
    );
    assert!(
        captured.len() > body.len(),
        "the object's {} bytes crossed loopback ({} bytes captured)",
        body.len(),
        captured.len()
    );
    // The calls (over 96 KiB to each worker, against a few KiB for a handshake)
    // crossed loopback TCP, not a Unix socket the capture cannot see, so the request
    // marker's absence means something.
    for node in ["w1", "w2"] {
        let port = call_port(&cluster, node);
        let bytes = payload_to_port(&captured, port);
        assert!(
            bytes > 96 * 1024,
            "calls to {node} crossed its call port {port} over TCP ({bytes} bytes)"
        );
    }
    for what in ["argument", "request", "session", "name", "object", "environment"] {
        assert!(
            !contains(&captured, &marker(what)),
            "the {what} marker crossed loopback in cleartext"
        );
    }
    assert!(
        !contains(&captured, &cluster.local.token),
        "the cluster token crossed loopback in cleartext"
    );
    // Every worker and client joined with it during the capture: its secret never crossed
    // loopback in the clear either (the joins prove it with an HMAC inside TLS).
    let secret = cluster.local.token.split('.').nth(1).expect("a join token's secret");
    assert!(
        !contains(&captured, secret),
        "the join token's secret crossed loopback in cleartext"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_port_refuses_another_clusters_node_plain_bytes_and_silence() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let address = cluster.local.address.clone();
    // Held open and silent: must not keep anyone else out.
    let silent: Vec<_> = (0..8)
        .filter_map(|_| std::net::TcpStream::connect(&address).ok())
        .collect();
    // A whole ractor_cluster handshake in cleartext gets no session.
    let mut plain = std::net::TcpStream::connect(&address).expect("connect");
    let _ = plain.write_all(&[
        0, 0, 0, 0, 0, 0, 0, 12, 10, 10, b'r', b'e', b'g', b'a', b't', b't', b'a',
    ]);
    plain
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("read timeout");
    let mut answer = Vec::new();
    let closed = std::io::Read::read_to_end(&mut plain, &mut answer);
    assert!(
        !matches!(&closed, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "a cleartext handshake was left open: {closed:?}"
    );
    assert!(
        answer.is_empty() || answer[0] == 0x15,
        "a cleartext handshake got something other than a TLS alert: {answer:?}"
    );
    // A client of another cluster is refused at the join, by its token.
    let started = Instant::now();
    let other = Client::connect(&address, &regatta::JoinToken::generate().to_string()).await;
    assert!(
        matches!(other, Err(Error::TokenRefused { .. })),
        "a client with another token: {:?}",
        other.err()
    );
    assert!(started.elapsed() < Duration::from_secs(15), "refused promptly");
    // The right token still gets in while the silent connections are open: a new process
    // (one client per process, docs/NOTES.md).
    let mut status = cluster
        .local
        .run_extra(&["status", "--address", &address], &cluster.local.token, "status.log")
        .expect("run regatta status");
    let code = status.wait().expect("wait for regatta status");
    assert!(
        code.success(),
        "regatta status with the token: {}",
        cluster.local.log("status")
    );
    assert!(
        cluster.local.log("status").contains("w1"),
        "{}",
        cluster.local.log("status")
    );
    let echo = cluster
        .client
        .spawn::<Echo>("ok:".into(), ActorOptions::new())
        .await
        .expect("spawn");
    assert_eq!(echo.call("still".into()).await.expect("call").text, "ok:still");
    drop(silent);
    let head_log = cluster.local.log("head");
    assert!(
        head_log.contains("did not prove it belongs to the cluster"),
        "the head logs the refused handshakes:\n{head_log}"
    );
}

/// A GET of the job list with the cluster token over `config`: the raw reply, or the TLS
/// error that ended it.
fn list_jobs_over(config: std::sync::Arc<rustls::ClientConfig>, host: &str, token: &str) -> Result<String, String> {
    use std::io::Read;
    let stream = std::net::TcpStream::connect(host).map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("regatta-node").expect("a DNS name");
    let connection = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(connection, stream);
    let request =
        format!("GET /api/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    match tls.read_to_end(&mut reply) {
        Ok(_) => Ok(String::from_utf8_lossy(&reply).to_string()),
        Err(_) if reply.starts_with(b"HTTP/1.1") => Ok(String::from_utf8_lossy(&reply).to_string()),
        Err(e) => Err(e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_api_speaks_https_and_refuses_plain_http_and_another_clusters_certificate() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let base = cluster.local.job_address.clone();
    assert!(base.starts_with("https://"), "{base}");
    let host = support::host_of(&base).to_string();
    let token = cluster.local.token.clone();

    // The CLI's client trusts the token's authority: a list works, and so does a client
    // of another token not (it does not trust this head).
    let jobs = JobClient::new(&base, &token).expect("job client");
    jobs.list().await.expect("list over HTTPS");
    let stranger = JobClient::new(&base, "another-clusters-token").expect("job client");
    let err = stranger
        .list()
        .await
        .expect_err("another token's client does not trust this head");
    assert!(matches!(err, Error::Token(_)), "{err}");
    assert!(err.to_string().contains("certificate"), "{err}");

    // Plain HTTP gets a pointer to HTTPS, not a hang or a reset.
    let plain = support::exchange(
        &format!("http://{host}"),
        format!("GET /api/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    );
    assert!(plain.starts_with("HTTP/1.1 400"), "{plain}");
    assert!(plain.contains("speaks HTTPS"), "{plain}");
    assert!(
        !plain.contains("\"jobs\"") && !plain.contains("[]"),
        "no job data over plain HTTP: {plain}"
    );

    // Without a client certificate (as a browser): the token decides.
    let anonymous = list_jobs_over(support::any_server_tls(), &host, &token).expect("a client without a certificate");
    assert!(anonymous.starts_with("HTTP/1.1 200"), "{anonymous}");
    // With a certificate of another cluster's authority: refused at the handshake, even
    // with the right bearer token.
    let mut foreign = (*regatta_net::identity_from_secret("another-clusters-secret")
        .expect("identity")
        .client)
        .clone();
    foreign
        .dangerous()
        .set_certificate_verifier(std::sync::Arc::new(support::AnyServer(std::sync::Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))));
    foreign.alpn_protocols = vec![b"http/1.1".to_vec()];
    let refused = list_jobs_over(std::sync::Arc::new(foreign), &host, &token);
    assert!(
        refused.is_err(),
        "a certificate of another cluster was accepted: {refused:?}"
    );

    // The head is unharmed.
    jobs.list().await.expect("list still works");
    let echo = cluster
        .client
        .spawn::<Echo>("ok:".into(), ActorOptions::new())
        .await
        .expect("spawn");
    assert_eq!(echo.call("still".into()).await.expect("call").text, "ok:still");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_serves_the_operators_own_certificate_which_clients_trust_with_its_ca() {
    let dir = std::env::temp_dir().join(format!("regatta-own-cert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (cert_file, key_file, ca_file) = support::own_certificate(&dir);

    let cert_arg = cert_file.display().to_string();
    let key_arg = key_file.display().to_string();
    let cluster = TestCluster::start_specs(
        vec![regatta::local::WorkerSpec::new("w1", "CPU=1")],
        &["--tls-cert", &cert_arg, "--tls-key", &key_arg],
    )
    .await;
    let base = cluster.local.job_address.clone();
    let token = cluster.local.token.clone();
    let trusting = JobClient::with_ca(&base, &token, Some(&std::fs::read(&ca_file).expect("CA file")))
        .expect("job client with the CA");
    trusting
        .list()
        .await
        .expect("a client given the CA trusts the head's own certificate");
    // Without the CA, the token's authority alone does not vouch for it.
    let err = JobClient::new(&base, &token)
        .expect("client")
        .list()
        .await
        .expect_err("untrusted");
    assert!(matches!(err, Error::Token(_)), "{err}");
    assert!(err.to_string().contains("--ca-cert"), "{err}");
    // The CLI with --ca-cert.
    let mut list = cluster
        .local
        .run_extra(
            &[
                "job",
                "list",
                "--address",
                &base,
                "--ca-cert",
                &ca_file.display().to_string(),
            ],
            &token,
            "list.log",
        )
        .expect("regatta job list");
    assert!(list.wait().expect("wait").success(), "{}", cluster.local.log("list"));

    // A certificate file that is not one stops the head with a message naming it.
    std::fs::write(dir.join("bad.pem"), "not a certificate").expect("write");
    let bad = dir.join("bad.pem").display().to_string();
    let mut head = cluster
        .local
        .run_extra(
            &[
                "head",
                "--port",
                "0",
                "--job-port",
                "0",
                "--metrics-port",
                "0",
                "--no-cluster-state",
                "--state-dir",
                &dir.join("state").display().to_string(),
                "--tls-cert",
                &bad,
                "--tls-key",
                &key_arg,
            ],
            &token,
            "bad-head.log",
        )
        .expect("start a head with a bad certificate");
    let status = head.wait().expect("wait");
    assert!(!status.success(), "a head with a bad certificate file started");
    let log = cluster.local.log("bad-head");
    assert!(log.contains("bad.pem") && log.contains("certificate"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_started_with_insecure_serves_plain_http_says_so_loudly_and_https_clients_are_told_why() {
    let cluster = TestCluster::start_specs(vec![regatta::local::WorkerSpec::new("w1", "CPU=1")], &["--insecure"]).await;
    let token = cluster.local.token.clone();
    let plain = cluster.local.job_address.replacen("https://", "http://", 1);
    let jobs = JobClient::new(&plain, &token).expect("a client over http://");
    let id = jobs
        .submit(&JobSubmission {
            entrypoint: "echo plain".into(),
            ..Default::default()
        })
        .await
        .expect("a submission over plain HTTP");
    let record = jobs.wait(&id, Duration::from_millis(50)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    // The bearer token is still required over plain HTTP.
    let wrong = JobClient::new(&plain, "another-token")
        .expect("client")
        .list()
        .await
        .expect_err("a wrong token over plain HTTP");
    assert!(matches!(wrong, Error::Token(_)), "{wrong}");
    // A client expecting HTTPS is told the head may run with --insecure.
    let err = JobClient::new(&cluster.local.job_address, &token)
        .expect("client")
        .list()
        .await
        .expect_err("https:// to a plain HTTP head");
    assert!(err.to_string().contains("--insecure"), "{err}");
    let log = cluster.local.log("head");
    assert!(log.contains("THE JOB API SERVES PLAIN HTTP (--insecure)"), "{log}");
}

/// A TCP relay on a free loopback port to `target` that keeps, per connection, every byte
/// the client sent: what an eavesdropper on the path could record and send again.
fn recording_relay(target: String) -> (String, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a relay");
    let address = listener.local_addr().expect("relay address").to_string();
    let recorded: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let keep = recorded.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(&target) else {
                continue;
            };
            let index = {
                let mut all = keep.lock().expect("recording");
                all.push(Vec::new());
                all.len() - 1
            };
            let (mut from_client, mut to_server) =
                (client.try_clone().expect("clone"), server.try_clone().expect("clone"));
            let keep = keep.clone();
            std::thread::spawn(move || {
                let mut buffer = [0u8; 64 * 1024];
                while let Ok(n @ 1..) = from_client.read(&mut buffer) {
                    keep.lock().expect("recording")[index].extend_from_slice(&buffer[..n]);
                    if to_server.write_all(&buffer[..n]).is_err() {
                        break;
                    }
                }
                let _ = to_server.shutdown(std::net::Shutdown::Write);
            });
            let (mut from_server, mut to_client) = (server, client);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut from_server, &mut to_client);
                let _ = to_client.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    (address, recorded)
}

/// Sends `bytes` to `address` on a new connection and reads what comes back until the
/// peer closes or 3 s pass.
fn replay(address: &str, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(address).expect("connect for the replay");
    let _ = stream.set_read_timeout(Some(Duration::from_secs(3)));
    let _ = stream.write_all(bytes);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    answer
}

fn refusals(cluster: &TestCluster) -> usize {
    cluster
        .local
        .log("head")
        .matches("did not prove it belongs to the cluster")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_traffic_replayed_to_the_tls_ports_opens_no_session_and_submits_no_job() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;

    // A job submitted through the relay, then everything the client sent, sent again.
    let job_port = support::host_of(&cluster.local.job_address).to_string();
    let (relay, recorded) = recording_relay(job_port.clone());
    let through_relay = JobClient::new(&format!("https://{relay}"), &cluster.local.token).expect("client");
    let submission = JobSubmission {
        entrypoint: "echo once".into(),
        ..Default::default()
    };
    let id = through_relay
        .submit(&submission)
        .await
        .expect("a submission through the relay");
    drop(through_relay);
    let connections = recorded.lock().expect("recording").clone();
    assert!(
        connections.iter().any(|c| c.len() > 200),
        "the relay recorded the submission"
    );
    for bytes in &connections {
        let answer = replay(&job_port, bytes);
        assert!(!contains(&answer, "submission_id"), "a replay got an answer");
    }
    let api = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("client");
    let jobs = api.list().await.expect("list");
    assert_eq!(
        jobs.iter().map(|j| j.submission_id.clone()).collect::<Vec<_>>(),
        vec![id],
        "the replayed submission must not make a second job"
    );

    // A client's whole session with the head (a status through the relay), sent again.
    let (relay, recorded) = recording_relay(cluster.local.address.clone());
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["status", "--address", &relay])
        .env("REGATTA_TOKEN", &cluster.local.token)
        .output()
        .expect("regatta status");
    assert!(
        out.status.success(),
        "status through the relay: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = refusals(&cluster);
    let connections = recorded.lock().expect("recording").clone();
    assert!(!connections.is_empty(), "the relay recorded the session");
    for bytes in &connections {
        replay(&cluster.local.address, bytes);
    }
    support::eventually("the head to refuse the replays", Duration::from_secs(10), || async {
        (refusals(&cluster) >= before + connections.len()).then_some(())
    })
    .await;
    let status = cluster.client.status().await.expect("the head still answers");
    let clients = status.nodes.iter().filter(|n| n.state == "alive").count();
    assert_eq!(
        clients, 1,
        "the worker is alive and no replayed node joined: {status:?}"
    );
    let echo = cluster
        .client
        .spawn::<Echo>("ok:".into(), ActorOptions::new())
        .await
        .expect("spawn still works");
    assert_eq!(
        echo.call("still here".into()).await.expect("call").text,
        "ok:still here"
    );
}
