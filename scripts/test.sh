#!/usr/bin/env bash
# Runs Regatta's whole test suite: unit tests of the pure cores, multi-process cluster
# tests (head and workers as real processes on loopback), robustness tests and doc tests.
# Idempotent; installs nothing the suite does not need. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Cluster tests start several processes each; two test threads keep 2-core machines responsive.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"

cargo build --workspace --all-targets
cargo test --workspace --all-targets
cargo test --workspace --doc
