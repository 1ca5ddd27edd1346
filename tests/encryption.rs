//! Nothing the cluster's processes say to each other crosses the network in cleartext: a
//! capture of all loopback traffic (tcpdump, installed by `scripts/test.sh`) while a head
//! and two workers spawn a named actor with marked arguments, call it, move an object
//! between processes and call from one worker into the other holds none of the markers
//! nor the cluster token. A marker sent in cleartext on purpose proves the capture sees.
//!
//! And the cluster port refuses what does not prove the token at the TLS handshake: a
//! node of another cluster, plain bytes, a silent connection.

mod support;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use regatta::kinds::{Caller, Echo, Fanout, Noop, Store, StoreOp, StoreReply};
use regatta::{ActorOptions, CallPath, Client, Error, Resources};
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
        // "received by filter" and never written.
        .args(["-i", "lo", "--immediate-mode", "-U", "-Z", "root", "-n", "-s", "0", "-w"])
        .arg(file)
        .arg("tcp")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("tcpdump log"))
        .spawn()
        .expect("start tcpdump");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&log).unwrap_or_default().contains("listening on") {
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

fn stop(mut tcpdump: Child) {
    let _ = Command::new("kill").args(["-INT", &tcpdump.id().to_string()]).status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while tcpdump.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = tcpdump.kill();
    let _ = tcpdump.wait();
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
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
    let cluster = TestCluster::start(&[("w1", "CPU=4,pin:w1=1"), ("w2", "CPU=4,pin:w2=1")]).await;
    // A named actor with a marked argument on w1, called with a marked request, found by
    // its marked name.
    let echo = cluster
        .client
        .spawn::<Echo>(marker("argument"), pinned("w1").name(marker("name")))
        .await
        .expect("spawn the marked echo");
    let reply = echo.call(marker("request")).await.expect("call the echo");
    assert_eq!(reply.text, format!("{}{}", marker("argument"), marker("request")));
    // The same through the sessions (the path a caller falls back to).
    let by_session = cluster.client.with_call_path(CallPath::Session).handle::<Echo>(echo.id());
    let reply = by_session.call(marker("session")).await.expect("call through the sessions");
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
    let store = cluster.client.spawn::<Store>((), pinned("w2")).await.expect("spawn a store on w2");
    match store.call(StoreOp::Get(reference.clone())).await.expect("get on w2") {
        StoreReply::Got { len, digest } => {
            assert_eq!(len, body.len() as u64);
            assert_eq!(digest, regatta::kinds::digest(body.as_bytes()));
        }
        other => panic!("get on w2: {other:?}"),
    }

    // An actor on w1 calling one on w2: the workers open a session to each other on first use.
    let noop = cluster.client.spawn::<Noop>((), pinned("w2")).await.expect("spawn noop on w2");
    let caller = cluster.client.spawn::<Caller>((), pinned("w1")).await.expect("spawn caller on w1");
    let calls = caller
        .call(Fanout {
            targets: vec![noop.id()],
            calls_per_target: 3,
            arg_bytes: 16,
        })
        .await
        .expect("w1 calls into w2");
    assert_eq!(calls, 3);

    // The control: one marker sent in cleartext over loopback, on purpose.
    let control = marker("control");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let mut plain = std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
    plain.write_all(control.as_bytes()).expect("write");
    plain.flush().expect("flush");
    drop(listener.accept().expect("accept"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop(tcpdump);

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
    for what in ["argument", "request", "session", "name", "object"] {
        assert!(!contains(&captured, &marker(what)), "the {what} marker crossed loopback in cleartext");
    }
    assert!(
        !contains(&captured, &cluster.local.token),
        "the cluster token crossed loopback in cleartext"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_port_refuses_another_clusters_node_plain_bytes_and_silence() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let address = cluster.local.address.clone();
    // Held open and silent: must not keep anyone else out.
    let silent: Vec<_> = (0..8).filter_map(|_| std::net::TcpStream::connect(&address).ok()).collect();
    // A whole ractor_cluster handshake in cleartext gets no session.
    let mut plain = std::net::TcpStream::connect(&address).expect("connect");
    let _ = plain.write_all(&[0, 0, 0, 0, 0, 0, 0, 12, 10, 10, b'r', b'e', b'g', b'a', b't', b't', b'a']);
    // A client of another cluster is refused at the handshake, by its token.
    let started = Instant::now();
    let other = Client::connect(&address, "another-clusters-token").await;
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
    assert!(code.success(), "regatta status with the token: {}", cluster.local.log("status"));
    assert!(cluster.local.log("status").contains("w1"), "{}", cluster.local.log("status"));
    let echo = cluster.client.spawn::<Echo>("ok:".into(), ActorOptions::new()).await.expect("spawn");
    assert_eq!(echo.call("still".into()).await.expect("call").text, "ok:still");
    drop(silent);
    let head_log = cluster.local.log("head");
    assert!(
        head_log.contains("did not prove the cluster token"),
        "the head logs the refused handshakes:\n{head_log}"
    );
}
