"""glibc malloc tuning for bivit's own processes (the CLI, the server, dataset and benchmark workers).

A forward pass allocates activations of tens of MiB per op. glibc serves blocks above its mmap threshold
(128 KiB, adaptively up to 32 MiB) with fresh mmaps and gives freed heap tops back to the OS, so every forward
pass page-faults its working memory in again, zeroed by the kernel: measured here, ~1.3M minor faults for 50
rounds of two activation-sized tensors, 10x fewer with the thresholds raised, and 2.6-9.5% of an encode.
Raising the mmap and trim thresholds keeps freed blocks in the heap for the next pass, at the price of a
resident size that stays at its peak. That is a process-wide choice, so `import bivit` never makes it: only
bivit's entry points call `tune()`. `BIVIT_MALLOC_TUNE=0` turns it off; glibc's own `MALLOC_MMAP_THRESHOLD_`
/ `MALLOC_TRIM_THRESHOLD_` environment settings, when present, are left to win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("bivit")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap (and are reused)
TRIM_THRESHOLD = (1 << 31) - 1  # never give the heap top back (the largest value mallopt takes)

_done: bool | None = None


def tune() -> bool:
    """Raise glibc's mmap and trim thresholds for this process, once. True if applied."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if (not sys.platform.startswith("linux") or os.environ.get("BIVIT_MALLOC_TUNE", "1") == "0"
            or "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.debug("bivit: glibc refused the malloc thresholds; using its defaults")
    return _done
