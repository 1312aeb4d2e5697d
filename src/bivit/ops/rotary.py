"""The rotary position embedding of q and k: interleaved pairs (x[..., 2k], x[..., 2k+1]) turned as complex
numbers by the tables of `rope_tables`, in fp32, rounded once to the input dtype.

Two implementations of one formula, x * cos + pairs_swapped(x) * sin, each product and the sum rounded to fp32
on its own: bivit's compiled kernel (`bivit.kernels`, one pass over q and k) and PyTorch's elementwise ops
(autograd, and machines without the compiled kernels). Both give the same bits (tested with `torch.equal`), so
which one runs never changes an embedding. Both are batch-invariant: real multiplies and adds round the same
in vector and scalar code (a complex multiply's kernels do not, so its result would depend on where in the
batch tensor an element sits).
"""

from __future__ import annotations

import math
from functools import lru_cache

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


@lru_cache(maxsize=256)
@torch.inference_mode(False)  # cached tables are shared with autograd forwards, which must be able to save them
def _rope_cos_sin(h: int, w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D RoPE of an h x w grid as fp32 `[h*w, head_dim]` tables in the interleaved layout of `ops.rope`:
    cos = (c0, c0, c1, c1, ...), sin = (-s0, s0, -s1, s1, ...); complex slot 2i turns with the column, 2i+1
    with the row.

    The frequencies are the reference's, 1 / theta^(4k / head_dim) in float32, with the power computed in float64
    by the C library and rounded once (PyTorch's float32 pow is a vector kernel: its last bit depends on the
    CPU). The angles are float32 products (column or row index times frequency), as the reference forms them;
    their cos and sin come from `_cos_sin`, per column and per row (an angle depends on one of them only), and
    are gathered into the grid's table.
    """
    exponents = torch.arange(0, head_dim // 4, dtype=torch.float32) * 4 / head_dim
    freqs = 1.0 / _float32([theta ** e for e in exponents.tolist()])  # theta^e in float64, rounded once
    cos_c, sin_c = _cos_sin(torch.outer(torch.arange(w, dtype=torch.float32), freqs))  # [w, dim/4]
    cos_r, sin_r = _cos_sin(torch.outer(torch.arange(h, dtype=torch.float32), freqs))  # [h, dim/4]

    def grid(col: torch.Tensor, row: torch.Tensor) -> torch.Tensor:  # -> [h*w, dim/2]: (col, row) per frequency
        return torch.stack([col.repeat(h, 1), row.repeat_interleave(w, dim=0)], dim=-1).flatten(1)

    cos, sin = grid(cos_c, cos_r), grid(sin_c, sin_r)
    return cos.repeat_interleave(2, dim=-1), torch.stack([-sin, sin], dim=-1).flatten(1)


def _float32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def _cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 angles, each computed in float64 by the C library one value at a time and rounded
    once to float32. Not PyTorch's float32 cos/sin: where PyTorch is built with MKL they call MKL's vector math,
    whose last bit changed from one process to the next on the same machine (on an AMX Xeon one process in
    about twenty got other RoPE tables, so other embeddings); a vectorised kernel also rounds a tensor's scalar
    tail differently, so an element's bits would depend on where it sits."""
    flat = angles.flatten().tolist()
    return (_float32([math.cos(a) for a in flat]).view(angles.shape),
            _float32([math.sin(a) for a in flat]).view(angles.shape))


def rope_tables(grid_thw: list[tuple[int, int, int]], head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[L, head_dim]` for packed items; every frame of a chunk shares its spatial table."""
    tables = [_rope_cos_sin(h, w, head_dim, theta) for _, h, w in grid_thw]
    return (torch.cat([c.repeat(t, 1) for (c, _), (t, _, _) in zip(tables, grid_thw)]),
            torch.cat([s.repeat(t, 1) for (_, s), (t, _, _) in zip(tables, grid_thw)]))
