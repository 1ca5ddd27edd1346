#!/usr/bin/env bash
# Stages the libtorch the image's regatta-torch-rank loads into the build context
# (target/docker-libtorch/<flavour>/lib), for `BINARIES=prebuilt` builds on machines where
# no image can be pulled. Files are hard-linked where the cache shares the filesystem.
#   cpu  (default): the CPU libtorch scripts/setup-libtorch.sh caches (about 440 MB).
#   cuda: torch/lib of the PyPI `torch==2.11.0` wheel (CUDA 13) with the NVIDIA runtime
#         wheels' libraries (cuBLAS, cuDNN, NCCL, ...), downloaded once into
#         ~/.cache/regatta/libtorch-cuda-2.11.0 (several GB).
# Idempotent; staging one flavour removes the other's staged files.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
flavour="${1:-cpu}"
out="$repo/target/docker-libtorch/$flavour/lib"
# One flavour at a time in the build context (the other would be sent with every build).
for other in cpu cuda; do
    [ "$other" != "$flavour" ] && rm -rf "$repo/target/docker-libtorch/$other"
done
mkdir -p "$out"
link_all() {
    for file in "$1"/*.so*; do
        [ -e "$out/$(basename "$file")" ] && continue
        ln "$file" "$out/" 2>/dev/null || cp "$file" "$out/"
    done
}
case "$flavour" in
    cpu)
        link_all "$(bash "$repo/scripts/setup-libtorch.sh")/lib"
        ;;
    cuda)
        cache="$HOME/.cache/regatta/libtorch-cuda-2.11.0"
        if [ ! -f "$cache/.complete" ]; then
            mkdir -p "$cache"
            python3 -m pip download --quiet --dest "$cache/wheels" "torch==2.11.0" >&2
            python3 - "$cache" <<'PY'
import glob, os, shutil, sys, zipfile
cache = sys.argv[1]
os.makedirs(os.path.join(cache, "lib"), exist_ok=True)
for wheel in glob.glob(os.path.join(cache, "wheels", "*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            base = os.path.basename(name)
            # torch/lib/*.so* and nvidia/*/lib/*.so* (cuBLAS, cuDNN, NCCL, the runtime).
            if ".so" in base and ("/lib/" in name) and (name.startswith("torch/lib/") or name.startswith("nvidia/")):
                with archive.open(name) as src, open(os.path.join(cache, "lib", base), "wb") as dst:
                    shutil.copyfileobj(src, dst)
PY
            rm -rf "$cache/wheels"
            touch "$cache/.complete"
        fi
        # cudarc (the NCCL binding) looks for libnccl.so; the wheel ships libnccl.so.2.
        [ -e "$cache/lib/libnccl.so.2" ] && ln -sf libnccl.so.2 "$cache/lib/libnccl.so"
        link_all "$cache/lib"
        # CUDA graphs for the decode step (regatta-torch-rank looks beside libtorch), built
        # against the same wheel where the torch venv scripts/test.sh makes is at hand;
        # without it the image's engine decodes eagerly and its log says so.
        torch_python="${REGATTA_TORCH_VENV:-$HOME/.cache/regatta/torch-venv}/bin/python"
        if [ -x "$torch_python" ]; then
            bash "$repo/scripts/build-cuda-graphs.sh" "$out" "$torch_python" >/dev/null
        else
            echo "warning: no torch venv at $torch_python: the image gets no CUDA graphs library" >&2
        fi
        ;;
    *)
        echo "unknown flavour $flavour; use cpu or cuda" >&2
        exit 2
        ;;
esac
echo "$out"
