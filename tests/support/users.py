"""Run a child process the way an ordinary user would be treated: file permissions apply to it.

The tests run as root in CI containers, and root bypasses permission bits (CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH), so `chmod 000` alone cannot make a folder unreadable. `ordinary` drops those two
capabilities from the child before it executes (from its bounding set: an exec'd program cannot get them back);
for a non-root user it changes nothing.
"""

from __future__ import annotations

import ctypes
import os

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def ordinary() -> None:
    """`preexec_fn` for subprocess: the child is subject to permission bits even when it runs as root."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")
