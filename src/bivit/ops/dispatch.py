"""Which ops and kernels run for a device: one explicit table per device type, and the ops the model calls.

* `CPU_OPS`, `cuda_ops()`: the op tables. The CPU's are bivit's CPU ops (invariant or stock inside, by the
  mode); CUDA tensors in invariant mode take the Triton ops (`ops.cuda`); in default mode every tensor takes the
  CPU table's ops, whose stock branches run PyTorch's on any device. `linear` ... `temporal_mean` below pick the
  table for their first tensor: the only place that decides it.
* `backend_for(device)`: what an encoder on that device type does at load and reports: load its kernels
  (`load`), pack the weights and prove invariance (`pack_and_prove`), describe the kernels and name the class of
  bits.
* `interpreted()` / `recording()`: CPU tensors take the CUDA table too, under Triton's interpreter (the GPU
  path's tests and its CPU dry run) or with every launch recorded instead of run (`bivit.diagnose.gpu_build`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .. import kernels
from ..base import state
from ..base.dtypes import dtype_name
from ..errors import ConfigError
from ..kernels import cuda
from . import attend, gemm, norms, pointwise
from .mode import is_batch_invariant
from .proof import prove
from .selection import attention_kernel, compute_dtype, cpu_bits_class, gemm_kernel, norm_kernel, require


@dataclass(frozen=True)
class Ops:
    """The ops of the forward pass for tensors of one device (same names, arguments and output dtypes)."""

    linear: Callable
    patch_conv: Callable
    layer_norm: Callable
    rms_norm: Callable
    attention: Callable
    temporal_mean: Callable


CPU_OPS = Ops(gemm.linear, gemm.patch_conv, norms.layer_norm, norms.rms_norm, attend.attention, pointwise.temporal_mean)


@state.memo(state.FIXED)
def cuda_ops() -> Ops:
    """The Triton ops; triton is checked once per process (`cuda.require`) before any is used."""
    cuda.require()
    from . import cuda as ops  # optional: imports triton (the gpu extra), so only after `require` says it is there

    return Ops(ops.linear, ops.patch_conv, ops.layer_norm, ops.rms_norm, ops.attention, ops.temporal_mean)


_routed: ContextVar[bool] = ContextVar("bivit_cpu_tensors_take_cuda_ops", default=False)


def ops_for(x: torch.Tensor) -> Ops:
    """The op table for an op whose first tensor is `x`."""
    if is_batch_invariant() and (x.device.type == "cuda" or _routed.get()):
        return cuda_ops()
    return CPU_OPS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: str | None = None,
           add_to: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.t() + bias`, then GELU when `gelu` names it ("erf" or "tanh"), then `add_to +` that when
    `add_to` is given (a residual): written into `add_to` unless autograd records, the add fused into the GEMM
    where the device's kernel can (the GPU's adds in its epilogue)."""
    return ops_for(x).linear(x, weight, bias, gelu, add_to)


def patch_conv(pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Conv2d with kernel = stride = patch size on `[L, C, p, p]` patches -> `[L, D]`."""
    return ops_for(pixels).patch_conv(pixels, weight, bias)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return ops_for(x).layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return ops_for(x).rms_norm(x, weight, eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int],
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Non-causal attention over packed `[L, heads, head_dim]` items (each attends to itself) -> `[L, heads *
    head_dim]`; q and k rotated by `rope` first."""
    return ops_for(q).attention(q, k, v, seqlens, rope)


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk), returning `x.dtype`."""
    return ops_for(x).temporal_mean(x)


@contextlib.contextmanager
def _cpu_tensors_take_cuda_ops() -> Iterator[None]:
    token = _routed.set(True)
    try:
        yield
    finally:
        _routed.reset(token)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Send CPU tensors down the GPU path too (tests and the CPU dry run), under Triton's interpreter."""
    cuda.require_interpreter()
    with _cpu_tensors_take_cuda_ops():
        yield


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record every GPU kernel launch instead of running it (`kernels.cuda.recording`), CPU tensors taking the
    GPU path meanwhile (nothing is computed)."""
    with cuda.recording() as launches, _cpu_tensors_take_cuda_ops():
        yield launches


# ------------------------------------------------------------------------------------------- per device

class CpuBackend:
    """Invariant mode on a CPU: bivit's compiled kernels (bivit-arith/1), packed and proven at load."""

    def load(self) -> None:
        kernels.library()  # load and self-test the installed kernels now, not mid-request

    def pack_and_prove(self, model: torch.nn.Module) -> None:
        """Refuse invariant mode where it cannot run here; pack the weights and prove every op invariant on this
        machine now, not on the first request."""
        require()
        gemm.pack_weights(gemm.gemms(model))
        prove(model)

    def describe(self, model: torch.nn.Module, dtypes: Sequence[torch.dtype], batch_invariant: bool) -> dict:
        if not batch_invariant:
            default = kernels.attention()
            return {"gemm": ["PyTorch F.linear (default mode: not batch invariant)"],
                    "attention": "PyTorch SDPA" if default is None else f"bivit compiled ({default.name})",
                    "norm": ["PyTorch row-wise kernel"], "proof": None}
        attention = attention_kernel(dtypes[0])
        return {"gemm": [f"{dtype_name(d)}: {gemm_kernel(d).describe()}" for d in dtypes],
                "attention": f"bivit compiled ({attention.name_for(compute_dtype(dtypes[0]))})",
                "norm": [f"{dtype_name(d)}: {norm_kernel(d).name} compiled norm" for d in dtypes],
                "proof": prove(model).summary()}

    def bits(self, dtypes: Sequence[torch.dtype], batch_invariant: bool) -> str:
        return cpu_bits_class(tuple(dtypes), batch_invariant)


class CudaBackend:
    """Invariant mode on an NVIDIA GPU: bivit's Triton kernels (fixed tiles: nothing to pack or prove)."""

    def load(self) -> None:
        pass  # triton is needed by invariant mode only: `pack_and_prove`

    def pack_and_prove(self, model: torch.nn.Module) -> None:
        cuda_ops()  # fixed tiles: nothing to pack or prove, only triton to check

    def describe(self, model: torch.nn.Module, dtypes: Sequence[torch.dtype], batch_invariant: bool) -> dict:
        return {**cuda.describe(batch_invariant), "proof": None}

    def bits(self, dtypes: Sequence[torch.dtype], batch_invariant: bool) -> str:
        facts = json.dumps(cuda.facts(torch.device("cuda"), batch_invariant), sort_keys=True).encode()
        return f"{'gpu' if batch_invariant else 'stock'}/{hashlib.sha256(facts).hexdigest()[:16]}"


BACKENDS = {"cpu": CpuBackend(), "cuda": CudaBackend()}


def backend_for(device: torch.device):
    """The backend of `device`'s type; ConfigError for another (invariant mode runs on CPUs and NVIDIA GPUs)."""
    try:
        return BACKENDS[device.type]
    except KeyError:
        raise ConfigError(f"option 'device' = {str(device)!r}: bivit runs on cpu and cuda devices") from None


def bits_class(dtypes: Sequence[torch.dtype], device: torch.device, batch_invariant: bool) -> str:
    """The class of bits an encoder whose tower and projector compute in `dtypes` (tower first) gets on `device`
    in this process (`bivit.ops.bits`): `bivit-arith/1`, or the class of what runs there."""
    return backend_for(device).bits(dtypes, batch_invariant)


__all__ = ["BACKENDS", "CPU_OPS", "Ops", "attention", "backend_for", "bits_class", "cuda_ops", "interpreted",
           "layer_norm", "linear", "ops_for", "patch_conv", "recording", "rms_norm", "temporal_mean"]
