//! A job whose entrypoint asks for resources runs its driver on the node that holds them:
//! a [`JobDriver`] actor placed in the reserved bundle starts the driver there under its
//! own supervisor, and the head copies the driver's log into the job's log as it grows.

use std::time::Duration;

use regatta_proto::GroupId;
use regatta_proto::Resources;
use regatta_proto::{JobStatus, JobSubmission};

use super::{now_ms, DriverError, JobManager, PACKAGE_CHUNK, REMOTE_POLL_EVERY};
use crate::client::{ActorHandle, ActorOptions, Cluster};
use crate::jobs::driver::{DriverArgs, DriverReply, DriverRequest, JobDriver};
use crate::jobs::log::CappedLog;
use crate::net::calls::CallPlane;

/// Where a driver on a worker runs: its node's name and address.
struct Placed {
    node: String,
    host: String,
}

impl JobManager {
    /// Runs a job through a [`JobDriver`] actor in its reserved bundle `group`. A lost node
    /// or driver fails the job with the cause.
    pub(super) async fn run_remote(&self, id: &str, submission: &JobSubmission, group: GroupId) {
        if let Err(error) = self.drive_remote(id, submission, group).await {
            let stopping = self.is_stopping(id);
            self.update(id, |r| {
                if stopping {
                    r.exited(None, true, now_ms());
                } else {
                    r.failed(error.error_type(), error.to_string(), now_ms());
                }
            });
        }
    }

    /// Places the driver's actor, hands it the job's packages, starts the driver and
    /// copies its log until it ends.
    async fn drive_remote(&self, id: &str, submission: &JobSubmission, group: GroupId) -> Result<(), DriverError> {
        let driver = self.place_driver(id, submission, group).await?;
        self.update(id, |r| {
            r.message = "sending the job's packages to the driver's node".into()
        });
        for name in submission.runtime_env.packages() {
            self.send_package(&driver, name).await?;
        }
        if self.is_stopping(id) {
            return Ok(());
        }
        let placed = start_driver(&driver, submission).await?;
        self.update(id, |r| {
            r.driver_node_id = Some(placed.node.clone());
            r.message = format!("starting the driver on node {}", placed.node);
        });
        tracing::info!(job = id, node = %placed.node, "driver starting on a worker");
        self.copy_log(id, &driver, &placed).await
    }

    /// Spawns the job's [`JobDriver`] actor in its reserved bundle and waits until it runs.
    async fn place_driver(
        &self,
        id: &str,
        submission: &JobSubmission,
        group: GroupId,
    ) -> Result<ActorHandle<JobDriver>, DriverError> {
        let config = &self.inner.config;
        let cluster =
            Cluster::new(self.inner.link.clone(), None, CallPlane::session_only()).with_job(Some(id.to_string()));
        let text = submission.resources_text();
        let resources = Resources::parse_request(&text).map_err(DriverError::Resources)?;
        let env = self
            .env_for(submission, id)
            .map_err(DriverError::Credentials)?
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
            .map_err(|cause| DriverError::Place { resources: text, cause })?;
        driver
            .wait_ready(Duration::from_secs(60))
            .await
            .map_err(DriverError::NotReady)?;
        Ok(driver)
    }

    /// Sends an uploaded package to a driver's node in chunks.
    async fn send_package(&self, driver: &ActorHandle<JobDriver>, name: &str) -> Result<(), DriverError> {
        use tokio::io::AsyncReadExt;
        let path = self.inner.packages.archive_path(name);
        let unreadable = |cause| DriverError::PackageRead {
            name: name.to_string(),
            path: path.clone(),
            cause,
        };
        let mut file = tokio::fs::File::open(&path).await.map_err(unreadable)?;
        let mut first = true;
        loop {
            let mut chunk = Vec::with_capacity(PACKAGE_CHUNK);
            let read = (&mut file)
                .take(PACKAGE_CHUNK as u64)
                .read_to_end(&mut chunk)
                .await
                .map_err(unreadable)?;
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
                .map_err(|cause| DriverError::PackageSend {
                    name: name.to_string(),
                    cause,
                })?;
            if read < PACKAGE_CHUNK {
                return Ok(());
            }
        }
    }

    /// Copies the driver's log into the job's log as it grows, until the driver ends (its
    /// outcome recorded) or its node or supervisor is lost; asks it to stop when the job is.
    async fn copy_log(&self, id: &str, driver: &ActorHandle<JobDriver>, placed: &Placed) -> Result<(), DriverError> {
        let log_path = self.log_path(id);
        let mut log =
            CappedLog::create(&log_path, self.inner.config.log_cap_bytes).map_err(|cause| DriverError::LogCreate {
                path: log_path.clone(),
                cause,
            })?;
        let mut offset = 0u64;
        let mut stop_sent = false;
        loop {
            if self.is_stopping(id) && !stop_sent {
                stop_sent = true;
                let _ = driver.call(DriverRequest::Stop).await;
            }
            let progress = driver
                .call(DriverRequest::Poll { offset })
                .await
                .map_err(|cause| DriverError::Lost {
                    node: placed.node.clone(),
                    cause,
                })?;
            let DriverReply::Progress {
                log: bytes,
                next,
                driver: process,
                outcome,
                lost: gone,
            } = progress
            else {
                return Err(DriverError::Unexpected {
                    request: "a poll",
                    reply: format!("{progress:?}"),
                });
            };
            offset = next;
            if !bytes.is_empty() {
                log.append(&bytes).map_err(|cause| DriverError::LogWrite {
                    path: log_path.clone(),
                    cause,
                })?;
                self.inner.changes.send_modify(|n| *n += 1);
            }
            if let Some(process) = process.filter(|_| self.get(id).is_ok_and(|r| r.status == JobStatus::Pending)) {
                self.update(id, |r| r.started(process.pid, &placed.host, now_ms()));
                tracing::info!(job = id, node = %placed.node, pid = process.pid, "driver started");
            }
            match (outcome, gone) {
                (Some(outcome), _) if bytes.is_empty() => {
                    self.record_outcome(id, outcome);
                    return Ok(());
                }
                (None, Some(why)) => return Err(DriverError::SupervisorGone(why)),
                _ => {}
            }
            if bytes.len() < (1 << 20) {
                tokio::time::sleep(REMOTE_POLL_EVERY).await;
            }
        }
    }
}

/// Asks the placed driver actor to start the driver with the job's packages.
async fn start_driver(driver: &ActorHandle<JobDriver>, submission: &JobSubmission) -> Result<Placed, DriverError> {
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
        .map_err(DriverError::Start)?;
    match started {
        DriverReply::Started { node, host } => Ok(Placed { node, host }),
        other => Err(DriverError::Unexpected {
            request: "a start",
            reply: format!("{other:?}"),
        }),
    }
}
