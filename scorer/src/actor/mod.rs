//! The scorer actor: a light actor inside a node's agent that launches its executor
//! (`regatta-torch-rank score`, which links libtorch and holds the model), and scores one
//! partition per request: reads the partition's rows through object_store, batches them by
//! length, has the executor score each batch, and writes the partition's output (errors
//! file first, then the Parquet file under its final name, so the Parquet file's existence
//! means the partition is done).
//!
//! Scoring is in `score.rs`, generating (rows joining the executor's running batch) in
//! `generate.rs`, the pipe to the executor in `link.rs`, writing a partition's outcome in
//! `finish.rs` and the Prometheus series in `metrics.rs`.

mod finish;
mod generate;
mod link;
mod metrics;
mod score;

use std::sync::Arc;
use std::time::Duration;

use regatta_runtime::executor::{launch, Launch};
use regatta_runtime::{Actor, ActorContext, ActorError};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::error::{Error, Result};
use crate::generate::SamplingParams;
use crate::parquet_input::RowSlice;
use crate::protocol::{FromScorer, ScorerSetup, ToScorer};
use finish::finish_partition;
use generate::generate;
use link::{read_reply, Link, LinkState};

/// How long loading a checkpoint may take.
const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// Constructor arguments.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScorerArgs {
    /// How the executor loads the model (GPUs are filled in on the node).
    pub setup: ScorerSetup,
    /// The run's sampling defaults when it generates (rows lay their `params` over them);
    /// `None`: the run scores.
    #[serde(default)]
    pub sampling: Option<SamplingParams>,
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
    /// Tokens scored (prompt tokens, when generating).
    pub tokens: u64,
    /// Tokens generated.
    #[serde(default)]
    pub output_tokens: u64,
    /// Wall time.
    pub seconds: f64,
    /// The node that scored it.
    pub node: String,
}

/// Partitions a generating scorer has in flight at once: the next one's rows join the
/// executor's batch while the last rows of the one before still decode, so the batch
/// never drains between partitions.
pub const GENERATE_DEPTH: usize = 2;

/// A scorer actor.
pub struct ScorerActor {
    batch_size: usize,
    stdin: Arc<tokio::sync::Mutex<ChildStdin>>,
    /// A scoring run's replies, read by the one call in flight.
    stdout: Option<Lines<BufReader<ChildStdout>>>,
    /// A generating run's link to its executor (replies read by a task of their own).
    link: Option<Arc<Link>>,
    _child: Child,
}

impl Actor for ScorerActor {
    const KIND: &'static str = "scorer";
    type Args = ScorerArgs;
    type Request = PartitionTask;
    type Reply = PartitionReport;

    async fn create(args: ScorerArgs, ctx: &ActorContext) -> std::result::Result<Self, ActorError> {
        let mut setup = args.setup;
        setup.gpus = ctx.gpu_ids().to_vec();
        let executor = launch(&Launch {
            executor: args.executor.clone(),
            args: vec!["score".into()],
            env: Vec::new(),
            gpus: setup.gpus.clone(),
            capture_stderr: false,
            storage: true,
        })
        .map_err(|e| Error::Executor(e.to_string()))?;
        let (child, mut stdin, stdout) = (executor.child, executor.stdin, executor.stdout);
        let mut stdout = BufReader::new(stdout).lines();
        let model_name = setup
            .checkpoint
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let line = serde_json::to_string(&ToScorer::Setup(setup))?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| Error::Executor(format!("the scorer executor is gone: {e}")))?;
        await_ready(&mut stdout).await?;
        let stdin = Arc::new(tokio::sync::Mutex::new(stdin));
        let (stdout, link) = match args.sampling {
            Some(sampling) => {
                let link = Arc::new(Link {
                    stdin: stdin.clone(),
                    sampling,
                    model_name,
                    state: std::sync::Mutex::new(LinkState::default()),
                });
                tokio::spawn(link.clone().read_replies(stdout));
                (None, Some(link))
            }
            None => (Some(stdout), None),
        };
        Ok(Self {
            batch_size: args.batch_size.max(1),
            stdin,
            stdout,
            link,
            _child: child,
        })
    }

    async fn handle(
        &mut self,
        task: PartitionTask,
        ctx: &ActorContext,
    ) -> std::result::Result<PartitionReport, ActorError> {
        let node = ctx.node().to_string();
        match self.link.clone() {
            Some(link) => finish_partition(task.clone(), node, async move { generate(&link, &task).await }).await,
            None => {
                let work = self.score(&task);
                finish_partition(task.clone(), node, work).await
            }
        }
    }

    fn max_concurrency(&self) -> usize {
        if self.link.is_some() {
            GENERATE_DEPTH
        } else {
            1
        }
    }

    fn handle_concurrently(
        &self,
        task: PartitionTask,
        ctx: &ActorContext,
    ) -> Option<futures::future::BoxFuture<'static, std::result::Result<PartitionReport, ActorError>>> {
        let link = self.link.clone()?;
        let node = ctx.node().to_string();
        Some(Box::pin(finish_partition(task.clone(), node, async move {
            generate(&link, &task).await
        })))
    }
}

/// Waits for the executor to say it has loaded its model.
async fn await_ready(stdout: &mut Lines<BufReader<ChildStdout>>) -> Result<()> {
    match tokio::time::timeout(READY_TIMEOUT, read_reply(stdout)).await {
        Ok(Ok(FromScorer::Ready {
            params,
            device,
            kv_cache_bytes,
        })) => {
            match kv_cache_bytes {
                Some(bytes) => tracing::info!(
                    "scorer ready: {params} parameters on {device}, KV cache budget {} MiB",
                    bytes >> 20
                ),
                None => tracing::info!("scorer ready: {params} parameters on {device}"),
            }
            Ok(())
        }
        Ok(Ok(FromScorer::Failed(reason))) => {
            Err(Error::Executor(format!("the scorer cannot load its model: {reason}")))
        }
        Ok(Ok(other)) => Err(Error::Executor(format!(
            "the scorer executor said {other:?} before it was ready"
        ))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Error::Executor(format!(
            "the scorer executor did not load its model within {READY_TIMEOUT:?}"
        ))),
    }
}
