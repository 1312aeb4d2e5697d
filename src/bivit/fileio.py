"""Files: the one way bivit replaces a file, appends lines, and opens a file it expects to be a regular one.

Reading: `open_regular` opens only regular files, without blocking, so a FIFO or a link to a device (where a
file is expected) is refused at once instead of hanging or reading forever.

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
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Sequence, Union

TMP_PREFIX = ".tmp-"


def fsync_dir(path: Union[str, os.PathLike]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Union[str, os.PathLike], data: Union[bytes, Callable[[str], None]], *,
                 before_replace: Optional[Callable[[], None]] = None) -> None:
    """Replace `path` with `data` (bytes, or a function that writes the file at the path it is given).

    `before_replace` runs after the temp file is durable and before the rename (a test pause point).
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
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def check_writable(path: Union[str, os.PathLike], inputs: Sequence[Union[str, os.PathLike]] = ()) -> None:
    """Fail now, before any work, if `write_atomic(path, ...)` would fail later: `path` is one of `inputs`, a
    directory or another special file, or its folder cannot be created or written. Creates missing folders."""
    path = Path(path)
    for src in inputs:
        try:
            if os.path.samefile(src, path):
                raise NotRegularFile(errno.EEXIST, "is one of the inputs; choose another output", str(path))
        except FileNotFoundError:
            continue
    try:
        check_regular(path, os.stat(path))
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}.probe"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(probe)


def append_lines(path: Union[str, os.PathLike], lines: Sequence[str]) -> None:
    """Append whole lines with one write, then fsync: a kill leaves at most a trailing partial line."""
    if not lines:
        return
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFile(OSError):
    """A path that should name a regular file names something else (a directory, FIFO, device, socket)."""


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


def read_regular(path: Union[str, os.PathLike]) -> bytes:
    with open_regular(path) as f:
        return f.read()


def read_json(path: Union[str, os.PathLike]) -> Any:
    """A JSON file's value. OSError if it cannot be read (NotRegularFile, without blocking, for a directory, FIFO
    or device); ValueError if it is not JSON (or not UTF-8/16/32)."""
    return json.loads(read_regular(path))


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
