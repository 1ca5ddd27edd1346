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
//!
//! The events a run reports are in `events.rs`, reserving the bundles in `placement.rs`,
//! one attempt on a placed group in `attempt.rs`, and watching its ranks in `watch.rs`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use regatta_runtime::{Cluster, Resources, RunReporter};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::tensorboard::TensorBoardWriter;

mod attempt;
mod events;
mod outcome;
mod placement;
mod watch;

pub(crate) use attempt::random_secret;
use attempt::AttemptError;
use events::step_figures;
pub use events::{TrainEvent, TrainSummary};

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
            let (group, world) = self.reserve(wait).await.map_err(reserve_failed)?;
            if let Some(from) = previous.filter(|from| *from != world) {
                self.report_rescale(from, world, &mut summary, &mut on_event);
            }
            if let Some(from) = grew_from.take() {
                self.adjust_probe_skip(from, world);
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

    /// Counts and reports a change of the number of ranks from `from` to `world`.
    fn report_rescale(
        &self,
        from: usize,
        world: usize,
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
    ) {
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

    /// After a restart to grow from `from` ranks: probe at every checkpoint again when it
    /// got more ranks, else let twice as many checkpoints pass first (1 to 16).
    fn adjust_probe_skip(&self, from: usize, world: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let skip = if world > from {
            0
        } else {
            (self.probe_skip.load(Relaxed) * 2).clamp(1, 16)
        };
        self.probe_skip.store(skip, Relaxed);
    }

    fn scaling(&self) -> Option<&crate::config::ScalingConfig> {
        self.config.scaling.as_ref()
    }

    fn bundle(&self) -> Resources {
        Resources::from_units(self.config.resources.iter().map(|(k, v)| (k.as_str(), *v)))
    }
}

/// A failed reservation as the run's error: only a fault of the cluster or of the
/// configuration can come out of one.
fn reserve_failed(error: AttemptError) -> TrainError {
    match error {
        AttemptError::Cluster(error) => TrainError::Cluster(error),
        AttemptError::Fatal(reason) => TrainError::Fatal(reason),
        AttemptError::Lost { reason, .. } => TrainError::Fatal(reason),
        AttemptError::Grow { .. } => TrainError::Fatal("placement grew unasked".into()),
    }
}
