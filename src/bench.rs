//! `regatta bench`: Regatta's counterparts of `ray microbenchmark` cases, printed in Ray's
//! line format (`<case> per second <value> +- <spread>`) so the two outputs line up.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;

use crate::kinds::{Caller, Fanout, Noop, Store, StoreOp, StoreReply};
use crate::local::{LocalCluster, LocalOptions, WorkerSpec};
use regatta_runtime::{ActorHandle, ActorOptions, ActorPool, Client, Resources, Strategy};

/// Options of `regatta bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Which cases: `actors`, `objects`, `cluster`, `train`, `score`, `generate`, `data`,
    /// or `all` (the first five).
    #[arg(default_value = "all")]
    pub suite: String,
    /// Trials per case (mean and standard deviation are printed).
    #[arg(long, default_value_t = 3)]
    pub trials: usize,
    /// Small counts (a smoke run for tests, not for figures).
    #[arg(long)]
    pub quick: bool,
    /// `train` and `generate`: a Hugging Face model folder (local or URL), or a
    /// `config.json` file of a Llama-family model to initialise randomly; default: the
    /// built-in GPT for `train`, data/bench-llama-110m.json for `generate`.
    #[arg(long)]
    pub model: Option<String>,
    /// `train`: compare full fine-tuning with LoRA adapters of this rank (ZeRO-3, 2 ranks).
    #[arg(long)]
    pub lora: Option<usize>,
    /// `train`: compare with the optimizer state offloaded to the host (ZeRO-3, 2 ranks).
    #[arg(long)]
    pub offload: bool,
    /// `data`: the corpus size in GB (made once under ~/.cache/regatta).
    #[arg(long, default_value_t = 2.0)]
    pub data_gb: f64,
    /// `data`: seconds each source is read.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
}

/// Mean and standard deviation of trial figures.
pub fn mean_spread(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
    (mean, var.sqrt())
}

fn report(case: &str, unit: &str, values: &[f64]) {
    let (mean, spread) = mean_spread(values);
    println!("{case} {unit} {mean:.2} +- {spread:.2}");
}

fn workers() -> Vec<WorkerSpec> {
    vec![
        WorkerSpec::new("w1", "CPU=2,pin:w1=1"),
        WorkerSpec::new("w2", "CPU=2,pin:w2=1"),
    ]
}

fn start_cluster() -> anyhow::Result<LocalCluster> {
    let mut options = LocalOptions::new(workers())?;
    options.binary = std::env::current_exe().context("cannot find this executable")?;
    LocalCluster::start(options)
}

/// Runs the benchmark suite on local clusters started from this binary.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let suites: Vec<&str> = match args.suite.as_str() {
        "all" => vec!["cluster", "actors", "objects", "train", "score"],
        one @ ("actors" | "objects" | "cluster" | "train" | "score" | "generate" | "data") => vec![one],
        other => {
            bail!(
                "unknown benchmark suite '{other}'; use actors, objects, cluster, train, score, generate, data or all"
            )
        }
    };
    let trials = args.trials.max(1);
    for suite in suites {
        let outcome = tokio::select! {
            outcome = run_suite(suite, trials, &args) => outcome,
            () = crate::cli::shutdown_signal() => return Ok(ExitCode::from(130)),
        };
        outcome?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_suite(suite: &str, trials: usize, args: &BenchArgs) -> anyhow::Result<()> {
    let (quick, model) = (args.quick, args.model.as_deref());
    if suite == "cluster" {
        return cluster_start(trials).await;
    }
    if suite == "train" && (args.lora.is_some() || args.offload) {
        return crate::bench_train::variants(trials, quick, model, args.lora, args.offload).await;
    }
    if suite == "train" {
        return crate::bench_train::train(trials, quick, model).await;
    }
    if suite == "score" {
        return crate::bench_score::score(trials, quick).await;
    }
    if suite == "generate" {
        return generate(model);
    }
    if suite == "data" {
        let bench = crate::bench_data::DataBench {
            gigabytes: if args.quick { 0.05 } else { args.data_gb },
            seconds: if args.quick { 5.0 } else { args.seconds },
            shards: 64,
        };
        return tokio::task::block_in_place(|| crate::bench_data::run(&bench));
    }
    let mut cluster = start_cluster()?;
    let outcome = match suite {
        "actors" => actors(&cluster, trials, quick).await,
        _ => objects(&cluster, trials, quick).await,
    };
    cluster.shutdown();
    outcome
}

/// KV-cache generation in the executor (the one binary that links libtorch), with every
/// core: output tokens/s at batch limits 1 to 128 beside the machine's bounds.
fn generate(model: Option<&str>) -> anyhow::Result<()> {
    let executor = regatta_runtime::executor::executor_path(None).map_err(anyhow::Error::msg)?;
    let model = model.unwrap_or("data/bench-llama-110m.json");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let status = std::process::Command::new(&executor)
        .args(["bench-generate", model, &cores.to_string()])
        .status()
        .with_context(|| format!("cannot run {}", executor.display()))?;
    anyhow::ensure!(status.success(), "the generation benchmark failed ({status})");
    Ok(())
}

/// Time for a head and 2 workers to be ready, and their idle resident memory.
async fn cluster_start(trials: usize) -> anyhow::Result<()> {
    println!("# cluster");
    let mut ready = Vec::new();
    let mut memory = Vec::new();
    for _ in 0..trials {
        let started = Instant::now();
        let mut cluster = start_cluster()?;
        let client = cluster.connect(Duration::from_secs(30)).await?;
        ready.push(started.elapsed().as_secs_f64());
        drop(client);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pids = cluster.pids();
        memory.push(pids.iter().map(|pid| rss_bytes(*pid)).sum::<u64>() as f64 / 1e6);
        cluster.shutdown();
    }
    report("head and 2 workers ready", "seconds", &ready);
    report("idle head and 2 workers resident", "megabytes", &memory);
    scrape_with_many_actors(trials).await
}

/// How long a `/metrics` scrape of the head takes with thousands of live actors.
async fn scrape_with_many_actors(trials: usize) -> anyhow::Result<()> {
    let mut cluster = start_cluster()?;
    let client = cluster.connect(Duration::from_secs(30)).await?;
    let actors = 2_000;
    let spawned =
        futures::future::try_join_all((0..actors).map(|_| client.spawn::<Noop>((), ActorOptions::new()))).await?;
    futures::future::try_join_all(spawned.iter().map(|a| a.call(Vec::new()))).await?;
    // The head refreshes its snapshot once a second.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let host = cluster.metrics_address.trim_start_matches("http://").to_string();
    let mut millis = Vec::new();
    for _ in 0..trials.max(3) {
        let started = Instant::now();
        let body = http_get(&host, "/metrics")?;
        millis.push(started.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(
            body.contains("regatta_actors{kind=\"noop\",state=\"alive\"} 2000"),
            "the scrape does not show the 2,000 actors"
        );
    }
    report(
        &format!("metrics scrape of the head with {actors} actors"),
        "milliseconds",
        &millis,
    );
    cluster.shutdown();
    Ok(())
}

fn http_get(host: &str, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    Ok(reply)
}

/// Resident memory of a process (Linux), 0 when unknown.
pub fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_string))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Runs `round` `trials` times; each returns the operations it did; prints ops per second.
async fn rate<F, Fut>(case: &str, trials: usize, mut round: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<usize>>,
{
    let mut rates = Vec::with_capacity(trials);
    for _ in 0..trials {
        let started = Instant::now();
        let ops = round().await?;
        rates.push(ops as f64 / started.elapsed().as_secs_f64());
    }
    report(case, "per second", &rates);
    Ok(())
}

async fn noops(client: &Client, count: usize) -> anyhow::Result<Vec<ActorHandle<Noop>>> {
    let mut actors = Vec::with_capacity(count);
    for _ in 0..count {
        actors.push(client.spawn::<Noop>((), ActorOptions::new()).await?);
    }
    for actor in &actors {
        actor.wait_ready(Duration::from_secs(30)).await?;
    }
    Ok(actors)
}

async fn actors(cluster: &LocalCluster, trials: usize, quick: bool) -> anyhow::Result<()> {
    let client = cluster.connect(Duration::from_secs(30)).await?;
    let scale = if quick { 20 } else { 1 };
    println!("# actors");
    let one = noops(&client, 1).await?.remove(0);
    let sync_calls = 5_000 / scale;
    rate("1:1 actor calls sync", trials, || async {
        for _ in 0..sync_calls {
            one.call(Vec::new()).await?;
        }
        Ok(sync_calls)
    })
    .await?;
    let batch = 10_000 / scale;
    rate("1:1 actor calls async", trials, || async {
        futures::future::try_join_all((0..batch).map(|_| one.call(Vec::new()))).await?;
        Ok(batch)
    })
    .await?;
    // Ray's case calls an actor with max_concurrency=16 in batches of 1000 from one
    // client; here 4 client tasks each keep batches of 250 calls in flight to one actor.
    rate("1:1 actor calls concurrent", trials, || async {
        let rounds = batch / 1000;
        let tasks = (0..4).map(|_| {
            let one = one.clone();
            async move {
                for _ in 0..rounds.max(1) {
                    futures::future::try_join_all((0..250).map(|_| one.call(Vec::new()))).await?;
                }
                anyhow::Ok(rounds.max(1) * 250)
            }
        });
        Ok(futures::future::try_join_all(tasks).await?.iter().sum())
    })
    .await?;
    let servers = noops(&client, 4).await?;
    rate("1:n actor calls async", trials, || async {
        let calls = servers
            .iter()
            .flat_map(|s| (0..batch / 4).map(move |_| s.call(Vec::new())));
        Ok(futures::future::try_join_all(calls).await?.len())
    })
    .await?;
    let mut callers = Vec::new();
    for _ in 0..4 {
        callers.push(client.spawn::<Caller>((), ActorOptions::new()).await?);
    }
    let targets: Vec<_> = servers.iter().map(|s| s.id()).collect();
    for (case, arg_bytes) in [
        ("n:n actor calls async", 0usize),
        ("n:n actor calls with arg async", 1024),
    ] {
        let per_target = (batch / 16) as u32;
        rate(case, trials, || async {
            let fanout = Fanout {
                targets: targets.clone(),
                calls_per_target: per_target,
                arg_bytes,
            };
            let done = futures::future::try_join_all(
                callers
                    .iter()
                    .map(|c| c.call_timeout(fanout.clone(), Duration::from_secs(120))),
            )
            .await?;
            Ok(done.iter().sum::<u64>() as usize)
        })
        .await?;
    }
    let creations = 1_000 / scale;
    rate("actor creation (create and call each)", trials, || async {
        let spawned =
            futures::future::try_join_all((0..creations).map(|_| client.spawn::<Noop>((), ActorOptions::new())))
                .await?;
        futures::future::try_join_all(spawned.iter().map(|a| a.call(Vec::new()))).await?;
        futures::future::try_join_all(spawned.iter().map(|a| a.kill())).await?;
        Ok(creations)
    })
    .await?;
    let groups = 1_000 / scale;
    rate("placement group create/removal", trials, || async {
        for _ in 0..groups {
            let group = client
                .create_placement_group(vec![Resources::parse_request("CPU=0.01")?; 2], Strategy::Pack)
                .await?;
            group.ready(Duration::from_secs(10)).await?;
            group.remove().await?;
        }
        Ok(groups)
    })
    .await?;
    let items = 20_000 / scale;
    let workers = noops(&client, 4).await?;
    rate("ActorPool map", trials, || {
        let workers = workers.clone();
        async move {
            let mut pool = ActorPool::new(workers);
            let results = pool.map((0..items).map(|_| Vec::new())).await;
            anyhow::ensure!(results.iter().all(Result::is_ok), "a pool item failed");
            Ok(items)
        }
    })
    .await?;
    Ok(())
}

async fn store_on(client: &Client, node: &str) -> anyhow::Result<ActorHandle<Store>> {
    let actor = client
        .spawn::<Store>(
            (),
            ActorOptions::new().resources(Resources::parse_request(&format!("pin:{node}"))?),
        )
        .await?;
    actor.wait_ready(Duration::from_secs(30)).await?;
    Ok(actor)
}

async fn objects(cluster: &LocalCluster, trials: usize, quick: bool) -> anyhow::Result<()> {
    let client = cluster.connect(Duration::from_secs(30)).await?;
    let scale = if quick { 20 } else { 1 };
    println!("# physical limits measured in this run");
    report(
        "memcpy gigabytes",
        "per second",
        &(0..trials).map(|_| memcpy_gbps((1 << 30) / scale)).collect::<Vec<_>>(),
    );
    let mut tcp = Vec::new();
    for _ in 0..trials {
        tcp.push(loopback_tcp_gbps((2 << 30) / scale)?);
    }
    report("loopback tcp gigabytes", "per second", &tcp);

    println!("# object store");
    let small = Bytes::from_static(&[7u8; 100]);
    let mut puts = Vec::new();
    let mut gets = Vec::new();
    for _ in 0..trials {
        let count = 2_000 / scale;
        let started = Instant::now();
        let mut refs = Vec::with_capacity(count);
        for _ in 0..count {
            refs.push(client.put_bytes(small.clone()).await?);
        }
        puts.push(count as f64 / started.elapsed().as_secs_f64());
        let started = Instant::now();
        for reference in &refs {
            client.get_bytes(reference).await?;
        }
        gets.push(count as f64 / started.elapsed().as_secs_f64());
        for reference in &refs {
            client.free(reference).await?;
        }
    }
    report("single client put calls (Plasma Store)", "per second", &puts);
    report("single client get calls (Plasma Store)", "per second", &gets);

    let mut put_gb = Vec::new();
    for _ in 0..trials {
        let payload = vec![1u8; (1 << 30) / scale];
        let started = Instant::now();
        let reference = client.put_bytes(payload).await?;
        put_gb.push(((1u64 << 30) / scale as u64) as f64 / started.elapsed().as_secs_f64() / 1e9);
        client.free(&reference).await?;
    }
    report("single client put gigabytes", "per second", &put_gb);

    let (a, b) = (store_on(&client, "w1").await?, store_on(&client, "w2").await?);
    let sizes: &[(&str, u64)] = if quick {
        &[("100 MB", 100_000_000)]
    } else {
        &[("100 MB", 100_000_000), ("1 GB", 1_000_000_000)]
    };
    for &(label, size) in sizes {
        let mut rates = Vec::new();
        for seed in 0..trials as u64 {
            let reference = match a
                .call_timeout(
                    StoreOp::Put {
                        size,
                        seed,
                        keep: false,
                    },
                    Duration::from_secs(300),
                )
                .await?
            {
                StoreReply::Put { reference, .. } => reference,
                other => bail!("unexpected reply {other:?}"),
            };
            match b
                .call_timeout(StoreOp::Fetch(reference.clone()), Duration::from_secs(300))
                .await?
            {
                StoreReply::Fetched { len, nanos } => rates.push(len as f64 / nanos as f64),
                other => bail!("unexpected reply {other:?}"),
            }
            client.free(&reference).await?;
        }
        report(&format!("cross-node get {label} gigabytes"), "per second", &rates);
    }
    Ok(())
}

/// Copies `size` bytes between two buffers and returns GB/s.
pub fn memcpy_gbps(size: usize) -> f64 {
    let source = vec![3u8; size];
    // Touch every target page first, so the figure is copy bandwidth, not page faults.
    let mut target = vec![1u8; size];
    let started = Instant::now();
    target.copy_from_slice(&source);
    let secs = started.elapsed().as_secs_f64();
    std::hint::black_box(&target);
    size as f64 / secs / 1e9
}

/// Streams `size` bytes over a loopback TCP connection and returns GB/s.
pub fn loopback_tcp_gbps(size: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut stream, _) = listener.accept()?;
        let mut buffer = vec![0u8; 1 << 20];
        let mut total = 0;
        loop {
            let n = stream.read(&mut buffer)?;
            if n == 0 {
                return Ok(total);
            }
            total += n;
        }
    });
    let chunk = vec![5u8; 1 << 20];
    let started = Instant::now();
    let mut stream = TcpStream::connect(address)?;
    let mut sent = 0;
    while sent < size {
        stream.write_all(&chunk)?;
        sent += chunk.len();
    }
    drop(stream);
    let received = reader.join().map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        received == sent,
        "loopback lost bytes: sent {sent}, received {received}"
    );
    Ok(received as f64 / secs / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_spread() {
        assert_eq!(mean_spread(&[2.0, 4.0]), (3.0, 1.0));
        assert_eq!(mean_spread(&[]), (0.0, 0.0));
    }
}
