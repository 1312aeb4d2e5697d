"""The one packing rule: how the model's items (images, video chunks) are cut into forward passes.

A forward pass holds consecutive items. The next item starts a new pass when the pass already holds one and the
item would take it past the budget; an item larger than the budget runs alone. `Pass` is the rule for callers
that fill passes as items arrive (`Encoder.encode_stream`, the service's batching worker): each asks the pass
whether the next item still fits, and nothing else decides it; `pack` applies the same rule to a list;
`check_pixels` validates a packed pass a caller made itself. In
invariant mode the cut never changes an item's bits, it only bounds memory; in default mode it does (which is
what invariant mode is for).

The budget is one number with one name, `max_batch_patches` (`--max-batch-patches` on every command), one
default, `MAX_BATCH_PATCHES`, checked once where it enters (`check_budget`: `load_encoder`, a command's options)
and held by the encoder from then on. It counts patches: a pass's memory and time grow with its patches, since
every tower layer runs on them. Tokens would not bound it: an image has 4 patches per token, a video chunk of t
frames 4t (its frames are averaged into one set of tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Sequence, TypeVar

from ..base.options import whole
from ..errors import MediaError

if TYPE_CHECKING:  # type hints only
    import torch

    from ..checkpoint.config import ModelConfig

# Patches per forward pass unless the caller says otherwise: every front end and the library. About 40 MB of
# float32 pixels, and a full-size tower's activations for them fit a few GB.
MAX_BATCH_PATCHES = 16384


def check_budget(value: Any, option: str = "max_batch_patches") -> int:
    """The budget: `MAX_BATCH_PATCHES` for None, `value` if it is a positive integer, else ConfigError naming
    `option` (how the caller spelled it: a keyword or a command's flag)."""
    return MAX_BATCH_PATCHES if value is None else whole(value, option, 1)


T = TypeVar("T")


class Pass(Generic[T]):
    """The forward pass being filled under `budget` patches: its items (whatever the caller keeps per item) and
    their patches. The one pass-filling rule: the caller asks `fits` before each `add`, runs the pass (`take`)
    when the next item does not fit, and may stop waiting for more once the pass is `full`."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.items: list[T] = []
        self.patches = 0

    def __len__(self) -> int:
        return len(self.items)

    def fits(self, patches: int) -> bool:
        """Whether an item of `patches` patches joins this pass (else it starts the next one): an empty pass
        takes any item, so one larger than the budget runs alone."""
        return not self.items or self.patches + patches <= self.budget

    @property
    def full(self) -> bool:
        """No item can join any more (nothing is gained by waiting for one)."""
        return self.patches >= self.budget

    def add(self, item: T, patches: int) -> None:
        self.items.append(item)
        self.patches += patches

    def take(self) -> list[T]:
        """The pass's items, in order; the pass is empty again."""
        items, self.items, self.patches = self.items, [], 0
        return items


def pack(patch_counts: Sequence[int], budget: int) -> list[range]:
    """Consecutive items (by their patch counts) cut into passes by the rule: one range of item indices each."""
    passes: list[range] = []
    filling: Pass[int] = Pass(budget)
    for i, n in enumerate(patch_counts):
        if not filling.fits(n):
            passes.append(range(filling.take()[0], i))
        filling.add(i, n)
    if filling:
        passes.append(range(filling.take()[0], len(patch_counts)))
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
