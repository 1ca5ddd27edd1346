//! A job's driver on a worker: the actor the head's job manager places in the bundle that
//! holds the job's entrypoint resources (`entrypoint_num_cpus|gpus|memory|resources`), so
//! the driver runs on a node that has them, as Ray's job supervisor does.
//!
//! The actor runs the driver the way the head runs one: under `regatta job-shim` (the
//! worker's own binary), with the driver's output in a capped log in a folder of its own.
//! The head drives it with calls: the job's packages in chunks (`working_dir`,
//! `py_modules`, unpacked here), a start, then polls that bring back the log's new bytes,
//! the driver's identity and, at the end, its outcome; a stop forwards to the supervisor.
//! The node dying kills the actor with it, and the head fails the job with that cause.
//! Dropping the actor (the job ended, was stopped, or the node shuts down) kills whatever
//! is left of the driver and removes the folder.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::log;
use super::packages;
use super::shim::{self, RunFiles, ShimArgs, ShimOutcome, StartError};
use crate::client::{Actor, ActorContext, ActorError};
use regatta_proto::{ProcessIdentity, RuntimeEnv, PACKAGE_SCHEME};

/// What the head gives a job's driver actor.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DriverArgs {
    /// The job's id.
    pub job: String,
    /// The driver's shell command.
    pub entrypoint: String,
    /// The driver's environment beyond the worker's own (job variables, cluster address
    /// and token, job id).
    pub env: Vec<(String, String)>,
    /// A working directory on the node (when the job names a path, not a package).
    pub working_dir: Option<String>,
    /// Bytes per log part.
    pub log_cap_bytes: u64,
    /// Time between SIGTERM and SIGKILL on a stop.
    pub stop_grace: Duration,
}

/// What the head asks of it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum DriverRequest {
    /// The next bytes of package `name` (chunks in order, from offset 0).
    Package {
        /// The package's name (`_ray_pkg_<hash>.zip`).
        name: String,
        /// Its next bytes.
        chunk: Vec<u8>,
    },
    /// Start the driver in the `working_dir` package (or the path in the arguments) with
    /// the `py_modules` packages on `PYTHONPATH`.
    Start {
        /// The package that is the working directory.
        working_dir: Option<String>,
        /// Packages whose folders go on `PYTHONPATH`.
        py_modules: Vec<String>,
    },
    /// The log's bytes after `offset`, the driver's identity, and how it ended if it did.
    Poll {
        /// Where the head's copy of the log is.
        offset: u64,
    },
    /// Stop the job (SIGTERM to the supervisor, which ends the driver).
    Stop,
}

/// Its answers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum DriverReply {
    /// Done.
    Done,
    /// The supervisor runs on `node` (reached at `host`).
    Started {
        /// The node's name.
        node: String,
        /// Its address.
        host: String,
    },
    /// Progress since `offset`.
    Progress {
        /// New log bytes (up to 1 MiB).
        log: Vec<u8>,
        /// The offset after them.
        next: u64,
        /// The driver, once it started.
        driver: Option<ProcessIdentity>,
        /// How it ended; the log is complete once this comes with no new bytes.
        outcome: Option<ShimOutcome>,
        /// The supervisor ended without recording an outcome: why.
        lost: Option<String>,
    },
}

/// The actor.
pub struct JobDriver {
    args: DriverArgs,
    dir: PathBuf,
    supervisor: Option<ProcessIdentity>,
    driver: Option<ProcessIdentity>,
}

impl JobDriver {
    fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("driver.log")
    }

    fn archive(&self, name: &str) -> Result<PathBuf, ActorError> {
        // Package names were checked by the head; refuse anything else all the same.
        packages::parse_name(packages::PROTOCOL, name)?;
        Ok(self.dir.join("packages").join(name))
    }

    fn unpacked(&self, name: &str) -> Result<PathBuf, ActorError> {
        let archive = self.archive(name)?;
        let dest = self.dir.join("unpacked").join(name);
        if !dest.is_dir() {
            packages::unpack(&archive, &dest).map_err(|e| format!("cannot unpack the package {name}: {e}"))?;
        }
        Ok(dest)
    }

    fn start(
        &mut self,
        working_dir: Option<String>,
        py_modules: Vec<String>,
        ctx: &ActorContext,
    ) -> Result<DriverReply, ActorError> {
        if self.supervisor.is_some() {
            return Err("the driver was started already".into());
        }
        let mut env: Vec<(OsString, OsString)> = self.args.env.iter().map(|(k, v)| (k.into(), v.into())).collect();
        let inherited = env
            .iter()
            .rev()
            .find(|(k, _)| k == "PYTHONPATH")
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var_os("PYTHONPATH"));
        let packages = RuntimeEnv {
            working_dir: working_dir
                .map(|name| format!("{PACKAGE_SCHEME}{name}"))
                .or_else(|| self.args.working_dir.clone()),
            py_modules: py_modules
                .iter()
                .map(|name| format!("{PACKAGE_SCHEME}{name}"))
                .collect(),
            ..RuntimeEnv::default()
        };
        let (working_dir, python_path) = packages::driver_dirs(&packages, inherited, |name| {
            self.unpacked(name).map_err(|cause| StartError::Package {
                name: name.to_string(),
                cause,
            })
        })?;
        env.extend(python_path.map(|path| ("PYTHONPATH".into(), path)));
        if !ctx.gpu_ids().is_empty() {
            let devices: Vec<String> = ctx.gpu_ids().iter().map(u32::to_string).collect();
            env.push(("CUDA_VISIBLE_DEVICES".into(), devices.join(",").into()));
        }
        let binary = std::env::current_exe().map_err(|e| format!("cannot find the worker's own binary: {e}"))?;
        let shim = ShimArgs {
            job: self.args.job.clone(),
            run_dir: self.run_dir(),
            log: self.log(),
            log_cap_bytes: self.args.log_cap_bytes,
            stop_grace: self.args.stop_grace,
            working_dir,
            entrypoint: self.args.entrypoint.clone(),
            parent: Some(std::process::id()),
        };
        self.supervisor = Some(shim::start_supervisor(&binary, &shim, &env)?);
        Ok(DriverReply::Started {
            node: ctx.node().to_string(),
            host: ctx.host().to_string(),
        })
    }

    fn poll(&mut self, offset: u64) -> DriverReply {
        let files = RunFiles::new(&self.run_dir(), &self.args.job);
        if self.driver.is_none() {
            self.driver = shim::read_json(&files.driver);
        }
        // The outcome is read before the log, so the log read after it is complete.
        let mut outcome: Option<ShimOutcome> = shim::read_json(&files.status);
        let mut lost = None;
        if let (None, Some(supervisor)) = (&outcome, &self.supervisor) {
            if !shim::is_alive(supervisor) {
                // It writes the outcome before it exits: look once more.
                outcome = shim::read_json(&files.status);
                if outcome.is_none() {
                    lost = Some(format!(
                        "the job's supervisor (pid {}) ended without recording how the driver ended: {}",
                        supervisor.pid,
                        shim::tail_of(&files.messages)
                    ));
                }
            }
        }
        let (log, next) = log::read_from(&self.log(), offset);
        DriverReply::Progress {
            log,
            next,
            driver: self.driver.clone(),
            outcome,
            lost,
        }
    }
}

impl Actor for JobDriver {
    const KIND: &'static str = "regatta.job-driver";
    type Args = DriverArgs;
    type Request = DriverRequest;
    type Reply = DriverReply;

    async fn create(args: DriverArgs, ctx: &ActorContext) -> Result<Self, ActorError> {
        regatta_proto::validate_job_id(&args.job)?;
        let dir = std::env::temp_dir()
            .join("regatta-drivers")
            .join(format!("{}-{}", args.job, ctx.id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["run", "packages", "unpacked"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        Ok(Self {
            args,
            dir,
            supervisor: None,
            driver: None,
        })
    }

    async fn handle(&mut self, request: DriverRequest, ctx: &ActorContext) -> Result<DriverReply, ActorError> {
        match request {
            DriverRequest::Package { name, chunk } => {
                let path = self.archive(&name)?;
                let mut file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                file.write_all(&chunk)
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                Ok(DriverReply::Done)
            }
            DriverRequest::Start {
                working_dir,
                py_modules,
            } => self.start(working_dir, py_modules, ctx),
            DriverRequest::Poll { offset } => Ok(self.poll(offset)),
            DriverRequest::Stop => {
                if let Some(supervisor) = &self.supervisor {
                    shim::signal_process(supervisor, "TERM");
                }
                Ok(DriverReply::Done)
            }
        }
    }
}

impl Drop for JobDriver {
    fn drop(&mut self) {
        let files = RunFiles::new(&self.run_dir(), &self.args.job);
        let ended = shim::read_json::<ShimOutcome>(&files.status).is_some();
        if !ended {
            // The job is over for the head (ended, stopped, or this node is going away):
            // nothing of it may run on with the cluster's token.
            if let Some(supervisor) = &self.supervisor {
                shim::signal_process(supervisor, "KILL");
            }
            if let Some(driver) = self.driver.clone().or_else(|| shim::read_json(&files.driver)) {
                shim::signal_group_of(&driver, "KILL");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
