//! The head's job manager: runs each job's driver on the head with the cluster's address
//! and token in its environment, under a supervisor process of its own
//! ([`super::job_shim`]) that keeps the driver's output in a capped log and records how it
//! ended. The manager records every state change on disk, follows the supervisor's files,
//! and cleans up the job's actors and objects when the job ends or is stopped. A restarted
//! head finds running jobs again from their records and their supervisors' files.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::process::Command;
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::headlink::HeadLink;
use crate::https::ApiTls;
use crate::job::JOB_ID_ENV;
use crate::job::{error_type, finished_beyond, JobRecord, JobStatus, JobSubmission, ProcessIdentity, MAX_FINISHED_JOBS};
use crate::job_log;
use crate::job_packages::PackageStore;
use crate::job_shim::{self, RunFiles, ShimOutcome};
use crate::job_store::JobStore;
use crate::placement::Strategy;
use crate::protocol::{GroupId, GroupSpec, HeadRequest};
use crate::resources::Resources;

/// Environment variable a driver finds the cluster address in.
pub const ADDRESS_ENV: &str = "REGATTA_ADDRESS";

/// How the job service runs.
#[derive(Clone, Debug)]
pub struct JobConfig {
    /// Where records and logs live.
    pub state_dir: PathBuf,
    /// Bytes of log kept per part (two parts at most).
    pub log_cap_bytes: u64,
    /// Time between SIGTERM and SIGKILL when a job is stopped.
    pub stop_grace: Duration,
    /// Largest package (`working_dir`, `py_modules`) a client may upload.
    pub max_package_bytes: u64,
    /// HTTP port of the job API (0: any).
    pub http_port: u16,
    /// HTTPS (by default with the token's certificate) or plain HTTP.
    pub tls: ApiTls,
    /// The `regatta` binary, whose `job-shim` command supervises each driver (default: the
    /// running executable, which is `regatta` for `regatta head`).
    pub supervisor_binary: Option<PathBuf>,
}

impl JobConfig {
    /// Defaults: `~/.regatta/head`, 64 MiB logs, 3 s grace, 500 MiB packages, port 8265.
    pub fn new() -> Self {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."));
        Self {
            state_dir: home.join(".regatta").join("head"),
            log_cap_bytes: 64 << 20,
            stop_grace: Duration::from_secs(3),
            max_package_bytes: crate::job_packages::MAX_PACKAGE_BYTES,
            http_port: 8265,
            tls: ApiTls::Token,
            supervisor_binary: std::env::current_exe().ok(),
        }
    }
}

impl Default for JobConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a job request was refused, mapped to an HTTP status by the API.
#[derive(Debug)]
pub(crate) enum JobError {
    /// 400.
    Invalid(String),
    /// 404.
    Unknown(String),
    /// 413.
    TooLarge(String),
    /// 500.
    Internal(String),
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// How often a job's supervisor files are looked at.
const FOLLOW_EVERY: Duration = Duration::from_millis(100);

struct Inner {
    store: JobStore,
    logs: PathBuf,
    run: PathBuf,
    records: Mutex<BTreeMap<String, JobRecord>>,
    stopping: Mutex<HashSet<String>>,
    config: JobConfig,
    cluster_address: String,
    token: String,
    link: Arc<HeadLink>,
    changes: watch::Sender<u64>,
    packages: PackageStore,
    session_name: String,
}

/// The job manager; cheap to clone.
#[derive(Clone)]
pub(crate) struct JobManager {
    inner: Arc<Inner>,
}

impl JobManager {
    /// Opens the job store. Jobs that were running when the head went away are followed
    /// again through their supervisors ([`JobManager::resume`]); a job whose driver had not
    /// started is marked failed.
    pub(crate) fn open(config: JobConfig, cluster_address: String, token: String, link: Arc<HeadLink>) -> Result<Self> {
        // Job records hold the drivers' environments: owner only, as the head's state.
        super::state_file::private_dir(&config.state_dir)?;
        let store = JobStore::open(&config.state_dir.join("jobs"))?;
        let logs = config.state_dir.join("logs");
        let run = config.state_dir.join("run");
        for dir in [&logs, &run] {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
        }
        let records = store
            .load_all()
            .into_iter()
            .map(|record| (record.submission_id.clone(), record))
            .collect();
        let (changes, _) = watch::channel(0);
        let packages = PackageStore::open(config.state_dir.join("packages"))?;
        let session_name = format!("regatta_{}", crate::node::random_hex(6));
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                logs,
                run,
                records: Mutex::new(records),
                stopping: Mutex::new(HashSet::new()),
                config,
                cluster_address,
                token,
                link,
                changes,
                packages,
                session_name,
            }),
        })
    }

    /// Takes back the jobs a previous head left running: each one with a supervisor is
    /// followed again (its driver kept running, its log kept growing); one without (its
    /// driver had not started) is marked failed and its reservation freed.
    pub(crate) fn resume(&self) {
        let unfinished: Vec<JobRecord> = self
            .records()
            .values()
            .filter(|r| !r.status.is_terminal())
            .cloned()
            .collect();
        for record in unfinished {
            let id = record.submission_id.clone();
            let manager = self.clone();
            match record.supervisor {
                Some(supervisor) => {
                    tracing::info!(job = %id, pid = supervisor.pid, "following a job the previous head started");
                    tokio::spawn(async move {
                        manager.follow(&id, supervisor).await;
                        manager.cleanup(&id, record.driver_group).await;
                    });
                }
                None => {
                    self.update(&id, |r| {
                        r.failed(
                            error_type::SUPERVISOR,
                            "the head restarted before the driver started; submit the job again".into(),
                            now_ms(),
                        )
                    });
                    tokio::spawn(async move { manager.cleanup(&id, record.driver_group).await });
                }
            }
        }
    }

    fn records(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, JobRecord>> {
        self.inner.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies a change to a record, persists it and wakes followers.
    fn update(&self, id: &str, change: impl FnOnce(&mut JobRecord)) {
        let saved = {
            let mut records = self.records();
            let Some(record) = records.get_mut(id) else { return };
            change(record);
            record.clone()
        };
        if let Err(e) = self.inner.store.save(&saved) {
            tracing::error!(job = id, error = %e, "could not persist a job record");
        }
        self.inner.changes.send_modify(|n| *n += 1);
    }

    /// A receiver that changes whenever any job changes.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// The package store of uploaded `working_dir`s and `py_modules`.
    pub(crate) fn packages(&self) -> &PackageStore {
        &self.inner.packages
    }

    /// The largest package accepted.
    pub(crate) fn max_package_bytes(&self) -> u64 {
        self.inner.config.max_package_bytes
    }

    /// This head's session name (a new one each start).
    pub(crate) fn session_name(&self) -> &str {
        &self.inner.session_name
    }

    /// Accepts a job and starts its driver in the background.
    pub(crate) fn submit(&self, submission: JobSubmission) -> std::result::Result<String, JobError> {
        submission.validate().map_err(JobError::Invalid)?;
        for package in submission.runtime_env.packages() {
            if !self.inner.packages.exists(package) {
                return Err(JobError::Invalid(format!(
                    "runtime_env names the package gcs://{package}, which was not uploaded (or was deleted): upload it with PUT /api/packages/gcs/{package}"
                )));
            }
            self.inner.packages.touch(package);
        }
        if let Some(dir) = submission.runtime_env.working_dir.as_ref().filter(|_| submission.runtime_env.working_dir_package().is_none()) {
            if !Path::new(dir).is_dir() {
                return Err(JobError::Invalid(format!(
                    "runtime_env.working_dir '{dir}' is not a directory on the head"
                )));
            }
        }
        let resources = submission.resources_text();
        if !resources.is_empty() {
            Resources::parse_request(&resources).map_err(|e| JobError::Invalid(e.to_string()))?;
        }
        let id = submission
            .submission_id
            .clone()
            .unwrap_or_else(|| format!("job-{}", crate::node::random_hex(6)));
        let record = JobRecord::new(id.clone(), &submission, now_ms());
        {
            let mut records = self.records();
            if records.contains_key(&id) {
                // Ray's words, which Ray's clients and scripts expect.
                return Err(JobError::Invalid(format!(
                    "Job with submission_id {id} already exists. Please use a different submission_id."
                )));
            }
            records.insert(id.clone(), record.clone());
        }
        self.inner
            .store
            .save(&record)
            .map_err(|e| JobError::Internal(e.to_string()))?;
        let manager = self.clone();
        let job = id.clone();
        tokio::spawn(async move { manager.run(job, submission).await });
        tracing::info!(job = %id, "job submitted");
        self.prune_finished();
        Ok(id)
    }

    /// Deletes the oldest finished jobs beyond [`MAX_FINISHED_JOBS`] (records and logs).
    fn prune_finished(&self) {
        let doomed = finished_beyond(self.records().values(), MAX_FINISHED_JOBS);
        for id in doomed {
            match self.delete(&id) {
                Ok(()) => tracing::info!(job = %id, "deleted a finished job past the {MAX_FINISHED_JOBS} kept"),
                Err(e) => tracing::warn!(job = %id, error = ?e, "could not delete an old finished job"),
            }
        }
    }

    /// One job's record.
    pub(crate) fn get(&self, id: &str) -> std::result::Result<JobRecord, JobError> {
        self.records()
            .get(id)
            .cloned()
            .ok_or_else(|| JobError::Unknown(format!("Job {id} does not exist")))
    }

    /// Every job, oldest first.
    pub(crate) fn list(&self) -> Vec<JobRecord> {
        let mut all: Vec<JobRecord> = self.records().values().cloned().collect();
        all.sort_by_key(|r| r.submitted_at);
        all
    }

    /// The job's log file.
    pub(crate) fn log_path(&self, id: &str) -> PathBuf {
        self.inner.logs.join(format!("{id}.log"))
    }

    /// The job's kept log.
    pub(crate) fn logs(&self, id: &str) -> std::result::Result<Vec<u8>, JobError> {
        self.get(id)?;
        Ok(job_log::read_all(&self.log_path(id)).unwrap_or_default())
    }

    /// Stops a job: SIGTERM to its supervisor, which sends SIGTERM to the driver's process
    /// group and SIGKILL after the grace period. Returns false when the job had already ended.
    pub(crate) async fn stop(&self, id: &str) -> std::result::Result<bool, JobError> {
        let record = self.get(id)?;
        if record.status.is_terminal() {
            return Ok(false);
        }
        self.inner
            .stopping
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string());
        // Read again after marking the stop: a supervisor recorded before this read gets
        // the signal here; one recorded after it sees the mark in `run` and is signalled there.
        let record = self.get(id)?;
        let Some(supervisor) = record.supervisor else {
            // Not started: the job's task sees the stop before it starts a supervisor.
            self.update(id, |r| r.stopped_before_start(now_ms()));
            return Ok(true);
        };
        job_shim::signal_process(&supervisor, "TERM");
        let mut changes = self.subscribe();
        let deadline = tokio::time::Instant::now() + self.inner.config.stop_grace + Duration::from_secs(5);
        while !self.get(id)?.status.is_terminal() {
            if tokio::time::timeout_at(deadline, changes.changed()).await.is_err() {
                // The supervisor did not finish the stop: end both, checking who they are.
                tracing::warn!(
                    job = id,
                    "the job's supervisor did not stop the driver in time; killing both"
                );
                job_shim::signal_process(&supervisor, "KILL");
                if let Some(driver) = self.get(id)?.driver {
                    job_shim::signal_group_of(&driver, "KILL");
                }
                self.update(id, |r| r.exited(None, true, now_ms()));
                break;
            }
        }
        Ok(true)
    }

    /// Stops every running job at once; returns when they all ended or after the grace
    /// period (their supervisors finish the stops without this head).
    pub(crate) async fn stop_all(&self) {
        let running: Vec<String> = self
            .records()
            .values()
            .filter(|r| !r.status.is_terminal())
            .map(|r| r.submission_id.clone())
            .collect();
        if running.is_empty() {
            return;
        }
        tracing::info!(jobs = running.len(), "stopping the running jobs");
        let stops = running.iter().map(|id| self.stop(id));
        let _ = tokio::time::timeout(self.inner.config.stop_grace, futures::future::join_all(stops)).await;
    }

    /// Publishes the count of jobs in each state.
    pub(crate) fn publish_metrics(&self) {
        let mut counts: BTreeMap<JobStatus, i64> = BTreeMap::new();
        for record in self.records().values() {
            *counts.entry(record.status).or_insert(0) += 1;
        }
        let gauge = &crate::metrics::metrics().jobs;
        for state in [
            JobStatus::Pending,
            JobStatus::Running,
            JobStatus::Succeeded,
            JobStatus::Failed,
            JobStatus::Stopped,
        ] {
            gauge
                .with_label_values(&[&state.to_string()])
                .set(counts.get(&state).copied().unwrap_or(0));
        }
    }

    /// Deletes a finished job's record and logs.
    pub(crate) fn delete(&self, id: &str) -> std::result::Result<(), JobError> {
        let record = self.get(id)?;
        if !record.status.is_terminal() {
            return Err(JobError::Invalid(format!(
                "job '{id}' is {}; stop it before deleting it",
                record.status
            )));
        }
        self.records().remove(id);
        self.inner
            .store
            .remove(id)
            .map_err(|e| JobError::Internal(e.to_string()))?;
        let path = self.log_path(id);
        let _ = std::fs::remove_file(job_log::rotated(&path));
        let _ = std::fs::remove_file(path);
        RunFiles::new(&self.inner.run, id).remove();
        Ok(())
    }

    fn is_stopping(&self, id: &str) -> bool {
        self.inner
            .stopping
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }

    /// The whole life of one job.
    async fn run(self, id: String, submission: JobSubmission) {
        let group = match self.reserve(&id, &submission).await {
            Ok(group) => group,
            Err(message) => {
                self.update(&id, |r| r.failed(error_type::START, message, now_ms()));
                self.cleanup(&id, None).await;
                return;
            }
        };
        if self.is_stopping(&id) {
            self.cleanup(&id, group).await;
            return;
        }
        match self.start_supervisor(&id, &submission) {
            Ok(supervisor) => {
                if self.is_stopping(&id) {
                    job_shim::signal_process(&supervisor, "TERM");
                }
                self.follow(&id, supervisor).await;
            }
            Err(message) => self.update(&id, |r| r.failed(error_type::START, message, now_ms())),
        }
        self.cleanup(&id, group).await;
    }

    /// Reserves the driver's resources as a one-bundle placement group, waiting while the
    /// cluster is busy; fails at once when no node could ever hold them.
    async fn reserve(&self, id: &str, submission: &JobSubmission) -> std::result::Result<Option<GroupId>, String> {
        let text = submission.resources_text();
        if text.is_empty() {
            return Ok(None);
        }
        let bundle = Resources::parse_request(&text).map_err(|e| e.to_string())?;
        let spec = GroupSpec {
            bundles: vec![bundle],
            strategy: Strategy::Pack,
            name: Some(format!("job {id} driver")),
        };
        let group: GroupId = self
            .inner
            .link
            .ask(&HeadRequest::CreateGroup(spec), Duration::from_secs(30))
            .await
            .map_err(|e| format!("the driver's resources {text} cannot be reserved: {e}"))?;
        self.update(id, |r| {
            r.message = format!("waiting for the driver's resources {text}");
            r.driver_group = Some(group);
        });
        loop {
            if self.is_stopping(id) {
                return Ok(Some(group));
            }
            let ready = self
                .inner
                .link
                .ask::<Vec<String>>(&HeadRequest::WaitGroup(group), Duration::from_secs(1))
                .await;
            match ready {
                Ok(_) => return Ok(Some(group)),
                Err(Error::Timeout { .. }) => continue,
                Err(e) => return Err(format!("reserving the driver's resources failed: {e}")),
            }
        }
    }

    /// Starts the job's supervisor (`regatta job-shim`) in a process group of its own, with
    /// the driver's environment, and records who it is.
    fn start_supervisor(&self, id: &str, submission: &JobSubmission) -> std::result::Result<ProcessIdentity, String> {
        let config = &self.inner.config;
        let binary = config
            .supervisor_binary
            .clone()
            .ok_or("cannot find the regatta binary that supervises drivers (JobConfig::supervisor_binary)")?;
        let files = RunFiles::new(&self.inner.run, id);
        files.remove();
        let messages = std::fs::File::create(&files.messages)
            .map_err(|e| format!("cannot create {}: {e}", files.messages.display()))?;
        let mut command = Command::new(&binary);
        command
            .arg("job-shim")
            .arg("--job")
            .arg(id)
            .arg("--run-dir")
            .arg(&self.inner.run)
            .arg("--log")
            .arg(self.log_path(id))
            .arg("--log-cap-bytes")
            .arg(config.log_cap_bytes.to_string())
            .arg("--stop-grace-ms")
            .arg(config.stop_grace.as_millis().to_string());
        let (working_dir, python_path) = self.package_dirs(submission)?;
        if let Some(dir) = &working_dir {
            command.arg("--working-dir").arg(dir);
        }
        if let Some(path) = python_path {
            command.env("PYTHONPATH", path);
        }
        command
            .arg("--")
            .arg(&submission.entrypoint)
            .envs(&submission.runtime_env.env_vars)
            .env(ADDRESS_ENV, &self.inner.cluster_address)
            .env(crate::token::TOKEN_ENV, &self.inner.token)
            .env(JOB_ID_ENV, id)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(messages)
            .process_group(0)
            .kill_on_drop(false);
        let mut child = command
            .spawn()
            .map_err(|e| format!("could not start the job supervisor {}: {e}", binary.display()))?;
        let pid = child.id().unwrap_or(0);
        // Reaps the supervisor when it ends; a restarted head follows it by its identity.
        tokio::spawn(async move { child.wait().await });
        let supervisor = job_shim::identity_of(pid).ok_or_else(|| {
            format!(
                "the job supervisor (pid {pid}) ended at once: {}",
                tail_of(&RunFiles::new(&self.inner.run, id).messages)
            )
        })?;
        self.update(id, |r| {
            r.supervisor = Some(supervisor.clone());
            r.message = "starting the driver".into();
        });
        tracing::info!(job = id, supervisor = pid, "job supervisor started");
        Ok(supervisor)
    }

    /// Deletes the packages no unfinished job names, once unused for their grace period.
    pub(crate) fn sweep_packages(&self) {
        let referenced = self
            .records()
            .values()
            .filter(|r| !r.status.is_terminal())
            .flat_map(|r| r.runtime_env.packages().into_iter().map(str::to_string).collect::<Vec<_>>())
            .collect();
        self.inner.packages.sweep(&referenced);
    }

    /// The driver's working directory and `PYTHONPATH` with its packages unpacked: the
    /// `working_dir` package's folder is where it starts and heads `PYTHONPATH`, each
    /// `py_modules` package's folder follows (as Ray does), then the inherited path.
    fn package_dirs(&self, submission: &JobSubmission) -> std::result::Result<(Option<PathBuf>, Option<std::ffi::OsString>), String> {
        let env = &submission.runtime_env;
        let unpack = |name: &str| {
            self.inner.packages.unpacked_dir(name).map_err(|e| match e {
                JobError::Invalid(m) | JobError::Unknown(m) | JobError::TooLarge(m) | JobError::Internal(m) => {
                    format!("cannot prepare the package gcs://{name}: {m}")
                }
            })
        };
        let mut path = Vec::new();
        let working_dir = match env.working_dir_package() {
            Some(name) => {
                let dir = unpack(name)?;
                path.push(dir.clone());
                Some(dir)
            }
            None => env.working_dir.as_ref().map(PathBuf::from),
        };
        for module in env.py_modules.iter().filter_map(|m| m.strip_prefix(crate::job::PACKAGE_SCHEME)) {
            path.push(unpack(module)?);
        }
        if path.is_empty() {
            return Ok((working_dir, None));
        }
        let inherited = env
            .env_vars
            .get("PYTHONPATH")
            .map(std::ffi::OsString::from)
            .or_else(|| std::env::var_os("PYTHONPATH"));
        path.extend(inherited.iter().flat_map(std::env::split_paths));
        let joined = std::env::join_paths(path).map_err(|e| format!("cannot build the driver's PYTHONPATH: {e}"))?;
        Ok((working_dir, Some(joined)))
    }

    /// Follows a job through its supervisor's files until the job ends: the driver's
    /// identity when it starts, the log as it grows, the outcome when it ends.
    async fn follow(&self, id: &str, supervisor: ProcessIdentity) {
        let files = RunFiles::new(&self.inner.run, id);
        let log = self.log_path(id);
        let mut seen_log = None;
        let node_address = host_of(&self.inner.cluster_address).to_string();
        loop {
            let log_size = [log.clone(), job_log::rotated(&log)].map(|p| std::fs::metadata(p).map(|m| m.len()).ok());
            if seen_log != Some(log_size) {
                seen_log = Some(log_size);
                self.inner.changes.send_modify(|n| *n += 1);
            }
            if self.get(id).is_ok_and(|r| r.driver.is_none()) {
                if let Some(driver) = job_shim::read_json::<ProcessIdentity>(&files.driver) {
                    let pid = driver.pid;
                    self.update(id, |r| {
                        r.started(pid, &node_address, now_ms());
                        r.driver = Some(driver);
                    });
                    tracing::info!(job = id, pid, "driver started");
                }
            }
            if let Some(outcome) = job_shim::read_json::<ShimOutcome>(&files.status) {
                self.record_outcome(id, outcome);
                break;
            }
            if !job_shim::is_alive(&supervisor) {
                // It writes the outcome before it exits: look once more.
                match job_shim::read_json::<ShimOutcome>(&files.status) {
                    Some(outcome) => self.record_outcome(id, outcome),
                    None => {
                        // Its driver must not run on untracked, with the cluster token.
                        if let Some(driver) = self.get(id).ok().and_then(|r| r.driver) {
                            job_shim::signal_group_of(&driver, "KILL");
                        }
                        let stopping = self.is_stopping(id);
                        let why = format!(
                            "the job's supervisor (pid {}) ended without recording how the driver ended: {}",
                            supervisor.pid,
                            tail_of(&files.messages)
                        );
                        self.update(id, |r| {
                            if stopping {
                                r.exited(None, true, now_ms());
                            } else {
                                r.failed(error_type::SUPERVISOR, why, now_ms());
                            }
                        });
                    }
                }
                break;
            }
            tokio::time::sleep(FOLLOW_EVERY).await;
        }
        self.inner.changes.send_modify(|n| *n += 1);
        tracing::info!(job = id, status = %self.get(id).map(|r| r.status).unwrap_or(JobStatus::Failed), "job ended");
    }

    fn record_outcome(&self, id: &str, outcome: ShimOutcome) {
        let stopping = outcome.stopped || self.is_stopping(id);
        self.update(id, |r| match outcome.error {
            Some(error) if !stopping => r.failed(error_type::START, error, now_ms()),
            _ => {
                r.exited(outcome.code, stopping, now_ms());
                if let (Some(signal), false) = (outcome.signal, stopping) {
                    r.message = format!("driver was killed by signal {signal}");
                }
            }
        });
    }

    /// Kills the job's actors, frees its objects and its driver reservation.
    async fn cleanup(&self, id: &str, group: Option<GroupId>) {
        if let Some(group) = group {
            let _ = self
                .inner
                .link
                .ask::<()>(&HeadRequest::RemoveGroup(group), Duration::from_secs(30))
                .await;
        }
        if let Err(e) = self
            .inner
            .link
            .ask::<()>(&HeadRequest::EndJob(id.to_string()), Duration::from_secs(30))
            .await
        {
            tracing::warn!(job = id, error = %e, "could not clean up the job's actors and objects");
        }
        self.inner.stopping.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        if let Ok(record) = self.get(id) {
            for package in record.runtime_env.packages() {
                self.inner.packages.touch(package);
            }
        }
        self.sweep_packages();
        if let Ok(record) = self.get(id) {
            let ran_ms = record
                .end_time
                .unwrap_or(0)
                .saturating_sub(record.start_time.or(record.end_time).unwrap_or(0));
            crate::metrics::metrics()
                .job_seconds
                .with_label_values(&[&record.status.to_string()])
                .observe(ran_ms as f64 / 1000.0);
        }
        self.inner.changes.send_modify(|n| *n += 1);
    }
}

/// The host of a `host:port` address (`[v6]:port` too).
fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// The last lines of a supervisor's messages, for an error that says why.
fn tail_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.len() {
        0 => format!("it left no message in {}", path.display()),
        n => lines[n.saturating_sub(5)..].join(" | "),
    }
}
