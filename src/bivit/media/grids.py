"""Patch grids and token counts of images and video frames under the model's preprocessing: pure arithmetic,
imported by decoding (memory bounds), preprocessing and the encoder (docs/model.md, "Images")."""

from __future__ import annotations

import math

from ..checkpoint.preprocess_config import K25_PROCESSING, PROCESSING_PRESETS, ProcessorConfig
from ..errors import ConfigError, MediaError

PATCH_SIZE = K25_PROCESSING.patch_size
MERGE_KERNEL = K25_PROCESSING.merge_kernel_size
IN_PATCH_LIMIT = K25_PROCESSING.in_patch_limit
PATCH_LIMIT_ON_ONE_SIDE = K25_PROCESSING.patch_limit_on_one_side


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
