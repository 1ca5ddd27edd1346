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
