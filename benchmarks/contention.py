"""Invariant vs default mode on a busy machine: the same case beside `--busy` CPU-bound processes.

    python benchmarks/contention.py                                  # full-size K2.6, 448x448, bf16, 2 busy loops
    python benchmarks/contention.py --dtype float32 --repeats 5
    python benchmarks/contention.py --preset demo --repeats 1        # quick check of the script itself

Invariant mode makes more, shorter parallel calls than default mode (pinned GEMM tiles, chunked pointwise
ops); each OpenMP fork/join waits for every thread, and on an oversubscribed machine some thread is always
descheduled. This script measures what that costs: both modes in their own worker processes (`bivit bench`'s
workers, same checkpoint and pixels), rounds alternating between "alone" and "beside N busy loops" (each a
process spinning in pure Python), the mode order rotating per round. It prints median times, the invariant /
default ratio in each condition (the issue's target: <= 1.5 beside two busy loops) and each condition's
slowdown. "Alone" means without *our* busy loops: the load average printed with it says what else ran.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bivit import bench
from bivit.errors import BivitError

MODES = ("bivit-invariant", "bivit-default")


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(100000):
            pass


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], dtypes=sorted(bench.TORCH_DTYPES))
    p.add_argument("--case", default="448x448", help="substring of a `bivit bench` case name")
    p.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the encoder")
    args = p.parse_args(argv)
    try:
        case = bench.select_cases([args.case], args.seed)[0]
    except BivitError as e:
        print(f"contention: error: {e}", file=sys.stderr)
        return 2
    bench.start(args)
    threads = torch.get_num_threads()
    print(f"preset {args.preset}, {args.dtype}, case {case.name}, {args.busy} busy loops, {args.repeats} rounds")
    ctx = multiprocessing.get_context("spawn")
    times = {(m, c): [] for m in MODES for c in ("alone", "busy")}
    loads = {"alone": [], "busy": []}
    with tempfile.TemporaryDirectory(prefix="bivit-contention-") as tmp:
        tmp = Path(tmp)
        bench.write_checkpoint_isolated(tmp / "checkpoint", args.preset, args.seed)
        bench.save_cases(tmp / "inputs.safetensors", [case])
        workers = {m: bench.Worker(m, tmp / "checkpoint", args.dtype, threads, tmp / "inputs.safetensors")
                   for m in MODES}
        try:
            for w in workers.values():
                w.run(0)  # warm-up
            for r in range(args.repeats):
                for cond in (("alone", "busy") if r % 2 == 0 else ("busy", "alone")):
                    stop, spinners = ctx.Event(), []
                    if cond == "busy":
                        spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
                        for s in spinners:
                            s.start()
                    try:
                        order = MODES if (r + (cond == "busy")) % 2 == 0 else MODES[::-1]
                        for m in order:
                            times[(m, cond)].append(workers[m].run(0)["seconds"])
                        loads[cond].append(os.getloadavg()[0])
                    finally:
                        stop.set()
                        for s in spinners:
                            s.join(timeout=5)
                    print(f"round {r + 1} {cond:5}: " + "  ".join(f"{m} {times[(m, cond)][-1]:.2f} s" for m in MODES),
                          file=sys.stderr, flush=True)
        finally:
            for w in workers.values():
                w.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print("\n| condition | load avg (1 min) | invariant s | default s | invariant / default |")
    print("|---|---:|---:|---:|---:|")
    for cond in ("alone", "busy"):
        inv, dflt = med[("bivit-invariant", cond)], med[("bivit-default", cond)]
        print(f"| {cond if cond == 'alone' else f'beside {args.busy} busy loops'} | "
              f"{statistics.median(loads[cond]):.1f} | {inv:.2f} | {dflt:.2f} | **{inv / dflt:.2f}** |")
    for m in MODES:
        print(f"{m}: busy / alone = {med[(m, 'busy')] / med[(m, 'alone')]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
