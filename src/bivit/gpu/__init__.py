"""bivit on NVIDIA GPUs: the invariant forward as Triton kernels (docs/gpu.md).

In invariant mode, an op of `bivit.ops` whose first tensor lives on a CUDA device runs the op of the same name in
`bivit.gpu.ops` instead (`route`, applied once in `bivit.ops`): a fixed-tile GEMM with bias, GELU and the
residual add fused, row-wise norms, a varlen attention whose per-item work does not depend on the pack, the
rotary embedding, and the temporal mean; no cuBLAS, no SDPA. In default mode a CUDA tensor takes PyTorch's
stock ops (cuBLAS, fused attention): fast, not batch-invariant.

Triton is optional (`pip install 'bivit[gpu]'`); this package imports it only when a kernel is first needed.
`interpreted()` sends CPU tensors down the same path under Triton's interpreter (TRITON_INTERPRET=1 set before
triton is imported): that is how the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import ConfigError

_on_cpu: ContextVar[bool] = ContextVar("bivit_gpu_on_cpu", default=False)


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
        from .. import notices

        notices.fallback("triton-version", f"triton {_triton_version()}", unlisted,
                         "bivit's Triton kernels run on it untested", "pip install 'bivit[gpu]'")


def triton_mismatch() -> str | None:
    """Why the installed triton is not one the `gpu` extra allows, or None when it is (or none is installed).
    The extra (pyproject.toml) is the one home of the range: read from the source tree bivit runs from, else
    from the installed package's metadata."""
    version = _triton_version()
    if version is None:
        return None
    from packaging.requirements import Requirement

    for line in gpu_extra():
        req = Requirement(line)
        if req.name == "triton" and not req.specifier.contains(version, prereleases=True):
            return f"not a version the gpu extra allows ({req})"
    return None


def gpu_extra() -> list[str]:
    """The requirements of the `gpu` extra."""
    tree = Path(__file__).resolve().parents[3] / "pyproject.toml"
    if tree.is_file() and sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(tree.read_text())["project"]["optional-dependencies"]["gpu"]
    try:
        requires = importlib.metadata.requires("bivit") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r.split(";")[0].strip() for r in requires if 'extra == "gpu"' in r]


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (TRITON_INTERPRET=1 when triton was imported: its own
    library functions are decorated then)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Send CPU tensors down the Triton path too (tests and the CPU dry run), under Triton's interpreter."""
    require()
    if not interpreting():
        raise ConfigError("bivit.gpu.interpreted() needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                          "triton is imported")
    _fixed_order_interpreter_dot()
    with _routed():
        yield


@functools.cache
def _fixed_order_interpreter_dot() -> None:
    """Triton's interpreter computes `tl.dot` with numpy's matmul, i.e. the CPU's BLAS, whose bits for a row can
    depend on where the row sits in the tile (seen: OpenBLAS's Haswell sgemm on an AVX2-only AMD EPYC, one row
    at tile row 0 vs 37), so the interpreter showed pack dependence the kernels do not have. numpy's einsum
    (no BLAS) adds each element's products in K order whatever the other rows: the interpreter's dot then
    depends on the row's data only, as the compiled kernel's does."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8:  # fp8: the interpreter's own conversion
            return stock(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.einsum("ik,kj->ij", a.data, b.data, dtype=d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    stock = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = create_dot


@contextlib.contextmanager
def _routed() -> Iterator[None]:
    """CPU tensors take the Triton path (for `interpreted` and `ops.recording`, which checks nothing else)."""
    token = _on_cpu.set(True)
    try:
        yield
    finally:
        _on_cpu.reset(token)


def takes(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs here: invariant mode, and `x` on a CUDA device (or any device, `interpreted`)."""
    from ..ops.mode import is_batch_invariant  # here: bivit.ops imports this package

    return is_batch_invariant() and (x.device.type == "cuda" or _on_cpu.get())


def route(stock: Callable) -> Callable:
    """`stock` (an op of `bivit.ops`), except where `takes(first tensor)`: then `bivit.gpu.ops.<same name>`."""
    name = stock.__name__

    @functools.wraps(stock)
    def op(x, *args, **kwargs):
        if takes(x):
            require()
            from . import ops

            return getattr(ops, name)(x, *args, **kwargs)
        return stock(x, *args, **kwargs)

    return op


def facts(device: torch.device, batch_invariant: bool) -> dict:
    """What decides an embedding's bits on a GPU (for the fingerprint and `describe`): the device, the library
    versions and, in invariant mode, the kernels' pinned settings."""
    name, capability = "", None
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        capability = list(torch.cuda.get_device_capability(device))
    out = {"device": name, "capability": capability, "torch": torch.__version__, "cuda": torch.version.cuda}
    if batch_invariant:
        from . import ops

        out.update(triton=_triton_version(), precision=ops.PRECISION, fp_fusion=ops.FP_FUSION,
                   gemm_tiles={str(d).removeprefix("torch."): list(vars(ops.gemm_tiles(d)).values())
                               for d in (torch.bfloat16, torch.float16, torch.float32)},
                   interpreted=interpreting())
    return out


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(batch_invariant: bool) -> dict:
    """The `kernels` entry of `Encoder.describe()` for an encoder on a GPU."""
    if not batch_invariant:
        return {"gemm": ["PyTorch F.linear on CUDA (cuBLAS; default mode: not batch invariant)"],
                "attention": "PyTorch SDPA per item"}
    return {"gemm": [f"bivit Triton fixed-tile GEMM (triton {_triton_version()}, tiles by dtype, no split-K)"],
            "attention": "bivit Triton varlen attention (per-item query blocks)"}
