"""The per-item stages of encode-dataset, the same for both engines: prepare (read, check, decode) and encode.

Why the result does not depend on how the work is cut (engine, worker count, --batch-tokens): every item is
encoded by a batch-invariant Encoder, whose output for an item is bit-identical whatever shares the call, and
each item travels on its own with its dtype stated explicitly, so nothing is ever concatenated across workers.
(vLLM's data-parallel encoder made an empty tensor in the *pixel* dtype on a rank that got no items while busy
ranks returned float32, a mixed-dtype gather waiting to happen; here an empty batch is just zero rows.)
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..errors import MediaError
from ..fileio import read_regular, sha256_file
from ..media import MediaBatch, preprocess_images
from ..video import join_chunks, preprocess_video, split_by_input

# Videos up to this size are decoded from the very bytes that were hashed; larger ones from the path after a
# streamed hash check (holding a multi-GB file in memory is worse than a file swapped mid-job, which is rare).
VIDEO_BYTES_LIMIT = 512 * 2**20


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


@dataclass
class Prepared:
    """A work item after decoding: its chunks (one for an image) as a MediaBatch, or the reason it failed.

    Reasons (here and in Encoded) do not name a source: several sources may share the bytes, and each gets its
    own line `"{source}: {reason}"` in errors.jsonl.
    """

    sha256: str
    batch: Optional[MediaBatch] = None
    error: Optional[str] = None


@dataclass
class Encoded:
    sha256: str
    tensor: Optional[torch.Tensor] = None
    grid_thw: Optional[list] = None
    timestamps: Optional[list] = None
    error: Optional[str] = None


def prepare(sha: str, kind: str, path: Path, name: str, processing: Any = None, alpha: str = "model") -> Prepared:
    """Read, check and preprocess one item under the model's `processing` (a ProcessorConfig) and `alpha`.
    Never raises for a bad input: the reason is returned."""
    changed = "file changed while the job ran (its sha256 differs from the one planned)"
    try:
        if kind == "video" and path.stat().st_size > VIDEO_BYTES_LIMIT:
            if sha256_file(path) != sha:
                return Prepared(sha, error=changed)
            batch = preprocess_video(path, name=name, processing=processing)
        else:
            data = read_regular(path)
            if hashlib.sha256(data).hexdigest() != sha:
                return Prepared(sha, error=changed)
            batch = (preprocess_video(data, name=name, processing=processing) if kind == "video" else
                     preprocess_images([data], names=[name], processing=processing, alpha=alpha))
        if len(batch) == 0:
            return Prepared(sha, error="no frames decoded")
        return Prepared(sha, batch)
    except MediaError as e:
        return Prepared(sha, error=e.about(name))
    except OSError as e:
        return Prepared(sha, error=f"cannot read ({e.strerror or e})")
    except Exception as e:  # a decoder bug must not stop the job; it is recorded with its type
        return Prepared(sha, error=f"{type(e).__name__}: {e}")


def group_by_tokens(items: Sequence[Prepared], batch_tokens: int) -> list[list[Prepared]]:
    """Cut items into encode calls of about `batch_tokens` tokens (an item is never split; invariance makes the
    cut irrelevant to the result, it only bounds memory)."""
    groups: list[list[Prepared]] = []
    cur: list[Prepared] = []
    n = 0
    for it in items:
        t = sum(it.batch.token_counts)
        if cur and n + t > batch_tokens:
            groups.append(cur)
            cur, n = [], 0
        cur.append(it)
        n += t
    if cur:
        groups.append(cur)
    return groups


def encode_prepared(encoder: Any, items: Sequence[Prepared], batch_tokens: int) -> list[Encoded]:
    """Encode prepared items (any number, zero included) in token-bounded calls; failures are per item."""
    out: list[Encoded] = [Encoded(p.sha256, error=p.error) for p in items if p.error is not None]
    good = [p for p in items if p.error is None]
    for group in group_by_tokens(good, batch_tokens):
        try:
            tensors = encoder.encode_batch(MediaBatch.concat([p.batch for p in group]))
        except Exception:
            # Find which item broke the call: encode each alone (same bits, by invariance).
            for p in group:
                try:
                    out.append(_assemble(p, encoder.encode_batch(p.batch)))
                except Exception as e:
                    out.append(Encoded(p.sha256, error=f"encode failed: {type(e).__name__}: {e}"))
            continue
        per_item = split_by_input(tensors, [len(p.batch) for p in group])
        out.extend(_assemble(p, chunks) for p, chunks in zip(group, per_item))
    return out


def _assemble(p: Prepared, chunks: Sequence[torch.Tensor]) -> Encoded:
    # `grid_thw` and `timestamps` in the manifest say where each chunk of a stored video starts.
    return Encoded(p.sha256, join_chunks(chunks), p.batch.grid_thw.tolist(), p.batch.timestamps)
