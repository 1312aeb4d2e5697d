"""Opening a video container the way bivit allows it: a still image refused from its first bytes before
FFmpeg sees it (`still_image`), then only the demuxers of `VIDEO_DEMUXERS`, no protocol at all (FFmpeg sees a file object, never a path,
so nothing nests another open), the stream and its frame rate read, frames above the size limit refused by
the decoder before it allocates them, the length the container declares for the
truncation check (`TRUNCATION_SLACK`), and anything PyAV raises turned into a MediaError naming the input
(docs/limits.md); and what decoding frames costs (`DecodeBudget`). Sampling and chunking the frames is
`bivit.media.video`'s.
"""

from __future__ import annotations

import io
import os
import threading
from contextlib import contextmanager
from fractions import Fraction
from typing import BinaryIO, Iterator, Optional, Union

import av

from ..base.fileio import open_regular
from ..errors import ConfigError, MediaError
from .kinds import _STILL_IMAGE_BRANDS as STILL_IMAGE_BRANDS  # what `media_kind` calls an image

# The demuxers bivit reads videos with (FFmpeg names): the containers of `bivit.media.kinds.VIDEO_EXTENSIONS`.
VIDEO_DEMUXERS = ("mov", "matroska", "avi", "gif", "apng", "mpeg", "mpegvideo", "mpegts", "asf", "flv", "ogg",
                  "mxf", "yuv4mpegpipe", "hevc", "h264", "m4v", "ivf", "dv", "nut")
# Only these demuxers: FFmpeg's still-image demuxers (png_pipe, webp_pipe, exr_pipe, psd_pipe, ... 38 of them)
# decode the picture while probing it (+982 MB for a 0.95 MB PNG), before bivit could say what it is; they are
# refused right after detection, and a still image is recognised by its first bytes before FFmpeg sees it.
_OPEN_OPTIONS = {"format_whitelist": ",".join(VIDEO_DEMUXERS),
                 "protocol_whitelist": "none"}  # no protocol has this name: nested opens are all refused
# The first bytes of still-image formats (the images bivit reads, and what FFmpeg's image pipes would parse).
_STILL_IMAGES = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"BM", "bmp"), (b"II*\x00", "tiff"),
                 (b"MM\x00*", "tiff"), (b"v/1\x01", "exr"), (b"8BPS", "psd"), (b"DDS ", "dds"), (b"qoif", "qoi"),
                 (b"\x00\x00\x00\x0cjP  ", "jpeg2000"), (b"\xff\x4f\xff\x51", "jpeg2000"), (b"\xff\x0a", "jpegxl"),
                 (b"\x00\x00\x00\x0cJXL ", "jpegxl"), (b"#?RADIANCE", "hdr"))
# PNG chunks read looking for an APNG's animation control (acTL, before the first IDAT).
_PNG_CHUNKS_READ = 64
# A declared length the frames may fall short of before the video counts as truncated: a header off by a frame
# or two (edit lists, rounding) is not damage, half a video is. Missing more than max(FRAMES frames, SECONDS s)
# plus FRACTION of the declared length is truncation.
TRUNCATION_SLACK = {"frames": 2, "seconds": 0.5, "fraction": 0.02}

VideoInput = Union[str, os.PathLike, bytes]


# What a decoded frame counts against `max_decoded_pixels` at least (a 128x128 frame): its fixed cost (FFmpeg's
# per-frame work, bivit's per-frame checks) is ~12 us, what ~1,700 pixels of a large frame cost; counted at 10x
# that, a video of tiny frames is charged for its frames, not its pixels.
FRAME_MIN_PIXELS = 128 * 128


class DecodeBudget:
    """Decoding work (frames x max(frame pixels, `FRAME_MIN_PIXELS`)) that one or several videos may do, charged
    as frames are decoded; thread-safe, so a request's videos, decoded in parallel, share one. A video over it
    raises a MediaError naming itself."""

    def __init__(self, limit: int):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"max_decoded_pixels must be a positive integer, got {limit!r}")
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def charge(self, pixels: int, name: str) -> None:
        with self._lock:
            self.used += pixels
            over = self.used > self.limit
        if over:
            raise MediaError(f"{name}: decoding its frames takes more than max_decoded_pixels={self.limit} "
                             f"pixels (frames decoded x their pixels, at least {FRAME_MIN_PIXELS} a frame)")


def frame_work(pixels: int) -> int:
    """What decoding one frame of `pixels` pixels counts against a `DecodeBudget`."""
    return max(pixels, FRAME_MIN_PIXELS)


def decoder_max_pixels(max_frame_pixels: int) -> int:
    """The frame size FFmpeg's decoder refuses before allocating a frame: 4x bivit's limit plus a 128x128
    block, so that no legal frame's coded size (each side aligned up to at most 128) reaches it."""
    return 4 * max_frame_pixels + 128 * 128


def still_image(head: bytes, file: BinaryIO) -> Optional[str]:
    """The still-image format `head` (a file's first bytes) starts like, or None; an APNG (acTL before its first
    IDAT, within the first `_PNG_CHUNKS_READ` chunks) is a video. `file` is read from its current position."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if len(head) >= 12 and head[4:8] == b"ftyp" and head[8:12] in STILL_IMAGE_BRANDS:
        return f"heif ({head[8:12].decode('latin-1')})"
    fmt = next((name for magic, name in _STILL_IMAGES if head.startswith(magic)), None)
    if fmt != "png":
        return fmt
    file.seek(8)
    for _ in range(_PNG_CHUNKS_READ):
        chunk = file.read(8)
        if len(chunk) < 8 or chunk[4:] == b"IDAT":
            break
        if chunk[4:] == b"acTL":
            return None
        file.seek(int.from_bytes(chunk[:4], "big") + 4, io.SEEK_CUR)
    return "png"


def _reason(e: BaseException) -> str:
    # FFmpeg errors carry the path in str(e); the strerror alone reads better after our own "name: " prefix.
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


@contextmanager
def translate_errors(name: str, doing: str) -> Iterator[None]:
    """Turn anything PyAV raises into a MediaError naming the input; bivit errors pass through."""
    try:
        yield
    except (MediaError, ConfigError):
        raise
    except (av.FFmpegError, OSError, EOFError, ValueError, IndexError, RuntimeError) as e:
        raise MediaError(f"{name}: {doing} failed, corrupt or unsupported video ({_reason(e)})") from None
    except MemoryError:
        raise MediaError(f"{name}: {doing} failed: not enough memory") from None


class Container:
    """An opened container and its video stream; a fresh one per decoding pass."""

    def __init__(self, src: VideoInput, name: str, max_frame_pixels: Optional[int] = None):
        self.name, self.max_frame_pixels = name, max_frame_pixels
        # A file object named by its descriptor: FFmpeg sees neither the path (no protocol is parsed from it)
        # nor its extension (bytes and paths are probed alike).
        try:
            self.file: BinaryIO = io.BytesIO(src) if isinstance(src, bytes) else open_regular(src)
        except OSError as e:
            raise MediaError(f"{name}: cannot read ({e.strerror or e})") from None
        try:
            still = still_image(self.file.read(16), self.file)
            self.file.seek(0)
        except BaseException:
            self.file.close()
            raise
        if still is not None:
            self.file.close()
            raise MediaError(f"{name}: is a still image ({still}), not a video; encode it as an image")
        with translate_errors(name, "opening"):
            try:
                self.container = av.open(self.file, mode="r", metadata_errors="ignore",
                                         container_options=_OPEN_OPTIONS)
            except av.error.ArgumentError:  # how FFmpeg refuses a detected format that is not on the whitelist
                self.file.close()
                raise MediaError(f"{name}: not a video container bivit reads (FFmpeg demuxers "
                                 f"{', '.join(VIDEO_DEMUXERS)})") from None
            except BaseException:
                self.file.close()
                raise
        try:
            with translate_errors(name, "reading the stream list"):
                fmt = self.container.format.name
                # Cover art in audio files is a 'video' stream with one picture: not a video.
                streams = [s for s in self.container.streams.video
                           if not s.disposition & av.stream.Disposition.attached_pic]
                if not streams:
                    raise MediaError(f"{name}: has no video stream")
                self.stream = streams[0]
                if max_frame_pixels is not None:
                    # FFmpeg's decoder checks every frame's size against this before allocating it: a stream
                    # whose header says 64x48 may hold 16000x16000 frames (+1.5 GB for one MJPEG frame). It
                    # checks coded sizes (aligned up to 16-128 pixels a side), hence the margin; bivit checks
                    # each decoded frame's own size against the exact limit.
                    self.stream.codec_context.options = {"max_pixels": str(decoder_max_pixels(max_frame_pixels))}
                self.format = fmt
                self.codec = self.stream.codec_context.name
                self.width = self.stream.codec_context.width
                self.height = self.stream.codec_context.height
                self.reported_frames = int(self.stream.frames or 0)
                rate = self.stream.average_rate or self.stream.guessed_rate
                if rate is None or not rate > 0:
                    raise MediaError(f"{name}: the video stream reports no frame rate")
                self.fps = float(rate)
                self.declared_s = self._declared_seconds()
                # Keep PyAV's default slice threading: with frame threading ("AUTO"/"FRAME") FFmpeg drops the
                # decode error of a truncated file and just ends the stream early, hiding the damage.
        except BaseException:
            self.close()
            raise

    def _declared_seconds(self) -> Optional[float]:
        """How long a container without a frame count says the video stream lasts, where it stores it for the
        video itself: Matroska/WebM's per-track DURATION tag, or its segment duration when the file holds one
        stream (never an FFmpeg estimate from the bitrate, never the longest of several streams)."""
        if "matroska" not in self.format:
            return None
        tag = self.stream.metadata.get("DURATION")
        if tag:
            try:
                h, m, sec = tag.split(":")
                return int(h) * 3600 + int(m) * 60 + float(sec)
            except ValueError:
                return None
        if len(self.container.streams) == 1 and self.container.duration:
            return self.container.duration / av.time_base
        return None

    def frames(self) -> Iterator[av.VideoFrame]:
        with translate_errors(self.name, "decoding"):
            try:
                yield from self.container.decode(self.stream)
            except av.error.ArgumentError as e:  # how the decoder refuses a frame above `max_pixels`
                if self.max_frame_pixels is None:
                    raise
                raise MediaError(f"{self.name}: decoding failed: a frame is larger than max_frame_pixels="
                                 f"{self.max_frame_pixels}, or the stream is corrupt ({_reason(e)})") from None

    def close(self) -> None:
        try:
            self.container.close()
        except Exception:  # closing a half-read container must never mask the real error
            pass
        self.file.close()

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_container(path: VideoInput, name: str) -> None:
    """Open a video's container and read its stream list (a video stream with a frame rate); no frame decoded."""
    with Container(path, name):
        pass


def check_complete(name: str, declared_s: float, covered_s: float, fps: float, declared: str) -> None:
    """MediaError when the frames cover clearly less than the container declares (see TRUNCATION_SLACK)."""
    slack = (max(TRUNCATION_SLACK["frames"] / fps, TRUNCATION_SLACK["seconds"])
             + TRUNCATION_SLACK["fraction"] * declared_s)
    if covered_s < declared_s - slack:
        raise MediaError(f"{name}: truncated or damaged: the container declares {declared}, its frames cover "
                         f"{covered_s:.2f} s")


def timestamp_rate(count: int, first: Optional[Fraction], last: Optional[Fraction], fps: float) -> float:
    """The average frame rate a video of `count` frames is sampled by (Kimi's processor samples by "the average
    frame rate", docs/model.md): the stream's declared `fps`, unless its frames' own timestamps (the first and
    the last, in seconds) span clearly another length (beyond `TRUNCATION_SLACK`), then theirs, (count - 1) /
    span. A variable-rate Matroska file declares its nominal rate (40 frames over 18 s, declared 1000 fps:
    sampled by it, one frame of the 18 s); a constant-rate one declares its own rate, which is kept bit for bit."""
    if count < 2 or first is None or last is None or not last > first:
        return fps
    span = float(last - first)
    slack = max(TRUNCATION_SLACK["frames"] / fps, TRUNCATION_SLACK["seconds"]) + TRUNCATION_SLACK["fraction"] * span
    return fps if abs((count - 1) / fps - span) <= slack else (count - 1) / span
