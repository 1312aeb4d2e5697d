"""Opening a video container the way bivit allows it: only the demuxers of `VIDEO_DEMUXERS` (and the still-image
pipes, so that a still image gets its own message), no protocol at all (FFmpeg sees a file object, never a path,
so nothing nests another open), the stream and its frame rate read, the length the container declares for the
truncation check (`TRUNCATION_SLACK`), and anything PyAV raises turned into a MediaError naming the input
(docs/limits.md). Sampling and chunking the frames is `bivit.video`'s.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import BinaryIO, Iterator, Optional, Union

import av

from .errors import ConfigError, MediaError
from .fileio import open_regular

# The demuxers bivit reads videos with (FFmpeg names): the containers of `bivit.kinds.VIDEO_EXTENSIONS`.
VIDEO_DEMUXERS = ("mov", "matroska", "avi", "gif", "apng", "mpeg", "mpegvideo", "mpegts", "asf", "flv", "ogg",
                  "mxf", "yuv4mpegpipe", "hevc", "h264", "m4v", "ivf", "dv", "nut")
# Still-image demuxers read the given bytes only; allowed so that a still image gets its own message.
_STILL_DEMUXERS = ("image2pipe", *sorted(f for f in av.formats_available if f.endswith("_pipe")))
_OPEN_OPTIONS = {"format_whitelist": ",".join(VIDEO_DEMUXERS + _STILL_DEMUXERS),
                 "protocol_whitelist": "none"}  # no protocol has this name: nested opens are all refused
# A declared length the frames may fall short of before the video counts as truncated: a header off by a frame
# or two (edit lists, rounding) is not damage, half a video is. Missing more than max(FRAMES frames, SECONDS s)
# plus FRACTION of the declared length is truncation.
TRUNCATION_SLACK = {"frames": 2, "seconds": 0.5, "fraction": 0.02}

VideoInput = Union[str, os.PathLike, bytes]


def decoder_max_pixels(max_frame_pixels: int) -> int:
    """The frame size FFmpeg's decoder refuses before allocating a frame: 4x bivit's limit plus a 128x128
    block, so that no legal frame's coded size (each side aligned up to at most 128) reaches it."""
    return 4 * max_frame_pixels + 128 * 128


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


class Source:
    """An opened container and its video stream; a fresh one per decoding pass."""

    def __init__(self, src: VideoInput, name: str, max_frame_pixels: Optional[int] = None):
        self.name, self.max_frame_pixels = name, max_frame_pixels
        # A file object named by its descriptor: FFmpeg sees neither the path (no protocol is parsed from it)
        # nor its extension (bytes and paths are probed alike).
        try:
            self.file: BinaryIO = io.BytesIO(src) if isinstance(src, bytes) else open_regular(src)
        except OSError as e:
            raise MediaError(f"{name}: cannot read ({e.strerror or e})") from None
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
                if fmt in ("image2", "image2pipe") or fmt.endswith("_pipe"):
                    raise MediaError(f"{name}: is a still image ({fmt}), not a video; encode it as an image")
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

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_container(path: VideoInput, name: str) -> None:
    """Open a video's container and read its stream list (a video stream with a frame rate); no frame decoded."""
    with Source(path, name):
        pass


def check_complete(name: str, declared_s: float, covered_s: float, fps: float, declared: str) -> None:
    """MediaError when the frames cover clearly less than the container declares (see TRUNCATION_SLACK)."""
    slack = (max(TRUNCATION_SLACK["frames"] / fps, TRUNCATION_SLACK["seconds"])
             + TRUNCATION_SLACK["fraction"] * declared_s)
    if covered_s < declared_s - slack:
        raise MediaError(f"{name}: truncated or damaged: the container declares {declared}, its frames cover "
                         f"{covered_s:.2f} s")
