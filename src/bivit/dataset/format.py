"""The on-disk format of an encoded dataset folder: file names, record types, and reading them back.

    DIR/dataset.json              header: format, bivit version, the encoder (`Encoder.describe()`: model name
                                  + fingerprint, dtypes, width, preprocessing, kernels)
    DIR/manifest.jsonl            one line per encoded input: its record (`bivit.records.Record`, as files list
                                  it: tensor, source, kind, sha256, tokens, grid_thw, chunk_tokens, sizes,
                                  timestamps, placeholders) with the dataset's keys `shard` (the tensor's
                                  file), size, mtime_ns and seq
    DIR/errors.jsonl              one line per input that failed: its record (error "SOURCE: reason",
                                  error_kind, sha256 when it could be read) with the dataset's key `seq`;
                                  lines of older folders hold source, error, sha256 and seq only
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

import json
import re
from pathlib import Path
from typing import Any, Optional

from .. import records
from ..errors import BivitError, FormatError
from ..fileio import parse_json, read_regular

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


def manifest_record(obj: Any) -> records.Record:
    """A manifest line as its record (`bivit.records.Record`; the dataset's own keys `shard`, `size`,
    `mtime_ns`, `seq` in `extra`, readable as attributes), checked: its shard a file name of this folder
    (`shard-N.safetensors`: no `..`, no path, so nothing outside the folder is ever read as an embedding), its
    tensor key and seq of their types; FormatError otherwise. Lines of older folders name the tensor `key`."""
    if not isinstance(obj, dict):
        raise FormatError(f"a manifest line that is not an object: {str(obj)[:200]}")
    if "tensor" not in obj and "key" in obj:
        obj = {("tensor" if k == "key" else k): v for k, v in obj.items()}
    shard = obj.get("shard")
    if not isinstance(shard, str) or not SHARD_RE.fullmatch(shard):
        raise FormatError(f"a manifest record names {str(shard)[:200]!r} as its shard, not a shard file of its "
                          "folder (shard-N.safetensors)")
    for key, types in (("sha256", str), ("tensor", str), ("seq", int)):
        value = obj.get(key, 0 if key == "seq" else None)
        if not isinstance(value, types) or isinstance(value, bool):
            raise FormatError(f"a manifest record whose {key!r} is a {type(value).__name__}: {str(obj)[:200]}")
    rec = records.Record.from_json(obj)
    for key, default in (("size", None), ("mtime_ns", None), ("seq", 0)):
        rec.extra.setdefault(key, default)
    return rec


def manifest_line(rec: records.Record) -> str:
    """A record as its line of manifest.jsonl or errors.jsonl."""
    return json.dumps(rec.to_json(), separators=(",", ":"), ensure_ascii=False)


def error_record(obj: Any) -> records.Record:
    """An errors.jsonl line as its record (`error` set; `seq` in `extra`, readable as an attribute); FormatError
    for a line that is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("seq", 0), int) or isinstance(obj.get("seq"), bool) \
            or not isinstance(obj.get("error"), str):
        raise FormatError(f"not an error record: {str(obj)[:200]}")
    rec = records.Record.from_json(obj)
    rec.extra.setdefault("seq", 0)
    return rec


ErrorRecord = records.Record  # a failed input's record: its name before errors were records like the others


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


def current_state(directory: Path) -> tuple[dict[str, records.Record], dict[str, records.Record]]:
    """What each source is now: its latest manifest record, or its latest error if that came later.

    Returns (encoded sources -> record, failed sources -> record with `error`); a source is in exactly one.
    """
    return state_from_rows(read_jsonl(directory / MANIFEST)[0], read_jsonl(directory / ERRORS)[0])


def state_from_rows(manifest_rows: list[dict], error_rows: list[dict]) -> tuple[dict[str, records.Record],
                                                                                dict[str, records.Record]]:
    """`current_state` of rows already read (a writer opening a folder reads each file once)."""
    encoded: dict[str, records.Record] = {}
    for row in manifest_rows:
        rec = manifest_record(row)
        encoded[rec.source] = rec
    errors: dict[str, records.Record] = {}
    for row in error_rows:
        err = error_record(row)
        errors[err.source] = err
    for source, err in list(errors.items()):
        rec = encoded.get(source)
        if rec is not None:
            if rec.seq >= err.seq:
                del errors[source]
            else:
                del encoded[source]  # failed since it was encoded: its old embedding is not its bytes any more
    return encoded, errors
