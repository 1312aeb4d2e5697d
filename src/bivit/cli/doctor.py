"""`bivit doctor`: the machine, PyTorch, the kernels installed and chosen and why, the extras (no model load)."""

from __future__ import annotations

import json
import logging
from typing import Optional

import typer

from ..errors import ConfigError, InvarianceError
from .common import FAILURE, DtypeOpt, ModelOpt, ProjDtypeOpt, command, encoder_spec, fail


@command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    prove: bool = typer.Option(False, "--prove", help="Also run the invariance proof now on the model's real "
                               "shapes and print its table (op, path, alone=packed=reversed, threads), and check "
                               "the demo model's golden rows against the committed bits."),
    model: Optional[str] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
) -> None:
    """Show what runs on this machine, for a bug report.

    What this machine and install run: CPU kind and instruction sets, PyTorch (capability, oneDNN bf16/fp16,
    threads), the compiled kernels (the variants installed, the one loaded, or why none is and the fix), the GEMM
    kernel per dtype, the attention, the extras installed, and the class of bits invariant mode computes (or why
    it is refused here). Loads no model, unless --prove: then the load-time proof runs on --model (default: the
    demo) at --dtype, and the demo model's rows for bivit's golden inputs are compared with the committed ones
    ("bits bivit-arith/1: match"); exit 1 where invariant mode is refused here or the rows differ."""
    spec = encoder_spec(model, dtype, projector_dtype)  # refused as every command refuses them, --prove or not
    from ..diagnose.doctor import format_report, prove as run_proof, report  # torch and the kernels: not for --help

    logging.getLogger("bivit").setLevel(logging.ERROR)  # every fallback is in the report itself
    r = report()
    if prove:
        try:
            r["proof"] = run_proof(spec)
        except (ConfigError, InvarianceError) as e:
            typer.echo(json.dumps(r, indent=2) if as_json else "\n".join(format_report(r)))
            fail(str(e), FAILURE)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    lines = format_report(r)
    if prove:
        p = r["proof"]
        lines.append(f"proof        {p['model']} at {p['dtype']}: {len(p['checks'])} ops in {p['seconds']:.2f} s "
                     f"(+ {p['pack_seconds']:.2f} s packing weights)")
        lines += ["  " + row for row in p["table"]]
        lines.append(p["golden"]["line"])
    typer.echo("\n".join(lines))
    if prove and r["proof"]["golden"]["committed"] and not r["proof"]["golden"]["match"]:
        raise typer.Exit(FAILURE)
