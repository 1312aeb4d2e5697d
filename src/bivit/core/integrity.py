"""What makes a file of records prove itself (docs/formats.md, "The checksum"): the checksum over its metadata,
each record held to itself (`check_record`: its tokens, grids, chunks, placeholders and kind agree), and each
embedding held to its record (`check_embedding`: rows, dtype, `tensor_sha256`).

A checksum without a rule for its absence is no defence: flipping one bit of its key would make a damaged file
read as an old one. So which files may lack it is decided by their format (`bivit.embeddings/1`, written before
checksums), and the format is itself covered: a current file without its checksum is refused.

Imports nothing heavy (`bivit.serve.client` reads answers through `bivit.core.records`); torch only to hash a tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..errors import FormatError
from ..media.grids import grid_tokens

if TYPE_CHECKING:  # type hints only
    import torch

# The metadata key of a file's checksum, and the keys it covers (their strings as stored, in this order).
CHECKSUM_KEY = "metadata_sha256"
COVERED = ("format", "encoder", "items")
# A record's values bivit writes are far below these; above them a value is damage, refused before any
# arithmetic on it (a grid of 1e18 was a TypeError, [50, 50] chunks of 108 rows torch's RuntimeError).
MAX_GRID = 2**16  # frames, patch rows or patch columns of one chunk
KINDS = ("image", "video")
_HEX64 = re.compile(r"[0-9a-f]{64}")

_log = logging.getLogger("bivit.records")


def metadata_sha256(meta: Mapping[str, Any]) -> str:
    """The checksum of a file's metadata: sha256 of the JSON list of its `COVERED` strings as stored."""
    text = json.dumps([meta.get(k) for k in COVERED], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_metadata(meta: Mapping[str, Any], name: str) -> None:
    """FormatError naming the file unless its metadata holds its checksum and matches it (a file of the current
    format: it is the format, not the key's presence, that says a checksum is due)."""
    stored = meta.get(CHECKSUM_KEY)
    if not isinstance(stored, str):
        raise FormatError(f"{name}: format {meta.get('format')!r} without its {CHECKSUM_KEY!r}: the file is damaged "
                          "or was altered")
    if not all(isinstance(meta.get(k), str) for k in COVERED) or metadata_sha256(meta) != stored:
        raise FormatError(f"{name}: its metadata does not match the checksum it holds ({CHECKSUM_KEY}): the file is "
                          "damaged or was altered")


def said_unverified(name: str, what: str) -> None:
    """Say once per file that part of it (`what`) is read unverified: only files of older formats get here."""
    if (name, what) not in _UNVERIFIED:
        _UNVERIFIED.add((name, what))
        _log.warning(f"{name}: {what}")


_UNVERIFIED: set = set()  # (file, what) said


def _fail(where: str, field: str, why: str, obj: Mapping[str, Any]) -> FormatError:
    return FormatError(f"{where}record {str(obj.get('source'))[:200]!r}: {field!r} {why}")


def _whole(value: Any, low: int = 0, high: Optional[int] = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def check_record(obj: Mapping[str, Any], where: str = "") -> None:
    """FormatError naming `where` (the file, "PATH: "), the record and the field unless a record as a file lists
    it agrees with itself: its kind is one bivit writes; an encoded item's grid has one [t, h, w] per chunk
    (an image: one, t = 1), its `chunk_tokens` are each grid's rows (`bivit.media.grids.grid_tokens`) and add up to
    `tokens`, each placeholder replaces its chunk's rows, each video chunk has its timestamp; a failed item
    names no tensor. Keys older files lack are not asked for."""
    kind = obj.get("kind")
    if kind is not None and kind not in KINDS:
        raise _fail(where, "kind", f"is {str(kind)[:50]!r}, not one of {', '.join(KINDS)}", obj)
    for key in ("sha256", "tensor_sha256"):
        if obj.get(key) is not None and not (isinstance(obj[key], str) and _HEX64.fullmatch(obj[key])):
            raise _fail(where, key, "is not a sha256 (64 lowercase hex digits)", obj)
    if obj.get("error") is not None:
        if not isinstance(obj["error"], str) or obj.get("tensor") is not None:
            raise _fail(where, "error", "must be text, and a failed item names no tensor", obj)
        return
    grid = obj.get("grid_thw") or []
    if not isinstance(grid, list) or not all(isinstance(g, list) and len(g) == 3 and all(_whole(n, 1, MAX_GRID)
                                                                                         for n in g) for g in grid):
        raise _fail(where, "grid_thw", f"is not a list of [t, h, w] of whole numbers from 1 to {MAX_GRID}", obj)
    if kind == "image" and (len(grid) > 1 or any(t != 1 for t, _, _ in grid)):
        raise _fail(where, "grid_thw", f"holds {len(grid)} chunks of {[g[0] for g in grid]} frames for an image "
                    "(one chunk of one frame)", obj)
    rows = [grid_tokens(h, w) for _, h, w in grid]
    chunk_tokens = obj.get("chunk_tokens")
    if chunk_tokens is not None and (chunk_tokens != rows or not all(_whole(n) for n in chunk_tokens)):
        raise _fail(where, "chunk_tokens", f"is {str(chunk_tokens)[:100]}, its grid_thw's rows are {rows}", obj)
    tokens = obj.get("tokens")
    if tokens is not None and (not _whole(tokens) or (grid and tokens != sum(rows))):
        raise _fail(where, "tokens", f"is {str(tokens)[:50]}, its chunks hold {sum(rows)} rows", obj)
    placeholders = obj.get("placeholders") or []
    if placeholders and (not isinstance(placeholders, list) or len(placeholders) != len(rows) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) and _whole(p.get("tokens")) and p["tokens"] == n
            for p, n in zip(placeholders, rows))):
        raise _fail(where, "placeholders", f"do not give each of its {len(rows)} chunks its text and rows {rows}",
                    obj)
    stamps = obj.get("timestamps")
    if stamps is not None and (kind == "image" or not isinstance(stamps, list) or len(stamps) != len(rows)
                               or not all(isinstance(s, str) for s in stamps)):
        raise _fail(where, "timestamps", f"are not one text per chunk of a video ({len(rows)} chunks)", obj)
    sizes = obj.get("sizes")
    if sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(rows) or not all(
            z is None or (isinstance(z, list) and len(z) == 2 and all(_whole(v, 1) for v in z)) for z in sizes)):
        raise _fail(where, "sizes", f"are not one [width, height] (or null) per chunk ({len(rows)} chunks)", obj)


def embedding_sha256(tensor: "torch.Tensor") -> str:
    """A record's `tensor_sha256`: the sha256 of a tensor's bytes as a safetensors file stores them (C order)."""
    import torch  # heavy (torch): bivit.serve.client reads records without it (module docstring)

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()


def check_embedding(embedding: Any, tokens: int, dtype: Optional[str], name: str, checksum: Optional[str] = None,
                    file: Optional[str] = None) -> None:
    """FormatError naming `file` and `name` (the tensor) unless `embedding` is what its record says: a 2-D tensor
    of `tokens` rows, in `dtype` (a torch dtype's name, if stated), with the record's `checksum` (`tensor_sha256`;
    only records of older formats lack it: read unverified, said once per file)."""
    name = f"{file}: {name}" if file else name
    shape = tuple(getattr(embedding, "shape", ()))
    if len(shape) != 2 or shape[0] != tokens:
        raise FormatError(f"{name}: a tensor of shape {list(shape)}, its record says {tokens} rows")
    stored = str(embedding.dtype).removeprefix("torch.")
    if dtype is not None and stored != dtype:
        raise FormatError(f"{name}: a {stored} tensor, its file says {dtype}")
    if checksum is None:
        said_unverified(file or name, "its records hold no tensor checksums (a file of an older bivit format): its "
                        "embeddings are read unverified")
    elif embedding_sha256(embedding) != checksum:
        raise FormatError(f"{name}: its bytes do not match the checksum its record holds (tensor_sha256): the file "
                          "is damaged")


def sealed(obj: Mapping[str, Any], key: str) -> dict:
    """`obj` with its checksum under `key`: the sha256 of its canonical JSON (`_canonical`) without that key
    (a line of a dataset's manifest or errors, its header)."""
    body = {k: v for k, v in obj.items() if k != key}
    return {**body, key: hashlib.sha256(_canonical(body)).hexdigest()}


def unsealed(obj: Mapping[str, Any], key: str, where: str, required: bool) -> dict:
    """`obj` without its checksum under `key`, checked; FormatError naming `where` when it does not match, or
    when it is missing and `required` (a folder of the current format: its version, which the header's checksum
    covers, says so). Missing and not required (an older folder): read unverified, said once per file."""
    body = {k: v for k, v in obj.items() if k != key}
    stored = obj.get(key)
    if stored is None and not required:
        said_unverified(where, f"written without checksums ({key}, before bivit wrote them): read unverified")
    elif stored is None or hashlib.sha256(_canonical(body)).hexdigest() != stored:
        what = "without its checksum" if stored is None else "not matching its checksum"
        raise FormatError(f"{where}: {str(obj.get('source', 'the header'))[:200]!r} {what} ({key}): the file is "
                          "damaged or was altered")
    return body


def _canonical(obj: Mapping[str, Any]) -> bytes:
    # As its writer dumps it: parsing and dumping again gives the same text for JSON's own values.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
