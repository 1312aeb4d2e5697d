"""Elementwise ops whose bits must not depend on the tensor's size or the thread count (GELU), and the
temporal mean of a video chunk's frames.

A GELU is named by the function it computes: "erf" (the exact GELU) or "tanh" (its tanh approximation); PyTorch's
name for each (`approximate`) is used only where its ops are called.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.gemm import APPROXIMATE
from .mode import emit, is_batch_invariant, needs_grad
from .selection import gelu_out


# Vectorised CPU kernels finish each thread's range with scalar code for its last (length mod 2 x vector width)
# elements, and for some ops (tanh-GELU, complex multiply) the scalar code rounds differently from the vector
# code. Which elements land in such a tail depends on the tensor's size and the thread count: on the batch.
# In invariant mode those ops therefore run in calls of exactly POINTWISE_CHUNK elements, each computed by one
# thread with no scalar tail: PyTorch's GELU kernel cuts a call of more than 16384 elements into one range per
# thread (numel / threads: at 3 threads not a multiple of any vector width; the load-time proof caught it),
# and runs one of at most 16384 elements (under ATen's 32768 grain) in one range. 16384 is a multiple of every
# vector width. (GELU after a compiled GEMM runs inside it instead: `bivit.kernels.gemm`.)
POINTWISE_CHUNK = 16384


def _chunked_pointwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, out_fn: Callable | None = None,
                       **kwargs) -> torch.Tensor:
    """`fn(*xs, **kwargs)` elementwise over same-shaped tensors, in calls of exactly POINTWISE_CHUNK elements.

    `out_fn(*chunks, **kwargs, out=...)`, when given, writes full chunks in place (no temporary per chunk).
    """
    flats = [x.contiguous().view(-1) for x in xs]
    out = torch.empty_like(flats[0])
    n = out.numel()
    full = n - n % POINTWISE_CHUNK
    for start in range(0, full, POINTWISE_CHUNK):
        chunks = [f[start:start + POINTWISE_CHUNK] for f in flats]
        if out_fn is not None:
            out_fn(*chunks, **kwargs, out=out[start:start + POINTWISE_CHUNK])
        else:
            out[start:start + POINTWISE_CHUNK] = fn(*chunks, **kwargs)
    if n > full:
        pads = []
        for f in flats:
            pad = f.new_zeros(POINTWISE_CHUNK)
            pad[:n - full] = f[full:]
            pads.append(pad)
        out[full:] = fn(*pads, **kwargs)[:n - full]
    return out.view(xs[0].shape)


def chunked_gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    # With or without `out=`, GELU at the same chunk size gives the same bits; `out=` saves a temporary per chunk.
    return _chunked_pointwise(F.gelu, x, out_fn=gelu_out(), approximate=APPROXIMATE[kind])


class _InvariantGelu(torch.autograd.Function):
    """GELU in fixed-size chunks, forward and backward (both have vector/scalar rounding differences)."""

    @staticmethod
    def forward(ctx, x, kind):
        ctx.save_for_backward(x)
        ctx.kind = kind
        return chunked_gelu(x, kind)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return chunked_gelu_backward(grad, x, ctx.kind), None


def chunked_gelu_backward(grad: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """GELU's (`kind`) input gradient at `x`, in the same fixed-size chunks as the forward."""
    return _chunked_pointwise(torch.ops.aten.gelu_backward, grad, x, out_fn=_gelu_backward_out,
                              approximate=APPROXIMATE[kind])


def _gelu_backward_out(grad: torch.Tensor, x: torch.Tensor, approximate: str, out: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=approximate, grad_input=out)


def gelu(x: torch.Tensor, kind: str = "erf") -> torch.Tensor:
    """GELU of `kind` ("erf" or "tanh")."""
    if not is_batch_invariant():
        return emit("gelu", F.gelu(x, approximate=APPROXIMATE[kind]))
    if needs_grad(x):
        return emit("gelu", _InvariantGelu.apply(x, kind))
    return emit("gelu", chunked_gelu(x, kind))


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk), returning `x.dtype` like `torch.mean` does."""
    if not is_batch_invariant():
        return emit("temporal_mean", x.mean(dim=0))
    # Fixed order: frame 0 + frame 1 + ... in float32 (or wider), one division, then back to the input dtype.
    acc = x[0].to(torch.promote_types(x.dtype, torch.float32), copy=True)
    for f in range(1, x.shape[0]):
        acc += x[f]
    return emit("temporal_mean", (acc / x.shape[0]).to(x.dtype))
