#!/usr/bin/env bash
# The GPU check of bivit's invariant path, one run, under 7 minutes (docs/gpu.md): invariance of the full-size
# model in bf16 (alone / packed / reversed / N streams), the no-cuBLAS/SDPA guard, parity with bivit's CPU fp32
# forward, images/s (invariant, default, transformers). Writes gpu-check-results/gpu-check.{json,txt}.
#
#   scripts/gpu-check.sh --fetch-wheels   here, with the network: the wheels the GPU machine lacks -> .gpu-wheels/
#   scripts/gpu-check.sh                  on the GPU machine (no network): installs from .gpu-wheels/, runs
#   scripts/gpu-check.sh --dry-run        on a CPU: the same script at toy size under Triton's interpreter
#
# The GPU machine is expected to have Python 3.12, torch with CUDA and triton; it gets bivit from this tree
# (PYTHONPATH) and safetensors, numpy and the transformers baseline from the carried wheels when it lacks them.
# PyAV is not needed: the check feeds patches, not files.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels

if [ "${1:-}" = "--fetch-wheels" ]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
        "transformers==5.23.0" "safetensors>=0.4" "numpy>=1.24"
    du -sh "$WHEELS"
    exit 0
fi

if [ "${1:-}" != "--dry-run" ]; then
    for pair in safetensors:safetensors numpy:numpy transformers:transformers==5.23.0; do
        module=${pair%%:*}
        if ! python -c "import $module" 2>/dev/null; then
            if [ -d "$WHEELS" ]; then
                echo "gpu-check: installing $module from $WHEELS"
                pip install -q --no-index --find-links "$WHEELS" "${pair#*:}" || echo "gpu-check: $module not installed"
            else
                echo "gpu-check: $module missing and no $WHEELS (run --fetch-wheels where there is a network)"
            fi
        fi
    done
fi

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu-check: $(date -u +%FT%TZ) python $(python -c 'import sys; print(sys.version.split()[0])')"
timeout 420 python scripts/gpu_check.py "$@"
