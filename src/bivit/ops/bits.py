"""Classes of bits: which arithmetic computed an encoder's rows, so that one id never names two sets of rows.

bivit-arith/1 (docs/arithmetic.md, `bivit/kernels/arith.h`) fixes every rounded operation from pixels to
projector output, and every compiled kernel computes it: the `portable` C variant on any CPU, the `avx2` and
`avx512` variants (fp32 FMAs, AVX-512 BF16 pair products), AMX tiles where they compute it. So invariant mode's
rows are one set of bits on every CPU: class `bivit-arith/1`. Not every path computes it:

* `native/<kernel>,.../...`: `BIVIT_ARITH=native` lets the fastest kernel of this machine run even where it
  computes another order (bf16 on AMX tiles, where tdpbf16ps is not a chain of bivit-arith/1's roundings): the
  class names each such kernel, and the machine kind; bits of this machine kind only;
* `stock/attention=<kernel>,threads=<n>/...`: default mode (`batch_invariant=False`): PyTorch's stock kernels
  (and the attention named), bits that depend on the batch, the thread count and the machine kind;
* `gpu/...`: the Triton path on a GPU.

There is no other: invariant mode on a CPU computes bivit-arith/1 or `native/`, or is refused
(`bivit.ops.selection.require`); docs/cpu-kinds.md lists every knob and what it does to the class.

The class is part of the fingerprint, hence of every encoder-cache id, a dataset's header and every answer
(`Encoder.describe()["bits"]`): rows of two classes never share an id.

Conformance, proven per process: before a compiled kernel counts as computing bivit-arith/1, it computes fixed
problems whose results' SHA-256 are committed here (`CONFORMANCE`: GEMMs at odd sizes with both GELUs, attention
over 1, 17, 37 and 300 keys with the rotary tables, both norms; float32 and bfloat16, float16 GEMMs) and must
give exactly those bits. A numpy transcription of the arithmetic, independent of the kernels, checks the hashes
(tests/support/arith_reference.py), and `bivit doctor --prove` checks whole encoded rows against committed
ones (`bivit.diagnose.golden`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import numpy as np
import torch

from ..base import notices, state
from ..kernels.cpu import cpu_info

ARITH = "bivit-arith/1"
ARITH_ENV = "BIVIT_ARITH"
MODES = ("canonical", "native")


@state.memo(state.FIXED)
def mode() -> str:
    """`BIVIT_ARITH`: `canonical` (default: bivit-arith/1 wherever a compiled library runs) or `native` (the
    fastest kernels of this machine, their own class where they compute another order). Read once per process."""
    value = os.environ.get(ARITH_ENV, "canonical").strip().lower() or "canonical"
    if value not in MODES:
        notices.note("arith", f"{ARITH_ENV}={value!r} not understood", f"not one of {', '.join(MODES)}",
                     "canonical arithmetic (bivit-arith/1) runs")
        return "canonical"
    return value


# ----------------------------------------------------------------------------------------- fixed problems

def exact_values(shape: tuple[int, ...], seed: int, scale_bits: int = 0, spread: int = 8) -> torch.Tensor:
    """float32 values m * 2^-(23 + scale_bits + e): 24-bit integers m (|m| < 2^23) and exponents e in [0, spread)
    from numpy's PCG64, so the same on every platform (integer generation and exact conversions only). Values of
    full precision over `spread` binades: products and sums of them round in nearly every step, so any change
    in the order of a reduction changes some result."""
    g = np.random.Generator(np.random.PCG64(seed))
    m = g.integers(-2 ** 23, 2 ** 23, size=shape, dtype=np.int64).astype(np.float64)
    e = g.integers(0, spread, size=shape, dtype=np.int64)
    return torch.from_numpy(np.ldexp(m, -(23 + scale_bits + e)).astype(np.float32))


GEMM_PROBLEM = (37, 77, 50)   # M, K (odd: a bf16 pair's padding), N (off every panel width)
ATTENTION_LENGTHS = (300, 37, 17, 1)  # over two 128-key chunks, odd, one past 16 lanes, a lone key
ATTENTION_HEADS, ATTENTION_DIM = 2, 72
NORM_PROBLEM = (19, 150)       # rows, d (not a multiple of 16)


def gemm_problem(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], w [N, K] in `dtype`, bias fp32 [N]: sums of order 1, GELU's inputs on both sides of 0."""
    m, k, n = GEMM_PROBLEM
    return (exact_values((m, k), 1, -1).to(dtype), exact_values((n, k), 2, 2).to(dtype), exact_values((n,), 3, 1))


def attention_problem(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int],
                                                   tuple[torch.Tensor, torch.Tensor]]:
    """q, k, v [L, heads, d] in `dtype`, the item lengths and rotary tables (cos, sin) [L, d] of a 1 x n grid
    per item (values exact in fp32)."""
    rows = sum(ATTENTION_LENGTHS)
    q, k, v = (exact_values((rows, ATTENTION_HEADS, ATTENTION_DIM), s, -2, 4).to(dtype) for s in (4, 5, 6))
    cos, sin = exact_values((rows, ATTENTION_DIM), 7, spread=3), exact_values((rows, ATTENTION_DIM), 8, spread=3)
    return q, k, v, list(ATTENTION_LENGTHS), (cos, sin)


def norm_problem(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, d], weight and bias [d] in `dtype`."""
    rows, d = NORM_PROBLEM
    return (exact_values((rows, d), 9, -2).to(dtype), (1 + exact_values((d,), 10, 3)).to(dtype),
            exact_values((d,), 11, 2).to(dtype))


def digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# Every problem's results are read in float32, before the last rounding to a 16-bit dtype: a reduction order that
# moves a result by one fp32 step would almost never show after it.

def gemm_outputs(kernel, dtype: torch.dtype) -> list[torch.Tensor]:
    """`kernel` (a `bivit.kernels.GemmKernel`) on the GEMM problem, without GELU, with tanh's and with erf's."""
    x, w, bias = gemm_problem(dtype)
    packed = kernel.pack(w)
    n = w.shape[0]
    return [kernel(x, packed, n, bias, torch.empty(x.shape[0], n, dtype=torch.float32), gelu=g,
                   bf16=dtype == torch.bfloat16) for g in (None, "tanh", "erf")]


def attention_outputs(kernel, dtype: torch.dtype) -> list[torch.Tensor]:
    """`kernel` (a `bivit.kernels.Attention`) on the attention problem, q and k rotated as it reads them."""
    q, k, v, lens, rope = attention_problem(dtype)
    out = torch.empty(q.shape, dtype=torch.float32)
    kernel(q, k, v, out, lens, rope=rope)
    return [out]


def norm_outputs(kernel, dtype: torch.dtype) -> list[torch.Tensor]:
    """`kernel` (a `bivit.kernels.Norm`): LayerNorm with weight and bias, then RMSNorm with weight."""
    x, w, b = norm_problem(dtype)
    eps = 1e-5
    out = [torch.empty(x.shape, dtype=torch.float32) for _ in range(2)]
    return [kernel(x, w, b, eps, False, out[0]), kernel(x, w, None, eps, True, out[1])]


# SHA-256 of each problem's outputs in bivit-arith/1, written by the portable kernel and checked against the numpy
# transcription of the arithmetic (tests/test_arith.py).
CONFORMANCE: dict[tuple[str, str], str] = {
    ("attention", "bfloat16"): "80fa7e039c542c923b231c49f26acd43db9aa036f2ac04f96180d6557cf1d1cb",
    ("attention", "float32"): "cdb6dafcac044c5db0b4a2acfedc12c0d1a19fb5797ccb2fc4c3b65354dac4df",
    ("gemm", "bfloat16"): "5755805004cc10d85fd9bb441e30a0eb849102a9b50bf4468bc9a95b96ad33fb",
    ("gemm", "float16"): "50298ede821cafaa9c94bb309c00f1de360e2ada54ef9ab5a410c490ff9e7b0d",
    ("gemm", "float32"): "93bc1f0b4d3ffe4f146a4bc6f0df1c4f1659e2586f207549bc6eb784fbecd9b7",
    ("norm", "bfloat16"): "94e99e82b4e2e5cb2341b40f294d4a927f1107a97dd386b0c7861459ab8caeb6",
    ("norm", "float16"): "84f5710d0ffcc9c2c6d5d2cc30fb4d3fa26461bcd16c161102d2799db9c5fc72",
    ("norm", "float32"): "975b5e5b19f4b1f5a7267a361fd0f13dd193d1ebcd8b81cd126b61b522d8d6b8",
}

PROBLEMS: dict[str, Callable] = {"gemm": gemm_outputs, "attention": attention_outputs, "norm": norm_outputs}


def conformance(op: str, kernel, dtype: torch.dtype) -> str | None:
    """Why `kernel` does not compute bivit-arith/1's `op` in `dtype` (its bits differ from the committed ones, or
    it raised), or None when it does. Cached per kernel and dtype (kernels are frozen dataclasses)."""
    return _conformance(op, kernel, dtype)


@state.memo(state.PROOFS)
def _conformance(op: str, kernel, dtype: torch.dtype) -> str | None:
    name = str(dtype).removeprefix("torch.")
    want = CONFORMANCE.get((op, name))
    if want is None:
        return f"no committed bits for {op} in {name}"
    try:
        with torch.inference_mode():
            got = digest(*PROBLEMS[op](kernel, dtype))
    except (ValueError, MemoryError, OSError) as e:
        return f"it raised ({e})"
    return None if got == want else f"its {op} bits in {name} are not {ARITH}'s ({got[:12]} instead of {want[:12]})"


# Variables that steer PyTorch's own CPU kernels (oneDNN's and MKL's instruction sets, oneDNN's fp32 math mode):
# default mode's bits depend on them.
STEERING_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE")


def machine_tag() -> str:
    """What a class of bits other than bivit-arith/1 is a function of on this CPU: the CPU model and flags, the
    PyTorch build and its dispatch, the variables that steer its kernels and its fp32 matmul precision (16 hex
    digits of their hash, with the CPU's name)."""
    model, flags = cpu_info()
    facts = [model, sorted(flags), torch.__version__, torch.version.git_version,
             torch.backends.cpu.get_cpu_capability(), {k: os.environ.get(k) for k in STEERING_ENV},
             torch.get_float32_matmul_precision()]
    return f"{model or 'unknown CPU'} #{hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]}"
