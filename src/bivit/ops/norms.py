"""Row-wise norms (LayerNorm, RMSNorm): the CPU kernels normalise each row on its own, so only LayerNorm's
weight gradient needs an invariant replacement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mode import emit, is_batch_invariant, needs_grad


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # The CPU kernel normalises each row on its own with one code path whatever the row count (verified by
    # the invariance tests), so both modes share its forward. Its backward sums the weight gradient in
    # per-thread partials (different bits at 1 and 2 threads), hence the Function in invariant mode.
    if is_batch_invariant() and needs_grad(x, weight, bias):
        return emit("layer_norm", _InvariantLayerNorm.apply(x, weight, bias, eps))
    return emit("layer_norm", F.layer_norm(x, (x.shape[-1],), weight, bias, eps))


class _InvariantLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dim: the stock kernel forward and input gradient (row by row), weight and bias
    gradients summed over rows in a fixed order in float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        y, mean, rstd = torch.native_layer_norm(x2, (d,), weight, bias, eps)
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
            gw = (g2.float() * ((x2.float() - mean) * rstd)).sum(0).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = g2.sum(0, dtype=torch.float32).to(bias.dtype)
        return gx, gw, gb, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return emit("rms_norm", F.rms_norm(x, (x.shape[-1],), weight, eps))
