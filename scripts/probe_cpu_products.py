"""The probe behind docs/NOTES.md's "Generation speed on the CPU" figures: one decode step's
matrix products of SmolLM2-135M (30 layers of distinct weights plus the tied head, so they
stream from memory as in the engine), timed with libtorch's `linear` and with weights
reordered once for oneDNN, separately and with q/k/v and gate/up stacked; then this
machine's bounds (f32 GEMM 2048^3, reading and copying memory). Run with the PyTorch of
scripts/test.sh's torch venv, nothing else running:

    ~/.cache/regatta/torch-venv/bin/python scripts/probe_cpu_products.py [--threads 2]
"""
import argparse
import time

import torch

LAYERS = 30
SEPARATE = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
GROUPED = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def timed(step, repeats=5):
    step()
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best


def products(shapes, rows, packed):
    weights = [[torch.randn(n, k) * 0.05 for n, k in shapes] for _ in range(LAYERS)] + [[torch.randn(*HEAD) * 0.05]]
    if packed:
        weights = [[torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in layer] for layer in weights]
    else:  # the engine's layout for decoder layers: [in, out] stored, handed over transposed
        weights = [[w.t().contiguous().t() for w in layer] for layer in weights[:-1]] + [weights[-1]]
    inputs = {k: torch.randn(rows, k) for k in (576, 1536)}

    def step():
        for layer in weights:
            for w in layer:
                x = inputs[w.shape[1]]
                if packed:
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                else:
                    torch.nn.functional.linear(x, w)
    return timed(step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"one decode step's products, {args.threads} threads (ms)")
    for rows in (1, 16, 64):
        plain = products(SEPARATE, rows, False)
        onednn = products(SEPARATE, rows, True)
        grouped = products(GROUPED, rows, True)
        print(f"rows {rows}: linear {plain * 1e3:.1f}, oneDNN {onednn * 1e3:.1f} ({plain / onednn:.2f}x), "
              f"oneDNN grouped {grouped * 1e3:.1f} ({onednn / grouped:.2f}x more)")
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    seconds = timed(lambda: a @ b, 10)
    print(f"f32 GEMM 2048^3: {2 * 2048 ** 3 / seconds / 1e9:.0f} GFLOP/s")
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 10)
    print(f"copying 256 MiB: {2 * (256 << 20) / seconds / 1e9:.1f} GB/s (read + write)")
    x = torch.randn(32 << 20)
    seconds = timed(lambda: x.sum(), 10)
    print(f"reading 128 MiB: {(128 << 20) / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
