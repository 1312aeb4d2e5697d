"""bivit's own CPU kernels: C sources shipped in this package, compiled on first use and called through ctypes.

Why compiled here and not shipped built: a kernel is only worth having for the instruction set it is written
for (AVX-512 BF16 dot products), so it is built on the machine that runs it, by the system C compiler, once,
into a cache keyed by the source and the compiler (`$BIVIT_KERNEL_CACHE`, else `$XDG_CACHE_HOME/bivit/kernels`,
else `~/.cache/bivit/kernels`). Plain C with a C ABI, no PyTorch headers: the build takes about a second, and
ctypes releases the GIL during the call. The library links the OpenMP runtime PyTorch has already loaded
(`libgomp.so.1`), so its threads are PyTorch's threads.

Where a kernel cannot be used (no compiler, another CPU, a failed build or self-test), `attention()` returns None
and says why once, with the fix (`bivit.notices`: a warning where a faster path is lost, else a note); callers
then use PyTorch's own kernel. `status()` reports what happened, for `bivit doctor` and `Encoder.describe()`. `BIVIT_ATTENTION` chooses: `auto`
(default: the bivit kernel on CPUs with AVX-512 BF16 but without AMX, where it was measured the faster one),
`bivit` (wherever the CPU can run it) or `sdpa` (never).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import notices

log = logging.getLogger("bivit")

_HERE = Path(__file__).parent
ATTENTION_ENV = "BIVIT_ATTENTION"
ATTENTION_CHOICES = ("auto", "bivit", "sdpa")
# Instruction sets the compiled attention needs. AMX Xeons have them too, but there PyTorch's fused attention
# runs on AMX tiles (measured at ~840 GFLOP/s in bf16) and `auto` leaves it in place.
ATTENTION_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp",
          "-shared", "-fPIC")
DTYPES = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128  # the kernel's register blocking covers head dims up to this (K2.x: 72, K3: 128)


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


class KernelUnavailable(Exception):
    """Why a compiled kernel is not used (said once; PyTorch's kernel runs instead). `chosen`: by the
    configuration or because a faster kernel runs (a note), not lost to a failure or to the CPU (a warning).
    `fix`: what the user can do about it (None: nothing)."""

    def __init__(self, reason: str, chosen: bool = False, fix: str | None = None) -> None:
        super().__init__(reason)
        self.chosen = chosen
        self.fix = fix


INSTALL_CC = "install a C compiler (e.g. apt install gcc), or set CC to one"


def find_compiler() -> tuple[str | None, str]:
    """(the C compiler kernels are built with, where it was found): `$CC`, else `cc` or `gcc` on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"], "$CC"
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return found, "PATH"
    return None, "PATH"


def _compiler() -> str:
    cc, _ = find_compiler()
    if not cc:
        raise KernelUnavailable("no C compiler found (no $CC, no cc or gcc on PATH)", fix=INSTALL_CC)
    return cc


def cache_dir() -> Path:
    root = os.environ.get("BIVIT_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bivit" / "kernels"


def build(source: Path) -> Path:
    """Compile `source` into a shared library in the cache (once per source, flags and compiler) -> its path.

    Written under a temporary name and renamed into place, so concurrent processes (dataset workers, server
    replicas) never load a half-written library."""
    cc = _compiler()
    try:
        probe = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C compiler {cc} does not run ({e})", fix=INSTALL_CC) from e
    if probe.returncode != 0:
        raise KernelUnavailable(f"the C compiler {cc} does not work (`{cc} --version` exited {probe.returncode})",
                                fix=INSTALL_CC)
    version = probe.stdout
    key = hashlib.sha256(source.read_bytes() + " ".join(CFLAGS).encode() + version.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {target.parent}: {e}",
                                fix="set BIVIT_KERNEL_CACHE to a writable folder") from e
    try:
        done = subprocess.run([cc, *CFLAGS, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            detail = " ".join(done.stderr.split())[-300:] or f"exit status {done.returncode}"
            raise KernelUnavailable(f"{cc} could not build {source.name}: {detail}",
                                    fix="set CC to a compiler with AVX-512 BF16 support (gcc >= 10, clang >= 9)")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building {source.name} failed: {e}", fix=INSTALL_CC) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclass(frozen=True)
class Attention:
    """The compiled attention (bf16 and fp32): one call per item, `out[n, heads, d]` written in place."""

    lib: ctypes.CDLL

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None = None) -> None:
        """q/k/v/out: `[n, heads, d]` views of one dtype with a contiguous last dim; lse: `[heads, n]` float32
        or None."""
        n, heads, d = q.shape
        fn = self.lib.bivit_attention_bf16 if q.dtype == torch.bfloat16 else self.lib.bivit_attention_f32
        rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, heads, d,
                q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                q.stride(1), k.stride(1), v.stride(1), out.stride(1), 1 / math.sqrt(d),
                None if lse is None else lse.data_ptr(), torch.get_num_threads())
        if rc == 1:
            raise MemoryError(f"bivit attention: no memory for the scratch of an item of {n} patches")
        if rc != 0:
            raise ValueError(f"bivit attention: unsupported head dim {d}")

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        return (q.dtype in DTYPES and q.device.type == "cpu" and q.dim() == 3
                and q.shape[2] <= MAX_HEAD_DIM and q.stride(2) == 1)


def _attention_choice() -> str:
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        log.warning("bivit: %s=%r is not one of %s; using auto", ATTENTION_ENV, choice, "/".join(ATTENTION_CHOICES))
        return "auto"
    return choice


def _load_attention() -> Attention:
    choice = _attention_choice()
    if choice == "sdpa":
        raise KernelUnavailable(f"{ATTENTION_ENV}=sdpa", chosen=True)
    _, flags = cpu_info()
    missing = [f for f in ATTENTION_NEEDS if f not in flags]
    if missing:
        raise KernelUnavailable(f"this CPU lacks {', '.join(missing)}")  # no fix: the CPU's limit
    # /proc/cpuinfo lists what the CPU has; PyTorch's capability also says the OS saves AVX-512 state (else the
    # first instruction would be SIGILL, not an exception) and honours ATEN_CPU_CAPABILITY.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        forced = os.environ.get("ATEN_CPU_CAPABILITY")
        raise KernelUnavailable(f"PyTorch runs {capability} kernels here, not AVX512"
                                + (f" (ATEN_CPU_CAPABILITY={forced})" if forced else " (the OS does not enable AVX-512)"),
                                fix="unset ATEN_CPU_CAPABILITY" if forced else None)
    if choice == "auto" and "amx_bf16" in flags:
        raise KernelUnavailable(f"AMX-BF16 CPU: PyTorch's fused attention runs on AMX here ({ATTENTION_ENV}=bivit "
                                "overrides)", chosen=True)
    lib = ctypes.CDLL(str(build(_HERE / "attention.c")))
    for fn in (lib.bivit_attention_bf16, lib.bivit_attention_f32):
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 11
                       + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    kernel = Attention(lib)
    for dtype, bound in ((torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)):
        _self_test(kernel, dtype, bound)
    return kernel


def _self_test(kernel: Attention, dtype: torch.dtype, bound: float) -> None:
    """Refuse a kernel that does not compute attention (a miscompile, an odd toolchain): compared with float64
    attention on a small item, it must be as close as rounding to `dtype` allows."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 37, 2, 72, generator=g).to(dtype).unbind(0)
    out = torch.empty_like(q)
    kernel(q, k, v, out)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.double().transpose(0, 1) for t in (q, k, v)))
    err = (out.double() - ref.transpose(0, 1)).abs().max().item()
    if not err <= bound:
        raise KernelUnavailable(f"the compiled attention failed its self-test in {dtype} (max error {err:.3g})",
                                fix="set CC to another compiler, and report it with the output of `bivit doctor`")


@functools.cache
def attention() -> Attention | None:
    """The compiled attention for this process, or None (PyTorch's fused attention is used instead; why is said
    once, with the fix: `bivit.notices`)."""
    try:
        kernel = _load_attention()
    except (KernelUnavailable, OSError, AttributeError) as e:
        if isinstance(e, KernelUnavailable) and e.chosen:
            notices.note("attention", "compiled attention not used", str(e), "PyTorch's fused attention runs")
        else:
            notices.fallback("attention", "compiled attention off", str(e),
                             "PyTorch's fused attention runs instead, slower", getattr(e, "fix", None))
        return None
    log.info("bivit: compiled attention in use (%s)", kernel.lib._name)
    return kernel


def status() -> dict:
    """The compiled attention in this process, as JSON: `in_use`, and `library` (the cached build it runs) or
    `why` (and `fix`) it does not. Builds it on first call, like `attention()`."""
    kernel = attention()
    if kernel is not None:
        return {"in_use": True, "kernel": "bivit compiled (AVX-512 BF16)", "library": kernel.lib._name}
    said = notices.said("attention")
    why = said[0] if said else None
    return {"in_use": False, "kernel": "PyTorch SDPA", "why": why.why if why else "unknown",
            "fix": why.fix if why else None}
