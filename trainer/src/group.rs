//! The trainer group as the driver sees it: reserve one bundle per rank (a placement
//! group with the per-rank resources), spawn a rank actor in each, hand every rank its
//! successor's ring address (rank 0's ring is the list of addresses the ranks bound, sent
//! through the cluster), then watch: loss per step from rank 0, checkpoints, failures.
//! A rank lost (its node died, its executor crashed, or it stopped making progress)
//! removes the whole group and starts it again from the newest checkpoint, up to
//! `max_failures` times; each restart is reported as an event (the job log shows it).
//!
//! An elastic run (`[scaling] min_workers..=max_workers`, streaming data) places as many
//! ranks as it can in that range: after a loss it waits `replacement_timeout_secs` for a
//! replacement, then continues with fewer ranks from the newest checkpoint; while it runs
//! short, each checkpoint probes for capacity and, when the missing ranks fit again, the
//! group restarts from that checkpoint at full size. The global batch stays (gradient
//! accumulation adapts, [`TrainConfig::rescale`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use regatta_runtime::{ActorHandle, ActorOptions, Cluster, Resources, RunReporter, Strategy};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::eval::EvalReport;
use crate::protocol::{FromExecutor, RankSetup, StepReport, TrainOp, TrainReply};
use crate::rank::{TrainRank, TrainRankArgs};
use crate::tensorboard::TensorBoardWriter;

/// How long a failed attempt waits for its surviving ranks' executors to exit, taking in
/// what they reported, before the restart.
const DRAIN_FOR: Duration = Duration::from_secs(5);

/// How often the driver asks the ranks for events.
const POLL_EVERY: Duration = Duration::from_millis(200);
/// How long a placement group may wait for resources.
const PLACEMENT_TIMEOUT: Duration = Duration::from_secs(120);

/// What happens during a run, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum TrainEvent {
    /// The group is placed and bound; training starts after `start_step`.
    Started {
        /// 0 for the first attempt.
        attempt: u32,
        /// Steps already done (from a checkpoint).
        start_step: u64,
        /// Model parameters.
        params: u64,
        /// Node of each rank.
        nodes: Vec<String>,
        /// Device of rank 0.
        device: String,
        /// Ranks in this attempt.
        world: usize,
    },
    /// The number of ranks changes (an elastic run lost a rank without a replacement, or
    /// regained capacity).
    Rescaled {
        /// Ranks before.
        from: usize,
        /// Ranks now.
        to: usize,
        /// Why.
        reason: String,
    },
    /// A rank skipped dataset rows it cannot read (`url@offset: why` of the first).
    Skipped {
        /// The rank.
        rank: usize,
        /// What and why.
        what: String,
        /// Rows skipped (1, or a step's rows past a rank's first 100 reports).
        count: u64,
    },
    /// A step finished (rank 0's report; every rank sees the same loss).
    Step(StepReport),
    /// A checkpoint was committed.
    Checkpoint {
        /// Steps it holds.
        step: u64,
        /// Where.
        url: String,
        /// It validates lowest so far (`keep_best`: the `best` pointer names it).
        best: bool,
    },
    /// A validation finished (`[eval]`).
    Eval(EvalReport),
    /// A rank was lost; the group restarts from the newest checkpoint.
    Restarting {
        /// The rank that failed.
        rank: usize,
        /// Why.
        reason: String,
        /// Failures so far.
        failures: u32,
        /// The limit.
        max_failures: u32,
    },
}

/// The result of a finished run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainSummary {
    /// Loss of every step, by step (a restarted step keeps its latest value).
    pub losses: BTreeMap<u64, f64>,
    /// The last step's report.
    pub last: Option<StepReport>,
    /// Rank failures survived.
    pub failures: u32,
    /// The newest checkpoint.
    pub checkpoint: Option<(u64, String)>,
    /// Validation loss by step (`[eval]`).
    pub evals: BTreeMap<u64, f64>,
    /// The checkpoint that validated lowest (`keep_best`).
    pub best: Option<(u64, String)>,
    /// The TensorBoard events file written (`[logging] tensorboard`).
    pub tensorboard: Option<String>,
    /// Model parameters.
    pub params: u64,
    /// Wall time of the whole run.
    pub seconds: f64,
    /// Ranks of the last attempt.
    pub world: usize,
    /// Changes of the number of ranks.
    pub rescales: u32,
}

enum AttemptError {
    Lost {
        rank: usize,
        reason: String,
    },
    /// Capacity for more ranks returned (an elastic run restarts larger).
    Grow {
        to: usize,
    },
    Fatal(String),
    Cluster(regatta_runtime::Error),
}

/// A trainer group on a cluster.
pub struct TrainerGroup {
    cluster: Cluster,
    config: TrainConfig,
    executor: Option<String>,
    /// Checkpoints an elastic attempt lets pass before it probes for capacity: doubled
    /// (up to 16) each time a restart to grow got no more ranks than before.
    probe_skip: std::sync::atomic::AtomicU32,
}

impl TrainerGroup {
    /// A group for `config` (validated here).
    pub fn new(cluster: Cluster, mut config: TrainConfig) -> Result<Self, TrainError> {
        config.validate().map_err(|e| TrainError::Fatal(e.to_string()))?;
        let cwd = std::env::current_dir().map_err(|e| TrainError::Fatal(format!("no working directory: {e}")))?;
        config.resolve_paths(&cwd);
        Ok(Self {
            cluster,
            config,
            executor: None,
            probe_skip: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// Runs the ranks with another executor binary: one built on
    /// `regatta_torch::executor_main` with the user's own model. It must exist on every node.
    pub fn executor(mut self, path: impl Into<String>) -> Self {
        self.executor = Some(path.into());
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Trains to the last step, calling `on_event` as things happen. Each step is also
    /// reported to the head's dashboard as a point of this run.
    /// With `[logging] tensorboard`, steps and validations also go to a TensorBoard events
    /// file there (a directory that cannot be written fails the run before it starts).
    pub async fn run(&self, mut on_event: impl FnMut(&TrainEvent)) -> Result<TrainSummary, TrainError> {
        let mut tensorboard = match self.config.logging.tensorboard.as_str() {
            "" => None,
            dir => Some(TensorBoardWriter::create(dir).await?),
        };
        let mut reporter = RunReporter::new(&self.cluster, "train");
        let mut outcome = self
            .run_attempts(|event| {
                match event {
                    TrainEvent::Step(report) => reporter.report(report.step, step_figures(report)),
                    TrainEvent::Eval(report) => reporter.report(
                        report.step,
                        BTreeMap::from([
                            ("eval_loss".to_string(), report.loss),
                            ("eval_perplexity".to_string(), report.perplexity()),
                        ]),
                    ),
                    _ => {}
                }
                if let Some(writer) = tensorboard.as_mut() {
                    writer.record(event);
                }
                on_event(event)
            })
            .await;
        reporter.finish(outcome.is_err());
        if let Some(writer) = tensorboard {
            // Written whether the run finished or failed: its curves are what shows why.
            let url = writer.finish().await;
            match (&mut outcome, url) {
                (Ok(summary), Ok(url)) => summary.tensorboard = Some(url),
                (Ok(_), Err(e)) => outcome = Err(e),
                (Err(_), Err(e)) => tracing::warn!("{e}"),
                (Err(_), Ok(_)) => {}
            }
        }
        outcome
    }

    async fn run_attempts(&self, mut on_event: impl FnMut(&TrainEvent)) -> Result<TrainSummary, TrainError> {
        let started = Instant::now();
        let mut summary = TrainSummary::default();
        let mut resume = self.config.checkpoint.resume;
        let max = self.config.max_failures;
        let mut wait = Duration::from_secs(3);
        let mut previous: Option<usize> = None;
        let mut grew_from: Option<usize> = None;
        for attempt in 0.. {
            let (group, world) = self.reserve(wait).await.map_err(|e| match e {
                AttemptError::Cluster(error) => TrainError::Cluster(error),
                AttemptError::Fatal(reason) => TrainError::Fatal(reason),
                AttemptError::Lost { reason, .. } => TrainError::Fatal(reason),
                AttemptError::Grow { .. } => TrainError::Fatal("placement grew unasked".into()),
            })?;
            if let Some(from) = previous.filter(|from| *from != world) {
                summary.rescales += 1;
                let reason = if world < from {
                    format!(
                        "no replacement could be placed within {}s",
                        self.scaling().map_or(0, |s| s.replacement_timeout_secs)
                    )
                } else {
                    "capacity returned".to_string()
                };
                on_event(&TrainEvent::Rescaled {
                    from,
                    to: world,
                    reason,
                });
            }
            if let Some(from) = grew_from.take() {
                use std::sync::atomic::Ordering::Relaxed;
                let skip = if world > from {
                    0
                } else {
                    (self.probe_skip.load(Relaxed) * 2).clamp(1, 16)
                };
                self.probe_skip.store(skip, Relaxed);
            }
            previous = Some(world);
            summary.world = world;
            match self
                .attempt(attempt, group, world, resume, &mut summary, &mut on_event)
                .await
            {
                Ok(()) => {
                    summary.seconds = started.elapsed().as_secs_f64();
                    return Ok(summary);
                }
                Err(AttemptError::Lost { rank, reason }) => {
                    if summary.failures >= max {
                        return Err(TrainError::TooManyFailures {
                            failures: summary.failures,
                            max,
                            rank,
                            reason,
                        });
                    }
                    summary.failures += 1;
                    on_event(&TrainEvent::Restarting {
                        rank,
                        reason,
                        failures: summary.failures,
                        max_failures: max,
                    });
                    resume = !self.config.checkpoint.dir.is_empty();
                    wait = Duration::from_secs(self.scaling().map_or(0, |s| s.replacement_timeout_secs));
                }
                Err(AttemptError::Grow { to }) => {
                    grew_from = Some(world);
                    tracing::info!(to, "capacity for {to} ranks: restarting from the newest checkpoint");
                    resume = true;
                    wait = Duration::from_secs(3);
                }
                Err(AttemptError::Fatal(reason)) => return Err(TrainError::Fatal(reason)),
                Err(AttemptError::Cluster(error)) => return Err(TrainError::Cluster(error)),
            }
        }
        unreachable!("the attempt loop only ends by returning")
    }

    fn scaling(&self) -> Option<&crate::config::ScalingConfig> {
        self.config.scaling.as_ref()
    }

    fn bundle(&self) -> Resources {
        Resources::from_units(self.config.resources.iter().map(|(k, v)| (k.as_str(), *v)))
    }

    /// A placement group for the next attempt and its size: `world_size` bundles, or for
    /// an elastic run the most in `min_workers..=max_workers` that can be placed (the
    /// largest waited for `wait`, smaller ones briefly, the smallest until
    /// [`PLACEMENT_TIMEOUT`]).
    async fn reserve(&self, wait: Duration) -> Result<(regatta_runtime::PlacementGroup, usize), AttemptError> {
        let strategy: Strategy = self.config.strategy.parse().map_err(AttemptError::Fatal)?;
        let Some(scaling) = self.scaling() else {
            // A fixed-size run: a cluster too small for it is an error at once.
            let world = self.config.world_size;
            let group = self
                .cluster
                .create_placement_group(vec![self.bundle(); world], strategy)
                .await
                .map_err(AttemptError::Cluster)?;
            let mut guard = RemoveOnDrop(Some(group.clone()));
            let ready = group.ready(PLACEMENT_TIMEOUT).await;
            guard.0 = None;
            if let Err(error) = ready {
                let _ = group.remove().await;
                return Err(AttemptError::Cluster(error));
            }
            return Ok((group, world));
        };
        let (min, max) = (scaling.min_workers, scaling.max_workers);
        for world in (min..=max).rev() {
            let patience = if world == min {
                PLACEMENT_TIMEOUT
            } else if world == max {
                wait
            } else {
                Duration::from_secs(2)
            };
            match self.place(world, strategy, patience).await {
                Ok(Some(group)) => return Ok((group, world)),
                Ok(None) if world > min => {}
                Ok(None) => {
                    return Err(AttemptError::Cluster(regatta_runtime::Error::Timeout {
                        what: format!("placing {world} ranks"),
                        timeout: patience,
                    }))
                }
                Err(error) => return Err(AttemptError::Cluster(error)),
            }
        }
        Err(AttemptError::Fatal("no world size to place".into()))
    }

    /// A placement group of `world` bundles once it is placed, waiting up to `patience`
    /// (also while the cluster is too small for it at all: a node may be joining);
    /// `None` when it was not placed in time.
    async fn place(
        &self,
        world: usize,
        strategy: Strategy,
        patience: Duration,
    ) -> Result<Option<regatta_runtime::PlacementGroup>, regatta_runtime::Error> {
        let deadline = Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self
                .cluster
                .create_placement_group(vec![self.bundle(); world], strategy)
                .await
            {
                Ok(group) => {
                    // Removed if this future is dropped while it waits (Ctrl-C in the driver).
                    let mut guard = RemoveOnDrop(Some(group.clone()));
                    let ready = group.ready(left.max(Duration::from_millis(100))).await;
                    guard.0 = None;
                    return match ready {
                        Ok(_) => Ok(Some(group)),
                        Err(_) => {
                            let _ = group.remove().await;
                            Ok(None)
                        }
                    };
                }
                Err(regatta_runtime::Error::Infeasible(_)) if left > Duration::from_secs(1) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(regatta_runtime::Error::Infeasible(_)) => return Ok(None),
                Err(other) => return Err(other),
            }
        }
    }

    /// Whether `extra` more ranks could be placed now (a placement group is created and
    /// removed again).
    async fn capacity_for(&self, extra: usize) -> bool {
        let Ok(strategy) = self.config.strategy.parse::<Strategy>() else {
            return false;
        };
        let Ok(probe) = self
            .cluster
            .create_placement_group(vec![self.bundle(); extra], strategy)
            .await
        else {
            return false;
        };
        let mut guard = RemoveOnDrop(Some(probe.clone()));
        let ready = probe.ready(Duration::from_secs(2)).await.is_ok();
        guard.0 = None;
        let _ = probe.remove().await;
        ready
    }

    async fn attempt(
        &self,
        attempt: u32,
        group: regatta_runtime::PlacementGroup,
        world: usize,
        resume: bool,
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
    ) -> Result<(), AttemptError> {
        // Removes the group even when this future is dropped (Ctrl-C in the driver).
        let mut guard = RemoveOnDrop(Some(group.clone()));
        let per_rank = self.bundle();
        let config = match self.config.rescale(world) {
            Ok(config) => config,
            Err(e) => {
                let _ = group.remove().await;
                guard.0 = None;
                return Err(AttemptError::Fatal(e.to_string()));
            }
        };
        let result = async {
            let nodes = group.ready(PLACEMENT_TIMEOUT).await.map_err(AttemptError::Cluster)?;
            let secret = random_secret().map_err(|e| AttemptError::Fatal(e.to_string()))?;
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let mut ranks = Vec::with_capacity(world);
            for rank in 0..world {
                let args = TrainRankArgs {
                    setup: RankSetup {
                        rank,
                        world,
                        host: String::new(),
                        config: config.clone(),
                        resume,
                        gpus: Vec::new(),
                        rescales: summary.rescales,
                        attempt: stamp,
                    },
                    secret: secret.clone(),
                    executor: self.executor.clone(),
                };
                let options = ActorOptions::new()
                    .resources(per_rank.clone())
                    .in_group(&group, Some(rank));
                let handle = self
                    .cluster
                    .spawn::<TrainRank>(args, options)
                    .await
                    .map_err(|e| classify(rank, e))?;
                ranks.push(handle);
            }
            let (addresses, params, start_step, device, nccl_id) = bind_all(&ranks).await?;
            summary.params = params;
            on_event(&TrainEvent::Started {
                attempt,
                start_step,
                params,
                nodes,
                device,
                world,
            });
            let (addresses, nccl_id) = (&addresses, &nccl_id);
            let connects = ranks.iter().enumerate().map(|(i, rank)| async move {
                let op = TrainOp::Connect(addresses[(i + 1) % world].clone(), nccl_id.clone());
                rank.call_timeout(op, PLACEMENT_TIMEOUT)
                    .await
                    .map_err(|e| AttemptError::Lost {
                        rank: i,
                        reason: e.to_string(),
                    })
            });
            futures::future::try_join_all(connects).await?;
            self.watch(&ranks, summary, on_event).await
        }
        .await;
        // Removing the group stops every rank actor, which kills its executor.
        let _ = group.remove().await;
        guard.0 = None;
        result
    }

    async fn watch(
        &self,
        ranks: &[ActorHandle<TrainRank>],
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
    ) -> Result<(), AttemptError> {
        let mut seen = Seen::new(ranks.len());
        let outcome = self.watch_until_done(ranks, summary, on_event, &mut seen).await;
        let Err(error) = outcome else {
            return Ok(());
        };
        // Ranks still alive may hold steps and checkpoints not polled yet (a checkpoint
        // the restart resumes from must not leave a hole in the loss curve): drain them.
        // After a lost rank the survivors cannot go on: each is drained until its executor
        // has exited (every line it wrote read: a step reported just before its checkpoint
        // was saved may still be in the pipe), for DRAIN_FOR at most. Healthy ranks (the
        // group grows) are polled once: they would train on while waited for.
        let mut unreachable = Vec::new();
        let until = match error {
            AttemptError::Lost { .. } => Instant::now() + DRAIN_FOR,
            _ => Instant::now(),
        };
        for (rank, handle) in ranks.iter().enumerate() {
            loop {
                match handle.call_timeout(TrainOp::Poll, Duration::from_secs(5)).await {
                    Ok(TrainReply::Events { events, exited }) => {
                        let _ = seen.absorb(rank, events, summary, on_event);
                        if exited.is_some() || Instant::now() >= until {
                            break;
                        }
                        tokio::time::sleep(POLL_EVERY).await;
                    }
                    Ok(_) => break,
                    Err(e) => {
                        unreachable.push((rank, e.to_string()));
                        break;
                    }
                }
            }
        }
        Err(blame(error, &unreachable))
    }

    async fn watch_until_done(
        &self,
        ranks: &[ActorHandle<TrainRank>],
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
        seen: &mut Seen,
    ) -> Result<(), AttemptError> {
        let stall = Duration::from_secs(self.config.stall_timeout_secs.max(1));
        loop {
            for (rank, handle) in ranks.iter().enumerate() {
                let reply = handle
                    .call_timeout(TrainOp::Poll, Duration::from_secs(30))
                    .await
                    .map_err(|e| AttemptError::Lost {
                        rank,
                        reason: e.to_string(),
                    })?;
                let TrainReply::Events { events, exited } = reply else {
                    return Err(AttemptError::Lost {
                        rank,
                        reason: "the rank replied out of turn".into(),
                    });
                };
                seen.absorb(rank, events, summary, on_event)?;
                if let (Some(exited), false) = (exited, seen.finished[rank]) {
                    return Err(AttemptError::Lost { rank, reason: exited });
                }
            }
            if seen.finished.iter().all(|done| *done) {
                return Ok(());
            }
            if let (Some(scaling), Some(step)) = (self.scaling(), seen.new_checkpoint.take()) {
                let missing = scaling.max_workers.saturating_sub(ranks.len());
                // Not at the last step's checkpoint: the run is about to finish.
                let last = step >= self.config.steps;
                let waiting = seen.checkpoints <= self.probe_skip.load(std::sync::atomic::Ordering::Relaxed);
                if missing > 0
                    && !last
                    && !waiting
                    && !seen.finished.iter().any(|d| *d)
                    && self.capacity_for(missing).await
                {
                    tracing::info!(step, missing, "capacity returned at the checkpoint of step {step}");
                    return Err(AttemptError::Grow {
                        to: scaling.max_workers,
                    });
                }
            }
            if seen.last_progress.elapsed() > stall {
                return Err(AttemptError::Lost {
                    rank: 0,
                    reason: format!("no step finished for {stall:?}"),
                });
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }
}

/// What one attempt has heard from its ranks.
struct Seen {
    new_checkpoint: Option<u64>,
    checkpoints: u32,
    steps: std::collections::BTreeSet<u64>,
    finished: Vec<bool>,
    last_progress: Instant,
}

impl Seen {
    fn new(world: usize) -> Self {
        Self {
            new_checkpoint: None,
            checkpoints: 0,
            steps: Default::default(),
            finished: vec![false; world],
            last_progress: Instant::now(),
        }
    }

    /// Takes in a rank's events. Every rank reports the same loss for a step; the first
    /// report of a step counts, so a step is recorded even when rank 0 died before its
    /// report was polled. Rank 0 alone reports checkpoints and sets the last report.
    fn absorb(
        &mut self,
        rank: usize,
        events: Vec<FromExecutor>,
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
    ) -> Result<(), AttemptError> {
        for event in events {
            match event {
                FromExecutor::Step(report) => {
                    self.last_progress = Instant::now();
                    if rank == 0 {
                        summary.last = Some(report.clone());
                    }
                    if self.steps.insert(report.step) {
                        summary.losses.insert(report.step, report.loss);
                        on_event(&TrainEvent::Step(report));
                    }
                }
                FromExecutor::Checkpoint { step, url, best } if rank == 0 => {
                    self.new_checkpoint = Some(step);
                    self.checkpoints += 1;
                    summary.checkpoint = Some((step, url.clone()));
                    if best {
                        summary.best = Some((step, url.clone()));
                    }
                    on_event(&TrainEvent::Checkpoint { step, url, best });
                }
                FromExecutor::Eval(report) if rank == 0 => {
                    self.last_progress = Instant::now();
                    summary.evals.insert(report.step, report.loss);
                    on_event(&TrainEvent::Eval(report));
                }
                FromExecutor::Finished { .. } => self.finished[rank] = true,
                FromExecutor::Skipped { what, count } => on_event(&TrainEvent::Skipped { rank, what, count }),
                FromExecutor::Failed { reason, fatal: true } => {
                    return Err(AttemptError::Fatal(format!("rank {rank}: {reason}")))
                }
                FromExecutor::Failed { reason, fatal: false } => return Err(AttemptError::Lost { rank, reason }),
                _ => {}
            }
        }
        Ok(())
    }
}

/// A step's figures as the dashboard charts them.
fn step_figures(report: &StepReport) -> BTreeMap<String, f64> {
    let mut figures = BTreeMap::from([
        ("loss".to_string(), report.loss),
        ("lr".to_string(), report.lr),
        ("grad_norm".to_string(), report.grad_norm),
        ("tokens_per_sec".to_string(), report.tokens_per_sec),
        ("step_secs".to_string(), report.step_secs),
        ("collective_secs".to_string(), report.collective_secs),
        (
            "bytes_per_rank".to_string(),
            (report.param_bytes + report.grad_bytes + report.optimizer_bytes) as f64,
        ),
    ]);
    if let Some(mfu) = report.mfu {
        figures.insert("mfu".to_string(), mfu);
    }
    figures
}

/// Removes a placement group (stopping its ranks and their executors) when dropped, from
/// a background task: the driver may be cancelled at any await.
struct RemoveOnDrop(Option<regatta_runtime::PlacementGroup>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let (Some(group), Ok(runtime)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(async move {
                let _ = group.remove().await;
            });
        }
    }
}

/// The rank a lost attempt is blamed on. A rank whose executor exited because its ring
/// peer vanished is a victim, not the cause: when the blamed rank still answers and
/// another does not, the unreachable one is the lost rank.
fn blame(error: AttemptError, unreachable: &[(usize, String)]) -> AttemptError {
    match error {
        AttemptError::Lost { rank, reason } => match unreachable.first() {
            Some((gone, cause)) if unreachable.iter().all(|(r, _)| *r != rank) => AttemptError::Lost {
                rank: *gone,
                reason: format!("{cause} (rank {rank}: {reason})"),
            },
            _ => AttemptError::Lost { rank, reason },
        },
        other => other,
    }
}

type Bound = (Vec<String>, u64, u64, String, Option<String>);

async fn bind_all(ranks: &[ActorHandle<TrainRank>]) -> Result<Bound, AttemptError> {
    let binds = ranks.iter().enumerate().map(|(rank, handle)| async move {
        handle
            .call_timeout(TrainOp::Bind, Duration::from_secs(330))
            .await
            .map_err(|e| classify(rank, e))
    });
    let mut addresses = Vec::with_capacity(ranks.len());
    let mut first = None;
    let mut starts = Vec::new();
    for (rank, reply) in futures::future::try_join_all(binds).await?.into_iter().enumerate() {
        if let TrainReply::Failed { reason, fatal } = reply {
            return Err(if fatal {
                AttemptError::Fatal(reason)
            } else {
                AttemptError::Lost { rank, reason }
            });
        }
        let TrainReply::Bound {
            addr,
            params,
            start_step,
            device,
            nccl_id,
        } = reply
        else {
            return Err(AttemptError::Fatal("a rank replied out of turn".into()));
        };
        addresses.push(addr);
        starts.push(start_step);
        first.get_or_insert((params, start_step, device, nccl_id));
    }
    let (params, start_step, device, nccl_id) =
        first.ok_or_else(|| AttemptError::Fatal("a group of no ranks".into()))?;
    if starts.iter().any(|s| *s != start_step) {
        return Err(AttemptError::Fatal(format!(
            "the ranks loaded checkpoints of different steps: {starts:?}"
        )));
    }
    Ok((addresses, params, start_step, device, nccl_id))
}

/// A spawn or bind failure is fatal when the cause is in the run's own inputs (a missing
/// executor, bad data, a bad checkpoint); a lost node or a crashed executor is worth a
/// restart.
fn classify(rank: usize, error: regatta_runtime::Error) -> AttemptError {
    use regatta_runtime::Error;
    let text = error.to_string();
    let lost = match &error {
        Error::ActorDead { cause, .. } => cause.contains("node "),
        Error::CallFailed { .. } | Error::Timeout { .. } => true,
        Error::Remote { .. } => true,
        _ => false,
    };
    if lost {
        AttemptError::Lost { rank, reason: text }
    } else {
        AttemptError::Fatal(format!("rank {rank}: {text}"))
    }
}

/// 256 random bits from the OS, hex-encoded: the ring's TLS identity derives from it.
pub(crate) fn random_secret() -> crate::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).map_err(|e| crate::Error::Secret(e.to_string()))?;
    Ok(crate::hex::encode(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(rank: usize) -> AttemptError {
        AttemptError::Lost {
            rank,
            reason: "ring peer closed".into(),
        }
    }

    fn blamed(error: AttemptError) -> Option<usize> {
        match error {
            AttemptError::Lost { rank, .. } => Some(rank),
            _ => None,
        }
    }

    #[test]
    fn a_rank_that_still_answers_passes_the_blame_to_the_unreachable_one() {
        let gone = [(1, "node w2 lost".to_string())];
        assert_eq!(blamed(blame(lost(0), &gone)), Some(1));
    }

    #[test]
    fn an_unreachable_blamed_rank_keeps_the_blame() {
        let gone = [(0, "node w1 lost".to_string()), (1, "node w2 lost".to_string())];
        assert_eq!(blamed(blame(lost(1), &gone)), Some(1));
        assert_eq!(blamed(blame(lost(0), &[])), Some(0));
    }

    #[test]
    fn only_lost_attempts_are_reattributed() {
        let gone = [(1, "node w2 lost".to_string())];
        assert!(matches!(
            blame(AttemptError::Grow { to: 3 }, &gone),
            AttemptError::Grow { to: 3 }
        ));
    }
}
