"""The single writer of an encoded dataset folder: its lock, its recovery after a crash, and durable commits.

Crash safety (a SIGKILL at any instant leaves nothing half-written that a reader or the next run would take
for data):
  1. A shard is written to a `.tmp-*` file in DIR, fsynced, renamed to its final name, then DIR is fsynced.
  2. Manifest lines are appended (one write, then fsync) only after their shard is durable.
  3. The next run (holding DIR's lock) deletes the temp files bivit writes there
     (`.tmp-<shard or header>.<pid>.<thread>`; no other file), truncates a trailing partial line and deletes
     shards no manifest line references (renamed but killed before their lines were appended).
Every manifest and error line carries the next `seq` (see `bivit.dataset.format`), so an error stays the
source's state until the source is encoded again.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from safetensors.torch import save

from .. import __version__
from ..base.dtypes import dtype_name
from ..base.fileio import append_lines, fsync_dir, temp_target, write_atomic
from ..core import records
from ..core.integrity import sealed
from ..errors import BivitError, ErrorKind
from .format import (DEFAULT_SHARD_MB, ERRORS, FORMAT, FORMAT_VERSION, HEADER, HEADER_KEY, LOCK, MANIFEST,
                     SHARD_RE, checked, encoder_of, manifest_line, manifest_record, read_header, read_jsonl,
                     state_from_rows)
from .journal import Journal, read_entries
from .pipeline import Source

# A pending shard is also committed after this many seconds, so a kill loses at most this much work even when
# shards are large and encoding is slow.
DEFAULT_FLUSH_SECONDS = 60.0
# A folder written with other values for these keys holds tensors that are not comparable with this run's ("bits"
# first: a run on a machine whose kernels compute another class of bits is the likeliest cause, and says why).
# An older format_version is continued in its own (`read_header` refuses a newer one).
_MUST_MATCH = ("bits", "fingerprint", "dtype", "projector_dtype", "output_dtype", "batch_invariant",
               "alpha")


def _own_temp(name: str) -> bool:
    """A temp file bivit itself writes in a dataset folder (the only `.tmp-*` files it may delete: a user's
    `.tmp-notes` is not one)."""
    target = temp_target(name)
    return target is not None and (target in (HEADER, MANIFEST, ERRORS) or SHARD_RE.fullmatch(target) is not None)


def header_for(encoder: Any) -> dict:
    """What a dataset folder records about the encoder that wrote it: the model as its spec names it
    (`Encoder.spec`) and what computes (`Encoder.describe`, under this format's key names); a later run must match
    the checked keys."""
    about = encoder.describe()
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "bivit_version": __version__,
            "model": encoder.spec.model,
            "model_name": about.pop("model"), "is_demo": about.pop("demo"), **about,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


class DatasetWriter:
    """Holds DIR's lock, recovers it, and commits shards + manifest lines. Not thread-safe: one thread calls it
    (the driver, in the Ray engine).

    `on_step(step, count)`, when given, is called at each step of a commit (`before_rename`, `after_rename`,
    `after_commit`, with the shards this writer committed before it) and after each input taken (`journaled`,
    with the journal's entries): the instants a crash can fall between, so that a test can stop the process at
    one it chooses.
    """

    def __init__(self, out: str | os.PathLike, header: dict, *, shard_mb: float = DEFAULT_SHARD_MB,
                 flush_seconds: float = DEFAULT_FLUSH_SECONDS,
                 on_step: Optional[Callable[[str, int], None]] = None):
        self.dir = Path(out)
        self.header = header
        self.shard_bytes = max(1, int(shard_mb * 2**20))
        self.flush_seconds = flush_seconds
        self._on_step = on_step or (lambda step, count: None)
        if self.dir.exists() and not self.dir.is_dir():
            raise BivitError(f"{out}: exists and is not a directory")
        created = False  # whether this run created DIR's lock file: a refused folder must not keep it
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            try:
                self._lock_fd: Optional[int] = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:
                self._lock_fd = os.open(self.dir / LOCK, os.O_RDWR)
        except OSError as e:
            raise BivitError(f"{out}: cannot write the output folder ({e.strerror or e})") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise BivitError(f"{out}: another bivit encode-dataset is writing this folder") from None
        # key -> (tensor, its manifest lines)
        self._pending: dict[str, tuple[torch.Tensor, list[records.Record]]] = {}
        self._pending_bytes = 0
        self._pending_since: Optional[float] = None
        self.tokens_written = 0
        self._commits = 0  # shards this writer has committed (`on_step`)
        self.journal = Journal(self.dir)
        try:
            self._open_header()
            self._recover()
            self._replay()
            self.tokens_written = 0  # what this run encodes: a killed run's journal is the killed run's work
        except BaseException:
            if created and not (self.dir / HEADER).exists():  # refused before it became a dataset folder
                (self.dir / LOCK).unlink(missing_ok=True)
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------------------------

    def _open_header(self) -> None:
        old = read_header(self.dir)
        if old is not None:
            diff = [k for k in _MUST_MATCH if old.get(k) != self.header.get(k)]
            if diff:
                what = ", ".join(f"{k} {old.get(k)!r} there vs {self.header.get(k)!r} now" for k in diff)
                raise BivitError(f"{self.dir}: written by a different encoder ({what}); choose another --out")
            self.header = old
        else:
            leftovers = [p.name for p in self.dir.iterdir() if p.name != LOCK and not _own_temp(p.name)]
            if leftovers:
                raise BivitError(f"{self.dir}: not empty and has no {HEADER} (found {sorted(leftovers)[0]!r}); "
                                 "choose an empty or new --out")
            write_atomic(self.dir / HEADER, (json.dumps(sealed(self.header, HEADER_KEY), indent=2) + "\n").encode())

    def _recover(self) -> None:
        for p in self.dir.iterdir():
            if _own_temp(p.name):
                p.unlink()  # a shard or header that was being written when a previous run died
        seq, rows = 0, {}
        for name in (MANIFEST, ERRORS):  # each file read (and parsed) once
            path = self.dir / name
            rows[name], end = read_jsonl(path)
            seq = max([seq, *(int(r.get("seq", 0)) for r in rows[name])])
            if path.exists() and path.stat().st_size != end:
                with open(path, "r+b") as f:  # drop a line cut short by a kill
                    f.truncate(end)
                    os.fsync(f.fileno())
        self._seq = seq
        # Only what resuming needs, kept small: (size, mtime_ns, sha256) per source that is encoded now (a
        # source that failed since is not: it must be read again), one record per stored content.
        current, failed = state_from_rows(rows[MANIFEST], rows[ERRORS], self.dir, self.header)
        self.by_source: dict[str, tuple[Optional[int], Optional[int], str]] = {
            r.source: (r.size, r.mtime_ns, r.sha256) for r in current.values()}
        self.by_hash: dict[str, records.Record] = {}
        for row in rows[MANIFEST]:
            rec = manifest_record(row, str(self.dir / MANIFEST), checked(self.header))
            self.by_hash.setdefault(rec.sha256, rec)
        referenced = {r.shard for r in self.by_hash.values()}
        numbers = [-1]
        for p in self.dir.iterdir():
            m = SHARD_RE.match(p.name)
            if not m:
                continue
            if p.name not in referenced:
                p.unlink()  # committed to disk but killed before its manifest lines: its items get re-encoded
                continue
            numbers.append(int(m.group(1)))
        missing = sorted(s for s in referenced if not (self.dir / s).is_file())
        if missing:
            raise BivitError(f"{self.dir / MANIFEST}: references shard {missing[0]!r}, which is missing "
                             "(the folder was changed outside bivit)")
        self._next_shard = max(numbers) + 1
        self._write_errors(failed, len(rows[ERRORS]))
        fsync_dir(self.dir)

    def _replay(self) -> None:
        """Commit what the journal of a killed run holds (`bivit.dataset.journal`), lines already committed
        left out, then empty it."""
        for lines, tensor in read_entries(self.journal.path):
            lines = [r for r in lines if self.by_source.get(r.source) != self._identity(r)]
            sha = lines[0].sha256 if lines else None
            if sha is None:
                continue
            if sha in self.by_hash:  # its shard is committed
                self.add_lines([with_keys(r, shard=self.by_hash[sha].shard) for r in lines])
            elif sha in self._pending:
                self._pending[sha][1].extend(lines)
            elif tensor is not None:
                self._hold(sha, tensor, lines, journal=False)
        self.commit()
        self.journal.clear()

    @staticmethod
    def _identity(rec: records.Record) -> tuple:
        """What says a source is unchanged since its line was written (`bivit.dataset.sources.plan`)."""
        return rec.size, rec.mtime_ns, rec.sha256

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def compact_errors(self, listed: Optional[set[str]] = None) -> None:
        """Keep one line per source that is failed now (its latest error); drop the rest.

        `listed`: after a run that listed SRC, every source it listed (files, and folders it could not list):
        an error is a fact about a source still there, so that of a file deleted or taken out of the manifest,
        or of a folder that could be listed this time (its files speak for themselves now), is dropped.
        """
        error_rows, _ = read_jsonl(self.dir / ERRORS)
        _, failed = state_from_rows(read_jsonl(self.dir / MANIFEST)[0], error_rows, self.dir, self.header)
        if listed is not None:
            failed = {s: e for s, e in failed.items() if s in listed}
        self._write_errors(failed, len(error_rows))

    def _write_errors(self, failed: dict[str, records.Record], lines: int) -> None:
        """errors.jsonl as one line per failed source, unless it has exactly that many `lines` already."""
        if len(failed) != lines:
            lines = "".join(manifest_line(e) + "\n" for e in failed.values())
            write_atomic(self.dir / ERRORS, lines.encode("utf-8"))

    # -- writing ---------------------------------------------------------------------------------------------

    def add_lines(self, lines: Sequence[records.Record]) -> None:
        """Manifest lines whose tensor is already durable (a duplicate of a stored item)."""
        lines = [with_keys(r, seq=self._next_seq()) for r in lines]
        append_lines(self.dir / MANIFEST, [manifest_line(r) for r in lines])
        for r in lines:
            self.by_source[r.source] = (r.size, r.mtime_ns, r.sha256)
            self.by_hash.setdefault(r.sha256, r)

    def add_error(self, sources: Sequence[Source], reason: str, sha: Optional[str] = None,
                  kind: ErrorKind = ErrorKind.MEDIA) -> None:
        """Record that `sources` could not be encoded (for a failure of `kind`), one record each with the error
        `"{source}: {reason}"`; they stay failed until encoded again."""
        reason = " ".join(str(reason).split())  # one line
        append_lines(self.dir / ERRORS, [manifest_line(records.Record(
            s.source, s.kind, sha, error=f"{s.source}: {reason}", error_kind=kind, extra={"seq": self._next_seq()}))
            for s in sources])
        for s in sources:
            self.by_source.pop(s.source, None)

    def add(self, rec: records.Record, sources: Sequence[Source], stats: Sequence[Optional[os.stat_result]]) -> None:
        """One encoded input (its record, `bivit.dataset.pipeline.record_of`: embedding in memory) and every
        source with its bytes; commits a shard when one is full."""
        sha, tensor = rec.sha256, rec.embedding
        stored = self.by_hash.get(sha)
        if stored is not None:  # bytes already durable: the sources only need lines pointing there
            self.add_lines([source_line(stored, s, st) for s, st in zip(sources, stats)])
            return
        expected, width = self.header["output_dtype"], self.header["text_hidden_size"]
        if dtype_name(tensor.dtype) != expected or tensor.ndim != 2 or tensor.shape[1] != width:
            # Guard against a worker returning something else (the vLLM idle-rank dtype bug, a mismatched model).
            raise BivitError(f"encoder returned {tuple(tensor.shape)} {tensor.dtype} for {sources[0].source}; "
                             f"expected [tokens, {width}] {expected}")
        lines = [source_line(rec, s, st) for s, st in zip(sources, stats)]
        if sha in self._pending:
            self._pending[sha][1].extend(lines)
            self.journal.append(lines, None)
        else:
            self._hold(sha, tensor, lines)
        self._on_step("journaled", self.journal.entries)
        if self._pending_bytes >= self.shard_bytes or time.monotonic() - self._pending_since >= self.flush_seconds:
            self.commit()

    def _hold(self, sha: str, tensor: torch.Tensor, lines: list[records.Record], journal: bool = True) -> None:
        """A new tensor and its lines, pending until the next commit; in the journal first (`journal`)."""
        tensor = tensor.contiguous()
        if journal:
            self.journal.append(lines, tensor)
        self._pending[sha] = (tensor, lines)
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_since is None:
            self._pending_since = time.monotonic()

    def commit(self) -> None:
        """Write the pending tensors as one durable shard, then append their manifest lines."""
        if not self._pending:
            return
        name = f"shard-{self._next_shard:06d}.safetensors"
        self._next_shard += 1
        tensors = {k: t for k, (t, _) in self._pending.items()}
        lines = [with_keys(r, shard=name) for _, pending in self._pending.values() for r in pending]
        # The shard is an embedding file of its own: the records committed with it (`bivit.core.records`). Serialised
        # in memory (one shard, --shard-mb) so that a full disk is an OSError naming the shard.
        encoder = encoder_of(self.header)
        meta = records.metadata(encoder, lines)
        write_atomic(self.dir / name, save(tensors, metadata=meta),
                     before_replace=lambda: self._on_step("before_rename", self._commits))
        self._on_step("after_rename", self._commits)
        self.add_lines(lines)
        self.journal.clear()
        self.tokens_written += sum(int(t.shape[0]) for t, _ in self._pending.values())
        self._pending.clear()
        self._pending_bytes = 0
        self._pending_since = None
        self._commits += 1
        self._on_step("after_commit", self._commits - 1)

    def close(self) -> None:
        self.journal.close()
        if getattr(self, "_lock_fd", None) is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def with_keys(rec: records.Record, **keys: Any) -> records.Record:
    """A copy of a manifest record with some of the dataset's own keys (`shard`, `seq`, ...) set."""
    return dataclasses.replace(rec, extra={**rec.extra, **keys})


def source_line(rec: records.Record, source: Source, st: Optional[os.stat_result]) -> records.Record:
    """`rec` (the record of some bytes) as the manifest line of one `source` with those bytes (its name, kind,
    and the size and mtime a re-run compares to skip it unread)."""
    return dataclasses.replace(rec, source=source.source, kind=source.kind,
                               extra={**rec.extra, "size": st.st_size if st else None,
                                      "mtime_ns": st.st_mtime_ns if st else None})
