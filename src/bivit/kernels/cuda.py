"""The invariant GPU path's kernels, launched: one or two Triton kernel launches per op (`triton_jit`), what they
need (triton, the version the `gpu` extra allows) and what decides their bits (`facts`). The op layer
(`bivit.ops.cuda`) calls these for CUDA tensors in invariant mode (docs/gpu.md).

Everything that changes bits is pinned here, in one place, and reported by `facts`:
* GEMM tiles per weight dtype (`gemm_tiles`), never per row count; attention tiles per head dim.
* `PRECISION`: fp32 dots in IEEE float32 (no TF32); 16-bit dots multiply exactly and accumulate in float32.
* `FP_FUSION`: off, so `a * b + c` rounds the product and the sum as written (the CPU path's formulas), on any
  compiler version's contraction heuristics.

Triton is optional (`pip install 'bivit[gpu]'`): importing this module does not import it; the launchers do.
Under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported) the same launches run on CPU tensors:
how the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import math
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .. import notices, state
from ..errors import ConfigError
from .gemm import ACTS

PRECISION = "ieee"
FP_FUSION = False
ROPE_ROWS = 16  # rows per rope program (elementwise: the grouping changes no bits)
MEAN_BLOCK = 1024  # elements per temporal-mean program (elementwise)


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
    if tree.is_file() and sys.version_info >= (3, 11):
        import tomllib  # stdlib only from Python 3.11 (checked above)

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
        raise ConfigError("bivit.gpu.interpreted() needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                          "triton is imported")
    _fixed_order_interpreter_dot()


@state.memo(state.FIXED)
def _fixed_order_interpreter_dot() -> None:
    """Triton's interpreter computes `tl.dot` with numpy's matmul, i.e. the CPU's BLAS, whose bits for a row can
    depend on where the row sits in the tile (seen: OpenBLAS's Haswell sgemm on an AVX2-only AMD EPYC, one row
    at tile row 0 vs 37), so the interpreter showed pack dependence the kernels do not have. numpy's einsum
    (no BLAS) adds each element's products in K order whatever the other rows: the interpreter's dot then
    depends on the row's data only, as the compiled kernel's does."""
    import numpy as np  # could be module-level: no cycle, no cost (torch, imported above, loads numpy)
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
    import triton  # optional: the gpu extra (triton)

    return Tiles(64, 64, max(16, triton.next_power_of_2(head_dim)), 4, 2)


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
    """One kernel launch as the JIT sees it: what `bivit.gpu.build` compiles to show what runs."""

    kernel: object
    args: tuple
    kwargs: dict


_recorder: ContextVar[list | None] = ContextVar("bivit_gpu_recorder", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record every launch instead of running it (the outputs stay unwritten): the exact arguments, constexprs
    and options a forward launches, for compiling them ahead (`bivit.gpu.build`)."""
    launches: list[Launch] = []
    token = _recorder.set(launches)
    try:
        yield launches
    finally:
        _recorder.reset(token)


def _launch(kernel, grid, *args, tiles: Tiles | None = None, **constexprs) -> None:
    kwargs = dict(constexprs, enable_fp_fusion=FP_FUSION)
    if tiles is not None:
        kwargs.update(num_warps=tiles.warps, num_stages=tiles.stages)
    launches = _recorder.get()
    if launches is not None:
        launches.append(Launch(kernel, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


def gemm(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: str | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """`[residual +] gelu(x2 @ weight.T + bias)` for 2-D `x2`, in the weights' dtype (the CPU invariant GEMM's
    contract: the input is cast to it); with `residual` the result is written into it."""
    import triton  # optional: the gpu extra (triton)

    from . import triton_jit as K  # imports triton at its top: the gpu extra

    x2 = x2.to(weight.dtype).contiguous()
    weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    y = residual if residual is not None else x2.new_empty(m, n)
    if m == 0:
        return y
    t = gemm_tiles(weight.dtype)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
    _launch(K.gemm_kernel, grid, x2, weight, weight if bias is None else bias, y, y, m, tiles=t, N=n, K=k,
            HAS_BIAS=bias is not None, GELU=ACTS[gelu], RESIDUAL=residual is not None, PRECISION=PRECISION,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k)
    return y


def norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
         rms: bool) -> torch.Tensor:
    """LayerNorm (or RMSNorm) over the last dim, in x's dtype."""
    import triton  # optional: the gpu extra (triton)

    from . import triton_jit as K  # imports triton at its top: the gpu extra

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        dummy = x2
        _launch(K.norm_kernel, (x2.shape[0],), x2, dummy if weight is None else weight.contiguous(),
                dummy if bias is None else bias.contiguous(), y, x2.shape[0], x2.stride(0), float(eps), N=n,
                RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                BLOCK_N=triton.next_power_of_2(n))
    return y.view(x.shape)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[L, slots, head_dim]` rotated by float32 tables `[L, head_dim]` -> a new contiguous tensor of x's dtype
    (the formula of `bivit.ops.rope`)."""
    import triton  # optional: the gpu extra (triton)

    from . import triton_jit as K  # imports triton at its top: the gpu extra

    length, slots, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty((length, slots, d), dtype=x.dtype, device=x.device)
    if length:
        cos, sin = (t.to(device=x.device, dtype=torch.float32).contiguous() for t in (cos, sin))
        _launch(K.rope_kernel, (triton.cdiv(length, ROPE_ROWS),), x, cos, sin, y, length, x.stride(0),
                x.stride(1), SLOTS=slots, D=d, BLOCK_R=ROPE_ROWS, BLOCK_D=triton.next_power_of_2(d))
    return y


@functools.lru_cache(maxsize=64)
def _item_table(seqlens: tuple[int, ...], block_m: int, device: torch.device) -> torch.Tensor:
    """One (item start, item length, query block start) row per query block; blocks start at each item's first
    row. Cached: every layer of a forward uses the same table."""
    rows, start = [], 0
    for n in seqlens:
        rows += [(start, n, q0) for q0 in range(start, start + n, block_m)]
        start += n
    return torch.tensor(rows, dtype=torch.int32).view(-1, 3).to(device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens) -> torch.Tensor:
    """Varlen attention over packed `[L, heads, head_dim]` q/k/v (item i owns `seqlens[i]` rows) -> `[L, heads,
    head_dim]` in q's dtype."""
    from . import triton_jit as K  # imports triton at its top: the gpu extra

    length, heads, d = q.shape
    out = torch.empty((length, heads, d), dtype=q.dtype, device=q.device)
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ConfigError(f"attention: q/k/v rows must be [heads, {d}] with unit stride (got {t.stride()})")
    if length:
        tiles = attention_tiles(d)
        table = _item_table(tuple(int(n) for n in seqlens), tiles.block_m, q.device)
        _launch(K.attention_kernel, (table.shape[0], heads), q, k, v, out, table, q.stride(0), k.stride(0),
                v.stride(0), out.stride(0), 1.0 / math.sqrt(d), tiles=tiles, D=d, PRECISION=PRECISION,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_k)
    return out


def temporal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 (the frames of one chunk) in x's dtype: frames added in order in float32."""
    import triton  # optional: the gpu extra (triton)

    from . import triton_jit as K  # imports triton at its top: the gpu extra

    frames = x.contiguous()
    e = frames[0].numel()
    y = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    if e:
        _launch(K.frame_mean_kernel, (triton.cdiv(e, MEAN_BLOCK),), frames, y, frames.shape[0], e,
                BLOCK=MEAN_BLOCK)
    return y
