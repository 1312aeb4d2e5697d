"""GEMMs (Linear layers and the patch conv): the invariant GEMM of `bivit.ops`.

In invariant mode a GEMM runs in bivit's compiled GEMM (`bivit.kernels.gemm`), whose reduction order bivit fixes:
each output element is one fp32 accumulator fed its K products in order by one thread, and threads split the
output by rows and columns only. A row's bits therefore depend on that row, the weights and the kernel, not on
the batch, the row count or the thread count, by construction. The kernel per dtype is `selection.gemm_kernel`:
the best one this CPU runs that computes bivit-arith/1 and passed its self-test and the load-time proof
(`bivit.ops.proof`), fixed for the process.

Weights are packed once per tensor version into the kernel's layout (again after an optimizer step or
`update_weights`), and dropped with the tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..kernels.gemm import APPROXIMATE
from . import packs
from .mode import emit, is_batch_invariant, needs_grad
from .pointwise import chunked_gelu_backward
from .selection import gemm_kernel


def _packed(kernel, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
              transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(packed weight, float32 bias) for `kernel` (`bivit.ops.packs`); the bias widened exactly: it is never
    wider than float32."""
    return packs.packed(key, (kernel, transposed), lambda: (
        kernel.pack(weight.detach()), None if bias is None else bias.detach().float().contiguous()))


def _widened(kernel, x2: torch.Tensor) -> torch.Tensor:
    """The rows as the fp32 kernel multiplies them: 16-bit rows widened here in one vectorised pass (exact, so the
    same bits as the kernel widening them itself, which it does per task: again for every group of columns)."""
    return x2.float() if kernel.name == "fp32" and x2.dtype != torch.float32 else x2


def _gemm(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
          transposed: bool = False, gelu: str | None = None) -> torch.Tensor:
    """`x2 @ weight.t() + bias` (then GELU if `gelu`), invariant: each row's bits depend on that row alone."""
    if x2.shape[1] != weight.shape[1]:  # the kernel would read past the packed weight: refuse as F.linear does
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({x2.shape[0]}x{x2.shape[1]} and "
                           f"{weight.shape[1]}x{weight.shape[0]})")
    kernel = gemm_kernel(weight.dtype)
    x2 = x2 if x2.dtype == weight.dtype and x2.stride(-1) == 1 else x2.to(weight.dtype).contiguous()
    x2 = _widened(kernel, x2)
    packed, bias32 = _packed(kernel, weight, bias, key, transposed)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=weight.dtype)  # the weights' dtype, as F.linear returns
    # A profiler range per shape: the compiled call is invisible to torch.profiler otherwise (profile_ops.py).
    with torch.profiler.record_function(f"bivit::gemm {weight.shape[0]}x{weight.shape[1]}"):
        return kernel(x2, packed, weight.shape[0], bias32, out, gelu=gelu, bf16=weight.dtype == torch.bfloat16)


class _InvariantLinear(torch.autograd.Function):
    """`x2 @ weight.t() + bias` (then GELU if `gelu`) in invariant mode, forward and input gradient; `key` owns
    the packed copies. The forward is the inference call itself, so a trainer's outputs are the bits an encoder
    serves; backward recomputes the pre-activation (one GEMM of the saved input) instead of storing it."""

    @staticmethod
    def forward(ctx, x2, weight, bias, key, gelu):
        ctx.save_for_backward(x2, weight, bias, key)
        ctx.gelu = gelu
        return _gemm(x2, weight.detach(), None if bias is None else bias.detach(), key, gelu=gelu)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, bias, key = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.gelu is not None:
            pre = _gemm(x2, weight.detach(), None if bias is None else bias.detach(), key)
            grad = chunked_gelu_backward(grad, pre, ctx.gelu)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _gemm(grad, weight.detach().t(), None, key, transposed=True)
        # Weight and bias gradients sum over the batch's rows (by definition they depend on the batch), in bivit's
        # GEMM too: the rows in order, in one thread per element, whatever the thread count (a library GEMM
        # split those rows over threads: the patch conv's weight gradient changed between 1 and 2 threads).
        if ctx.needs_input_grad[1]:
            gw = _row_sums(grad, x2)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = _row_sums(grad, grad.new_ones(grad.shape[0], 1), torch.float32).view(-1).to(grad.dtype)
        return gx, gw, gb, None, None


def _row_sums(grad: torch.Tensor, x2: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`grad.t() @ x2` (`[out, rows] @ [rows, in]`): per element the rows summed in order by one thread, in bivit's
    GEMM (x2's rows packed as its weights, per call; x2 in grad's dtype, as the forward multiplied it)."""
    kernel = gemm_kernel(grad.dtype)
    x2 = x2 if x2.dtype == grad.dtype else x2.to(grad.dtype)
    a = _widened(kernel, grad.t().contiguous())
    packed = kernel.pack(x2.t().contiguous())
    return kernel(a, packed, x2.shape[1], None, a.new_empty(a.shape[0], x2.shape[1], dtype=out_dtype or grad.dtype),
                  bf16=grad.dtype == torch.bfloat16)


def _invariant_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      key: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
    if needs_grad(x2, weight, bias):
        return _InvariantLinear.apply(x2, weight, bias, key, gelu)
    return _gemm(x2, weight, bias, key, gelu=gelu)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: str | None = None,
           add_to: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.t() + bias`, then GELU when `gelu` names it ("erf" or "tanh"), then `add_to +` that when
    `add_to` is given (a residual): written into `add_to` unless autograd records (then a new tensor), so a
    residual add makes no tensor of its own.

    Traced as "linear", "gelu", "add" in default mode (stock ops), as one "linear[_gelu][_add]" in invariant
    mode."""
    if not is_batch_invariant():
        out = emit("linear", F.linear(x, weight, bias))
        if gelu is not None:
            out = emit("gelu", F.gelu(out, approximate=APPROXIMATE[gelu]))
        return out if add_to is None else emit("add", _added(add_to, out))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = _invariant_linear(x2, weight, bias, weight, gelu).view(*lead, weight.shape[0])
    kind = "linear" if gelu is None else "linear_gelu"
    return emit(kind, out) if add_to is None else emit(kind + "_add", _added(add_to, out))


def _added(add_to: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`add_to + y`: into `add_to` where autograd records nothing (same bits: one rounding to their dtype)."""
    return add_to + y if torch.is_grad_enabled() else add_to.add_(y)


def patch_conv(pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Conv2d with kernel = stride = patch size on `[L, C, p, p]` patches -> `[L, D]`."""
    if not is_batch_invariant():
        return emit("patch_conv", F.conv2d(pixels, weight, bias, stride=weight.shape[-1]).flatten(1))
    # A kernel-sized conv over one patch is exactly a GEMM over the flattened patch; pin it like any GEMM.
    out = _invariant_linear(pixels.reshape(pixels.shape[0], -1).contiguous(), weight.reshape(weight.shape[0], -1),
                            bias, weight)
    return emit("patch_conv", out)


def gemms(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None, str | None]]:
    """(weight, bias, GELU after it) of every GEMM of `module`: its Linear layers and kernel-sized convs (the
    patch embedding), as `pack_weights`, the proof and the roofline need them."""
    return [(m.weight, m.bias, getattr(m, "gelu", None)) for m in module.modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


def pack_weights(gemms: Sequence[tuple]) -> None:
    """Pack the weights of the GEMMs `(weight, bias[, gelu])` of a model now (at load, or after a weight update)
    rather than at their first use."""
    with torch.no_grad():
        for w, b, *_ in gemms:
            _packed(gemm_kernel(w.dtype), w.reshape(w.shape[0], -1), b, w, False)
