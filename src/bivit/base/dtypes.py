"""Dtypes by name: the spellings bivit accepts, the canonical name of each, and the defaults cascade.

An encoder has three dtypes: the tower computes in `dtype` (default bfloat16), the projector in
`projector_dtype` (default: the tower's), and embeddings are returned in `output_dtype` (default: the
projector's). Every front end passes the user's spellings through here; none keeps its own list.

Imports no torch at module level: the CLI reads the names and defaults for its help text before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

from ..errors import ConfigError

if TYPE_CHECKING:  # type hints only
    import torch

# Accepted spelling -> canonical name (the name `torch.<name>` has, and the one files and headers store).
ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
DEFAULT_DTYPE = "bfloat16"
CHOICES = "bfloat16, float32 or float16"  # for messages and help texts

DtypeLike = Union[str, "torch.dtype", None]


def dtype_name(dtype: "torch.dtype") -> str:
    """Canonical name of a torch dtype: "bfloat16", "float32", ..."""
    return str(dtype).removeprefix("torch.")


def canonical_name(value: DtypeLike, option: str) -> Optional[str]:
    """The canonical name of an accepted spelling (or torch dtype); None stays None; ConfigError names `option`."""
    if value is None:
        return None
    name = str(value).lower().removeprefix("torch.")
    if name not in ALIASES:
        where = f"{option} {value!r}" if option.startswith("--") else f"option {option!r} = {value!r}"
        raise ConfigError(f"{where}: expected {CHOICES}")
    return ALIASES[name]


def dtype_option(value: str, option: str, runs: Optional[Sequence[str]] = None) -> str:
    """A command's dtype option -> its canonical name. Every command accepts the same spellings and refuses the
    others with the same line (`canonical_name`); `runs`: the dtypes this command can run when it cannot run all
    (a dtype outside them is refused naming them)."""
    name = canonical_name(value, option)
    if runs is not None and name not in runs:
        raise ConfigError(f"{option} {value!r}: this command runs {' or '.join(runs)}, not {name}")
    return name


def parse_dtype(value: DtypeLike, option: str) -> Optional["torch.dtype"]:
    """A torch dtype from an accepted spelling (a torch dtype passes through); None stays None."""
    import torch  # the CLI checks spellings (`canonical_name`) before torch loads; this is for the library

    if value is None or isinstance(value, torch.dtype):
        return value
    return getattr(torch, canonical_name(value, option))


def resolve_dtypes(dtype: DtypeLike = DEFAULT_DTYPE, projector_dtype: DtypeLike = None,
                   output_dtype: DtypeLike = None) -> tuple["torch.dtype", "torch.dtype", "torch.dtype"]:
    """(tower, projector, output) dtypes with the defaults applied: projector <- tower, output <- projector."""
    tower = parse_dtype(DEFAULT_DTYPE if dtype is None else dtype, "dtype")
    projector = parse_dtype(projector_dtype, "projector_dtype") or tower
    return tower, projector, parse_dtype(output_dtype, "output_dtype") or projector
