"""The service's exact embedding cache."""

from __future__ import annotations

import collections
import threading
from typing import Optional

from ..core.records import Record


class EmbeddingCache:
    """Exact LRU cache of embeddings (each item's record, its embedding in memory), bounded by bytes.

    Keyed by (encoder fingerprint, item kind, sha256 of the item bytes). Serving a hit is exact only because the
    encoder is batch invariant: the cached bits are the bits any batch would produce for those bytes.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._data: collections.OrderedDict[tuple, Record] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size(r: Record) -> int:
        return (r.embedding.numel() * r.embedding.element_size() if r.embedding is not None else 0) + 256

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: tuple) -> Optional[Record]:
        with self._lock:
            r = self._data.get(key)
            if r is not None:
                self._data.move_to_end(key)
            return r

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def put(self, key: tuple, r: Record) -> None:
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
