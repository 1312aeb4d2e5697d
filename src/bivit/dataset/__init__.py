"""Encoded datasets: `bivit encode-dataset` writes a folder of sharded safetensors, `open_dataset` reads it.

    format      file names, record types, reading the lines back (cheap to import)
    reader      EncodedDataset / open_dataset (cheap to import; torch loads on the first tensor)
    pipeline    the per-item stages both engines run (the core's prepare and encode_stream) and the dataset's
                policies around them: planned hash checked, failures recorded with their reason
    sources     what SRC names, and the plan: skip, deduplicate or encode
    writer      DatasetWriter: the folder's lock, crash recovery and durable commits
    journal     progress below one shard: every input taken, kept before the next (the writer's alone)
    local       the in-process engine
    ray_engine  the Ray Data engine (imports only `pipeline`)
    job         encode_dataset: one whole run

Identical files (same bytes) are encoded once; all their manifest lines point to the same stored tensor.
This package imports only the reader; `encode_dataset` loads the writing side when first used.
"""

from __future__ import annotations

from typing import Any

from .format import ERRORS, HEADER, MANIFEST
from .reader import EncodedDataset, open_dataset

# Its records are `bivit.Record`s (`bivit.core.records`), as every file bivit writes holds.
__all__ = ["ERRORS", "HEADER", "MANIFEST", "EncodedDataset", "encode_dataset", "open_dataset"]


def __getattr__(name: str) -> Any:
    if name == "encode_dataset":
        from .job import encode_dataset  # torch and the model: `bivit.dataset`'s readers need neither

        return encode_dataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
