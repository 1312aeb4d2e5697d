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

Every op is differentiable in both modes. Where the invariant path calls a kernel that autograd cannot see
through (the pre-packed GEMM, the chunked GELU) or whose stock backward is not invariant (LayerNorm's weight
gradient is summed in per-thread partials), a `torch.autograd.Function` supplies the backward, computed the
invariant way too: the input gradient of a GEMM (`grad_x = grad_y @ W`) runs at the same pinned tiles, so an
item's input gradient does not depend on its batch; weight gradients sum over the batch (by definition they
depend on it) but in a fixed order, so they do not depend on the thread count. Without autograd (`encode`
runs under `inference_mode`) the Functions are skipped: the fast path stays the fast path.

Private PyTorch entry points (oneDNN's pre-packed GEMM, GELU with `out=`) are optional: if one is missing or
raises, bivit logs it once and uses the public op, which computes the same bits at the same shape.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger("bivit")
T = TypeVar("T")

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
    # bf16 weights pre-packed into oneDNN's blocked layout, per (weight tensor, transposed?) -> (version, packed):
    # dropped with the weight, re-packed when the weight is updated in place (optimizer step, update_weights).
    packed: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)


_plans = _Plans()


# Pre-pack bf16 weights for oneDNN (an extra packed copy of those weights in memory; same bits either way).
PACK_BF16 = True


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
        log.warning("bivit: %s failed (%s); using the public op instead (same results, slower)", name, error)


def _can_pack(weight: torch.Tensor) -> bool:
    return (PACK_BF16 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
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
    """The one GEMM call of invariant mode, `x @ weight.t()`; the probe proves facts about exactly this call.

    bf16 weights are packed once (oneDNN's blocked layout for the pinned tile): stock `F.linear` re-packs the
    weight on every call, which at a 256-row tile costs about as much as the multiply itself. The packed call
    computes the same bits as `F.linear` at the same shape; fp32 keeps MKL's GEMM. `key` is the tensor the
    packed copy belongs to (the Linear or conv weight); `transposed` says `weight` is that tensor's transpose
    (the input-gradient GEMM), which gets its own packed copy.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
                 transposed: bool = False) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        if _can_pack(weight):
            slot = _plans.packed.setdefault(key, {})
            version, packed = slot.get(transposed, (None, None))
            if version != _version(key):
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                     CANDIDATE_TILES[-1])
                except Exception as e:  # an old or odd oneDNN build: the plain GEMM is just as exact
                    _give_up("_reorder_linear_weight", e)
                    packed = None
                slot[transposed] = (_version(key), packed)
            self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            try:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            except Exception as e:
                _give_up("_linear_pointwise", e)
                raise _PrivateOpFailed from e
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
    key = (w.shape[0], w.shape[1], w.stride(), w.dtype, w.device, gemm.bias is None, gemm.packed is not None)
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
        return [_retrying(lambda: gemm_plan(_Gemm(w.reshape(w.shape[0], -1), b, w))) for w, b in gemms]


def _retrying(call: Callable[[], T]) -> T:
    """`call()`, and once more if a private kernel failed in it (it is switched off by then: public ops)."""
    try:
        return call()
    except _PrivateOpFailed:
        return call()


def _tiled(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
           transposed: bool = False) -> torch.Tensor:
    """`x2 @ weight.t() + bias` computed at the pinned tile sizes only: each row's bits depend on that row alone."""
    return _retrying(lambda: _tiled_with(_Gemm(weight, bias, key, transposed), x2))


def _tiled_with(gemm: _Gemm, x2: torch.Tensor) -> torch.Tensor:
    m, k = x2.shape
    plan = gemm_plan(gemm)
    out = x2.new_empty(m, gemm.weight.shape[0])
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


class _InvariantLinear(torch.autograd.Function):
    """`x2 @ weight.t() + bias` at pinned tiles, forward and input gradient; `key` owns the packed copies."""

    @staticmethod
    def forward(ctx, x2, weight, bias, key):
        ctx.save_for_backward(x2, weight, key)
        ctx.has_bias = bias is not None
        return _tiled(x2, weight.detach(), None if bias is None else bias.detach(), key)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, key = ctx.saved_tensors
        grad = grad.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _tiled(grad, weight.detach().t(), None, key, transposed=True)
        if ctx.needs_input_grad[1]:
            gw = grad.t().mm(x2)  # sums over the batch; one GEMM of a fixed shape, whatever the threads
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum(0, dtype=torch.float32).to(grad.dtype)  # per column, rows added in order
        return gx, gw, gb, None


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _invariant_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      key: torch.Tensor) -> torch.Tensor:
    if _needs_grad(x2, weight, bias):
        return _InvariantLinear.apply(x2, weight, bias, key)
    return _tiled(x2, weight, bias, key)


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
        return _chunked_pointwise(torch.ops.aten.gelu_backward, grad, x, out_fn=_gelu_backward_out,
                                  approximate=ctx.approximate), None


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
