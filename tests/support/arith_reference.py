"""bivit-arith/1 transcribed into numpy, one rounding at a time (docs/arithmetic.md): the reference the compiled
kernels and the committed hashes are checked against. Independent of the kernels: no C, no PyTorch op, only
numpy's float32 and float64 elementwise arithmetic (IEEE everywhere), with the fused multiply-add and the
flush of bf16 arithmetic emulated exactly.

Slow (Python loops over the reduction axes, numpy over everything else): for small shapes.
"""

from __future__ import annotations

import numpy as np

F32, F64 = np.float32, np.float64
FLT_MIN = F64(2.0 ** -126)

# ------------------------------------------------------------------------------------------------ rounding


def _round_exact(s: np.ndarray, err: np.ndarray) -> np.ndarray:
    """float32 nearest (ties to even) to the exact value s + err (float64 s, |err| <= half an ulp of s)."""
    r = s.astype(F32)
    r64 = r.astype(F64)
    other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf)).astype(F32))
    tie = (r64 != s) & (s == (r64 + other.astype(F64)) / 2) & (err != 0)
    up = np.where(err > 0, np.maximum(r, other), np.minimum(r, other))
    return np.where(tie, up, r).astype(F32)


def _tiny(r: np.ndarray, s: np.ndarray, err: np.ndarray) -> np.ndarray:
    """x86's tininess, detected after rounding: the exact value s + err rounded to 24 bits with an unbounded
    exponent is below 2^-126 in magnitude (r: its IEEE float32 rounding)."""
    a = np.abs(r.astype(F64))
    edge = a == FLT_MIN  # rounded up to 2^-126 through the denormal grid; maybe not with 24 bits
    u = np.abs(s) * F64(2.0 ** 150)  # the 24-bit grid below 2^-126 is 2^-150
    half = F64(2.0 ** 24 - 0.5)
    toward = np.sign(err) * np.sign(s)
    below = (u < half) | ((u == half) & (toward < 0))
    return (a < FLT_MIN) | (edge & below)


def _flush(r: np.ndarray, s: np.ndarray, err: np.ndarray) -> np.ndarray:
    return np.where(_tiny(r, s, err), np.copysign(F32(0), r.astype(F32)), r).astype(F32)


def daz(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, F32)
    return np.where(np.abs(x.astype(F64)) < FLT_MIN, np.copysign(F32(0), x), x).astype(F32)


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


class Arith:
    """The float32 operations of one mode: IEEE (`flush=False`) or bf16's flushed mode (DAZ + FTZ)."""

    def __init__(self, flush: bool):
        self.flush = flush

    def _in(self, *xs):
        return [daz(x) if self.flush else np.asarray(x, F32) for x in xs]

    def _out(self, r, s, err):
        return _flush(r, s, err) if self.flush else r

    def fma(self, a, b, c):
        a, b, c = self._in(a, b, c)
        p = a.astype(F64) * b.astype(F64)  # exact: 24 + 24 bits
        s, err = _two_sum(p, c.astype(F64))
        return self._out(_round_exact(s, err), s, err)

    def add(self, a, b):
        a, b = self._in(a, b)
        s, err = _two_sum(a.astype(F64), b.astype(F64))
        return self._out(_round_exact(s, err), s, err)

    def sub(self, a, b):
        return self.add(a, -np.asarray(b, F32))

    def mul(self, a, b):
        a, b = self._in(a, b)
        p = a.astype(F64) * b.astype(F64)
        return self._out(p.astype(F32), p, np.zeros_like(p))

    def div(self, a, b):  # double rounding through float64 is exact for a quotient of floats (53 >= 2 * 24 + 2)
        a, b = self._in(a, b)
        q = a.astype(F64) / b.astype(F64)
        r = q.astype(F32)
        return self._out(r, r.astype(F64), np.zeros_like(q)) if self.flush else r

    def sqrt(self, a):
        (a,) = self._in(a)
        return np.sqrt(a.astype(F64)).astype(F32)


IEEE, FLUSHED = Arith(False), Arith(True)


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 (nearest even; NaN -> 0x7FC0), returned widened to float32."""
    u = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    r = np.where((u & 0x7FFFFFFF) > 0x7F800000, np.uint32(0x7FC0), r)
    return (r << 16).astype(np.uint32).view(F32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` ("float32", "bfloat16", "float16"), widened back to float32."""
    if dtype == "bfloat16":
        return bf16(x)
    if dtype == "float16":
        return np.asarray(x, F32).astype(np.float16).astype(F32)
    return np.asarray(x, F32)


# ------------------------------------------------------------------------------------------------ functions

EXP2 = [F32(c) for c in (1.5252733804059841e-05, 1.5403530393381606e-04, 1.3333558146428443e-03,
                         9.6181291076284772e-03, 5.5504108664821580e-02, 2.4022650695910071e-01,
                         6.9314718055994531e-01, 1.0)]


def exp2_neg(A: Arith, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, F32)
    x = np.where(x > F32(-126), x, F32(-126)).astype(F32)  # NaN -> -126
    n = np.rint(x).astype(F32)
    f = A.sub(x, n)
    p = np.full(x.shape, EXP2[0], F32)
    for c in EXP2[1:]:
        p = A.fma(p, f, np.full(x.shape, c, F32))
    scale = ((n.astype(np.int64) + 127) << 23).astype(np.uint32).view(F32)
    return A.mul(p, scale)


def gelu(A: Arith, x: np.ndarray, act: str) -> np.ndarray:
    """GELU of `act`: "tanh" (the tanh approximation) or "erf"."""
    x = np.asarray(x, F32)
    if act == "tanh":
        u = A.mul(F32(0.7978845608028654), A.fma(A.mul(F32(0.044715), x), A.mul(x, x), x))
        e = exp2_neg(A, A.mul(np.abs(u), F32(-2.0) * F32(1.4426950408889634)))
        t = A.div(A.sub(F32(1), e), A.add(F32(1), e))
    else:
        u = A.mul(x, F32(0.7071067811865476))
        a = np.abs(u)
        r = A.div(F32(1), A.fma(F32(0.3275911), a, F32(1)))
        poly = A.fma(F32(1.061405429), r, F32(-1.453152027))
        for c in (1.421413741, -0.284496736, 0.254829592):
            poly = A.fma(poly, r, F32(c))
        poly = A.mul(poly, r)
        e = exp2_neg(A, A.mul(A.mul(a, a), F32(-1.4426950408889634)))
        t = A.fma(-poly, e, F32(1))
    t = (t.view(np.uint32) | (u.view(np.uint32) & np.uint32(0x80000000))).view(F32)
    return A.mul(A.mul(F32(0.5), x), A.add(F32(1), t))


def _tree(A: Arith, lane: np.ndarray) -> np.ndarray:
    """Lanes added pairwise, (l, l + half) at each level, down to one."""
    while lane.shape[-1] > 1:
        half = lane.shape[-1] // 2
        lane = A.add(lane[..., :half], lane[..., half:])
    return lane[..., 0]


def lanes16_sum(A: Arith, terms: np.ndarray, lanes: int = 16) -> np.ndarray:
    """The 16-lane sum over the last axis: lane l adds terms l, l + 16, ... in order from +0; then the tree
    (`lanes`: another width, for the controls)."""
    lane = np.zeros(terms.shape[:-1] + (lanes,), F32)
    for j in range(terms.shape[-1]):
        lane[..., j % lanes] = A.add(lane[..., j % lanes], terms[..., j])
    return _tree(A, lane)


def gemm(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, act: str | None, bf16_arith: bool,
         pairs_swapped: bool = False) -> np.ndarray:
    """act(x @ w.T + bias) in fp32 (not rounded to an output dtype): x [M, K], w [N, K] (values of their
    dtype, as float32). `pairs_swapped`: k + 1 before k in each pair (a control: vdpbf16ps on pairs as stored)."""
    A = FLUSHED if bf16_arith else IEEE
    acc = np.zeros((x.shape[0], w.shape[0]), F32)
    order = [k ^ 1 if pairs_swapped and (k ^ 1) < x.shape[1] else k for k in range(x.shape[1])]
    for k in order:
        acc = A.fma(x[:, k:k + 1], w[None, :, k], acc)
    if bf16_arith and x.shape[1] % 2:
        acc = A.add(acc, F32(0))  # a bf16 pair's padding, 0 x 0
    v = A.add(acc, np.zeros(w.shape[0], F32) if bias is None else bias[None, :])
    return v if act is None else gelu(A, v, act)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dtype: str) -> np.ndarray:
    """x [L, heads, d] rotated (IEEE: x * cos + swapped(x) * sin, each product and the sum rounded), rounded to
    `dtype`."""
    swapped = x.reshape(x.shape[:-1] + (-1, 2))[..., ::-1].reshape(x.shape)
    y = IEEE.add(IEEE.mul(x, cos[:, None, :]), IEEE.mul(swapped, sin[:, None, :]))
    return round_to(y, dtype)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens, dtype: str, rope_tables=None, lanes: int = 16,
              chunk: int = 128, round_p: bool = True) -> np.ndarray:
    """Per item and head: softmax(q k^T / sqrt(d)) v in bivit-arith/1, in fp32 (not rounded to `dtype`).
    `lanes`, `chunk`, `round_p`: another sum width, chunk of keys, or bf16 numerators left in fp32 (controls)."""
    if rope_tables is not None:
        q, k = rope(q, *rope_tables, dtype), rope(k, *rope_tables, dtype)
    bf = dtype == "bfloat16"
    A = FLUSHED if bf else IEEE
    d = q.shape[-1]
    scale2 = IEEE.mul(F32(1 / np.sqrt(d)), F32(1.4426950408889634))
    out = np.zeros(q.shape, F32)
    start = 0
    for n in lens:
        for h in range(q.shape[1]):
            qi, ki, vi = (t[start:start + n, h] for t in (q, k, v))
            acc = np.zeros((n, n), F32)
            for c in range(d):
                acc = A.fma(qi[:, c:c + 1], ki[None, :, c], acc)
            if bf and d % 2:
                acc = A.add(acc, F32(0))
            s = A.mul(acc, scale2)
            m = s.max(axis=1, keepdims=True)
            e = exp2_neg(A, A.sub(s, m))
            inv = A.div(F32(1), lanes16_sum(A, e, lanes))[:, None]
            p = bf16(e) if bf and round_p else e
            tot = np.zeros((n, d), F32)
            for c0 in range(0, n, chunk):
                c1 = min(c0 + chunk, n)
                part = np.zeros((n, d), F32)
                for j in range(c0, c1):
                    part = A.fma(p[:, j:j + 1], vi[None, j, :], part)
                if bf and n % 2 and c1 == n:
                    part = A.add(part, F32(0))
                tot = A.add(tot, part)
            out[start:start + n, h] = A.mul(tot, inv)
        start += n
    return out


def fma_lanes16_sum(A: Arith, a: np.ndarray, b: np.ndarray, lanes: int = 16) -> np.ndarray:
    """The 16-lane sum of a * b over the last axis, each lane a chain fma(a_j, b_j, lane) from +0, then the tree."""
    lane = np.zeros(a.shape[:-1] + (lanes,), F32)
    for j in range(a.shape[-1]):
        lane[..., j % lanes] = A.fma(a[..., j], b[..., j], lane[..., j % lanes])
    return _tree(A, lane)


def layer_norm(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: float, lanes: int = 16) -> np.ndarray:
    """LayerNorm over the last axis in fp32 (IEEE), not rounded to an output dtype (`lanes`: for the controls)."""
    A, d = IEEE, x.shape[-1]
    mean = A.div(lanes16_sum(A, x, lanes), F32(d))[..., None]
    dev = A.sub(x, mean)
    var = A.div(fma_lanes16_sum(A, dev, dev, lanes), F32(d))
    rstd = A.div(F32(1), A.sqrt(A.add(var, F32(eps))))[..., None]
    w = np.ones(d, F32) if w is None else w
    b = np.zeros(d, F32) if b is None else b
    return A.fma(A.mul(dev, rstd), w, b)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis in fp32 (IEEE), not rounded to an output dtype."""
    A, d = IEEE, x.shape[-1]
    rstd = A.div(F32(1), A.sqrt(A.add(A.div(fma_lanes16_sum(A, x, x), F32(d)), F32(eps))))[..., None]
    y = A.mul(x, rstd)
    return y if w is None else A.mul(y, w)
