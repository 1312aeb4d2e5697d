"""Which kernel computes each op: decided once per process, per dtype, from the CPU and the installed kernels (and
the load-time proof, which can refuse a kernel on this machine: `refuse`, `bivit.ops.proof`).

Invariant mode on a CPU runs bivit's compiled kernels only, one arithmetic: the GEMM, attention and norms are
the fastest kernels of the installed library that take the dtype, pass their self-test, compute bivit-arith/1
(`bits.conformance`; with BIVIT_ARITH=native that is not required) and were not refused by the proof. Where
no such kernel is left (no library for this CPU in the install, a variant named that does not run here,
BIVIT_ATTENTION=sdpa, every kernel refused) invariant mode is refused with the reason (`require`,
`InvarianceError`): it never mixes in PyTorch's kernels, whose bits are another arithmetic. float16 runs the
fp32 kernels on exactly widened values (docs/arithmetic.md). What runs adds up to the process's class of bits
(`cpu_bits_class`), which names every kernel that does not compute bivit-arith/1.

Why decided up front and never changed: an item's bits depend on which kernel computed them. Each choice is a
pure function of (dtype, the CPU, the install, the environment read once), checked once on a tiny problem before
any weight is touched, and fixed for the life of the process: a kernel that raises after it was chosen raises
to the caller; it is never replaced silently by one that rounds differently.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernels
from ..base import notices, state
from ..base.dtypes import dtype_name
from ..errors import BivitError, ConfigError, InvarianceError
from ..kernels.gemm import self_test
from . import bits

log = logging.getLogger("bivit")


# (op, path) -> why: paths the load-time proof refused on this machine (bivit.ops.proof), for this process.
_refused: dict[tuple[str, str], str] = state.table(state.PROOFS)


def refuse(op: str, path: str, why: str) -> None:
    """Never use `path` for `op` again in this process: the proof found it not invariant here. Said once; every
    kernel choice is made again without it (`bivit.base.state.CHOICES`)."""
    if (op, path) in _refused:
        return
    _refused[(op, path)] = why
    notices.fallback(f"refused-{op}-{path}", f"{op} path {path} refused", why,
                     "the next proven path runs instead", None)
    state.reset(state.CHOICES)


def refused(op: str, path: str) -> bool:
    return (op, path) in _refused


def require() -> None:
    """Raise ConfigError, with the reason and the fix, where invariant mode cannot run on this CPU in this process
    (no compiled library runs, or BIVIT_ATTENTION names PyTorch's attention): what an encoder checks at load."""
    why = kernels.unavailable()
    if why is not None:
        fix = f"; {why.fix}" if why.fix else ""
        raise ConfigError(f"invariant mode runs bivit's compiled kernels only, and none runs here: {why}{fix} "
                          "(or use batch_invariant=False)")
    if kernels.attention_choice() == "sdpa":
        raise ConfigError(f"{kernels.ATTENTION_ENV}=sdpa selects PyTorch's attention, another arithmetic than "
                          f"{bits.ARITH}: invariant mode does not run it (unset {kernels.ATTENTION_ENV}, or use "
                          "batch_invariant=False)")


def _none_left(op: str, dtype: torch.dtype) -> BivitError:
    require()
    if dtype not in kernels.ETYPES:
        return ConfigError(f"invariant mode computes {', '.join(map(dtype_name, kernels.ETYPES))}; a {op} in "
                           f"{dtype_name(dtype)} is none of them")
    forced = os.environ.get(GEMM_ENV, "").strip()
    if op == "gemm" and any(k.name == forced and k.takes(dtype) for k in kernels.gemm_kernels()):
        # the user's choice left nothing: theirs to undo, not this machine's fault
        return ConfigError(f"{GEMM_ENV}={forced}: that kernel does not compute {bits.ARITH} in {dtype_name(dtype)} "
                           f"here, and invariant mode runs no other arithmetic (unset {GEMM_ENV}, or "
                           f"{bits.ARITH_ENV}=native for this machine's own bits)")
    refusals = "; ".join(f"{path}: {why}" for (o, path), why in _refused.items() if o == op)
    return InvarianceError(f"no compiled {op} kernel that computes {bits.ARITH} in {dtype_name(dtype)} is left on "
                           f"this machine{': ' + refusals if refusals else ''} (bivit doctor lists why each is off); "
                           "use batch_invariant=False, or report this machine")


def gemm_kernel(dtype: torch.dtype):
    """Invariant mode's compiled GEMM kernel for weights of `dtype` (`bivit.kernels.GemmKernel`); raises
    ConfigError or InvarianceError where none is left. Fixed per process and dtype, except that the load-time
    proof may refuse it first (`refuse`)."""
    kernel = _decide_gemm_kernel(dtype)
    if kernel is None:
        raise _none_left("gemm", dtype)
    return kernel


GEMM_ENV = "BIVIT_GEMM"  # a GEMM kernel's name: run that one wherever it takes the dtype (how tests force each)


@state.memo(state.CHOICES)
def _decide_gemm_kernel(dtype: torch.dtype):
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
    for kernel in candidates:
        if refused("gemm", kernel.name):
            continue
        why = _gemm_self_test(kernel, dtype, self_test)
        if why is not None:
            notices.fallback(f"gemm-{kernel.name}-{name}", f"{kernel.name} GEMM off for {name}",
                             f"it failed its self-test: {why}", "the next GEMM kernel runs instead", None)
            continue
        if bits.mode() == "canonical":
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
    """Invariant mode's attention for q/k/v of `dtype` (`bivit.kernels.Attention`): bivit's compiled kernel of
    that dtype (float16: the float32 kernel, on q/k/v widened exactly, `ops.attend`); raises ConfigError or
    InvarianceError where none is left."""
    kernel = _decide_attention(compute_dtype(dtype))
    if kernel is None:
        raise _none_left("attention", dtype)
    return kernel


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the compiled attention computes q/k/v of `dtype` in: float16 widened (exactly) to float32."""
    return dtype if dtype in kernels.DTYPES else torch.float32


@state.memo(state.CHOICES)
def _decide_attention(dtype: torch.dtype):
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
                                     f"{off} (a miscompile or a CPU fault)", "the next compiled attention runs", None)
                continue
        return kernel
    return None


def norm_kernel(dtype: torch.dtype):
    """Invariant mode's LayerNorm/RMSNorm for rows of `dtype`: bivit's compiled kernel (`bivit.kernels.Norm`);
    raises ConfigError or InvarianceError where it does not run or compute bivit-arith/1 here."""
    kernel = _decide_norm(dtype)
    if kernel is None:
        raise _none_left("norm", dtype)
    return kernel


@state.memo(state.CHOICES)
def _decide_norm(dtype: torch.dtype):
    kernel = kernels.norm()
    if kernel is None or refused("norm", kernel.name) or dtype not in kernels.ETYPES:
        return None
    off = bits.conformance("norm", kernel, dtype)
    if off is not None:
        notices.fallback(f"norm-bits-{dtype_name(dtype)}", "compiled norms off", f"{off} (a miscompile or a CPU "
                         "fault)", "invariant mode is refused", None)
        return None
    return kernel


def cpu_bits_class(dtypes: tuple[torch.dtype, ...], batch_invariant: bool) -> str:
    """The class of bits an encoder whose tower and projector compute in `dtypes` (tower first) gets on this CPU
    in this process (`bivit.ops.bits`). Invariant mode: bivit-arith/1 where every kernel computes it, else
    `native/` and each kernel that does not (BIVIT_ARITH=native), with this machine kind. Default mode:
    `stock/`, PyTorch's kernels with the attention that runs and the thread count (both change its bits), with
    this machine kind and the variables that steer PyTorch's kernels."""
    if not batch_invariant:
        attention = kernels.attention()
        name = "sdpa" if attention is None else attention.name
        return f"stock/attention={name},threads={torch.get_num_threads()}/{bits.machine_tag()}"
    own: list[str] = []
    for dtype in dict.fromkeys(dtypes):
        for op, kernel in (("gemm", gemm_kernel(dtype)), ("norm", norm_kernel(dtype))):
            if bits.conformance(op, kernel, dtype) is not None:
                own.append(f"{op}-{dtype_name(dtype)}={kernel.name}")
    attention, compute = attention_kernel(dtypes[0]), compute_dtype(dtypes[0])
    if bits.conformance("attention", attention, compute) is not None:
        own.append(f"attention={attention.name_for(compute)}")
    return f"native/{','.join(own)}/{bits.machine_tag()}" if own else bits.ARITH


def private(namespace, name: str) -> Callable | None:
    """A private PyTorch entry point, or None when this build lacks it."""
    fn = getattr(namespace, name, None)
    return fn if callable(fn) else None


@state.memo(state.FIXED)
def gelu_out() -> Callable | None:
    """GELU with an `out=` argument (`torch._C._nn.gelu`), or None: F.gelu computes the same bits, with a
    temporary per call."""
    fn = private(torch._C._nn, "gelu")
    if fn is None:
        return None
    try:
        x = torch.randn(16, dtype=torch.float32)
        out = torch.empty(16, dtype=torch.float32)
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
        q, k, v = torch.randn(3, 1, 1, 4, 8, dtype=torch.float32).unbind(0)
        out, lse = forward(q, k, v)[:2]
        fn(torch.ones_like(out), q, k, v, out, lse, 0.0, False, scale=1 / math.sqrt(8))
    except Exception:
        return None
    return fn
