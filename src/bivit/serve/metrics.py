"""The Prometheus series of one service app (needs the `serve` extra's prometheus-client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Prometheus series of one app; a registry per app so several apps can live in one process (tests)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("bivit_queue_depth", "Items waiting for the batching worker", registry=r)
        self.inflight_items = Gauge("bivit_inflight_items", "Items admitted and not yet answered", registry=r)
        self.body_bytes = Gauge("bivit_body_bytes", "Bytes of /v1/encode bodies received and held", registry=r)
        self.answer_bytes = Gauge("bivit_answer_bytes", "Bytes of answers being computed or written", registry=r)
        self.pixel_bytes = Gauge("bivit_pixel_bytes", "Preprocessed pixel bytes held for admitted requests",
                                 registry=r)
        self.batch_items = Histogram("bivit_batch_items", "Items per forward pass", registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.batch_patches = Histogram("bivit_batch_patches", "Patches per forward pass", registry=r,
                                       buckets=tuple(4 ** i for i in range(1, 9)))
        self.batch_seconds = Histogram("bivit_batch_seconds", "Duration of one encode_batch call", registry=r)
        self.latency = Histogram("bivit_request_latency_seconds", "Latency of POST /v1/encode", registry=r,
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.requests = Counter("bivit_requests_total", "Requests answered by the app, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.tokens = Counter("bivit_tokens_total", "Tokens computed by the encoder (cache hits excluded)",
                              registry=r)
        self.items = Counter("bivit_items_total", "Items answered, by outcome", ["outcome"], registry=r)
        self.cache_hits = Counter("bivit_cache_hits_total", "Embedding cache hits", registry=r)
        self.cache_misses = Counter("bivit_cache_misses_total", "Embedding cache misses", registry=r)
        self.cache_bytes = Gauge("bivit_cache_bytes", "Bytes held by the embedding cache", registry=r)
        self.errors = Counter("bivit_errors_total", "Errors by kind (request- and item-level)", ["kind"],
                              registry=r)
