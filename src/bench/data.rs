//! `regatta bench data`: the streaming loader's tokens/s per loader worker and its memory
//! over the run, reading a multi-GB JSONL corpus from a local folder and from an
//! S3-compatible server (moto, as the test suite runs it), with the training step a no-op
//! (`regatta-torch-rank bench-data`, the binary that holds the loader). The corpus is made
//! once and kept under `~/.cache/regatta/bench-corpus-<GB>g`.

use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};

/// Bytes per corpus file.
const FILE_BYTES: u64 = 64 << 20;
/// The IBM loader's figure per worker (`../shared/seeds/ibm-training-throughput.txt`).
const IBM_TOKENS_PER_SEC: f64 = 90_000.0;

/// The result line of `regatta-torch-rank bench-data` (its `BenchDataResult`).
#[derive(serde::Deserialize)]
struct Measured {
    tokens: u64,
    seconds: f64,
    tokens_per_sec: f64,
    files: usize,
    dataset_bytes: u64,
    plan_secs: f64,
    upload_secs: f64,
    rss_mib: Vec<f64>,
    text_bytes_per_token: f64,
}

/// Options of the data benchmark.
pub struct DataBench {
    /// Corpus size in GB (decimal).
    pub gigabytes: f64,
    /// Seconds each source is read.
    pub seconds: f64,
    /// Logical shards (all read by the one measured worker).
    pub shards: usize,
}

fn cache_dir() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/tmp".into());
    PathBuf::from(home).join(".cache/regatta")
}

/// Word `rank` of a synthetic language: `data/corpus.txt`'s distinct words first, then
/// syllable strings, so the vocabulary is far larger than the tokenizer's word cache.
fn word(rank: usize, known: &[&str]) -> String {
    if let Some(w) = known.get(rank) {
        return (*w).to_string();
    }
    const SYLLABLES: [&str; 24] = [
        "ka", "lo", "mi", "ten", "ra", "su", "vel", "do", "qui", "an", "or", "pe", "struk", "ia", "ne", "bo", "gar",
        "fu", "le", "shi", "on", "ty", "wex", "zu",
    ];
    let mut n = rank;
    let mut out = String::new();
    while n > 0 || out.len() < 4 {
        out.push_str(SYLLABLES[n % SYLLABLES.len()]);
        n /= SYLLABLES.len();
    }
    out
}

/// A deterministic stream of documents in 64 MiB JSONL files totalling `bytes`: words
/// drawn log-uniformly (about Zipf's law) from 300,000 (a quarter of the draws fall
/// outside the 10,000 most common, as in natural text's long tail); made once.
fn corpus(bytes: u64) -> anyhow::Result<PathBuf> {
    let dir = cache_dir().join(format!("bench-corpus-{}m", bytes >> 20));
    let marker = dir.with_extension("complete");
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(&bytes.to_string()) {
        return Ok(dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let text = std::fs::read_to_string(format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR")))?;
    let mut known: Vec<&str> = text.split_whitespace().collect();
    known.sort_unstable();
    known.dedup();
    const VOCABULARY: f64 = 300_000.0;
    let words: Vec<String> = (0..VOCABULARY as usize).map(|r| word(r, &known)).collect();
    eprintln!(
        "data: writing a {:.1} GB corpus to {}",
        bytes as f64 / 1e9,
        dir.display()
    );
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut written, mut file, mut doc) = (0u64, 0usize, 0u64);
    while written < bytes {
        let path = dir.join(format!("part-{file:05}.jsonl"));
        let mut out = BufWriter::with_capacity(1 << 20, std::fs::File::create(&path)?);
        let mut in_file = 0u64;
        while in_file < FILE_BYTES && written + in_file < bytes {
            let len = 50 + (next() % 400) as usize;
            let mut body = String::with_capacity(len * 7);
            for i in 0..len {
                if i > 0 {
                    body.push(' ');
                }
                let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
                let rank = (VOCABULARY.powf(u) as usize).saturating_sub(1).min(words.len() - 1);
                body.push_str(&words[rank]);
            }
            let line = format!("{}\n", serde_json::json!({"id": doc, "text": body}));
            out.write_all(line.as_bytes())?;
            in_file += line.len() as u64;
            doc += 1;
        }
        out.flush()?;
        written += in_file;
        file += 1;
    }
    std::fs::write(&marker, bytes.to_string())?;
    Ok(dir)
}

fn moto_server() -> Option<PathBuf> {
    [
        std::env::var("REGATTA_MOTO_SERVER").ok(),
        Some(
            cache_dir()
                .join("test-venv/bin/moto_server")
                .to_string_lossy()
                .into_owned(),
        ),
    ]
    .into_iter()
    .flatten()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

struct Moto(Child);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts moto on a free port with bucket `bench`; returns it and its endpoint.
fn start_moto(server: &Path) -> anyhow::Result<(Moto, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new(server)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", server.display()))?;
    let moto = Moto(child);
    let address = format!("127.0.0.1:{port}");
    let request = format!("PUT /bench HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    for _ in 0..300 {
        if let Ok(mut stream) = std::net::TcpStream::connect(&address) {
            let mut reply = String::new();
            if stream.write_all(request.as_bytes()).is_ok()
                && stream.read_to_string(&mut reply).is_ok()
                && reply.starts_with("HTTP/1.1 200")
            {
                return Ok((moto, format!("http://{address}")));
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("moto did not start on {address}")
}

fn measure(executor: &Path, spec: &serde_json::Value, env: &[(&str, &str)]) -> anyhow::Result<Measured> {
    let output = Command::new(executor)
        .args(["bench-data", &spec.to_string()])
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", executor.display()))?;
    if !output.status.success() {
        bail!("{} bench-data failed ({})", executor.display(), output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no result line")?;
    Ok(serde_json::from_str(line)?)
}

fn print(case: &str, r: &Measured, shards: usize) {
    // Memory after the loader has opened every shard's first unit (2 s in) to the end.
    let settled: Vec<f64> = r.rss_mib.iter().skip(2).copied().collect();
    let (low, high) = settled
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(l, h), v| (l.min(*v), h.max(*v)));
    println!(
        "data {case} loader tokens per second per worker {:.2} +- 0.00  ({:.2}x the IBM loader's 90,000; {:.2} MB/s \
         of text at {:.2} bytes/token; {} tokens in {:.1}s, {shards} shards, {} files of {:.2} GB listed in {:.2}s{})",
        r.tokens_per_sec,
        r.tokens_per_sec / IBM_TOKENS_PER_SEC,
        r.tokens_per_sec * r.text_bytes_per_token / 1e6,
        r.text_bytes_per_token,
        r.tokens,
        r.seconds,
        r.files,
        r.dataset_bytes as f64 / 1e9,
        r.plan_secs,
        if r.upload_secs > 0.5 {
            format!(", uploaded in {:.0}s", r.upload_secs)
        } else {
            String::new()
        }
    );
    println!(
        "data {case} loader resident MiB from 2s to the end {low:.1} .. {high:.1} (first {:.1}, last {:.1}, {} samples)",
        r.rss_mib.first().copied().unwrap_or(0.0),
        r.rss_mib.last().copied().unwrap_or(0.0),
        r.rss_mib.len()
    );
    let every: Vec<String> = r.rss_mib.iter().step_by(10).map(|v| format!("{v:.0}")).collect();
    println!("data {case} loader resident MiB every 10s: {}", every.join(" "));
}

/// Runs the benchmark: the local folder, then moto when it is installed.
pub fn run(bench: &DataBench) -> anyhow::Result<()> {
    let executor = regatta_runtime::executor::executor_path(None).map_err(anyhow::Error::msg)?;
    let bytes = (bench.gigabytes * 1e9) as u64;
    let dir = corpus(bytes)?;
    let tokenizer = format!("{}/data/tokenizer.json", env!("CARGO_MANIFEST_DIR"));
    let spec = |source: &str, upload: Option<&Path>| {
        serde_json::json!({
            "source": source,
            "upload_from": upload.map(|p| p.to_string_lossy().into_owned()),
            "tokenizer": tokenizer,
            "context": 2048,
            "shards": bench.shards,
            "world": 1,
            "rows_per_step": 4,
            "prefetch": 64,
            "seconds": bench.seconds,
        })
    };
    println!(
        "data: one loader worker (the rank's background thread: ranged reads, JSON parsing, tokenizing with \
         data/tokenizer.json, packing to 2048 tokens), training step a no-op"
    );
    let local = measure(&executor, &spec(&dir.to_string_lossy(), None), &[])?;
    print("local", &local, bench.shards);
    let Some(server) = moto_server() else {
        println!(
            "data s3: skipped: moto_server not found (scripts/test.sh installs it in ~/.cache/regatta/test-venv, or set \
             REGATTA_MOTO_SERVER)"
        );
        return Ok(());
    };
    let (_moto, endpoint) = start_moto(&server)?;
    let env = [
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ALLOW_HTTP", "true"),
    ];
    let s3 = measure(&executor, &spec("s3://bench/corpus/", Some(&dir)), &env)?;
    print("s3 (moto)", &s3, bench.shards);
    Ok(())
}
