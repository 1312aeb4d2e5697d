"""`bivit verify`: items alone vs in random batch layouts, invariant and default mode."""

from __future__ import annotations

import random
from pathlib import Path
from typing import List, Optional

import typer

from .common import FAILURE, DtypeOpt, ModelOpt, ProjDtypeOpt, command, need_extra, open_encoder, writable


@command()
def verify(
    files: List[Path] = typer.Argument(None, help="Images and videos (default: a built-in synthetic set of images)."),
    model: Optional[Path] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    layouts: int = typer.Option(6, help="Random batch layouts per mode."),
    seed: int = typer.Option(0, help="Seed of the random layouts."),
    bisect: bool = typer.Option(False, "--bisect", help="Name the first op that differs between bs=1 and bs=N."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the per-item differences."),
) -> None:
    """Items alone vs in random batch layouts, invariant and default mode; exit 1 unless invariant is bit-stable."""
    from .. import verify as v
    from ..dtypes import dtype_name

    if plot is not None:
        need_extra("verify --plot", "matplotlib", "plot")
        writable(plot, files or (), "--plot")
    encoders = [open_encoder(model, dtype, projector_dtype, None, inv) for inv in (True, False)]
    if files:
        batch = v.items_of(encoders[0], [str(f) for f in files])
    else:
        batch = v.items_of(encoders[0], v.synthetic_images(seed), [f"synthetic {w}x{h}" for w, h in v.SYNTHETIC_SIZES])
    plan = v.random_layouts(len(batch), layouts, random.Random(seed), batch.patch_counts)
    reports = []
    for enc in encoders:
        rep = v.check(enc, batch, plan)
        reports.append(rep)
        typer.echo(f"{rep.mode} mode ({dtype_name(enc.dtype)}): "
                   f"{'BIT-STABLE' if rep.stable else 'NOT bit-stable'} over {len(plan)} layouts")
        for line in v.format_report(rep):
            typer.echo(line)
        if bisect:
            diff = v.bisect(enc, batch, needle=0) if len(batch) > 1 else None
            typer.echo(f"  bisect (item 0 alone vs first of {len(batch)}): " + (
                "no op differs" if diff is None else
                f"first difference at {diff.module or '<root>'} ({diff.kind}, call {diff.occurrence}), "
                f"max |diff| = {diff.max_diff:.3g}"))
    if plot:
        v.plot(reports, str(plot))
        typer.echo(f"plot written to {plot}")
    if not reports[0].stable:
        raise typer.Exit(FAILURE)
