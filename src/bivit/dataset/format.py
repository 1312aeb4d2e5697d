"""The on-disk format of an encoded dataset folder: file names, record types, and reading them back.

    DIR/dataset.json              header: format, format_version, bivit version, the encoder
                                  (`Encoder.describe()`: model name + fingerprint, dtypes, width, preprocessing,
                                  kernels), and its checksum `header_sha256`
    DIR/manifest.jsonl            one line per encoded input: its record (`bivit.core.records.Record`, as files list
                                  it: tensor, source, kind, sha256, tokens, grid_thw, chunk_tokens, sizes,
                                  timestamps, placeholders) with the dataset's keys `shard` (the tensor's
                                  file), size, mtime_ns and seq
    DIR/errors.jsonl              one line per input that failed: its record (error "SOURCE: reason",
                                  error_kind, sha256 when it could be read) with the dataset's key `seq`;
                                  lines of older folders hold source, error, sha256 and seq only
    DIR/shard-000000.safetensors  embeddings keyed by the sha256 of the input's bytes; an embedding file of
                                  its own (`bivit.core.records`: format, encoder, the records committed with it)

`bivit.load_embeddings` opens the folder (records in manifest order) or any one shard. Folders written before
manifest lines carried chunk_tokens and placeholders, and before shards carried records, still open: their
records have no placeholders, and an old shard's records come from the folder's manifest.

Both files of lines are append-only, and each line carries `seq`, a number that grows over the folder's life:
for a source, whichever of its manifest or error lines has the larger `seq` says what it is now (encoded, or
failed since). A trailing partial line (a writer killed mid-append) is not a line.

Every line and the header carry their checksum (`line_sha256`, `header_sha256`: `bivit.core.integrity.sealed`),
checked by every reader: from `format_version` 2 on they must (the version is covered by the header's), and
folders of version 1 read unverified, said once per file. Both files are read within bounds (`MAX_HEADER_BYTES`,
`MAX_LINES_BYTES`, `MAX_LINE_BYTES`).

Imports nothing heavy: `bivit.open_dataset` must be cheap.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from ..base.fileio import open_regular, parse_json, read_regular
from ..core import records
from ..core.integrity import sealed, unsealed
from ..errors import FormatError

# The default shard size of a dataset job (`encode_dataset`, `bivit encode-dataset`), here so the CLI reads it
# cheaply.
DEFAULT_SHARD_MB = 256  # target size of one safetensors shard

FORMAT = "bivit-encoded-dataset"
FORMAT_VERSION = 2  # 2: lines and header carry their checksums
LINE_KEY, HEADER_KEY = "line_sha256", "header_sha256"
# What a reader reads of the folder's own files, at most (they were read whole, any size): a header is a few KB;
# a line some hundred bytes per chunk (a 4-hour video at max_frames: about 40 KB); a manifest about 700 bytes an
# input (8 GiB: some 10 million inputs, whose records a reader holds in memory).
MAX_HEADER_BYTES = 2**20
MAX_LINE_BYTES = 4 * 2**20
MAX_LINES_BYTES = 8 * 2**30
HEADER = "dataset.json"
MANIFEST = "manifest.jsonl"
ERRORS = "errors.jsonl"
LOCK = ".lock"
SHARD_RE = re.compile(r"^shard-(\d{6,})\.safetensors$")


def manifest_record(obj: Any, where: str = MANIFEST, checked: bool = False) -> records.Record:
    """A manifest line (of file `where`) as its record (`bivit.core.records.Record`; the dataset's own keys `shard`,
    `size`, `mtime_ns`, `seq` in `extra`, readable as attributes), checked: its checksum (`checked`: required),
    its shard a file name of this folder (`shard-N.safetensors`: no `..`, no path, so nothing outside the folder
    is ever read as an embedding), its tensor key and seq of their types, the record itself
    (`bivit.core.integrity.check_record`); FormatError naming the file otherwise. Lines of older folders name the
    tensor `key`."""
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: a manifest line that is not an object: {str(obj)[:200]}")
    obj = unsealed(obj, LINE_KEY, str(where), checked)
    if "tensor" not in obj and "key" in obj:
        obj = {("tensor" if k == "key" else k): v for k, v in obj.items()}
    shard = obj.get("shard")
    if not isinstance(shard, str) or not SHARD_RE.fullmatch(shard):
        raise FormatError(f"{where}: a manifest record names {str(shard)[:200]!r} as its shard, not a shard file of "
                          "its folder (shard-N.safetensors)")
    for key, types in (("sha256", str), ("tensor", str), ("seq", int)):
        value = obj.get(key, 0 if key == "seq" else None)
        if not isinstance(value, types) or isinstance(value, bool):
            raise FormatError(f"{where}: a manifest record whose {key!r} is a {type(value).__name__}: "
                              f"{str(obj)[:200]}")
    rec = records.Record.from_json(obj, file=str(where))
    for key, default in (("size", None), ("mtime_ns", None), ("seq", 0)):
        rec.extra.setdefault(key, default)
    return rec


def manifest_line(rec: records.Record) -> str:
    """A record as its line of manifest.jsonl or errors.jsonl, with its checksum."""
    return json.dumps(sealed(rec.to_json(), LINE_KEY), separators=(",", ":"), ensure_ascii=False)


def error_record(obj: Any, where: str = ERRORS, checked: bool = False) -> records.Record:
    """An errors.jsonl line (of file `where`) as its record (`error` set; `seq` in `extra`, readable as an
    attribute); FormatError naming the file for a line that is not one (its checksum: as `manifest_record`)."""
    if isinstance(obj, dict):
        obj = unsealed(obj, LINE_KEY, str(where), checked)
    if not isinstance(obj, dict) or not isinstance(obj.get("seq", 0), int) or isinstance(obj.get("seq"), bool) \
            or not isinstance(obj.get("error"), str):
        raise FormatError(f"{where}: not an error record: {str(obj)[:200]}")
    rec = records.Record.from_json(obj, file=str(where))
    rec.extra.setdefault("seq", 0)
    return rec


def encoder_of(header: dict) -> dict:
    """The encoder's description (`Encoder.describe()`'s keys) in a folder's header, as records carry it."""
    folder_only = {"format", "format_version", "bivit_version", "model", "model_name", "is_demo", "created"}
    return {"model": header.get("model_name"), "demo": header.get("is_demo"),
            **{k: v for k, v in header.items() if k not in folder_only}}


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Complete lines of a JSONL file and the byte length they cover (a trailing partial line is left out);
    FormatError naming the file above `MAX_LINES_BYTES`, or a line above `MAX_LINE_BYTES`."""
    out, end = [], 0
    try:
        with open_regular(path) as f:  # a FIFO or device is refused without blocking
            size = os.fstat(f.fileno()).st_size
            if size > MAX_LINES_BYTES:
                raise FormatError(f"{path}: {size} bytes, more than the {MAX_LINES_BYTES} bivit reads of it")
            for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(line) > MAX_LINE_BYTES:
                    raise FormatError(f"{path}:{lineno}: a line of more than the {MAX_LINE_BYTES} bytes bivit reads")
                if not line.endswith(b"\n"):
                    break
                end += len(line)
                if end > MAX_LINES_BYTES:  # grown since
                    raise FormatError(f"{path}: more than the {MAX_LINES_BYTES} bytes bivit reads of it")
                if not line.strip():
                    continue
                try:
                    out.append(parse_json(line))
                except ValueError as e:  # not JSON, nested too deep, a repeated key
                    raise FormatError(f"{path}:{lineno}: corrupt line ({getattr(e, 'msg', e)})") from None
    except FileNotFoundError:
        return [], 0
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror or e})") from None
    return out, end


def read_header(directory: Path) -> Optional[dict]:
    """The folder's dataset.json (without its checksum, checked), or None when there is none; FormatError when
    it is not bivit's, is damaged or of a format version this bivit does not read."""
    path = directory / HEADER
    if not path.exists():
        return None
    try:
        header = parse_json(read_regular(path, MAX_HEADER_BYTES))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: unreadable dataset header ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise FormatError(f"{path}: not a bivit encoded dataset")
    version = header.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise FormatError(f"{path}: format_version {str(version)[:50]}, which this bivit does not read (it reads 1 "
                          f"to {FORMAT_VERSION}); a newer bivit wrote it, or the file is damaged")
    return unsealed(header, HEADER_KEY, str(path), version >= 2)


def checked(header: dict) -> bool:
    """Whether a folder's lines must carry their checksums (format_version 2 on)."""
    return header.get("format_version", 1) >= 2


def current_state(directory: Path, header: dict) -> tuple[dict[str, records.Record], dict[str, records.Record]]:
    """What each source is now: its latest manifest record, or its latest error if that came later.

    Returns (encoded sources -> record, failed sources -> record with `error`); a source is in exactly one.
    """
    return state_from_rows(read_jsonl(directory / MANIFEST)[0], read_jsonl(directory / ERRORS)[0], directory,
                           header)


def state_from_rows(manifest_rows: list[dict], error_rows: list[dict], directory: Path, header: dict
                    ) -> tuple[dict[str, records.Record], dict[str, records.Record]]:
    """`current_state` of rows already read (a writer opening a folder reads each file once)."""
    encoded: dict[str, records.Record] = {}
    for row in manifest_rows:
        rec = manifest_record(row, str(directory / MANIFEST), checked(header))
        encoded[rec.source] = rec
    errors: dict[str, records.Record] = {}
    for row in error_rows:
        err = error_record(row, str(directory / ERRORS), checked(header))
        errors[err.source] = err
    for source, err in list(errors.items()):
        rec = encoded.get(source)
        if rec is not None:
            if rec.seq >= err.seq:
                del errors[source]
            else:
                del encoded[source]  # failed since it was encoded: its old embedding is not its bytes any more
    return encoded, errors
