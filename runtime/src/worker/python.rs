//! Python actors and task workers: the actor kind behind the `regatta` Python package's
//! `@regatta.remote`. Each instance is one Python process (an executor, as
//! `regatta-torch-rank` is for ranks: killed with the actor, exiting when orphaned), started
//! with the driver's interpreter as `python -m regatta._worker`.
//!
//! The actor does not look inside what it carries: the driver's pickles go to the process
//! and its answers come back as they are. Frames on the process's stdin and stdout are a
//! 4-byte big-endian length and that many bytes; the process's own prints go to its stderr
//! (the node's log). The first frame is the constructor (`cloudpickle` of the class and its
//! arguments, or of nothing for a task worker); its answer starts with `O` (ready) or `E`
//! (the error's text). A call's answer starts with `O` or `E` too; the driver unpickles it.
//!
//! What the process prints (its stderr) becomes the actor's log: the node's log, and the
//! actor's last lines on the dashboard. Lines the process starts with `\x1e` are kept
//! marked live: the calling driver follows them while the call runs; `\x1e\x1d` and a
//! count marks that many of the actor's last lines live.
//!
//! An actor that runs its calls one after another has up to [`PIPELINED`] of them written
//! into its process at once: the process reads its next call as soon as it answers one,
//! without waiting for the node. A process that dies fails the call in it with its cause;
//! the next call (or the first of those already written behind it, which never started)
//! starts a new process and runs the constructor again, up to `max_restarts` times (Ray's
//! actor restarts), and the calls written behind are given to it in order. After that every
//! call says the actor is dead.
//!
//! With `max_concurrency` above 1 (Ray's async and threaded actors) up to that many calls
//! are in the process at once: each frame then starts with an 8-byte call number, which
//! its answer carries back, answers come in any order, and the process runs coroutine
//! methods on its event loop and plain ones on a thread pool. Such a process is not
//! restarted: when it dies, the calls in it and every later one fail with the cause.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::client::{Actor, ActorContext, ActorError};
use crate::executor::{self, Executor, Launch};

/// What starts a line of the process's stderr that its caller follows live (the worker
/// marks what a call prints once it has run a while; see `_worker.py`).
const LIVE_MARK: char = '\u{1e}';
/// After [`LIVE_MARK`], with a count: "my last this many lines are live too" (what a call
/// printed in its first second, written as it came, once the call has run that long).
const MARK_LIVE: char = '\u{1d}';

/// Frames up to this size are written with their length in one write (a copy): larger
/// ones in two, as the copy would cost more than the extra wake-up it saves.
const ONE_WRITE_MAX: usize = 64 * 1024;

/// The largest frame either side sends (2 GiB): bigger values belong in the object store.
pub const MAX_FRAME: usize = (1 << 31) - 1;

/// The constructor arguments.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PythonArgs {
    /// The interpreter (the driver's `sys.executable` by default).
    pub python: String,
    /// `PYTHONPATH` entries the process needs (where the driver found `regatta`).
    pub path: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// The constructor frame.
    pub init: Vec<u8>,
    /// How many times a dead process is replaced.
    pub max_restarts: u32,
    /// Calls in the process at once (1: one after another, in order).
    #[serde(default = "one")]
    pub max_concurrency: u32,
}

fn one() -> u32 {
    1
}

/// Why a call to a Python actor's process, or the process's start, failed.
#[derive(Clone, Debug, thiserror::Error)]
pub(crate) enum WorkerError {
    /// The interpreter could not be started.
    #[error("cannot start the Python worker ({python}): {cause}")]
    Launch { python: String, cause: Arc<crate::Error> },
    /// The process died during an exchange.
    #[error("the Python worker process (pid {pid}) died: {ending}; its last output is in the actor's log")]
    Died { pid: u32, ending: Ending },
    /// The process of an actor whose calls run beside each other died.
    #[error("the Python worker process (pid {pid}) died; its last output is in the actor's log")]
    DiedBeside { pid: u32 },
    /// A call could not be written to the process.
    #[error("the Python worker process died: its pipe broke: {0}")]
    PipeBroke(Arc<std::io::Error>),
    /// The process ended with the call in it, unanswered.
    #[error("the Python worker process went away")]
    Gone,
    /// An answer of a concurrent actor without the call's number.
    #[error("the Python worker process sent a frame without a call number")]
    NoCallNumber,
    /// The constructor raised: the worker's account of it (exception and traceback).
    #[error("{0}")]
    Constructor(String),
    /// The constructor's answer is neither success nor an exception.
    #[error("the Python worker answered its constructor with an unknown frame")]
    UnknownFrame,
    /// A process that died could not be started again.
    #[error("the actor could not be restarted: {0}")]
    Restart(Box<WorkerError>),
    /// The process died once more than `max_restarts` allows: the actor is dead.
    #[error("{cause} (restarts exhausted: {max_restarts})")]
    Exhausted { cause: Box<WorkerError>, max_restarts: u32 },
    /// No process runs (a start is under way or failed).
    #[error("the Python worker is not running")]
    NotRunning,
    /// A call too large for a frame.
    #[error("a call of {0} bytes is over the 2 GiB frame limit: pass large values through the object store")]
    TooLarge(usize),
    /// The process answered when no call was in it.
    #[error("the Python worker process answered a call it was not given")]
    Unasked,
}

/// How a process that died during an exchange ended, as far as can be told.
#[derive(Clone, Debug)]
pub(crate) enum Ending {
    /// It exited.
    Exited(std::process::ExitStatus),
    /// Not (yet) reaped; its pipe broke.
    PipeBroke(Arc<std::io::Error>),
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited(status) => write!(f, "it exited with {status}"),
            Self::PipeBroke(e) => write!(f, "its pipe broke: {e}"),
        }
    }
}

type Waiters = std::collections::HashMap<u64, tokio::sync::oneshot::Sender<Result<Vec<u8>, WorkerError>>>;

/// The process of an actor whose calls run beside each other: a writer shared by the
/// calls, a reader task that hands each answer to its call, and the cause once it died.
struct Shared {
    stdin: tokio::sync::Mutex<tokio::process::ChildStdin>,
    waiters: std::sync::Mutex<Waiters>,
    dead: std::sync::Mutex<Option<WorkerError>>,
    next: std::sync::atomic::AtomicU64,
    _child: std::sync::Mutex<tokio::process::Child>,
}

impl Shared {
    fn fail_all(&self, why: &WorkerError) {
        *self.dead.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
        let waiters = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, waiter) in waiters {
            let _ = waiter.send(Err(why.clone()));
        }
    }

    async fn call(self: Arc<Self>, request: Vec<u8>) -> Result<Vec<u8>, WorkerError> {
        if let Some(why) = self.dead.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(why);
        }
        let key = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (answer, waiting) = tokio::sync::oneshot::channel();
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, answer);
        let mut frame = Vec::with_capacity(8 + request.len());
        frame.extend_from_slice(&key.to_be_bytes());
        frame.extend_from_slice(&request);
        let sent = {
            let mut stdin = self.stdin.lock().await;
            write_frame(&mut *stdin, &frame).await
        };
        if let Err(e) = sent {
            let why = WorkerError::PipeBroke(Arc::new(e));
            self.fail_all(&why);
            return Err(why);
        }
        waiting.await.unwrap_or(Err(WorkerError::Gone))
    }
}

/// One Python process behind an actor.
pub struct PythonActor {
    /// The process of an actor whose calls run one after another.
    line: Option<Line>,
    /// The process of an actor whose calls run beside each other.
    shared: Option<Arc<Shared>>,
    /// How many of its calls the node hands it at once.
    limit: usize,
}

/// How many calls of an actor that runs them one after another are handed to its process
/// at once: the node writes the next ones while one runs, so the process reads its next
/// call as soon as it answers one, without waiting for the node (a wake-up less per call on
/// each side). The process still runs them one at a time, in order.
const PIPELINED: usize = 32;

type Answer = tokio::sync::oneshot::Sender<Result<Vec<u8>, WorkerError>>;

/// The calls of an actor that runs them one after another: written to its process as they
/// come, answered oldest first (the process answers in order), by a supervisor task that
/// reads the answers and, when the process dies, starts the next one for the calls left.
struct Line {
    state: Arc<LineState>,
    supervisor: tokio::task::JoinHandle<()>,
}

impl Drop for Line {
    fn drop(&mut self) {
        // The supervisor owns the process: stopping it kills the process.
        self.supervisor.abort();
        self.state.calls().close();
    }
}

struct LineState {
    calls: std::sync::Mutex<Calls>,
    /// Signalled when a call waits and no process runs.
    wanted: tokio::sync::Notify,
}

#[derive(Default)]
struct Calls {
    /// Calls given to the process, or to give to the next one, oldest first: each as its
    /// frame (length and request), kept until answered for a next process.
    waiting: std::collections::VecDeque<(bytes::Bytes, Answer)>,
    /// The running process's stdin.
    pipe: Pipe,
    /// The writer task while [`Pipe::Busy`]: stopped when its process dies or the actor
    /// stops (a pipe whose reader never drains would hold it forever).
    writer: Option<tokio::task::AbortHandle>,
    /// Counts the processes: a writer of an earlier one leaves the pipe alone.
    generation: u64,
    /// How the last process died when no call was in it: the next call is answered with
    /// it, as it would have found the process dead.
    died: Option<WorkerError>,
    /// Why every call fails from now on (restarts exhausted, or a restart failed).
    dead: Option<WorkerError>,
}

/// The stdin of a [`Line`]'s process.
#[derive(Default)]
enum Pipe {
    /// No process runs, or its stdin broke (it is dying): frames wait for the next one.
    #[default]
    Closed,
    /// Nothing is being written: a frame is written at once, by the caller's task.
    Idle(tokio::process::ChildStdin),
    /// A writer task has the stdin (a frame did not fit the pipe): these frames follow.
    Busy(std::collections::VecDeque<bytes::Bytes>),
}

/// How much of a frame a write that does not wait wrote.
enum Written {
    All,
    /// This many bytes; the rest must wait for room in the pipe.
    Part(usize),
    Broken,
}

/// Writes what of `frame` the pipe takes now, without waiting.
fn write_now(stdin: &mut tokio::process::ChildStdin, frame: &[u8]) -> Written {
    use tokio::io::AsyncWrite;
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    let mut done = 0;
    while done < frame.len() {
        match std::pin::Pin::new(&mut *stdin).poll_write(&mut context, &frame[done..]) {
            std::task::Poll::Ready(Ok(0)) | std::task::Poll::Ready(Err(_)) => return Written::Broken,
            std::task::Poll::Ready(Ok(n)) => done += n,
            std::task::Poll::Pending => return Written::Part(done),
        }
    }
    Written::All
}

impl Calls {
    /// Closes the pipe: frames wait for the next process; a writer task stops.
    fn close(&mut self) {
        self.pipe = Pipe::Closed;
        if let Some(writer) = self.writer.take() {
            writer.abort();
        }
    }

    /// Gives `frame` to the running process: written here when the pipe is idle and takes
    /// it whole (no task woken for it), else by a writer task, after the frames before it.
    fn send(&mut self, frame: bytes::Bytes, state: &Arc<LineState>) {
        match &mut self.pipe {
            Pipe::Closed => {}
            Pipe::Busy(backlog) => backlog.push_back(frame),
            Pipe::Idle(stdin) => match write_now(stdin, &frame) {
                Written::All => {}
                Written::Broken => self.pipe = Pipe::Closed,
                Written::Part(done) => {
                    let Pipe::Idle(stdin) = std::mem::replace(&mut self.pipe, Pipe::Busy(Default::default())) else {
                        return;
                    };
                    let writer = tokio::spawn(write_rest(state.clone(), self.generation, stdin, frame.slice(done..)));
                    self.writer = Some(writer.abort_handle());
                }
            },
        }
    }
}

/// Writes `rest` and then the frames queued behind it, waiting for room in the pipe; gives
/// the stdin back once none are left.
async fn write_rest(
    state: Arc<LineState>,
    generation: u64,
    mut stdin: tokio::process::ChildStdin,
    mut rest: bytes::Bytes,
) {
    loop {
        let written = stdin.write_all(&rest).await;
        let mut calls = state.calls();
        if calls.generation != generation {
            // Its process died and another runs: this stdin is not that one's.
            return;
        }
        if written.is_err() {
            // The process is dying: its supervisor sees its stdout end.
            calls.pipe = Pipe::Closed;
            calls.writer = None;
            return;
        }
        let next = match &mut calls.pipe {
            Pipe::Busy(backlog) => backlog.pop_front(),
            _ => return,
        };
        match next {
            Some(frame) => rest = frame,
            None => {
                calls.pipe = Pipe::Idle(stdin);
                calls.writer = None;
                return;
            }
        }
    }
}

impl LineState {
    fn calls(&self) -> std::sync::MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `request` to the process (in the order calls come), or to the next one.
    fn call(self: &Arc<Self>, request: Vec<u8>) -> futures::future::BoxFuture<'static, Result<Vec<u8>, WorkerError>> {
        let Some(len) = frame_length(request.len()) else {
            return Box::pin(std::future::ready(Err(WorkerError::TooLarge(request.len()))));
        };
        let (answer, answered) = tokio::sync::oneshot::channel();
        {
            let mut calls = self.calls();
            if let Some(why) = calls.died.take().or_else(|| calls.dead.clone()) {
                return Box::pin(std::future::ready(Err(why)));
            }
            let mut frame = Vec::with_capacity(4 + request.len());
            frame.extend_from_slice(&len.to_be_bytes());
            frame.extend_from_slice(&request);
            let frame = bytes::Bytes::from(frame);
            if matches!(calls.pipe, Pipe::Closed) && calls.waiting.is_empty() {
                // No process runs (it died before): the supervisor starts the next.
                self.wanted.notify_one();
            }
            calls.send(frame.clone(), self);
            calls.waiting.push_back((frame, answer));
        }
        Box::pin(async move { answered.await.unwrap_or(Err(WorkerError::Gone)) })
    }

    /// Fails every waiting call with `why`, and every later one.
    fn kill(&self, why: WorkerError) {
        let mut calls = self.calls();
        for (_, answer) in calls.waiting.drain(..) {
            let _ = answer.send(Err(why.clone()));
        }
        calls.close();
        calls.dead = Some(why);
    }
}

/// Runs the processes of a [`Line`]: answers its calls from the process's answers, oldest
/// first; when the process dies, fails the call in it with the cause and, while restarts
/// are left, starts the next process once a call waits, which is given the calls that were
/// written to the dead one after the one in it (they never started: the process runs one
/// at a time).
async fn supervise(state: Arc<LineState>, start: Start, mut process: Executor) {
    let mut restarts = 0;
    loop {
        let Executor {
            mut child,
            stdin,
            stdout,
            ..
        } = process;
        let pid = child.id().unwrap_or(0);
        // Buffered: an answer's length and bytes in one read.
        let mut stdout = tokio::io::BufReader::with_capacity(64 * 1024, stdout);
        {
            let mut calls = state.calls();
            calls.generation += 1;
            calls.pipe = Pipe::Idle(stdin);
            let frames: Vec<bytes::Bytes> = calls.waiting.iter().map(|(frame, _)| frame.clone()).collect();
            for frame in frames {
                calls.send(frame, &state);
            }
        }
        let why = loop {
            match read_frame(&mut stdout).await {
                Ok(answer) => match state.calls().waiting.pop_front() {
                    Some((_, to)) => {
                        let _ = to.send(Ok(answer));
                    }
                    None => break WorkerError::Unasked,
                },
                Err(e) => {
                    let ending = match child.try_wait() {
                        Ok(Some(status)) => Ending::Exited(status),
                        _ => Ending::PipeBroke(Arc::new(e)),
                    };
                    break WorkerError::Died { pid, ending };
                }
            }
        };
        // Killed if it still runs.
        drop(child);
        state.calls().close();
        // A moment for the node's log to hold the process's last words before its caller
        // hears of its death (calls that come meanwhile wait for the next process).
        tokio::time::sleep(Duration::from_millis(50)).await;
        {
            let mut calls = state.calls();
            // The call in it; or, when it died between calls, the first to find it dead (as
            // a call written to a dead pipe did). An answer nobody asked for is no call's
            // fault: the calls waiting go to the next process.
            if !matches!(why, WorkerError::Unasked) {
                match calls.waiting.pop_front() {
                    Some((_, to)) => {
                        let _ = to.send(Err(why.clone()));
                    }
                    None => calls.died = Some(why.clone()),
                }
            }
        }
        if restarts >= start.args.max_restarts {
            state.kill(WorkerError::Exhausted {
                cause: Box::new(why),
                max_restarts: start.args.max_restarts,
            });
            return;
        }
        // The next process starts when a call needs it.
        while state.calls().waiting.is_empty() {
            state.wanted.notified().await;
        }
        restarts += 1;
        process = match start.run().await {
            Ok(next) => next,
            Err(why) => {
                state.kill(WorkerError::Restart(Box::new(why)));
                return;
            }
        };
    }
}

/// A frame's length prefix, for `len` bytes within [`MAX_FRAME`].
fn frame_length(len: usize) -> Option<u32> {
    u32::try_from(len).ok().filter(|n| *n as usize <= MAX_FRAME)
}

async fn write_frame(to: &mut (impl AsyncWriteExt + Unpin), bytes: &[u8]) -> std::io::Result<()> {
    let len = frame_length(bytes.len())
        .ok_or_else(|| std::io::Error::other(format!("a frame of {} bytes is over the 2 GiB limit", bytes.len())))?;
    if bytes.len() <= ONE_WRITE_MAX {
        // One write: the process wakes once, to a whole frame.
        let mut frame = Vec::with_capacity(4 + bytes.len());
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(bytes);
        to.write_all(&frame).await?;
    } else {
        to.write_all(&len.to_be_bytes()).await?;
        to.write_all(bytes).await?;
    }
    to.flush().await
}

async fn read_frame(from: &mut (impl AsyncReadExt + Unpin)) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "a frame of {len} bytes is over the 2 GiB limit"
        )));
    }
    let mut bytes = vec![0u8; len];
    from.read_exact(&mut bytes).await?;
    Ok(bytes)
}

/// What starts an actor's process: its arguments, its GPUs and its context.
struct Start {
    args: PythonArgs,
    gpus: Vec<u32>,
    ctx: ActorContext,
}

impl Start {
    /// Starts the process and runs the constructor.
    async fn run(&self) -> Result<Executor, WorkerError> {
        let mut env = self.args.env.clone();
        let inherited = std::env::var("PYTHONPATH").ok().filter(|p| !p.is_empty());
        let path: Vec<String> = self.args.path.iter().cloned().chain(inherited).collect();
        if !path.is_empty() {
            env.push(("PYTHONPATH".into(), path.join(":")));
        }
        env.push(("PYTHONUNBUFFERED".into(), "1".into()));
        env.push((
            "REGATTA_MAX_CONCURRENCY".into(),
            self.args.max_concurrency.max(1).to_string(),
        ));
        let mut process = executor::launch(&Launch {
            executor: Some(self.args.python.clone()),
            args: vec!["-m".into(), "regatta._worker".into()],
            env,
            gpus: self.gpus.clone(),
            capture_stderr: true,
            storage: false,
        })
        .map_err(|cause| WorkerError::Launch {
            python: self.args.python.clone(),
            cause: Arc::new(cause),
        })?;
        if let Some(stderr) = process.stderr.take() {
            let ctx = self.ctx.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncBufReadExt;
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    match line.strip_prefix(LIVE_MARK) {
                        Some(live) => match live.strip_prefix(MARK_LIVE).map(str::parse) {
                            Some(Ok(count)) => ctx.mark_live(count),
                            _ => ctx.log_live(live),
                        },
                        None => ctx.log(line),
                    }
                }
            });
        }
        let answer = exchange(&mut process, &self.args.init).await?;
        match answer.split_first() {
            Some((b'O', _)) => Ok(process),
            Some((b'E', text)) => Err(WorkerError::Constructor(String::from_utf8_lossy(text).into_owned())),
            _ => Err(WorkerError::UnknownFrame),
        }
    }
}

/// Hands a started process to its calls running beside each other: a reader task routes
/// each answer (its first 8 bytes name the call) and fails every call when the process ends.
fn share(process: Executor) -> Arc<Shared> {
    let Executor {
        child,
        stdin,
        mut stdout,
        ..
    } = process;
    let pid = child.id().unwrap_or(0);
    let shared = Arc::new(Shared {
        stdin: tokio::sync::Mutex::new(stdin),
        waiters: std::sync::Mutex::new(Waiters::new()),
        dead: std::sync::Mutex::new(None),
        next: std::sync::atomic::AtomicU64::new(0),
        _child: std::sync::Mutex::new(child),
    });
    let reader = Arc::downgrade(&shared);
    tokio::spawn(async move {
        loop {
            let frame = read_frame(&mut stdout).await;
            let Some(shared) = reader.upgrade() else { return };
            match frame {
                Ok(frame) if frame.len() >= 8 => {
                    let key = u64::from_be_bytes(frame[..8].try_into().unwrap_or_default());
                    let waiter = shared.waiters.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
                    if let Some(waiter) = waiter {
                        let _ = waiter.send(Ok(frame[8..].to_vec()));
                    }
                }
                Ok(_) => {
                    shared.fail_all(&WorkerError::NoCallNumber);
                    return;
                }
                Err(_) => {
                    shared.fail_all(&WorkerError::DiedBeside { pid });
                    return;
                }
            }
        }
    });
    shared
}

/// Sends one frame and reads the answer; a process that dies on the way is described.
async fn exchange(process: &mut Executor, request: &[u8]) -> Result<Vec<u8>, WorkerError> {
    let sent = write_frame(&mut process.stdin, request).await;
    let answer = match sent {
        Ok(()) => read_frame(&mut process.stdout).await,
        Err(e) => Err(e),
    };
    answer.map_err(|e| {
        let ending = match process.child.try_wait() {
            Ok(Some(status)) => Ending::Exited(status),
            _ => Ending::PipeBroke(Arc::new(e)),
        };
        WorkerError::Died {
            pid: process.child.id().unwrap_or(0),
            ending,
        }
    })
}

impl Actor for PythonActor {
    const KIND: &'static str = "regatta.python";
    type Args = PythonArgs;
    type Request = Vec<u8>;
    type Reply = Vec<u8>;

    async fn create(args: PythonArgs, ctx: &ActorContext) -> Result<Self, ActorError> {
        let concurrent = args.max_concurrency > 1;
        let limit = args.max_concurrency.max(1) as usize;
        let start = Start {
            gpus: ctx.gpu_ids().to_vec(),
            ctx: ctx.clone(),
            args,
        };
        let process = start.run().await?;
        if concurrent {
            return Ok(Self {
                line: None,
                shared: Some(share(process)),
                limit,
            });
        }
        let state = Arc::new(LineState {
            calls: std::sync::Mutex::default(),
            wanted: tokio::sync::Notify::new(),
        });
        let supervisor = tokio::spawn(supervise(state.clone(), start, process));
        Ok(Self {
            line: Some(Line { state, supervisor }),
            shared: None,
            limit: PIPELINED,
        })
    }

    async fn handle(&mut self, request: Vec<u8>, ctx: &ActorContext) -> Result<Vec<u8>, ActorError> {
        // Every call goes through `handle_concurrently`; this is its path all the same.
        match self.handle_concurrently(request, ctx) {
            Some(call) => call.await,
            None => Err(WorkerError::NotRunning.into()),
        }
    }

    fn max_concurrency(&self) -> usize {
        self.limit
    }

    fn handle_concurrently(
        &self,
        request: Vec<u8>,
        _ctx: &ActorContext,
    ) -> Option<futures::future::BoxFuture<'static, Result<Vec<u8>, ActorError>>> {
        if let Some(line) = &self.line {
            let call = line.state.call(request);
            return Some(Box::pin(async move { call.await.map_err(ActorError::from) }));
        }
        let shared = self.shared.clone()?;
        Some(Box::pin(
            async move { shared.call(request).await.map_err(ActorError::from) },
        ))
    }
}
