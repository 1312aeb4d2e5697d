"""The on-disk format of an encoded dataset folder: file names, record types, and reading them back.

    DIR/dataset.json              header: format, bivit version, the encoder (`Encoder.describe()`: model name
                                  + fingerprint, dtypes, width, preprocessing, kernels)
    DIR/manifest.jsonl            one line per encoded input: its record (`bivit.records`: source, sha256,
                                  kind, tokens, grid_thw, chunk_tokens, sizes, timestamps, placeholders) with the
                                  tensor's `shard` and `key` (and size, mtime_ns, seq)
    DIR/errors.jsonl              one line per input that failed (source, error, sha256 when it could be read)
    DIR/shard-000000.safetensors  embeddings keyed by the sha256 of the input's bytes; an embedding file of
                                  its own (`bivit.records`: format, encoder, the records committed with it)

`bivit.load_embeddings` opens the folder (records in manifest order) or any one shard. Folders written before
manifest lines carried chunk_tokens and placeholders, and before shards carried records, still open: their
records have no placeholders, and an old shard's records come from the folder's manifest.

Both files of lines are append-only, and each line carries `seq`, a number that grows over the folder's life:
for a source, whichever of its manifest or error lines has the larger `seq` says what it is now (encoded, or
failed since). A trailing partial line (a writer killed mid-append) is not a line.

Imports nothing heavy: `bivit.open_dataset` must be cheap.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import BivitError
from ..fileio import parse_json, read_regular
from ..records import FormatError

# The default shard size of a dataset job (`encode_dataset`, `bivit encode-dataset`), here so the CLI reads it
# cheaply.
DEFAULT_SHARD_MB = 256  # target size of one safetensors shard

FORMAT = "bivit-encoded-dataset"
FORMAT_VERSION = 1
HEADER = "dataset.json"
MANIFEST = "manifest.jsonl"
ERRORS = "errors.jsonl"
LOCK = ".lock"
SHARD_RE = re.compile(r"^shard-(\d{6,})\.safetensors$")


@dataclass(frozen=True)
class Record:
    """One manifest line: `source` was encoded into tensor `key` of `shard` (both inside the dataset folder)."""

    source: str
    sha256: str
    shard: str
    key: str
    tokens: int
    grid_thw: list  # [[t, h, w], ...]: one entry for an image, one per chunk for a video
    kind: str = "image"
    timestamps: Optional[list] = None  # per chunk, videos only
    size: Optional[int] = None  # file size and mtime when encoded: a re-run skips unchanged files unread
    mtime_ns: Optional[int] = None
    seq: int = 0  # order of this line among all manifest and error lines of the folder
    chunk_tokens: Optional[list] = None  # per chunk, its rows (None in lines of older folders: from grid_thw)
    placeholders: Optional[list] = None  # per chunk, {"text", "tokens"} (None in lines of older folders)
    sizes: Optional[list] = None  # per chunk, [width, height] before resizing (None: older folders, or unknown)

    def record(self, encoder: dict, load: Any = None) -> Any:
        """This line as a `bivit.records.Record` (its tensor: `key` in `shard`; the dataset's own keys in
        `extra`)."""
        from .. import records

        row = dataclasses.asdict(self)
        row["tensor"] = row.pop("key")
        return records.Record.from_json(row, encoder, load)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), ensure_ascii=False)

    @staticmethod
    def from_json(obj: dict) -> "Record":
        """A manifest line, checked: its shard a file name of this folder (`shard-N.safetensors`: no `..`, no
        path, so nothing outside the folder is ever read as an embedding), each key of the type it is written
        with; FormatError otherwise."""
        if not isinstance(obj, dict):
            raise FormatError(f"a manifest line that is not an object: {str(obj)[:200]}")
        names = {f.name for f in dataclasses.fields(Record)}
        try:
            rec = Record(**{k: v for k, v in obj.items() if k in names})
        except TypeError as e:  # a required key missing
            raise FormatError(f"not a manifest record ({e}): {str(obj)[:200]}") from None
        if not isinstance(rec.shard, str) or not SHARD_RE.fullmatch(rec.shard):
            raise FormatError(f"a manifest record names {str(rec.shard)[:200]!r} as its shard, not a shard file of "
                              "its folder (shard-N.safetensors)")
        for key, types in (("source", str), ("sha256", str), ("key", str), ("tokens", int), ("kind", str),
                           ("grid_thw", list), ("seq", int)):
            value = getattr(rec, key)
            if not isinstance(value, types) or isinstance(value, bool):
                raise FormatError(f"a manifest record whose {key!r} is a {type(value).__name__}: {str(obj)[:200]}")
        return rec


@dataclass(frozen=True)
class ErrorRecord:
    """One errors.jsonl line: `source` could not be encoded (from bytes with `sha256`, when they could be read)."""

    source: str
    error: str
    sha256: Optional[str] = None
    seq: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @staticmethod
    def from_json(obj: dict) -> "ErrorRecord":
        if not isinstance(obj, dict) or not isinstance(obj.get("seq", 0), int):
            raise FormatError(f"not an error record: {str(obj)[:200]}")
        return ErrorRecord(str(obj.get("source")), str(obj.get("error", "")), obj.get("sha256"), int(obj.get("seq", 0)))


def encoder_of(header: dict) -> dict:
    """The encoder's description (`Encoder.describe()`'s keys) in a folder's header, as records carry it."""
    folder_only = {"format", "format_version", "bivit_version", "model", "model_name", "is_demo", "created"}
    return {"model": header.get("model_name"), "demo": header.get("is_demo"),
            **{k: v for k, v in header.items() if k not in folder_only}}


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Complete lines of a JSONL file and the byte length they cover (a trailing partial line is left out)."""
    try:
        data = read_regular(path)  # a FIFO or device is refused without blocking
    except FileNotFoundError:
        return [], 0
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror or e})") from None
    end = data.rfind(b"\n") + 1  # 0 when no complete line
    out = []
    for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            out.append(parse_json(line))
        except ValueError as e:  # not JSON, nested too deep, a repeated key
            raise FormatError(f"{path}:{lineno}: corrupt line ({getattr(e, 'msg', e)})") from None
    return out, end


def read_header(directory: Path) -> Optional[dict]:
    """The folder's dataset.json, or None when there is none; BivitError when it is not bivit's."""
    path = directory / HEADER
    if not path.exists():
        return None
    try:
        header = parse_json(read_regular(path))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: unreadable dataset header ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BivitError(f"{path}: not a bivit encoded dataset")
    return header


def current_state(directory: Path) -> tuple[dict[str, Record], dict[str, ErrorRecord]]:
    """What each source is now: its latest manifest record, or its latest error if that came later.

    Returns (encoded sources -> Record, failed sources -> ErrorRecord); a source is in exactly one of them.
    """
    return state_from_rows(read_jsonl(directory / MANIFEST)[0], read_jsonl(directory / ERRORS)[0])


def state_from_rows(manifest_rows: list[dict], error_rows: list[dict]) -> tuple[dict[str, Record],
                                                                                dict[str, ErrorRecord]]:
    """`current_state` of rows already read (a writer opening a folder reads each file once)."""
    records: dict[str, Record] = {}
    for row in manifest_rows:
        rec = Record.from_json(row)
        records[rec.source] = rec
    errors: dict[str, ErrorRecord] = {}
    for row in error_rows:
        err = ErrorRecord.from_json(row)
        errors[err.source] = err
    for source, err in list(errors.items()):
        rec = records.get(source)
        if rec is not None:
            if rec.seq >= err.seq:
                del errors[source]
            else:
                del records[source]  # failed since it was encoded: its old embedding is not its bytes any more
    return records, errors
