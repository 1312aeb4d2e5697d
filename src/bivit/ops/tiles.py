"""The fallback invariant GEMM, where bivit's compiled GEMM does not run (no C compiler, a CPU without a
variant): PyTorch's GEMMs (oneDNN, MKL) at pinned row counts, proven on this machine rather than invariant by
construction (the load-time proof, `bivit.ops.proof`, checks them at this thread count and another).

Library GEMMs pick kernels and reduction orders by shape (on an AVX-512 EPYC, stock fp32 `F.linear` computes a
row three ways: M = 1, M in {2, 3}, M >= 4), but at one fixed shape a row's result does not depend on its
position or its neighbours. In invariant mode GEMMs therefore run only at pinned row counts ("tiles"). Which
row counts are allowed (`CANDIDATE_TILES`) is decided by a probe on this machine and library, at load: the
reference tile must compute moved rows bit-identically, and every other size is used only if it computes every
row bit-identically to the reference tile. What the probe proved is recorded per machine kind and library build
(the kernel cache), so later loads on the same kind do not repeat it. The rows of a call are cut into the
largest proven tiles, the remainder zero-padded up to a proven size. If even the reference tile is not
row-position invariant, every row is computed alone (M = 1 always: slow, exact) and the probe says so.

Which kernel a GEMM uses (pre-packed oneDNN or not, fused GELU or not, bf16 widened to float32 or not) is
`backend.gemm_path(dtype)`: fixed per process and dtype, never switched by a failure.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import kernels, state
from . import packs
from .backend import KernelFailed, gemm_path
from .pointwise import chunked_gelu

log = logging.getLogger("bivit")

# Row counts GEMMs may run at in invariant mode, ascending. REFERENCE_TILE is the tile whose row-position
# invariance the probe proves directly; every other size is used only if it computes each row bit-identically
# to it. Large tiles mean few calls (each call is one OpenMP fork/join, which is what hurts on a busy machine,
# and one output copy less when a whole input fits one call); small ones keep the zero-padding of tails small.
# The probe computes about 3x the largest tile's rows per GEMM shape, once per machine kind (the plan is then
# recorded): tiles above 1024 rows are proven only where that stays under PROBE_TILE_FLOPS per tile, i.e. for
# the tower's GEMMs (2048 rows: one call for a 2048-patch batch, two for 3072) and not for the projector's
# 5-7x larger weights, which see a quarter of the rows.
CANDIDATE_TILES = (64, 128, 256, 512, 1024, 2048)
REFERENCE_TILE = 256
PROBE_TILE_FLOPS = 25e9


@dataclass
class GemmPlan:
    """Which row counts a GEMM of one shape may run at in invariant mode, as proven by the probe."""

    tiles: tuple[int, ...]  # ascending; empty means: row by row (M = 1), the exact slow path

    @property
    def exact_fallback(self) -> bool:
        return not self.tiles


# The proven plan per GEMM shape (`gemm_plan`), for this process; probing one takes the lock.
_plans: dict[tuple, GemmPlan] = state.table(state.PROOFS)
_plans_lock = threading.Lock()


def _prepared(weight: torch.Tensor, key: torch.Tensor, transposed: bool, compute: torch.dtype,
              packed: bool) -> torch.Tensor:
    """`weight` in `compute` dtype, pre-packed for oneDNN when `packed` (`bivit.ops.packs`)."""
    def make() -> torch.Tensor:
        ready = weight.detach().to(compute).contiguous()
        if packed:
            try:
                ready = torch.ops.mkldnn._reorder_linear_weight(ready, REFERENCE_TILE)
            except Exception as e:
                raise KernelFailed(f"oneDNN weight packing of a {tuple(weight.shape)} weight failed: {e}") from e
        return ready

    return packs.prepared(key, ("tiles", packed, transposed), make)


class Gemm:
    """The one GEMM call of invariant mode, `x @ weight.t() + bias` (then GELU when `gelu` names its
    approximation); the probe proves facts about exactly this call.

    With the pre-packed path, weights are packed once (oneDNN's blocked layout): stock bf16 `F.linear` re-packs
    the weight on every call, which at a 256-row tile costs about as much as the multiply itself (the packed
    call computes the same bits); in fp32 oneDNN's packed GEMM is faster than MKL's. GELU then runs as oneDNN's
    post-op on the float32 accumulator, inside the GEMM: no second pass over the output (its bits differ from
    GELU of the rounded output, within rounding; both are exact per row). Without fusion, `fuses` is False and
    the caller applies GELU itself. Where the compute dtype is wider than the weights' (bf16 on a CPU without a
    bf16 GEMM), inputs are widened per call and the result rounded back to the weights' dtype.
    `key` is the tensor the prepared copy belongs to (the Linear or conv weight); `transposed` says `weight` is
    that tensor's transpose (the input-gradient GEMM), which gets its own copy. `pack=False` forces PyTorch's
    GEMM (the row-by-row exact path).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
                 transposed: bool = False, gelu: str | None = None, pack: bool = True) -> None:
        path = gemm_path(weight.dtype, weight.device.type)
        self.weight, self.dtype, self.compute = weight, weight.dtype, path.compute
        self.bias = None if bias is None else bias.detach().to(self.compute)  # exact: bias is never wider
        self.key, self.transposed = key, transposed
        self.packs = pack and path.packed
        self.gelu = gelu if self.packs and path.fused_gelu else None

    @property
    def fuses(self) -> bool:
        return self.gelu is not None

    def plan_key(self) -> tuple:
        w = self.weight
        # the thread count too: oneDNN's blocking (and so which tiles are proven) depends on it
        return (w.shape[0], w.shape[1], w.stride(), w.dtype, self.compute, w.device, self.bias is None,
                self.packs, self.gelu, torch.get_num_threads())

    def prepared(self) -> torch.Tensor:
        """The weight as the kernel takes it (packed and/or widened), made at its first use (`_prepared`)."""
        if not self.packs and self.compute == self.dtype:
            return self.weight
        return _prepared(self.weight, self.key, self.transposed, self.compute, self.packs)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The GEMM of `x`'s rows, into `out` when given (else a new tensor of the weights' dtype)."""
        xc = x if x.dtype == self.compute else x.to(self.compute)
        weight = self.prepared()
        if self.packs:
            try:
                if self.gelu is not None:
                    y = torch.ops.mkldnn._linear_pointwise(xc, weight, self.bias, "gelu", [], self.gelu)
                else:
                    y = torch.ops.mkldnn._linear_pointwise(xc, weight, self.bias, "none", [], "")
            except Exception as e:
                raise KernelFailed(f"oneDNN's packed GEMM raised for input {tuple(x.shape)}: {e}") from e
        elif out is not None and self.compute == self.dtype:
            # MKL writes straight into `out` (a row block of the caller's output: no temporary, no copy).
            return self._mm(xc, weight, out)
        else:
            y = self._mm(xc, weight, xc.new_empty(xc.shape[0], weight.shape[0]))
        if out is not None:
            return out.copy_(y)
        return y if y.dtype == self.dtype else y.to(self.dtype)

    def _mm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(self.bias, x, weight.t(), out=out)


# Bump when what the probe proves changes: plans recorded by an older bivit are then proven again.
PLAN_FORMAT = 2


@state.memo(state.FIXED)
def _build_facts() -> str:
    model, flags = kernels.cpu_info()
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("ONEDNN_", "DNNL_", "MKL_", "ATEN_", "OMP_", "KMP_", "GOMP_")))
    return json.dumps([PLAN_FORMAT, torch.__version__, torch.version.git_version, torch.__config__.show(), model,
                       sorted(flags), torch.backends.cpu.get_cpu_capability(), env])


def _plan_record_name() -> str:
    """The plan record of this machine kind, library build and thread count: what decides which kernel a GEMM
    shape gets (CPU flags, PyTorch/oneDNN/MKL versions, the variables that cap their instruction sets, threads).
    A plan proven under one of them is reused only under the same one."""
    facts = f"{_build_facts()}|threads={torch.get_num_threads()}"
    return f"gemm-plans-{hashlib.sha256(facts.encode()).hexdigest()[:16]}.json"


_records: dict[str, dict] = state.table(state.PROOFS)  # plan records read or written by this process, by name


def _probe(gemm: Gemm) -> GemmPlan:
    """The plan of this GEMM's shape: recorded in the kernel cache when this machine kind and library proved it
    before (`kernels.cache`: the same ownership checks as a compiled kernel), else proven now and recorded.
    The proof costs a few hundred GFLOP per model (seconds at load; more on a CPU without bf16 GEMMs)."""
    name, shape = _plan_record_name(), repr(gemm.plan_key())
    if name not in _records:
        _records[name] = kernels.cache.read_record(name) or {}
    tiles = _records[name].get(shape)
    if isinstance(tiles, list) and all(t in CANDIDATE_TILES for t in tiles) and tiles == sorted(set(tiles)):
        return GemmPlan(tuple(tiles))
    log.info("bivit: proving the GEMM tile plan of shape %s on this machine kind (once; recorded in the kernel "
             "cache)", shape)
    plan = _prove(gemm)
    record = kernels.cache.read_record(name) or {}  # re-read: another process may have added shapes meanwhile
    record[shape] = list(plan.tiles)
    kernels.cache.write_record(name, record)
    _records[name] = record
    return plan


def _prove(gemm: Gemm) -> GemmPlan:
    """Prove, on this machine and library, which tile sizes compute a row the same way as REFERENCE_TILE.

    Row-position invariance at the reference tile: the tile is computed, then computed again with half of its
    rows moved (reversed) to other positions beside other neighbours; each moved row must come back
    bit-identical. Then every other candidate size is allowed only if it reproduces, bit for bit, what
    reference tiles compute for the same rows. Kernel choice depends on shapes, not values, so one probe per
    GEMM shape (and post-op) suffices.
    """
    g = torch.Generator(device="cpu").manual_seed(1234)
    w = gemm.weight
    candidates = [t for t in CANDIDATE_TILES if t <= 1024 or 2 * t * w.shape[0] * w.shape[1] <= PROBE_TILE_FLOPS]
    ref_rows, half, most = REFERENCE_TILE, REFERENCE_TILE // 2, max(candidates)
    x = torch.randn(max(most, ref_rows), w.shape[1], generator=g).to(w.device, w.dtype)
    ref = torch.cat([gemm(x[i:i + ref_rows]) for i in range(0, x.shape[0] - ref_rows + 1, ref_rows)])
    moved = torch.randn(ref_rows, w.shape[1], generator=g).to(w.device, w.dtype)
    moved[half:] = torch.flip(x[:half], [0])
    if not torch.equal(torch.flip(gemm(moved)[half:], [0]), ref[:half]):
        return GemmPlan(())
    tiles = [t for t in candidates if t == ref_rows or (t <= ref.shape[0] and torch.equal(gemm(x[:t]), ref[:t]))]
    return GemmPlan(tuple(sorted(tiles)))


def gemm_plan(gemm: Gemm) -> GemmPlan:
    """The proven plan for GEMMs of this weight's shape, dtype, device and kernel (probed once, then cached)."""
    key = gemm.plan_key()
    plan = _plans.get(key)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(key)
            if plan is None:
                plan = _probe(gemm)
                if plan.exact_fallback and not gemm.fuses:
                    w = gemm.weight
                    log.warning("bivit: GEMM %sx%s %s is not row-position invariant on this machine; using the "
                                "exact row-by-row path (slower)", w.shape[0], w.shape[1], w.dtype)
                _plans[key] = plan
    return plan


def self_check(gemms: Sequence[tuple], prepare: bool = False) -> list[GemmPlan]:
    """Probe the GEMMs `(weight, bias[, gelu])` of a model at load, so a failure is known (and said) up front.
    `weight` is a Linear weight `[out, in]` or a patch-conv weight `[out, C, p, p]`; `gelu` (None, "tanh" or
    "none") names the GELU that follows the GEMM: the fused call is what is probed then, unless it cannot fuse
    or is not invariant (the plain GEMM is probed instead). Returns the plan inference will use.

    A shape whose plan this machine kind has recorded is not computed again, and its weights are then prepared
    (packed, widened) at their first use, unless `prepare`: loading costs reading the weights, little more."""
    plans = []
    with torch.no_grad():
        for w, b, *rest in gemms:
            gemm, _ = _fused_or_plain(w.reshape(w.shape[0], -1), b, w, rest[0] if rest else None)
            plan = gemm_plan(gemm)
            if prepare:
                gemm.prepared()
            plans.append(plan)
    return plans


def _calls(m: int, tiles: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Cut m rows into GEMM calls (start, rows, tile): the largest tiles first; a remainder runs zero-padded in
    one call when that wastes at most a quarter of it (or when it is below the smallest tile)."""
    calls, start = [], 0
    while start < m:
        rest = m - start
        up = next((t for t in tiles if t >= rest), None)
        if up is not None and (up == tiles[0] or 4 * rest >= 3 * up):
            calls.append((start, rest, up))
            break
        tile = max(t for t in tiles if t <= rest)
        calls.append((start, tile, tile))
        start += tile
    return calls


def _fused_or_plain(weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor, gelu: str | None,
                    transposed: bool = False) -> tuple[Gemm, str | None]:
    """The GEMM call for `weight` followed by GELU `gelu`, and the GELU still to apply after it: the fused call
    where oneDNN fuses it and its plan is proven (nothing left), else the plain call (then `gelu`)."""
    if gelu is not None:
        fused = Gemm(weight, bias, key, transposed, gelu)
        if fused.fuses and not gemm_plan(fused).exact_fallback:
            return fused, None
    return Gemm(weight, bias, key, transposed), gelu


def tiled(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor,
           transposed: bool = False, gelu: str | None = None) -> torch.Tensor:
    """`x2 @ weight.t() + bias` (then GELU if `gelu`) at the proven tile sizes only: each row's bits depend on
    that row alone."""
    gemm, gelu = _fused_or_plain(weight, bias, key, gelu, transposed)
    if gemm.packs and gemm_plan(gemm).exact_fallback:
        gemm = Gemm(weight, bias, key, transposed, pack=False)  # row by row: PyTorch's GEMM at M = 1
    out = _tiled_with(gemm, x2)
    return out if gelu is None else chunked_gelu(out, gelu)


def _tiled_with(gemm: Gemm, x2: torch.Tensor) -> torch.Tensor:
    m = x2.shape[0]
    plan = gemm_plan(gemm)
    if plan.exact_fallback:
        # One thread: a library GEMV at M = 1 may split K over threads (MKL's fp32 one did, at 3 threads).
        out = x2.new_empty(m, gemm.weight.shape[0])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i in range(m):
                gemm(x2[i:i + 1], out=out[i:i + 1])
        finally:
            torch.set_num_threads(threads)
        return out
    calls = _calls(m, plan.tiles)
    if len(calls) == 1:  # the whole input in one call: its result is the output (no copy)
        return gemm(x2 if m == calls[0][2] else _zero_padded(x2, calls[0][2]))[:m]
    out = x2.new_empty(m, gemm.weight.shape[0])
    for start, rows, tile in calls:
        if rows == tile:
            gemm(x2[start:start + rows], out=out[start:start + rows])
        else:  # the zero-padded tail: its rows are computed as in a full tile
            out[start:] = gemm(_zero_padded(x2[start:], tile))[:rows]
    return out


def _zero_padded(x2: torch.Tensor, rows: int) -> torch.Tensor:
    pad = x2.new_zeros(rows, x2.shape[1])
    pad[:x2.shape[0]] = x2
    return pad


Layer = tuple[torch.Tensor, "torch.Tensor | None", "str | None"]  # (weight, bias, GELU after it or None)


def chain(layers: Sequence[Layer]) -> list[tuple[Gemm, str | None]] | None:
    """Each layer's GEMM call (fused with its GELU where that is proven, else with GELU as a separate step), or
    None where one of them runs row by row (the exact path of `_tiled`)."""
    steps = []
    for weight, bias, gelu in layers:
        step = _fused_or_plain(weight, bias, weight, gelu)
        if gemm_plan(step[0]).exact_fallback:
            return None
        steps.append(step)
    return steps


def chain_into(residual: torch.Tensor, x: torch.Tensor, steps: list[tuple[Gemm, str | None]]) -> None:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    r2 = residual.view(-1, residual.shape[-1])
    tiles = tuple(sorted(set.intersection(*(set(gemm_plan(g).tiles) for g, _ in steps))))  # REFERENCE_TILE at least
    for start, rows, tile in _calls(x2.shape[0], tiles):
        h = x2[start:start + rows] if rows == tile else _zero_padded(x2[start:], tile)
        for gemm, gelu in steps:
            h = gemm(h)
            if gelu is not None:
                h = chunked_gelu(h, gelu)
        r2[start:start + rows].add_(h[:rows])
