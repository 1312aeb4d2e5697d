"""The op layer: the only place that knows about batch invariance.

Every reduction-bearing op of the model (GEMMs, the patch conv, norms, attention, the temporal mean) is
called through this module. One switch, `batch_invariant(True)`, makes each of them compute an item's rows
in a way that does not depend on which other rows share the call:

* GEMMs run only at pinned row counts ("tiles"). Library GEMMs pick kernels and reduction orders by shape
  (stock CPU `F.linear` computes the same row three different ways for M = 1, M in {2, 3} and M >= 4), but
  at one fixed shape a row's result does not depend on its position or its neighbours. The rows of a call
  are cut into tiles of the largest size in `CANDIDATE_TILES`; the tail is zero-padded up to the smallest
  *proven* tile size. Which
  tile sizes are allowed is decided by `self_check()` on this machine and library, at load: a tile size is
  used only if it computes every row bit-identically to the largest tile. If even the largest tile is not
  row-position invariant, every row is computed alone (M = 1 always: slow, exact) and the check says so.
* The patch conv is the same GEMM over flattened patches.
* Norms are row-wise kernels; attention runs per item, so its shapes depend on the item only; the temporal
  mean adds frames in a fixed order in float32.

Every op returns exactly the dtype the op it replaces returns (never a silently promoted float32): that is
the dtype contract that vLLM's invariant `mean` broke on Kimi-K2.6 (issue 41638).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger("bivit")

# Row counts GEMMs may run at in invariant mode, ascending; the last is the main tile. 256 rows reach the
# GEMM's full speed on our CPUs (128 rows are ~13% slower in bf16); 64 keeps tail padding small.
CANDIDATE_TILES = (64, 256)

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


def _emit(kind: str, out: torch.Tensor) -> torch.Tensor:
    cb = _tracer.get()
    if cb is not None:
        cb(kind, out)
    return out


# --------------------------------------------------------------------------------------------- GEMM

@dataclass
class GemmPlan:
    """Which row counts a GEMM of one shape may run at in invariant mode, as proven by the probe."""

    tiles: tuple[int, ...]  # ascending; empty means: row by row (M = 1), the exact slow path

    @property
    def exact_fallback(self) -> bool:
        return not self.tiles


@dataclass
class _Plans:
    lock: threading.Lock = field(default_factory=threading.Lock)
    by_shape: dict[tuple, GemmPlan] = field(default_factory=dict)
    # bf16 weights pre-packed once into oneDNN's blocked layout, per weight tensor (dropped with it).
    packed: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)


_plans = _Plans()


# Pre-pack bf16 weights for oneDNN (an extra packed copy of those weights in memory; same bits either way).
PACK_BF16 = True


def _can_pack(weight: torch.Tensor) -> bool:
    return (PACK_BF16 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class _Gemm:
    """The one GEMM call of invariant mode for one weight; the probe proves facts about exactly this call.

    bf16 weights are packed once (oneDNN's blocked layout for the pinned tile): stock `F.linear` re-packs the
    weight on every call, which at a 256-row tile costs about as much as the multiply itself. The packed call
    computes the same bits as `F.linear` at the same shape; fp32 keeps MKL's GEMM.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        if _can_pack(weight):
            self.packed = _plans.packed.get(key)
            if self.packed is None:
                try:
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, CANDIDATE_TILES[-1])
                except RuntimeError:  # an old or odd oneDNN build: the plain GEMM is just as exact
                    self.packed = None
                else:
                    _plans.packed[key] = self.packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight.t())
        return torch.addmm(self.bias, x, self.weight.t())


def _probe(gemm: _Gemm) -> GemmPlan:
    """Prove, on this machine and library, which tile sizes compute a row the same way as the largest tile.

    Row-position invariance at the largest tile: the tile is computed, then computed again with half of its
    rows moved (reversed) to other positions beside other neighbours; each moved row must come back
    bit-identical. Then a smaller tile is allowed only if it reproduces its rows bit for bit. Kernel choice
    depends on shapes, not values, so one probe per GEMM shape suffices; it costs three GEMMs.
    """
    g = torch.Generator(device="cpu").manual_seed(1234)
    big, half = CANDIDATE_TILES[-1], CANDIDATE_TILES[-1] // 2
    w = gemm.weight
    x = torch.randn(big, w.shape[1], generator=g).to(w.device, w.dtype)
    ref = gemm(x)
    moved = torch.randn(big, w.shape[1], generator=g).to(w.device, w.dtype)
    moved[half:] = torch.flip(x[:half], [0])
    if not torch.equal(torch.flip(gemm(moved)[half:], [0]), ref[:half]):
        return GemmPlan(())
    tiles = [t for t in CANDIDATE_TILES[:-1] if torch.equal(gemm(x[-t:].contiguous()), ref[-t:])]
    return GemmPlan(tuple(tiles) + (big,))


def gemm_plan(gemm: _Gemm) -> GemmPlan:
    """The proven plan for GEMMs of this weight's shape, dtype, device and kernel (probed once, then cached)."""
    w = gemm.weight
    key = (w.shape[0], w.shape[1], w.dtype, w.device, gemm.bias is None, gemm.packed is not None)
    plan = _plans.by_shape.get(key)
    if plan is None:
        with _plans.lock:
            plan = _plans.by_shape.get(key)
            if plan is None:
                plan = _probe(gemm)
                if plan.exact_fallback:
                    log.warning("bivit: GEMM %sx%s %s is not row-position invariant on this machine; using the "
                                "exact row-by-row path (slower)", w.shape[0], w.shape[1], w.dtype)
                _plans.by_shape[key] = plan
    return plan


def self_check(gemms: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> list[GemmPlan]:
    """Pack and probe the GEMMs `(weight, bias)` of a model at load, so a failure is known (and said) up front.

    `weight` is a Linear weight `[out, in]` or a patch-conv weight `[out, C, p, p]`.
    """
    with torch.no_grad():
        return [gemm_plan(_Gemm(w.reshape(w.shape[0], -1), b, w)) for w, b in gemms]


def _invariant_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      key: torch.Tensor) -> torch.Tensor:
    m, k = x2.shape
    gemm = _Gemm(weight, bias, key)
    plan = gemm_plan(gemm)
    out = x2.new_empty(m, weight.shape[0])
    if plan.exact_fallback:
        for i in range(m):
            out[i:i + 1] = gemm(x2[i:i + 1])
        return out
    big = plan.tiles[-1]
    full = m - m % big
    for start in range(0, full, big):
        out[start:start + big] = gemm(x2[start:start + big])
    if m > full:
        # Zero-pad the tail up to the smallest proven tile: its rows are computed as in a full tile.
        tile = next(t for t in plan.tiles if t >= m - full)
        pad = x2.new_zeros(tile, k)
        pad[:m - full] = x2[full:]
        out[full:] = gemm(pad)[:m - full]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not _invariant.get():
        return _emit("linear", F.linear(x, weight, bias))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = _invariant_linear(x2, weight, bias, weight)
    return _emit("linear", out.view(*lead, weight.shape[0]))


def patch_conv(pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Conv2d with kernel = stride = patch size on `[L, C, p, p]` patches -> `[L, D]`."""
    if not _invariant.get():
        return _emit("patch_conv", F.conv2d(pixels, weight, bias, stride=weight.shape[-1]).flatten(1))
    # A kernel-sized conv over one patch is exactly a GEMM over the flattened patch; pin it like any GEMM.
    out = _invariant_linear(pixels.reshape(pixels.shape[0], -1).contiguous(), weight.reshape(weight.shape[0], -1),
                            bias, weight)
    return _emit("patch_conv", out)


# --------------------------------------------------------------------------------------------- row-wise ops

def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # The CPU kernel normalises each row on its own with one code path whatever the row count (verified by
    # the invariance tests), so both modes share it.
    return _emit("layer_norm", F.layer_norm(x, (x.shape[-1],), weight, bias, eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return _emit("rms_norm", F.rms_norm(x, (x.shape[-1],), weight, eps))


# Vectorised CPU kernels finish each thread's range with scalar code for its last (length mod 2 x vector width)
# elements, and for some ops (tanh-GELU, complex multiply) the scalar code rounds differently from the vector
# code. Which elements land in such a tail depends on the tensor's size and the thread count: on the batch.
# In invariant mode those ops therefore run in calls of exactly POINTWISE_CHUNK elements: 2 x ATen's grain
# size (32768), so a call uses at most 2 threads whatever torch.get_num_threads() says, each thread gets a
# range of 32768 elements — a multiple of every vector width — and no element ever takes the scalar path.
POINTWISE_CHUNK = 2 * 32768


def _chunked_pointwise(fn: Callable[..., torch.Tensor], x: torch.Tensor, **kwargs) -> torch.Tensor:
    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat)
    n = flat.numel()
    full = n - n % POINTWISE_CHUNK
    for start in range(0, full, POINTWISE_CHUNK):
        fn(flat[start:start + POINTWISE_CHUNK], **kwargs, out=out[start:start + POINTWISE_CHUNK])
    if n > full:
        pad = flat.new_zeros(POINTWISE_CHUNK)
        pad[:n - full] = flat[full:]
        out[full:] = fn(pad, **kwargs)[:n - full]
    return out.view(x.shape)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if not _invariant.get():
        return _emit("gelu", F.gelu(x, approximate=approximate))
    return _emit("gelu", _chunked_pointwise(torch._C._nn.gelu, x, approximate=approximate))


# --------------------------------------------------------------------------------------------- per-item ops

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    """Non-causal attention over packed `[L, heads, head_dim]` q/k/v where item i owns `seqlens[i]` rows.

    Each item attends only to itself, so it runs alone: its kernel shapes depend on that item alone, which
    makes attention batch-invariant in both modes (and is what the reference does on CPU too).
    """
    heads, head_dim = q.shape[1], q.shape[2]
    out = q.new_empty(q.shape[0], heads * head_dim)
    start = 0
    for n in seqlens:
        # [1, heads, n, head_dim]: the 4-D form is what selects PyTorch's fused CPU (flash) kernel; 3-D
        # inputs fall back to the unfused math path, 3x slower at Kimi's shapes.
        qi, ki, vi = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
        out[start:start + n].view(n, heads, head_dim).copy_(F.scaled_dot_product_attention(qi, ki, vi)[0]
                                                            .transpose(0, 1))
        start += n
    return _emit("attention", out)


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk), returning `x.dtype` like `torch.mean` does."""
    if not _invariant.get():
        return _emit("temporal_mean", x.mean(dim=0))
    # Fixed order: frame 0 + frame 1 + ... in float32, one division, then back to the input dtype.
    acc = x[0].to(torch.float32, copy=True)
    for f in range(1, x.shape[0]):
        acc += x[f]
    return _emit("temporal_mean", (acc / x.shape[0]).to(x.dtype))
