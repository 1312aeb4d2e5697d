"""bivit's compiled GEMM (`gemm.h`): invariant by construction, the GEMM of invariant mode wherever the compiled
library runs.

Each output element is one fp32 accumulator fed its K products in k order by one thread (bivit-arith/1:
`arith.h`, docs/arithmetic.md); threads split the output by rows and columns only, never K. So a row's bits depend
on that row and the weights, not on the other rows of the call, their number, or the thread count (`gemm.h`
gives the whole argument), nor on the kernel wherever it computes bivit-arith/1. The kernels:

* `fp32`: fp32 FMAs; bf16 and fp16 weights and inputs are widened exactly (a product of two 16-bit values is
  exact in fp32), so it is the math of a 16-bit GEMM with fp32 accumulation. Every variant has it.
* `avx512_bf16`: bf16 pair products (vdpbf16ps, each pair stored swapped so the chain runs in k order), on CPUs
  with AVX-512 BF16;
* `amx`, `amx_swapped`: bf16 on AMX tiles, where the CPU has AMX and the OS grants its tile state, with each
  pair as stored or swapped (what tdpbf16ps computes is decided by the load-time conformance check).

Which kernel computes a dtype is fixed per process (`bivit.ops.selection`), never per call.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import torch

from .abi import CONSTS, GemmArgs, GemmPackArgs, fill

ETYPES = {torch.float32: CONSTS["E_F32"], torch.bfloat16: CONSTS["E_BF16"], torch.float16: CONSTS["E_F16"]}
# GELU after the GEMM, by the function it computes: "erf" (the exact GELU) or "tanh" (its tanh approximation)
ACTS = {None: CONSTS["ACT_NONE"], "tanh": CONSTS["ACT_GELU_TANH"], "erf": CONSTS["ACT_GELU_ERF"]}
# each GELU by PyTorch's name for it (F.gelu's `approximate`: "none" is the erf form)
APPROXIMATE = {"erf": "none", "tanh": "tanh"}
KINDS = {"fp32": CONSTS["GEMM_FP32"], "avx512_bf16": CONSTS["GEMM_AVX512_BF16"], "amx": CONSTS["GEMM_AMX"],
         "amx_swapped": CONSTS["GEMM_AMX_SWAPPED"]}


@dataclass(frozen=True)
class GemmKernel:
    """One compiled GEMM kernel: `pack` a weight once, then `y = x @ weight.t() + bias` any number of times."""

    lib: ctypes.CDLL = field(repr=False)
    variant: str  # the library's instruction-set variant
    name: str     # a key of KINDS

    @property
    def kind(self) -> int:
        return KINDS[self.name]

    def describe(self) -> str:
        return f"bivit {self.name} GEMM ({self.variant} library)"

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether this kernel multiplies weights and inputs of `dtype` (the 16-bit kinds: bf16 only)."""
        return dtype in ETYPES and (self.name == "fp32" or dtype == torch.bfloat16)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` `[N, K]` (last dim contiguous) in this kernel's blocked layout, as a byte tensor."""
        n, k = weight.shape
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        args = fill(GemmPackArgs, w=weight.data_ptr(), out=None, w_row=weight.stride(0), N=n, K=k, kind=self.kind,
                    wt=ETYPES[weight.dtype], threads=torch.get_num_threads())
        buf = torch.empty(self.lib.bivit_gemm_packed_bytes(args), dtype=torch.uint8)
        args.out = buf.data_ptr()
        rc = self.lib.bivit_gemm_pack(args)
        if rc != CONSTS["RC_OK"]:
            raise ValueError(f"bivit gemm: cannot pack a {tuple(weight.shape)} {weight.dtype} weight (code {rc})")
        return buf

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
                 out: torch.Tensor, gelu: str | None = None, threads: int | None = None,
                 bf16: bool | None = None) -> torch.Tensor:
        """`out[M, n] = x[M, K] @ weight.t() + bias`, then GELU `gelu` ("erf", "tanh" or None) on the fp32
        sum: x and out with a contiguous last dim, bias float32 `[n]` contiguous or None. `threads` defaults to
        PyTorch's thread count; it never changes the bits. `bf16`: the arithmetic is a bf16 GEMM's (flushed;
        default: x is bf16, or the kernel multiplies bf16 pairs), as it is for bf16 weights whose rows the fp32
        kernel gets widened."""
        m, k = x.shape
        rc = self.lib.bivit_gemm(self.args(x, packed, n, bias, out, gelu, threads, bf16))
        if rc == CONSTS["RC_NO_MEMORY"]:
            raise MemoryError(f"bivit gemm: no memory for the scratch of a {m}x{k} by {k}x{n} GEMM")
        if rc != CONSTS["RC_OK"]:
            raise ValueError(f"bivit gemm: bad sizes {m}x{k} by {k}x{n} (code {rc})")
        return out

    def peak_gflops(self, threads: int | None = None, seconds: float = 0.2) -> float | None:
        """GFLOP/s of this kernel's multiply-add instruction alone (no memory, independent accumulators) on
        `threads` threads: the rate no GEMM on that instruction passes here. None where the kernel has no such
        loop (the portable one)."""
        threads = threads or torch.get_num_threads()
        steps, elapsed = 1 << 16, 0.0
        while elapsed < seconds:  # longer runs until one lasts `seconds`: a short one measures the start-up
            steps *= 4
            t0 = time.perf_counter()
            flops = self.lib.bivit_gemm_peak(self.kind, steps, threads)
            elapsed = time.perf_counter() - t0
            if flops < 0:
                return None
        return flops / elapsed / 1e9

    def args(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor,
             gelu: str | None = None, threads: int | None = None, bf16: bool | None = None) -> GemmArgs:
        """The C call's arguments for `__call__`'s tensors, each stride named by its tensor (what the tests
        tamper with to show a misplaced stride fails the self-test)."""
        m, k = x.shape
        if bf16 is None:
            bf16 = x.dtype == torch.bfloat16 or self.name != "fp32"
        return fill(GemmArgs, x=x.data_ptr(), w=packed.data_ptr(), bias=None if bias is None else bias.data_ptr(),
                    y=out.data_ptr(), x_row=x.stride(0), y_row=out.stride(0), M=m, N=n, K=k, kind=self.kind,
                    xt=ETYPES[x.dtype], yt=ETYPES[out.dtype], act=ACTS[gelu], flush=int(bf16),
                    threads=threads or torch.get_num_threads())


def self_test(kernel: GemmKernel, dtype: torch.dtype) -> str | None:
    """Why `kernel` must not be used for `dtype` (a miscompile, an odd toolchain, a CPU that faults), or None:
    on shapes that reach every tail (rows, columns, K not multiples of any block), as close to float64 as
    rounding to `dtype` allows, and each row bit-identical computed alone, in the call, and at 3 threads."""
    g = torch.Generator().manual_seed(0)
    m, n, k = 37, 50, 77
    # x and every y are views with row strides of their own (k + 3, n + 5), so a call that passed one's stride as
    # the other's reads or writes the wrong rows and fails below; y's buffers have room for twice its rows, so
    # such a call writes wrong places of them, not past them.
    w = torch.randn(n, k, generator=g, dtype=torch.float32).to(dtype)
    x = torch.randn(m, k + 3, generator=g, dtype=torch.float32).to(dtype)[:, :k]
    bias = torch.randn(n, generator=g, dtype=torch.float32)

    def out(rows: int) -> torch.Tensor:
        return torch.empty(2 * rows, n + 5, dtype=torch.float32)[:rows, :n]

    try:
        packed = kernel.pack(w)
        y = kernel(x, packed, n, bias, out(m), threads=2)
        alone = torch.cat([kernel(x[i:i + 1], packed, n, bias, out(1), threads=1) for i in range(5)])
        many = kernel(x, packed, n, bias, out(m), threads=3)
    except (ValueError, MemoryError, OSError) as e:
        return f"it raised ({e})"
    ref = x.double() @ w.double().t() + bias.double()
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    if not err <= 1e-5:
        return f"its result is off by {err:.3g} (relative) from float64"
    for gelu in ("tanh", "erf"):
        act = kernel(x, packed, n, bias, out(m), gelu=gelu)
        exact = torch.nn.functional.gelu(ref, approximate=APPROXIMATE[gelu])
        gerr = float((act.double() - exact).abs().max() / ref.abs().max())
        if not gerr <= 1e-5:
            return f"its GELU ({gelu}) is off by {gerr:.3g} (relative) from float64"
    if not (torch.equal(alone, y[:5]) and torch.equal(many, y)):
        return "its rows change with the rows beside them or the thread count"
    return None
