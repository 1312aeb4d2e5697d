#!/usr/bin/env bash
# The GPU check of bivit's invariant path (docs/gpu.md): one run that brings back every number, each section on
# its own, every result as JSON under --out (default $OUT when set), a one-screen summary.txt at the end.
#
#   scripts/gpu-check.sh --fetch-wheels   here, with the network: wheels the GPU machine may lack -> .gpu-wheels/
#   scripts/gpu-check.sh [--quick]        on the GPU machine (no network): installs only from .gpu-wheels/
#   scripts/gpu-check.sh --dry-run        on a CPU: every section at toy size under Triton's interpreter
#
# .gpu-wheels/ is git-ignored: name it in the device tool's `carry` so that it travels with the tree. The GPU
# machine's own python3 (with its CUDA torch and triton) runs the check; bivit comes from this tree (src/).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.gpu-wheels

if [ "${1:-}" = "--fetch-wheels" ]; then
    # What scripts/gpu_check.py imports beyond torch and triton (its NEEDED), for the GPU machine's CPython 3.12.
    # triton itself cannot travel (its wheel is over the 64 MiB a tree may carry): the preflight says when the
    # GPU machine's triton is not one the gpu extra allows.
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" \
        "numpy>=1.24" "safetensors>=0.4" "packaging>=23" || exit 1
    du -sh "$WHEELS"
    exit 0
fi

limit=470  # the check stops starting work at 450 s (160 s with --quick); this is the hard stop
for arg in "$@"; do [ "$arg" = "--quick" ] && limit=180; done
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/bivit-triton-cache}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu-check: $(date -u +%FT%TZ) $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
timeout "$limit" "$PY" scripts/gpu_check.py "$@"
