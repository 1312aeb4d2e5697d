"""Counting what parsing a JSON text would build, without parsing it (`json_cost`): `bivit.base.fileio.parse_json`
refuses text over its nesting or element limits before anything is built. numpy scans the bytes a chunk at a
time, so a large text (a 60 MB request body of one base64 string) holds the interpreter lock a millisecond per
step, not the whole count.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np


class JsonCost:
    """What parsing a JSON text would build, counted without parsing it (`json_cost`): `elements` (arrays, objects,
    strings (keys included), numbers, true/false/null), `depth` (nesting of arrays and objects), `string_bytes`
    (the bytes between quotes). Counting stops early once `elements` passes the caller's limit."""

    __slots__ = ("elements", "depth", "string_bytes")

    def __init__(self) -> None:
        self.elements = self.depth = self.string_bytes = 0


_SCAN_CHUNK = 1 << 20
# Per byte value: bytes of numbers and literals (each run outside strings is one element), the bytes that open an
# array or object, and the nesting step of each bracket.
_SCALAR = np.zeros(256, bool)
_SCALAR[list(b"+-.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")] = True
_OPENS = np.zeros(256, bool)
_OPENS[list(b"[{")] = True
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def json_cost(data: Union[bytes, bytearray], stop_after: Optional[int] = None) -> JsonCost:
    """`JsonCost` of UTF-8 JSON text, in 1 MiB chunks with numpy: a step holds the interpreter lock for about a
    millisecond, memory is at most ~20 bytes per byte of one chunk (~20 MB) whatever the text, and a chunk inside
    one long string (base64 data) costs one comparison. Strings are found as the parser finds them (a quote ends a
    string unless an odd run of backslashes precedes it); the counts may differ from the parser's only after text
    the parser refuses (a backslash outside a string), where it stops. Stops once more than `stop_after`
    elements are counted."""
    cost = JsonCost()
    inside, run, level, after_scalar = False, 0, 0, False  # carried from one chunk to the next
    view = memoryview(data)
    for start in range(0, len(data), _SCAN_CHUNK):
        end = min(start + _SCAN_CHUNK, len(data))
        a = np.frombuffer(view[start:end], np.uint8)
        n = a.size
        quotes = a == 34
        if run or data.find(b"\\", start, end) >= 0:
            real, run = _unescaped(a, quotes, run)
        else:
            real = quotes
        count = int(np.count_nonzero(real))
        if count == 0 and inside:  # the middle of a long string
            cost.string_bytes += n
            continue
        if count:
            parity = ((np.cumsum(real, dtype=np.uint8) + np.uint8(inside)) & 1).view(bool)  # wraps: parity holds
            outside = ~(parity | real)
            cost.string_bytes += n - int(np.count_nonzero(outside)) - count
            cost.elements += int(np.count_nonzero(real & parity))  # opening quotes
            inside = bool(parity[-1])
        else:
            outside = np.ones(n, bool)
        cost.elements += int(np.count_nonzero(_OPENS[a] & outside))
        scalar = _SCALAR[a] & outside
        cost.elements += int(np.count_nonzero(scalar[1:] & ~scalar[:-1])) + int(bool(scalar[0]) and not after_scalar)
        after_scalar = bool(scalar[-1])
        levels = np.cumsum(_STEP[a] * outside, dtype=np.int64) + level
        cost.depth, level = max(cost.depth, int(levels.max())), int(levels[-1])
        if stop_after is not None and cost.elements > stop_after:
            break
    return cost


def _unescaped(a: Any, quotes: Any, run: int) -> tuple[Any, int]:
    """(the quotes of chunk `a` that no odd run of backslashes escapes, the run of backslashes ending the chunk),
    `run` being the run that ended the previous chunk."""
    n = a.size
    idx = np.arange(n, dtype=np.int32)
    # For each position, the last index at or before it that is not a backslash (-1 - run: the carried run).
    last = np.maximum.accumulate(np.where(a == 92, np.int32(-1 - run), idx))
    before = np.empty(n, np.int32)
    before[0], before[1:] = -1 - run, last[:-1]
    even_run = ((idx - before) & 1).astype(bool)  # idx - 1 - before backslashes precede position idx
    return quotes & even_run, n - 1 - int(last[-1])
