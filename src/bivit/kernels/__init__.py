"""bivit's own CPU kernels: C sources shipped in this package, compiled on first use and called through ctypes.

Why compiled here and not shipped built: a kernel is only worth having for the instruction set it is written
for, so it is built on the machine that runs it, by the system C compiler, once, into a cache keyed by the
source and the compiler (`cache`: checked before anything in it is loaded). Plain C with a C ABI, no PyTorch
headers: the build takes about a second, and ctypes releases the GIL during the call. The library links the
OpenMP runtime PyTorch has already loaded (`libgomp.so.1`), so its threads are PyTorch's threads.

The attention comes in one variant per instruction set (`VARIANTS`, best first): `avx512` (AVX-512 BF16 dot
products; fp32 by FMAs) and `avx2` (AVX2 + FMA, all arithmetic in fp32; bf16 widened in registers). A process
uses the best variant that both the CPU's flags (/proc/cpuinfo) and PyTorch's own dispatch
(`torch.backends.cpu.get_cpu_capability()`, which honours `ATEN_CPU_CAPABILITY` and says whether the OS saves
the AVX-512 state) allow. The choice is made once per process, from those facts alone, never from a failure.

Where no kernel is used (`attention()` returns None, and says why once in the log), PyTorch's fused attention
runs. `BIVIT_ATTENTION` chooses: `auto` (default: the best variant, except on CPUs with AMX, where PyTorch's
attention runs on AMX tiles), `bivit` (the best variant wherever the CPU can run one), `avx512` or `avx2` (that
variant, if the CPU can run it: how the tests exercise the AVX2 kernel on an AVX-512 machine) or `sdpa` (never).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .cache import CACHE_ENV, Build, KernelUnavailable, Loaded, cache_dir, compiler, load

__all__ = ["ATTENTION_ENV", "CACHE_ENV", "Attention", "KernelUnavailable", "VARIANTS", "Variant", "attention",
           "cache_dir", "compiler", "cpu_info", "load_attention", "pick_variant"]

log = logging.getLogger("bivit")

_HERE = Path(__file__).parent
ATTENTION_ENV = "BIVIT_ATTENTION"
DTYPES = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128  # every variant's register blocking covers head dims up to this (K2.x: 72, K3: 128)
COMMON_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class Variant:
    """One instruction-set variant of the compiled attention."""

    name: str
    source: str
    needs: tuple[str, ...]           # /proc/cpuinfo flags the code executes
    capabilities: tuple[str, ...]    # PyTorch CPU capabilities under which it may run
    cflags: tuple[str, ...]

    def build(self) -> Build:
        return Build(_HERE / self.source, (_HERE / "common.h",), (*COMMON_CFLAGS, *self.cflags))


VARIANTS = (
    Variant("avx512", "attention_avx512.c", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), ("AVX512",),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")),
    Variant("avx2", "attention_avx2.c", ("avx2", "fma"), ("AVX2", "AVX512"), ("-mavx2", "-mfma")),
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
    """The variant `choice` selects on a CPU with `flags` where PyTorch dispatches `capability` kernels; raises
    KernelUnavailable (chosen=True) where none is to run. A pure function of its arguments."""
    if choice == "sdpa":
        raise KernelUnavailable(f"{ATTENTION_ENV}=sdpa", chosen=True)
    named = [v for v in VARIANTS if v.name == choice]
    for v in named or VARIANTS:
        missing = [f for f in v.needs if f not in flags]
        if missing:
            if named:
                raise KernelUnavailable(f"{ATTENTION_ENV}={choice}: this CPU lacks {', '.join(missing)}", chosen=True)
            continue
        if capability not in v.capabilities:
            if named:
                raise KernelUnavailable(f"{ATTENTION_ENV}={choice}: PyTorch runs {capability} kernels here",
                                        chosen=True)
            continue
        if choice == "auto" and "amx_bf16" in flags:
            raise KernelUnavailable(f"AMX-BF16 CPU: PyTorch's fused attention runs on AMX here ({ATTENTION_ENV}=bivit "
                                    "overrides)", chosen=True)
        return v
    needs = " or ".join("+".join(v.needs) for v in VARIANTS)
    raise KernelUnavailable(f"neither this CPU nor PyTorch's {capability} kernels allow a variant (needs {needs})",
                            chosen=True)


@dataclass(frozen=True)
class Attention:
    """The compiled attention (bf16 and fp32) of one variant: one call per packed batch, each item attending to
    itself, `out[L, heads, d]` written in place."""

    loaded: Loaded
    variant: str

    @property
    def lib(self):
        return self.loaded.lib

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 seqlens: Sequence[int], lse: torch.Tensor | None = None) -> None:
        """q/k/v/out: `[L, heads, d]` views of one dtype with a contiguous last dim, item i owning the next
        `seqlens[i]` rows; lse: float32 with room for `heads * L` values (item by item, `[heads, n_i]` each), or
        None."""
        _, heads, d = q.shape
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0, out=cu[1:])
        fn = self.lib.bivit_attention_bf16 if q.dtype == torch.bfloat16 else self.lib.bivit_attention_f32
        rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu.data_ptr(), len(seqlens), heads, d,
                q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                q.stride(1), k.stride(1), v.stride(1), out.stride(1), 1 / math.sqrt(d),
                None if lse is None else lse.data_ptr(), torch.get_num_threads())
        if rc == 1:
            raise MemoryError(f"bivit attention: no memory for the scratch of {len(seqlens)} item(s) of up to "
                              f"{max(seqlens)} patches")
        if rc == 2:
            raise ValueError(f"bivit attention: unsupported head dim {d}")
        if rc != 0:
            raise ValueError(f"bivit attention: bad item lengths {list(seqlens)}")

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        return (q.dtype in DTYPES and q.device.type == "cpu" and q.dim() == 3
                and q.shape[2] <= MAX_HEAD_DIM and q.stride(2) == 1)


def load_attention(variant: Variant) -> Attention:
    """Build (or find in the cache), load and self-test one variant. The caller has checked the CPU runs it."""
    loaded = load(variant.build())
    for fn in (loaded.lib.bivit_attention_bf16, loaded.lib.bivit_attention_f32):
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 11
                       + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    kernel = Attention(loaded, variant.name)
    for dtype, bound in ((torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)):
        _self_test(kernel, dtype, bound)
    return kernel


def _self_test(kernel: Attention, dtype: torch.dtype, bound: float) -> None:
    """Refuse a kernel that does not compute attention (a miscompile, an odd toolchain): compared with float64
    attention on two small items of one call, it must be as close as rounding to `dtype` allows."""
    g = torch.Generator().manual_seed(0)
    lens = [37, 20]
    q, k, v = torch.randn(3, sum(lens), 2, 72, generator=g).to(dtype).unbind(0)
    out = torch.empty_like(q)
    kernel(q, k, v, out, lens)
    err, start = 0.0, 0
    for n in lens:
        item = [t[start:start + n].double().transpose(0, 1) for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*item).transpose(0, 1)
        err = max(err, (out[start:start + n].double() - ref).abs().max().item())
        start += n
    if not err <= bound:
        raise KernelUnavailable(f"the compiled attention ({kernel.variant}) failed its self-test in {dtype} "
                                f"(max error {err:.3g})")


@functools.cache
def attention() -> Attention | None:
    """The compiled attention for this process, or None (PyTorch's fused attention is used instead)."""
    try:
        variant = pick_variant(_attention_choice(), cpu_info()[1], torch.backends.cpu.get_cpu_capability())
        kernel = load_attention(variant)
    except (KernelUnavailable, OSError, AttributeError) as e:
        chosen = isinstance(e, KernelUnavailable) and e.chosen
        (log.info if chosen else log.warning)("bivit: compiled attention not used (%s); PyTorch's fused attention "
                                              "runs instead%s", e, "" if chosen else ", slower")
        return None
    log.info("bivit: compiled attention in use (%s, %s)", kernel.variant, kernel.loaded.path)
    return kernel
