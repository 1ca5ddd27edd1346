//! The head's job manager: runs each job's driver on the head with the cluster's address
//! and token in its environment, under a supervisor process of its own
//! ([`super::job_shim`]) that keeps the driver's output in a capped log and records how it
//! ended. The manager records every state change on disk, follows the supervisor's files,
//! and cleans up the job's actors and objects when the job ends or is stopped. A restarted
//! head finds running jobs again from their records and their supervisors' files.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::calls::CallPlane;
use crate::client::{ActorHandle, ActorOptions, Cluster};
use crate::error::{Error, Result};
use crate::headlink::HeadLink;
use crate::https::ApiTls;
use crate::job::JOB_ID_ENV;
use crate::job::{
    error_type, finished_beyond, JobRecord, JobStatus, JobSubmission, ProcessIdentity, MAX_FINISHED_JOBS,
};
use crate::job_log;
use crate::job_packages::PackageStore;
use crate::job_shim::{self, tail_of, RunFiles, ShimArgs, ShimOutcome};
use crate::job_store::JobStore;
use crate::placement::Strategy;
use crate::protocol::{GroupId, GroupSpec, HeadRequest};
use crate::resources::Resources;
use crate::worker::job_driver::{DriverArgs, DriverReply, DriverRequest, JobDriver};

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
#[derive(Debug, thiserror::Error)]
pub(crate) enum JobError {
    /// 400.
    #[error("{0}")]
    Invalid(String),
    /// 404.
    #[error("{0}")]
    Unknown(String),
    /// 413.
    #[error("{0}")]
    TooLarge(String),
    /// 500.
    #[error("{0}")]
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

/// How often a driver on a worker is asked for its progress.
const REMOTE_POLL_EVERY: Duration = Duration::from_millis(200);

/// Bytes of a package per call to a driver's node.
const PACKAGE_CHUNK: usize = 4 << 20;

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
                    let why = match &record.driver_node_id {
                        // Its actor is stopped with the job's other actors below.
                        Some(node) => format!(
                            "the head restarted while the driver ran on node {node}; drivers on workers are not followed across a head restart: submit the job again"
                        ),
                        None => "the head restarted before the driver started; submit the job again".into(),
                    };
                    self.update(&id, |r| r.failed(error_type::SUPERVISOR, why, now_ms()));
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
        submission.validate().map_err(|e| JobError::Invalid(e.to_string()))?;
        for package in submission.runtime_env.packages() {
            if !self.inner.packages.exists(package) {
                return Err(JobError::Invalid(format!(
                    "runtime_env names the package gcs://{package}, which was not uploaded (or was deleted): upload it with PUT /api/packages/gcs/{package}"
                )));
            }
            self.inner.packages.touch(package);
        }
        if let Some(dir) = submission.runtime_env.working_dir_path() {
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
        if let Some(group) = group {
            self.run_remote(&id, &submission, group).await;
            self.cleanup(&id, Some(group)).await;
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

    /// Runs a job whose entrypoint asks for resources on the node that holds them: a
    /// [`JobDriver`] actor placed in the reserved bundle runs the driver there, and this
    /// copies its log into the job's log as it grows. A lost node or driver fails the job
    /// with the cause.
    async fn run_remote(&self, id: &str, submission: &JobSubmission, group: GroupId) {
        if let Err((kind, message)) = self.drive_remote(id, submission, group).await {
            let stopping = self.is_stopping(id);
            self.update(id, |r| {
                if stopping {
                    r.exited(None, true, now_ms());
                } else {
                    r.failed(kind, message, now_ms());
                }
            });
        }
    }

    async fn drive_remote(
        &self,
        id: &str,
        submission: &JobSubmission,
        group: GroupId,
    ) -> std::result::Result<(), (&'static str, String)> {
        let config = &self.inner.config;
        let cluster =
            Cluster::new(self.inner.link.clone(), None, CallPlane::session_only()).with_job(Some(id.to_string()));
        let start = |message: String| (error_type::START, message);
        let text = submission.resources_text();
        let resources = Resources::parse_request(&text).map_err(|e| start(e.to_string()))?;
        let env = driver_env(submission, &self.inner.cluster_address, &self.inner.token, id);
        let env = env
            .into_iter()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
            .collect();
        let args = DriverArgs {
            job: id.to_string(),
            entrypoint: submission.entrypoint.clone(),
            env,
            working_dir: submission.runtime_env.working_dir_path().map(str::to_string),
            log_cap_bytes: config.log_cap_bytes,
            stop_grace: config.stop_grace,
        };
        let options = ActorOptions::new().resources(resources).in_bundle(group, 0);
        let driver = cluster
            .spawn::<JobDriver>(args, options)
            .await
            .map_err(|e| start(format!("cannot place the driver in its reserved resources {text}: {e}")))?;
        driver
            .wait_ready(Duration::from_secs(60))
            .await
            .map_err(|e| start(format!("the driver's actor did not start: {e}")))?;
        self.update(id, |r| {
            r.message = "sending the job's packages to the driver's node".into()
        });
        for name in submission.runtime_env.packages() {
            self.send_package(&driver, name).await.map_err(start)?;
        }
        if self.is_stopping(id) {
            return Ok(());
        }
        let started = driver
            .call(DriverRequest::Start {
                working_dir: submission.runtime_env.working_dir_package().map(str::to_string),
                py_modules: submission
                    .runtime_env
                    .py_module_packages()
                    .into_iter()
                    .map(str::to_string)
                    .collect(),
            })
            .await
            .map_err(|e| start(format!("the driver could not start: {e}")))?;
        let DriverReply::Started { node, host } = started else {
            return Err(start(format!("the driver's actor answered {started:?} to a start")));
        };
        self.update(id, |r| {
            r.driver_node_id = Some(node.clone());
            r.message = format!("starting the driver on node {node}");
        });
        tracing::info!(job = id, node = %node, "driver starting on a worker");
        let lost = |e: Error| {
            (
                error_type::SUPERVISOR,
                format!("the driver's node {node} or its driver actor was lost: {e}"),
            )
        };
        let log_path = self.log_path(id);
        let mut log = job_log::CappedLog::create(&log_path, config.log_cap_bytes)
            .map_err(|e| start(format!("cannot create {}: {e}", log_path.display())))?;
        let mut offset = 0u64;
        let mut stop_sent = false;
        loop {
            if self.is_stopping(id) && !stop_sent {
                stop_sent = true;
                let _ = driver.call(DriverRequest::Stop).await;
            }
            let progress = driver.call(DriverRequest::Poll { offset }).await.map_err(lost)?;
            let DriverReply::Progress {
                log: bytes,
                next,
                driver: process,
                outcome,
                lost: gone,
            } = progress
            else {
                return Err(start(format!("the driver's actor answered {progress:?} to a poll")));
            };
            offset = next;
            if !bytes.is_empty() {
                log.append(&bytes)
                    .map_err(|e| start(format!("cannot write {}: {e}", log_path.display())))?;
                self.inner.changes.send_modify(|n| *n += 1);
            }
            if let Some(process) = process.filter(|_| self.get(id).is_ok_and(|r| r.status == JobStatus::Pending)) {
                self.update(id, |r| r.started(process.pid, &host, now_ms()));
                tracing::info!(job = id, node = %node, pid = process.pid, "driver started");
            }
            match (outcome, gone) {
                (Some(outcome), _) if bytes.is_empty() => {
                    self.record_outcome(id, outcome);
                    return Ok(());
                }
                (None, Some(why)) => return Err((error_type::SUPERVISOR, why)),
                _ => {}
            }
            if bytes.len() < (1 << 20) {
                tokio::time::sleep(REMOTE_POLL_EVERY).await;
            }
        }
    }

    /// Sends an uploaded package to a driver's node in chunks.
    async fn send_package(&self, driver: &ActorHandle<JobDriver>, name: &str) -> std::result::Result<(), String> {
        use tokio::io::AsyncReadExt;
        let path = self.inner.packages.archive_path(name);
        let mut file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| format!("the package gcs://{name} cannot be read ({}): {e}", path.display()))?;
        let mut first = true;
        loop {
            let mut chunk = Vec::with_capacity(PACKAGE_CHUNK);
            let read = (&mut file)
                .take(PACKAGE_CHUNK as u64)
                .read_to_end(&mut chunk)
                .await
                .map_err(|e| format!("the package gcs://{name} cannot be read: {e}"))?;
            if read == 0 && !first {
                return Ok(());
            }
            first = false;
            driver
                .call(DriverRequest::Package {
                    name: name.to_string(),
                    chunk,
                })
                .await
                .map_err(|e| format!("the package gcs://{name} could not be sent to the driver's node: {e}"))?;
            if read < PACKAGE_CHUNK {
                return Ok(());
            }
        }
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
        let (working_dir, python_path) = self.package_dirs(submission)?;
        let args = ShimArgs {
            job: id.to_string(),
            run_dir: self.inner.run.clone(),
            log: self.log_path(id),
            log_cap_bytes: config.log_cap_bytes,
            stop_grace: config.stop_grace,
            working_dir,
            entrypoint: submission.entrypoint.clone(),
            parent: None,
        };
        let mut env = driver_env(submission, &self.inner.cluster_address, &self.inner.token, id);
        env.extend(python_path.map(|path| ("PYTHONPATH".into(), path)));
        let supervisor = job_shim::start_supervisor(&binary, &args, &env)?;
        let pid = supervisor.pid;
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
            .flat_map(|r| {
                r.runtime_env
                    .packages()
                    .into_iter()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect();
        self.inner.packages.sweep(&referenced);
    }

    /// The driver's working directory and `PYTHONPATH`, its packages unpacked in this
    /// head's package store ([`crate::job_packages::driver_dirs`]).
    fn package_dirs(
        &self,
        submission: &JobSubmission,
    ) -> std::result::Result<(Option<PathBuf>, Option<std::ffi::OsString>), String> {
        let env = &submission.runtime_env;
        let inherited = env
            .env_vars
            .get("PYTHONPATH")
            .map(std::ffi::OsString::from)
            .or_else(|| std::env::var_os("PYTHONPATH"));
        crate::job_packages::driver_dirs(env, inherited, |name| {
            self.inner
                .packages
                .unpacked_dir(name)
                .map_err(|e| format!("cannot prepare the package gcs://{name}: {e}"))
        })
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
        let record = self.get(id);
        for package in record.iter().flat_map(|r| r.runtime_env.packages()) {
            self.inner.packages.touch(package);
        }
        self.sweep_packages();
        if let Ok(record) = record {
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

/// A driver's environment beyond the inherited one: the job's variables, then the
/// cluster's address, token and the job's id (which the job cannot override).
pub(crate) fn driver_env(
    submission: &JobSubmission,
    cluster_address: &str,
    token: &str,
    id: &str,
) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    let mut env: Vec<(std::ffi::OsString, std::ffi::OsString)> = submission
        .runtime_env
        .env_vars
        .iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    env.push((ADDRESS_ENV.into(), cluster_address.into()));
    env.push((crate::token::TOKEN_ENV.into(), token.into()));
    env.push((JOB_ID_ENV.into(), id.into()));
    env
}
