"""The `bivit` command line: one module per command, the app and the error style in `common`.

    common   the Typer app, one-line errors (exit 2 for a mistake, 1 for a failed run), shared options
    encode   bivit encode            verify   bivit verify          serve    bivit serve
    dataset  bivit encode-dataset    bench    bivit bench

Commands import what they need when they run, so `bivit serve` without the serve extra says which extra to
install instead of "No such option". Each command parses its options and formats its output; the work between
is the library's.
"""

from __future__ import annotations

import logging

from . import encode, verify, serve, dataset, bench  # noqa: F401  (registers the commands, in help order)
from .common import app

__all__ = ["app", "main"]


def main() -> None:
    from ..allocator import tune

    tune()  # this process is bivit's own: keep freed activation memory for the next forward pass
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # The demo notice is printed once by the CLI itself; keep the library's logger quiet about it.
    logging.getLogger("bivit").setLevel(logging.ERROR)
    app()
