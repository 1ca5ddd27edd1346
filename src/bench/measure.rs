//! What every benchmark shares: the mean and spread of trials, the line format, and the
//! machine's own limits measured in the same run (memcpy, loopback TCP, resident memory).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Mean and standard deviation of trial figures.
pub fn mean_spread(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
    (mean, var.sqrt())
}

/// Prints one result line in `ray microbenchmark`'s format.
pub(super) fn report(case: &str, unit: &str, values: &[f64]) {
    let (mean, spread) = mean_spread(values);
    println!("{case} {unit} {mean:.2} +- {spread:.2}");
}

/// Every trial's figure on a comment line under its case (the first trials of a run can
/// differ from the rest: a fresh VM's memory is slow to touch the first time).
pub(super) fn report_each(values: &[f64]) {
    let each: Vec<String> = values.iter().map(|v| format!("{v:.2}")).collect();
    println!("#   each trial: {}", each.join(" "));
}

/// The `q` quantile (0 to 1) of `values`, sorted in place; 0 for none.
pub(super) fn quantile(values: &mut [f64], q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64 - 1.0) * q).round() as usize;
    values.get(index).copied().unwrap_or(0.0)
}

/// A plain HTTP GET of `path` on `host` (`ip:port`): the whole reply, headers included.
pub(super) fn http_get(host: &str, path: &str) -> anyhow::Result<String> {
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

/// The upper bound of the bucket holding the `q` quantile (0 to 1) of a Prometheus
/// histogram in exposition text: `series` is the metric name with its labels but without
/// `le` (`name_bucket{request="spawn"`). `None` when the series has no observations;
/// `f64::INFINITY` when the quantile lies beyond the last finite bucket.
pub(super) fn histogram_quantile(text: &str, series: &str, q: f64) -> Option<f64> {
    let prefix = format!("{series},le=\"");
    let mut buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|line| line.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (bound, count) = rest.split_once("\"} ")?;
            let bound = if bound == "+Inf" {
                f64::INFINITY
            } else {
                bound.parse().ok()?
            };
            Some((bound, count.trim().parse().ok()?))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = (q * total).ceil().max(1.0);
    buckets
        .iter()
        .find(|(_, cumulative)| *cumulative >= rank)
        .map(|(bound, _)| *bound)
}

/// Resident memory of a process (Linux), 0 when unknown.
pub fn rss_bytes(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:") * 1024
}

/// The most resident memory a process has had so far (Linux `VmHWM`), 0 when unknown.
pub fn peak_rss_bytes(pid: u32) -> u64 {
    status_kib(pid, "VmHWM:") * 1024
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).map(str::to_string))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        .unwrap_or(0)
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

/// The same-host object path's own floor on this machine, in GB/s: `size` bytes copied
/// into a fresh sealed memfd (what a holder does once per object) and mapped with every
/// page populated (what a reader does), with no process, socket or actor between them.
/// On a VM it is bound by the kernel handing out fresh shared-memory pages, well below
/// memcpy; errors (no memfd) report as 0.
pub fn shared_memory_gbps(size: usize) -> f64 {
    let source = vec![5u8; size];
    let started = Instant::now();
    let mapped = regatta_object_store::Segment::create(&source)
        .map(std::sync::Arc::new)
        .and_then(|segment| segment.map());
    let secs = started.elapsed().as_secs_f64();
    match mapped {
        Ok(bytes) if bytes.len() == size => size as f64 / secs / 1e9,
        _ => 0.0,
    }
}

/// Streams `size` bytes over a loopback TCP connection wrapped in TLS 1.3 (the cluster's
/// own mutual-TLS configuration, from a token) between two tasks, and returns GB/s: what
/// rustls's 16 KiB records leave of the loopback on this machine. The object path's sealed
/// frames (1 MiB, opened in place) are not bound by it and run above it here.
pub async fn loopback_tls_gbps(size: usize) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let identity = regatta_net::identity_from_secret("loopback-tls-probe")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let acceptor = tokio_rustls::TlsAcceptor::from(identity.server.clone());
    let reader = tokio::spawn(async move {
        let (stream, _) = listener.accept().await?;
        let mut stream = acceptor.accept(stream).await?;
        let mut buffer = vec![0u8; 1 << 20];
        let mut total = 0usize;
        loop {
            let n = stream.read(&mut buffer).await?;
            if n == 0 {
                return Ok::<usize, std::io::Error>(total);
            }
            total += n;
        }
    });
    let connector = tokio_rustls::TlsConnector::from(identity.client.clone());
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from(regatta_net::SERVER_NAME)?;
    let mut stream = connector
        .connect(name, tokio::net::TcpStream::connect(address).await?)
        .await?;
    let chunk = vec![7u8; 1 << 20];
    let started = Instant::now();
    let mut sent = 0;
    while sent < size {
        let n = chunk.len().min(size - sent);
        stream.write_all(&chunk[..n]).await?;
        sent += n;
    }
    stream.shutdown().await?;
    let received = reader.await??;
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(received == size, "the TLS probe received {received} of {size} bytes");
    Ok(size as f64 / secs / 1e9)
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

/// Bounces a 64-byte message `count` times between two threads over loopback TCP with
/// Nagle off, and returns round trips per second: the floor under any request and reply
/// between processes on this machine (two kernel socket passes and two thread wake-ups).
pub fn loopback_tcp_round_trips(count: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    ping_pong(client, server, count)
}

/// As [`loopback_tcp_round_trips`], over a Unix socket pair: the floor of the call
/// channel between processes on one host.
pub fn loopback_unix_round_trips(count: usize) -> anyhow::Result<f64> {
    let (client, server) = std::os::unix::net::UnixStream::pair()?;
    ping_pong(client, server, count)
}

/// Round trips per second of 64-byte messages from this thread to an echo thread.
fn ping_pong<S: Read + Write + Send + 'static>(mut client: S, mut server: S, count: usize) -> anyhow::Result<f64> {
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut message = [0u8; 64];
        loop {
            match server.read_exact(&mut message) {
                Ok(()) => server.write_all(&message)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut message = [7u8; 64];
    let started = Instant::now();
    for _ in 0..count {
        client.write_all(&message)?;
        client.read_exact(&mut message)?;
    }
    let secs = started.elapsed().as_secs_f64();
    drop(client);
    echo.join().map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    Ok(count as f64 / secs)
}

/// As [`loopback_tcp_round_trips`], between two tokio tasks on two runtimes (the echo's own
/// two-thread runtime, the caller's): adds the runtimes' parking and waking to the floor.
pub async fn loopback_tcp_round_trips_tokio(count: usize) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            listener.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let (mut stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let mut message = [0u8; 64];
            tokio::spawn(async move {
                loop {
                    match stream.read_exact(&mut message).await {
                        Ok(_) => stream.write_all(&message).await?,
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                        Err(e) => return Err(anyhow::Error::from(e)),
                    }
                }
            })
            .await?
        })
    });
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream.set_nodelay(true)?;
    let mut message = [7u8; 64];
    let started = Instant::now();
    for _ in 0..count {
        stream.write_all(&message).await?;
        stream.read_exact(&mut message).await?;
    }
    let secs = started.elapsed().as_secs_f64();
    drop(stream);
    tokio::task::spawn_blocking(move || echo.join())
        .await?
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    Ok(count as f64 / secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_spread() {
        assert_eq!(mean_spread(&[2.0, 4.0]), (3.0, 1.0));
        assert_eq!(mean_spread(&[]), (0.0, 0.0));
    }

    const TEXT: &str = "# TYPE x histogram
x_bucket{request=\"spawn\",le=\"0.00001\"} 50
x_bucket{request=\"spawn\",le=\"0.0001\"} 98
x_bucket{request=\"spawn\",le=\"0.001\"} 100
x_bucket{request=\"spawn\",le=\"+Inf\"} 100
x_bucket{request=\"view\",le=\"0.00001\"} 0
x_bucket{request=\"view\",le=\"+Inf\"} 1
";

    #[test]
    fn quantiles_come_from_the_bucket_that_holds_them() {
        let spawn = "x_bucket{request=\"spawn\"";
        assert_eq!(histogram_quantile(TEXT, spawn, 0.5), Some(0.00001));
        assert_eq!(histogram_quantile(TEXT, spawn, 0.51), Some(0.0001));
        assert_eq!(histogram_quantile(TEXT, spawn, 0.99), Some(0.001));
        assert_eq!(
            histogram_quantile(TEXT, "x_bucket{request=\"view\"", 0.5),
            Some(f64::INFINITY)
        );
        assert_eq!(histogram_quantile(TEXT, "x_bucket{request=\"kill\"", 0.5), None);
    }
}
