"""Weights packed for a GEMM kernel (into its blocked layout, widened to the dtype it multiplies in):
made once per weight tensor, kernel and layout, made again when the weight is updated in place (an optimizer
step, `update_weights`: a new tensor version), and dropped with the tensor.
"""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..base import state

T = TypeVar("T")

# weight tensor -> {how it was packed: (the tensor's version then, the packed weight)}
_packs: WeakIdKeyDictionary = state.table(state.WEIGHTS, WeakIdKeyDictionary)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: cannot be updated in place outside inference mode
        return -1


def packed(key: torch.Tensor, how: Hashable, make: Callable[[], T]) -> T:
    """`make()`'s weight for `key` (the Linear or conv weight it belongs to) packed `how` (the kernel and
    layout it is for), made on the first call and again after `key` was updated in place."""
    slot = _packs.setdefault(key, {})
    version, ready = slot.get(how, (None, None))
    if version != _version(key) or ready is None:
        ready = make()
        slot[how] = (_version(key), ready)
    return ready
