"""Offline encoding of a folder (or a manifest) of images and videos into sharded safetensors.

`bivit encode-dataset SRC --out DIR` writes:

    DIR/dataset.json              header: format, bivit version, model name + fingerprint, dtypes, width
    DIR/manifest.jsonl            one line per encoded input (source, sha256, shard, key, tokens, grid_thw, ...)
    DIR/errors.jsonl              one line per input that failed (source, error)
    DIR/shard-000000.safetensors  embeddings keyed by the sha256 of the input's bytes

Identical files (same bytes) are encoded once; all their manifest lines point to the same stored tensor.

Why the result does not depend on how the work is cut (engine, worker count, --batch-tokens): every item is
encoded by a batch-invariant Encoder, whose output for an item is bit-identical whatever shares the call, and
each item travels on its own with its dtype stated explicitly, so nothing is ever concatenated across workers.
(vLLM's data-parallel encoder made an empty tensor in the *pixel* dtype on a rank that got no items while busy
ranks returned float32, a mixed-dtype gather waiting to happen; here an empty batch is just zero rows.)

Crash safety (a SIGKILL at any instant leaves nothing half-written that a reader or the next run would take
for data):
  1. A shard is written to `.tmp-*` in DIR, fsynced, renamed to its final name, then DIR is fsynced.
  2. Manifest lines are appended (one write, then fsync) only after their shard is durable.
  3. The next run (holding DIR's lock) deletes `.tmp-*` files, truncates a trailing partial manifest line and
     deletes shards no manifest line references (renamed but killed before their lines were appended).
Resuming re-runs the same command: sources already in the manifest with the same size and mtime are skipped
without reading them; others are hashed, and a hash that is already stored costs a manifest line, not an
encode.

The Ray engine lives in `bivit.dataset_ray` so that the local path never imports ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import fcntl
import hashlib
import importlib.util
import json
import os
import queue
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import typer

from .encoder import dtype_name, parse_dtype
from .errors import BivitError, ConfigError, MediaError
from .video import VIDEO_EXTENSIONS as VIDEO_EXTS

FORMAT = "bivit-encoded-dataset"
FORMAT_VERSION = 1
HEADER = "dataset.json"
MANIFEST = "manifest.jsonl"
ERRORS = "errors.jsonl"
LOCK = ".lock"
TMP_PREFIX = ".tmp-"
SHARD_RE = re.compile(r"^shard-(\d{6,})\.safetensors$")

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})
# Videos are what `bivit.video.is_video_path` says (the rule Encoder.encode uses), so a file is encoded the same
# way here as through the API. That includes .gif: always a video there (a one-frame GIF is a one-chunk video
# with t = 1 and the 4096-patch frame budget), never by content.
VIDEO_EXTENSIONS = VIDEO_EXTS
# Videos up to this size are decoded from the very bytes that were hashed; larger ones from the path after a
# streamed hash check (holding a multi-GB file in memory is worse than a file swapped mid-job, which is rare).
VIDEO_BYTES_LIMIT = 512 * 2**20

DEFAULT_BATCH_TOKENS = 4096
DEFAULT_SHARD_MB = 256
# A pending shard is also committed after this many seconds, so a kill loses at most this much work even when
# shards are large and encoding is slow.
DEFAULT_FLUSH_SECONDS = 60.0
# Test hook, a pause point only: "PHASE:SECONDS" sleeps at PHASE (before_rename | after_rename | after_commit)
# of every shard commit, so a test can SIGKILL the process at a chosen instant. It changes nothing else.
PAUSE_ENV = "BIVIT_DATASET_TEST_PAUSE"


# --------------------------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Source:
    """One input file: `source` is how it is named in the manifest, `path` where it is read from."""

    source: str
    path: Path
    kind: str  # "image" | "video"


def media_kind(path: str | os.PathLike) -> Optional[str]:
    ext = os.path.splitext(str(path))[1].lower()
    if ext in IMAGE_EXTENSIONS:
        return "image"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    return None


def list_sources(src: str | os.PathLike, exclude: Optional[os.PathLike] = None) -> list[Source]:
    """The inputs named by SRC: a directory (recursive, by extension, sorted), a manifest file, or one media file.

    A manifest is one path per line, or JSONL objects with a `path` field; relative paths resolve against the
    manifest's folder. Blank lines and lines starting with `#` are ignored. A manifest may name files with any
    extension (an unknown one is treated as an image). `exclude` (the output directory) is never listed.
    """
    root = Path(src)
    if root.is_dir():
        return _list_dir(root, exclude)
    if root.is_file() and media_kind(root) is not None:  # a single image or video
        return [Source(root.name, root, media_kind(root))]
    if root.is_file():
        return _list_manifest(root)
    raise BivitError(f"{src}: no such file or directory")


def _list_dir(root: Path, exclude: Optional[os.PathLike]) -> list[Source]:
    skip = Path(exclude).resolve() if exclude is not None else None
    out = []
    # Symlinked folders are not followed (cycles); symlinked files are listed.
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None:
            dirnames[:] = [d for d in dirnames if (here / d).resolve() != skip]
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            kind = media_kind(name)
            if kind is None or name.startswith("."):
                continue
            path = here / name
            out.append(Source(path.relative_to(root).as_posix(), path, kind))
    out.sort(key=lambda s: s.source)
    return out


def _list_manifest(manifest: Path) -> list[Source]:
    base = manifest.resolve().parent
    out, seen = [], set()
    try:
        text = manifest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BivitError(f"{manifest}: cannot read the manifest ({e})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BivitError(f"{manifest}:{lineno}: invalid JSON ({e.msg})") from None
            name = obj.get("path") if isinstance(obj, dict) else None
            if not isinstance(name, str) or not name:
                raise BivitError(f"{manifest}:{lineno}: a JSON line needs a non-empty string field 'path'")
        else:
            name = line
        p = Path(name)
        path = p if p.is_absolute() else base / p
        # The manifest names a file relative to its folder (or absolutely): that name is the source.
        source = p.as_posix() if not p.is_absolute() else str(p)
        source = os.path.normpath(source).replace(os.sep, "/")
        if source in seen:
            continue
        seen.add(source)
        out.append(Source(source, path, media_kind(name) or "image"))
    return out


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# Manifest records and the output directory


@dataclass(frozen=True)
class Record:
    """One manifest line: `source` was encoded into tensor `key` of `shard` (both inside the dataset folder)."""

    source: str
    sha256: str
    shard: str
    key: str
    tokens: int
    grid_thw: list  # [[t, h, w], ...]: one entry for an image, one per chunk for a video
    kind: str = "image"
    timestamps: Optional[list] = None  # per chunk, videos only
    size: Optional[int] = None  # file size and mtime when encoded: a re-run skips unchanged files unread
    mtime_ns: Optional[int] = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), ensure_ascii=False)

    @staticmethod
    def from_json(obj: dict) -> "Record":
        names = {f.name for f in dataclasses.fields(Record)}
        return Record(**{k: v for k, v in obj.items() if k in names})


@dataclass(frozen=True)
class ErrorRecord:
    source: str
    error: str
    sha256: Optional[str] = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Complete lines of a JSONL file and the byte length they cover (a trailing partial line is left out)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    end = data.rfind(b"\n") + 1  # 0 when no complete line
    out = []
    for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise BivitError(f"{path}:{lineno}: corrupt line ({e.msg})") from None
    return out, end


def _append_lines(path: Path, lines: Sequence[str]) -> None:
    """Append whole lines with one write, then fsync: a kill leaves at most a trailing partial line."""
    if not lines:
        return
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.parent / f"{TMP_PREFIX}{path.name}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _pause(phase: str) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if spec:
        want, _, seconds = spec.partition(":")
        if want == phase:
            time.sleep(float(seconds or 1))




def header_for(encoder: Any, model: Optional[str]) -> dict:
    """What a dataset folder records about the encoder that wrote it; a later run must match the checked keys."""
    from . import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "bivit_version": __version__,
        "model": model,
        "model_name": encoder.model_name,
        "is_demo": bool(encoder.is_demo),
        "fingerprint": encoder.fingerprint,
        "dtype": dtype_name(encoder.dtype),
        "projector_dtype": dtype_name(encoder.projector_dtype),
        "output_dtype": dtype_name(encoder.output_dtype),
        "text_hidden_size": int(encoder.config.text_hidden_size),
        "batch_invariant": bool(encoder.batch_invariant),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


# A folder written with other values for these keys holds tensors that are not comparable with this run's.
_MUST_MATCH = ("format_version", "fingerprint", "dtype", "projector_dtype", "output_dtype", "batch_invariant")


class DatasetWriter:
    """The single writer of an output folder: holds its lock, recovers it, and commits shards + manifest lines.

    Not thread-safe: one thread calls it (the driver, in the Ray engine).
    """

    def __init__(self, out: str | os.PathLike, header: dict, *, shard_mb: float = DEFAULT_SHARD_MB,
                 flush_seconds: float = DEFAULT_FLUSH_SECONDS):
        self.dir = Path(out)
        self.header = header
        self.shard_bytes = max(1, int(shard_mb * 2**20))
        self.flush_seconds = flush_seconds
        if self.dir.exists() and not self.dir.is_dir():
            raise BivitError(f"{out}: exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise BivitError(f"{out}: another bivit encode-dataset is writing this folder") from None
        try:
            self._open_header()
            self._recover()
        except BaseException:
            self.close()
            raise
        self._pending: dict[str, tuple[torch.Tensor, list[Record]]] = {}  # key -> (tensor, its manifest lines)
        self._pending_bytes = 0
        self._pending_since: Optional[float] = None
        self.tokens_written = 0

    # -- opening ---------------------------------------------------------------------------------------------

    def _open_header(self) -> None:
        path = self.dir / HEADER
        if path.exists():
            try:
                old = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise BivitError(f"{path}: unreadable dataset header ({e})") from None
            if old.get("format") != FORMAT:
                raise BivitError(f"{path}: not a bivit encoded dataset")
            diff = [k for k in _MUST_MATCH if old.get(k) != self.header.get(k)]
            if diff:
                what = ", ".join(f"{k} {old.get(k)!r} there vs {self.header.get(k)!r} now" for k in diff)
                raise BivitError(f"{self.dir}: written by a different encoder ({what}); choose another --out")
            self.header = old
        else:
            leftovers = [p.name for p in self.dir.iterdir() if p.name != LOCK and not p.name.startswith(TMP_PREFIX)]
            if leftovers:
                raise BivitError(f"{self.dir}: not empty and has no {HEADER} (found {sorted(leftovers)[0]!r}); "
                                 "choose an empty or new --out")
            _write_atomic(path, (json.dumps(self.header, indent=2) + "\n").encode())

    def _recover(self) -> None:
        for p in self.dir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                p.unlink()  # a shard or header that was being written when a previous run died
        for name in (MANIFEST, ERRORS):
            path = self.dir / name
            _, end = _read_jsonl(path)
            if path.exists() and path.stat().st_size != end:
                with open(path, "r+b") as f:  # drop a line cut short by a kill
                    f.truncate(end)
                    os.fsync(f.fileno())
        rows, _ = _read_jsonl(self.dir / MANIFEST)
        # Only what resuming needs, kept small: (size, mtime_ns, sha256) per source, one record per content.
        self.by_source: dict[str, tuple[Optional[int], Optional[int], str]] = {}
        self.by_hash: dict[str, Record] = {}
        for row in rows:
            rec = Record.from_json(row)
            self.by_source[rec.source] = (rec.size, rec.mtime_ns, rec.sha256)
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
        self.compact_errors()
        _fsync_dir(self.dir)

    def compact_errors(self) -> None:
        """Keep one line per failed source (its latest error), and none for a source encoded since."""
        path = self.dir / ERRORS
        rows, _ = _read_jsonl(path)
        latest = {r.get("source"): r for r in rows}
        keep = [r for s, r in latest.items() if s not in self.by_source]
        if len(keep) != len(rows):
            _write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep).encode("utf-8"))

    # -- writing ---------------------------------------------------------------------------------------------

    def add_lines(self, records: Sequence[Record]) -> None:
        """Manifest lines whose tensor is already durable (a duplicate of a stored item)."""
        _append_lines(self.dir / MANIFEST, [r.to_json() for r in records])
        for r in records:
            self.by_source[r.source] = (r.size, r.mtime_ns, r.sha256)
            self.by_hash.setdefault(r.sha256, r)

    def add_error(self, sources: Sequence[Source], message: str, sha: Optional[str] = None) -> None:
        msg = " ".join(str(message).split())  # one line
        _append_lines(self.dir / ERRORS, [json.dumps(dataclasses.asdict(ErrorRecord(s.source, msg, sha)),
                                                     ensure_ascii=False) for s in sources])

    def add(self, sha: str, tensor: torch.Tensor, grid_thw: list, timestamps: Optional[list],
            sources: Sequence[Source], stats: Sequence[Optional[os.stat_result]]) -> None:
        """One encoded item (its tensor and every source with these bytes); commits a shard when one is full."""
        stored = self.by_hash.get(sha)
        if stored is not None:  # bytes already durable: the sources only need lines pointing there
            self.add_lines([dataclasses.replace(stored, source=s.source, kind=s.kind, size=st and st.st_size,
                                                mtime_ns=st and st.st_mtime_ns) for s, st in zip(sources, stats)])
            return
        expected = self.header["output_dtype"]
        if dtype_name(tensor.dtype) != expected or tensor.ndim != 2 or tensor.shape[1] != self.header["text_hidden_size"]:
            # Guard against a worker returning something else (the vLLM idle-rank dtype bug, a mismatched model).
            raise BivitError(f"encoder returned {tuple(tensor.shape)} {tensor.dtype} for {sources[0].source}; "
                             f"expected [tokens, {self.header['text_hidden_size']}] {expected}")
        lines = []
        for s, st in zip(sources, stats):
            rec = Record(s.source, sha, "", sha, int(tensor.shape[0]), grid_thw, s.kind, timestamps,
                         st.st_size if st else None, st.st_mtime_ns if st else None)
            lines.append(rec)
        if sha in self._pending:
            self._pending[sha][1].extend(lines)
            return
        self._pending[sha] = (tensor.contiguous(), lines)
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_since is None:
            self._pending_since = time.monotonic()
        if self._pending_bytes >= self.shard_bytes or time.monotonic() - self._pending_since >= self.flush_seconds:
            self.commit()

    def commit(self) -> None:
        """Write the pending tensors as one durable shard, then append their manifest lines."""
        if not self._pending:
            return
        from safetensors.torch import save_file

        name = f"shard-{self._next_shard:06d}.safetensors"
        self._next_shard += 1
        final = self.dir / name
        tmp = self.dir / f"{TMP_PREFIX}{name}"
        save_file({k: t for k, (t, _) in self._pending.items()}, str(tmp),
                  metadata={"format": FORMAT, "fingerprint": str(self.header["fingerprint"])})
        os.chmod(tmp, 0o644)  # safetensors creates files owner-only; the manifest and header are 0644
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _pause("before_rename")
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        _pause("after_rename")
        records = [dataclasses.replace(r, shard=name) for _, lines in self._pending.values() for r in lines]
        self.add_lines(records)
        self.tokens_written += sum(int(t.shape[0]) for t, _ in self._pending.values())
        self._pending.clear()
        self._pending_bytes = 0
        self._pending_since = None
        _pause("after_commit")

    def close(self) -> None:
        if getattr(self, "_lock_fd", None) is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------------------
# Planning: what to encode, what to skip, what only needs a manifest line


@dataclass
class Work:
    """One distinct content (sha256) to encode, and every source in this run that has those bytes."""

    sha256: str
    kind: str
    path: Path
    sources: list[Source] = field(default_factory=list)
    stats: list[Optional[os.stat_result]] = field(default_factory=list)


@dataclass
class Plan:
    work: list[Work]
    skipped: int = 0
    deduplicated: int = 0  # sources that cost no encode: same bytes as a stored or another listed source
    failed: int = 0


def plan(sources: Sequence[Source], writer: DatasetWriter, hash_threads: int = 4) -> Plan:
    """Decide per source: skip (already in the manifest), dedup (bytes already stored or listed) or encode."""
    result = Plan([])
    to_hash: list[tuple[Source, os.stat_result]] = []
    for s in sources:
        try:
            st = os.stat(s.path)
        except OSError as e:
            writer.add_error([s], f"{s.source}: cannot read ({e.strerror or e})")
            result.failed += 1
            continue
        prev = writer.by_source.get(s.source)
        if prev is not None and prev[:2] == (st.st_size, st.st_mtime_ns):
            result.skipped += 1  # unchanged since it was encoded: not even read
            continue
        to_hash.append((s, st))

    def digest(item: tuple[Source, os.stat_result]) -> str | OSError:
        try:
            return sha256_file(item[0].path)
        except OSError as e:
            return e

    works: dict[str, Work] = {}
    dup_lines: list[Record] = []
    with ThreadPoolExecutor(max(1, hash_threads)) as pool:  # hashing is I/O and hashlib releases the GIL
        for (s, st), sha in zip(to_hash, pool.map(digest, to_hash)):
            if isinstance(sha, OSError):
                writer.add_error([s], f"{s.source}: cannot read ({sha.strerror or sha})")
                result.failed += 1
                continue
            prev = writer.by_source.get(s.source)
            if prev is not None and prev[2] == sha:
                result.skipped += 1  # touched, same bytes
                continue
            stored = writer.by_hash.get(sha)
            if stored is not None:
                dup_lines.append(dataclasses.replace(stored, source=s.source, kind=s.kind, size=st.st_size,
                                                     mtime_ns=st.st_mtime_ns))
                result.deduplicated += 1
            elif sha in works:
                works[sha].sources.append(s)
                works[sha].stats.append(st)
                result.deduplicated += 1
            else:
                works[sha] = Work(sha, s.kind, s.path, [s], [st])
    writer.add_lines(dup_lines)
    result.work = list(works.values())
    return result


# --------------------------------------------------------------------------------------------------------------
# Per-item stages shared by both engines


@dataclass
class Prepared:
    """A work item after decoding: its chunks (one for an image) as a MediaBatch, or the reason it failed."""

    sha256: str
    batch: Any = None  # bivit.media.MediaBatch
    error: Optional[str] = None


@dataclass
class Encoded:
    sha256: str
    tensor: Optional[torch.Tensor] = None
    grid_thw: Optional[list] = None
    timestamps: Optional[list] = None
    error: Optional[str] = None


def prepare(sha: str, kind: str, path: Path, name: str) -> Prepared:
    """Read, check and preprocess one item. Never raises for a bad input: the error is returned."""
    from .media import preprocess_images

    from .video import preprocess_video

    changed = f"{name}: file changed while the job ran (its sha256 differs from the one planned)"
    try:
        if kind == "video" and path.stat().st_size > VIDEO_BYTES_LIMIT:
            if sha256_file(path) != sha:
                return Prepared(sha, error=changed)
            batch = preprocess_video(path)
        else:
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != sha:
                return Prepared(sha, error=changed)
            batch = preprocess_video(data) if kind == "video" else preprocess_images([data])
        if len(batch) == 0:
            return Prepared(sha, error=f"{name}: no frames decoded")
        return Prepared(sha, batch)
    except MediaError as e:
        msg = str(e)
        # media names bytes inputs "<N bytes>"; name the file instead.
        return Prepared(sha, error=msg if msg.startswith(name) else f"{name}: {msg.split(': ', 1)[-1]}")
    except OSError as e:
        return Prepared(sha, error=f"{name}: cannot read ({e.strerror or e})")
    except Exception as e:  # a decoder bug must not stop the job; it is recorded with its type
        return Prepared(sha, error=f"{name}: {type(e).__name__}: {e}")


def group_by_tokens(items: Sequence[Prepared], batch_tokens: int) -> list[list[Prepared]]:
    """Cut items into encode calls of about `batch_tokens` tokens (an item is never split; invariance makes the
    cut irrelevant to the result, it only bounds memory)."""
    groups: list[list[Prepared]] = []
    cur: list[Prepared] = []
    n = 0
    for it in items:
        t = sum(it.batch.token_counts)
        if cur and n + t > batch_tokens:
            groups.append(cur)
            cur, n = [], 0
        cur.append(it)
        n += t
    if cur:
        groups.append(cur)
    return groups


def encode_prepared(encoder: Any, items: Sequence[Prepared], batch_tokens: int) -> list[Encoded]:
    """Encode prepared items (any number, zero included) in token-bounded calls; failures are per item."""
    from .media import MediaBatch

    out: list[Encoded] = [Encoded(p.sha256, error=p.error) for p in items if p.error is not None]
    good = [p for p in items if p.error is None]
    for group in group_by_tokens(good, batch_tokens):
        try:
            tensors = encoder.encode_batch(MediaBatch.concat([p.batch for p in group]))
        except Exception:
            # Find which item broke the call: encode each alone (same bits, by invariance).
            for p in group:
                try:
                    out.append(_assemble(p, encoder.encode_batch(p.batch)))
                except Exception as e:
                    out.append(Encoded(p.sha256, error=f"encode failed: {type(e).__name__}: {e}"))
            continue
        i = 0
        for p in group:
            n = len(p.batch)
            out.append(_assemble(p, tensors[i : i + n]))
            i += n
    return out


def _assemble(p: Prepared, chunks: Sequence[torch.Tensor]) -> Encoded:
    # A video is stored as the concatenation of its chunks' embeddings (what Encoder.encode returns for a video
    # path); `grid_thw` and `timestamps` in the manifest say where each chunk starts.
    tensor = chunks[0] if len(chunks) == 1 else torch.cat(list(chunks))
    return Encoded(p.sha256, tensor, p.batch.grid_thw.tolist(), p.batch.timestamps)


# --------------------------------------------------------------------------------------------------------------
# The job


@dataclass
class Summary:
    encoded: int = 0  # distinct contents encoded in this run
    skipped: int = 0  # sources already in the manifest
    deduplicated: int = 0  # sources whose bytes were already stored or listed twice
    failed: int = 0  # sources recorded in errors.jsonl by this run
    tokens: int = 0  # tokens written by this run
    seconds: float = 0.0
    engine: str = "local"
    workers: int = 1

    def line(self) -> str:
        rate = self.encoded / self.seconds if self.seconds > 0 else 0.0
        return (f"encoded {self.encoded}, skipped {self.skipped}, deduplicated {self.deduplicated}, "
                f"failed {self.failed}; {self.tokens} tokens in {self.seconds:.1f} s "
                f"({rate:.2f} items/s, engine {self.engine}"
                + (f", {self.workers} workers)" if self.engine == "ray" else ")"))


def _parse_dtype(name: Optional[str], option: str) -> Optional[str]:
    """The dtype's canonical name (the encoder's aliases), or a one-line error naming the option."""
    if name is None:
        return None
    try:
        return dtype_name(parse_dtype(name, option))
    except ConfigError:
        raise BivitError(f"{option} {name!r}: expected bfloat16, float16 or float32") from None


def encode_dataset(src: str | os.PathLike, out: str | os.PathLike, *, model: Optional[str] = None,
                   dtype: str = "bfloat16", projector_dtype: Optional[str] = None,
                   output_dtype: Optional[str] = None, engine: str = "local", ray_address: Optional[str] = None,
                   workers: int = 1, cpus_per_worker: int = 1, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                   shard_mb: float = DEFAULT_SHARD_MB, flush_seconds: float = DEFAULT_FLUSH_SECONDS,
                   progress: bool = True) -> Summary:
    """Encode every image/video named by `src` into `out` (see the module docstring). Returns the summary."""
    t0 = time.monotonic()
    if engine not in ("local", "ray"):
        raise BivitError(f"--engine {engine!r}: expected 'local' or 'ray'")
    if engine == "ray" and importlib.util.find_spec("ray") is None:  # say so before any work is done
        raise BivitError("--engine ray needs Ray Data: pip install 'bivit[ray]'")
    if workers < 1 or cpus_per_worker < 1:
        raise BivitError("--workers and --cpus-per-worker must be at least 1")
    if batch_tokens < 1:
        raise BivitError("--batch-tokens must be at least 1")
    if shard_mb <= 0:
        raise BivitError("--shard-mb must be positive")
    opts = dict(dtype=_parse_dtype(dtype, "--dtype"), projector_dtype=_parse_dtype(projector_dtype, "--projector-dtype"),
                output_dtype=_parse_dtype(output_dtype, "--output-dtype"))
    out = Path(out)
    sources = list_sources(src, exclude=out)

    from . import load_encoder

    # The driver always loads the model: its fingerprint goes into (or is checked against) the header, and each
    # Ray worker checks that it loaded the same thing.
    encoder = load_encoder(model, dtype=opts["dtype"], projector_dtype=opts["projector_dtype"],
                           output_dtype=opts["output_dtype"], batch_invariant=True)
    summary = Summary(engine=engine, workers=workers)
    with DatasetWriter(out, header_for(encoder, model), shard_mb=shard_mb, flush_seconds=flush_seconds) as writer:
        p = plan(sources, writer)
        summary.skipped, summary.deduplicated, summary.failed = p.skipped, p.deduplicated, p.failed
        bar = _progress(len(p.work), progress)
        works = {w.sha256: w for w in p.work}

        def sink(e: Encoded) -> None:
            w = works.pop(e.sha256, None)
            if w is None:  # a result delivered twice (a retried Ray task): already handled
                return
            if e.error is not None:
                writer.add_error(w.sources, e.error, e.sha256)
                summary.failed += len(w.sources)
                summary.deduplicated -= len(w.sources) - 1  # nothing was stored for them to share
            else:
                writer.add(e.sha256, e.tensor, e.grid_thw, e.timestamps, w.sources, w.stats)
                summary.encoded += 1
            bar.update(1)

        try:
            if engine == "local":
                _run_local(encoder, p.work, batch_tokens, sink)
            else:
                del encoder  # workers load their own; free the driver's copy
                try:
                    from .dataset_ray import run_ray
                except ImportError as e:
                    raise BivitError(f"--engine ray needs Ray Data ({e.name or e} is missing): "
                                     "pip install 'bivit[ray]'") from None

                run_ray(p.work, sink, model=model, opts=opts, fingerprint=writer.header["fingerprint"],
                        address=ray_address, workers=workers, cpus_per_worker=cpus_per_worker,
                        batch_tokens=batch_tokens)
        except BaseException:
            # Interrupted (Ctrl-C, a Ray worker lost): keep what is already encoded, so a re-run resumes after it.
            with contextlib.suppress(Exception):
                writer.commit()
            raise
        finally:
            bar.close()
        writer.commit()
        writer.compact_errors()
        summary.tokens = writer.tokens_written
    summary.seconds = time.monotonic() - t0
    return summary


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="item", desc="encoding", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _run_local(encoder: Any, work: Sequence[Work], batch_tokens: int, sink: Callable[[Encoded], None]) -> None:
    """In-process: one thread decodes ahead while this one encodes (PIL and torch both release the GIL)."""
    for group in _prefetch(_token_groups(work, batch_tokens), depth=2):
        for e in encode_prepared(encoder, group, batch_tokens):
            sink(e)


def _token_groups(work: Sequence[Work], batch_tokens: int) -> Iterator[list[Prepared]]:
    cur: list[Prepared] = []
    n = 0
    for w in work:
        p = prepare(w.sha256, w.kind, w.path, w.sources[0].source)
        cur.append(p)
        n += sum(p.batch.token_counts) if p.error is None else 0
        if n >= batch_tokens:
            yield cur
            cur, n = [], 0
    if cur:
        yield cur


def _prefetch(it: Iterator[Any], depth: int) -> Iterator[Any]:
    q: "queue.Queue[Any]" = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():  # never block forever on a consumer that has gone away
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            for x in it:
                if not put((True, x)):
                    return
        except BaseException as e:  # surfaced in the consumer
            put((False, e))
            return
        put((True, done))

    t = threading.Thread(target=produce, name="bivit-prefetch", daemon=True)
    t.start()
    try:
        while True:
            ok, x = q.get()
            if not ok:
                raise x
            if x is done:
                return
            yield x
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                q.get_nowait()


# --------------------------------------------------------------------------------------------------------------
# Reading


class EncodedDataset:
    """A folder written by `bivit encode-dataset`, opened for reading.

    `len(ds)`, `for rec in ds`, `ds[source]` / `ds.get(source)` -> Record, `ds.by_hash(sha)` -> [Record, ...],
    `ds.tensor(source_or_record)` -> torch.Tensor `[tokens, text_hidden]` in the stored dtype,
    `ds.numpy(source_or_record)` -> np.ndarray (bfloat16 has no numpy dtype: it is returned as float32, which
    holds every bfloat16 value exactly; float16/float32 are returned as they are stored).
    A source that was re-encoded after its file changed is reported with its latest record.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        hp = self.path / HEADER
        if not hp.is_file():
            raise BivitError(f"{self.path}: not an encoded dataset (no {HEADER})")
        try:
            self.header: dict = json.loads(hp.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise BivitError(f"{hp}: unreadable dataset header ({e})") from None
        if self.header.get("format") != FORMAT:
            raise BivitError(f"{hp}: not a bivit encoded dataset")
        # A trailing partial line (a writer killed mid-append, or still writing) is not a record.
        rows, _ = _read_jsonl(self.path / MANIFEST)
        by_source: dict[str, Record] = {}
        for row in rows:
            rec = Record.from_json(row)
            by_source[rec.source] = rec
        self._by_source = by_source
        self.records: list[Record] = list(by_source.values())
        self._by_hash: dict[str, list[Record]] = {}
        for rec in self.records:
            self._by_hash.setdefault(rec.sha256, []).append(rec)
        err_rows, _ = _read_jsonl(self.path / ERRORS)
        latest = {r["source"]: ErrorRecord(r["source"], r.get("error", ""), r.get("sha256")) for r in err_rows}
        self.errors: list[ErrorRecord] = [e for s, e in latest.items() if s not in by_source]
        self._handles: dict[str, Any] = {}

    @property
    def fingerprint(self) -> str:
        return self.header["fingerprint"]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.header["output_dtype"])

    @property
    def sources(self) -> list[str]:
        return [r.source for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __contains__(self, source: object) -> bool:
        return source in self._by_source

    def __getitem__(self, source: str) -> Record:
        try:
            return self._by_source[source]
        except KeyError:
            raise KeyError(f"{source!r} is not in {self.path / MANIFEST}") from None

    def get(self, source: str, default: Any = None) -> Any:
        return self._by_source.get(source, default)

    def by_hash(self, sha256: str) -> list[Record]:
        """Every record whose file had these bytes (they share one stored tensor); [] if none."""
        return list(self._by_hash.get(sha256.lower(), []))

    def tensor(self, item: "str | Record") -> torch.Tensor:
        rec = item if isinstance(item, Record) else self[item]
        handle = self._handles.get(rec.shard)
        if handle is None:
            from safetensors import safe_open

            path = self.path / rec.shard
            if not path.is_file():
                raise BivitError(f"{path}: shard missing (needed for {rec.source!r})")
            handle = safe_open(str(path), framework="pt")
            self._handles[rec.shard] = handle
        try:
            return handle.get_tensor(rec.key)
        except Exception as e:
            raise BivitError(f"{self.path / rec.shard}: no tensor {rec.key!r} for {rec.source!r} ({e})") from None

    def numpy(self, item: "str | Record") -> np.ndarray:
        t = self.tensor(item)
        if t.dtype == torch.bfloat16:
            t = t.float()  # exact: every bfloat16 is a float32
        return t.numpy()

    def chunks(self, item: "str | Record") -> list[torch.Tensor]:
        """A video's embedding cut back into its chunks (one element for an image)."""
        rec = item if isinstance(item, Record) else self[item]
        t = self.tensor(rec)
        sizes = [(h // 2) * (w // 2) for _, h, w in rec.grid_thw]
        return list(torch.split(t, sizes))

    def close(self) -> None:
        """Release the open shard files (also done by `with open_dataset(...) as ds:`)."""
        self._handles.clear()

    def __enter__(self) -> "EncodedDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EncodedDataset({str(self.path)!r}, {len(self)} records, {len(self.errors)} errors)"


def open_dataset(path: str | os.PathLike) -> EncodedDataset:
    """Open a folder written by `bivit encode-dataset` (see EncodedDataset)."""
    return EncodedDataset(path)


# --------------------------------------------------------------------------------------------------------------
# CLI


def encode_dataset_command(
    src: Annotated[Path, typer.Argument(help="Folder of images/videos (recursive) or a manifest file (one path "
                                             "per line, or JSONL with a 'path' field).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder (created; re-running resumes it).",
                                      show_default=False)],
    model: Annotated[Optional[str], typer.Option(help="Checkpoint folder; default: the tiny built-in demo model.")] = None,
    dtype: Annotated[str, typer.Option(help="Tower dtype: bfloat16, float16 or float32.")] = "bfloat16",
    projector_dtype: Annotated[Optional[str], typer.Option(help="Projector dtype (default: the tower dtype).")] = None,
    output_dtype: Annotated[Optional[str], typer.Option(help="Stored embedding dtype (default: the projector's).")] = None,
    engine: Annotated[str, typer.Option(help="local (in-process) or ray (Ray Data actor pool).")] = "local",
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster to join (e.g. auto or ray://host:10001); "
                                                            "default: start a local Ray.")] = None,
    workers: Annotated[int, typer.Option(help="Ray engine: encoder actors (each loads the model once).")] = 1,
    cpus_per_worker: Annotated[int, typer.Option(help="Ray engine: CPUs (torch threads) per encoder actor.")] = 1,
    batch_tokens: Annotated[int, typer.Option(help="Tokens per encode call (memory bound; results do not "
                                                   "depend on it).")] = DEFAULT_BATCH_TOKENS,
    shard_mb: Annotated[float, typer.Option(help="Target size of one safetensors shard, MiB.")] = DEFAULT_SHARD_MB,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Encode every image and video under SRC into sharded safetensors in --out (resumable, crash-safe)."""
    try:
        summary = encode_dataset(src, out, model=model, dtype=dtype, projector_dtype=projector_dtype,
                                 output_dtype=output_dtype, engine=engine, ray_address=ray_address, workers=workers,
                                 cpus_per_worker=cpus_per_worker, batch_tokens=batch_tokens, shard_mb=shard_mb,
                                 progress=progress)
    except BivitError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo(f"interrupted; everything encoded so far is in {out}, run the same command to resume", err=True)
        raise typer.Exit(130) from None
    typer.echo(summary.line())
    if summary.failed:
        typer.echo(f"{summary.failed} inputs failed; see {Path(out) / ERRORS}", err=True)


if __name__ == "__main__":  # `python -m bivit.dataset SRC --out DIR ...` (the CLI registers the same function)
    typer.run(encode_dataset_command)
