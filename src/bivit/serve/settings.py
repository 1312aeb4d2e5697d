"""The service's limits (the `bivit serve` options), each validated; imports nothing heavy, so the CLI refuses a
bad option before loading anything."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from ..base.options import KIB_IN_MIB, TIB_IN_MIB, number, size_mb_words, whole


# The range of each number option, and how a message says it: a value outside is refused at start (`bivit serve`
# says so in one line and exits 2, before loading anything). Sizes from 1 KiB to 1 TiB and times from 1 ms to 11
# days: a smaller size (`--max-body-mb 1e-9` is 0 bytes) refuses every request, a longer wait overflows a timer
# (`--max-wait-ms 1e300` killed the batching thread, and every request then timed out).
_MIB = (KIB_IN_MIB, TIB_IN_MIB, size_mb_words())
_SECONDS = (1e-3, 1e6, "a time in seconds from 0.001 to 1000000 (11 days)")
RANGES: dict[str, tuple[float, float, str]] = {
    "max_body_mb": _MIB, "max_bodies_mb": _MIB, "max_request_pixels_mb": _MIB, "max_queue_pixels_mb": _MIB,
    "max_response_mb": _MIB, "max_answers_mb": _MIB, "max_weights_mb": _MIB,
    "cache_mb": (0.0, TIB_IN_MIB, size_mb_words(0.0, " (no cache)")),
    "request_timeout_s": _SECONDS, "header_timeout_s": _SECONDS, "body_timeout_s": _SECONDS,
    "write_timeout_s": _SECONDS, "max_wait_ms": (0.0, 60_000.0, "a time in milliseconds from 0 to 60000"),
    "max_video_mpixels": (1e-3, 1e9, "a number of million pixels from 0.001 to 1000000000"),
    "max_queue": (1, 1_000_000, "a whole number"),
    "preprocess_threads": (1, 1024, "a whole number"),
    "retry_after_s": (1, 3600, "a whole number of seconds"),
}
WHOLE = ("max_queue", "preprocess_threads", "retry_after_s")


@dataclass
class ServerSettings:
    """Operational limits of the service (the `bivit serve` options); every one is checked here (`RANGES`).
    Forward passes are cut by the encoder's own `max_batch_patches` (`bivit.core.packing`), as in every front end.

    Memory the service holds for requests is bounded by `max_queue_pixels_mb` (preprocessed pixels of every
    admitted request) plus what is being decoded (one item per preprocessing thread: `preprocess_threads` for
    images, as many again at most for videos) plus answers being computed or written (`max_answers_mb`, each at
    most `max_response_mb`) plus the cache (`cache_mb`) plus the request bodies held (`max_bodies_mb`).
    """

    api_key: Optional[str] = None
    max_wait_ms: float = 5.0  # how long the worker waits for more items once one is queued
    max_queue: int = 256  # items admitted and not yet answered, over all requests
    max_body_mb: float = 64.0
    max_bodies_mb: Optional[float] = None  # /v1/encode bodies held at once, all requests (None: 4 x max_body_mb)
    request_timeout_s: float = 120.0  # from the end of the body to the answer; decoding stops at it too
    header_timeout_s: float = 10.0  # to receive a request's headers (a connection that is slower is closed)
    body_timeout_s: float = 60.0  # to receive a request's body (408 after)
    write_timeout_s: float = 30.0  # an answer's client reads nothing of it this long: the connection is closed
    max_request_pixels_mb: float = 512.0  # preprocessed float32 pixels of one request's distinct items
    max_queue_pixels_mb: float = 2048.0  # the same over all admitted requests (429 above)
    max_response_mb: float = 256.0  # one response, every copy of an item counted (JSON: ~20 bytes a value)
    max_answers_mb: Optional[float] = None  # answers being computed or written, all requests (None: 4 x the above)
    max_video_mpixels: float = 65536.0  # decoding work of one request's videos (`bivit.media.container.DecodeBudget`), millions
    cache_mb: float = 256.0
    preprocess_threads: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    retry_after_s: int = 1
    # POST /v1/weights body limit; None: the served model's weights as their dtypes store them + 16 MiB, the
    # largest body a valid update can be (`bivit.serve.weights.WeightUpdates.limit_mb`)
    max_weights_mb: Optional[float] = None
    allow_weight_updates_without_key: bool = False  # POST /v1/weights is refused while api_key is unset
    ec_dir: Optional[str] = None  # also write each item's rows to vLLM's encoder cache here (item meta "ec_ids")

    def __post_init__(self) -> None:
        for name in WHOLE:
            lo, hi, what = RANGES[name]
            whole(getattr(self, name), _flag(name), lo, hi, what)
        for name, share in (("max_bodies_mb", "max_body_mb"), ("max_answers_mb", "max_response_mb")):
            if getattr(self, name) is None and isinstance(getattr(self, share), (int, float)):
                setattr(self, name, 4 * getattr(self, share))
        for name, (lo, hi, expected) in RANGES.items():
            value = getattr(self, name)
            if name not in WHOLE and not (value is None and name == "max_weights_mb"):
                number(value, _flag(name), lo, hi, expected)

    @staticmethod
    def mb(value: float) -> int:
        return int(value * 2**20)


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"
