//! The rank actor: a light actor inside a node's agent that launches and supervises the
//! rank's executor process (the one that links libtorch and drives the device), relays
//! the driver's instructions to it and its events back, and publishes its metrics on the
//! node's `/metrics`. A crash inside libtorch, CUDA or NCCL costs the executor, which the
//! driver sees as this rank failing with the executor's last log lines as the cause.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use regatta_runtime::executor::{launch, Launch};
use regatta_runtime::{Actor, ActorContext, ActorError};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout};

use crate::metrics::TrainMetrics;
use crate::protocol::{FromExecutor, RankSetup, ToExecutor, TrainOp, TrainReply};

/// The ring's shared secret, handed to the executor through its environment.
pub const SECRET_ENV: &str = "REGATTA_RING_SECRET";
/// Lines of the executor's stderr kept for the cause of a failure.
const STDERR_TAIL: usize = 20;
/// How long an executor may take to load libtorch, the data and a checkpoint.
const BIND_TIMEOUT: Duration = Duration::from_secs(300);

/// Constructor arguments of a rank actor.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainRankArgs {
    /// What the executor is told (host and GPUs are filled in on the node).
    pub setup: RankSetup,
    /// The ring secret.
    pub secret: String,
    /// The executor binary; `None`: the node's default.
    pub executor: Option<String>,
}

#[derive(Default)]
struct Shared {
    events: Vec<FromExecutor>,
    bound: Option<FromExecutor>,
    stderr: VecDeque<String>,
    exited: Option<String>,
    /// The executor's stdout was read to its end: every event it wrote is in `events`.
    stdout_done: bool,
}

/// One rank of a trainer group.
pub struct TrainRank {
    rank: usize,
    stdin: ChildStdin,
    shared: Arc<Mutex<Shared>>,
    _child: Arc<tokio::sync::Mutex<Child>>,
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

impl Actor for TrainRank {
    const KIND: &'static str = "train-rank";
    type Args = TrainRankArgs;
    type Request = TrainOp;
    type Reply = TrainReply;

    async fn create(args: TrainRankArgs, ctx: &ActorContext) -> Result<Self, ActorError> {
        let mut setup = args.setup;
        if setup.world == 0 || setup.rank >= setup.world {
            return Err(format!("rank {} does not fit a group of {}", setup.rank, setup.world).into());
        }
        setup.host = ctx.host().to_string();
        setup.gpus = ctx.gpu_ids().to_vec();
        let executor = launch(&Launch {
            executor: args.executor.clone(),
            args: Vec::new(),
            env: vec![(SECRET_ENV.to_string(), args.secret.clone())],
            gpus: setup.gpus.clone(),
            capture_stderr: true,
            storage: true,
        })?;
        let (child, mut stdin, stdout) = (executor.child, executor.stdin, executor.stdout);
        let Some(stderr) = executor.stderr else {
            return Err("the executor's stderr is missing".into());
        };
        let (rank, world, rescales) = (setup.rank, setup.world, setup.rescales);
        let line = serde_json::to_string(&ToExecutor::Setup(Box::new(setup))).map_err(|e| e.to_string())?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| format!("cannot write to the trainer executor: {e}"))?;
        let shared = Arc::new(Mutex::new(Shared::default()));
        let metrics = TrainMetrics::get();
        metrics.started(rank, world, rescales);
        tokio::spawn(relay_events(stdout, shared.clone(), metrics, rank));
        tokio::spawn(keep_stderr_tail(stderr, shared.clone(), rank));
        let child = Arc::new(tokio::sync::Mutex::new(child));
        tokio::spawn(watch_exit(Arc::downgrade(&child), shared.clone()));
        Ok(Self {
            rank,
            stdin,
            shared,
            _child: child,
        })
    }

    async fn handle(&mut self, op: TrainOp, _ctx: &ActorContext) -> Result<TrainReply, ActorError> {
        match op {
            TrainOp::Bind => {
                let deadline = tokio::time::Instant::now() + BIND_TIMEOUT;
                loop {
                    {
                        let shared = lock(&self.shared);
                        if let Some(FromExecutor::Bound(binding)) = &shared.bound {
                            return Ok(TrainReply::Bound(binding.clone()));
                        }
                        if let Some(FromExecutor::Failed { reason, fatal }) = shared.events.last() {
                            return Ok(TrainReply::Failed {
                                reason: format!("rank {}: {reason}", self.rank),
                                fatal: *fatal,
                            });
                        }
                        if let Some(exited) = &shared.exited {
                            return Err(format!("rank {}: {exited}", self.rank).into());
                        }
                    }
                    if tokio::time::Instant::now() > deadline {
                        return Err(
                            format!("rank {}: the executor did not start within {BIND_TIMEOUT:?}", self.rank).into(),
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            TrainOp::Connect(next, nccl_id) => {
                let line = serde_json::to_string(&ToExecutor::Connect { next, nccl_id }).map_err(|e| e.to_string())?;
                self.stdin
                    .write_all(format!("{line}\n").as_bytes())
                    .await
                    .map_err(|e| format!("rank {}: cannot reach the executor: {e}", self.rank))?;
                Ok(TrainReply::Connected)
            }
            TrainOp::Poll => {
                let mut shared = lock(&self.shared);
                Ok(TrainReply::Events {
                    events: std::mem::take(&mut shared.events),
                    exited: shared.exited.clone(),
                })
            }
        }
    }
}

/// Reads the executor's events from its stdout into `shared` (its other lines are its
/// log), until the executor closes it.
async fn relay_events(stdout: ChildStdout, shared: Arc<Mutex<Shared>>, metrics: &'static TrainMetrics, rank: usize) {
    let mut lines = BufReader::new(stdout).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<FromExecutor>(&line) {
            Ok(event) => {
                metrics.observe(rank, &event);
                let mut shared = lock(&shared);
                if matches!(event, FromExecutor::Bound(_)) {
                    shared.bound = Some(event);
                } else {
                    shared.events.push(event);
                }
            }
            Err(_) => tracing::info!(rank, "executor: {line}"),
        }
    }
    lock(&shared).stdout_done = true;
}

/// Logs the executor's stderr and keeps its last [`STDERR_TAIL`] lines for the cause of a
/// failure.
async fn keep_stderr_tail(stderr: ChildStderr, shared: Arc<Mutex<Shared>>, rank: usize) {
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        tracing::info!(rank, "executor: {line}");
        let mut shared = lock(&shared);
        if shared.stderr.len() == STDERR_TAIL {
            shared.stderr.pop_front();
        }
        shared.stderr.push_back(line);
    }
}

/// Waits for the executor to exit and records why in `shared`. Polls through a weak
/// reference, so dropping the actor drops (and kills) the child.
async fn watch_exit(child: Weak<tokio::sync::Mutex<Child>>, shared: Arc<Mutex<Shared>>) {
    loop {
        let Some(child) = child.upgrade() else { return };
        let status = child.lock().await.try_wait();
        drop(child);
        match status {
            Ok(Some(status)) => {
                // The exit is reported only once the events the executor wrote last are
                // read (a step's loss must not be lost behind its exit on a busy machine); a
                // pipe some other process keeps open ends the wait after a few seconds. Then
                // a moment for stderr's last lines.
                let drained = tokio::time::Instant::now() + Duration::from_secs(5);
                while !lock(&shared).stdout_done && tokio::time::Instant::now() < drained {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut shared = lock(&shared);
                let tail: Vec<String> = shared.stderr.iter().cloned().collect();
                shared.exited = Some(format!(
                    "executor exited with {status}; last output: {}",
                    tail.join(" | ")
                ));
                return;
            }
            Ok(None) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => {
                lock(&shared).exited = Some(format!("cannot watch the executor: {e}"));
                return;
            }
        }
    }
}
