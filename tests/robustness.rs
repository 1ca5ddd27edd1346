//! Bad input from outside: wrong tokens, garbage bytes, truncated frames and well-formed
//! messages of the wrong type never crash or wedge a node.

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use regatta::kinds::{Counter, CounterOp, CounterReply};
use regatta::{ActorOptions, Client, Error};
use support::TestCluster;

async fn assert_cluster_works(cluster: &TestCluster, nodes: usize) {
    let status = cluster.client.status().await.expect("the head still answers");
    let alive = status.nodes.iter().filter(|n| n.state == "alive").count();
    assert_eq!(alive, nodes, "every node still alive: {status:?}");
    let counter = cluster
        .client
        .spawn::<Counter>(41, ActorOptions::new())
        .await
        .expect("spawn still works");
    assert_eq!(
        counter.call(CounterOp::Add(1)).await.expect("call still works"),
        CounterReply::Total(42)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_the_wrong_token_is_refused_and_both_sides_log_it() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let mut intruder = cluster
        .local
        .run_extra(
            &[
                "worker",
                "--address",
                &cluster.local.address,
                "--name",
                "intruder",
                "--bind",
                "127.0.0.1",
                "--advertise-host",
                "127.0.0.1",
            ],
            &regatta::JoinToken::generate().to_string(),
            "intruder.log",
        )
        .expect("start intruder");
    let deadline = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(status) = intruder.try_wait().expect("wait") {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = intruder.kill();
            panic!("the refused worker kept running:\n{}", cluster.local.log("intruder"));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(2), "a refused token exits with status 2");
    let worker_log = cluster.local.log("intruder");
    assert!(
        worker_log.contains("refused this process") && worker_log.contains("knows no join token"),
        "worker log:\n{worker_log}"
    );
    let head_log = cluster.local.log("head");
    assert!(
        head_log.contains("did not prove it belongs to the cluster") && head_log.contains("knows no join token"),
        "head log:\n{head_log}"
    );

    // The right id with another secret: refused for the secret.
    let id = cluster.local.token.split('.').next().expect("an id").to_string();
    let forged = format!("{id}.{}", "7".repeat(32));
    let client = Client::connect(&cluster.local.address, &forged).await;
    assert!(
        matches!(&client, Err(Error::TokenRefused { reason, .. }) if reason.contains("secret is wrong")),
        "client with a wrong secret: {:?}",
        client.err()
    );
    // A token that is not a join token at all (an older Regatta's): told so before any
    // connection.
    let client = Client::connect(&cluster.local.address, "also-wrong").await;
    assert!(
        matches!(&client, Err(Error::Token(why)) if why.contains("regatta token generate")),
        "client with an old-style token: {:?}",
        client.err()
    );

    let status = cluster.client.status().await.expect("status");
    assert!(
        status.nodes.iter().all(|n| n.name != "intruder"),
        "the intruder never joined"
    );
    assert_cluster_works(&cluster, 1).await;
}

fn send(address: &str, bytes: &[u8]) {
    if let Ok(mut stream) = TcpStream::connect(address) {
        let _ = stream.write_all(bytes);
        let _ = stream.flush();
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn frame(length: u64, body: &[u8]) -> Vec<u8> {
    let mut bytes = length.to_be_bytes().to_vec();
    bytes.extend_from_slice(body);
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_bytes_and_bad_frames_on_any_node_port_are_survived() {
    let mut cluster = TestCluster::start(&[("w1", "CPU=2"), ("w2", "CPU=2")]).await;
    let status = cluster.client.status().await.expect("status");
    let mut ports = vec![cluster.local.address.clone()];
    ports.extend(status.nodes.iter().map(|n| n.address.clone()));
    // The job API's HTTPS port too.
    ports.push(support::host_of(&cluster.local.job_address).to_string());

    let mut noise = vec![0u8; 64 * 1024];
    let mut x: u32 = 0x1234_5678;
    for byte in noise.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *byte = x as u8;
    }
    // Held open and silent for the whole test: must not wedge anything.
    let idle: Vec<TcpStream> = ports.iter().filter_map(|p| TcpStream::connect(p).ok()).collect();
    for address in &ports {
        send(address, &noise);
        send(address, &frame(u64::MAX, b"x"));
        send(address, &frame(1 << 40, b"xyz"));
        send(address, &frame(100, &[7u8; 10]));
        send(address, &frame(16, &[0xff; 16]));
        send(address, &frame(0, b""));
        send(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    }
    // Give the head longer than a heartbeat timeout to notice any node that went down.
    tokio::time::sleep(Duration::from_millis(support::HEARTBEAT_TIMEOUT_MS + 300)).await;
    for (name, running) in cluster.local.processes_running() {
        assert!(running, "{name} died from garbage:\n{}", cluster.local.log(&name));
    }
    assert_cluster_works(&cluster, 2).await;
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn well_formed_messages_of_the_wrong_type_get_an_error_reply() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let counter = cluster
        .client
        .spawn::<Counter>(0, ActorOptions::new())
        .await
        .expect("spawn");
    counter.call(CounterOp::Get).await.expect("alive");
    let targets = [
        "head".to_string(),
        "agent/w1".to_string(),
        format!("actor/{}", counter.id()),
    ];
    for target in &targets {
        for junk in [
            vec![],
            vec![0xff; 3],
            vec![9, 0, 0, 0, 0, 0, 0, 0, 1, 2],
            b"{\"json\": true}".to_vec(),
        ] {
            let reply = cluster.client.send_raw(target, junk.clone()).await;
            let reply = reply.unwrap_or_else(|e| panic!("{target} did not answer {junk:?}: {e}"));
            let text = String::from_utf8_lossy(&reply);
            assert!(
                text.contains("could not decode"),
                "{target} answered {junk:?} with {text}"
            );
        }
    }
    // A typed handle of the wrong kind is refused before anything is sent.
    let wrong = cluster.client.handle::<regatta::kinds::Echo>(counter.id());
    let err = wrong.call("hi".into()).await.err().expect("kind mismatch");
    assert!(err.to_string().contains("is of kind 'counter', not 'echo'"), "{err}");
    assert_eq!(
        counter.call(CounterOp::Add(3)).await.expect("actor survived"),
        CounterReply::Total(3)
    );
    assert_cluster_works(&cluster, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_rejoin_a_restarted_head() {
    let mut cluster = TestCluster::start(&[("w1", "CPU=2"), ("w2", "CPU=2")]).await;
    cluster.local.restart_head().expect("restart the head");
    let address = cluster.local.address.clone();
    let token = cluster.local.token.clone();
    let client = support::eventually("a client of the new head", Duration::from_secs(10), || {
        let (address, token) = (address.clone(), token.clone());
        async move { Client::connect(&address, &token).await.ok() }
    })
    .await;
    let names = vec!["w1".to_string(), "w2".to_string()];
    regatta::local::wait_for_nodes(&client, &names, Duration::from_secs(15))
        .await
        .expect("both workers registered again with the new head");
    let counter = client
        .spawn::<Counter>(1, ActorOptions::new())
        .await
        .expect("spawn on the new head");
    assert_eq!(
        counter.call(CounterOp::Get).await.expect("call"),
        CounterReply::Total(1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_get_a_clear_error_and_the_session_survives() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let echo = cluster
        .client
        .spawn::<regatta::kinds::Echo>(String::new(), ActorOptions::new())
        .await
        .expect("spawn");
    let huge = "x".repeat(20 << 20);
    let err = echo.call(huge).await.err().expect("a 20 MiB message is refused");
    assert!(err.to_string().contains("object store"), "{err}");
    let reply = echo
        .call("still here".into())
        .await
        .expect("the session to the worker survived");
    assert_eq!(reply.text, "still here");
    assert_cluster_works(&cluster, 1).await;
}

/// `regatta head` with a ready file: on a port another process holds it exits with
/// `EXIT_ADDRESS_IN_USE` and writes no file (a supervisor then picks other ports, as
/// `LocalCluster` does); on free ports it writes its cluster address, whole, once it listens.
#[test]
fn a_head_tells_a_taken_port_by_its_exit_status_and_readiness_by_its_file() {
    let dir = support::temp_dir("ready-file");
    let ready = dir.join("head.ready");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port to hold");
    let port = taken.local_addr().expect("its address").port().to_string();
    let head = |port: &str| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_regatta"));
        command
            .args([
                "head",
                "--bind",
                "127.0.0.1",
                "--port",
                port,
                "--no-job-api",
                "--metrics-port",
                "0",
            ])
            .args([
                "--no-cluster-state",
                "--token",
                "readyf.0123456789abcdef0123456789abcdef",
                "--state-dir",
            ])
            .arg(dir.join("state"))
            .arg("--ready-file")
            .arg(&ready)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        command
    };

    let refused = head(&port).output().expect("run regatta head");
    assert_eq!(
        refused.status.code(),
        Some(i32::from(regatta::local::EXIT_ADDRESS_IN_USE)),
        "stderr: {}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains(&port),
        "the error names the port"
    );
    assert!(!ready.exists(), "no ready file from a head that never listened");

    let mut child = head("0").spawn().expect("start regatta head");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(
            child.try_wait().expect("wait").is_none(),
            "the head exited before it was ready"
        );
        assert!(Instant::now() < deadline, "no ready file after 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let address = std::fs::read_to_string(&ready).expect("read the ready file");
    let connected = TcpStream::connect(address.trim());
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    connected.unwrap_or_else(|e| panic!("the ready file's address {address:?} takes no connection: {e}"));
}
