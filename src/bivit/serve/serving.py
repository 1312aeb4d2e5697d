"""One request's life in the service: items, cache lookup, admission, the core's stages, answer.

1. The event loop reads the body (bounded by `max_body_mb`) and splits it into items (`bivit.serve.bodies`),
   hashes each item and looks it up in the embedding cache.
2. Cache misses are admitted (`bivit.serve.admission`: items in flight, pixels and answer bytes held) and
   prepared in the decode pool their cost chooses (`Encoder.prepare`: decoding, resizing, chunking), so that
   work never blocks the event loop. Every decode stops at its request's deadline (an item still queued then is
   never started).
3. Each prepared item's chunks (one for an image) go to the Batcher, whose single worker coalesces queued
   chunks from all concurrent requests into forward passes by the packing rule.
4. Each item's result is `bivit.core.items.assemble`'s (a video: its chunks joined), answered in input order; the
   answer's bytes are held against `max_answers_mb` from admission until it is written (`bivit.serve.answers`).

Requests hold the weights gate shared (`bivit.serve.weights`): a weight update waits for them, and they for it.

Why coalescing is allowed to change nothing: with `batch_invariant=True` (the default) an item's embedding is
bit-identical whatever other items share the forward pass, so a response equals offline
`encoder.encode([same input])` alone. The exact cache relies on the same property; with
`--no-batch-invariant` it is switched off, because a cached answer could then differ from a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import time
from typing import Callable, Optional

from ..core import records
from ..core.encoder import Encoder
from ..core.encoder_cache import Sink
from ..core.items import ItemResult, Prepared, assemble
from ..errors import BadItem, BivitError, EncodeFailed, ErrorKind
from ..media.container import DecodeBudget
from .admission import JSON_BYTES_PER_VALUE, Admission, Budget, Cost
from .batcher import Batcher
from .bodies import BodyReader
from .embedding_cache import EmbeddingCache
from .logs import log
from .metrics import Metrics
from .protocol import UploadItem, too_many_items
from .settings import ServerSettings
from .weights import WeightUpdates


class Service:
    """State shared by the routes of one app: encoder, batcher, cache, metrics, admission, weight updates.
    `held`: the batching worker's (`Batcher`)."""

    def __init__(self, encoder: Encoder, settings: ServerSettings, *, held: Optional[Callable[[], bool]] = None):
        self.encoder = encoder
        self.settings = settings
        self.metrics = Metrics()
        self.bodies = BodyReader(settings, self.metrics)
        # Without batch invariance a cached embedding may differ from a fresh one, so no cache at all.
        self.cache = EmbeddingCache(int(settings.cache_mb * 2**20) if encoder.batch_invariant else 0)
        self.batcher = Batcher(encoder, settings.max_wait_ms / 1000.0, self.metrics, held=held)
        self.admission = Admission(settings, encoder.processing, self.metrics)
        self.draining = False
        # What computes the answers (Encoder.describe(): every answer's `encoder`, /v1/info). It hashes every
        # weight (the fingerprint): done once here, never on the event loop during a request.
        self.info = encoder.describe()
        self.ec = None if settings.ec_dir is None else Sink(settings.ec_dir, self.fingerprint)
        self.weights = WeightUpdates(self)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the weights serving now (the one the answers' `encoder` names)."""
        return self.info["fingerprint"]

    def weights_swapped(self, fingerprint: str) -> None:
        """On the batching worker, once new weights are in (`bivit.serve.weights`): answers name them from now."""
        self.info = {**self.info, "fingerprint": fingerprint}  # a new dict: answers in flight keep theirs
        if self.ec is not None:  # ids pin the weights: the new ones write under new ids (none is in flight)
            self.ec = Sink(self.settings.ec_dir, fingerprint)
        self.cache.clear()  # entries are keyed by the old fingerprint: unreachable, only taking memory
        self.metrics.cache_bytes.set(self.cache.nbytes)

    # -- lifecycle
    def start(self) -> None:
        self.admission.start()
        self.batcher.start()

    def stop(self) -> None:
        self.draining = True
        self.batcher.stop()
        self.admission.stop()

    # -- encoding
    def _prepare(self, item: UploadItem, sha256: str, deadline: float, decode: DecodeBudget) -> Prepared:
        """Runs in a thread pool: the item's bytes -> its chunks (the model's preprocessing and the server's
        --alpha, as offline). From the bytes (no temp file); decoding stops at the request's deadline, so a
        request that timed out does not keep a preprocessing thread from the next one, and a video's decoding is
        charged to the request's `decode` budget frame by frame."""
        return self.encoder.prepare(item.data, name=item.name, kind=item.kind, sha256=sha256, deadline=deadline,
                                    video_options=dict(max_decoded_pixels=decode))

    async def encode_item(self, item: UploadItem, key: tuple, deadline: float, budget: Budget, cost: Cost,
                          copies: int) -> ItemResult:
        """One distinct item of a request (`cost`: `item_cost`'s) -> the core's result (its error: why it failed,
        `error_kind` says which kind)."""
        pool = self.admission.pool_for(item, cost.work)
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
        keys = await asyncio.wrap_future(self.admission.pool.submit(owner, self.ec.feed, result))
        if "ec_error" in keys:
            log.error("encoder cache not written", extra={"fields": {"item": result.source, "reason": keys["ec_error"]}})
        return result, keys

    async def encode_request(self, items: list[UploadItem], json_response: bool = False
                             ) -> tuple[list[records.Record], dict, Callable[[], None]]:
        """-> (one record per item, its embedding in memory; the encoder's description with the fingerprint of
        the weights used; what releases the bytes its answer holds against `max_answers_mb`, to call once the
        answer is written or abandoned)."""
        budget = self.admission.budget(self.encoder.config.text_hidden_size * (
            JSON_BYTES_PER_VALUE if json_response else self.encoder.output_dtype.itemsize))
        try:
            async with self.weights.gate.shared():
                return await self._encode_request(items, budget), self.info, budget.release_answer
        except BaseException:
            budget.release_answer()
            raise

    def _keys(self, items: list[UploadItem], fingerprint: str) -> list[Optional[tuple]]:
        """Each item's cache key (None for an item that could not be extracted); on a worker thread."""
        return [None if it.data is None else (fingerprint, it.kind, hashlib.sha256(it.data).hexdigest())
                for it in items]

    async def _encode_request(self, items: list[UploadItem], budget: Budget) -> list[records.Record]:
        deadline = time.monotonic() + self.settings.request_timeout_s
        if len(items) > self.settings.max_queue:
            raise too_many_items(len(items), self.settings.max_queue)
        budget.take_records([it.name for it in items])
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
            self.admission.check_queue(n)
            # Images are counted from their headers, and videos' decoding work from theirs, before decoding.
            cost = dict(zip(unique, await loop.run_in_executor(None, self.admission.costs,
                                                               [items[i] for i in unique.values()])))
            budget.check_decoding(sum(c.work for key, c in cost.items() if items[unique[key]].kind == "video"
                                      and c.work is not None))
            try:
                budget.take(sum(c.pixels for c in cost.values() if c.pixels is not None),
                            sum(c.tokens * copies[key] for key, c in cost.items() if c.tokens is not None))
                with self.admission.in_flight(n):
                    tasks = [asyncio.ensure_future(self.encode_item(items[i], key, deadline, budget, cost[key],
                                                                    copies[key])) for key, i in unique.items()]
                    try:
                        fresh = await _gathered(tasks, max(0.0, deadline - time.monotonic()))
                        if time.monotonic() > deadline and any(r.error is not None for r in fresh):
                            raise asyncio.TimeoutError  # items stopped at the deadline decoding shares: a timeout
                        # The one conversion of an item in the service: its record (no embedding hashed here, on
                        # the event loop), which the cache, --ec-dir and the answer (`_record`) take.
                        fresh = [await self._with_encoder_cache(records.Record.of_result(r), budget) for r in fresh]
                    except asyncio.TimeoutError:
                        raise ErrorKind.TIMEOUT.error(f"request not answered within --request-timeout-s "
                                                      f"{self.settings.request_timeout_s:g}") from None
                    finally:
                        for t in tasks:  # one item over a budget ends the request: stop the others
                            t.cancel()
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


async def _gathered(tasks: list, seconds: float) -> list:
    """`gather(*tasks)` within `seconds` (TimeoutError after). Not `wait_for(gather(...))`: cancelled by a client's
    hangup, wait_for left the gather's CancelledError unretrieved, and asyncio logged it at error level with a
    traceback, once per hangup."""
    async with asyncio.timeout(seconds):
        return await asyncio.gather(*tasks)


def _record(i: int, name: str, result: records.Record, extra: dict) -> records.Record:
    """Input `i`'s record in the answer (its tensor "i"), its embedding in memory, under its upload's `name`
    (copies of one item and cache hits share a record made under another name); a failed item's reason
    names it."""
    own = {"cached": extra.get("cached", False) and result.error is None,
           **{k: v for k, v in extra.items() if k != "cached"}}
    if result.error is not None:
        return dataclasses.replace(result, source=name, error=f"{name}: {result.error}", extra=own)
    return dataclasses.replace(result, source=name, tensor=str(i), tensor_sha256=result.embedding_sha256, extra=own)
