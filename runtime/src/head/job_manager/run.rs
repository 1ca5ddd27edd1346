//! One job's life on the head: its driver's reservation, its supervisor, following it
//! through the supervisor's files, and the cleanup when it ends.

use std::path::PathBuf;
use std::time::Duration;

use regatta_proto::Resources;
use regatta_proto::Strategy;
use regatta_proto::{job_error_type as error_type, JobStatus, JobSubmission, ProcessIdentity};
use regatta_proto::{GroupId, GroupSpec, HeadRequest};

use super::{host_of, now_ms, DriverError, JobManager, FOLLOW_EVERY};
use crate::error::Error;
use crate::jobs::log;
use crate::jobs::packages;
use crate::jobs::shim::{self, tail_of, RunFiles, ShimArgs, ShimOutcome, StartError};

impl JobManager {
    /// The whole life of one job.
    pub(super) async fn run(self, id: String, submission: JobSubmission) {
        let group = match self.reserve(&id, &submission).await {
            Ok(group) => group,
            Err(error) => {
                self.update(&id, |r| r.failed(error.error_type(), error.to_string(), now_ms()));
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
                    shim::signal_process(&supervisor, "TERM");
                }
                self.follow(&id, supervisor).await;
            }
            Err(error) => self.update(&id, |r| r.failed(error.error_type(), error.to_string(), now_ms())),
        }
        self.cleanup(&id, group).await;
    }

    /// Reserves the driver's resources as a one-bundle placement group, waiting while the
    /// cluster is busy; fails at once when no node could ever hold them.
    async fn reserve(&self, id: &str, submission: &JobSubmission) -> Result<Option<GroupId>, DriverError> {
        let text = submission.resources_text();
        if text.is_empty() {
            return Ok(None);
        }
        let bundle = Resources::parse_request(&text).map_err(DriverError::Resources)?;
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
            .map_err(|cause| DriverError::Reserve {
                resources: text.clone(),
                cause,
            })?;
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
                Err(e) => return Err(DriverError::Reserving(e)),
            }
        }
    }

    /// Starts the job's supervisor (`regatta job-shim`) in a process group of its own, with
    /// the driver's environment, and records who it is.
    fn start_supervisor(&self, id: &str, submission: &JobSubmission) -> Result<ProcessIdentity, DriverError> {
        let config = &self.inner.config;
        let binary = config
            .supervisor_binary
            .clone()
            .ok_or(DriverError::NoSupervisorBinary)?;
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
        let mut env = self.env_for(submission, id).map_err(DriverError::Credentials)?;
        env.extend(python_path.map(|path| ("PYTHONPATH".into(), path)));
        let supervisor = shim::start_supervisor(&binary, &args, &env)?;
        let pid = supervisor.pid;
        self.update(id, |r| {
            r.supervisor = Some(supervisor.clone());
            r.message = "starting the driver".into();
        });
        tracing::info!(job = id, supervisor = pid, "job supervisor started");
        Ok(supervisor)
    }

    /// The driver's working directory and `PYTHONPATH`, its packages unpacked in this
    /// head's package store ([`crate::jobs::packages::driver_dirs`]).
    fn package_dirs(
        &self,
        submission: &JobSubmission,
    ) -> Result<(Option<PathBuf>, Option<std::ffi::OsString>), StartError> {
        let env = &submission.runtime_env;
        let inherited = env
            .env_vars
            .get("PYTHONPATH")
            .map(std::ffi::OsString::from)
            .or_else(|| std::env::var_os("PYTHONPATH"));
        packages::driver_dirs(env, inherited, |name| {
            self.inner
                .packages
                .unpacked_dir(name)
                .map_err(|cause| StartError::Package {
                    name: name.to_string(),
                    cause: Box::new(cause),
                })
        })
    }

    /// Follows a job through its supervisor's files until the job ends: the driver's
    /// identity when it starts, the log as it grows, the outcome when it ends.
    pub(super) async fn follow(&self, id: &str, supervisor: ProcessIdentity) {
        let files = RunFiles::new(&self.inner.run, id);
        let log = self.log_path(id);
        let mut seen_log = None;
        let node_address = host_of(&self.inner.cluster_address).to_string();
        loop {
            let log_size = [log.clone(), log::rotated(&log)].map(|p| std::fs::metadata(p).map(|m| m.len()).ok());
            if seen_log != Some(log_size) {
                seen_log = Some(log_size);
                self.inner.changes.send_modify(|n| *n += 1);
            }
            if self.get(id).is_ok_and(|r| r.driver.is_none()) {
                if let Some(driver) = shim::read_json::<ProcessIdentity>(&files.driver) {
                    let pid = driver.pid;
                    self.update(id, |r| {
                        r.started(pid, &node_address, now_ms());
                        r.driver = Some(driver);
                    });
                    tracing::info!(job = id, pid, "driver started");
                }
            }
            if let Some(outcome) = shim::read_json::<ShimOutcome>(&files.status) {
                self.record_outcome(id, outcome);
                break;
            }
            if !shim::is_alive(&supervisor) {
                // It writes the outcome before it exits: look once more.
                match shim::read_json::<ShimOutcome>(&files.status) {
                    Some(outcome) => self.record_outcome(id, outcome),
                    None => {
                        // Its driver must not run on untracked, with the cluster token.
                        if let Some(driver) = self.get(id).ok().and_then(|r| r.driver) {
                            shim::signal_group_of(&driver, "KILL");
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

    pub(super) fn record_outcome(&self, id: &str, outcome: ShimOutcome) {
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
    pub(super) async fn cleanup(&self, id: &str, group: Option<GroupId>) {
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
