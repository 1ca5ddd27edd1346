#!/usr/bin/env bash
# The main job: sets up what is missing (libtorch 2.11 from PyPI wheels, cached in
# ~/.cache/regatta; a release build of `regatta` and its libtorch executor
# `regatta-torch-rank`), then starts a local cluster (head and 2 workers as processes,
# embedded defaults: data, checkpoints and scores on local disk), runs a quick actor and
# object workload, trains the built-in GPT with ZeRO-2 over 2 ranks, scores the shipped
# evaluation set before and after training with a pool of scorer actors, prints a report
# and stops every process it started (Ctrl-C too). Extra arguments go to `regatta demo`
# (for example --steps 500 or --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "setting up libtorch (cached after the first run)..."
bash scripts/setup-libtorch.sh >/dev/null
echo "building regatta and regatta-torch-rank (release)..."
cargo build --release --workspace --bins
exec ./target/release/regatta demo "$@"
