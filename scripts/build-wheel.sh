#!/usr/bin/env bash
# Builds the `regatta` Python wheel with the `regatta` binary inside it (regatta/bin/regatta),
# so that `pip install regatta-*.whl` is the whole set-up: `regatta.init()` starts its local
# cluster from that binary, and `python -m regatta ...` is the CLI.
#
#   scripts/build-wheel.sh [--debug] [--out DIR]     (default: release build, into target/wheels)
#
# The binary is built first (cargo, the same target/), copied into the package for the
# wheel's build only, and removed again: the source tree never keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
out=target/wheels
while [ $# -gt 0 ]; do
    case "$1" in
        --debug) profile=debug ;;
        --out) out="$2"; shift ;;
        *) echo "usage: $0 [--debug] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
venv="${REGATTA_TEST_VENV:-$HOME/.cache/regatta/test-venv}"
maturin="$(command -v maturin || true)"
[ -n "$maturin" ] || maturin="$venv/bin/maturin"
[ -x "$maturin" ] || { echo "maturin not found: run scripts/test.sh once, or pip install maturin" >&2; exit 1; }
export PYO3_PYTHON="${PYO3_PYTHON:-$venv/bin/python}"

cargo_flags=()
maturin_flags=()
if [ "$profile" = release ]; then
    cargo_flags+=(--release)
    maturin_flags+=(--release)
fi
cargo build "${cargo_flags[@]}" -p regatta --bin regatta
bin_dir=python/regatta/bin
mkdir -p "$bin_dir"
trap 'rm -rf "$bin_dir"' EXIT
cp "target/$profile/regatta" "$bin_dir/regatta"
# Debug information stays out of the wheel (the debug binary is mostly that).
strip --strip-debug "$bin_dir/regatta" 2>/dev/null || true
"$maturin" build --quiet "${maturin_flags[@]}" -m python/Cargo.toml --out "$out" >&2
ls -1 "$out"/regatta-*.whl
