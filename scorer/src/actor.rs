//! The scorer actor: a light actor inside a node's agent that launches its executor
//! (`regatta-torch-rank score`, which links libtorch and holds the model), and scores one
//! partition per request: reads the partition's rows through object_store, batches them by
//! length, has the executor score each batch, and writes the partition's output (errors
//! file first, then the Parquet file under its final name, so the Parquet file's existence
//! means the partition is done).

use crate::error::{Error, Result};
use std::ops::Range;
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};
use regatta_object_store::Place;
use regatta_runtime::{Actor, ActorContext, ActorError};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::output::{to_parquet, ScoredRow};
use crate::parquet_input::{ParquetInput, RowSlice};
use crate::partition::{owned_lines, parse_row, read_window, Row, RowError};
use crate::plan::{errors_name, length_batches, output_name};
use crate::protocol::{FromScorer, ScorerSetup, ToScorer};

/// How long loading a checkpoint may take.
const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// Constructor arguments.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScorerArgs {
    /// How the executor loads the model (GPUs are filled in on the node).
    pub setup: ScorerSetup,
    /// Rows per batch.
    pub batch_size: usize,
    /// The executor binary; `None`: `regatta-torch-rank` next to the node's binary.
    pub executor: Option<String>,
}

/// Which rows of the input a partition holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Slice {
    /// JSONL: the lines whose first byte falls in `start..end`.
    Bytes {
        /// Start of the byte range.
        start: u64,
        /// End of the range (exclusive).
        end: u64,
    },
    /// Parquet: rows of one row group.
    Rows(RowSlice),
}

/// One partition to score.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartitionTask {
    /// The input (path or URL): JSONL, or Parquet when the name ends in `.parquet`.
    pub input: String,
    /// The partition's index.
    pub partition: usize,
    /// Its rows.
    pub slice: Slice,
    /// The output directory (path or URL).
    pub output: String,
    /// Whether this run handed the partition out before (counted as a retry).
    pub retry: bool,
}

/// What scoring a partition did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartitionReport {
    /// The partition.
    pub partition: usize,
    /// Rows scored.
    pub rows: u64,
    /// Rows that went to the errors file.
    pub errors: u64,
    /// Tokens scored.
    pub tokens: u64,
    /// Wall time.
    pub seconds: f64,
    /// The node that scored it.
    pub node: String,
}

struct Metrics {
    rows: IntCounterVec,
    tokens: IntCounterVec,
    partitions: IntCounterVec,
    batch_seconds: HistogramVec,
}

fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let registry = regatta_runtime::metrics().registry();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            let _ = registry.register(Box::new(metric.clone()));
            metric
        };
        let batch_seconds = HistogramVec::new(
            HistogramOpts::new("regatta_score_batch_seconds", "Time to score one batch")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &[],
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(batch_seconds.clone()));
        Metrics {
            rows: counter(
                "regatta_score_rows_total",
                "Rows scored, and rows refused as malformed",
                &["outcome"],
            ),
            tokens: counter("regatta_score_tokens_total", "Tokens scored", &[]),
            partitions: counter(
                "regatta_score_partitions_total",
                "Partitions finished, failed, or started again after a failure or a lost actor",
                &["outcome"],
            ),
            batch_seconds,
        }
    })
}

/// A scorer actor.
pub struct ScorerActor {
    batch_size: usize,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    _child: Child,
}

impl ScorerActor {
    async fn request(&mut self, message: &ToScorer) -> Result<FromScorer> {
        let line = serde_json::to_string(message)?;
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| Error::Executor(format!("the scorer executor is gone: {e}")))?;
        read_reply(&mut self.stdout).await
    }

    async fn read_rows(task: &PartitionTask) -> Result<(Vec<(u64, Row)>, Vec<RowError>)> {
        match &task.slice {
            Slice::Bytes { start, end } => Self::read_lines(&task.input, *start..*end).await,
            Slice::Rows(rows) => ParquetInput::open(&task.input).await?.read(rows).await,
        }
    }

    async fn read_lines(input: &str, range: Range<u64>) -> Result<(Vec<(u64, Row)>, Vec<RowError>)> {
        let (place, name) = Place::file(input).map_err(Error::Storage)?;
        let size = place.size(&name).await.map_err(Error::Storage)?;
        let range = range.start..range.end.min(size);
        let mut window = read_window(&range);
        loop {
            let buf = place.get_range(&name, window.clone()).await.map_err(Error::Storage)?;
            let (lines, more) = owned_lines(&buf, window.start, &range, window.end >= size);
            if more.is_some() {
                // Grow geometrically: a very long line costs O(n) bytes fetched, not O(n^2).
                let grow = (window.end - window.start).max(64 << 10);
                window.end = (window.end + grow).min(size);
                continue;
            }
            let (mut rows, mut errors) = (Vec::new(), Vec::new());
            for (offset, line) in lines {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                match parse_row(line, offset) {
                    Ok(row) => rows.push((offset, row)),
                    Err(error) => errors.push(error),
                }
            }
            return Ok((rows, errors));
        }
    }
}

async fn read_reply(stdout: &mut Lines<BufReader<ChildStdout>>) -> Result<FromScorer> {
    loop {
        match stdout.next_line().await {
            Ok(Some(line)) => match serde_json::from_str(&line) {
                Ok(message) => return Ok(message),
                Err(_) => tracing::info!("scorer executor: {line}"),
            },
            Ok(None) => {
                return Err(Error::Executor(
                    "the scorer executor exited (see the node's log)".into(),
                ))
            }
            Err(e) => return Err(Error::Executor(format!("cannot read from the scorer executor: {e}"))),
        }
    }
}

impl Actor for ScorerActor {
    const KIND: &'static str = "scorer";
    type Args = ScorerArgs;
    type Request = PartitionTask;
    type Reply = PartitionReport;

    async fn create(args: ScorerArgs, ctx: &ActorContext) -> std::result::Result<Self, ActorError> {
        let mut setup = args.setup;
        setup.gpus = ctx.gpu_ids().to_vec();
        let path =
            regatta_trainer::executor_path(args.executor.as_deref()).map_err(|e| Error::Executor(e.to_string()))?;
        let mut child = regatta_trainer::rank::executor_command(&path, &setup.gpus)
            .arg("score")
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::Executor(format!("cannot start the scorer executor {}: {e}", path.display())))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::Executor("the executor's pipes are missing".into()).into());
        };
        let mut actor = Self {
            batch_size: args.batch_size.max(1),
            stdin,
            stdout: BufReader::new(stdout).lines(),
            _child: child,
        };
        let line = serde_json::to_string(&ToScorer::Setup(setup))?;
        actor
            .stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| Error::Executor(format!("the scorer executor is gone: {e}")))?;
        match tokio::time::timeout(READY_TIMEOUT, read_reply(&mut actor.stdout)).await {
            Ok(Ok(FromScorer::Ready { .. })) => Ok(actor),
            Ok(Ok(FromScorer::Failed(reason))) => {
                Err(Error::Executor(format!("the scorer cannot load its model: {reason}")).into())
            }
            Ok(Ok(other)) => {
                Err(Error::Executor(format!("the scorer executor said {other:?} before it was ready")).into())
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(Error::Executor(format!(
                "the scorer executor did not load its model within {READY_TIMEOUT:?}"
            ))
            .into()),
        }
    }

    async fn handle(
        &mut self,
        task: PartitionTask,
        ctx: &ActorContext,
    ) -> std::result::Result<PartitionReport, ActorError> {
        let started = Instant::now();
        let m = metrics();
        if task.retry {
            m.partitions.with_label_values(&["retried"]).inc();
        }
        let outcome = async {
            let (rows, mut errors) = Self::read_rows(&task).await?;
            let (offsets, rows): (Vec<u64>, Vec<Row>) = rows.into_iter().unzip();
            let lengths: Vec<usize> = rows.iter().map(|r| r.text.len()).collect();
            let mut scored: Vec<Option<ScoredRow>> = vec![None; rows.len()];
            let mut tokens = 0u64;
            for batch in length_batches(&lengths, self.batch_size) {
                let request: Vec<(String, String)> = batch
                    .iter()
                    .map(|i| (rows[*i].id.clone(), rows[*i].text.clone()))
                    .collect();
                let timer = Instant::now();
                let reply = self.request(&ToScorer::Batch(request)).await?;
                m.batch_seconds
                    .with_label_values(&[] as &[&str])
                    .observe(timer.elapsed().as_secs_f64());
                let FromScorer::Scored(results) = reply else {
                    return Err(Error::Executor(format!(
                        "the scorer executor replied {reply:?} to a batch"
                    )));
                };
                if results.len() != batch.len() {
                    return Err(Error::Executor(format!(
                        "{} results for a batch of {}",
                        results.len(),
                        batch.len()
                    )));
                }
                for (i, result) in batch.into_iter().zip(results) {
                    match result {
                        Ok(score) => {
                            tokens += score.tokens;
                            scored[i] = Some(ScoredRow {
                                id: rows[i].id.clone(),
                                tokens: score.tokens as i64,
                                truncated: score.truncated,
                                log_likelihood: score.log_likelihood,
                                perplexity: score.perplexity,
                                generated: score.generated,
                            });
                        }
                        Err(reason) => errors.push(RowError {
                            id: Some(rows[i].id.clone()),
                            offset: offsets[i],
                            reason,
                        }),
                    }
                }
            }
            let scored: Vec<ScoredRow> = scored.into_iter().flatten().collect();
            let out = Place::dir(&task.output).map_err(Error::Storage)?;
            if !errors.is_empty() {
                let mut text = String::new();
                for error in &errors {
                    text.push_str(&serde_json::to_string(error).map_err(|e| Error::Output(e.to_string()))?);
                    text.push('\n');
                }
                out.put(&errors_name(task.partition), Bytes::from(text))
                    .await
                    .map_err(Error::Storage)?;
            }
            out.put(&output_name(task.partition), to_parquet(&scored)?)
                .await
                .map_err(Error::Storage)?;
            m.rows.with_label_values(&["scored"]).inc_by(scored.len() as u64);
            m.rows.with_label_values(&["malformed"]).inc_by(errors.len() as u64);
            m.tokens.with_label_values(&[] as &[&str]).inc_by(tokens);
            Ok(PartitionReport {
                partition: task.partition,
                rows: scored.len() as u64,
                errors: errors.len() as u64,
                tokens,
                seconds: started.elapsed().as_secs_f64(),
                node: ctx.node().to_string(),
            })
        }
        .await;
        let label = if outcome.is_ok() { "done" } else { "failed" };
        m.partitions.with_label_values(&[label]).inc();
        outcome.map_err(ActorError::from)
    }
}
