//! The job supervisor (`regatta job-shim`): the process between the head and a job's
//! driver. The head starts it in a process group of its own and does not hold its pipes,
//! so the driver keeps running, and its output keeps being kept, while the head is down.
//!
//! The supervisor starts the driver (`sh -c <entrypoint>`) in another process group,
//! copies its stdout and stderr into the job's capped log, and leaves two small files
//! beside the job record that the head (this one or a restarted one) reads:
//!
//! - `<id>.driver.json`: the driver's [`ProcessIdentity`], once it started;
//! - `<id>.status.json`: the [`ShimOutcome`], written (atomically) when the driver ended.
//!
//! SIGTERM to the supervisor means "stop the job": it sends SIGTERM to the driver's
//! process group, SIGKILL after the grace period, and records `stopped`. Being the
//! driver's parent, it signals a pid that cannot have been reused: the driver is not
//! reaped before that. The head signals the supervisor itself only after checking its
//! identity, pid and start time, so a reused pid is never killed.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::process::Command;

use super::log::CappedLog;
use crate::error::{Error, Result};
use regatta_proto::ProcessIdentity;

/// What a supervisor is told on its command line.
#[derive(Clone, Debug)]
pub struct ShimArgs {
    /// The job's id (for messages).
    pub job: String,
    /// The job's folder of supervisor files (`<state-dir>/run`).
    pub run_dir: PathBuf,
    /// The job's log file.
    pub log: PathBuf,
    /// Bytes per log part.
    pub log_cap_bytes: u64,
    /// Time between SIGTERM and SIGKILL when the job is stopped.
    pub stop_grace: Duration,
    /// The driver's working directory.
    pub working_dir: Option<PathBuf>,
    /// The driver's shell command.
    pub entrypoint: String,
    /// Stop the job when this process (the worker that started the supervisor) is no
    /// longer its parent: a driver on a worker must not outlive the worker. `None` for
    /// drivers on the head, which outlive a head restart on purpose.
    pub parent: Option<u32>,
}

/// How the driver ended, as the supervisor recorded it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimOutcome {
    /// Its exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// The job was stopped on request.
    pub stopped: bool,
    /// Why the driver could not run at all.
    pub error: Option<String>,
}

/// The supervisor's files for job `id` in `run_dir`.
#[derive(Clone, Debug)]
pub(crate) struct RunFiles {
    /// The driver's identity once it started.
    pub(crate) driver: PathBuf,
    /// The outcome once it ended.
    pub(crate) status: PathBuf,
    /// The supervisor's own messages (its stderr).
    pub(crate) messages: PathBuf,
}

impl RunFiles {
    pub(crate) fn new(run_dir: &Path, id: &str) -> Self {
        Self {
            driver: run_dir.join(format!("{id}.driver.json")),
            status: run_dir.join(format!("{id}.status.json")),
            messages: run_dir.join(format!("{id}.shim.log")),
        }
    }

    /// Removes every file (when the job is deleted).
    pub(crate) fn remove(&self) {
        for path in [&self.driver, &self.status, &self.messages] {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Why a job's supervisor or its driver could not be started.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    /// A file the start needs could not be created.
    #[error("cannot create {what} {}: {cause}", path.display())]
    Create {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    /// The supervisor's process could not be started.
    #[error("could not start the job supervisor {}: {cause}", binary.display())]
    Supervisor { binary: PathBuf, cause: std::io::Error },
    /// The driver's process could not be started.
    #[error("could not start the driver: {0}")]
    Driver(std::io::Error),
    /// The supervisor ended before its identity could be read: its own last messages.
    #[error("the job supervisor (pid {pid}) ended at once: {messages}")]
    EndedAtOnce { pid: u32, messages: String },
    /// A package the driver needs could not be unpacked.
    #[error("cannot prepare the package gcs://{name}: {cause}")]
    Package {
        name: String,
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The packages' folders do not make a `PYTHONPATH`.
    #[error("cannot build the driver's PYTHONPATH: {0}")]
    PythonPath(#[from] std::env::JoinPathsError),
}

/// Starts `<binary> job-shim` for `args` in a process group of its own, with `env` over
/// the allowlisted part of this process's environment ([`crate::environment`]; later
/// entries win) and its own messages in the run files;
/// returns the supervisor's identity once it runs. The supervisor is reaped when it ends;
/// whoever started it follows it through its files, not its pipes.
pub(crate) fn start_supervisor(
    binary: &Path,
    args: &ShimArgs,
    env: &[(std::ffi::OsString, std::ffi::OsString)],
) -> std::result::Result<ProcessIdentity, StartError> {
    let files = RunFiles::new(&args.run_dir, &args.job);
    files.remove();
    let messages = std::fs::File::create(&files.messages).map_err(|cause| StartError::Create {
        what: "the supervisor's messages file",
        path: files.messages.clone(),
        cause,
    })?;
    let mut command = Command::new(binary);
    command
        .arg("job-shim")
        .arg("--job")
        .arg(&args.job)
        .arg("--run-dir")
        .arg(&args.run_dir)
        .arg("--log")
        .arg(&args.log)
        .arg("--log-cap-bytes")
        .arg(args.log_cap_bytes.to_string())
        .arg("--stop-grace-ms")
        .arg(args.stop_grace.as_millis().to_string());
    if let Some(dir) = &args.working_dir {
        command.arg("--working-dir").arg(dir);
    }
    if let Some(parent) = args.parent {
        command.arg("--parent").arg(parent.to_string());
    }
    crate::environment::restrict(&mut command);
    command
        .arg("--")
        .arg(&args.entrypoint)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(messages)
        .process_group(0)
        .kill_on_drop(false);
    let mut child = command.spawn().map_err(|cause| StartError::Supervisor {
        binary: binary.to_path_buf(),
        cause,
    })?;
    let pid = child.id().unwrap_or(0);
    tokio::spawn(async move { child.wait().await });
    identity_of(pid).ok_or_else(|| StartError::EndedAtOnce {
        pid,
        messages: tail_of(&files.messages),
    })
}

/// The last lines of a supervisor's messages, for an error that says why.
pub(crate) fn tail_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.len() {
        0 => format!("it left no message in {}", path.display()),
        n => lines[n.saturating_sub(5)..].join(" | "),
    }
}

/// The state letter and start time (field 3 and field 22) of a `/proc/<pid>/stat` line.
/// The command name (field 2) is in parentheses and may hold spaces and parentheses, so
/// the fields are counted from the last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<(char, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start = fields.get(22 - 3)?.parse().ok()?;
    Some((state, start))
}

/// The identity of the live process `pid`; `None` when there is none, or only a zombie.
pub(crate) fn identity_of(pid: u32) -> Option<ProcessIdentity> {
    match stat_of(pid)? {
        ('Z' | 'X', _) => None,
        (_, start_ticks) => Some(ProcessIdentity {
            pid,
            start_ticks,
            boot: boot_id(),
        }),
    }
}

/// This boot's id; empty where the kernel does not say.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_string())
        .unwrap_or_default()
}

/// The identity of a child this process has not reaped yet, even when it has already
/// exited (a zombie keeps its start time).
fn child_identity(pid: u32) -> Option<ProcessIdentity> {
    stat_of(pid).map(|(_, start_ticks)| ProcessIdentity {
        pid,
        start_ticks,
        boot: boot_id(),
    })
}

fn stat_of(pid: u32) -> Option<(char, u64)> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether `process` still runs: the same pid with the same start time.
pub(crate) fn is_alive(process: &ProcessIdentity) -> bool {
    identity_of(process.pid).as_ref() == Some(process)
}

/// Sends `signal` (`TERM`, `KILL`) to `process` if it is still that process; returns
/// whether it was.
pub(crate) fn signal_process(process: &ProcessIdentity, signal: &str) -> bool {
    is_alive(process) && kill(signal, &process.pid.to_string())
}

/// Sends `signal` to the process group led by `process` if its leader is still that
/// process; returns whether it was.
pub(crate) fn signal_group_of(process: &ProcessIdentity, signal: &str) -> bool {
    is_alive(process) && kill(signal, &format!("-{}", process.pid))
}

/// `kill -SIGNAL -- target`.
fn kill(signal: &str, target: &str) -> bool {
    if target == "0" || target == "-0" || target == "1" || target == "-1" {
        return false;
    }
    std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(target)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Writes `value` as JSON to `path` atomically (a temporary file, then a rename).
pub(crate) fn write_json_atomically<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let text =
        serde_json::to_vec(value).map_err(|e| Error::Rejected(format!("cannot encode {}: {e}", path.display())))?;
    std::fs::write(&tmp, text).map_err(|e| Error::io(format!("cannot write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("cannot move {} into place", path.display()), e))
}

/// Reads a JSON file; `None` when it is absent or not (yet) whole.
pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Runs the supervisor: starts the driver, keeps its output, waits for it to end (or for a
/// stop) and records how it ended. Errors are only those that leave no outcome written.
pub async fn supervise_job(args: ShimArgs) -> Result<ShimOutcome> {
    use tokio::signal::unix::{signal, SignalKind};
    let files = RunFiles::new(&args.run_dir, &args.job);
    // Before the driver exists: a stop that comes earlier ends this process, and no driver.
    let mut terminate =
        signal(SignalKind::terminate()).map_err(|e| Error::io("cannot handle SIGTERM in the job supervisor", e))?;
    let outcome = match start_driver(&args, &files) {
        Err(reason) => ShimOutcome {
            error: Some(reason.to_string()),
            ..ShimOutcome::default()
        },
        Ok((mut child, copies)) => {
            let driver = child.id().unwrap_or(0);
            let group = format!("-{driver}");
            let (status, mut stopped) = tokio::select! {
                status = child.wait() => (status, false),
                _ = stop_requested(&mut terminate, args.parent) => {
                    kill("TERM", &group);
                    let status = match tokio::time::timeout(args.stop_grace, child.wait()).await {
                        Ok(status) => status,
                        Err(_) => {
                            kill("KILL", &group);
                            child.wait().await
                        }
                    };
                    // What the driver left behind in its group goes too.
                    kill("KILL", &group);
                    (status, true)
                }
            };
            // Background processes the driver started may still hold its output open; the
            // job ends when they close it, or when it is stopped (its group id cannot be
            // reused while they live).
            let outputs = futures::future::join_all(copies);
            tokio::pin!(outputs);
            if !stopped {
                tokio::select! {
                    _ = &mut outputs => {}
                    _ = stop_requested(&mut terminate, args.parent) => {
                        kill("KILL", &group);
                        stopped = true;
                    }
                }
            }
            if stopped {
                let _ = tokio::time::timeout(Duration::from_secs(2), &mut outputs).await;
            }
            match status {
                Ok(status) => {
                    use std::os::unix::process::ExitStatusExt;
                    ShimOutcome {
                        code: status.code(),
                        signal: status.signal(),
                        stopped,
                        error: None,
                    }
                }
                Err(e) => ShimOutcome {
                    stopped,
                    error: Some(format!("lost track of the driver: {e}")),
                    ..ShimOutcome::default()
                },
            }
        }
    };
    write_json_atomically(&files.status, &outcome)?;
    Ok(outcome)
}

/// Resolves when the job is to stop: SIGTERM, or (with `parent`) the process that started
/// this supervisor is gone (this process was re-parented).
async fn stop_requested(terminate: &mut tokio::signal::unix::Signal, parent: Option<u32>) {
    let orphaned = async {
        match parent {
            Some(parent) => loop {
                if std::os::unix::process::parent_id() != parent {
                    tracing::warn!(
                        parent,
                        "the worker that started this job's supervisor is gone; stopping the driver"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            },
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = terminate.recv() => {}
        _ = orphaned => {}
    }
}

type Copies = Vec<tokio::task::JoinHandle<()>>;

/// Starts the driver in its own process group with its output going into the log, and
/// records its identity.
fn start_driver(args: &ShimArgs, files: &RunFiles) -> std::result::Result<(tokio::process::Child, Copies), StartError> {
    let log = CappedLog::create(&args.log, args.log_cap_bytes).map_err(|cause| StartError::Create {
        what: "the job log",
        path: args.log.clone(),
        cause,
    })?;
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(&args.entrypoint)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    if let Some(dir) = &args.working_dir {
        command.current_dir(dir);
    }
    let mut child = command.spawn().map_err(StartError::Driver)?;
    let pid = child.id().unwrap_or(0);
    // Not reaped before `wait`: a driver that already exited still has its identity.
    if let Some(identity) = child_identity(pid) {
        if let Err(e) = write_json_atomically(&files.driver, &identity) {
            tracing::warn!(job = %args.job, error = %e, "could not record the driver's identity");
        }
    }
    let log = Arc::new(Mutex::new(log));
    let copies = [
        child.stdout.take().map(|out| tokio::spawn(copy_into(out, log.clone()))),
        child.stderr.take().map(|err| tokio::spawn(copy_into(err, log.clone()))),
    ];
    Ok((child, copies.into_iter().flatten().collect()))
}

async fn copy_into(mut from: impl tokio::io::AsyncRead + Unpin, log: Arc<Mutex<CappedLog>>) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(e) = log.append(&buffer[..n]) {
                    tracing::warn!(error = %e, "could not write a job log");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let fields_after: Vec<String> = (3..=52).map(|n| n.to_string()).collect();
        let line = format!("4242 (my (odd) name) S {}", fields_after[1..].join(" "));
        // Field 3 is the state; fields 4.. are their own numbers, so field 22 reads 22.
        assert_eq!(parse_stat(&line), Some(('S', 22)));
        assert_eq!(parse_stat("4242 (cut"), None);
        assert_eq!(parse_stat("4242 (short) S 1 2"), None);
    }

    #[test]
    fn a_live_process_is_told_apart_from_one_that_reuses_its_pid() {
        let me = identity_of(std::process::id()).expect("this process");
        assert!(is_alive(&me));
        let impostor = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me.clone()
        };
        assert!(!is_alive(&impostor));
        assert!(
            !signal_process(&impostor, "TERM"),
            "a different start time is another process"
        );
        assert!(!me.boot.is_empty(), "this kernel names its boot");
        let before_a_reboot = ProcessIdentity {
            boot: "another boot".into(),
            ..me
        };
        assert!(
            !is_alive(&before_a_reboot),
            "a record from another boot is another process"
        );
    }

    #[test]
    fn a_stop_signal_never_reaches_a_process_whose_start_time_differs() {
        let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let real = identity_of(sleeper.id()).expect("sleeper");
        let reused = ProcessIdentity {
            start_ticks: real.start_ticks.wrapping_sub(1),
            ..real.clone()
        };
        assert!(!signal_process(&reused, "KILL"));
        assert!(!signal_group_of(&reused, "KILL"));
        assert!(matches!(sleeper.try_wait(), Ok(None)), "the sleeper must be untouched");
        assert!(signal_process(&real, "KILL"));
        let status = sleeper.wait().expect("wait");
        assert!(!status.success());
        assert!(!is_alive(&real));
    }
}
