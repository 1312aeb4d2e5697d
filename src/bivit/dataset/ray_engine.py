"""The Ray engine of `bivit encode-dataset` (kept apart so the local engine never imports ray).

Pipeline (Ray Data, streaming): items -> `prepare_rows` (read, check sha256, prepare: the core's stage 1) ->
`EncodeActor` pool (`map_batches` with a callable class, one model load per actor) -> the driver, which alone
writes shards and the manifest through `DatasetWriter` (so only the driver needs the output folder, and the
crash-safety rules of `bivit.dataset.writer` hold unchanged). Imports only the per-item stages
(`bivit.dataset.pipeline`), never the writer or the job. Workers need the input files at the same absolute paths
(a shared filesystem on a cluster) and bivit installed.

Every row crosses process boundaries on its own, as its record (`bivit.core.records.Record` JSON: the one shape of an
item outside memory) and raw bytes plus their stated dtype and shape, under one fixed Arrow schema, also for an
empty batch: Ray Data's rows are Arrow values, not Python objects. Going in, a prepared item is its record and its
pixels, made a `Prepared` again in the actor (the core encodes those); coming out, the actor converts each result
once (`bivit.dataset.pipeline.record_of`) and the driver reads that record back with its embedding, which is
what the writer and --ec-dir take. The encoder crosses as its `EncoderSpec` (a dataclass: it pickles). Nothing concatenates results across workers, so an idle worker (no
items) contributes zero rows and cannot inject a tensor of another dtype (the vLLM data-parallel bug).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import pyarrow as pa
import ray
import ray.data
import torch

from ..base.allocator import tune
from ..base.dtypes import dtype_name, parse_dtype
from ..core import records
from ..core.encoder import load_encoder
from ..core.items import Prepared
from ..core.spec import EncoderSpec
from ..errors import BivitError
from ..media.pixels import MediaBatch
from .pipeline import Work, encode_prepared, prepare

# Rows entering the encoders: one per distinct file (a `bivit.core.items.Prepared`: its record, and its pixels).
PREPARED_SCHEMA = pa.schema([
    ("record", pa.string()),  # `bivit.core.records.Record` JSON: metadata per chunk, or the reason preparing failed
    ("pixels", pa.large_binary()),  # float32 [L, 3, p, p], C order
    ("patch", pa.int64()),  # p
])
# Rows leaving the encoders (a `bivit.core.records.Record`: its JSON, and its embedding).
ENCODED_SCHEMA = pa.schema([
    ("record", pa.string()),
    ("data", pa.large_binary()),  # the embedding's raw bytes
    ("dtype", pa.string()),
    ("rows", pa.int64()),
    ("cols", pa.int64()),
])
# Local Ray only: the object store holds a few batches of pixels in flight; Ray spills beyond it.
LOCAL_OBJECT_STORE_BYTES = 512 * 2**20
# Rows handed to one encoder call; the actor then cuts them by --batch-patches. Irrelevant to the results.
ROWS_PER_ACTOR_BATCH = 8


def prepare_rows(table: pa.Table, processing: Any = None, alpha: str = "model") -> pa.Table:
    """Ray task: read + prepare each listed file (the driver's model preprocessing and alpha). Failures become
    rows whose record has `error` set."""
    out = {name: [] for name in PREPARED_SCHEMA.names}
    for row in table.to_pylist():
        p = prepare(row["sha256"], row["kind"], Path(os.fsdecode(row["path"])), row["name"], processing, alpha)
        pixels = None if p.batch is None else p.batch.pixel_values.contiguous()
        out["record"].append(_record_json(records.Record.of_result(p)))
        out["pixels"].append(None if pixels is None else pixels.numpy().tobytes())
        out["patch"].append(None if pixels is None else int(pixels.shape[-1]))
    return pa.table(out, schema=PREPARED_SCHEMA)


def _record_json(record: records.Record) -> str:
    return json.dumps(record.to_json(), separators=(",", ":"), ensure_ascii=False)


def _unpack_prepared(row: dict) -> Prepared:
    p = records.Record.from_json(json.loads(row["record"])).to_item(Prepared)
    if p.error is None:
        pixels = torch.frombuffer(bytearray(row["pixels"]), dtype=torch.float32).reshape(-1, 3, row["patch"],
                                                                                         row["patch"])
        p.batch = MediaBatch(pixels, torch.tensor(p.grid_thw, dtype=torch.int64).reshape(-1, 3), p.timestamps, [])
    return p


class EncodeActor:
    """Ray actor: loads the encoder once, then encodes whatever batch it is given (zero rows included)."""

    def __init__(self, spec: EncoderSpec, fingerprint: str, bits: Optional[str], threads: int):
        # The driver loaded the same model first and said its notices (demo model, a fast path off) once; each
        # actor saying them again would only repeat them, prefixed by Ray, on the driver's terminal.
        logging.getLogger("bivit").setLevel(logging.ERROR)
        torch.set_num_threads(threads)
        tune()  # an actor process is bivit's own (see bivit.base.allocator)
        self.encoder = load_encoder(spec)
        if bits is not None and self.encoder.bits != bits:
            # Another CPU kind or install whose kernels do not compute the driver's arithmetic (bivit.ops.bits):
            # its rows would not be the rows the dataset's other shards hold for the same inputs.
            raise BivitError(f"worker on {os.uname().nodename} computes bits {self.encoder.bits}, the driver "
                             f"{bits}: rows of two classes cannot share a dataset; give every node one class "
                             "(bivit-arith/1 wherever a C compiler is found and BIVIT_ARITH is unset)")
        if self.encoder.fingerprint != fingerprint:
            # Another node with other weights (or another torch/bivit build that loads them differently).
            raise BivitError(f"worker on {os.uname().nodename} loaded model {spec.model or 'demo'} with fingerprint "
                             f"{self.encoder.fingerprint[:16]}, the driver has {fingerprint[:16]}")

    def __call__(self, table: pa.Table) -> pa.Table:
        items = [_unpack_prepared(r) for r in table.to_pylist()]
        return encoded_table(encode_prepared(self.encoder, items))


def encoded_table(results: Sequence[records.Record]) -> pa.Table:
    """Results' records as rows of ENCODED_SCHEMA; an empty list gives an empty table of the same schema."""
    out = {name: [] for name in ENCODED_SCHEMA.names}
    for r in results:
        t = None if r.embedding is None else r.embedding.contiguous()
        out["record"].append(_record_json(r))
        out["data"].append(None if t is None else t.view(torch.uint8).numpy().tobytes())
        out["dtype"].append(None if t is None else dtype_name(t.dtype))
        out["rows"].append(None if t is None else int(t.shape[0]))
        out["cols"].append(None if t is None else int(t.shape[1]))
    return pa.table(out, schema=ENCODED_SCHEMA)


def decode_encoded(row: dict) -> records.Record:
    """A row of ENCODED_SCHEMA -> the record the actor made, its embedding in memory."""
    r = records.Record.from_json(json.loads(row["record"]))
    if r.error is None:
        dtype = parse_dtype(row["dtype"], "dtype")
        raw = (torch.frombuffer(bytearray(row["data"]), dtype=torch.uint8) if row["data"]
               else torch.zeros(0, dtype=torch.uint8))
        r = dataclasses.replace(r, _embedding=raw.view(dtype).reshape(row["rows"], row["cols"]))
    return r


# On a cluster Ray restarts a lost actor and retries its items; a local actor that dies died of this machine (its
# memory): the job stops, keeps what is encoded, and a re-run resumes. Restartable actors also make Ray log an
# error-level core_worker line about their constructor arguments on every local run.
_NO_RESTARTS = {"max_restarts": 0}


@contextlib.contextmanager
def _ray_session(address: Optional[str], cpus_needed: int) -> Iterator[Any]:
    if ray.is_initialized():  # the caller's Ray (a notebook, a test): use it, leave it running
        yield ray
        return
    # Ray's own log lines at WARNING (the token-auth default, disabled progress bars) are not the user's business
    # here; its errors still show. Worker lines reach the driver with a "(pid=...)" prefix, colored only on a
    # terminal (in a log file, raw ANSI escapes).
    quiet = dict(logging_level=logging.ERROR, log_to_driver=True, configure_logging=True)
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
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


def run_ray(work: Sequence[Work], sink: Callable[[records.Record], None], *, spec: EncoderSpec,
            fingerprint: str, address: Optional[str], workers: int, cpus_per_worker: int,
            processing: Any = None, bits: Optional[str] = None) -> None:
    """Encode `work` on a Ray actor pool, each actor loading the encoder of `spec`, and hand every result's
    record to `sink` (called in this thread only)."""
    if not work:
        return
    if spec.model is not None and Path(spec.model).exists():
        # workers do not share the driver's working directory (a hub repo id stays as it is: each worker
        # resolves it from its own Hugging Face cache)
        spec = dataclasses.replace(spec, model=str(Path(spec.model).resolve()))
    with _ray_session(address, workers * cpus_per_worker + 1), warnings.catch_warnings():
        # Ray's warnings stay out of the output (docs/dataset.md), e.g. that an actor pool larger than the blocks
        # it gets will not use all its actors: advice about Ray's own tuning that bivit's user cannot act on.
        warnings.filterwarnings("ignore", module=r"ray(\.|$)")
        ctx = ray.data.DataContext.get_current()
        bars = ctx.enable_progress_bars
        ctx.enable_progress_bars = False  # bivit shows its own bar, in items
        data_log = logging.getLogger("ray.data")
        level = data_log.level
        data_log.setLevel(logging.ERROR)  # e.g. "Progress bars disabled": bivit shows its own
        # The path as bytes: a file name that is not UTF-8 is no Arrow string.
        items = [{"sha256": w.sha256, "kind": w.kind, "path": os.fsencode(Path(w.path).resolve()),
                  "name": w.sources[0].source} for w in work]
        try:
            ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items), 4 * workers, 256)))
            ds = ds.map_batches(prepare_rows, fn_kwargs=dict(processing=processing, alpha=spec.alpha),
                                batch_format="pyarrow", batch_size=ROWS_PER_ACTOR_BATCH, num_cpus=1)
            with warnings.catch_warnings():  # max_restarts has no named parameter (yet): Ray warns of the kwargs
                warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
                ds = ds.map_batches(
                    EncodeActor,
                    fn_constructor_kwargs=dict(spec=spec, fingerprint=fingerprint, bits=bits, threads=cpus_per_worker),
                    compute=ray.data.ActorPoolStrategy(size=workers),
                    batch_format="pyarrow", batch_size=ROWS_PER_ACTOR_BATCH, num_cpus=cpus_per_worker,
                    **({} if address else _NO_RESTARTS),
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
