"""The service's limits (the `bivit serve` options), each validated; imports nothing heavy, so the CLI refuses a
bad option before loading anything."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError


@dataclass
class ServerSettings:
    """Operational limits of the service (the `bivit serve` options); every one is checked here. Forward passes
    are cut by the encoder's own `max_batch_patches` (`bivit.packing`), as in every front end.

    Memory the service holds for requests is bounded by `max_queue_pixels_mb` (preprocessed pixels of every
    admitted request) plus what is being decoded (one item per preprocessing thread: `preprocess_threads` for
    images, as many again at most for videos) plus responses being written
    (each at most `max_response_mb`) plus the cache (`cache_mb`) plus the request bodies held (`max_bodies_mb`).
    """

    api_key: Optional[str] = None
    max_wait_ms: float = 5.0  # how long the worker waits for more items once one is queued
    max_queue: int = 256  # items admitted and not yet answered, over all requests
    max_body_mb: float = 64.0
    max_bodies_mb: Optional[float] = None  # /v1/encode bodies held at once, all requests (None: 4 x max_body_mb)
    request_timeout_s: float = 120.0  # from the end of the body to the answer; decoding stops at it too
    header_timeout_s: float = 10.0  # to receive a request's headers (a connection that is slower is closed)
    body_timeout_s: float = 60.0  # to receive a request's body (408 after)
    max_request_pixels_mb: float = 512.0  # preprocessed float32 pixels of one request's distinct items
    max_queue_pixels_mb: float = 2048.0  # the same over all admitted requests (429 above)
    max_response_mb: float = 256.0  # one response, every copy of an item counted (JSON: ~20 bytes a value)
    max_video_mpixels: float = 65536.0  # decoding work of one video: frames decoded x frame pixels, in millions
    cache_mb: float = 256.0
    preprocess_threads: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    retry_after_s: int = 1
    max_weights_mb: float = 8192.0  # body limit of POST /v1/weights (a full K2.6 vision part in fp32: ~1.9 GB)
    allow_weight_updates_without_key: bool = False  # POST /v1/weights is refused while api_key is unset
    ec_dir: Optional[str] = None  # also write each item's rows to vLLM's encoder cache here (item meta "ec_ids")

    def __post_init__(self) -> None:
        for name in ("max_queue", "preprocess_threads", "retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r}: expected a whole number >= 1")
        if self.max_bodies_mb is None:
            self.max_bodies_mb = 4 * self.max_body_mb if isinstance(self.max_body_mb, (int, float)) else None
        for name in ("max_body_mb", "max_bodies_mb", "request_timeout_s", "header_timeout_s", "body_timeout_s",
                     "max_request_pixels_mb", "max_queue_pixels_mb", "max_response_mb", "max_video_mpixels",
                     "max_wait_ms", "cache_mb", "max_weights_mb"):
            value = getattr(self, name)
            zero_ok = name in ("max_wait_ms", "cache_mb")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not zero_ok):
                raise ConfigError(f"--{name.replace('_', '-')} {value!r}: expected a finite number "
                                  f"{'>= 0' if zero_ok else '> 0'}")

    @staticmethod
    def mb(value: float) -> int:
        return int(value * 2**20)
