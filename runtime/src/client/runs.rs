//! A training or scoring driver's reports to the head's dashboard ([`RunReporter`]).

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use regatta_proto::RunPoint;

use super::Cluster;

/// Reports one run's points to the head (`/api/runs` and the dashboard's charts). Reports
/// are fire-and-forget: a head that is away costs the run nothing but a gap in its chart.
pub struct RunReporter {
    cluster: Cluster,
    name: String,
    kind: String,
    last_step: u64,
}

impl RunReporter {
    /// A run of `kind` (`train`, `score`) named `<kind>-<job>-<start time in ms>` (the job
    /// part only when the driver runs in a job).
    pub fn new(cluster: &Cluster, kind: &str) -> Self {
        let started_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let name = match cluster.job() {
            Some(job) => format!("{kind}-{job}-{started_ms}"),
            None => format!("{kind}-{started_ms}"),
        };
        Self {
            cluster: cluster.clone(),
            name,
            kind: kind.to_string(),
            last_step: 0,
        }
    }

    /// The run's name on the dashboard.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A point at `step` with named figures.
    pub fn report(&mut self, step: u64, values: BTreeMap<String, f64>) {
        self.last_step = step;
        self.send(step, values, false);
    }

    /// The run's end: `failed` is recorded as a figure (0 or 1) at the last step.
    pub fn finish(&mut self, failed: bool) {
        let values = BTreeMap::from([("failed".to_string(), if failed { 1.0 } else { 0.0 })]);
        self.send(self.last_step, values, true);
    }

    fn send(&self, step: u64, values: BTreeMap<String, f64>, finished: bool) {
        self.cluster.report_run(RunPoint {
            run: self.name.clone(),
            kind: self.kind.clone(),
            job: self.cluster.job().map(str::to_string),
            step,
            values,
            finished,
        });
    }
}
