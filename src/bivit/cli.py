"""The `bivit` command line: every command is defined here (encode, verify, serve, encode-dataset, bench).

One error style for all of them: a user mistake, an unusable input or output, a missing extra or an unavailable
device prints one line `bivit: error: ...` on stderr and exits 2, before any work is done; a run that went
wrong (inputs that failed, invariant mode not bit-stable, a write failing mid-run) exits 1. Never a traceback.
Commands import what they need when they run, so `bivit serve` without the serve extra says which extra to
install instead of "No such option".
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from .dataset import format as dataset_format  # light: file names and defaults
from .errors import BivitError
from .serve.settings import ServerSettings as Limits  # light: no web framework

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="bivit: batch-invariant vision encoding for Kimi-K2.5/K2.6/K3.")

USAGE, FAILURE = 2, 1
# The schema of the file `bivit encode` writes (its "bivit" header key).
ENCODE_FORMAT = "bivit.encode/1"
# Patches per forward pass when `bivit encode` groups files (no effect on results in invariant mode).
GROUP_PATCHES = 4096

ModelOpt = typer.Option(None, "--model", help="Checkpoint directory (Moonshot weights) or hub repo id "
                        "(org/name[@revision]; only config and vision shards are fetched). Default: the demo model.")
AlphaOpt = typer.Option("model", "--alpha", help="Transparency: model (what the model's processor does), drop, "
                        "or white (vLLM's loader: RGBA onto white).")
DtypeOpt = typer.Option("bfloat16", "--dtype", help="Tower compute dtype: bfloat16, float32 or float16.")
ProjDtypeOpt = typer.Option(None, "--projector-dtype", help="Projector dtype (default: --dtype).")
OutDtypeOpt = typer.Option(None, "--output-dtype", help="Output dtype (default: projector dtype).")


def fail(message: str, code: int = USAGE) -> None:
    typer.echo(f"bivit: error: {message}", err=True)
    raise typer.Exit(code)


def need_extra(command: str, module: str, extra: str) -> None:
    """Exit with one line when an optional dependency of `command` is not installed."""
    if importlib.util.find_spec(module) is None:
        fail(f"`bivit {command}` needs the {extra!r} extra ({module} is not installed): "
             f"pip install 'bivit[{extra}]'")


def command(name: Optional[str] = None) -> Callable:
    """Register a command whose BivitErrors become the one-line error (exit 2), and whose unexpected OSErrors
    (a disk that fills up mid-run) a one-line failure (exit 1)."""
    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except BivitError as e:
                fail(str(e))
            except OSError as e:
                fail(_os_message(e), FAILURE)
        return app.command(name)(run)
    return register


def _os_message(e: OSError) -> str:
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


def writable(path: Path, inputs: Any = (), option: str = "--out") -> None:
    """Exit 2 now if the output cannot be written later (before any encoding is done)."""
    from .fileio import check_writable

    try:
        check_writable(path, inputs)
    except OSError as e:
        fail(f"{option} {path}: {e.strerror or e}")


def open_encoder(model: Optional[Path], dtype: str, projector_dtype: Optional[str], output_dtype: Optional[str],
                 batch_invariant: bool = True, max_batch_tokens: Optional[int] = None, alpha: str = "model") -> Any:
    from .encoder import DEMO_NOTICE, load_encoder

    enc = load_encoder(model, dtype=dtype, projector_dtype=projector_dtype, output_dtype=output_dtype,
                       batch_invariant=batch_invariant, max_batch_tokens=max_batch_tokens, alpha=alpha)
    if enc.is_demo:
        typer.echo(DEMO_NOTICE, err=True)
    return enc


# ------------------------------------------------------------------------------------------------ encode

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
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .encoder import dtype_name
    from .fileio import write_atomic
    from .media import MediaBatch, batch_placeholders
    from .video import is_video_path, join_chunks, split_by_input

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
        write_atomic(out, lambda tmp: save_file(tensors, tmp, metadata=meta))
    tokens = sum(i["tokens"] for i in items)
    where = f" -> {out}" if tensors else " (nothing written)"
    typer.echo(f"encoded {len(items)} of {len(files)} inputs, {tokens} tokens in "
               f"{time.perf_counter() - t0:.2f} s{where}" + (f"; {failed} failed" if failed else ""))
    if failed:
        raise typer.Exit(FAILURE)


# ------------------------------------------------------------------------------------------------ verify

@command()
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
    """Items alone vs in random batch layouts, invariant and default mode; exit 1 unless invariant is bit-stable."""
    from . import verify as v
    from .encoder import dtype_name

    if plot is not None:
        need_extra("verify --plot", "matplotlib", "plot")
        writable(plot, files or (), "--plot")
    encoders = [open_encoder(model, dtype, projector_dtype, None, inv) for inv in (True, False)]
    if files:
        batch = encoders[0].preprocess([str(f) for f in files])
    else:
        batch = encoders[0].preprocess(v.synthetic_images(seed))
        batch.sources = [f"synthetic {w}x{h}" for w, h in v.SYNTHETIC_SIZES]
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


# ------------------------------------------------------------------------------------------------- serve

@command()
def serve(
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint directory or hub repo id (default: demo "
                                        "model)"),
    host: str = typer.Option("127.0.0.1", help="Interface to bind; loopback by default"),
    port: int = typer.Option(8000, help="TCP port"),
    dtype: str = typer.Option("bfloat16", help="Tower dtype: bfloat16 or float32"),
    device: str = typer.Option("cpu", help="torch device"),
    batch_invariant: bool = typer.Option(True, "--batch-invariant/--no-batch-invariant",
                                         help="Bit-identical answers however requests are batched (the cache is "
                                              "off without it)"),
    api_key: Optional[str] = typer.Option(None, envvar="BIVIT_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' (all but /health)"),
    # Defaults are ServerSettings' own (one home for each limit).
    max_batch_tokens: int = typer.Option(Limits.max_batch_tokens, help="Patch budget of one forward pass"),
    max_wait_ms: float = typer.Option(Limits.max_wait_ms, help="Max wait for more items before a forward pass"),
    max_queue: int = typer.Option(Limits.max_queue, help="Items in flight before 429"),
    max_body_mb: float = typer.Option(Limits.max_body_mb, help="Request body limit (413 above)"),
    request_timeout_s: float = typer.Option(Limits.request_timeout_s,
                                            help="Per-request timeout after the body (504 after)"),
    header_timeout_s: float = typer.Option(Limits.header_timeout_s,
                                           help="Time to send a request's headers (connection closed after)"),
    body_timeout_s: float = typer.Option(Limits.body_timeout_s, help="Time to send a request's body (408 after)"),
    max_request_pixels_mb: float = typer.Option(Limits.max_request_pixels_mb,
                                                help="Decoded float32 pixels of one request (413 above)"),
    max_queue_pixels_mb: float = typer.Option(Limits.max_queue_pixels_mb,
                                              help="Decoded pixels of all admitted requests (429 above)"),
    max_response_mb: float = typer.Option(Limits.max_response_mb,
                                          help="Size of one response, every copy counted (413 above)"),
    max_video_mpixels: float = typer.Option(Limits.max_video_mpixels,
                                            help="Decoding work of one video, frames x frame pixels, millions "
                                                 "(item error above)"),
    cache_mb: float = typer.Option(Limits.cache_mb, help="Exact embedding cache size; 0 disables"),
    max_weights_mb: float = typer.Option(Limits.max_weights_mb, help="POST /v1/weights body limit (413 above)"),
    allow_weight_updates_without_key: bool = typer.Option(
        False, "--allow-weight-updates-without-key",
        help="Accept POST /v1/weights without --api-key (trusted machines only)"),
    log_level: str = typer.Option("info", help="debug, info, warning or error"),
    alpha: str = AlphaOpt,
) -> None:
    """Serve the encoder over HTTP: POST /v1/encode, /v1/weights, GET /health, /ready, /metrics (serve extra)."""
    for module in ("fastapi", "uvicorn", "prometheus_client", "multipart"):
        need_extra("serve", module, "serve")
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    settings = Limits(api_key=api_key or None, max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms,
                      max_queue=max_queue, max_body_mb=max_body_mb, request_timeout_s=request_timeout_s,
                      header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                      max_request_pixels_mb=max_request_pixels_mb, max_queue_pixels_mb=max_queue_pixels_mb,
                      max_response_mb=max_response_mb, max_video_mpixels=max_video_mpixels,
                      cache_mb=cache_mb, max_weights_mb=max_weights_mb,
                      allow_weight_updates_without_key=allow_weight_updates_without_key)
    from .encoder import load_encoder
    from .serve.app import configure_logging, run

    configure_logging(log_level)  # the service logs JSON lines, its demo warning included
    encoder = load_encoder(model, device=device, dtype=dtype, batch_invariant=batch_invariant,
                           max_batch_tokens=max_batch_tokens, alpha=alpha)
    run(encoder, settings, host=host, port=port, log_level=log_level)


# ---------------------------------------------------------------------------------------- encode-dataset

@command("encode-dataset")
def encode_dataset(
    src: Path = typer.Argument(..., show_default=False,
                               help="Folder of images/videos (recursive) or a manifest file (one path per line, "
                                    "or JSONL with a 'path' field)."),
    out: Path = typer.Option(..., "--out", "-o", show_default=False,
                             help="Output folder (created; re-running resumes it)."),
    model: Optional[str] = typer.Option(None, help="Checkpoint folder or hub repo id; default: the tiny built-in "
                                                   "demo model."),
    dtype: str = typer.Option("bfloat16", help="Tower dtype: bfloat16, float16 or float32."),
    projector_dtype: Optional[str] = typer.Option(None, help="Projector dtype (default: the tower dtype)."),
    output_dtype: Optional[str] = typer.Option(None, help="Stored embedding dtype (default: the projector's)."),
    engine: str = typer.Option("local", help="local (in-process) or ray (Ray Data actor pool)."),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (e.g. auto or ray://host:10001); "
                                                         "default: start a local Ray."),
    workers: int = typer.Option(1, help="Ray engine: encoder actors (each loads the model once)."),
    cpus_per_worker: int = typer.Option(1, help="Ray engine: CPUs (torch threads) per encoder actor."),
    batch_tokens: int = typer.Option(dataset_format.DEFAULT_BATCH_TOKENS,
                                     help="Tokens per encode call (memory bound; results do not depend on it)."),
    shard_mb: float = typer.Option(dataset_format.DEFAULT_SHARD_MB, help="Target size of one safetensors shard, MiB."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    allow_failures: bool = typer.Option(False, "--allow-failures",
                                        help="Exit 0 even when some inputs could not be encoded."),
    alpha: str = AlphaOpt,
) -> None:
    """Encode every image and video under SRC into sharded safetensors in --out (resumable, crash-safe).

    Inputs that cannot be encoded are listed in OUT/errors.jsonl (and `open_dataset(OUT).errors`) until they
    are encoded; the exit status is then 1 unless --allow-failures.
    """
    # A missing Ray extra, bad --engine/--workers values: encode_dataset says so before any work.
    writable(out / dataset_format.HEADER, option="--out")  # before the model loads
    from .dataset.job import encode_dataset as run

    try:
        summary = run(src, out, model=model, dtype=dtype, projector_dtype=projector_dtype, output_dtype=output_dtype,
                      engine=engine, ray_address=ray_address, workers=workers, cpus_per_worker=cpus_per_worker,
                      batch_tokens=batch_tokens, shard_mb=shard_mb, progress=progress, alpha=alpha)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; everything encoded so far is in {out}, run the same command to resume", err=True)
        raise typer.Exit(130) from None
    typer.echo(summary.line())
    if summary.failed:
        typer.echo(f"{summary.failed} inputs failed; see {Path(out) / dataset_format.ERRORS}", err=True)
        if not allow_failures:
            raise typer.Exit(FAILURE)


# ------------------------------------------------------------------------------------------------- bench

@command()
def bench(
    dtype: str = typer.Option("both", "--dtype", help="bfloat16, float32 or both."),
    repeats: int = typer.Option(3, "--repeats", help="Timed repeats per case and implementation (median reported)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed rounds first (kernel selection, caches)."),
    out_dir: Path = typer.Option(Path("bench-results"), "--out-dir", help="Where bench.json/.md/.png go."),
    skip_hf: bool = typer.Option(False, "--skip-hf", help="Do not run the transformers port."),
    preset: str = typer.Option("kimi-k2.6", "--preset", help="Model size: kimi-k2.6 (full size), kimi-k3, demo."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per implementation (default: "
                                                                  "torch's default here)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and images."),
    in_process: bool = typer.Option(False, "--in-process", help="All implementations in this process (debugging; "
                                                                "memory is then not attributable)."),
    cases: Optional[List[str]] = typer.Option(None, "--case", help="Only the cases whose name contains this "
                                                                   "(repeatable; default: all four)."),
) -> None:
    """Throughput of bivit (invariant and default mode) vs the transformers port, against the GEMM peak.

    Seeded random weights at full size (no download); a fixed mix of a 448x448 image, an 896x672 image, 32
    images of 112x112 in one call and a 4-frame video chunk; repeats interleaved across implementations, each
    implementation in its own process. Prints Markdown tables; writes bench.json, bench.md and bench.png.
    """
    from . import bench as b

    if dtype not in b.DTYPE_CHOICES:
        fail(f"--dtype {dtype!r}: expected bfloat16, float32 or both")
    if repeats < 1 or warmup < 0 or (threads is not None and threads < 1):
        fail("--repeats and --threads must be >= 1, --warmup >= 0")
    writable(out_dir / "bench.json", option="--out-dir")
    chosen = [c for c in b.standard_cases(seed) if not cases or any(part in c.name for part in cases)]
    if not chosen:
        fail(f"--case {' '.join(cases)}: no case matches (cases: "
             f"{', '.join(c.name for c in b.standard_cases(seed))})")
    command_line = b.command_line()
    typer.echo(f"$ {command_line}")
    record = b.run_benchmark(preset=preset, dtypes=b.DTYPE_CHOICES[dtype], impls=b.BIVIT_IMPLS if skip_hf else b.IMPLS,
                             repeats=repeats, warmup=warmup, threads=threads, seed=seed, isolate=not in_process,
                             cases=chosen)
    record["command"] = command_line
    summary = b.summarize(record)
    report = f"$ {command_line}\n\n" + b.format_report(record, summary)
    typer.echo(report.split("\n", 2)[2])
    try:
        written = b.write_outputs(record, report, summary, out_dir, "bench", command_line,
                                  lambda s: typer.echo(s, err=True))
    except OSError as e:
        fail(f"cannot write results to {out_dir}: {e}", FAILURE)
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def main() -> None:
    from .allocator import tune

    tune()  # this process is bivit's own: keep freed activation memory for the next forward pass
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # The demo notice is printed once by the CLI itself; keep the library's logger quiet about it.
    logging.getLogger("bivit").setLevel(logging.ERROR)
    app()


if __name__ == "__main__":
    main()
