//! A cluster on this machine: a head and workers as separate `regatta` processes on
//! loopback, for the demo job, the examples and the tests. Dropping it stops every process
//! it started.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use regatta_runtime::{Client, ClusterStatus};

/// One worker to start: its name and declared resources.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// Node name.
    pub name: String,
    /// `--resources` value (overrides detected amounts).
    pub resources: String,
    /// Extra command-line arguments.
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// The loopback address it binds and advertises (default `127.0.0.1`): workers on
    /// different addresses of `127.0.0.0/8` stand for workers on different hosts (their
    /// objects still travel through shared memory unless that is turned off).
    pub host: String,
}

impl WorkerSpec {
    /// A worker named `name` declaring `resources`.
    pub fn new(name: &str, resources: &str) -> Self {
        Self {
            name: name.into(),
            resources: resources.into(),
            args: Vec::new(),
            env: Vec::new(),
            host: "127.0.0.1".into(),
        }
    }

    /// Binds and advertises `host` (an address of `127.0.0.0/8`) instead of `127.0.0.1`.
    pub fn host(mut self, host: &str) -> Self {
        self.host = host.into();
        self
    }

    /// Adds command-line arguments.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// How to start a local cluster.
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// The `regatta` binary to run.
    pub binary: PathBuf,
    /// Workers to start.
    pub workers: Vec<WorkerSpec>,
    /// Head's heartbeat timeout.
    pub heartbeat_timeout_ms: u64,
    /// Where process logs go (one file per process).
    pub log_dir: PathBuf,
    /// The cluster token (random when `None`).
    pub token: Option<String>,
    /// Extra head arguments.
    pub head_args: Vec<String>,
}

impl LocalOptions {
    /// Two CPU workers, logs under the system temp dir, binary found by [`find_binary`].
    pub fn new(workers: Vec<WorkerSpec>) -> anyhow::Result<Self> {
        Ok(Self::with_binary(workers, find_binary()?))
    }

    /// [`LocalOptions::new`] running a given `regatta` binary.
    pub fn with_binary(workers: Vec<WorkerSpec>, binary: PathBuf) -> Self {
        let log_dir = std::env::temp_dir().join(format!("regatta-local-{}-{}", std::process::id(), unique()));
        Self {
            binary,
            workers,
            heartbeat_timeout_ms: 3_000,
            log_dir,
            token: None,
            head_args: Vec::new(),
        }
    }
}

/// Finds the `regatta` binary: `$REGATTA_BIN`, this executable when it is `regatta`, a
/// `regatta` next to this executable or one folder up (cargo's `examples/` and `deps/`),
/// then `$PATH`.
pub fn find_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("REGATTA_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().context("cannot find this executable")?;
    if exe.file_name().is_some_and(|n| n == "regatta") {
        return Ok(exe);
    }
    for dir in exe.ancestors().skip(1).take(2) {
        let candidate = dir.join("regatta");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("regatta");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    bail!("cannot find the regatta binary: build it with `cargo build --release` or set REGATTA_BIN")
}

/// A name part no other call in this process returns: a counter beside the clock. The clock
/// alone repeated once when two tests started clusters at the same instant (a coarse clock
/// on the CI machine), and the second head found the first one's state directory locked.
fn unique() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let count = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{nanos}-{count}")
}

/// A running local cluster.
pub struct LocalCluster {
    options: LocalOptions,
    head: Child,
    workers: Vec<Option<Child>>,
    /// The head's cluster address.
    pub address: String,
    /// The cluster token.
    pub token: String,
    /// The head's job API, `https://127.0.0.1:PORT`.
    pub job_address: String,
    /// The head's metrics and service discovery, `http://127.0.0.1:PORT`.
    pub metrics_address: String,
    stopped: bool,
}

impl LocalCluster {
    /// Starts the head and every worker (it does not wait for them: see [`Self::wait_ready`]).
    pub fn start(options: LocalOptions) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&options.log_dir)
            .with_context(|| format!("cannot create {}", options.log_dir.display()))?;
        let token = options
            .token
            .clone()
            .unwrap_or_else(|| regatta_runtime::JoinToken::generate().to_string());
        let (head, [port, job_port, metrics_port]) = start_head(&options, &token)?;
        let address = format!("127.0.0.1:{port}");
        let mut cluster = Self {
            head,
            workers: Vec::new(),
            address,
            token,
            job_address: format!("https://127.0.0.1:{job_port}"),
            metrics_address: format!("http://127.0.0.1:{metrics_port}"),
            stopped: false,
            options,
        };
        for index in 0..cluster.options.workers.len() {
            let child = cluster.spawn_worker(index)?;
            cluster.workers.push(Some(child));
        }
        Ok(cluster)
    }

    fn spawn_worker(&self, index: usize) -> anyhow::Result<Child> {
        let spec = &self.options.workers[index];
        let mut args: Vec<String> = [
            "worker",
            "--address",
            &self.address,
            "--name",
            &spec.name,
            "--bind",
            &spec.host,
            "--advertise-host",
            &spec.host,
            "--resources",
            &spec.resources,
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        args.extend(spec.args.iter().cloned());
        spawn(
            &self.options.binary,
            &self.options.log_dir.join(format!("{}.log", spec.name)),
            &args,
            &self.token,
            &spec.env,
        )
    }

    /// Process ids of the head and every running worker.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = vec![self.head.id()];
        pids.extend(self.workers.iter().flatten().map(Child::id));
        pids
    }

    /// The process id of worker `index`, if it runs.
    pub fn worker_pid(&self, index: usize) -> Option<u32> {
        self.workers.get(index).and_then(|c| c.as_ref()).map(Child::id)
    }

    /// Connects a client and waits until every worker has registered.
    pub async fn connect(&self, timeout: Duration) -> anyhow::Result<Client> {
        let deadline = Instant::now() + timeout;
        let client = loop {
            match Client::connect(&self.address, &self.token).await {
                Ok(client) => break client,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "head not up yet");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e).context("the local head did not come up"),
            }
        };
        let names: Vec<String> = self.options.workers.iter().map(|w| w.name.clone()).collect();
        wait_for_nodes(&client, &names, deadline - Instant::now()).await?;
        Ok(client)
    }

    /// SIGKILLs worker `index` (as a crash would).
    pub fn kill_worker(&mut self, index: usize) -> anyhow::Result<()> {
        if let Some(mut child) = self.workers.get_mut(index).and_then(Option::take) {
            child.kill().context("cannot kill the worker")?;
            let _ = child.wait();
        }
        Ok(())
    }

    /// Starts worker `index` again (after [`Self::kill_worker`]).
    pub fn restart_worker(&mut self, index: usize) -> anyhow::Result<()> {
        self.kill_worker(index)?;
        let child = self.spawn_worker(index)?;
        self.workers[index] = Some(child);
        Ok(())
    }

    /// Kills the head (SIGKILL) and starts it again on the same ports and state directory.
    pub fn restart_head(&mut self) -> anyhow::Result<()> {
        self.kill_head()?;
        self.start_head_again()
    }

    /// Kills the head with SIGKILL, as a crash or the OOM killer would.
    pub fn kill_head(&mut self) -> anyhow::Result<()> {
        self.head.kill().context("cannot kill the head")?;
        let _ = self.head.wait();
        Ok(())
    }

    /// Starts the head again on the same ports and state directory (after
    /// [`LocalCluster::kill_head`]); its log is `head-restarted.log`.
    pub fn start_head_again(&mut self) -> anyhow::Result<()> {
        let port: u16 = self
            .address
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(6380);
        let port_of = |address: &str| address.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0);
        let args = head_args(
            &self.options,
            [port, port_of(&self.job_address), port_of(&self.metrics_address)],
        );
        self.head = spawn(
            &self.options.binary,
            &self.options.log_dir.join("head-restarted.log"),
            &args,
            &self.token,
            &[],
        )?;
        Ok(())
    }

    /// Whether the head and each worker process are still running, by name.
    pub fn processes_running(&mut self) -> Vec<(String, bool)> {
        let mut out = vec![("head".to_string(), matches!(self.head.try_wait(), Ok(None)))];
        for (spec, child) in self.options.workers.iter().zip(self.workers.iter_mut()) {
            let running = child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)));
            out.push((spec.name.clone(), running));
        }
        out
    }

    /// Starts an extra process of the `regatta` binary against this cluster (for tests of
    /// bad tokens and the like), logging to `log_name` in the log folder.
    pub fn run_extra(&self, args: &[&str], token: &str, log_name: &str) -> anyhow::Result<Child> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        spawn(
            &self.options.binary,
            &self.options.log_dir.join(log_name),
            &args,
            token,
            &[],
        )
    }

    /// The log file of a process (`head`, a worker name, or an extra's log name).
    pub fn log_path(&self, name: &str) -> PathBuf {
        let file = if name.ends_with(".log") {
            name.to_string()
        } else {
            format!("{name}.log")
        };
        self.options.log_dir.join(file)
    }

    /// The head's state directory.
    pub fn head_state_dir(&self) -> PathBuf {
        self.options.log_dir.join("head-state")
    }

    /// The current part of a job's log on the head's disk (readable while the head is down).
    pub fn job_log(&self, job: &str) -> PathBuf {
        self.head_state_dir().join("logs").join(format!("{job}.log"))
    }

    /// Reads a process's log.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_path(name)).unwrap_or_default()
    }

    /// Stops every process (SIGTERM, then SIGKILL after a grace period). Safe to call again.
    pub fn shutdown(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let mut children: Vec<Child> = self.workers.iter_mut().filter_map(Option::take).collect();
        for child in &children {
            terminate(child);
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for child in &mut children {
            wait_or_kill(child, deadline);
        }
        terminate(&self.head);
        wait_or_kill(&mut self.head, Instant::now() + Duration::from_secs(3));
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Waits until every named node is alive in the cluster status.
pub async fn wait_for_nodes(client: &Client, names: &[String], timeout: Duration) -> anyhow::Result<ClusterStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        let status = client.status().await?;
        let alive = |name: &String| status.nodes.iter().any(|n| &n.name == name && n.state == "alive");
        if names.iter().all(alive) {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            bail!("nodes {names:?} did not all register within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn head_args(options: &LocalOptions, [port, job_port, metrics_port]: [u16; 3]) -> Vec<String> {
    let state_dir = options.log_dir.join("head-state"); // LocalCluster::head_state_dir
    let mut args: Vec<String> = [
        "head",
        "--bind",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--heartbeat-timeout-ms",
        &options.heartbeat_timeout_ms.to_string(),
        "--job-port",
        &job_port.to_string(),
        "--metrics-port",
        &metrics_port.to_string(),
        "--state-dir",
        &state_dir.to_string_lossy(),
        // The jobs of a local cluster end with it.
        "--stop-jobs-on-exit",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.extend(options.head_args.iter().cloned());
    args
}

fn spawn(binary: &Path, log: &Path, args: &[String], token: &str, env: &[(String, String)]) -> anyhow::Result<Child> {
    let out = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    let err = out.try_clone().context("cannot duplicate a log handle")?;
    Command::new(binary)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("REGATTA_TOKEN", token)
        .env("REGATTA_LOG_COLOR", "never")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))
}

/// `regatta head`'s exit status when a port it was to listen on is taken (Linux's
/// `EADDRINUSE`), so a supervisor that chose the ports (as [`LocalCluster`] does) can tell it
/// from other failures.
pub const EXIT_ADDRESS_IN_USE: u8 = 98;

/// Starts the head on three free ports and waits until it is up (it writes its ready file
/// once every port is open). A port is free when chosen but may be taken before the head
/// binds it (another cluster starting beside this one): the head then exits with
/// [`EXIT_ADDRESS_IN_USE`] and is started again on other ports, up to five times.
fn start_head(options: &LocalOptions, token: &str) -> anyhow::Result<(Child, [u16; 3])> {
    let log = options.log_dir.join("head.log");
    let ready = options.log_dir.join("head.ready");
    let mut last = String::new();
    for _ in 0..5 {
        let ports = free_ports()?;
        let _ = std::fs::remove_file(&ready);
        let mut args = head_args(options, ports);
        args.extend(["--ready-file".to_string(), ready.to_string_lossy().into_owned()]);
        let mut head = spawn(&options.binary, &log, &args, token, &[])?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if ready.exists() {
                return Ok((head, ports));
            }
            if let Some(status) = head.try_wait().context("cannot wait for the head")? {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if status.code() != Some(i32::from(EXIT_ADDRESS_IN_USE)) {
                    bail!("the local head exited ({status}):\n{text}");
                }
                last = text;
                break;
            }
            if Instant::now() >= deadline {
                // Slow, not failed: the caller's connect reports what happens next.
                return Ok((head, ports));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    bail!("the local head found no free ports in five tries; last log:\n{last}")
}

/// Three distinct free TCP ports for the head, chosen below Linux's ephemeral range
/// (32768 and up): the head binds them a moment after they are chosen, and a port from the
/// ephemeral range could be handed to another process (a worker binding port 0) meanwhile.
fn free_ports() -> anyhow::Result<[u16; 3]> {
    use std::hash::{BuildHasher, Hasher};
    let mut seed = std::collections::hash_map::RandomState::new().build_hasher().finish();
    let mut held = Vec::new();
    for _ in 0..2_000 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let candidate = 20_000 + (seed >> 33) as u16 % 12_000;
        if held.iter().any(|(port, _)| *port == candidate) {
            continue;
        }
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", candidate)) {
            held.push((candidate, listener));
            if held.len() == 3 {
                return Ok([held[0].0, held[1].0, held[2].0]);
            }
        }
    }
    anyhow::bail!("cannot find three free ports between 20000 and 32000")
}

fn terminate(child: &Child) {
    // SIGTERM lets the process shut down its sessions; there is no portable std call.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .stderr(Stdio::null())
        .status();
}

fn wait_or_kill(child: &mut Child, deadline: Instant) {
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A client of the cluster at `$REGATTA_ADDRESS` (token as [`regatta_runtime::resolve_token`]
/// finds it) or, when that is unset, of a local cluster of `workers` started for the caller
/// and stopped when the returned [`LocalCluster`] is dropped. For examples and drivers that
/// run both ways.
pub async fn connect_or_start(workers: Vec<WorkerSpec>) -> anyhow::Result<(Option<LocalCluster>, Client)> {
    if let Ok(address) = std::env::var(regatta_runtime::ADDRESS_ENV) {
        let (token, _) = regatta_runtime::resolve_token(None, None, false)?;
        let client = Client::connect(&address, &token)
            .await
            .with_context(|| format!("cannot reach the cluster at {address}"))?;
        return Ok((None, client));
    }
    let options = LocalOptions::new(workers)?;
    println!(
        "starting a local cluster: head + {} workers (logs in {})",
        options.workers.len(),
        options.log_dir.display()
    );
    let local = LocalCluster::start(options)?;
    let client = local.connect(Duration::from_secs(30)).await?;
    Ok((Some(local), client))
}
