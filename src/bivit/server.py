"""The encoder service: an HTTP API whose answers are bit-identical to offline encoding.

Layout of one request through `POST /v1/encode`:

1. The event loop reads the body (bounded by `max_body_mb`), splits it into items (multipart `file` parts or
   JSON base64 items), hashes each item and looks it up in the embedding cache.
2. Cache misses are admitted against `max_queue` (else 429 + Retry-After) and preprocessed in a thread pool,
   so decoding and resizing never block the event loop.
3. Each preprocessed item (each chunk, for a video) goes into one queue. A single worker thread owns the
   Encoder (it is not re-entrant) and coalesces queued items from all concurrent requests into
   `encoder.encode_batch(MediaBatch.concat(items))` calls, bounded by a patch budget and a max wait.
4. The request assembles its items' embeddings in input order and answers with a safetensors body
   (or JSON with `?format=json`).

Why coalescing is allowed to change nothing: with `batch_invariant=True` (the default) an item's embedding is
bit-identical whatever other items share the forward pass, so a response equals offline
`encoder.encode([same input])` alone. The exact cache relies on the same property: an embedding computed in
one batch is the embedding any other batch would have produced, so serving it again is exact. With
`--no-batch-invariant` the cache is switched off, because a cached answer could then differ from a fresh one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
from safetensors.torch import save as save_safetensors

from .errors import BivitError, MediaError
from .media import MediaBatch
from .video import is_video_path

try:  # The service needs the `serve` extra; say so in one line instead of a bare ImportError.
    import typer
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from starlette.requests import ClientDisconnect
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"bivit.server needs the 'serve' extra: pip install 'bivit[serve]' ({_e})") from None

SAFETENSORS_MEDIA_TYPE = "application/vnd.bivit.safetensors"
RESPONSE_FORMAT = "bivit.encode/1"
log = logging.getLogger("bivit.server")

# Container signatures that mean "video" (ISO BMFF brands that are still images are excluded below).
_STILL_IMAGE_BRANDS = {b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"}


@dataclass
class ServerSettings:
    """Operational limits of the service (the `bivit serve` options)."""

    api_key: Optional[str] = None
    max_batch_tokens: int = 16384  # patches per forward pass; an item larger than this runs alone
    max_wait_ms: float = 5.0  # how long the worker waits for more items once one is queued
    max_queue: int = 256  # items admitted and not yet answered, over all requests
    max_body_mb: float = 64.0
    request_timeout_s: float = 120.0
    cache_mb: float = 256.0
    preprocess_threads: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    retry_after_s: int = 1


class _HTTPError(Exception):
    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


# ----------------------------------------------------------------------------------------------- metrics


class _Metrics:
    """Prometheus series of one app; a registry per app so several apps can live in one process (tests)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("bivit_queue_depth", "Items waiting for the batching worker", registry=r)
        self.inflight_items = Gauge("bivit_inflight_items", "Items admitted and not yet answered", registry=r)
        self.batch_items = Histogram("bivit_batch_items", "Items per forward pass", registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.batch_patches = Histogram("bivit_batch_patches", "Patches per forward pass", registry=r,
                                       buckets=tuple(4 ** i for i in range(1, 9)))
        self.batch_seconds = Histogram("bivit_batch_seconds", "Duration of one encode_batch call", registry=r)
        self.latency = Histogram("bivit_request_latency_seconds", "Latency of POST /v1/encode", registry=r,
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.requests = Counter("bivit_requests_total", "Encode requests by HTTP status", ["status"], registry=r)
        self.tokens = Counter("bivit_tokens_total", "Tokens computed by the encoder (cache hits excluded)",
                              registry=r)
        self.items = Counter("bivit_items_total", "Items answered, by outcome", ["outcome"], registry=r)
        self.cache_hits = Counter("bivit_cache_hits_total", "Embedding cache hits", registry=r)
        self.cache_misses = Counter("bivit_cache_misses_total", "Embedding cache misses", registry=r)
        self.cache_bytes = Gauge("bivit_cache_bytes", "Bytes held by the embedding cache", registry=r)
        self.errors = Counter("bivit_errors_total", "Errors by kind (request- and item-level)", ["kind"],
                              registry=r)


# ------------------------------------------------------------------------------------------------ cache


@dataclass
class _Result:
    """One answered item: an embedding and its metadata, or an error."""

    name: str
    kind: str = "image"
    sha256: str = ""
    embedding: Optional[torch.Tensor] = None
    grid_thw: list[list[int]] = field(default_factory=list)
    timestamps: Optional[list[str]] = None
    cached: bool = False
    error: Optional[str] = None
    error_kind: Optional[str] = None

    @property
    def tokens(self) -> int:
        return 0 if self.embedding is None else int(self.embedding.shape[0])


class EmbeddingCache:
    """Exact LRU cache of embeddings, bounded by bytes.

    Keyed by (encoder fingerprint, item kind, sha256 of the item bytes). Serving a hit is exact only because the
    encoder is batch invariant: the cached bits are the bits any batch would produce for those bytes.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._data: collections.OrderedDict[tuple, _Result] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size(r: _Result) -> int:
        return (r.embedding.numel() * r.embedding.element_size() if r.embedding is not None else 0) + 256

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: tuple) -> Optional[_Result]:
        with self._lock:
            r = self._data.get(key)
            if r is not None:
                self._data.move_to_end(key)
            return r

    def put(self, key: tuple, r: _Result) -> None:
        size = self._size(r)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= self._size(old)
            self._data[key] = r
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._data.popitem(last=False)
                self._bytes -= self._size(evicted)


# ---------------------------------------------------------------------------------------------- batcher


@dataclass
class _Job:
    item: MediaBatch  # exactly one item (an image, or one video chunk)
    patches: int
    future: concurrent.futures.Future
    enqueued: float


class Batcher:
    """One worker thread that owns the Encoder and coalesces queued items into forward passes.

    A batch closes when the next queued item would push it past `max_patches`, or `max_wait_s` after its oldest
    item was queued, whichever comes first. Items are taken in arrival order. An item larger than the budget runs
    alone. If a coalesced call raises, its items are retried one by one so that one bad item fails only itself.
    """

    def __init__(self, encoder: Any, max_patches: int, max_wait_s: float, metrics: _Metrics):
        self._encoder = encoder
        self._max_patches = max(1, int(max_patches))
        self._max_wait = max(0.0, float(max_wait_s))
        self._metrics = metrics
        self._queue: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bivit-batcher", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, item: MediaBatch) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the batching worker is stopping")
            self._queue.append(_Job(item, sum(item.patch_counts), fut, time.monotonic()))
            self._metrics.queue_depth.set(len(self._queue))
            self._cv.notify()
        return fut

    def stop(self, timeout: Optional[float] = None) -> None:
        """Finish every queued item, then end the worker."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            jobs = self._next_batch()
            if jobs is None:
                return
            if jobs:
                self._encode(jobs)

    def _next_batch(self) -> Optional[list[_Job]]:
        with self._cv:
            while not self._queue:
                if self._stopping:
                    return None
                self._cv.wait()
            jobs: list[_Job] = []
            patches = 0
            deadline = self._queue[0].enqueued + self._max_wait
            while True:
                while self._queue:
                    job = self._queue[0]
                    if jobs and patches + job.patches > self._max_patches:
                        self._metrics.queue_depth.set(len(self._queue))
                        return jobs
                    self._queue.popleft()
                    # False when the request already gave up (timeout): do not spend a forward pass on it.
                    if job.future.set_running_or_notify_cancel():
                        jobs.append(job)
                        patches += job.patches
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopping or patches >= self._max_patches:
                    break
                self._cv.wait(remaining)
            self._metrics.queue_depth.set(len(self._queue))
            return jobs

    def _encode(self, jobs: list[_Job]) -> None:
        batch = MediaBatch.concat([j.item for j in jobs])
        t0 = time.perf_counter()
        try:
            outs = self._encoder.encode_batch(batch)
        except Exception as e:  # noqa: BLE001 - the worker must survive anything one batch does
            if len(jobs) > 1:
                for j in jobs:  # isolate the culprit; the others still get their (identical) answers
                    self._encode([j])
            else:
                jobs[0].future.set_exception(e)
            return
        self._metrics.batch_seconds.observe(time.perf_counter() - t0)
        self._metrics.batch_items.observe(len(jobs))
        self._metrics.batch_patches.observe(sum(j.patches for j in jobs))
        self._metrics.tokens.inc(sum(int(o.shape[0]) for o in outs))
        for j, o in zip(jobs, outs):
            # A private host copy: outputs may be views of one buffer (safetensors refuses shared storage, and
            # the cache must not pin a whole batch), and responses and the cache live in host memory.
            o = o.detach()
            j.future.set_result(o.cpu().contiguous() if o.device.type != "cpu" else o.contiguous().clone())


# ---------------------------------------------------------------------------------------------- helpers


def _sniff_video(data: bytes) -> bool:
    """True when the bytes start like a video container (decided from the bytes, so it is cache-safe)."""
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return data[8:12] not in _STILL_IMAGE_BRANDS
    return (data[:4] == b"\x1a\x45\xdf\xa3"  # Matroska / WebM
            or (data[:4] == b"RIFF" and data[8:12] == b"AVI ")
            or data[:3] == b"FLV"
            or data[:4] == b"\x00\x00\x01\xba"  # MPEG program stream
            or (len(data) > 376 and data[0] == data[188] == data[376] == 0x47))  # MPEG transport stream


@dataclass
class _Item:
    """One uploaded item.

    It is a video when its name has a video extension (exactly how offline `Encoder.encode` decides for a
    path, `.gif` included), when the client says so (part Content-Type `video/*`, JSON `"kind": "video"`), or
    when its bytes start like a video container (which Pillow could not read anyway). Otherwise an image.
    """

    name: str
    data: Optional[bytes]
    video_hint: bool = False
    image_hint: bool = False  # JSON "kind": "image" forces the image path
    error: Optional[str] = None  # set when the item could not even be extracted (bad base64)

    @property
    def kind(self) -> str:
        if self.image_hint:
            return "image"
        if self.video_hint or is_video_path(self.name) or (self.data is not None and _sniff_video(self.data)):
            return "video"
        return "image"


def _bearer_ok(header: Optional[str], key: str) -> bool:
    if not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), key.encode())


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: machine-readable logs for the request log and uvicorn's own messages."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = "".join(traceback.format_exception(*record.exc_info))
        return json.dumps(out, default=str)


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # `bivit` CLI quiets the library logger; the service's own logs (one line per request) must still show.
    logging.getLogger("bivit.server").setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def _check_content_type(request: Request) -> str:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in ("multipart/form-data", "application/json"):
        raise _HTTPError(415, "unsupported_media_type",
                         f"Content-Type {ctype or '(none)'!r} is not accepted; send multipart/form-data with "
                         "'file' parts or application/json {\"items\": [{\"data\": <base64>}]}")
    return ctype


def _error_body(kind: str, message: str, **extra: Any) -> dict:
    return {"error": {"kind": kind, "message": message}, **extra}


# ------------------------------------------------------------------------------------------------- app


class _Service:
    """State shared by the routes of one app: encoder, batcher, cache, metrics, admission counter."""

    def __init__(self, encoder: Any, settings: ServerSettings):
        self.encoder = encoder
        self.settings = settings
        self.metrics = _Metrics()
        invariant = bool(getattr(encoder, "batch_invariant", True))
        # Without batch invariance a cached embedding may differ from a fresh one, so no cache at all.
        self.cache = EmbeddingCache(int(settings.cache_mb * 2**20) if invariant else 0)
        self.batcher = Batcher(encoder, settings.max_batch_tokens, settings.max_wait_ms / 1000.0, self.metrics)
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.inflight = 0  # items admitted and not yet answered; touched only on the event loop
        self.draining = False
        self.dtype = str(getattr(encoder, "output_dtype", torch.float32)).removeprefix("torch.")
        # Hashes every weight: do it once here, never on the event loop during a request.
        self.fingerprint = str(getattr(encoder, "fingerprint", ""))

    # -- lifecycle
    def start(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(self.settings.preprocess_threads,
                                                          thread_name_prefix="bivit-preprocess")
        self.batcher.start()

    def stop(self) -> None:
        self.draining = True
        self.batcher.stop()
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # -- request parsing
    async def read_body(self, request: Request) -> bytes:
        limit = int(self.settings.max_body_mb * 2**20)
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise _HTTPError(400, "bad_request", f"invalid Content-Length {declared!r}") from None
            if n > limit:
                await self._discard_body(request, n)
                raise _HTTPError(413, "too_large", f"request body of {n} bytes exceeds --max-body-mb "
                                 f"{self.settings.max_body_mb:g} ({limit} bytes)")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:  # a chunked or lying body: stop at the limit, never hold more than it
                    await self._discard_body(request, limit)
                    raise _HTTPError(413, "too_large", f"request body exceeds --max-body-mb "
                                     f"{self.settings.max_body_mb:g} ({limit} bytes)")
                chunks.append(chunk)
        except ClientDisconnect:
            raise _HTTPError(400, "bad_request", "client disconnected while sending the body") from None
        return b"".join(chunks)

    async def _discard_body(self, request: Request, up_to: int) -> None:
        # Read and drop (a bounded amount of) the rest of the body before answering 413: closing a socket with
        # unread data sends a TCP reset, and the client would see "connection reset" instead of the 413.
        # A client that sent `Expect: 100-continue` has not sent the body; reading would invite it to.
        if "100-continue" in request.headers.get("expect", "").lower():
            return
        budget = min(up_to, int(self.settings.max_body_mb * 2**20) + 64 * 2**20)
        deadline = time.monotonic() + 5.0
        seen = 0
        with contextlib.suppress(Exception):
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > budget or time.monotonic() > deadline:
                    return

    async def parse_items(self, request: Request, body: bytes) -> list[_Item]:
        if _check_content_type(request) == "multipart/form-data":
            return await self._parse_multipart(request, body)
        return self._parse_json(body)

    async def _parse_multipart(self, request: Request, body: bytes) -> list[_Item]:
        sent = False

        async def replay() -> dict:  # feed the already-bounded body to Starlette's multipart parser
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(request.scope, replay).form(max_files=self.settings.max_queue + 1)
        except Exception as e:  # noqa: BLE001 - malformed multipart in any of the parser's ways
            raise _HTTPError(400, "bad_request", f"malformed multipart body: {getattr(e, 'detail', None) or e}") \
                from None
        items = []
        try:
            for key, value in form.multi_items():
                if key != "file":
                    raise _HTTPError(400, "bad_request", f"unexpected form field {key!r}; send each image or "
                                     "video as a file part named 'file'")
                if isinstance(value, str):
                    raise _HTTPError(400, "bad_request", "form field 'file' must be a file part (curl -F file=@path)")
                data = await value.read()
                name = value.filename or f"item{len(items)}"
                items.append(_Item(name, data, (value.content_type or "").lower().startswith("video/")))
        finally:
            await form.close()
        return items

    def _parse_json(self, body: bytes) -> list[_Item]:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise _HTTPError(400, "bad_request", f"invalid JSON body: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
            raise _HTTPError(400, "bad_request", 'JSON body must be {"items": [{"data": "<base64>", "name": ...}]}')
        items = []
        for i, entry in enumerate(doc["items"]):
            if not isinstance(entry, dict) or not isinstance(entry.get("data"), str):
                raise _HTTPError(400, "bad_request", f"items[{i}] must be an object with a base64 string 'data'")
            name = str(entry.get("name") or f"item{i}")
            kind = entry.get("kind")
            if kind not in (None, "image", "video"):
                raise _HTTPError(400, "bad_request", f"items[{i}].kind must be 'image' or 'video', got {kind!r}")
            try:
                data = base64.b64decode(entry["data"], validate=True)
            except (binascii.Error, ValueError) as e:
                items.append(_Item(name, None, error=f"{name}: invalid base64 ({e})"))
                continue
            items.append(_Item(name, data, video_hint=kind == "video", image_hint=kind == "image"))
        return items

    # -- encoding
    def _preprocess(self, item: _Item) -> MediaBatch:
        """Runs in the thread pool: bytes -> MediaBatch (one item per image, one per video chunk)."""
        if item.kind == "image":
            batch = self.encoder.preprocess([item.data])
            batch.sources = [item.name]
            return batch
        # The video decoder wants a path.
        suffix = Path(item.name).suffix if is_video_path(item.name) else ".bin"
        fd, path = tempfile.mkstemp(prefix="bivit-upload-", suffix=suffix)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(item.data)
            try:
                return self.encoder.preprocess_video(path)
            except MediaError as e:  # name the upload, not the temp file
                raise MediaError(str(e).replace(path, item.name)) from None
        finally:
            os.unlink(path)

    async def encode_item(self, item: _Item, key: tuple) -> _Result:
        res = _Result(item.name, item.kind, key[2])
        loop = asyncio.get_running_loop()
        try:
            batch = await loop.run_in_executor(self.pool, self._preprocess, item)
        except MediaError as e:
            # bivit.media names a bytes input "<N bytes>"; name the upload instead.
            msg, anon = str(e), f"<{len(item.data or b'')} bytes>"
            res.error = item.name + msg[len(anon):] if msg.startswith(anon) else msg
            res.error_kind = "media"
            return res
        except BivitError as e:
            res.error, res.error_kind = str(e), "invalid"
            return res
        if len(batch) == 0:
            res.error, res.error_kind = f"{item.name}: no frames to encode", "media"
            return res
        futures = [asyncio.wrap_future(self.batcher.submit(batch.item(c))) for c in range(len(batch))]
        try:
            outs = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for f in futures:  # the request timed out: drop its items that have not started
                f.cancel()
            raise
        except BivitError as e:
            res.error, res.error_kind = f"{item.name}: {e}", "invalid"
            return res
        except Exception as e:  # noqa: BLE001 - a failing forward pass fails this item only
            log.error("encode failed", exc_info=e, extra={"fields": {"item": item.name}})
            res.error, res.error_kind = f"{item.name}: encoding failed ({type(e).__name__}: {e})", "internal"
            return res
        res.embedding = outs[0] if len(outs) == 1 else torch.cat(outs)
        res.grid_thw = batch.grid_thw.tolist()
        res.timestamps = list(batch.timestamps) if batch.timestamps is not None else None
        return res

    async def encode_request(self, items: list[_Item]) -> list[_Result]:
        results: list[Optional[_Result]] = [None] * len(items)
        todo: list[tuple[int, tuple]] = []
        fp = self.fingerprint
        for i, it in enumerate(items):
            if it.data is None:
                results[i] = _Result(it.name, error=it.error, error_kind="bad_item")
                continue
            key = (fp, it.kind, hashlib.sha256(it.data).hexdigest())
            hit = self.cache.get(key) if self.cache.max_bytes else None
            if hit is not None:
                self.metrics.cache_hits.inc()
                results[i] = _Result(it.name, hit.kind, hit.sha256, hit.embedding, hit.grid_thw, hit.timestamps,
                                     cached=True)
            else:
                if self.cache.max_bytes:
                    self.metrics.cache_misses.inc()
                todo.append((i, key))
        if todo:
            # Identical items of one request are encoded once (exact: same bytes, same encoder, same bits).
            unique: dict[tuple, int] = {}
            for i, key in todo:
                unique.setdefault(key, i)
            n = len(unique)
            if n > self.settings.max_queue:
                raise _HTTPError(413, "too_many_items", f"request has {n} items to encode, more than --max-queue "
                                 f"{self.settings.max_queue}; split it")
            if self.inflight + n > self.settings.max_queue:
                raise _HTTPError(429, "queue_full", f"server busy: {self.inflight} items in flight, --max-queue "
                                 f"{self.settings.max_queue}; retry later",
                                 {"Retry-After": str(self.settings.retry_after_s)})
            self.inflight += n
            self.metrics.inflight_items.set(self.inflight)
            try:
                fresh = await asyncio.wait_for(
                    asyncio.gather(*(self.encode_item(items[i], key) for key, i in unique.items())),
                    self.settings.request_timeout_s)
            except asyncio.TimeoutError:
                raise _HTTPError(504, "timeout", f"request not answered within --request-timeout-s "
                                 f"{self.settings.request_timeout_s:g}") from None
            finally:
                self.inflight -= n
                self.metrics.inflight_items.set(self.inflight)
            by_key = dict(zip(unique, fresh))
            for key, r in by_key.items():
                if r.embedding is not None and self.cache.max_bytes:
                    self.cache.put(key, r)
            for i, key in todo:
                results[i] = replace(by_key[key], name=items[i].name)
            self.metrics.cache_bytes.set(self.cache.nbytes)
        return results  # type: ignore[return-value]

    # -- responses
    def item_meta(self, i: int, r: _Result) -> dict:
        return {"index": i, "name": r.name, "kind": r.kind, "sha256": r.sha256,
                "tensor": str(i) if r.embedding is not None else None,
                "tokens": r.tokens, "grid_thw": r.grid_thw, "timestamps": r.timestamps, "cached": r.cached,
                "error": r.error, "error_kind": r.error_kind}

    def header_meta(self) -> dict:
        return {"format": RESPONSE_FORMAT, "model": str(getattr(self.encoder, "model_name", "")),
                "fingerprint": self.fingerprint, "dtype": self.dtype}


def _render_json(header: dict, metas: list[dict], results: list[_Result]) -> bytes:
    for m, r in zip(metas, results):
        # Python floats print the shortest repr that round-trips: float32 (and bfloat16) values come back
        # exactly when the client casts the numbers to the response's `dtype`.
        m["embedding"] = None if r.embedding is None else r.embedding.float().tolist()
    return json.dumps({**header, "items": metas}, separators=(",", ":"), allow_nan=False).encode()


def _render_safetensors(header: dict, metas: list[dict], results: list[_Result]) -> bytes:
    tensors, seen = {}, set()
    for i, r in enumerate(results):
        if r.embedding is not None:
            # The same bytes twice in a request share one tensor; safetensors refuses shared storage.
            ptr = r.embedding.untyped_storage().data_ptr()
            tensors[str(i)] = r.embedding.clone() if ptr in seen else r.embedding
            seen.add(ptr)
    return save_safetensors(tensors, metadata={**header, "items": json.dumps(metas)})


def create_app(encoder: Any, settings: Optional[ServerSettings] = None) -> FastAPI:
    """The service around a loaded Encoder. The app starts its worker on startup and drains it on shutdown."""
    settings = settings or ServerSettings()
    svc = _Service(encoder, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        log.info("ready", extra={"fields": {**svc.header_meta(), "max_batch_tokens": settings.max_batch_tokens,
                                            "max_queue": settings.max_queue,
                                            "cache_mb": settings.cache_mb if svc.cache.max_bytes else 0}})
        try:
            yield
        finally:
            # uvicorn calls this only after in-flight requests finished (graceful shutdown), so the queue is
            # normally empty; stop() still finishes anything queued before the worker ends.
            await asyncio.get_running_loop().run_in_executor(None, svc.stop)
            log.info("stopped")

    app = FastAPI(title="bivit encoder", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = svc

    @app.exception_handler(_HTTPError)
    async def _http_error(request: Request, exc: _HTTPError) -> JSONResponse:
        svc.metrics.errors.labels(exc.kind).inc()
        request.state.error = exc.message
        return JSONResponse(_error_body(exc.kind, exc.message), exc.status, headers=exc.headers)

    @app.middleware("http")
    async def _frame(request: Request, call_next):
        # Request id, auth, structured request log. Auth guards every route except /health.
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.items = 0
        request.state.failed = 0
        request.state.error = None
        t0 = time.perf_counter()
        if settings.api_key and request.url.path != "/health" and \
                not _bearer_ok(request.headers.get("authorization"), settings.api_key):
            svc.metrics.errors.labels("auth").inc()
            request.state.error = "missing or wrong API key"
            response: Response = JSONResponse(_error_body("auth", "missing or wrong API key "
                                                          "(send 'Authorization: Bearer <key>')"), 401,
                                              headers={"WWW-Authenticate": "Bearer"})
        else:
            try:
                response = await call_next(request)
            except Exception:  # noqa: BLE001 - a bug must still produce a 500 and a log line
                log.exception("unhandled error", extra={"fields": {"id": rid}})
                svc.metrics.errors.labels("internal").inc()
                response = JSONResponse(_error_body("internal", "internal server error"), 500)
        latency = time.perf_counter() - t0
        response.headers["X-Request-ID"] = rid
        if request.url.path == "/v1/encode":
            svc.metrics.latency.observe(latency)
            svc.metrics.requests.labels(str(response.status_code)).inc()
        if request.url.path not in ("/health", "/metrics", "/ready") or response.status_code >= 400:
            fields = {"id": rid, "method": request.method, "path": request.url.path,
                      "status": response.status_code, "items": request.state.items,
                      "failed": request.state.failed, "latency_ms": round(latency * 1000, 3)}
            if request.state.error:
                fields["error"] = request.state.error
            log.info("request", extra={"fields": fields})
        return response

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = svc.batcher.alive and not svc.draining
        body = {"ready": ok, "worker_alive": svc.batcher.alive, "draining": svc.draining, **svc.header_meta()}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        fmt = request.query_params.get("format", "safetensors")
        if fmt not in ("safetensors", "json"):
            raise _HTTPError(400, "bad_request", f"format must be 'safetensors' or 'json', got {fmt!r}")
        _check_content_type(request)  # 415 before reading a byte of the body
        body = await svc.read_body(request)
        items = await svc.parse_items(request, body)
        if not items:
            raise _HTTPError(400, "bad_request", "no items: send at least one 'file' part or JSON item")
        request.state.items = len(items)
        results = await svc.encode_request(items)

        failed = [r for r in results if r.error is not None]
        request.state.failed = len(failed)
        for r in failed:
            svc.metrics.errors.labels(r.error_kind or "internal").inc()
        for r in results:
            svc.metrics.items.labels("error" if r.error else ("cached" if r.cached else "encoded")).inc()
        metas = [svc.item_meta(i, r) for i, r in enumerate(results)]
        if len(failed) == len(results):
            # Nothing to return: a client error unless the server itself broke.
            internal = any(r.error_kind == "internal" for r in failed)
            status = 500 if internal else 422
            request.state.error = failed[0].error
            return JSONResponse(_error_body(failed[0].error_kind or "internal",
                                            "every item failed: " + "; ".join(str(r.error) for r in failed),
                                            **svc.header_meta(), items=metas), status)
        # Serialising can take a while for big answers (JSON above all); keep it off the event loop.
        loop = asyncio.get_running_loop()
        if fmt == "json":
            return Response(await loop.run_in_executor(None, _render_json, svc.header_meta(), metas, results),
                            media_type="application/json")
        return Response(await loop.run_in_executor(None, _render_safetensors, svc.header_meta(), metas, results),
                        media_type=SAFETENSORS_MEDIA_TYPE)

    return app


# ---------------------------------------------------------------------------------------------------- CLI


def serve_command(
    model: Annotated[Optional[str], typer.Option("--model", help="Checkpoint directory (default: demo model)")] = None,
    host: Annotated[str, typer.Option(help="Interface to bind; loopback by default")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    dtype: Annotated[str, typer.Option(help="Tower dtype: bfloat16 or float32")] = "bfloat16",
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant/--no-batch-invariant",
                                                  help="Bit-identical answers however requests are batched "
                                                       "(the cache is off without it)")] = True,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="BIVIT_API_KEY", help="Require 'Authorization: Bearer KEY' (all but /health)")] = None,
    max_batch_tokens: Annotated[int, typer.Option(help="Patch budget of one forward pass")] = 16384,
    max_wait_ms: Annotated[float, typer.Option(help="Max wait for more items before a forward pass")] = 5.0,
    max_queue: Annotated[int, typer.Option(help="Items in flight before 429")] = 256,
    max_body_mb: Annotated[float, typer.Option(help="Request body limit (413 above)")] = 64.0,
    request_timeout_s: Annotated[float, typer.Option(help="Per-request timeout (504 after)")] = 120.0,
    cache_mb: Annotated[float, typer.Option(help="Exact embedding cache size; 0 disables")] = 256.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Serve the encoder over HTTP: POST /v1/encode, GET /health, /ready, /metrics."""
    import uvicorn

    if log_level.lower() not in ("debug", "info", "warning", "error"):
        typer.echo(f"error: --log-level must be debug, info, warning or error, got {log_level!r}", err=True)
        raise typer.Exit(2)
    configure_logging(log_level)
    for name, value in (("--max-batch-tokens", max_batch_tokens), ("--max-queue", max_queue)):
        if value < 1:
            typer.echo(f"error: {name} must be at least 1, got {value}", err=True)
            raise typer.Exit(2)
    try:
        from . import load_encoder

        encoder = load_encoder(model, device=device, dtype=dtype, batch_invariant=batch_invariant,
                               max_batch_tokens=max_batch_tokens)
    except BivitError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if getattr(encoder, "is_demo", False):
        log.warning("serving the built-in DEMO model (tiny, seeded random weights): its embeddings are not Kimi's")
    settings = ServerSettings(api_key=api_key or None, max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms,
                              max_queue=max_queue, max_body_mb=max_body_mb, request_timeout_s=request_timeout_s,
                              cache_mb=cache_mb)
    if host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        log.warning("serving on a non-loopback interface without --api-key", extra={"fields": {"host": host}})
    config = uvicorn.Config(create_app(encoder, settings), host=host, port=port, log_config=None,
                            access_log=False, log_level=log_level.lower(),
                            # Bounded graceful shutdown: accepted requests get their answers first.
                            timeout_graceful_shutdown=int(request_timeout_s) + 10)
    uvicorn.Server(config).run()


def main() -> None:
    from .allocator import tune

    tune()
    typer.run(serve_command)


if __name__ == "__main__":
    main()
