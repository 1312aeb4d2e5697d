"""The op layer: the only place that knows about batch invariance.

Every reduction-bearing op of the model (GEMMs, the patch conv, norms, attention, the temporal mean) is called
through this package. One switch, `batch_invariant(True)` (`mode`), makes each of them compute an item's rows in
a way that does not depend on which other rows share the call:

* `gemm`: GEMMs and the patch conv (a GEMM over flattened patches) run in bivit's compiled GEMM, whose reduction
  order is fixed (one accumulator per output element, K in order, no split over threads); where it does not
  run, PyTorch's GEMMs at row counts proven on this machine (`tiles`).
* `pointwise`: GELU in fixed-size chunks (vectorised kernels round a thread's scalar tail differently); the
  temporal mean adds frames in a fixed order in float32.
* `norms`: row-wise kernels; LayerNorm's weight gradient is summed in a fixed order.
* `attend`: attention per item, so its shapes depend on the item only (bivit's compiled kernel, whose units are
  fixed per item, or PyTorch's where it does not run).
* `rotary`: the rotary embedding of q and k, elementwise in fp32 (bivit's compiled kernel or PyTorch's ops, same
  bits).
* `backend`: which kernel each op uses, decided once per process and dtype from the CPU and the PyTorch build,
  never switched by a failure (an item's bits depend only on the checkpoint, the dtype settings, the input and
  the machine kind); the load-time proof can refuse one first.
* `proof`: the load-time proof: every op of the model, at its real shapes, computes each item's rows
  bit-identically alone, packed and reversed, at this thread count and others; a path that does not is
  refused for this machine and the next one proven.

Every op returns exactly the dtype the op it replaces returns (never a silently promoted float32): that is the
dtype contract that vLLM's invariant `mean` broke on Kimi-K2.6 (issue 41638).

Every op is differentiable in both modes. Where the invariant path calls a kernel that autograd cannot see
through (the pre-packed GEMM, the chunked GELU) or whose stock backward is not invariant (LayerNorm's weight
gradient is summed in per-thread partials), a `torch.autograd.Function` supplies the backward, computed the
invariant way too: the input gradient of a GEMM runs at the same pinned tiles, so an item's input gradient does
not depend on its batch; weight gradients sum over the batch (by definition they depend on it) but in a fixed
order, so they do not depend on the thread count. Without autograd (`encode` runs under `inference_mode`) the
Functions are skipped: the fast path stays the fast path.
"""

from .backend import GemmPath, KernelFailed, attention_kernel, gemm_kernel, gemm_path, norm_kernel
from .bits import ARITH
# The ops the model calls: each picks the op table of its first tensor's device (device.py: CPU, or in invariant
# mode CUDA's Triton ops).
from .device import (attention, backend_for, bits_class, layer_norm, linear, patch_conv, residual_linear, rms_norm,
                     temporal_mean)
from .gemm import gemms, prepare
from .tiles import CANDIDATE_TILES, REFERENCE_TILE, GemmPlan, gemm_plan, self_check
from .mode import batch_invariant, checkpoint, is_batch_invariant, trace
from .pointwise import POINTWISE_CHUNK, gelu
from .proof import InvarianceError, Proof, prove
from .rotary import rope, rope_tables

__all__ = [
    "ARITH", "CANDIDATE_TILES", "POINTWISE_CHUNK", "REFERENCE_TILE", "GemmPath", "GemmPlan", "InvarianceError",
    "KernelFailed", "Proof", "attention", "backend_for", "bits_class", "gemms", "norm_kernel", "prove", "rope_tables",
    "attention_kernel", "batch_invariant", "checkpoint", "gelu", "gemm_kernel", "gemm_path", "gemm_plan",
    "is_batch_invariant", "layer_norm", "linear", "patch_conv", "prepare", "residual_linear", "rms_norm", "rope",
    "self_check", "temporal_mean", "trace",
]
