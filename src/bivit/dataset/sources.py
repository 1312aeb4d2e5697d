"""What an encode-dataset run works on: the sources named by SRC, and the plan (skip, deduplicate or encode).

SRC is a folder (recursive, by extension, sorted), a manifest file (one path per line, or JSONL with a `path`
field) or one media file. Planning reads each new or changed source once to hash it; a source already in the
manifest with the same size and mtime is skipped unread, and bytes already stored cost a manifest line, not an
encode.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..base.fileio import check_regular, file_kind, parse_json, read_regular, sha256_file
from ..errors import BivitError
from ..media.kinds import media_kind
from ..media.names import label, stored, too_long
from .pipeline import Source, Work
from .writer import DatasetWriter, source_line


def list_sources(src: str | os.PathLike, exclude: Optional[os.PathLike] = None,
                 follow_symlinks: bool = False) -> list[Source]:
    """The inputs named by SRC: a directory (recursive, by extension, sorted), a manifest file, or one media file.

    A manifest is one path per line, or JSONL objects with a `path` field; relative paths resolve against the
    manifest's folder. Blank lines and lines starting with `#` are ignored. A manifest may name files with any
    extension (an unknown one is treated as an image). `exclude` (the output directory) is never listed.

    Names of any bytes: a source is named as `bivit.media.names.stored` keeps it (a file name that is not UTF-8 is
    escaped) and read at its real path; a manifest path with a NUL or longer than `MAX_NAME_BYTES` is a source
    that failed, with its reason. In a folder, a symbolic link whose target is outside SRC is a source that
    failed ("not followed"), unless `follow_symlinks`: what SRC names is what the job reads.
    """
    root = check_source(src)
    if root.is_dir():
        return _list_dir(root, exclude, follow_symlinks)
    if media_kind(root) is not None:  # a single image or video
        return [Source(stored(root.name), root, media_kind(root))]
    return _list_manifest(root)


def check_source(src: str | os.PathLike) -> Path:
    """SRC as a path when it is a folder or a file (what `list_sources` reads); BivitError naming it otherwise."""
    root = Path(src)
    if root.is_dir() or root.is_file():
        return root
    if root.exists():
        raise BivitError(f"{src}: not a folder, a manifest or a media file but {file_kind(root.stat().st_mode)}")
    raise BivitError(f"{src}: no such file or directory")


def _list_dir(root: Path, exclude: Optional[os.PathLike], follow_symlinks: bool = False) -> list[Source]:
    skip = Path(exclude).resolve() if exclude is not None else None
    inside = root.resolve()
    out = []

    def unreadable(e: OSError) -> None:  # a folder os.walk cannot list: its files must not vanish silently
        where = Path(e.filename or root)
        name = where.relative_to(root).as_posix() + "/" if where != root else "./"
        out.append(Source(stored(name), where, "image", error=f"cannot list the folder ({e.strerror or e})"))

    # Symlinked folders are not followed (cycles); symlinked files are listed, those leading out of SRC as failed
    # (a link to a system file put that file's sha256 in errors.jsonl) unless `follow_symlinks`.
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        here = Path(dirpath)
        if skip is not None:
            dirnames[:] = [d for d in dirnames if (here / d).resolve() != skip]
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            kind = media_kind(name)
            if kind is None or name.startswith("."):
                continue
            path = here / name
            error = None
            if not follow_symlinks and path.is_symlink() and not path.resolve().is_relative_to(inside):
                error = "a symbolic link to a file outside the folder, not followed (--follow-symlinks reads it)"
            out.append(Source(stored(path.relative_to(root).as_posix()), path, kind, error=error))
    out.sort(key=lambda s: s.source)
    return out


def _list_manifest(manifest: Path) -> list[Source]:
    base = manifest.resolve().parent
    out, seen = [], set()
    try:
        # A path that is not UTF-8 (as `find` writes one) is the file's name all the same: decoded as the file
        # system decodes names, so it opens that file.
        text = os.fsdecode(read_regular(manifest))
    except OSError as e:
        raise BivitError(f"{manifest}: cannot read the manifest ({e.strerror or e})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                obj = parse_json(line.encode("utf-8", "surrogateescape"))
            except ValueError as e:  # not JSON, nested too deeply, a repeated key
                raise BivitError(f"{manifest}:{lineno}: invalid JSON ({getattr(e, 'msg', e)})") from None
            name = obj.get("path") if isinstance(obj, dict) else None
            if not isinstance(name, str) or not name:
                raise BivitError(f"{manifest}:{lineno}: a JSON line needs a non-empty string field 'path'")
        else:
            name = line
        if too_long(name):  # its record names the line and the start of the path
            out.append(Source(stored(f"{manifest.name}:{lineno}: {label(name)}"), manifest, "image",
                              error=too_long(name)))
            continue
        if "\0" in name:
            out.append(Source(stored(name), manifest, "image", error="the path holds a NUL character, which no "
                              "file name can"))
            continue
        p = Path(name)
        # The manifest names a file relative to its folder (or absolutely): that name, normalised, is the source,
        # and the file read is the one the normalised name means (`x/../a.png` is `a.png` even without `x/`).
        source = os.path.normpath(p.as_posix() if not p.is_absolute() else str(p)).replace(os.sep, "/")
        path = Path(source) if p.is_absolute() else base / source
        if source in seen:
            continue
        seen.add(source)
        out.append(Source(stored(source), path, media_kind(name) or "image"))
    return out


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
        reason = s.error
        if reason is None:
            try:
                st = os.stat(s.path)
                check_regular(s.path, st)  # a FIFO or a link to /dev/zero would block or never end
            except (OSError, ValueError) as e:  # ValueError: a name the OS cannot take (a NUL)
                reason = f"cannot read ({getattr(e, 'strerror', None) or e})"
        if reason is not None:
            writer.add_error([s], reason)
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
    dup_lines: list = []  # manifest records (`bivit.core.records.Record`)
    with ThreadPoolExecutor(max(1, hash_threads)) as pool:  # hashing is I/O and hashlib releases the GIL
        for (s, st), sha in zip(to_hash, pool.map(digest, to_hash)):
            if isinstance(sha, OSError):
                writer.add_error([s], f"cannot read ({sha.strerror or sha})")
                result.failed += 1
                continue
            prev = writer.by_source.get(s.source)
            if prev is not None and prev[2] == sha:
                result.skipped += 1  # touched, same bytes
                continue
            stored = writer.by_hash.get(sha)
            if stored is not None:
                dup_lines.append(source_line(stored, s, st))
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
