"""`bivit encode`: files in, one safetensors file of embeddings and per-input metadata out."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from .common import (EC_PROBE, FAILURE, AlphaOpt, DeprecatedOpt, DtypeOpt, EcDirOpt, ModelOpt, OutDtypeOpt,
                     ProjDtypeOpt, command, open_encoder, renamed_option, writable)

# The schema of the file `bivit encode` writes (its "bivit" header key).
ENCODE_FORMAT = "bivit.encode/1"
# Patches per forward pass unless --max-batch-patches says otherwise (no effect on results in invariant mode).
DEFAULT_BATCH_PATCHES = 4096


@command()
def encode(
    files: List[Path] = typer.Argument(..., help="Images and/or videos."),
    out: Path = typer.Option(Path("embeddings.safetensors"), "--out", "-o", help="Output safetensors file."),
    model: Optional[Path] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    output_dtype: Optional[str] = OutDtypeOpt,
    max_batch_patches: Optional[int] = typer.Option(
        None, "--max-batch-patches", help=f"At most this many patches per forward pass (default "
                                          f"{DEFAULT_BATCH_PATCHES})."),
    max_batch_tokens: Optional[int] = DeprecatedOpt("--max-batch-tokens"),
    no_batch_invariant: bool = typer.Option(False, "--no-batch-invariant", help="Stock kernels (not invariant)."),
    alpha: str = AlphaOpt,
    ec_dir: Optional[Path] = EcDirOpt,
) -> None:
    """Encode files into one safetensors file: tensor "i" is input i's embedding, shape (tokens, text_hidden).

    Per-input metadata (source, kind, content sha256, sizes, grid_thw per chunk, tokens, video chunk timestamps,
    and the prompt placeholders: per image or chunk the text the model's processor writes and the rows that
    replace its <|media_pad|>) and the encoder's description (`Encoder.describe`: fingerprint included) are
    stored as JSON under the "bivit" header key. With --ec-dir, each image's / chunk's rows also go to vLLM's
    encoder cache and its ids into the metadata ("ec_ids"). Bad files are reported and skipped; exit status 1 if
    any failed.
    """
    budget = renamed_option(max_batch_patches, max_batch_tokens, "--max-batch-patches", "--max-batch-tokens")
    budget = DEFAULT_BATCH_PATCHES if budget is None else budget
    writable(out, files)  # before anything is loaded or encoded
    if ec_dir is not None:
        writable(ec_dir / EC_PROBE, option="--ec-dir")
    from safetensors.torch import save
    from tqdm import tqdm

    from ..engines.media import media_of
    from ..engines.vllm import write_encoder_cache
    from ..fileio import write_atomic

    enc = open_encoder(model, dtype, projector_dtype, output_dtype, not no_batch_invariant, alpha=alpha)
    t0 = time.perf_counter()
    tensors, items, failed = {}, [], 0
    # Files share forward passes (prepared one by one as passes fill, so memory holds about one pass); in
    # invariant mode each result is the bits of encoding it alone.
    results = enc.encode_stream((enc.prepare(path) for path in files), budget)
    for r in tqdm(results, total=len(files), desc="encoding", unit="file", disable=len(files) < 2, file=sys.stderr):
        if r.error is not None:
            failed += 1
            tqdm.write(f"bivit: skipped: {r.error}", file=sys.stderr)
            continue
        key = str(len(items))
        tensors[key] = r.embedding
        items.append({"key": key, **r.to_dict()})
        if ec_dir is not None:
            items[-1]["ec_ids"] = write_encoder_cache(ec_dir, [media_of(r, enc.fingerprint)])[0]
    if tensors:
        meta = {"bivit": json.dumps({"format": ENCODE_FORMAT, **enc.describe(), "items": items})}
        write_atomic(out, save(tensors, metadata=meta))  # a full disk is an OSError naming --out
    tokens = sum(i["tokens"] for i in items)
    where = f" -> {out}" if tensors else " (nothing written)"
    typer.echo(f"encoded {len(items)} of {len(files)} inputs, {tokens} tokens in "
               f"{time.perf_counter() - t0:.2f} s{where}" + (f"; {failed} failed" if failed else ""))
    if ec_dir is not None:
        typer.echo(f"encoder cache: {sum(len(i['ec_ids']) for i in items)} items in {ec_dir} (ids: \"ec_ids\" of "
                   "each item in the file's metadata)")
    if failed:
        raise typer.Exit(FAILURE)
