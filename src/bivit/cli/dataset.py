"""`bivit encode-dataset`: a folder or manifest of media into a resumable sharded dataset folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ..dataset import format as dataset_format  # light: file names and defaults
from ..packing import PATCHES_PER_TOKEN  # light
from .common import (EC_PROBE, FAILURE, AlphaOpt, DeprecatedOpt, DeviceOpt, DtypeOpt, EcDirOpt, ModelOpt, OutDtypeOpt,
                     ProjDtypeOpt, check_options, command, plural, progress_shown, renamed_option, writable)


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
    batch_patches: Optional[int] = typer.Option(
        None, "--batch-patches", help=f"Patches per forward pass (memory bound; results do not depend on it) "
                                      f"(default {dataset_format.DEFAULT_BATCH_PATCHES})."),
    batch_tokens: Optional[int] = DeprecatedOpt("--batch-tokens"),
    shard_mb: float = typer.Option(dataset_format.DEFAULT_SHARD_MB, help="Target size of one safetensors shard, MiB."),
    progress: bool = typer.Option(True, help="Show a progress bar (when stderr is a terminal)."),
    allow_failures: bool = typer.Option(False, "--allow-failures",
                                        help="Exit 0 even when some inputs could not be encoded."),
    alpha: str = AlphaOpt,
    ec_dir: Optional[Path] = EcDirOpt,
) -> None:
    """Encode a folder or manifest into a dataset folder.

    Every image and video under SRC goes into sharded safetensors in --out (resumable, crash-safe). Inputs that
    cannot be encoded are listed in OUT/errors.jsonl (and `open_dataset(OUT).errors`) until they are encoded; the
    exit status is then 1 unless --allow-failures. With --ec-dir, every record's rows also go to vLLM's encoder
    cache (ids: `bivit.engines.vllm.load_media(OUT)`)."""
    check_options(model, dtype, projector_dtype, output_dtype, alpha, device)
    # --batch-tokens counted tokens: 4 patches each is what it allowed an image (a video chunk of t frames has 4t).
    batch_patches = renamed_option(batch_patches, batch_tokens, "--batch-patches", "--batch-tokens",
                                   PATCHES_PER_TOKEN, " patches, 4 per token of an image")
    from ..dataset.job import check_job
    from ..dataset.sources import check_source

    # Before --out is created: a mistyped SRC or option leaves no empty folder behind.
    check_job(engine, device, workers, cpus_per_worker, shard_mb)  # a missing Ray extra too
    check_source(src)
    writable(out / dataset_format.HEADER, option="--out")  # before the model loads
    if ec_dir is not None:
        writable(ec_dir / EC_PROBE, option="--ec-dir")
    from ..dataset.job import encode_dataset as run

    try:
        summary = run(src, out, model=model, dtype=dtype, projector_dtype=projector_dtype, output_dtype=output_dtype,
                      device=device, engine=engine, ray_address=ray_address, workers=workers,
                      cpus_per_worker=cpus_per_worker, batch_patches=batch_patches, shard_mb=shard_mb,
                      progress=progress and progress_shown(), alpha=alpha)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; everything encoded so far is in {out}, run the same command to resume", err=True)
        raise typer.Exit(130) from None
    typer.echo(_summary_line(summary))
    if ec_dir is not None:
        from ..engines.media import iter_media
        from ..engines.vllm import write_encoder_cache

        # Every record of the folder (a resumed run's earlier ones too); ids already there are left as they are.
        written = sum(len(ids) for ids in (write_encoder_cache(ec_dir, [m])[0] for m in iter_media(out)))
        typer.echo(f"encoder cache: {written} items in {ec_dir} (ids: bivit.engines.vllm.load_media(OUT))")
    if summary.failed:
        typer.echo(f"{plural(summary.failed, 'input')} failed; see {Path(out) / dataset_format.ERRORS}", err=True)
        if not allow_failures:
            raise typer.Exit(FAILURE)


def _summary_line(s: Any) -> str:
    rate = s.encoded / s.seconds if s.seconds > 0 else 0.0
    return (f"encoded {s.encoded}, skipped {s.skipped}, deduplicated {s.deduplicated}, failed {s.failed}; "
            f"{plural(s.tokens, 'token')} in {s.seconds:.1f} s ({rate:.2f} items/s, engine {s.engine}"
            + (f", {plural(s.workers, 'worker')})" if s.engine == "ray" else ")"))
