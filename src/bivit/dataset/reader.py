"""Reading a folder written by `bivit encode-dataset`: `open_dataset(path)` -> EncodedDataset.

Cheap to import (torch and safetensors load on the first tensor read), so `import bivit` and
`bivit.open_dataset` stay fast.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from safetensors import safe_open

from ..base.dtypes import dtype_name, parse_dtype
from ..core import records
from ..core.integrity import check_embedding
from ..core.records import Record
from ..errors import BivitError, FormatError
from ..media.kinds import media_kind
from .format import FORMAT, HEADER, MANIFEST, current_state, encoder_of, read_header

if TYPE_CHECKING:  # type hints only
    import numpy as np
    import torch


class EncodedDataset:
    """A folder written by `bivit encode-dataset`, opened for reading.

    `len(ds)`, `for rec in ds`, `ds[source]` / `ds.get(source)` -> Record, `ds.by_hash(sha)` -> [Record, ...],
    `ds.tensor(source_or_record)` -> torch.Tensor `[tokens, text_hidden]` in the stored dtype,
    `ds.numpy(source_or_record)` -> np.ndarray (bfloat16 has no numpy dtype: it is returned as float32, which
    holds every bfloat16 value exactly; float16/float32 are returned as they are stored).
    A source that was re-encoded after its file changed is reported with its latest record; a source whose
    latest attempt failed is in `errors` (with the reason), not among the records.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header = read_header(self.path)
        if header is None:
            raise BivitError(f"{self.path}: not an encoded dataset (no {HEADER})")
        self.header: dict = header
        by_source, failed = current_state(self.path, header)
        self._by_source = by_source
        self.records: list[Record] = list(by_source.values())
        self._by_hash: dict[str, list[Record]] = {}
        for rec in self.records:
            self._by_hash.setdefault(rec.sha256, []).append(rec)
        self.errors: list[Record] = list(failed.values())  # each with `error`, `error_kind`, `seq`
        self._handles: dict[str, Any] = {}

    @property
    def fingerprint(self) -> str:
        return self.header["fingerprint"]

    @property
    def dtype(self) -> "torch.dtype":
        return parse_dtype(self.header["output_dtype"], "output_dtype")

    @property
    def sources(self) -> list[str]:
        return [r.source for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __contains__(self, source: object) -> bool:
        return source in self._by_source

    def __getitem__(self, source: str) -> Record:
        try:
            return self._by_source[source]
        except KeyError:
            raise KeyError(f"{source!r} is not in {self.path / MANIFEST}") from None

    def get(self, source: str, default: Any = None) -> Any:
        return self._by_source.get(source, default)

    def by_hash(self, sha256: str) -> list[Record]:
        """Every record whose file had these bytes (they share one stored tensor); [] if none."""
        return list(self._by_hash.get(sha256.lower(), []))

    def tensor(self, item: "str | Record") -> "torch.Tensor":
        """The stored embedding of a record: read from its shard, a regular file inside this folder (a link out
        of it is refused), and checked against the record (rows, dtype, checksum); FormatError naming the shard
        and the tensor otherwise."""
        rec = item if isinstance(item, Record) else self[item]
        tensor = self._read(rec)
        check_embedding(tensor, rec.tokens, self.header.get("output_dtype"), f"tensor {rec.tensor!r} of "
                        f"{rec.source!r}", rec.tensor_sha256, str(self.path / rec.shard))
        return tensor

    def _read(self, rec: Record) -> "torch.Tensor":
        """A record's tensor from its shard, unchecked."""
        path = self.path / rec.shard  # a plain file name: checked when the manifest was read
        handle = self._handles.get(rec.shard)
        if handle is None:
            if not path.exists():
                raise BivitError(f"{path}: shard missing (needed for {rec.source!r})")
            if os.path.dirname(os.path.realpath(path)) != os.path.realpath(self.path):
                raise FormatError(f"{path}: a link to a file outside the dataset folder")
            if not stat.S_ISREG(path.stat().st_mode):
                raise FormatError(f"{path}: not a regular file")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - SafetensorError and whatever a damaged file raises
                raise FormatError(f"{path}: not a readable safetensors file ({e})") from None
            self._handles[rec.shard] = handle
        try:
            return handle.get_tensor(rec.tensor)
        except Exception as e:
            raise FormatError(f"{path}: no tensor {rec.tensor!r} for {rec.source!r} ({e})") from None

    def numpy(self, item: "str | Record") -> "np.ndarray":
        t = self.tensor(item)  # torch's, read from the shard: this module (the CLI's start) imports no torch
        if dtype_name(t.dtype) == "bfloat16":
            t = t.float()  # exact: every bfloat16 is a float32
        return t.numpy()

    def embeddings(self, shard: Optional[str] = None) -> Any:
        """The folder as `bivit.core.records.Embeddings` (what `bivit.load_embeddings` gives for it): its records in
        manifest order, each reading its embedding on first use, then its failed inputs (`errors`) in the order
        they failed, each a record with `error` set and no embedding, as a `bivit encode` file keeps a failed
        input; `shard`: only the records stored in that shard (in the order they were committed)."""
        encoder = encoder_of(self.header)
        # Each record checks what it reads (`Record.embedding`), against its shard.
        recs = [dataclasses.replace(r, encoder=encoder, _load=lambda key, r=r: self._read(r),
                                    _file=str(self.path / r.shard)) for r in self.records
                if shard is None or r.shard == shard]
        if shard is None:
            # The reason alone, as a `bivit encode` record keeps it: the record names the source already.
            recs += [dataclasses.replace(e, kind=media_kind(e.source) or "image", encoder=encoder,
                                         error=e.error.removeprefix(f"{e.source}: "), extra={"seq": e.seq})
                     for e in sorted(self.errors, key=lambda e: e.seq)]
        where = self.path if shard is None else self.path / shard
        return records.Embeddings(recs, encoder, f"{FORMAT}/{self.header.get('format_version')}", str(where),
                                  self.close)

    def chunks(self, item: "str | Record") -> list["torch.Tensor"]:
        """A video's embedding cut back into its chunks (one element for an image)."""
        rec = item if isinstance(item, Record) else self[item]
        return list(self.tensor(rec).split(rec.chunk_tokens))

    def close(self) -> None:
        """Release the open shard files (also done by `with open_dataset(...) as ds:`)."""
        self._handles.clear()

    def __enter__(self) -> "EncodedDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EncodedDataset({str(self.path)!r}, {len(self)} records, {len(self.errors)} errors)"


def open_dataset(path: str | os.PathLike) -> EncodedDataset:
    """Open a folder written by `bivit encode-dataset` (see EncodedDataset)."""
    return EncodedDataset(path)
