//! The scorer actor: a light actor inside a node's agent that launches its executor
//! (`regatta-torch-rank score`, which links libtorch and holds the model), and scores one
//! partition per request: reads the partition's rows through object_store, batches them by
//! length, has the executor score each batch, and writes the partition's output (errors
//! file first, then the Parquet file under its final name, so the Parquet file's existence
//! means the partition is done).

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts};
use regatta_object_store::Place;
use regatta_runtime::executor::{launch, Launch};
use regatta_runtime::{Actor, ActorContext, ActorError};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::oneshot;

use crate::generate::openai::{self, Endpoint, OpenAiRow};
use crate::generate::{parse_prompt_row, GenRequest, GenStats, Generation, Prompt, PromptRow, SamplingParams};
use crate::jsonl::read_owned_lines;
use crate::output::{generated_to_parquet, to_parquet, GeneratedRow, ScoredRow};
use crate::parquet_input::{ParquetInput, RowSlice};
use crate::partition::{parse_row, Row, RowError};
use crate::plan::{errors_name, length_batches, openai_errors_name, openai_output_name, output_name};
use crate::protocol::{FromScorer, ScorerSetup, ToScorer};

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

struct Metrics {
    rows: IntCounterVec,
    tokens: IntCounterVec,
    output_tokens: IntCounterVec,
    partitions: IntCounterVec,
    batch_seconds: HistogramVec,
    /// Generation figures summed over the process's scorer actors: each actor adds the
    /// change since its last report and takes its share back when it stops, so the series
    /// are one per node whatever the number of actors it ever hosted.
    running: IntGauge,
    waiting: IntGauge,
    capacity: IntGauge,
    kv_used: IntGauge,
    kv_blocks: IntGauge,
    preemptions: prometheus::IntCounter,
    cached_tokens: prometheus::IntCounter,
}

impl Metrics {
    /// Applies the change from `before` to `after` of one actor's generation figures.
    fn generation(&self, before: &GenStats, after: &GenStats) {
        let delta = |a: usize, b: usize| b as i64 - a as i64;
        self.running.add(delta(before.running, after.running));
        self.waiting.add(delta(before.waiting, after.waiting));
        self.capacity.add(delta(before.max_batch, after.max_batch));
        self.kv_used.add(delta(before.used_blocks, after.used_blocks));
        self.kv_blocks.add(delta(before.blocks, after.blocks));
        self.output_tokens
            .with_label_values(&[] as &[&str])
            .inc_by(after.new_tokens);
        self.preemptions
            .inc_by(after.preemptions.saturating_sub(before.preemptions));
        self.cached_tokens
            .inc_by(after.cached_tokens.saturating_sub(before.cached_tokens));
    }
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
        let gauge = |name: &str, help: &str| {
            let metric = IntGauge::new(name, help).expect("valid metric");
            let _ = registry.register(Box::new(metric.clone()));
            metric
        };
        let plain_counter = |name: &str, help: &str| {
            let metric = prometheus::IntCounter::new(name, help).expect("valid metric");
            let _ = registry.register(Box::new(metric.clone()));
            metric
        };
        Metrics {
            output_tokens: counter("regatta_score_output_tokens_total", "Tokens generated", &[]),
            running: gauge(
                "regatta_score_running_sequences",
                "Sequences the node's scorers are decoding",
            ),
            waiting: gauge(
                "regatta_score_waiting_sequences",
                "Sequences waiting for a batch slot or KV cache blocks (the queue)",
            ),
            capacity: gauge(
                "regatta_score_batch_capacity",
                "Sequences the node's generating scorers may decode at once (their max_batch)",
            ),
            kv_used: gauge("regatta_score_kv_blocks_used", "KV cache blocks in use"),
            preemptions: plain_counter(
                "regatta_score_preemptions_total",
                "Sequences preempted for cache blocks (recomputed when they join again)",
            ),
            cached_tokens: plain_counter(
                "regatta_score_prefix_cached_tokens_total",
                "Tokens found in cached KV blocks when a row joined (a shared prefix, or a preempted row's own blocks)",
            ),
            kv_blocks: gauge(
                "regatta_score_kv_blocks",
                "KV cache blocks of the node's generating scorers",
            ),
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

/// A partition's output before it is written.
struct Outcome {
    rows: u64,
    file: Bytes,
    /// Files written before the output file (OpenAI-format results), by name.
    extra: Vec<(String, Bytes)>,
    errors: Vec<RowError>,
    tokens: u64,
    output_tokens: u64,
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

/// What a generating scorer's partitions share: the executor's stdin, and the answers
/// its reply reader hands to each partition by tag.
struct Link {
    stdin: Arc<tokio::sync::Mutex<ChildStdin>>,
    sampling: SamplingParams,
    /// The model's name in OpenAI-format answers (the last part of its location).
    model_name: String,
    state: std::sync::Mutex<LinkState>,
}

type Answer = std::result::Result<Vec<std::result::Result<Generation, String>>, String>;

#[derive(Default)]
struct LinkState {
    waiting: HashMap<u64, oneshot::Sender<Answer>>,
    /// Set once the executor is gone: later partitions fail at once.
    gone: Option<String>,
}

impl Link {
    /// Registers a partition's answer before its rows go out.
    fn expect(&self, tag: u64) -> Result<oneshot::Receiver<Answer>> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| Error::Executor("a scorer link lock was poisoned".into()))?;
        if let Some(reason) = &state.gone {
            return Err(Error::Executor(reason.clone()));
        }
        let (sender, receiver) = oneshot::channel();
        state.waiting.insert(tag, sender);
        Ok(receiver)
    }

    /// Hands `answer` to the partition tagged `tag` (no one waiting: dropped).
    fn answer(&self, tag: u64, answer: Answer) {
        if let Ok(mut state) = self.state.lock() {
            if let Some(sender) = state.waiting.remove(&tag) {
                let _ = sender.send(answer);
            }
        }
    }

    /// Fails every partition waiting (and, when `gone`, every later one).
    fn fail_all(&self, reason: &str, gone: bool) {
        if let Ok(mut state) = self.state.lock() {
            for (_, sender) in state.waiting.drain() {
                let _ = sender.send(Err(reason.to_string()));
            }
            if gone {
                state.gone = Some(reason.to_string());
            }
        }
    }

    /// Reads the executor's replies until it exits: answers by tag, progress figures to
    /// the node's gauges (taken back when the executor is gone).
    async fn read_replies(self: Arc<Self>, mut stdout: Lines<BufReader<ChildStdout>>) {
        let m = metrics();
        let mut reported = GenStats::default();
        loop {
            match read_reply(&mut stdout).await {
                Ok(FromScorer::Stats(stats)) => {
                    m.generation(&reported, &stats);
                    reported = GenStats { new_tokens: 0, ..stats };
                }
                Ok(FromScorer::Generated { tag, results }) => self.answer(tag, Ok(results)),
                Ok(FromScorer::Failed(reason)) => self.fail_all(&format!("generation failed: {reason}"), false),
                Ok(other) => tracing::warn!("the scorer executor said {other:?} while generating"),
                Err(e) => {
                    self.fail_all(&e.to_string(), true);
                    break;
                }
            }
        }
        m.generation(&reported, &GenStats::default());
    }
}

async fn send(stdin: &tokio::sync::Mutex<ChildStdin>, message: &ToScorer) -> Result<()> {
    let line = serde_json::to_string(message)?;
    stdin
        .lock()
        .await
        .write_all(format!("{line}\n").as_bytes())
        .await
        .map_err(|e| Error::Executor(format!("the scorer executor is gone: {e}")))
}

impl ScorerActor {
    async fn request(&mut self, message: &ToScorer) -> Result<FromScorer> {
        send(&self.stdin, message).await?;
        let stdout = self
            .stdout
            .as_mut()
            .ok_or_else(|| Error::Executor("this scorer generates; it cannot score batches".into()))?;
        read_reply(stdout).await
    }

    /// A generating run's rows: JSONL lines with `prompt`, `text` or `messages` (and
    /// `params`); Parquet rows' `text` as the prompt.
    /// Also says whether any line is in OpenAI's batch input format (the partition's
    /// results are then also written in OpenAI's batch output format).
    async fn read_prompt_rows(task: &PartitionTask) -> Result<(Vec<(u64, PromptRow)>, Vec<RowError>, bool)> {
        match &task.slice {
            Slice::Bytes { start, end } => {
                let (place, name) = Place::file(&task.input)?;
                let size = place.size(&name).await?;
                let (mut rows, mut errors, mut openai_lines) = (Vec::new(), Vec::new(), false);
                for (offset, line) in read_owned_lines(&place, &name, size, *start..*end).await? {
                    // A cheap look for OpenAI's key; the parse decides the row.
                    openai_lines |= line.windows(11).any(|w| w == b"\"custom_id\"");
                    match parse_prompt_row(&line, offset) {
                        Ok(row) => rows.push((offset, row)),
                        Err(error) => errors.push(error),
                    }
                }
                Ok((rows, errors, openai_lines))
            }
            Slice::Rows(_) => {
                let (rows, errors) = Self::read_rows(task).await?;
                let rows = rows
                    .into_iter()
                    .map(|(offset, row)| {
                        let prompt = PromptRow {
                            id: row.id,
                            prompt: Prompt::Text(row.text),
                            params: None,
                            openai: None,
                        };
                        (offset, prompt)
                    })
                    .collect();
                Ok((rows, errors, false))
            }
        }
    }

    /// Scores a partition's rows in length-sorted batches.
    async fn score(&mut self, task: &PartitionTask) -> Result<Outcome> {
        let m = metrics();
        let (rows, mut errors) = Self::read_rows(task).await?;
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
        Ok(Outcome {
            rows: scored.len() as u64,
            file: to_parquet(&scored)?,
            extra: Vec::new(),
            errors,
            tokens,
            output_tokens: 0,
        })
    }

    async fn read_rows(task: &PartitionTask) -> Result<(Vec<(u64, Row)>, Vec<RowError>)> {
        match &task.slice {
            Slice::Bytes { start, end } => Self::read_lines(&task.input, *start..*end).await,
            Slice::Rows(rows) => ParquetInput::open(&task.input).await?.read(rows).await,
        }
    }

    async fn read_lines(input: &str, range: Range<u64>) -> Result<(Vec<(u64, Row)>, Vec<RowError>)> {
        let (place, name) = Place::file(input)?;
        let size = place.size(&name).await?;
        let (mut rows, mut errors) = (Vec::new(), Vec::new());
        for (offset, line) in read_owned_lines(&place, &name, size, range).await? {
            match parse_row(&line, offset) {
                Ok(row) => rows.push((offset, row)),
                Err(error) => errors.push(error),
            }
        }
        Ok((rows, errors))
    }
}

/// Generates for a partition's rows: every row with valid settings goes to the executor
/// in one request, tagged with the partition, and joins its running batch; rows it cannot
/// run, and rows with bad settings, go to the errors file.
async fn generate(link: &Link, task: &PartitionTask) -> Result<Outcome> {
    let (rows, mut errors, openai_lines) = ScorerActor::read_prompt_rows(task).await?;
    let mut requests = Vec::with_capacity(rows.len());
    let mut offsets = Vec::with_capacity(rows.len());
    let mut metas = Vec::with_capacity(rows.len());
    for (offset, row) in rows {
        match link.sampling.with_overrides(row.params.as_ref()) {
            Ok(params) => {
                offsets.push(offset);
                metas.push(row.openai);
                requests.push(GenRequest {
                    id: row.id,
                    prompt: row.prompt,
                    params,
                });
            }
            Err(reason) => errors.push(RowError {
                id: Some(row.id),
                offset,
                reason,
            }),
        }
    }
    let results = if requests.is_empty() {
        Vec::new()
    } else {
        let tag = task.partition as u64;
        let answer = link.expect(tag)?;
        let sent = send(
            &link.stdin,
            &ToScorer::Generate {
                tag,
                rows: requests.clone(),
            },
        )
        .await;
        if let Err(e) = sent {
            link.answer(tag, Err(e.to_string()));
            return Err(e);
        }
        let results = answer
            .await
            .map_err(|_| Error::Executor("the scorer executor's reply reader stopped".into()))?
            .map_err(Error::Executor)?;
        if results.len() != requests.len() {
            return Err(Error::Executor(format!(
                "the scorer executor answered {} rows to generate with {} results",
                requests.len(),
                results.len()
            )));
        }
        results
    };
    let mut out = Vec::with_capacity(results.len());
    let mut openai_out = String::new();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (mut prompt_tokens, mut output_tokens) = (0, 0);
    for (((request, offset), meta), result) in requests.into_iter().zip(offsets).zip(metas).zip(results) {
        match result {
            Ok(g) => {
                prompt_tokens += g.prompt_tokens;
                output_tokens += g.generated_tokens;
                if openai_lines {
                    let meta = meta.unwrap_or(OpenAiRow {
                        endpoint: if matches!(request.prompt, Prompt::Chat(_)) {
                            Endpoint::Chat
                        } else {
                            Endpoint::Completions
                        },
                        model: None,
                    });
                    let line = openai::output_line(
                        &request.id,
                        &meta,
                        &link.model_name,
                        &g.text,
                        &g.finish_reason,
                        g.prompt_tokens,
                        g.generated_tokens,
                        created,
                    );
                    openai_out.push_str(&line.to_string());
                    openai_out.push('\n');
                }
                out.push(GeneratedRow {
                    id: request.id,
                    generated: g.text,
                    prompt_tokens: g.prompt_tokens as i64,
                    generated_tokens: g.generated_tokens as i64,
                    finish_reason: g.finish_reason,
                    token_logprobs: g.logprobs,
                });
            }
            Err(reason) => errors.push(RowError {
                id: Some(request.id),
                offset,
                reason,
            }),
        }
    }
    let mut extra = Vec::new();
    if openai_lines {
        let mut error_lines = String::new();
        for error in &errors {
            error_lines.push_str(&openai::error_line(error).to_string());
            error_lines.push('\n');
        }
        extra.push((openai_errors_name(task.partition), Bytes::from(error_lines)));
        extra.push((openai_output_name(task.partition), Bytes::from(openai_out)));
    }
    Ok(Outcome {
        rows: out.len() as u64,
        file: generated_to_parquet(&out)?,
        extra,
        errors,
        tokens: prompt_tokens,
        output_tokens,
    })
}

/// Runs a partition's work and writes its output: the errors file first, then the output
/// file under its final name (its existence means the partition is done).
async fn finish_partition(
    task: PartitionTask,
    node: String,
    work: impl std::future::Future<Output = Result<Outcome>>,
) -> std::result::Result<PartitionReport, ActorError> {
    let started = Instant::now();
    let m = metrics();
    if task.retry {
        m.partitions.with_label_values(&["retried"]).inc();
    }
    let outcome = async {
        let done = work.await?;
        let out = Place::dir(&task.output)?;
        if !done.errors.is_empty() {
            let mut text = String::new();
            for error in &done.errors {
                text.push_str(&serde_json::to_string(error).map_err(|e| Error::Output(e.to_string()))?);
                text.push('\n');
            }
            out.put(&errors_name(task.partition), Bytes::from(text)).await?;
        }
        for (name, bytes) in done.extra {
            out.put(&name, bytes).await?;
        }
        out.put(&output_name(task.partition), done.file).await?;
        m.rows.with_label_values(&["scored"]).inc_by(done.rows);
        m.rows
            .with_label_values(&["malformed"])
            .inc_by(done.errors.len() as u64);
        m.tokens.with_label_values(&[] as &[&str]).inc_by(done.tokens);
        Ok::<_, Error>(PartitionReport {
            partition: task.partition,
            rows: done.rows,
            errors: done.errors.len() as u64,
            tokens: done.tokens,
            output_tokens: done.output_tokens,
            seconds: started.elapsed().as_secs_f64(),
            node,
        })
    }
    .await;
    let label = if outcome.is_ok() { "done" } else { "failed" };
    m.partitions.with_label_values(&[label]).inc();
    outcome.map_err(ActorError::from)
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
        let executor = launch(&Launch {
            executor: args.executor.clone(),
            args: vec!["score".into()],
            env: Vec::new(),
            gpus: setup.gpus.clone(),
            capture_stderr: false,
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
        match tokio::time::timeout(READY_TIMEOUT, read_reply(&mut stdout)).await {
            Ok(Ok(FromScorer::Ready {
                params,
                device,
                kv_cache_bytes,
            })) => match kv_cache_bytes {
                Some(bytes) => tracing::info!(
                    "scorer ready: {params} parameters on {device}, KV cache budget {} MiB",
                    bytes >> 20
                ),
                None => tracing::info!("scorer ready: {params} parameters on {device}"),
            },
            Ok(Ok(FromScorer::Failed(reason))) => {
                return Err(Error::Executor(format!("the scorer cannot load its model: {reason}")).into())
            }
            Ok(Ok(other)) => {
                return Err(Error::Executor(format!("the scorer executor said {other:?} before it was ready")).into())
            }
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => {
                return Err(Error::Executor(format!(
                    "the scorer executor did not load its model within {READY_TIMEOUT:?}"
                ))
                .into())
            }
        }
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
