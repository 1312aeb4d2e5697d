"""Which kernel computes each op: decided once per process, per dtype, from the CPU and the PyTorch build (and
the load-time proof, which can refuse a kernel on this machine: `refuse`, `bivit.ops.proof`).

Invariant mode's GEMM, attention and norms are bivit's compiled kernels (`gemm_kernel`, `attention_kernel`,
`norm_kernel`): the fastest kernel of the compiled library that takes the dtype, passes its self-test, computes
bivit-arith/1 (`bits.conformance`; with BIVIT_ARITH=native that is not required) and was not refused by the
proof. What they add up to is the process's class of bits (`bits_class`). The rest of this docstring is about
the fallback where no compiled GEMM runs (`bivit.ops.tiles`): PyTorch's oneDNN GEMMs at proven row counts.

Why decided up front and never changed: an item's bits depend on which kernel computed them. bivit once
switched a private kernel off process-wide the first time it raised; on a CPU where oneDNN has no bf16 GEMM,
loading a bf16 encoder then changed the bits of a float32 encoder loaded earlier in the same process. Now each
choice is a pure function of (dtype, what oneDNN and PyTorch report about this CPU, which private entry points
this PyTorch build has), checked once on a tiny tensor before any weight is touched, and fixed for the life of
the process. A kernel that raises after it was chosen is a bug and raises (`KernelFailed`), it is never
replaced silently by one that rounds differently.

The choices, per dtype `D` of a GEMM's weights:
* `compute`: the dtype the GEMM multiplies in. `D` where oneDNN has a native GEMM for it (float32 always;
  bfloat16 where it reports bf16 support: AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX; float16 likewise), else
  float32: the weights are widened once, activations per call, and the float32 result is rounded back to `D`.
  A product of two bf16 (or fp16) numbers is exact in float32, so this is the same math as a bf16 GEMM with
  float32 accumulation, several times faster than PyTorch's generic bf16 GEMM on a CPU without bf16 units.
* `packed`: the weights are pre-packed once into oneDNN's blocked layout (`torch.ops.mkldnn`), where this build
  has those entry points and they run here.
* `fused_gelu`: GELU runs as oneDNN's post-op on the float32 accumulator inside the packed GEMM.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernels, notices, state
from ..dtypes import dtype_name
from ..kernels import cpu
from ..kernels.gemm import self_test
from . import bits

log = logging.getLogger("bivit")


# (op, path) -> why: paths the load-time proof refused on this machine (bivit.ops.proof), for this process.
_refused: dict[tuple[str, str], str] = state.table(state.PROOFS)


def refuse(op: str, path: str, why: str) -> None:
    """Never use `path` for `op` again in this process: the proof found it not invariant here. Said once; every
    kernel choice is made again without it (`bivit.state.CHOICES`)."""
    if (op, path) in _refused:
        return
    _refused[(op, path)] = why
    notices.fallback(f"refused-{op}-{path}", f"{op} path {path} refused", why,
                     "the next proven path runs instead", None)
    state.reset(state.CHOICES)


def refused(op: str, path: str) -> bool:
    return (op, path) in _refused


def gemm_kernel(dtype: torch.dtype, device_type: str = "cpu"):
    """Invariant mode's compiled GEMM kernel for weights of `dtype` (`bivit.kernels.GemmKernel`), or None where
    none runs here (PyTorch's GEMMs at proven tiles then: `bivit.ops.tiles`). Fixed per process and dtype,
    except that the load-time proof may refuse it first (`refuse`)."""
    return _decide_gemm_kernel(dtype, device_type)


# Kernels tried before the library's own (tests put a deliberately broken one here to see the proof refuse it).
extra_gemm_kernels: list = []


GEMM_ENV = "BIVIT_GEMM"  # a GEMM kernel's name: run that one wherever it takes the dtype (how tests force each)


@state.memo(state.CHOICES)
def _decide_gemm_kernel(dtype: torch.dtype, device_type: str):
    if device_type != "cpu":
        return None
    name = dtype_name(dtype)
    library = kernels.gemm_kernels()
    candidates = [k for k in library if k.takes(dtype)]
    forced = os.environ.get(GEMM_ENV, "").strip()
    if forced and not any(k.name == forced for k in library):
        notices.note("gemm-forced", f"{GEMM_ENV}={forced} not used", "this process's library has no such GEMM "
                     f"kernel (it has {', '.join(k.name for k in library) or 'none'})", "the usual choice runs")
    elif forced and any(k.name == forced for k in candidates):  # (a kernel that does not take the dtype: not here)
        candidates = [k for k in candidates if k.name == forced]
    amx_off = None
    for kernel in (*extra_gemm_kernels, *candidates):
        if refused("gemm", kernel.name):
            continue
        why = _gemm_self_test(kernel, dtype, self_test)
        if why is not None:
            notices.fallback(f"gemm-{kernel.name}-{name}", f"{kernel.name} GEMM off for {name}",
                             f"it failed its self-test: {why}", "the next GEMM kernel runs instead", None)
            continue
        if kernel not in extra_gemm_kernels and bits.mode() == "canonical":
            off = bits.conformance("gemm", kernel, dtype)
            if off is not None and kernel.name.startswith("amx"):
                amx_off = amx_off or off  # AMX's own order: said once, below, if no AMX kernel computes it
                continue
            if off is not None:
                notices.fallback(f"gemm-{kernel.name}-{name}-bits", f"{kernel.name} GEMM off for {name}",
                                 f"{off} (a miscompile or a CPU fault)", "the next GEMM kernel runs instead", None)
                continue
        if amx_off is not None:
            notices.fallback("gemm-amx-bits", f"AMX not used for {name} GEMMs",
                             f"AMX tiles compute another order of roundings on this CPU than {bits.ARITH} "
                             f"({amx_off})", f"{name} GEMMs run on {kernel.name}, slower, with bits every CPU "
                             "computes", f"{bits.ARITH_ENV}=native (AMX's own bits, this CPU kind only)")
        log.info("bivit: %s GEMMs: %s", name, kernel.describe())
        if dtype != torch.float32 and kernel.name == "fp32":  # no fix: the CPU's limit (or no fp16 kernel)
            notices.fallback(f"gemm-{name}", f"{name} GEMMs widened to float32",
                             f"bivit has no {name} GEMM kernel for this CPU (bf16: AVX-512 BF16 or AMX); its "
                             "weights are widened to float32 once, exact products",
                             "same math, float32 speed, twice the weight memory")
        return kernel
    return None


@state.memo(state.PROOFS)
def _gemm_self_test(kernel, dtype: torch.dtype, test: Callable) -> str | None:
    return test(kernel, dtype)


def attention_kernel(dtype: torch.dtype):
    """Invariant mode's attention for q/k/v of `dtype`: bivit's compiled kernel (`bivit.kernels.Attention`), or
    None for PyTorch's fused attention per item (where no compiled library runs or takes the dtype, where
    BIVIT_ATTENTION=sdpa, or where the proof refused the compiled one)."""
    return _decide_attention(dtype)


@state.memo(state.CHOICES)
def _decide_attention(dtype: torch.dtype):
    if dtype not in kernels.DTYPES:
        return None
    for kernel in kernels.attention_candidates():
        path = kernel.name_for(dtype)
        if refused("attention", path):
            continue
        if bits.mode() == "canonical":
            off = bits.conformance("attention", kernel, dtype)
            if off is not None:
                if kernel.amx:
                    notices.fallback("attention-amx-bits", "AMX attention not used in invariant mode",
                                     f"its exp and sums are not {bits.ARITH}'s", f"bf16 attention runs on "
                                     f"{kernel.variant} code, slower, with bits every CPU computes",
                                     f"{bits.ARITH_ENV}=native (AMX's own bits, this CPU kind only)")
                else:
                    notices.fallback(f"attention-{path}-bits", f"compiled attention ({path}) off",
                                     f"{off} (a miscompile or a CPU fault)", "PyTorch's attention runs instead", None)
                continue
        return kernel
    return None


def norm_kernel(dtype: torch.dtype):
    """Invariant mode's LayerNorm/RMSNorm for rows of `dtype`: bivit's compiled kernel (`bivit.kernels.Norm`), or
    None for PyTorch's row-wise kernels (where no compiled library runs)."""
    return _decide_norm(dtype)


@state.memo(state.CHOICES)
def _decide_norm(dtype: torch.dtype):
    kernel = kernels.norm()
    if kernel is None or refused("norm", "bivit") or dtype not in kernels.ETYPES:
        return None
    off = bits.conformance("norm", kernel, dtype)
    if off is not None:
        notices.fallback(f"norm-bits-{dtype_name(dtype)}", "compiled norms off", f"{off} (a miscompile or a CPU "
                         "fault)", "PyTorch's row-wise norms run instead", None)
        return None
    return kernel


def cpu_bits_class(dtypes: tuple[torch.dtype, ...], batch_invariant: bool) -> str:
    """The class of bits an encoder whose tower and projector compute in `dtypes` (tower first) gets on this CPU
    in this process (`bivit.ops.bits`): bivit-arith/1 where every GEMM, the attention and every norm runs a
    kernel that computes it; otherwise a class named after what runs, tied to this machine kind."""
    if not batch_invariant:
        return f"stock/{bits.machine_tag()}"
    own: list[str] = []
    fallback = False
    for dtype in dict.fromkeys(dtypes):
        kernel = gemm_kernel(dtype)
        fallback |= kernel is None or norm_kernel(dtype) is None
        if kernel is not None and bits.conformance("gemm", kernel, dtype) is not None:
            own.append(f"gemm-{dtype_name(dtype)}={kernel.name}")
    attention = attention_kernel(dtypes[0])
    fallback |= attention is None
    if attention is not None and bits.conformance("attention", attention, dtypes[0]) is not None:
        own.append(f"attention={attention.name_for(dtypes[0])}")
    if fallback:
        return f"fallback/{bits.machine_tag()}"
    return f"native/{','.join(own)}/{bits.machine_tag()}" if own else bits.ARITH


class KernelFailed(RuntimeError):
    """A kernel chosen for this process raised. Not recoverable by switching kernels: that would change bits."""


def private(namespace, name: str) -> Callable | None:
    """A private PyTorch entry point, or None when this build lacks it."""
    fn = getattr(namespace, name, None)
    return fn if callable(fn) else None


@dataclass(frozen=True)
class GemmPath:
    """How invariant-mode GEMMs of one weight dtype run in this process."""

    dtype: torch.dtype
    compute: torch.dtype
    packed: bool
    fused_gelu: bool
    note: str = ""  # why a faster kind of path is not used here ("" when none is missing)

    def describe(self) -> str:
        how = "oneDNN pre-packed" if self.packed else "PyTorch"
        via = "" if self.compute == self.dtype else f" (weights widened to {dtype_name(self.compute)})"
        fused = ", GELU fused" if self.fused_gelu else ""
        return f"{dtype_name(self.dtype)}: {how} {dtype_name(self.compute)} GEMM{via}{fused}"


# What oneDNN needs for a native GEMM per dtype (what a user can look for in the CPU's flags).
_NATIVE_NEEDS = {torch.bfloat16: "AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX",
                 torch.float16: "AVX-512 FP16, AVX-NE-CONVERT or AMX-FP16"}


def _onednn_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN has a native GEMM for the 16-bit `dtype` on this CPU (it honours ONEDNN_MAX_CPU_ISA)."""
    query = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    fn = private(torch.ops.mkldnn, query) if query else None
    if fn is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(fn())
    except Exception:  # an odd build: treat as absent (decided once, the same way in every process)
        return False


def _packed_gemm_runs(dtype: torch.dtype, gelu: str | None) -> bool:
    """One tiny pre-packed GEMM (with GELU `gelu` as post-op) in `dtype`: does this build run it, correctly?"""
    reorder = private(torch.ops.mkldnn, "_reorder_linear_weight")
    pointwise = private(torch.ops.mkldnn, "_linear_pointwise")
    if reorder is None or pointwise is None or not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*s, generator=g).to(dtype) for s in ((24, 40), (24,), (8, 40)))
    try:
        packed = reorder(w, 8)
        y = pointwise(x, packed, b, "none", [], "") if gelu is None else pointwise(x, packed, b, "gelu", [], gelu)
    except Exception as e:
        log.debug("bivit: oneDNN packed GEMM (%s, gelu=%s) does not run here: %s", dtype_name(dtype), gelu, e)
        return False
    ref = F.linear(x.float(), w.float(), b.float())
    if gelu is not None:
        ref = F.gelu(ref, approximate=gelu)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return (y.dtype == dtype and y.shape == ref.shape
            and bool(torch.allclose(y.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))))


def _check_amx() -> None:
    def granted() -> bool:
        try:
            return bool(torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx())
        except Exception:  # an odd build: treat as not granted
            return False

    flags = cpu.cpu_info()[1]
    lost = cpu.amx_unused(flags, cpu.has_amx(flags) and granted(), os.environ.get("ONEDNN_MAX_CPU_ISA"))
    if lost:
        notices.fallback("amx", "AMX not used", lost[0], "bf16 GEMMs run on AVX-512 instead, slower", lost[1])


def gemm_path(dtype: torch.dtype, device_type: str = "cpu") -> GemmPath:
    """The GEMM path of weights in `dtype` on `device_type`, the same in every process on this machine: decided
    on the first call, then fixed (one decision per (dtype, device type), however the call is spelled)."""
    return _decide_gemm_path(dtype, device_type)


@state.memo(state.CHOICES)
def _decide_gemm_path(dtype: torch.dtype, device_type: str) -> GemmPath:
    if device_type != "cpu":
        return GemmPath(dtype, dtype, packed=False, fused_gelu=False)
    if dtype == torch.bfloat16:
        _check_amx()
    compute = torch.float32 if dtype in _NATIVE_NEEDS and not _onednn_native(dtype) else dtype
    packed = _packed_gemm_runs(compute, None)
    fused = packed and all(_packed_gemm_runs(compute, g) for g in ("tanh", "none"))
    name, note, what, instead, fix = dtype_name(dtype), "", "", "", None
    tested_torch = "install the PyTorch build bivit is tested with (torch==2.13.0, CPU)"
    if not packed:
        what, fix = f"{name} GEMMs not pre-packed", tested_torch
        note = ("this PyTorch build has no usable oneDNN pre-packed GEMM (torch.ops.mkldnn._linear_pointwise); "
                "GEMMs are re-packed on every call")
        instead = "weights are re-packed on every call, slower"
    elif not fused:
        what, fix = f"{name} GEMMs without fused GELU", tested_torch
        note = "oneDNN's GELU post-op does not run in this build; GELU is a separate pass"
        instead = "GELU runs as a separate pass, slower"
    elif compute != dtype:
        what = f"{name} GEMMs widened to float32"  # no fix: the CPU's limit (and the fastest GEMM it has)
        note = (f"oneDNN has no {name} GEMM on this CPU (it needs {_NATIVE_NEEDS.get(dtype, '')}); its weights are "
                "widened to float32 once, exact products")
        instead = "same results, float32 speed, twice the weight memory"
    path = GemmPath(dtype, compute, packed, fused, note)
    if note:
        notices.fallback(f"gemm-{name}", what, note.split(";")[0], instead, fix)
    else:
        log.info("bivit: %s", path.describe())
    return path


@state.memo(state.FIXED)
def gelu_out() -> Callable | None:
    """GELU with an `out=` argument (`torch._C._nn.gelu`), or None: F.gelu computes the same bits, with a
    temporary per call."""
    fn = private(torch._C._nn, "gelu")
    if fn is None:
        return None
    try:
        x = torch.randn(16)
        out = torch.empty(16)
        fn(x, approximate="tanh", out=out)
        if not torch.equal(out, F.gelu(x, approximate="tanh")):
            return None
    except Exception:
        return None
    return fn


@state.memo(state.FIXED)
def flash_attention_backward() -> Callable | None:
    """PyTorch's flash-attention backward for CPU (a private op), or None where this build lacks it or it does not
    run: gradients then come from autograd through PyTorch's attention (same math, its own rounding)."""
    fn = private(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    forward = private(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    if fn is None or forward is None:
        return None
    try:
        q, k, v = torch.randn(3, 1, 1, 4, 8).unbind(0)
        out, lse = forward(q, k, v)[:2]
        fn(torch.ones_like(out), q, k, v, out, lse, 0.0, False, scale=1 / math.sqrt(8))
    except Exception:
        return None
    return fn
