//! A driver's connection to a cluster (a local one it started, or a running head), and
//! the placement groups and objects it holds.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::sync::{mpsc, oneshot};

use regatta::local::{LocalCluster, LocalOptions, WorkerSpec};
use regatta::{
    ActorId, ActorOptions, Client, ObjectId, ObjectRef, PlacementGroup, PythonActor, PythonArgs, Resources, Strategy,
    View, ViewQuery,
};

use crate::object::{Held, Object};
use crate::pending::{settle, Pending, Slot};
use crate::{error, placing_error, runtime, CALL_TIMEOUT};

/// Objects of at least this many bytes are lent to Python in place ([`Held`]) rather than
/// copied into a `bytes`: the Python side's `_SHARED_MIN`, the store's shared-memory floor.
const LEND_MIN_BYTES: usize = 1 << 20;

/// A placement group: bundles of resources reserved together.
#[pyclass(module = "regatta._native")]
pub(crate) struct Group {
    group: PlacementGroup,
}

#[pymethods]
impl Group {
    /// The group's id.
    #[getter]
    fn id(&self) -> String {
        self.group.id().to_string()
    }

    /// Waits up to `timeout` seconds for every bundle to be reserved: the node of each
    /// bundle, or None when the time ran out.
    fn ready(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Vec<String>>> {
        if !timeout.is_finite() || timeout < 0.0 {
            return Err(PyValueError::new_err(format!(
                "timeout must be a number >= 0, not {timeout}"
            )));
        }
        let group = self.group.clone();
        match py.detach(|| runtime().block_on(group.ready(Duration::from_secs_f64(timeout)))) {
            Ok(nodes) => Ok(Some(nodes)),
            Err(regatta::Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(error(e)),
        }
    }

    /// Removes the group: its actors are killed and its resources freed.
    fn remove(&self, py: Python<'_>) -> PyResult<()> {
        let group = self.group.clone();
        py.detach(|| runtime().block_on(group.remove())).map_err(error)
    }
}

/// What the driver keeps of an actor it calls: its handle (which remembers where the actor
/// runs, so a call does not ask the head), its calls in flight, and the queue that writes
/// its calls in order while some are in flight.
struct Lane {
    handle: regatta::ActorHandle<PythonActor>,
    in_flight: Arc<AtomicUsize>,
    queue: Option<mpsc::UnboundedSender<Next>>,
}

/// What an actor's call queue does next.
enum Next {
    /// Sends a call once the one before is written (or ended).
    Call(Vec<u8>, Arc<Slot>),
    /// Waits until a call started on the caller's thread is written (or ended).
    After(oneshot::Receiver<()>),
}

fn closed() -> PyErr {
    PyRuntimeError::new_err("the call queue is closed")
}

impl Lane {
    /// The actor's call queue, started on first use: each call goes once the one before it
    /// is on the wire (calls reach the actor in the order they were written).
    fn queue(&mut self, cluster: &regatta::Cluster) -> mpsc::UnboundedSender<Next> {
        if let Some(queue) = self.queue.as_ref().filter(|q| !q.is_closed()) {
            return queue.clone();
        }
        let (queue, mut next) = mpsc::unbounded_channel::<Next>();
        let (handle, cluster) = (self.handle.clone(), cluster.clone());
        runtime().spawn(async move {
            while let Some(item) = next.recv().await {
                let written = match item {
                    Next::After(written) => written,
                    Next::Call(request, slot) => {
                        let (sent, written) = oneshot::channel();
                        let (handle, cluster) = (handle.clone(), cluster.clone());
                        tokio::spawn(async move {
                            let result = handle.call_pipelined(request, CALL_TIMEOUT, sent).await;
                            settle(&cluster, &slot, result).await;
                        });
                        written
                    }
                };
                let _ = written.await;
            }
        });
        self.queue = Some(queue.clone());
        queue
    }
}

/// `written` while the call behind it may still be written (neither written nor ended).
fn still_unwritten(mut written: oneshot::Receiver<()>) -> Option<oneshot::Receiver<()>> {
    matches!(written.try_recv(), Err(oneshot::error::TryRecvError::Empty)).then_some(written)
}

/// Runs `call` on this thread until it waits (a call's request is written here, on the
/// caller's thread, when its connection is open and free: no hand-off to a runtime thread
/// before it goes), then leaves the rest (waiting for the answer) to the runtime, but only
/// once something wakes it: a spawn from this thread would wake a parked runtime thread for
/// every call, only to poll the call once and park again, on the cores the actor's node and
/// process need. Woken (its answer came, on a runtime thread), it is spawned from there:
/// onto that thread's own queue, with no other thread woken.
fn start_here(call: impl Future<Output = ()> + Send + 'static) {
    let mut call: Call = Box::pin(call);
    let parked = Arc::new(Parked(Mutex::new(Parking::Polling)));
    let waker = Waker::from(parked.clone());
    let _runtime = runtime().enter();
    if call.as_mut().poll(&mut Context::from_waker(&waker)).is_ready() {
        return;
    }
    let mut state = parked.0.lock().unwrap_or_else(|p| p.into_inner());
    if matches!(*state, Parking::Woken) {
        // Woken while this thread polled it: nothing else will spawn it.
        *state = Parking::Spawned;
        drop(state);
        runtime().spawn(call);
    } else {
        *state = Parking::Parked(call);
    }
}

type Call = std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Where a call started by [`start_here`] is until it is first woken.
enum Parking {
    /// Being polled by the caller's thread.
    Polling,
    /// Woken during that poll.
    Woken,
    /// Waiting, polled by no one: its first wake spawns it.
    Parked(Call),
    /// A task now: the runtime's own waker wakes it from here on.
    Spawned,
}

/// The waker of a call started by [`start_here`].
struct Parked(Mutex<Parking>);

impl std::task::Wake for Parked {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match std::mem::replace(&mut *state, Parking::Spawned) {
            Parking::Polling => *state = Parking::Woken,
            Parking::Parked(call) => {
                drop(state);
                runtime().spawn(call);
            }
            Parking::Woken => *state = Parking::Woken,
            Parking::Spawned => {}
        }
    }
}

/// A driver's connection to a cluster.
#[pyclass(module = "regatta._native")]
pub(crate) struct Cluster {
    client: Mutex<Option<Client>>,
    local: Mutex<Option<LocalCluster>>,
    lanes: Arc<Mutex<HashMap<u64, Lane>>>,
    address: String,
}

impl Cluster {
    fn cluster(&self) -> PyResult<regatta::Cluster> {
        let client = self.client.lock().unwrap_or_else(|p| p.into_inner());
        client
            .as_ref()
            .map(|c| c.cluster().clone())
            .ok_or_else(|| PyRuntimeError::new_err("regatta is shut down: call regatta.init() first"))
    }
}

#[pymethods]
impl Cluster {
    /// Starts a head and workers as processes of the `regatta` binary (`binary`, else
    /// `REGATTA_BIN` or `regatta` on PATH) and connects to it. `workers` are
    /// `(name, resources)` pairs such as `("worker-0", "CPU=8")`.
    #[staticmethod]
    #[pyo3(signature = (workers, binary=None, log_dir=None))]
    fn start_local(
        py: Python<'_>,
        workers: Vec<(String, String)>,
        binary: Option<String>,
        log_dir: Option<String>,
    ) -> PyResult<Self> {
        let specs = workers
            .iter()
            .map(|(name, resources)| WorkerSpec::new(name, resources))
            .collect();
        let mut options = match binary {
            Some(binary) => LocalOptions::with_binary(specs, binary.into()),
            None => LocalOptions::new(specs).map_err(error)?,
        };
        if let Some(dir) = log_dir {
            options.log_dir = dir.into();
        }
        py.detach(move || {
            let local = LocalCluster::start(options).map_err(|e| format!("{e:#}"))?;
            let client = runtime()
                .block_on(local.connect(Duration::from_secs(60)))
                .map_err(|e| {
                    format!(
                        "the local cluster did not come up: {e:#}\nhead log:\n{}",
                        local.log("head")
                    )
                })?;
            let address = local.address.clone();
            Ok::<_, String>(Self {
                client: Mutex::new(Some(client)),
                local: Mutex::new(Some(local)),
                lanes: Arc::default(),
                address,
            })
        })
        .map_err(PyRuntimeError::new_err)
    }

    /// Connects to a running head (`host:port`) with the cluster token.
    #[staticmethod]
    fn connect(py: Python<'_>, address: String, token: String) -> PyResult<Self> {
        let client = py
            .detach(|| runtime().block_on(Client::connect(&address, &token)))
            .map_err(error)?;
        Ok(Self {
            client: Mutex::new(Some(client)),
            local: Mutex::new(None),
            lanes: Arc::default(),
            address,
        })
    }

    /// The head's cluster address.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// The local cluster's job API (`https://127.0.0.1:PORT`), when this driver started one.
    #[getter]
    fn job_address(&self) -> Option<String> {
        let local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        local.as_ref().map(|l| l.job_address.clone())
    }

    /// The local cluster's token, when this driver started one.
    #[getter]
    fn token(&self) -> Option<String> {
        let local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        local.as_ref().map(|l| l.token.clone())
    }

    /// The local cluster's head log folder, when this driver started one.
    fn log_dir(&self) -> Option<String> {
        let local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        local
            .as_ref()
            .and_then(|l| l.log_path("head").parent().map(|p| p.display().to_string()))
    }

    /// Spawns a Python actor; returns its id. `resources` is a resource list
    /// (`CPU=1,GPU=1`); the constructor runs when the actor is placed (its failure makes
    /// the actor dead, seen at its first call).
    #[pyo3(signature = (init, python, path, resources, name=None, max_restarts=0, env=Vec::new(), group=None, bundle=None, max_concurrency=1))]
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        &self,
        py: Python<'_>,
        init: Vec<u8>,
        python: String,
        path: Vec<String>,
        resources: String,
        name: Option<String>,
        max_restarts: u32,
        env: Vec<(String, String)>,
        group: Option<PyRef<'_, Group>>,
        bundle: Option<usize>,
        max_concurrency: u32,
    ) -> PyResult<u64> {
        let cluster = self.cluster()?;
        let resources = if resources.trim().is_empty() {
            Resources::default()
        } else {
            Resources::parse_request(&resources).map_err(|e| PyValueError::new_err(e.to_string()))?
        };
        let mut options = ActorOptions::new().resources(resources).max_restarts(max_restarts);
        if let Some(name) = name {
            options = options.name(name);
        }
        if let Some(group) = &group {
            options = options.in_group(&group.group, bundle);
        }
        let args = PythonArgs {
            python,
            path,
            env,
            init,
            max_restarts,
            max_concurrency: max_concurrency.max(1),
        };
        let handle = py
            .detach(|| runtime().block_on(cluster.spawn::<PythonActor>(args, options)))
            .map_err(placing_error)?;
        Ok(handle.id().0)
    }

    /// Reserves a placement group of `bundles` (resource lists) with `strategy` (`PACK`,
    /// `SPREAD`, `STRICT_PACK`, `STRICT_SPREAD`); fails at once when no nodes could ever
    /// hold it.
    fn create_group(&self, py: Python<'_>, bundles: Vec<String>, strategy: String) -> PyResult<Group> {
        let cluster = self.cluster()?;
        let strategy = strategy
            .parse::<Strategy>()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let bundles = bundles
            .iter()
            .map(|b| Resources::parse_request(b).map_err(|e| PyValueError::new_err(e.to_string())))
            .collect::<PyResult<Vec<_>>>()?;
        let group = py
            .detach(|| runtime().block_on(cluster.create_placement_group(bundles, strategy)))
            .map_err(placing_error)?;
        Ok(Group { group })
    }

    /// Sends `request` to actor `actor`. Calls from this driver to one actor reach it in
    /// order: each is written after the one before is on the wire, without waiting for its
    /// answer (pipelined); with `ordered` false (an actor whose calls run beside each
    /// other) each goes at once. With `end`, the actor exists for this one call (a task that
    /// asked for resources): it is killed as soon as the answer is here, so its resources are
    /// free again whether or not anyone ever reads the result.
    #[pyo3(signature = (actor, request, ordered=true, end=false))]
    fn call(&self, actor: u64, request: Vec<u8>, ordered: bool, end: bool) -> PyResult<Pending> {
        let cluster = self.cluster()?;
        let ender = end.then(|| (cluster.clone(), self.lanes.clone()));
        let finish = move || {
            if let Some((cluster, lanes)) = ender {
                // On the runtime, not in place: a call that fails at once ends inside its
                // first poll, on the caller's thread, which still holds `lanes` here.
                runtime().spawn(async move {
                    lanes.lock().unwrap_or_else(|p| p.into_inner()).remove(&actor);
                    // An error here is a worker that is gone already: nothing left to free.
                    let _ = cluster.kill(ActorId(actor)).await;
                });
            }
        };
        let mut lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let lane = lanes.entry(actor).or_insert_with(|| Lane {
            handle: cluster.handle::<PythonActor>(ActorId(actor)),
            in_flight: Arc::default(),
            queue: None,
        });
        // An idle actor's call is written here, on the caller's thread (no hand-off to a
        // runtime thread before it goes: what a caller waiting on each answer pays for);
        // while calls are in flight, runtime threads write them, beside the caller's work.
        let idle = lane.in_flight.load(Ordering::Acquire) == 0;
        let slot = Arc::new(Slot::counted(lane.in_flight.clone()));
        let pending = Pending { slot: slot.clone() };
        let handle = lane.handle.clone();
        if !ordered {
            let call = async move {
                settle(&cluster, &slot, handle.call_timeout(request, CALL_TIMEOUT).await).await;
                finish();
            };
            if idle {
                start_here(call);
            } else {
                runtime().spawn(call);
            }
            return Ok(pending);
        }
        if !idle && !end {
            // Every call in flight was written, or is ahead of this one in the queue.
            lane.queue(&cluster)
                .send(Next::Call(request, slot))
                .map_err(|_| closed())?;
            return Ok(pending);
        }
        let (sent, written) = oneshot::channel();
        let settler = cluster.clone();
        start_here(async move {
            let result = handle.call_pipelined(request, CALL_TIMEOUT, sent).await;
            settle(&settler, &slot, result).await;
            finish();
        });
        if let Some(written) = still_unwritten(written) {
            // Not written yet (its route is being looked up): later calls wait for it.
            lane.queue(&cluster).send(Next::After(written)).map_err(|_| closed())?;
        }
        Ok(pending)
    }

    /// Stores `parts`, concatenated, as one object in this node's object store.
    fn put(&self, py: Python<'_>, parts: Vec<pyo3::pybacked::PyBackedBytes>) -> PyResult<Object> {
        let cluster = self.cluster()?;
        let total = parts.iter().map(|p| p.len()).sum();
        let mut bytes = Vec::with_capacity(total);
        for part in &parts {
            bytes.extend_from_slice(part);
        }
        let reference = py
            .detach(|| runtime().block_on(cluster.put_bytes(bytes)))
            .map_err(error)?;
        Ok(Object { reference })
    }

    /// Stores the object a Python driver wrote into memfd `fd` (made with
    /// `MFD_ALLOW_SEALING`, no mapping of it left): sealed here and kept as it is, so the
    /// put's one copy was the write. The caller keeps and closes its own `fd`.
    fn put_memfd(&self, py: Python<'_>, fd: i32) -> PyResult<Object> {
        let cluster = self.cluster()?;
        if fd < 0 {
            return Err(PyValueError::new_err(format!("bad file descriptor {fd}")));
        }
        // A second open of the same file (through /proc) that this side owns, writable as
        // sealing needs; the caller's descriptor stays the caller's.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))
            .map_err(|e| error(format!("cannot open the object's file (descriptor {fd}): {e}")))?;
        let segment = regatta_object_store::Segment::seal(file).map_err(error)?;
        let reference = py
            .detach(|| runtime().block_on(cluster.put_segment(segment)))
            .map_err(error)?;
        Ok(Object { reference })
    }

    /// An object's contents: `bytes` (a copy) for one under [`LEND_MIN_BYTES`], else a
    /// [`Held`] lending the store's own bytes (its shared-memory mapping on this host, or
    /// the buffer a pull from another node received into), which Python views in place.
    fn read<'py>(&self, py: Python<'py>, object: PyRef<'py, Object>) -> PyResult<Bound<'py, PyAny>> {
        let cluster = self.cluster()?;
        let reference = object.reference.clone();
        let bytes = py
            .detach(|| runtime().block_on(cluster.get_bytes(&reference)))
            .map_err(error)?;
        if bytes.len() < LEND_MIN_BYTES {
            return Ok(PyBytes::new(py, &bytes).into_any());
        }
        Ok(Bound::new(py, Held { bytes })?.into_any())
    }

    /// An object by id (a reference received from elsewhere; held from its first read).
    fn object(&self, id: &str) -> PyResult<Object> {
        let id: ObjectId = id
            .parse()
            .map_err(|e| PyValueError::new_err(format!("bad object id {id:?}: {e}")))?;
        Ok(Object {
            reference: ObjectRef::from_id(id),
        })
    }

    /// Kills an actor (it is not restarted).
    fn kill(&self, py: Python<'_>, actor: u64) -> PyResult<()> {
        let cluster = self.cluster()?;
        self.lanes.lock().unwrap_or_else(|p| p.into_inner()).remove(&actor);
        py.detach(|| runtime().block_on(cluster.kill(ActorId(actor))))
            .map_err(error)
    }

    /// The node the actor runs (or last ran) on, and its log lines there after line number
    /// `after` (the node's own numbering), as `(number, live, text)`: what the driver
    /// follows of a long call (`live` lines are the ones the call's worker marked for its
    /// caller).
    #[allow(clippy::type_complexity)]
    fn actor_logs(
        &self,
        py: Python<'_>,
        actor: u64,
        after: u64,
    ) -> PyResult<(Option<String>, Vec<(u64, bool, String)>)> {
        let cluster = self.cluster()?;
        let (node, lines) = py
            .detach(|| runtime().block_on(cluster.actor_logs(ActorId(actor), after)))
            .map_err(error)?;
        Ok((
            node,
            lines.into_iter().map(|line| (line.seq, line.live, line.text)).collect(),
        ))
    }

    /// For an actor waiting for resources (pending, or restarting elsewhere): `(seconds
    /// waited, resources it asks for)`; None once it is placed (or gone).
    fn actor_waiting(&self, py: Python<'_>, actor: u64) -> PyResult<Option<(f64, String)>> {
        let cluster = self.cluster()?;
        let view = py
            .detach(|| runtime().block_on(cluster.view(ViewQuery::Actor(ActorId(actor)))))
            .map_err(error)?;
        Ok(match view {
            View::Actor(Some(row)) => row.waiting_s.map(|waited| (waited, row.resources.to_string())),
            _ => None,
        })
    }

    /// The id of the live actor named `name`, if any.
    fn named(&self, py: Python<'_>, name: String) -> PyResult<Option<u64>> {
        let cluster = self.cluster()?;
        let found = py
            .detach(|| runtime().block_on(cluster.named::<PythonActor>(&name)))
            .map_err(error)?;
        Ok(found.map(|h| h.id().0))
    }

    /// The nodes: `(name, state, total resources, available resources)`, resources as
    /// `{name: amount}`.
    #[allow(clippy::type_complexity)]
    fn nodes(&self, py: Python<'_>) -> PyResult<Vec<(String, String, HashMap<String, f64>, HashMap<String, f64>)>> {
        let cluster = self.cluster()?;
        let status = py.detach(|| runtime().block_on(cluster.status())).map_err(error)?;
        Ok(status
            .nodes
            .iter()
            .map(|n| {
                let mut available = n.total.clone();
                available.subtract(&n.used);
                (n.name.clone(), n.state.clone(), amounts(&n.total), amounts(&available))
            })
            .collect())
    }

    /// Disconnects, and stops the local cluster this driver started.
    fn shutdown(&self, py: Python<'_>) {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let client = self.client.lock().unwrap_or_else(|p| p.into_inner()).take();
        let local = self.local.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(move || {
            drop(client);
            if let Some(mut local) = local {
                local.shutdown();
            }
        });
    }
}

fn amounts(resources: &Resources) -> HashMap<String, f64> {
    resources.to_units().into_iter().collect()
}
