//! Shared scaffolding for the integration tests: start a head and workers as real
//! processes of the `regatta` binary on loopback, connect a client, kill a worker.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use regatta::local::{LocalCluster, LocalOptions, WorkerSpec};
use regatta::Client;

/// Heartbeat timeout the tests run with, so node loss is seen quickly.
pub const HEARTBEAT_TIMEOUT_MS: u64 = 1_000;

/// A cluster under test plus a connected client.
pub struct TestCluster {
    pub local: LocalCluster,
    pub client: Client,
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
            assert!(Instant::now() < deadline, "node {node} never became {state}: {status:?}");
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
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// A fresh empty directory under the system temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("regatta-test-{name}-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
