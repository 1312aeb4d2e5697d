"""What batch invariance costs: bivit invariant mode vs default mode, same weights, same pixels, same machine.

    python benchmarks/invariance_cost.py                      # full-size K2.6, bf16 and fp32, 3 repeats
    python benchmarks/invariance_cost.py --preset demo        # quick check of the script itself
    python benchmarks/invariance_cost.py --dtype bfloat16 --repeats 5 --out cost.json

The input mix is `bivit bench`'s (a 448x448 image, an 896x672 image, 32 images of 112x112 in one call, a
4-frame video chunk). Each mode runs in its own worker process; repeats alternate between the modes (the
first mode of each round alternates too) so that a shared machine's noise hits both alike. The printed ratio
is invariant time / default time: 1.00 means invariance is free, 1.10 means it costs 10 %. It is given as the
ratio of the median times and as the median (and range) of the per-round ratios, which is the more robust
figure when the machine's load drifts during the run.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from bivit import bench
from bivit.errors import BivitError


def ratios(record: dict) -> dict:
    """Per dtype and case (plus "whole mix"): medians of both modes and invariant/default ratios."""
    out = {}
    names = [c["name"] for c in record["cases"]]
    for dtype, run in record["runs"].items():
        inv, dflt = run["impls"]["bivit-invariant"]["times"], run["impls"]["bivit-default"]["times"]
        rows = {}
        for name in names + ["whole mix"]:
            if name == "whole mix":
                a = [sum(inv[n][r] for n in names) for r in range(record["repeats"])]
                b = [sum(dflt[n][r] for n in names) for r in range(record["repeats"])]
            else:
                a, b = inv[name], dflt[name]
            per_round = [x / y for x, y in zip(a, b)]
            rows[name] = {"invariant_s": statistics.median(a), "default_s": statistics.median(b),
                          "ratio_of_medians": statistics.median(a) / statistics.median(b),
                          "per_round": per_round, "per_round_median": statistics.median(per_round)}
        out[dtype] = rows
    return out


def format_table(record: dict, table: dict) -> str:
    tokens = {c["name"]: c["tokens"] for c in record["cases"]}
    tokens["whole mix"] = sum(tokens.values())
    lines = ["| dtype | case | tokens | invariant s | default s | invariant / default (medians) | "
             "per-round ratio: median [min, max] | invariant tokens/s | default tokens/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype, rows in table.items():
        for name, r in rows.items():
            pr = r["per_round"]
            lines.append(f"| {dtype} | {name} | {tokens[name]} | {r['invariant_s']:.3f} | {r['default_s']:.3f} | "
                         f"**{r['ratio_of_medians']:.3f}** | {r['per_round_median']:.3f} [{min(pr):.3f}, "
                         f"{max(pr):.3f}] | {tokens[name] / r['invariant_s']:.0f} | "
                         f"{tokens[name] / r['default_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], dtype="both", dtypes=sorted(bench.DTYPE_CHOICES))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="also write the raw record and ratios as JSON here")
    args = p.parse_args(argv)
    bench.start(args)
    command = bench.command_line()
    try:
        record = bench.run_benchmark(preset=args.preset, dtypes=bench.DTYPE_CHOICES[args.dtype],
                                     impls=bench.BIVIT_IMPLS, repeats=args.repeats, warmup=args.warmup,
                                     threads=args.threads, seed=args.seed)
    except BivitError as e:
        print(f"invariance_cost: error: {e}", file=sys.stderr)
        return 2
    record["command"] = command
    table = ratios(record)
    print(f"\npreset {args.preset}, {args.repeats} interleaved repeats (+{args.warmup} warm-up); at the end: "
          f"{bench.load_line()}\n")
    print(format_table(record, table))
    for dtype, rows in table.items():
        mix = rows["whole mix"]
        print(f"\n{dtype}: batch invariance costs {100 * (mix['ratio_of_medians'] - 1):+.1f} % of the default "
              f"mode's time on the whole mix (per-round median {100 * (mix['per_round_median'] - 1):+.1f} %)")
    if args.out:
        bench.write_text(args.out, json.dumps({"record": record, "ratios": table}, indent=1, default=str))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
