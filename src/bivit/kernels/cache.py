"""The kernel cache: where compiled kernels are kept between processes, and why a library found there is one
bivit built.

A shared library runs code the moment it is loaded (its constructors), before any self-test can look at it, so
nothing is loaded from the cache unless it could only have been written by this user (or root):

* the cache directory is created 0700 (whatever the umask), and before use it must be owned by this user or
  root and writable by no one else. The default one (`$XDG_CACHE_HOME/bivit/kernels`, else
  `~/.cache/bivit/kernels`) is tightened to 0700 if an older bivit left it looser; a cache the user names in
  `$BIVIT_KERNEL_CACHE` (e.g. one prepared for a team) is never changed, only refused with the reason;
* a library and the file recording its SHA-256 (written at build) must be regular files (not links), owned by
  this user or root and writable by no one else, and the library's bytes must have that hash;
* the bytes that were checked are the bytes loaded: they are copied into an anonymous memory file
  (`memfd_create`) and loaded from there, so nothing can swap the file between the check and the load.

The same directory and checks hold small records bivit proves once per machine and library (the GEMM tile
plans of `bivit.ops.gemm`): a planted record could not run code, but could make invariant mode use tiles it
never proved.

A library that fails a check in a directory that passes is rebuilt (and the cache entry replaced); a directory
that fails is not used at all. Either way the reason is said once, and PyTorch's kernel runs where no library
could be loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bivit")

CACHE_ENV = "BIVIT_KERNEL_CACHE"


class KernelUnavailable(Exception):
    """Why a compiled kernel is not used (said once, `bivit.notices`; PyTorch's kernel runs instead). `chosen`:
    by the configuration or because a faster kernel runs (a note), not lost to a failure or to the CPU (a
    warning). `fix`: what the user can do about it (None: nothing)."""

    def __init__(self, reason: str, chosen: bool = False, fix: str | None = None) -> None:
        super().__init__(reason)
        self.chosen = chosen
        self.fix = fix


INSTALL_CC = "install a C compiler (e.g. apt install gcc), or set CC to one"
WRITABLE_CACHE = f"set {CACHE_ENV} to a writable folder of your own"


@dataclass(frozen=True)
class Build:
    """One library: a C source (plus the headers it includes) compiled with `cflags`."""

    source: Path
    headers: tuple[Path, ...]
    cflags: tuple[str, ...]
    what: str = ""  # what the library holds, for the line that says it is being compiled (default: its source)

    @property
    def name(self) -> str:
        return self.source.stem


def find_compiler() -> tuple[str | None, str]:
    """(the C compiler kernels are built with, where it was found): `$CC`, else `cc` or `gcc` on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"], "$CC"
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return found, "PATH"
    return None, "PATH"


def compiler() -> str:
    cc, _ = find_compiler()
    if not cc:
        raise KernelUnavailable("no C compiler found (no $CC, no cc or gcc on PATH)", fix=INSTALL_CC)
    return cc


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bivit" / "kernels"


def _trusted_owner(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0)


def _loose(st: os.stat_result) -> bool:
    """Writable by group or others (then someone other than the owner could have written it)."""
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _make_private_dirs(path: Path) -> None:
    """Create `path` and any missing parents 0700 (mkdir's mode is masked by the umask; chmod is not)."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:  # another process made it first; it is checked below like any directory
            continue
        os.chmod(p, 0o700)


def open_cache() -> tuple[int, Path]:
    """The cache directory, created or checked -> (an open descriptor of it, its path). Files are then opened
    relative to the descriptor: the directory checked is the directory used."""
    path = cache_dir()
    explicit = bool(os.environ.get(CACHE_ENV))
    try:
        _make_private_dirs(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {path}: {e}", fix=WRITABLE_CACHE) from e
    try:
        st = os.fstat(fd)
        if not _trusted_owner(st):
            raise KernelUnavailable(f"the kernel cache {path} belongs to uid {st.st_uid}, not to this user: a library "
                                    f"there could have been planted (use a directory of your own in {CACHE_ENV})")
        if _loose(st):
            if explicit or st.st_uid != os.geteuid():
                raise KernelUnavailable(f"the kernel cache {path} is writable by other users "
                                        f"(mode {stat.S_IMODE(st.st_mode):o}): a library there could have been "
                                        f"planted (chmod 700 it, or use another {CACHE_ENV})")
            os.fchmod(fd, 0o700)
            log.warning("bivit: the kernel cache %s was writable by other users (mode %o); made it 0700",
                        path, stat.S_IMODE(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def key(build: Build, cc: str) -> str:
    """Cache key of a build: its sources, flags and compiler version (a new compiler builds a new library)."""
    try:
        probe = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C compiler {cc} does not run ({e})", fix=INSTALL_CC) from e
    if probe.returncode != 0:
        raise KernelUnavailable(f"the C compiler {cc} does not work (`{cc} --version` exited {probe.returncode})",
                                fix=INSTALL_CC)
    version = probe.stdout
    h = hashlib.sha256()
    for source in (build.source, *build.headers):
        h.update(source.name.encode() + b"\0" + source.read_bytes())
    h.update(" ".join(build.cflags).encode() + version.encode())
    return h.hexdigest()[:16]


class _Refused(Exception):
    """A cache entry that is not loaded (why, for the log); it is rebuilt."""


def _read_private(dir_fd: int, name: str) -> bytes:
    """A file of the cache: a regular file (not a link) owned by this user or root, writable by no one else."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symbolic link
        raise _Refused(f"{name} cannot be opened as a plain file ({e.strerror})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"{name} is not a regular file")
        if not _trusted_owner(st):
            raise _Refused(f"{name} belongs to uid {st.st_uid}")
        if _loose(st):
            raise _Refused(f"{name} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _cached(dir_fd: int, lib: str, digest: str) -> bytes:
    """The cached library's bytes, checked against the hash recorded when it was built."""
    data = _read_private(dir_fd, lib)
    recorded = _read_private(dir_fd, digest).decode(errors="replace").strip()
    if hashlib.sha256(data).hexdigest() != recorded:
        raise _Refused(f"{lib} does not have the SHA-256 recorded when it was built")
    return data


def _write_private(dir_fd: int, name: str, data: bytes) -> None:
    """Write `name` in the cache 0600, atomically (a temporary name, then a rename): concurrent processes (dataset
    workers, server replicas) never read a half-written file."""
    tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def _compile(build: Build, cc: str) -> bytes:
    """Compile in a private temporary directory -> the library's bytes."""
    with tempfile.TemporaryDirectory(prefix="bivit-build-") as tmp:
        out = Path(tmp) / f"{build.name}.so"
        try:
            done = subprocess.run([cc, *build.cflags, "-o", str(out), str(build.source)], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"building {build.source.name} failed: {e}", fix=INSTALL_CC) from e
        if done.returncode != 0:
            detail = " ".join(done.stderr.split())[-300:] or f"exit status {done.returncode}"
            isa = " ".join(f for f in build.cflags if f.startswith("-m"))
            raise KernelUnavailable(f"{cc} could not build {build.source.name}: {detail}",
                                    fix=f"set CC to a compiler that accepts {isa} (gcc >= 10, clang >= 9)")
        return out.read_bytes()


def library_bytes(build: Build) -> tuple[bytes, Path]:
    """The library of `build`: from the cache when a checked copy is there, else compiled now and cached
    -> (its bytes, its path in the cache)."""
    cc = compiler()
    lib_key = key(build, cc)
    lib, digest = f"{build.name}-{lib_key}.so", f"{build.name}-{lib_key}.sha256"
    dir_fd, path = open_cache()
    try:
        try:
            return _cached(dir_fd, lib, digest), path / lib
        except FileNotFoundError:
            pass
        except _Refused as e:
            log.warning("bivit: kernel cache %s: not loading %s; rebuilding it", path, e)
        # The first load on a machine takes seconds longer because of this; say why, on a logger the CLI shows.
        logging.getLogger("bivit.kernels.build").info(
            "bivit: compiling the CPU kernels for this machine (%s, with %s, once; cached in %s)",
            build.what or build.source.name, cc, path)
        data = _compile(build, cc)
        try:
            _write_private(dir_fd, digest, hashlib.sha256(data).hexdigest().encode() + b"\n")
            _write_private(dir_fd, lib, data)
        except OSError as e:
            raise KernelUnavailable(f"cannot write the kernel cache {path}: {e}", fix=WRITABLE_CACHE) from e
        return data, path / lib
    finally:
        os.close(dir_fd)


def read_record(name: str) -> dict | None:
    """A small JSON record kept in the cache (e.g. the GEMM tile plans proven on this machine), under the same
    checks as a library; None when it is missing, unreadable or fails a check (it is then made anew)."""
    try:
        dir_fd, path = open_cache()
    except KernelUnavailable as e:
        log.debug("bivit: no kernel cache for %s: %s", name, e)
        return None
    try:
        return json.loads(_read_private(dir_fd, name))
    except FileNotFoundError:
        return None
    except (_Refused, ValueError, OSError) as e:
        log.warning("bivit: kernel cache %s: not using %s (%s)", path, name, e)
        return None
    finally:
        os.close(dir_fd)


def write_record(name: str, record: dict) -> None:
    """Write a JSON record into the cache atomically; a cache that cannot be written is not an error."""
    try:
        dir_fd, path = open_cache()
    except KernelUnavailable as e:
        log.debug("bivit: no kernel cache for %s: %s", name, e)
        return
    try:
        _write_private(dir_fd, name, json.dumps(record, sort_keys=True).encode())
    except OSError as e:
        log.debug("bivit: cannot write %s to the kernel cache %s: %s", name, path, e)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class Loaded:
    """A loaded library; `fd` keeps its memory file open (and its /proc name unique) for the process's life."""

    lib: ctypes.CDLL
    path: Path
    fd: int | None


def load(build: Build) -> Loaded:
    """Build or find `build`'s library, check it, and load exactly the checked bytes."""
    data, path = library_bytes(build)
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None:  # not Linux: load the checked file itself (its directory admits no other writer)
        return Loaded(ctypes.CDLL(str(path)), path, None)
    fd = memfd_create(build.name, getattr(os, "MFD_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return Loaded(ctypes.CDLL(f"/proc/self/fd/{fd}"), path, fd)
    except OSError as e:  # memory files not executable here (vm.memfd_noexec): the checked file itself
        os.close(fd)
        log.debug("bivit: loading %s from memory failed (%s); loading the cached file", build.name, e)
        return Loaded(ctypes.CDLL(str(path)), path, None)
    except BaseException:
        os.close(fd)
        raise
