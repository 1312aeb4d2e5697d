"""Reading image inputs within limits: the formats bivit decodes (`IMAGE_FORMATS`), an image whose header claims
more than `MAX_IMAGE_PIXELS` pixels or a side over `MAX_IMAGE_SIDE`, or whose decoding and preprocessing would
take more than `MAX_IMAGE_BYTES` of memory (`image_work_bytes`) refused before decoding, decoding stopped at a
deadline, and every decoder failure a MediaError naming the input (docs/limits.md). Preprocessing the decoded
image is `bivit.media.pixels`'s.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import re
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..base.fileio import read_regular
from ..checkpoint.preprocess_config import ProcessorConfig
from ..errors import MediaError
from .grids import image_grid, navit_size, processing_of

# Refuse images whose header claims more pixels than this before decoding them (decompression bombs).
# K3's 65536 patches of 14x14 is ~12.8 MP after resizing; 200 MP leaves room for any real photo or scan.
MAX_IMAGE_PIXELS = 200_000_000
# Refuse an image with a side longer than this before decoding. Shrinking a side of n pixels to the model's at
# most 7,168 takes bicubic weights of ~32 bytes per pixel of it, and Pillow keeps a row pointer per row: a 39 KB
# PNG of 40,000,000x1 pixels (within MAX_IMAGE_BYTES) peaked at 1.4 GB. 262,144 admits a 1080-wide scrolling
# screenshot 240 screens long (its weights: 8 MB).
MAX_IMAGE_SIDE = 2**18
# Refuse images whose decoding and preprocessing would take more memory than this (`image_work_bytes`, from the
# header, before decoding): pixels alone do not bound it (a 1x60,000,000 PNG of 117 KB asks for ~3.7 GB, half of
# it resize weights). 2 GiB admits a 200 MP RGB photo (~1.1 GB for K2.x, ~1.7 GB for K3); other modes count two
# more full-size copies (conversion, alpha), so a 200 MP RGBA image (~2.6 GB) is refused.
MAX_IMAGE_BYTES = 2 * 2**30
# The formats bivit decodes (Pillow format names); anything else, EPS through Ghostscript included, is refused
# before a plugin parses more than the magic bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF")  # JPEG includes MPO (multi-picture JPEG)
# Scans of one JPEG. libjpeg walks every block of a scan's components once per scan, even an empty one (10
# bytes): 1 MB of empty scans over a 5500x5500 image is ~18 minutes of CPU. Encoders write one scan per
# component at most (baseline), 10 (libjpeg's progressive script) or a few more (mozjpeg's optimised scans).
MAX_JPEG_SCANS = 100
# Chunks of one PNG (Pillow parses every chunk before and after the pixels: 5M empty chunks in 60 MB took 11.5 s
# and +850 MB before anything was decoded). Data arrives in IDAT chunks of 8-64 KB: 262,144 of 8 KB is 2 GiB,
# the most bivit reads of one image; other chunks (text, colour profile, ...) number a few dozen in real files.
MAX_PNG_CHUNKS = 2**18
MAX_PNG_OTHER_CHUNKS = 1024
# Values of one TIFF tag (Pillow builds a tuple of them when it opens the file: one tag of 15M values took 1.3 s
# and +1.2 GB). The largest real ones are the strip or tile offsets and byte counts: 2^20 tiles of 16x16 is
# 268 MP, more than MAX_IMAGE_PIXELS.
MAX_TIFF_TAG_VALUES = 2**20

ImageInput = Union[Image.Image, np.ndarray, str, os.PathLike, bytes]


def input_name(src: object) -> str:
    """How messages call an image input that has no name given: its path, `<N bytes>` or `<TypeName>`."""
    if isinstance(src, (str, os.PathLike)):
        return str(src)
    if isinstance(src, bytes):
        return f"<{len(src)} bytes>"
    return f"<{type(src).__name__}>"


def check_deadline(deadline: float | None, name: str, what: str = "the image") -> None:
    """MediaError once `deadline` (a `time.monotonic()` value) has passed: nobody waits for the result any more."""
    if deadline is not None and time.monotonic() > deadline:
        raise MediaError(f"{name}: decoding stopped at its deadline ({what} takes too long to decode)", name)


# Pillow's own bomb guard is a process-wide setting (a warning above 89.5 MP, an error above 179 MP, both below
# bivit's limits, and checked again while some formats decode, TIFF and GIF among them). bivit switches it off
# while it parses a header, and while it decodes an image above Pillow's limit, after checking the image against
# its own limits; reference-counted under a lock, so concurrent decodes never restore the wrong value and the
# guard is back as soon as no such decode runs.
_PIL_GUARD = threading.Lock()
_guard_holders = 0
_guard_saved: int | None = None


@contextmanager
def _pillow_guard_off() -> Iterator[None]:
    global _guard_holders, _guard_saved
    with _PIL_GUARD:
        if _guard_holders == 0:
            _guard_saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        _guard_holders += 1
    try:
        yield
    finally:
        with _PIL_GUARD:
            _guard_holders -= 1
            if _guard_holders == 0:
                Image.MAX_IMAGE_PIXELS = _guard_saved


def _pillow_limit() -> int | None:
    """Pillow's own pixel limit as its user set it (not bivit's temporary None)."""
    with _PIL_GUARD:
        return _guard_saved if _guard_holders else Image.MAX_IMAGE_PIXELS


class _Encoded(io.BytesIO):
    """An image's encoded bytes as Pillow reads them: every read first checks the deadline, so decoding formats
    that Pillow feeds block by block (PNG, JPEG, BMP, GIF) stops within a block of it. Once `stops` is set (the
    offsets where a JPEG's scans start), no read crosses one: libjpeg is handed one scan at a time, so the
    deadline is checked between scans, whatever few bytes a scan takes."""

    def __init__(self, data: bytes, name: str, deadline: float | None):
        super().__init__(data)
        self.name_, self.deadline = name, deadline
        self.stops: list[int] = []

    def read(self, size: int | None = -1) -> bytes:
        check_deadline(self.deadline, self.name_)
        pos = self.tell()
        stop = bisect.bisect_right(self.stops, pos)
        if stop < len(self.stops):
            room = self.stops[stop] - pos
            size = room if size is None or size < 0 else min(size, room)
        return super().read(size)


# A marker in entropy-coded data: 0xFF not followed by a stuffed zero or a restart marker (RST0-7).
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7]")


def jpeg_scans(data: bytes) -> list[int]:
    """The offsets of the start-of-scan markers of the first image of a JPEG (up to its EOI), walking the
    marker segments by their lengths, so a thumbnail inside an APP segment is skipped. Stops early past
    MAX_JPEG_SCANS + 1; a malformed layout ends the walk (the decoder then says what is wrong)."""
    scans: list[int] = []
    pos = 2  # after SOI
    n = len(data)
    while pos + 1 < n and len(scans) <= MAX_JPEG_SCANS:
        if data[pos] != 0xFF:
            break
        while pos + 1 < n and data[pos + 1] == 0xFF:  # fill bytes
            pos += 1
        if pos + 1 >= n:
            break
        marker = data[pos + 1]
        if marker == 0xD9:  # EOI
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length
            pos += 2
            continue
        if pos + 4 > n:
            break
        end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker != 0xDA:
            pos = end
            continue
        scans.append(pos)
        found = _JPEG_MARKER.search(data, end)
        if found is None:
            break
        pos = found.start()
    return scans


# ---------------------------------------------------------------------------------- memory of one image
# Bytes per pixel Pillow stores for a mode (every mode not listed takes 4).
_PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}
# Arrays normalisation holds per padded output pixel: two uint8 copies (padded, stacked), float64 x/255 and its
# float32 copy, the float32 patches (3 channels each).
_NORMALIZE_BYTES = 3 * (1 + 1 + 8 + 4 + 4)
# Python objects, numpy temporaries and allocator slack of one image, whatever its size.
_FIXED_BYTES = 32 * 2**20


def pillow_bytes(width: int, height: int, mode: str = "RGBA") -> int:
    """Memory Pillow holds for one image: its pixels and a pointer per row (which dominates a 1-pixel-wide one)."""
    return height * (width * _PIXEL_BYTES.get(mode, 4) + 8)


def _bicubic_bytes(size_in: int, size_out: int) -> int:
    """Pillow's bicubic filter weights for resizing one axis: `size_out` rows of ceil(2 * scale) * 2 + 1 doubles.
    About 32 bytes per input pixel when shrinking a lot: 1.9 GB for a 60,000,000-pixel-long side."""
    support = 2.0 * max(size_in / size_out, 1.0)
    return size_out * ((math.ceil(support) * 2 + 1) * 8 + 8)


def _decoder_bytes(img: Image.Image) -> tuple[int, int]:
    """Memory a format's decoder takes beyond the image it fills: (while it decodes, kept with the decoded image);
    (0, 0) for formats decoded row by row."""
    w, h = img.size
    fmt = img.format
    if fmt in ("JPEG", "MPO") and img.info.get("progressive"):
        # libjpeg keeps every DCT coefficient (2 bytes) of every component of a progressive JPEG, MCU-padded.
        return 2 * len(img.getbands()) * (-(-w // 16) * 16) * (-(-h // 16) * 16), 0
    if fmt == "WEBP":
        # Pillow keeps libwebp's decoder (its canvases) and the RGBA it returned as long as the image lives.
        return 0, 24 * w * h
    if fmt == "GIF":
        return 8 * w * h, 0  # the frame and its palette conversion
    if fmt == "TIFF":
        tags = img.tag_v2
        rgba = 4 * w * h if tags.get(262) == 6 and tags.get(259) in (6, 7) else 0  # YCbCr JPEG: decoded as RGBA
        try:
            samples = int(tags.get(277, 1))
            bits = tags.get(258, (8,))
            bits = tuple(bits) if isinstance(bits, (tuple, list)) else (bits,)
            bits_per_pixel = sum(map(int, bits)) if len(bits) >= samples else int(bits[0]) * samples
            if 322 in tags and 323 in tags:  # one tile at a time
                block = int(tags[322]) * int(tags[323])
            else:  # one strip at a time; a missing RowsPerStrip means one strip of the whole image
                block = w * min(h, int(tags.get(278, h)))
        except (TypeError, ValueError, IndexError):  # tags Pillow parsed but that make no sense: assume the worst
            bits_per_pixel, block = 64, w * h
        return -(-block * bits_per_pixel // 8) + rgba, 0
    return 0, 0


def image_work_bytes(width: int, height: int, mode: str = "RGB", processing: ProcessorConfig | None = None,
                     decoder: tuple[int, int] = (0, 0)) -> int:
    """An upper bound of the memory (bytes) decoding an image and preprocessing it for the model takes, beyond
    its encoded bytes: the decoded image; the decoder's working memory (`decoder`: while decoding, and kept with
    the image; `_decoder_bytes`); then two full-size copies for a mode other than RGB (conversion, alpha
    handling), the resize's filter weights and intermediate image, and normalisation at the resized size.
    Checked against MAX_IMAGE_BYTES before decoding; tests measure the peak RSS against it per format and path."""
    p = processing_of(processing)
    decoded = pillow_bytes(width, height, mode) + decoder[1]
    copies = 0 if mode == "RGB" else 2 * pillow_bytes(width, height)
    new_w, new_h = navit_size(width, height, p.in_patch_limit, p.patch_size, p.patch_limit_on_one_side)
    resize = 0
    if (new_w, new_h) != (width, height):
        resize = (_bicubic_bytes(width, new_w) + _bicubic_bytes(height, new_h) + pillow_bytes(new_w, new_h)
                  + (pillow_bytes(new_w, height) if new_w != width else 0))
    grid_h, grid_w = image_grid(width, height, p)
    normalize = grid_h * grid_w * p.patch_size ** 2 * _NORMALIZE_BYTES
    return decoded + max(decoder[0], copies + resize + normalize) + _FIXED_BYTES


def _check_work(size: tuple[int, int], mode: str, name: str, max_bytes: int | None,
                processing: ProcessorConfig | None, decoder: tuple[int, int] = (0, 0)) -> None:
    if max_bytes is None:
        return
    w, h = size
    if processing is None:  # decoding only (`load_image`)
        need = pillow_bytes(w, h, mode) + sum(decoder) + _FIXED_BYTES
    else:
        need = image_work_bytes(w, h, mode, processing, decoder)
    if need > max_bytes:
        raise MediaError(f"{name}: a {w}x{h} {mode} image needs about {need} bytes of memory to decode"
                         f"{'' if processing is None else ' and preprocess'}, more than the limit of {max_bytes} bytes")


# --------------------------------------------------------------------------------------------- loading

def _png_chunks(data: bytes) -> tuple[int, int]:
    """(chunks, chunks other than IDAT) of a PNG, walked by their lengths up to IEND; the walk stops past the
    limits (MAX_PNG_CHUNKS, MAX_PNG_OTHER_CHUNKS)."""
    pos, chunks, other = 8, 0, 0
    while pos + 8 <= len(data) and chunks <= MAX_PNG_CHUNKS and other <= MAX_PNG_OTHER_CHUNKS:
        kind = data[pos + 4:pos + 8]
        chunks += 1
        other += kind != b"IDAT"
        if kind == b"IEND":
            break
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")
    return chunks, other


def _tiff_largest_tag(data: bytes) -> int:
    """The most values one tag of a TIFF's first directory holds (classic TIFF and BigTIFF); 0 if the layout
    cannot be read (Pillow then says what is wrong)."""
    order = "little" if data[:2] == b"II" else "big"
    big = int.from_bytes(data[2:4], order) == 43
    if big:
        head, entry, size = 8, 20, 8
        ifd = int.from_bytes(data[8:16], order)
    else:
        head, entry, size = 2, 12, 4
        ifd = int.from_bytes(data[4:8], order)
    if ifd + head > len(data):
        return 0
    entries = int.from_bytes(data[ifd:ifd + head], order)
    largest = 0
    for k in range(entries):
        at = ifd + head + k * entry
        if at + entry > len(data):
            break
        largest = max(largest, int.from_bytes(data[at + 4:at + 4 + size], order))
    return largest


def _check_structure(data: bytes, name: str) -> None:
    """Refuse, from the bytes alone, a file whose parsing alone would cost more than any real image's: too many
    PNG chunks, a TIFF tag with too many values. JPEG scans are counted once the header says it is a JPEG."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        chunks, other = _png_chunks(data)
        if chunks > MAX_PNG_CHUNKS or other > MAX_PNG_OTHER_CHUNKS:
            raise MediaError(f"{name}: a PNG of more than {MAX_PNG_CHUNKS} chunks, or more than "
                             f"{MAX_PNG_OTHER_CHUNKS} besides its image data")
    elif data[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        values = _tiff_largest_tag(data)
        if values > MAX_TIFF_TAG_VALUES:
            raise MediaError(f"{name}: a TIFF tag of {values} values, more than the {MAX_TIFF_TAG_VALUES} bivit reads")


def _open_header(data: bytes, name: str, max_pixels: int, deadline: float | None = None) -> Image.Image:
    """Parse an image's header (no pixel decoding), in a format bivit reads, and refuse it above `max_pixels`."""
    _check_structure(data, name)
    fp = _Encoded(data, name, deadline)
    with _pillow_guard_off():
        img = Image.open(fp, formats=IMAGE_FORMATS)
    _check_pixels(img.size, name, max_pixels)
    if img.format in ("JPEG", "MPO"):
        scans = jpeg_scans(data)
        if len(scans) > MAX_JPEG_SCANS:
            raise MediaError(f"{name}: a JPEG of more than {MAX_JPEG_SCANS} scans (every scan makes the decoder "
                             "walk the whole image again)")
        fp.stops = scans
    return img


def load_image(src: ImageInput, max_pixels: int = MAX_IMAGE_PIXELS, name: str | None = None, *,
               max_bytes: int | None = MAX_IMAGE_BYTES, deadline: float | None = None) -> Image.Image:
    """Decode any accepted input into a PIL image in its own mode (alpha kept), or raise MediaError.

    `name` is how messages call the input (default: its path, or `<N bytes>`); it becomes `MediaError.source`.
    `max_bytes` bounds the memory decoding takes (`image_work_bytes` without preprocessing); `deadline` (a
    `time.monotonic()` value) stops decoding once it has passed.
    """
    return _named(name or input_name(src), _load_image, src, max_pixels, max_bytes, deadline, None)


def _named(name: str, fn: Callable, *args: Any) -> Any:
    try:
        return fn(name, *args)
    except MediaError as e:
        e.source = name
        raise


def _load_image(name: str, src: ImageInput, max_pixels: int, max_bytes: int | None, deadline: float | None,
                processing: ProcessorConfig | None) -> Image.Image:
    """`load_image`; with `processing`, `max_bytes` also covers preprocessing the image for it."""
    check_deadline(deadline, name)
    if isinstance(src, Image.Image):
        img = src
        _check_pixels(img.size, name, max_pixels)
        _check_work(img.size, img.mode, name, max_bytes, processing)
    elif isinstance(src, np.ndarray):
        if src.ndim != 3 or src.shape[2] != 3 or src.dtype != np.uint8:
            raise MediaError(f"{name}: numpy images must be HxWx3 uint8, got shape {src.shape} dtype {src.dtype}")
        if src.shape[0] == 0 or src.shape[1] == 0:
            raise MediaError(f"{name}: image has no pixels (shape {src.shape})")
        _check_pixels((src.shape[1], src.shape[0]), name, max_pixels)
        _check_work((src.shape[1], src.shape[0]), "RGB", name, max_bytes, processing)
        return Image.fromarray(np.ascontiguousarray(src), "RGB")
    elif isinstance(src, (str, os.PathLike, bytes)):
        img = _decode(input_bytes(src, name, max_bytes), name, max_pixels, max_bytes, deadline, processing)
    else:
        raise MediaError(f"{name}: unsupported input type; pass a PIL.Image, an HxWx3 uint8 array, bytes or a path")
    if img.width < 1 or img.height < 1:
        raise MediaError(f"{name}: image has no pixels ({img.width}x{img.height})")
    return img


def image_size(src: ImageInput, max_pixels: int = MAX_IMAGE_PIXELS, name: str | None = None) -> tuple[int, int]:
    """(width, height) of an image input; files and bytes are read up to their header only. `name`: as in
    `load_image`."""
    if isinstance(src, (str, os.PathLike, bytes)):
        name = name or input_name(src)
        return _decode(input_bytes(src, name, MAX_IMAGE_BYTES), name, max_pixels, None, None, None, load=False).size
    return load_image(src, max_pixels, name).size


@dataclass(frozen=True)
class ImageHeader:
    """What an encoded image's header says: its size and the memory decoding and preprocessing it will take."""

    width: int
    height: int
    work_bytes: int


def image_header(data: bytes, processing: ProcessorConfig | str | None = None, name: str | None = None,
                max_pixels: int = MAX_IMAGE_PIXELS) -> ImageHeader:
    """The header of an encoded image (nothing decoded); MediaError as decoding it would raise for a bad header."""
    name = name or input_name(data)
    proc = processing_of(processing)

    def header(name: str) -> ImageHeader:
        img = _decode(input_bytes(data, name), name, max_pixels, None, None, None, load=False)
        return ImageHeader(img.width, img.height, image_work_bytes(img.width, img.height, img.mode, proc,
                                                                   _decoder_bytes(img)))
    return _named(name, header)


def input_bytes(src: str | os.PathLike | bytes, name: str, max_bytes: int | None = None) -> bytes:
    """The bytes of an encoded image given as bytes or a path (a file larger than `max_bytes` is not read)."""
    if isinstance(src, bytes):
        data = src
    else:
        try:
            data = read_regular(src, max_bytes)  # a directory, FIFO or device is refused without blocking
        except FileNotFoundError:
            raise MediaError(f"{name}: no such file") from None
        except OSError as e:
            raise MediaError(f"{name}: cannot read ({e.strerror or e})") from None
    if not data:
        raise MediaError(f"{name}: file is empty")
    return data


def _decode(data: bytes, name: str, max_pixels: int, max_bytes: int | None, deadline: float | None,
            processing: ProcessorConfig | None, load: bool = True) -> Image.Image:
    """The image in `data`, its header checked against `max_pixels` and its memory against `max_bytes` (with
    `processing`: preprocessing included); its pixels decoded too when `load`. Whatever Pillow or a plugin
    raises becomes a MediaError naming the input."""
    try:
        img = _open_header(data, name, max_pixels, deadline)
        if load:
            _check_work(img.size, img.mode, name, max_bytes, processing, _decoder_bytes(img))
            limit = _pillow_limit()
            with _pillow_guard_off() if limit is not None and img.width * img.height > limit else nullcontext():
                img.load()
            check_deadline(deadline, name)
        return img
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(f"{name}: not an image format bivit reads ({', '.join(IMAGE_FORMATS)})") from None
    except MemoryError:
        raise MediaError(f"{name}: not enough memory to decode the image") from None
    except Exception as e:  # noqa: BLE001 - OSError, SyntaxError, ValueError, struct.error, ...: plugins vary
        raise MediaError(f"{name}: corrupt or truncated image ({e or type(e).__name__})") from None


def open_image(src: ImageInput, max_pixels: int = MAX_IMAGE_PIXELS, name: str | None = None) -> Image.Image:
    """Decode any accepted input into an RGB PIL image, alpha dropped (K2.5/K2.6's `convert("RGB")`)."""
    img = load_image(src, max_pixels, name)
    return img if img.mode == "RGB" else img.convert("RGB")


def _check_pixels(size: tuple[int, int], name: str, max_pixels: int) -> None:
    w, h = size
    if w * h > max_pixels:
        raise MediaError(f"{name}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (decompression bomb?)")
    if max(w, h) > MAX_IMAGE_SIDE:
        raise MediaError(f"{name}: {w}x{h}: a side of {max(w, h)} pixels exceeds the limit of {MAX_IMAGE_SIDE}")


def load_for_model(src: ImageInput, processing: ProcessorConfig | str | None, name: str,
                   max_pixels: int = MAX_IMAGE_PIXELS, *, max_bytes: int | None = MAX_IMAGE_BYTES,
                   deadline: float | None = None) -> Image.Image:
    """`load_image`, with `max_bytes` covering preprocessing the image for `processing` too (what
    `bivit.media.pixels.preprocess_images` decodes with)."""
    return _named(name, _load_image, src, max_pixels, max_bytes, deadline, processing_of(processing))
