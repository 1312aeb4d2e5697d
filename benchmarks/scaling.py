"""How encoding time and peak memory grow with the size of one image, up to the 16384-patch maximum.

    python benchmarks/scaling.py                                # full-size K2.6, bf16, invariant mode
    python benchmarks/scaling.py --max-patches 4096             # stop early (the 16384 point takes minutes)
    python benchmarks/scaling.py --preset demo --out-dir /tmp/s # quick check of the script itself

One square image per point (256, 1024, 2304, 4096, 9216, 16384 patches = 224 ... 1792 px a side), encoded
alone by one worker process that holds the model throughout. Before each point the worker's resident-set
high-water mark is reset, so "run peak RSS" is that point's own peak and "working memory" = run peak minus
the resident size right after loading (weights, inputs, runtime). Points run smallest first, so memory the
allocator kept from an earlier point is below what the current one needs anyway. A small warm-up run comes
first (kernel selection); then `--repeats` timed runs per point (median). Time grows linearly with patches in
the GEMMs and quadratically in attention; the table shows attention's share of the FLOPs at each point.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bivit import bench
from bivit.checkpoint.config import PRESETS
from bivit.errors import BivitError

POINTS = (256, 1024, 2304, 4096, 9216, 16384)


def measure(args, log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    cfg = PRESETS[args.preset]
    points = [p for p in args.points if p <= args.max_patches]
    if not points:
        raise BivitError(f"no point at or below --max-patches {args.max_patches}")
    cases = [bench.square_case(p, args.seed) for p in points]
    impl = f"bivit-{args.mode}"
    dtype = bench.TORCH_DTYPES[args.dtype]
    record = {"format": "bivit.scaling/2", "preset": args.preset, "dtype": args.dtype, "mode": args.mode,
              "repeats": args.repeats, "env": bench.environment(torch.get_num_threads()), "points": []}
    with tempfile.TemporaryDirectory(prefix="bivit-scaling-") as tmp:
        tmp = Path(tmp)
        log(f"writing a seeded random {args.preset} checkpoint (bf16) ...")
        bench.write_checkpoint_isolated(tmp / "checkpoint", args.preset, args.seed)
        warm = bench.square_case(min(points), args.seed + 1)
        bench.save_cases(tmp / "inputs.safetensors", [warm] + cases)
        worker = bench.Worker(impl, tmp / "checkpoint", args.dtype, torch.get_num_threads(),
                              tmp / "inputs.safetensors")
        try:
            record["load_s"] = worker.info["load_s"]
            record["memory_loaded"] = worker.info["memory"]
            record["source"] = worker.info["source"]
            worker.run(0)  # warm-up: first GEMM calls at each shape pick (or JIT) their kernels
            shapes = bench.gemm_shapes(cfg)
            peak = {how: bench.gemm_gflops(dtype, shapes, how=how) for how in ("stock", "bivit")}
            record["gemm_peak_gflops"] = max(v for rates in peak.values() for v in rates.values())
            record["gemm_peak"] = peak
            for i, case in enumerate(cases, start=1):
                worker.reset_peak()
                times = [worker.run(i)["seconds"] for _ in range(args.repeats)]
                mem = worker.memory()
                flops = bench.case_flops(cfg, case)
                (t, h, w), = case.grids()
                point = {"patches": case.patches, "tokens": case.tokens, "side_px": h * cfg.patch_size,
                         "times": times, "median_s": statistics.median(times), "flops": flops.total,
                         "gemm_flops": flops.gemm, "run_peak_mib": mem["hwm_mib"], "rss_after_mib": mem["rss_mib"],
                         "loadavg": os.getloadavg()}
                record["points"].append(point)
                log(f"{case.patches:6d} patches: {point['median_s']:.2f} s, run peak {point['run_peak_mib']:.0f} MiB")
        finally:
            worker.close()
    return record


def format_table(record: dict) -> str:
    loaded = record["memory_loaded"]["loaded"]["rss_mib"]
    peak = record["gemm_peak_gflops"]
    lines = [f"preset {record['preset']}, {record['dtype']}, bivit {record['mode']} mode, "
             f"{bench.machine_line(record['env'])}, median of {record['repeats']}; "
             f"GEMM rate {peak:.0f} GFLOP/s; resident after load {loaded:.0f} MiB", "",
             "| patches | image px | tokens | median s | patches/s | tokens/s | TFLOP | attention share | GFLOP/s | "
             "% of GEMM rate | run peak RSS | working memory |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in record["points"]:
        s = p["median_s"]
        gflops = p["flops"] / s / 1e9
        lines.append(f"| {p['patches']} | {p['side_px']}x{p['side_px']} | {p['tokens']} | {s:.2f} | "
                     f"{p['patches'] / s:.0f} | {p['tokens'] / s:.0f} | {p['flops'] / 1e12:.2f} | "
                     f"{100 * (1 - p['gemm_flops'] / p['flops']):.0f}% | {gflops:.0f} | {100 * gflops / peak:.0f}% | "
                     f"{p['run_peak_mib']:.0f} MiB | {p['run_peak_mib'] - loaded:.0f} MiB |")
    return "\n".join(lines)


def plot(record: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = record["points"]
    x = [p["patches"] for p in pts]
    loaded = record["memory_loaded"]["loaded"]["rss_mib"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.plot(x, [p["median_s"] for p in pts], "o-", label="measured")
    # What the same FLOPs would take at the measured GEMM peak: the floor a perfect implementation would hit.
    a1.plot(x, [p["flops"] / (record["gemm_peak_gflops"] * 1e9) for p in pts], "--", label="FLOPs at GEMM rate")
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.set_xlabel("patches per image")
    a1.set_ylabel("seconds per image")
    a1.set_xticks(x, [str(v) for v in x])
    a1.legend()
    a1.grid(True, which="both", alpha=0.3)
    a2.plot(x, [p["run_peak_mib"] for p in pts], "o-", label="run peak RSS")
    a2.axhline(loaded, color="gray", ls="--", label="resident after load")
    a2.set_xscale("log")
    a2.set_xticks(x, [str(v) for v in x])
    a2.set_xlabel("patches per image")
    a2.set_ylabel("MiB")
    a2.legend()
    a2.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    bench.save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], dtypes=sorted(bench.TORCH_DTYPES), repeats=1)
    p.add_argument("--mode", default="invariant", choices=["invariant", "default"])
    p.add_argument("--points", type=lambda s: [int(v) for v in s.split(",")], default=list(POINTS),
                   help="comma-separated patch counts (even square sides), default " + ",".join(map(str, POINTS)))
    p.add_argument("--max-patches", type=int, default=16384)
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    bench.start(args)
    command = bench.command_line()
    t0 = time.perf_counter()
    try:
        record = measure(args)
    except BivitError as e:
        print(f"scaling: error: {e}", file=sys.stderr)
        return 2
    record["command"] = command
    record["wall_s"] = time.perf_counter() - t0
    table = format_table(record)
    print(table)
    bench.write_text(args.out_dir / "scaling.json", json.dumps(record, indent=1, default=str))
    bench.write_text(args.out_dir / "scaling.md", f"$ {command}\n\n{table}\n")
    written = [args.out_dir / "scaling.json", args.out_dir / "scaling.md"]
    try:
        plot(record, args.out_dir / "scaling.png", command)
        written.append(args.out_dir / "scaling.png")
    except ImportError:
        print("scaling: PNG skipped: matplotlib is not installed (pip install 'bivit[plot]')", file=sys.stderr)
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
