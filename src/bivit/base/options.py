"""The numbers every front end's options hold, checked one way with one message each: whole numbers in a range
and sizes in MiB (dtypes by name are `bivit.base.dtypes`'; an encoder's options are `bivit.core.spec`'s). A command's
flag (`--shard-mb`) or the library's keyword (`shard_mb`) names the option, so a value is refused with the same line
whichever command or call it came through.

Imports nothing heavy: the CLI checks its options before torch loads.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..errors import ConfigError

KIB_IN_MIB = 2.0 ** -10
BYTE_IN_MIB = 2.0 ** -20
TIB_IN_MIB = 2.0 ** 20
_SIZE_WORDS = {0.0: "0", BYTE_IN_MIB: f"{BYTE_IN_MIB!r} (1 byte)", KIB_IN_MIB: f"{KIB_IN_MIB!r} (1 KiB)"}


def whole(value: Any, option: str, low: int, high: Optional[int] = None, what: str = "a whole number") -> int:
    """`value` if it is an int from `low` to `high` (no upper bound for None), else ConfigError naming `option`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ConfigError(f"{option} {value!r}: expected {what} {bound}")
    return value


def number(value: Any, option: str, low: float, high: float, expected: str) -> float:
    """`value` if it is a finite number from `low` to `high`, else ConfigError naming `option` and `expected`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ConfigError(f"{option} {value!r}: expected {expected}")
    return value


def size_mb_words(low: float = KIB_IN_MIB, note: str = "") -> str:
    """How a message says the sizes from `low` (0, one byte or one KiB) to 1 TiB."""
    return f"a size in MiB from {_SIZE_WORDS[low]}{note} to {TIB_IN_MIB:.0f} (1 TiB)"


def size_mb(value: Any, option: str, low: float = KIB_IN_MIB, note: str = "") -> float:
    """A size in MiB from `low` to 1 TiB (a larger one overflows what it sizes, a smaller one refuses everything:
    `--max-body-mb 1e-9` is 0 bytes), else ConfigError naming `option`."""
    return number(value, option, low, TIB_IN_MIB, size_mb_words(low, note))


# The demo model's weights are seeded: the same seed, the same demo encoder (and golden rows) everywhere.
DEMO_SEED = 0
