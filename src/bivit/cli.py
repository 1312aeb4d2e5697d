"""`bivit` command line. User errors print one line (no traceback) and set a non-zero exit status."""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch
import typer
from tqdm import tqdm

from .encoder import DEMO_NOTICE, Encoder, dtype_name, load_encoder
from .errors import BivitError
from .media import MediaBatch

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="bivit: batch-invariant vision encoding for Kimi-K2.5/K2.6/K3.")

ModelOpt = typer.Option(None, "--model", help="Checkpoint directory (Moonshot weights). Default: the demo model.")
DtypeOpt = typer.Option("bfloat16", "--dtype", help="Tower compute dtype: bfloat16, float32 or float16.")
ProjDtypeOpt = typer.Option(None, "--projector-dtype", help="Projector dtype (default: --dtype).")
# Patches per forward pass when `bivit encode` groups files (no effect on results in invariant mode).
GROUP_PATCHES = 4096
OutDtypeOpt = typer.Option(None, "--output-dtype", help="Output dtype (default: projector dtype).")


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"bivit: error: {message}", err=True)
    raise typer.Exit(code)


def open_encoder(model: Optional[Path], dtype: str, projector_dtype: Optional[str], output_dtype: Optional[str],
                 batch_invariant: bool = True, max_batch_tokens: Optional[int] = None) -> Encoder:
    try:
        enc = load_encoder(model, dtype=dtype, projector_dtype=projector_dtype, output_dtype=output_dtype,
                           batch_invariant=batch_invariant, max_batch_tokens=max_batch_tokens)
    except BivitError as e:
        fail(str(e))
    if enc.is_demo:
        typer.echo(DEMO_NOTICE, err=True)
    return enc


def _preprocess(encoder: Encoder, path: str) -> MediaBatch:
    from .video import is_video_path

    return encoder.preprocess_video(path) if is_video_path(path) else encoder.preprocess([path])


def write_safetensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write to a temp file beside `path`, fsync, rename: a reader never sees a half-written file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@app.command()
def encode(
    files: List[Path] = typer.Argument(..., help="Images and/or videos."),
    out: Path = typer.Option(Path("embeddings.safetensors"), "--out", "-o", help="Output safetensors file."),
    model: Optional[Path] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    output_dtype: Optional[str] = OutDtypeOpt,
    max_batch_tokens: Optional[int] = typer.Option(None, help="At most this many patches per forward pass."),
    no_batch_invariant: bool = typer.Option(False, "--no-batch-invariant", help="Stock kernels (not invariant)."),
) -> None:
    """Encode files into one safetensors file: tensor "i" is input i's embedding, shape (tokens, text_hidden).

    Per-input metadata (source, grid_thw per chunk, tokens, video chunk timestamps) is stored as JSON under
    the "bivit" header key. Bad files are reported and skipped; the exit status is 1 if any failed.
    """
    enc = open_encoder(model, dtype, projector_dtype, output_dtype, not no_batch_invariant, max_batch_tokens)
    t0 = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    items: list[dict] = []
    failed = 0
    pending: list[tuple[Path, MediaBatch]] = []

    def flush() -> None:
        # Files share forward passes; in invariant mode each result is the bits of encoding it alone.
        outs = iter(enc.encode_batch(MediaBatch.concat([b for _, b in pending])))
        for path, batch in pending:
            chunks = [next(outs) for _ in range(len(batch))]
            key = str(len(items))
            tensors[key] = torch.cat(chunks)
            entry = {"key": key, "source": str(path), "tokens": int(tensors[key].shape[0]),
                     "grid_thw": batch.grid_thw.tolist(), "chunk_tokens": [int(c.shape[0]) for c in chunks]}
            if batch.timestamps is not None:
                entry["timestamps"] = batch.timestamps
            items.append(entry)
        pending.clear()

    group_patches = max_batch_tokens or GROUP_PATCHES
    for path in tqdm(files, desc="encoding", unit="file", disable=len(files) < 2, file=sys.stderr):
        try:
            batch = _preprocess(enc, str(path))
        except BivitError as e:
            failed += 1
            tqdm.write(f"bivit: skipped: {e}", file=sys.stderr)
            continue
        pending.append((path, batch))
        if sum(sum(b.patch_counts) for _, b in pending) >= group_patches:
            flush()
    if pending:
        flush()
    if tensors:
        meta = {"bivit": json.dumps({"format": "bivit.encode/1", "model": enc.model_name, "demo": enc.is_demo,
                                     "dtype": dtype_name(enc.dtype), "projector_dtype": dtype_name(enc.projector_dtype),
                                     "output_dtype": dtype_name(enc.output_dtype),
                                     "batch_invariant": enc.batch_invariant, "items": items})}
        write_safetensors_atomic(out, tensors, meta)
    tokens = sum(i["tokens"] for i in items)
    where = f" -> {out}" if tensors else " (nothing written)"
    typer.echo(f"encoded {len(items)} of {len(files)} inputs, {tokens} tokens in "
               f"{time.perf_counter() - t0:.2f} s{where}" + (f"; {failed} failed" if failed else ""))
    if failed:
        raise typer.Exit(1)


@app.command()
def verify(
    files: List[Path] = typer.Argument(None, help="Images (default: a built-in synthetic set)."),
    model: Optional[Path] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    layouts: int = typer.Option(6, help="Random batch layouts per mode."),
    seed: int = typer.Option(0, help="Seed of the random layouts."),
    bisect: bool = typer.Option(False, "--bisect", help="Name the first op that differs between bs=1 and bs=N."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the per-item differences."),
) -> None:
    """Encode items alone and in random batch layouts, invariant vs default mode; exit 1 unless invariant is bit-stable."""
    from . import verify as v

    encoders = [open_encoder(model, dtype, projector_dtype, None, inv) for inv in (True, False)]
    try:
        if files:
            batch = encoders[0].preprocess([str(f) for f in files])
        else:
            batch = encoders[0].preprocess(v.synthetic_images(seed))
            batch.sources = [f"synthetic {w}x{h}" for w, h in v.SYNTHETIC_SIZES]
    except BivitError as e:
        fail(str(e))
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
        raise typer.Exit(1)


def _register(name: str, module: str, attr: str, extra: str) -> None:
    """Commands whose dependencies are extras: registered when importable, else a one-line hint."""
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        reason = str(e)  # `e` itself is unbound once the except block ends

        def missing() -> None:
            fail(f"`bivit {name}` needs the {extra!r} extra: pip install 'bivit[{extra}]' ({reason})")

        missing.__doc__ = f"(unavailable: pip install 'bivit[{extra}]')"
        app.command(name)(missing)
        return
    app.command(name)(fn)


_register("serve", "bivit.server", "serve_command", "serve")
_register("encode-dataset", "bivit.dataset", "encode_dataset_command", "ray")
_register("bench", "bivit.bench", "bench_command", "test")


def main() -> None:
    from .allocator import tune

    tune()  # this process is bivit's own: keep freed activation memory for the next forward pass
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # The demo notice is printed once by the CLI itself; keep the library's logger quiet about it.
    logging.getLogger("bivit").setLevel(logging.ERROR)
    try:
        app()
    except BivitError as e:
        typer.echo(f"bivit: error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
