"""The one packing rule: how the model's items (images, video chunks) are cut into forward passes.

A forward pass holds consecutive items. The next item starts a new pass when the pass already holds one and the
item would take it past the budget; an item larger than the budget runs alone. `pack` applies the rule to a
list, `starts_new_pass` is the rule itself for callers that fill passes as items arrive (the service's
batching worker, `Encoder.encode_stream`); `check_pixels` validates a packed pass a caller made itself. In
invariant mode the cut never changes an item's bits, it only bounds memory; in default mode it does (which is
what invariant mode is for).

The budget is one number with one name, `max_batch_patches` (`--max-batch-patches` on every command), one
default, `MAX_BATCH_PATCHES`, checked once where it enters (`check_budget`: `load_encoder`, a command's options)
and held by the encoder from then on. It counts patches: a pass's memory and time grow with its patches, since
every tower layer runs on them. Tokens would not bound it: an image has 4 patches per token, a video chunk of t
frames 4t (its frames are averaged into one set of tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .errors import ConfigError, MediaError

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig

# Patches per forward pass unless the caller says otherwise: every front end and the library. About 40 MB of
# float32 pixels, and a full-size tower's activations for them fit a few GB.
MAX_BATCH_PATCHES = 16384


def check_budget(value: Any, option: str = "max_batch_patches") -> int:
    """The budget: `MAX_BATCH_PATCHES` for None, `value` if it is a positive integer, else ConfigError naming
    `option` (how the caller spelled it: a keyword or a command's flag)."""
    if value is None:
        return MAX_BATCH_PATCHES
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{option} {value!r}: expected a whole number >= 1")
    return value


def starts_new_pass(items: int, patches: int, item_patches: int, budget: int) -> bool:
    """Whether an item of `item_patches` patches starts a new pass after a pass of `items` items and `patches`
    patches, under `budget`."""
    return items > 0 and patches + item_patches > budget


def pack(patch_counts: Sequence[int], budget: int) -> list[range]:
    """Consecutive items (by their patch counts) cut into passes by the rule: one range of item indices each."""
    passes, first, used = [], 0, 0
    for i, n in enumerate(patch_counts):
        if starts_new_pass(i - first, used, n, budget):
            passes.append(range(first, i))
            first, used = i, 0
        used += n
    if patch_counts:
        passes.append(range(first, len(patch_counts)))
    return passes


def check_pixels(config: "ModelConfig", pixels: "torch.Tensor", grid_thw: "torch.Tensor") -> None:
    """Raise MediaError unless `pixels` `[L, 3, p, p]` and `grid_thw` `[n, 3]` describe valid packed items."""
    p = config.patch_size
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, p, p):
        raise MediaError(f"pixel_values must be [L, 3, {p}, {p}], got {list(pixels.shape)}")
    if (grid_thw <= 0).any():
        raise MediaError(f"grid_thw entries must be positive, got {grid_thw.tolist()}")
    if ((grid_thw[:, 1:] % 2) != 0).any():
        raise MediaError(f"grid h and w must be even (2x2 merge), got {grid_thw.tolist()}")
    if (grid_thw[:, 0] > config.pos_emb_time).any():
        raise MediaError(f"chunks hold at most {config.pos_emb_time} frames, got {grid_thw.tolist()}")
    total = int(grid_thw.prod(-1).sum())
    if total != pixels.shape[0]:
        raise MediaError(f"grid_thw describes {total} patches but pixel_values has {pixels.shape[0]}")
