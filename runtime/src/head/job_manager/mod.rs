//! The head's job manager: runs each job's driver on the head with the cluster's address
//! and token in its environment, under a supervisor process of its own
//! ([`super::shim`]) that keeps the driver's output in a capped log and records how it
//! ended. The manager records every state change on disk, follows the supervisor's files,
//! and cleans up the job's actors and objects when the job ends or is stopped. A restarted
//! head finds running jobs again from their records and their supervisors' files.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use regatta_proto::Resources;
use regatta_proto::{
    finished_beyond, job_error_type as error_type, JobRecord, JobStatus, JobSubmission, JOB_ID_ENV, MAX_FINISHED_JOBS,
};
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::head::job_store::JobStore;
use crate::jobs::log;
use crate::jobs::packages::PackageStore;
use crate::jobs::shim::{self, RunFiles, StartError};
use crate::jobs::JobError;
use crate::net::headlink::HeadLink;
use crate::net::https::ApiTls;

mod remote;
mod run;

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
    /// Address the job API listens on (default: the head's `bind`).
    pub http_bind: Option<std::net::IpAddr>,
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
            max_package_bytes: crate::jobs::packages::MAX_PACKAGE_BYTES,
            http_port: 8265,
            http_bind: None,
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

/// Why a job's driver did not start, or was lost once it ran; the job's record says which
/// ([`DriverError::error_type`]) and why.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DriverError {
    /// `JobConfig::supervisor_binary` is unset and the running binary was not found.
    #[error("cannot find the regatta binary that supervises drivers (JobConfig::supervisor_binary)")]
    NoSupervisorBinary,
    /// The supervisor (or its packages) could not be started on the head.
    #[error(transparent)]
    Supervisor(#[from] StartError),
    /// The entrypoint's resources do not parse.
    #[error(transparent)]
    Resources(regatta_proto::Error),
    /// The driver's join token could not be made (or kept).
    #[error("cannot make the driver's join token: {0}")]
    Credentials(Error),
    /// The head refused the driver's reservation.
    #[error("the driver's resources {resources} cannot be reserved: {cause}")]
    Reserve { resources: String, cause: Error },
    /// Waiting for the reservation failed.
    #[error("reserving the driver's resources failed: {0}")]
    Reserving(Error),
    /// The driver's actor could not be placed in the reservation.
    #[error("cannot place the driver in its reserved resources {resources}: {cause}")]
    Place { resources: String, cause: Error },
    /// The driver's actor was placed but did not start.
    #[error("the driver's actor did not start: {0}")]
    NotReady(Error),
    /// An uploaded package could not be read on the head.
    #[error("the package gcs://{name} cannot be read ({}): {cause}", path.display())]
    PackageRead {
        name: String,
        path: PathBuf,
        cause: std::io::Error,
    },
    /// A package could not be handed to the driver's node.
    #[error("the package gcs://{name} could not be sent to the driver's node: {cause}")]
    PackageSend { name: String, cause: Error },
    /// The driver's actor could not start the driver.
    #[error("the driver could not start: {0}")]
    Start(Error),
    /// The driver's actor answered something else than the request asks for.
    #[error("the driver's actor answered {reply} to {request}")]
    Unexpected { request: &'static str, reply: String },
    /// The job's log on the head could not be created.
    #[error("cannot create {}: {cause}", path.display())]
    LogCreate { path: PathBuf, cause: std::io::Error },
    /// The job's log on the head could not be written.
    #[error("cannot write {}: {cause}", path.display())]
    LogWrite { path: PathBuf, cause: std::io::Error },
    /// The driver's node or its actor stopped answering.
    #[error("the driver's node {node} or its driver actor was lost: {cause}")]
    Lost { node: String, cause: Error },
    /// The driver's supervisor on its node ended without recording an outcome: the node's
    /// account of it.
    #[error("{0}")]
    SupervisorGone(String),
}

impl DriverError {
    /// The record's `error_type`: the driver did not start, or it was lost while it ran.
    pub(crate) fn error_type(&self) -> &'static str {
        match self {
            Self::Lost { .. } | Self::SupervisorGone(_) => error_type::SUPERVISOR,
            _ => error_type::START,
        }
    }
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
    /// The join tokens: each job's driver gets one of its own, revoked when the job ends.
    desk: Arc<regatta_net::JoinDesk>,
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
    pub(crate) fn open(
        config: JobConfig,
        cluster_address: String,
        desk: Arc<regatta_net::JoinDesk>,
        link: Arc<HeadLink>,
    ) -> Result<Self> {
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
        let session_name = format!("regatta_{}", crate::net::node::random_hex(6));
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                logs,
                run,
                records: Mutex::new(records),
                stopping: Mutex::new(HashSet::new()),
                config,
                cluster_address,
                desk,
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

    /// Applies a change to a record, persists it and wakes followers; a job that ended
    /// loses its join token.
    fn update(&self, id: &str, change: impl FnOnce(&mut JobRecord)) {
        let saved = {
            let mut records = self.records();
            let Some(record) = records.get_mut(id) else { return };
            change(record);
            if record.status.is_terminal() {
                // Before anyone can see the job ended: its token is dead by then.
                self.revoke_job_token(id);
            }
            record.clone()
        };
        if let Err(e) = self.inner.store.save(&saved) {
            tracing::error!(job = id, error = %e, "could not persist a job record");
        }
        self.inner.changes.send_modify(|n| *n += 1);
    }

    /// A new join token for job `id`'s driver (no expiry: it is revoked when the job ends).
    fn job_token(&self, id: &str) -> Result<String> {
        let token = regatta_net::JoinToken::generate();
        let mut tokens = self.inner.desk.tokens.lock().unwrap_or_else(|p| p.into_inner());
        tokens.insert(&token, None, None, &job_token_description(id));
        if let Err(e) = self.inner.desk.save(&tokens) {
            tokens.revoke(&token.id);
            return Err(e.into());
        }
        Ok(token.to_string())
    }

    /// Revokes job `id`'s join tokens (its driver's process may keep its certificate; no
    /// new process joins with them).
    fn revoke_job_token(&self, id: &str) {
        let description = job_token_description(id);
        let mut tokens = self.inner.desk.tokens.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<String> = tokens
            .list()
            .filter(|(_, entry)| entry.description == description)
            .map(|(token, _)| token.to_string())
            .collect();
        if ids.is_empty() {
            return;
        }
        for token in &ids {
            tokens.revoke(token);
        }
        match self.inner.desk.save(&tokens) {
            Ok(()) => tracing::info!(job = id, "revoked the job's join token"),
            Err(e) => {
                tracing::error!(job = id, error = %e, "revoked the job's join token until the head restarts, but could not keep that")
            }
        }
    }

    /// The driver's environment: [`driver_env`] with a join token of the job's own.
    fn env_for(&self, submission: &JobSubmission, id: &str) -> Result<Vec<(std::ffi::OsString, std::ffi::OsString)>> {
        let token = self.job_token(id)?;
        let mut env = driver_env(submission, &self.inner.cluster_address, &token, id);
        env.push((
            crate::net::trust::CA_HASH_ENV.into(),
            self.inner.desk.issuing_hash().to_string().into(),
        ));
        Ok(env)
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
            .unwrap_or_else(|| format!("job-{}", crate::net::node::random_hex(6)));
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
        Ok(log::read_all(&self.log_path(id)).unwrap_or_default())
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
        shim::signal_process(&supervisor, "TERM");
        let mut changes = self.subscribe();
        let deadline = tokio::time::Instant::now() + self.inner.config.stop_grace + Duration::from_secs(5);
        while !self.get(id)?.status.is_terminal() {
            if tokio::time::timeout_at(deadline, changes.changed()).await.is_err() {
                // The supervisor did not finish the stop: end both, checking who they are.
                tracing::warn!(
                    job = id,
                    "the job's supervisor did not stop the driver in time; killing both"
                );
                shim::signal_process(&supervisor, "KILL");
                if let Some(driver) = self.get(id)?.driver {
                    shim::signal_group_of(&driver, "KILL");
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
        let _ = std::fs::remove_file(log::rotated(&path));
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
}

/// The host of a `host:port` address (`[v6]:port` too).
fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// What a job's join token is listed as.
fn job_token_description(id: &str) -> String {
    format!("job {id}'s driver")
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
    env.push((crate::net::token::TOKEN_ENV.into(), token.into()));
    env.push((JOB_ID_ENV.into(), id.into()));
    env
}
