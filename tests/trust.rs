//! The cluster's trust end to end: join tokens made on the head with a use limit and an
//! expiry, listed without their secrets, revoked, and still honoured after the head
//! restarts; a pinned authority hash that is not the head's refused; the authority the
//! same across a restart (docs/TRUST.md).

mod support;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::TestCluster;

/// Runs `regatta token ARGS` against the cluster's job API with its admin token.
fn token_command(cluster: &TestCluster, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_regatta"))
        .arg("token")
        .args(args)
        .args(["--address", &cluster.local.job_address])
        .env("REGATTA_TOKEN", &cluster.local.token)
        .env_remove("REGATTA_CA_HASH")
        .output()
        .expect("run regatta token")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).to_string()
}

/// Starts worker `name` with `token` (and `extra` arguments); returns its exit status if it
/// ended within `wait`, else `None` (it is running, and killed when `running` drops).
fn worker(
    cluster: &TestCluster,
    running: &mut Vec<KillOnDrop>,
    name: &str,
    token: &str,
    extra: &[&str],
    wait: Duration,
) -> Option<i32> {
    let mut args = vec![
        "worker",
        "--address",
        &cluster.local.address,
        "--name",
        name,
        "--bind",
        "127.0.0.1",
        "--advertise-host",
        "127.0.0.1",
        "--resources",
        "CPU=1",
    ];
    args.extend_from_slice(extra);
    let mut child = cluster
        .local
        .run_extra(&args, token, &format!("{name}.log"))
        .expect("start the worker");
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().expect("wait") {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Left running: the cluster's shutdown does not know it, so end it with the test.
    running.push(KillOnDrop(child));
    None
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
    }
}

fn ca_hash(listing: &str) -> String {
    listing
        .lines()
        .find_map(|l| l.strip_prefix("cluster authority "))
        .unwrap_or_else(|| panic!("no authority in {listing}"))
        .trim()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_tokens_are_limited_listed_revoked_and_kept_across_a_head_restart() {
    let mut cluster = TestCluster::start(&[("w1", "CPU=1")]).await;
    let mut running = Vec::new();

    // A one-use token, printed with the authority's hash to pin.
    let made = token_command(&cluster, &["create", "--uses", "1", "--description", "one GPU box"]);
    assert!(made.status.success(), "{made:?}");
    let once = stdout(&made).trim().to_string();
    let told = String::from_utf8_lossy(&made.stderr).to_string();
    let pin = told
        .split_whitespace()
        .find(|w| w.starts_with("sha256:"))
        .unwrap_or_else(|| panic!("no hash in {told}"))
        .to_string();
    assert_ne!(once, cluster.local.token);

    // It joins a worker, pinned; its second use is refused, and says why.
    assert_eq!(
        worker(
            &cluster,
            &mut running,
            "w2",
            &once,
            &["--ca-hash", &pin],
            Duration::from_secs(3)
        ),
        None
    );
    cluster.wait_node_state("w2", "alive", Duration::from_secs(30)).await;
    assert_eq!(
        worker(&cluster, &mut running, "w3", &once, &[], Duration::from_secs(20)),
        Some(2)
    );
    assert!(
        cluster.local.log("w3").contains("no uses left"),
        "{}",
        cluster.local.log("w3")
    );

    // The bootstrap token with another authority pinned: refused before anything is sent.
    let other = format!("sha256:{}", "0".repeat(64));
    assert_eq!(
        worker(
            &cluster,
            &mut running,
            "w4",
            &cluster.local.token,
            &["--ca-hash", &other],
            Duration::from_secs(20)
        ),
        Some(2)
    );
    assert!(
        cluster.local.log("w4").contains("pinned authority"),
        "{}",
        cluster.local.log("w4")
    );

    // The list names the tokens, never a secret.
    let listing = stdout(&token_command(&cluster, &["list"]));
    let (once_id, once_secret) = once.split_once('.').expect("id.secret");
    assert!(
        listing.contains(once_id) && listing.contains("one GPU box"),
        "{listing}"
    );
    assert!(listing.contains("[bootstrap]"), "{listing}");
    assert!(!listing.contains(once_secret), "a secret was listed: {listing}");
    let boot_secret = cluster.local.token.split('.').nth(1).expect("secret");
    assert!(!listing.contains(boot_secret), "a secret was listed: {listing}");
    assert_eq!(ca_hash(&listing), pin);

    // A revoked token joins nothing; revoking an unknown id says so.
    let revoked = stdout(&token_command(&cluster, &["create"])).trim().to_string();
    let revoked_id = revoked.split('.').next().expect("id").to_string();
    assert!(token_command(&cluster, &["revoke", &revoked_id]).status.success());
    assert!(!token_command(&cluster, &["revoke", &revoked_id]).status.success());
    assert_eq!(
        worker(&cluster, &mut running, "w5", &revoked, &[], Duration::from_secs(20)),
        Some(2)
    );
    assert!(
        cluster.local.log("w5").contains("knows no join token"),
        "{}",
        cluster.local.log("w5")
    );

    // A token made before the head restarts still works after, under the same authority.
    let kept = stdout(&token_command(&cluster, &["create", "--uses", "5"]))
        .trim()
        .to_string();
    cluster.local.restart_head().expect("restart the head");
    let after = support::eventually(
        "the restarted head lists its tokens",
        Duration::from_secs(30),
        || async {
            let out = token_command(&cluster, &["list"]);
            out.status.success().then(|| stdout(&out))
        },
    )
    .await;
    assert_eq!(ca_hash(&after), pin, "the authority is kept across a restart");
    assert!(!after.contains(&revoked_id), "a revoked token came back: {after}");
    let client = regatta::Client::connect(&cluster.local.address, &kept)
        .await
        .expect("a kept token joins the restarted head");
    client.status().await.expect("status");
    // The one-use token's spent use was kept too.
    assert_eq!(
        worker(&cluster, &mut running, "w6", &once, &[], Duration::from_secs(20)),
        Some(2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_node_is_dead_at_once_its_actor_moves_and_it_cannot_join_again() {
    use regatta::kinds::Echo;
    use regatta::{ActorOptions, Resources};
    let mut cluster = TestCluster::start(&[("w1", "CPU=1,spot=1"), ("w2", "CPU=1,spot=1")]).await;
    let mut running = Vec::new();
    let echo = cluster
        .client
        .spawn::<Echo>(
            "moved:".into(),
            ActorOptions::new()
                .resources(Resources::parse_request("spot=1").expect("resources"))
                .max_restarts(1),
        )
        .await
        .expect("spawn");
    let status = cluster.client.status().await.expect("status");
    let on = status
        .actors
        .iter()
        .find(|a| a.view.id == echo.id())
        .and_then(|a| a.view.node.clone())
        .expect("placed");

    let removed = token_command_with(&cluster, &["node", "remove", &on]);
    assert!(removed.status.success(), "{removed:?}");
    assert!(stdout(&removed).contains(&format!("removed {on}")), "{removed:?}");
    // Dead at once (well within the 2 s heartbeat timeout), its actor restarted elsewhere.
    cluster.wait_node_state(&on, "dead", Duration::from_secs(1)).await;
    let reply = support::eventually(
        "the actor answers from the other node",
        Duration::from_secs(30),
        || async { echo.call("still".into()).await.ok() },
    )
    .await;
    assert_eq!(reply.text, "moved:still");
    // The other worker learns of the removal from its heartbeats: its listeners refuse
    // the removed node's certificate from then on, not only the head's.
    let other = if on == "w1" { "w2" } else { "w1" };
    support::eventually(
        "the other worker refusing the removed node",
        Duration::from_secs(10),
        || async {
            let log = cluster.local.log(other);
            log.contains(&format!(
                "node removed from the cluster: its certificate is refused here from now on node={on}"
            ))
            .then_some(())
        },
    )
    .await;
    // The worker process is refused by the head and ends.
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster
        .local
        .processes_running()
        .iter()
        .any(|(name, running)| *name == on && *running)
    {
        assert!(Instant::now() < deadline, "the removed worker kept running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(cluster.local.log(&on).contains("removed"), "{}", cluster.local.log(&on));
    // Its name cannot join again, even with a valid token.
    let name = format!("{on}");
    assert_eq!(
        worker(
            &cluster,
            &mut running,
            &name,
            &cluster.local.token,
            &[],
            Duration::from_secs(20)
        ),
        Some(2)
    );
    assert!(
        cluster
            .local
            .log(&format!("{name}.log"))
            .contains("was removed from the cluster"),
        "{}",
        cluster.local.log(&format!("{name}.log"))
    );
    let status = cluster.client.status().await.expect("status");
    assert!(
        status.nodes.iter().any(|n| n.name == on && n.state == "dead"),
        "{status:?}"
    );
}

/// Runs `regatta ARGS` (a job API command) against the cluster with its admin token.
fn token_command_with(cluster: &TestCluster, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(args)
        .args(["--address", &cluster.local.job_address])
        .env("REGATTA_TOKEN", &cluster.local.token)
        .env_remove("REGATTA_CA_HASH")
        .output()
        .expect("run regatta")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_driver_gets_a_token_of_its_own_that_ends_with_the_job() {
    use regatta::{JobClient, JobStatus, JobSubmission};
    let cluster = TestCluster::start(&[("w1", "CPU=1")]).await;
    let jobs = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("job client");
    let mut submission = JobSubmission {
        entrypoint: "printenv REGATTA_TOKEN REGATTA_CA_HASH SECRET_SETTING".into(),
        ..Default::default()
    };
    submission
        .runtime_env
        .env_vars
        .insert("SECRET_SETTING".into(), "s3cr3t-value".into());
    let id = jobs.submit(&submission).await.expect("submit");
    let record = jobs.wait(&id, Duration::from_millis(100)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    let logs = jobs.logs(&id).await.expect("logs");
    let lines: Vec<&str> = logs.lines().collect();
    let [token, hash, secret] = lines[..] else {
        panic!("three lines: {logs}")
    };
    assert_eq!(secret, "s3cr3t-value", "the driver has its environment");
    assert_ne!(token, cluster.local.token, "not the bootstrap token");
    assert!(token.parse::<regatta::JoinToken>().is_ok(), "{token}");
    let listing = stdout(&token_command(&cluster, &["list"]));
    assert_eq!(ca_hash(&listing), hash);
    // The job has ended: its token joins nothing now.
    let refused = regatta::Client::connect(&cluster.local.address, token).await;
    assert!(
        matches!(&refused, Err(regatta::Error::TokenRefused { reason, .. }) if reason.contains("knows no join token")),
        "{:?}",
        refused.err()
    );
    // The job API names the environment's variables, not their values.
    let record = jobs.status(&id).await.expect("status");
    assert_eq!(record.runtime_env.env_vars["SECRET_SETTING"], "<hidden>");
    let listed = jobs.list().await.expect("list");
    assert!(!format!("{listed:?}").contains("s3cr3t-value"), "{listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_lived_certificates_are_renewed_before_they_expire() {
    use regatta::kinds::Echo;
    use regatta::local::WorkerSpec;
    use regatta::{ActorOptions, Resources};
    // Certificates valid 3 s: renewed about every 2 s.
    let cluster = TestCluster::start_specs(
        vec![WorkerSpec::new("w1", "CPU=1,spot=1")],
        &["--cert-lifetime-secs", "3"],
    )
    .await;
    let echo = cluster
        .client
        .spawn::<Echo>(
            "renewed:".into(),
            ActorOptions::new().resources(Resources::parse_request("spot=1").expect("resources")),
        )
        .await
        .expect("spawn");
    tokio::time::sleep(Duration::from_secs(8)).await;
    // A new client's first handshakes with w1 (its call channel) and the head check
    // certificates issued well after the first ones expired.
    let late = regatta::Client::connect(&cluster.local.address, &cluster.local.token)
        .await
        .expect("a new client joins");
    let handle = late.handle::<Echo>(echo.id());
    assert_eq!(handle.call("late".into()).await.expect("call w1").text, "renewed:late");
    // The first client renewed its own too: its new sessions still work.
    assert_eq!(echo.call("first".into()).await.expect("call").text, "renewed:first");
    let log = cluster.local.log("w1");
    assert!(log.matches("renewed this process's certificate").count() >= 2, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_inherits_the_allowlist_and_the_operators_names_not_the_nodes_secrets() {
    use regatta::local::WorkerSpec;
    use regatta::{JobClient, JobStatus, JobSubmission};
    let mut spec = WorkerSpec::new("w1", "CPU=2");
    spec.env = vec![
        ("AWS_SECRET_ACCESS_KEY".into(), "leaked-cloud-key".into()),
        ("DATABASE_URL".into(), "postgres://u:leaked@db".into()),
        ("WANDB_PROJECT".into(), "passed-project".into()),
        ("LC_TIME".into(), "C".into()),
    ];
    spec.args = vec!["--pass-env".into(), "WANDB_*".into()];
    let cluster = TestCluster::start_specs(vec![spec], &[]).await;
    let jobs = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("job client");
    // One CPU: the driver runs on w1, under its environment.
    let submission = JobSubmission {
        entrypoint: "env".into(),
        entrypoint_num_cpus: Some(1.0),
        ..Default::default()
    };
    let id = jobs.submit(&submission).await.expect("submit");
    let record = jobs.wait(&id, Duration::from_millis(100)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}");
    assert_eq!(record.driver_node_id.as_deref(), Some("w1"), "{record:?}");
    let logs = jobs.logs(&id).await.expect("logs");
    let names: Vec<&str> = logs.lines().filter_map(|l| l.split_once('=').map(|(k, _)| k)).collect();
    for present in ["PATH", "WANDB_PROJECT", "LC_TIME", "REGATTA_TOKEN", "REGATTA_ADDRESS"] {
        assert!(names.contains(&present), "{present} is missing: {names:?}");
    }
    for absent in ["AWS_SECRET_ACCESS_KEY", "DATABASE_URL", "CARGO_MANIFEST_DIR"] {
        assert!(!names.contains(&absent), "{absent} was passed on: {names:?}");
    }
    assert!(!logs.contains("leaked"), "{logs}");
    assert!(
        !logs.contains(&format!("REGATTA_TOKEN={}\n", cluster.local.token)),
        "the node's own token stays with it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_idle_connections_to_the_job_api_do_not_stop_a_worker_from_joining() {
    let cluster = TestCluster::start(&[("w1", "CPU=1")]).await;
    let api: std::net::SocketAddr = support::host_of(&cluster.local.job_address)
        .parse()
        .expect("the job API's address");
    // 2,000 connections that never send a byte, from eight /24s of loopback: more than
    // the job API serves at once.
    let mut idle = Vec::new();
    for i in 0..2_000u32 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(std::net::SocketAddr::from(([127, 0, (i % 8) as u8, 1], 0)))
            .expect("bind a loopback source");
        if let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_secs(5), socket.connect(api)).await {
            idle.push(stream);
        }
    }
    assert!(idle.len() > 1_024, "only {} connections opened", idle.len());
    // Meanwhile a worker joins (a token check and a certificate on the cluster port) and
    // registers.
    let mut running = Vec::new();
    let token = cluster.local.token.clone();
    assert_eq!(
        worker(&cluster, &mut running, "w2", &token, &[], Duration::from_millis(500)),
        None,
        "the worker runs"
    );
    cluster.wait_node_state("w2", "alive", Duration::from_secs(30)).await;
    let log = cluster.local.log("head");
    assert!(
        log.contains("closed a connection to the job API at once"),
        "the connections past the limit were closed: {log}"
    );
    // Once they go, the job API answers again.
    drop(idle);
    let jobs = regatta::JobClient::new(&cluster.local.job_address, &token).expect("job client");
    support::eventually("the job API answering", Duration::from_secs(30), || async {
        jobs.list().await.ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regatta_ca_prints_the_authority_that_lets_a_plain_tls_client_trust_the_dashboard() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    use std::io::{Read, Write};
    let cluster = TestCluster::start(&[("w1", "CPU=1")]).await;
    let ca = |pin: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_regatta"));
        command
            .args(["ca", "--address", &cluster.local.job_address])
            .env("REGATTA_TOKEN", &cluster.local.token)
            .env_remove("REGATTA_CA_HASH");
        if let Some(pin) = pin {
            command.args(["--ca-hash", pin]);
        }
        command.output().expect("regatta ca")
    };
    let output = ca(None);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let pem = stdout(&output);
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----\n"), "{pem}");
    let hash = ca_hash(&stdout(&token_command(&cluster, &["list"])));
    assert!(String::from_utf8_lossy(&output.stderr).contains(&hash));
    assert!(ca(Some(&hash)).status.success());
    let wrong = ca(Some(&format!("sha256:{}", "0".repeat(64))));
    assert!(!wrong.status.success());
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("not the pinned"));

    // A plain TLS client trusting that authority alone, with the usual name checks (a
    // browser that imported it), reaches the dashboard by the names browsers use.
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        roots.add(cert.expect("a PEM certificate")).expect("a root");
    }
    let config = std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let port: u16 = support::host_of(&cluster.local.job_address)
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the job API's port");
    let get = |name: &str| -> std::io::Result<String> {
        let server = ServerName::try_from(name.to_string()).expect("a server name");
        let connection = rustls::ClientConnection::new(config.clone(), server).map_err(std::io::Error::other)?;
        let tcp = std::net::TcpStream::connect(("127.0.0.1", port))?;
        let mut tls = rustls::StreamOwned::new(connection, tcp);
        tls.write_all(b"GET / HTTP/1.1\r\nHost: dashboard\r\nConnection: close\r\n\r\n")?;
        let mut text = Vec::new();
        let _ = tls.read_to_end(&mut text);
        if text.is_empty() {
            return Err(std::io::Error::other("no answer"));
        }
        Ok(String::from_utf8_lossy(&text).into_owned())
    };
    for name in ["127.0.0.1", "localhost"] {
        let page = get(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(page.starts_with("HTTP/1.1 200"), "{name}: {page}");
    }
    let refused = get("elsewhere.example.org");
    assert!(refused.is_err(), "a name the certificate does not carry: {refused:?}");
}

/// Runs `regatta ca ARGS` against the cluster's job API with its admin token.
fn ca_command(cluster: &TestCluster, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_regatta"))
        .arg("ca")
        .args(args)
        .args(["--address", &cluster.local.job_address])
        .env("REGATTA_TOKEN", &cluster.local.token)
        .env_remove("REGATTA_CA_HASH")
        .output()
        .expect("run regatta ca")
}

/// The hash on the line of `regatta ca show|rotate|finish` that starts with `role`.
fn authority_line(output: &Output, role: &str) -> String {
    stdout(output)
        .lines()
        .find_map(|l| l.strip_prefix(role))
        .map(|rest| rest.split_whitespace().next().unwrap_or_default().to_string())
        .unwrap_or_else(|| panic!("no {role} line in {output:?}"))
}

/// Whether a TLS handshake to the cluster port at `address` (of the process named `name`)
/// with `identity`'s client configuration goes through, the first read included (TLS 1.3
/// tells a refused client certificate there).
async fn handshake_with(address: &str, name: &str, identity: &regatta_net::TlsIdentity) -> bool {
    use tokio::io::AsyncReadExt;
    let (_, client) = identity.with_alpn(b"regatta-sessions/1");
    let Ok(tcp) = tokio::net::TcpStream::connect(address).await else {
        return false;
    };
    let name = rustls::pki_types::ServerName::try_from(name.to_string()).expect("name");
    let Ok(mut stream) = tokio_rustls::TlsConnector::from(client).connect(name, tcp).await else {
        return false;
    };
    let mut byte = [0u8; 1];
    !matches!(
        tokio::time::timeout(Duration::from_millis(500), stream.read(&mut byte)).await,
        Ok(Err(_) | Ok(0))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authority_rotates_without_a_restart_and_the_old_one_is_refused_once_finished() {
    use regatta::kinds::Echo;
    use regatta::local::WorkerSpec;
    use regatta::{ActorOptions, Resources};
    // Certificates valid 10 s: a rotation's overlap lasts that long.
    let mut cluster = TestCluster::start_specs(
        vec![WorkerSpec::new("w1", "CPU=1,spot=1"), WorkerSpec::new("w2", "CPU=1")],
        &["--cert-lifetime-secs", "10"],
    )
    .await;
    let mut running = Vec::new();
    let echo = cluster
        .client
        .spawn::<Echo>(
            "rotated:".into(),
            ActorOptions::new().resources(Resources::parse_request("spot=1").expect("resources")),
        )
        .await
        .expect("spawn");
    assert_eq!(echo.call("before".into()).await.expect("call").text, "rotated:before");
    let shown = ca_command(&cluster, &["show"]);
    assert!(shown.status.success(), "{shown:?}");
    let (cluster_id, old) = (authority_line(&shown, "cluster"), authority_line(&shown, "issuing"));
    assert_eq!(cluster_id, old, "a cluster is known by its first authority");
    // The old authority, as a leaked key would be: kept aside to forge a certificate later.
    let ca_dir = cluster.local.head_state_dir().join("ca");
    let leaked = support::temp_dir("leaked-ca");
    for file in ["ca.key", "ca.crt"] {
        std::fs::copy(ca_dir.join(file), leaked.join(file)).expect("copy the old authority");
    }

    // The rotation is the admin's: no bearer, no rotation; a bad finish body says why.
    let base = &cluster.local.job_address;
    let (code, _) = support::http(base, "POST", "/api/ca/rotate", None, b"");
    assert_eq!(code, 401);
    let token = Some(cluster.local.token.as_str());
    for body in [&b"{\"force\": 1}"[..], b"{\"forse\": true}", b"not json"] {
        let (code, text) = support::http(base, "POST", "/api/ca/finish", token, body);
        assert!(code == 400 && text.contains("a finish request"), "{code} {text}");
    }
    let (code, text) = support::http(base, "POST", "/api/ca/finish", token, b"");
    assert!(
        code == 409 && text.contains("no rotation is under way"),
        "{code} {text}"
    );
    let rotated = ca_command(&cluster, &["rotate"]);
    assert!(rotated.status.success(), "{rotated:?}");
    let new = authority_line(&rotated, "issuing");
    assert_ne!(new, old);
    assert_eq!(authority_line(&rotated, "retiring"), old);
    assert!(
        !ca_dir.join("ca.key").exists(),
        "the retiring authority's key is deleted"
    );
    let early = ca_command(&cluster, &["finish"]);
    assert!(
        !early.status.success(),
        "finished with certificates of the old one in use"
    );
    assert!(String::from_utf8_lossy(&early.stderr).contains("--force"), "{early:?}");
    // The workers hear of it from their next heartbeat and renew under the new authority at
    // once, not at two-thirds of their certificates' lives.
    for node in ["w1", "w2"] {
        support::eventually(
            &format!("{node} renewing under the new authority"),
            Duration::from_secs(5),
            || async {
                cluster
                    .local
                    .log(node)
                    .contains("renewed this process's certificate under the cluster's rotated authorities")
                    .then_some(())
            },
        )
        .await;
    }
    // During the overlap: a client that trusts only the old authority reaches w1, which now
    // presents a certificate of the new one; joiners pinning either authority join.
    assert_eq!(echo.call("during".into()).await.expect("call").text, "rotated:during");
    let pinned = |hash: &str| regatta::JoinCredentials::parse(&cluster.local.token, Some(hash)).expect("credentials");
    let pinned_old = regatta::Client::connect_credentials(&cluster.local.address, &pinned(&old))
        .await
        .expect("a client pinning the old authority joins during the overlap");
    let handle = pinned_old.handle::<Echo>(echo.id());
    assert_eq!(
        handle.call("old pin".into()).await.expect("call").text,
        "rotated:old pin"
    );
    assert_eq!(
        worker(
            &cluster,
            &mut running,
            "w3",
            &cluster.local.token,
            &["--ca-hash", &old],
            Duration::from_secs(3)
        ),
        None
    );
    cluster.wait_node_state("w3", "alive", Duration::from_secs(30)).await;
    let printed = ca_command(&cluster, &[]);
    assert!(printed.status.success(), "{printed:?}");
    assert_eq!(
        stdout(&printed).matches("-----BEGIN CERTIFICATE-----").count(),
        2,
        "both authorities"
    );
    let listing = stdout(&token_command(&cluster, &["list"]));
    assert!(listing.contains(&format!("retiring authority {old}")), "{listing}");

    // Once every certificate of the old authority has expired, the rotation finishes.
    support::eventually("the rotation finishing", Duration::from_secs(30), || async {
        ca_command(&cluster, &["finish"]).status.success().then_some(())
    })
    .await;
    let shown = ca_command(&cluster, &["show"]);
    assert_eq!(authority_line(&shown, "issuing"), new);
    assert_eq!(authority_line(&shown, "retiring"), "-");
    assert_eq!(authority_line(&shown, "cluster"), cluster_id, "the cluster's id stays");
    // A joiner pinning the old authority is refused and told why.
    assert_eq!(
        worker(
            &cluster,
            &mut running,
            "w4",
            &cluster.local.token,
            &["--ca-hash", &old],
            Duration::from_secs(20)
        ),
        Some(2)
    );
    assert!(
        cluster.local.log("w4").contains("rotated away"),
        "{}",
        cluster.local.log("w4")
    );
    // A certificate the leaked old key signs is refused by the head, and by a worker once it
    // has renewed; one of the new authority is not.
    let forged = regatta_net::TlsIdentity::issued_by(
        &regatta_net::ClusterCa::load_or_create(&leaked).expect("the leaked authority"),
        &regatta_net::Role::Node("w9".into()),
    )
    .expect("a forged certificate");
    let genuine = regatta_net::join(
        &cluster.local.address,
        &cluster.local.token.parse().expect("token"),
        None,
        &regatta_net::Role::Client("probe".into()),
    )
    .await
    .expect("join");
    let head = (cluster.local.address.as_str(), regatta_net::HEAD_NAME);
    let status = cluster.client.status().await.expect("status");
    let w1 = status
        .nodes
        .iter()
        .find(|n| n.name == "w1")
        .expect("w1")
        .address
        .clone();
    for (address, name) in [head, (w1.as_str(), "w1.node.regatta")] {
        assert!(
            handshake_with(address, name, &genuine).await,
            "{name} refused a genuine certificate"
        );
        assert!(
            !handshake_with(address, name, &forged).await,
            "{name} took a forged certificate"
        );
    }
    // Everything keeps working under the new authority, across a restart of the head.
    let pinned_new = regatta::Client::connect_credentials(&cluster.local.address, &pinned(&new))
        .await
        .expect("a client pinning the new authority joins");
    assert_eq!(
        pinned_new
            .handle::<Echo>(echo.id())
            .call("after".into())
            .await
            .expect("call")
            .text,
        "rotated:after"
    );
    cluster.local.restart_head().expect("restart the head");
    for node in ["w1", "w2", "w3"] {
        cluster.wait_node_state(node, "alive", Duration::from_secs(30)).await;
    }
    let shown = support::eventually("the restarted head's authorities", Duration::from_secs(30), || async {
        let out = ca_command(&cluster, &["show"]);
        out.status.success().then_some(out)
    })
    .await;
    assert_eq!(authority_line(&shown, "issuing"), new);
    assert_eq!(authority_line(&shown, "cluster"), cluster_id);
    assert_eq!(
        echo.call("restarted".into()).await.expect("call").text,
        "rotated:restarted"
    );
}
