//! The driver of a scoring run: split the input into partitions, skip those whose output
//! exists, hand the rest to a pool of scorer actors as each becomes free (faster actors
//! take more), retry a partition whose actor died on another actor (spawning a
//! replacement), and write a manifest once every partition is settled.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use regatta_object_store::Place;
use regatta_runtime::{ActorHandle, ActorOptions, Cluster, Resources};
use serde::{Deserialize, Serialize};

use crate::actor::{PartitionReport, PartitionTask, ScorerActor, ScorerArgs, Slice, GENERATE_DEPTH};
use crate::generate::{GenerationSetup, SamplingParams};
use crate::parquet_input::{is_parquet, row_slices, ParquetInput};
use crate::partition::byte_ranges;
use crate::plan::Plan;
use crate::protocol::{AdapterBase, ScorerSetup};

/// How long spawning one scorer actor (placing it and loading its model) may take.
const SPAWN_TIMEOUT: Duration = Duration::from_secs(120);

/// A scoring run: what `score.toml` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoreConfig {
    /// The input (path or URL): JSONL, one `{"id": ..., "text": ...}` per line, or a
    /// Parquet file (name ending in `.parquet`) with `id` and `text` columns.
    pub input: String,
    /// A Hugging Face model folder (Llama, Mistral, Qwen2; local or by URL), a trainer
    /// checkpoint directory (its newest step is used) or one step's directory, or a
    /// TorchScript file (`.pt`, `.ts`, `.torchscript`) mapping token ids
    /// `[batch, time]` to logits `[batch, time, vocab]`.
    pub model: String,
    /// A LoRA adapter applied to `model` without merging: a PEFT folder
    /// (`adapter_config.json` + `adapter_model.safetensors`) or a LoRA training run's
    /// checkpoint directory (its newest step) or step directory. Empty: none.
    pub adapter: String,
    /// How the base under `adapter` is held: `auto` (as the adapter was trained: quantized
    /// for a QLoRA run's checkpoint, or as a base folder bitsandbytes stored in 4 or 8 bits),
    /// `none` (the compute dtype), `nf4` or `fp4` (4 bits in blocks of 64) or `int8`
    /// (LLM.int8's row-wise bytes), dequantized per projection as it is used.
    pub adapter_base: AdapterBase,
    /// With `adapter_base` nf4 or fp4: quantize the absmax values again (8 bits).
    pub double_quant: bool,
    /// Longest token sequence a TorchScript model takes (required for one; a checkpoint
    /// carries its own).
    pub context: usize,
    /// Output directory (path or URL): `part-NNNNN.parquet` per partition, errors files,
    /// `_manifest.json`.
    pub output: String,
    /// A `tokenizer.json` overriding the checkpoint's.
    pub tokenizer: String,
    /// Scorer actors.
    pub actors: usize,
    /// Rows per batch.
    pub batch_size: usize,
    /// Partitions (0: four per actor).
    pub partitions: usize,
    /// Greedy tokens generated per row.
    pub max_new_tokens: usize,
    /// Resources per actor, for example `{ GPU = 1, "accelerator_type:A100" = 1 }`.
    pub resources: BTreeMap<String, f64>,
    /// Attempts per partition before the run fails.
    pub max_attempts: u32,
    /// `auto`, `cpu` or `cuda`.
    pub device: String,
    /// libtorch threads per actor on CPU.
    pub threads: usize,
    /// Generate a continuation of each row's `prompt`, `text` or chat `messages` (with the
    /// KV cache and continuous batching) instead of scoring `text`.
    pub generate: bool,
    /// Generation: 0 is greedy; above 0 samples with the logits divided by it.
    pub temperature: f64,
    /// Generation: nucleus sampling's probability mass (1: off).
    pub top_p: f64,
    /// Generation: only the k most likely tokens (0: off).
    pub top_k: usize,
    /// Generation: the seed of every row's random stream (mixed with the row's id).
    pub seed: u64,
    /// Generation: strings that end a row's text.
    pub stop: Vec<String>,
    /// Generation: return each token's log-probability.
    pub logprobs: bool,
    /// Generation: sequences decoded together per actor.
    pub max_batch: usize,
    /// Generation: the KV cache's budget per actor, in MiB; unset: each executor takes a
    /// share of the memory it finds free ([`crate::generate::auto_kv_cache_bytes`]).
    pub kv_cache_mb: Option<u64>,
    /// Generation: prompt tokens prefilled per step (longer prompts take several steps).
    pub prefill_tokens: usize,
    /// Generation: rows share the KV cache blocks of a common prefix (a system prompt, a
    /// few-shot header) instead of computing them again.
    pub prefix_caching: bool,
    /// Generation: on CUDA, each decode step's batch shape is captured once as a CUDA graph
    /// and replayed; off, every step launches its kernels one by one.
    pub cuda_graphs: bool,
}

/// Tokens generated per row when generating and `max_new_tokens` is not set.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 256;

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            input: String::new(),
            model: String::new(),
            adapter: String::new(),
            adapter_base: AdapterBase::Auto,
            double_quant: false,
            context: 0,
            output: String::new(),
            tokenizer: String::new(),
            actors: 2,
            batch_size: 32,
            partitions: 0,
            max_new_tokens: 0,
            resources: BTreeMap::from([("CPU".to_string(), 1.0)]),
            max_attempts: 3,
            device: "auto".into(),
            threads: 1,
            generate: false,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            stop: Vec::new(),
            logprobs: false,
            max_batch: 32,
            kv_cache_mb: None,
            prefill_tokens: 512,
            prefix_caching: true,
            cuda_graphs: true,
        }
    }
}

impl ScoreConfig {
    /// Parses `score.toml`; unknown keys are errors.
    pub fn from_toml(text: &str) -> Result<Self> {
        let config: Self = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        Ok(config)
    }

    /// The model, and the adapter applied to it when there is one (what the output's
    /// plan and manifest record).
    pub fn model_and_adapter(&self) -> String {
        if self.adapter.is_empty() {
            self.model.clone()
        } else {
            format!("{} + adapter {}", self.model, self.adapter)
        }
    }

    /// Checks the fields.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in [("input", &self.input), ("model", &self.model), ("output", &self.output)] {
            if value.is_empty() {
                return Err(Error::Config(format!("{name} must be set")));
            }
        }
        if !(1..=1024).contains(&self.actors) {
            return Err(Error::Config(format!("actors must be 1..=1024, not {}", self.actors)));
        }
        if !(1..=65536).contains(&self.batch_size) {
            return Err(Error::Config(format!(
                "batch_size must be 1..=65536, not {}",
                self.batch_size
            )));
        }
        if self.partitions != 0 && self.partitions < self.actors {
            return Err(Error::Config(format!(
                "partitions ({}) must be at least the number of actors ({})",
                self.partitions, self.actors
            )));
        }
        if self.generate && crate::protocol::is_torchscript(&self.model) {
            return Err(Error::Config(
                "generate needs a model folder or checkpoint: a TorchScript module has no KV cache".into(),
            ));
        }
        if !self.adapter.is_empty() && crate::protocol::is_torchscript(&self.model) {
            return Err(Error::Config(
                "adapter needs a Hugging Face model folder or checkpoint as model, not a TorchScript module".into(),
            ));
        }
        if !matches!(self.adapter_base, AdapterBase::Auto | AdapterBase::None) && self.adapter.is_empty() {
            return Err(Error::Config(format!(
                "adapter_base = \"{}\" holds the base under an adapter quantized (QLoRA) and needs `adapter`",
                self.adapter_base.name()
            )));
        }
        if crate::protocol::is_torchscript(&self.model) && !(2..=1 << 20).contains(&self.context) {
            return Err(Error::Config(format!(
                "a TorchScript model needs `context`, the longest token sequence it takes (2 or more; \
                 `regatta-torch-rank export` prints it), not {}",
                self.context
            )));
        }
        if !matches!(self.device.as_str(), "auto" | "cpu" | "cuda") {
            return Err(Error::Config(format!(
                "device must be auto, cpu or cuda, not {:?}",
                self.device
            )));
        }
        if !self.generate {
            if self.max_new_tokens > 4096 {
                return Err(Error::Config("max_new_tokens must be at most 4096".into()));
            }
            return Ok(());
        }
        self.sampling().validate().map_err(Error::Config)?;
        if !(1..=4096).contains(&self.max_batch) {
            return Err(Error::Config(format!(
                "max_batch must be 1..=4096, not {}",
                self.max_batch
            )));
        }
        if let Some(mb) = self.kv_cache_mb.filter(|mb| !(1..=1 << 20).contains(mb)) {
            return Err(Error::Config(format!("kv_cache_mb must be 1..=1048576, not {mb}")));
        }
        if !(1..=1 << 20).contains(&self.prefill_tokens) {
            return Err(Error::Config(format!(
                "prefill_tokens must be 1..=1048576, not {}",
                self.prefill_tokens
            )));
        }
        Ok(())
    }

    /// The run's sampling defaults (rows may override them with `params`).
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            max_new_tokens: if self.max_new_tokens == 0 {
                DEFAULT_MAX_NEW_TOKENS
            } else {
                self.max_new_tokens
            },
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stop: self.stop.clone(),
            logprobs: self.logprobs,
        }
    }

    /// The executor's KV cache and batch limits.
    pub fn generation_setup(&self) -> GenerationSetup {
        GenerationSetup {
            kv_cache_bytes: self.kv_cache_mb.map(|mb| mb << 20),
            max_batch: self.max_batch,
            prefill_tokens: self.prefill_tokens,
            prefix_caching: self.prefix_caching,
            cuda_graphs: self.cuda_graphs,
            ..GenerationSetup::default()
        }
    }

    /// Makes relative local paths absolute against `base`.
    pub fn resolve_paths(&mut self, base: &std::path::Path) {
        for path in [
            &mut self.input,
            &mut self.model,
            &mut self.adapter,
            &mut self.output,
            &mut self.tokenizer,
        ] {
            *path = regatta_object_store::absolute(path, base);
        }
    }
}

/// Progress of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    /// Partitions done (including skipped).
    pub partitions_done: usize,
    /// Partitions in the run.
    pub partitions: usize,
    /// Rows scored by this run.
    pub rows: u64,
    /// Malformed rows found by this run.
    pub errors: u64,
    /// Tokens scored (or prompt tokens read, when generating) by this run.
    pub tokens: u64,
    /// Tokens generated by this run.
    pub output_tokens: u64,
    /// Input bytes covered by finished partitions (of `input_bytes`; for Parquet input, the
    /// partition's share of the rows times the file size).
    pub bytes_done: u64,
    /// Input size.
    pub input_bytes: u64,
    /// Seconds since the run started.
    pub seconds: f64,
    /// Partitions retried so far.
    pub retries: u32,
    /// Partitions skipped because an earlier run finished them.
    pub skipped: usize,
}

/// Progress as the dashboard charts it.
fn progress_figures(p: &Progress) -> std::collections::BTreeMap<String, f64> {
    let per_sec = |n: u64| if p.seconds > 0.0 { n as f64 / p.seconds } else { 0.0 };
    std::collections::BTreeMap::from([
        ("partitions_done".to_string(), p.partitions_done as f64),
        ("partitions".to_string(), p.partitions as f64),
        ("rows".to_string(), p.rows as f64),
        ("rows_per_sec".to_string(), per_sec(p.rows)),
        ("output_tokens_per_sec".to_string(), per_sec(p.output_tokens)),
        ("tokens_per_sec".to_string(), per_sec(p.tokens)),
        ("errors".to_string(), p.errors as f64),
        ("retries".to_string(), p.retries as f64),
    ])
}

/// The manifest written at the end of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoreManifest {
    /// Input.
    pub input: String,
    /// Model.
    pub model: String,
    /// Partitions, each with its rows (a byte range or a row group's rows) and output file.
    pub partitions: Vec<(Slice, String)>,
    /// Rows scored by the last run (earlier runs' rows are in their files).
    pub rows_this_run: u64,
    /// Malformed rows found by the last run.
    pub errors_this_run: u64,
}

/// Where a run records its layout in its output, before any partition is written.
const PLAN_FILE: &str = "_plan.json";

/// What makes partition files of one run valid for another: the same input (and size),
/// model and partition layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct OutputLayout {
    input: String,
    input_bytes: u64,
    model: String,
    partitions: Vec<Slice>,
    /// The sampling settings of a generating run (absent when scoring).
    #[serde(default)]
    generation: Option<SamplingParams>,
}

impl OutputLayout {
    /// What differs from `other`, in words; `None` when they match.
    fn difference(&self, other: &Self) -> Option<String> {
        if self.input != other.input || self.input_bytes != other.input_bytes {
            Some(format!(
                "input {} of {} bytes, not {} of {} bytes",
                self.input, self.input_bytes, other.input, other.input_bytes
            ))
        } else if self.model != other.model {
            Some(format!("model {}, not {}", self.model, other.model))
        } else if self.generation != other.generation {
            Some(format!(
                "generation settings {}, not {}",
                describe(&self.generation),
                describe(&other.generation)
            ))
        } else if self.partitions != other.partitions {
            Some(format!(
                "{} partitions laid out differently from these {}",
                self.partitions.len(),
                other.partitions.len()
            ))
        } else {
            None
        }
    }
}

fn describe(generation: &Option<SamplingParams>) -> String {
    match generation {
        Some(params) => serde_json::to_string(params).unwrap_or_default(),
        None => "none (scoring)".into(),
    }
}

/// What the driver waits for.
enum Event {
    /// A partition's call returned: the actor's slot, the actor's incarnation in it when
    /// the call went out, the partition, the reply.
    Scored(usize, u64, usize, regatta_runtime::Result<PartitionReport>),
    /// A replacement actor for a slot was spawned (or not).
    Replaced(usize, Result<ActorHandle<ScorerActor>>),
}

/// A scoring run on a cluster.
pub struct ScoreRun {
    cluster: Cluster,
    config: ScoreConfig,
    executor: Option<String>,
}

fn actor_options(config: &ScoreConfig) -> ActorOptions {
    let resources = Resources::from_units(config.resources.iter().map(|(k, v)| (k.as_str(), *v)));
    // The driver replaces a dead actor itself (and retries its partition elsewhere).
    ActorOptions::new().resources(resources).max_restarts(0)
}

impl ScoreRun {
    /// A run of `config` (validated; relative paths resolved against the working directory).
    pub fn new(cluster: Cluster, mut config: ScoreConfig) -> Result<Self> {
        config.validate()?;
        let cwd = std::env::current_dir().map_err(|e| Error::Run(format!("no working directory: {e}")))?;
        config.resolve_paths(&cwd);
        Ok(Self {
            cluster,
            config,
            executor: None,
        })
    }

    /// Scorer actors run this executor binary instead of `regatta-torch-rank`.
    pub fn executor(mut self, path: impl Into<String>) -> Self {
        self.executor = Some(path.into());
        self
    }

    /// The name prefix of this run's actors: a hash of the output location, so a driver
    /// started again on the same output finds the actors an earlier, killed driver left.
    fn actor_prefix(&self) -> String {
        let hash = self.config.output.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        format!("scorer-{hash:016x}-")
    }

    /// Stops actors an earlier driver of the same output left running (a driver killed
    /// with SIGKILL cannot stop its own), so their resources are free again.
    async fn stop_leftovers(&self) -> Result<usize> {
        let prefix = self.actor_prefix();
        let status = self.cluster.status().await?;
        let mut stopped = 0;
        for line in status.actors {
            let alive = matches!(line.view.state, regatta_runtime::ActorState::Alive);
            if alive && line.name.as_deref().is_some_and(|n| n.starts_with(&prefix)) {
                let _ = self.cluster.kill(line.view.id).await;
                stopped += 1;
            }
        }
        Ok(stopped)
    }

    async fn spawn_actor(&self) -> Result<ActorHandle<ScorerActor>> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let serial = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{}{}-{serial}", self.actor_prefix(), std::process::id());
        let args = ScorerArgs {
            setup: ScorerSetup {
                checkpoint: self.config.model.clone(),
                adapter: self.config.adapter.clone(),
                adapter_base: self.config.adapter_base,
                double_quant: self.config.double_quant,
                context: self.config.context,
                tokenizer: self.config.tokenizer.clone(),
                device: self.config.device.clone(),
                threads: self.config.threads,
                max_new_tokens: if self.config.generate {
                    0
                } else {
                    self.config.max_new_tokens
                },
                gpus: Vec::new(),
                generation: self.config.generate.then(|| self.config.generation_setup()),
            },
            sampling: self.config.generate.then(|| self.config.sampling()),
            batch_size: self.config.batch_size,
            executor: self.executor.clone(),
        };
        // A spawn placed on a node that dies before the head notices can wait forever:
        // give up after a while (an actor that appears later carries this run's name
        // prefix and is stopped at the end of the run).
        // Waits until the actor has loaded its model, so no partition is ever handed to an
        // actor that will not start (placed on a node that is dying, say).
        let spawn = async {
            let handle = self
                .cluster
                .spawn::<ScorerActor>(args, actor_options(&self.config).name(name))
                .await?;
            handle.wait_ready(SPAWN_TIMEOUT).await?;
            Ok(handle)
        };
        match tokio::time::timeout(SPAWN_TIMEOUT + Duration::from_secs(30), spawn).await {
            Ok(spawned) => spawned,
            Err(_) => Err(Error::Run(format!(
                "a scorer actor was not ready within {SPAWN_TIMEOUT:?}"
            ))),
        }
    }

    /// Makes sure the partition files already in `output` belong to this very run (same
    /// input, size, model and partitions), so a rerun that skips them loses and repeats no
    /// row; records the run's layout in `_plan.json` before any partition is written.
    async fn claim_output(
        &self,
        output: &Place,
        existing: &[String],
        slices: &[(Slice, u64)],
        size: u64,
    ) -> Result<()> {
        let layout = OutputLayout {
            input: self.config.input.clone(),
            input_bytes: size,
            model: self.config.model_and_adapter(),
            partitions: slices.iter().map(|(slice, _)| slice.clone()).collect(),
            generation: self.config.generate.then(|| self.config.sampling()),
        };
        match output.get_opt(PLAN_FILE).await? {
            Some(bytes) => {
                let earlier: OutputLayout = serde_json::from_slice(&bytes)
                    .map_err(|e| Error::Output(format!("{}/{PLAN_FILE} is not a scoring plan: {e}", output.url())))?;
                if let Some(difference) = earlier.difference(&layout) {
                    return Err(Error::Output(format!(
                        "{} holds the output of another run ({difference}); use a new output location, \
                         or rerun with the same input, model and partitions to finish it",
                        output.url()
                    )));
                }
                Ok(())
            }
            None if existing.iter().any(|name| crate::plan::partition_of(name).is_some()) => {
                Err(Error::Output(format!(
                    "{} already holds partition files but no {PLAN_FILE}; use an empty output location",
                    output.url()
                )))
            }
            None => {
                let body = serde_json::to_vec_pretty(&layout)?;
                output.put(PLAN_FILE, Bytes::from(body)).await.map_err(Error::from)
            }
        }
    }

    /// Scores every partition not finished before; calls `on_progress` after each one and
    /// reports each to the head's dashboard as a point of this run.
    pub async fn run(&self, mut on_progress: impl FnMut(&Progress)) -> Result<Progress> {
        let mut reporter = regatta_runtime::RunReporter::new(&self.cluster, "score");
        let outcome = self
            .run_partitions(|progress| {
                reporter.report(progress.partitions_done as u64, progress_figures(progress));
                on_progress(progress)
            })
            .await;
        reporter.finish(outcome.is_err());
        outcome
    }

    async fn run_partitions(&self, mut on_progress: impl FnMut(&Progress)) -> Result<Progress> {
        let started = Instant::now();
        let c = &self.config;
        let count = if c.partitions == 0 { 4 * c.actors } else { c.partitions };
        let (slices, size) = plan_slices(&c.input, count).await?;
        let output = Place::dir(&c.output)?;
        let existing = output.list().await?;
        self.claim_output(&output, &existing, &slices, size).await?;
        let mut plan = Plan::new(slices.len(), &existing, c.max_attempts);
        let mut progress = Progress {
            partitions_done: plan.done(),
            partitions: slices.len(),
            rows: 0,
            errors: 0,
            tokens: 0,
            output_tokens: 0,
            bytes_done: 0,
            input_bytes: size,
            seconds: 0.0,
            retries: 0,
            skipped: plan.skipped(),
        };
        let stopped = self.stop_leftovers().await?;
        if stopped > 0 {
            tracing::info!(stopped, "stopped scorer actors an earlier driver of this output left");
        }
        let mut actors = Vec::new();
        if !plan.is_settled() {
            for _ in 0..c.actors.min(slices.len()) {
                actors.push(self.spawn_actor().await?);
            }
        }
        let task = |p: usize, retry: bool| PartitionTask {
            input: c.input.clone(),
            partition: p,
            slice: slices[p].0.clone(),
            output: c.output.clone(),
            retry,
        };
        // A generating actor takes GENERATE_DEPTH partitions at once, so its batch stays
        // full across partition boundaries; a scoring actor one at a time.
        let depth = if c.generate { GENERATE_DEPTH } else { 1 };
        let mut idle: Vec<usize> = (0..actors.len()).flat_map(|slot| vec![slot; depth]).collect();
        let mut incarnation = vec![0u64; actors.len()];
        // Calls lost with a dead actor, given back to its slot once the replacement is up.
        let mut orphaned = vec![0usize; actors.len()];
        let mut replacing = vec![false; actors.len()];
        let mut replacements = 0u32;
        let mut running: FuturesUnordered<futures::future::BoxFuture<'_, Event>> = FuturesUnordered::new();
        loop {
            while let Some(slot) = idle.pop() {
                let Some(partition) = plan.hand_out() else {
                    idle.push(slot);
                    break;
                };
                let handle = actors[slot].clone();
                let request = task(partition, plan.is_retry(partition));
                let born = incarnation[slot];
                running.push(Box::pin(async move {
                    let reply = handle.call_timeout(request, Duration::from_secs(24 * 3600)).await;
                    Event::Scored(slot, born, partition, reply)
                }));
            }
            let Some(event) = running.next().await else {
                break;
            };
            match event {
                Event::Scored(slot, _, partition, Ok(report)) => {
                    plan.finished(partition);
                    progress.rows += report.rows;
                    progress.errors += report.errors;
                    progress.tokens += report.tokens;
                    progress.output_tokens += report.output_tokens;
                    progress.bytes_done += slices[partition].1;
                    idle.push(slot);
                }
                Event::Scored(slot, born, partition, Err(error)) => {
                    let dead = matches!(
                        error,
                        regatta_runtime::Error::ActorDead { .. } | regatta_runtime::Error::CallFailed { .. }
                    );
                    let reason = error.to_string();
                    tracing::warn!(partition, %reason, "partition failed");
                    if dead && born < incarnation[slot] {
                        // An actor already replaced: its slot's new actor takes the call.
                        plan.lost(partition);
                        idle.push(slot);
                    } else if dead && replacing[slot] {
                        // The actor's other call: its replacement is on its way.
                        plan.lost(partition);
                        orphaned[slot] += 1;
                    } else if dead {
                        // Its node or executor is gone: the partition goes to another actor
                        // without using an attempt, and a new actor takes this one's place on
                        // whatever node has room (the run goes on with fewer if none has).
                        plan.lost(partition);
                        replacing[slot] = true;
                        orphaned[slot] += 1;
                        replacements += 1;
                        if replacements as usize > 4 * c.actors.max(1) {
                            return Err(Error::Run(format!(
                                "scorer actors keep dying ({replacements} replaced); last: {reason}"
                            )));
                        }
                        // Spawned beside the other actors' work, never blocking it. Until the
                        // head has declared a dead node dead, a new actor may land on it: back
                        // off a little more with every replacement.
                        let backoff = Duration::from_millis(500 * u64::from(replacements.min(20)));
                        running.push(Box::pin(async move {
                            tokio::time::sleep(backoff).await;
                            Event::Replaced(slot, self.spawn_actor().await)
                        }));
                    } else {
                        if !plan.failed(partition, reason) {
                            break;
                        }
                        idle.push(slot);
                    }
                }
                Event::Replaced(slot, Ok(actor)) => {
                    actors[slot] = actor;
                    incarnation[slot] += 1;
                    replacing[slot] = false;
                    idle.extend(std::iter::repeat_n(slot, std::mem::take(&mut orphaned[slot])));
                }
                Event::Replaced(slot, Err(e)) => {
                    replacing[slot] = false;
                    orphaned[slot] = 0;
                    tracing::warn!("no replacement scorer: {e}");
                }
            }
            progress.partitions_done = plan.done();
            progress.retries = plan.retries();
            progress.seconds = started.elapsed().as_secs_f64();
            on_progress(&progress);
            if plan.is_settled() {
                // Every partition is done: a replacement still being spawned is not needed.
                break;
            }
            if running.is_empty() && idle.is_empty() {
                return Err(Error::Run("every scorer actor died and none could be replaced".into()));
            }
        }
        for actor in &actors {
            let _ = actor.kill().await;
        }
        // Also any actor whose spawn was given up on but which appeared since.
        let _ = self.stop_leftovers().await;
        if let Some((partition, reason)) = plan.failures().iter().next() {
            return Err(Error::Run(format!(
                "partition {partition} failed {} times; last: {reason}",
                c.max_attempts
            )));
        }
        let manifest = ScoreManifest {
            input: c.input.clone(),
            model: c.model_and_adapter(),
            partitions: slices
                .iter()
                .enumerate()
                .map(|(p, (slice, _))| (slice.clone(), crate::plan::output_name(p)))
                .collect(),
            rows_this_run: progress.rows,
            errors_this_run: progress.errors,
        };
        let body = serde_json::to_vec_pretty(&manifest)?;
        output.put("_manifest.json", Bytes::from(body)).await?;
        progress.seconds = started.elapsed().as_secs_f64();
        Ok(progress)
    }
}

/// The input's partitions, each with its weight in input bytes (for progress and ETA), and
/// the input's size: JSONL byte ranges, or Parquet row groups (cut into row ranges when
/// there are fewer groups than `count`).
async fn plan_slices(input: &str, count: usize) -> Result<(Vec<(Slice, u64)>, u64)> {
    if is_parquet(input) {
        let parquet = ParquetInput::open(input).await?;
        let (size, rows) = (parquet.size(), parquet.rows().max(1));
        let slices = row_slices(parquet.group_rows(), count)
            .into_iter()
            .map(|rows_slice| {
                let share = u128::from(rows_slice.rows.end - rows_slice.rows.start) * u128::from(size);
                let weight = u64::try_from(share / u128::from(rows)).unwrap_or(size);
                (Slice::Rows(rows_slice), weight)
            })
            .collect();
        return Ok((slices, size));
    }
    let (place, name) = Place::file(input)?;
    let size = place.size(&name).await?;
    let slices = byte_ranges(size, count)
        .into_iter()
        .map(|r| {
            (
                Slice::Bytes {
                    start: r.start,
                    end: r.end,
                },
                r.end - r.start,
            )
        })
        .collect();
    Ok((slices, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generating_configs_are_checked_with_the_field_named() {
        let base = ScoreConfig {
            input: "rows.jsonl".into(),
            model: "/models/llama".into(),
            output: "/tmp/out".into(),
            generate: true,
            ..ScoreConfig::default()
        };
        base.validate().unwrap();
        assert_eq!(base.sampling().max_new_tokens, DEFAULT_MAX_NEW_TOKENS);
        let parsed = ScoreConfig::from_toml(
            "input = \"a\"\nmodel = \"m\"\noutput = \"o\"\ngenerate = true\ntemperature = 0.7\nstop = [\"\\n\"]\nkv_cache_mb = 64",
        )
        .unwrap();
        assert_eq!(
            (parsed.temperature, parsed.stop.clone(), parsed.kv_cache_mb),
            (0.7, vec!["\n".to_string()], Some(64))
        );
        assert_eq!(parsed.generation_setup().kv_cache_bytes, Some(64 << 20));
        assert_eq!(ScoreConfig::default().generation_setup().kv_cache_bytes, None);
        type Change = fn(&mut ScoreConfig);
        let cases: [(Change, &str); 5] = [
            (|c| c.model = "/m/model.pt".into(), "TorchScript module has no KV cache"),
            (|c| c.temperature = -0.5, "temperature must be"),
            (|c| c.top_p = 2.0, "top_p must be"),
            (|c| c.max_batch = 0, "max_batch must be"),
            (|c| c.kv_cache_mb = Some(0), "kv_cache_mb must be"),
        ];
        for (change, expected) in cases {
            let mut config = base.clone();
            change(&mut config);
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn a_4bit_base_is_asked_by_name_and_only_under_an_adapter() {
        let parsed = ScoreConfig::from_toml(
            "input = \"a\"\nmodel = \"m\"\noutput = \"o\"\nadapter = \"run/ckpt\"\nadapter_base = \"nf4\"\ndouble_quant = true",
        )
        .unwrap();
        assert_eq!((parsed.adapter_base, parsed.double_quant), (AdapterBase::Nf4, true));
        parsed.validate().unwrap();
        assert_eq!(ScoreConfig::default().adapter_base, AdapterBase::Auto);
        let without = ScoreConfig {
            adapter: String::new(),
            ..parsed.clone()
        };
        let error = without.validate().unwrap_err().to_string();
        assert!(
            error.contains("adapter_base = \"nf4\"") && error.contains("needs `adapter`"),
            "{error}"
        );
        let unknown = ScoreConfig::from_toml("adapter_base = \"nf5\"")
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("adapter_base") || unknown.contains("nf5"), "{unknown}");
        assert_eq!("fp4".parse::<AdapterBase>().unwrap(), AdapterBase::Fp4);
        let flag = "int4".parse::<AdapterBase>().unwrap_err().to_string();
        assert!(flag.contains("auto, none, nf4, fp4 or int8, not \"int4\""), "{flag}");
    }

    #[test]
    fn an_output_belongs_to_one_input_model_and_layout() {
        let layout = |input: &str, bytes: u64, model: &str, parts: u64| OutputLayout {
            input: input.into(),
            input_bytes: bytes,
            model: model.into(),
            partitions: (0..parts).map(|p| Slice::Bytes { start: p, end: p + 1 }).collect(),
            generation: None,
        };
        let run = layout("/d/rows.jsonl", 4, "/ckpt", 4);
        assert_eq!(run.difference(&run.clone()), None);
        let grown = run.difference(&layout("/d/rows.jsonl", 5, "/ckpt", 4)).unwrap();
        assert!(grown.contains("of 4 bytes, not /d/rows.jsonl of 5 bytes"), "{grown}");
        assert!(run
            .difference(&layout("/d/rows.jsonl", 4, "/other", 4))
            .unwrap()
            .contains("model"));
        assert!(run
            .difference(&layout("/d/rows.jsonl", 4, "/ckpt", 3))
            .unwrap()
            .contains("4 partitions laid out differently from these 3"));
        let generating = OutputLayout {
            generation: Some(SamplingParams::default()),
            ..run.clone()
        };
        assert!(run
            .difference(&generating)
            .unwrap()
            .contains("generation settings none (scoring)"));
    }
}
