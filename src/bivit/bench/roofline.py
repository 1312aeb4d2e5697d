"""What a case costs and what this machine can do: FLOPs per case (GEMM, attention, other), the GEMM and
attention rates measured on this machine, and the roofline time they give.

* **FLOPs.** GEMM: every linear layer, the patch conv and the projector; attention: QK^T and PV over each
  item's patches (`flops_per_item` is their sum, tested against `torch.utils.flop_counter`);
  other: an approximate count of the elementwise work (norms, GELU, RoPE, softmax, residual adds; one FLOP per
  multiply or add as written, `OTHER_PER_ELEMENT`). GFLOP/s figures count GEMM + attention only. Invariant
  mode executes more than that (zero-padded GEMM tiles); that is a cost, not work, so it is not counted.
* **Rates.** GEMM: the best GFLOP/s of two ways of running the tower's GEMM shapes on `PEAK_ROWS` rows, stock
  `F.linear` and bivit's invariant GEMM (`bivit.ops.linear` in invariant mode: the compiled kernel on packed
  weights, or the proven-tile fallback), best of `TRIES`; attention: the best of PyTorch's fused attention and
  bivit's compiled one (where it runs here),
  one item of n patches, at every item length of the mix. Both are measured in every round, between the
  workers' turns, and the best over rounds is the machine's rate.
* **Kernel peak**: the GFLOP/s of invariant mode's GEMM kernel's multiply-add instruction alone (`vdpbf16ps` for
  bf16 on AVX-512 BF16, FMAs otherwise), on every thread, touching no memory (`kernel_peak_gflops`): what no
  kernel built on it can pass. Rates and cases are also printed as a share of it, so the distance to the
  physical limit is measured in the same run, not inferred.
* **Roofline** of a case = its GEMM FLOPs at the GEMM rate + each item's attention FLOPs at the attention rate
  for its length: the time of nothing but the two essential kernels, each at the best speed this machine gives
  it. "% of roofline" = roofline / measured time; the gap is everything else (elementwise ops, copies, tile
  padding, calls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from .. import ops
from ..checkpoint.config import ModelConfig
from ..errors import BivitError
from ..model import VisionModel
from ..ops import gemms
from .workload import Case

PEAK_ROWS = 2048
TRIES = 3
# Elementwise FLOPs per element (multiplies and adds as written; transcendental functions count once).
OTHER_PER_ELEMENT = {"layer_norm": 8, "gelu": 8, "rope": 3, "softmax": 3, "add": 1}


@dataclass(frozen=True)
class Flops:
    gemm: int
    attention: int
    other: int

    @property
    def total(self) -> int:
        """GEMM + attention: the work GFLOP/s figures count."""
        return self.gemm + self.attention


def flops_per_item(cfg: ModelConfig, t: int, h: int, w: int) -> int:
    """Multiply-add FLOPs (x2) of the GEMMs and attention for one item."""
    n, d, a = t * h * w, cfg.hidden_size, cfg.attn_width
    per_layer = 2 * n * d * (3 * a) + 2 * n * a * d + 2 * 2 * n * d * cfg.intermediate_size + 2 * 2 * n * n * a
    tokens = (h // 2) * (w // 2)
    proj = 2 * tokens * (4 * d) * (4 * d) + 2 * tokens * (4 * d) * cfg.text_hidden_size
    return cfg.num_layers * per_layer + 2 * n * d * 3 * cfg.patch_size ** 2 + proj


def attention_flops_per_item(cfg: ModelConfig, t: int, h: int, w: int) -> int:
    """QK^T and PV over all t*h*w patches of the item (they attend to each other, to nothing else)."""
    n = t * h * w
    return cfg.num_layers * 2 * 2 * n * n * cfg.attn_width


def gemm_flops_per_item(cfg: ModelConfig, t: int, h: int, w: int) -> int:
    """FLOPs of the GEMM-shaped work of one item: every linear, the patch conv, the projector."""
    return flops_per_item(cfg, t, h, w) - attention_flops_per_item(cfg, t, h, w)


def other_flops_per_item(cfg: ModelConfig, t: int, h: int, w: int) -> int:
    """The elementwise work of one item, approximately (`OTHER_PER_ELEMENT`)."""
    e = OTHER_PER_ELEMENT
    n, d, tokens = t * h * w, cfg.hidden_size, (h // 2) * (w // 2)
    per_layer = (2 * e["layer_norm"] * n * d + e["rope"] * 2 * n * cfg.attn_width
                 + e["softmax"] * n * n * cfg.num_heads + e["gelu"] * n * cfg.intermediate_size + 2 * e["add"] * n * d)
    merge = cfg.projector_input_size * cfg.merge_area
    tail = (e["layer_norm"] * n * d + e["add"] * n * d  # final norm, position embedding
            + e["add"] * (t - 1) * tokens * merge  # temporal mean
            + (e["layer_norm"] + e["gelu"]) * tokens * merge)  # projector norm and GELU
    return cfg.num_layers * per_layer + tail


def case_flops(cfg: ModelConfig, case: Case) -> Flops:
    grids = case.grids()
    return Flops(sum(gemm_flops_per_item(cfg, *g) for g in grids), sum(attention_flops_per_item(cfg, *g) for g in grids),
                 sum(other_flops_per_item(cfg, *g) for g in grids))


def gemm_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of the GEMMs of one tower block (wqkv, wo, mlp.fc0, mlp.fc1), read off the model itself."""
    with torch.device("meta"):
        block = VisionModel(cfg.replace(num_layers=1)).vision_tower.encoder.blocks[0]
    return list(dict.fromkeys(tuple(w.shape) for w, *_ in gemms(block)))


def _best_of(fn: Callable[[], object], tries: int) -> float:
    fn()  # the first call at a shape may pick or JIT a kernel, or prepare a weight
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(dtype: torch.dtype, shapes: Iterable[tuple[int, int]], rows: int = PEAK_ROWS, how: str = "stock",
                tries: int = TRIES, seed: int = 0) -> dict[str, float]:
    """Best-of-`tries` GFLOP/s per (out, in) shape, with bias as the model calls it: `how` = "stock"
    (`F.linear`) or "bivit" (bivit's invariant GEMM on prepared weights, one call of `rows` rows)."""
    g = torch.Generator().manual_seed(seed)
    result = {}
    with torch.inference_mode():
        for n, k in shapes:
            x = torch.randn(rows, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            if how == "stock":
                call = lambda: F.linear(x, w, b)  # noqa: E731
            else:
                def call(x=x, w=w, b=b):
                    with ops.batch_invariant():
                        return ops.linear(x, w, b)
            result[f"{n}x{k}"] = 2 * rows * n * k / _best_of(call, tries) / 1e9
    return result


def attention_gflops(dtype: torch.dtype, cfg: ModelConfig, lengths: Iterable[int], how: str = "sdpa",
                     tries: int = TRIES, seed: int = 0) -> dict[int, float] | None:
    """Best-of-`tries` GFLOP/s of one item of n patches, per n in `lengths`: `how` = "sdpa" (PyTorch's fused
    attention) or "bivit" (bivit's compiled attention; None where it does not run here)."""
    kernel = ops.attention_kernel(dtype) if how == "bivit" else None
    if how == "bivit" and kernel is None:
        return None
    g = torch.Generator().manual_seed(seed)
    result = {}
    with torch.inference_mode():
        for n in sorted(set(lengths)):
            q, k, v = (torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g).to(dtype) for _ in range(3))
            if kernel is not None:
                out = torch.empty_like(q)
                call = lambda: kernel(q, k, v, out, [n])  # noqa: E731
            else:
                qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
                call = lambda: F.scaled_dot_product_attention(qh, kh, vh)  # noqa: E731
            result[n] = 4 * n * n * cfg.num_heads * cfg.head_dim / _best_of(call, tries) / 1e9
    return result


def kernel_peak_gflops(dtype: torch.dtype) -> float | None:
    """GFLOP/s of the multiply-add instruction of invariant mode's GEMM kernel for `dtype` alone (no memory, every
    thread): the physical limit of bivit's kernels here, which the GEMM and attention rates approach. None where
    that kernel has no peak loop (the portable one) or no kernel runs."""
    try:
        kernel = ops.gemm_kernel(dtype)
    except BivitError:
        return None
    return kernel.peak_gflops()


def roofline_s(gemm_flops: float, attention_flops: Iterable[tuple[int, float]], gemm_rate: float,
               attention_rate: dict[int, float]) -> float:
    """Seconds for `gemm_flops` at `gemm_rate` plus each item's (length, FLOPs) at the attention rate for its
    length (GFLOP/s)."""
    return gemm_flops / (gemm_rate * 1e9) + sum(f / (attention_rate[n] * 1e9) for n, f in attention_flops)
