"""`load_embeddings`: the one reader of everything bivit writes, a single embedding file (`bivit.core.records`) or a
dataset folder and its shards (`bivit.dataset`). It sits above both, so neither imports the other."""

from __future__ import annotations

import os
from pathlib import Path

from ..base.fileio import open_regular
from ..core import records
from ..core.records import Embeddings
from ..errors import FormatError
from ..media.kinds import SNIFF_BYTES, sniff
from . import format as dataset_format
from .reader import open_dataset


def load_embeddings(path: str | os.PathLike) -> Embeddings:
    """Open any embedding file bivit writes (`bivit.core.records`): a `bivit encode` file, a saved service answer, a
    dataset shard, or a whole dataset folder -> Embeddings, the items in input (or manifest) order, each a Record
    with `.embedding` (read on first use) and its metadata. FormatError for a file that is not one, or of a
    format version this bivit does not read (the message names it)."""
    p = Path(path)
    if p.is_dir():
        return open_dataset(p).embeddings()
    try:
        meta = records.file_metadata(p)
    except FormatError:
        what = _media(p)
        if what is None:
            raise
        raise FormatError(f"{p}: {what}, not an embedding file (encode it first: bivit encode {p})") from None
    if meta.get("format") == dataset_format.FORMAT:  # a shard of an older dataset folder: its records are there
        if not (p.parent / dataset_format.HEADER).is_file():
            raise FormatError(f"{p}: a dataset shard written by an older bivit, whose records are in its folder's "
                              f"{dataset_format.MANIFEST}; open it inside that folder (no {dataset_format.HEADER} "
                              f"next to it)")
        return open_dataset(p.parent).embeddings(shard=p.name)
    return records.read_file(p, meta)


def _media(path: Path) -> str | None:
    """What media a file that is not an embedding file is ("a PNG image"), when it is media."""
    try:
        with open_regular(path) as f:  # never waits on a FIFO put in the file's place since
            return sniff(f.read(SNIFF_BYTES))
    except OSError:
        return None
