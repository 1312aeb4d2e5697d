"""Installs of bivit other than the one under test, made on disk: the installed package copied with some of its
compiled kernel libraries left out (what a build without one variant, or without any, installs), importable with
`env_for` (PYTHONPATH first)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import bivit
from bivit import kernels


def package_without(root: Path, variants: Iterable[str]) -> Path:
    """A copy of the installed bivit package under `root` without the libraries of `variants` -> the folder to
    put first on PYTHONPATH."""
    src = Path(bivit.__file__).parent
    dest = root / "bivit"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for v in kernels.VARIANTS:
        if v.name in set(variants):
            path = kernels.library_path(v)
            assert path is not None, f"the install under test has no {v.name} library to leave out"
            (dest / "kernels" / path.name).unlink()
    return root


def env_for(root: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that imports bivit from `root`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), **extra}
