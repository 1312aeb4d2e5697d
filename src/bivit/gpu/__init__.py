"""bivit on NVIDIA GPUs: the invariant forward as Triton kernels (docs/gpu.md).

In invariant mode, an op whose first tensor lives on a CUDA device runs the Triton op of the op layer's CUDA
table (`bivit.ops.dispatch`, `bivit.ops.cuda`), launched by `bivit.kernels.triton_jit` (the kernels and their
launchers; what they need and what decides their bits: `bivit.kernels.cuda`): a fixed-tile GEMM with bias, GELU
and the residual add fused, row-wise norms, a varlen attention whose per-item work does not depend on the pack,
the rotary embedding, and the temporal mean; no cuBLAS, no SDPA. In default mode a CUDA tensor takes PyTorch's
stock ops (cuBLAS, fused attention): fast, not batch-invariant.

This package is the GPU path's public face: what it needs (`missing`, `require`, `triton_mismatch`,
`gpu_extra`), what decides its bits (`facts`), and `interpreted()`, which sends CPU tensors down the same path
under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported): how the kernels are tested on
machines without a GPU. `python -m bivit.gpu.build` compiles what a forward launches for a GPU architecture (it
imports triton; this package does not).
"""

from __future__ import annotations

from ..kernels.cuda import facts, gpu_extra, interpreting, missing, require, triton_mismatch, triton_version
from ..ops.dispatch import interpreted, recording

__all__ = ["facts", "gpu_extra", "interpreted", "interpreting", "missing", "recording", "require",
           "triton_mismatch", "triton_version"]
