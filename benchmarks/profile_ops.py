"""Where the time goes: `torch.profiler` over one forward per case, invariant and default mode, bf16 and fp32.

    python benchmarks/profile_ops.py                                   # full-size K2.6, the bench's 4 cases, ~10 min
    python benchmarks/profile_ops.py --cases 896x672 --dtype bfloat16  # one case, one dtype: ~1-2 min
    python benchmarks/profile_ops.py --preset demo                     # quick check of the script itself

The model, weights and pixels are `bivit bench`'s: a seeded random checkpoint (weights std 1/sqrt(fan_in), so
27 layers stay well-conditioned) written once in bf16 and loaded by `load_encoder`, and the bench's input mix
(`--cases` picks cases by a substring of their names). Before profiling, one traced forward per mode counts
subnormal values in every op's output (a tower full of denormals would time the FPU's slow path, not bivit).
bivit's compiled kernels show as profiler ranges: `bivit::gemm <out>x<in>` per GEMM shape, `bivit::attention`,
`bivit::norm`.
Then, per case, the two modes alternate for `--repeats` rounds under the profiler; the table shows the ops
with the most self CPU time (summed over repeats, divided by the repeats), both modes side by side, plus
wall time and the attention kernel's achieved GFLOP/s. Numbers are from a shared machine unless the load
average printed with them is below the thread count: compare the two modes, not runs.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from bivit import bench
from bivit.checkpoint.config import PRESETS
from bivit.core.encoder import load_encoder
from bivit.errors import BivitError

MODES = ("invariant", "default")
# PyTorch's fused attention, and bivit's compiled one (a profiler range around the kernel calls)
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "bivit::attention")


def profile_once(enc, case) -> tuple[float, dict[str, tuple[float, int]]]:
    """(wall s, {op: (self CPU s, calls)}) of one forward."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        enc.encode_batch(case.batch)
        wall = time.perf_counter() - t0
    return wall, {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], dtype="both", dtypes=sorted(bench.DTYPE_CHOICES), repeats=1)
    p.add_argument("--cases", nargs="*", default=None, help="substrings of case names (default: all four)")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--top", type=int, default=12, help="ops shown per table")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="reuse (or create) the seeded checkpoint here instead of a temporary directory")
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset]
    try:
        cases = bench.select_cases(args.cases, args.seed, option="--cases")
    except BivitError as e:
        print(f"profile: error: {e}", file=sys.stderr)
        return 2
    bench.start(args)
    print(f"preset {args.preset}")
    with tempfile.TemporaryDirectory(prefix="bivit-profile-") as tmp:
        ckpt = args.checkpoint or Path(tmp) / "checkpoint"
        if not (ckpt / "config.json").exists():
            bench.write_checkpoint_isolated(ckpt, args.preset, args.seed)
        for dtype in bench.DTYPE_CHOICES[args.dtype]:
            encs = {m: load_encoder(ckpt, dtype=dtype, batch_invariant=m == "invariant") for m in args.modes}
            for mode, enc in encs.items():
                sub = bench.count_subnormals(enc.encode_batch, cases[0].batch)
                print(f"\n[{dtype}] {mode}: subnormal values in op outputs of '{cases[0].name}': "
                      f"{sub['subnormal']} of {sub['values']}")
            for case in cases:
                n_attn = bench.case_flops(cfg, case).attention
                walls = {m: [] for m in encs}
                ops_ = {m: {} for m in encs}
                for enc in encs.values():
                    enc.encode_batch(case.batch)  # warm-up: kernel choice, probes, caches
                for r in range(args.repeats):
                    order = list(encs) if r % 2 == 0 else list(encs)[::-1]
                    for mode in order:
                        wall, table = profile_once(encs[mode], case)
                        walls[mode].append(wall)
                        for k, (s, n) in table.items():
                            s0, n0 = ops_[mode].get(k, (0.0, 0))
                            ops_[mode][k] = (s0 + s / args.repeats, n0 + n / args.repeats)
                print(f"\n### {case.name}, {dtype} ({bench.load_line()})\n")
                print(format_table(ops_, walls, n_attn, args.top))
            del encs
    return 0


def format_table(ops_: dict, walls: dict, attention_flops: int, top: int) -> str:
    modes = list(ops_)
    totals = {m: sum(s for s, _ in ops_[m].values()) for m in modes}
    keys = set()
    for m in modes:
        keys |= {k for k, _ in sorted(ops_[m].items(), key=lambda kv: -kv[1][0])[:top]}
    keys = sorted(keys, key=lambda k: -max(ops_[m].get(k, (0, 0))[0] for m in modes))
    lines = ["| op | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    lines.append("| wall time (median) | " + " | ".join(f"{statistics.median(walls[m]):.3f} s" for m in modes) + " |")
    lines.append("| total self CPU | " + " | ".join(f"{totals[m]:.3f} s" for m in modes) + " |")
    for k in keys:
        cells = []
        for m in modes:
            s, n = ops_[m].get(k, (0.0, 0))
            cell = f"{s:.3f} s ({100 * s / totals[m]:.0f}%, {n:.0f} calls)" if n else "—"
            if k in ATTENTION and s > 0:
                cell += f", {attention_flops / s / 1e9:.0f} GFLOP/s"
            cells.append(cell)
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
