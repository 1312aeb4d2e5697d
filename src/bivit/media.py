"""Image preprocessing exactly as the model's media processor does it (docs/model.md, "Images"), and the prompt
placeholders it writes.

Everything here is per item and independent of batching: pixels are a pure function of the input bytes and
the model's `ProcessorConfig` (`bivit.preprocess_config`). Video decoding lives in `bivit.video`; it reuses
`frames_to_item` so a video frame is processed the way an image is, with the per-frame budget.

Decoding reads only `IMAGE_FORMATS`, and refuses before decoding an image whose header claims more than
`MAX_IMAGE_PIXELS` pixels or whose decoding and preprocessing would take more than `MAX_IMAGE_BYTES` of memory
(`image_work_bytes`); every decoder failure is a MediaError naming the input (docs/limits.md).

Transparency (`alpha`): "model" does what the model's processor does (K2.5/K2.6 drop alpha with
`convert("RGB")`; K3 composites onto its `transparent_bg_config` background at its fill stage), "drop" always
drops it, "white" first does what vLLM's image loader does (an RGBA image pasted onto white with its alpha as
mask, other modes converted to RGB), then the model's processor.
"""

from __future__ import annotations

import io
import math
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .errors import ConfigError, MediaError
from .fileio import read_regular
from .preprocess_config import K25_PROCESSING, PROCESSING_PRESETS, ProcessorConfig, TransparentBg, check_alpha

PATCH_SIZE = K25_PROCESSING.patch_size
MERGE_KERNEL = K25_PROCESSING.merge_kernel_size
IN_PATCH_LIMIT = K25_PROCESSING.in_patch_limit
PATCH_LIMIT_ON_ONE_SIDE = K25_PROCESSING.patch_limit_on_one_side
# Refuse images whose header claims more pixels than this before decoding them (decompression bombs).
# K3's 65536 patches of 14x14 is ~12.8 MP after resizing; 200 MP leaves room for any real photo or scan.
MAX_IMAGE_PIXELS = 200_000_000
# Refuse images whose decoding and preprocessing would take more memory than this (`image_work_bytes`, from the
# header, before decoding): pixels alone do not bound it (a 1x60,000,000 PNG of 117 KB asks for ~3.7 GB, half of
# it resize weights). 2 GiB admits a 200 MP RGB photo (~1.1 GB for K2.x, ~1.7 GB for K3); other modes count two
# more full-size copies (conversion, alpha), so a 200 MP RGBA image (~2.6 GB) is refused.
MAX_IMAGE_BYTES = 2 * 2**30
# The formats bivit decodes (Pillow format names); anything else, EPS through Ghostscript included, is refused
# before a plugin parses more than the magic bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF")  # JPEG includes MPO (multi-picture JPEG)
MEDIA_PAD = "<|media_pad|>"

ImageInput = Union[Image.Image, np.ndarray, str, os.PathLike, bytes]


@dataclass
class MediaBatch:
    """Preprocessed items, packed: `pixel_values` float32 `[L, 3, 14, 14]`, `grid_thw` int64 `[n, 3]`.

    Item i owns rows `offsets[i]:offsets[i+1]` of `pixel_values` (t*h*w patches, frame-major then row-major).
    `timestamps` is set for video chunks (one `HH:MM:SS.fff` string per item), else None. `sizes` holds
    each item's (width, height) before resizing (K3 writes it into the image placeholder).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    timestamps: list[str] | None = None
    sources: list[str] = field(default_factory=list)
    sizes: list[tuple[int, int] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.grid_thw.shape[0])

    @property
    def patch_counts(self) -> list[int]:
        return [int(t * h * w) for t, h, w in self.grid_thw.tolist()]

    @property
    def token_counts(self) -> list[int]:
        return [grid_tokens(h, w) for _, h, w in self.grid_thw.tolist()]

    def item(self, i: int) -> "MediaBatch":
        """Item i alone, as a batch of one."""
        start = sum(self.patch_counts[:i])
        stop = start + self.patch_counts[i]
        return MediaBatch(
            self.pixel_values[start:stop],
            self.grid_thw[i : i + 1].clone(),
            None if self.timestamps is None else [self.timestamps[i]],
            self.sources[i : i + 1],
            self.sizes[i : i + 1],
        )

    @staticmethod
    def concat(batches: Sequence["MediaBatch"]) -> "MediaBatch":
        if not batches:
            return MediaBatch(torch.zeros(0, 3, PATCH_SIZE, PATCH_SIZE), torch.zeros(0, 3, dtype=torch.int64))
        stamps = None
        if any(b.timestamps is not None for b in batches):
            stamps = [s for b in batches for s in (b.timestamps or [None] * len(b))]
        return MediaBatch(
            torch.cat([b.pixel_values for b in batches]),
            torch.cat([b.grid_thw for b in batches]),
            stamps,
            [s for b in batches for s in b.sources],
            [s for b in batches for s in (b.sizes or [None] * len(b))],
        )


def grid_tokens(h: int, w: int) -> int:
    """Tokens of an item with an h x w patch grid per frame: the 2x2 merger's output (frames are averaged)."""
    return (int(h) // MERGE_KERNEL) * (int(w) // MERGE_KERNEL)


def navit_size(width: int, height: int, patch_limit: int = IN_PATCH_LIMIT,
               patch_size: int = PATCH_SIZE, side_limit: int = PATCH_LIMIT_ON_ONE_SIDE) -> tuple[int, int]:
    """Size (w, h) the reference resizes an image to: fit the patch budget and the per-side limit, never upscale."""
    if width < 1 or height < 1:
        raise MediaError(f"image has no pixels ({width}x{height})")
    s1 = math.sqrt(patch_limit / (max(1, width // patch_size) * max(1, height // patch_size)))
    s2 = side_limit * patch_size / width
    s3 = side_limit * patch_size / height
    scale = min(1.0, s1, s2, s3)
    cap = side_limit * patch_size
    return min(max(1, int(width * scale)), cap), min(max(1, int(height * scale)), cap)


def padded_grid(width: int, height: int, patch_limit: int = IN_PATCH_LIMIT,
                patch_size: int = PATCH_SIZE, merge: int = MERGE_KERNEL,
                side_limit: int = PATCH_LIMIT_ON_ONE_SIDE) -> tuple[int, int]:
    """Patch grid (h, w) of an image of this size after resize and padding to a multiple of patch*merge."""
    new_w, new_h = navit_size(width, height, patch_limit, patch_size, side_limit)
    unit = patch_size * merge
    return (-(-new_h // unit) * merge, -(-new_w // unit) * merge)


def processing_of(processing: ProcessorConfig | str | None) -> ProcessorConfig:
    """A ProcessorConfig, or a preset name ("kimi-k2.6", "kimi-k3", ...), or None for K2.x's."""
    if processing is None:
        return PROCESSING_PRESETS["kimi-k2.6"]
    if isinstance(processing, str):
        if processing not in PROCESSING_PRESETS:
            raise ConfigError(f"model {processing!r}: expected one of {', '.join(PROCESSING_PRESETS)} "
                              "or a ProcessorConfig")
        return PROCESSING_PRESETS[processing]
    return processing


def image_grid(width: int, height: int, processing: ProcessorConfig, patch_limit: int | None = None
               ) -> tuple[int, int]:
    """Patch grid (h, w) of one image (or video frame, with its `patch_limit`) under the model's rules."""
    p = processing
    return padded_grid(width, height, p.in_patch_limit if patch_limit is None else patch_limit, p.patch_size,
                       p.merge_kernel_size, p.patch_limit_on_one_side)


def image_token_count(width: int, height: int, patch_limit: int | None = None, *,
                      model: ProcessorConfig | str | None = None) -> int:
    """Tokens the encoder produces for a `width` x `height` image, without loading it.

    `model`: a preset name ("kimi-k2.6" by default, "kimi-k3", ...) or an encoder's `processing`;
    `patch_limit` overrides its image patch budget.
    """
    return grid_tokens(*image_grid(width, height, processing_of(model), patch_limit))


# ------------------------------------------------------------------------------------------ placeholders

@dataclass(frozen=True)
class Placeholder:
    """The text the model's processor writes for one image or video chunk, and the embedding rows that
    replace its single `<|media_pad|>`."""

    text: str
    tokens: int

    def to_dict(self) -> dict:
        """The JSON form in `bivit encode` metadata and the service's item metadata."""
        return {"text": self.text, "tokens": self.tokens}


def image_placeholder_text(processing: ProcessorConfig, width: int, height: int) -> str:
    if processing.processor == "kimi_k3":
        return f"<|media_begin|>image {width}x{height}<|media_content|>{MEDIA_PAD}<|media_end|>"
    return f"<|media_begin|>image<|media_content|>{MEDIA_PAD}<|media_end|>"


def chunk_placeholder_text(timestamp: str) -> str:
    return f"{timestamp}<|media_begin|>video<|media_content|>{MEDIA_PAD}<|media_end|>"


def batch_placeholders(batch: MediaBatch, processing: ProcessorConfig) -> list[Placeholder]:
    """One Placeholder per item of a preprocessed batch (a video chunk when the item has a timestamp)."""
    out = []
    stamps = batch.timestamps or [None] * len(batch)
    sizes = batch.sizes or [None] * len(batch)
    for stamp, size, tokens in zip(stamps, sizes, batch.token_counts):
        if stamp is not None:
            out.append(Placeholder(chunk_placeholder_text(stamp), tokens))
        else:
            if size is None:
                raise ValueError("batch has no image sizes: it was not made by bivit's preprocessing")
            out.append(Placeholder(image_placeholder_text(processing, *size), tokens))
    return out


# ---------------------------------------------------------------------------------------------- decoding

def _describe(src: object) -> str:
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
    that Pillow feeds block by block (PNG, JPEG, BMP, GIF) stops within a block of it."""

    def __init__(self, data: bytes, name: str, deadline: float | None):
        super().__init__(data)
        self.name_, self.deadline = name, deadline

    def read(self, size: int | None = -1) -> bytes:
        check_deadline(self.deadline, self.name_)
        return super().read(size)


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

def _open_header(data: bytes, name: str, max_pixels: int, deadline: float | None = None) -> Image.Image:
    """Parse an image's header (no pixel decoding), in a format bivit reads, and refuse it above `max_pixels`."""
    with _pillow_guard_off():
        img = Image.open(_Encoded(data, name, deadline), formats=IMAGE_FORMATS)
    _check_pixels(img.size, name, max_pixels)
    return img


def load_image(src: ImageInput, max_pixels: int = MAX_IMAGE_PIXELS, name: str | None = None, *,
               max_bytes: int | None = MAX_IMAGE_BYTES, deadline: float | None = None) -> Image.Image:
    """Decode any accepted input into a PIL image in its own mode (alpha kept), or raise MediaError.

    `name` is how messages call the input (default: its path, or `<N bytes>`); it becomes `MediaError.source`.
    `max_bytes` bounds the memory decoding takes (`image_work_bytes` without preprocessing); `deadline` (a
    `time.monotonic()` value) stops decoding once it has passed.
    """
    return _named(name or _describe(src), _load_image, src, max_pixels, max_bytes, deadline, None)


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
        img = _decode(_input_bytes(src, name, max_bytes), name, max_pixels, max_bytes, deadline, processing)
    else:
        raise MediaError(f"{name}: unsupported input type; pass a PIL.Image, an HxWx3 uint8 array, bytes or a path")
    if img.width < 1 or img.height < 1:
        raise MediaError(f"{name}: image has no pixels ({img.width}x{img.height})")
    return img


def image_size(src: ImageInput, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(width, height) of an image input; files and bytes are read up to their header only."""
    if isinstance(src, (str, os.PathLike, bytes)):
        name = _describe(src)
        return _decode(_input_bytes(src, name, MAX_IMAGE_BYTES), name, max_pixels, None, None, None, load=False).size
    return load_image(src, max_pixels).size


@dataclass(frozen=True)
class ImageHeader:
    """What an encoded image's header says: its size and the memory decoding and preprocessing it will take."""

    width: int
    height: int
    work_bytes: int


def image_header(data: bytes, processing: ProcessorConfig | str | None = None, name: str | None = None,
                max_pixels: int = MAX_IMAGE_PIXELS) -> ImageHeader:
    """The header of an encoded image (nothing decoded); MediaError as decoding it would raise for a bad header."""
    name = name or _describe(data)
    proc = processing_of(processing)

    def header(name: str) -> ImageHeader:
        img = _decode(_input_bytes(data, name), name, max_pixels, None, None, None, load=False)
        return ImageHeader(img.width, img.height, image_work_bytes(img.width, img.height, img.mode, proc,
                                                                   _decoder_bytes(img)))
    return _named(name, header)


def _input_bytes(src: str | os.PathLike | bytes, name: str, max_bytes: int | None = None) -> bytes:
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


# ------------------------------------------------------------------------------------------ transparency

def _background(bg: TransparentBg, top: int, height: int, width: int) -> np.ndarray:
    """Rows `top:top+height` of the background: a flat colour, or squares of `chessboard_square_size` whose
    top-left one is white unless `chessboard_square_on_top_left`."""
    if bg.pattern != "chessboard":
        return np.full((height, width, 3), {"white": 255, "black": 0, "gray": 128}[bg.pattern], np.uint8)
    s = bg.chessboard_square_size
    parity = (np.arange(top, top + height)[:, None] // s + np.arange(width)[None, :] // s) % 2
    board = np.full((height, width, 3), bg.chessboard_white_value, np.uint8)
    board[parity == (1 if bg.chessboard_square_on_top_left else 0)] = bg.chessboard_gray_value
    return board


# Pixels composited at a time: the float32 arithmetic takes ~50 bytes a pixel, so a 200 MP image is done in
# bands rather than with 10 GB of temporaries (per-pixel arithmetic: the bands give the same bits).
_COMPOSITE_PIXELS = 1 << 20


def composite(img: Image.Image, bg: TransparentBg | None) -> Image.Image:
    """K3's `transparent_bg_config` compositing: RGB with alpha blended in float32 over the background, truncated.

    `bg=None` (or an image without alpha) is a plain `convert("RGB")`.
    """
    if bg is None:
        return img.convert("RGB")
    if img.mode == "RGB":
        return img
    if "A" not in img.getbands() and "transparency" not in img.info:
        return img.convert("RGB")
    out = Image.new("RGB", img.size)
    rows = max(1, _COMPOSITE_PIXELS // img.width)
    for top in range(0, img.height, rows):
        rgba = np.asarray(img.crop((0, top, img.width, min(top + rows, img.height))).convert("RGBA"))
        back = _background(bg, top, rgba.shape[0], rgba.shape[1])
        a = rgba[:, :, 3:4].astype(np.float32) / 255.0
        out.paste(Image.fromarray((a * rgba[:, :, :3] + (1 - a) * back).astype(np.uint8)), (0, top))
    return out


def paste_on_white(img: Image.Image) -> Image.Image:
    """vLLM's image loader: an RGBA image pasted onto white with its alpha as mask; other modes -> RGB."""
    if img.mode == "RGB":
        return img
    if img.mode != "RGBA":
        return img.convert("RGB")
    out = Image.new("RGB", img.size, (255, 255, 255))
    out.paste(img, mask=img.getchannel("A"))
    return out


# ------------------------------------------------------------------------------------------------ pixels

def _resize_pad(img: Image.Image, patch_limit: int, processing: ProcessorConfig,
                fill_after: TransparentBg | None | bool = False) -> np.ndarray:
    """Resize (PIL bicubic) to the navit size and zero pad; `fill_after` (K3's after_resize stage) is the
    background composited onto the resized image (None: plain RGB conversion), False: nothing to do."""
    p = processing
    new_w, new_h = navit_size(img.width, img.height, patch_limit, p.patch_size, p.patch_limit_on_one_side)
    if (new_w, new_h) != img.size:
        img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    if fill_after is not False:
        img = composite(img, fill_after)
    arr = np.asarray(img, dtype=np.uint8)
    unit = p.patch_size * p.merge_kernel_size
    pad_h, pad_w = (-new_h) % unit, (-new_w) % unit
    # Zero pad in uint8, so the padding normalises to exactly (0 - mean) / std like the reference.
    return np.pad(arr, ((0, pad_h), (0, pad_w), (0, 0)))


def _normalize(frames: np.ndarray, processing: ProcessorConfig) -> np.ndarray:
    # Bit-exact with the reference: x/255 in float64 stored as float32, then `x -= mean` and `x *= 1/std`
    # in place (each evaluated in float64 from the float32 value, stored as float32).
    x = (frames / 255.0).astype(np.float32)
    x -= np.array(processing.image_mean, dtype=np.float64)
    x *= 1.0 / np.array(processing.image_std, dtype=np.float64)
    return x


def _patchify(arrays: Sequence[np.ndarray], processing: ProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    if len({a.shape for a in arrays}) != 1:
        raise MediaError(f"frames of one chunk differ in size: {sorted({a.shape[:2] for a in arrays})}")
    x = _normalize(np.stack(arrays), processing)  # [T, H, W, C]
    p = processing.patch_size
    t, hh, ww, c = x.shape
    gh, gw = hh // p, ww // p
    x = x.reshape(t, gh, p, gw, p, c).transpose(0, 1, 3, 5, 2, 4)
    pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(t * gh * gw, c, p, p))
    return pixels, (t, gh, gw)


def frames_to_item(frames: Sequence[Image.Image], patch_limit: int = IN_PATCH_LIMIT,
                   processing: ProcessorConfig | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Resize, pad, normalise and patchify one item (an image, or the RGB frames of one video chunk).

    Returns pixels `[t*h*w, 3, p, p]` (frame-major, then row-major) and its grid `(t, h, w)`.
    """
    proc = processing_of(processing)
    return _patchify([_resize_pad(f if f.mode == "RGB" else f.convert("RGB"), patch_limit, proc) for f in frames],
                     proc)


def image_to_item(img: Image.Image, processing: ProcessorConfig | None = None, alpha: str = "model"
                  ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One decoded image (any mode) -> pixels and grid, with transparency handled as `alpha` says."""
    proc = processing_of(processing)
    check_alpha(alpha)
    fill_after: TransparentBg | None | bool = False
    if alpha == "white":
        img = paste_on_white(img)
    if alpha == "drop" or proc.processor == "kimi_k25":
        img = img if img.mode == "RGB" else img.convert("RGB")
    elif proc.transparent_bg_fill_stage == "before_resize":
        img = composite(img, proc.transparent_bg_config)
    else:  # K3's after_resize: the image is resized in its own mode, then composited
        fill_after = proc.transparent_bg_config
    try:
        arr = _resize_pad(img, proc.in_patch_limit, proc, fill_after)
    except (OSError, ValueError) as e:  # a mode Pillow cannot resize
        raise MediaError(f"cannot resize a {img.mode} image ({e})") from None
    except MemoryError:
        raise MediaError(f"not enough memory to resize a {img.width}x{img.height} {img.mode} image") from None
    return _patchify([arr], proc)


def preprocess_images(images: Sequence[ImageInput], max_pixels: int = MAX_IMAGE_PIXELS,
                      names: Sequence[str] | None = None, *, processing: ProcessorConfig | str | None = None,
                      alpha: str = "model", max_bytes: int | None = MAX_IMAGE_BYTES,
                      deadline: float | None = None) -> MediaBatch:
    """Preprocess images into one packed MediaBatch (input order) under the model's `processing` rules;
    `names` label them (see `load_image`).

    `max_bytes` bounds the memory decoding and preprocessing one image takes (`image_work_bytes`, checked from
    its header before decoding); `deadline` (a `time.monotonic()` value) stops the work once it has passed.
    """
    proc = processing_of(processing)
    items = []
    for i, src in enumerate(images):
        name = names[i] if names is not None else _describe(src)
        img = _named(name, _load_image, src, max_pixels, max_bytes, deadline, proc)
        try:
            pixels, grid = image_to_item(img, proc, alpha)
        except MediaError as e:
            raise MediaError(f"{name}: {e}", source=name) from None
        items.append(MediaBatch(pixels, torch.tensor([grid], dtype=torch.int64), None, [name], [img.size]))
    return MediaBatch.concat(items)
