"""`bivit doctor`: the machine, PyTorch, the kernels chosen and why, the compiler, the extras (no model load)."""

from __future__ import annotations

import json
import logging

import typer

from .common import command


@command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """What this machine and install run, for a bug report: CPU kind and instruction sets, PyTorch (capability,
    oneDNN bf16/fp16, threads), the GEMM path per dtype, the compiled attention (in use, or why not and the fix),
    the C compiler, the extras installed. Loads no model."""
    from ..doctor import format_report, report

    logging.getLogger("bivit").setLevel(logging.ERROR)  # every fallback is in the report itself
    r = report()
    typer.echo(json.dumps(r, indent=2) if as_json else "\n".join(format_report(r)))
