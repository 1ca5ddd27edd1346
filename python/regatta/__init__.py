"""Regatta from Python, in Ray's shape.

    import regatta

    regatta.init()                      # a local cluster for this script, like ray.init()

    @regatta.remote
    def square(x):
        return x * x

    @regatta.remote(num_cpus=1, max_restarts=2)
    class Counter:
        def __init__(self, start):
            self.total = start
        def add(self, n):
            self.total += n
            return self.total

    print(sum(regatta.get([square.remote(i) for i in range(100)])))
    counter = Counter.remote(10)
    print(regatta.get(counter.add.remote(5)))

Functions run on a pool of reusable Python worker processes; each actor is one Python
process on a worker node (the ``regatta.python`` actor kind), placed, restarted and
accounted by the cluster like any other actor. Values travel pickled with cloudpickle.
"""

import asyncio
import atexit
import collections
import ctypes
import inspect
import itertools
import mmap
import os
import pickle
import shutil
import struct
import sys
import threading
import time

import cloudpickle

from . import _native
from .exceptions import (ActorDiedError, GetTimeoutError, InfeasibleError, RegattaError, TaskError,
                         WorkerCrashedError)

__all__ = [
    "init", "shutdown", "is_initialized", "remote", "get", "put", "wait", "kill", "get_actor",
    "cluster_resources", "available_resources", "nodes", "ObjectRef", "ActorHandle",
    "TaskError", "ActorDiedError", "WorkerCrashedError", "GetTimeoutError", "InfeasibleError", "RegattaError",
]

_driver = None
_driver_lock = threading.Lock()

# Options Regatta carries out, for functions and for classes.
_FUNCTION_OPTIONS = {"num_cpus", "num_gpus", "memory", "resources", "accelerator_type", "max_retries", "name",
                     "scheduling_strategy", "num_returns", "runtime_env"}
_ACTOR_OPTIONS = {"num_cpus", "num_gpus", "memory", "resources", "accelerator_type", "name", "lifetime",
                  "max_restarts", "max_task_retries", "scheduling_strategy", "max_concurrency", "runtime_env"}
# Ray's options that Regatta does not carry out yet: refused by name, never ignored.
_NOT_YET = {"placement_group", "concurrency_groups",
            "retry_exceptions", "label_selector"}


# A call that has run this long has its prints followed live (the worker's _LIVE_AFTER);
# followed actors' logs are read this often.
_LIVE_AFTER = 1.0
_FOLLOW_EVERY = 0.5
# How long an ended call's actor is still read (its last lines may come after its answer).
_ENDED_GRACE = 1.0
# A call whose actor has waited this long for resources is warned about (once per actor).
_WAITING_WARN_AFTER = float(os.environ.get("REGATTA_WAITING_WARN_AFTER", "10"))


class _Follower:
    """Prints what calls print while they run (Ray's ``log_to_driver``): a call that runs
    longer than a second, and every call of an actor that runs calls beside each other,
    writes its prints marked live into its actor's log; a thread here reads those actors'
    new lines every half second while such calls run (and for a second after they end) and
    prints them prefixed. Shorter calls' prints come with their answers instead (``_decode``)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.calls = collections.deque()  # (actor, what, started, pending, concurrent), in call order
        self.followed = {}  # actor -> [(what, started, pending, seen ended at)] of calls followed
        self.seen = {}  # (actor, node) -> number of the last log line printed there
        self.nodes = {}  # actor -> the node its lines were last read on
        self.warned = set()  # actors said to be waiting for resources
        self.lock = threading.Lock()
        self.thread = None
        self.stopped = threading.Event()

    def call(self, actor, what, pending, concurrent):
        """Notes a call just made (cheap: most calls end before they are looked at)."""
        self.calls.append((actor, what, time.monotonic(), pending, concurrent))
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(target=self.run, daemon=True, name="regatta-logs")
                    self.thread.start()

    def run(self):
        while not self.stopped.wait(_FOLLOW_EVERY):
            self.tick()

    def tick(self):
        with self.lock:
            now = time.monotonic()
            # Calls old enough to be followed (or of a concurrent actor) become followed;
            # a call that already ended in its first second printed through its answer.
            while self.calls and (self.calls[0][4] or now - self.calls[0][2] >= _LIVE_AFTER):
                actor, what, started, pending, concurrent = self.calls.popleft()
                if concurrent or not pending.done():
                    self.followed.setdefault(actor, []).append((what, started, pending, None))
            for actor, calls in list(self.followed.items()):
                # A call's last lines can reach its node's log just after its answer reached
                # here: an ended call is let go only after a read a grace period later.
                for i, (what, started, pending, ended) in enumerate(calls):
                    if ended is None and pending.done():
                        calls[i] = (what, started, pending, now)
                self.print_new(actor, calls[0][0].removeprefix("task "))
                left = [call for call in calls if call[3] is None or now - call[3] < _ENDED_GRACE]
                if left:
                    self.followed[actor] = left
                    waiting = [call for call in left if call[3] is None]
                    if waiting and now - waiting[0][1] >= _WAITING_WARN_AFTER:
                        self.warn_if_waiting(actor, waiting[0][0])
                else:
                    del self.followed[actor]

    def warn_if_waiting(self, actor, what):
        """Says once, as Ray does, when a call's actor has waited long for resources that no
        node has free (an actor asking for more than any node has is refused at once)."""
        if actor in self.warned:
            return
        try:
            waiting = self.cluster.actor_waiting(actor)
        except Exception:
            return
        if waiting is not None and waiting[0] >= _WAITING_WARN_AFTER:
            self.warned.add(actor)
            print(f"regatta: warning: {what} has waited {waiting[0]:.0f} s for resources: it asks for "
                  f"{waiting[1] or 'nothing'}, which no node has free now (held by other actors or "
                  "reservations). It starts when they are freed; `regatta status` lists it pending.",
                  file=sys.stderr, flush=True)

    def print_new(self, actor, name):
        # Lines are numbered per node: an actor restarted on another node starts a cursor there.
        node = self.nodes.get(actor)
        try:
            node_now, lines = self.cluster.actor_logs(actor, self.seen.get((actor, node), 0))
        except Exception:  # the actor or its node is gone: its lines went with it
            return
        if node_now != node:
            self.nodes[actor] = node_now
            try:
                node_now, lines = self.cluster.actor_logs(actor, self.seen.get((actor, node_now), 0))
            except Exception:
                return
        # Only live lines move the cursor: a call's first lines are marked live after the
        # fact, so lines read unmarked are read again until a live line passes them.
        for number, live, text in lines:
            if live:
                self.seen[(actor, node_now)] = max(self.seen.get((actor, node_now), 0), number)
                print(f"({name}) {text}", flush=True)

    def stop(self):
        """Stops following, after a last read of the calls still followed (a moment after
        the last answers, whose lines may still be on their way into the nodes' logs)."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
            if self.followed or self.calls:
                time.sleep(_FOLLOW_EVERY / 2)
            self.tick()


class _Driver:
    def __init__(self, cluster, local, token):
        self.cluster = cluster
        self.local = local
        self.token = token
        self.lock = threading.Lock()
        self.task_workers = []
        self.turn = itertools.count()
        self.owned = set()  # actors this driver stops at shutdown (not detached)
        # One-call task workers (tasks with resources) -> their call (None until made): each
        # ends itself once it has answered, so an entry lasts only until then.
        self.one_call = {}
        self.python = sys.executable
        self.path = _worker_path()
        self.follower = _Follower(cluster)

    def call(self, actor, request, what, ordered=True, concurrent=False, end=False):
        """Calls an actor (or a task worker); its prints are followed while it runs. With
        ``end`` the actor is there for this call alone and is killed once it has answered."""
        pending = self.cluster.call(actor, request, ordered, end)
        if end:
            with self.lock:
                self.one_call[actor] = pending
        if log_to_driver:
            self.follower.call(actor, what, pending, concurrent)
        return pending

    def worker_env(self):
        """What a worker process needs to join the cluster as a driver of its own (to call
        actors it is handed, start tasks, ``get``) when its code asks."""
        return [("REGATTA_ADDRESS", self.cluster.address), ("REGATTA_TOKEN", self.token),
                (_WORKER_ENV, "1")]

    def spawn(self, init, resources, name=None, max_restarts=0, detached=False, strategy=None, max_concurrency=1,
              env_vars=None, one_call=False):
        group, bundle = _placement(strategy)
        env = list((env_vars or {}).items()) + self.worker_env()
        try:
            actor = self.cluster.spawn(init, self.python, self.path, resources, name, max_restarts, env,
                                       group, bundle, max_concurrency)
        except _native.Infeasible as error:
            raise InfeasibleError(f"no node could ever hold this request: {error}") from None
        if one_call:
            with self.lock:
                # Those that have answered have ended: only the rest are kept.
                self.one_call = {a: p for a, p in self.one_call.items() if p is None or not p.done()}
                self.one_call[actor] = None
        elif not detached:
            with self.lock:
                self.owned.add(actor)
        return actor

    def unfinished(self):
        """The actors this driver stops at shutdown: its own, and one-call task workers that
        have not answered."""
        with self.lock:
            return list(self.owned) + [a for a, p in self.one_call.items() if p is None or not p.done()]

    def task_worker(self):
        with self.lock:
            if not self.task_workers:
                size = max(1, min(32, int(_sum_resources(available=False).get("CPU", 1))))
                init = cloudpickle.dumps((None, (), {}))
                for _ in range(size):
                    actor = self.cluster.spawn(init, self.python, self.path, "", None, 1000, self.worker_env())
                    self.task_workers.append(actor)
                    self.owned.add(actor)
            return self.task_workers[next(self.turn) % len(self.task_workers)]

    def forget(self, actor):
        with self.lock:
            self.owned.discard(actor)
            self.one_call.pop(actor, None)
            if actor in self.task_workers:
                self.task_workers.remove(actor)


def _worker_path():
    """Where the worker processes find this package and the driver's modules."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen, path = set(), []
    for entry in [here] + [p or os.getcwd() for p in sys.path]:
        entry = os.path.abspath(entry)
        if entry not in seen and os.path.isdir(entry):
            seen.add(entry)
            path.append(entry)
    return path


# Set in the environment of the cluster's Python worker processes.
_WORKER_ENV = "REGATTA_PYTHON_WORKER"


def _binary():
    """The ``regatta`` binary a local cluster runs: ``REGATTA_BIN``, else the one this wheel
    carries (``regatta/bin/regatta``), else ``regatta`` on PATH; None when there is none."""
    if os.environ.get("REGATTA_BIN"):
        return os.environ["REGATTA_BIN"]
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "regatta")
    if os.access(bundled, os.X_OK):
        return bundled
    return shutil.which("regatta")


def _current():
    driver = _driver
    if driver is None and os.environ.get(_WORKER_ENV) == "1":
        # Code running in a task or an actor joins the cluster on first use.
        init(address="auto", ignore_reinit_error=True)
        driver = _driver
    if driver is None:
        raise RegattaError("regatta is not initialized: call regatta.init() first")
    return driver


def _read_token(token):
    if token:
        return token
    if os.environ.get("REGATTA_TOKEN"):
        return os.environ["REGATTA_TOKEN"]
    path = os.path.expanduser("~/.regatta/token")
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        raise RegattaError(
            "no cluster token: pass token=..., set REGATTA_TOKEN, or put it in ~/.regatta/token"
        ) from None


def init(address=None, *, token=None, num_cpus=None, num_gpus=None, resources=None, binary=None,
         log_dir=None, ignore_reinit_error=False):
    """Starts a local cluster for this script (``address=None``) or joins one: ``"auto"``
    (``REGATTA_ADDRESS``, as a job's driver has it) or ``"HOST:PORT"``; the token comes
    from ``token``, ``REGATTA_TOKEN`` or ``~/.regatta/token``. A local cluster is a head
    and one worker with ``num_cpus`` (default: this machine's), ``num_gpus`` and
    ``resources``, run by the ``regatta`` binary (``binary``, ``REGATTA_BIN``, the one this
    wheel carries, or PATH)."""
    global _driver
    with _driver_lock:
        if _driver is not None:
            if ignore_reinit_error:
                return
            raise RegattaError("regatta.init() was called already: call regatta.shutdown() first")
        if address is None:
            if token is not None:
                raise ValueError("token= is for joining a cluster (address=...); a local cluster makes its own")
            parts = [f"CPU={num_cpus if num_cpus is not None else os.cpu_count()}"]
            if num_gpus:
                parts.append(f"GPU={num_gpus}")
            for name, amount in (resources or {}).items():
                parts.append(f"{name}={amount}")
            binary = binary or _binary()
            if binary is None:
                raise RegattaError("cannot find the regatta binary for a local cluster: pass binary=..., set "
                                   "REGATTA_BIN, put `regatta` on PATH, or install a wheel built by "
                                   "scripts/build-wheel.sh (it carries one)")
            cluster = _native.Cluster.start_local([("worker-0", ",".join(parts))], binary, log_dir)
            local, token = True, cluster.token
        else:
            if num_cpus is not None or num_gpus is not None or resources is not None:
                raise ValueError("num_cpus, num_gpus and resources describe a local cluster; "
                                 "a running cluster's nodes declare their own")
            if address == "auto":
                address = os.environ.get("REGATTA_ADDRESS")
                if not address:
                    raise RegattaError('address="auto" needs REGATTA_ADDRESS (set for job drivers)')
            token = _read_token(token)
            cluster = _native.Cluster.connect(address, token)
            local = False
        _driver = _Driver(cluster, local, token)
    atexit.register(shutdown)


def is_initialized():
    """Whether ``init`` was called (and not ``shutdown``)."""
    return _driver is not None


def shutdown():
    """Stops this driver's actors (detached ones stay) and, for a local cluster, the cluster."""
    global _driver
    with _driver_lock:
        driver, _driver = _driver, None
    if driver is None:
        return
    driver.follower.stop()
    for actor in driver.unfinished():
        try:
            driver.cluster.kill(actor)
        except Exception:  # already dead, or the cluster is gone
            pass
    driver.cluster.shutdown()


def _sum_resources(available):
    totals = {}
    for _name, state, total, free in _current().cluster.nodes():
        if state != "alive":
            continue
        for key, amount in (free if available else total).items():
            totals[key] = totals.get(key, 0.0) + amount
    return totals


def cluster_resources():
    """Resources of the alive nodes, summed."""
    return _sum_resources(available=False)


def available_resources():
    """Resources of the alive nodes not held by actors or reservations, summed."""
    return _sum_resources(available=True)


def nodes():
    """Every node: ``{"NodeName", "Alive", "Resources", "Available"}``."""
    return [{"NodeName": name, "Alive": state == "alive", "Resources": total, "Available": free}
            for name, state, total, free in _current().cluster.nodes()]


def _resource_text(options):
    parts = []
    if options.get("num_cpus") is not None:
        parts.append(f"CPU={options['num_cpus']}")
    if options.get("num_gpus") is not None:
        parts.append(f"GPU={options['num_gpus']}")
    if options.get("memory") is not None:
        parts.append(f"memory={int(options['memory'])}")
    if options.get("accelerator_type") is not None:
        parts.append(f"accelerator_type:{options['accelerator_type']}=0.001")
    for name, amount in (options.get("resources") or {}).items():
        if name in ("CPU", "GPU", "memory"):
            raise ValueError(f"give {name} with num_cpus/num_gpus/memory, not in resources")
        parts.append(f"{name}={amount}")
    return ",".join(parts)


def _placement(strategy):
    """The native group and bundle index a scheduling strategy names (or none)."""
    if strategy is None or strategy == "DEFAULT":
        return None, None
    from .util import PlacementGroupSchedulingStrategy

    if not isinstance(strategy, PlacementGroupSchedulingStrategy):
        raise ValueError(f"scheduling_strategy {strategy!r} is not supported: use a "
                         "PlacementGroupSchedulingStrategy or leave it out")
    index = strategy.placement_group_bundle_index
    return strategy.placement_group._group, (None if index is None or index < 0 else index)


def _env_vars(options):
    """The ``env_vars`` of a ``runtime_env`` option; its other keys are refused by name."""
    runtime_env = options.get("runtime_env") or {}
    if not isinstance(runtime_env, dict):
        raise ValueError(f"runtime_env must be a dict, not {type(runtime_env).__name__}")
    for key in runtime_env:
        if key != "env_vars":
            raise ValueError(f"runtime_env.{key} is not supported: Regatta carries out env_vars only; install "
                             "packages into the environment the workers run")
    env_vars = runtime_env.get("env_vars") or {}
    for key, value in env_vars.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key or "=" in key:
            raise ValueError(f"runtime_env.env_vars takes names and string values, not {key!r}: {value!r}")
    return env_vars


def _check_options(options, allowed, what):
    _env_vars(options)
    for name in options:
        if name in _NOT_YET:
            raise ValueError(f"the option {name!r} is not supported by Regatta yet")
        if name not in allowed:
            raise ValueError(f"unknown option {name!r} for {what}; known: {', '.join(sorted(allowed))}")
    if "lifetime" in options and options["lifetime"] not in (None, "detached", "non_detached"):
        raise ValueError(f"lifetime must be 'detached' or 'non_detached', not {options['lifetime']!r}")


# Values the standard pickler writes exactly as cloudpickle would (by value, no code), five
# times faster: a call's request made of these skips cloudpickle.
_PLAIN = frozenset((int, float, str, bytes, bool, type(None)))


def _dumps(value, what):
    try:
        return cloudpickle.dumps(value)
    except Exception as error:
        raise TypeError(f"{what} cannot be sent to the cluster: it cannot be pickled ({error})") from error


# A call whose arguments pickle to more than this goes with each large top-level argument
# stored in the object store and sent as its ref (Ray's 100 KB threshold): the worker reads
# it from the store on its node (a mapping on this host) instead of through the call.
_INLINE_ARGS_MAX = 100 * 1024


def _request(head, args, kwargs, what):
    """A call's request: the pickle of ``head + (args, kwargs)``, and the refs of the
    arguments it stored (held by the call until it is done, so the worker finds them).
    ``what`` names the function or method, for errors."""
    if (not args and not kwargs) or (all(type(a) in _PLAIN for a in args)
                                     and all(type(v) in _PLAIN for v in kwargs.values())):
        # The head is a method's name or a function pickled once (_Raw): plain too.
        request = pickle.dumps(head + (args, kwargs), protocol=5)
    else:
        request = _dumps(head + (args, kwargs), f"the arguments of {what}")
    if len(request) <= _INLINE_ARGS_MAX:
        return request, []
    kept = []

    def stored(value):
        if isinstance(value, ObjectRef):
            return value
        pickled = _pickle(value)
        if len(pickled[0]) + sum(len(r) for r in pickled[1]) <= _INLINE_ARGS_MAX:
            return value
        ref = ObjectRef("argument", store=_store(_current().cluster, _serialize(value, pickled)))
        kept.append(ref)
        return ref

    args = tuple(stored(a) for a in args)
    kwargs = {k: stored(v) for k, v in kwargs.items()}
    return _dumps(head + (args, kwargs), f"the arguments of {what}"), kept


def _resolve_args(args, kwargs):
    """Top-level ObjectRef arguments become their values (as Ray resolves them): a stored
    object travels as its id and the worker reads it from the object store; the result of
    a call in flight is waited for here."""
    if not any(isinstance(a, ObjectRef) for a in args) and not any(
            isinstance(v, ObjectRef) for v in kwargs.values()):
        return args, kwargs

    def resolve(value):
        if isinstance(value, ObjectRef) and value._store is None:
            return get(value)
        return value

    return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}


_MAGIC = b"RGT1"
_ALIGN = 64


def _pad(n):
    return b"\0" * (-n % _ALIGN)


def _pickle(value):
    """The pickle of a value (protocol 5) and its out-of-band buffers: the buffers' own
    memory (numpy arrays, ...), not copies."""
    buffers = []
    header = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return header, [b.raw() for b in buffers]


def _serialize(value, pickled=None):
    """A value (or its ``_pickle``) as the parts of one stored object: a table, the pickle,
    then each out-of-band buffer 64-byte aligned, so a reader's arrays view the object's
    bytes instead of copies; the put writes each part straight into the object."""
    header, raws = pickled or _pickle(value)
    table = _MAGIC + struct.pack(">IQ", len(raws), len(header)) + b"".join(struct.pack(">Q", len(r)) for r in raws)
    parts = [table, _pad(len(table)), header, _pad(len(header))]
    for raw in raws:
        parts += [raw, _pad(len(raw))]
    return parts


# Objects of at least this many bytes are written straight into shared memory (a sealed
# memfd the store keeps) and read by mapping it: the store's SHARED_MEMORY_MIN_BYTES.
_SHARED_MIN = 1 << 20
# The most one write() call takes (Linux caps a write at just under 2 GiB).
_WRITE_MAX = 1 << 30
# Whether this host's shared memory gets huge pages only through a mapping advised for
# them (transparent_hugepage/shmem_enabled is "advise"): then a put copies through one, at
# copy speed instead of the ~2 GB/s of 4 KiB pages allocated one by one (docs/PYTHON.md).
_HUGE_BY_ADVICE = _native.shared_memory_huge_pages() == "advise"


def _store(cluster, parts):
    """Stores an object's parts: a large one with one copy, written into a memfd the store
    then seals and keeps (readers on this host map those pages); a small one as bytes."""
    total = sum(len(p) for p in parts)
    if total < _SHARED_MIN or not hasattr(os, "memfd_create"):
        return cluster.put([bytes(p) for p in parts])
    fd = os.memfd_create("regatta-object", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if _HUGE_BY_ADVICE:
            _copy_through_huge_mapping(fd, parts, total)
        else:
            for part in parts:
                view = memoryview(part).cast("B")
                while len(view):
                    view = view[os.write(fd, view[:_WRITE_MAX]):]
        return cluster.put_memfd(fd)
    finally:
        os.close(fd)


def _copy_through_huge_mapping(fd, parts, total):
    """Copies the parts into memfd ``fd`` through a shared mapping advised for huge pages,
    unmapped again before the store seals the file (a write seal refuses a mapped file)."""
    os.ftruncate(fd, total)
    with mmap.mmap(fd, total) as mapping:
        mapping.madvise(mmap.MADV_HUGEPAGE)
        offset = 0
        for part in parts:
            view = memoryview(part).cast("B")
            mapping[offset:offset + len(view)] = view
            offset += len(view)


def _read(store):
    """A stored object's contents: bytes for a small one, else a read-only view of the
    store's own bytes (its shared-memory mapping on this host, or what a pull from another
    node received), no copy: arrays read from it are views of those pages."""
    data = _current().cluster.read(store)
    if isinstance(data, bytes):
        return data
    # The stable ABI of Python 3.10 gives a native class no buffer protocol: a ctypes array
    # over the lent bytes exports them, and keeps the lender alive as long as any view.
    lent = (ctypes.c_char * len(data)).from_address(data.address)
    lent._held = data
    return memoryview(lent).cast("B").toreadonly()


def _deserialize(blob):
    if blob[:4] != _MAGIC:
        raise RegattaError("the object is not one the Python API stored")
    count, header_len = struct.unpack(">IQ", blob[4:16])
    lengths = struct.unpack(f">{count}Q", blob[16:16 + 8 * count])
    view = memoryview(blob)
    offset = 16 + 8 * count
    offset += -offset % _ALIGN
    header = view[offset:offset + header_len]
    offset += header_len + (-header_len % _ALIGN)
    buffers = []
    for length in lengths:
        buffers.append(view[offset:offset + length])
        offset += length + (-length % _ALIGN)
    return cloudpickle.loads(header, buffers=buffers)


def _object_ref(object_id):
    """A stored object's ref rebuilt from its id (in the process that received it)."""
    return ObjectRef("put", store=_current().cluster.object(object_id))


class ObjectRef:
    """A value a task or actor call will produce (or one ``put`` holds). ``get`` it, ``wait``
    for it, or ``await`` it."""

    def __init__(self, what, pending=None, value=None, retry=None, retries=0, on_done=None, is_task=False,
                 store=None, kept=()):
        self._what = what
        # Stored arguments of the call, held until it is done.
        self._kept = kept
        self._is_task = is_task
        self._pending = pending
        self._store = store
        self._value = value
        self._settled = pending is None
        self._error = None
        self._retry = retry
        self._retries = retries
        self._on_done = on_done
        self._lock = threading.Lock()

    def _ready(self):
        return self._settled or self._store is not None or self._pending.done()

    def _settle(self, deadline):
        with self._lock:
            if self._store is not None:
                # Read each time, as Ray does: the ref does not keep a copy alive.
                try:
                    return _deserialize(_read(self._store))
                except RuntimeError as error:
                    raise RegattaError(f"cannot read object {self._store.id}: {error}") from None
            while not self._settled:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                outcome = self._pending.result(left)
                if outcome is None:
                    raise GetTimeoutError(f"{self._what} did not finish in time")
                kind, payload = outcome
                if kind == "failed" and self._retry is not None and self._retries > 0:
                    self._retries -= 1
                    self._pending = self._retry()
                    continue
                self._settled = True
                self._kept = ()
                pending, self._pending = self._pending, None
                try:
                    self._value, self._error = _decode(self._what, kind, bytes(payload), self._is_task, pending)
                finally:
                    if self._on_done is not None:
                        self._on_done()
        if self._error is not None:
            raise self._error
        return self._value

    def __reduce__(self):
        if self._store is not None:
            return (_object_ref, (self._store.id,))
        raise TypeError("the ObjectRef of a call in flight cannot be sent inside another value yet: pass it "
                        "as a top-level argument (it is resolved first), or get() it and put() the value")

    def __await__(self):
        return asyncio.get_running_loop().run_in_executor(None, self._settle, None).__await__()

    def __repr__(self):
        state = "ready" if self._ready() else "pending"
        return f"ObjectRef({self._what}, {state})"


# Whether what remote code prints is printed by the driver (Ray's log_to_driver).
log_to_driver = os.environ.get("REGATTA_LOG_TO_DRIVER", "1") != "0"


class _PartRef(ObjectRef):
    """One of the ``num_returns`` values of a call: the call's result split."""

    def __init__(self, parent, index, count):
        super().__init__(f"{parent._what}[{index}]")
        self._parent, self._index, self._count = parent, index, count

    def _ready(self):
        return self._parent._ready()

    def _settle(self, deadline):
        values = self._parent._settle(deadline)
        if not isinstance(values, (tuple, list)) or len(values) != self._count:
            shown = len(values) if isinstance(values, (tuple, list)) else f"a {type(values).__name__}"
            raise RegattaError(f"{self._parent._what} has num_returns={self._count} but returned {shown}")
        return values[self._index]

    def __reduce__(self):
        raise TypeError("the ObjectRef of a call in flight cannot be sent inside another value yet")


def _split(ref, num_returns):
    """A call's ref as Ray hands it for ``num_returns``: one ref, a list of them, or None."""
    if num_returns is None or num_returns == 1:
        return ref
    if not isinstance(num_returns, int) or num_returns < 0:
        raise ValueError(f"num_returns must be an integer >= 0, not {num_returns!r}")
    if num_returns == 0:
        return None
    return [_PartRef(ref, i, num_returns) for i in range(num_returns)]


def _decode(what, kind, payload, is_task, pending=None):
    kind, _, cause = kind.partition("/")
    if kind == "ok" and payload[:1] == b"L":
        pid, length = struct.unpack(">II", payload[1:9])
        text = payload[9:9 + length].decode("utf-8", "replace")
        payload = payload[9 + length:]
        if log_to_driver:
            name = what.removeprefix("task ")
            for line in text.splitlines():
                print(f"({name} pid={pid}) {line}", flush=True)
    if kind == "ok":
        if payload[:1] == b"O":
            return cloudpickle.loads(payload[1:]), None
        if payload[:1] == b"R":
            # A large result, stored by the worker and held by this driver since it came.
            stored = pending.stored() if pending is not None else None
            if stored is None:
                return None, RegattaError(f"{what}: its result object {payload[1:].decode()} is not held")
            return _deserialize(_read(stored)), None
        if payload[:1] == b"E":
            cause, text = cloudpickle.loads(payload[1:])
            return None, TaskError(what, text, cause).as_instanceof_cause()
        return None, RegattaError(f"{what}: the worker answered with an unknown frame")
    message = payload.decode("utf-8", "replace")
    if kind == "dead":
        return None, ActorDiedError(f"{what}: the actor is dead: {message}", cause=cause)
    if kind == "failed":
        if is_task:
            return None, WorkerCrashedError(f"{what}: the worker process died and the task's retries are spent: {message}")
        return None, ActorDiedError(f"{what}: the actor's process died during the call: {message}", cause="exited")
    return None, RegattaError(f"{what}: {message}")


def put(value):
    """Stores ``value`` in the cluster's object store (once) and returns its ref: pass it to
    tasks and actors (it travels as its id, and they read it from the store on their node),
    or ``get`` it back. Buffers such as numpy arrays are stored as they are (pickle protocol
    5), and a reader's arrays are read-only views of the object it read."""
    driver = _current()
    parts = _serialize(value)
    return ObjectRef("put", store=_store(driver.cluster, parts))


def get(refs, *, timeout=None):
    """The value of a ref, or the values of a list of refs (in order). Raises the remote
    error (a ``TaskError``, also an instance of the remote exception's class),
    ``ActorDiedError``, ``WorkerCrashedError``, or ``GetTimeoutError`` after ``timeout``
    seconds."""
    if timeout is not None and timeout < 0:
        raise ValueError("timeout must be >= 0")
    deadline = None if timeout is None else time.monotonic() + timeout
    if isinstance(refs, ObjectRef):
        return refs._settle(deadline)
    if isinstance(refs, (list, tuple)):
        for ref in refs:
            if not isinstance(ref, ObjectRef):
                raise TypeError(f"get() takes ObjectRefs, not {type(ref).__name__}")
        return [ref._settle(deadline) for ref in refs]
    raise TypeError(f"get() takes an ObjectRef or a list of them, not {type(refs).__name__}")


def wait(refs, *, num_returns=1, timeout=None, fetch_local=True):
    """``(ready, not_ready)``: the first ``num_returns`` refs that are done (or those done
    when ``timeout`` seconds pass), in the order given."""
    refs = list(refs)
    if not all(isinstance(r, ObjectRef) for r in refs):
        raise TypeError("wait() takes a list of ObjectRefs")
    if len(set(map(id, refs))) != len(refs):
        raise ValueError("wait() got the same ObjectRef twice")
    if not 0 <= num_returns <= len(refs):
        raise ValueError(f"num_returns must be between 0 and {len(refs)}, not {num_returns}")
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.0005
    while True:
        ready = [r for r in refs if r._ready()]
        if len(ready) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            ready = ready[:num_returns]
            chosen = set(map(id, ready))
            return ready, [r for r in refs if id(r) not in chosen]
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


class RemoteFunction:
    """A function made remote with ``@regatta.remote``: ``f.remote(*args)`` runs it on the
    cluster and returns an ObjectRef."""

    def __init__(self, function, options):
        _check_options(options, _FUNCTION_OPTIONS, "a remote function")
        self._function = function
        self._options = options
        self._name = getattr(function, "__qualname__", repr(function))
        self._pickled = None

    def __call__(self, *args, **kwargs):
        raise TypeError(f"remote function {self._name} cannot be called directly: use {self._name}.remote()")

    def options(self, **options):
        """The same function with these options."""
        return RemoteFunction(self._function, {**self._options, **options})

    def remote(self, *args, **kwargs):
        driver = _current()
        if self._pickled is None:
            self._pickled = _dumps(self._function, f"function {self._name}")
        args, kwargs = _resolve_args(args, kwargs)
        request, kept = _request((None, _Raw(self._pickled)), args, kwargs, self._name)
        resources = _resource_text(self._options)
        retries = self._options.get("max_retries", 3)
        what = f"task {self._name}"
        strategy = self._options.get("scheduling_strategy")
        _placement(strategy)  # refuses what is not supported before anything starts
        env_vars = _env_vars(self._options)
        if resources or strategy is not None or env_vars:
            # A task that asks for resources runs in a worker holding them, killed as soon as
            # it has answered (whether or not the result is ever read), as Ray frees a
            # finished task's resources.
            holder = {}

            def submit():
                actor = driver.spawn(cloudpickle.dumps((None, (), {})), resources, strategy=strategy, env_vars=env_vars,
                                     one_call=True)
                holder["actor"] = actor
                return driver.call(actor, request, what, end=True)

            def done():
                actor = holder.get("actor")
                if actor is not None:
                    driver.forget(actor)

            return _split(ObjectRef(what, submit(), retry=submit, retries=retries, on_done=done, is_task=True,
                                    kept=kept), self._options.get("num_returns"))

        def submit():
            return driver.call(driver.task_worker(), request, what)

        return _split(ObjectRef(what, submit(), retry=submit, retries=retries, is_task=True, kept=kept),
                      self._options.get("num_returns"))


class _Raw:
    """A function pickled once, sent as bytes inside each call's pickle."""

    def __init__(self, pickled):
        self.pickled = pickled

    def __reduce__(self):
        return (cloudpickle.loads, (self.pickled,))


class ActorClass:
    """A class made remote: ``Cls.remote(*args)`` starts an actor and returns its handle."""

    def __init__(self, cls, options):
        _check_options(options, _ACTOR_OPTIONS, "an actor class")
        self._cls = cls
        self._options = options

    def __call__(self, *args, **kwargs):
        raise TypeError(f"actor class {self._cls.__name__} cannot be instantiated directly: use "
                        f"{self._cls.__name__}.remote()")

    def options(self, **options):
        """The same class with these options."""
        return ActorClass(self._cls, {**self._options, **options})

    def remote(self, *args, **kwargs):
        driver = _current()
        args, kwargs = _resolve_args(args, kwargs)
        init = _dumps((self._cls, args, kwargs), f"actor class {self._cls.__name__} or its arguments")
        # An actor with coroutine methods is an async actor: its calls run beside each other
        # (Ray's default of 1000 at once); max_concurrency sets it, for threaded actors too.
        is_async = any(inspect.iscoroutinefunction(getattr(self._cls, n, None)) for n in dir(self._cls))
        concurrency = int(self._options.get("max_concurrency", 1000 if is_async else 1))
        if concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, not {concurrency}")
        if concurrency > 1 and int(self._options.get("max_restarts", 0)) > 0:
            raise ValueError("max_restarts is not supported yet for actors whose calls run concurrently "
                             "(async actors, max_concurrency > 1)")
        actor = driver.spawn(
            init,
            _resource_text(self._options),
            name=self._options.get("name"),
            max_restarts=int(self._options.get("max_restarts", 0)),
            detached=self._options.get("lifetime") == "detached",
            strategy=self._options.get("scheduling_strategy"),
            max_concurrency=concurrency,
            env_vars=_env_vars(self._options),
        )
        methods = {name for name in dir(self._cls) if callable(getattr(self._cls, name, None))}
        return ActorHandle(actor, self._cls.__name__, methods, int(self._options.get("max_task_retries", 0)),
                           concurrent=concurrency > 1)


class ActorHandle:
    """A handle on an actor: ``handle.method.remote(*args)`` returns an ObjectRef."""

    def __init__(self, actor_id, class_name, methods=None, retries=0, concurrent=False):
        self._actor_id = actor_id
        self._class_name = class_name
        self._methods = None if methods is None else set(methods)
        self._retries = retries
        # Calls to an actor that runs them beside each other are not held in order.
        self._concurrent = concurrent

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._methods is not None and name not in self._methods:
            raise AttributeError(f"actor class {self._class_name} has no method {name!r}")
        method = _ActorMethod(self, name)
        self.__dict__[name] = method  # the next look-up finds it without this call
        return method

    def __reduce__(self):
        # Only the id travels: the receiving task or actor calls the same actor.
        methods = None if self._methods is None else tuple(sorted(self._methods))
        return (ActorHandle, (self._actor_id, self._class_name, methods, self._retries, self._concurrent))

    def __repr__(self):
        return f"ActorHandle({self._class_name}, id={self._actor_id})"


class _ActorMethod:
    def __init__(self, handle, name, num_returns=None):
        self._handle = handle
        self._name = name
        self._num_returns = num_returns
        # Made once: a call's own work is kept to what differs between calls.
        self._what = f"{handle._class_name}.{name}"
        self._head = (name, None)

    def options(self, **options):
        """This method with ``num_returns``."""
        for name in options:
            if name != "num_returns":
                raise ValueError(f"unknown option {name!r} for an actor method; known: num_returns")
        return _ActorMethod(self._handle, self._name, options.get("num_returns"))

    def __call__(self, *args, **kwargs):
        raise TypeError(f"actor method {self._name} cannot be called directly: use .{self._name}.remote()")

    def remote(self, *args, **kwargs):
        driver = _current()
        if args or kwargs:
            args, kwargs = _resolve_args(args, kwargs)
        handle, what = self._handle, self._what
        request, kept = _request(self._head, args, kwargs, what)
        actor = handle._actor_id
        ordered = not handle._concurrent
        if handle._retries > 0:
            def submit():
                return driver.call(actor, request, what, ordered, concurrent=not ordered)

            ref = ObjectRef(what, submit(), retry=submit, retries=handle._retries, kept=kept)
        else:
            ref = ObjectRef(what, driver.call(actor, request, what, ordered, concurrent=not ordered), kept=kept)
        return ref if self._num_returns is None else _split(ref, self._num_returns)


def remote(*args, **options):
    """``@regatta.remote`` or ``@regatta.remote(num_cpus=..., ...)`` on a function (a task)
    or a class (an actor)."""
    def make(target):
        if isinstance(target, type):
            return ActorClass(target, options)
        if callable(target):
            return RemoteFunction(target, options)
        raise TypeError(f"@regatta.remote takes a function or a class, not {type(target).__name__}")

    if len(args) == 1 and not options and callable(args[0]):
        return make(args[0])
    if args:
        raise TypeError("@regatta.remote takes keyword options only, e.g. @regatta.remote(num_cpus=1)")
    return make


def kill(actor, *, no_restart=True):
    """Kills an actor; its calls in flight fail with ActorDiedError."""
    if not isinstance(actor, ActorHandle):
        raise TypeError(f"kill() takes an ActorHandle, not {type(actor).__name__}")
    driver = _current()
    driver.cluster.kill(actor._actor_id)
    driver.forget(actor._actor_id)


def get_actor(name):
    """The live actor named ``name`` (``.options(name=...)``); ValueError if there is none."""
    actor = _current().cluster.named(name)
    if actor is None:
        raise ValueError(f"no live actor named {name!r}")
    return ActorHandle(actor, name)
