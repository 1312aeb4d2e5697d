"""What bivit-arith/1 costs: this checkout's invariant encoder against another checkout's (the per-kind kernels
before it) and the transformers port, on the full-size model, in one interleaved run.

    git worktree add /tmp/bivit-before b914131        # the checkout to compare with
    python benchmarks/arith_cost.py --against /tmp/bivit-before --dtype bfloat16 --repeats 3

Every implementation runs in a process of its own (the other checkout's bivit from its own `src/` on PYTHONPATH)
on the same seeded checkpoint and the same float32 pixels (`bivit bench`'s cases: a 448x448 image, 32 images of
112x112 in one call, an 896x672 image); rounds are interleaved, the first implementation rotating per round, so a
shared machine's noise lands on all alike; times are medians of the timed rounds (one untimed warm-up round
first). Prints the command, the CPU (model name and flags) and a Markdown table of seconds and ratios, then the
same encodes split into the time inside bivit's GEMM calls and the rest (each checkout's own GEMM wrapper, timed
around every call), which says whether a difference is the GEMMs' or everything else's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bivit.bench import script_dtype

HERE = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, sys, time, torch
kind, ckpt, dtype, cases_path = sys.argv[1:5]
cases = torch.load(cases_path)
if kind == "hf":
    from bivit.bench.workers import load_runner
    from bivit.media.pixels import MediaBatch
    runner = load_runner("hf-sdpa", ckpt, dtype)
    run = lambda c: runner(MediaBatch(c["pixels"], c["grid"], None, ["x"] * len(c["grid"])))
else:
    import bivit
    from bivit.kernels.gemm import GemmKernel
    enc = bivit.load_encoder(ckpt, dtype=dtype, batch_invariant=kind != "default")
    run = lambda c: enc.encode_pixels(c["pixels"], c["grid"])
    gemm_call = GemmKernel.__call__
    def timed_gemm(*a, **k):
        t0 = time.perf_counter()
        try:
            return gemm_call(*a, **k)
        finally:
            gemm_s[0] += time.perf_counter() - t0
    GemmKernel.__call__ = timed_gemm
gemm_s = [0.0]
print(json.dumps({"ready": True, "bits": getattr(enc, "bits", None) if kind != "hf" else None}), flush=True)
for line in sys.stdin:
    i = int(line)
    gemm_s[0] = 0.0
    t0 = time.perf_counter()
    out = run(cases[i])
    print(json.dumps({"seconds": time.perf_counter() - t0, "gemm_seconds": gemm_s[0] if kind != "hf" else None,
                      "items": len(out)}), flush=True)
"""


def cpu_line() -> str:
    from bivit.kernels import cpu_info

    model, flags = cpu_info()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model} (flags: {', '.join(have) or 'no AVX2'}; PyTorch {torch.backends.cpu.get_cpu_capability()})"


class Impl:
    def __init__(self, name: str, kind: str, src: Path, ckpt: Path, dtype: str, cases: Path, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, kind, str(ckpt), dtype, str(cases)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the worker died (exit code {self.proc.wait()})")
        return json.loads(line)

    def run(self, i: int) -> tuple[float, float | None]:
        """(seconds of the encode, of it inside GEMM calls: None for the port)"""
        self.proc.stdin.write(f"{i}\n")
        got = self._read()
        return got["seconds"], got["gemm_seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", type=Path, required=True, help="another bivit checkout (its src/ is imported)")
    p.add_argument("--dtype", default="bfloat16", type=script_dtype(["bfloat16", "float32"]),
                   metavar="{bfloat16,float32}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", default="kimi-k2.6")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()

    from bivit.bench.workload import standard_cases, write_checkpoint

    print("$ python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    print(f"CPU {cpu_line()}, {args.threads} threads, torch {torch.__version__}", flush=True)
    cases = [c for c in standard_cases(0) if c.name in ("image 448x448", "32 images 112x112", "image 896x672")]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", args.preset, 0)
        path = Path(tmp) / "cases.pt"
        torch.save([{"pixels": c.batch.pixel_values, "grid": c.batch.grid_thw} for c in cases], path)
        specs = [("bivit-arith/1 (this checkout)", "invariant", HERE / "src"),
                 (f"per-kind kernels ({args.against.name})", "invariant", args.against / "src")]
        if not args.skip_hf:
            specs.append(("transformers port", "hf", HERE / "src"))
        impls = [Impl(name, kind, src, ckpt, args.dtype, path, args.threads) for name, kind, src in specs]
        for impl in impls:
            print(f"  {impl.name}: bits {impl.info.get('bits')}", flush=True)
        times: dict[tuple[str, str], list[float]] = {}
        gemm: dict[tuple[str, str], list[float]] = {}
        try:
            for r in range(args.repeats + 1):
                for i, case in enumerate(cases):
                    order = impls[r % len(impls):] + impls[:r % len(impls)]
                    for impl in order:
                        t, g = impl.run(i)
                        if r:  # round 0: warm-up
                            times.setdefault((impl.name, case.name), []).append(t)
                            if g is not None:
                                gemm.setdefault((impl.name, case.name), []).append(g)
                print(f"  round {r} done: " + ", ".join(f"{i.name} {sum(times.get((i.name, c.name), [0])[-1:]):.1f} s"
                                                        for i in impls for c in cases[:1]), flush=True)
        finally:
            for impl in impls:
                impl.close()
    base = impls[0].name
    print(f"\n| case ({args.dtype}) | " + " | ".join(i.name for i in impls) + " | "
          + " | ".join(f"{i.name} / {base}" for i in impls[1:]) + " |")
    print("|---" * (2 * len(impls)) + "|")
    for case in cases:
        med = [statistics.median(times[(i.name, case.name)]) for i in impls]
        print(f"| {case.name} | " + " | ".join(f"{m:.3f} s" for m in med) + " | "
              + " | ".join(f"{m / med[0]:.3f}" for m in med[1:]) + " |")
    split = [i for i in impls if (i.name, cases[0].name) in gemm]
    print(f"\n| case ({args.dtype}): in GEMM calls / the rest, medians | "
          + " | ".join(i.name for i in split) + " |")
    print("|---" * (len(split) + 1) + "|")
    for case in cases:
        cells = []
        for i in split:
            g, t = gemm[(i.name, case.name)], times[(i.name, case.name)]
            cells.append(f"{statistics.median(g):.3f} s / {statistics.median(x - y for x, y in zip(t, g)):.3f} s")
        print(f"| {case.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
