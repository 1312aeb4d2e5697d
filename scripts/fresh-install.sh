#!/usr/bin/env bash
# A fresh install as a user gets it, run where no C compiler is: build bivit's wheel (the package build compiles
# the CPU kernels), install it with its dependencies into a new virtual environment, then run it with no compiler
# reachable (PATH holds the environment's bin only, CC unset) and a new empty home: the first `bivit encode` of
# the sample (its time, its class of bits), `bivit encode` of the golden images (their rows against the committed
# hashes), `bivit doctor --prove` in bf16 and fp32 (the load-time proof and the demo model's golden rows, video
# included), and no file written outside --out.
#
#   bash scripts/fresh-install.sh [WORKDIR]      (CI: .ci/run; WORKDIR defaults to a new temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
mkdir -p "$work"
echo "fresh install in $work"
python -m build --wheel --outdir "$work/dist" . > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
python -m venv "$work/venv"
# torch pinned to the CPU build the README names (pip finds it on this machine's disk, as the README's line does)
"$work/venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0 "$work"/dist/bivit-*.whl
mkdir -p "$work/home" "$work/out"
run() {
    env -i PATH="$work/venv/bin" HOME="$work/home" TMPDIR="$work/home" LANG=C.UTF-8 "$@"
}
if run /bin/sh -c 'command -v cc || command -v gcc || command -v clang' >/dev/null 2>&1; then
    echo "a C compiler is reachable in the check's environment" >&2
    exit 1
fi
start=$(date +%s%N)
run bivit encode examples/sample.png --out "$work/out/sample.safetensors" 2> "$work/encode.err"
end=$(date +%s%N)
cat "$work/encode.err" >&2
if grep -qi compil "$work/encode.err"; then echo "the first encode compiled something" >&2; exit 1; fi
run python - "$work/out/sample.safetensors" <<'PY'
import sys
import bivit
with bivit.load_embeddings(sys.argv[1]) as f:
    assert f.encoder["bits"] == "bivit-arith/1", f.encoder["bits"]
    print(f"class {f.encoder['bits']}, fingerprint {f.encoder['fingerprint'][:12]}, {len(f)} item(s)")
PY
echo "first bivit encode of the sample on the fresh install: $(( (end - start) / 1000000 )) ms (wall, process start to exit)"
# The golden images written as PNG files and encoded by the command itself: each file's rows against the committed
# hashes (bivit/diagnose/golden.json; the golden video is decoded frames, not a file: doctor --prove checks it below).
mkdir -p "$work/golden"
run python - "$work/golden" <<'PY'
import sys
from bivit.diagnose import golden
for name, x in golden.inputs().items():
    if name.startswith("image"):
        x.save(f"{sys.argv[1]}/{name.split()[1]}.png")
PY
for dtype in bfloat16 float32; do
    run bivit encode "$work"/golden/*.png --dtype "$dtype" --out "$work/out/golden-$dtype.safetensors" 2>/dev/null
    run python - "$work/out/golden-$dtype.safetensors" "$dtype" <<'PY'
import sys
import bivit
from bivit.diagnose import golden
want = golden.committed()["bivit-arith/1"]["demo"][sys.argv[2]]
with bivit.load_embeddings(sys.argv[1]) as f:
    got = {f"image {r.source.rsplit('/', 1)[-1][:-4]}": golden.digest(r.embedding) for r in f}
assert got and all(got[k] == want[k] for k in got), {k: (got[k][:12], want[k][:12]) for k in got}
print(f"bivit encode of the {len(got)} golden images at {sys.argv[2]}: the committed rows, bit for bit")
PY
done
for dtype in bfloat16 float32; do
    run bivit doctor --prove --dtype "$dtype" > "$work/doctor-$dtype.txt"
    grep -E "^kernels|^bits|^proof" "$work/doctor-$dtype.txt"
    tail -1 "$work/doctor-$dtype.txt" | grep -q "^bits bivit-arith/1: match" || { echo "golden rows differ" >&2; exit 1; }
done
written=$(find "$work/home" -mindepth 1 | head -5)
if [ -n "$written" ]; then echo "files written outside --out: $written" >&2; exit 1; fi
echo "fresh install without a compiler: bivit-arith/1, golden rows match, nothing written outside --out"
