"""Names of any bytes (file names, upload names, manifest paths) reach the records, losslessly, and never stop a
batch or a dataset; what a terminal or a log line quotes of them is escaped and cut (`bivit.media.names`).

Before: `bivit encode ok0.png $'bad\\xff.png'` raised UnicodeEncodeError writing its file (a traceback, no output,
the good input lost too); `bivit encode-dataset` on a folder holding such a name failed before its first shard,
and again on every run; a NUL in a manifest path was a traceback before any work, every run. The service's side
(JSON and multipart names) is in test_server_limits.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bivit
from bivit.media.names import MAX_NAME_BYTES, shown, stored, too_long, unescape
from support.media import png_bytes

# Each kind of name that is not plain text, as the file system gives it to Python (bytes that are not UTF-8
# decoded with surrogateescape): invalid UTF-8, newline, escape, bidi override, a backslash, plain.
FILE_NAMES = [b"ok0.png", b"bad\xff.png", b"new\nline.png", b"esc\x1b[31m.png", "\u202egnp.png".encode(),
              b"back\\slash.png", b"a\\xff.png"]


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bivit", *map(os.fsdecode, args)], capture_output=True,
                          cwd=cwd, timeout=300)


def write_images(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i, raw in enumerate(FILE_NAMES):
        (folder / os.fsdecode(raw)).write_bytes(png_bytes(56, 28 * (i + 1), i))
    return [os.fsdecode(raw) for raw in FILE_NAMES]


def test_stored_names_are_text_lossless_and_distinct():
    names = [os.fsdecode(raw) for raw in FILE_NAMES] + ["\ud800.png", "nul\x00.png", "x\\ud800y", "\\", ""]
    kept = [stored(n) for n in names]
    for name, text in zip(names, kept):
        text.encode("utf-8")  # valid text: JSON in UTF-8 can hold it
        assert unescape(text) == name
    assert len(set(kept)) == len(kept)  # `a\xff.png` (a backslash, x, f, f) and `a<0xff>.png` stay apart
    assert stored("caf\u00e9 photo.png") == "caf\u00e9 photo.png"  # text without a backslash is kept as it is
    for text in kept:
        line = shown(text)
        assert "\n" not in line and "\x1b" not in line and "\u202e" not in line
    assert shown("x" * 5000).endswith("... (4000 more characters)")
    assert too_long("a" * MAX_NAME_BYTES) is None and "4097 bytes" in too_long("a" * (MAX_NAME_BYTES + 1))


def test_encode_keeps_every_input_whatever_its_name(tmp_path):
    names = write_images(tmp_path)
    missing = "gone\x1b[2J.png"  # does not exist: its skip line must not clear the terminal
    r = run_cli("encode", *names, missing, "--out", "out.safetensors", cwd=tmp_path)
    assert r.returncode == 1 and b"Traceback" not in r.stderr, r.stderr[-3000:]
    skipped = [ln for ln in r.stderr.decode().splitlines() if ln.startswith("bivit: skipped: ")]
    assert skipped == ["bivit: skipped: gone\\x1b[2J.png: does not exist"], r.stderr
    recs = bivit.load_embeddings(tmp_path / "out.safetensors")
    assert [unescape(rec.source) for rec in recs] == names + [missing]
    assert all(rec.ok for rec in recs[:-1]) and recs[-1].error
    assert recs[1].source == "bad\\xff.png" and recs[5].source == "back\\\\slash.png"


def test_a_dataset_of_any_names_is_encoded_resumed_and_read(tmp_path):
    names = write_images(tmp_path / "src")
    manifest = tmp_path / "list.txt"  # the same files by path, and lines no file can be named by
    lines = [os.fsencode(f"src/{n}") for n in names if "\n" not in n] + [
        b"src/nul\x00byte.png", b"src/" + b"z" * 5000 + b".png",
        json.dumps({"path": "src/json\u0000nul.png"}).encode()]
    manifest.write_bytes(b"\n".join(lines) + b"\n")

    r = run_cli("encode-dataset", "src", "--out", "folder.emb", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = bivit.load_embeddings(tmp_path / "folder.emb")
    assert sorted(unescape(rec.source) for rec in recs) == sorted(names)
    assert all((tmp_path / "src" / unescape(rec.source)).is_file() and rec.embedding is not None for rec in recs)
    r = run_cli("encode-dataset", "src", "--out", "folder.emb", cwd=tmp_path)  # resumed: nothing read again
    assert r.returncode == 0 and b"encoded 0, skipped 7" in r.stdout, r.stdout

    r = run_cli("encode-dataset", "list.txt", "--out", "list.emb", cwd=tmp_path)
    assert r.returncode == 1 and b"Traceback" not in r.stderr, r.stderr[-3000:]
    ds = bivit.open_dataset(tmp_path / "list.emb")
    assert len(ds) == len(names) - 1  # every file the manifest can name
    reasons = sorted(e.error for e in ds.errors)
    assert len(reasons) == 3 and any("NUL" in e for e in reasons) and any("5008 bytes" in e for e in reasons)
    assert max(len(e.source) for e in ds.errors) < 200


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_symlinks_leaving_the_folder_are_not_followed(tmp_path):
    """A link to a system file put that file's sha256 in errors.jsonl. A link leading out of SRC is now a failed
    input, not read; `--follow-symlinks` reads it; a link inside SRC is read as before."""
    (tmp_path / "outside.png").write_bytes(png_bytes(56, 56, 30))
    src = tmp_path / "src"
    src.mkdir()
    (src / "own.png").write_bytes(png_bytes(56, 56, 31))
    (src / "out.png").symlink_to(tmp_path / "outside.png")
    (src / "in.png").symlink_to(src / "own.png")
    r = run_cli("encode-dataset", src, "--out", tmp_path / "a.emb")
    assert r.returncode == 1, r.stderr[-3000:]
    ds = bivit.open_dataset(tmp_path / "a.emb")
    assert sorted(ds.sources) == ["in.png", "own.png"]
    [error] = ds.errors
    assert error.source == "out.png" and "not followed" in error.error and error.sha256 is None
    r = run_cli("encode-dataset", src, "--out", tmp_path / "b.emb", "--follow-symlinks")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(bivit.open_dataset(tmp_path / "b.emb").sources) == ["in.png", "out.png", "own.png"]
