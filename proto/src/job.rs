//! Jobs as data: what a submission may contain, the record the head keeps, and the rules
//! of its lifecycle. Pure: parsing, validation and state transitions, no processes.
//!
//! The JSON shapes follow Ray's job REST API (`entrypoint`, `submission_id`,
//! `runtime_env.env_vars`, `runtime_env.working_dir`, `metadata`, `entrypoint_resources`) so
//! that scripts written against Ray move over.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::protocol::GroupId;

/// Environment variable a driver finds its job id in.
pub const JOB_ID_ENV: &str = "REGATTA_JOB_ID";

/// A job's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum JobStatus {
    /// Accepted; the driver has not started.
    Pending,
    /// The driver runs.
    Running,
    /// The driver exited with status 0.
    Succeeded,
    /// The driver exited with another status, or could not start.
    Failed,
    /// Stopped on request.
    Stopped,
}

impl JobStatus {
    /// Whether the job is over.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Stopped)
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Self::Pending => "PENDING",
            Self::Running => "RUNNING",
            Self::Succeeded => "SUCCEEDED",
            Self::Failed => "FAILED",
            Self::Stopped => "STOPPED",
        };
        f.write_str(text)
    }
}

/// The driver's environment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeEnv {
    /// Extra environment variables.
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// Directory the driver starts in (must exist on the head).
    #[serde(default)]
    pub working_dir: Option<String>,
}

/// A job submission (the body of `POST /api/jobs`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSubmission {
    /// Shell command line of the driver.
    pub entrypoint: String,
    /// Caller-chosen id (default: generated).
    #[serde(default)]
    pub submission_id: Option<String>,
    /// Environment variables and working directory.
    #[serde(default)]
    pub runtime_env: RuntimeEnv,
    /// Free-form labels.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// CPUs the driver needs (reserved in the cluster while it runs).
    #[serde(default)]
    pub entrypoint_num_cpus: Option<f64>,
    /// GPUs the driver needs.
    #[serde(default)]
    pub entrypoint_num_gpus: Option<f64>,
    /// Other resources the driver needs, e.g. `{"accelerator_type:H100": 0.001}`.
    #[serde(default)]
    pub entrypoint_resources: BTreeMap<String, f64>,
}

/// The largest accepted submission id.
pub const MAX_ID_LEN: usize = 128;

impl JobSubmission {
    /// Checks what JSON parsing cannot: a non-empty entrypoint, a safe id, sane amounts.
    pub fn validate(&self) -> Result<(), String> {
        if self.entrypoint.trim().is_empty() {
            return Err("entrypoint is empty; give the driver's command line".into());
        }
        if let Some(id) = &self.submission_id {
            validate_id(id)?;
        }
        for (name, value) in self.runtime_env.env_vars.iter() {
            if name.is_empty() || name.contains('=') || name.contains('\0') || value.contains('\0') {
                return Err(format!("runtime_env.env_vars has an invalid entry '{name}'"));
            }
        }
        let amounts = self
            .entrypoint_num_cpus
            .iter()
            .chain(self.entrypoint_num_gpus.iter())
            .chain(self.entrypoint_resources.values());
        for amount in amounts {
            if !amount.is_finite() || *amount < 0.0 {
                return Err(format!("resource amount {amount} must be a finite number >= 0"));
            }
        }
        Ok(())
    }

    /// The driver's resources as a resource-list string (`CPU=1,GPU=0.5,...`).
    pub fn resources_text(&self) -> String {
        let mut parts = Vec::new();
        if let Some(cpus) = self.entrypoint_num_cpus.filter(|c| *c > 0.0) {
            parts.push(format!("CPU={cpus}"));
        }
        if let Some(gpus) = self.entrypoint_num_gpus.filter(|g| *g > 0.0) {
            parts.push(format!("GPU={gpus}"));
        }
        for (name, amount) in &self.entrypoint_resources {
            parts.push(format!("{name}={amount}"));
        }
        parts.join(",")
    }
}

/// Ids become file names: only letters, digits, `-`, `_` and `.`, not starting with `.`.
pub fn validate_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "submission_id '{id}' is not allowed: use 1 to {MAX_ID_LEN} letters, digits, '-', '_' or '.', not starting with '.'"
        ))
    }
}

/// What the head keeps about a job (the body of `GET /api/jobs/{id}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// The job's id.
    pub submission_id: String,
    /// Same as `submission_id` (Ray has both).
    pub job_id: String,
    /// The driver's command line.
    pub entrypoint: String,
    /// The state.
    pub status: JobStatus,
    /// A sentence about the state.
    pub message: String,
    /// The driver's exit code, once it exited.
    pub driver_exit_code: Option<i32>,
    /// Submission time, ms since the Unix epoch.
    pub submitted_at: u64,
    /// Driver start time.
    pub start_time: Option<u64>,
    /// End time.
    pub end_time: Option<u64>,
    /// Labels.
    pub metadata: BTreeMap<String, String>,
    /// The driver's environment.
    pub runtime_env: RuntimeEnv,
    /// Resources reserved for the driver.
    pub entrypoint_resources: String,
    /// The driver's process id (its process group id too).
    pub driver_pid: Option<u32>,
    /// The process that runs and watches the driver (`regatta job-shim`): not the head, so
    /// the driver outlives a head restart and the restarted head finds it again.
    #[serde(default)]
    pub supervisor: Option<ProcessIdentity>,
    /// The driver process, told apart from a later process that reuses its pid.
    #[serde(default)]
    pub driver: Option<ProcessIdentity>,
    /// The placement group holding the driver's resources, removed when the job ends.
    #[serde(default)]
    pub driver_group: Option<GroupId>,
}

/// A process told apart from any later one that reuses its pid: the pid, its start time
/// (clock ticks after boot, field 22 of `/proc/<pid>/stat`) and the boot it ran in (the
/// state directory outlives a reboot, after which pids and start times repeat).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    /// The process id.
    pub pid: u32,
    /// When it started, in clock ticks after boot.
    pub start_ticks: u64,
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`).
    #[serde(default)]
    pub boot: String,
}

impl JobRecord {
    /// A new pending record.
    pub fn new(id: String, submission: &JobSubmission, now_ms: u64) -> Self {
        Self {
            job_id: id.clone(),
            submission_id: id,
            entrypoint: submission.entrypoint.clone(),
            status: JobStatus::Pending,
            message: "waiting to start the driver".into(),
            driver_exit_code: None,
            submitted_at: now_ms,
            start_time: None,
            end_time: None,
            metadata: submission.metadata.clone(),
            runtime_env: submission.runtime_env.clone(),
            entrypoint_resources: submission.resources_text(),
            driver_pid: None,
            supervisor: None,
            driver: None,
            driver_group: None,
        }
    }

    /// The driver started.
    pub fn started(&mut self, pid: u32, now_ms: u64) {
        if self.status == JobStatus::Pending {
            self.status = JobStatus::Running;
            self.message = format!("driver running (pid {pid})");
            self.driver_pid = Some(pid);
            self.start_time = Some(now_ms);
        }
    }

    /// The driver exited (`code` is `None` when a signal ended it). A job being stopped
    /// ends as STOPPED whatever the driver's status.
    pub fn exited(&mut self, code: Option<i32>, stopping: bool, now_ms: u64) {
        if self.status.is_terminal() {
            return;
        }
        self.driver_exit_code = code;
        self.end_time = Some(now_ms);
        (self.status, self.message) = match (stopping, code) {
            (true, _) => (JobStatus::Stopped, "stopped on request".to_string()),
            (false, Some(0)) => (JobStatus::Succeeded, "driver exited with code 0".to_string()),
            (false, Some(code)) => (JobStatus::Failed, format!("driver exited with code {code}")),
            (false, None) => (JobStatus::Failed, "driver was killed by a signal".to_string()),
        };
    }

    /// The job could not run (or the head lost it); `message` says why.
    pub fn failed(&mut self, message: String, now_ms: u64) {
        if !self.status.is_terminal() {
            self.status = JobStatus::Failed;
            self.message = message;
            self.end_time = Some(now_ms);
        }
    }

    /// Stopped before its driver started.
    pub fn stopped_before_start(&mut self, now_ms: u64) {
        if self.status == JobStatus::Pending {
            self.status = JobStatus::Stopped;
            self.message = "stopped before the driver started".into();
            self.end_time = Some(now_ms);
        }
    }
}

/// Finished jobs the head keeps (records and logs); older finished ones are deleted when a
/// new job is submitted, so a long-lived head does not grow without bound.
pub const MAX_FINISHED_JOBS: usize = 1_000;

/// The finished jobs beyond the newest `keep` (by end time, then submission time), oldest
/// first: what to delete. Running jobs are never chosen.
pub fn finished_beyond<'a>(records: impl IntoIterator<Item = &'a JobRecord>, keep: usize) -> Vec<String> {
    let mut finished: Vec<&JobRecord> = records.into_iter().filter(|r| r.status.is_terminal()).collect();
    if finished.len() <= keep {
        return Vec::new();
    }
    finished.sort_by_key(|r| (r.end_time.unwrap_or(0), r.submitted_at, r.submission_id.clone()));
    let excess = finished.len() - keep;
    finished
        .into_iter()
        .take(excess)
        .map(|r| r.submission_id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn submission(json: &str) -> Result<JobSubmission, String> {
        let parsed: JobSubmission = serde_json::from_str(json).map_err(|e| e.to_string())?;
        parsed.validate().map(|()| parsed)
    }

    #[test]
    fn only_the_oldest_finished_jobs_beyond_the_bound_are_pruned() {
        let base = submission(r#"{"entrypoint": "x"}"#).unwrap();
        let mut records = Vec::new();
        for (i, end) in [(0, Some(50)), (1, None), (2, Some(10)), (3, Some(30)), (4, None)] {
            let mut record = JobRecord::new(format!("job-{i}"), &base, i);
            if let Some(end) = end {
                record.started(1, end - 1);
                record.exited(Some(0), false, end);
            }
            records.push(record);
        }
        // Three finished (ends 50, 10, 30), two running: keep the newest two finished.
        assert_eq!(finished_beyond(&records, 2), vec!["job-2".to_string()]);
        assert_eq!(finished_beyond(&records, 0), vec!["job-2", "job-3", "job-0"]);
        assert!(finished_beyond(&records, 3).is_empty());
    }

    #[test]
    fn ray_shaped_submissions_parse() {
        let s = submission(
            r#"{"entrypoint": "python x.py", "submission_id": "job_1", "runtime_env": {"env_vars": {"A": "1"}, "working_dir": "/tmp"},
                "metadata": {"team": "ml"}, "entrypoint_num_cpus": 1, "entrypoint_resources": {"accelerator_type:H100": 0.001}}"#,
        )
        .unwrap();
        assert_eq!(s.submission_id.as_deref(), Some("job_1"));
        assert_eq!(s.resources_text(), "CPU=1,accelerator_type:H100=0.001");
    }

    #[test]
    fn bad_submissions_say_what_is_wrong() {
        assert!(submission(r#"{"submission_id": "x"}"#)
            .unwrap_err()
            .contains("missing field `entrypoint`"));
        assert!(submission(r#"{"entrypoint": "  "}"#)
            .unwrap_err()
            .contains("entrypoint is empty"));
        assert!(submission(r#"{"entrypoint": "x", "submission_id": "../etc"}"#)
            .unwrap_err()
            .contains("not allowed"));
        assert!(submission(r#"{"entrypoint": "x", "entrypont_num_cpus": 1}"#)
            .unwrap_err()
            .contains("unknown field"));
        assert!(submission(r#"{"entrypoint": "x", "entrypoint_num_cpus": -1}"#)
            .unwrap_err()
            .contains(">= 0"));
    }

    #[test]
    fn lifecycle_follows_the_driver() {
        let mut r = JobRecord::new("j".into(), &submission(r#"{"entrypoint": "x"}"#).unwrap(), 1);
        assert_eq!(r.status, JobStatus::Pending);
        r.started(42, 2);
        assert_eq!(
            (r.status, r.driver_pid, r.start_time),
            (JobStatus::Running, Some(42), Some(2))
        );
        r.exited(Some(3), false, 5);
        assert_eq!(
            (r.status, r.driver_exit_code, r.end_time),
            (JobStatus::Failed, Some(3), Some(5))
        );
        r.exited(Some(0), false, 6);
        assert_eq!(r.status, JobStatus::Failed, "terminal states stick");
        let mut stopped = JobRecord::new(
            "k".into(),
            &JobSubmission {
                entrypoint: "x".into(),
                ..Default::default()
            },
            1,
        );
        stopped.started(1, 1);
        stopped.exited(None, true, 2);
        assert_eq!(stopped.status, JobStatus::Stopped);
        assert_eq!(serde_json::to_value(JobStatus::Succeeded).unwrap(), "SUCCEEDED");
    }
}
