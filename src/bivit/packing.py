"""The one packing rule: how the model's items (images, video chunks) are cut into forward passes.

A forward pass holds consecutive items. The next item starts a new pass when the pass already holds one and the
item would take it past the budget; an item larger than the budget runs alone. `pack` applies the rule to a
list, `starts_new_pass` is the rule itself for callers that fill passes as items arrive (the service's
batching worker, `Encoder.encode_stream`); `check_pixels` validates a packed pass a caller made itself. In
invariant mode the cut never changes an item's bits, it only bounds memory; in default mode it does (which is
what invariant mode is for).

The budget counts patches (`max_batch_patches`, `--max-batch-patches`, `--batch-patches`): a pass's memory and
time grow with its patches, since every tower layer runs on them. Tokens would not bound it: an image has 4
patches per token, a video chunk of t frames 4t (its frames are averaged into one set of tokens).

Old spellings still work, with a deprecation message: `max_batch_tokens` (encoder, service) always counted
patches and converts 1:1; the dataset job's `batch_tokens` counted tokens and converts at 4 patches per token,
exactly what it allowed for images (a pass of video chunks is now bounded by its patches too).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .errors import ConfigError, MediaError

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig

# Patches per token of an image (the 2x2 merger): how a token budget of the dataset job converts.
PATCHES_PER_TOKEN = 4


def check_budget(value: Any, option: str = "max_batch_patches") -> Optional[int]:
    """`value` if it is None or a positive integer, else ConfigError naming `option`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"option {option!r} = {value!r}: expected a positive integer")
    return value


def renamed(value: Any, old_value: Any, *, name: str, old_name: str, factor: int = 1,
            stacklevel: int = 3) -> Any:
    """`value`, or a value given under a deprecated name (`old_value`, times `factor`) with a DeprecationWarning
    that says how it converted. Both given: ConfigError."""
    if old_value is None:
        return value
    if value is not None:
        raise ConfigError(f"options {name!r} and {old_name!r} (its deprecated name) both given; give {name!r}")
    check_budget(old_value, old_name)
    how = f" ({old_value} -> {old_value * factor}, {factor} patches per token)" if factor != 1 else ""
    warnings.warn(f"{old_name!r} is deprecated, use {name!r}{how}", DeprecationWarning, stacklevel=stacklevel)
    return old_value * factor


def starts_new_pass(items: int, patches: int, item_patches: int, budget: Optional[int]) -> bool:
    """Whether an item of `item_patches` patches starts a new pass after a pass of `items` items and `patches`
    patches, under `budget` (None: no budget, one pass)."""
    return budget is not None and items > 0 and patches + item_patches > budget


def pack(patch_counts: Sequence[int], budget: Optional[int]) -> list[range]:
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
