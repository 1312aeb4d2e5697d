"""The local engine of encode-dataset: in-process, one thread decodes ahead while this one encodes."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterator, Sequence

from .pipeline import Encoded, Prepared, Work, encode_prepared, prepare


def run_local(encoder: Any, work: Sequence[Work], batch_tokens: int, sink: Callable[[Encoded], None]) -> None:
    """In-process: one thread decodes ahead while this one encodes (PIL and torch both release the GIL)."""
    for group in _prefetch(_token_groups(work, batch_tokens, encoder), depth=2):
        for e in encode_prepared(encoder, group, batch_tokens):
            sink(e)


def _token_groups(work: Sequence[Work], batch_tokens: int, encoder: Any) -> Iterator[list[Prepared]]:
    """Prepared items in groups cut by `group_by_tokens`' rule (close a group before it would exceed the
    budget), so that each group is one encode call there rather than a full call plus a small remainder."""
    cur: list[Prepared] = []
    n = 0
    for w in work:
        p = prepare(w.sha256, w.kind, w.path, w.sources[0].source, encoder.processing, encoder.alpha)
        t = sum(p.batch.token_counts) if p.error is None else 0
        if cur and n + t > batch_tokens:
            yield cur
            cur, n = [], 0
        cur.append(p)
        n += t
    if cur:
        yield cur


def _prefetch(it: Iterator[Any], depth: int) -> Iterator[Any]:
    q: "queue.Queue[Any]" = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():  # never block forever on a consumer that has gone away
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            for x in it:
                if not put((True, x)):
                    return
        except BaseException as e:  # surfaced in the consumer
            put((False, e))
            return
        put((True, done))

    t = threading.Thread(target=produce, name="bivit-prefetch", daemon=True)
    t.start()
    try:
        while True:
            ok, x = q.get()
            if not ok:
                raise x
            if x is done:
                return
            yield x
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                q.get_nowait()
