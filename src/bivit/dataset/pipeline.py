"""The per-item stages of encode-dataset, the same for both engines: what an item is (`Source`, `Work`), reading
it with its planned hash checked (`prepare`), encoding prepared items (`encode_prepared`), and the one conversion
of an encoded item into what the job commits (`record_of`). Both stages are the core's (`bivit.core.items`,
`Encoder.encode_stream`); this module adds only the dataset's policies: the bytes decoded are the bytes planned, and
nothing an input does stops the job.

Why the result does not depend on how the work is cut (engine, worker count, --batch-patches): every item is
encoded by a batch-invariant Encoder, whose output for an item is bit-identical whatever shares the pass, and
each item travels on its own with its dtype stated explicitly, so nothing is ever concatenated across workers.
(vLLM's data-parallel encoder made an empty tensor in the *pixel* dtype on a rank that got no items while busy
ranks returned float32, a mixed-dtype gather waiting to happen; here an empty batch is just zero rows.)
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..base.fileio import read_regular, sha256_file
from ..core import records
from ..core.items import ItemResult, Prepared, prepare as prepare_input
from ..errors import BivitError

# Videos up to this size are decoded from the very bytes that were hashed; larger ones from the path after a
# streamed hash check (holding a multi-GB file in memory is worse than a file swapped mid-job, which is rare).
VIDEO_BYTES_LIMIT = 512 * 2**20
# Decoding one image stops after this long (a MediaError, recorded in errors.jsonl): no image can hold the job.
# Far above the seconds the largest image bivit admits (200 MP) takes to decode and resize. Videos have no
# deadline here: a legal 4-hour video takes longer than any fixed bound to decode; their frame count, duration
# and the size of every decoded frame bound them (docs/limits.md).
IMAGE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Source:
    """One input file: `source` is how it is named in the manifest, `path` where it is read from.

    `error` is set when listing already found it unusable (a folder that cannot be read): it is recorded, never
    silently dropped.
    """

    source: str
    path: Path
    kind: str  # "image" | "video"
    error: Optional[str] = None


@dataclass
class Work:
    """One distinct content (sha256) to encode, and every source in this run that has those bytes."""

    sha256: str
    kind: str
    path: Path
    sources: list[Source] = field(default_factory=list)
    stats: list[Optional[os.stat_result]] = field(default_factory=list)


def prepare(sha: str, kind: str, path: Path, name: str, processing: Any = None, alpha: str = "model",
            image_timeout_s: float = IMAGE_TIMEOUT_S) -> Prepared:
    """Read one item, check it still has the planned `sha`, and prepare it under the model's `processing` (a
    ProcessorConfig) and `alpha`, an image's decoding stopped after `image_timeout_s`. Never raises for a bad
    input: the reason is the Prepared's error."""
    deadline = time.monotonic() + image_timeout_s if kind == "image" else None
    try:
        if kind == "video" and path.stat().st_size > VIDEO_BYTES_LIMIT:
            data, same = path, sha256_file(path) == sha
        else:
            data = read_regular(path)
            same = hashlib.sha256(data).hexdigest() == sha
        if not same:
            raise BivitError("file changed while the job ran (its sha256 differs from the one planned)")
        return prepare_input(data, processing=processing, alpha=alpha, name=name, kind=kind, sha256=sha,
                             deadline=deadline)
    except OSError as e:
        error: BaseException = BivitError(f"cannot read ({e.strerror or e})")
    except BivitError as e:
        error = e
    except Exception as e:  # a decoder bug must not stop the job; it is recorded with its type
        error = BivitError(f"{type(e).__name__}: {e}")
    return Prepared(name, kind, sha, error=error)


def encode_prepared(encoder: Any, items: Sequence[Prepared]) -> list[records.Record]:
    """Encode prepared items (any number, zero included) in passes of the encoder's `max_batch_patches`;
    failures are per item. -> their records (`record_of`)."""
    return [record_of(r) for r in encoder.encode_stream(items)]


def record_of(result: ItemResult) -> records.Record:
    """The job's one conversion of an encoded item, where it is encoded (in process, or in a Ray actor): its
    record, embedding in memory and filed under its content hash (its tensor's key in a shard), `shard` to be
    set by the writer; a failed item's reason and kind as errors.jsonl keeps them. The writer, --ec-dir and the
    Ray rows take this record."""
    return records.Record.of_result(result, tensor=result.sha256, shard="")
