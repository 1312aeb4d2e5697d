"""The `bivit` command line: one module per command, the app and the error style in `common`.

    common   the Typer app, one-line errors (exit 2 for a mistake, 1 for a failed run), shared options
    encode   bivit encode            verify   bivit verify          serve    bivit serve
    dataset  bivit encode-dataset    bench    bivit bench           doctor   bivit doctor

Commands import what they need when they run, so `bivit serve` without the serve extra says which extra to
install instead of "No such option". Each command parses its options and formats its output; the work between
is the library's.
"""

from __future__ import annotations

import logging

from ..base.allocator import tune
from . import encode, verify, serve, dataset, bench, doctor  # noqa: F401  (registers the commands, in help order)
from .common import app

__all__ = ["app", "main"]


class _Once(logging.Filter):
    """Each distinct line once per process: a command that loads two encoders (verify) says the demo notice or a
    disabled kernel once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        line = record.getMessage()
        if line in self.seen:
            return False
        self.seen.add(line)
        return True


def main() -> None:
    tune()  # this process is bivit's own: keep freed activation memory for the next forward pass
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # The library's warnings (the demo notice, a fast path that is off and why: bivit.base.notices) are one line each
    # on stderr, said once; `bivit serve` replaces this with its JSON log lines.
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Once())
    logging.getLogger("bivit").setLevel(logging.WARNING)
    # The one INFO line shown: the first load on a machine compiles the kernels, seconds with no output otherwise.
    logging.getLogger("bivit.kernels.build").setLevel(logging.INFO)
    app()
