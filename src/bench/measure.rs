//! What every benchmark shares: the mean and spread of trials, the line format, and the
//! machine's own limits measured in the same run (memcpy, loopback TCP, resident memory).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

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

/// The `q` quantile (0 to 1) of `values`, sorted in place; 0 for none.
pub(super) fn quantile(values: &mut [f64], q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64 - 1.0) * q).round() as usize;
    values.get(index).copied().unwrap_or(0.0)
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
