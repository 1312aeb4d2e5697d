"""The kernel cache (`bivit.kernels.cache`): builds are cached and atomic, and nothing another user could have
written is ever loaded. Each attack plants a library whose constructor (code that runs inside `dlopen`,
before any self-test) leaves a marker file: the marker must never appear, and the library bivit loads must be
the one it built."""

import hashlib
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from bivit.kernels import cache

HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
pytestmark = pytest.mark.skipif(not HAS_CC, reason="no C compiler")

GENUINE = "int tiny(void) { return 42; }\n"
PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
int tiny(void) { return 666; }
"""


@pytest.fixture(autouse=True)
def _warnings_reach_caplog(caplog):
    """The checks' reasons are WARNING lines of the `bivit` logger; a command run in-process earlier in the session
    (the CLI, doctor, a Ray worker) may have raised that logger's level, so set it here for each test."""
    caplog.set_level(logging.WARNING, logger="bivit")


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> cache.Build:
    """A one-function library built like the attention (same cache, same checks), cheap to compile."""
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = tmp_path / "src" / "tiny.c"
    source.parent.mkdir()
    source.write_text(GENUINE)
    return cache.Build(source, (), ("-O1", "-shared", "-fPIC"))


def _entry(build: cache.Build) -> tuple[str, str]:
    """The cache file names of `build`'s library and of its recorded hash."""
    k = cache.key(build, cache.compiler())
    return f"{build.name}-{k}.so", f"{build.name}-{k}.sha256"


def _planted(tmp_path: Path) -> tuple[bytes, Path]:
    """A library that, when loaded, writes a marker file -> (its bytes, the marker's path)."""
    marker = tmp_path / "marker"
    src = tmp_path / "planted.c"
    src.write_text(PLANTED % marker)
    out = tmp_path / "planted.so"
    subprocess.run([cache.compiler(), "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out.read_bytes(), marker


def _plant(directory: Path, build: cache.Build, data: bytes, mode: int = 0o600) -> None:
    """Put `data` in `directory` as `build`'s library, with a hash file that matches it."""
    lib, digest = _entry(build)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / lib).write_bytes(data)
    (directory / digest).write_text(hashlib.sha256(data).hexdigest() + "\n")
    os.chmod(directory / lib, mode)
    os.chmod(directory / digest, mode)


def _loads_genuine(build: cache.Build) -> None:
    assert cache.load(build).lib.tiny() == 42


def test_build_is_cached_atomic_and_recorded(tiny):
    first = cache.load(tiny)
    assert first.lib.tiny() == 42
    lib, digest = _entry(tiny)
    directory = cache.cache_dir()
    stamp = (directory / lib).stat().st_mtime_ns
    assert cache.load(tiny).path == first.path and (directory / lib).stat().st_mtime_ns == stamp  # reused
    assert sorted(p.name for p in directory.iterdir()) == sorted([lib, digest])  # no temporary left behind
    assert (directory / digest).read_text().strip() == hashlib.sha256((directory / lib).read_bytes()).hexdigest()
    tiny.source.write_text("int tiny(void) { return 43; }\n")
    assert cache.load(tiny).path != first.path  # a changed source is a new library


def test_build_errors_name_the_cause(tiny, tmp_path, monkeypatch):
    tiny.source.write_text("int broken(void) { return }\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cache.KernelUnavailable, match="no-such-cc"):
        cache.load(tiny)
    monkeypatch.delenv("CC")
    with pytest.raises(cache.KernelUnavailable, match="could not build tiny.c"):
        cache.load(tiny)
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(blocked / "cache"))
    with pytest.raises(cache.KernelUnavailable, match="cannot write the kernel cache"):
        cache.load(tiny)


def test_cache_directories_are_private_even_under_umask_000(tiny, tmp_path):
    old = os.umask(0)
    try:
        _loads_genuine(tiny)
    finally:
        os.umask(old)
    for d in (tmp_path / "xdg", tmp_path / "xdg" / "bivit", cache.cache_dir()):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in cache.cache_dir().iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_library_planted_in_a_shared_cache_is_never_loaded(tiny, tmp_path, monkeypatch, mode):
    """`BIVIT_KERNEL_CACHE` names a directory other users can write (a team directory, a sticky /tmp-like one):
    a library planted there with the right name and a matching hash file is not loaded; the cache is refused
    with the reason, and left as it was."""
    data, marker = _planted(tmp_path)
    shared = tmp_path / "shared"
    _plant(shared, tiny, data)
    os.chmod(shared, mode)
    monkeypatch.setenv(cache.CACHE_ENV, str(shared))
    with pytest.raises(cache.KernelUnavailable, match="writable by other users"):
        cache.load(tiny)
    assert not marker.exists()
    assert stat.S_IMODE(shared.stat().st_mode) == mode  # a cache the user named is never changed


@pytest.mark.skipif(not IS_ROOT, reason="making a directory of another user needs root")
def test_a_cache_directory_of_another_user_is_refused(tiny, tmp_path, monkeypatch):
    data, marker = _planted(tmp_path)
    theirs = tmp_path / "theirs"
    _plant(theirs, tiny, data)
    os.chmod(theirs, 0o755)
    os.chown(theirs, 12345, 12345)
    monkeypatch.setenv(cache.CACHE_ENV, str(theirs))
    with pytest.raises(cache.KernelUnavailable, match="belongs to uid 12345"):
        cache.load(tiny)
    assert not marker.exists()


def test_a_private_shared_cache_the_user_names_is_used(tiny, tmp_path, monkeypatch):
    """The same checks, passed: a directory of this user's that no one else can write."""
    mine = tmp_path / "team-cache"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv(cache.CACHE_ENV, str(mine))
    _loads_genuine(tiny)
    assert (mine / _entry(tiny)[0]).is_file()


def test_a_library_not_matching_its_recorded_hash_is_rebuilt_not_loaded(tiny, tmp_path, caplog):
    _loads_genuine(tiny)
    data, marker = _planted(tmp_path)
    lib, digest = _entry(tiny)
    (cache.cache_dir() / lib).write_bytes(data)  # swapped after the build; the recorded hash is the genuine one
    _loads_genuine(tiny)
    assert not marker.exists()
    assert "does not have the SHA-256 recorded" in caplog.text
    assert hashlib.sha256((cache.cache_dir() / lib).read_bytes()).hexdigest() == \
        (cache.cache_dir() / digest).read_text().strip()  # the entry was replaced by a genuine build


def test_a_library_without_a_recorded_hash_is_rebuilt_not_loaded(tiny, tmp_path):
    data, marker = _planted(tmp_path)
    _plant(cache.cache_dir(), tiny, data)
    (cache.cache_dir() / _entry(tiny)[1]).unlink()
    _loads_genuine(tiny)
    assert not marker.exists()


def test_a_planted_symlink_is_not_followed(tiny, tmp_path, caplog):
    data, marker = _planted(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    _plant(elsewhere, tiny, data)
    lib, digest = _entry(tiny)
    directory = cache.cache_dir()
    directory.mkdir(parents=True)
    (directory / lib).symlink_to(elsewhere / lib)
    (directory / digest).symlink_to(elsewhere / digest)
    _loads_genuine(tiny)
    assert not marker.exists()
    assert "cannot be opened as a plain file" in caplog.text
    assert not (directory / lib).is_symlink()


@pytest.mark.parametrize("owner", [None, 12345])
def test_a_library_others_could_write_is_rebuilt_not_loaded(tiny, tmp_path, caplog, owner):
    """A file writable by group/others (mode 666), or owned by another user, in the user's own cache."""
    if owner is not None and not IS_ROOT:
        pytest.skip("giving a file to another user needs root")
    data, marker = _planted(tmp_path)
    directory = cache.cache_dir()
    _plant(directory, tiny, data, mode=0o666 if owner is None else 0o644)
    os.chmod(tmp_path / "xdg", 0o700)
    os.chmod(tmp_path / "xdg" / "bivit", 0o700)
    os.chmod(directory, 0o700)
    if owner is not None:
        for name in _entry(tiny):
            os.chown(directory / name, owner, owner)
    _loads_genuine(tiny)
    assert not marker.exists()
    assert ("writable by other users" if owner is None else f"belongs to uid {owner}") in caplog.text


def test_a_loose_default_cache_is_made_private(tiny, tmp_path, caplog):
    """The default cache left 0777 by an older bivit (created under umask 000) is tightened before use, and a
    library planted there by another user meanwhile is still refused by the file checks."""
    directory = cache.cache_dir()
    directory.mkdir(parents=True)
    os.chmod(directory, 0o777)
    _loads_genuine(tiny)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert "made it 0700" in caplog.text
