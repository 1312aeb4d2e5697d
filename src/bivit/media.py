"""Image preprocessing exactly as Moonshot's media processor does it (docs/model.md, "Images").

Everything here is per item and independent of batching: pixels are a pure function of the input bytes.
Video decoding lives in `bivit.video`; it reuses `frames_to_item` so a video frame is processed the way an
image is, with a smaller patch budget.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .errors import MediaError
from .fileio import read_regular

PATCH_SIZE = 14
MERGE_KERNEL = 2
IN_PATCH_LIMIT = 16384
PATCH_LIMIT_ON_ONE_SIDE = 512
# Names that are images when a folder is listed (videos: `bivit.video.VIDEO_EXTENSIONS`; `bivit.video.media_kind`).
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})
# Refuse images whose header claims more pixels than this before decoding them (decompression bombs).
# 16384 patches of 14x14 is ~3.2 MP after resizing; 200 MP leaves room for any real photo or scan.
MAX_IMAGE_PIXELS = 200_000_000

ImageInput = Union[Image.Image, np.ndarray, str, os.PathLike, bytes]


@dataclass
class MediaBatch:
    """Preprocessed items, packed: `pixel_values` float32 `[L, 3, 14, 14]`, `grid_thw` int64 `[n, 3]`.

    Item i owns rows `offsets[i]:offsets[i+1]` of `pixel_values` (t*h*w patches, frame-major then row-major).
    `timestamps` is set for video chunks (one `HH:MM:SS.fff` string per item), else None.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    timestamps: list[str] | None = None
    sources: list[str] = field(default_factory=list)

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
                patch_size: int = PATCH_SIZE, merge: int = MERGE_KERNEL) -> tuple[int, int]:
    """Patch grid (h, w) of an image of this size after resize and padding to a multiple of patch*merge."""
    new_w, new_h = navit_size(width, height, patch_limit, patch_size)
    unit = patch_size * merge
    return (-(-new_h // unit) * merge, -(-new_w // unit) * merge)


def image_token_count(width: int, height: int, patch_limit: int = IN_PATCH_LIMIT) -> int:
    """Tokens the encoder produces for a `width` x `height` image, without loading it."""
    return grid_tokens(*padded_grid(width, height, patch_limit))


def _describe(src: object) -> str:
    if isinstance(src, (str, os.PathLike)):
        return str(src)
    if isinstance(src, bytes):
        return f"<{len(src)} bytes>"
    return f"<{type(src).__name__}>"


def open_image(src: ImageInput, max_pixels: int = MAX_IMAGE_PIXELS, name: str | None = None) -> Image.Image:
    """Decode any accepted input into an RGB PIL image, or raise MediaError saying which input and why.

    `name` is how messages call the input (default: its path, or `<N bytes>`); it becomes `MediaError.source`.
    """
    name = name or _describe(src)
    try:
        return _open_image(src, max_pixels, name)
    except MediaError as e:
        e.source = name
        raise


def _open_image(src: ImageInput, max_pixels: int, name: str) -> Image.Image:
    if isinstance(src, Image.Image):
        img = src
        _check_pixels(img.size, name, max_pixels)
    elif isinstance(src, np.ndarray):
        if src.ndim != 3 or src.shape[2] != 3 or src.dtype != np.uint8:
            raise MediaError(f"{name}: numpy images must be HxWx3 uint8, got shape {src.shape} dtype {src.dtype}")
        if src.shape[0] == 0 or src.shape[1] == 0:
            raise MediaError(f"{name}: image has no pixels (shape {src.shape})")
        _check_pixels((src.shape[1], src.shape[0]), name, max_pixels)
        return Image.fromarray(np.ascontiguousarray(src), "RGB")
    elif isinstance(src, (str, os.PathLike, bytes)):
        if isinstance(src, bytes):
            data = src
        else:
            try:
                data = read_regular(src)  # a directory, FIFO or device is refused without blocking
            except FileNotFoundError:
                raise MediaError(f"{name}: no such file") from None
            except OSError as e:
                raise MediaError(f"{name}: cannot read ({e.strerror or e})") from None
        if not data:
            raise MediaError(f"{name}: file is empty")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(data))
                _check_pixels(img.size, name, max_pixels)
                img.load()
        except MediaError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise MediaError(f"{name}: refused as a decompression bomb ({e})") from None
        except UnidentifiedImageError:
            raise MediaError(f"{name}: not an image format Pillow can read") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise MediaError(f"{name}: corrupt or truncated image ({e})") from None
    else:
        raise MediaError(f"{name}: unsupported input type; pass a PIL.Image, an HxWx3 uint8 array, bytes or a path")
    if img.width < 1 or img.height < 1:
        raise MediaError(f"{name}: image has no pixels ({img.width}x{img.height})")
    # .convert("RGB") drops alpha without compositing, as the reference does.
    return img if img.mode == "RGB" else img.convert("RGB")


def _check_pixels(size: tuple[int, int], name: str, max_pixels: int) -> None:
    w, h = size
    if w * h > max_pixels:
        raise MediaError(f"{name}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (decompression bomb?)")


def _resize_pad(img: Image.Image, patch_limit: int) -> np.ndarray:
    new_w, new_h = navit_size(img.width, img.height, patch_limit)
    if (new_w, new_h) != img.size:
        img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.uint8)
    unit = PATCH_SIZE * MERGE_KERNEL
    pad_h, pad_w = (-new_h) % unit, (-new_w) % unit
    # Zero pad in uint8, so the padding normalises to exactly -1.0 like the reference.
    return np.pad(arr, ((0, pad_h), (0, pad_w), (0, 0)))


def _normalize(frames: np.ndarray) -> np.ndarray:
    # Bit-exact with the reference: x/255 in float64 stored as float32, then (x - mean) / std evaluated in
    # float64 from that float32 value, stored as float32.
    x = (frames.astype(np.float64) / 255.0).astype(np.float32)
    return ((x.astype(np.float64) - 0.5) * (1.0 / 0.5)).astype(np.float32)


def frames_to_item(frames: Sequence[Image.Image], patch_limit: int = IN_PATCH_LIMIT) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Resize, pad, normalise and patchify one item (an image, or the frames of one video chunk).

    Returns pixels `[t*h*w, 3, 14, 14]` (frame-major, then row-major) and its grid `(t, h, w)`.
    """
    arrays = [_resize_pad(f, patch_limit) for f in frames]
    if len({a.shape for a in arrays}) != 1:
        raise MediaError(f"frames of one chunk differ in size: {sorted({a.shape[:2] for a in arrays})}")
    x = _normalize(np.stack(arrays))  # [T, H, W, C]
    t, hh, ww, c = x.shape
    gh, gw = hh // PATCH_SIZE, ww // PATCH_SIZE
    x = x.reshape(t, gh, PATCH_SIZE, gw, PATCH_SIZE, c).transpose(0, 1, 3, 5, 2, 4)
    pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(t * gh * gw, c, PATCH_SIZE, PATCH_SIZE))
    return pixels, (t, gh, gw)


def preprocess_images(images: Sequence[ImageInput], max_pixels: int = MAX_IMAGE_PIXELS,
                      names: Sequence[str] | None = None) -> MediaBatch:
    """Preprocess images into one packed MediaBatch (input order); `names` label them (see `open_image`)."""
    items = []
    for i, src in enumerate(images):
        name = names[i] if names is not None else _describe(src)
        pixels, grid = frames_to_item([open_image(src, max_pixels, name)])
        items.append(MediaBatch(pixels, torch.tensor([grid], dtype=torch.int64), None, [name]))
    return MediaBatch.concat(items)
