"""vLLM's encoder cache on disk, as bivit writes it: each image's (each video chunk's) rows under an id that pins
the encoder and the content, for vLLM's ECExampleConnector (`shared_storage_path`).

    DIR/<id>/encoder_cache.safetensors    one contiguous CPU tensor "ec_cache": the rows vLLM loads as the
                                          item's encoder output

`Sink.feed` is the one way the front ends feed `--ec-dir` (`bivit encode`, `bivit encode-dataset`, the service):
each encoded input's record (`bivit.core.records.Record`, its embedding in memory) as it arrives. An input whose files
cannot be written (`EncoderCacheError`) keeps its embedding everywhere (nothing encoded is lost): its record carries
`ec_error` instead of `ec_ids`, and the command fails in one line once its output is written (the service answers the
item with `ec_error`). `bivit.integrations.vllm` reads and checks the same layout.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..base.dtypes import dtype_name
from ..base.fileio import write_atomic
from ..errors import BivitError

# Changes whenever the id derivation does, so ids of one derivation never name another's rows.
EC_ID_SCHEME = "bivit-ec/1"
EC_FILE = "encoder_cache.safetensors"
EC_KEY = "ec_cache"
# Safetensors' short dtype names, by bivit's dtype names.
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class EncoderCacheError(BivitError):
    """An input's encoder-cache files could not be written (a full disk, a read-only folder, a file in the way)."""


def ec_id(fingerprint: str, sha256: str, kind: str, chunk: int) -> str:
    """The id under which one image's (or one video chunk's) rows are stored for vLLM's encoder cache.

    A hash of the id scheme, the encoder fingerprint (config, weights, dtypes, invariant mode, preprocessing,
    alpha handling and the class of bits that computes them), the input's content hash, its kind and the chunk
    index: the same input encoded by the same encoder always gets the same id, on any machine of its class, and
    any change that could change the rows changes the id. The
    result is a file-name-safe string vLLM uses as the item's `mm_hash`.
    """
    key = json.dumps([EC_ID_SCHEME, fingerprint, sha256, kind, int(chunk)], separators=(",", ":"))
    return "bivit-" + hashlib.sha256(key.encode()).hexdigest()


def write_rows(directory: Union[str, os.PathLike], ids: Sequence[str], chunks: Sequence[torch.Tensor]) -> None:
    """Write each chunk's rows under its id. Atomic per file (a reader sees no file or a whole one); an id already
    holding exactly these rows is left as it is, so concurrent producers of the same items are safe (the id pins
    the encoder and the content, and each writer's file is complete). Anything else at an id is replaced, never
    written through: other rows (a zero tensor of the right shape planted at a predictable id was answered as
    the image, and vLLM would have read zeros), an empty, truncated or foreign file, a symbolic link (file or id
    folder). OSError naming the file when one cannot be written."""
    root = Path(directory)
    for i, rows in zip(ids, chunks):
        folder = root / i
        if folder.is_symlink():  # an id folder linking elsewhere: never write through it
            folder.unlink()
        path = folder / EC_FILE
        if _holds(path, rows):
            continue
        folder.mkdir(parents=True, exist_ok=True)
        # Serialised first: write_atomic then owns every write error (an OSError naming the file); its rename
        # replaces a link or a broken file at the path, never what a link points to.
        write_atomic(path, save({EC_KEY: rows.detach().cpu().contiguous().clone()}))


def _holds(path: Path, rows: torch.Tensor) -> bool:
    """Whether `path` is a regular file (not a link) holding exactly `rows` (shape, dtype and bits) as its
    encoder-cache tensor."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            sl = f.get_slice(EC_KEY)
            if list(sl.get_shape()) != list(rows.shape) or sl.get_dtype() != SAFETENSORS_DTYPES.get(
                    dtype_name(rows.dtype)):
                return False
            stored = f.get_tensor(EC_KEY)
    except Exception:  # noqa: BLE001 - a truncated or foreign file is replaced
        return False
    # Bits, not values: -0.0 and 0.0 (and NaN payloads) are rows vLLM would read differently.
    return torch.equal(stored.view(torch.uint8), rows.detach().cpu().contiguous().view(torch.uint8))


class Sink:
    """`--ec-dir`: the encoded inputs of one encoder (`fingerprint`), written to `directory` one by one."""

    def __init__(self, directory: Union[str, os.PathLike], fingerprint: str) -> None:
        self.directory, self.fingerprint = Path(directory), fingerprint
        self.written = 0  # ids written or found complete

    def ids(self, result: Any) -> list[str]:
        """The ids of an encoded input's images / chunks (its `bivit.core.records.Record`)."""
        return [ec_id(self.fingerprint, result.sha256, result.kind, i) for i in range(len(result.grid_thw))]

    def put(self, result: Any) -> list[str]:
        """Write an encoded input's rows (its `bivit.core.records.Record`, embedding in memory) -> its ids;
        EncoderCacheError naming the folder and the reason when a file cannot be written."""
        ids = self.ids(result)
        try:
            write_rows(self.directory, ids, result.chunks)
        except OSError as e:
            raise EncoderCacheError(f"cannot write the encoder cache in {self.directory} "
                                    f"({e.strerror or e})") from None
        self.written += len(ids)
        return ids

    def feed(self, record: Any) -> dict:
        """`--ec-dir`'s one step in every front end: an input's record (embedding in memory) -> the keys its record
        gains, {"ec_ids": its ids} or {"ec_error": why its files could not be written} (it keeps its embedding);
        {} for an input that failed."""
        if record.error is not None:
            return {}
        try:
            return {"ec_ids": self.put(record)}
        except EncoderCacheError as e:
            return {"ec_error": str(e)}
