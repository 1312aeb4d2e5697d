"""The op layer: the only place that knows about batch invariance.

Every reduction-bearing op of the model (GEMMs, the patch conv, norms, attention, the temporal mean) is
called through this module. One switch, `batch_invariant(True)`, makes each of them compute an item's rows
in a way that does not depend on which other rows share the call:

* GEMMs run only at pinned row counts ("tiles"). Library GEMMs pick kernels and reduction orders by shape
  (on an AVX-512 EPYC, stock fp32 `F.linear` computes a row three ways: M = 1, M in {2, 3}, M >= 4), but
  at one fixed shape a row's result does not depend on its position or its neighbours. Which row counts
  ("tiles", `CANDIDATE_TILES`) are allowed is decided by `self_check()` on this machine and library, at load:
  the reference tile must compute moved rows bit-identically, and every other size is used only if it
  computes every row bit-identically to the reference tile. The rows of a call are then cut into the largest
  proven tiles, the remainder zero-padded up to a proven size. If even the reference tile is not row-position
  invariant, every row is computed alone (M = 1 always: slow, exact) and the check says so.
* GELU after a GEMM is fused into it (a oneDNN post-op) where available; the probe proves the fused call.
* The patch conv is the same GEMM over flattened patches.
* Norms are row-wise kernels; attention runs per item, so its shapes depend on the item only; the temporal
  mean adds frames in a fixed order in float32.

Every op returns exactly the dtype the op it replaces returns (never a silently promoted float32): that is
the dtype contract that vLLM's invariant `mean` broke on Kimi-K2.6 (issue 41638).

Every op is differentiable in both modes. Where the invariant path calls a kernel that autograd cannot see
through (the pre-packed GEMM, the chunked GELU) or whose stock backward is not invariant (LayerNorm's weight
gradient is summed in per-thread partials), a `torch.autograd.Function` supplies the backward, computed the
invariant way too: the input gradient of a GEMM (`grad_x = grad_y @ W`) runs at the same pinned tiles, so an
item's input gradient does not depend on its batch; weight gradients sum over the batch (by definition they
depend on it) but in a fixed order, so they do not depend on the thread count. Without autograd (`encode`
runs under `inference_mode`) the Functions are skipped: the fast path stays the fast path.

Private PyTorch entry points (oneDNN's pre-packed GEMM and its GELU post-op, GELU with `out=`) are optional: if
one is missing or raises, bivit logs it once and uses public ops, probed afresh: still batch-invariant, slower,
and (for fp32 GEMMs and fused GELU) not the same bits as the private kernel.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from . import kernels

log = logging.getLogger("bivit")
T = TypeVar("T")

# Row counts GEMMs may run at in invariant mode, ascending. REFERENCE_TILE is the tile whose row-position
# invariance the probe proves directly; every other size is used only if it computes each row bit-identically
# to it. Large tiles mean few calls (each call is one OpenMP fork/join, which is what hurts on a busy machine,
# and one output copy less when a whole input fits one call); small ones keep the zero-padding of tails small.
# The probe computes about 2.5x the largest tile's rows per GEMM shape at load, hence no larger tile.
CANDIDATE_TILES = (64, 128, 256, 512, 1024)
REFERENCE_TILE = 256

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
    # bf16 weights pre-packed into oneDNN's blocked layout, per (weight tensor, transposed?) -> (version, packed):
    # dropped with the weight, re-packed when the weight is updated in place (optimizer step, update_weights).
    packed: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)


_plans = _Plans()


# Weights of these dtypes are pre-packed for oneDNN in invariant mode (an extra packed copy of the GEMM weights
# in memory). Without packing, bf16 computes the same bits slower (stock `F.linear` packs on every call); fp32
# falls back to MKL's GEMM, slower here and different bits (still invariant); neither fuses GELU.
PACK_DTYPES = (torch.bfloat16, torch.float32)


def _private(namespace, name: str) -> Callable | None:
    """A private PyTorch entry point, or None when this build lacks it or an earlier call raised."""
    if name in _broken:
        return None
    fn = getattr(namespace, name, None)
    return fn if callable(fn) else None


_broken: set[str] = set()


def _give_up(name: str, error: Exception) -> None:
    if name not in _broken:
        _broken.add(name)
        log.warning("bivit: %s failed (%s); using public ops instead (still batch-invariant, slower)", name, error)


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.dtype in PACK_DTYPES and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and _private(torch.ops.mkldnn, "_linear_pointwise") is not None
            and _private(torch.ops.mkldnn, "_reorder_linear_weight") is not None)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: cannot be updated in place outside inference mode
        return -1


class _PrivateOpFailed(Exception):
    """A private kernel raised; the whole op is recomputed with public ones."""


class _Gemm:
    """The one GEMM call of invariant mode, `x @ weight.t() + bias` (then GELU when `gelu` names its
    approximation); the probe proves facts about exactly this call.

    Weights are packed once (oneDNN's blocked layout): stock bf16 `F.linear` re-packs the weight on every
    call, which at a 256-row tile costs about as much as the multiply itself (the packed call computes the same
    bits); in fp32 oneDNN's packed GEMM is faster than MKL's here. With a packed weight, GELU runs as oneDNN's
    post-op on the float32 accumulator, inside the GEMM: no second pass over the output, no separate kernel
    calls (its bits differ from GELU of the rounded bf16 output, within rounding; both are exact per row).
    Without one, `fuses` is False and the caller applies GELU itself. `key` is the tensor the packed copy
    belongs to (the Linear or conv weight); `transposed` says `weight` is that tensor's transpose (the
    input-gradient GEMM), which gets its own packed copy.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
                 transposed: bool = False, gelu: str | None = None, pack: bool = True) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        if pack and _can_pack(weight):
            slot = _plans.packed.setdefault(key, {})
            version, packed = slot.get(transposed, (None, None))
            if version != _version(key):
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                     REFERENCE_TILE)
                except Exception as e:  # an old or odd oneDNN build: the plain GEMM is just as exact
                    _give_up("_reorder_linear_weight", e)
                    packed = None
                slot[transposed] = (_version(key), packed)
            self.packed = packed
        self.gelu = gelu if self.packed is not None and "_linear_pointwise+gelu" not in _broken else None

    @property
    def fuses(self) -> bool:
        return self.gelu is not None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The GEMM of `x`'s rows, into `out` when given (else a new tensor)."""
        if self.packed is not None:
            try:
                if self.gelu is not None:
                    y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [], self.gelu)
                else:
                    y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            except Exception as e:
                _give_up("_linear_pointwise+gelu" if self.gelu is not None else "_linear_pointwise", e)
                raise _PrivateOpFailed from e
            return y if out is None else out.copy_(y)
        # MKL writes straight into `out` (a row block of the caller's output: no temporary, no copy).
        if out is None:
            out = x.new_empty(x.shape[0], self.weight.shape[0])
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)


def _probe(gemm: _Gemm) -> GemmPlan:
    """Prove, on this machine and library, which tile sizes compute a row the same way as REFERENCE_TILE.

    Row-position invariance at the reference tile: the tile is computed, then computed again with half of its
    rows moved (reversed) to other positions beside other neighbours; each moved row must come back
    bit-identical. Then every other candidate size is allowed only if it reproduces, bit for bit, what
    reference tiles compute for the same rows. Kernel choice depends on shapes, not values, so one probe per
    GEMM shape (and post-op) suffices.
    """
    g = torch.Generator(device="cpu").manual_seed(1234)
    ref_rows, half, most = REFERENCE_TILE, REFERENCE_TILE // 2, max(CANDIDATE_TILES)
    w = gemm.weight
    x = torch.randn(max(most, ref_rows), w.shape[1], generator=g).to(w.device, w.dtype)
    ref = torch.cat([gemm(x[i:i + ref_rows]) for i in range(0, x.shape[0] - ref_rows + 1, ref_rows)])
    moved = torch.randn(ref_rows, w.shape[1], generator=g).to(w.device, w.dtype)
    moved[half:] = torch.flip(x[:half], [0])
    if not torch.equal(torch.flip(gemm(moved)[half:], [0]), ref[:half]):
        return GemmPlan(())
    tiles = [t for t in CANDIDATE_TILES
             if t == ref_rows or (t <= ref.shape[0] and torch.equal(gemm(x[:t]), ref[:t]))]
    return GemmPlan(tuple(sorted(tiles)))


def gemm_plan(gemm: _Gemm) -> GemmPlan:
    """The proven plan for GEMMs of this weight's shape, dtype, device and kernel (probed once, then cached)."""
    w = gemm.weight
    key = (w.shape[0], w.shape[1], w.stride(), w.dtype, w.device, gemm.bias is None, gemm.packed is not None,
           gemm.gelu)
    plan = _plans.by_shape.get(key)
    if plan is None:
        with _plans.lock:
            plan = _plans.by_shape.get(key)
            if plan is None:
                plan = _probe(gemm)
                if plan.exact_fallback and not gemm.fuses:
                    log.warning("bivit: GEMM %sx%s %s is not row-position invariant on this machine; using the "
                                "exact row-by-row path (slower)", w.shape[0], w.shape[1], w.dtype)
                _plans.by_shape[key] = plan
    return plan


def self_check(gemms: Sequence[tuple]) -> list[GemmPlan]:
    """Pack and probe the GEMMs `(weight, bias[, gelu])` of a model at load, so a failure is known (and said)
    up front. `weight` is a Linear weight `[out, in]` or a patch-conv weight `[out, C, p, p]`; `gelu` (None,
    "tanh" or "none") names the GELU that follows the GEMM: the fused call is what is probed then, unless it
    cannot fuse or is not invariant (the plain GEMM is probed instead). Returns the plan inference will use."""

    def fused_plan(w2, b, w, gelu) -> GemmPlan | None:
        gemm = _Gemm(w2, b, w, gelu=gelu)
        return gemm_plan(gemm) if gemm.fuses else None

    plans = []
    with torch.no_grad():
        for w, b, *rest in gemms:
            w2 = w.reshape(w.shape[0], -1)
            gelu = rest[0] if rest else None
            plan = _retrying(lambda: fused_plan(w2, b, w, gelu)) if gelu is not None else None
            if plan is None or plan.exact_fallback:
                plan = _retrying(lambda: gemm_plan(_Gemm(w2, b, w)))
            plans.append(plan)
    return plans


def _retrying(call: Callable[[], T]) -> T:
    """`call()`, and once more if a private kernel failed in it (it is switched off by then: public ops)."""
    try:
        return call()
    except _PrivateOpFailed:
        return call()


def _calls(m: int, tiles: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Cut m rows into GEMM calls (start, rows, tile): the largest tiles first; a remainder runs zero-padded in
    one call when that wastes at most a quarter of it (or when it is below the smallest tile)."""
    calls, start = [], 0
    while start < m:
        rest = m - start
        up = next((t for t in tiles if t >= rest), None)
        if up is not None and (up == tiles[0] or 4 * rest >= 3 * up):
            calls.append((start, rest, up))
            break
        tile = max(t for t in tiles if t <= rest)
        calls.append((start, tile, tile))
        start += tile
    return calls


def _tiled(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
           transposed: bool = False, gelu: str | None = None) -> torch.Tensor:
    """`x2 @ weight.t() + bias` (then GELU if `gelu`) at the proven tile sizes only: each row's bits depend on
    that row alone."""
    return _retrying(lambda: _tiled_or_unfused(x2, weight, bias, key, transposed, gelu))


def _tiled_or_unfused(x2, weight, bias, key, transposed, gelu) -> torch.Tensor:
    if gelu is not None:
        fused = _Gemm(weight, bias, key, transposed, gelu)
        if fused.fuses and not gemm_plan(fused).exact_fallback:
            return _tiled_with(fused, x2)
    gemm = _Gemm(weight, bias, key, transposed)
    if gemm.packed is not None and gemm_plan(gemm).exact_fallback:
        gemm = _Gemm(weight, bias, key, transposed, pack=False)  # row by row: the stock GEMM at M = 1
    out = _tiled_with(gemm, x2)
    return out if gelu is None else _chunked_gelu(out, gelu)


def _tiled_with(gemm: _Gemm, x2: torch.Tensor) -> torch.Tensor:
    m, k = x2.shape
    plan = gemm_plan(gemm)
    if plan.exact_fallback:
        out = x2.new_empty(m, gemm.weight.shape[0])
        for i in range(m):
            gemm(x2[i:i + 1], out=out[i:i + 1])
        return out
    calls = _calls(m, plan.tiles)
    if len(calls) == 1:  # the whole input in one call: its result is the output (no copy)
        return gemm(x2 if m == calls[0][2] else _zero_padded(x2, calls[0][2]))[:m]
    out = x2.new_empty(m, gemm.weight.shape[0])
    for start, rows, tile in calls:
        if rows == tile:
            gemm(x2[start:start + rows], out=out[start:start + rows])
        else:  # the zero-padded tail: its rows are computed as in a full tile
            out[start:] = gemm(_zero_padded(x2[start:], tile))[:rows]
    return out


def _zero_padded(x2: torch.Tensor, rows: int) -> torch.Tensor:
    pad = x2.new_zeros(rows, x2.shape[1])
    pad[:x2.shape[0]] = x2
    return pad


class _InvariantLinear(torch.autograd.Function):
    """`x2 @ weight.t() + bias` (then GELU if `gelu`) at pinned tiles, forward and input gradient; `key` owns
    the packed copies.

    The forward is the inference call itself (fused GELU included), so a trainer's outputs are the bits an
    encoder serves. A fused GEMM keeps no pre-activation; backward recomputes it (one plain tiled GEMM of the
    saved input) instead of storing an `[rows, out]` tensor per layer.
    """

    @staticmethod
    def forward(ctx, x2, weight, bias, key, gelu):
        ctx.save_for_backward(x2, weight, bias, key)
        ctx.gelu = gelu
        return _tiled(x2, weight.detach(), None if bias is None else bias.detach(), key, gelu=gelu)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, bias, key = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.gelu is not None:
            pre = _tiled(x2, weight.detach(), None if bias is None else bias.detach(), key)
            grad = _chunked_gelu_backward(grad, pre, ctx.gelu)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _tiled(grad, weight.detach().t(), None, key, transposed=True)
        if ctx.needs_input_grad[1]:
            gw = grad.t().mm(x2)  # sums over the batch; one GEMM of a fixed shape, whatever the threads
        if bias is not None and ctx.needs_input_grad[2]:
            gb = grad.sum(0, dtype=torch.float32).to(grad.dtype)  # per column, rows added in order
        return gx, gw, gb, None, None


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _invariant_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      key: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
    if _needs_grad(x2, weight, bias):
        return _InvariantLinear.apply(x2, weight, bias, key, gelu)
    return _tiled(x2, weight, bias, key, gelu=gelu)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gelu: str | None = None) -> torch.Tensor:
    """`x @ weight.t() + bias`, then GELU when `gelu` names its approximation ("tanh" or "none" = erf).

    Traced as "linear" then "gelu" in default mode (two stock ops), as one "linear_gelu" in invariant mode."""
    if not _invariant.get():
        out = _emit("linear", F.linear(x, weight, bias))
        return out if gelu is None else _emit("gelu", F.gelu(out, approximate=gelu))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = _invariant_linear(x2, weight, bias, weight, gelu)
    return _emit("linear" if gelu is None else "linear_gelu", out.view(*lead, weight.shape[0]))


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
    # the invariance tests), so both modes share its forward. Its backward sums the weight gradient in
    # per-thread partials (different bits at 1 and 2 threads), hence the Function in invariant mode.
    if _invariant.get() and _needs_grad(x, weight, bias):
        return _emit("layer_norm", _InvariantLayerNorm.apply(x, weight, bias, eps))
    return _emit("layer_norm", F.layer_norm(x, (x.shape[-1],), weight, bias, eps))


class _InvariantLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dim: the stock kernel forward and input gradient (row by row), weight and bias
    gradients summed over rows in a fixed order in float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        y, mean, rstd = torch.native_layer_norm(x2, (d,), weight, bias, eps)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        d = x2.shape[-1]
        g2 = grad.reshape(-1, d).contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.native_layer_norm_backward(g2, x2, (d,), mean, rstd, weight, bias,
                                                           [True, False, False])[0].view(grad.shape)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = (g2.float() * ((x2.float() - mean) * rstd)).sum(0).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = g2.sum(0, dtype=torch.float32).to(bias.dtype)
        return gx, gw, gb, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return _emit("rms_norm", F.rms_norm(x, (x.shape[-1],), weight, eps))


# Vectorised CPU kernels finish each thread's range with scalar code for its last (length mod 2 x vector width)
# elements, and for some ops (tanh-GELU, complex multiply) the scalar code rounds differently from the vector
# code. Which elements land in such a tail depends on the tensor's size and the thread count: on the batch.
# In invariant mode those ops therefore run in calls of exactly POINTWISE_CHUNK elements: 2 x ATen's grain
# size (32768), so a call uses at most 2 threads whatever torch.get_num_threads() says, each thread gets a
# range of 32768 elements — a multiple of every vector width — and no element ever takes the scalar path.
POINTWISE_CHUNK = 2 * 32768


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


def _chunked_gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    out_fn = _private(torch._C._nn, "gelu")
    if out_fn is not None:
        try:
            return _chunked_pointwise(F.gelu, x, out_fn=out_fn, approximate=approximate)
        except Exception as e:  # recomputed whole below: F.gelu at the same chunk size gives the same bits
            _give_up("torch._C._nn.gelu", e)
    return _chunked_pointwise(F.gelu, x, approximate=approximate)


class _InvariantGelu(torch.autograd.Function):
    """GELU in fixed-size chunks, forward and backward (both have vector/scalar rounding differences)."""

    @staticmethod
    def forward(ctx, x, approximate):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return _chunked_gelu(x, approximate)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _chunked_gelu_backward(grad, x, ctx.approximate), None


def _chunked_gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU's input gradient at `x`, in the same fixed-size chunks as the forward."""
    return _chunked_pointwise(torch.ops.aten.gelu_backward, grad, x, out_fn=_gelu_backward_out,
                              approximate=approximate)


def _gelu_backward_out(grad: torch.Tensor, x: torch.Tensor, approximate: str, out: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=approximate, grad_input=out)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if not _invariant.get():
        return _emit("gelu", F.gelu(x, approximate=approximate))
    if _needs_grad(x):
        return _emit("gelu", _InvariantGelu.apply(x, approximate))
    return _emit("gelu", _chunked_gelu(x, approximate))


# --------------------------------------------------------------------------------------------- per-item ops

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    """Non-causal attention over packed `[L, heads, head_dim]` q/k/v where item i owns `seqlens[i]` rows -> `[L,
    heads * head_dim]`.

    Each item attends only to itself, so it runs alone: its kernel shapes depend on that item alone, which
    makes attention batch-invariant in both modes (and is what the reference does on CPU too). On CPUs where
    it is the faster kernel, bf16 and fp32 run bivit's compiled attention (`bivit.kernels`: a fixed split of
    each item into units computed by one thread each, so its bits depend on neither batch nor thread count);
    elsewhere PyTorch's fused attention.
    """
    kernel = kernels.attention() if all(kernels.Attention.supports(t) for t in (q, k, v)) else None
    if kernel is None:
        out = _sdpa(q, k, v, seqlens)
    elif _needs_grad(q, k, v):
        out = _CompiledAttention.apply(q, k, v, list(seqlens), kernel)
    else:
        out = q.new_empty(q.shape)
        with torch.profiler.record_function("bivit::attention"):  # else invisible to torch.profiler
            for s, e in _spans(seqlens):
                kernel(q[s:e], k[s:e], v[s:e], out[s:e])
    return _emit("attention", out.view(q.shape[0], -1))


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
    private backward is missing, the gradient of PyTorch's own attention, recomputed (same math, its rounding).
    """

    @staticmethod
    def forward(ctx, q, k, v, seqlens, kernel):
        out = q.new_empty(q.shape)
        lse = torch.empty(q.shape[0] * q.shape[1], dtype=torch.float32)
        for s, e in _spans(seqlens):
            kernel(q[s:e], k[s:e], v[s:e], out[s:e], lse[s * q.shape[1]:e * q.shape[1]].view(q.shape[1], e - s))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seqlens = seqlens
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        heads = q.shape[1]
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        flash_backward = _private(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
        for s, e in _spans(ctx.seqlens):
            item = _heads_first(grad[s:e], q[s:e], k[s:e], v[s:e], out[s:e])
            item_lse = lse[s * heads:e * heads].view(1, heads, e - s)
            try:
                if flash_backward is None:
                    raise _PrivateOpFailed
                parts = flash_backward(*item, item_lse, 0.0, False, scale=1 / math.sqrt(q.shape[2]))
            except Exception as error:
                if not isinstance(error, _PrivateOpFailed):
                    _give_up("_scaled_dot_product_flash_attention_for_cpu_backward", error)
                parts = _sdpa_grads(*item)
            for g, part in zip(grads, parts):
                g[s:e] = part[0].transpose(0, 1)
        return *grads, None, None


def _sdpa_grads(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                _out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradient of PyTorch's attention at q/k/v (recomputed: the compiled forward's output is not used)."""
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(F.scaled_dot_product_attention(*qkv), qkv, grad)


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk), returning `x.dtype` like `torch.mean` does."""
    if not _invariant.get():
        return _emit("temporal_mean", x.mean(dim=0))
    # Fixed order: frame 0 + frame 1 + ... in float32 (or wider), one division, then back to the input dtype.
    acc = x[0].to(torch.promote_types(x.dtype, torch.float32), copy=True)
    for f in range(1, x.shape[0]):
        acc += x[f]
    return _emit("temporal_mean", (acc / x.shape[0]).to(x.dtype))


# --------------------------------------------------------------------------------------------- training

def checkpoint(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`fn(*args)` with activation checkpointing: the recomputation in backward runs in the mode of the forward."""
    from torch.utils.checkpoint import checkpoint as _checkpoint

    mode = _invariant.get()

    def run(*a):
        with batch_invariant(mode):
            return fn(*a)

    return _checkpoint(run, *args, use_reentrant=False)
