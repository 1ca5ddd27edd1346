//! The driver of a scoring run: split the input into partitions, skip those whose output
//! exists, hand the rest to a pool of scorer actors as each becomes free (faster actors
//! take more), retry a partition whose actor died on another actor (spawning a
//! replacement), and write a manifest once every partition is settled.

mod config;
mod dispatch;
mod layout;
mod progress;
mod spawn;

use std::time::Instant;

use regatta_object_store::Place;
use regatta_runtime::Cluster;

use crate::actor::Slice;
use crate::error::{Error, Result};
use crate::parquet_input::{is_parquet, row_slices, ParquetInput};
use crate::partition::byte_ranges;
use crate::plan::Plan;
use dispatch::Dispatch;
use layout::OutputLayout;
use progress::progress_figures;

pub use config::ScoreConfig;
pub use layout::ScoreManifest;
pub use progress::Progress;

/// A scoring run on a cluster.
pub struct ScoreRun {
    cluster: Cluster,
    config: ScoreConfig,
    executor: Option<String>,
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
        OutputLayout::of(c, &slices, size).claim(&output, &existing).await?;
        let plan = Plan::new(slices.len(), &existing, c.max_attempts);
        let progress = Progress::starting(&plan, size);
        let stopped = self.stop_leftovers().await?;
        if stopped > 0 {
            tracing::info!(stopped, "stopped scorer actors an earlier driver of this output left");
        }
        let actors = if plan.is_settled() {
            Vec::new()
        } else {
            self.spawn_actors(c.actors.min(slices.len())).await?
        };
        let dispatch = Dispatch::new(self, &slices, plan, progress, started, actors);
        let (plan, mut progress) = dispatch.run(&mut on_progress).await?;
        // Also any actor whose spawn was given up on but which appeared since.
        let _ = self.stop_leftovers().await;
        if let Some((partition, reason)) = plan.failures().iter().next() {
            return Err(Error::Run(format!(
                "partition {partition} failed {} times; last: {reason}",
                c.max_attempts
            )));
        }
        ScoreManifest::of(c, &slices, &progress).write(&output).await?;
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
