"""One `bivit encode-dataset` run: list the sources, plan, encode with the chosen engine, commit, summarise.

Resuming is re-running the same command: sources already in the manifest with the same size and mtime are
skipped without reading them; others are hashed, and a hash that is already stored costs a manifest line, not
an encode. Interrupted (Ctrl-C, a lost Ray worker), the run commits what is already encoded before it stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from ..base.options import BYTE_IN_MIB, size_mb, whole
from ..core.encoder import load_encoder
from ..core.encoder_cache import Sink
from ..core.records import Record
from ..core.spec import EncoderSpec
from ..errors import BivitError, ConfigError
from .format import DEFAULT_SHARD_MB
from .local import run_local
from .sources import list_sources, plan
from .writer import DEFAULT_FLUSH_SECONDS, DatasetWriter, header_for


@dataclass
class Summary:
    encoded: int = 0  # distinct contents encoded in this run
    skipped: int = 0  # sources already in the manifest
    deduplicated: int = 0  # sources whose bytes were already stored or listed twice
    failed: int = 0  # sources recorded in errors.jsonl by this run
    tokens: int = 0  # tokens written by this run
    ec_written: int = 0  # images / video chunks written to (or found complete in) --ec-dir
    ec_failed: list = dataclasses.field(default_factory=list)  # inputs encoded but not written there: why
    seconds: float = 0.0
    engine: str = "local"
    workers: int = 1


def check_job(engine: str = "local", device: str = "cpu", workers: int = 1, cpus_per_worker: int = 1,
              shard_mb: float = DEFAULT_SHARD_MB) -> None:
    """BivitError, before any work is done, for options a job cannot run with (the CLI asks before it creates
    the output folder)."""
    if engine not in ("local", "ray"):
        raise BivitError(f"--engine {engine!r}: expected 'local' or 'ray'")
    if engine == "ray" and importlib.util.find_spec("ray") is None:
        raise BivitError("--engine ray needs Ray Data: pip install 'bivit[ray]'")
    if engine == "ray" and str(device) != "cpu":
        raise BivitError(f"--device {device}: the Ray engine's workers encode on CPU; use --engine local")
    whole(workers, "--workers", 1, 4096)
    whole(cpus_per_worker, "--cpus-per-worker", 1, 1024)
    size_mb(shard_mb, "--shard-mb", BYTE_IN_MIB)  # a tiny one: one item per shard


def encode_dataset(src: str | os.PathLike, out: str | os.PathLike, spec: Optional[EncoderSpec] = None, *,
                   engine: str = "local", ray_address: Optional[str] = None, workers: int = 1,
                   cpus_per_worker: int = 1, shard_mb: float = DEFAULT_SHARD_MB,
                   flush_seconds: float = DEFAULT_FLUSH_SECONDS, progress: bool = True,
                   ec_dir: Optional[str | os.PathLike] = None, follow_symlinks: bool = False,
                   **options: Any) -> Summary:
    """Encode every image/video named by `src` into `out` (see `bivit.dataset`). Returns the summary.

    The encoder: `spec` (`bivit.EncoderSpec`; invariant mode), or its fields as keywords (`model`, `dtype`,
    `projector_dtype`, `output_dtype`, `device`, `alpha`, `max_batch_patches`, ...), as `load_encoder` takes
    them; refused naming the command's flags (`--dtype`). `max_batch_patches`: patches per forward pass
    (`bivit.core.packing`: a memory bound, results do not depend on it). `device`: where the local engine's model
    runs (the Ray engine's workers encode on CPU). `ec_dir`: also
    write each input this run encodes to vLLM's encoder cache there (`bivit.core.encoder_cache`), as it is encoded;
    one whose files cannot be written keeps its embedding and is listed in `Summary.ec_failed`.
    `follow_symlinks`: read the files that symbolic links in a `src` folder point to outside it (by default
    such a link is a failed input: `bivit.dataset.sources.list_sources`).
    """
    t0 = time.monotonic()
    spec = EncoderSpec.of(spec, **options)
    check_job(engine, spec.device, workers, cpus_per_worker, shard_mb)
    if not spec.batch_invariant:  # shards of one folder must hold the same rows for the same bytes, always
        raise ConfigError("a dataset is encoded in invariant mode: batch_invariant=False is not an option here")
    spec = spec.checked(flags=True)
    out = Path(out)
    sources = list_sources(src, exclude=out, follow_symlinks=follow_symlinks)

    # The driver always loads the model: its fingerprint goes into (or is checked against) the header, and each
    # Ray worker checks that it loaded the same thing.
    encoder = load_encoder(spec)
    summary = Summary(engine=engine, workers=workers)
    with DatasetWriter(out, header_for(encoder), shard_mb=shard_mb, flush_seconds=flush_seconds) as writer:
        p = plan(sources, writer)
        summary.skipped, summary.deduplicated, summary.failed = p.skipped, p.deduplicated, p.failed
        bar = _progress(len(p.work), progress)
        works = {w.sha256: w for w in p.work}
        ec = None if ec_dir is None else Sink(ec_dir, writer.header["fingerprint"])

        def sink(r: Record) -> None:  # each item's record, as the engine made it (`pipeline.record_of`)
            w = works.pop(r.sha256, None)
            if w is None:  # a result delivered twice (a retried Ray task): already handled
                return
            if ec is not None:
                failed = ec.feed(r).get("ec_error")
                if failed is not None:  # the embedding is kept (committed below); the run says so
                    summary.ec_failed.append(f"{r.source}: {failed}")
            if r.error is not None:
                writer.add_error(w.sources, r.error, r.sha256, r.error_kind)
                summary.failed += len(w.sources)
                summary.deduplicated -= len(w.sources) - 1  # nothing was stored for them to share
            else:
                writer.add(r, w.sources, w.stats)
                summary.encoded += 1
            bar.update(1)

        try:
            if engine == "local":
                run_local(encoder, p.work, sink)
            else:
                processing = encoder.processing  # the preprocessing tasks follow the driver's model
                del encoder  # workers load their own; free the driver's copy
                try:
                    from .ray_engine import run_ray  # Ray: optional, seconds to import, only for --engine ray
                except ImportError as e:
                    raise BivitError(f"--engine ray needs Ray Data ({e.name or e} is missing): "
                                     "pip install 'bivit[ray]'") from None

                run_ray(p.work, sink, spec=spec, fingerprint=writer.header["fingerprint"],
                        bits=writer.header.get("bits"), address=ray_address, workers=workers,
                        cpus_per_worker=cpus_per_worker, processing=processing)
        except BaseException:
            # Interrupted (Ctrl-C, a Ray worker lost): keep what is already encoded, so a re-run resumes after it.
            with contextlib.suppress(Exception):
                writer.commit()
            raise
        finally:
            bar.close()
        writer.commit()
        writer.compact_errors(listed={s.source for s in sources})
        summary.tokens = writer.tokens_written
        summary.ec_written = 0 if ec is None else ec.written
    summary.seconds = time.monotonic() - t0
    return summary


def _progress(total: int, enabled: bool) -> Any:
    return tqdm(total=total, unit="item", desc="encoding", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
