"""Where two forwards of one model first differ: every op's output recorded with the module that ran it
(`bivit verify --bisect` and the GPU check's invariance section use it). Imports only the op layer, so it runs
where the media stack (PyAV) is not installed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .. import ops


@dataclass
class OpDiff:
    module: str
    kind: str
    occurrence: int
    max_diff: float


@contextlib.contextmanager
def op_recorder(model: torch.nn.Module, sink: list) -> Iterator[None]:
    """Record (module path, op kind, output) for every op, the module path coming from forward hooks."""
    stack: list[str] = []
    handles = []
    def enter(name: str) -> Callable:
        def hook(module, args) -> None:
            stack.append(name)
        return hook

    def leave(module, args, output) -> None:  # returning None keeps the module's output
        stack.pop()

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))

    def record(kind: str, out: torch.Tensor) -> None:
        sink.append((stack[-1] if stack else "", kind, out.detach().clone()))

    try:
        with ops.trace(record):
            yield
    finally:
        for h in handles:
            h.remove()


def first_difference(model: torch.nn.Module, alone: Callable[[], object], first_in_batch: Callable[[], object]
                     ) -> OpDiff | None:
    """First op of `model` whose output differs between the forward `alone` (one item) and `first_in_batch` (the
    same item leading a batch): ops matched by (module path, op kind, occurrence), the item's rows leading."""
    alone_trace: list = []
    batch_trace: list = []
    with op_recorder(model, alone_trace):
        alone()
    with op_recorder(model, batch_trace):
        first_in_batch()
    index: dict[tuple[str, str, int], torch.Tensor] = {}
    seen: dict[tuple[str, str], int] = {}
    for module, kind, out in batch_trace:
        k = seen.get((module, kind), 0)
        seen[(module, kind)] = k + 1
        index[(module, kind, k)] = out
    seen.clear()
    for module, kind, out in alone_trace:
        k = seen.get((module, kind), 0)
        seen[(module, kind)] = k + 1
        other = index[(module, kind, k)][: out.shape[0]]
        if not torch.equal(other, out):
            return OpDiff(module, kind, k, float((other.float() - out.float()).abs().max()))
    return None
