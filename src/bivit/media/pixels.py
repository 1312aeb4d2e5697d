"""Image preprocessing exactly as the model's media processor does it (docs/model.md, "Images"), the packed batch
of items (`MediaBatch`), and the prompt placeholders the processor writes.

Everything here is per item and independent of batching: pixels are a pure function of the input bytes and
the model's `ProcessorConfig` (`bivit.checkpoint.preprocess_config`). Decoding an input within its limits is
`bivit.media.decode`'s, grid and token arithmetic `bivit.media.grids`'. Video decoding lives in `bivit.media.video`; it
reuses `frames_to_item` so a video frame is processed the way an image is, with the per-frame budget.

Transparency (`alpha`): "model" does what the model's processor does (K2.5/K2.6 drop alpha with
`convert("RGB")`; K3 composites onto its `transparent_bg_config` background at its fill stage), "drop" always
drops it, "white" first does what vLLM's image loader does (an RGBA image pasted onto white with its alpha as
mask, other modes converted to RGB), then the model's processor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from ..checkpoint.preprocess_config import ProcessorConfig, TransparentBg, check_alpha
from ..errors import MediaError
from .decode import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ImageInput, input_name, load_for_model
from .grids import IN_PATCH_LIMIT, PATCH_SIZE, grid_tokens, navit_size, processing_of

MEDIA_PAD = "<|media_pad|>"



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


def normalize_patches(patches: torch.Tensor, processing: ProcessorConfig) -> torch.Tensor:
    """Raw patches `[L, 3, p, p]` uint8 (resized and zero-padded pixels, cut into patches: what vLLM's Kimi-K2.5
    processor hands a model that normalises on its device) -> float32 patches normalised exactly as `_patchify`
    normalises (the same function, channels last)."""
    if patches.dtype != torch.uint8 or patches.ndim != 4 or patches.shape[1] != 3:
        raise MediaError(f"expected raw uint8 patches [L, 3, p, p], got {str(patches.dtype).removeprefix('torch.')} "
                         f"{list(patches.shape)}")
    x = _normalize(patches.cpu().numpy().transpose(0, 2, 3, 1), processing)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


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
        name = names[i] if names is not None else input_name(src)
        img = load_for_model(src, proc, name, max_pixels, max_bytes=max_bytes, deadline=deadline)
        try:
            pixels, grid = image_to_item(img, proc, alpha)
        except MediaError as e:
            raise MediaError(f"{name}: {e}", source=name) from None
        items.append(MediaBatch(pixels, torch.tensor([grid], dtype=torch.int64), None, [name], [img.size]))
    return MediaBatch.concat(items)
