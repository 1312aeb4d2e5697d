"""The whole forward pass (MoonViT tower -> 2x2 temporal-pool merger -> PatchMerger projector) in bivit-arith/1,
written from the spec (docs/arithmetic.md, docs/model.md) in numpy with `arith_reference`'s exact operations: an
implementation that shares no code with bivit's model, ops or kernels, to check bivit's rows bit for bit.

K2.x layout (LayerNorm, biases, tanh-GELU MLP, PatchMerger); one tower dtype (the projector's too). Slow: small
inputs only.
"""

from __future__ import annotations

import math

import numpy as np

from . import arith_reference as R

F32 = np.float32


def _libm32(fn, x: np.ndarray) -> np.ndarray:
    return np.array([fn(float(v)) for v in np.asarray(x).ravel()], np.float64).astype(F32).reshape(np.shape(x))


def temporal_table(t: int, dim: int) -> np.ndarray:
    """[t, dim]: sin then cos of f * w_k, w_k = 1 / fl32(10000^(k / (dim/2))) (float32 division)."""
    e = np.arange(dim // 2, dtype=F32) / F32(dim / 2)
    w = F32(1) / _libm32(lambda v: 10000.0 ** v, e)
    ang = np.arange(t, dtype=F32)[:, None] * w[None, :]
    return np.concatenate([_libm32(math.sin, ang), _libm32(math.cos, ang)], axis=1)


def rope_tables(h: int, w: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos [h*w, head_dim] = (c0, c0, c1, c1, ...), sin = (-s0, s0, ...); pair 2i turns with the column, 2i+1
    with the row, frequencies 1 / fl32(theta^(4k/head_dim))."""
    e = (np.arange(head_dim // 4, dtype=F32) * F32(4)) / F32(head_dim)
    freqs = F32(1) / _libm32(lambda v: theta ** v, e)
    col = np.arange(w, dtype=F32)[:, None] * freqs[None, :]  # [w, hd/4]
    row = np.arange(h, dtype=F32)[:, None] * freqs[None, :]  # [h, hd/4]
    cos = np.zeros((h * w, head_dim), F32)
    sin = np.zeros((h * w, head_dim), F32)
    for y in range(h):
        for x in range(w):
            angles = np.stack([col[x], row[y]], axis=-1).ravel()  # [hd/2]: (col f0, row f0, col f1, ...)
            c, s = _libm32(math.cos, angles), _libm32(math.sin, angles)
            cos[y * w + x] = np.repeat(c, 2)
            sin[y * w + x] = np.stack([-s, s], axis=-1).ravel()
    return cos, sin


def _weights(out: int, size: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    scale = F32(size) / F32(out)
    idx, wts = [], []
    for i in range(out):
        src = scale * (F32(i) + F32(0.5)) - F32(0.5)
        if mode == "bilinear":
            src = max(src, F32(0))
        i0 = min(int(math.floor(src)), size - 1)
        t = min(max(src - F32(i0), F32(0)), F32(1))
        if mode == "bilinear":
            idx.append([i0, i0 + (1 if i0 < size - 1 else 0)])
            wts.append([F32(1) - t, t])
            continue
        a = F32(-0.75)
        near = lambda x: ((((a + F32(2)) * x - (a + F32(3))) * x) * x) + F32(1)
        far = lambda x: (((a * x - F32(5) * a) * x + F32(8) * a) * x) - F32(4) * a
        idx.append([min(max(i0 + j, 0), size - 1) for j in (-1, 0, 1, 2)])
        wts.append([far(t + F32(1)), near(t), near(F32(1) - t), far((F32(1) - t) + F32(1))])
    return np.array(idx), np.array(wts, F32)


def resample(table: np.ndarray, h: int, w: int, mode: str) -> np.ndarray:
    """[H, W, D] -> [h, w, D]: taps along the width, then the height, products and sums rounded in tap order."""
    iy, wy = _weights(h, table.shape[0], mode)
    ix, wx = _weights(w, table.shape[1], mode)
    A = R.IEEE
    rows = A.mul(table[:, ix[:, 0]], wx[None, :, 0, None])
    for j in range(1, ix.shape[1]):
        rows = A.add(rows, A.mul(table[:, ix[:, j]], wx[None, :, j, None]))
    out = A.mul(rows[iy[:, 0]], wy[:, 0, None, None])
    for j in range(1, iy.shape[1]):
        out = A.add(out, A.mul(rows[iy[:, j]], wy[:, j, None, None]))
    return out


def forward(state: dict[str, np.ndarray], cfg, pixels: np.ndarray, grid_thw: list[tuple[int, int, int]],
            dtype: str) -> list[np.ndarray]:
    """Rows per item (float32 arrays holding values of `dtype`): `state` the checkpoint's tensors as float32 arrays
    (values of `dtype`), `pixels` [L, 3, 14, 14] float32."""
    bf = dtype == "bfloat16"
    rnd = lambda a: R.round_to(a, dtype)
    W = lambda k: rnd(state[k])
    A = R.IEEE

    def linear(x, name, act=None):
        b = state.get(name + ".bias")
        return rnd(R.gemm(x, W(name + ".weight").reshape(state[name + ".weight"].shape[0], -1),
                          None if b is None else W(name + ".bias"), act, bf))

    def norm(x, name, eps):
        return rnd(R.layer_norm(x, W(name + ".weight"), W(name + ".bias"), eps))

    x = linear(rnd(pixels.reshape(pixels.shape[0], -1)), "vision_tower.patch_embed.proj")
    table = W("vision_tower.patch_embed.pos_emb.weight")
    pos = []
    for t, h, w in grid_thw:
        sp = table.reshape(h * w, -1) if (h, w) == table.shape[:2] else rnd(resample(table, h, w, cfg.pos_emb_interpolation).reshape(h * w, -1))
        if t > 1:
            sp = rnd(A.add(sp[None], rnd(temporal_table(t, table.shape[-1]))[:, None, :])).reshape(t * h * w, -1)
        pos.append(sp)
    x = rnd(A.add(x, np.concatenate(pos)))
    heads, hd = cfg.num_heads, cfg.head_dim
    cos = np.concatenate([np.tile(rope_tables(h, w, hd, cfg.rope_theta)[0], (t, 1)) for t, h, w in grid_thw])
    sin = np.concatenate([np.tile(rope_tables(h, w, hd, cfg.rope_theta)[1], (t, 1)) for t, h, w in grid_thw])
    lens = [t * h * w for t, h, w in grid_thw]
    for i in range(cfg.num_layers):
        p = f"vision_tower.encoder.blocks.{i}"
        qkv = linear(norm(x, p + ".norm0", cfg.norm_eps), p + ".wqkv").reshape(x.shape[0], 3, heads, hd)
        att = rnd(R.attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], lens, dtype, (cos, sin))).reshape(x.shape[0], -1)
        x = rnd(A.add(x, linear(att, p + ".wo")))
        y = linear(linear(norm(x, p + ".norm1", cfg.norm_eps), p + ".mlp.fc0", "tanh"), p + ".mlp.fc1")
        x = rnd(A.add(x, y))
    x = norm(x, "vision_tower.encoder.final_layernorm", cfg.norm_eps)
    merged, start = [], 0
    for t, h, w in grid_thw:
        item = x[start:start + t * h * w].reshape(t, h // 2, 2, w // 2, 2, -1)
        start += t * h * w
        acc = item[0].copy()
        for f in range(1, t):
            acc = A.add(acc, item[f])
        mean = rnd(A.div(acc, F32(t)))
        merged.append(mean.transpose(0, 2, 1, 3, 4).reshape((h // 2) * (w // 2), 4, -1))
    m = np.concatenate(merged)
    m = rnd(R.layer_norm(m, W("mm_projector.pre_norm.weight"), W("mm_projector.pre_norm.bias"), cfg.projector_ln_eps))
    out = linear(linear(m.reshape(m.shape[0], -1), "mm_projector.proj.0", "erf"), "mm_projector.proj.2")
    return np.split(out, np.cumsum([(h // 2) * (w // 2) for _, h, w in grid_thw])[:-1])
