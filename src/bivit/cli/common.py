"""What every `bivit` command shares: the Typer app, the one error style, shared options, opening the encoder.

One error style for all commands: a user mistake, an unusable input or output, a missing extra or an
unavailable device prints one line `bivit: error: ...` on stderr and exits 2, before any work is done; a run
that went wrong (inputs that failed, invariant mode not bit-stable, a write failing mid-run) exits 1. Never a
traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from .. import __version__
from ..base.dtypes import CHOICES as DTYPE_CHOICES, DEFAULT_DTYPE, canonical_name
from ..base.fileio import check_writable
from ..core.spec import EncoderSpec
from ..errors import BivitError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="bivit: batch-invariant vision encoding for Kimi-K2.5/K2.6/K3.")

USAGE, FAILURE = 2, 1


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"bivit {version()}")
        raise typer.Exit()


@app.callback()
def _options(_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                           help="Print bivit's version and exit.")) -> None:
    pass

ModelOpt = typer.Option(None, "--model", help="Checkpoint directory (Moonshot weights) or hub repo id "
                        "(org/name[@revision]; only config and vision shards are fetched). Default: the demo model.")
DeviceOpt = typer.Option("cpu", "--device", help="torch device: cpu, or cuda[:N] (invariant mode runs bivit's "
                         "Triton kernels there: pip install 'bivit[gpu]').")
AlphaOpt = typer.Option("model", "--alpha", help="Transparency: model (what the model's processor does), drop, "
                        "or white (vLLM's loader: RGBA onto white).")
DtypeOpt = typer.Option(DEFAULT_DTYPE, "--dtype", help=f"Tower compute dtype: {DTYPE_CHOICES}.")
ProjDtypeOpt = typer.Option(None, "--projector-dtype", help="Projector dtype (default: --dtype).")
OutDtypeOpt = typer.Option(None, "--output-dtype", help="Output dtype (default: projector dtype).")
MaxBatchPatchesOpt = typer.Option(None, "--max-batch-patches", show_default=False,
                                  help="At most this many patches per forward pass (default 16384): bounds memory, "
                                       "never changes an embedding.")
EcDirOpt = typer.Option(None, "--ec-dir", help="Also write each image's / video chunk's rows to this folder in vLLM's "
                        "encoder-cache layout (ECExampleConnector's shared_storage_path; docs/encode-once.md).")
EC_PROBE = ".bivit-ec-probe"  # the name --ec-dir's writability is checked with


def plural(n: int, noun: str) -> str:
    """`n` and `noun`, singular for 1 ("1 input", "2 inputs")."""
    return f"{n} {noun if n == 1 else noun + 's'}"


def progress_shown() -> bool:
    """Whether progress bars go to stderr: only a terminal redraws a bar in place; in a log file or a pipe each
    redraw would be one more line."""
    return sys.stderr.isatty()


def version() -> str:
    import importlib.metadata  # 35 ms that every other command's start would pay for --version

    try:
        return importlib.metadata.version("bivit")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return __version__


def fail(message: str, code: int = USAGE) -> None:
    typer.echo(f"bivit: error: {message}", err=True)
    raise typer.Exit(code)


def need_extra(command: str, module: str, extra: str) -> None:
    """Exit with one line when an optional dependency of `command` is not installed."""
    if importlib.util.find_spec(module) is None:
        fail(f"`bivit {command}` needs the {extra!r} extra ({module} is not installed): "
             f"pip install 'bivit[{extra}]'")


def command(name: Optional[str] = None) -> Callable:
    """Register a command whose BivitErrors become the one-line error (exit 2), and whose unexpected OSErrors
    (a disk that fills up mid-run) a one-line failure (exit 1)."""
    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except BivitError as e:
                fail(str(e))
            except OSError as e:
                fail(_os_message(e), FAILURE)
        return app.command(name)(run)
    return register


def _os_message(e: OSError) -> str:
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


def writable(path: Path, inputs: Any = (), option: str = "--out") -> None:
    """Exit 2 now if the output cannot be written later (before any encoding is done)."""
    try:
        check_writable(path, inputs)
    except OSError as e:
        fail(f"{option} {path}: {e.strerror or e}")


def encoder_spec(model: Optional[str] = None, dtype: Optional[str] = None, projector_dtype: Optional[str] = None,
                 output_dtype: Optional[str] = None, alpha: str = "model", device: str = "cpu",
                 max_batch_patches: Optional[int] = None, batch_invariant: bool = True) -> EncoderSpec:
    """The encoder a command was given, as its spec (`bivit.base.options.EncoderSpec`), checked before its inputs are
    read, before any output is created and before the model loads (ConfigError naming the flag: one line, exit 2).
    The command hands it whole to `load_encoder`."""
    return EncoderSpec(model, dtype=dtype, projector_dtype=projector_dtype, output_dtype=output_dtype, alpha=alpha,
                       device=device, max_batch_patches=max_batch_patches,
                       batch_invariant=batch_invariant).checked(flags=True)
