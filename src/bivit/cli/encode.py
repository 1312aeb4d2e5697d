"""`bivit encode`: files in, one safetensors file of embeddings and per-input metadata out."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import BivitError
from .common import (FAILURE, AlphaOpt, DtypeOpt, ModelOpt, OutDtypeOpt, ProjDtypeOpt, command, open_encoder,
                     writable)

# The schema of the file `bivit encode` writes (its "bivit" header key).
ENCODE_FORMAT = "bivit.encode/1"
# Patches per forward pass when `bivit encode` groups files (no effect on results in invariant mode).
GROUP_PATCHES = 4096

@command()
def encode(
    files: List[Path] = typer.Argument(..., help="Images and/or videos."),
    out: Path = typer.Option(Path("embeddings.safetensors"), "--out", "-o", help="Output safetensors file."),
    model: Optional[Path] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    output_dtype: Optional[str] = OutDtypeOpt,
    max_batch_tokens: Optional[int] = typer.Option(None, help="At most this many patches per forward pass."),
    no_batch_invariant: bool = typer.Option(False, "--no-batch-invariant", help="Stock kernels (not invariant)."),
    alpha: str = AlphaOpt,
) -> None:
    """Encode files into one safetensors file: tensor "i" is input i's embedding, shape (tokens, text_hidden).

    Per-input metadata (source, grid_thw per chunk, tokens, video chunk timestamps, and the prompt placeholders:
    per image or chunk the text the model's processor writes and the rows that replace its <|media_pad|>) is
    stored as JSON under the "bivit" header key. Bad files are reported and skipped; exit status 1 if any failed.
    """
    writable(out, files)  # before anything is loaded or encoded
    import torch
    from safetensors.torch import save
    from tqdm import tqdm

    from ..dtypes import dtype_name
    from ..fileio import write_atomic
    from ..media import MediaBatch, batch_placeholders
    from ..video import is_video_path, join_chunks, split_by_input

    enc = open_encoder(model, dtype, projector_dtype, output_dtype, not no_batch_invariant, max_batch_tokens, alpha)
    t0 = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    items: list[dict] = []
    failed = 0
    pending: list[tuple[Path, MediaBatch]] = []

    def flush() -> None:
        # Files share forward passes; in invariant mode each result is the bits of encoding it alone.
        outs = enc.encode_batch(MediaBatch.concat([b for _, b in pending]))
        for (path, batch), chunks in zip(pending, split_by_input(outs, [len(b) for _, b in pending])):
            key = str(len(items))
            tensors[key] = join_chunks(chunks)
            entry = {"key": key, "source": str(path), "tokens": int(tensors[key].shape[0]),
                     "grid_thw": batch.grid_thw.tolist(), "chunk_tokens": [int(c.shape[0]) for c in chunks]}
            if batch.timestamps is not None:
                entry["timestamps"] = batch.timestamps
            entry["placeholders"] = [p.to_dict() for p in batch_placeholders(batch, enc.processing)]
            items.append(entry)
        pending.clear()

    group_patches = max_batch_tokens or GROUP_PATCHES
    for path in tqdm(files, desc="encoding", unit="file", disable=len(files) < 2, file=sys.stderr):
        try:
            batch = enc.preprocess_video(path) if is_video_path(path) else enc.preprocess([str(path)])
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
        meta = {"bivit": json.dumps({"format": ENCODE_FORMAT, "model": enc.model_name, "demo": enc.is_demo,
                                     "dtype": dtype_name(enc.dtype), "projector_dtype": dtype_name(enc.projector_dtype),
                                     "output_dtype": dtype_name(enc.output_dtype),
                                     "batch_invariant": enc.batch_invariant, "alpha": enc.alpha,
                                     "processing": enc.processing.to_dict(), "items": items})}
        write_atomic(out, save(tensors, metadata=meta))  # a full disk is an OSError naming --out
    tokens = sum(i["tokens"] for i in items)
    where = f" -> {out}" if tensors else " (nothing written)"
    typer.echo(f"encoded {len(items)} of {len(files)} inputs, {tokens} tokens in "
               f"{time.perf_counter() - t0:.2f} s{where}" + (f"; {failed} failed" if failed else ""))
    if failed:
        raise typer.Exit(FAILURE)
