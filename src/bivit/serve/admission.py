"""Admission: what an item costs before it is decoded, what a request and the service may hold, and which decode
pool an admitted item waits in.

A request is admitted against `max_queue` (items in flight over all requests, else 429 + Retry-After); its
items are costed from their headers (`item_cost`) and their preprocessed pixels and answer bytes held against
the request's and the service's limits (`Budget`), before anything is decoded. Admitted items decode in thread
pools chosen by their cost: videos in one, heavy videos (or ones whose header does not say) in a one-thread pool
of their own, images in another, images whose header says they are heavy (`HEAVY_IMAGE_SIZE`) in a third of one
thread and light ones (`LIGHT_IMAGE_SIZE`) in a fourth of one thread, so a heavy item never makes a small one
wait for a thread; each pool takes its work round-robin across requests (`FairPool`).

A request's videos share one decoding budget (`max_video_mpixels`, `bivit.media.container.DecodeBudget`), charged from
their headers before anything is decoded and then frame by frame.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

from ..checkpoint.preprocess_config import ProcessorConfig
from ..errors import ErrorKind, MediaError
from ..media.container import FRAME_MIN_PIXELS, DecodeBudget
from ..media.decode import image_header, image_work_bytes
from ..media.grids import PATCH_SIZE, grid_tokens, image_grid
from ..media.video import decode_work
from .metrics import Metrics
from .pools import FairPool
from .protocol import UploadItem
from .settings import ServerSettings

# Bytes of preprocessed pixels per patch: float32 [3, 14, 14].
PATCH_BYTES = 3 * PATCH_SIZE * PATCH_SIZE * 4
# A JSON response writes each value as text: at most ~20 bytes with its separator.
JSON_BYTES_PER_VALUE = 20
# An item's record in the answer beyond its name (which it holds up to three times: source, error, the 422
# message): keys, sha256, grid, placeholders, a reason. Counted for every item, failed and cached ones too.
RECORD_BYTES = 1024
# An image whose decoding and preprocessing takes more memory than an RGB photo of this size does (as the model
# preprocesses it; `bivit.media.decode.image_work_bytes`) is heavy: decoded in the one-thread heavy pool, so at most one
# such image is in memory at a time and none holds a thread a small image needs. A 64 MP PNG decodes in about 2 s
# on one core; the 14000x14000 PNGs that starved small requests take 5-7 s each.
HEAVY_IMAGE_SIZE = (8192, 8192)
# An image that takes no more than an RGB photo of this size is light: decoded in a one-thread pool of its own
# (in tens of milliseconds), so a small request never waits for a thread that decodes a large image (two
# requests of 13 7500x7500 PNGs held both image threads for ~10 s at a time on 2 busy cores).
LIGHT_IMAGE_SIZE = (1024, 1024)
# A video whose decoding work (`bivit.media.video.decode_work`, from its header) is above this, or not known before
# decoding, is heavy: decoded in a one-thread pool of its own, so a short clip never waits for a thread that
# decodes a long video (two 200,000-frame videos held both video threads until the small ones' deadline).
# About 500 frames of 1080p, or 60,000 tiny frames: a few seconds of decoding on one core.
HEAVY_VIDEO_WORK = 10**9


class Cost(NamedTuple):
    """What an item costs, from its header, before anything is decoded: preprocessed pixel bytes and tokens (an
    image; a video's are counted once decoded: None), and the work of decoding it (an image: the memory
    `image_work_bytes` estimates; a video: `bivit.media.video.decode_work`), None where the header does not say."""

    pixels: Optional[int] = None
    tokens: Optional[int] = None
    work: Optional[int] = None


def item_cost(item: UploadItem, processing: ProcessorConfig) -> Cost:
    """An item's `Cost` from its header alone, under the model's `processing` (nothing known when the header is
    unreadable: decoding will then say what is wrong)."""
    try:
        if item.kind == "video":
            return Cost(work=decode_work(item.data, name=item.name))
        head = image_header(item.data, processing)
    except MediaError:
        return Cost()
    gh, gw = image_grid(head.width, head.height, processing)
    return Cost(gh * gw * PATCH_BYTES, grid_tokens(gh, gw), head.work_bytes)


class Admission:
    """What the service has admitted (items in flight; preprocessed pixel bytes and answer bytes held, see
    `Budget`), and the decode pools. The counters are touched only on the event loop."""

    def __init__(self, settings: ServerSettings, processing: ProcessorConfig, metrics: Metrics):
        self.settings, self.processing, self.metrics = settings, processing, metrics
        # Images, heavy images and videos decode in separate pools: a video or a heavy image that is slow to decode
        # (until its request's deadline) never makes a small image wait for a thread. Each pool takes its work
        # round-robin across requests (`FairPool`): a request of many items never holds a pool from another.
        self.pool: Optional[FairPool] = None
        self.heavy_pool: Optional[FairPool] = None
        self.light_pool: Optional[FairPool] = None
        self.video_pool: Optional[FairPool] = None
        self.heavy_video_pool: Optional[FairPool] = None
        self.heavy_bytes = image_work_bytes(*HEAVY_IMAGE_SIZE, "RGB", processing)
        self.light_bytes = image_work_bytes(*LIGHT_IMAGE_SIZE, "RGB", processing)
        self.heavy_video_work = HEAVY_VIDEO_WORK
        self.inflight = 0  # items admitted and not yet answered
        self.pixels_held = 0  # preprocessed pixel bytes of admitted requests
        self.answers_held = 0  # bytes of answers being computed or written

    def start(self) -> None:
        threads = self.settings.preprocess_threads
        self.pool = FairPool(threads, "bivit-preprocess")
        self.heavy_pool = FairPool(1, "bivit-heavy")
        self.light_pool = FairPool(1, "bivit-light")
        self.video_pool = FairPool(threads, "bivit-video")
        self.heavy_video_pool = FairPool(1, "bivit-heavy-video")

    def stop(self) -> None:
        for pool in (self.pool, self.heavy_pool, self.light_pool, self.video_pool, self.heavy_video_pool):
            if pool is not None:
                pool.shutdown()

    def pool_for(self, item: UploadItem, work: Optional[int]) -> FairPool:
        """Heavy and other videos, heavy, light and other images (`work`: `item_cost`'s) each their pool."""
        if item.kind == "video":
            return self.heavy_video_pool if work is None or work > self.heavy_video_work else self.video_pool
        if work is None:
            return self.pool
        return self.heavy_pool if work > self.heavy_bytes else self.light_pool if work <= self.light_bytes \
            else self.pool

    def costs(self, items: list[UploadItem]) -> list[Cost]:
        """`item_cost` of each item; on a worker thread: parsing a header is work too."""
        return [item_cost(it, self.processing) for it in items]

    def budget(self, token_bytes: int) -> "Budget":
        """A new request's `Budget`, its answer taking `token_bytes` a token."""
        return Budget(self, token_bytes)

    def check_queue(self, n: int) -> None:
        """413 when a request has more distinct items to encode than --max-queue, 429 when they do not fit beside
        the items in flight."""
        s = self.settings
        if n > s.max_queue:
            raise ErrorKind.TOO_MANY_ITEMS.error(f"request has {n} items to encode, more than --max-queue "
                                                 f"{s.max_queue}; split it")
        if self.inflight + n > s.max_queue:
            items_text = f"{self.inflight} item{'' if self.inflight == 1 else 's'}"
            raise ErrorKind.QUEUE_FULL.error(f"server busy: {items_text} in flight, --max-queue "
                                             f"{s.max_queue}; retry later", {"Retry-After": str(s.retry_after_s)})

    @contextlib.contextmanager
    def in_flight(self, n: int) -> Iterator[None]:
        """`n` items in flight (`bivit_inflight_items`) inside the block."""
        self.inflight += n
        self.metrics.inflight_items.set(self.inflight)
        try:
            yield
        finally:
            self.inflight -= n
            self.metrics.inflight_items.set(self.inflight)


class Budget:
    """What one request holds against the limits: preprocessed pixel bytes (its own, and the service's total over
    admitted requests), the size its answer will have (its own, and the service's total of answers being
    computed or written), and the decoding work of its videos (`decode`, shared by their decode threads). Used
    on the event loop only, but for `decode`."""

    def __init__(self, admission: Admission, token_bytes: int):
        self.admission, self.token_bytes = admission, token_bytes
        self.pixels = 0
        self.response = 0
        self.decode = DecodeBudget(int(admission.settings.max_video_mpixels * 1e6))

    def check_decoding(self, work: int) -> None:
        """413 when the decoding work its videos' headers announce is more than the request may do."""
        if work > self.decode.limit:
            raise ErrorKind.TOO_LARGE.error(f"the request's videos need {work / 1e6:.0f} M frame pixels of "
                               f"decoding (frames x their pixels, at least {FRAME_MIN_PIXELS} a frame), more than "
                               f"--max-video-mpixels {self.admission.settings.max_video_mpixels:g}; send fewer or "
                               "shorter videos")

    def take_records(self, names: list[str]) -> None:
        """Every byte of the answer is counted, records included: a failed item has no tokens but a record."""
        self.take(0, 0, sum(RECORD_BYTES + 3 * len(name.encode("utf-8", "surrogatepass")) for name in names))

    def take(self, pixels: int, tokens: int, other_bytes: int = 0) -> None:
        held, s = self.admission, self.admission.settings
        answer = tokens * self.token_bytes + other_bytes
        if self.response + answer > s.mb(s.max_response_mb):
            raise ErrorKind.RESPONSE_TOO_LARGE.error(f"the response would exceed --max-response-mb "
                               f"{s.max_response_mb:g} ({self.response + answer} bytes); "
                               "send fewer items (every copy of an item is answered)")
        if held.answers_held + answer > s.mb(s.max_answers_mb):
            # Answers wait for their clients to read them: clients that never read held 2.9 GB at four of them.
            raise ErrorKind.BUSY.error(f"server busy: {held.answers_held} bytes of answers being "
                               f"computed or written, --max-answers-mb {s.max_answers_mb:g}; retry later",
                               {"Retry-After": str(s.retry_after_s)})
        if self.pixels + pixels > min(s.mb(s.max_request_pixels_mb), s.mb(s.max_queue_pixels_mb)):
            raise ErrorKind.TOO_LARGE.error(f"request needs more than --max-request-pixels-mb "
                               f"{s.max_request_pixels_mb:g} of decoded pixels; send fewer or smaller items")
        if held.pixels_held + pixels > s.mb(s.max_queue_pixels_mb):
            raise ErrorKind.QUEUE_FULL.error(f"server busy: --max-queue-pixels-mb {s.max_queue_pixels_mb:g} "
                               "of decoded pixels in flight; retry later", {"Retry-After": str(s.retry_after_s)})
        self.pixels += pixels
        self.response += answer
        held.pixels_held += pixels
        held.answers_held += answer
        held.metrics.pixel_bytes.set(held.pixels_held)
        held.metrics.answer_bytes.set(held.answers_held)

    def release(self) -> None:
        """Its pixels are encoded (or dropped)."""
        held = self.admission
        held.pixels_held -= self.pixels
        self.pixels = 0
        held.metrics.pixel_bytes.set(held.pixels_held)

    def release_answer(self) -> None:
        """Its answer is written (or abandoned); idempotent."""
        held = self.admission
        held.answers_held -= self.response
        self.response = 0
        held.metrics.answer_bytes.set(held.answers_held)
