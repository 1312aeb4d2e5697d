"""The wire format of `POST /v1/encode`: reading a request's items, writing its answer or an error.

Request: multipart `file` parts, or JSON `{"items": [{"data": "<base64>", "name": ..., "kind": ...}]}`.
Response: an embedding file (`bivit.core.records`, format bivit.embeddings/1: `format`, `encoder`, `items` in its
header metadata, tensor "i" for input i that has an embedding), the same file `bivit encode` writes and
`bivit.load_embeddings` reads; or the same as JSON with each item's `embedding` as nested float lists
(`?format=json`). A record carries its `error_kind` when it failed, the service's own `cached` (and `ec_ids`
with --ec-dir). An error is `{"error": {"kind", "message"}, ...}`, its kind and status from
`bivit.errors.ErrorKind`.

Imports neither torch nor PyAV: `bivit.serve.client` stays light; torch loads when a body is (de)serialised.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ..base.fileio import TooManyElements, parse_json
from ..core import records
from ..errors import ErrorKind, RequestError
from ..media.kinds import media_kind
from ..media.names import label, shown, stored, too_long

SAFETENSORS_MEDIA_TYPE = "application/vnd.bivit.safetensors"


@dataclass
class UploadItem:
    """One uploaded item.

    It is a video when `bivit.media.kinds.media_kind` says so from its name or its first bytes (exactly how offline
    encoding decides for a path, `.gif` included), or when the client says so (part Content-Type `video/*`,
    JSON `"kind": "video"`); JSON `"kind": "image"` forces the image path. Otherwise an image.
    """

    name: str
    data: Optional[bytes]
    video_hint: bool = False
    image_hint: bool = False
    error: Optional[str] = None  # why the item could not even be extracted (bad base64), without its name

    @property
    def kind(self) -> str:
        if self.image_hint:
            return "image"
        if self.video_hint or media_kind(self.name, self.data) == "video":
            return "video"
        return "image"


# JSON elements one item takes: its object, the keys "data", "name", "kind" and their values, and one to spare.
ITEM_ELEMENTS = 8


def upload_name(raw: Optional[str], i: int) -> tuple[str, Optional[str]]:
    """An upload's name as its record stores it (`bivit.media.names.stored`: lone surrogates escaped; `item{i}` when
    it has none), and why the item is refused (a name longer than `bivit.media.names.MAX_NAME_BYTES`: its record then
    holds the name's start and length), or None."""
    if not raw:
        return f"item{i}", None
    refused = too_long(raw)
    return (label(raw), refused) if refused else (stored(raw), None)


def too_many_items(n: object, max_items: int) -> RequestError:
    return ErrorKind.TOO_MANY_ITEMS.error(f"request has {n} items, more than --max-queue {max_items} "
                        "(every copy and every failed item counted); split it")


def parse_json_request(body: bytes | bytearray, max_items: int) -> list[UploadItem]:
    """The items of a JSON request body; RequestError (400) when the body is not the documented shape, 413 when
    it holds more JSON elements than `max_items` items need (counted before parsing: nothing is built).

    A key repeated in one object is refused (which one counts differs between parsers), and so is nesting
    deeper than `bivit.base.fileio.MAX_JSON_DEPTH`; base64 may be split into lines (MIME's 76 columns), any other
    non-alphabet character is an error.
    """
    most = ITEM_ELEMENTS * max_items + 64
    try:
        doc = parse_json(body, max_elements=most)  # counted before anything is built
    except TooManyElements:
        raise ErrorKind.TOO_MANY_ITEMS.error(f"request body holds more than {most} JSON elements (arrays, "
                           f"objects, strings, numbers, literals), more than --max-queue {max_items} items need; "
                           "split it") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise ErrorKind.BAD_REQUEST.error(f"invalid JSON body: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ErrorKind.BAD_REQUEST.error('JSON body must be {"items": [{"data": "<base64>", "name": ...}]}')
    if len(doc["items"]) > max_items:
        raise too_many_items(len(doc["items"]), max_items)
    items = []
    for i, entry in enumerate(doc["items"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("data"), str):
            raise ErrorKind.BAD_REQUEST.error(f"items[{i}] must be an object with a base64 string 'data'")
        raw = entry.get("name")
        if raw is not None and not isinstance(raw, str):
            raise ErrorKind.BAD_REQUEST.error(f"items[{i}].name must be a string, got a {type(raw).__name__}")
        name, refused = upload_name(raw, i)
        kind = entry.get("kind")
        if kind not in (None, "image", "video"):
            raise ErrorKind.BAD_REQUEST.error(f"items[{i}].kind must be 'image' or 'video', got "
                                              f"{shown(repr(kind), 100)}")
        if refused:
            items.append(UploadItem(name, None, error=refused))
            continue
        try:
            data = base64.b64decode("".join(entry["data"].split()), validate=True)
        except (binascii.Error, ValueError) as e:
            items.append(UploadItem(name, None, error=f"invalid base64 ({e})"))
            continue
        items.append(UploadItem(name, data, video_hint=kind == "video", image_hint=kind == "image"))
    return items


def error_body(kind: ErrorKind, message: str, **extra: Any) -> dict:
    """An error answer's JSON: `{"error": {"kind", "message"}, ...}`."""
    return {"error": {"kind": kind, "message": message}, **extra}


def answer(info: dict, recs: list[records.Record], as_json: bool = False) -> tuple[Optional[int], Iterator[bytes]]:
    """The answer to a request, `info` being the encoder's description (`Encoder.describe()`) at the weights that
    computed them, in pieces made as they are asked for: an embedding file of its records (its length known,
    `records.file_pieces`), or the same as JSON (`json_chunks`; its length not known)."""
    embeddings = [r.embedding for r in recs]
    if as_json:
        return None, json_chunks(info, recs, embeddings)
    return records.file_pieces(info, recs, embeddings)


def failed_answer(info: dict, recs: list[records.Record]) -> bytes:
    """The JSON answer when every item failed: the first reasons in the message, every record in `items`."""
    failed = [r for r in recs if r.error is not None]
    shown = "; ".join(str(r.error) for r in failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
    body = error_body(failed[0].error_kind or ErrorKind.INTERNAL, "every item failed: " + shown, format=records.FORMAT,
                      encoder=info, items=[r.to_json() for r in recs])
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def json_chunks(encoder: dict, recs: list[records.Record], embeddings: list, size: int = 2**20) -> Iterator[bytes]:
    """The JSON answer (`?format=json`: `{"format", "encoder", "items"}`, each record with `embedding` as nested
    float lists; Python floats print the shortest repr that round-trips, so float32 and bfloat16 values come back
    exactly when cast to the encoder's output dtype) in pieces of about `size` bytes, each made when asked for, a
    few rows at a time (a 145 MB answer made by one `json.dumps` call held the interpreter lock for 12 s, and its
    floats 1 GB)."""
    pending: list[str] = []
    held = 0
    for piece in _json_pieces(encoder, recs, embeddings):
        pending.append(piece)
        held += len(piece)
        if held >= size:
            yield "".join(pending).encode()
            pending, held = [], 0
    yield "".join(pending).encode()


def _json_pieces(encoder: dict, recs: list[records.Record], embeddings: list) -> Iterator[str]:
    def dumps(obj: Any) -> str:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)

    yield dumps({"format": records.FORMAT, "encoder": dict(encoder)})[:-1] + ',"items":['
    for k, (r, e) in enumerate(zip(recs, embeddings)):
        yield ("," if k else "") + dumps(r.to_json())[:-1] + ',"embedding":'
        if e is None:
            yield "null}"
            continue
        rows = e.float()
        if not bool(rows.isfinite().all()):
            raise ValueError(f"{r.source}: an embedding holds NaN or Inf, which JSON cannot hold")
        yield "["
        step = max(1, 16384 // max(1, rows.shape[1]))  # rows made into floats at a time: ~16k values
        for start in range(0, rows.shape[0], step):
            yield ("" if start == 0 else ",") + ",".join(
                "[" + ",".join(map(float.__repr__, row)) + "]" for row in rows[start:start + step].tolist())
        yield "]}"
    yield "]}"
