"""Files: the one way bivit replaces a file, appends lines, opens a file it expects to be a regular one, and
parses JSON it did not write.

Reading: `open_regular` opens only regular files, without blocking, so a FIFO or a link to a device (where a
file is expected) is refused at once instead of hanging or reading forever; `read_regular` can refuse a file
larger than the caller will hold in memory.

JSON from outside (checkpoint files, request bodies, manifests, embedding file headers) goes through
`parse_json`: what parsing would build is counted first (`json_cost`: elements of every kind, nesting), so text
that would nest deeper than `MAX_JSON_DEPTH` (200k nested `[` would otherwise raise RecursionError) or build more
than the reader's element limit (40 MB of `[]` is 13 million lists, 1.1 GB) is refused before anything is built;
and a key repeated in one object is refused (parsers disagree on which one counts).

A reader (or a process killed at any instant) sees either the old file or the complete new one: the data goes
to a temp file in the same folder, is fsynced, renamed over the target, and the folder is fsynced so the
rename itself survives a crash. A replaced file keeps its permission bits; a new one gets the usual
0666 & ~umask (temp-file helpers create 0600, which would silently make outputs private).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Sequence, Union

TMP_PREFIX = ".tmp-"
# `write_atomic`'s temp file for TARGET is `.tmp-TARGET.PID.THREAD` (`.tmp-TARGET.PID` before threads were named);
# `check_writable`'s probe is `.tmp-TARGET.PID.probe`.
_TMP_NAME = re.compile(re.escape(TMP_PREFIX) + r"(?P<target>.+?)\.\d+(?:\.\d+)?(?:\.probe)?")

# JSON bivit reads from outside: config.json and preprocessor_config.json are a few KB and Kimi-K2.6's weight
# index about 10 MB; none nests deeper than 4 levels, a request body 3.
MAX_JSON_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64


def fsync_dir(path: Union[str, os.PathLike]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_target(name: str) -> Optional[str]:
    """The file name a bivit temp file of this name was writing (`write_atomic`'s or `check_writable`'s), or
    None when the name is not one bivit gives its temp files: only those may be deleted as leftovers."""
    m = _TMP_NAME.fullmatch(name)
    return m["target"] if m else None


def write_atomic(path: Union[str, os.PathLike], data: Union[bytes, Callable[[str], None]], *,
                 before_replace: Optional[Callable[[], None]] = None) -> None:
    """Replace `path` with `data` (bytes, or a function that writes the file at the path it is given).

    `before_replace` runs after the temp file is durable and before the rename (a test pause point). A write
    that fails (a full disk, a file size limit) raises OSError naming `path`; the temp file is removed. A writer
    function must raise OSError for its own write errors: serialise to bytes instead of handing the path to a
    library that wraps them in its own exception (safetensors' `save_file` raises SafetensorError).
    """
    path = Path(path)
    # One temp name per process and thread: concurrent writers of one path (threads of an encoder-cache
    # producer) never share, or unlink, each other's temp file.
    tmp = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_ident()}"
    try:
        old_mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        old_mode = None
    tmp.unlink(missing_ok=True)  # a leftover of a killed process that had our pid and thread id
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies the umask
    try:
        new_mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if isinstance(data, (bytes, bytearray, memoryview)):
            _write_all(fd, data)
        else:
            os.close(fd)
            fd = -1
            data(str(tmp))
            fd = os.open(tmp, os.O_RDWR)
        os.fchmod(fd, old_mode if old_mode is not None else new_mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:  # os.write names no file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    fsync_dir(path.parent)


def check_writable(path: Union[str, os.PathLike], inputs: Sequence[Union[str, os.PathLike]] = ()) -> None:
    """Fail now, before any work, if `write_atomic(path, ...)` would fail later: `path` is one of `inputs`, a
    directory or another special file, or its folder cannot be created or written. Creates missing folders."""
    path = Path(path)
    for src in inputs:
        try:
            same = os.path.samefile(src, path)
        except OSError:  # a missing output; an input that cannot be looked at (a name too long) is that
            continue     # input's failure, said as the input's; the output's own are found below
        if same:
            raise NotRegularFile(errno.EEXIST, "is one of the inputs; choose another output", str(path))
    try:
        check_regular(path, os.stat(path))
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}.probe"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(probe)


def append_lines(path: Union[str, os.PathLike], lines: Sequence[str]) -> None:
    """Append whole lines with one write, then fsync: a kill leaves at most a trailing partial line. A write that
    fails (a full disk, a file size limit) raises OSError naming `path`."""
    if not lines:
        return
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except OSError as e:
        if e.filename is None and e.errno is not None:  # os.write names no file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFile(OSError):
    """A path that should name a regular file names something else (a directory, FIFO, device, socket)."""


class FileTooLarge(OSError):
    """A file is larger than the caller reads into memory."""


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Union[str, os.PathLike], st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, f"not a regular file but {file_kind(st.st_mode)}", str(path))


def open_regular(path: Union[str, os.PathLike]) -> BinaryIO:
    """Open a regular file for reading (links followed); NotRegularFile for anything else, without blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        check_regular(path, os.fstat(fd))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Union[str, os.PathLike], max_bytes: Optional[int] = None) -> bytes:
    """A regular file's bytes; FileTooLarge when it holds more than `max_bytes` (checked before reading, and
    while reading, for a file that grows)."""
    with open_regular(path) as f:
        if max_bytes is None:
            return f.read()
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            raise FileTooLarge(errno.EFBIG, f"larger than the {max_bytes} bytes bivit reads from it "
                               f"({max(size, len(data))} bytes)", str(path))
        return data


def unique_keys(pairs: list) -> dict:
    """`object_pairs_hook` that refuses a key repeated in one object (ValueError naming it)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears more than once in one object")
    return out


class TooManyElements(ValueError):
    """JSON text holding more elements than its reader allows (`parse_json`'s `max_elements`)."""


# JSON bivit reads from outside builds at most this many elements (~100 bytes of memory each at most: a header of
# 40 MB of `[]` took 1.13 GB). Kimi-K2.6's weight index holds ~2,000; an embedding file's header about 30 per
# item (a full 256 MB dataset shard of real embeddings: a few hundred items).
MAX_JSON_ELEMENTS = 4_000_000


def parse_json(data: Union[bytes, bytearray, str], max_depth: int = MAX_JSON_DEPTH,
               max_elements: Optional[int] = MAX_JSON_ELEMENTS) -> Any:
    """The value of JSON text from outside bivit; ValueError if it is not JSON (or not UTF-8/16/32), nests
    deeper than `max_depth` or repeats a key in one object; TooManyElements if it holds more than `max_elements`
    elements of any kind (arrays, objects, strings, numbers, literals). Both counted before parsing (`json_cost`),
    so nothing is built for text over a limit."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    encoding = json.detect_encoding(data)
    if encoding != "utf-8":  # UTF-16/32 text: counted in its UTF-8 form (at most 1.5x its size)
        data = data.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    # numpy (JSON counting's): fileio loads with every CLI start (cli.common) and with bivit.serve.client
    from .jsoncost import json_cost

    cost = json_cost(data, max_elements)
    if cost.depth > max_depth:  # first: a count that stopped early may still have seen the nesting
        raise ValueError(f"nested {cost.depth} levels deep, more than the {max_depth} bivit reads")
    if max_elements is not None and cost.elements > max_elements:
        raise TooManyElements(f"more than {max_elements} elements (arrays, objects, strings, numbers, literals)")
    return json.loads(data, object_pairs_hook=unique_keys)


def read_json(path: Union[str, os.PathLike], max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file's value (see `parse_json`). OSError if it cannot be read (NotRegularFile, without blocking,
    for a directory, FIFO or device; FileTooLarge above `max_bytes`); ValueError if it is not acceptable JSON."""
    return parse_json(read_regular(path, max_bytes))


def sha256_file(path: Union[str, os.PathLike], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _write_all(fd: int, data: Union[bytes, bytearray, memoryview]) -> None:
    """`os.write` until every byte is written (one call may write less)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
