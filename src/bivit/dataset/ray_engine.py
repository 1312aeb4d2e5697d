"""The Ray engine of `bivit encode-dataset` (kept apart so the local engine never imports ray).

Pipeline (Ray Data, streaming): items -> `prepare_rows` (read, check sha256, decode, preprocess) ->
`EncodeActor` pool (`map_batches` with a callable class, one model load per actor) -> the driver, which alone
writes shards and the manifest through `DatasetWriter` (so only the driver needs the output folder, and the
crash-safety rules of `bivit.dataset.writer` hold unchanged). Imports only the per-item stages
(`bivit.dataset.pipeline`), never the writer or the job. Workers need the input files at the same absolute paths
(a shared filesystem on a cluster) and bivit installed.

Every row crosses process boundaries on its own, as raw bytes plus its stated dtype and shape, under one fixed
Arrow schema, also for an empty batch. Nothing concatenates results across workers, so an idle worker (no
items) contributes zero rows and cannot inject a tensor of another dtype (the vLLM data-parallel bug).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import pyarrow as pa
import torch

from ..dtypes import dtype_name, parse_dtype
from ..encoder import load_encoder
from ..errors import BivitError
from ..media import MediaBatch
from .pipeline import Encoded, Prepared, Work, encode_prepared, prepare

# Rows entering the encoders: one per distinct file.
PREPARED_SCHEMA = pa.schema([
    ("sha256", pa.string()),
    ("pixels", pa.large_binary()),  # float32 [L, 3, p, p], C order
    ("patch", pa.int64()),  # p
    ("grid", pa.list_(pa.int64())),  # flattened [n, 3]
    ("timestamps", pa.list_(pa.string())),  # null for images
    ("error", pa.string()),  # null unless preprocessing failed
])
# Rows leaving the encoders.
ENCODED_SCHEMA = pa.schema([
    ("sha256", pa.string()),
    ("data", pa.large_binary()),  # the embedding's raw bytes
    ("dtype", pa.string()),
    ("rows", pa.int64()),
    ("cols", pa.int64()),
    ("grid", pa.list_(pa.int64())),
    ("timestamps", pa.list_(pa.string())),
    ("error", pa.string()),
])
# Local Ray only: the object store holds a few batches of pixels in flight; Ray spills beyond it.
LOCAL_OBJECT_STORE_BYTES = 512 * 2**20
# Rows handed to one encoder call; the actor then cuts them by --batch-tokens. Irrelevant to the results.
ROWS_PER_ACTOR_BATCH = 8


def prepare_rows(table: pa.Table, processing: Any = None, alpha: str = "model") -> pa.Table:
    """Ray task: read + preprocess each listed file (the driver's model preprocessing and alpha). Failures become
    rows with `error` set."""
    out = {name: [] for name in PREPARED_SCHEMA.names}
    for row in table.to_pylist():
        p = prepare(row["sha256"], row["kind"], Path(row["path"]), row["name"], processing, alpha)
        out["sha256"].append(p.sha256)
        if p.error is not None:
            for k, v in (("pixels", None), ("patch", None), ("grid", None), ("timestamps", None), ("error", p.error)):
                out[k].append(v)
            continue
        pix = p.batch.pixel_values.contiguous()
        out["pixels"].append(pix.numpy().tobytes())
        out["patch"].append(int(pix.shape[-1]))
        out["grid"].append([int(v) for v in p.batch.grid_thw.reshape(-1).tolist()])
        out["timestamps"].append(p.batch.timestamps)
        out["error"].append(None)
    return pa.table(out, schema=PREPARED_SCHEMA)


def _unpack_prepared(row: dict) -> Prepared:
    if row["error"] is not None:
        return Prepared(row["sha256"], error=row["error"])
    p = row["patch"]
    pixels = torch.frombuffer(bytearray(row["pixels"]), dtype=torch.float32).reshape(-1, 3, p, p)
    grid = torch.tensor(row["grid"], dtype=torch.int64).reshape(-1, 3)
    return Prepared(row["sha256"], MediaBatch(pixels, grid, row["timestamps"], []))


class EncodeActor:
    """Ray actor: loads the encoder once, then encodes whatever batch it is given (zero rows included)."""

    def __init__(self, model: Optional[str], opts: dict, fingerprint: str, threads: int, batch_tokens: int):
        torch.set_num_threads(threads)
        from ..allocator import tune

        tune()  # an actor process is bivit's own (see bivit.allocator)
        self.encoder = load_encoder(model, batch_invariant=True, **opts)
        if self.encoder.fingerprint != fingerprint:
            # Another node with other weights (or another torch/bivit build that loads them differently).
            raise BivitError(f"worker on {os.uname().nodename} loaded model {model or 'demo'} with fingerprint "
                             f"{self.encoder.fingerprint[:16]}, the driver has {fingerprint[:16]}")
        self.batch_tokens = batch_tokens

    def __call__(self, table: pa.Table) -> pa.Table:
        items = [_unpack_prepared(r) for r in table.to_pylist()]
        return encoded_table(encode_prepared(self.encoder, items, self.batch_tokens))


def encoded_table(results: Sequence[Encoded]) -> pa.Table:
    """Results as rows of ENCODED_SCHEMA; an empty list gives an empty table of the same schema."""
    out = {name: [] for name in ENCODED_SCHEMA.names}
    for e in results:
        out["sha256"].append(e.sha256)
        if e.error is not None:
            for k in ("data", "dtype", "rows", "cols", "grid", "timestamps"):
                out[k].append(None)
            out["error"].append(e.error)
            continue
        t = e.tensor.contiguous()
        out["data"].append(t.view(torch.uint8).numpy().tobytes())
        out["dtype"].append(dtype_name(t.dtype))
        out["rows"].append(int(t.shape[0]))
        out["cols"].append(int(t.shape[1]))
        out["grid"].append([v for g in e.grid_thw for v in g])
        out["timestamps"].append(e.timestamps)
        out["error"].append(None)
    return pa.table(out, schema=ENCODED_SCHEMA)


def decode_encoded(row: dict) -> Encoded:
    if row["error"] is not None:
        return Encoded(row["sha256"], error=row["error"])
    dtype = parse_dtype(row["dtype"], "dtype")
    raw = torch.frombuffer(bytearray(row["data"]), dtype=torch.uint8) if row["data"] else torch.zeros(0, dtype=torch.uint8)
    tensor = raw.view(dtype).reshape(row["rows"], row["cols"])
    g = row["grid"]
    return Encoded(row["sha256"], tensor, [g[i : i + 3] for i in range(0, len(g), 3)], row["timestamps"])


@contextlib.contextmanager
def _ray_session(address: Optional[str], cpus_needed: int) -> Iterator[Any]:
    import ray

    if ray.is_initialized():  # the caller's Ray (a notebook, a test): use it, leave it running
        yield ray
        return
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)
    if address:
        ray.init(address=address, **quiet)
    else:
        # Logical CPUs: enough for every actor plus a preprocessing task even on a 2-core machine.
        ray.init(num_cpus=max(os.cpu_count() or 1, cpus_needed), include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
    try:
        yield ray
    finally:
        ray.shutdown()


def run_ray(work: Sequence[Work], sink: Callable[[Encoded], None], *, model: Optional[str], opts: dict,
            fingerprint: str, address: Optional[str], workers: int, cpus_per_worker: int, batch_tokens: int,
            processing: Any = None) -> None:
    """Encode `work` on a Ray actor pool and hand every result to `sink` (called in this thread only)."""
    if not work:
        return
    if model is not None and Path(model).exists():
        model = str(Path(model).resolve())  # workers do not share the driver's working directory (a hub repo
        # id stays as it is: each worker resolves it from its own Hugging Face cache)
    with _ray_session(address, workers * cpus_per_worker + 1) as ray:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        bars = ctx.enable_progress_bars
        ctx.enable_progress_bars = False  # bivit shows its own bar, in items
        data_log = logging.getLogger("ray.data")
        level = data_log.level
        data_log.setLevel(logging.WARNING)
        items = [{"sha256": w.sha256, "kind": w.kind, "path": str(Path(w.path).resolve()), "name": w.sources[0].source}
                 for w in work]
        try:
            ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items), 4 * workers, 256)))
            ds = ds.map_batches(prepare_rows, fn_kwargs=dict(processing=processing, alpha=opts.get("alpha", "model")),
                                batch_format="pyarrow", batch_size=ROWS_PER_ACTOR_BATCH, num_cpus=1)
            ds = ds.map_batches(
                EncodeActor,
                fn_constructor_kwargs=dict(model=model, opts=opts, fingerprint=fingerprint, threads=cpus_per_worker,
                                           batch_tokens=batch_tokens),
                compute=ray.data.ActorPoolStrategy(size=workers),
                batch_format="pyarrow", batch_size=ROWS_PER_ACTOR_BATCH, num_cpus=cpus_per_worker,
            )
            for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in table.to_pylist():
                    sink(decode_encoded(row))
        except BivitError:
            raise
        except Exception as e:  # a worker died or could not start: say so in one line; finished items are kept
            cause = getattr(e, "cause", None) or e
            msg = str(cause).strip().splitlines()
            raise BivitError(f"ray engine failed: {type(cause).__name__}: {msg[-1] if msg else ''}") from None
        finally:
            data_log.setLevel(level)
            ctx.enable_progress_bars = bars
