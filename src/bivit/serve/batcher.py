"""The batching worker: one thread owns the Encoder (it is not re-entrant) and coalesces queued items (images and
video chunks) from all requests into forward passes, by the packing rule (`bivit.core.packing`).

Anything else that touches the encoder (a weight update) runs on the same thread, between forward passes
(`Batcher.call`), so no forward pass ever sees half-updated weights.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..core.packing import Pass
from ..media.pixels import MediaBatch
from .metrics import Metrics

HELD_POLL_S = 0.005  # how often a worker with items queued asks `held` again


@dataclass
class _Job:
    item: Optional[MediaBatch]  # exactly one item (an image, or one video chunk); None for a call
    patches: int
    future: concurrent.futures.Future
    enqueued: float
    call: Optional[Callable[[], Any]] = None  # run alone on the worker thread, in queue order


class Batcher:
    """One worker thread that owns the Encoder and coalesces queued items into forward passes.

    A batch closes when the next queued item starts a new pass by the packing rule (it would push the batch past
    the encoder's `max_batch_patches`), or `max_wait_s` after its oldest item was queued, whichever comes first. Items are taken in
    arrival order. An item larger than the budget runs alone. A pass that raises is run again item by item
    (`Encoder.forward_each`), so that one bad item fails only itself.

    `held()`, when given, is asked before each forward pass or call: while it says True none starts (unless the
    worker is stopping); requests are still admitted and their items queued (`bivit_queue_depth`). What is in
    flight at a given moment, and which items share a forward pass, is then decided by whoever holds it (a test),
    not by how fast the machine happens to be.
    """

    def __init__(self, encoder: Any, max_wait_s: float, metrics: Metrics,
                 held: Optional[Callable[[], bool]] = None):
        self._encoder = encoder
        self._max_patches = encoder.max_batch_patches  # checked when the encoder was loaded
        self._max_wait = max(0.0, float(max_wait_s))
        self._metrics = metrics
        self._queue: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._held = held or (lambda: False)

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

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the worker thread after the items queued before it, alone; its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the batching worker is stopping")
            self._queue.append(_Job(None, 0, fut, time.monotonic(), call=fn))
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
            if jobs and jobs[0].call is not None:
                self._call(jobs[0])
            elif jobs:
                self._encode(jobs)

    def _next_batch(self) -> Optional[list[_Job]]:
        with self._cv:
            while not self._queue or (self._held() and not self._stopping):  # stopping: queued items still run
                if self._stopping and not self._queue:
                    return None
                self._cv.wait(HELD_POLL_S if self._queue else None)  # queued: only held
            filling: Pass[_Job] = Pass(self._max_patches)  # the packing rule decides where the batch ends
            deadline = self._queue[0].enqueued + self._max_wait
            while True:
                while self._queue:
                    job = self._queue[0]
                    if job.call is not None:  # a call runs alone: it ends the batch before it
                        if filling:
                            self._metrics.queue_depth.set(len(self._queue))
                            return filling.take()
                        self._queue.popleft()
                        self._metrics.queue_depth.set(len(self._queue))
                        return [job] if job.future.set_running_or_notify_cancel() else []
                    if not filling.fits(job.patches):
                        self._metrics.queue_depth.set(len(self._queue))
                        return filling.take()
                    self._queue.popleft()
                    # False when the request already gave up (timeout): do not spend a forward pass on it.
                    if job.future.set_running_or_notify_cancel():
                        filling.add(job, job.patches)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopping or filling.full:
                    break
                self._cv.wait(remaining)
            self._metrics.queue_depth.set(len(self._queue))
            return filling.take()

    @staticmethod
    def _call(job: _Job) -> None:
        try:
            job.future.set_result(job.call())
        except Exception as e:  # noqa: BLE001 - handed to the caller; the worker goes on
            job.future.set_exception(e)

    def _encode(self, jobs: list[_Job]) -> None:
        batch = MediaBatch.concat([j.item for j in jobs])
        t0 = time.perf_counter()
        outs = self._encoder.forward_each(batch)  # the worker survives anything one item does
        done = [(j, o) for j, o in zip(jobs, outs) if not isinstance(o, Exception)]
        if done:
            self._metrics.batch_seconds.observe(time.perf_counter() - t0)
            self._metrics.batch_items.observe(len(done))
            self._metrics.batch_patches.observe(sum(j.patches for j, _ in done))
            self._metrics.tokens.inc(sum(int(o.shape[0]) for _, o in done))
        for j, o in zip(jobs, outs):
            if isinstance(o, Exception):
                j.future.set_exception(o)
                continue
            # A private host copy: outputs may be views of one buffer (safetensors refuses shared storage, and
            # the cache must not pin a whole batch), and responses and the cache live in host memory.
            o = o.detach()
            j.future.set_result(o.cpu().contiguous() if o.device.type != "cpu" else o.contiguous().clone())
