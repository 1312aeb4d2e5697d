"""bivit's own CPU kernels: C sources shipped in this package, compiled on first use and called through ctypes.

Why compiled here and not shipped built: a kernel is only worth having for the instruction set it is written
for, so it is built on the machine that runs it, by the system C compiler, once, into a cache keyed by the
source and the compiler (`cache`: checked before anything in it is loaded). Plain C with a C ABI, no PyTorch
headers: the build takes seconds, once per machine (gcc -O3: 3.3 s for the avx512 variant, 0.8 s for avx2, on
a Zen 5 EPYC), and ctypes releases the GIL during the call. The library links the OpenMP runtime PyTorch has
already loaded (`libgomp.so.1`), so its threads are PyTorch's threads.

The library (GEMMs, attention, RoPE, norms) comes in one variant per instruction set (`VARIANTS`, best first):
`avx512` (bf16 by AVX-512 BF16 dot products, fp32 by FMAs; AMX tiles where the CPU has them), `avx2` (AVX2 +
FMA, all arithmetic in fp32, bf16 widened in registers) and `portable` (plain C: any CPU with a C compiler,
slowly). All of them compute bivit-arith/1 (`arith.h`, docs/arithmetic.md): the variant decides the speed, not
the bits (the AMX tiles only where the load-time conformance check says they compute it too, `bivit.ops.bits`).
A process uses the best variant that both the CPU's flags (/proc/cpuinfo) and PyTorch's own dispatch
(`torch.backends.cpu.get_cpu_capability()`, which honours `ATEN_CPU_CAPABILITY` and says whether the OS saves
the AVX-512 state) allow: decided once per process from those facts, never from a failure. Without a C
compiler `library()` is None, says why once with the fix (`bivit.notices`: a warning where a faster path is
lost, else a note), and PyTorch's kernels run (their bits are the machine's own class). `status()` reports
what happened, for `bivit doctor`.

`BIVIT_ATTENTION` chooses: `auto` (default: the best variant, except that default mode on CPUs with AMX keeps
PyTorch's attention, running on AMX tiles; invariant mode always runs the compiled one), `bivit` (the best
variant wherever one runs), `avx512`, `avx2` or `portable` (that variant, GEMMs and norms included, if the CPU
can run it: how the tests run every variant a machine has) or `sdpa` (PyTorch's attention; the RoPE kernel
computes PyTorch's bits, so it runs whatever the choice). The compiled attention also takes the RoPE tables
(`Attention(..., rope=)`) and rotates q and k as it packs them, with the same bits: inference then never writes
the rotated q and k out.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .. import notices
from . import abi
from .abi import CONSTS, AttentionArgs, NormArgs, RopeArgs, fill
from .cache import CACHE_ENV, Build, KernelUnavailable, Loaded, cache_dir, compiler, find_compiler, load
from .gemm import ETYPES, GemmKernel

__all__ = ["ATTENTION_ENV", "CACHE_ENV", "Attention", "GemmKernel", "KernelUnavailable", "Library", "Norm", "Rope",
           "VARIANTS", "Variant", "attention", "attention_candidates", "attention_declined", "cache_dir", "compiler",
           "cpu_info", "find_compiler", "gemm_kernels", "library", "load_library", "norm", "pick_variant", "rope",
           "status"]

log = logging.getLogger("bivit")

_HERE = Path(__file__).parent
ATTENTION_ENV = "BIVIT_ATTENTION"
DTYPES = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128  # every variant's register blocking covers head dims up to this (K2.x: 72, K3: 128)
# -ffp-contract=off: a product and a sum written apart stay apart (rounded twice, as PyTorch rounds them), so
# the RoPE kernel computes PyTorch's bits; the attention's fused multiply-adds are explicit intrinsics.
COMMON_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class Variant:
    """One instruction-set variant of the compiled kernels."""

    name: str
    source: str
    needs: tuple[str, ...]                  # /proc/cpuinfo flags the code executes
    capabilities: tuple[str, ...] | None    # PyTorch CPU capabilities under which it may run (None: any)
    cflags: tuple[str, ...]

    def build(self) -> Build:
        # Every header: the sources include each other's definitions (arith.h's arithmetic is every variant's).
        # One library per variant holds every kernel (its source is named after the first one written): the
        # compile line names the library, not the attention alone.
        return Build(_HERE / self.source, tuple(sorted(_HERE.glob("*.h"))), (*COMMON_CFLAGS, *self.cflags),
                     what=f"the {self.name} library of GEMM, attention, norm and RoPE kernels from {self.source}")


VARIANTS = (
    Variant("avx512", "attention_avx512.c", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "f16c"),
            ("AVX512",),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c")),
    Variant("avx2", "attention_avx2.c", ("avx2", "fma", "f16c"), ("AVX2", "AVX512"), ("-mavx2", "-mfma", "-mf16c")),
    # No instruction-set flags: it runs on any CPU the compiler targets (fmaf is the C library's there).
    Variant("portable", "portable.c", (), None, ()),
)
ATTENTION_CHOICES = ("auto", "bivit", *(v.name for v in VARIANTS), "sdpa")


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, instruction-set flags) from /proc/cpuinfo; ("", empty) where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "", frozenset()
    model = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), "")
    flags = frozenset(next((l.split(":", 1)[1].split() for l in lines if l.startswith("flags")), []))
    return model, flags


def _attention_choice() -> str:
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        log.warning("bivit: %s=%r is not one of %s; using auto", ATTENTION_ENV, choice, "/".join(ATTENTION_CHOICES))
        return "auto"
    return choice


def pick_variant(choice: str, flags: frozenset[str], capability: str) -> Variant:
    """The variant of the compiled kernels on a CPU with `flags` where PyTorch dispatches `capability` kernels:
    the best one both allow, or the one `choice` names; raises KernelUnavailable where none is to run (chosen
    when `choice` named a variant, else the CPU's limit: no fix). A pure function of its arguments."""
    named = [v for v in VARIANTS if v.name == choice]
    unset = f"unset {ATTENTION_ENV} (auto picks the variant this CPU runs)"
    for v in named or VARIANTS:
        missing = [f for f in v.needs if f not in flags]
        if missing:
            if named:
                raise KernelUnavailable(f"{ATTENTION_ENV}={choice}: this CPU lacks {', '.join(missing)}",
                                        chosen=True, fix=unset)
            continue
        if v.capabilities is not None and capability not in v.capabilities:
            if named:
                raise KernelUnavailable(f"{ATTENTION_ENV}={choice}: PyTorch runs {capability} kernels here",
                                        chosen=True, fix=unset)
            continue
        return v
    raise AssertionError("the portable variant runs anywhere")


def attention_declined(choice: str, flags: frozenset[str]) -> str | None:
    """Why `choice` leaves PyTorch's attention in place on a CPU with `flags` (None: the compiled one runs)."""
    if choice == "sdpa":
        return f"{ATTENTION_ENV}=sdpa"
    if choice == "auto" and "amx_bf16" in flags:
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
        if rc == 1:
            raise MemoryError(f"bivit attention: no memory for the scratch of {len(seqlens)} item(s) of up to "
                              f"{max(seqlens)} patches")
        if rc == 2:
            raise ValueError(f"bivit attention: unsupported head dim {args.d}")
        if rc != 0:
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
        if rc != 0:
            raise ValueError(f"bivit rope: unsupported head dim {d}")

    @staticmethod
    def supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
        return (x.dtype in DTYPES and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
                and x.shape[2] % 2 == 0 and x.shape[2] <= 256 and cos.dtype == torch.float32
                and cos.is_contiguous() and tuple(cos.shape) == (x.shape[0], x.shape[2]))


@dataclass(frozen=True)
class Norm:
    """The compiled LayerNorm / RMSNorm (`norm.h`): bivit-arith/1's norms, row by row."""

    lib: ctypes.CDLL = field(repr=False)

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
        if rc == 1:
            raise MemoryError(f"bivit norm: no memory for a row of {d}")
        if rc != 0:
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
    first chosen: `bivit.ops.backend`). `attention` is the variant's own code (bivit-arith/1); `attention_amx`
    runs bf16 on AMX tiles where the CPU has them (its own arithmetic: BIVIT_ARITH=native), else None."""

    loaded: Loaded
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
        if {"amx_bf16", "amx_tile"} <= flags:
            if lib.bivit_amx_init() == 0:
                kinds[:0] = ["amx", "amx_swapped"]
            else:
                notices.fallback("amx", "AMX not used", "the CPU has AMX but the OS does not grant its tile state to "
                                 "this process (Linux before 5.16, or a VM that hides it)",
                                 "bf16 GEMMs run on AVX-512 BF16 instead, slower",
                                 "a Linux kernel >= 5.16 with AMX enabled for this machine")
    return tuple(GemmKernel(lib, variant, k) for k in kinds)


def load_library(variant: Variant) -> Library:
    """Build (or find in the cache), load and self-test one variant. The caller has checked the CPU runs it."""
    loaded = load(variant.build())
    lib = loaded.lib
    abi.bind(lib)
    gemms = _gemm_kernels(lib, variant.name, cpu_info()[1])
    # AMX tiles for bf16 attention where the GEMM has them, unless a variant was named (BIVIT_ATTENTION=avx512
    # runs that variant's own code).
    amx = any(g.name == "amx" for g in gemms) and _attention_choice() in ("auto", "bivit")
    library = Library(loaded, variant.name, Attention(lib, variant.name), Attention(lib, variant.name, True) if amx
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
    return torch.randn(2 * rows * row + 2 * heads * head, generator=g).to(dtype).as_strided((rows, heads, d),
                                                                                            (row, head, 1))


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


@functools.cache
def library() -> Library | None:
    """This process's compiled kernels (the variant `pick_variant` chooses), or None: PyTorch's kernels are
    used instead, and why is said once, with the fix."""
    choice = _attention_choice()
    try:
        variant = pick_variant(choice, cpu_info()[1], torch.backends.cpu.get_cpu_capability())
        lib = load_library(variant)
    except (KernelUnavailable, OSError, AttributeError) as e:
        if isinstance(e, KernelUnavailable) and e.chosen:
            notices.note("attention", "compiled kernels not used", str(e),
                         "PyTorch's GEMMs (at proven tiles in invariant mode), attention and RoPE run")
        else:
            notices.fallback("attention", "compiled kernels off", str(e),
                             "PyTorch's GEMMs (at proven tiles in invariant mode), attention and RoPE run instead, "
                             "slower", getattr(e, "fix", None))
        return None
    log.info("bivit: compiled kernels in use (%s, %s)", lib.variant, lib.loaded.path)
    return lib


def gemm_kernels() -> tuple[GemmKernel, ...]:
    """This process's compiled GEMM kernels, best first (none where the compiled library does not run)."""
    lib = library()
    return () if lib is None else lib.gemms


def rope() -> Rope | None:
    lib = library()
    return None if lib is None else lib.rope


@functools.cache
def attention() -> Attention | None:
    """The compiled attention for this process, or None (PyTorch's fused attention is used instead; why is said
    once: `bivit.notices`)."""
    lib = library()
    if lib is None:
        return None
    why = attention_declined(_attention_choice(), cpu_info()[1])
    if why:
        notices.note("attention", "compiled attention not used", why, "PyTorch's fused attention runs")
        return None
    log.info("bivit: compiled attention in use (%s)", lib.variant)
    return lib.attention_amx or lib.attention


def attention_candidates() -> tuple[Attention, ...]:
    """Invariant mode's compiled attentions, fastest first (`bivit.ops.backend` picks one): AMX tiles where the
    library has them, then the variant's own code; none where no library runs or BIVIT_ATTENTION=sdpa. Each is
    invariant by construction (PyTorch's fused attention on AMX tiles is faster still but gave other bits at
    other thread counts)."""
    lib = library()
    if lib is None or _attention_choice() == "sdpa":
        return ()
    return tuple(a for a in (lib.attention_amx, lib.attention) if a is not None)


def norm() -> Norm | None:
    lib = library()
    return None if lib is None else lib.norm


def status() -> dict:
    """The compiled attention in this process, as JSON: `in_use`, and `library` (the cached build it runs) or
    `why` (and `fix`) it does not. Builds it on first call, like `attention()`."""
    kernel = attention()
    if kernel is not None:
        return {"in_use": True, "kernel": f"bivit compiled ({kernel.name})", "library": str(library().loaded.path)}
    said = notices.said("attention")
    why = said[0] if said else None
    return {"in_use": False, "kernel": "PyTorch SDPA", "why": why.why if why else "unknown",
            "fix": why.fix if why else None}
