"""`bivit verify`: items alone vs in random batch layouts, invariant and default mode."""

from __future__ import annotations

import random
from pathlib import Path
from typing import List, Optional

import typer

from ..base.dtypes import dtype_name
from ..base.dtypes import CHOICES as DTYPE_CHOICES
from ..base.options import whole
from ..errors import BivitError
from ..media.names import shown
from .common import (FAILURE, DeviceOpt, ModelOpt, OutDtypeOpt, ProjDtypeOpt, command, encoder_spec, need_extra, plural,
                     writable)

# Why float32: stock float32 GEMMs (MKL/oneDNN, AVX2 or AVX-512; float32 never runs on AMX tiles, so AMX Xeons
# behave like AVX-512 CPUs here) compute a single row (a 1-token item alone: M = 1) with another kernel and
# reduction order than a batch of rows, so default mode differs on the synthetic set's small items on every CPU
# kind (measured: `bivit verify` on an AVX-512 BF16 EPYC and there with AVX2 kernels forced by ATEN_CPU_CAPABILITY,
# ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS; F.linear in float32 on an AMX Xeon in an earlier round). Stock
# bfloat16 GEMMs were row-count invariant at these shapes on the EPYC and the Xeon: a bf16 run shows nothing there.
VERIFY_DTYPE = "float32"


@command()
def verify(
    files: List[Path] = typer.Argument(None, metavar="FILE", show_default=False,
                                       help="Images and videos (default: a built-in synthetic set of images)."),
    model: Optional[str] = ModelOpt,
    dtype: str = typer.Option(VERIFY_DTYPE, "--dtype", help=f"Tower compute dtype: {DTYPE_CHOICES}. float32 by "
                              "default: stock float32 GEMMs change their reduction order with the row count on every "
                              "CPU kind, so default mode shows what invariance prevents (stock bfloat16 GEMMs often "
                              "do not)."),
    projector_dtype: Optional[str] = ProjDtypeOpt,
    output_dtype: Optional[str] = OutDtypeOpt,
    device: str = DeviceOpt,
    layouts: int = typer.Option(6, help="Random batch layouts per mode."),
    seed: int = typer.Option(0, help="Seed of the random layouts."),
    bisect: bool = typer.Option(False, "--bisect", help="Name the first op that differs between bs=1 and bs=N."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the per-item differences."),
) -> None:
    """Show that invariant mode is bit-stable under batching.

    Encodes each item alone and inside random batch layouts, in invariant and default mode, and prints per item
    "bit-identical" or the max difference; exit 1 unless invariant mode is bit-stable."""
    # torch and the model: loaded once the options are good
    from ..core import encoder, items
    from ..diagnose import verify as v  # the same

    spec = encoder_spec(model, dtype, projector_dtype, output_dtype, device=device)  # before --plot's folder is made
    whole(layouts, "--layouts", 1, 10_000)
    whole(seed, "--seed", 0, 2**32 - 1)
    if plot is not None:
        need_extra("verify --plot", "matplotlib", "plot")
        writable(plot, files or (), "--plot")
    skipped: list[BivitError] = []

    def skip(e: BivitError) -> None:  # named in one line and left out, as `bivit encode` does
        skipped.append(e)
        typer.echo(f"bivit: skipped: {shown(str(e))}", err=True)

    def none_left() -> None:
        typer.echo(f"verified 0 of {plural(len(files), 'input')}; {len(skipped)} failed")
        raise typer.Exit(FAILURE)

    good = []
    for f in files or ():
        try:
            items.check_input(f)  # every input exists and is an image or video, before the models load
            good.append(f)
        except BivitError as e:
            skip(e)
    if files and not good:
        none_left()
    encoders = [encoder.load_encoder(spec, batch_invariant=inv) for inv in (True, False)]
    if files:
        batch = v.items_of(encoders[0], [str(f) for f in good], skip=skip)  # a file that fails to decode
        if batch is None:
            none_left()
    else:
        batch = v.items_of(encoders[0], v.synthetic_images(seed), [f"synthetic {w}x{h}" for w, h in v.SYNTHETIC_SIZES])
    plan = v.random_layouts(len(batch), layouts, random.Random(seed), batch.patch_counts)
    reports = []
    for enc in encoders:
        reports.append(v.check(enc, batch, plan))
    for enc, rep in zip(encoders, reports):
        typer.echo(f"{rep.mode} mode ({dtype_name(enc.dtype)}): "
                   f"{'BIT-STABLE' if rep.stable else 'NOT bit-stable'} over {plural(len(plan), 'layout')}")
        for line in v.format_report(rep):
            typer.echo(line)
        if bisect and len(batch) > 1:
            # The item that differs (default mode's, for invariant mode: the same item, shown not to differ).
            needle, diff = v.bisect_report(enc, batch, rep, also=reports[1])
            typer.echo(f"  bisect ({rep.items[needle].source} alone vs first of {len(batch)}): " + (
                "no op differs" if diff is None else
                f"first difference at {diff.module or '<root>'} ({diff.kind}, call {diff.occurrence}), "
                f"max |diff| = {diff.max_diff:.3g}"))
    if reports[1].stable:
        name = dtype_name(encoders[1].dtype)
        hint = ("stock float32 GEMMs change with the row count: --dtype float32" if name != "float32" else
                "the built-in set, `bivit verify` without files, has the 1- to 3-token items where they do" if files
                else "")
        typer.echo(f"note: default mode was bit-stable too: this CPU's stock {name} kernels gave these inputs the "
                   "same bits in every layout tried, so this run cannot show what invariance prevents"
                   + (f" ({hint})" if hint else ""))
    if plot:
        v.plot(reports, str(plot))
        typer.echo(f"plot written to {plot}")
    if skipped:
        typer.echo(f"{plural(len(skipped), 'input')} skipped (above)")
    if not reports[0].stable or skipped:
        raise typer.Exit(FAILURE)
