"""Attention over packed items: each item attends only to itself. Invariant mode: bivit's compiled kernel, always
(float16 q/k/v widened exactly to float32 for it, the output rounded back once). Default mode: the compiled
kernel where it is the faster one on this CPU, else PyTorch's fused attention.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from .. import kernels
from ..errors import ConfigError
from .mode import emit, is_batch_invariant, needs_grad
from .rotary import rope as rotate
from .selection import attention_kernel, compute_dtype, flash_attention_backward


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int],
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Non-causal attention over packed `[L, heads, head_dim]` q/k/v where item i owns `seqlens[i]` rows -> `[L,
    heads * head_dim]`; with `rope`, q and k are first rotated by its (cos, sin) tables (`ops.rope`).

    Each item attends only to itself, so it runs alone: its kernel shapes depend on that item alone (what the
    reference does on CPU too). bivit's compiled attention (`bivit.kernels`) makes one call for the whole batch,
    split into per-item units computed by one thread each, so an item's bits depend on neither the batch nor
    the thread count: invariant mode always runs it (`selection.attention_kernel`), default mode where it is the
    faster kernel; elsewhere PyTorch's fused attention runs. Without autograd the compiled kernel also rotates
    q and k as it reads them, with `ops.rope`'s bits: the rotated q and k are never written out.
    """
    if is_batch_invariant():
        dtype = q.dtype
        kernel = attention_kernel(dtype)
        # The kernel reads q's shape from k and v and the rows from the item lengths: refuse what it would read past.
        if not (q.dim() == 3 and q.shape == k.shape == v.shape and sum(seqlens) == q.shape[0]):
            raise RuntimeError(f"attention: q, k, v of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                               f"for items of {sum(seqlens)} rows in all")
        if q.shape[2] > kernels.MAX_HEAD_DIM:
            raise ConfigError(f"head dim {q.shape[2]}: bivit's compiled attention takes head dims up to "
                              f"{kernels.MAX_HEAD_DIM}, so invariant mode cannot run this model")
        q, k, v = (_kernel_view(t, compute_dtype(dtype)) for t in (q, k, v))
        out = _compiled(kernel, q, k, v, seqlens, rope)
        return emit("attention", out.to(dtype).view(q.shape[0], -1))
    kernel = kernels.attention() if all(kernels.Attention.supports(t) for t in (q, k, v)) else None
    if kernel is None:
        q, k = (q, k) if rope is None else (rotate(q, *rope), rotate(k, *rope))
        return emit("attention", _sdpa(q, k, v, seqlens).view(q.shape[0], -1))
    return emit("attention", _compiled(kernel, q, k, v, seqlens, rope).view(q.shape[0], -1))


def _kernel_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as the compiled kernel reads it: `dtype` (a widening is exact), a contiguous last dim."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _compiled(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int],
              rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    fused = (rope is not None and not needs_grad(q, k, v) and kernels.Attention.supports_rope(q, *rope))
    if rope is not None and not fused:
        q, k = rotate(q, *rope), rotate(k, *rope)
    if needs_grad(q, k, v):
        return _CompiledAttention.apply(q, k, v, list(seqlens), kernel)
    out = q.new_empty(q.shape)
    with torch.profiler.record_function("bivit::attention"):  # else invisible to torch.profiler
        kernel(q, k, v, out, seqlens, rope=rope if fused else None)
    return out


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch's flash attention (forward and backward) splits an item's heads over threads and runs each head's
    GEMMs inside that parallel region, or, at one thread, outside any: another GEMM code path, other bits (seen:
    an item's pixel gradient changed between 1 and 2 threads with torch restricted to AVX2). Run at one thread
    it takes the same path whatever the process's thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _spans(seqlens: Sequence[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(seqlens))
    return list(zip([0] + ends[:-1], ends))


def _heads_first(*ts: torch.Tensor) -> list[torch.Tensor]:
    # [n, heads, d] -> [1, heads, n, d]: the 4-D form is what selects PyTorch's fused CPU (flash) kernel; 3-D
    # inputs fall back to the unfused math path, 3x slower at Kimi's shapes.
    return [t.transpose(0, 1)[None] for t in ts]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    out = q.new_empty(q.shape)
    for s, e in _spans(seqlens):
        out[s:e].copy_(F.scaled_dot_product_attention(*_heads_first(q[s:e], k[s:e], v[s:e]))[0].transpose(0, 1))
    return out


class _CompiledAttention(torch.autograd.Function):
    """The compiled attention's forward (the bits `encode` serves) with PyTorch's flash-attention backward,
    fed the forward's output and log-sum-exp; per item, so gradients are batch-invariant too. Where that
    private backward is missing (`selection.flash_attention_backward`), the gradient of PyTorch's own attention,
    recomputed (same math, its rounding).
    """

    @staticmethod
    def forward(ctx, q, k, v, seqlens, kernel):
        out = q.new_empty(q.shape)
        lse = torch.empty(q.shape[0] * q.shape[1], dtype=torch.float32)  # item by item, [heads, n_i] each
        kernel(q, k, v, out, seqlens, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seqlens = seqlens
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        with one_thread():
            _item_grads(grad, q, k, v, out, lse, ctx.seqlens, grads)
        return *grads, None, None


def _item_grads(grad, q, k, v, out, lse, seqlens, grads) -> None:
    """Each item's q/k/v gradients into `grads`, from PyTorch's flash backward (or, where this build lacks it, the
    gradient of PyTorch's own attention, recomputed)."""
    heads, flash_backward = q.shape[1], flash_attention_backward()
    for s, e in _spans(seqlens):
        item = _heads_first(grad[s:e], q[s:e], k[s:e], v[s:e], out[s:e])
        item_lse = lse[s * heads:e * heads].view(1, heads, e - s)
        if flash_backward is None:
            parts = _sdpa_grads(*item)
        else:
            parts = flash_backward(*item, item_lse, 0.0, False, scale=1 / math.sqrt(q.shape[2]))
        for g, part in zip(grads, parts):
            g[s:e] = part[0].transpose(0, 1)


def _sdpa_grads(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                _out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradient of PyTorch's attention at q/k/v (recomputed: the compiled forward's output is not used)."""
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(F.scaled_dot_product_attention(*qkv), qkv, grad)
