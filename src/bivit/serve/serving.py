"""One request's life in the service: items, cache lookup, admission, the core's stages, answer.

1. The event loop reads the body (bounded by `max_body_mb`) and splits it into items (`bivit.serve.bodies`),
   hashes each item and looks it up in the embedding cache.
2. Cache misses are admitted against `max_queue` (else 429 + Retry-After) and prepared in thread pools
   (`Encoder.prepare`: decoding, resizing, chunking), so that work never blocks the event loop: videos in one,
   images in another, images whose header says they are heavy (`HEAVY_IMAGE_SIZE`) in a third of one thread
   and light ones (`LIGHT_IMAGE_SIZE`) in a fourth of one thread, so a heavy item never makes a small one wait
   for a thread; each pool takes its work round-robin across requests (`FairPool`). Every decode stops at its request's
   deadline (an item still queued then is never started).
3. Each prepared item's chunks (one for an image) go to the Batcher, whose single worker coalesces queued
   chunks from all concurrent requests into forward passes by the packing rule.
4. Each item's result is `bivit.items.assemble`'s (a video: its chunks joined), answered in input order; the
   answer's bytes are held against `max_answers_mb` from admission until it is written (`bivit.serve.answers`).

A request's videos share one decoding budget (`max_video_mpixels`, `bivit.container.DecodeBudget`), charged from
their headers before anything is decoded and then frame by frame; heavy videos decode in a pool of their own.

Weight updates (`POST /v1/weights`) pass a gate that requests hold shared and an update holds alone: the
update waits for the requests in flight (they finish on the old weights, none is lost), new requests wait for
the update; the weights are swapped on the batching worker between forward passes. So every response is
computed entirely with the weights whose fingerprint it names, and the cache (keyed by fingerprint) never
serves an old embedding as a new one.

Why coalescing is allowed to change nothing: with `batch_invariant=True` (the default) an item's embedding is
bit-identical whatever other items share the forward pass, so a response equals offline
`encoder.encode([same input])` alone. The exact cache relies on the same property; with
`--no-batch-invariant` it is switched off, because a cached answer could then differ from a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Mapping
from typing import Callable, Iterator, NamedTuple, Optional

from safetensors import SafetensorError, safe_open

from .. import records
from ..container import FRAME_MIN_PIXELS, DecodeBudget
from ..decode import image_header, image_work_bytes
from ..encoder import Encoder
from ..encoder_cache import Sink
from ..errors import BadItem, BivitError, CheckpointError, EncodeFailed, ErrorKind, MediaError
from ..grids import PATCH_SIZE, grid_tokens, image_grid
from ..items import ItemResult, Prepared, assemble
from ..preprocess_config import ProcessorConfig
from ..video import decode_work
from .batcher import Batcher
from .bodies import BodyReader
from .embedding_cache import EmbeddingCache
from .metrics import Metrics
from .pools import FairPool
from .protocol import UploadItem, too_many_items
from .settings import ServerSettings

log = logging.getLogger("bivit.server")


# Bytes of preprocessed pixels per patch: float32 [3, 14, 14].
PATCH_BYTES = 3 * PATCH_SIZE * PATCH_SIZE * 4
# A JSON response writes each value as text: at most ~20 bytes with its separator.
JSON_BYTES_PER_VALUE = 20
# An item's record in the answer beyond its name (which it holds up to three times: source, error, the 422
# message): keys, sha256, grid, placeholders, a reason. Counted for every item, failed and cached ones too.
RECORD_BYTES = 1024
# An image whose decoding and preprocessing takes more memory than an RGB photo of this size does (as the model
# preprocesses it; `bivit.decode.image_work_bytes`) is heavy: decoded in the one-thread heavy pool, so at most one
# such image is in memory at a time and none holds a thread a small image needs. A 64 MP PNG decodes in about 2 s
# on one core; the 14000x14000 PNGs that starved small requests take 5-7 s each.
HEAVY_IMAGE_SIZE = (8192, 8192)
# An image that takes no more than an RGB photo of this size is light: decoded in a one-thread pool of its own
# (in tens of milliseconds), so a small request never waits for a thread that decodes a large image (two
# requests of 13 7500x7500 PNGs held both image threads for ~10 s at a time on 2 busy cores).
LIGHT_IMAGE_SIZE = (1024, 1024)
# A video whose decoding work (`bivit.video.decode_work`, from its header) is above this, or not known before
# decoding, is heavy: decoded in a one-thread pool of its own, so a short clip never waits for a thread that
# decodes a long video (two 200,000-frame videos held both video threads until the small ones' deadline).
# About 500 frames of 1080p, or 60,000 tiny frames: a few seconds of decoding on one core.
HEAVY_VIDEO_WORK = 10**9


class _Cost(NamedTuple):
    """What an item costs, from its header, before anything is decoded: preprocessed pixel bytes and tokens (an
    image; a video's are counted once decoded: None), and the work of decoding it (an image: the memory
    `image_work_bytes` estimates; a video: `bivit.video.decode_work`), None where the header does not say."""

    pixels: Optional[int] = None
    tokens: Optional[int] = None
    work: Optional[int] = None


def item_cost(item: UploadItem, processing: ProcessorConfig) -> _Cost:
    """An item's `_Cost` from its header alone, under the model's `processing` (nothing known when the header is
    unreadable: decoding will then say what is wrong)."""
    try:
        if item.kind == "video":
            return _Cost(work=decode_work(item.data, name=item.name))
        head = image_header(item.data, processing)
    except MediaError:
        return _Cost()
    gh, gw = image_grid(head.width, head.height, processing)
    return _Cost(gh * gw * PATCH_BYTES, grid_tokens(gh, gw), head.work_bytes)


class WeightsGate:
    """Held shared by requests, alone by a weight update; an update waiting holds back new requests."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writers = 0  # waiting or running updates

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writers)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        async with self._cond:
            self._writers += 1  # from now on no new reader enters
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: not self._readers)
            yield
        finally:  # also when cancelled while waiting: the readers held back must be let in
            async with self._cond:
                self._writers -= 1
                self._cond.notify_all()


class Service:
    """State shared by the routes of one app: encoder, batcher, cache, metrics, admission counter."""

    def __init__(self, encoder: Encoder, settings: ServerSettings):
        self.encoder = encoder
        self.settings = settings
        self.metrics = Metrics()
        self.bodies = BodyReader(settings, self.metrics)
        # Without batch invariance a cached embedding may differ from a fresh one, so no cache at all.
        self.cache = EmbeddingCache(int(settings.cache_mb * 2**20) if encoder.batch_invariant else 0)
        self.batcher = Batcher(encoder, settings.max_wait_ms / 1000.0, self.metrics)
        # Images, heavy images and videos decode in separate pools: a video or a heavy image that is slow to decode
        # (until its request's deadline) never makes a small image wait for a thread. Each pool takes its work
        # round-robin across requests (`FairPool`): a request of many items never holds a pool from another.
        self.pool: Optional[FairPool] = None
        self.heavy_pool: Optional[FairPool] = None
        self.light_pool: Optional[FairPool] = None
        self.video_pool: Optional[FairPool] = None
        self.heavy_video_pool: Optional[FairPool] = None
        self.heavy_bytes = image_work_bytes(*HEAVY_IMAGE_SIZE, "RGB", encoder.processing)
        self.light_bytes = image_work_bytes(*LIGHT_IMAGE_SIZE, "RGB", encoder.processing)
        self.heavy_video_work = HEAVY_VIDEO_WORK
        self.inflight = 0  # items admitted and not yet answered; touched only on the event loop
        self.pixels_held = 0  # preprocessed pixel bytes of admitted requests (see _Budget); event loop only
        self.answers_held = 0  # bytes of answers being computed or written (see _Budget); event loop only
        self.draining = False
        # What computes the answers (Encoder.describe(): every answer's `encoder`, /v1/info). It hashes every
        # weight (the fingerprint): done once here, never on the event loop during a request.
        self.info = encoder.describe()
        self.ec = None if settings.ec_dir is None else Sink(settings.ec_dir, self.fingerprint)
        self.gate = WeightsGate()
        self.updating = asyncio.Lock()  # one weight update at a time

    @property
    def weights_limit_mb(self) -> float:
        """--max-weights-mb, else the served model's weights as their dtypes store them + 16 MiB of header: the
        largest a valid update can be."""
        weights = sum(t.numel() * t.element_size() for t in self.encoder.model.state_dict().values())
        return self.settings.max_weights_mb or weights / 2**20 + 16

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the weights serving now (the one the answers' `encoder` names)."""
        return self.info["fingerprint"]

    # -- lifecycle
    def start(self) -> None:
        self.pool = FairPool(self.settings.preprocess_threads, "bivit-preprocess")
        self.heavy_pool = FairPool(1, "bivit-heavy")
        self.light_pool = FairPool(1, "bivit-light")
        self.video_pool = FairPool(self.settings.preprocess_threads, "bivit-video")
        self.heavy_video_pool = FairPool(1, "bivit-heavy-video")
        self.batcher.start()

    def stop(self) -> None:
        self.draining = True
        self.batcher.stop()
        for pool in (self.pool, self.heavy_pool, self.light_pool, self.video_pool, self.heavy_video_pool):
            if pool is not None:
                pool.shutdown()

    # -- encoding
    def _prepare(self, item: UploadItem, sha256: str, deadline: float, decode: DecodeBudget) -> Prepared:
        """Runs in a thread pool: the item's bytes -> its chunks (the model's preprocessing and the server's
        --alpha, as offline). From the bytes (no temp file); decoding stops at the request's deadline, so a
        request that timed out does not keep a preprocessing thread from the next one, and a video's decoding is
        charged to the request's `decode` budget frame by frame."""
        return self.encoder.prepare(item.data, name=item.name, kind=item.kind, sha256=sha256, deadline=deadline,
                                    video_options=dict(max_decoded_pixels=decode))

    def _pool_for(self, item: UploadItem, work: Optional[int]) -> FairPool:
        """Heavy and other videos, heavy, light and other images (`work`: `item_cost`'s) each their pool."""
        if item.kind == "video":
            return self.heavy_video_pool if work is None or work > self.heavy_video_work else self.video_pool
        if work is None:
            return self.pool
        return self.heavy_pool if work > self.heavy_bytes else self.light_pool if work <= self.light_bytes \
            else self.pool

    async def encode_item(self, item: UploadItem, key: tuple, deadline: float, budget: "_Budget", cost: _Cost,
                          copies: int) -> ItemResult:
        """One distinct item of a request (`cost`: `item_cost`'s) -> the core's result (its error: why it failed,
        `error_kind` says which kind)."""
        pool = self._pool_for(item, cost.work)
        prepared = await asyncio.wrap_future(pool.submit(budget, self._prepare, item, key[2], deadline,
                                                         budget.decode))
        if prepared.error is not None:
            return assemble(prepared)
        if cost.pixels is None:  # a video (or an image whose header said nothing): counted once decoded
            budget.take(prepared.batch.pixel_values.nbytes, prepared.tokens * copies)
        futures = [asyncio.wrap_future(self.batcher.submit(chunk)) for chunk in prepared.chunks()]
        try:
            outs = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for f in futures:  # the request timed out: drop its items that have not started
                f.cancel()
            raise
        except BivitError as e:
            outs = [e]
        except Exception as e:  # noqa: BLE001 - a failing forward pass fails this item only
            log.error("encode failed", exc_info=e, extra={"fields": {"item": item.name}})
            outs = [EncodeFailed(f"encoding failed ({type(e).__name__}: {e})")]
        return assemble(prepared, outs)

    async def _with_encoder_cache(self, result: records.Record, owner: object) -> tuple[records.Record, dict]:
        """`result` and its record's own keys: with --ec-dir its rows written there (only files missing: so
        also on a cache hit, whose files may have been deleted since) and their ids, or `ec_error` (the item
        keeps its embedding)."""
        if self.ec is None or result.error is not None:
            return result, {}
        keys = await asyncio.wrap_future(self.pool.submit(owner, self.ec.feed, result))
        if "ec_error" in keys:
            log.error("encoder cache not written", extra={"fields": {"item": result.source, "reason": keys["ec_error"]}})
        return result, keys

    async def encode_request(self, items: list[UploadItem], json_response: bool = False
                             ) -> tuple[list[records.Record], dict, Callable[[], None]]:
        """-> (one record per item, its embedding in memory; the encoder's description with the fingerprint of
        the weights used; what releases the bytes its answer holds against `max_answers_mb`, to call once the
        answer is written or abandoned)."""
        budget = _Budget(self, self.encoder.config.text_hidden_size * (
            JSON_BYTES_PER_VALUE if json_response else self.encoder.output_dtype.itemsize))
        try:
            async with self.gate.shared():
                return await self._encode_request(items, budget), self.info, budget.release_answer
        except BaseException:
            budget.release_answer()
            raise

    def _keys(self, items: list[UploadItem], fingerprint: str) -> list[Optional[tuple]]:
        """Each item's cache key (None for an item that could not be extracted); on a worker thread."""
        return [None if it.data is None else (fingerprint, it.kind, hashlib.sha256(it.data).hexdigest())
                for it in items]

    def _costs(self, items: list[UploadItem]) -> list[_Cost]:
        """`item_cost` of each item; on a worker thread: parsing a header is work too."""
        return [item_cost(it, self.encoder.processing) for it in items]

    async def _encode_request(self, items: list[UploadItem], budget: "_Budget") -> list[records.Record]:
        deadline = time.monotonic() + self.settings.request_timeout_s
        if len(items) > self.settings.max_queue:
            raise too_many_items(len(items), self.settings.max_queue)
        # Every byte of the answer is counted, records included: a failed item has no tokens but a record.
        budget.take(0, 0, sum(RECORD_BYTES + 3 * len(it.name.encode("utf-8", "surrogatepass")) for it in items))
        results: list[Optional[tuple[records.Record, dict]]] = [None] * len(items)
        todo: list[tuple[int, tuple]] = []
        fp = self.fingerprint
        loop = asyncio.get_running_loop()
        keys = await loop.run_in_executor(None, self._keys, items, fp)
        for i, (it, key) in enumerate(zip(items, keys)):
            if key is None:
                results[i] = records.Record.of_error(it.name, it.kind, BadItem(it.error)), {}
                continue
            hit = self.cache.get(key) if self.cache.max_bytes else None
            if hit is not None:
                self.metrics.cache_hits.inc()
                budget.take(0, hit.tokens)
                result, extra = await self._with_encoder_cache(hit, budget)
                results[i] = result, {**extra, "cached": True}
            else:
                if self.cache.max_bytes:
                    self.metrics.cache_misses.inc()
                todo.append((i, key))
        if todo:
            # Identical items of one request are encoded once (exact: same bytes, same encoder, same bits), but
            # every copy is answered, so every copy counts towards the response size.
            unique: dict[tuple, int] = {}
            for i, key in todo:
                unique.setdefault(key, i)
            copies = collections.Counter(key for _, key in todo)
            n = len(unique)
            if n > self.settings.max_queue:
                raise ErrorKind.TOO_MANY_ITEMS.error(f"request has {n} items to encode, more than --max-queue "
                                   f"{self.settings.max_queue}; split it")
            if self.inflight + n > self.settings.max_queue:
                items_text = f"{self.inflight} item{'' if self.inflight == 1 else 's'}"
                raise ErrorKind.QUEUE_FULL.error(f"server busy: {items_text} in flight, --max-queue "
                                   f"{self.settings.max_queue}; retry later",
                                   {"Retry-After": str(self.settings.retry_after_s)})
            # Images are counted from their headers, and videos' decoding work from theirs, before decoding.
            cost = dict(zip(unique, await loop.run_in_executor(None, self._costs, [items[i] for i in unique.values()])))
            budget.check_decoding(sum(c.work for key, c in cost.items() if items[unique[key]].kind == "video"
                                      and c.work is not None))
            try:
                budget.take(sum(c.pixels for c in cost.values() if c.pixels is not None),
                            sum(c.tokens * copies[key] for key, c in cost.items() if c.tokens is not None))
                self.inflight += n
                self.metrics.inflight_items.set(self.inflight)
                tasks = [asyncio.ensure_future(self.encode_item(items[i], key, deadline, budget, cost[key], copies[key]))
                         for key, i in unique.items()]
                try:
                    fresh = await _gathered(tasks, max(0.0, deadline - time.monotonic()))
                    if time.monotonic() > deadline and any(r.error is not None for r in fresh):
                        raise asyncio.TimeoutError  # items stopped at the deadline decoding shares: a timeout
                    # The one conversion of an item in the service: its record (no embedding hashed here, on the
                    # event loop), which the cache, --ec-dir and the answer (`_record`) take.
                    fresh = [await self._with_encoder_cache(records.Record.of_result(r), budget) for r in fresh]
                except asyncio.TimeoutError:
                    raise ErrorKind.TIMEOUT.error(f"request not answered within --request-timeout-s "
                                       f"{self.settings.request_timeout_s:g}") from None
                finally:
                    for t in tasks:  # one item over a budget ends the request: stop the others
                        t.cancel()
                    self.inflight -= n
                    self.metrics.inflight_items.set(self.inflight)
            finally:
                budget.release()
            by_key = dict(zip(unique, fresh))
            for key, (r, _) in by_key.items():
                if r.error is None and self.cache.max_bytes:
                    self.cache.put(key, r)
            for i, key in todo:
                results[i] = by_key[key]
            self.metrics.cache_bytes.set(self.cache.nbytes)
        # Off the event loop: each distinct embedding is hashed for its record (`tensor_sha256`).
        return await loop.run_in_executor(None, lambda: [_record(i, it.name, *r)  # type: ignore[misc]
                                                         for i, (it, r) in enumerate(zip(items, results))])

    # -- weight sync
    async def update_weights(self, path: str) -> dict:
        """A safetensors file (a spooled body) -> the encoder's new weights (all or nothing) -> {fingerprint,
        previous, tensors}. The caller holds `updating` (one update, and one body, at a time)."""
        try:
            handle = await asyncio.get_running_loop().run_in_executor(None, lambda: safe_open(path, "pt"))
        except (SafetensorError, ValueError, OSError) as e:
            raise ErrorKind.BAD_WEIGHTS.error(f"body is not a safetensors file ({e})") from None
        tensors = _LazyTensors(handle, "POST /v1/weights")

        def apply() -> str:  # on the batching worker, between forward passes
            fingerprint = self.encoder.update_weights(tensors, source="POST /v1/weights")
            self.info = {**self.info, "fingerprint": fingerprint}  # a new dict: answers in flight keep theirs
            if self.ec is not None:  # ids pin the weights: the new ones write under new ids (none is in flight)
                self.ec = Sink(self.settings.ec_dir, fingerprint)
            self.cache.clear()  # entries are keyed by the old fingerprint: unreachable, only taking memory
            self.metrics.cache_bytes.set(self.cache.nbytes)
            return fingerprint

        async with self.gate.exclusive():
            previous = self.fingerprint
            swap = asyncio.wrap_future(self.batcher.call(apply))
            try:
                fingerprint = await asyncio.shield(swap)
            except asyncio.CancelledError:  # the client hung up: keep the gate until the swap is over
                await asyncio.wait({swap})
                raise
            except BivitError as e:  # refused whole: the old weights keep serving
                raise ErrorKind.BAD_WEIGHTS.error(str(e)) from None
        log.info("weights updated", extra={"fields": {"fingerprint": fingerprint, "previous": previous,
                                                      "tensors": len(tensors)}})
        return {"fingerprint": fingerprint, "previous_fingerprint": previous, "tensors": len(tensors)}


async def _gathered(tasks: list, seconds: float) -> list:
    """`gather(*tasks)` within `seconds` (TimeoutError after). Not `wait_for(gather(...))`: cancelled by a client's
    hangup, wait_for left the gather's CancelledError unretrieved, and asyncio logged it at error level with a
    traceback, once per hangup."""
    async with asyncio.timeout(seconds):
        return await asyncio.gather(*tasks)


class _Budget:
    """What one request holds against the limits: preprocessed pixel bytes (its own, and the service's total over
    admitted requests), the size its answer will have (its own, and the service's total of answers being
    computed or written), and the decoding work of its videos (`decode`, shared by their decode threads). Used
    on the event loop only, but for `decode`."""

    def __init__(self, service: Service, token_bytes: int):
        self.svc, self.token_bytes = service, token_bytes
        self.pixels = 0
        self.response = 0
        self.decode = DecodeBudget(int(service.settings.max_video_mpixels * 1e6))

    def check_decoding(self, work: int) -> None:
        """413 when the decoding work its videos' headers announce is more than the request may do."""
        if work > self.decode.limit:
            raise ErrorKind.TOO_LARGE.error(f"the request's videos need {work / 1e6:.0f} M frame pixels of "
                               f"decoding (frames x their pixels, at least {FRAME_MIN_PIXELS} a frame), more than "
                               f"--max-video-mpixels {self.svc.settings.max_video_mpixels:g}; send fewer or "
                               "shorter videos")

    def take(self, pixels: int, tokens: int, other_bytes: int = 0) -> None:
        s = self.svc.settings
        answer = tokens * self.token_bytes + other_bytes
        if self.response + answer > s.mb(s.max_response_mb):
            raise ErrorKind.RESPONSE_TOO_LARGE.error(f"the response would exceed --max-response-mb "
                               f"{s.max_response_mb:g} ({self.response + answer} bytes); "
                               "send fewer items (every copy of an item is answered)")
        if self.svc.answers_held + answer > s.mb(s.max_answers_mb):
            # Answers wait for their clients to read them: clients that never read held 2.9 GB at four of them.
            raise ErrorKind.BUSY.error(f"server busy: {self.svc.answers_held} bytes of answers being "
                               f"computed or written, --max-answers-mb {s.max_answers_mb:g}; retry later",
                               {"Retry-After": str(s.retry_after_s)})
        if self.pixels + pixels > min(s.mb(s.max_request_pixels_mb), s.mb(s.max_queue_pixels_mb)):
            raise ErrorKind.TOO_LARGE.error(f"request needs more than --max-request-pixels-mb "
                               f"{s.max_request_pixels_mb:g} of decoded pixels; send fewer or smaller items")
        if self.svc.pixels_held + pixels > s.mb(s.max_queue_pixels_mb):
            raise ErrorKind.QUEUE_FULL.error(f"server busy: --max-queue-pixels-mb {s.max_queue_pixels_mb:g} "
                               "of decoded pixels in flight; retry later", {"Retry-After": str(s.retry_after_s)})
        self.pixels += pixels
        self.response += answer
        self.svc.pixels_held += pixels
        self.svc.answers_held += answer
        self.svc.metrics.pixel_bytes.set(self.svc.pixels_held)
        self.svc.metrics.answer_bytes.set(self.svc.answers_held)

    def release(self) -> None:
        """Its pixels are encoded (or dropped)."""
        self.svc.pixels_held -= self.pixels
        self.pixels = 0
        self.svc.metrics.pixel_bytes.set(self.svc.pixels_held)

    def release_answer(self) -> None:
        """Its answer is written (or abandoned); idempotent."""
        self.svc.answers_held -= self.response
        self.response = 0
        self.svc.metrics.answer_bytes.set(self.svc.answers_held)


class _LazyTensors(Mapping):
    """The tensors of an open safetensors file, each read when asked for (a weight update checks and copies one at
    a time, not the whole body); one that cannot be read is a CheckpointError naming it."""

    def __init__(self, handle, source: str):
        self.handle, self.source, self._keys = handle, source, list(handle.keys())

    def __getitem__(self, key: str):
        if key not in self._keys:
            raise KeyError(key)
        try:
            return self.handle.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - a damaged or truncated body
            raise CheckpointError(f"{self.source}: tensor {key!r} cannot be read ({e})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _record(i: int, name: str, result: records.Record, extra: dict) -> records.Record:
    """Input `i`'s record in the answer (its tensor "i"), its embedding in memory, under its upload's `name`
    (copies of one item and cache hits share a record made under another name); a failed item's reason
    names it."""
    own = {"cached": extra.get("cached", False) and result.error is None,
           **{k: v for k, v in extra.items() if k != "cached"}}
    if result.error is not None:
        return dataclasses.replace(result, source=name, error=f"{name}: {result.error}", extra=own)
    return dataclasses.replace(result, source=name, tensor=str(i), tensor_sha256=result.embedding_sha256, extra=own)
