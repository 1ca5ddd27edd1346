"""Ray's `ray microbenchmark` call and task cases, written once against the API Ray and
Regatta share, run for either: `python microbenchmark.py regatta|ray [--seconds S]`.

Prints one line per case in `ray microbenchmark`'s format, and a JSON line at the end."""

import argparse
import json
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["regatta", "ray"])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--gigabytes", type=float, default=1.0, help="size of the array put and got")
    args = parser.parse_args()
    if args.backend == "ray":
        import ray as api

        api.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR")
    else:
        import regatta as api

        api.init(num_cpus=args.cpus)

    @api.remote
    def small():
        return b"ok"

    @api.remote
    class Actor:
        def small(self):
            return b"ok"

    @api.remote
    class Client:
        """One of n callers of n actors (Ray's n:n case)."""

        def __init__(self, servers):
            self.servers = servers

        def round(self, calls):
            return len(api.get([s.small.remote() for _ in range(calls) for s in self.servers]))

    actor = Actor.remote()
    concurrent = Actor.options(max_concurrency=16).remote()
    n = args.cpus
    servers = [Actor.remote() for _ in range(n)]
    clients = [Client.remote(servers) for _ in range(n)]
    api.get([actor.small.remote(), concurrent.small.remote()] + [s.small.remote() for s in servers])
    api.get([small.remote() for _ in range(20)])
    api.get([c.round.remote(1) for c in clients])
    value = api.put(0)

    def timeit(name, body, per_call):
        # Warm-up, then as many rounds as fit in the time.
        body()
        start, rounds = time.perf_counter(), 0
        while time.perf_counter() - start < args.seconds:
            body()
            rounds += 1
        rate = rounds * per_call / (time.perf_counter() - start)
        print(f"{name} per second {rate:.2f} +- 0.0", flush=True)
        return rate

    results = {
        "single client tasks sync": timeit("single client tasks sync", lambda: api.get(small.remote()), 1),
        "single client tasks async": timeit(
            "single client tasks async", lambda: api.get([small.remote() for _ in range(200)]), 200),
        "1:1 actor calls sync": timeit("1:1 actor calls sync", lambda: api.get(actor.small.remote()), 1),
        "1:1 actor calls async": timeit(
            "1:1 actor calls async", lambda: api.get([actor.small.remote() for _ in range(200)]), 200),
        "1:1 actor calls concurrent": timeit(
            "1:1 actor calls concurrent", lambda: api.get([concurrent.small.remote() for _ in range(200)]), 200),
        "1:n actor calls async": timeit(
            "1:n actor calls async", lambda: api.get([s.small.remote() for _ in range(100) for s in servers]),
            100 * n),
        "n:n actor calls async": timeit(
            "n:n actor calls async", lambda: api.get([c.round.remote(50) for c in clients]), 50 * n * n),
        "single client put calls": timeit("single client put calls", lambda: api.put(0), 1),
        "single client get calls": timeit("single client get calls", lambda: api.get(value), 1),
    }
    # put and get of one large numpy array, against a plain copy of it (the memcpy floor).
    import numpy as np

    array = np.ones(int(args.gigabytes * (1 << 30)) // 8, dtype=np.float64)
    gb = array.nbytes / 1e9

    def best_of(body, rounds=3):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            body()
            times.append(time.perf_counter() - start)
        return gb / min(times)

    results["numpy copy (memcpy floor) gigabytes"] = best_of(lambda: array.copy())

    def memfd_write():
        # The same bytes written into fresh shared memory (a memfd), as a shared-memory
        # store must hold them: the floor for a put that readers on the host can map.
        import os

        fd = os.memfd_create("floor")
        try:
            view = memoryview(array).cast("B")
            while len(view):
                view = view[os.write(fd, view[:1 << 30]):]
        finally:
            os.close(fd)

    results["memfd write (shared-memory floor) gigabytes"] = best_of(memfd_write)

    def memfd_advised_copy():
        # The same bytes copied into a fresh memfd through a mapping advised for huge pages:
        # as fast as a copy where the host gives shared memory huge pages on advice
        # (transparent_hugepage/shmem_enabled "advise"), slower than the write where it never does.
        import mmap
        import os

        fd = os.memfd_create("floor")
        try:
            os.ftruncate(fd, array.nbytes)
            with mmap.mmap(fd, array.nbytes) as mapping:
                mapping.madvise(mmap.MADV_HUGEPAGE)
                mapping[:] = memoryview(array).cast("B")
        finally:
            os.close(fd)

    results["memfd copy, mapping advised huge pages gigabytes"] = best_of(memfd_advised_copy)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as setting:
            print(f"host's shared-memory huge pages: {setting.read().strip()}", flush=True)
    except OSError:
        pass
    refs = []
    results["single client put gigabytes"] = best_of(lambda: refs.append(api.put(array)))
    ref = refs[-1]
    results["single client get gigabytes"] = best_of(lambda: api.get(ref))
    for name in ("numpy copy (memcpy floor) gigabytes", "memfd write (shared-memory floor) gigabytes",
                 "memfd copy, mapping advised huge pages gigabytes", "single client put gigabytes", "single client get gigabytes"):
        print(f"{name} per second {results[name]:.2f} +- 0.0", flush=True)
    del refs, ref
    print(json.dumps({"backend": args.backend, **results}))
    api.shutdown()


if __name__ == "__main__":
    main()
