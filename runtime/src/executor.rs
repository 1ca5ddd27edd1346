//! Executor processes: the `regatta-torch-rank` binary that links libtorch and drives the
//! device. A trainer rank and a scorer actor each launch one from inside a worker's agent
//! and speak JSON lines over its stdin and stdout; this module is the one place that finds
//! the binary, gives it its GPUs and makes sure it never outlives the agent that started it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};

use crate::error::{Error, Result};

/// Names the executor binary (default: `regatta-torch-rank` next to the running binary).
pub const EXECUTOR_ENV: &str = "REGATTA_TORCH_RANK";

/// The executor binary's file name.
const EXECUTOR_NAME: &str = "regatta-torch-rank";

/// Where the executor binary is: the argument, `REGATTA_TORCH_RANK`, or next to this binary.
pub fn executor_path(explicit: Option<&str>) -> Result<PathBuf> {
    if let Some(path) = explicit
        .map(str::to_string)
        .or_else(|| std::env::var(EXECUTOR_ENV).ok())
    {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(Error::Executor(format!(
                "the executor {} does not exist",
                path.display()
            )))
        };
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("cannot find the running binary", e))?;
    let beside = exe.with_file_name(EXECUTOR_NAME);
    if beside.is_file() {
        return Ok(beside);
    }
    Err(Error::Executor(format!(
        "the executor {EXECUTOR_NAME} is not next to {} on this node; build it with \
         `scripts/setup-libtorch.sh` then `cargo build -p regatta-torch` (see README), or set {EXECUTOR_ENV}",
        exe.display()
    )))
}

/// What to start: the binary, its first arguments, extra environment, the actor's GPUs.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    /// The binary; `None`: [`executor_path`]'s default.
    pub executor: Option<String>,
    /// Arguments (a subcommand such as `score`; none for a trainer rank).
    pub args: Vec<String>,
    /// Extra environment variables (secrets go here, never on the command line).
    pub env: Vec<(String, String)>,
    /// The GPU indices the actor was given: the only ones the executor sees.
    pub gpus: Vec<u32>,
    /// Whether the executor reads and writes object storage (Regatta's trainer and scorer
    /// executors): it then inherits the storage credentials too
    /// ([`crate::environment::STORAGE_PREFIXES`]); users' code does not.
    pub storage: bool,
    /// Pipe stderr back to the caller (to keep its tail as a failure's cause); else it is
    /// inherited (the node's log).
    pub capture_stderr: bool,
}

/// A running executor and its pipes; dropping `child` kills it.
pub struct Executor {
    /// The process (killed on drop).
    pub child: Child,
    /// Its stdin: JSON lines to it.
    pub stdin: ChildStdin,
    /// Its stdout: JSON lines from it (other lines are its log).
    pub stdout: ChildStdout,
    /// Its stderr when [`Launch::capture_stderr`] was set.
    pub stderr: Option<ChildStderr>,
    /// The binary that runs.
    pub path: PathBuf,
}

/// The command that starts `path`: the allowlisted environment only
/// ([`crate::environment`]; with `storage`, the storage credentials too), stdin and stdout piped, killed when the child is dropped, and
/// limited to `gpus` (`CUDA_VISIBLE_DEVICES`).
fn command(path: &Path, gpus: &[u32], storage: bool) -> Command {
    let mut command = Command::new(path);
    if storage {
        crate::environment::restrict_for_storage(&mut command);
    } else {
        crate::environment::restrict(&mut command);
    }
    command.stdin(Stdio::piped()).stdout(Stdio::piped()).kill_on_drop(true);
    if !gpus.is_empty() {
        let visible: Vec<String> = gpus.iter().map(u32::to_string).collect();
        command.env("CUDA_VISIBLE_DEVICES", visible.join(","));
    }
    command
}

/// Starts an executor.
pub fn launch(launch: &Launch) -> Result<Executor> {
    let path = executor_path(launch.executor.as_deref())?;
    let mut command = command(&path, &launch.gpus, launch.storage);
    command.args(&launch.args).envs(launch.env.iter().map(|(k, v)| (k, v)));
    command.stderr(if launch.capture_stderr {
        Stdio::piped()
    } else {
        Stdio::inherit()
    });
    let mut child = command
        .spawn()
        .map_err(|e| Error::Executor(format!("cannot start the executor {}: {e}", path.display())))?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(Error::Executor("the executor's pipes are missing".into()));
    };
    let stderr = child.stderr.take();
    Ok(Executor {
        child,
        stdin,
        stdout,
        stderr,
        path,
    })
}

/// Called by the executor itself: exits when the agent that started it dies without
/// cleaning up (SIGKILL re-parents the executor) rather than go on alone.
pub fn exit_when_orphaned() {
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(200));
        if std::os::unix::process::parent_id() != parent {
            eprintln!("{EXECUTOR_NAME}: the agent that started this executor is gone; exiting");
            std::process::exit(3);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_executor_that_does_not_exist_is_an_error_naming_it() {
        let err = executor_path(Some("/nonexistent/regatta-torch-rank")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/regatta-torch-rank"), "{err}");
    }

    #[tokio::test]
    async fn an_executor_sees_only_its_gpus_and_its_environment() {
        use tokio::io::AsyncReadExt;
        let mut running = launch(&Launch {
            executor: Some("/bin/sh".into()),
            args: vec!["-c".into(), "echo $CUDA_VISIBLE_DEVICES $SECRET".into()],
            env: vec![("SECRET".into(), "s3cret".into())],
            gpus: vec![2, 3],
            capture_stderr: true,
            storage: false,
        })
        .expect("sh starts");
        let mut out = String::new();
        running.stdout.read_to_string(&mut out).await.expect("read stdout");
        assert_eq!(out.trim(), "2,3 s3cret");
        assert!(running.stderr.is_some());
    }
}
