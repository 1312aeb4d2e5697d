"""`bivit encode`: files in, one embedding file (`bivit.core.records`, format bivit.embeddings/1) out."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from ..core import records as rec
from ..errors import BivitError
from ..media.kinds import media_kind
from ..media.names import label, shown, stored, too_long
from .common import (EC_PROBE, FAILURE, AlphaOpt, DeviceOpt, DtypeOpt, EcDirOpt, MaxBatchPatchesOpt, ModelOpt,
                     OutDtypeOpt, ProjDtypeOpt, command, encoder_spec, fail, plural, progress_shown, writable)

@command()
def encode(
    files: List[Path] = typer.Argument(..., metavar="FILE", help="Images and/or videos."),
    out: Path = typer.Option(Path("embeddings.safetensors"), "--out", "-o", help="Output safetensors file."),
    model: Optional[str] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    output_dtype: Optional[str] = OutDtypeOpt,
    max_batch_patches: Optional[int] = MaxBatchPatchesOpt,
    no_batch_invariant: bool = typer.Option(False, "--no-batch-invariant", help="Stock kernels (not invariant)."),
    alpha: str = AlphaOpt,
    ec_dir: Optional[Path] = EcDirOpt,
    device: str = DeviceOpt,
) -> None:
    """Encode files into one embedding file.

    Tensor "i" is input i's embedding, shape (tokens, text_hidden). The file (format bivit.embeddings/1, read back
    with bivit.load_embeddings) records the encoder (model, fingerprint, dtypes, preprocessing, kernels) and one
    record per input, in order: source, kind, sha256, tokens, grid_thw, tokens and original size per chunk, video
    chunk timestamps, the prompt placeholders (per image or chunk the text the model's processor writes and the rows
    that replace its <|media_pad|>), or the error. With --ec-dir, each image's / chunk's rows also go to vLLM's
    encoder cache and their ids into the record ("ec_ids"). Bad files are reported and skipped; exit status 1 if any
    failed."""
    # Options, output, inputs: all checked before anything is loaded or encoded.
    spec = encoder_spec(model, dtype, projector_dtype, output_dtype, alpha, device, max_batch_patches,
                        batch_invariant=not no_batch_invariant)
    writable(out, files)
    if ec_dir is not None:
        writable(ec_dir / EC_PROBE, option="--ec-dir")
    # torch (the media pipeline, the encoder cache's writer): loaded once the options are good
    from ..core import encoder, encoder_cache, items

    results: list[Any] = [None] * len(files)  # per input: its record, or its error before any model loaded
    # How each input is named in the file (a name that is not UTF-8 escaped; one too long to keep, cut)
    refused = [too_long(str(p)) for p in files]
    names = [label(str(p)) if why else stored(str(p)) for p, why in zip(files, refused)]
    kinds = {}
    for i, path in enumerate(files):  # each input's existence, kind and header
        try:
            if refused[i]:
                raise BivitError(f"{names[i]}: {refused[i]}")
            kinds[i] = items.check_input(path, names[i])
        except BivitError as e:
            results[i] = e
            typer.echo(f"bivit: skipped: {shown(str(e))}", err=True)
    if not kinds:
        typer.echo(f"encoded 0 of {plural(len(files), 'input')} (nothing written); {len(files)} failed")
        raise typer.Exit(FAILURE)

    enc = encoder.load_encoder(spec)  # its demo notice and any fast path left off: said once by the log (cli.main)
    t0 = time.perf_counter()
    with _progress(show=(len(kinds) > 1 or "video" in kinds.values()) and progress_shown()) as bar:
        def prepared():
            for i, kind in kinds.items():
                if kind == "video":  # decoding a long video takes a while of its own
                    bar.set_description(f"decoding {shown(stored(files[i].name), 80)}")
                p = enc.prepare(files[i], name=names[i])
                bar.total += len(p.grid_thw)
                bar.set_description("encoding")
                yield p

        # Files share forward passes (prepared one by one as passes fill, so memory holds about one pass); in
        # invariant mode each result is the bits of encoding it alone.
        ec, ec_failed = (None if ec_dir is None else encoder_cache.Sink(ec_dir, enc.fingerprint)), []
        for i, r in zip(kinds, enc.encode_stream(prepared(), on_pass=bar.update)):
            # The one conversion: the file's record of the core's result, its embedding filed as tensor "i"
            results[i] = record = rec.Record.of_result(r, tensor=str(i))
            if ec is not None:  # as each result arrives, as every front end does
                record.extra.update(ec.feed(record))
                if "ec_error" in record.extra:  # the embedding is kept: said once --out is written
                    ec_failed.append(record.extra["ec_error"])
            if r.error is not None:  # named, whatever raised it (an allocation failure names no file)
                bar.write(f"bivit: skipped: {shown(names[i])}: "
                          f"{shown(rec.error_text(r.error, r.source))}",
                          file=sys.stderr)

    records = [rec.Record.of_error(names[i], media_kind(path) or "image", r)
               if isinstance(r, BaseException) else r  # refused before the model loaded
               for i, (path, r) in enumerate(zip(files, results))]
    embeddings = [r.embedding for r in records]
    done = [r for r in records if r.ok]
    if done:
        rec.save(out, enc.describe(), records, embeddings)
    failed = len(records) - len(done)
    where = f" -> {out}" if done else " (nothing written)"
    tokens = plural(sum(r.tokens for r in done), "token")
    typer.echo(f"encoded {len(done)} of {plural(len(files), 'input')}, {tokens} in {time.perf_counter() - t0:.2f} s"
               f"{where}" + (f"; {failed} failed" if failed else ""))
    if ec_failed:
        fail(f"--ec-dir {ec_dir}: {plural(len(ec_failed), 'input')} not written there, {ec_failed[0]} ({out} is "
             "written, with every embedding)", FAILURE)
    if ec_dir is not None:
        typer.echo(f"encoder cache: {plural(ec.written, 'item')} in {ec_dir} "
                   "(ids: \"ec_ids\" of each record in the file)")
    if failed:
        raise typer.Exit(FAILURE)


def _progress(show: bool) -> Any:
    """A bar in chunks (an image is one, a video one per 4 sampled frames), growing as inputs are decoded, so a
    single long video shows where it is."""
    from tqdm import tqdm  # 20 ms every command's start would pay, for a bar only `encode` shows

    return tqdm(total=0, desc="encoding", unit="chunk", disable=not show, file=sys.stderr, dynamic_ncols=True)
