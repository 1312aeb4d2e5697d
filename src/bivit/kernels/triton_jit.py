"""The Triton kernels of the invariant GPU path and their launchers (one or two launches per op: `gemm`, `norm`,
`rotate`, `attention`, `temporal_mean`, which `bivit.ops.cuda` calls), on the kernel floor beside the C kernels.
Importing it imports triton (the `gpu` extra): it is imported only where triton is installed
(`bivit.kernels.cuda.require` first). Each launcher sits beside its kernel: a kernel's arguments are written next
to the one call that passes them.

What makes each kernel batch-invariant is one rule: a row's result is computed by the same instructions, in the
same order, whatever the other rows of the launch are and wherever the row sits in it.
* No kernel takes a size that depends on the batch as a specialised argument: the row count `M` (and the item
  table of attention) is `do_not_specialize`, so one compiled binary serves every batch of a layer shape.
* Every size the model fixes (a layer's N and K, the head dim, the norm width, the heads) is a `tl.constexpr`:
  the compiler sees the exact shape the model runs, so masks and alignments are known at compile time (a
  run-time head dim of 72 compiled to 255 registers with spills and no cp.async pipelining; `tl.constexpr`, to
  a 2-stage pipeline without spills: tests/test_gpu_compiled.py).
* Tiles come from the layer's shape and dtype only (`bivit.kernels.cuda`), never from the row count; K is walked
  from 0 upwards in whole tiles by one program (no split-K), so a dot product adds its terms in one fixed order.
* Attention runs one program per (query block, head) of one item: query blocks start at the item's first row,
  keys are walked from the item's first row, so the pack around an item changes no operation on its data.
Every kernel accumulates in float32 and rounds once to the output dtype.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from .abi import CONSTS
from .cuda import PRECISION, attention_tiles, gemm_tiles, launch
from .gemm import ACTS

ROPE_ROWS = 16  # rows per rope program (elementwise: the grouping changes no bits)
MEAN_BLOCK = 1024  # elements per temporal-mean program (elementwise)

# GELU kinds: the C kernels' ACT_* (abi.CONSTS, checked against each C library at load): one numbering for
# every kernel that takes one.
GELU_TANH = tl.constexpr(CONSTS["ACT_GELU_TANH"])
GELU_ERF = tl.constexpr(CONSTS["ACT_GELU_ERF"])


@triton.jit
def _gelu(y, KIND: tl.constexpr):
    """GELU of a float32 tile: KIND GELU_ERF = erf form, GELU_TANH = tanh approximation (tanh written with exp: one
    formula in the interpreter and on the GPU); ACT_NONE: none."""
    if KIND == GELU_ERF:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif KIND == GELU_TANH:
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    return y


@triton.jit(do_not_specialize=["M"])
def gemm_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = [r +] gelu(x @ w.T + b): x `[M, K]`, w `[N, K]` (a Linear weight), y and r `[M, N]`, all contiguous
    (row strides K and N: known to the compiler, so a K of 588 still loads aligned vectors). With RESIDUAL, the
    GEMM's result is rounded to y's dtype and then added to r in float32 and rounded again: the bits of
    `r.add_(linear(x))`; y may be r itself (each element is read and written by one program)."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    acc = _gelu(acc, GELU)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = y_ptr + rm[:, None] * N + rn[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(out, y, mask=mask)


@triton.jit(do_not_specialize=["M"])
def norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, stride_x, eps, N: tl.constexpr, RMS: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """LayerNorm (or RMSNorm with RMS) of one row per program, in float32, over the last dim of `[M, N]`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    else:
        xc = tl.where(mask, x - tl.sum(x, axis=0) / N, 0.0)
        y = xc * tl.math.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["L"])
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, L, stride_row, stride_slot, SLOTS: tl.constexpr, D: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotary embedding of `[L, SLOTS, D]` by float32 tables `[L, D]`: y = x * cos + pairs_swapped(x) * sin, in
    float32, into a contiguous y. Elementwise: a value's bits depend on that value and its table entries only."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < L) & (d[None, :] < D)
    c = tl.load(cos_ptr + rows[:, None] * D + d[None, :], mask=mask, other=0.0)
    s = tl.load(sin_ptr + rows[:, None] * D + d[None, :], mask=mask, other=0.0)
    for slot in range(SLOTS):
        src = x_ptr + rows[:, None] * stride_row + slot * stride_slot
        x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
        pair = tl.load(src + (d ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * c + pair * s
        tl.store(y_ptr + (rows[:, None] * SLOTS + slot) * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, stride_q, stride_k, stride_v, stride_o, scale,
                     D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Non-causal attention of one query block of one item, one head (flash-attention's online softmax).

    `table` holds one (item start, item length, query block start) row per program: the query block starts
    at start + j * BLOCK_M and the keys are walked from the item's start in BLOCK_N steps, so an item's
    programs do the same work on the same data wherever the item sits in the pack. Rows are `[heads, D]`
    with the head at a stride of D."""
    block = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(table_ptr + block * 3).to(tl.int64)
    end = start + tl.load(table_ptr + block * 3 + 1).to(tl.int64)
    q0 = tl.load(table_ptr + block * 3 + 2).to(tl.int64)
    rm = q0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    dmask = rd < D
    q = tl.load(q_ptr + rm[:, None] * stride_q + head * D + rd[None, :],
                mask=(rm[:, None] < end) & dmask[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        kmask = rn < end
        k = tl.load(k_ptr + rn[None, :] * stride_k + head * D + rd[:, None],
                    mask=kmask[None, :] & dmask[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rn[:, None] * stride_v + head * D + rd[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + rm[:, None] * stride_o + head * D + rd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < end) & dmask[None, :])


@triton.jit(do_not_specialize=["E"])
def frame_mean_kernel(x_ptr, y_ptr, T, E, BLOCK: tl.constexpr):
    """Mean of T frames `[T, E]` (contiguous) -> `[E]`: frame 0 + frame 1 + ... in float32, one division, one
    rounding; the order of `bivit.ops.temporal_mean`'s invariant CPU path, hence its bits."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = offs < E
    acc = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for f in range(1, T):
        acc += tl.load(x_ptr + f * E + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (acc / T).to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------- launchers

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
    launch(gemm_kernel, grid, x2, weight, weight if bias is None else bias, y, y, m, tiles=t, N=n, K=k,
           HAS_BIAS=bias is not None, GELU=ACTS[gelu], RESIDUAL=residual is not None, PRECISION=PRECISION,
           BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k)
    return y


def norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
         rms: bool) -> torch.Tensor:
    """LayerNorm (or RMSNorm) over the last dim, in x's dtype."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        dummy = x2
        launch(norm_kernel, (x2.shape[0],), x2, dummy if weight is None else weight.contiguous(),
               dummy if bias is None else bias.contiguous(), y, x2.shape[0], x2.stride(0), float(eps), N=n,
               RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
               BLOCK_N=triton.next_power_of_2(n))
    return y.view(x.shape)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[L, slots, head_dim]` rotated by float32 tables `[L, head_dim]` -> a new contiguous tensor of x's dtype
    (the formula of `bivit.ops.rope`)."""
    length, slots, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty((length, slots, d), dtype=x.dtype, device=x.device)
    if length:
        cos, sin = (t.to(device=x.device, dtype=torch.float32).contiguous() for t in (cos, sin))
        launch(rope_kernel, (triton.cdiv(length, ROPE_ROWS),), x, cos, sin, y, length, x.stride(0),
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens) -> torch.Tensor:
    """Varlen attention over packed `[L, heads, head_dim]` q/k/v (item i owns `seqlens[i]` rows) -> `[L, heads,
    head_dim]` in q's dtype."""
    length, heads, d = q.shape
    out = torch.empty((length, heads, d), dtype=q.dtype, device=q.device)
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ConfigError(f"attention: q/k/v rows must be [heads, {d}] with unit stride (got {t.stride()})")
    if length:
        tiles = attention_tiles(d)
        table = _item_table(tuple(int(n) for n in seqlens), tiles.block_m, q.device)
        launch(attention_kernel, (table.shape[0], heads), q, k, v, out, table, q.stride(0), k.stride(0),
               v.stride(0), out.stride(0), 1.0 / math.sqrt(d), tiles=tiles, D=d, PRECISION=PRECISION,
               BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_k)
    return out


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk) in x's dtype: frames added in order in float32."""
    frames = x.contiguous()
    e = frames[0].numel()
    y = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    if e:
        launch(frame_mean_kernel, (triton.cdiv(e, MEAN_BLOCK),), frames, y, frames.shape[0], e,
               BLOCK=MEAN_BLOCK)
    return y
