#!/usr/bin/env bash
# Installs libtorch 2.11 (the version tch 0.24 expects) from PyPI wheels into a cache
# outside the clone, without any download at run time: the CPU parts of the `torch` wheel
# (include/, libtorch_cpu.so, libtorch.so, libc10.so, libgomp) plus libcudart and libcupti
# from the NVIDIA runtime wheels, which libtorch links against even for CPU use.
# Idempotent. Prints the LIBTORCH path; export it (and LD_LIBRARY_PATH=$LIBTORCH/lib) for
# builds of the trainer.
set -euo pipefail

dest="${LIBTORCH:-$HOME/.cache/regatta/libtorch-2.11.0}"
if [ -f "$dest/.complete" ]; then
    echo "$dest"
    exit 0
fi
work="$(mktemp -d -t regatta-libtorch.XXXXXX)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --dest "$work" \
    "torch==2.11.0" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cupti==13.0.85" >&2
mkdir -p "$dest/lib" "$dest/include"
cd "$work"
python3 - "$dest" <<'PY'
import glob, os, shutil, sys, zipfile
dest = sys.argv[1]
keep_libs = ("libtorch_cpu.so", "libtorch.so", "libc10.so", "libgomp", "libcudart.so", "libcupti.so")
for wheel in glob.glob("*.whl"):
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            base = os.path.basename(name)
            if name.startswith("torch/include/") and not name.endswith("/"):
                target = os.path.join(dest, "include", name[len("torch/include/"):])
            elif "/lib/" in name and base.startswith(keep_libs):
                target = os.path.join(dest, "lib", base)
            else:
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with archive.open(name) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
PY
touch "$dest/.complete"
echo "$dest"
