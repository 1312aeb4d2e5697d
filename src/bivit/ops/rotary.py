"""The rotary position embedding of q and k: interleaved pairs (x[..., 2k], x[..., 2k+1]) turned as complex
numbers by the tables of `bivit.model.rope_tables`, in fp32, rounded once to the input dtype.

Two implementations of one formula, x * cos + pairs_swapped(x) * sin, each product and the sum rounded to fp32
on its own: bivit's compiled kernel (`bivit.kernels`, one pass over q and k) and PyTorch's elementwise ops
(autograd, and machines without the compiled kernels). Both give the same bits (tested with `torch.equal`), so
which one runs never changes an embedding. Both are batch-invariant: real multiplies and adds round the same
in vector and scalar code (a complex multiply's kernels do not, so its result would depend on where in the
batch tensor an element sits).
"""

from __future__ import annotations

import torch

from .. import kernels
from .mode import needs_grad


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[L, ..., head_dim]` rotated by fp32 tables `[L, head_dim]` (cos = (c0, c0, c1, c1, ...),
    sin = (-s0, s0, -s1, s1, ...)) -> a new tensor of x's dtype and shape."""
    kernel = None if needs_grad(x) else kernels.rope()
    if kernel is not None:
        x3 = _rows_slots(x)
        if x3 is not None and kernel.supports(x3, cos) and sin.is_contiguous() and sin.dtype == torch.float32:
            out = torch.empty(x.shape, dtype=x.dtype)
            with torch.profiler.record_function("bivit::rope"):  # else invisible to torch.profiler
                kernel(x3, cos, sin, out.view(x3.shape))
            return out
    return rope_reference(x, cos, sin)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """PyTorch's form of `rope` (differentiable). x is widened to fp32 first (exact): a bf16 strided view times
    fp32 tables would take PyTorch's slow mixed-dtype path."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    xf = x.float()
    out = xf * cos.view(shape)
    out += xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin.view(shape)
    return out.to(x.dtype)


def _rows_slots(x: torch.Tensor) -> torch.Tensor | None:
    """x as a `[L, slots, head_dim]` view (q and k heads of a row merged), or None where no view exists."""
    try:
        return x.view(x.shape[0], -1, x.shape[-1])
    except RuntimeError:
        return None
