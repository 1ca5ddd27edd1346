"""Ray's side of the cases `ray microbenchmark` lacks, printed in its line format.

Run by scripts/bench-vs-ray.sh inside the Ray virtualenv; not part of the test suite.
"""
import os
import statistics
import subprocess
import sys
import time

import psutil

# Ray 2.60 turns token authentication on for `ray start --head` but not for nodes joining
# from the same machine; the comparison runs without it, as Regatta's token is cheap.
os.environ["RAY_AUTH_MODE"] = "disabled"

import ray  # noqa: E402  (after the environment is set)
from ray.util import ActorPool  # noqa: E402


def report(case, unit, values):
    spread = statistics.pstdev(values) if len(values) > 1 else 0.0
    print(f"{case} {unit} {statistics.mean(values):.2f} +- {spread:.2f}", flush=True)


def ray_processes():
    mine = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != mine and ("ray" in cmd or "gcs_server" in cmd or "raylet" in cmd) and "ray_bench.py" not in cmd:
            found.append(proc)
    return found


def cluster_start(trials):
    ready, memory = [], []
    for _ in range(trials):
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
        started = time.perf_counter()
        subprocess.run(["ray", "start", "--head", "--port=6379", "--num-cpus=2", "--disable-usage-stats"], check=True, capture_output=True)
        for _ in range(2):
            subprocess.run(["ray", "start", "--address=127.0.0.1:6379", "--num-cpus=2"], check=True, capture_output=True)
        ray.init(address="127.0.0.1:6379", logging_level="ERROR")
        while sum(1 for n in ray.nodes() if n["Alive"]) < 3:
            time.sleep(0.05)
        ready.append(time.perf_counter() - started)
        ray.shutdown()
        time.sleep(10)
        memory.append(sum(p.info["memory_info"].rss for p in ray_processes() if p.info["memory_info"]) / 1e6)
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
    report("head and 2 workers ready", "seconds", ready)
    report("idle head and 2 workers resident", "megabytes", memory)


@ray.remote(num_cpus=0)
class Noop:
    def f(self, arg=None):
        return 0


def rate(case, trials, round_fn):
    values = []
    for _ in range(trials):
        started = time.perf_counter()
        ops = round_fn()
        values.append(ops / (time.perf_counter() - started))
    report(case, "per second", values)


def actor_cases(trials):
    ray.init(logging_level="ERROR")

    def creation():
        count = 20  # Ray starts one process per actor: about 2 per second here.
        actors = [Noop.remote() for _ in range(count)]
        ray.get([a.f.remote() for a in actors])
        for actor in actors:
            ray.kill(actor)
        return count

    rate("actor creation (create and call each)", trials, creation)
    workers = [Noop.remote() for _ in range(4)]
    ray.get([w.f.remote() for w in workers])

    def pool_map():
        items = 20_000
        pool = ActorPool(workers)
        list(pool.map(lambda actor, value: actor.f.remote(value), range(items)))
        return items

    rate("ActorPool map", trials, pool_map)
    ray.shutdown()


def cross_node_get(trials):
    """Two Ray nodes on this machine, each with its own object store (as two Regatta
    workers): an actor on one puts a numpy array, an actor on the other times `ray.get` of
    it, which Ray's object manager pulls between the stores. Printed under both of
    Regatta's path names so the table sets Ray's one figure beside each."""
    import numpy as np

    subprocess.run(["ray", "stop", "--force"], capture_output=True)
    subprocess.run(["ray", "start", "--head", "--port=6379", "--num-cpus=1", '--resources={"n0": 1}',
                    "--disable-usage-stats"], check=True, capture_output=True)
    subprocess.run(["ray", "start", "--address=127.0.0.1:6379", "--num-cpus=1", '--resources={"n1": 1}'],
                   check=True, capture_output=True)
    ray.init(address="127.0.0.1:6379", logging_level="ERROR")
    while sum(1 for n in ray.nodes() if n["Alive"]) < 2:
        time.sleep(0.05)

    @ray.remote(num_cpus=0, resources={"n0": 0.01})
    class Holder:
        def put(self, size, seed):
            array = (np.arange(size, dtype=np.uint64) * 31 + seed).astype(np.uint8)
            return [ray.put(array)]

    @ray.remote(num_cpus=0, resources={"n1": 0.01})
    class Reader:
        def fetch(self, refs):
            started = time.perf_counter()
            array = ray.get(refs[0])
            return array.nbytes / (time.perf_counter() - started) / 1e9

    holder, reader = Holder.remote(), Reader.remote()
    for label, size in [("100 MB", 100_000_000), ("1 GB", 1_000_000_000)]:
        rates = []
        for seed in range(trials):
            refs = ray.get(holder.put.remote(size, seed))
            rates.append(ray.get(reader.fetch.remote(refs)))
            del refs
        for path in ("shared memory", "network"):
            report(f"cross-node get {label} ({path}) gigabytes", "per second", rates)
            print("#   each trial: " + " ".join(f"{r:.2f}" for r in rates))
    ray.shutdown()
    subprocess.run(["ray", "stop", "--force"], capture_output=True)


if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    cases = sys.argv[2] if len(sys.argv) > 2 else "all"
    if cases in ("all", "cluster"):
        cluster_start(trials)
    if cases in ("all", "actors"):
        actor_cases(trials)
    if cases in ("all", "objects"):
        cross_node_get(trials)
