"""Row-wise norms (LayerNorm, RMSNorm).

In invariant mode they run bivit's compiled norm (`bivit.kernels.Norm`, bivit-arith/1: each row's sums in 16
lanes whatever the CPU's vector width; `selection.norm_kernel`): PyTorch's CPU kernels normalise each row on its
own too, but sum it in as many lanes as the CPU's vector type has, so their bits depend on the CPU kind.
Default mode: PyTorch's.

Training: the forward is the kernel's (the bits an encoder serves); the input gradient is PyTorch's
(LayerNorm's from the kernel's mean and rstd, RMSNorm's by autograd through its formula); LayerNorm's weight
and bias gradients are summed over rows in a fixed order in float32 (PyTorch's backward sums them in per-thread
partials: other bits at 1 and 2 threads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mode import emit, is_batch_invariant, needs_grad
from .selection import norm_kernel


def _compiled(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
    """Invariant mode's norm kernel for `x`, and the weight and bias as it reads them (contiguous, of one dtype:
    float32 where theirs differ, exactly)."""
    # The kernel reads d values of each: refuse another shape as PyTorch's norms do, before it reads past one.
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (x.shape[-1],):
            raise RuntimeError(f"Expected {name} to be of same shape as normalized_shape, but got {name} of "
                               f"shape {list(t.shape)} and normalized_shape = [{x.shape[-1]}]")
    dtypes = {t.dtype for t in (weight, bias) if t is not None}
    common = dtypes.pop() if len(dtypes) == 1 else torch.float32
    weight, bias = (None if t is None else t.to(common).contiguous() for t in (weight, bias))
    return norm_kernel(x.dtype), weight, bias


def _run(kernel, x: torch.Tensor, weight, bias, eps: float, rms: bool,
         stats: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype)
    mean = torch.empty(x2.shape[0], dtype=torch.float32) if stats and not rms else None
    rstd = torch.empty(x2.shape[0], dtype=torch.float32) if stats else None
    with torch.profiler.record_function("bivit::norm"):  # else invisible to torch.profiler
        kernel(x2, weight, bias, eps, rms, out, mean, rstd)
    return out.view(x.shape), mean, rstd


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if not is_batch_invariant():
        return emit("layer_norm", F.layer_norm(x, (x.shape[-1],), weight, bias, eps))
    kernel, w, b = _compiled(x, weight, bias)
    if needs_grad(x, weight, bias):
        return emit("layer_norm", _InvariantLayerNorm.apply(x, weight, bias, eps, kernel))
    return emit("layer_norm", _run(kernel, x, w, b, eps, rms=False)[0])


class _InvariantLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dim: the compiled kernel's forward and PyTorch's input gradient (row by row) from
    its mean and rstd; weight and bias gradients summed over rows in a fixed order in float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, kernel):
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        _, w, b = _compiled(x, weight, bias)
        y, mean, rstd = _run(kernel, x2, w, b, eps, rms=False, stats=True)
        mean, rstd = (t.view(-1, 1).to(x.dtype) for t in (mean, rstd))  # what PyTorch's backward reads
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        d = x2.shape[-1]
        g2 = grad.reshape(-1, d).contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.native_layer_norm_backward(g2, x2, (d,), mean, rstd, weight, bias,
                                                           [True, False, False])[0].view(grad.shape)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = (g2.float() * ((x2.float() - mean.float()) * rstd.float())).sum(0).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = g2.sum(0, dtype=torch.float32).to(bias.dtype)
        return gx, gw, gb, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    if eps is None:  # what F.rms_norm uses then
        eps = torch.finfo(x.dtype).eps
    if not is_batch_invariant():
        return emit("rms_norm", F.rms_norm(x, (x.shape[-1],), weight, eps))
    kernel, w, _ = _compiled(x, weight, None)
    if needs_grad(x, weight):
        return emit("rms_norm", _InvariantRmsNorm.apply(x, weight, eps, kernel))
    return emit("rms_norm", _run(kernel, x, w, None, eps, rms=True)[0])


class _InvariantRmsNorm(torch.autograd.Function):
    """RMSNorm: the compiled kernel's forward; gradients by autograd through PyTorch's RMSNorm (the same formula,
    its rounding)."""

    @staticmethod
    def forward(ctx, x, weight, eps, kernel):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _run(kernel, x, _compiled(x, weight, None)[1], None, eps, rms=True)[0]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xs = x.detach().requires_grad_(ctx.needs_input_grad[0])
            ws = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            y = F.rms_norm(xs, (x.shape[-1],), ws, ctx.eps)
            inputs = [t for t in (xs, ws) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, inputs, grad))
        return (next(grads) if ctx.needs_input_grad[0] else None,
                next(grads) if ctx.needs_input_grad[1] else None, None, None)
