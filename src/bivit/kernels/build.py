"""How bivit's C kernels are built: one shared library per instruction-set variant, compiled by the package
build (`setup.py` reads this file on its own, without importing bivit or torch) and installed inside the package,
like any C extension. Nothing is compiled at run time: a process picks one of the installed libraries
(`bivit.kernels`) and loads it with ctypes.

The variants, best first: `avx512` (bf16 by AVX-512 BF16 dot products, fp32 by FMAs; AMX tiles where the CPU has
them), `avx2` (AVX2 + FMA, all arithmetic in fp32, bf16 widened in registers) and `portable` (plain C, no
instruction-set flags: any CPU). Every one computes bivit-arith/1 (`arith.h`, docs/arithmetic.md): the variant
decides the speed, never the bits. An x86-64 build compiles all three, each with its own flags (one source may
use AVX-512 while the process runs on a CPU without it: only the library the CPU runs is ever loaded); any other
platform compiles `portable`.

OpenMP: every library is linked with `-fopenmp`, so it needs `libgomp.so.1`. `import torch` has loaded PyTorch's
own copy (torch/lib/libgomp.so.1, soname libgomp.so.1) before bivit loads a library, and the dynamic linker
resolves a needed soname to an object already loaded: the process has one OpenMP runtime, PyTorch's, and the
kernels' threads are PyTorch's threads. No system libgomp is needed at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

# -ffp-contract=off: a product and a sum written apart stay apart (rounded twice, as PyTorch rounds them), so the
# RoPE kernel computes PyTorch's bits; the attention's fused multiply-adds are explicit intrinsics.
# -fno-fast-math: a CFLAGS with -ffast-math (a user's, a distribution's) must not reorder bivit-arith/1's sums;
# the load-time conformance check would refuse such a library, this keeps it from being built.
COMMON_CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-fopenmp",)
PACKAGE = "bivit.kernels"


@dataclass(frozen=True)
class Variant:
    """One instruction-set variant of the compiled kernels."""

    name: str
    source: str                             # the C file (it includes the headers of this folder)
    needs: tuple[str, ...]                  # /proc/cpuinfo flags the code executes
    capabilities: tuple[str, ...] | None    # PyTorch CPU capabilities under which it may run (None: any)
    cflags: tuple[str, ...]
    x86_only: bool = True

    @property
    def module(self) -> str:
        """The library's name in the package (`bivit.kernels._bivit_<variant>`, with the platform's extension
        suffix on disk)."""
        return f"_bivit_{self.name}"


VARIANTS = (
    Variant("avx512", "attention_avx512.c", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "f16c"),
            ("AVX512",),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c")),
    Variant("avx2", "attention_avx2.c", ("avx2", "fma", "f16c"), ("AVX2", "AVX512"), ("-mavx2", "-mfma", "-mf16c")),
    # No instruction-set flags: it runs on any CPU the compiler targets (fmaf is the C library's there).
    Variant("portable", "portable.c", (), None, (), x86_only=False),
)

X86_64 = ("x86_64", "amd64")


def buildable(machine: str) -> tuple[Variant, ...]:
    """The variants a build for `machine` (`platform.machine()` of the target) compiles."""
    x86 = machine.lower() in X86_64
    return tuple(v for v in VARIANTS if x86 or not v.x86_only)
