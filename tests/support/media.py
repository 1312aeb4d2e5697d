"""Real test media written with PyAV and Pillow: videos whose frames say which frame they are, and images.

Every video frame carries its own index as a 4x4 grid of black/white blocks (16 bits, row-major, most
significant bit first). Black and white survive yuv420p subsampling, lossy codecs at our settings and the GIF
palette, so `read_frame_index` recovers the index from a decoded frame: tests can check *which* frames a
decoder sampled, not just how many.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from fractions import Fraction
from pathlib import Path
from typing import Callable, Union

import av
import numpy as np
from PIL import Image

GRID = 4  # blocks per side of the index pattern
BITS = GRID * GRID

PathLike = Union[str, os.PathLike]


def frame_pattern(index: int, size: tuple[int, int]) -> np.ndarray:
    """HxWx3 uint8 frame showing `index` as a 4x4 grid of black (0) / white (1) blocks; size is (w, h)."""
    if not 0 <= index < 2**BITS:
        raise ValueError(f"frame index {index} does not fit in {BITS} bits")
    w, h = size
    bits = [(index >> (BITS - 1 - k)) & 1 for k in range(BITS)]
    grid = np.array(bits, dtype=np.uint8).reshape(GRID, GRID) * 255
    # Block edges at round(k * side / GRID) so any frame size works, not just multiples of 4.
    rows = np.minimum(np.arange(h) * GRID // h, GRID - 1)
    cols = np.minimum(np.arange(w) * GRID // w, GRID - 1)
    frame = grid[rows[:, None], cols[None, :]]
    return np.repeat(frame[:, :, None], 3, axis=2)


def random_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 array of random pixels, distinct per (h, w, seed)."""
    return np.random.default_rng(seed * 7919 + h * 31 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)


def mixed_inputs(folder: PathLike, image_sizes: list[tuple[int, int]], seed: int, frames: int, fps: int) -> list[Path]:
    """PNG files of random pixels, one per (h, w) of `image_sizes` (seeds `seed`, `seed` + 1, ...), then an 84x56
    video of `frames` frames at `fps`, written into `folder`: the inputs of a test that encodes images and a
    video across processes."""
    folder = Path(folder)
    paths = []
    for i, (h, w) in enumerate(image_sizes):
        paths.append(folder / f"im{i}.png")
        Image.fromarray(random_image(h, w, seed=seed + i)).save(paths[-1])
    return paths + [make_video(folder / "clip.mp4", frames=frames, fps=fps, size=(84, 56))]


def png_bytes(w: int, h: int, seed: int) -> bytes:
    """A w x h RGB PNG of random pixels (distinct seeds give distinct bytes, so no cache hits across tests)."""
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def read_frame_index(frame: Union[Image.Image, np.ndarray]) -> int:
    """Inverse of `frame_pattern` for a decoded (possibly lossy) frame: threshold the centre of each block."""
    arr = np.asarray(frame.convert("RGB") if isinstance(frame, Image.Image) else frame, dtype=np.float64)
    h, w = arr.shape[:2]
    value = 0
    for r in range(GRID):
        for c in range(GRID):
            # The middle half of the block, away from edges where codecs blur.
            y0, y1 = (4 * r + 1) * h // (4 * GRID), (4 * r + 3) * h // (4 * GRID)
            x0, x1 = (4 * c + 1) * w // (4 * GRID), (4 * c + 3) * w // (4 * GRID)
            bit = arr[y0 : max(y1, y0 + 1), x0 : max(x1, x0 + 1)].mean() > 127.5
            value = (value << 1) | int(bit)
    return value


# Codec per extension; the first encoder this PyAV build has wins.
_CODECS = {
    ".mp4": ["libx264", "h264", "mpeg4"],
    ".m4v": ["libx264", "h264", "mpeg4"],
    ".mov": ["libx264", "h264", "mpeg4"],
    ".mkv": ["libx264", "h264", "mpeg4"],
    ".avi": ["mpeg4"],
    ".webm": ["libvpx", "libvpx-vp9"],
    ".gif": ["gif"],
}
# High-quality settings so the index pattern survives; they do not change what a decoder must handle.
_OPTIONS = {
    "libx264": {"crf": "10", "preset": "ultrafast"},
    "h264": {"crf": "10"},
    "mpeg4": {"qscale": "2"},
    "libvpx": {"crf": "4", "b": "2M"},
    "libvpx-vp9": {"crf": "4", "b": "0", "deadline": "realtime", "cpu-used": "8"},
}


def _available(codec: str) -> bool:
    try:
        av.codec.Codec(codec, "w")
        return True
    except Exception:
        return False


def _pick_codec(path: Path, codec: str | None) -> str:
    if codec is not None:
        return codec
    for name in _CODECS.get(path.suffix.lower(), []):
        if _available(name):
            return name
    raise ValueError(f"no encoder available for {path.suffix!r}")


def _rate(fps: Union[int, float, Fraction]) -> Fraction:
    return fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1_000_000)


def make_video(path: PathLike, frames: int = 8, fps: Union[int, float, Fraction] = 10,
               size: tuple[int, int] = (84, 56), codec: str | None = None,
               content: Callable[[int, tuple[int, int]], np.ndarray] | None = None,
               options: dict[str, str] | None = None, container_options: dict[str, str] | None = None) -> Path:
    """Write a real video of `frames` frames at `fps` (a Fraction for exact NTSC rates), size (w, h).

    The container follows the extension (.mp4/.m4v/.mov/.mkv -> H.264 or MPEG-4 part 2, .avi -> MPEG-4,
    .webm -> VP8, .gif -> GIF). `content(index, size)` gives frame `index` as HxWx3 uint8; default
    `frame_pattern`. Returns the path.
    """
    path = Path(path)
    codec = _pick_codec(path, codec)
    content = content or frame_pattern
    w, h = size
    with av.open(str(path), "w", options=container_options or {}) as out:
        stream = out.add_stream(codec, rate=_rate(fps), options={**_OPTIONS.get(codec, {}), **(options or {})})
        stream.width, stream.height = w, h
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        for i in range(frames):
            _mux(out, stream, av.VideoFrame.from_ndarray(np.ascontiguousarray(content(i, size)), format="rgb24"))
        _mux(out, stream, None)
    return path


def _mux(out, stream, frame) -> None:
    """Encode one frame (None: flush the encoder) and write its packets."""
    for packet in stream.encode(frame):
        out.mux(packet)


def make_zero_frame_video(path: PathLike) -> Path:
    """A valid .mkv/.webm whose video stream has no frames (only an audio stream carries packets)."""
    path = Path(path)
    webm = path.suffix.lower() == ".webm"
    with av.open(str(path), "w") as out:
        video = out.add_stream("libvpx" if webm else "mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        audio = out.add_stream("libopus" if webm else "aac", rate=48000)
        out.start_encoding()
        samples = np.zeros((1, 960 * 4), np.int16 if webm else np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="s16" if webm else "fltp", layout="mono")
        frame.sample_rate = 48000
        _mux(out, audio, frame)
        _mux(out, audio, None)
    return path


def make_audio_only(path: PathLike) -> Path:
    """A valid .mp4/.m4a holding one short AAC stream and no video stream."""
    path = Path(path)
    with av.open(str(path), "w", format="mp4") as out:
        audio = out.add_stream("aac", rate=48000)
        out.start_encoding()
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024 * 4), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 48000
        _mux(out, audio, frame)
        _mux(out, audio, None)
    return path


def make_image(path: PathLike, size: tuple[int, int] = (84, 56), mode: str = "RGB", seed: int = 0,
               index: int | None = None) -> Path:
    """Write an image with Pillow (format from the extension): random pixels, or `frame_pattern(index)`."""
    path = Path(path)
    w, h = size
    if index is not None:
        arr = frame_pattern(index, size)
        img = Image.fromarray(arr, "RGB").convert(mode)
    else:
        rng = np.random.default_rng(seed)
        channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
        arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        img = Image.fromarray(arr[:, :, 0] if channels == 1 else arr, mode)
    img.save(path)
    return path


def overstate_avi_frame_count(path: PathLike, frames: int) -> Path:
    """Patch an .avi written by `make_video` so its headers claim `frames` frames (a lying container count).

    FFmpeg's avi demuxer reports the video stream header's `dwLength` as the stream's frame count; the main
    header's `dwTotalFrames` is patched too so both agree.
    """
    path = Path(path)
    data = bytearray(path.read_bytes())
    strh = data.find(b"strh")
    if strh < 0 or data[strh + 8 : strh + 12] != b"vids":
        raise ValueError(f"{path}: no video stream header found")
    # strh payload: fccType, fccHandler, dwFlags, wPriority+wLanguage, dwInitialFrames, dwScale, dwRate,
    # dwStart, dwLength (bytes 32..36 of the payload).
    data[strh + 8 + 32 : strh + 8 + 36] = struct.pack("<I", frames)
    avih = data.find(b"avih")
    data[avih + 8 + 16 : avih + 8 + 20] = struct.pack("<I", frames)  # dwTotalFrames
    path.write_bytes(bytes(data))
    return path


def blank_png(width: int, height: int, color_type: int = 0) -> bytes:
    """A black PNG of any size, compressed as it is written (a 1x60,000,000 grey one is 117 KB, written in a
    second without ever holding its 120 MB of rows)."""
    row = b"\x00" * (1 + width * {0: 1, 2: 3, 4: 2, 6: 4}[color_type])
    rows_per = max(1, (1 << 20) // len(row))
    z, parts, left = zlib.compressobj(9), [], height
    while left:
        n = min(rows_per, left)
        parts.append(z.compress(row * n))
        left -= n
    parts.append(z.flush())

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def tiny_video(frames: int, fps: int, size: int = 16) -> bytes:
    """An H.264 MP4 of `frames` black `size` x `size` frames at `fps` (~20 us a frame to make)."""
    buf = io.BytesIO()
    out = av.open(buf, "w", format="mp4")
    stream = out.add_stream("libx264", rate=Fraction(fps))
    stream.width = stream.height = size
    stream.pix_fmt = "yuv420p"
    stream.options = {"preset": "ultrafast", "tune": "zerolatency"}
    frame = av.VideoFrame.from_ndarray(np.zeros((size, size, 3), np.uint8), format="rgb24").reformat(format="yuv420p")
    for i in range(frames):
        frame.pts = i
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)
    out.close()
    return buf.getvalue()
