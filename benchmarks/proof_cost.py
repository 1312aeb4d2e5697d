"""What every load pays on top of reading the weights: packing them for bivit's kernels and the load-time proof
(`bivit.ops.proof`), on a full-size model (seeded by torch, built in memory: no checkpoint on disk), in CPU time
and wall time. Nothing is compiled or kept between processes, so every load pays both.

    python benchmarks/proof_cost.py [--preset kimi-k2.6] [--dtype both] [--threads N]
"""

from __future__ import annotations

import sys
import time

import torch

from bivit import bench, ops
from bivit.checkpoint.config import PRESETS
from bivit.model import VisionModel


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], dtype="both", dtypes=sorted(bench.DTYPE_CHOICES))
    args = p.parse_args(argv)
    bench.start(args)
    for name in bench.DTYPE_CHOICES[args.dtype]:
        torch.manual_seed(args.seed)
        with torch.no_grad():
            net = VisionModel(PRESETS[args.preset]).to(getattr(torch, name)).requires_grad_(False)
            times = [(time.process_time(), time.perf_counter())]
            ops.pack_weights(ops.gemms(net))
            times.append((time.process_time(), time.perf_counter()))
            proof = ops.prove(net)
            times.append((time.process_time(), time.perf_counter()))
        (c0, w0), (c1, w1), (c2, w2) = times
        print(f"{name}: packing {c1 - c0:.2f} s CPU ({w1 - w0:.2f} s wall); proof {c2 - c1:.2f} s CPU "
              f"({w2 - w1:.2f} s wall), {len(proof.checks)} checks, each invariant: "
              f"{all(c.invariant for c in proof.checks)}", flush=True)
        del net
    print(bench.load_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
