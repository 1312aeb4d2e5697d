"""bivit's own CPU kernels: C libraries built with the package and installed in it, called through ctypes.

The package build compiles one library per instruction-set variant (`build`: `avx512`, `avx2`, `portable`; an
x86-64 build has all three, other platforms `portable`), so a process never compiles anything: it picks one
installed library and loads it. Plain C with a C ABI, no PyTorch headers; ctypes releases the GIL during the
call; the libraries use the OpenMP runtime PyTorch has loaded (`build` says how), so their threads are PyTorch's.

Every variant computes bivit-arith/1 (`arith.h`, docs/arithmetic.md): the variant decides the speed, not the
bits (AMX tiles only where the load-time conformance check says they compute it too, `bivit.ops.bits`). A
process uses the best installed variant that both the CPU's flags (/proc/cpuinfo) and PyTorch's own dispatch
(`torch.backends.cpu.get_cpu_capability()`, which honours `ATEN_CPU_CAPABILITY` and says whether the OS saves
the AVX-512 state) allow: decided once per process from those facts, never from a failure. Where no library
runs (an install without its kernels, a variant named that this CPU or install lacks), `library()` is None
and `unavailable()` says why: default mode then runs PyTorch's kernels, invariant mode is refused with that
reason (`bivit.ops.selection`). `status()` reports what happened, for `bivit doctor`.

`BIVIT_ATTENTION` chooses: `auto` (default: the best variant, except that default mode on CPUs with AMX keeps
PyTorch's attention, running on AMX tiles), `bivit` (the best variant wherever one runs), `avx512`, `avx2` or
`portable` (that variant, GEMMs and norms included, if the CPU and the install run it: how the tests run every
variant a machine has; the same bits whichever) or `sdpa` (PyTorch's attention in default mode; invariant mode
refuses it). The compiled attention also takes the RoPE tables (`Attention(..., rope=)`) and rotates q and k as
it packs them, with the same bits: inference then never writes the rotated q and k out.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..base import notices, state
from . import abi
from .abi import CONSTS, AttentionArgs, KernelUnavailable, NormArgs, RopeArgs, fill
from .build import VARIANTS, Variant
from .cpu import amx_unused, cpu_info, has_amx
from .gemm import ETYPES, GemmKernel

__all__ = ["ATTENTION_ENV", "Attention", "GemmKernel", "KernelUnavailable", "Library", "Norm", "Rope", "VARIANTS",
           "Variant", "attention", "attention_candidates", "attention_choice", "attention_declined", "cpu_info",
           "gemm_kernels", "installed", "library", "library_path", "load_library", "norm", "pick_variant", "rope",
           "status", "unavailable"]

log = logging.getLogger("bivit")

ATTENTION_ENV = "BIVIT_ATTENTION"
DTYPES = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = CONSTS["MAX_D"]  # every variant's register blocking covers head dims up to this (K2.x: 72, K3: 128)
ATTENTION_CHOICES = ("auto", "bivit", *(v.name for v in VARIANTS), "sdpa")


def attention_choice() -> str:
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        log.warning("bivit: %s=%r is not one of %s; using auto", ATTENTION_ENV, choice, "/".join(ATTENTION_CHOICES))
        return "auto"
    return choice


REINSTALL = "reinstall bivit (pip install bivit, or pip install -e . in a checkout): the package build compiles them"


def library_path(variant: Variant) -> Path | None:
    """Where the package build installed `variant`'s library, or None where this install has none."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{variant.module}{suffix}"
        if path.is_file():
            return path
    return None


@state.memo(state.FIXED)
def installed() -> frozenset[str]:
    """The variants this install has a library of."""
    return frozenset(v.name for v in VARIANTS if library_path(v) is not None)


def pick_variant(choice: str, flags: frozenset[str], capability: str, present: frozenset[str]) -> Variant:
    """The variant of the compiled kernels on a CPU with `flags` where PyTorch dispatches `capability` kernels and
    the install has the variants `present`: the best one all allow, or the one `choice` names; raises
    KernelUnavailable where none is to run (chosen when `choice` named a variant). A pure function of its
    arguments."""
    named = [v for v in VARIANTS if v.name == choice]
    unset = f"unset {ATTENTION_ENV} (auto picks the variant this CPU runs)"
    for v in named or VARIANTS:
        missing = [f for f in v.needs if f not in flags]
        why = None
        if missing:
            why = f"this CPU lacks {', '.join(missing)}"
        elif v.capabilities is not None and capability not in v.capabilities:
            why = f"PyTorch runs {capability} kernels here"
        elif v.name not in present:
            why = f"this install has no {v.name} library (built without it)"
        if why is None:
            return v
        if named:
            raise KernelUnavailable(f"{ATTENTION_ENV}={choice}: {why}", chosen=True, fix=unset)
    raise KernelUnavailable("this install has none of bivit's compiled kernels", fix=REINSTALL)


def attention_declined(choice: str, flags: frozenset[str]) -> str | None:
    """Why default mode leaves PyTorch's attention in place on a CPU with `flags` (None: the compiled one runs)."""
    if choice == "sdpa":
        return f"{ATTENTION_ENV}=sdpa"
    if choice == "auto" and has_amx(flags):
        return (f"AMX-BF16 CPU: in default mode PyTorch's fused attention runs on AMX here ({ATTENTION_ENV}=bivit "
                "overrides; invariant mode runs the compiled one)")
    return None


@dataclass(frozen=True)
class Attention:
    """The compiled attention (bf16 and fp32) of one variant: one call per packed batch, each item attending to
    itself, `out[L, heads, d]` written in place. `amx`: bf16 runs on AMX tiles (`attention_amx.h`; the CPU has
    AMX and the OS grants it), fp32 on the variant's own code."""

    lib: ctypes.CDLL = field(repr=False)
    variant: str
    amx: bool = False

    @property
    def name(self) -> str:
        """The path's name (what `bivit doctor`, `describe()` and the load-time proof call it)."""
        return f"{self.variant}+amx" if self.amx else self.variant

    def name_for(self, dtype: torch.dtype) -> str:
        """What computes `dtype`: AMX tiles run bf16 only."""
        return self.name if dtype == torch.bfloat16 else self.variant

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 seqlens: Sequence[int], lse: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """q/k/v/out: `[L, heads, d]` views of one dtype (out: or float32) with a contiguous last dim, item i owning
        the next `seqlens[i]` rows; lse: float32 with room for `heads * L` values (item by item, `[heads, n_i]` each), or
        None; rope: the (cos, sin) tables of `Rope` (`supports_rope`), which q and k are then rotated by as the
        kernel reads them: the bits of rotating them with `Rope` first."""
        args = self.args(q, k, v, out, seqlens, lse, rope)
        if q.dtype == torch.bfloat16:
            fn = self.lib.bivit_attention_amx_bf16 if self.amx else self.lib.bivit_attention_bf16
        else:
            fn = self.lib.bivit_attention_f32
        rc = fn(args)
        if rc == CONSTS["RC_NO_MEMORY"]:
            raise MemoryError(f"bivit attention: no memory for the scratch of {len(seqlens)} item(s) of up to "
                              f"{max(seqlens)} patches")
        if rc == CONSTS["RC_UNSUPPORTED"]:
            raise ValueError(f"bivit attention: unsupported head dim {args.d}")
        if rc != CONSTS["RC_OK"]:
            raise ValueError(f"bivit attention: bad item lengths {list(seqlens)}")

    def args(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, seqlens: Sequence[int],
             lse: torch.Tensor | None = None,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> AttentionArgs:
        """The C call's arguments for `__call__`'s tensors, every stride named by its tensor (what the tests
        tamper with to show a misplaced stride fails). It keeps the item offsets it points to alive."""
        _, heads, d = q.shape
        cos, sin = rope if rope is not None else (None, None)
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0, out=cu[1:])
        args = fill(AttentionArgs, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
                    cu=cu.data_ptr(), lse=None if lse is None else lse.data_ptr(),
                    cos=None if cos is None else cos.data_ptr(), sin=None if sin is None else sin.data_ptr(),
                    count=len(seqlens), heads=heads, d=d,
                    q_row=q.stride(0), k_row=k.stride(0), v_row=v.stride(0), out_row=out.stride(0),
                    q_head=q.stride(1), k_head=k.stride(1), v_head=v.stride(1), out_head=out.stride(1),
                    scale=1 / math.sqrt(d), yt=ETYPES[out.dtype], threads=torch.get_num_threads())
        args.keep_alive = cu  # the struct holds only cu's address
        return args

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        return (q.dtype in DTYPES and q.device.type == "cpu" and q.dim() == 3
                and q.shape[2] <= MAX_HEAD_DIM and q.stride(2) == 1)

    @staticmethod
    def supports_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether the kernel can rotate q and k itself (`rope=`): an even head dim and `Rope`'s tables."""
        return q.shape[2] % 2 == 0 and all(
            t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == (q.shape[0], q.shape[2])
            for t in (cos, sin))


@dataclass(frozen=True)
class Rope:
    """The compiled rotary embedding (`bivit.ops.rotary` holds the math and PyTorch's form of it; same bits)."""

    lib: ctypes.CDLL

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
        """x, out: `[L, slots, d]` of one dtype, last dim contiguous; cos, sin: contiguous float32 `[L, d]`."""
        rows, slots, d = x.shape
        fn = self.lib.bivit_rope_bf16 if x.dtype == torch.bfloat16 else self.lib.bivit_rope_f32
        rc = fn(fill(RopeArgs, x=x.data_ptr(), out=out.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), rows=rows,
                     slots=slots, d=d, x_row=x.stride(0), x_slot=x.stride(1), out_row=out.stride(0),
                     out_slot=out.stride(1), threads=torch.get_num_threads()))
        if rc != CONSTS["RC_OK"]:
            raise ValueError(f"bivit rope: unsupported head dim {d}")

    @staticmethod
    def supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
        return (x.dtype in DTYPES and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
                and x.shape[2] % 2 == 0 and x.shape[2] <= CONSTS["ROPE_MAX_D"] and cos.dtype == torch.float32
                and cos.is_contiguous() and tuple(cos.shape) == (x.shape[0], x.shape[2]))


@dataclass(frozen=True)
class Norm:
    """The compiled LayerNorm / RMSNorm (`norm.h`): bivit-arith/1's norms, row by row."""

    lib: ctypes.CDLL = field(repr=False)
    name = "bivit"  # the path's name (the proof's, a refusal's, a native class's): one kind of norm per library

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                 rms: bool, out: torch.Tensor, mean: torch.Tensor | None = None,
                 rstd: torch.Tensor | None = None) -> torch.Tensor:
        """x, out: `[rows, d]` with a contiguous last dim; weight, bias: contiguous `[d]` of one dtype (or None);
        mean, rstd: float32 `[rows]` to receive them (LayerNorm's mean; RMSNorm writes rstd only), or None."""
        rows, d = x.shape
        wt = weight if weight is not None else bias
        rc = self.lib.bivit_norm(fill(
            NormArgs, x=x.data_ptr(), w=None if weight is None else weight.data_ptr(),
            b=None if bias is None else bias.data_ptr(), y=out.data_ptr(),
            mean=None if mean is None else mean.data_ptr(), rstd=None if rstd is None else rstd.data_ptr(),
            rows=rows, d=d, x_row=x.stride(0), y_row=out.stride(0), eps=eps, rms=int(rms), xt=ETYPES[x.dtype],
            wt=ETYPES[wt.dtype] if wt is not None else CONSTS["E_F32"], yt=ETYPES[out.dtype],
            threads=torch.get_num_threads()))
        if rc == CONSTS["RC_NO_MEMORY"]:
            raise MemoryError(f"bivit norm: no memory for a row of {d}")
        if rc != CONSTS["RC_OK"]:
            raise ValueError(f"bivit norm: bad sizes {rows}x{d}")
        return out

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
        params = [t for t in (weight, bias) if t is not None]
        return (x.dtype in ETYPES and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
                and all(t.dtype == params[0].dtype and t.dtype in ETYPES and t.is_contiguous()
                        and t.shape == (x.shape[1],) for t in params))


@dataclass(frozen=True)
class Library:
    """One variant's compiled kernels, loaded and self-tested (the GEMM kernels are self-tested per dtype when
    first chosen: `bivit.ops.selection`). `attention` is the variant's own code (bivit-arith/1); `attention_amx`
    runs bf16 on AMX tiles where the CPU has them (its own arithmetic: BIVIT_ARITH=native), else None."""

    path: Path
    variant: str
    attention: Attention
    attention_amx: Attention | None
    rope: Rope
    norm: Norm
    gemms: tuple[GemmKernel, ...]  # the GEMM kernels this CPU runs, best first


def _gemm_kernels(lib: ctypes.CDLL, variant: str, flags: frozenset[str]) -> tuple[GemmKernel, ...]:
    kinds = ["fp32"]
    if variant == "avx512":
        kinds.insert(0, "avx512_bf16")
        if has_amx(flags):
            lost = amx_unused(flags, lib.bivit_amx_init() == 0)
            if lost is None:
                kinds[:0] = ["amx", "amx_swapped"]
            else:
                notices.fallback("amx", "AMX not used", lost[0], "bf16 GEMMs run on AVX-512 BF16 instead, slower",
                                 lost[1])
    return tuple(GemmKernel(lib, variant, k) for k in kinds)


def load_library(variant: Variant) -> Library:
    """Load and self-test one installed variant. The caller has checked the CPU runs it."""
    path = library_path(variant)
    if path is None:
        raise KernelUnavailable(f"this install has no {variant.name} library", fix=REINSTALL)
    lib = ctypes.CDLL(str(path))
    abi.bind(lib)
    gemms = _gemm_kernels(lib, variant.name, cpu_info()[1])
    # AMX tiles for bf16 attention where the GEMM has them, unless a variant was named (BIVIT_ATTENTION=avx512
    # runs that variant's own code).
    amx = any(g.name == "amx" for g in gemms) and attention_choice() in ("auto", "bivit")
    library = Library(path, variant.name, Attention(lib, variant.name), Attention(lib, variant.name, True) if amx
                      else None, Rope(lib), Norm(lib), gemms)
    for dtype, bound in SELF_TEST_BOUNDS.items():
        _self_test(library.attention, dtype, bound)
        if amx and dtype == torch.bfloat16:
            _self_test(library.attention_amx, dtype, bound)
    return library


SELF_TEST_BOUNDS = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}  # the self-test's max error per dtype


def _strided(rows: int, heads: int, d: int, row_pad: int, head_pad: int, g: torch.Generator,
             dtype: torch.dtype) -> torch.Tensor:
    """A random `[rows, heads, d]` view whose heads are `d + head_pad` and rows `heads * (d + head_pad) +
    row_pad` elements apart, in a buffer twice the size it spans (so a call with strides mixed up reads and
    writes wrong places of it, not past it)."""
    head = d + head_pad
    row = heads * head + row_pad
    buffer = torch.randn(2 * rows * row + 2 * heads * head, generator=g, dtype=torch.float32).to(dtype)
    return buffer.as_strided((rows, heads, d), (row, head, 1))


def self_test_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The self-test's q, k, v, out (random) and item lengths: two items, and every tensor with row and head
    strides of its own, all eight different, so a call that passes one tensor's stride for another's (or a
    head stride for a row stride) computes something else and fails the test."""
    g = torch.Generator().manual_seed(0)
    lens = [37, 20]
    q, k, v, out = (_strided(sum(lens), 2, 72, row_pad, head_pad, g, dtype)
                    for row_pad, head_pad in ((5, 3), (11, 1), (0, 7), (2, 2)))
    return q, k, v, out, lens


def _self_test(kernel: Attention, dtype: torch.dtype, bound: float) -> None:
    """Refuse a kernel that does not compute attention (a miscompile, an odd toolchain, arguments in the wrong
    fields): compared with float64 attention on two small items of one call, it must be as close as rounding
    to `dtype` allows. (The RoPE kernel is held to PyTorch's bits by `bivit.ops.rotary` itself.)"""
    q, k, v, out, lens = self_test_inputs(dtype)
    kernel(q, k, v, out, lens)
    err, start = 0.0, 0
    for n in lens:
        item = [t[start:start + n].double().transpose(0, 1) for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*item).transpose(0, 1)
        err = max(err, (out[start:start + n].double() - ref).abs().max().item())
        start += n
    if not err <= bound:
        raise KernelUnavailable(f"the compiled attention ({kernel.name}) failed its self-test in {dtype} "
                                f"(max error {err:.3g})")


@state.memo(state.FIXED)
def _loaded() -> tuple[Library | None, KernelUnavailable | None]:
    try:
        variant = pick_variant(attention_choice(), cpu_info()[1], torch.backends.cpu.get_cpu_capability(),
                               installed())
        lib = load_library(variant)
    except (KernelUnavailable, OSError, AttributeError) as e:  # (AttributeError: an entry point missing)
        why = e if isinstance(e, KernelUnavailable) else KernelUnavailable(
            f"bivit's compiled kernels do not load: {e}", fix=REINSTALL)  # a broken install
        return None, why
    log.info("bivit: compiled kernels in use (%s, %s)", lib.variant, lib.path)
    return lib, None


def library() -> Library | None:
    """This process's compiled kernels (the variant `pick_variant` chooses), or None (`unavailable()` says why:
    default mode then runs PyTorch's kernels, and says so once, `attention`; invariant mode is refused with it)."""
    return _loaded()[0]


def unavailable() -> KernelUnavailable | None:
    """Why no compiled library runs in this process (None where one does)."""
    return _loaded()[1]


def gemm_kernels() -> tuple[GemmKernel, ...]:
    """This process's compiled GEMM kernels, best first (none where the compiled library does not run)."""
    lib = library()
    return () if lib is None else lib.gemms


def rope() -> Rope | None:
    lib = library()
    return None if lib is None else lib.rope


@state.memo(state.FIXED)
def attention() -> Attention | None:
    """The compiled attention for this process, or None (PyTorch's fused attention is used instead; why is said
    once: `bivit.base.notices`)."""
    lib, lost = _loaded()
    if lost is not None:
        if lost.chosen:
            notices.note("attention", "compiled kernels not used", str(lost), "PyTorch's kernels run")
        else:
            notices.fallback("attention", "compiled kernels not used", str(lost), "PyTorch's kernels run, slower",
                             lost.fix)
        return None
    why = attention_declined(attention_choice(), cpu_info()[1])
    if why:
        notices.note("attention", "compiled attention not used", why, "PyTorch's fused attention runs")
        return None
    log.info("bivit: compiled attention in use (%s)", lib.variant)
    return lib.attention_amx or lib.attention


def attention_candidates() -> tuple[Attention, ...]:
    """Invariant mode's compiled attentions, fastest first (`bivit.ops.selection` picks one): AMX tiles where the
    library has them, then the variant's own code; none where no library runs. Each is invariant by construction
    (PyTorch's fused attention on AMX tiles is faster still but gave other bits at other thread counts)."""
    lib = library()
    if lib is None:
        return ()
    return tuple(a for a in (lib.attention_amx, lib.attention) if a is not None)


def norm() -> Norm | None:
    lib = library()
    return None if lib is None else lib.norm


def status() -> dict:
    """The compiled kernels in this process, as JSON: the variants installed, the library loaded (`library`,
    `variant`) or why none is (`why`, `fix`), and the attention default mode runs (`kernel`)."""
    lib, why = library(), unavailable()
    kernel = attention()
    out = {"installed": sorted(installed(), key=[v.name for v in VARIANTS].index),
           "kernel": f"bivit compiled ({kernel.name})" if kernel is not None else "PyTorch SDPA"}
    if lib is not None:
        return {**out, "in_use": True, "variant": lib.variant, "library": str(lib.path)}
    return {**out, "in_use": False, "why": str(why), "fix": why.fix}
