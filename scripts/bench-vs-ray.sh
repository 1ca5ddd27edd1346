#!/usr/bin/env bash
# Runs Ray's `ray microbenchmark` (plus ray_bench.py for the cases it lacks: actor
# creation, ActorPool map, cluster start time, idle memory) and `regatta bench` on this
# machine, one after the other, and prints one table: case, Ray, Regatta, ratio.
# Ray goes into its own cached virtualenv (~/.cache/regatta/ray-venv). Takes ~15 minutes
# on a 2-core machine; run it on an otherwise idle machine.
# `scripts/bench-vs-ray.sh objects` runs only the object cases (cross-node get between two
# Ray nodes with their own object stores on this machine, against `regatta bench objects`).
# `scripts/bench-vs-ray.sh store` runs Ray's object store put/get cases ("Plasma Store",
# "single client put gigabytes") against `regatta bench objects`.
# `scripts/bench-vs-ray.sh actors` runs only Ray's "1:1 actor calls" cases against
# `regatta bench actors` (with the machine's loopback round-trip floor beside them).
set -euo pipefail
cd "$(dirname "$0")/.."

ray_version="${RAY_VERSION:-2.60.0}"
venv="${REGATTA_RAY_VENV:-$HOME/.cache/regatta/ray-venv}"
if [ ! -x "$venv/bin/ray" ] || ! "$venv/bin/python" -c "import numpy, psutil, ray, sys; sys.exit(ray.__version__ != '$ray_version')"; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "ray[default]==$ray_version" numpy psutil
fi
export PATH="$venv/bin:$PATH"
export RAY_AUTH_MODE=disabled RAY_DISABLE_USAGE_STATS=1
trials="${TRIALS:-3}"
out="${BENCH_OUT:-target/bench}"
mkdir -p "$out"

suite="${1:-all}"
# The machine, then Ray's and Regatta's figures side by side (also in $out/table.md).
print_table() {
    echo
    echo "Machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(lscpu | sed -n 's/^Model name: *//p'); $(date -u +%Y-%m-%d)"
    python3 scripts/bench_table.py "$out/ray.txt" "$out/regatta.txt" | tee "$out/table.md"
}
cargo build --release --bin regatta
if [ "$suite" = "objects" ]; then
    echo "== Ray $ray_version: cross-node get"
    python "scripts/ray_bench.py" "$trials" objects 2>&1 | tee "$out/ray.txt"
    echo "== Regatta: regatta bench objects"
    ./target/release/regatta bench objects --trials "$trials" 2>/dev/null | tee "$out/regatta.txt"
    print_table
    exit 0
fi
if [ "$suite" = "store" ]; then
    echo "== Ray $ray_version: ray microbenchmark, the object store's put and get cases"
    ray stop --force >/dev/null 2>&1 || true
    RAY_DISABLE_USAGE_STATS=1 TESTS_TO_RUN="Plasma Store" timeout 1800 ray microbenchmark 2>&1 | tee "$out/ray.txt" || true
    ray stop --force >/dev/null 2>&1 || true
    RAY_DISABLE_USAGE_STATS=1 TESTS_TO_RUN="single client put gigabytes" timeout 1800 ray microbenchmark 2>&1 | tee -a "$out/ray.txt" || true
    ray stop --force >/dev/null 2>&1 || true
    echo "== Regatta: regatta bench objects"
    ./target/release/regatta bench objects --trials "$trials" 2>/dev/null | tee "$out/regatta.txt"
    print_table
    exit 0
fi
if [ "$suite" = "actors" ]; then
    echo "== Ray $ray_version: ray microbenchmark, 1:1 actor calls"
    ray stop --force >/dev/null 2>&1 || true
    # Ray's client-mode cases run after the filtered ones whatever the filter, and can fail to
    # start on a small machine; the figures needed are printed by then.
    RAY_DISABLE_USAGE_STATS=1 TESTS_TO_RUN="1:1 actor calls" timeout 1800 ray microbenchmark 2>&1 | tee "$out/ray.txt" ||
        echo "(ray microbenchmark failed after its 1:1 cases: its Ray Client part, not needed here)"
    ray stop --force >/dev/null 2>&1 || true
    echo "== Regatta: regatta bench actors"
    ./target/release/regatta bench actors --trials "$trials" 2>/dev/null | tee "$out/regatta.txt"
    print_table
    exit 0
fi
echo "== Ray $ray_version: ray microbenchmark"
ray stop --force >/dev/null 2>&1 || true
RAY_DISABLE_USAGE_STATS=1 timeout 3600 ray microbenchmark 2>&1 | tee "$out/ray.txt"
echo "== Ray: cluster start, idle memory, actor creation, ActorPool map"
RAY_DISABLE_USAGE_STATS=1 python "scripts/ray_bench.py" "$trials" 2>&1 | tee -a "$out/ray.txt"
ray stop --force >/dev/null 2>&1 || true
echo "== Regatta: regatta bench"
./target/release/regatta bench all --trials "$trials" 2>/dev/null | tee "$out/regatta.txt"
print_table
