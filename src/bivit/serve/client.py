"""Python client of the encoder service (`bivit serve`).

    with bivit.Client("http://127.0.0.1:8000") as client:
        embeddings = client.encode(["cat.png", "clip.mp4"])   # list of [tokens, text_hidden] tensors

Inputs are sent so that the server sees exactly what offline `Encoder.encode` would read: paths as their file
bytes under their own file name (the extension decides image vs video, as offline), bytes as they are, PIL
images and HxWx3 uint8 arrays as lossless PNG of their RGB pixels. The answer is the server's safetensors body,
so the tensors arrive bit for bit, in the encoder's output dtype: an embedding file (`bivit.core.records`), whose
records (`bivit.Record`) the client returns.

Failed items: `encode` raises `EncodeError` if any item failed (its `.errors` maps input index -> the server's
message and its `.results` still holds the tensors of the items that succeeded, None for the failed ones);
`encode_results` never raises for item failures and returns one record per input instead.
Request-level failures (auth, size, overload, timeout, unreachable server) raise `ServerError`.

Importing the client loads neither torch nor PyAV (nor numpy, Pillow or httpx): httpx loads with the first
Client, torch with the first answer.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..core import records
from ..errors import BivitError, ErrorKind, MediaError

if TYPE_CHECKING:  # type hints only
    import httpx
    import torch
    from PIL import Image

# The status of an answer whose every item failed by the input's fault: its JSON lists each item's record.
ITEMS_FAILED = ErrorKind.MEDIA.status


class ServerError(BivitError):
    """The server refused or could not answer a request (status None: it could not be reached)."""

    def __init__(self, message: str, status: Optional[int] = None, kind: Optional[str] = None,
                 retry_after: Optional[float] = None):
        super().__init__(message)
        self.status, self.kind, self.retry_after = status, kind, retry_after


class EncodeError(BivitError):
    """One or more items failed on the server; the message lists them with the server's reasons."""

    def __init__(self, message: str, errors: dict[int, str], results: list[Optional["torch.Tensor"]]):
        super().__init__(message)
        self.errors = errors
        self.results = results


def _loaded(module: str, name: str) -> Optional[type]:
    """`module.name` if this process has imported `module`. An input of that type (a PIL image, a numpy array)
    can only exist once its module is loaded, so the client never imports Pillow or numpy for a caller that
    sends paths or bytes."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def _is(src: Any, module: str, name: str) -> bool:
    cls = _loaded(module, name)
    return cls is not None and isinstance(src, cls)


def _png(img: "Image.Image") -> bytes:
    """A lossless PNG of the image as the encoder would see it: transparency is kept (what happens to it is the
    server's --alpha mode, as offline it is the encoder's `alpha`); without any, the RGB conversion every mode
    gets first is done here."""
    buf = io.BytesIO()
    if "A" in img.getbands() or "transparency" in img.info:
        if img.mode not in ("RGBA", "LA", "P", "L", "RGB"):  # modes PNG stores with their transparency
            img = img.convert("RGBA")
    elif img.mode != "RGB":
        img = img.convert("RGB")
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _as_part(src: Any, i: int) -> tuple[str, bytes]:
    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if not path.is_file():
            raise MediaError(f"{path}: no such file")
        return path.name, path.read_bytes()
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"item{i}", bytes(src)
    if _is(src, "PIL.Image", "Image"):
        return f"item{i}.png", _png(src)
    if _is(src, "numpy", "ndarray"):
        from PIL import Image  # only for an array input: importing the client loads no Pillow (module docstring)

        if src.ndim != 3 or src.shape[2] != 3 or src.dtype.name != "uint8" or 0 in src.shape:
            raise MediaError(f"<input {i}>: numpy images must be HxWx3 uint8, got shape {src.shape} dtype {src.dtype}")
        return f"item{i}.png", _png(Image.fromarray(src.copy(order="C"), "RGB"))
    raise MediaError(f"<input {i}>: unsupported input type {type(src).__name__}; pass a path, bytes, a PIL.Image "
                     "or an HxWx3 uint8 array")


def parse_response(body: bytes) -> tuple[dict, list[records.Record]]:
    """Split an answer into (the encoder's description: model, fingerprint, dtypes, ...; one record per
    input, in order)."""
    try:
        answer = records.from_bytes(body, "response")
    except BivitError as e:
        raise ServerError(str(e)) from None
    return answer.encoder, list(answer)


class Client:
    """Synchronous client of one bivit server. Thread-safe (one connection pool shared by all threads)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: Optional[str] = None, timeout: float = 120.0):
        import httpx  # httpx (slow to import) loads with the first Client (module docstring)

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        import httpx  # loaded by __init__ already: this names its exceptions, as the module's head cannot

        try:
            r = self._http.request(method, path, **kw)
        except httpx.TimeoutException as e:
            raise ServerError(f"{self.url}{path}: no answer in time ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise ServerError(f"{self.url}{path}: cannot reach the server ({e})") from None
        if r.status_code >= 400 and r.status_code != ITEMS_FAILED:
            try:
                err = r.json()["error"]
                kind, message = err["kind"], err["message"]
            except (ValueError, KeyError, TypeError):
                kind, message = None, r.text[:500]
            retry = r.headers.get("retry-after")
            raise ServerError(f"{self.url}{path}: HTTP {r.status_code}: {message}", r.status_code, kind,
                              float(retry) if retry and retry.replace(".", "", 1).isdigit() else None)
        return r

    def encode_results(self, inputs: Sequence[Any]) -> list[records.Record]:
        """Encode; one record per input (its embedding, None if it failed, and its metadata: source, kind, sha256,
        tokens, grid_thw, chunk_tokens, timestamps, placeholders, error, error_kind; the service's `cached` in
        `.extra`). Never raises for items."""
        if isinstance(inputs, (str, os.PathLike, bytes)) or _is(inputs, "PIL.Image", "Image") \
                or _is(inputs, "numpy", "ndarray"):
            inputs = [inputs]
        parts = [_as_part(src, i) for i, src in enumerate(inputs)]
        if not parts:
            return []
        files = [("file", (name, data, "application/octet-stream")) for name, data in parts]
        r = self._request("POST", "/v1/encode", files=files)
        if r.status_code == ITEMS_FAILED:  # every item failed; the JSON body lists them
            return [records.Record.from_json(m) for m in r.json().get("items") or []]
        _, results = parse_response(r.content)
        if len(results) != len(parts):
            raise ServerError(f"server answered {len(results)} items for {len(parts)} inputs")
        return results

    def encode(self, inputs: Sequence[Any]) -> list["torch.Tensor"]:
        """One `[tokens, text_hidden]` tensor per input, bit-identical to offline `Encoder.encode`.

        Raises EncodeError (with the server's messages and the partial results) if any item failed.
        """
        results = self.encode_results(inputs)
        errors = {i: r.error for i, r in enumerate(results) if r.error is not None}
        if errors:
            listing = "; ".join(f"[{i}] {msg}" for i, msg in errors.items())
            raise EncodeError(f"{len(errors)} of {len(results)} items failed: {listing}", errors,
                              [r.embedding for r in results])
        return [r.embedding for r in results]  # type: ignore[misc]

    def update_weights(self, state_dict: Any) -> dict:
        """`POST /v1/weights`: replace every vision/projector weight of the server (a trainer's `state_dict()`, in
        the server's dtypes) -> `{"fingerprint", "previous_fingerprint", "tensors"}`. A refused update raises
        ServerError naming the key (the old weights keep serving)."""
        from safetensors.torch import save  # heavy (torch, by safetensors.torch): only for a weight update

        body = save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()})
        r = self._request("POST", "/v1/weights", content=body, headers={"Content-Type": "application/octet-stream"})
        if r.status_code == ErrorKind.BAD_WEIGHTS.status:
            raise ServerError(f"{self.url}/v1/weights: HTTP {r.status_code}: {r.json()['error']['message']}",
                              r.status_code, ErrorKind.BAD_WEIGHTS)
        return r.json()

    def health(self) -> dict:
        """GET /health (liveness; needs no API key)."""
        return self._request("GET", "/health").json()

    def ready(self) -> dict:
        """GET /ready: model loaded and batching worker alive (raises ServerError with status 503 if not)."""
        return self._request("GET", "/ready").json()
