"""The Python process behind one Regatta actor or task worker (``python -m regatta._worker``).

The worker's Rust actor (``regatta.python``) starts it and speaks length-prefixed frames on
its stdin and stdout: a 4-byte big-endian length, then that many bytes. The first frame is
the constructor: ``cloudpickle`` of ``(class, args, kwargs)``, or of ``(None, (), {})`` for a
task worker; it is answered ``O`` (ready) or ``E`` followed by the error's text. Then each
frame is a call, ``(method_name, function, args, kwargs)``: an actor method by name, or a
task's function. It is answered ``O`` + the pickled result, ``R`` + the id of the object
it stored a result of a mebibyte or more in (see ``_answer``), or ``E`` + the pickled
``(exception or None, traceback text)``, preceded, when the call printed anything, by
``L`` + this process's pid and the text's length (4 bytes each, big-endian) + the text:
the driver prints it as Ray's ``log_to_driver`` does. A call that runs longer than a second
sends no such text: what it prints (from its start) goes to stderr marked live (lines
starting ``\x1e``), and the driver follows those lines through the actor's log as they
come; so do actors whose calls run beside each other, for everything they print.

User code's prints go to stderr (the node's log and the actor's log on the dashboard), never
into the frames' own bytes; its stdin is /dev/null. For an actor that runs calls one after
another, the node writes the next calls while one runs: they are read in order, each after
the previous answer went out.
"""

import inspect
import os
import pickle
import struct
import sys
import threading
import time
import traceback


def _exit_when_orphaned():
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="regatta-orphan-watch").start()


def _read_exact(stream, n):
    first = stream.read(n)
    if len(first) == n:
        # The usual case: all of it at once.
        return first
    if not first:
        return None
    chunks = [first]
    n -= len(first)
    while n:
        chunk = stream.read(n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


# A call that has run this long has its prints followed live by its caller.
_LIVE_AFTER = 1.0
# What starts a stderr line the caller follows live (the Rust side keeps it marked live).
_LIVE_MARK = "\x1e"


class _Live:
    """Writes to the process's stderr with each line marked live: the caller's driver
    follows these lines through the actor's log while the call runs."""

    def __init__(self, out):
        self.out = out
        self.line_start = True

    def write(self, text):
        parts = text.split("\n")
        for i, part in enumerate(parts):
            piece = part if i == len(parts) - 1 else part + "\n"
            if not piece:
                continue
            if self.line_start:
                self.out.write(_LIVE_MARK)
            self.out.write(piece)
            self.line_start = piece.endswith("\n")
        return len(text)

    def flush(self):
        self.out.flush()

    def isatty(self):
        return False

    def __getattr__(self, name):
        return getattr(self.out, name)


class _Tee:
    """What one call prints, written to stderr as it comes (so a crash loses none of it)
    and kept: a call that ends within its first second sends the kept text with its answer.
    Once the call has run that long, the kept lines are marked live after the fact (a
    ``\x1e\x1d`` + count line) and what follows is written marked live, for the driver to
    follow: each line reaches the driver once, in order, and the node's log once."""

    def __init__(self, out):
        self.out = out
        self.kept = []
        self.started = time.monotonic()
        self.live = None
        self.closed = False
        self.lock = threading.Lock()

    def go_live(self):
        """Once the call has run a second: what was held, and from now on all, goes out
        marked live (also called by a watcher, for a call that printed and then went quiet)."""
        with self.lock:
            if self.live is None and not self.closed and time.monotonic() - self.started >= _LIVE_AFTER:
                self.live = _Live(self.out)
                kept = "".join(self.kept)
                if kept:
                    if not kept.endswith("\n"):
                        kept += "\n"
                        self.out.write("\n")
                    # The lines the node kept of it: empty ones are not kept.
                    count = sum(1 for line in kept.split("\n") if line.rstrip("\r"))
                    self.out.write(f"{_LIVE_MARK}\x1d{count}\n")
                self.out.flush()
                self.kept = []

    def write(self, text):
        self.go_live()
        with self.lock:
            if self.live is not None:
                return self.live.write(text)
            self.kept.append(text)
            return self.out.write(text)

    def close(self):
        """Ends the call: the text kept for its answer (none once it went live)."""
        with self.lock:
            self.closed = True
            self.out.flush()
            return "".join(self.kept)

    def flush(self):
        with self.lock:
            if self.live is not None:
                self.out.flush()

    def isatty(self):
        return False

    def __getattr__(self, name):
        return getattr(self.out, name)


def _resolve_top_level(args, kwargs):
    """Stored objects given as top-level arguments arrive as refs: their values, as Ray
    hands them."""
    if not args and not kwargs:
        return args, kwargs
    import regatta

    def resolve(value):
        return regatta.get(value) if isinstance(value, regatta.ObjectRef) else value

    return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}


def _answer(result, cloudpickle):
    """A call's ``O`` answer, or for a result of at least a mebibyte (numpy arrays, tensors,
    ...) ``R`` + the id of an object this process stores it in, buffers out of band: the
    caller maps it on this host instead of receiving it through the pipes. The caller holds
    the object from the moment the answer arrives; this process lets go of it at once."""
    import regatta

    if type(result) in regatta._PLAIN and not (type(result) in (str, bytes) and len(result) >= regatta._SHARED_MIN):
        # Written exactly as cloudpickle would, ten times faster (small answers are most).
        return b"O" + pickle.dumps(result, protocol=5)
    header, raws = regatta._pickle(result)
    if len(header) + sum(len(r) for r in raws) < regatta._SHARED_MIN:
        # Without out-of-band buffers this pickle is the in-band one: no second pickling.
        return b"O" + (header if not raws else cloudpickle.dumps(result))
    stored = regatta._store(regatta._current().cluster, regatta._serialize(result, (header, raws)))
    return b"R" + stored.id.encode()


def _serve_concurrently(instance, read, write, limit, failure, cloudpickle):
    """Calls beside each other: coroutine methods on one event loop, at most ``limit`` at
    once, plain ones on a pool of ``limit`` threads (at most 64); each frame and answer
    starts with the call's 8-byte number."""
    import asyncio
    import concurrent.futures
    import inspect

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(limit, 64), thread_name_prefix="regatta-call")
    gate = asyncio.Semaphore(limit)
    lock = threading.Lock()

    def send(key, answer):
        with lock:
            write(struct.pack(">Q", key) + answer)

    async def run_async(key, target, args, kwargs):
        async with gate:
            try:
                args, kwargs = await loop.run_in_executor(pool, _resolve_top_level, args, kwargs)
                answer = _answer(await target(*args, **kwargs), cloudpickle)
            except BaseException as error:  # noqa: BLE001 - everything goes back to the caller
                answer = failure(error)
            send(key, answer)

    async def finish(key, coroutine):
        # A coroutine that a plain method returned, awaited on the loop.
        try:
            answer = _answer(await coroutine, cloudpickle)
        except BaseException as error:  # noqa: BLE001
            answer = failure(error)
        send(key, answer)

    def run_plain(key, target, args, kwargs):
        # A plain method: one hop, straight onto a pool thread (the pool's size caps how many
        # run at once), which resolves its refs, runs it and answers.
        try:
            args, kwargs = _resolve_top_level(args, kwargs)
            result = target(*args, **kwargs)
            if inspect.iscoroutine(result):
                asyncio.run_coroutine_threadsafe(finish(key, result), loop)
                return
            answer = _answer(result, cloudpickle)
        except BaseException as error:  # noqa: BLE001
            answer = failure(error)
        send(key, answer)

    def reader():
        while True:
            frame = read()
            if frame is None:
                loop.call_soon_threadsafe(loop.stop)
                return
            (key,) = struct.unpack(">Q", frame[:8])
            try:
                method, function, args, kwargs = cloudpickle.loads(frame[8:])
                target = function if function is not None else getattr(instance, method)
            except BaseException as error:  # noqa: BLE001
                send(key, failure(error))
                continue
            if inspect.iscoroutinefunction(target):
                asyncio.run_coroutine_threadsafe(run_async(key, target, args, kwargs), loop)
            else:
                pool.submit(run_plain, key, target, args, kwargs)

    threading.Thread(target=reader, daemon=True, name="regatta-frames").start()
    loop.run_forever()


def main():
    import cloudpickle

    _exit_when_orphaned()
    # The frames keep duplicates of fds 0 and 1 (not inherited by subprocesses). The node
    # writes an actor's next calls while one runs: user code or a subprocess that reads
    # stdin must find nothing there, not the calls behind it, so fd 0 becomes /dev/null.
    frames_in = os.fdopen(os.dup(0), "rb")  # buffered: a frame's length and bytes in one read
    frames_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)
    # Prints, of user code and of libraries, go to stderr from here on.
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def read():
        header = _read_exact(frames_in, 4)
        if header is None:
            return None
        (length,) = struct.unpack(">I", header)
        return _read_exact(frames_in, length)

    def write(payload):
        frames_out.write(struct.pack(">I", len(payload)))
        frames_out.write(payload)
        frames_out.flush()

    def failure(error):
        text = traceback.format_exc()
        try:
            return b"E" + cloudpickle.dumps((error, text))
        except Exception:  # an exception that cannot be pickled travels as text
            return b"E" + cloudpickle.dumps((None, text))

    init = read()
    if init is None:
        return
    try:
        target, args, kwargs = cloudpickle.loads(init)
        instance = target(*args, **kwargs) if target is not None else None
    except BaseException:
        write(b"E" + traceback.format_exc().encode("utf-8", "replace"))
        return
    write(b"O")
    limit = int(os.environ.get("REGATTA_MAX_CONCURRENCY", "1"))
    if limit > 1:
        # Calls beside each other print into one stream: all of it followed live.
        sys.stdout = sys.stderr = _Live(sys.__stderr__)
        _serve_concurrently(instance, read, write, limit, failure, cloudpickle)
        return
    loop = None
    current = [None]

    def watch_quiet_calls():
        while True:
            time.sleep(_LIVE_AFTER / 4)
            tee = current[0]
            if tee is not None:
                tee.go_live()

    threading.Thread(target=watch_quiet_calls, daemon=True, name="regatta-live").start()
    while True:
        request = read()
        if request is None:
            return
        tee = current[0] = _Tee(sys.__stderr__)
        sys.stdout = sys.stderr = tee
        try:
            method, function, args, kwargs = cloudpickle.loads(request)
            args, kwargs = _resolve_top_level(args, kwargs)
            if function is not None:
                result = function(*args, **kwargs)
            else:
                result = getattr(instance, method)(*args, **kwargs)
            if inspect.iscoroutine(result):
                # An async method of an actor run one call at a time.
                import asyncio

                loop = loop or asyncio.new_event_loop()
                result = loop.run_until_complete(result)
            answer = _answer(result, cloudpickle)
        except BaseException as error:  # noqa: BLE001 - everything goes back to the caller
            answer = failure(error)
        finally:
            sys.stdout = sys.stderr = sys.__stderr__
        printed = tee.close().encode("utf-8", "replace")
        if printed:
            answer = b"L" + struct.pack(">II", os.getpid(), len(printed)) + printed + answer
        write(answer)


if __name__ == "__main__":
    main()
