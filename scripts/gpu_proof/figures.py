#!/usr/bin/env python3
"""The GPU proof's figures as a Markdown table, from the step outputs in RUN_DIR (the JSON
lines each step left, and the `regatta score` summary lines). A missing step shows as
"-": the report lists every step's outcome above the table."""
import json
import pathlib
import re
import sys

run = pathlib.Path(sys.argv[1])
batches = sys.argv[2].split()


def load(name):
    try:
        return json.loads((run / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def fmt(value, spec=".0f"):
    return "-" if value is None else format(value, spec)


peak = (load("peak") or {}).get("gemm_flops_per_sec")
flops = (load("flops") or {}).get("flops_per_token")
rows = ["| figure | Regatta | peer (PyTorch + transformers) | ratio |", "| --- | ---: | ---: | ---: |"]
if peak:
    rows.append(f"| GEMM peak measured now ({(load('peak') or {}).get('dtype')}) | | {peak / 1e12:.1f} TFLOP/s | |")
for fixture in ["llama", "mistral", "qwen2"]:
    check = load(f"logits-{fixture}")
    if check:
        rows.append(
            f"| {fixture} fixture logits vs transformers ({check.get('dtype')}) | max abs diff "
            f"{check.get('max_abs_diff', float('nan')):.2e}, argmax agreement {check.get('argmax_agreement', 0):.3f} | | |"
        )
attention = load("attention-check")
if attention:
    rows.append(
        f"| packed attention, {attention.get('kernel')} on {attention.get('on')} vs dense mask in f32 | "
        f"output {attention.get('output_relative_diff', float('nan')):.1e}, gradients "
        f"{attention.get('gradient_relative_diff', float('nan')):.1e} (relative); {attention.get('kernel_ms', 0):.1f} ms "
        f"vs {attention.get('dense_mask_ms', 0):.1f} ms with the mask | | |"
    )
peer = load("peer-train") or {}
for stage in ["2", "3"]:
    ours = (load(f"train-zero{stage}") or {}).get("last") or {}
    tps, peer_tps = ours.get("tokens_per_sec"), peer.get("tokens_per_sec")
    ratio = f"{tps / peer_tps:.2f}x" if tps and peer_tps else "-"
    rows.append(f"| train ZeRO-{stage}, tokens/s (last step) | {fmt(tps)} | {fmt(peer_tps)} | {ratio} |")
    if tps and flops and peak:
        peer_mfu = f"{100 * flops * peer_tps / peak:.1f}%" if peer_tps else "-"
        rows.append(f"| train ZeRO-{stage}, MFU vs measured peak | {100 * flops * tps / peak:.1f}% | {peer_mfu} | |")
if peer.get("peak_allocated_bytes"):
    rows.append(f"| train peak allocated (peer) | | {peer['peak_allocated_bytes'] / 2**30:.1f} GiB | |")
for batch in batches:
    ours = None
    try:
        text = (run / f"generate-b{batch}.log").read_text()
        found = re.findall(r"(\d+) output tokens, ([0-9.]+) output tokens/s", text)
        ours = float(found[-1][1]) if found else None
    except OSError:
        pass
    theirs = (load(f"peer-generate-b{batch}") or {}).get("output_tokens_per_sec")
    ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
    rows.append(f"| generate, batch limit {batch}, output tokens/s (Regatta: end to end, start-up included) | {fmt(ours)} | {fmt(theirs)} | {ratio} |")
for batch in batches:
    ours, theirs = load(f"engine-b{batch}"), load(f"peer-ids-b{batch}")
    if not ours or not theirs:
        rows.append(f"| engine alone, batch limit {batch} | - | - | - |")
        continue
    tokens = sum(len(o) for o in ours["outputs"])
    peer_tokens = sum(len(o) for o in theirs["outputs"])
    same = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"]))
    agree = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(ours["outputs"], theirs["outputs"]))
    gen, peer_gen = tokens / ours["generate_seconds"], peer_tokens / theirs["generate_seconds"]
    e2e = tokens / (ours["load_seconds"] + ours["generate_seconds"])
    peer_e2e = peer_tokens / (theirs["load_seconds"] + theirs["generate_seconds"])
    decode = ours["decode_tokens"] / max(ours["decode_seconds"], 1e-9)
    rows.append(f"| engine alone (generate-ids), batch limit {batch}: output tokens/s generating | {gen:.0f} | {peer_gen:.0f} | {gen / peer_gen:.2f}x |")
    rows.append(f"| ... end to end, model load included | {e2e:.0f} | {peer_e2e:.0f} | {e2e / peer_e2e:.2f}x |")
    rows.append(f"| ... decode steps alone (Regatta) | {decode:.0f} | | |")
    rows.append(f"| ... identical rows; leading tokens in agreement | {same}/{len(ours['outputs'])}; {agree}/{peer_tokens} | | |")
    rows.append(f"| ... CUDA graphs: decode steps replayed; graphs captured | {ours.get('graph_steps', 0)}; {ours.get('graphs_captured', 0)}"
                f"{' (off: ' + ours['graphs_off'] + ')' if ours.get('graphs_off') else ''} | | |")
    eager = load(f"engine-eager-b{batch}")
    if eager:
        eager_tokens = sum(len(o) for o in eager["outputs"])
        eager_gen = eager_tokens / eager["generate_seconds"]
        eager_decode = eager["decode_tokens"] / max(eager["decode_seconds"], 1e-9)
        same_eager = sum(a == b for a, b in zip(ours["outputs"], eager["outputs"]))
        rows.append(f"| ... eager decode (`cuda_graphs: false`): tokens/s generating; decode steps alone; rows identical to graphs' | "
                    f"{eager_gen:.0f}; {eager_decode:.0f}; {same_eager}/{len(eager['outputs'])} | | graphs {gen / eager_gen:.2f}x |")
    if ours.get("peak_allocated_bytes") or theirs.get("peak_allocated_bytes"):
        rows.append(f"| ... peak allocated | {ours.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB | "
                    f"{theirs.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB | |")
sampled, sampled_eager = load(f"engine-sampled-b{batches[-1]}"), load(f"engine-sampled-eager-b{batches[-1]}")
if sampled and sampled_eager:
    rate = lambda o: sum(len(t) for t in o["outputs"]) / o["generate_seconds"]
    same = sum(a == b for a, b in zip(sampled["outputs"], sampled_eager["outputs"]))
    rows.append(f"| engine alone, sampling (temperature 0.8, top-p 0.95), batch limit {batches[-1]}: tokens/s generating, graphs; eager; rows identical "
                f"| {rate(sampled):.0f}; {rate(sampled_eager):.0f}; {same}/{len(sampled['outputs'])} | | graphs {rate(sampled) / rate(sampled_eager):.2f}x |")
    rows.append(f"| ... CUDA graphs: decode steps replayed; graphs captured | {sampled.get('graph_steps', 0)}; {sampled.get('graphs_captured', 0)}"
                f"{' (off: ' + sampled['graphs_off'] + ')' if sampled.get('graphs_off') else ''} | | |")
else:
    rows.append(f"| engine alone, sampling, batch limit {batches[-1]} | - | | |")
lora, peer_lora = (load("train-lora") or {}).get("last") or {}, load("peer-lora") or {}
tps, peer_tps = lora.get("tokens_per_sec"), peer_lora.get("tokens_per_sec")
ratio = f"{tps / peer_tps:.2f}x" if tps and peer_tps else "-"
rows.append(f"| LoRA r8 (ZeRO-2), tokens/s | {fmt(tps)} | {fmt(peer_tps)} | {ratio} |")
# QLoRA beside that LoRA run: the base's bytes held, the CUDA peak and tokens/s.
for name, label in [("train-lora", "as is (bf16)"), ("train-qlora-nf4", "NF4"), ("train-qlora-nf4-dq", "NF4, double quantization"), ("train-qlora-int8", "int8 (LLM.int8)")]:
    last = (load(name) or {}).get("last") or {}
    if not last:
        rows.append(f"| LoRA r8, base {label}: frozen bytes; CUDA peak allocated; tokens/s | - | | |")
        continue
    peak_bytes = last.get("cuda_peak_allocated_bytes")
    peak_text = "-" if peak_bytes is None else f"{peak_bytes / 2**30:.2f} GiB"
    rows.append(f"| LoRA r8, base {label}: frozen bytes; CUDA peak allocated; tokens/s | "
                f"{last.get('frozen_param_bytes', 0) / 2**20:.1f} MiB; {peak_text}; {fmt(last.get('tokens_per_sec'))} | | |")
print("\n".join(rows))
