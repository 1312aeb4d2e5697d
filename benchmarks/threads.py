"""How encoding time scales with threads: the same implementations at several thread counts, interleaved.

    python benchmarks/threads.py                                   # 1, 2, 4 ... up to the CPU count; bf16
    python benchmarks/threads.py --threads-list 1 2 --case 112x112 # chosen thread counts and cases
    python benchmarks/threads.py --impl bivit-invariant --impl hf-sdpa
    python benchmarks/threads.py --preset demo --repeats 1         # quick check of the script itself

One worker process per (implementation, thread count), each holding the model (`bivit bench`'s workers, seeded
random full-size weights, the bench's input mix); round by round every worker runs every case, the order of the
workers rotating per round, so the machine's noise lands on every thread count alike. Reported per case: the
median time per thread count, the speed-up over the smallest thread count, the parallel efficiency
(speed-up / thread ratio), and the CPU use (CPU seconds per wall second per thread: far below 100% means the
run did not get its cores, and its speed-up is not a measurement of scaling). Thread counts above the CPU count
are refused: they measure the scheduler, not the code.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bivit import bench
from bivit.checkpoint.config import PRESETS
from bivit.errors import BivitError

IMPL_DEFAULT = ("bivit-invariant", "hf-sdpa")


def main() -> None:
    p = bench.script_args(__doc__.splitlines()[0], repeats=2)
    p.add_argument("--threads-list", type=int, nargs="+", default=None,
                   help="thread counts (default: 1, 2, 4 ... up to the CPU count)")
    p.add_argument("--impl", action="append", choices=bench.IMPLS, default=None)
    p.add_argument("--case", action="append", default=None, help="cases whose name contains this (repeatable)")
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    cpus = os.cpu_count() or 1
    counts = sorted(set(args.threads_list or [t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) if t <= cpus]))
    if counts[0] < 1 or counts[-1] > cpus:
        sys.exit(f"threads.py: thread counts must be within 1..{cpus} (this machine's CPU count)")
    impls = args.impl or list(IMPL_DEFAULT)
    if "hf-sdpa" in impls and (reason := bench.hf_unavailable_reason(PRESETS[args.preset])):
        print(f"the transformers port is skipped: {reason}")
        impls.remove("hf-sdpa")
    env = bench.start(args)
    try:
        cases = bench.select_cases(args.case, args.seed)
    except BivitError as e:
        sys.exit(f"threads.py: {e}")
    workers: dict[tuple[str, int], bench.Worker] = {}
    times: dict[tuple[str, int, str], list[float]] = {}
    cpu: dict[tuple[str, int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bivit-threads-") as tmp:
        checkpoint, inputs = Path(tmp) / "checkpoint", Path(tmp) / "inputs.safetensors"
        bench.write_checkpoint_isolated(checkpoint, args.preset, args.seed)
        bench.save_cases(inputs, cases)
        try:
            for impl in impls:
                for t in counts:
                    workers[impl, t] = bench.Worker(impl, checkpoint, args.dtype, t, inputs)
            keys = list(workers)
            for r in range(args.warmup + args.repeats):
                for ci, case in enumerate(cases):
                    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                        res = workers[key].run(ci)
                        if r >= args.warmup:
                            times.setdefault((*key, case.name), []).append(res["seconds"])
                            cpu.setdefault((*key, case.name), []).append(res["cpu_s"] / res["seconds"] / key[1])
                    print(f"{'round ' + str(r - args.warmup + 1) if r >= args.warmup else 'warm-up'} | {case.name}",
                          file=sys.stderr, flush=True)
        finally:
            for w in workers.values():
                w.close()
    print(f"\n{args.dtype}, {len(counts)} thread counts, {args.repeats} timed rounds (medians); "
          f"{env['cpu']}, {cpus} CPUs; {bench.load_line()} at the end\n")
    print("| case | implementation | " + " | ".join(f"{t} thr s (CPU use)" for t in counts)
          + " | " + " | ".join(f"speed-up {counts[0]}->{t} (efficiency)" for t in counts[1:]) + " |")
    print("|---|---|" + "---:|" * (2 * len(counts) - 1))
    for case in cases:
        for impl in impls:
            med = {t: statistics.median(times[impl, t, case.name]) for t in counts}
            use = {t: statistics.median(cpu[impl, t, case.name]) for t in counts}
            cells = [f"{med[t]:.3f} ({use[t]:.0%})" for t in counts]
            cells += [f"{med[counts[0]] / med[t]:.2f}x ({med[counts[0]] / med[t] / (t / counts[0]):.0%})"
                      for t in counts[1:]]
            print(f"| {case.name} | {impl} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
