//! Training and scoring runs as the head keeps them for the dashboard: each driver reports
//! a point per step or per finished partition (`HeadRequest::RunReport`), the head keeps a
//! bounded series per run and a bounded number of runs.
//!
//! Bounds: at most [`MAX_POINTS`] points per run (past it every other point is dropped, so
//! a long run keeps its whole shape at half the resolution), at most [`MAX_RUNS`] runs
//! (past it the run reported least recently goes, finished runs first), at most
//! [`MAX_VALUES`] values per point, names up to [`MAX_NAME`] bytes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Points kept per run.
pub const MAX_POINTS: usize = 2048;
/// Runs kept.
pub const MAX_RUNS: usize = 128;
/// Values kept per point.
pub const MAX_VALUES: usize = 32;
/// Longest run or value name, in bytes.
pub const MAX_NAME: usize = 128;

/// One report from a run's driver.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunPoint {
    /// The run's name (unique in the cluster while it is kept).
    pub run: String,
    /// `train` or `score`.
    pub kind: String,
    /// The job the driver runs in, if any.
    pub job: Option<String>,
    /// Step (training) or partitions done (scoring).
    pub step: u64,
    /// Figures at that point by name (`loss`, `tokens_per_sec`, `rows_per_sec`, ...).
    pub values: BTreeMap<String, f64>,
    /// The run ended (its last report; at the last point's step its figures join that point).
    pub finished: bool,
}

/// One kept point.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSample {
    /// Step or partitions done.
    pub step: u64,
    /// Seconds since the run's first report.
    pub at_s: f64,
    /// Figures by name.
    pub values: BTreeMap<String, f64>,
}

/// A run in a listing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Name.
    pub name: String,
    /// `train` or `score`.
    pub kind: String,
    /// Its job, if any.
    pub job: Option<String>,
    /// The latest step.
    pub step: u64,
    /// The latest figures.
    pub last: BTreeMap<String, f64>,
    /// Seconds from its first report to its latest.
    pub duration_s: f64,
    /// Seconds since its latest report.
    pub idle_s: f64,
    /// Whether it reported its end.
    pub finished: bool,
    /// Points kept.
    pub points: usize,
}

/// A run with its points.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunDetail {
    /// The listing's line.
    pub summary: RunSummary,
    /// Its kept points, oldest first.
    pub points: Vec<RunSample>,
}

#[derive(Serialize, Deserialize)]
struct Run {
    kind: String,
    job: Option<String>,
    started_ms: u64,
    updated_ms: u64,
    finished: bool,
    points: Vec<RunSample>,
}

/// Every run the head keeps.
#[derive(Default, Serialize, Deserialize)]
pub struct RunBook {
    runs: BTreeMap<String, Run>,
}

impl RunBook {
    /// No runs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes in a report; returns why it was refused, if it was.
    pub fn report(&mut self, point: RunPoint, now_ms: u64) -> Result<(), Error> {
        if point.run.is_empty() || point.run.len() > MAX_NAME || point.kind.len() > MAX_NAME {
            return Err(Error::BadRunName {
                run: point.run.chars().take(40).collect(),
                max: MAX_NAME,
            });
        }
        let values: BTreeMap<String, f64> = point
            .values
            .into_iter()
            .filter(|(name, value)| value.is_finite() && name.len() <= MAX_NAME)
            .take(MAX_VALUES)
            .collect();
        if !self.runs.contains_key(&point.run) && self.runs.len() >= MAX_RUNS {
            self.evict();
        }
        let run = self.runs.entry(point.run).or_insert_with(|| Run {
            kind: point.kind.clone(),
            job: point.job.clone(),
            started_ms: now_ms,
            updated_ms: now_ms,
            finished: false,
            points: Vec::new(),
        });
        run.updated_ms = now_ms;
        run.finished |= point.finished;
        // The end of a run adds its figures (`failed`) to its last point.
        if point.finished {
            if let Some(last) = run.points.last_mut().filter(|last| last.step == point.step) {
                last.values.extend(values);
                return Ok(());
            }
        }
        if run.points.len() >= MAX_POINTS {
            let mut keep = false;
            run.points.retain(|_| {
                keep = !keep;
                keep
            });
        }
        run.points.push(RunSample {
            step: point.step,
            at_s: now_ms.saturating_sub(run.started_ms) as f64 / 1000.0,
            values,
        });
        Ok(())
    }

    /// The run reported least recently goes, finished runs first.
    fn evict(&mut self) {
        let victim = self
            .runs
            .iter()
            .min_by_key(|(_, run)| (!run.finished, run.updated_ms))
            .map(|(name, _)| name.clone());
        if let Some(name) = victim {
            self.runs.remove(&name);
        }
    }

    /// How many runs are kept.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Every run, by name.
    pub fn summaries(&self, now_ms: u64) -> Vec<RunSummary> {
        self.runs.iter().map(|(name, run)| summary(name, run, now_ms)).collect()
    }

    /// One run with its points.
    pub fn detail(&self, name: &str, now_ms: u64) -> Option<RunDetail> {
        let run = self.runs.get(name)?;
        Some(RunDetail {
            summary: summary(name, run, now_ms),
            points: run.points.clone(),
        })
    }
}

fn summary(name: &str, run: &Run, now_ms: u64) -> RunSummary {
    let last = run.points.last();
    RunSummary {
        name: name.to_string(),
        kind: run.kind.clone(),
        job: run.job.clone(),
        step: last.map_or(0, |p| p.step),
        last: last.map(|p| p.values.clone()).unwrap_or_default(),
        duration_s: run.updated_ms.saturating_sub(run.started_ms) as f64 / 1000.0,
        idle_s: now_ms.saturating_sub(run.updated_ms) as f64 / 1000.0,
        finished: run.finished,
        points: run.points.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(run: &str, step: u64, loss: f64) -> RunPoint {
        RunPoint {
            run: run.into(),
            kind: "train".into(),
            job: Some("job-1".into()),
            step,
            values: [("loss".to_string(), loss), ("bad".to_string(), f64::NAN)].into(),
            finished: false,
        }
    }

    #[test]
    fn a_run_keeps_its_points_in_order_without_non_finite_values() {
        let mut book = RunBook::new();
        for step in 1..=3 {
            book.report(point("r", step, 4.0 - step as f64), 1000 * step).unwrap();
        }
        let run = book.detail("r", 5000).unwrap();
        assert_eq!(run.points.iter().map(|p| p.step).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(run.points[2].at_s, 2.0);
        assert_eq!(run.summary.last, [("loss".to_string(), 1.0)].into());
        assert_eq!((run.summary.duration_s, run.summary.idle_s), (2.0, 2.0));
        assert_eq!(run.summary.job.as_deref(), Some("job-1"));
        assert!(book.detail("other", 0).is_none());
    }

    #[test]
    fn a_long_run_keeps_its_shape_within_the_bound() {
        let mut book = RunBook::new();
        let steps = (MAX_POINTS * 3) as u64;
        for step in 1..=steps {
            book.report(point("r", step, 1.0), step).unwrap();
        }
        let run = book.detail("r", 0).unwrap();
        assert!(run.points.len() <= MAX_POINTS, "{}", run.points.len());
        assert!(run.points.len() > MAX_POINTS / 2);
        assert_eq!(run.points.first().unwrap().step, 1);
        assert_eq!(run.points.last().unwrap().step, steps);
        assert!(run.points.windows(2).all(|w| w[0].step < w[1].step));
    }

    #[test]
    fn the_book_is_bounded_and_drops_finished_runs_first() {
        let mut book = RunBook::new();
        let mut done = point("done", 1, 1.0);
        done.finished = true;
        book.report(done, 0).unwrap();
        for i in 0..MAX_RUNS + 10 {
            book.report(point(&format!("run-{i}"), 1, 1.0), 1 + i as u64).unwrap();
        }
        assert_eq!(book.len(), MAX_RUNS);
        assert!(book.detail("done", 0).is_none(), "the finished run goes first");
        assert!(book.detail("run-0", 0).is_none(), "then the least recently reported");
        assert!(book.detail(&format!("run-{}", MAX_RUNS + 9), 0).is_some());
    }

    #[test]
    fn the_end_of_a_run_joins_its_last_point() {
        let mut book = RunBook::new();
        book.report(point("r", 5, 2.0), 0).unwrap();
        let mut end = point("r", 5, 2.0);
        end.values = [("failed".to_string(), 0.0)].into();
        end.finished = true;
        book.report(end, 10).unwrap();
        let run = book.detail("r", 10).unwrap();
        assert!(run.summary.finished);
        assert_eq!(run.points.len(), 1);
        assert_eq!(run.summary.last.keys().collect::<Vec<_>>(), vec!["failed", "loss"]);
    }

    #[test]
    fn bad_names_are_refused() {
        let mut book = RunBook::new();
        assert!(matches!(
            book.report(point("", 1, 1.0), 0),
            Err(Error::BadRunName { .. })
        ));
        let long = book.report(point(&"x".repeat(MAX_NAME + 1), 1, 1.0), 0).unwrap_err();
        assert_eq!(
            long,
            Error::BadRunName {
                run: "x".repeat(40),
                max: MAX_NAME
            }
        );
        assert!(book.is_empty());
    }
}
