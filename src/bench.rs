//! `regatta bench`: Regatta's counterparts of `ray microbenchmark` cases, printed in Ray's
//! line format (`<case> per second <value> +- <spread>`) so the two outputs line up.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;

use crate::kinds::{Store, StoreOp, StoreReply};
use crate::local::{LocalCluster, LocalOptions, WorkerSpec};
use regatta_runtime::{ActorHandle, ActorOptions, Client, Resources};

/// Options of `regatta bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Which cases: `objects` (more to come), or `all`.
    #[arg(default_value = "all")]
    pub suite: String,
    /// Trials per case (mean and standard deviation are printed).
    #[arg(long, default_value_t = 3)]
    pub trials: usize,
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

/// Runs the benchmark suite on a local cluster started from this binary.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    if !matches!(args.suite.as_str(), "all" | "objects") {
        bail!("unknown benchmark suite '{}'; use objects or all", args.suite);
    }
    let workers = vec![WorkerSpec::new("w1", "CPU=2,pin:w1=1"), WorkerSpec::new("w2", "CPU=2,pin:w2=1")];
    let mut options = LocalOptions::new(workers)?;
    options.binary = std::env::current_exe().context("cannot find this executable")?;
    let mut cluster = LocalCluster::start(options)?;
    let outcome = tokio::select! {
        outcome = objects(&cluster, args.trials.max(1)) => outcome,
        () = crate::cli::shutdown_signal() => Ok(()),
    };
    cluster.shutdown();
    outcome.map(|()| ExitCode::SUCCESS)
}

async fn store_on(client: &Client, node: &str) -> anyhow::Result<ActorHandle<Store>> {
    let actor = client
        .spawn::<Store>((), ActorOptions::new().resources(Resources::parse_request(&format!("pin:{node}"))?))
        .await?;
    actor.wait_ready(Duration::from_secs(30)).await?;
    Ok(actor)
}

async fn objects(cluster: &LocalCluster, trials: usize) -> anyhow::Result<()> {
    let client = cluster.connect(Duration::from_secs(30)).await?;
    println!("# physical limits measured in this run");
    report("memcpy gigabytes", "per second", &(0..trials).map(|_| memcpy_gbps(1 << 30)).collect::<Vec<_>>());
    let mut tcp = Vec::new();
    for _ in 0..trials {
        tcp.push(loopback_tcp_gbps(2 << 30)?);
    }
    report("loopback tcp gigabytes", "per second", &tcp);

    println!("# object store");
    let small = Bytes::from_static(&[7u8; 100]);
    let mut puts = Vec::new();
    let mut gets = Vec::new();
    for _ in 0..trials {
        let count = 2_000;
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
        let payload = vec![1u8; 1 << 30];
        let started = Instant::now();
        let reference = client.put_bytes(payload).await?;
        put_gb.push(1.0 / started.elapsed().as_secs_f64() * (1u64 << 30) as f64 / 1e9);
        client.free(&reference).await?;
    }
    report("single client put gigabytes", "per second", &put_gb);

    let (a, b) = (store_on(&client, "w1").await?, store_on(&client, "w2").await?);
    for (label, size) in [("100 MB", 100_000_000u64), ("1 GB", 1_000_000_000u64)] {
        let mut rates = Vec::new();
        for seed in 0..trials as u64 {
            let reference = match a.call_timeout(StoreOp::Put { size, seed, keep: false }, Duration::from_secs(300)).await? {
                StoreReply::Put { reference, .. } => reference,
                other => bail!("unexpected reply {other:?}"),
            };
            match b.call_timeout(StoreOp::Fetch(reference.clone()), Duration::from_secs(300)).await? {
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
    anyhow::ensure!(received == sent, "loopback lost bytes: sent {sent}, received {received}");
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
