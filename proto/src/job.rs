//! Jobs as data: what a submission may contain, the record the head keeps, and the rules
//! of its lifecycle. Pure: parsing, validation and state transitions, no processes.
//!
//! The JSON shapes follow Ray's job REST API (`entrypoint`, `submission_id`,
//! `runtime_env.env_vars`, `runtime_env.working_dir`, `metadata`, `entrypoint_resources`) so
//! that scripts written against Ray move over.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::Error;
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

/// The driver's environment: the parts of Ray's `runtime_env` Regatta carries out.
///
/// Anything else Ray's `runtime_env` can hold (`pip`, `conda`, `uv`, `container`,
/// `image_uri`, `nsight`, ...) is refused by name at submission, never ignored: a driver
/// that silently lacks its packages fails later and further from the cause.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawRuntimeEnv")]
pub struct RuntimeEnv {
    /// Extra environment variables.
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// Where the driver starts: a folder on the driver's node, or a package uploaded through
    /// the job API (`gcs://_ray_pkg_<hash>.zip`, as Ray's client names a zipped folder),
    /// unpacked for the driver.
    #[serde(default)]
    pub working_dir: Option<String>,
    /// Uploaded packages (`gcs://...` URIs) whose folders go on the driver's `PYTHONPATH`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub py_modules: Vec<String>,
    /// Ray's client applies these while zipping `working_dir`; kept only to show them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excludes: Vec<String>,
}

/// The `runtime_env` keys Regatta carries out.
pub const RUNTIME_ENV_KEYS: &[&str] = &["env_vars", "working_dir", "py_modules", "excludes"];

/// `runtime_env` as sent, before unsupported keys are refused.
#[derive(Deserialize)]
struct RawRuntimeEnv {
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    py_modules: Option<Vec<String>>,
    #[serde(default)]
    excludes: Option<Vec<String>>,
    #[serde(flatten)]
    other: BTreeMap<String, serde::de::IgnoredAny>,
}

impl TryFrom<RawRuntimeEnv> for RuntimeEnv {
    type Error = Error;

    fn try_from(raw: RawRuntimeEnv) -> Result<Self, Error> {
        // Ray's client adds its own bookkeeping (`_ray_commit`): no feature, nothing to do.
        if let Some(name) = raw.other.keys().find(|name| !name.starts_with('_')) {
            let why = match name.as_str() {
                "pip" | "uv" | "conda" => {
                    "Regatta does not install packages per job: install them into the environment the workers run (the image or its virtualenv)"
                }
                "container" | "image_uri" => "Regatta runs drivers on the node itself, not in a per-job container",
                _ => "Regatta does not carry it out",
            };
            return Err(Error::UnsupportedRuntimeEnv {
                key: name.clone(),
                why,
                supported: RUNTIME_ENV_KEYS,
            });
        }
        Ok(Self {
            env_vars: raw.env_vars,
            working_dir: raw.working_dir,
            py_modules: raw.py_modules.unwrap_or_default(),
            excludes: raw.excludes.unwrap_or_default(),
        })
    }
}

/// The scheme of packages uploaded through the job API (Ray's client names them so).
pub const PACKAGE_SCHEME: &str = "gcs://";

impl RuntimeEnv {
    /// The uploaded packages the driver needs (`working_dir` first, then `py_modules`), as
    /// their names without the scheme.
    pub fn packages(&self) -> Vec<&str> {
        self.working_dir_package()
            .into_iter()
            .chain(self.py_module_packages())
            .collect()
    }

    /// The `working_dir` package's name, when the working directory is one.
    pub fn working_dir_package(&self) -> Option<&str> {
        self.working_dir
            .as_deref()
            .and_then(|uri| uri.strip_prefix(PACKAGE_SCHEME))
    }

    /// The `working_dir` as a path on the driver's node, when it is not a package.
    pub fn working_dir_path(&self) -> Option<&str> {
        self.working_dir
            .as_deref()
            .filter(|_| self.working_dir_package().is_none())
    }

    /// The `py_modules` packages' names.
    pub fn py_module_packages(&self) -> Vec<&str> {
        self.py_modules
            .iter()
            .filter_map(|uri| uri.strip_prefix(PACKAGE_SCHEME))
            .collect()
    }
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
    /// Memory the driver needs, in bytes.
    #[serde(default)]
    pub entrypoint_memory: Option<u64>,
    /// Ray's node label selector: refused when not empty (place by resources instead).
    #[serde(default)]
    pub entrypoint_label_selector: Option<BTreeMap<String, String>>,
    /// Other resources the driver needs, e.g. `{"accelerator_type:H100": 0.001}`.
    #[serde(default)]
    pub entrypoint_resources: BTreeMap<String, f64>,
}

/// The largest accepted submission id.
pub const MAX_ID_LEN: usize = 128;

impl JobSubmission {
    /// Checks what JSON parsing cannot: a non-empty entrypoint, a safe id, sane amounts.
    pub fn validate(&self) -> Result<(), Error> {
        if self.entrypoint.trim().is_empty() {
            return Err(Error::EmptyEntrypoint);
        }
        if let Some(id) = &self.submission_id {
            validate_id(id)?;
        }
        for (name, value) in self.runtime_env.env_vars.iter() {
            if name.is_empty() || name.contains('=') || name.contains('\0') || value.contains('\0') {
                return Err(Error::BadEnvVar { name: name.clone() });
            }
        }
        if self.entrypoint_label_selector.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(Error::LabelSelectorUnsupported);
        }
        for uri in self.runtime_env.working_dir.iter().chain(&self.runtime_env.py_modules) {
            if uri.contains("://") && !uri.starts_with(PACKAGE_SCHEME) {
                return Err(Error::UnsupportedPackage {
                    uri: uri.clone(),
                    scheme: PACKAGE_SCHEME,
                });
            }
        }
        if let Some(module) = self
            .runtime_env
            .py_modules
            .iter()
            .find(|m| !m.starts_with(PACKAGE_SCHEME))
        {
            return Err(Error::PyModuleNotUploaded {
                module: module.clone(),
                scheme: PACKAGE_SCHEME,
            });
        }
        let amounts = self
            .entrypoint_num_cpus
            .iter()
            .chain(self.entrypoint_num_gpus.iter())
            .chain(self.entrypoint_resources.values());
        for amount in amounts {
            if !amount.is_finite() || *amount < 0.0 {
                return Err(Error::BadAmount { amount: *amount });
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
        if let Some(memory) = self.entrypoint_memory.filter(|m| *m > 0) {
            parts.push(format!("memory={memory}"));
        }
        for (name, amount) in &self.entrypoint_resources {
            parts.push(format!("{name}={amount}"));
        }
        parts.join(",")
    }
}

/// Ids become file names: only letters, digits, `-`, `_` and `.`, not starting with `.`.
pub fn validate_id(id: &str) -> Result<(), Error> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::BadJobId {
            id: id.to_string(),
            max: MAX_ID_LEN,
        })
    }
}

/// Ray's job type: jobs submitted through the job API are `SUBMISSION`.
pub const SUBMISSION_TYPE: &str = "SUBMISSION";

fn submission_type() -> String {
    SUBMISSION_TYPE.to_string()
}

/// Where the driver runs, in Ray's shape (`driver_info` of Ray's `JobDetails`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverInfo {
    /// The driver's id (the job's id: one driver per job).
    pub id: String,
    /// The address of the node it runs on.
    pub node_ip_address: String,
    /// Its process id, as text (Ray's clients read a string).
    pub pid: String,
}

/// Why a job failed, in Ray's `error_type` names.
pub mod error_type {
    /// The entrypoint ran and exited with a non-zero status or by a signal.
    pub const ENTRYPOINT: &str = "JOB_ENTRYPOINT_COMMAND_ERROR";
    /// The entrypoint could not be started (its working directory, its packages, the
    /// supervisor).
    pub const START: &str = "JOB_ENTRYPOINT_COMMAND_START_ERROR";
    /// The node running the driver died, or the head lost track of it.
    pub const SUPERVISOR: &str = "JOB_SUPERVISOR_ACTOR_DIED";
}

/// What the head keeps about a job (the body of `GET /api/jobs/{id}`): a superset of Ray's
/// `JobDetails`, whose clients ignore the fields they do not know.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// Ray's job type, always `SUBMISSION`.
    #[serde(rename = "type", default = "submission_type")]
    pub kind: String,
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
    /// Why it failed, in Ray's names ([`error_type`]); `None` unless FAILED.
    #[serde(default)]
    pub error_type: Option<String>,
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
    /// CPUs reserved for the driver.
    #[serde(default)]
    pub entrypoint_num_cpus: Option<f64>,
    /// GPUs reserved for the driver.
    #[serde(default)]
    pub entrypoint_num_gpus: Option<f64>,
    /// Memory reserved for the driver, in bytes.
    #[serde(default)]
    pub entrypoint_memory: Option<u64>,
    /// Other resources reserved for the driver.
    #[serde(default, deserialize_with = "resources_map_or_text")]
    pub entrypoint_resources: BTreeMap<String, f64>,
    /// The driver's process id (its process group id too).
    pub driver_pid: Option<u32>,
    /// Where the driver runs (Ray's shape), once it started.
    #[serde(default)]
    pub driver_info: Option<DriverInfo>,
    /// The node the driver runs on, when it runs on a worker (`None`: on the head).
    #[serde(default)]
    pub driver_node_id: Option<String>,
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

/// `entrypoint_resources` as Ray writes it (a map), or as records of earlier Regatta
/// versions kept it (`"CPU=1,GPU=1"`): a state directory written before still loads.
fn resources_map_or_text<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<BTreeMap<String, f64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Map(BTreeMap<String, f64>),
        Text(String),
    }
    Ok(match Either::deserialize(deserializer)? {
        Either::Map(map) => map,
        Either::Text(text) => text
            .split(',')
            .filter_map(|part| part.split_once('='))
            .filter_map(|(name, amount)| Some((name.trim().to_string(), amount.trim().parse().ok()?)))
            .collect(),
    })
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

/// What the job API shows in place of an environment variable's value.
pub const HIDDEN_ENV_VALUE: &str = "<hidden>";

impl JobRecord {
    /// The record as the job API shows it: the environment's names with every value
    /// replaced by [`HIDDEN_ENV_VALUE`] (values are often credentials; the driver has them).
    pub fn without_env_values(mut self) -> Self {
        for value in self.runtime_env.env_vars.values_mut() {
            *value = HIDDEN_ENV_VALUE.to_string();
        }
        self
    }

    /// A new pending record.
    pub fn new(id: String, submission: &JobSubmission, now_ms: u64) -> Self {
        Self {
            kind: submission_type(),
            job_id: id.clone(),
            submission_id: id,
            entrypoint: submission.entrypoint.clone(),
            status: JobStatus::Pending,
            message: "waiting to start the driver".into(),
            error_type: None,
            driver_exit_code: None,
            submitted_at: now_ms,
            start_time: None,
            end_time: None,
            metadata: submission.metadata.clone(),
            runtime_env: submission.runtime_env.clone(),
            entrypoint_num_cpus: submission.entrypoint_num_cpus,
            entrypoint_num_gpus: submission.entrypoint_num_gpus,
            entrypoint_memory: submission.entrypoint_memory,
            entrypoint_resources: submission.entrypoint_resources.clone(),
            driver_pid: None,
            driver_info: None,
            driver_node_id: None,
            supervisor: None,
            driver: None,
            driver_group: None,
        }
    }

    /// The driver started as process `pid` on the node at `node_address`.
    pub fn started(&mut self, pid: u32, node_address: &str, now_ms: u64) {
        if self.status == JobStatus::Pending {
            self.status = JobStatus::Running;
            self.message = format!("driver running (pid {pid})");
            self.driver_pid = Some(pid);
            self.driver_info = Some(DriverInfo {
                id: self.submission_id.clone(),
                node_ip_address: node_address.to_string(),
                pid: pid.to_string(),
            });
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
        if self.status == JobStatus::Failed {
            self.error_type = Some(error_type::ENTRYPOINT.to_string());
        }
    }

    /// The job could not run (or the head lost it): `kind` is one of [`error_type`]'s,
    /// `message` says why.
    pub fn failed(&mut self, kind: &str, message: String, now_ms: u64) {
        if !self.status.is_terminal() {
            self.status = JobStatus::Failed;
            self.error_type = Some(kind.to_string());
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
        parsed.validate().map(|()| parsed).map_err(|e| e.to_string())
    }

    #[test]
    fn only_the_oldest_finished_jobs_beyond_the_bound_are_pruned() {
        let base = submission(r#"{"entrypoint": "x"}"#).unwrap();
        let mut records = Vec::new();
        for (i, end) in [(0, Some(50)), (1, None), (2, Some(10)), (3, Some(30)), (4, None)] {
            let mut record = JobRecord::new(format!("job-{i}"), &base, i);
            if let Some(end) = end {
                record.started(1, "127.0.0.1", end - 1);
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
    fn what_ray_s_client_sends_parses() {
        // `ray job submit --working-dir . --entrypoint-num-gpus 1 --entrypoint-memory 1000`,
        // as Ray 2.60's client normalises it.
        let s = submission(
            r#"{"entrypoint": "python job.py", "runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip",
                "py_modules": ["gcs://_ray_pkg_fedcba9876543210.zip"], "excludes": ["*.log"], "env_vars": {"A": "1"}},
                "metadata": {}, "entrypoint_num_gpus": 1, "entrypoint_memory": 1000}"#,
        )
        .unwrap();
        assert_eq!(
            s.runtime_env.packages(),
            vec!["_ray_pkg_0123456789abcdef.zip", "_ray_pkg_fedcba9876543210.zip"]
        );
        assert_eq!(
            s.runtime_env.working_dir_package(),
            Some("_ray_pkg_0123456789abcdef.zip")
        );
        assert_eq!(s.resources_text(), "GPU=1,memory=1000");
        let record = JobRecord::new("j".into(), &s, 1);
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["entrypoint_num_gpus"], 1.0);
        assert_eq!(json["runtime_env"]["excludes"][0], "*.log");
        let back: JobRecord = serde_json::from_value(json).unwrap();
        assert_eq!(back, record);
    }

    #[test]
    fn unsupported_runtime_env_keys_are_refused_by_name() {
        let from_ray =
            submission(r#"{"entrypoint": "x", "runtime_env": {"_ray_commit": "b7f4259e", "env_vars": {}}}"#).unwrap();
        assert_eq!(from_ray.runtime_env, RuntimeEnv::default());
        for key in ["pip", "conda", "container", "nsight"] {
            let error = submission(&format!(
                r#"{{"entrypoint": "x", "runtime_env": {{"{key}": ["torch"]}}}}"#
            ))
            .unwrap_err();
            assert!(
                error.contains(&format!("runtime_env.{key} is not supported")),
                "{error}"
            );
        }
        let error =
            submission(r#"{"entrypoint": "x", "runtime_env": {"working_dir": "s3://bucket/pkg.zip"}}"#).unwrap_err();
        assert!(error.contains("s3://bucket/pkg.zip"), "{error}");
        let error = submission(r#"{"entrypoint": "x", "entrypoint_label_selector": {"zone": "a"}}"#).unwrap_err();
        assert!(error.contains("entrypoint_label_selector"), "{error}");
    }

    #[test]
    fn records_of_earlier_versions_still_load() {
        let mut old = serde_json::to_value(JobRecord::new(
            "j".into(),
            &submission(r#"{"entrypoint": "x"}"#).unwrap(),
            1,
        ))
        .unwrap();
        let object = old.as_object_mut().unwrap();
        object.remove("type");
        object.insert("entrypoint_resources".into(), "CPU=1,GPU=0.5".into());
        let record: JobRecord = serde_json::from_value(old).unwrap();
        assert_eq!(record.kind, "SUBMISSION");
        assert_eq!(
            record.entrypoint_resources,
            BTreeMap::from([("CPU".into(), 1.0), ("GPU".into(), 0.5)])
        );
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
    fn refusals_are_typed_by_what_is_wrong() {
        let parse = |json: &str| serde_json::from_str::<JobSubmission>(json).unwrap();
        assert_eq!(parse(r#"{"entrypoint": " "}"#).validate(), Err(Error::EmptyEntrypoint));
        assert_eq!(
            validate_id("../etc"),
            Err(Error::BadJobId {
                id: "../etc".into(),
                max: MAX_ID_LEN
            })
        );
        assert_eq!(
            parse(r#"{"entrypoint": "x", "entrypoint_num_gpus": -1}"#).validate(),
            Err(Error::BadAmount { amount: -1.0 })
        );
        assert_eq!(
            parse(r#"{"entrypoint": "x", "runtime_env": {"py_modules": ["/home/me/lib"]}}"#).validate(),
            Err(Error::PyModuleNotUploaded {
                module: "/home/me/lib".into(),
                scheme: PACKAGE_SCHEME,
            })
        );
    }

    #[test]
    fn lifecycle_follows_the_driver() {
        let mut r = JobRecord::new("j".into(), &submission(r#"{"entrypoint": "x"}"#).unwrap(), 1);
        assert_eq!(r.status, JobStatus::Pending);
        r.started(42, "10.0.0.7", 2);
        assert_eq!(
            (r.status, r.driver_pid, r.start_time),
            (JobStatus::Running, Some(42), Some(2))
        );
        let info = serde_json::to_value(&r).unwrap();
        assert_eq!(info["type"], "SUBMISSION");
        assert_eq!(
            info["driver_info"],
            serde_json::json!({"id": "j", "node_ip_address": "10.0.0.7", "pid": "42"}),
            "Ray's clients read the pid as a string"
        );
        r.exited(Some(3), false, 5);
        assert_eq!(
            (r.status, r.driver_exit_code, r.end_time),
            (JobStatus::Failed, Some(3), Some(5))
        );
        assert_eq!(r.error_type.as_deref(), Some(error_type::ENTRYPOINT));
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
        stopped.started(1, "127.0.0.1", 1);
        stopped.exited(None, true, 2);
        assert_eq!(stopped.status, JobStatus::Stopped);
        assert_eq!(serde_json::to_value(JobStatus::Succeeded).unwrap(), "SUCCEEDED");
    }

    /// Bounded fuzzing of the job API's JSON: any bytes, and any JSON, parse and validate
    /// or are refused with a reason, never a panic.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// A fixed seed unless `PROPTEST_RNG_SEED` names one: CI runs the same cases every
        /// time (a flaky fuzz is a failing test); a developer widens the search with
        /// `PROPTEST_RNG_SEED` and `PROPTEST_CASES`.
        fn fuzz_config(cases: u32) -> ProptestConfig {
            let mut config = ProptestConfig::with_cases(
                std::env::var("PROPTEST_CASES")
                    .ok()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(cases),
            );
            if matches!(config.rng_seed, proptest::test_runner::RngSeed::Random) {
                config.rng_seed = proptest::test_runner::RngSeed::Fixed(0x5eed_1e55);
            }
            config
        }

        fn json() -> impl Strategy<Value = serde_json::Value> {
            let leaf = prop_oneof![
                Just(serde_json::Value::Null),
                any::<bool>().prop_map(serde_json::Value::from),
                any::<f64>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                proptest::collection::vec(any::<char>(), 0..24)
                    .prop_map(|c| serde_json::Value::from(String::from_iter(c))),
            ];
            let keys = prop_oneof![
                Just("entrypoint".to_string()),
                Just("runtime_env".to_string()),
                Just("env_vars".to_string()),
                Just("working_dir".to_string()),
                Just("submission_id".to_string()),
                Just("metadata".to_string()),
                Just("entrypoint_resources".to_string()),
                Just("entrypoint_num_cpus".to_string()),
                proptest::collection::vec(any::<char>(), 0..8).prop_map(String::from_iter),
            ];
            leaf.prop_recursive(4, 48, 6, move |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                    proptest::collection::btree_map(keys.clone(), inner, 0..6)
                        .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
                ]
            })
        }

        proptest! {
            #![proptest_config(fuzz_config(512))]

            #[test]
            fn any_bytes_are_parsed_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                if let Ok(submission) = serde_json::from_slice::<JobSubmission>(&bytes) {
                    let _ = submission.validate();
                }
            }

            #[test]
            fn any_json_is_parsed_and_validated_or_refused(value in json()) {
                if let Ok(submission) = serde_json::from_value::<JobSubmission>(value) {
                    if submission.validate().is_ok() {
                        let _ = submission.resources_text();
                        let again = serde_json::to_vec(&submission).expect("encodes");
                        let back: JobSubmission = serde_json::from_slice(&again).expect("reads back");
                        prop_assert_eq!(back, submission);
                    }
                }
            }
        }
    }
}
