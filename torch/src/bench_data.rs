//! `regatta-torch-rank bench-data SPEC_JSON`: one rank's streaming loader (the background
//! thread that reads, tokenizes and packs) feeding a training loop whose step is a no-op:
//! tokens/s of the loader and the process's resident memory over the run, as one JSON
//! line. What `regatta bench data` runs against a local folder and an S3-compatible server.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::TokenizerSettings;
use regatta_trainer::{DataConfig, SourceConfig};
use serde::{Deserialize, Serialize};

use crate::data::TextTokenizer;
use crate::error::{Error, Result};
use crate::stream::{plan, Loader, LoaderSpec};

/// What to measure.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchDataSpec {
    /// The source: a folder, prefix or file.
    pub source: String,
    /// Copy this local folder's files to `source` first (an object-store prefix).
    #[serde(default)]
    pub upload_from: Option<String>,
    /// A `tokenizer.json`.
    pub tokenizer: String,
    /// Tokens per row input.
    pub context: usize,
    /// Logical shards.
    pub shards: usize,
    /// The world the measured rank (rank 0) belongs to.
    pub world: usize,
    /// Rows the no-op step takes.
    pub rows_per_step: usize,
    /// Rows read ahead.
    pub prefetch: usize,
    /// How long to read.
    pub seconds: f64,
}

/// What was measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchDataResult {
    /// Tokens delivered (rows x context).
    pub tokens: u64,
    /// Rows delivered.
    pub rows: u64,
    /// Seconds of reading.
    pub seconds: f64,
    /// Tokens per second of the one loader.
    pub tokens_per_sec: f64,
    /// Files and bytes the source lists.
    pub files: usize,
    /// Bytes the source holds.
    pub dataset_bytes: u64,
    /// Seconds listing the source and dealing it to shards.
    pub plan_secs: f64,
    /// Seconds uploading (`upload_from`).
    pub upload_secs: f64,
    /// Resident memory (MiB) sampled once a second from the loader's start.
    pub rss_mib: Vec<f64>,
    /// Bytes of document text per token, measured on the first MiB of the first file.
    pub text_bytes_per_token: f64,
}

/// Bytes of `text` fields per token over the first MiB of `file` of `source`.
async fn bytes_per_token(source: &str, file: &str, tokenizer: &TextTokenizer) -> Result<f64> {
    let place = Place::dir(source)?;
    let size = place.size(file).await?;
    let head = place.get_range(file, 0..size.min(1 << 20)).await?;
    let (mut bytes, mut tokens) = (0usize, 0usize);
    for line in head.split(|b| *b == b'\n') {
        if let Ok(serde_json::Value::Object(row)) = serde_json::from_slice::<serde_json::Value>(line) {
            if let Some(text) = row.get("text").and_then(|t| t.as_str()) {
                bytes += text.len();
                tokens += tokenizer.encode(text.as_bytes())?.len();
            }
        }
    }
    Ok(bytes as f64 / tokens.max(1) as f64)
}

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn upload(from: &str, to: &str) -> Result<()> {
    let target = Place::dir(to)?;
    let mut names: Vec<_> = std::fs::read_dir(from)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .collect();
    names.sort_by_key(|e| e.file_name());
    for entry in names {
        let bytes = std::fs::read(entry.path())?;
        let name = entry.file_name().to_string_lossy().into_owned();
        target.put(&name, Bytes::from(bytes)).await?;
    }
    Ok(())
}

/// Runs the measurement and prints the result as one JSON line.
pub fn bench_data(spec: &BenchDataSpec) -> Result<BenchDataResult> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let started = Instant::now();
    if let Some(from) = &spec.upload_from {
        runtime.block_on(upload(from, &spec.source))?;
    }
    let upload_secs = started.elapsed().as_secs_f64();
    let tokenizer = Arc::new(runtime.block_on(TextTokenizer::load(&spec.tokenizer))?);
    let data = DataConfig {
        path: String::new(),
        sources: vec![SourceConfig {
            path: spec.source.clone(),
            weight: 1.0,
        }],
        shards: spec.shards,
        epochs: None,
        prefetch: spec.prefetch,
        ..DataConfig::default()
    };
    let planned = Instant::now();
    let plan = Arc::new(runtime.block_on(plan(&data, 1))?);
    let plan_secs = planned.elapsed().as_secs_f64();
    let files = plan.sources[0].files.len();
    let first = plan.sources[0].files[0].name.clone();
    let text_bytes_per_token = runtime.block_on(bytes_per_token(&plan.sources[0].url, &first, &tokenizer))?;
    let dataset_bytes = plan.sources[0].files.iter().map(|f| f.size).sum();
    let loader_spec = LoaderSpec {
        shards: regatta_trainer::stream::rank_shards(plan.shards, spec.world, 0),
        state: plan.start(),
        plan,
        context: spec.context,
        prefetch: spec.prefetch,
        after: None,
    };
    let settings = Arc::new(TokenizerSettings::default());
    let mut loader = Loader::start(loader_spec, tokenizer, settings, runtime.handle().clone())?;
    let start = Instant::now();
    let (mut tokens, mut rows) = (0u64, 0u64);
    let mut rss = vec![rss_mib()];
    let mut next_sample = 1.0;
    while start.elapsed().as_secs_f64() < spec.seconds {
        let taken = loader.take(spec.rows_per_step)?;
        // What the training loop does with them before its (no-op) step.
        let batches = crate::executor::stream_batches(&taken, spec.rows_per_step, spec.context);
        drop(batches);
        rows += taken.len() as u64;
        // Each row moves its shard's stream on by `context` tokens (endless: no padding).
        tokens += (taken.len() * spec.context) as u64;
        if start.elapsed().as_secs_f64() >= next_sample {
            rss.push(rss_mib());
            next_sample += 1.0;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let skipped = loader.take_skipped();
    if let Some(first) = skipped.first() {
        return Err(Error::Dataset(format!(
            "the benchmark corpus has {} unreadable rows, first: {}",
            skipped.len(),
            first.what
        )));
    }
    Ok(BenchDataResult {
        tokens,
        rows,
        seconds,
        tokens_per_sec: tokens as f64 / seconds.max(1e-9),
        files,
        dataset_bytes,
        plan_secs,
        upload_secs,
        rss_mib: rss,
        text_bytes_per_token,
    })
}
