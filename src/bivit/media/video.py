"""Video input exactly as Kimi-K2.5/K2.6's processor samples, chunks and timestamps it (docs/model.md, "Video").

The numbers come from the model's `ProcessorConfig` (`bivit.checkpoint.preprocess_config`); K2.5/K2.6 publish
`sample_fps` 2, `temporal_merge_kernel_size` 4, `in_patch_limit_each_frame` 4096. A video becomes one item per
chunk of `temporal_merge_kernel_size` consecutive *sampled* frames (the last chunk may be shorter):

- N = the container's frame count, fps = its average frame rate (float, as FFmpeg's `av_q2d` gives it).
  `sample_fps = min(sample_fps, fps)`, `n = max(round(N * sample_fps / fps), 1)` (Python round, half to even),
  frame indices `np.linspace(0, N - 1, n).round().astype(int)`.
- Every frame of a chunk goes through the image pipeline (`bivit.media.pixels.frames_to_item`) with the per-frame
  budget (`in_patch_limit_each_frame`, shared by the chunk's frames when `in_patch_limit_video` is set); the
  chunk's grid is `[t, h, w]`.
- A chunk's timestamp is its first frame's index / fps formatted as the reference does: `datetime` (which
  rounds to microseconds) for the clock, plus the milliseconds truncated from the float (frame 23 at 10 fps
  prints `00:00:02.299`, frame 24000 at 24000/1001 fps `00:16:41.999`), hours wrapping past 24 h.
- Kimi-K3's published processor takes images only; bivit refuses a video for it with a MediaError.
- A video the caller decoded and sampled already (`preprocess_frames`) is chunked and timestamped the same way.

Decisions this module makes (the reference does not say):

- Frame count. We trust the container's count when it has one (mp4/mov/avi/gif). WebM/Matroska do not store
  one, so we count by decoding: two passes, the first decodes and counts, the second decodes again and keeps
  only the sampled frames. Holding every frame instead would need N decoded frames in memory (a 10 min 1080p
  video is ~110 GB of RGB); decoding twice costs CPU time only, and the first pass stops as soon as a limit
  is exceeded. If the decoder cleanly yields fewer frames than the container claimed (a lying header), the
  decoded count wins: we resample with it and decode again. A decode error FFmpeg reports (truncated or
  damaged data) is a MediaError, not a silently shorter video.
- Frame rate. The container's average rate, unless its frames' timestamps say clearly otherwise (only known
  where the frames are counted by decoding: Matroska/WebM, which declare a nominal rate, not an average): then
  their average rate, `bivit.media.container.timestamp_rate` (a variable-rate MKV of 40 frames over 18 s declaring
  1000 fps was one frame at 00:00:00.000; it is 37 frames in 10 chunks).
- Frames are decoded sequentially (no seeking): exact frame indices for every codec, at the cost of decoding
  frames that are not sampled. Frames are converted to RGB24 by FFmpeg's swscale (PyAV defaults: the frame's
  own colour matrix and range tags, no HDR tone mapping); display rotation metadata is ignored. Alpha (GIF)
  is dropped, not composited, as the image path does. The reference uses its own reader, which we could not
  run: if it converts colours differently (chroma upsampling, range handling), pixels can differ by a level or
  two; the sampled frame indices cannot.
- `.gif` is always a video (`bivit.media.kinds` decides by extension first), even with a single frame: how a path
  is encoded never depends on its content. Pass a GIF to the image path yourself to treat it as an image.
- Still-image files (PNG/JPEG/... even when renamed `.mp4`) are refused: FFmpeg would open them as a
  one-frame video, silently giving them the video budget and a timestamp.
- FFmpeg reads only what it is given (`bivit.media.container`): paths are opened by bivit (a regular file, no URL or
  protocol parsing of the name) and bytes are read from memory; FFmpeg gets `format_whitelist` (the containers
  of `VIDEO_DEMUXERS`: the probe may detect anything, but any other demuxer is refused before it opens, so an
  `ffconcat` script never names a file to read, SDP never binds a UDP port, HLS/DASH never fetch a segment,
  image2 never reads a file sequence) and a `protocol_whitelist` that matches no protocol (no nested open of
  anything).
- Truncation. A container that declares the video's length (its frame count: mp4/mov/avi/gif; Matroska/WebM's
  per-track duration, or the segment's when the file has one stream) and whose frames cover less of it than
  `TRUNCATION_SLACK` allows is refused as truncated (a WebM cut at half its size decodes cleanly to half its
  frames). Within the slack (a header off by a frame or two) the decoded frames win. Containers that declare
  no length (MPEG-TS, raw streams, live WebM) cannot be checked.
- Limits (all configurable; `None` disables one):
  * `max_frames=1024` sampled frames: 1024 1080p frames are 256 chunks of 1032 tokens, ~264k tokens, the
    whole of K2.5's 256k context, and ~10 GB of float32 pixels. With fps >= 2 this caps a video at 512 s.
  * `max_duration_s=4 h`: bounds decoding work (every frame is decoded) when the frame cap does not bind
    (sparse low-fps videos, or a raised `max_frames`); checked from metadata before decoding when possible.
  * `max_frame_pixels=7680*4320` (8K UHD): one decoded RGB frame is then at most ~100 MB.
  * `max_fps=1000`: the frame rate a container declares, checked before decoding. Sampling takes 2 frames a
    second whatever the rate, and every frame up to the last sampled one is decoded: a 58 MB MP4 of 4.5 M 16x16
    frames at 4.5 M fps (1 s long) was ~80 s of decoding for 2 sampled frames. No camera short of a scientific
    high-speed one records faster than 1000 fps.
  * `max_decoded_pixels` (the service's `--max-video-mpixels`): decoding work (`bivit.media.container.DecodeBudget`:
    each frame its pixels, at least `FRAME_MIN_PIXELS`), from the container's frame count before decoding when
    it has one, then frame by frame in every pass; one budget may be shared by several videos (a request's).
"""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import av
import numpy as np
import torch
from PIL import Image

from ..checkpoint.preprocess_config import K25_PROCESSING, ProcessorConfig
from ..errors import ConfigError, MediaError
from .container import (FRAME_MIN_PIXELS, Container, DecodeBudget, VideoInput, check_complete, frame_work,
                        translate_errors)
from .container import timestamp_rate
from .decode import check_deadline, load_image
from .grids import processing_of
from .pixels import MediaBatch, frames_to_item

SAMPLE_FPS = K25_PROCESSING.sample_fps
MAX_FRAMES = 1024
MAX_DURATION_S = 4 * 3600.0
MAX_FRAME_PIXELS = 7680 * 4320
MAX_FPS = 1000.0


@dataclass
class VideoChunk:
    """One encoded chunk of a video: its embedding `[tokens, text_hidden]`, grid, start time and position."""

    embedding: torch.Tensor
    grid_thw: tuple[int, int, int]
    timestamp: str
    index: int

    @property
    def token_count(self) -> int:
        return int(self.embedding.shape[0])


@dataclass(frozen=True)
class VideoInfo:
    """What the sampler needs to know about a video. `frame_count_from` is "container" or "decoding"."""

    source: str
    num_frames: int
    fps: float
    width: int
    height: int
    codec: str
    container: str
    frame_count_from: str

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


def _num_samples(num_frames: int, fps: float, sample_fps: float) -> int:
    # Same expression, same evaluation order as the reference, so float rounding matches too.
    sample_fps = min(sample_fps, fps)
    return max(round(num_frames * sample_fps / fps), 1)


def sample_frame_indices(num_frames: int, fps: float, sample_fps: float = SAMPLE_FPS) -> list[int]:
    """Indices of the frames the reference samples from a video of `num_frames` frames at `fps`."""
    fps = float(fps)
    if num_frames < 1:
        raise MediaError(f"video has no frames (num_frames={num_frames})")
    if not (math.isfinite(fps) and fps > 0):
        raise MediaError(f"video has no usable frame rate (fps={fps})")
    _check_positive("sample_fps", sample_fps)
    n = _num_samples(num_frames, fps, float(sample_fps))
    return np.linspace(0, num_frames - 1, n).round().astype(int).tolist()


def chunk_timestamp(frame_index: int, fps: float, mode: str = "hh:mm:ss.fff") -> str:
    """Timestamp of a frame exactly as the reference writes it (`mode` is the config's `timestamp_mode`).

    The clock part goes through `datetime`, which rounds the float seconds to microseconds; the milliseconds
    are truncated from the float itself, so the two can disagree right below a whole second, as they do in
    the reference.
    """
    t = frame_index / float(fps)
    clock = datetime.fromtimestamp(t, tz=timezone.utc)
    millis = f".{int((t % 1) * 1000):03d}"
    if mode == "hh:mm:ss.fff":
        return clock.strftime("%H:%M:%S") + millis
    if mode == "mm:ss.fff":
        return clock.strftime("%M:%S") + millis
    if mode == "mm:ss":
        return clock.strftime("%M:%S")
    raise ConfigError(f"timestamp_mode {mode!r}: expected hh:mm:ss.fff, mm:ss.fff or mm:ss")


def _check_positive(option: str, value: object, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # An integer option takes an int (a float such as 4.0 would later index a list: a TypeError, not this).
    ok = (isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0)
    if not ok:
        kind = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"{option} must be {kind}{' or None' if allow_none else ''}, got {value!r}")


def _describe(src: VideoInput) -> str:
    return f"<video {len(src)} bytes>" if isinstance(src, bytes) else os.fspath(src)


class _Limits:
    deadline: Optional[float] = None  # time.monotonic() after which decoding stops (a caller gave up waiting)
    budget: Optional[DecodeBudget] = None  # decoding work (every frame up to the last sampled one is decoded)
    charged = 0  # what this video has charged to the budget, every pass (the rest is other videos')
    frame_pixels = 0  # as the stream header says (refusing a clear case before decoding)

    def __init__(self, name: str, max_frames: Optional[int], max_duration_s: Optional[float],
                 max_frame_pixels: Optional[int], sample_fps: float, max_fps: Optional[float] = MAX_FPS):
        self.name, self.max_frames, self.max_duration_s = name, max_frames, max_duration_s
        self.max_frame_pixels, self.sample_fps, self.max_fps = max_frame_pixels, sample_fps, max_fps

    def check_time(self) -> None:
        check_deadline(self.deadline, self.name, "the video")

    def check_size(self, width: int, height: int) -> None:
        if self.max_frame_pixels is not None and width * height > self.max_frame_pixels:
            raise MediaError(f"{self.name}: frame size {width}x{height} = {width * height} pixels exceeds "
                             f"max_frame_pixels={self.max_frame_pixels}")

    def open(self, src: VideoInput) -> Container:
        """A decoding pass: FFmpeg's decoder refuses a frame above max_frame_pixels before allocating it; the frame
        rate is checked before any frame is decoded."""
        source = Container(src, self.name, self.max_frame_pixels)
        if self.max_fps is not None and source.fps > self.max_fps:
            source.close()
            raise MediaError(f"{self.name}: frame rate {source.fps:g} fps, more than max_fps={self.max_fps:g}")
        return source

    def check_frame(self, frame: av.VideoFrame) -> None:
        """Every decoded frame, sampled or not, in every pass: its own size (a header of 64x48 says nothing about
        the frames), its work charged to the budget; then the deadline."""
        self.check_size(frame.width, frame.height)
        if self.budget is not None:
            work = frame_work(frame.width * frame.height)
            self.charged += work
            self.budget.charge(work, self.name)
        self.check_time()

    def check_length(self, num_frames: int, fps: float, at_least: bool = False) -> None:
        """Raise if a video of `num_frames` frames (or more, when still counting) breaks a limit."""
        more = "at least " if at_least else ""
        seconds = num_frames / fps
        if self.max_duration_s is not None and seconds > self.max_duration_s:
            raise MediaError(f"{self.name}: video lasts {more}{seconds:.1f} s ({num_frames} frames at {fps:g} fps), "
                             f"more than max_duration_s={self.max_duration_s:g}")
        if self.max_frames is not None:
            n = _num_samples(num_frames, fps, self.sample_fps)
            if n > self.max_frames:
                raise MediaError(f"{self.name}: sampling at {min(self.sample_fps, fps):g} fps gives {more}{n} frames "
                                 f"({seconds:.1f} s of video), more than max_frames={self.max_frames}")
        work = num_frames * frame_work(self.frame_pixels)
        others = 0 if self.budget is None else self.budget.used - self.charged
        if self.budget is not None and work > self.budget.limit - others:
            raise MediaError(f"{self.name}: decoding {more}{num_frames} frames of {self.frame_pixels} pixels is "
                             f"{work} pixels (at least {FRAME_MIN_PIXELS} a frame), more than max_decoded_pixels="
                             f"{self.budget.limit}" + (f" ({others} used by other videos)" if others else ""))


def _count_frames(source: Container, limits: _Limits) -> tuple[int, float]:
    """Decode the whole stream once, counting frames; stop as soon as the count breaks a limit. A declared
    length the frames fall clearly short of is truncation. -> the count and the rate to sample by
    (`timestamp_rate`: the frames' own when the declared one disagrees with them)."""
    count = 0
    first = last = None
    frames = source.frames()
    try:
        for frame in frames:
            count += 1
            limits.check_frame(frame)
            if frame.pts is not None and frame.time_base is not None:
                first = frame.pts * frame.time_base if first is None else first
                last = frame.pts * frame.time_base
            limits.check_length(count, source.fps, at_least=True)
    finally:
        frames.close()
    if source.declared_s is not None and count:
        covered = float(last - first) + 1 / source.fps if first is not None else count / source.fps
        check_complete(source.name, source.declared_s, covered, source.fps, f"{source.declared_s:.2f} s")
    return count, timestamp_rate(count, first, last, source.fps)


def _probe(src: VideoInput, name: str, limits: _Limits) -> VideoInfo:
    with limits.open(src) as source:
        limits.check_size(source.width, source.height)
        limits.frame_pixels = source.width * source.height
        fps = source.fps
        if source.reported_frames > 0:
            count, origin = source.reported_frames, "container"
            limits.check_length(count, source.fps)
        else:
            # No count in the container: refuse an over-long video from its declared duration before decoding.
            declared = source.container.duration  # microseconds, or None
            if declared is not None and declared > 0 and limits.max_duration_s is not None:
                seconds = declared / av.time_base
                if seconds > limits.max_duration_s * 1.01 + 1:  # metadata is approximate: refuse only clear cases
                    raise MediaError(f"{name}: video lasts {seconds:.1f} s by its metadata, more than "
                                     f"max_duration_s={limits.max_duration_s:g}")
            (count, fps), origin = _count_frames(source, limits), "decoding"
            limits.check_length(count, fps)  # by its frames' timestamps: 40 frames at "1000 fps" may last 4 h
        if count == 0:
            raise MediaError(f"{name}: the video stream has no frames")
        return VideoInfo(name, count, fps, source.width, source.height, source.codec, source.format, origin)


class _ShortStream(Exception):
    """The decoder ran out of frames before the last sampled index; carries how many it produced."""

    def __init__(self, decoded: int):
        self.decoded = decoded


def _decode_selected(src: VideoInput, name: str, indices: Sequence[int], limits: _Limits) -> Iterator[Image.Image]:
    """Yield the frames at `indices` (sorted, repeats allowed) as RGB images, decoding sequentially."""
    with limits.open(src) as source:
        frames = source.frames()
        try:
            pos, decoded = 0, 0
            for i, frame in enumerate(frames):
                decoded = i + 1
                limits.check_frame(frame)
                if indices[pos] != i:
                    continue
                with translate_errors(name, f"converting frame {i} to RGB"):
                    image = Image.fromarray(frame.to_ndarray(format="rgb24"), "RGB")
                while pos < len(indices) and indices[pos] == i:
                    yield image
                    pos += 1
                if pos == len(indices):
                    return  # frames past the last sampled index are never needed
            raise _ShortStream(decoded)
        finally:
            frames.close()  # finish the decode generator while its container is still open


def chunk_frames(frames: Iterable[Image.Image], name: str, fps: float, indices: Sequence[int], chunk_size: int,
                 patch_limit: Optional[int], proc: ProcessorConfig,
                 check_time: Callable[[], None] = lambda: None) -> list[MediaBatch]:
    """Sampled RGB frames (video frame `indices[i]` at `fps`) -> one item per `chunk_size` frames, timestamped."""
    items: list[MediaBatch] = []
    buffer: list[Image.Image] = []

    def flush() -> None:
        c = len(items)
        limit = proc.chunk_frame_limit(len(buffer)) if patch_limit is None else patch_limit
        try:
            pixels, grid = frames_to_item(buffer, limit, proc)
        except MediaError as e:  # e.g. the resolution changed inside a chunk
            raise MediaError(f"{name}: chunk {c}: {e}") from None
        except MemoryError:
            raise MediaError(f"{name}: chunk {c}: not enough memory to preprocess its frames") from None
        stamp = chunk_timestamp(indices[c * chunk_size], fps, proc.timestamp_mode)
        items.append(MediaBatch(pixels, torch.tensor([grid], dtype=torch.int64), [stamp], [f"{name}#chunk{c}"],
                                [buffer[0].size]))
        buffer.clear()  # the chunk's decoded frames are not kept once patchified

    for image in frames:
        buffer.append(image)
        if len(buffer) == chunk_size:
            check_time()
            flush()
    if buffer:
        flush()
    return items


def preprocess_frames(frames: Sequence[Image.Image | np.ndarray], fps: float, indices: Optional[Sequence[int]] = None,
                      *, processing: ProcessorConfig | str | None = None, name: str = "<video frames>") -> MediaBatch:
    """A video already decoded and sampled -> the MediaBatch `preprocess_video` makes of a file whose sampler
    picked these frames: `frames[i]` (PIL or HxWx3 uint8) is frame `indices[i]` (default i) of a video at `fps`."""
    proc = processing_of(processing)
    if not proc.accepts_video:
        raise MediaError(f"{name}: this model's processor ({proc.processor}) accepts images only", name)
    indices = list(range(len(frames))) if indices is None else [int(i) for i in indices]
    _check_positive("fps", fps)
    if not frames or len(indices) != len(frames) or any(b < a for a, b in zip(indices, indices[1:])):
        raise MediaError(f"{name}: need at least one frame and one non-decreasing frame index per frame, got "
                         f"{len(frames)} frames and {len(indices)} indices", name)
    images = [load_image(f, name=f"{name} frame {i}").convert("RGB") for i, f in enumerate(frames)]
    with _naming(name):
        return MediaBatch.concat(chunk_frames(images, name, float(fps), indices, proc.temporal_merge_kernel_size,
                                              None, proc))


def preprocess_video(path: VideoInput, *, max_frames: Optional[int] = MAX_FRAMES,
                     max_duration_s: Optional[float] = MAX_DURATION_S,
                     max_frame_pixels: Optional[int] = MAX_FRAME_PIXELS, sample_fps: Optional[float] = None,
                     chunk_size: Optional[int] = None, patch_limit: Optional[int] = None,
                     processing: ProcessorConfig | str | None = None, name: Optional[str] = None,
                     deadline: Optional[float] = None, max_decoded_pixels: Optional[int | DecodeBudget] = None,
                     max_fps: Optional[float] = MAX_FPS) -> MediaBatch:
    """Decode, sample and chunk a video (a path or its bytes) into a MediaBatch: one item per chunk.

    `processing` is the model's preprocessing (default K2.x's); `sample_fps`, `chunk_size` (frames per chunk)
    and `patch_limit` (per frame) override its values. `timestamps[i]` is chunk i's start, `sources[i]` is
    `"{path}#chunk{i}"`. Raises MediaError naming the file (or `name`, how messages call the input) for
    unreadable, empty or frameless videos, for videos beyond a limit and for a model whose processor takes images
    only; ConfigError for a bad option. `deadline` (a `time.monotonic()` value): decoding stops with a MediaError
    once it has passed, so work nobody waits for any more does not go on. `max_decoded_pixels` (a number, or a
    `DecodeBudget` shared with other videos) bounds the decoding work (every frame up to the last sampled one is
    decoded, in every pass): checked from the container's frame count before decoding, then frame by frame.
    `max_fps`: the frame rate the container may declare.
    """
    proc = processing_of(processing)
    sample_fps = proc.sample_fps if sample_fps is None else sample_fps
    chunk_size = proc.temporal_merge_kernel_size if chunk_size is None else chunk_size
    _check_positive("chunk_size", chunk_size, integer=True)
    _check_positive("patch_limit", patch_limit, integer=True, allow_none=True)
    name, limits = _prepare(path, max_frames, max_duration_s, max_frame_pixels, sample_fps, name, max_fps)
    if not proc.accepts_video:
        raise MediaError(f"{name}: this model's processor ({proc.processor}) accepts images only, as its published "
                         "code does; videos cannot be encoded for it", name)
    limits.deadline = deadline
    if max_decoded_pixels is not None:
        limits.budget = max_decoded_pixels if isinstance(max_decoded_pixels, DecodeBudget) \
            else DecodeBudget(max_decoded_pixels)
    limits.check_time()  # queued until after its deadline: not started
    with _naming(name):
        return _preprocess(path, name, limits, sample_fps, chunk_size, patch_limit, proc)


def _preprocess(path: VideoInput, name: str, limits: _Limits, sample_fps: float, chunk_size: int,
                patch_limit: Optional[int], proc: ProcessorConfig) -> MediaBatch:
    info = _probe(path, name, limits)
    for attempt in range(2):
        indices = sample_frame_indices(info.num_frames, info.fps, sample_fps)
        try:
            items = chunk_frames(_decode_selected(path, name, indices, limits), name, info.fps, indices,
                                 chunk_size, patch_limit, proc, limits.check_time)
        except _ShortStream as short:
            if short.decoded == 0:
                raise MediaError(f"{name}: the video stream has no decodable frames") from None
            if attempt == 1:
                raise MediaError(f"{name}: decoding gives a different number of frames each time "
                                 f"({info.num_frames}, then {short.decoded})") from None
            check_complete(name, info.num_frames / info.fps, short.decoded / info.fps, info.fps,
                            f"{info.num_frames} frames ({info.num_frames / info.fps:.2f} s)")
            # The container over-reported its frame count; the frames the decoder yields are the truth.
            info = VideoInfo(name, short.decoded, info.fps, info.width, info.height, info.codec, info.container,
                             "decoding")
            limits.check_length(info.num_frames, info.fps)
            continue
        return MediaBatch.concat(items)
    raise AssertionError("unreachable")


def probe_video(path: VideoInput, *, max_frames: Optional[int] = MAX_FRAMES,
                max_duration_s: Optional[float] = MAX_DURATION_S,
                max_frame_pixels: Optional[int] = MAX_FRAME_PIXELS, sample_fps: float = SAMPLE_FPS,
                max_fps: Optional[float] = MAX_FPS) -> VideoInfo:
    """Frame count, fps and size of a video, with the limits checked (decodes it when the container has no count)."""
    name, limits = _prepare(path, max_frames, max_duration_s, max_frame_pixels, sample_fps, max_fps=max_fps)
    with _naming(name):
        return _probe(path, name, limits)


def decode_work(path: VideoInput, *, name: Optional[str] = None, max_frame_pixels: Optional[int] = MAX_FRAME_PIXELS,
                max_fps: Optional[float] = MAX_FPS) -> Optional[int]:
    """What decoding a video will count against a `DecodeBudget`, from its header alone (no frame decoded): its
    frame count (or, for Matroska/WebM, its declared length at its frame rate) times `frame_work` of its frame
    size; None when the container declares no length. MediaError when it cannot be opened, or breaks
    `max_frame_pixels` or `max_fps` by its header."""
    name, limits = _prepare(path, None, None, max_frame_pixels, SAMPLE_FPS, name, max_fps)
    with _naming(name), limits.open(path) as source:
        limits.check_size(source.width, source.height)
        frames = source.reported_frames or (math.ceil(source.declared_s * source.fps) if source.declared_s else 0)
        return frames * frame_work(source.width * source.height) if frames > 0 else None


@contextmanager
def _naming(name: str) -> Iterator[None]:
    try:
        yield
    except MediaError as e:
        e.source = name
        raise


def _prepare(path: VideoInput, max_frames: Optional[int], max_duration_s: Optional[float],
             max_frame_pixels: Optional[int], sample_fps: float, name: Optional[str] = None,
             max_fps: Optional[float] = MAX_FPS) -> tuple[str, _Limits]:
    """Validate the options and the input before FFmpeg sees it: a clear message beats a demuxer's."""
    _check_positive("sample_fps", sample_fps)
    _check_positive("max_fps", max_fps, allow_none=True)
    _check_positive("max_frames", max_frames, integer=True, allow_none=True)
    _check_positive("max_duration_s", max_duration_s, allow_none=True)
    _check_positive("max_frame_pixels", max_frame_pixels, integer=True, allow_none=True)
    if not isinstance(path, (str, os.PathLike, bytes)):
        raise MediaError(f"<{type(path).__name__}>: unsupported video input; pass a path or bytes")
    name = name or _describe(path)
    if isinstance(path, bytes):
        if not path:
            raise MediaError(f"{name}: video is empty", name)
    else:
        p = Path(path)
        if not p.exists():
            raise MediaError(f"{name}: no such file", name)
        if not p.is_file():
            raise MediaError(f"{name}: not a regular file", name)
        if p.stat().st_size == 0:
            raise MediaError(f"{name}: file is empty", name)
    return name, _Limits(name, max_frames, max_duration_s, max_frame_pixels, float(sample_fps), max_fps)


def video_chunks(batch: MediaBatch, embeddings: Sequence[torch.Tensor]) -> list[VideoChunk]:
    """Pair a video's MediaBatch (from `preprocess_video`) with one embedding per item."""
    if batch.timestamps is None:
        raise ValueError("batch has no timestamps: it was not made by preprocess_video")
    if len(embeddings) != len(batch):
        raise ValueError(f"{len(embeddings)} embeddings for {len(batch)} chunks")
    grids = [tuple(int(v) for v in g) for g in batch.grid_thw.tolist()]
    return [VideoChunk(e, g, s, i) for i, (e, g, s) in enumerate(zip(embeddings, grids, batch.timestamps))]
