"""The load-time proof: bivit's invariance, shown by this machine before it encodes anything.

bivit's compiled GEMM and attention are invariant by construction (each output element's reduction runs in an
order bivit fixes, in one thread), and the remaining ops are row-wise or elementwise. A construction argument
is only as good as the code that carries it out on this CPU, build and PyTorch, so at every load, every
reduction-bearing op of the model runs at its real shapes and dtypes on random items, and each
item's rows must come out bit-identical when it is computed

  * alone, at this process's thread count,
  * packed with the others, at another thread count (1, or 2 where this process runs 1),
  * packed in reverse order, at one thread more than this process's count (more threads than cores, often).

The ops: every distinct GEMM (Linear layers, the patch conv as its GEMM, GELU after it where the model has one),
attention at the model's heads and head dim (item lengths on both sides of the compiled kernel's small-item
split, with the rotary tables), and every norm. A kernel that fails is refused in this process
(`selection.refuse`: said once on stderr, listed in `bivit doctor`, `Encoder.describe()` and /v1/info) and the op is
proven again on the next compiled kernel (GEMM: the next kernel of the library; attention: the variant's AVX-512
code instead of AMX tiles). An op with no kernel left raises InvarianceError: invariant mode would break its
promise here.

It runs once per process and model shapes (a fraction of a second for the full-size model's shapes, next to
seconds of loading its weights): nothing is recorded on disk, so nothing on disk can steer it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..base import state
from ..base.dtypes import dtype_name
from ..errors import InvarianceError
from .attend import attention
from .gemm import gemms, linear
from .mode import batch_invariant
from .norms import layer_norm, rms_norm
from .rotary import rope_tables
from .selection import attention_kernel, compute_dtype, gemm_kernel, norm_kernel, refuse

log = logging.getLogger("bivit")

GEMM_ROWS = (1, 7, 33, 100)       # items of a GEMM or norm check (rows); tails of every microtile and block
ATTENTION_GRIDS = ((1, 1), (5, 5), (10, 10), (15, 20))  # items of the attention check: 1, 25, 100, 300 patches


@dataclass(frozen=True)
class Check:
    """One op at one shape: the path that computed it and whether every item came out bit-identical alone,
    packed and reversed at `threads`."""

    op: str
    path: str
    invariant: bool
    threads: tuple[int, ...]


@dataclass
class Proof:
    checks: list[Check]
    refused: list[tuple[str, str, str]]  # (op, path, why)
    seconds: float

    def summary(self) -> dict:
        """What an encoder's description carries: per op its path and verdict, and what was refused (no timing:
        the same in every process on this machine kind)."""
        return {"checks": [{**asdict(c), "threads": list(c.threads)} for c in self.checks],
                "refused": [list(r) for r in self.refused]}

    def to_dict(self) -> dict:
        return {**self.summary(), "seconds": round(self.seconds, 3)}

    def table(self) -> list[str]:
        width = max([len(c.op) for c in self.checks] + [2])
        pwidth = max([len(c.path) for c in self.checks] + [4])
        rows = [f"{'op':<{width}}  {'path':<{pwidth}}  alone=packed=reversed  threads"]
        for c in self.checks:
            rows.append(f"{c.op:<{width}}  {c.path:<{pwidth}}  {'yes' if c.invariant else 'NO':<21}  "
                        f"{','.join(map(str, c.threads))}")
        for op, path, why in self.refused:
            rows.append(f"refused: {op} via {path}: {why}")
        return rows


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_counts() -> tuple[int, int, int]:
    n = torch.get_num_threads()
    return n, (1 if n > 1 else 2), n + 1


def _items_invariant(run: Callable[[list], list[torch.Tensor]], items: list, threads: Sequence[int]) -> bool:
    """`run(items) -> one output per item`: each item's output bit-identical alone, packed, reversed."""
    with torch.inference_mode(), batch_invariant(True):
        with _threads(threads[0]):
            alone = [run([it])[0] for it in items]
        with _threads(threads[1]):
            packed = run(items)
        with _threads(threads[2]):
            backwards = run(items[::-1])[::-1]
    return all(torch.equal(a, p) and torch.equal(a, b) for a, p, b in zip(alone, packed, backwards))


def _rows(g: torch.Generator, width: int, dtype: torch.dtype, scale: float = 1.0) -> list[torch.Tensor]:
    return [(torch.randn(n, width, generator=g, dtype=torch.float32) * scale).to(dtype) for n in GEMM_ROWS]


def _split_rows(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list], list[torch.Tensor]]:
    def run(items: list) -> list[torch.Tensor]:
        return list(fn(torch.cat(items)).split([len(i) for i in items]))
    return run


def _gemm_path(dtype: torch.dtype) -> str:
    return gemm_kernel(dtype).describe()


def _attention_path(dtype: torch.dtype) -> str:
    return f"bivit compiled attention ({attention_kernel(dtype).name_for(compute_dtype(dtype))})"


def _norm_path(dtype: torch.dtype) -> str:
    return f"{norm_kernel(dtype).name} compiled norm"


def _prove_gemm(weight: torch.Tensor, bias: torch.Tensor | None, gelu: str | None, g: torch.Generator,
                threads: Sequence[int], refused: list) -> Check:
    w2 = weight.reshape(weight.shape[0], -1)
    op = f"gemm {w2.shape[1]}->{w2.shape[0]}{'+gelu' if gelu else ''} {dtype_name(weight.dtype)}"
    items = _rows(g, w2.shape[1], weight.dtype)
    run = _split_rows(lambda x: linear(x, w2, bias, gelu=gelu))

    def kernel() -> str:
        return gemm_kernel(weight.dtype).name

    return _prove_paths(op, "gemm", run, items, threads, refused, lambda: _gemm_path(weight.dtype), kernel)


def _prove_attention(heads: int, head_dim: int, theta: float, dtype: torch.dtype, g: torch.Generator,
                     threads: Sequence[int], refused: list) -> Check:
    op = f"attention {heads}x{head_dim} {dtype_name(dtype)}"
    items = []
    for h, w in ATTENTION_GRIDS:
        q, k, v = (torch.randn(h * w, heads, head_dim, generator=g, dtype=torch.float32).to(dtype) for _ in range(3))
        items.append((q, k, v, (1, h, w)))

    def run(batch: list) -> list[torch.Tensor]:
        grids = [it[3] for it in batch]
        q, k, v = (torch.cat([it[i] for it in batch]) for i in range(3))
        out = attention(q, k, v, [t * h * w for t, h, w in grids], rope=rope_tables(grids, head_dim, theta))
        return list(out.split([t * h * w for t, h, w in grids]))

    def kernel() -> str:
        return attention_kernel(dtype).name_for(compute_dtype(dtype))

    return _prove_paths(op, "attention", run, items, threads, refused, lambda: _attention_path(dtype), kernel)


def _prove_paths(op: str, kind: str, run: Callable[[list], list[torch.Tensor]], items: list,
                 threads: Sequence[int], refused: list, path: Callable[[], str],
                 kernel: Callable[[], str]) -> Check:
    """`op` proven on the kernel `kind` runs now (`path()`: its description, `kernel()`: its name); one that fails
    is refused and the next proven, until one passes (InvarianceError where none is left: `selection`)."""
    while True:
        current = path()
        if _items_invariant(run, items, threads):
            return Check(op, current, True, tuple(threads))
        name = kernel()
        why = f"{op}: an item's rows differ alone, packed and reversed at threads {threads}"
        refused.append((kind, name, why))
        refuse(kind, name, why)


def _prove_norm(module: torch.nn.Module, g: torch.Generator, threads: Sequence[int], refused: list) -> Check:
    weight = module.weight
    dim, dtype = weight.shape[0], weight.dtype
    if isinstance(module, torch.nn.LayerNorm):
        op, fn = f"layer_norm {dim} {dtype_name(dtype)}", lambda x: layer_norm(x, weight, module.bias, module.eps)
    else:
        op, fn = f"rms_norm {dim} {dtype_name(dtype)}", lambda x: rms_norm(x, weight, module.eps)
    return _prove_paths(op, "norm", _split_rows(fn), _rows(g, dim, dtype, scale=3.0), threads, refused,
                        lambda: _norm_path(dtype), lambda: norm_kernel(dtype).name)


def _key(model: torch.nn.Module) -> tuple:
    """What decides the proof's outcome in this process (whose kernels are fixed): the thread counts, the shapes
    and dtypes."""
    shapes = sorted({(tuple(w.shape), str(w.dtype), b is None, gelu or "") for w, b, gelu in gemms(model)})
    norms = sorted({(type(m).__name__, m.weight.shape[0], str(m.weight.dtype)) for m in model.modules()
                    if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))})
    cfg = model.config
    return (thread_counts(), repr(shapes), repr(norms), cfg.num_heads, cfg.head_dim, str(model.vision_tower.dtype))


def _run(model: torch.nn.Module) -> Proof:
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    threads = thread_counts()
    checks: list[Check] = []
    refused: list[tuple[str, str, str]] = []
    seen = set()
    for w, b, gelu in gemms(model):
        key = (tuple(w.shape), w.dtype, b is None, gelu)
        if key not in seen:
            seen.add(key)
            checks.append(_prove_gemm(w, b, gelu, g, threads, refused))
    cfg = model.config
    checks.append(_prove_attention(cfg.num_heads, cfg.head_dim, cfg.rope_theta, model.vision_tower.dtype, g,
                                   threads, refused))
    seen.clear()
    for m in model.modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) and m.weight is not None:
            key = (type(m), m.weight.shape[0], m.weight.dtype)
            if key not in seen:
                seen.add(key)
                checks.append(_prove_norm(m, g, threads, refused))
    return Proof(checks, refused, time.perf_counter() - start)


_proven: dict[tuple, Proof] = state.table(state.PROOFS)  # by `_key`, this process


def prove(model: torch.nn.Module, *, fresh: bool = False) -> Proof:
    """The proof for `model` in this process: run on its first load (and when `fresh`: `bivit doctor --prove`),
    its refusals applied. Raises InvarianceError where an op has no invariant kernel here."""
    key = _key(model)
    if not fresh and key in _proven:
        return _proven[key]
    log.info("bivit: proving invariance of every op at this model's shapes in this process")
    proof = _proven[key] = _run(model)
    failed = [c for c in proof.checks if not c.invariant]
    if failed:
        raise InvarianceError("invariant mode cannot keep its promise on this machine: "
                              + "; ".join(f"{c.op} via {c.path} is not bit-identical alone, packed and reversed "
                                          f"at threads {','.join(map(str, c.threads))}" for c in failed)
                              + " (no other kernel left); use batch_invariant=False, or report this machine")
    return proof
