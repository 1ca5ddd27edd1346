#!/usr/bin/env bash
# Builds libregatta_cuda_graphs.so (torch/src/shim/cuda_graphs.cpp): libtorch's CUDA graphs
# behind a small C API, which regatta-torch-rank loads beside itself (or from
# REGATTA_CUDA_GRAPHS_LIB) once CUDA is found, to replay the generation engine's decode
# step. Built against a CUDA PyTorch wheel's headers and libraries (the CPU-staged libtorch
# the binaries link against has no libtorch_cuda); the wheel must be the one the binaries
# load at run time (same version), as scripts/gpu-proof.sh does on the GPU host.
#
#   scripts/build-cuda-graphs.sh OUT_DIR [PYTHON]
#
# PYTHON: a python whose torch is that wheel (default: the torch venv scripts/test.sh makes).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:?usage: $0 OUT_DIR [PYTHON]}"
py="${2:-${REGATTA_TORCH_VENV:-$HOME/.cache/regatta/torch-venv}/bin/python}"
torch_dir="$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || {
    echo "error: $py cannot import torch; pass a python with a CUDA build of torch 2.11" >&2
    exit 1
}
site="$(dirname "$torch_dir")"
cuda_include=""
for dir in "$site"/nvidia/cu13/include "$site"/nvidia/cuda_runtime/include; do
    if [ -f "$dir/cuda_runtime_api.h" ]; then
        cuda_include="$dir"
        break
    fi
done
if [ -z "$cuda_include" ] || [ ! -e "$torch_dir/lib/libtorch_cuda.so" ]; then
    echo "error: $torch_dir is not a CUDA build of torch (no libtorch_cuda.so or cuda_runtime_api.h under $site/nvidia)" >&2
    exit 1
fi
# The runtime wheel's headers include crt/host_config.h, which NVIDIA ships in another wheel
# (nvidia-cuda-crt, nvcc's headers): fetched once per CUDA version, outside the clone.
crt_include="$cuda_include"
if [ ! -f "$cuda_include/crt/host_config.h" ]; then
    cuda_version="$("$py" -c 'from importlib.metadata import version; print(".".join(version("nvidia-cuda-runtime").split(".")[:2]))')"
    crt_dir="${REGATTA_CACHE:-$HOME/.cache/regatta}/cuda-crt-$cuda_version"
    if [ ! -f "$crt_dir/nvidia/cu13/include/crt/host_config.h" ] && [ ! -f "$crt_dir/.done" ]; then
        "$py" -m pip install --quiet --no-deps --target "$crt_dir" "nvidia-cuda-crt==$cuda_version.*"
        touch "$crt_dir/.done"
    fi
    crt_include="$(dirname "$(dirname "$(find "$crt_dir" -path '*/include/crt/host_config.h' | head -n 1)")")"
    if [ ! -f "$crt_include/crt/host_config.h" ]; then
        echo "error: no crt/host_config.h for CUDA $cuda_version (nvidia-cuda-crt) under $crt_dir" >&2
        exit 1
    fi
fi
cuda_major="$(basename "$(dirname "$cuda_include")" | tr -dc '0-9')"
abi="$("$py" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"
mkdir -p "$out"
# No run path: at run time the libraries are the ones already loaded (the wheel's, through
# LD_LIBRARY_PATH), found by their sonames.
g++ -shared -fPIC -O2 -std=c++17 -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -I"$torch_dir/include" -I"$torch_dir/include/torch/csrc/api/include" -I"$cuda_include" -I"$crt_include" \
    "$repo/torch/src/shim/cuda_graphs.cpp" \
    -L"$torch_dir/lib" -ltorch_cuda -lc10_cuda -ltorch_cpu -lc10 \
    -L"$(dirname "$cuda_include")/lib" -l:libcudart.so."${cuda_major:-13}" \
    -o "$out/libregatta_cuda_graphs.so"
echo "$out/libregatta_cuda_graphs.so"
