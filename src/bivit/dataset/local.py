"""The local engine of encode-dataset: in-process, one thread prepares ahead while this one encodes."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..core.items import Prepared
from ..core.records import Record
from .pipeline import Work, prepare, record_of


def run_local(encoder: Any, work: Sequence[Work], sink: Callable[[Record], None]) -> None:
    """In-process: one thread prepares ahead (about two passes of pixels) while this one encodes (PIL and torch
    both release the GIL); each result's record (`record_of`) goes to `sink`, in order."""
    prepared = (prepare(w.sha256, w.kind, w.path, w.sources[0].source, encoder.processing, encoder.alpha)
                for w in work)
    for result in encoder.encode_stream(_prefetch(prepared, 2 * encoder.max_batch_patches)):
        sink(record_of(result))


def _prefetch(items: Iterable[Prepared], max_patches: int) -> Iterator[Prepared]:
    """`items`, produced by a thread that stays ahead by at most `max_patches` patches (an item larger than that
    is still handed over, alone)."""
    q: "queue.Queue[Any]" = queue.Queue()
    done = object()
    stop = threading.Event()
    room = threading.Condition()
    ahead = 0  # patches produced and not yet consumed

    def put(x: Any, patches: int) -> bool:
        nonlocal ahead
        with room:
            while not stop.is_set() and ahead > 0 and ahead + patches > max_patches:
                room.wait()
            if stop.is_set():  # never block forever on a consumer that has gone away, nor work for it
                return False
            ahead += patches
        q.put(x)
        return True

    def produce() -> None:
        try:
            for p in items:
                if not put((True, p), p.patches if p.error is None else 0):
                    return
        except BaseException as e:  # surfaced in the consumer
            put((False, e), 0)
            return
        put((True, done), 0)

    def took(p: Prepared) -> None:
        nonlocal ahead
        with room:
            ahead -= p.patches if p.error is None else 0
            room.notify()

    t = threading.Thread(target=produce, name="bivit-prefetch", daemon=True)
    t.start()
    try:
        while True:
            ok, x = q.get()
            if not ok:
                raise x
            if x is done:
                return
            took(x)
            yield x
    finally:
        stop.set()
        with room:
            room.notify_all()
        with contextlib.suppress(queue.Empty):
            while True:
                q.get_nowait()
