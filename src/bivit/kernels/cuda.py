"""The part of the invariant GPU path that needs no triton: what its kernels need (triton, the version the `gpu`
extra allows), what decides their bits (`facts`) and how a launch is made or recorded (`launch`, `recording`).
The kernels and their launchers, one or two Triton kernel launches per op, are `triton_jit`; the op layer
(`bivit.ops.cuda`) calls those for CUDA tensors in invariant mode (docs/gpu.md).

Everything that changes bits is pinned here, in one place, and reported by `facts`:
* GEMM tiles per weight dtype (`gemm_tiles`), never per row count; attention tiles per head dim.
* `PRECISION`: fp32 dots in IEEE float32 (no TF32); 16-bit dots multiply exactly and accumulate in float32.
* `FP_FUSION`: off, so `a * b + c` rounds the product and the sum as written (the CPU path's formulas), on any
  compiler version's contraction heuristics.

Triton is optional (`pip install 'bivit[gpu]'`): importing this module does not import it; `triton_jit` does.
Under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported) the same launches run on CPU tensors:
how the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..base import notices, state
from ..errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: no stdlib TOML reader; the installed package's metadata is read instead
    tomllib = None

PRECISION = "ieee"
FP_FUSION = False


# --------------------------------------------------------------------------------------------- what it needs

def missing() -> str | None:
    """Why the Triton path cannot run in this process, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'bivit[gpu]')"
    return None


def require() -> None:
    """Raise ConfigError (naming the fix) unless the Triton path can run; say once if its triton is not one
    the `gpu` extra allows."""
    why = missing()
    if why is not None:
        raise ConfigError(f"batch_invariant on a GPU needs bivit's Triton kernels, but {why}")
    unlisted = triton_mismatch()
    if unlisted is not None:
        notices.fallback("triton-version", f"triton {triton_version()}", unlisted,
                         "bivit's Triton kernels run on it untested", "pip install 'bivit[gpu]'")


def triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def triton_mismatch() -> str | None:
    """Why the installed triton is not one the `gpu` extra allows, or None when it is (or none is installed).
    The extra (pyproject.toml) is the one home of the range: read from the source tree bivit runs from, else
    from the installed package's metadata."""
    version = triton_version()
    if version is None:
        return None
    from packaging.requirements import Requirement  # optional: the gpu extra (packaging)

    for line in gpu_extra():
        req = Requirement(line)
        if req.name == "triton" and not req.specifier.contains(version, prereleases=True):
            return f"not a version the gpu extra allows ({req})"
    return None


def gpu_extra() -> list[str]:
    """The requirements of the `gpu` extra."""
    tree = Path(__file__).resolve().parents[3] / "pyproject.toml"
    if tree.is_file() and tomllib is not None:
        return tomllib.loads(tree.read_text())["project"]["optional-dependencies"]["gpu"]
    try:
        requires = importlib.metadata.requires("bivit") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r.split(";")[0].strip() for r in requires if 'extra == "gpu"' in r]


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (TRITON_INTERPRET=1 when triton was imported: its own
    library functions are decorated then)."""
    import triton  # optional: the gpu extra (triton)

    return bool(triton.knobs.runtime.interpret)


def require_interpreter() -> None:
    """What running the launches on CPU tensors needs: triton, in its interpreter, with a dot in fixed order."""
    require()
    if not interpreting():
        raise ConfigError("bivit.ops.dispatch.interpreted() needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                          "triton is imported")
    _fixed_order_interpreter_dot()


@state.memo(state.FIXED)
def _fixed_order_interpreter_dot() -> None:
    """Triton's interpreter computes `tl.dot` with numpy's matmul, i.e. the CPU's BLAS, whose bits for a row can
    depend on where the row sits in the tile (seen: OpenBLAS's Haswell sgemm on an AVX2-only AMD EPYC, one row
    at tile row 0 vs 37), so the interpreter showed pack dependence the kernels do not have. numpy's einsum
    (no BLAS) adds each element's products in K order whatever the other rows: the interpreter's dot then
    depends on the row's data only, as the compiled kernel's does."""
    from triton.runtime import interpreter  # optional: the gpu extra (triton)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8:  # fp8: the interpreter's own conversion
            return stock(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.einsum("ik,kj->ij", a.data, b.data, dtype=d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    stock = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = create_dot


# ---------------------------------------------------------------------------------- what decides the bits

@dataclass(frozen=True)
class Tiles:
    """A launch configuration: tile sizes (what the bits depend on) and warps/stages (how fast)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


def gemm_tiles(dtype: torch.dtype) -> Tiles:
    """The one GEMM configuration of a weight dtype, whatever the row count: 128x128x64 tiles for 16-bit
    (wgmma on sm_90), 64x64x32 for float32 (IEEE dots run on the FMA units)."""
    if dtype == torch.float32:
        return Tiles(64, 64, 32, 4, 3)
    return Tiles(128, 128, 64, 8, 3)


def attention_tiles(head_dim: int) -> Tiles:
    """Query rows per program, key rows per step, and the head dim padded to a power of two (72 -> 128)."""
    return Tiles(64, 64, max(16, 1 << (head_dim - 1).bit_length()), 4, 2)


def facts(device: torch.device, batch_invariant: bool) -> dict:
    """What decides an embedding's bits on a GPU (for the class of bits and `describe`): the device, the library
    versions and, in invariant mode, the kernels' pinned settings."""
    name, capability = "", None
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        capability = list(torch.cuda.get_device_capability(device))
    out = {"device": name, "capability": capability, "torch": torch.__version__, "cuda": torch.version.cuda}
    if batch_invariant:
        out.update(triton=triton_version(), precision=PRECISION, fp_fusion=FP_FUSION,
                   gemm_tiles={str(d).removeprefix("torch."): list(vars(gemm_tiles(d)).values())
                               for d in (torch.bfloat16, torch.float16, torch.float32)},
                   interpreted=missing() is None and interpreting())
    return out


def describe(batch_invariant: bool) -> dict:
    """The `kernels` entry of `Encoder.describe()` for an encoder on a GPU."""
    if not batch_invariant:
        return {"gemm": ["PyTorch F.linear on CUDA (cuBLAS; default mode: not batch invariant)"],
                "attention": "PyTorch SDPA per item", "norm": ["PyTorch's"]}
    return {"gemm": [f"bivit Triton fixed-tile GEMM (triton {triton_version()}, tiles by dtype, no split-K)"],
            "attention": "bivit Triton varlen attention (per-item query blocks)", "norm": ["bivit Triton row norm"]}


# ----------------------------------------------------------------------------------------------- launching

@dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT sees it: what `bivit.diagnose.gpu_build` compiles to show what runs."""

    kernel: object
    args: tuple
    kwargs: dict


_recorder: ContextVar[list | None] = ContextVar("bivit_gpu_recorder", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record every launch instead of running it (the outputs stay unwritten): the exact arguments, constexprs
    and options a forward launches, for compiling them ahead (`bivit.diagnose.gpu_build`)."""
    launches: list[Launch] = []
    token = _recorder.set(launches)
    try:
        yield launches
    finally:
        _recorder.reset(token)


def launch(kernel, grid, *args, tiles: Tiles | None = None, **constexprs) -> None:
    """Launch `kernel` on `grid` with the pinned options (warps and stages from `tiles`), or record it when
    `recording`."""
    kwargs = dict(constexprs, enable_fp_fusion=FP_FUSION)
    if tiles is not None:
        kwargs.update(num_warps=tiles.warps, num_stages=tiles.stages)
    launches = _recorder.get()
    if launches is not None:
        launches.append(Launch(kernel, args, kwargs))
        return
    kernel[grid](*args, **kwargs)
