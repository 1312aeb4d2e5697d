"""What glibc's malloc thresholds (`bivit.base.allocator`) are worth: the same mode with and without them.

    python benchmarks/allocator.py                         # full-size K2.6, bf16, invariant, the bench's mix
    python benchmarks/allocator.py --dtype float32 --mode default --repeats 5
    python benchmarks/allocator.py --preset demo --repeats 1

Two `bivit bench` workers of one mode, one started with `BIVIT_MALLOC_TUNE=0` (glibc's defaults), one with
bivit's thresholds; the cases run alternately, the order rotating per round. Prints median seconds and minor
page faults per case and the tuned / untuned time ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bivit import bench


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], dtypes=sorted(bench.TORCH_DTYPES))
    p.add_argument("--mode", default="invariant", choices=("invariant", "default"))
    args = p.parse_args(argv)
    bench.start(args)
    threads = torch.get_num_threads()
    print(f"preset {args.preset}, {args.dtype}, bivit {args.mode} mode")
    cases = bench.standard_cases(args.seed)
    variants = ("glibc defaults", "bivit thresholds")
    res = {(v, c.name): {"s": [], "faults": []} for v in variants for c in cases}
    with tempfile.TemporaryDirectory(prefix="bivit-allocator-") as tmp:
        tmp = Path(tmp)
        bench.write_checkpoint_isolated(tmp / "checkpoint", args.preset, args.seed)
        bench.save_cases(tmp / "inputs.safetensors", cases)
        workers = {}
        try:
            for v in variants:
                os.environ["BIVIT_MALLOC_TUNE"] = "0" if v == variants[0] else "1"  # read by the spawned worker
                workers[v] = bench.Worker(f"bivit-{args.mode}", tmp / "checkpoint", args.dtype, threads,
                                          tmp / "inputs.safetensors")
            for r in range(args.repeats + 1):  # round 0: warm-up
                for i, c in enumerate(cases):
                    for v in (variants if (r + i) % 2 == 0 else variants[::-1]):
                        out = workers[v].run(i)
                        if r:
                            res[(v, c.name)]["s"].append(out["seconds"])
                            res[(v, c.name)]["faults"].append(out["minor_faults"])
        finally:
            os.environ.pop("BIVIT_MALLOC_TUNE", None)
            for w in workers.values():
                w.close()
    print(f"\nat the end: {bench.load_line()}\n")
    print("| case | " + " | ".join(f"{v} s (faults)" for v in variants) + " | tuned / defaults |")
    print("|---|---:|---:|---:|")
    totals = {v: 0.0 for v in variants}
    for c in cases:
        cells = []
        for v in variants:
            s = statistics.median(res[(v, c.name)]["s"])
            totals[v] += s
            cells.append(f"{s:.2f} ({statistics.median(res[(v, c.name)]['faults']) / 1e3:.0f}k)")
        ratio = statistics.median(res[(variants[1], c.name)]["s"]) / statistics.median(res[(variants[0], c.name)]["s"])
        print(f"| {c.name} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    print(f"| whole mix | {totals[variants[0]]:.2f} | {totals[variants[1]]:.2f} | "
          f"{totals[variants[1]] / totals[variants[0]]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
