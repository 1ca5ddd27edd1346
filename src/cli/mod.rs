//! The `regatta` command line.

mod ca;
mod common;
pub mod demo;
mod job;
mod node;
pub mod score;
mod status;
mod token;
pub mod train;

use common::TokenArgs;
pub use status::render as render_status;

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use regatta_runtime::{
    resolve_token, run_worker, start_head, HeadConfig, Registry, Resources, TokenSource, WorkerConfig,
};

use crate::local::EXIT_ADDRESS_IN_USE;

/// Regatta: an actor cluster runtime for ML training and batch scoring.
#[derive(Parser, Debug)]
#[command(name = "regatta", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a head node.
    Head(HeadArgs),
    /// Start a worker node that joins a head.
    Worker(WorkerArgs),
    /// Print the cluster's nodes, resources, placement groups, actors and waiting requests.
    Status(status::StatusArgs),
    /// Start a local cluster (head and 2 workers as processes), run an actor workload on
    /// it, print a report and shut it down.
    Demo(demo::DemoArgs),
    /// Run benchmarks on a local cluster, printed in `ray microbenchmark`'s format.
    Bench(crate::bench::BenchArgs),
    /// Train the built-in GPT with a ZeRO trainer group (on --address, or a local cluster
    /// started for the run).
    Train(train::TrainArgs),
    /// Score a JSONL dataset with a trainer checkpoint on a pool of scorer actors.
    Score(score::ScoreArgs),
    /// Submit, follow, stop and list jobs through the head's job API.
    #[command(subcommand)]
    Job(job::JobCommand),
    /// Join tokens: generate one offline, or create, list and revoke them on the head.
    #[command(subcommand)]
    Token(token::TokenCommand),
    /// Nodes of a running cluster: remove one for good.
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// Print the cluster authority's certificate (PEM), proven with the join token, for a
    /// browser or another TLS client to trust the head's HTTPS port.
    Ca(ca::CaArgs),
    /// Run many simulated nodes in this process against a head (`regatta bench scale`
    /// starts them): each registers, heartbeats and starts actors like a worker.
    #[command(hide = true)]
    SimulateNodes(SimulateArgs),
    /// Supervise one job's driver (the head starts this for each job; see the job API).
    #[command(hide = true)]
    JobShim(JobShimArgs),
    /// Exit 0 if an HTTP GET of the URL answers 200 within 5 s (for container health
    /// checks, e.g. `regatta probe http://127.0.0.1:9181/metrics`).
    Probe {
        /// `http://host:port/path`.
        url: String,
    },
}

#[derive(Args, Debug)]
struct JobShimArgs {
    /// The job's id.
    #[arg(long)]
    job: String,
    /// Where the supervisor's files go.
    #[arg(long)]
    run_dir: PathBuf,
    /// The job's log file.
    #[arg(long)]
    log: PathBuf,
    /// Bytes per log part.
    #[arg(long)]
    log_cap_bytes: u64,
    /// Milliseconds between SIGTERM and SIGKILL on a stop.
    #[arg(long)]
    stop_grace_ms: u64,
    /// The driver's working directory.
    #[arg(long)]
    working_dir: Option<PathBuf>,
    /// Stop the job when this process (the worker that started the supervisor) is gone.
    #[arg(long)]
    parent: Option<u32>,
    /// The driver's shell command.
    entrypoint: String,
}

#[derive(Args, Debug, Clone)]
struct ObjectArgs {
    /// Bytes of objects kept in memory before spilling (e.g. 512MiB, 4GB; default 30% of RAM).
    #[arg(long, value_parser = parse_bytes)]
    object_store_bytes: Option<u64>,
    /// Where objects spill: a directory, file:// or s3://bucket/prefix (AWS_* env vars
    /// configure S3). Default: /tmp/regatta-<uid>/spill/<node>. A local folder is made
    /// private to this user and refused when anyone else could write it or a folder above.
    #[arg(long, env = "REGATTA_SPILL_URL")]
    spill_url: Option<String>,
    /// TCP port of the object transfer endpoint (0: any).
    #[arg(long, default_value_t = 0)]
    object_port: u16,
}

impl ObjectArgs {
    fn config(&self, host: &str, bind: IpAddr) -> regatta_runtime::ObjectConfig {
        let mut config = regatta_runtime::ObjectConfig::new(host);
        config.capacity_bytes = self.object_store_bytes;
        config.spill_url = self.spill_url.clone();
        config.port = self.object_port;
        config.bind = bind;
        config
    }
}

/// A command-line value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// A size without a number.
    #[error("'{0}' is not a size like 512MiB")]
    NotASize(String),
    /// A size with a unit this does not know.
    #[error("unknown size unit '{unit}' in '{text}'; use B, KB, KiB, MB, MiB, GB, GiB")]
    SizeUnit { unit: String, text: String },
    /// A `--env`/`--metadata` value without `=` or without a key.
    #[error("'{0}' is not KEY=VALUE")]
    NotKeyValue(String),
    /// [`RUNTIME_THREADS_ENV`] that is not a count of at least 1.
    #[error("{RUNTIME_THREADS_ENV}='{0}' is not a number of threads (1 or more)")]
    NotAThreadCount(String),
}

/// Environment variable: how many threads a `regatta` process's async runtime runs. By
/// default as many as the CPUs it may use, at least 2. With 1, a node serves its actors'
/// calls on one thread, so a call and its answer never wake a second runtime thread
/// (on 2-core VMs, 1:1 sync Python actor calls 1.6x: BENCHMARKS.md); a long CPU-bound step
/// in the node (encrypting a large object) then delays the calls behind it.
pub const RUNTIME_THREADS_ENV: &str = "REGATTA_RUNTIME_THREADS";

/// The runtime's thread count: [`RUNTIME_THREADS_ENV`]'s `value` when set, else `cpus` (at
/// least 2: a blocking step in a command, such as a bench's floor measurement, must not
/// stall every other task).
pub fn runtime_threads(value: Option<&str>, cpus: usize) -> Result<usize, ArgError> {
    match value.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(cpus.max(2)),
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| ArgError::NotAThreadCount(text.to_string())),
    }
}

/// Parses `1234`, `64KB`, `64KiB`, `512MiB`, `4GB`, `1.5GiB`.
pub fn parse_bytes(text: &str) -> Result<u64, ArgError> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number.parse().map_err(|_| ArgError::NotASize(text.to_string()))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "kib" | "k" => 1024.0,
        "mb" => 1e6,
        "mib" | "m" => 1024.0 * 1024.0,
        "gb" => 1e9,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tb" => 1e12,
        "tib" | "t" => 1024.0_f64.powi(4),
        other => {
            return Err(ArgError::SizeUnit {
                unit: other.to_string(),
                text: text.to_string(),
            })
        }
    };
    Ok((value * scale) as u64)
}

#[derive(Args, Debug)]
struct HeadArgs {
    /// Cluster port.
    #[arg(long, default_value_t = 6380)]
    port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// Host or IP that workers and clients use to reach this head.
    #[arg(long, default_value = "127.0.0.1")]
    advertise_host: String,
    /// A worker silent this long is declared dead and its actors restarted elsewhere.
    #[arg(long, default_value_t = 3_000)]
    heartbeat_timeout_ms: u64,
    /// Unreferenced objects are released this long after their last reference drops.
    #[arg(long, default_value_t = 10_000)]
    object_grace_ms: u64,
    /// Network pulls of one large object (16 MiB or more) a node serves at once when many
    /// nodes get it together; the others wait for a copy, so a broadcast spreads as a tree
    /// (0: no limit, every node pulls from the first holder). Pulls between nodes that
    /// advertise the same host are not limited.
    #[arg(long, default_value_t = regatta_runtime::DEFAULT_OBJECT_FANOUT)]
    object_fanout: usize,
    /// Port of the job API and the dashboard (HTTPS unless --insecure).
    #[arg(long, default_value_t = 8265)]
    job_port: u16,
    /// Serve the job API with this certificate chain (PEM, leaf first) instead of one from
    /// the cluster's own authority; clients trust it with `regatta job --ca-cert`.
    #[arg(long, requires = "tls_key", conflicts_with = "insecure")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve the job API over plain HTTP: the token, job environments and logs cross the
    /// network in cleartext. Only behind a TLS-terminating proxy; it then listens on
    /// 127.0.0.1 unless --job-bind says otherwise.
    #[arg(long)]
    insecure: bool,
    /// Address the job API and dashboard listen on (default: --bind; with --insecure,
    /// 127.0.0.1).
    #[arg(long)]
    job_bind: Option<IpAddr>,
    /// HTTP port of the head's /metrics and Prometheus service discovery
    /// (/api/prometheus/sd); 0 turns it off.
    #[arg(long, default_value_t = 9180)]
    metrics_port: u16,
    /// Run without the job API.
    #[arg(long)]
    no_job_api: bool,
    /// Where the head keeps the cluster's state (nodes, actors, placement groups,
    /// objects), job records and logs (default ~/.regatta/head). A head started again on
    /// the same directory takes the cluster back: workers keep their actors. The cluster's
    /// certificate authority is kept in its `ca` folder.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Keep the cluster's state in memory only: a restarted head starts an empty cluster
    /// and the workers stop their actors (job records are still kept).
    #[arg(long)]
    no_cluster_state: bool,
    /// Bytes of each job's log kept on disk (in two parts, rotated).
    #[arg(long, value_parser = parse_bytes, default_value = "64MiB")]
    job_log_bytes: u64,
    /// Largest `working_dir` or `py_modules` package a job client may upload.
    #[arg(long, value_parser = parse_bytes, default_value = "500MiB")]
    job_package_bytes: u64,
    /// Stop running jobs when this head is stopped (SIGTERM, Ctrl-C). Without it their
    /// drivers keep running, and the next head on this state directory takes them back.
    #[arg(long)]
    stop_jobs_on_exit: bool,
    /// Once every port is open, write the cluster address to this file (written whole:
    /// a reader never sees part of it; removed when the head stops), for a supervisor
    /// waiting on the head. A port
    /// already taken ends the head with exit status 98 (`EADDRINUSE`).
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// How long the certificates the head issues at joins are valid, in seconds; each
    /// process renews its own when two thirds of that have passed.
    #[arg(long, default_value_t = 24 * 3600, value_parser = clap::value_parser!(u64).range(2..))]
    cert_lifetime_secs: u64,
    /// More environment variables the processes started for users' code inherit from this
    /// one (comma-separated names, `PREFIX*` for a prefix), beyond the allowlist in
    /// docs/TRUST.md; a job's own variables go in its runtime_env.
    #[arg(long, env = "REGATTA_PASS_ENV", value_name = "NAMES")]
    pass_env: Option<String>,
    #[command(flatten)]
    objects: ObjectArgs,
    #[command(flatten)]
    token: TokenArgs,
}

#[derive(Args, Debug)]
struct WorkerArgs {
    /// The head's cluster address, HOST:PORT.
    #[arg(long, env = "REGATTA_ADDRESS")]
    address: String,
    /// Resources, overriding detected ones: 'CPU=8,GPU=2,accelerator_type:H100=1'.
    #[arg(long, env = "REGATTA_RESOURCES", default_value = "")]
    resources: String,
    /// Node name (default: worker-<random>).
    #[arg(long)]
    name: Option<String>,
    /// Cluster port of this worker (0: any free port).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
    /// Host or IP others use to reach this worker (default: this machine's address towards the head).
    #[arg(long)]
    advertise_host: Option<String>,
    /// Interval between heartbeats to the head.
    #[arg(long, default_value_t = 500)]
    heartbeat_interval_ms: u64,
    /// HTTP port of this worker's /metrics (0: any free port; the head advertises it to
    /// Prometheus).
    #[arg(long, default_value_t = 0)]
    metrics_port: u16,
    /// TCP port of this worker's actor call channel (0: any free port). Callers that
    /// cannot reach it fall back to the cluster sessions (slower, still correct).
    #[arg(long, default_value_t = 0)]
    call_port: u16,
    /// More environment variables the processes started for users' code inherit from this
    /// one (comma-separated names, `PREFIX*` for a prefix), beyond the allowlist in
    /// docs/TRUST.md; a job's own variables go in its runtime_env.
    #[arg(long, env = "REGATTA_PASS_ENV", value_name = "NAMES")]
    pass_env: Option<String>,
    #[command(flatten)]
    objects: ObjectArgs,
    #[command(flatten)]
    token: TokenArgs,
}

#[derive(Args, Debug)]
struct SimulateArgs {
    /// The head's cluster address, HOST:PORT.
    #[arg(long, env = "REGATTA_ADDRESS")]
    address: String,
    /// Node names are PREFIX-NNNNN.
    #[arg(long, default_value = "sim")]
    prefix: String,
    /// Index of the first node.
    #[arg(long, default_value_t = 0)]
    first: usize,
    /// How many nodes.
    #[arg(long)]
    count: usize,
    /// What each node declares.
    #[arg(long, default_value = "CPU=128")]
    resources: String,
    /// Interval between each node's heartbeats.
    #[arg(long, default_value_t = 500)]
    heartbeat_interval_ms: u64,
    #[command(flatten)]
    token: TokenArgs,
}

/// Whether this process was started as a cluster node (`head` or `worker` as the first
/// argument), so that a driver binary can double as its own head and worker.
pub fn is_node_command() -> bool {
    matches!(std::env::args().nth(1).as_deref(), Some("head" | "worker"))
}

/// Runs the command line with `registry` as the worker's actor kinds.
pub fn main_with(registry: Registry) -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let workers = match runtime_threads(std::env::var(RUNTIME_THREADS_ENV).ok().as_deref(), cpus) {
        Ok(workers) => workers,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        // The main thread's stack size: the command's futures used to run there.
        .thread_stack_size(8 << 20)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The command runs as a task on the runtime's workers, not on this thread: a future
    // that `block_on` runs here is woken by another thread for every reply it awaits (a
    // futex wake-up, 8-30 us on a small VM), while a task's awaited reply is usually
    // handed over on the worker thread that read it (`regatta bench actors` shows both).
    let command = runtime.spawn(async move {
        match cli.command {
            Command::Head(args) => head(args).await,
            Command::Worker(args) => worker(args, registry).await,
            Command::Status(args) => status::run(args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Bench(args) => crate::bench::run(args).await,
            Command::Job(command) => job::run(command).await,
            Command::Token(command) => token::run(command).await,
            Command::Node(command) => node::run(command).await,
            Command::Ca(args) => ca::run(args).await,
            Command::Train(args) => train::run(args).await,
            Command::Score(args) => score::run(args).await,
            Command::Probe { url } => probe(&url).await,
            Command::SimulateNodes(args) => simulate_nodes(args, registry).await,
            Command::JobShim(args) => job_shim(args).await,
        }
    });
    let outcome = match runtime.block_on(command) {
        Ok(outcome) => outcome,
        // A panic ends the process as it did on this thread (its message is printed already).
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(anyhow::anyhow!("the command's task ended abnormally: {e}")),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("REGATTA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,ractor_cluster=error,ractor=warn"));
    use std::io::IsTerminal;
    let color = std::env::var("REGATTA_LOG_COLOR")
        .map(|v| v != "never")
        .unwrap_or_else(|_| std::io::stderr().is_terminal());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(color)
        .init();
}

async fn job_shim(args: JobShimArgs) -> anyhow::Result<ExitCode> {
    let outcome = regatta_runtime::supervise_job(regatta_runtime::ShimArgs {
        job: args.job,
        run_dir: args.run_dir,
        log: args.log,
        log_cap_bytes: args.log_cap_bytes,
        stop_grace: Duration::from_millis(args.stop_grace_ms),
        working_dir: args.working_dir,
        entrypoint: args.entrypoint,
        parent: args.parent,
    })
    .await?;
    if let Some(error) = &outcome.error {
        eprintln!("error: {error}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Where the job API listens: `--job-bind` when given; else loopback for plain HTTP
/// (`--insecure`: cleartext must not face the network unless asked), else `--bind`.
fn job_api_bind(bind: IpAddr, job_bind: Option<IpAddr>, insecure: bool) -> IpAddr {
    match job_bind {
        Some(address) => {
            if insecure && !address.is_loopback() {
                tracing::warn!(%address, "the plain-HTTP job API (--insecure) listens beyond this machine (--job-bind): put it behind a TLS-terminating proxy");
            }
            address
        }
        None if insecure => IpAddr::from([127, 0, 0, 1]),
        None => bind,
    }
}

/// Writes `bytes` to `path` through a temporary file beside it and a rename: a reader sees
/// the whole file or none.
fn write_whole(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    std::fs::write(&partial, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::rename(&partial, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

async fn head(args: HeadArgs) -> anyhow::Result<ExitCode> {
    let (token, source) = resolve_token(args.token.token.as_deref(), args.token.token_file.as_deref(), true)?;
    if let TokenSource::Generated(path) = &source {
        tracing::info!(file = %path.display(), "generated a join token; workers on other machines need --token with its contents");
    }
    if let Some(names) = &args.pass_env {
        regatta_runtime::environment::pass_also(names);
    }
    let mut config = HeadConfig::new(token);
    config.bind = args.bind;
    config.port = args.port;
    config.advertise_host = args.advertise_host;
    config.heartbeat_timeout_ms = args.heartbeat_timeout_ms;
    config.cert_lifetime = std::time::Duration::from_secs(args.cert_lifetime_secs);
    config.object_grace_ms = args.object_grace_ms;
    config.object_fanout = args.object_fanout;
    config.objects = args.objects.config(&config.advertise_host, args.bind);
    let mut jobs = regatta_runtime::JobConfig::new();
    if let Some(dir) = args.state_dir {
        jobs.state_dir = dir;
    }
    config.state_dir = (!args.no_cluster_state).then(|| jobs.state_dir.clone());
    config.jobs = if args.no_job_api {
        None
    } else {
        jobs.http_port = args.job_port;
        jobs.http_bind = Some(job_api_bind(args.bind, args.job_bind, args.insecure));
        jobs.log_cap_bytes = args.job_log_bytes;
        jobs.max_package_bytes = args.job_package_bytes;
        jobs.tls = match (args.insecure, args.tls_cert, args.tls_key) {
            (true, _, _) => regatta_runtime::ApiTls::Off,
            (false, Some(cert), Some(key)) => regatta_runtime::ApiTls::Files { cert, key },
            _ => regatta_runtime::ApiTls::Token,
        };
        Some(jobs)
    };
    config.metrics_port = (args.metrics_port != 0).then_some(args.metrics_port);
    let head = match start_head(config).await {
        Ok(head) => head,
        Err(error) if error.is_address_in_use() => {
            eprintln!("error: {error}");
            return Ok(ExitCode::from(EXIT_ADDRESS_IN_USE));
        }
        Err(error) => return Err(error.into()),
    };
    if let Some(path) = &args.ready_file {
        write_whole(path, head.address.as_bytes())?;
    }
    println!(
        "regatta head listening on {} (bind {}:{})",
        head.address, args.bind, args.port
    );
    if let Some(metrics) = head.metrics {
        println!("metrics on http://{metrics}/metrics, Prometheus discovery on http://{metrics}/api/prometheus/sd");
    }
    if let Some(api) = head.job_api {
        let scheme = if args.insecure { "http" } else { "https" };
        println!("job API and dashboard on {scheme}://{api}");
    }
    println!(
        "cluster authority {}: workers and clients elsewhere join with --token <the join token> --ca-hash {}",
        head.cluster, head.cluster
    );
    crate::signal::shutdown_signal().await;
    tracing::info!("head shutting down");
    if args.stop_jobs_on_exit {
        head.stop_jobs().await;
    }
    head.stop();
    if let Some(path) = &args.ready_file {
        // A stopped head is not ready: a supervisor must not read a stale file as up.
        let _ = std::fs::remove_file(path);
    }
    Ok(ExitCode::SUCCESS)
}

async fn worker(args: WorkerArgs, registry: Registry) -> anyhow::Result<ExitCode> {
    let (token, _) = resolve_token(args.token.token.as_deref(), args.token.token_file.as_deref(), false)?;
    if let Some(names) = &args.pass_env {
        regatta_runtime::environment::pass_also(names);
    }
    let mut config = WorkerConfig::new(args.address, token);
    config.ca_hash = args.token.ca_hash.clone();
    config.resources = Resources::parse_capacity(&args.resources)?;
    config.name = args.name;
    config.port = args.port;
    config.bind = args.bind;
    config.advertise_host = args.advertise_host;
    config.heartbeat_interval_ms = args.heartbeat_interval_ms;
    config.objects = args.objects.config("127.0.0.1", args.bind);
    config.metrics_port = Some(args.metrics_port);
    config.call_port = Some(args.call_port);
    match run_worker(config, registry, crate::signal::shutdown_signal()).await {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e @ regatta_runtime::Error::TokenRefused { .. }) => {
            tracing::error!("{e}");
            Ok(ExitCode::from(2))
        }
        Err(e) => Err(e.into()),
    }
}

async fn simulate_nodes(args: SimulateArgs, registry: Registry) -> anyhow::Result<ExitCode> {
    let (token, _) = resolve_token(args.token.token.as_deref(), args.token.token_file.as_deref(), false)?;
    let config = regatta_runtime::SimulatedNodes {
        head_address: args.address,
        token,
        prefix: args.prefix,
        first: args.first,
        count: args.count,
        resources: Resources::parse_capacity(&args.resources)?,
        heartbeat_interval_ms: args.heartbeat_interval_ms,
    };
    regatta_runtime::run_simulated_nodes(config, registry, crate::signal::shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}

async fn probe(url: &str) -> anyhow::Result<ExitCode> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow::anyhow!("'{url}' is not an http:// URL"))?;
    let (host, path) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(host).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await?;
        std::io::Result::Ok(head.starts_with(b"HTTP/1.1 200") || head.starts_with(b"HTTP/1.0 200"))
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Ok(true)) => Ok(ExitCode::SUCCESS),
        Ok(Ok(false)) => anyhow::bail!("{url} did not answer 200"),
        Ok(Err(e)) => anyhow::bail!("{url}: {e}"),
        Err(_) => anyhow::bail!("{url} did not answer within 5 s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_listens_on_loopback_unless_told_otherwise() {
        let any = IpAddr::from([0, 0, 0, 0]);
        let lan = IpAddr::from([10, 1, 2, 3]);
        assert_eq!(job_api_bind(any, None, false), any, "HTTPS follows --bind");
        assert_eq!(
            job_api_bind(any, None, true),
            IpAddr::from([127, 0, 0, 1]),
            "plain HTTP stays local"
        );
        assert_eq!(job_api_bind(any, Some(lan), true), lan, "--job-bind wins");
        assert_eq!(job_api_bind(lan, Some(any), false), any);
    }

    #[test]
    fn runtime_threads_default_to_the_cpus_at_least_two_and_bad_counts_say_why() {
        assert_eq!(runtime_threads(None, 8), Ok(8));
        assert_eq!(runtime_threads(None, 1), Ok(2));
        assert_eq!(runtime_threads(Some(" "), 4), Ok(4));
        assert_eq!(runtime_threads(Some("1"), 8), Ok(1));
        assert_eq!(runtime_threads(Some(" 3 "), 8), Ok(3));
        for bad in ["0", "-1", "two", "1.5"] {
            let error = runtime_threads(Some(bad), 8).unwrap_err();
            assert_eq!(error, ArgError::NotAThreadCount(bad.to_string()));
            assert!(error.to_string().contains(RUNTIME_THREADS_ENV), "{error}");
        }
    }

    #[test]
    fn sizes_parse_with_units_and_bad_ones_say_why() {
        assert_eq!(parse_bytes("1234"), Ok(1234));
        assert_eq!(parse_bytes("64KiB"), Ok(65536));
        assert_eq!(parse_bytes("40MiB"), Ok(40 << 20));
        assert_eq!(parse_bytes("4GB"), Ok(4_000_000_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        let unit = parse_bytes("12 parsecs").unwrap_err();
        assert!(
            matches!(&unit, ArgError::SizeUnit { unit, .. } if unit == "parsecs"),
            "{unit:?}"
        );
        assert!(
            unit.to_string().contains("unknown size unit 'parsecs' in '12 parsecs'"),
            "{unit}"
        );
        assert_eq!(parse_bytes("MiB"), Err(ArgError::NotASize("MiB".into())));
    }
}
