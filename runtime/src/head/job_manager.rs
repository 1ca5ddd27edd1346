//! The head's job manager: runs each job's driver as a process group on the head with the
//! cluster's address and token in its environment, captures its output into a capped log,
//! records every state change on disk, and cleans up the job's actors and objects when it
//! ends or is stopped.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::AsyncReadExt;
use tokio::process::Command;
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::headlink::HeadLink;
use crate::https::ApiTls;
use crate::job::JOB_ID_ENV;
use crate::job::{finished_beyond, JobRecord, JobStatus, JobSubmission, MAX_FINISHED_JOBS};
use crate::job_log::{self, CappedLog};
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
    /// HTTP port of the job API (0: any).
    pub http_port: u16,
    /// HTTPS (by default with the token's certificate) or plain HTTP.
    pub tls: ApiTls,
}

impl JobConfig {
    /// Defaults: `~/.regatta/head`, 64 MiB logs, 3 s grace, port 8265.
    pub fn new() -> Self {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."));
        Self {
            state_dir: home.join(".regatta").join("head"),
            log_cap_bytes: 64 << 20,
            stop_grace: Duration::from_secs(3),
            http_port: 8265,
            tls: ApiTls::Token,
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
    /// 409.
    Conflict(String),
    /// 500.
    Internal(String),
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Inner {
    store: JobStore,
    logs: PathBuf,
    records: Mutex<BTreeMap<String, JobRecord>>,
    stopping: Mutex<HashSet<String>>,
    config: JobConfig,
    cluster_address: String,
    token: String,
    link: Arc<HeadLink>,
    changes: watch::Sender<u64>,
}

/// The job manager; cheap to clone.
#[derive(Clone)]
pub(crate) struct JobManager {
    inner: Arc<Inner>,
}

impl JobManager {
    /// Opens the job store; jobs that were running when the head went away are marked
    /// failed and their leftover process groups killed.
    pub(crate) fn open(config: JobConfig, cluster_address: String, token: String, link: Arc<HeadLink>) -> Result<Self> {
        let store = JobStore::open(&config.state_dir.join("jobs"))?;
        let logs = config.state_dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(|e| Error::io(format!("cannot create {}", logs.display()), e))?;
        let mut records = BTreeMap::new();
        for mut record in store.load_all() {
            if !record.status.is_terminal() {
                if let Some(pid) = record.driver_pid {
                    signal_group(pid, "KILL");
                }
                record.failed("the head restarted while this job was running".into(), now_ms());
                store.save(&record)?;
            }
            records.insert(record.submission_id.clone(), record);
        }
        let (changes, _) = watch::channel(0);
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                logs,
                records: Mutex::new(records),
                stopping: Mutex::new(HashSet::new()),
                config,
                cluster_address,
                token,
                link,
                changes,
            }),
        })
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

    /// Accepts a job and starts its driver in the background.
    pub(crate) fn submit(&self, submission: JobSubmission) -> std::result::Result<String, JobError> {
        submission.validate().map_err(JobError::Invalid)?;
        if let Some(dir) = &submission.runtime_env.working_dir {
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
                return Err(JobError::Conflict(format!(
                    "a job with submission_id '{id}' already exists"
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
            .ok_or_else(|| JobError::Unknown(format!("no job with id '{id}'")))
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

    /// Stops a job: SIGTERM to the driver's process group, SIGKILL after the grace period.
    /// Returns false when the job had already ended.
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
        match record.driver_pid {
            None => self.update(id, |r| r.stopped_before_start(now_ms())),
            Some(pid) => {
                signal_group(pid, "TERM");
                let mut changes = self.subscribe();
                let deadline = tokio::time::Instant::now() + self.inner.config.stop_grace;
                while !self.get(id)?.status.is_terminal() {
                    if tokio::time::timeout_at(deadline, changes.changed()).await.is_err() {
                        signal_group(pid, "KILL");
                        break;
                    }
                }
            }
        }
        Ok(true)
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
                self.update(&id, |r| r.failed(message, now_ms()));
                self.cleanup(&id, None).await;
                return;
            }
        };
        if self.is_stopping(&id) {
            self.cleanup(&id, group).await;
            return;
        }
        match self.spawn_driver(&id, &submission) {
            Ok((child, log)) => self.supervise(&id, child, log).await,
            Err(message) => self.update(&id, |r| r.failed(message, now_ms())),
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
        self.update(id, |r| r.message = format!("waiting for the driver's resources {text}"));
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

    fn spawn_driver(
        &self,
        id: &str,
        submission: &JobSubmission,
    ) -> std::result::Result<(tokio::process::Child, CappedLog), String> {
        let log = CappedLog::create(&self.log_path(id), self.inner.config.log_cap_bytes)
            .map_err(|e| format!("cannot create the job log {}: {e}", self.log_path(id).display()))?;
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(&submission.entrypoint)
            .envs(&submission.runtime_env.env_vars)
            .env(ADDRESS_ENV, &self.inner.cluster_address)
            .env(crate::token::TOKEN_ENV, &self.inner.token)
            .env(JOB_ID_ENV, id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        if let Some(dir) = &submission.runtime_env.working_dir {
            command.current_dir(dir);
        }
        let child = command
            .spawn()
            .map_err(|e| format!("could not start the driver: {e}"))?;
        let pid = child.id().unwrap_or(0);
        self.update(id, |r| r.started(pid, now_ms()));
        tracing::info!(job = id, pid, "driver started");
        Ok((child, log))
    }

    /// Copies the driver's output into its log and records how it ended.
    async fn supervise(&self, id: &str, mut child: tokio::process::Child, log: CappedLog) {
        let log = Arc::new(Mutex::new(log));
        let copies = [
            child
                .stdout
                .take()
                .map(|out| tokio::spawn(copy_into(out, log.clone(), self.inner.changes.clone()))),
            child
                .stderr
                .take()
                .map(|err| tokio::spawn(copy_into(err, log.clone(), self.inner.changes.clone()))),
        ];
        let status = child.wait().await;
        for copy in copies.into_iter().flatten() {
            let _ = copy.await;
        }
        let stopping = self.is_stopping(id);
        match status {
            Ok(status) => self.update(id, |r| r.exited(status.code(), stopping, now_ms())),
            Err(e) => self.update(id, |r| r.failed(format!("lost track of the driver: {e}"), now_ms())),
        }
        if let Some(pid) = self.get(id).ok().and_then(|r| r.driver_pid) {
            if stopping {
                signal_group(pid, "KILL");
            }
        }
        tracing::info!(job = id, status = %self.get(id).map(|r| r.status).unwrap_or(JobStatus::Failed), "job ended");
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

async fn copy_into(
    mut from: impl tokio::io::AsyncRead + Unpin,
    log: Arc<Mutex<CappedLog>>,
    changes: watch::Sender<u64>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if let Ok(mut log) = log.lock() {
                    if let Err(e) = log.append(&buffer[..n]) {
                        tracing::warn!(error = %e, "could not write a job log");
                    }
                }
                changes.send_modify(|c| *c += 1);
            }
        }
    }
}

/// Sends a signal to a whole process group (`kill -SIG -- -PGID`).
fn signal_group(pgid: u32, signal: &str) {
    if pgid <= 1 {
        return;
    }
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}
