"""The `regatta` package against a real local cluster (a head and a worker started from the
`regatta` binary named by REGATTA_BIN): tasks, actors, errors, restarts and retries."""

import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import regatta
from regatta import ActorDiedError, GetTimeoutError, TaskError, WorkerCrashedError


@regatta.remote
def square(x):
    return x * x


@regatta.remote
def add(a, b):
    return a + b


@regatta.remote
def fails(message):
    raise KeyError(message)


@regatta.remote
def sleepy(seconds):
    time.sleep(seconds)
    return seconds


@regatta.remote
class Counter:
    def __init__(self, start):
        self.total = start

    def add(self, n):
        self.total += n
        return self.total

    def pid(self):
        return os.getpid()

    def read_stdin_after(self, seconds):
        time.sleep(seconds)
        return sys.stdin.read(), subprocess.run(["cat"], capture_output=True, timeout=30).stdout

    def die_after(self, seconds):
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGKILL)


@regatta.remote
class Broken:
    def __init__(self):
        raise RuntimeError("the constructor gives up")

    def ping(self):
        return "pong"


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_tasks_return_their_values_in_order():
    refs = [square.remote(i) for i in range(200)]
    assert regatta.get(refs) == [i * i for i in range(200)]
    assert regatta.get(square.remote(12)) == 144


def test_refs_given_as_arguments_are_resolved_first():
    assert regatta.get(add.remote(square.remote(3), square.remote(4))) == 25
    big = regatta.put(list(range(1000)))
    assert regatta.get(add.remote(big, [1])) == list(range(1000)) + [1]
    assert regatta.get(big) == list(range(1000))


def test_an_actor_keeps_its_state_and_answers_in_call_order():
    counter = Counter.remote(10)
    refs = [counter.add.remote(1) for _ in range(50)]
    assert regatta.get(refs) == list(range(11, 61))
    # Calls are pipelined (each written before the one before is answered) and still run
    # in the order they were made, from two actors' interleaved streams.
    other = Counter.remote(0)
    refs = [(counter if i % 3 else other).add.remote(i) for i in range(600)]
    got = regatta.get(refs)
    expected, totals = [], {"counter": 60, "other": 0}
    for i in range(600):
        key = "counter" if i % 3 else "other"
        totals[key] += i
        expected.append(totals[key])
    assert got == expected


def test_calls_written_by_the_caller_and_by_the_queue_keep_their_order():
    # A call to an idle actor is written on the caller's thread; calls made while others
    # are in flight go through the actor's queue. The first calls of a fresh actor cannot
    # be written at once (where it runs is still being looked up), so the queue waits for
    # them. Every mix of the three must keep the order the calls were made in.
    counter = Counter.remote(0)
    calls, totals = [], []
    for burst in [5, 1, 1, 3, 1, 8, 1, 2, 1, 1, 20, 1]:
        refs = []
        for _ in range(burst):
            n = len(calls) + 1
            totals.append((totals[-1] if totals else 0) + n)
            ref = counter.add.remote(n)
            calls.append(ref)
            refs.append(ref)
        if burst == 1:
            # Waited on at once: the next call finds the actor idle again.
            regatta.get(refs[0])
    assert regatta.get(calls) == totals


def test_a_remote_exception_is_a_task_error_and_an_instance_of_its_class():
    with pytest.raises(KeyError) as caught:
        regatta.get(fails.remote("missing thing"))
    error = caught.value
    assert isinstance(error, TaskError)
    assert "missing thing" in str(error)
    assert "in fails" in error.traceback_str and "KeyError" in error.traceback_str


def test_a_failed_constructor_makes_the_actor_dead_with_its_cause():
    broken = Broken.remote()
    with pytest.raises(ActorDiedError) as caught:
        regatta.get(broken.ping.remote(), timeout=60)
    assert "the constructor gives up" in str(caught.value)
    assert caught.value.cause == "constructor_failed"


def test_get_times_out_and_wait_splits_ready_from_pending():
    slow = sleepy.remote(3)
    with pytest.raises(GetTimeoutError):
        regatta.get(slow, timeout=0.2)
    quick = square.remote(2)
    ready, pending = regatta.wait([slow, quick], num_returns=1, timeout=30)
    assert ready == [quick] and pending == [slow]
    ready, pending = regatta.wait([slow], num_returns=1, timeout=0.05)
    assert ready == [] and pending == [slow]
    assert regatta.get(slow) == 3


def test_a_killed_actor_process_restarts_when_allowed_and_dies_when_not():
    restartable = Counter.options(max_restarts=1).remote(0)
    first = regatta.get(restartable.pid.remote())
    os.kill(first, signal.SIGKILL)
    with pytest.raises(ActorDiedError):
        regatta.get(restartable.add.remote(1), timeout=60)
    second = regatta.get(restartable.pid.remote(), timeout=60)
    assert second != first
    assert regatta.get(restartable.add.remote(5)) == 5, "the constructor ran again: state starts over"
    os.kill(second, signal.SIGKILL)
    with pytest.raises(ActorDiedError):
        regatta.get(restartable.add.remote(1), timeout=60)
    with pytest.raises(ActorDiedError) as caught:
        regatta.get(restartable.add.remote(1), timeout=60)
    assert "restarts exhausted" in str(caught.value)


def test_calls_written_behind_one_that_kills_the_process_run_on_the_next_one_in_order():
    # The node writes an actor's next calls into its process while one runs: those behind
    # the call that kills it never started there, and must each run once, in order, on the
    # restarted process, none lost and none run twice.
    actor = Counter.options(max_restarts=1).remote(0)
    first = regatta.get(actor.pid.remote(), timeout=60)
    dying = actor.die_after.remote(0.5)
    behind = [actor.add.remote(1) for _ in range(20)]
    with pytest.raises(ActorDiedError):
        regatta.get(dying, timeout=60)
    assert regatta.get(behind, timeout=60) == list(range(1, 21))
    assert regatta.get(actor.pid.remote(), timeout=60) != first


def test_a_call_that_reads_stdin_finds_it_empty_not_the_calls_written_behind_it():
    # Calls written behind a running one wait in the process's frame pipe: neither the
    # call nor a subprocess it starts may read them from stdin.
    actor = Counter.remote(0)
    reading = actor.read_stdin_after.remote(0.3)
    behind = [actor.add.remote(1) for _ in range(10)]
    assert regatta.get(reading, timeout=60) == ("", b"")
    assert regatta.get(behind, timeout=60) == list(range(1, 11))


def test_a_task_whose_worker_dies_is_retried(tmp_path):
    marker = tmp_path / "died-once"

    @regatta.remote
    def dies_once(path):
        if not os.path.exists(path):
            open(path, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return "survived"

    assert regatta.get(dies_once.remote(str(marker)), timeout=60) == "survived"

    @regatta.remote(max_retries=0)
    def always_dies():
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(WorkerCrashedError):
        regatta.get(always_dies.remote(), timeout=60)


def test_named_actors_are_found_and_killed():
    Counter.options(name="the-counter").remote(100)
    found = regatta.get_actor("the-counter")
    assert regatta.get(found.add.remote(1)) == 101
    regatta.kill(found)
    with pytest.raises(ActorDiedError) as caught:
        regatta.get(found.add.remote(1), timeout=60)
    assert caught.value.cause == "killed", str(caught.value)
    with pytest.raises(ValueError):
        regatta.get_actor("nobody-by-this-name")


def test_resources_are_reported_and_requests_are_honoured():
    assert regatta.cluster_resources()["CPU"] == 2.0
    assert regatta.get(square.options(num_cpus=1).remote(9), timeout=60) == 81
    holder = Counter.options(num_cpus=2).remote(0)
    assert regatta.get(holder.add.remote(1), timeout=60) == 1
    assert regatta.available_resources().get("CPU", 0.0) == 0.0
    regatta.kill(holder)
    with pytest.raises(regatta.InfeasibleError, match="GPU") as caught:
        Counter.options(num_gpus=4).remote(0)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(regatta.InfeasibleError, match="GPU"):
        square.options(num_gpus=1).remote(2)


def test_a_finished_task_frees_its_resources_whether_or_not_its_result_is_read():
    # As in Ray, a task's resources are free once it has finished: a driver that only waits
    # on refs, or drops them, must not starve the tasks after them.
    first = square.options(num_cpus=2).remote(3)
    assert regatta.wait([first], num_returns=1, timeout=30)[0] == [first]
    second = square.options(num_cpus=2).remote(4)
    assert regatta.wait([second], num_returns=1, timeout=30)[0] == [second], "the first task's CPUs were never freed"
    dropped = square.options(num_cpus=2).remote(5)
    regatta.wait([dropped], num_returns=1, timeout=30)
    del dropped
    assert regatta.get(square.options(num_cpus=2).remote(6), timeout=30) == 36
    assert regatta.get([first, second]) == [9, 16]
    deadline = time.monotonic() + 15
    while regatta.available_resources().get("CPU", 0.0) < 2.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert regatta.available_resources().get("CPU", 0.0) == 2.0
    # None of those workers is kept for stopping at shutdown: each ended with its answer.
    driver = regatta._current()
    owned = set(driver.owned)
    more = [square.options(num_cpus=1).remote(i) for i in range(4)]
    regatta.wait(more, num_returns=4, timeout=60)
    square.options(num_cpus=1).remote(7)  # a new one-call worker prunes those that answered
    assert len(driver.one_call) == 1 and driver.owned == owned, (driver.one_call, driver.owned - owned)


def test_a_call_whose_actor_waits_for_resources_is_warned_about_and_runs_once_they_are_free(capsys, monkeypatch):
    monkeypatch.setattr(regatta, "_WAITING_WARN_AFTER", 1.0)
    holder = Counter.options(num_cpus=2).remote(0)
    assert regatta.get(holder.add.remote(1), timeout=60) == 1
    waiting = Counter.options(num_cpus=1).remote(0)
    ref = waiting.add.remote(5)
    deadline, err = time.time() + 30, ""
    while "waited" not in err and time.time() < deadline:
        err += capsys.readouterr().err
        time.sleep(0.2)
    assert "Counter.add has waited" in err and "CPU=1" in err and "regatta status" in err, err
    assert not ref._ready()
    regatta.kill(holder)
    assert regatta.get(ref, timeout=60) == 5
    regatta.kill(waiting)


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="unknown option 'num_cpu'"):
        square.options(num_cpu=1)
    with pytest.raises(ValueError, match="runtime_env.pip is not supported"):
        Counter.options(runtime_env={"pip": ["requests"]})
    with pytest.raises(ValueError, match="max_concurrency"):
        Counter.options(max_concurrency=0).remote(0)
    with pytest.raises(TypeError, match="cannot be called directly"):
        square(3)
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot be pickled"):
        square.remote(lock)
    with pytest.raises(TypeError, match="ObjectRef"):
        regatta.get(3)
    with pytest.raises(regatta.RegattaError, match="called already"):
        regatta.init()


def test_a_driver_that_exits_leaves_no_worker_process_behind(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import os, regatta
        regatta.init(num_cpus=1)

        @regatta.remote
        class Holder:
            def pid(self):
                return os.getpid()

        holder = Holder.remote()
        print(regatta.get(holder.pid.remote()), flush=True)
        # exits without shutdown(): the actor and the local cluster go with the driver
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip().splitlines()[-1])
    deadline = time.time() + 15
    while alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the actor's process outlived its driver"


@regatta.remote
def bump(counter, n):
    # A task handed an actor: it joins the cluster and calls it.
    return regatta.get(counter.add.remote(n))


@regatta.remote
def outer(x):
    # A task that starts a task of its own.
    return regatta.get(square.remote(x)) + 1


def test_actor_handles_travel_to_tasks_and_tasks_start_tasks():
    counter = Counter.remote(0)
    assert regatta.get(bump.remote(counter, 5), timeout=120) == 5
    assert regatta.get(counter.add.remote(0)) == 5, "the task called the same actor"
    assert regatta.get(outer.remote(7), timeout=120) == 50


def test_a_wrong_token_is_refused_with_a_clear_error():
    def attempt(token):
        script = textwrap.dedent(f"""
            import regatta
            try:
                regatta.init(address={regatta._current().cluster.address!r}, token={token!r})
            except RuntimeError as error:
                print("refused:", error)
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        return result.stdout + result.stderr

    # A join token the head does not know: refused by the head, saying why.
    out = attempt("abcdef." + "0" * 32)
    assert "refused:" in out and "knows no join token" in out, out
    # Not a join token at all (an older Regatta's): told how to make one.
    out = attempt("not-the-token")
    assert "refused:" in out and "regatta token generate" in out, out


@regatta.remote
def chatty(n):
    for i in range(n):
        print(f"chatty line {i}")
    return n


def test_what_remote_code_prints_reaches_the_driver_prefixed(capsys):
    counter = Counter.remote(0)
    assert regatta.get(chatty.remote(2)) == 2
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "chatty line" in line]
    assert len(lines) == 2 and lines[0].startswith("(chatty pid=") and lines[1].endswith("chatty line 1"), out
    regatta.get(counter.pid.remote())
    assert "Counter.pid" not in capsys.readouterr().out, "a call that prints nothing prints nothing"


@regatta.remote
def ticker(n, pause):
    import sys

    print("tick 0 (held a second, then sent live)")
    for i in range(1, n):
        time.sleep(pause)
        print(f"tick {i}", file=sys.stderr if i % 2 else sys.stdout)
    return n


@regatta.remote(max_concurrency=2)
class Announcer:
    def say(self, text):
        print(text)
        return text


def printed(capsys, needle):
    return [line for line in capsys.readouterr().out.splitlines() if needle in line]


def test_a_long_call_prints_while_it_runs_each_line_once_in_order(capsys):
    ref = ticker.remote(16, 0.4)
    # Lines arrive while the call runs: long before its result.
    seen, deadline = [], time.time() + 30
    while not any("tick 3" in line for line in seen) and time.time() < deadline:
        seen += printed(capsys, "tick")
        time.sleep(0.1)
    assert any(line == "(ticker) tick 3" for line in seen), seen
    assert not ref._ready(), "the lines came before the result"
    assert regatta.get(ref, timeout=60) == 16
    deadline = time.time() + 10
    while not any("tick 15" in line for line in seen) and time.time() < deadline:
        seen += printed(capsys, "tick")
        time.sleep(0.1)
    texts = [line.removeprefix("(ticker) ") for line in seen]
    assert texts == ["tick 0 (held a second, then sent live)"] + [f"tick {i}" for i in range(1, 16)], seen
    # An actor whose calls run beside each other: its prints are followed too.
    announcer = Announcer.remote()
    assert regatta.get(announcer.say.remote("hello from beside")) == "hello from beside"
    seen, deadline = [], time.time() + 10
    while not seen and time.time() < deadline:
        seen = printed(capsys, "hello from beside")
        time.sleep(0.1)
    assert seen == ["(Announcer.say) hello from beside"], seen


@regatta.remote
def total(array):
    return float(array.sum()), array.flags.writeable


@regatta.remote
def first_of(refs):
    # Refs nested inside a value stay refs: the task reads them itself.
    return regatta.get(refs[0])


def test_put_stores_an_array_once_and_tasks_and_actors_read_it_from_the_store():
    import numpy as np

    array = np.arange(1_000_000, dtype=np.float32)
    ref = regatta.put(array)
    back = regatta.get(ref)
    assert np.array_equal(back, array) and back.dtype == np.float32
    assert not back.flags.writeable, "what get returns is read-only, as Ray's is"
    assert regatta.get(total.remote(ref)) == (float(array.sum()), False)
    assert regatta.get(first_of.remote([ref])).shape == (1_000_000,)
    counter = Counter.remote(0)
    assert regatta.get(counter.add.remote(regatta.put(7))) == 7
    # A put value is a snapshot: changing the original later changes nothing stored.
    array[0] = 99.0
    assert regatta.get(ref)[0] == 0.0


def mapped_file(array):
    """What holds the array's first byte, from /proc/self/maps: (path, inode)."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return (fields[5].strip() if len(fields) > 5 else ""), fields[4]
    return "", ""


@regatta.remote
def mapping_in_a_task(array):
    return mapped_file(array), array.flags.writeable, float(array[-1])


def test_arrays_read_from_the_store_are_views_of_its_shared_memory_not_copies():
    import numpy as np

    array = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: above the 1 MiB shared-memory floor
    ref = regatta.put(array)
    first, second = regatta.get(ref), regatta.get(ref)
    assert np.array_equal(first, array) and not first.flags.writeable
    name, inode = mapped_file(first)
    # Not the heap and not an anonymous copy: the sealed memfd the put wrote and the store keeps.
    assert name.startswith("/memfd:regatta-object"), f"the array lives in {name!r}, not the object's shared memory"
    assert mapped_file(second) == (name, inode), "a second get maps the same pages"
    assert first.__array_interface__["data"][0] != array.__array_interface__["data"][0]
    # A task on the same host maps the very same file (same inode), read-only.
    (task_name, task_inode), writeable, last = regatta.get(mapping_in_a_task.remote(ref))
    assert task_name.startswith("/memfd:regatta-object") and task_inode == inode
    assert not writeable and last == float(array[-1])
    # Below the floor, values are copied as bytes, and still read-only arrays.
    small = regatta.get(regatta.put(np.arange(1000, dtype=np.int64)))
    assert small[-1] == 999 and not mapped_file(small)[0].startswith("/memfd:")


def test_objects_streamed_from_another_process_are_read_in_place_where_they_arrived(tmp_path):
    # Without shared memory between the processes (as between hosts), an object comes
    # through the cluster's transfer into the reader's store: get views those received
    # bytes, every time, instead of copying them again (into bytes, or a fresh memfd).
    script = tmp_path / "driver.py"
    # The script gets this module's mapped_file as source: it runs in a process of its own.
    script.write_text(inspect.getsource(mapped_file) + textwrap.dedent("""
        import json, os
        os.environ["REGATTA_NO_SHARED_MEMORY"] = "1"
        import numpy as np, regatta

        def twice(ref):
            first, second = regatta.get(ref), regatta.get(ref)
            return {"same": bool(np.shares_memory(first, second)), "file": mapped_file(first)[0],
                    "writeable": bool(first.flags.writeable), "last": int(first[-1]),
                    "sum": int(second.sum(dtype=np.int64))}

        @regatta.remote
        def make(n):
            # A ref inside the result: read from the store at each get (a call's own
            # result is read once and kept by its ref).
            return [regatta.put(np.arange(n, dtype=np.int32))]

        @regatta.remote
        def read(refs):
            return twice(refs[0])

        regatta.init(num_cpus=1)
        n = 4 << 20
        print(json.dumps({"driver": twice(regatta.get(make.remote(n))[0]),
                          "task": regatta.get(read.remote([regatta.put(np.arange(n, dtype=np.int32))]))}))
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    import json

    n = 4 << 20
    for reader, seen in json.loads(result.stdout.strip().splitlines()[-1]).items():
        assert seen["last"] == n - 1 and seen["sum"] == n * (n - 1) // 2, (reader, seen)
        assert seen["same"], f"{reader}: two gets of one object gave two copies"
        assert not seen["file"].startswith("/memfd:"), f"{reader}: the object was copied into {seen['file']!r}"
        assert not seen["writeable"], f"{reader}: what get returns is read-only"


@regatta.remote
def big_result(n):
    import numpy as np

    return {"rows": np.full(n, 7, dtype=np.int32), "label": "big"}


_SHMEM_HUGE = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_huge_kib():
    """The host's shared memory held in transparent huge pages, from /proc/meminfo."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("ShmemHugePages:"):
                return int(line.split()[1])
    return 0


@regatta.remote
class Maker:
    def huge_pages(self):
        return regatta._native.shared_memory_huge_pages()

    def ones(self, n):
        import numpy as np

        return np.ones(n, dtype=np.float64)


def test_a_large_object_is_written_into_huge_pages_where_the_host_gives_them_on_advice(monkeypatch):
    """Where the host gives shared memory huge pages only on advice, a put (the driver's, and
    an actor's large result) copies through an advised mapping and gets them; where it gives
    none, 4 KiB pages. As root on a host whose sysfs is writable (the CI kind) the test sets
    the host's setting to "advise" while it runs and puts the old one back."""
    import numpy as np

    if not os.path.exists(_SHMEM_HUGE):
        pytest.skip("this kernel has no transparent huge pages")
    with open(_SHMEM_HUGE) as setting:
        original = setting.read().split("[")[1].split("]")[0]
    try:
        with open(_SHMEM_HUGE, "w") as setting:
            setting.write("advise")
    except OSError:
        pass  # not ours to change: the host's setting as it is
    try:
        maker = Maker.remote()  # a process started now reads the setting now
        mode = regatta.get(maker.huge_pages.remote())
        monkeypatch.setattr(regatta, "_HUGE_BY_ADVICE", mode == "advise")
        n = (64 << 20) // 8
        before = shmem_huge_kib()
        put = regatta.put(np.arange(n, dtype=np.float64))
        after_put = shmem_huge_kib()
        made = maker.ones.remote(n)
        regatta.wait([made], num_returns=1, timeout=60)
        after_result = shmem_huge_kib()
        # The bytes are the put's, read in place either way.
        got = regatta.get(put)
        assert mapped_file(got)[0].startswith("/memfd:regatta-object")
        assert got[12345] == 12345.0 and got[-1] == n - 1
        assert float(regatta.get(made).sum()) == n
        if mode == "never":
            assert after_put - before < 2048 and after_result - after_put < 2048, (before, after_put, after_result)
        else:
            # 64 MiB each, in 2 MiB pages (the last may be short of a whole one).
            assert after_put - before >= 60 << 10, f"{mode}: the put's huge pages {before} -> {after_put} KiB"
            assert after_result - after_put >= 60 << 10, f"{mode}: the result's {after_put} -> {after_result} KiB"
        del got, put, made
    finally:
        try:
            with open(_SHMEM_HUGE, "w") as setting:
                setting.write(original)
        except OSError:
            pass


def test_large_results_come_through_the_store_and_are_read_in_place():
    import numpy as np

    # A task's result of 16 MiB: stored by the worker, held by the driver as the answer came,
    # mapped here (the worker's memfd), not copied through the pipes.
    ref = big_result.remote(4 << 20)
    time.sleep(0.5)  # the worker has long let go of it by the time it is read
    value = regatta.get(ref)
    assert value["label"] == "big" and value["rows"].shape == (4 << 20,) and int(value["rows"][-1]) == 7
    name, _ = mapped_file(value["rows"])
    assert name.startswith("/memfd:regatta-object"), f"the result lives in {name!r}, not in shared memory"
    assert regatta.get(ref) is value, "a call's result is read once"
    # An actor's large result too, and small ones still travel in the answer.
    counter = Counter.remote(0)
    assert regatta.get(counter.add.remote(np.ones(1 << 19))).sum() == 1 << 19
    assert int(regatta.get(big_result.remote(10))["rows"].sum()) == 70


def test_large_arguments_go_through_the_store_and_small_ones_in_the_call():
    import gc

    import numpy as np

    # A 16 MiB argument (above Ray's 100 KB threshold): stored by the driver and read by the
    # task on this host as a mapping of that object, not unpickled from the call's bytes.
    array = np.arange(4 << 20, dtype=np.float32)
    (name, _), writeable, last = regatta.get(mapping_in_a_task.remote(array))
    assert name.startswith("/memfd:regatta-object"), f"the argument arrived in {name!r}, not in shared memory"
    assert not writeable and last == float(array[-1])
    # One of 400 KB (stored, below the shared-memory floor) and a keyword argument.
    assert regatta.get(total.remote(array=np.ones(100_000))) == (100_000.0, False)
    # A small one travels inside the call: a writable array of the worker's own.
    (name, _), writeable, _ = regatta.get(mapping_in_a_task.remote(np.ones(10)))
    assert writeable and not name.startswith("/memfd:")
    # The stored argument outlives the caller's last reference until the call ran.
    ref = mapping_in_a_task.remote(np.full(1 << 20, 3, dtype=np.float32))
    gc.collect()
    time.sleep(0.3)
    assert regatta.get(ref)[2] == 3.0
    # An actor's method too.
    counter = Counter.remote(0)
    assert regatta.get(counter.add.remote(np.ones(1 << 18))).sum() == 1 << 18


@regatta.remote(num_returns=2)
def pair(x):
    return x, x + 1


def test_num_returns_splits_a_result_into_refs():
    first, second = pair.remote(10)
    assert regatta.get([second, first]) == [11, 10]
    counter = Counter.remote(0)
    assert regatta.get(counter.add.options(num_returns=1).remote(3)) == 3
    wrong = pair.options(num_returns=3).remote(1)
    with pytest.raises(regatta.RegattaError, match="num_returns=3 but returned 2"):
        regatta.get(wrong[0])
    assert pair.options(num_returns=0).remote(1) is None


def test_refs_can_be_awaited_in_asyncio():
    import asyncio

    async def main():
        values = await asyncio.gather(square.remote(5), pair.remote(1)[1])
        return values

    assert asyncio.run(main()) == [25, 2]


@regatta.remote
class Rendezvous:
    """Each call waits until `n` calls are inside at once: only calls that run beside each
    other can all return True."""

    def __init__(self):
        import asyncio

        self.inside = 0
        self.everyone = asyncio.Event()

    async def meet(self, n):
        import asyncio

        self.inside += 1
        if self.inside >= n:
            self.everyone.set()
        try:
            await asyncio.wait_for(self.everyone.wait(), timeout=30)
            return True
        except asyncio.TimeoutError:
            return False


@regatta.remote(max_concurrency=4)
class Threaded:
    def __init__(self):
        import threading

        self.barrier = threading.Barrier(4, timeout=30)

    def meet(self):
        self.barrier.wait()
        return True


def test_async_and_threaded_actors_run_calls_beside_each_other():
    meeting = Rendezvous.remote()
    assert regatta.get([meeting.meet.remote(10) for _ in range(10)], timeout=60) == [True] * 10
    threaded = Threaded.remote()
    assert regatta.get([threaded.meet.remote() for _ in range(4)], timeout=60) == [True] * 4
    with pytest.raises(ValueError, match="max_restarts"):
        Threaded.options(max_restarts=1).remote()


@regatta.remote
def read_env(name):
    return os.environ.get(name)


def test_runtime_env_vars_reach_tasks_and_actors():
    assert regatta.get(read_env.options(runtime_env={"env_vars": {"REGATTA_TEST_VAR": "task"}}).remote(
        "REGATTA_TEST_VAR"), timeout=60) == "task"
    assert regatta.get(read_env.remote("REGATTA_TEST_VAR")) is None, "the pool's workers do not get it"

    @regatta.remote
    class Env:
        def get(self, name):
            return os.environ.get(name)

    holder = Env.options(runtime_env={"env_vars": {"REGATTA_TEST_VAR": "actor"}}).remote()
    assert regatta.get(holder.get.remote("REGATTA_TEST_VAR"), timeout=60) == "actor"
