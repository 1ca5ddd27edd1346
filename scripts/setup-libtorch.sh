#!/usr/bin/env bash
# Installs libtorch 2.11 (the version tch 0.24 expects) from PyPI wheels into a cache
# outside the clone, without any download at run time: the CPU parts of the `torch` wheel
# (include/, libtorch_cpu.so, libtorch.so, libc10.so, libgomp) plus libcudart and libcupti
# from the NVIDIA runtime wheels, which libtorch links against even for CPU use.
# Idempotent. Prints the LIBTORCH path; export it (and LD_LIBRARY_PATH=$LIBTORCH/lib) for
# builds of the trainer.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
# The repository's .libtorch link is what .cargo/config.toml points cargo at.
link() {
    ln -sfn "$1" "$repo/.libtorch"
    echo "$1"
}
# A libtorch the user already points at (LIBTORCH with lib/libtorch.so) is used as is.
# Resolved physically: LIBTORCH may be this repository's own .libtorch link (cargo sets it
# so for processes it starts), which must never be linked to itself.
if [ -n "${LIBTORCH:-}" ] && [ -f "$LIBTORCH/lib/libtorch.so" ] && [ -d "$LIBTORCH/include" ]; then
    link "$(cd "$LIBTORCH" && pwd -P)"
    exit 0
fi
dest="${LIBTORCH:-$HOME/.cache/regatta/libtorch-2.11.0}"
if [ -f "$dest/.complete" ]; then
    link "$dest"
    exit 0
fi
work="$(mktemp -d -t regatta-libtorch.XXXXXX)"
trap 'rm -rf "$work"' EXIT
pip=(python3 -m pip)
if ! python3 -m pip --version >/dev/null 2>&1; then
    # No pip for the system Python: a throwaway virtualenv brings one.
    python3 -m venv "$work/venv" >&2
    pip=("$work/venv/bin/pip")
fi
"${pip[@]}" download --quiet --no-deps --dest "$work" \
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
link "$dest"
