"""The ops of the invariant forward for CUDA tensors (`bivit.ops.dispatch`'s CUDA table): the same names, arguments
and output dtypes as the CPU ops they stand in for, each one or two Triton kernel launches
(`bivit.kernels.triton_jit`); forward only. Importing it imports triton: `ops.dispatch.cuda_ops` imports it after
`kernels.cuda.require`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError
from ..kernels import triton_jit
from .mode import emit, needs_grad


def _inference_only(*tensors: torch.Tensor | None) -> None:
    if needs_grad(*tensors):
        raise ConfigError("the invariant GPU path (Triton kernels) computes forward passes only; train with "
                          "batch_invariant(False) on a GPU, or invariant on a CPU")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: str | None = None,
           add_to: torch.Tensor | None = None) -> torch.Tensor:
    """With `add_to`, written into it: the GEMM adds into it in its epilogue (no pass of its own)."""
    _inference_only(x, weight, bias, add_to)
    x2 = x.reshape(-1, x.shape[-1])
    kind = "linear" if gelu is None else "linear_gelu"
    if add_to is None:
        return emit(kind, triton_jit.gemm(x2, weight, bias, gelu).view(*x.shape[:-1], weight.shape[0]))
    r2 = add_to.view(-1, add_to.shape[-1])
    if r2.dtype != weight.dtype or not r2.is_contiguous():
        raise ConfigError(f"linear: add_to ({r2.dtype}) must be a contiguous tensor of the weights' dtype "
                          f"({weight.dtype})")
    triton_jit.gemm(x2, weight, bias, gelu, residual=r2)
    return emit(kind + "_add", add_to)


def patch_conv(pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The patch conv (kernel = stride = patch) as unfold + GEMM: `[L, C, p, p]` -> `[L, D]`."""
    _inference_only(pixels, weight, bias)
    out = triton_jit.gemm(pixels.reshape(pixels.shape[0], -1), weight.reshape(weight.shape[0], -1), bias)
    return emit("patch_conv", out)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    _inference_only(x, weight, bias)
    return emit("layer_norm", triton_jit.norm(x, weight, bias, eps, rms=False))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    _inference_only(x, weight)
    # eps None is PyTorch's default for RMSNorm: the machine epsilon of the input's dtype
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return emit("rms_norm", triton_jit.norm(x, weight, None, eps, rms=True))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int],
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Varlen attention over packed `[L, heads, head_dim]` q/k/v (item i owns `seqlens[i]` rows; q and k rotated
    by `rope` first) -> `[L, heads * head_dim]` in q's dtype."""
    _inference_only(q, k, v)
    if rope is not None:
        q, k = triton_jit.rotate(q, *rope), triton_jit.rotate(k, *rope)
    out = triton_jit.attention(q, k, v, seqlens)
    return emit("attention", out.view(q.shape[0], -1))


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk) in x's dtype: frames added in order in float32."""
    _inference_only(x)
    return emit("temporal_mean", triton_jit.temporal_mean(x))
