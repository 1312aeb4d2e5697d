"""The op layer: the only place that knows about batch invariance.

Every reduction-bearing op of the model (GEMMs, the patch conv, norms, attention, the temporal mean) is called
through this package. One switch, `batch_invariant(True)` (`mode`), makes each of them compute an item's rows in
a way that does not depend on which other rows share the call:

* `gemm`: GEMMs and the patch conv (a GEMM over flattened patches) run in bivit's compiled GEMM, whose reduction
  order is fixed (one accumulator per output element, K in order, no split over threads).
* `pointwise`: GELU in fixed-size chunks (vectorised kernels round a thread's scalar tail differently); the
  temporal mean adds frames in a fixed order in float32.
* `norms`: row-wise kernels; LayerNorm's weight gradient is summed in a fixed order.
* `attend`: attention per item (bivit's compiled kernel, whose units are fixed per item).
* `positions`: the position terms' tables (a video chunk's sin-cos term, the learned table resampled to an
  item's grid), each value by a fixed sequence of float32 operations, so no CPU or process changes them.
* `rotary`: the rotary embedding of q and k, elementwise in fp32 (bivit's compiled kernel or PyTorch's ops, same
  bits).
* `selection`: which compiled kernel each op uses, decided once per process and dtype from the CPU and the
  installed kernels, never switched by a failure; invariant mode on a CPU runs bivit's kernels only (one
  arithmetic, bivit-arith/1) or is refused. The load-time proof can refuse a kernel first.
* `proof`: the load-time proof: every op of the model, at its real shapes, computes each item's rows
  bit-identically alone, packed and reversed, at this thread count and others; a kernel that does not is
  refused in this process and the next one proven.

Every op returns exactly the dtype the op it replaces returns (never a silently promoted float32): that is the
dtype contract that vLLM's invariant `mean` broke on Kimi-K2.6 (issue 41638).

Every op is differentiable in both modes. Where the invariant path calls a kernel that autograd cannot see
through (the pre-packed GEMM, the chunked GELU) or whose stock backward is not invariant (LayerNorm's weight
gradient is summed in per-thread partials), a `torch.autograd.Function` supplies the backward, computed the
invariant way too: the input gradient of a GEMM runs in the same compiled GEMM, so an item's input gradient does
not depend on its batch; weight gradients sum over the batch (by definition they depend on it) but in a fixed
order, so they do not depend on the thread count. Without autograd (`encode` runs under `inference_mode`) the
Functions are skipped: the fast path stays the fast path.
"""

from .bits import ARITH
# The ops the model calls: each picks the op table of its first tensor's device (dispatch.py: CPU, or in invariant
# mode CUDA's Triton ops).
from .dispatch import attention, backend_for, bits_class, layer_norm, linear, patch_conv, rms_norm, temporal_mean
from .gemm import gemms, pack_weights
from .mode import batch_invariant, checkpoint, is_batch_invariant, trace
from .pointwise import POINTWISE_CHUNK, gelu
from .positions import resample, temporal_embedding
from ..errors import InvarianceError
from .proof import Proof, prove
from .rotary import rope, rope_tables
from .selection import attention_kernel, gemm_kernel, norm_kernel, require

__all__ = [
    "ARITH", "POINTWISE_CHUNK", "InvarianceError", "Proof", "attention", "attention_kernel", "backend_for",
    "batch_invariant", "bits_class", "checkpoint", "gelu", "gemm_kernel", "gemms", "is_batch_invariant", "layer_norm",
    "linear", "norm_kernel", "pack_weights", "patch_conv", "prove", "require", "resample", "rms_norm", "rope",
    "rope_tables", "temporal_embedding", "temporal_mean", "trace",
]
