"""`bivit encode-dataset`: a folder or manifest of media into a resumable sharded dataset folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ..dataset import format as dataset_format  # light: file names and defaults
from .common import (EC_PROBE, FAILURE, AlphaOpt, DeviceOpt, DtypeOpt, EcDirOpt, MaxBatchPatchesOpt, ModelOpt,
                     OutDtypeOpt, ProjDtypeOpt, command, encoder_spec, plural, progress_shown, writable)


@command("encode-dataset")
def encode_dataset(
    src: Path = typer.Argument(..., show_default=False, metavar="SRC",
                               help="Folder of images/videos (recursive) or a manifest file (one path per line, "
                                    "or JSONL with a 'path' field)."),
    out: Path = typer.Option(..., "--out", "-o", show_default=False,
                             help="Output folder (created; re-running resumes it)."),
    model: Optional[str] = ModelOpt,
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    output_dtype: Optional[str] = OutDtypeOpt,
    device: str = DeviceOpt,
    engine: str = typer.Option("local", help="local (in-process) or ray (Ray Data actor pool)."),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (e.g. auto or ray://host:10001); "
                                                         "default: start a local Ray."),
    workers: int = typer.Option(1, help="Ray engine: encoder actors (each loads the model once)."),
    cpus_per_worker: int = typer.Option(1, help="Ray engine: CPUs (torch threads) per encoder actor."),
    max_batch_patches: Optional[int] = MaxBatchPatchesOpt,
    shard_mb: float = typer.Option(dataset_format.DEFAULT_SHARD_MB, help="Target size of one safetensors shard, MiB."),
    progress: bool = typer.Option(True, help="Show a progress bar (when stderr is a terminal)."),
    allow_failures: bool = typer.Option(False, "--allow-failures",
                                        help="Exit 0 even when some inputs could not be encoded."),
    alpha: str = AlphaOpt,
    ec_dir: Optional[Path] = EcDirOpt,
    follow_symlinks: bool = typer.Option(False, "--follow-symlinks",
                                         help="Read files that symbolic links in SRC point to outside SRC (by "
                                              "default they are listed as failed, not read)."),
) -> None:
    """Encode a folder or manifest into a dataset folder.

    Every image and video under SRC goes into sharded safetensors in --out (resumable, crash-safe). Inputs that
    cannot be encoded are listed in OUT/errors.jsonl (and `open_dataset(OUT).errors`) until they are encoded; the
    exit status is then 1 unless --allow-failures. With --ec-dir, each input this run encodes also goes to vLLM's
    encoder cache as it is encoded (ids: `bivit.integrations.rows.load_media(OUT)`)."""
    spec = encoder_spec(model, dtype, projector_dtype, output_dtype, alpha, device, max_batch_patches)
    # torch (the job's and the listing's media rules): loaded once the encoder options are good
    from ..dataset import job, sources

    # Before --out is created: a mistyped SRC or option leaves no empty folder behind.
    job.check_job(engine, device, workers, cpus_per_worker, shard_mb)  # a missing Ray extra too
    sources.check_source(src)
    writable(out / dataset_format.HEADER, option="--out")  # before the model loads
    if ec_dir is not None:
        writable(ec_dir / EC_PROBE, option="--ec-dir")
    try:
        summary = job.encode_dataset(src, out, spec, engine=engine, ray_address=ray_address, workers=workers,
                                     cpus_per_worker=cpus_per_worker, ec_dir=ec_dir, shard_mb=shard_mb,
                                     progress=progress and progress_shown(), follow_symlinks=follow_symlinks)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; everything encoded so far is in {out}, run the same command to resume", err=True)
        raise typer.Exit(130) from None
    typer.echo(_summary_line(summary))
    if ec_dir is not None:
        typer.echo(f"encoder cache: {plural(summary.ec_written, 'item')} in {ec_dir} "
                   "(ids: bivit.integrations.rows.load_media(OUT))")
    if summary.ec_failed:
        typer.echo(f"bivit: error: --ec-dir {ec_dir}: {plural(len(summary.ec_failed), 'input')} not written there, "
                   f"{summary.ec_failed[0]} ({out} holds every embedding)", err=True)
        raise typer.Exit(FAILURE)
    if summary.failed:
        typer.echo(f"{plural(summary.failed, 'input')} failed; see {Path(out) / dataset_format.ERRORS}", err=True)
        if not allow_failures:
            raise typer.Exit(FAILURE)


def _summary_line(s: Any) -> str:
    rate = s.encoded / s.seconds if s.seconds > 0 else 0.0
    return (f"encoded {s.encoded}, skipped {s.skipped}, deduplicated {s.deduplicated}, failed {s.failed}; "
            f"{plural(s.tokens, 'token')} in {s.seconds:.1f} s ({rate:.2f} items/s, engine {s.engine}"
            + (f", {plural(s.workers, 'worker')})" if s.engine == "ray" else ")"))
