"""The position terms' tables in bivit-arith/1's arithmetic: the sin-cos term of a video chunk's frames
(`temporal_embedding`) and the learned table resampled to an item's grid (`resample`), each value computed by
a fixed sequence of float32 operations (docs/arithmetic.md), so the tables do not depend on the CPU, its vector
width or the process. (RoPE's tables: `bivit.ops.rotary`.)
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch


def _libm32(fn, x: np.ndarray) -> np.ndarray:
    """fn (a float64 function of the C library) of each float32 value, rounded once to float32: not numpy's or
    PyTorch's float32 pow/sin/cos, whose last bit depends on the CPU's vector width (and, with MKL, on the
    process); one value at a time, so no element lands in a vector kernel's scalar tail."""
    return np.array([fn(float(v)) for v in x.ravel()], dtype=np.float64).astype(np.float32).reshape(x.shape)


@lru_cache(maxsize=16)
def temporal_embedding(frames: int, dim: int) -> torch.Tensor:
    """Frame f of a multi-frame chunk gets [sin(f*w_k), cos(f*w_k)], w_k = 10000^(-k/(dim/2)); fp32 `[frames, dim]`.

    The reference's buffer, in bivit-arith/1's arithmetic: e_k = k / (dim/2) and w_k = 1 / p_k in float32, p_k =
    10000^e_k and the sines and cosines of the float32 angles f * w_k each computed in float64 by the C library
    and rounded once. Row f depends on f alone, so a chunk of t frames builds (and caches) t rows.
    """
    e = np.arange(dim // 2, dtype=np.float32) / np.float32(dim / 2.0)
    omega = np.float32(1.0) / _libm32(lambda v: 10000.0 ** v, e)
    angles = np.arange(frames, dtype=np.float32)[:, None] * omega[None, :]
    return torch.from_numpy(np.concatenate([_libm32(math.sin, angles), _libm32(math.cos, angles)], axis=1))


def _source_weights(out_size: int, in_size: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per output index: the input indices and float32 weights of PyTorch's resampling (align_corners=False;
    bicubic with A = -0.75, clamped taps; bilinear), each weight computed in float32 operation by operation as
    ATen's formulas are written (no fused multiply-add): int64 [out, taps], float32 [out, taps]."""
    f32 = np.float32
    scale = f32(in_size) / f32(out_size)
    src = scale * (np.arange(out_size, dtype=f32) + f32(0.5)) - f32(0.5)
    if mode == "bilinear":
        src = np.maximum(src, f32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    t = np.minimum(np.maximum(src - i0.astype(f32), f32(0)), f32(1))
    if mode == "bilinear":
        idx = np.stack([i0, i0 + (i0 < in_size - 1)], axis=1)
        return idx, np.stack([f32(1) - t, t], axis=1)
    a = f32(-0.75)

    def near(x):  # |x| <= 1: ((A + 2) x - (A + 3)) x x + 1
        return ((((a + f32(2)) * x - (a + f32(3))) * x) * x) + f32(1)

    def far(x):  # 1 < |x| < 2: ((A x - 5A) x + 8A) x - 4A
        return (((a * x - f32(5) * a) * x + f32(8) * a) * x) - f32(4) * a

    weights = np.stack([far(t + f32(1)), near(t), near(f32(1) - t), far((f32(1) - t) + f32(1))], axis=1)
    idx = np.clip(i0[:, None] + np.arange(-1, 3), 0, in_size - 1)
    return idx, weights.astype(f32)


def resample(table: torch.Tensor, h: int, w: int, mode: str) -> torch.Tensor:
    """A `[H, W, D]` float32 table resampled to `[h, w, D]` (PyTorch's bicubic or bilinear interpolation,
    align_corners=False) in bivit-arith/1's order: along the width first, each tap's product and each sum
    rounded in float32 in tap order, then along the height the same way. PyTorch's CPU kernel computes these
    sums as compiled for the CPU kind (fused or not): other bits on AVX2 than without it."""
    iy, wy = (torch.from_numpy(a) for a in _source_weights(h, table.shape[0], mode))
    ix, wx = (torch.from_numpy(a) for a in _source_weights(w, table.shape[1], mode))
    rows = table[:, ix[:, 0]] * wx[None, :, 0, None]
    for j in range(1, ix.shape[1]):
        rows = rows + table[:, ix[:, j]] * wx[None, :, j, None]
    out = rows[iy[:, 0]] * wy[:, 0, None, None]
    for j in range(1, iy.shape[1]):
        out = out + rows[iy[:, j]] * wy[:, j, None, None]
    return out
