"""What a process says once about how it runs: each faster path it does not use, why, and the fix.

Why a module of its own: a fast path that is off changes no result, only the time, so nothing else would ever
tell the user (a 1080p forward once took twice as long without bivit's kernels, and no command said so). Every
place that decides against a faster path (the compiled kernels, a GEMM kernel per dtype, AMX) calls `fallback`
with the reason and the fix; it is logged once per process, as one line on the `bivit` logger at WARNING:

    bivit: AMX not used: the CPU has AMX but the OS does not grant its tile state to this process (...); bf16 GEMMs run on AVX-512 BF16 instead, slower; fix: a Linux kernel >= 5.16 ...

and kept, so that `bivit doctor`, `Encoder.describe()`, the service's /v1/info and `bivit bench` report the
same words. A path left off by the user's own choice (`BIVIT_ATTENTION=sdpa`) or because a faster one runs
(AMX) is a `note`: kept and logged at INFO, not a warning. The command line shows WARNING lines of the `bivit`
logger on stderr (`bivit.cli.main`); a library user sees them through logging as usual.

Imports nothing heavy.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from typing import Optional

from . import state

log = logging.getLogger("bivit")


@dataclass(frozen=True)
class Notice:
    """`what` is off (or chosen) because `why`, so `instead` runs; `fix` says what to do about it (None: nothing,
    e.g. a CPU limit); `warning`: a faster path that could run does not (else a choice, or a faster path runs)."""

    key: str
    what: str
    why: str
    instead: str = ""
    fix: Optional[str] = None
    warning: bool = True

    def line(self) -> str:
        return (f"bivit: {self.what}: {self.why}" + (f"; {self.instead}" if self.instead else "")
                + (f"; fix: {self.fix}" if self.fix else ""))

    def to_dict(self) -> dict:
        return asdict(self)


_lock = threading.Lock()
_said: dict[str, Notice] = state.table(state.SAID)


def _say(notice: Notice) -> Notice:
    with _lock:
        first = _said.setdefault(notice.key, notice)
    if first is notice:
        (log.warning if notice.warning else log.info)("%s", notice.line())
    return first


def fallback(key: str, what: str, why: str, instead: str = "", fix: Optional[str] = None) -> Notice:
    """Say once per process (WARNING) that `what` is off because `why` and `instead` runs, with the `fix`; `key`
    names the path."""
    return _say(Notice(key, what, why, instead, fix, warning=True))


def note(key: str, what: str, why: str, instead: str = "") -> Notice:
    """Keep (and log at INFO, once) why a path is not used where that is a choice, not a loss."""
    return _say(Notice(key, what, why, instead, None, warning=False))


def said(key: Optional[str] = None) -> list[Notice]:
    """What this process has said so far (every notice, or the one under `key`), in the order said."""
    with _lock:
        notices = list(_said.values())
    return [n for n in notices if key is None or n.key == key]


def warnings() -> list[str]:
    """The one-line fallback warnings said so far (for reports: describe(), /v1/info, bench)."""
    return [n.line() for n in said() if n.warning]
