#!/usr/bin/env bash
# The main job: builds Regatta (release), starts a local cluster (head and 2 workers as
# processes, embedded defaults), runs the demo workload on it, prints a report and stops
# every process it started. Extra arguments go to `regatta demo`.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --bin regatta
exec ./target/release/regatta demo "$@"
