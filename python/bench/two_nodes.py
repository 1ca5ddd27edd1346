"""A 1 GiB numpy array put by the driver and read by a task on another node, and the
other way round, for Regatta or Ray: `python two_nodes.py regatta|ray [--gigabytes G]`.

Both run two nodes on this one host, their objects moving between the nodes' stores over
loopback TCP: Ray with `ray.cluster_utils.Cluster` (a head and a worker node, a plasma
store each), Regatta with its local cluster and `REGATTA_NO_SHARED_MEMORY=1` (the driver's
store and the worker's pass objects through the cluster's transfer, as between hosts,
instead of handing over shared memory). Prints one JSON line."""

import argparse
import json
import os
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["regatta", "ray"])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.backend == "ray":
        import ray as api
        from ray.cluster_utils import Cluster

        store = int(3 * args.gigabytes * (1 << 30)) + (256 << 20)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": store, "include_dashboard": False})
        cluster.add_node(num_cpus=2, resources={"far": 2}, object_store_memory=store)
        api.init(address=cluster.address, logging_level="ERROR")
        far = {"resources": {"far": 1}}
    else:
        os.environ["REGATTA_NO_SHARED_MEMORY"] = "1"
        import regatta as api

        api.init(num_cpus=2, resources={"far": 2})
        far = {"resources": {"far": 1}}

    import numpy as np

    @api.remote(**far)
    def size_of(refs):
        # The ref inside a list: the task reads it itself (from the driver's node).
        return int(api.get(refs[0]).nbytes)

    @api.remote(**far)
    def make(n):
        return np.ones(n, dtype=np.uint8)

    n = int(args.gigabytes * (1 << 30))
    gb = n / 1e9
    api.get(size_of.remote([api.put(np.ones(1 << 20, dtype=np.uint8))]))  # warm-up: workers up
    to_far, from_far = [], []
    for _ in range(args.rounds):
        ref = api.put(np.ones(n, dtype=np.uint8))
        start = time.perf_counter()
        assert api.get(size_of.remote([ref])) == n
        to_far.append(time.perf_counter() - start)
        del ref
        made = make.remote(n)
        api.wait([made], num_returns=1, fetch_local=False)  # made and stored on the far node first
        start = time.perf_counter()
        assert api.get(made).nbytes == n
        from_far.append(time.perf_counter() - start)
        del made
    results = {"backend": args.backend,
               "driver put, task on the other node gets, gigabytes per second": gb / min(to_far),
               "task on the other node returns, driver gets, gigabytes per second": gb / min(from_far)}
    print(json.dumps(results), flush=True)
    api.shutdown()
    if args.backend == "ray":
        cluster.shutdown()


if __name__ == "__main__":
    main()
