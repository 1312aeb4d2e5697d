"""The one switch: `batch_invariant(True)` makes every op of this package compute an item's rows in a way that does
not depend on which other rows share the call. Also the op tracer (`bivit verify --bisect`) and activation
checkpointing that re-runs a forward in the mode it first ran in.

Nothing outside `bivit.ops` needs to know what the switch changes; the ops read it with `is_batch_invariant()`.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

_invariant: ContextVar[bool] = ContextVar("bivit_batch_invariant", default=False)
_tracer: ContextVar["Callable[[str, torch.Tensor], None] | None"] = ContextVar("bivit_tracer", default=None)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run the enclosed ops in batch-invariant mode (or explicitly not). Thread- and task-local."""
    token = _invariant.set(enabled)
    try:
        yield
    finally:
        _invariant.reset(token)


def is_batch_invariant() -> bool:
    return _invariant.get()


@contextlib.contextmanager
def trace(callback: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call `callback(op_kind, output)` after every op (used by `bivit verify --bisect`)."""
    token = _tracer.set(callback)
    try:
        yield
    finally:
        _tracer.reset(token)


def emit(kind: str, out: torch.Tensor) -> torch.Tensor:
    """Every op returns through here, so the tracer sees each op's output once."""
    cb = _tracer.get()
    if cb is not None:
        cb(kind, out)
    return out


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call (the ops' Functions are skipped otherwise: the fast path stays fast)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def checkpoint(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`fn(*args)` with activation checkpointing: the recomputation in backward runs in the mode of the forward."""
    mode = _invariant.get()

    def run(*a):
        with batch_invariant(mode):
            return fn(*a)

    return _checkpoint(run, *args, use_reentrant=False)
