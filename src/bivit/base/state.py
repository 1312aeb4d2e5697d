"""What this process has decided, proved, prepared and said, in one place, and the one way to forget it (`reset`).

Every per-process cache of the engine is made here, with `memo` (a function computed once per arguments) or
`table` (a mapping filled as the process goes), under the scope it belongs to:

* `CHOICES`: which kernel computes each op per dtype (`bivit.ops.selection`). Forgotten when the load-time proof
  refuses a kernel (`refuse`): every choice is made again without it.
* `PROOFS`: what was proven or tested on this machine: the load-time proofs, each kernel's
  self-test and conformance, the paths refused.
* `WEIGHTS`: weights prepared for a kernel (packed into its layout, widened to its dtype: `bivit.ops.packs`).
* `SAID`: the notices said (`bivit.base.notices`), once per process.
* `FIXED`: facts fixed for the life of the process (the CPU, the PyTorch build, the environment read once, the
  compiled library loaded, and what it said about them).

`reset()` forgets the first three: what follows decides, proves and prepares again, as a new process would, and
says nothing twice. The last two are forgotten only when named (a notice said by a fixed fact would otherwise be
lost while the fact stays).

Why registered here rather than cleared where each lives: `refuse()` once cleared three caches by hand, and a
cache added later that it did not name would have kept deciding with a refused kernel; tests reset state by
monkeypatching each cache they knew of. Pure memos of values (a RoPE table for a grid) are not state: they
answer the same in any process, so they keep their own `lru_cache`.

Imports nothing: the lowest floor (`bivit.base.notices` and `bivit.kernels` use it).
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

CHOICES, PROOFS, WEIGHTS, SAID, FIXED = "choices", "proofs", "weights", "said", "fixed"
SCOPES = (CHOICES, PROOFS, WEIGHTS, SAID, FIXED)
RESETTABLE = (CHOICES, PROOFS, WEIGHTS)  # what `reset()` forgets

_clears: dict[str, list[Callable[[], None]]] = {scope: [] for scope in SCOPES}

F = TypeVar("F", bound=Callable)
T = TypeVar("T")


def memo(scope: str) -> Callable[[F], F]:
    """Decorator: `functools.cache` for a function whose answers are this process's state in `scope`."""
    def wrap(fn: F) -> F:
        cached = functools.cache(fn)
        _clears[scope].append(cached.cache_clear)
        return cached  # type: ignore[return-value]
    return wrap


def table(scope: str, factory: Callable[[], T] = dict) -> T:  # type: ignore[assignment]
    """A new mapping (`factory()`: a dict, a weak-keyed one) holding this process's state in `scope`; `reset`
    empties it in place, so modules keep their reference to it."""
    made = factory()
    _clears[scope].append(made.clear)  # type: ignore[attr-defined]
    return made


def reset(*scopes: str) -> None:
    """Forget this process's state in `scopes` (default: `RESETTABLE`)."""
    for scope in scopes or RESETTABLE:
        for clear in _clears[scope]:
            clear()
