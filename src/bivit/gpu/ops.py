"""The invariant forward's ops on a GPU, each one or two Triton kernel launches (`bivit.gpu.kernels`); the same
names, arguments and output dtypes as the ops of `bivit.ops` they stand in for (`bivit.gpu.route`).

Everything that changes bits is pinned here, in one place, and reported by `bivit.gpu.facts`:
* GEMM tiles per weight dtype (`gemm_tiles`), never per row count; attention tiles per head dim.
* `PRECISION`: fp32 dots in IEEE float32 (no TF32); 16-bit dots multiply exactly and accumulate in float32.
* `FP_FUSION`: off, so `a * b + c` rounds the product and the sum as written (the CPU path's formulas), on any
  compiler version's contraction heuristics.
"""

from __future__ import annotations

import contextlib
import functools
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import triton

from ..errors import ConfigError
from ..ops.mode import emit, needs_grad
from . import kernels as K

PRECISION = "ieee"
FP_FUSION = False
ROPE_ROWS = 16  # rows per rope program (elementwise: the grouping changes no bits)
MEAN_BLOCK = 1024  # elements per temporal-mean program (elementwise)
_GELU = {None: K.GELU_NONE, "none": K.GELU_ERF, "tanh": K.GELU_TANH}


@dataclass(frozen=True)
class Tiles:
    """A launch configuration: tile sizes (what the bits depend on) and warps/stages (how fast)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


def gemm_tiles(dtype: torch.dtype) -> Tiles:
    """The one GEMM configuration of a weight dtype, whatever the row count: 128x128x64 tiles for 16-bit
    (wgmma on sm_90), 64x64x32 for float32 (IEEE dots run on the FMA units)."""
    if dtype == torch.float32:
        return Tiles(64, 64, 32, 4, 3)
    return Tiles(128, 128, 64, 8, 3)


def attention_tiles(head_dim: int) -> Tiles:
    """Query rows per program, key rows per step, and the head dim padded to a power of two (72 -> 128)."""
    return Tiles(64, 64, max(16, triton.next_power_of_2(head_dim)), 4, 2)


def _inference_only(*tensors: torch.Tensor | None) -> None:
    if needs_grad(*tensors):
        raise ConfigError("the invariant GPU path (Triton kernels) computes forward passes only; train with "
                          "batch_invariant(False) on a GPU, or invariant on a CPU")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT sees it: what `bivit.gpu.build` compiles to show what runs."""

    kernel: object
    args: tuple
    kwargs: dict


_recorder: ContextVar[list | None] = ContextVar("bivit_gpu_recorder", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record every launch instead of running it (the outputs stay unwritten): the exact arguments, constexprs
    and options a forward launches, for compiling them ahead (`bivit.gpu.build`). CPU tensors take the Triton
    path meanwhile."""
    from . import _routed

    launches: list[Launch] = []
    token = _recorder.set(launches)
    try:
        with _routed():
            yield launches
    finally:
        _recorder.reset(token)


def _launch(kernel, grid, *args, tiles: Tiles | None = None, **constexprs) -> None:
    kwargs = dict(constexprs, enable_fp_fusion=FP_FUSION)
    if tiles is not None:
        kwargs.update(num_warps=tiles.warps, num_stages=tiles.stages)
    launches = _recorder.get()
    if launches is not None:
        launches.append(Launch(kernel, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


def gemm(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: str | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """`[residual +] gelu(x2 @ weight.T + bias)` for 2-D `x2`, in the weights' dtype (the CPU invariant GEMM's
    contract: the input is cast to it); with `residual` the result is written into it."""
    x2 = x2.to(weight.dtype).contiguous()
    weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    y = residual if residual is not None else x2.new_empty(m, n)
    if m == 0:
        return y
    t = gemm_tiles(weight.dtype)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
    _launch(K.gemm_kernel, grid, x2, weight, weight if bias is None else bias, y, y, m, tiles=t, N=n, K=k,
            HAS_BIAS=bias is not None, GELU=_GELU[gelu], RESIDUAL=residual is not None, PRECISION=PRECISION,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gelu: str | None = None) -> torch.Tensor:
    _inference_only(x, weight, bias)
    out = gemm(x.reshape(-1, x.shape[-1]), weight, bias, gelu)
    return emit("linear" if gelu is None else "linear_gelu", out.view(*x.shape[:-1], weight.shape[0]))


def residual_linear(residual: torch.Tensor, x: torch.Tensor, layers: Sequence[tuple]) -> torch.Tensor:
    """`residual + L_k(... L_1(x))`, written into `residual`: the last GEMM adds into it in its epilogue."""
    _inference_only(residual, x, *(t for layer in layers for t in layer[:2]))
    h = x.reshape(-1, x.shape[-1])
    for weight, bias, gelu in layers[:-1]:
        h = gemm(h, weight, bias, gelu)
    weight, bias, gelu = layers[-1]
    r2 = residual.view(-1, residual.shape[-1])
    if r2.dtype != weight.dtype or not r2.is_contiguous():
        raise ConfigError(f"residual_linear: the residual ({r2.dtype}) must be a contiguous tensor of the "
                          f"weights' dtype ({weight.dtype})")
    gemm(h, weight, bias, gelu, residual=r2)
    return emit("residual_linear", residual)


def patch_conv(pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The patch conv (kernel = stride = patch) as unfold + GEMM: `[L, C, p, p]` -> `[L, D]`."""
    _inference_only(pixels, weight, bias)
    out = gemm(pixels.reshape(pixels.shape[0], -1), weight.reshape(weight.shape[0], -1), bias)
    return emit("patch_conv", out)


def _norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
          rms: bool) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        dummy = x2
        _launch(K.norm_kernel, (x2.shape[0],), x2, dummy if weight is None else weight.contiguous(),
                dummy if bias is None else bias.contiguous(), y, x2.shape[0], x2.stride(0), float(eps), N=n,
                RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                BLOCK_N=triton.next_power_of_2(n))
    return y.view(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    _inference_only(x, weight, bias)
    return emit("layer_norm", _norm(x, weight, bias, eps, rms=False))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    _inference_only(x, weight)
    # eps None is PyTorch's default for RMSNorm: the machine epsilon of the input's dtype
    return emit("rms_norm", _norm(x, weight, None, torch.finfo(x.dtype).eps if eps is None else eps, rms=True))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[L, slots, head_dim]` rotated by float32 tables `[L, head_dim]` -> a new contiguous tensor of x's dtype
    (the formula of `bivit.ops.rope`)."""
    length, slots, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty((length, slots, d), dtype=x.dtype, device=x.device)
    if length:
        cos, sin = (t.to(device=x.device, dtype=torch.float32).contiguous() for t in (cos, sin))
        _launch(K.rope_kernel, (triton.cdiv(length, ROPE_ROWS),), x, cos, sin, y, length, x.stride(0),
                x.stride(1), SLOTS=slots, D=d, BLOCK_R=ROPE_ROWS, BLOCK_D=triton.next_power_of_2(d))
    return y


@functools.lru_cache(maxsize=64)
def _item_table(seqlens: tuple[int, ...], block_m: int, device: torch.device) -> torch.Tensor:
    """One (item start, item length, query block start) row per query block; blocks start at each item's first
    row. Cached: every layer of a forward uses the same table."""
    rows, start = [], 0
    for n in seqlens:
        rows += [(start, n, q0) for q0 in range(start, start + n, block_m)]
        start += n
    return torch.tensor(rows, dtype=torch.int32).view(-1, 3).to(device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int],
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Varlen attention over packed `[L, heads, head_dim]` q/k/v (item i owns `seqlens[i]` rows; q and k rotated
    by `rope` first) -> `[L, heads * head_dim]` in q's dtype."""
    _inference_only(q, k, v)
    if rope is not None:
        q, k = rotate(q, *rope), rotate(k, *rope)
    length, heads, d = q.shape
    out = torch.empty((length, heads, d), dtype=q.dtype, device=q.device)
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ConfigError(f"attention: q/k/v rows must be [heads, {d}] with unit stride (got {t.stride()})")
    if length:
        tiles = attention_tiles(d)
        table = _item_table(tuple(int(n) for n in seqlens), tiles.block_m, q.device)
        _launch(K.attention_kernel, (table.shape[0], heads), q, k, v, out, table, q.stride(0), k.stride(0),
                v.stride(0), out.stride(0), 1.0 / math.sqrt(d), tiles=tiles, D=d, PRECISION=PRECISION,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_k)
    return emit("attention", out.view(length, heads * d))


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk) in x's dtype: frames added in order in float32."""
    _inference_only(x)
    frames = x.contiguous()
    e = frames[0].numel()
    y = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    if e:
        _launch(K.frame_mean_kernel, (triton.cdiv(e, MEAN_BLOCK),), frames, y, frames.shape[0], e,
                BLOCK=MEAN_BLOCK)
    return emit("temporal_mean", y)
