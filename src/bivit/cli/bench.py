"""`bivit bench`: throughput of bivit (invariant and default mode) against the transformers port."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..base.options import whole
from ..errors import BivitError
from .common import FAILURE, command, fail, writable


@command()
def bench(
    dtype: str = typer.Option("both", "--dtype",
                              help="bfloat16, float32 (any spelling --dtype takes elsewhere) or both."),
    repeats: int = typer.Option(3, "--repeats", help="Timed repeats per case and implementation (median reported)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed rounds first (kernel selection, caches)."),
    out_dir: Path = typer.Option(Path("bench-results"), "--out-dir", help="Where bench.json/.md/.png go."),
    skip_hf: bool = typer.Option(False, "--skip-hf", help="Do not run the transformers port."),
    preset: str = typer.Option("kimi-k2.6", "--preset", help="Model size: kimi-k2.6 (full size), kimi-k3, demo."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per implementation (default: "
                                                                  "torch's default here)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and images."),
    in_process: bool = typer.Option(False, "--in-process", help="All implementations in this process (debugging; "
                                                                "memory is then not attributable)."),
    cases: Optional[List[str]] = typer.Option(None, "--case", help="Only the cases whose name contains this "
                                                                   "(repeatable; default: all four)."),
) -> None:
    """Measure bivit's throughput on this CPU.

    Compares bivit (invariant and default mode) with the transformers port, each case beside its roofline.
    Seeded random weights at full size (no download); a fixed mix of a 448x448 image, an 896x672 image, 32
    images of 112x112 in one call and a 4-frame video chunk; repeats interleaved across implementations, each
    implementation in its own process. Per case: GEMM / attention / other FLOPs, this machine's GEMM and attention
    rates and the roofline they give. Prints Markdown tables; writes bench.json, bench.md and bench.png.
    """
    from .. import bench as b  # torch: not for --help

    dtypes = b.bench_dtypes(dtype)
    for flag, value, low, high in (("--repeats", repeats, 1, 1000), ("--warmup", warmup, 0, 1000),
                                   ("--threads", threads, 1, 4096), ("--seed", seed, 0, 2**32 - 1)):
        if value is not None:
            whole(value, flag, low, high)
    writable(out_dir / "bench.json", option="--out-dir")
    try:
        chosen = b.select_cases(cases, seed)
    except BivitError as e:
        fail(str(e))
    command_line = b.command_line()
    typer.echo(f"$ {command_line}")
    record = b.run_benchmark(preset=preset, dtypes=dtypes, impls=b.BIVIT_IMPLS if skip_hf else b.IMPLS,
                             repeats=repeats, warmup=warmup, threads=threads, seed=seed, isolate=not in_process,
                             cases=chosen)
    record["command"] = command_line
    summary = b.summarize(record)
    report = f"$ {command_line}\n\n" + b.format_report(record, summary)
    typer.echo(report.split("\n", 2)[2])
    try:
        written = b.write_outputs(record, report, summary, out_dir, "bench", command_line,
                                  lambda s: typer.echo(s, err=True))
    except OSError as e:
        fail(f"cannot write results to {out_dir}: {e}", FAILURE)
    typer.echo("wrote " + ", ".join(str(p) for p in written))
