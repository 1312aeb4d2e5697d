"""Progress below one shard: `DIR/journal.bin`, every input encoded since the last shard, as it is encoded.

A shard is committed when it is full (`--shard-mb`, 256 MiB by default) or a minute old, so a job killed before
its first commit kept nothing (eight SIGKILLs of a 10 s job: no manifest, every resume redid everything). Each
input the writer takes is appended here at once, its manifest lines and its tensor; the next run (holding the
folder's lock) commits what the journal holds as a shard before it plans, so the resume skips those inputs.

    entry := 8-byte little-endian length of HEAD | HEAD | the tensor's bytes (none for lines only)
    HEAD  := JSON {"lines": [manifest records], "dtype": ..., "shape": [...]} sealed (`entry_sha256`)

Appended with one write each (a killed process's writes are the kernel's to keep), fsynced at most every
`SYNC_SECONDS` (what a power cut may lose). Reading stops at the first entry that is incomplete or does not
match its checksums (the tail a kill cut short); its tensor must have the sha256 its lines hold. Only the
writer reads it: readers see an input once its shard and lines are committed.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from ..base.dtypes import dtype_name, parse_dtype
from ..base.fileio import open_regular, parse_json
from ..core import records
from ..core.integrity import embedding_sha256, sealed, unsealed
from ..errors import BivitError

JOURNAL = "journal.bin"
ENTRY_KEY = "entry_sha256"
SYNC_SECONDS = 5.0


class Journal:
    """The appending side (one writer, under the folder's lock)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / JOURNAL
        self._fd: Optional[int] = None
        self._synced = time.monotonic()
        self.entries = 0  # appended by this run since the journal was last emptied

    def append(self, lines: Sequence[records.Record], tensor: Optional[torch.Tensor]) -> None:
        """One input's manifest lines, and its tensor when it is new: kept before `append` returns."""
        head = {"lines": [r.to_json() for r in lines]}
        data = b""
        if tensor is not None:
            t = tensor.detach().cpu().contiguous()
            head.update(dtype=dtype_name(t.dtype), shape=list(t.shape))
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        text = json.dumps(sealed(head, ENTRY_KEY), separators=(",", ":"), ensure_ascii=False).encode()
        entry = struct.pack("<Q", len(text)) + text + data
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            written = 0
            while written < len(entry):
                written += os.write(self._fd, entry[written:])
            if time.monotonic() - self._synced >= SYNC_SECONDS:
                os.fsync(self._fd)
                self._synced = time.monotonic()
        except OSError as e:  # os.write names no file: a full disk is one line naming this one
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        self.entries += 1

    def clear(self) -> None:
        """Empty it: what it held is committed (a kill before this leaves entries the next run finds committed
        and skips)."""
        self.close()
        self.path.unlink(missing_ok=True)
        self.entries = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_entries(path: Path) -> Iterator[tuple[list[records.Record], Optional[torch.Tensor]]]:
    """The complete, intact entries of a journal, in order: (lines, tensor or None)."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return
    with f:
        while True:
            head = f.read(8)
            if len(head) < 8:
                return
            (n,) = struct.unpack("<Q", head)
            if n > records.MAX_HEADER_BYTES:
                return
            try:
                obj = unsealed(parse_json(f.read(n)), ENTRY_KEY, str(path), True)
                lines = [records.Record.from_json(x) for x in obj["lines"]]
                tensor = None
                if "dtype" in obj:
                    dtype = parse_dtype(obj["dtype"], "dtype")
                    shape = [int(s) for s in obj["shape"]]
                    size = dtype.itemsize * max(0, shape[0]) * max(0, shape[1])
                    data = f.read(size)
                    if len(data) < size:
                        return
                    tensor = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if size else \
                        torch.empty(shape, dtype=dtype)
                    if not lines or embedding_sha256(tensor) != lines[0].tensor_sha256:
                        return
            except (ValueError, TypeError, KeyError, IndexError, RuntimeError, BivitError):  # a tail cut short
                return
            yield lines, tensor
