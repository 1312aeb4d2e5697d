"""The wire format of `POST /v1/encode`, shared by the server and `bivit.client`.

Request: multipart `file` parts, or JSON `{"items": [{"data": "<base64>", "name": ..., "kind": ...}]}`.
Response (schema `RESPONSE_FORMAT`): a safetensors file whose tensors `"0"`, `"1"`, ... are the items'
embeddings by input index (none for a failed item) and whose header metadata holds `format`, `model`,
`fingerprint`, `dtype` and `items` (a JSON list of per-item metadata); or the same as JSON with each item's
`embedding` as nested float lists (`?format=json`). An error is `{"error": {"kind", "message"}, ...}`.

Imports neither torch nor PyAV: `bivit.client` stays light; torch loads when a body is (de)serialised.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..errors import BivitError
from ..fileio import parse_json
from ..kinds import media_kind

if TYPE_CHECKING:
    import torch

SAFETENSORS_MEDIA_TYPE = "application/vnd.bivit.safetensors"
RESPONSE_FORMAT = "bivit.response/1"


class RequestError(BivitError):
    """A request the service refuses: HTTP `status`, a machine-readable `kind`, extra response `headers`."""

    def __init__(self, status: int, kind: str, message: str, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


@dataclass
class UploadItem:
    """One uploaded item.

    It is a video when `bivit.kinds.media_kind` says so from its name or its first bytes (exactly how offline
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


@dataclass
class ItemResult:
    """One item of a response: its embedding (None if it failed) and its metadata."""

    name: str
    kind: str = "image"
    sha256: str = ""
    embedding: Optional["torch.Tensor"] = None
    grid_thw: list = field(default_factory=list)
    timestamps: Optional[list] = None
    placeholders: Optional[list] = None  # per image / chunk: {"text": prompt placeholder, "tokens": rows}
    ec_ids: Optional[list] = None  # per image / chunk: its id in vLLM's encoder cache (`bivit serve --ec-dir`)
    cached: bool = False
    error: Optional[str] = None
    error_kind: Optional[str] = None

    @property
    def tokens(self) -> int:
        return 0 if self.embedding is None else int(self.embedding.shape[0])


def parse_json_request(body: bytes) -> list[UploadItem]:
    """The items of a JSON request body; RequestError (400) when the body is not the documented shape.

    A key repeated in one object is refused (which one counts differs between parsers), and so is nesting
    deeper than `bivit.fileio.MAX_JSON_DEPTH`; base64 may be split into lines (MIME's 76 columns), any other
    non-alphabet character is an error.
    """
    try:
        doc = parse_json(body)
    except ValueError as e:  # UnicodeDecodeError included
        raise RequestError(400, "bad_request", f"invalid JSON body: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise RequestError(400, "bad_request", 'JSON body must be {"items": [{"data": "<base64>", "name": ...}]}')
    items = []
    for i, entry in enumerate(doc["items"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("data"), str):
            raise RequestError(400, "bad_request", f"items[{i}] must be an object with a base64 string 'data'")
        name = str(entry.get("name") or f"item{i}")
        kind = entry.get("kind")
        if kind not in (None, "image", "video"):
            raise RequestError(400, "bad_request", f"items[{i}].kind must be 'image' or 'video', got {kind!r}")
        try:
            data = base64.b64decode("".join(entry["data"].split()), validate=True)
        except (binascii.Error, ValueError) as e:
            items.append(UploadItem(name, None, error=f"invalid base64 ({e})"))
            continue
        items.append(UploadItem(name, data, video_hint=kind == "video", image_hint=kind == "image"))
    return items


def item_meta(i: int, r: ItemResult) -> dict:
    return {"index": i, "name": r.name, "kind": r.kind, "sha256": r.sha256,
            "tensor": str(i) if r.embedding is not None else None,
            "tokens": r.tokens, "grid_thw": r.grid_thw, "timestamps": r.timestamps,
            "placeholders": r.placeholders, "ec_ids": r.ec_ids, "cached": r.cached,
            "error": r.error, "error_kind": r.error_kind}


def result_from_meta(m: dict, embedding: Optional["torch.Tensor"] = None) -> ItemResult:
    return ItemResult(name=m["name"], kind=m["kind"], sha256=m["sha256"], embedding=embedding,
                      grid_thw=m.get("grid_thw") or [], timestamps=m.get("timestamps"),
                      placeholders=m.get("placeholders"), ec_ids=m.get("ec_ids"), cached=bool(m.get("cached")),
                      error=m.get("error"), error_kind=m.get("error_kind"))


def error_body(kind: str, message: str, **extra: Any) -> dict:
    return {"error": {"kind": kind, "message": message}, **extra}


def encode_json(header: dict, results: list[ItemResult]) -> bytes:
    metas = [item_meta(i, r) for i, r in enumerate(results)]
    for m, r in zip(metas, results):
        # Python floats print the shortest repr that round-trips: float32 (and bfloat16) values come back
        # exactly when the client casts the numbers to the response's `dtype`.
        m["embedding"] = None if r.embedding is None else r.embedding.float().tolist()
    return json.dumps({**header, "items": metas}, separators=(",", ":"), allow_nan=False).encode()


def encode_safetensors(header: dict, results: list[ItemResult]) -> bytes:
    from safetensors.torch import save

    tensors, seen = {}, set()
    for i, r in enumerate(results):
        if r.embedding is not None:
            # The same bytes twice in a request share one tensor; safetensors refuses shared storage.
            ptr = r.embedding.untyped_storage().data_ptr()
            tensors[str(i)] = r.embedding.clone() if ptr in seen else r.embedding
            seen.add(ptr)
    return save(tensors, metadata={**header, "items": json.dumps([item_meta(i, r) for i, r in enumerate(results)])})


def decode_safetensors(body: bytes) -> tuple[dict, list[ItemResult]]:
    """Split a safetensors response body into (header metadata, one ItemResult per input)."""
    from safetensors.torch import load

    if len(body) < 8:
        raise BivitError(f"response of {len(body)} bytes is not a safetensors file")
    (n,) = struct.unpack("<Q", body[:8])
    try:
        meta = dict(json.loads(body[8:8 + n]).get("__metadata__") or {})
        items = json.loads(meta.pop("items"))
    except (ValueError, KeyError) as e:
        raise BivitError(f"response header is not bivit's ({e})") from None
    tensors = load(body)
    return meta, [result_from_meta(m, tensors.get(m["tensor"]) if m.get("tensor") is not None else None)
                  for m in items]
