"""Names of inputs (file names, upload names, manifest paths) as bivit stores and shows them, whatever bytes they
hold.

A name reaches bivit as a Python str that may not be text: a file name that is not UTF-8 (Python decodes its
bytes with `surrogateescape`, as `os.fsdecode` does), a JSON name holding a lone surrogate (`"\\ud800"`). Records
are JSON in UTF-8 (a safetensors header, `manifest.jsonl`), which cannot hold either: `bad\\xff.png` made
`bivit encode` fail on its metadata, losing every input, and a dataset folder holding one such file failed
before its first shard, on every run.

    stored(name)    how records, manifests and `errors.jsonl` keep a name: itself when it is text without a
                    backslash; otherwise escaped, losslessly and never colliding with a name kept as it is:
                    `\\` -> `\\\\`, a byte that is not UTF-8 -> `\\xNN`, any other lone surrogate -> `\\uDXXX`
    unescape(s)     the name `stored` was given (a path `os.fsencode` turns back into its bytes)
    shown(text)     for one line of a terminal or a log: control characters (newline, NUL, escape), bidi
                    controls and lone surrogates written as escapes, and at most `SHOWN_CHARS` characters
    too_long(name)  why a name is refused (longer than `MAX_NAME_BYTES`), or None

Text in names (newlines, control and bidi characters included) is stored as it is: JSON escapes what it must,
and every line bivit prints or logs goes through `shown`.
"""

from __future__ import annotations

import re
from typing import Optional

# The longest name bivit stores (Linux's PATH_MAX). A longer one (an upload's, a manifest's) is refused as an
# item error: a 60 MB upload name was a 60 MB log line per request.
MAX_NAME_BYTES = 4096
# What a printed or logged line quotes of a text at most.
SHOWN_CHARS = 1000

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED = re.compile(r"\\(?:\\|x([0-9a-f]{2})|u(d[89a-f][0-9a-f]{2}))")


def _escape_char(ch: str) -> str:
    c = ord(ch)
    if ch == "\\":
        return "\\\\"
    if 0xDC80 <= c <= 0xDCFF:  # a byte surrogateescape could not decode
        return f"\\x{c - 0xDC00:02x}"
    return f"\\u{c:04x}"


def stored(name: str) -> str:
    """`name` as records keep it (see the module doc): valid UTF-8 text, and two names never store alike."""
    if "\\" not in name and not _LONE_SURROGATE.search(name):
        return name
    return re.sub("[\\\\\ud800-\udfff]", lambda m: _escape_char(m.group()), name)


def unescape(text: str) -> str:
    """The name `stored` turned into `text` (a stored name without a backslash is the name itself)."""
    def back(m: re.Match) -> str:
        if m.group(1) is not None:
            return chr(0xDC00 + int(m.group(1), 16))
        if m.group(2) is not None:
            return chr(int(m.group(2), 16))
        return "\\"
    return _ESCAPED.sub(back, text) if "\\" in text else text


def too_long(name: str) -> Optional[str]:
    """Why `name` is refused (more than `MAX_NAME_BYTES` bytes as UTF-8), or None."""
    size = len(name.encode("utf-8", "surrogatepass"))
    return f"its name is {size} bytes long, more than the {MAX_NAME_BYTES} bivit keeps" if size > MAX_NAME_BYTES \
        else None


def label(name: str) -> str:
    """What stands for a refused name in a record: its first 64 characters, shown, and its length."""
    return f"{shown(name[:64], 64)}... ({len(name.encode('utf-8', 'surrogatepass'))} bytes)"


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` for one line of a terminal or a log: every character Python does not call printable (controls such
    as newline, NUL and escape, bidi and other format characters such as U+202E, which turns the rest of a line
    around, line separators, lone surrogates) as its escape (`\\n`, `\\x00`, `\\u202e`, `\\udcff`), and cut after
    `limit` characters, saying how many more there were."""
    more = len(text) - limit
    text = text[:limit] if more > 0 else text
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return text + (f"... ({more} more characters)" if more > 0 else "")
