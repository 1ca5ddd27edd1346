#!/usr/bin/env bash
# The GPU proof (issue 45), ready to run in one call on a GPU host lent for minutes.
#
#   scripts/gpu-proof.sh prepare        on the CPU machine: builds regatta and
#                                       regatta-torch-rank (release), gathers what the run
#                                       needs into .gpu-proof/ (git-ignored, at most 60 MiB:
#                                       stripped binaries, fixtures, configs, the peer scripts;
#                                       no libtorch: the GPU host's own torch/lib is used)
#   bash .gpu-proof/gpu-proof.sh run    on the GPU host, from that folder, no network:
#                                       every step under its own timeout, report.md beside it
#                                       written as the steps go, even when one fails
#   scripts/gpu-proof.sh run --cpu      the same steps, small and on the CPU (tested by
#                                       tests/gpu_proof.rs so the script cannot rot)
#
# The run needs a python3 (REGATTA_PROOF_PYTHON) with torch 2.11, transformers and peft: its
# torch/lib is the libtorch the binaries load (with its nvidia-* libraries), and it runs the
# peer side (plain PyTorch + transformers on the same device). Environment knobs:
#   REGATTA_PROOF_DIR       the folder (default: .gpu-proof in the repository)
#   REGATTA_PROOF_PROFILE   cargo profile of `prepare` (default release)
#   REGATTA_PROOF_MAX_MIB   the folder's size limit (default 60)
#   REGATTA_PROOF_BUDGET_SECS  seconds the whole run may take (default 540): later steps
#                           are skipped, not cut, so report.md is whole before a hard limit
#   REGATTA_PROOF_BIN_DIR   take regatta and regatta-torch-rank from here instead of
#                           building (the test hands over the binaries under test)
#   REGATTA_PROOF_STEPS     run only the steps whose names match this extended regular
#                           expression (default: all), e.g. '^(doctor|make-model|engine-.*|peer-ids-.*)$'
#   REGATTA_PROOF_PYTHON    (prepare too) the python whose CUDA torch wheel
#                           libregatta_cuda_graphs.so is built against (default: the torch
#                           venv scripts/test.sh makes); without one, the engine decodes eagerly
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

usage() {
    echo "usage: $0 prepare | run [--cpu]" >&2
    exit 2
}

prepare() {
    set -e
    local repo out profile target_dir max_mib size_mib
    repo="$(cd "$here/.." && pwd)"
    out="${REGATTA_PROOF_DIR:-$repo/.gpu-proof}"
    profile="${REGATTA_PROOF_PROFILE:-release}"
    max_mib="${REGATTA_PROOF_MAX_MIB:-60}"
    if [ -n "${REGATTA_PROOF_BIN_DIR:-}" ]; then
        target_dir="$REGATTA_PROOF_BIN_DIR"
    else
        bash "$repo/scripts/setup-libtorch.sh" >/dev/null
        (cd "$repo" && cargo build --profile "$profile" -p regatta --bin regatta -p regatta-torch --bin regatta-torch-rank)
        target_dir="$repo/target/$([ "$profile" = dev ] && echo debug || echo "$profile")"
    fi
    rm -rf "$out"
    mkdir -p "$out/bin" "$out/fixtures"
    for bin in regatta regatta-torch-rank; do
        strip -o "$out/bin/$bin" "$target_dir/$bin"
    done
    # CUDA graphs for the decode step, beside regatta-torch-rank (where it looks for them).
    local graphs_python="${REGATTA_PROOF_PYTHON:-${REGATTA_TORCH_VENV:-$HOME/.cache/regatta/torch-venv}/bin/python}"
    if [ -x "$graphs_python" ] || command -v "$graphs_python" >/dev/null 2>&1; then
        bash "$repo/scripts/build-cuda-graphs.sh" "$out/bin" "$graphs_python" >/dev/null
    else
        echo "warning: no python with a CUDA torch at $graphs_python: no CUDA graphs library (the engine will decode eagerly)" >&2
    fi
    for fixture in llama mistral qwen2; do
        cp -r "$repo/torch/tests/fixtures/$fixture" "$out/fixtures/"
    done
    cp "$repo"/scripts/gpu_proof/* "$repo/scripts/bench_vs_hf.py" "$out/"
    cp "$repo/scripts/gpu-proof.sh" "$out/gpu-proof.sh"
    cp "$repo/data/bench-llama.json" "$repo/data/corpus.txt" "$out/"
    git -C "$repo" rev-parse --short HEAD >"$out/COMMIT" 2>/dev/null || echo unknown >"$out/COMMIT"
    size_mib=$(du -sm "$out" | cut -f1)
    if [ "$size_mib" -gt "$max_mib" ]; then
        echo "error: $out holds $size_mib MiB, more than $max_mib MiB" >&2
        exit 1
    fi
    echo "prepared $out ($size_mib MiB, commit $(cat "$out/COMMIT")): run it with bash $out/gpu-proof.sh run"
}

# --- run ------------------------------------------------------------------------------------

root=""
work=""
run_started=0
budget=540
report=""
failed=0

# step NAME TIMEOUT_SECS COMMAND...: runs it with its output in run/NAME.log and a section
# in the report (command, outcome, seconds, the log's tail).
step() {
    local name="$1" limit="$2"
    shift 2
    local log="$work/$name.log" started status
    if [ -n "${REGATTA_PROOF_STEPS:-}" ] && ! [[ "$name" =~ $REGATTA_PROOF_STEPS ]]; then
        echo "$name: not selected"
        return 0
    fi
    started=$(date +%s)
    # The whole run keeps within its budget (the lent machine's command limit): a step
    # that would start too late is skipped, and never cut below 30 s.
    local left=$((run_started + budget - started))
    if [ "$left" -lt 30 ]; then
        failed=$((failed + 1))
        printf '### %s: SKIPPED (the run budget of %ss is spent)\n\n' "$name" "$budget" >>"$report"
        echo "$name: skipped (budget spent)"
        return 0
    fi
    [ "$left" -lt "$limit" ] && limit="$left"
    # Device memory in use, sampled every 200 ms while the step runs (both sides alike).
    local sampler=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$work/$name.mem" 2>/dev/null &
        sampler=$!
    fi
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    status=$?
    local memory=""
    if [ -n "$sampler" ]; then
        kill "$sampler" 2>/dev/null
        wait "$sampler" 2>/dev/null
        memory=", peak device memory $(sort -n "$work/$name.mem" | tail -n 1) MiB (nvidia-smi)"
    fi
    local secs=$(($(date +%s) - started))
    local outcome="ok"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        outcome="TIMED OUT after ${limit}s"
    elif [ "$status" -ne 0 ]; then
        outcome="FAILED (exit $status)"
    fi
    [ "$outcome" = ok ] || failed=$((failed + 1))
    {
        echo "### $name: $outcome, ${secs}s$memory"
        echo
        echo '```'
        echo "\$ $*"
        tail -n 25 "$log"
        echo '```'
        echo
    } >>"$report"
    echo "$name: $outcome (${secs}s)"
    return 0
}

# The last line of a step's log that is one JSON object, into run/NAME.json.
json_of() {
    [ -f "$work/$1.log" ] || return 0
    grep -E '^\{.*\}$' "$work/$1.log" | tail -n 1 >"$work/$1.json" || true
}

# train.toml for a run: MODEL_CONFIG_JSON or a model folder, ZeRO stage, LoRA rank, and
# optionally the number of ranks (default 1).
write_train_toml() {
    local file="$1" model="$2" stage="$3" lora="$4" world="${5:-1}"
    "$PY" - "$file" "$model" "$stage" "$lora" "$world" <<PY
import json, os, sys
file, model, stage, lora, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
lines = [
    f"world_size = {world}", "max_failures = 0", f"zero_stage = {stage}", "steps = $TRAIN_STEPS",
    "micro_batch_size = $MICRO_BATCH", 'device = "$DEVICE"', "threads = $THREADS",
    "resources = $RESOURCES", "activation_checkpointing = $CHECKPOINTING",
]
if lora:
    lines.append("[lora]")
    lines.append(f"rank = {lora}")
lines += ["[model]", "context = $SEQ"]
if os.path.isdir(model):
    lines.append(f'path = "{model}"')
else:
    lines.append("[model.config]")
    for key, value in json.load(open(model)).items():
        if value is not None:
            lines.append(f"{key} = {json.dumps(value)}")
lines += ["[data]", 'path = "$work/corpus.jsonl"']
open(file, "w").write("\n".join(lines) + "\n")
PY
}

write_score_toml() {
    local file="$1" batch="$2"
    cat >"$file" <<TOML
input = "$work/prompts.jsonl"
model = "$work/model"
output = "$work/gen-b$batch"
actors = 1
partitions = 1
generate = true
max_new_tokens = $GEN_TOKENS
max_batch = $batch
${KV_MB:+kv_cache_mb = $KV_MB}
device = "$DEVICE"
threads = $THREADS
resources = $RESOURCES
TOML
}

run() {
    local mode=gpu
    case "${1:-}" in
        --cpu) mode=cpu ;;
        "") ;;
        *) usage ;;
    esac
    if [ -x "$here/bin/regatta" ]; then
        root="$here"
    else
        root="${REGATTA_PROOF_DIR:-$(cd "$here/.." && pwd)/.gpu-proof}"
    fi
    if [ ! -x "$root/bin/regatta" ]; then
        echo "error: no prepared folder at $root: run scripts/gpu-proof.sh prepare first" >&2
        exit 2
    fi
    PY="${REGATTA_PROOF_PYTHON:-python3}"
    run_started=$(date +%s)
    budget="${REGATTA_PROOF_BUDGET_SECS:-540}"
    work="$root/run"
    report="$root/report.md"
    rm -rf "$work"
    mkdir -p "$work/lib"
    # Not the repository root: its torch/ folder would shadow the torch package.
    cd "$work"
    # The python's torch/lib is the libtorch both sides load; its nvidia-* wheels bring
    # cuBLAS, cuDNN and NCCL. cudarc looks for libnccl.so, the wheel ships libnccl.so.2.
    local torch_dir site
    torch_dir="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || {
        echo "error: $PY cannot import torch; set REGATTA_PROOF_PYTHON to a python with torch 2.11" >&2
        exit 2
    }
    site="$(dirname "$torch_dir")"
    local libs="$work/lib:$torch_dir/lib"
    for dir in "$site"/nvidia/*/lib; do
        [ -d "$dir" ] && libs="$libs:$dir"
    done
    for nccl in "$site"/nvidia/*/lib/libnccl.so.2; do
        [ -e "$nccl" ] && ln -sf "$nccl" "$work/lib/libnccl.so"
    done
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export REGATTA_TORCH_RANK="$root/bin/regatta-torch-rank"
    export PATH="$root/bin:$PATH"
    local rank="$root/bin/regatta-torch-rank" regatta="$root/bin/regatta"

    if [ "$mode" = gpu ]; then
        # Activation checkpointing on both sides: a 1.1B model at context 2048 must fit an
        # 80 GB H100 while Regatta still computes in f32 with the math attention kernel.
        DEVICE=cuda DTYPE=bfloat16 MODEL_CONFIG="$root/llama-1b.json" SEQ=2048 MICRO_BATCH=4
        TRAIN_STEPS=20 THREADS=4 RESOURCES='{ CPU = 1, GPU = 1 }' GEN_BATCHES="1 32 128"
        GEN_TOKENS=64 KV_MB="" LORA_STEPS=10 DOCTOR_FLAGS="--require-cuda"
        CHECKPOINTING=true PEER_FLAGS="--checkpointing"
    else
        DEVICE=cpu DTYPE=float32 MODEL_CONFIG="$root/bench-llama.json" SEQ=64 MICRO_BATCH=2
        TRAIN_STEPS=4 THREADS=2 RESOURCES='{ CPU = 1 }' GEN_BATCHES="1 8" GEN_TOKENS=8
        KV_MB=64 LORA_STEPS=3 DOCTOR_FLAGS="" CHECKPOINTING=false PEER_FLAGS=""
    fi
    # The fixtures' logits are compared in bf16 on either device (f32 equality is
    # torch/tests/hf.rs's on the CPU).
    local logits_dtype=bfloat16
    {
        echo "# Regatta GPU proof ($mode mode)"
        echo
        echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit $(cat "$root/COMMIT" 2>/dev/null)"
        echo "- host: $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1 || echo 'no nvidia-smi')"
        echo "- python: $("$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)' 2>&1)"
        echo "- device $DEVICE, peer dtype $DTYPE, model $(basename "$MODEL_CONFIG"), context $SEQ, micro-batch $MICRO_BATCH, $TRAIN_STEPS steps"
        echo
    } >"$report"

    step doctor 120 "$rank" doctor $DOCTOR_FLAGS
    step doctor-json 60 "$rank" doctor --json
    step peak 180 "$PY" "$root/peer.py" peak --device "$DEVICE" --dtype "$DTYPE"
    json_of peak
    for fixture in llama mistral qwen2; do
        step "logits-$fixture" 180 bash -c "'$rank' logits '$root/fixtures/$fixture' '$root/fixtures/$fixture/reference.safetensors' '$work/$fixture.logits.safetensors' --device $DEVICE --dtype $logits_dtype && '$PY' '$root/logits_check.py' --model '$root/fixtures/$fixture' --ids '$root/fixtures/$fixture/reference.safetensors' --regatta '$work/$fixture.logits.safetensors' --device $DEVICE --dtype $logits_dtype"
        json_of "logits-$fixture"
    done

    step attention-check 180 "$rank" attention-check --device "$DEVICE" --time "$SEQ"
    json_of attention-check
    # NCCL on the one GPU: collectives on the communication stream, device timing, overlap,
    # a missing rank's join timeout, ZeRO-3 (prefetch, offload) over NCCL against no
    # collective (torch/src/nccl_check.rs). It needs CUDA: not a CPU-mode step.
    if [ "$mode" = gpu ]; then
        step nccl-check 300 "$rank" nccl-check
        json_of nccl-check
    fi
    # Training rows are documents (the corpus's lines, a docstring paragraph each) packed to
    # the context, so the packed-rows attention path is the one measured.
    "$PY" - "$root/corpus.txt" "$work/corpus.jsonl" <<'PY'
import json, sys
text = open(sys.argv[1], encoding="utf-8").read()
with open(sys.argv[2], "w") as out:
    for paragraph in text.split("\n"):
        if paragraph.strip():
            out.write(json.dumps({"text": paragraph.strip()}) + "\n")
PY
    step flops 60 "$PY" "$root/peer.py" flops --config "$MODEL_CONFIG" --seq "$SEQ"
    json_of flops
    for stage in 2 3; do
        write_train_toml "$work/train-zero$stage.toml" "$MODEL_CONFIG" "$stage" 0
        step "train-zero$stage" 420 "$regatta" train --config "$work/train-zero$stage.toml" --json --log-every 5
        json_of "train-zero$stage"
    done
    # Two ranks on the one GPU: NCCL refuses two ranks on one device ("Duplicate GPU"), so
    # on a single-GPU host this shows how that failure reads; it is not counted as failed.
    # On the CPU the two ranks train over the ring.
    write_train_toml "$work/train-zero3-2ranks.toml" "$MODEL_CONFIG" 3 0 2
    sed -i "s/^steps = .*/steps = $LORA_STEPS/" "$work/train-zero3-2ranks.toml"
    local before=$failed
    step train-zero3-2ranks 180 "$regatta" train --config "$work/train-zero3-2ranks.toml" --json
    [ "$mode" = gpu ] && failed=$before
    step peer-train 300 "$PY" "$root/peer.py" train --config "$MODEL_CONFIG" --seq "$SEQ" --batch "$MICRO_BATCH" \
        --steps "$TRAIN_STEPS" --device "$DEVICE" --dtype "$DTYPE" $PEER_FLAGS
    json_of peer-train

    step make-model 240 "$PY" "$root/make_model.py" --config "$MODEL_CONFIG" --tokenizer "$root/fixtures/llama/tokenizer.json" \
        --out "$work/model" --dtype "$DTYPE" --device "$DEVICE"
    local rows
    for batch in $GEN_BATCHES; do
        rows=$((batch * 2 > 8 ? batch * 2 : 8))
        "$PY" - "$work/prompts-$batch.jsonl" "$rows" <<'PY'
import json, sys
words = "the river runs past a small town where people trade grain wool and salt every week".split()
with open(sys.argv[1], "w") as out:
    for i in range(int(sys.argv[2])):
        n = 4 + i % 7
        out.write(json.dumps({"id": str(i), "prompt": " ".join(words[(i + j) % len(words)] for j in range(n))}) + "\n")
PY
        cp "$work/prompts-$batch.jsonl" "$work/prompts.jsonl"
        write_score_toml "$work/score-b$batch.toml" "$batch"
        step "generate-b$batch" 300 "$regatta" score --config "$work/score-b$batch.toml" --workers 1
        step "peer-generate-b$batch" 300 "$PY" "$root/peer.py" generate --model "$work/model" --prompts "$work/prompts-$batch.jsonl" \
            --max-new-tokens "$GEN_TOKENS" --batch "$batch" --device "$DEVICE" --dtype "$DTYPE"
        json_of "peer-generate-b$batch"
        # The budget each actor's executor chose (unset kv_cache_mb on the GPU: from the
        # memory free after the weights), from the local cluster's node logs.
        step "kv-budget-b$batch" 10 bash -c "grep -rh 'KV cache budget' \"\$(sed -n 's/.*(logs in \(.*\))/\1/p' '$work/generate-b$batch.log' | head -n 1)\""
        # The engine alone beside transformers.generate on the same token ids (tokenized
        # once here), each side's load and generation timed apart: the side-by-side of
        # scripts/bench-vs-hf.sh, on the device.
        "$PY" "$root/bench_vs_hf.py" ids --model "$work/model" --jsonl "$work/prompts-$batch.jsonl" \
            --out "$work/ids-$batch.json" --batch "$batch" --max-new-tokens "$GEN_TOKENS" --threads "$THREADS" \
            --device "$DEVICE" --kv-cache-mb "${KV_MB:-32768}" >"$work/ids-$batch.log" 2>&1
        # Both print every row's tokens as one JSON line: into run/NAME.json, not the report.
        # First without CUDA graphs (each decode step's kernels launched one by one), then
        # with them (the default).
        "$PY" -c 'import json, sys; job = json.load(open(sys.argv[1])); job["cuda_graphs"] = False; json.dump(job, open(sys.argv[2], "w"))' \
            "$work/ids-$batch.json" "$work/ids-eager-$batch.json"
        step "engine-eager-b$batch" 300 bash -c "'$rank' generate-ids '$work/model' '$work/ids-eager-$batch.json' >'$work/engine-eager-b$batch.json'"
        step "engine-b$batch" 300 bash -c "'$rank' generate-ids '$work/model' '$work/ids-$batch.json' >'$work/engine-b$batch.json'"
        step "peer-ids-b$batch" 300 bash -c "'$PY' '$root/bench_vs_hf.py' hf --model '$work/model' --prompts '$work/ids-$batch.json' \
            --batch $batch --max-new-tokens $GEN_TOKENS --threads $THREADS --device $DEVICE --dtype $DTYPE >'$work/peer-ids-b$batch.json'"
    done

    # Sampling rows (temperature 0.8, top-p 0.95, each row its own seeded stream) at the
    # largest batch limit, without and with CUDA graphs: the same logits give the same draws,
    # so the rows must be identical.
    local last_batch="${GEN_BATCHES##* }"
    if [ -f "$work/ids-$last_batch.json" ]; then
        "$PY" -c 'import json, sys
job = json.load(open(sys.argv[1]))
job.update(temperature=0.8, top_p=0.95, seed=7)
json.dump(job, open(sys.argv[2], "w"))
job["cuda_graphs"] = False
json.dump(job, open(sys.argv[3], "w"))' "$work/ids-$last_batch.json" "$work/ids-sampled-$last_batch.json" "$work/ids-sampled-eager-$last_batch.json"
    fi
    step "engine-sampled-eager-b$last_batch" 300 bash -c "'$rank' generate-ids '$work/model' '$work/ids-sampled-eager-$last_batch.json' >'$work/engine-sampled-eager-b$last_batch.json'"
    step "engine-sampled-b$last_batch" 300 bash -c "'$rank' generate-ids '$work/model' '$work/ids-sampled-$last_batch.json' >'$work/engine-sampled-b$last_batch.json'"

    # LoRA needs the model folder make-model wrote; without it the step fails on its own.
    mkdir -p "$work/model"
    write_train_toml "$work/train-lora.toml" "$work/model" 2 8
    sed -i "s/^steps = .*/steps = $LORA_STEPS/" "$work/train-lora.toml"
    step train-lora 300 "$regatta" train --config "$work/train-lora.toml" --json --log-every 5
    json_of train-lora
    # QLoRA: the same run with the base's projections in 4 bits (NF4; then with double
    # quantization) and in LLM.int8's bytes: the step lines' frozen bytes and CUDA peaks
    # against train-lora's.
    for quant in nf4 nf4-dq int8; do
        sed -e "s/^rank = 8$/rank = 8\nbase_quantization = \"${quant%-dq}\"/" "$work/train-lora.toml" >"$work/train-qlora-$quant.toml"
        [ "$quant" = nf4-dq ] && sed -i "s/^base_quantization = .*/&\ndouble_quant = true/" "$work/train-qlora-$quant.toml"
        step "train-qlora-$quant" 300 "$regatta" train --config "$work/train-qlora-$quant.toml" --json --log-every 5
        json_of "train-qlora-$quant"
    done
    step peer-lora 300 "$PY" "$root/peer.py" train --config "$MODEL_CONFIG" --seq "$SEQ" --batch "$MICRO_BATCH" \
        --steps "$LORA_STEPS" --device "$DEVICE" --dtype "$DTYPE" --lora-rank 8 --warmup 1 $PEER_FLAGS
    json_of peer-lora

    # `regatta bench train` on the device: ranks as the GPUs allow, MFU against the bf16
    # GEMM rate it measures itself (a short run: --quick, the 1.1B model).
    if [ "$mode" = gpu ]; then
        step bench-train 180 env REGATTA_BENCH_CORPUS="$root/corpus.txt" "$regatta" bench train --device cuda --quick --trials 1 --model "$MODEL_CONFIG"
    fi

    "$PY" "$root/figures.py" "$work" "$GEN_BATCHES" >"$work/figures.md" 2>&1 || true
    { echo "## Figures"; echo; cat "$work/figures.md"; echo; echo "$failed step(s) failed."; } >>"$report"
    echo "report: $report ($failed step(s) failed)"
    [ "$failed" -eq 0 ]
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) usage ;;
esac
