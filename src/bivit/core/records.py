"""The one embedding file format, `FORMAT` ("bivit.embeddings/2"): its records, writing and reading a file
(`bivit.dataset.embeddings.load_embeddings` is the public reader, which also opens dataset folders).

What `bivit encode` writes, what the service answers to `POST /v1/encode?format=safetensors` and every shard of a
dataset folder are safetensors files with the same four header metadata keys:

    format    "bivit.embeddings/2"
    encoder   JSON object: what computed the embeddings (`Encoder.describe()`: model, demo, fingerprint, dtype,
              projector_dtype, output_dtype, batch_invariant, alpha, processing, text_hidden_size, kernels)
    items     JSON list: one record per item, in input order (a dataset shard: the order they were committed)
    metadata_sha256  the checksum of the three above (`bivit.core.integrity`: every reader checks it, and each record
              against itself)

and one tensor per item that has an embedding, `[tokens, text_hidden]` in the encoder's output dtype, under the
key its record names. A record (`Record`) holds the keys of `RECORD_KEYS` (each one's meaning and type:
docs/formats.md, their one home): where its embedding is and its sha256 (`tensor`, `tensor_sha256`: every
reader checks it), what the input was (`source`, `kind`, `sha256`), its rows per chunk and the chunks' grids,
sizes, timestamps and prompt placeholders, or why it has none (`error`, `error_kind`, an `ErrorKind`);
plus what only one writer knows, under keys of its own (the service: `cached`; a dataset:
`shard`, `size`, `mtime_ns`, `seq`; --ec-dir: `ec_ids`), read back into `Record.extra` (and readable as
attributes: `r.cached`). A dataset folder keeps the same records in `manifest.jsonl` and the encoder in
`dataset.json` (see `bivit.dataset.format`).

Files of older bivit versions still open: `bivit.embeddings/1` (before the checksum: its records read
unverified, said once), `bivit.encode/1` (`bivit encode`: one "bivit" JSON key),
`bivit.response/1` (the service) and dataset folders written before shards carried records; anything else is
an error naming the format it found.

A `Record` is what crosses every boundary out of the core (`Record.of_result`; `Record.to_item` back, past a Ray
row); a failed item is a record with `error` and `error_kind`, wherever it is kept (errors.jsonl included).

Imports nothing heavy (`bivit.serve.client` reads answers through it): torch loads with the first embedding read
(safetensors' own module is light; its torch half is not).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

from safetensors import safe_open  # light: torch loads with the first tensor read

from ..base.dtypes import dtype_name
from ..base.fileio import open_regular, parse_json, write_atomic
from ..errors import BivitError, ErrorKind, FormatError, MediaError
from .integrity import (CHECKSUM_KEY, check_embedding, check_metadata, check_record, embedding_sha256, metadata_sha256,
                        said_unverified)

if TYPE_CHECKING:  # type hints only
    import torch

FORMAT = "bivit.embeddings/2"  # 2: the metadata's checksum (`bivit.core.integrity`)
# Formats this reader maps onto records (older bivit versions).
FORMAT_1 = "bivit.embeddings/1"
ENCODE_FORMAT_1 = "bivit.encode/1"
RESPONSE_FORMAT_1 = "bivit.response/1"
READS = (FORMAT, FORMAT_1, ENCODE_FORMAT_1, RESPONSE_FORMAT_1)
# The keys of a record, in the order files list them.
RECORD_KEYS = ("tensor", "tensor_sha256", "source", "kind", "sha256", "tokens", "grid_thw", "chunk_tokens", "sizes",
               "timestamps", "placeholders", "error", "error_kind")
# A safetensors header longer than this is not one bivit wrote (it bounds what a corrupt file makes us read).
MAX_HEADER_BYTES = 256 * 2**20


@dataclass
class Record:
    """One item of an embedding file: its metadata (see the module doc), `embedding` (read on first use) and
    the encoder that computed it (`encoder`: shared by the file's records; `model`, `fingerprint`, `dtype` are
    read from it)."""

    source: str
    kind: str = "image"
    sha256: Optional[str] = None
    tokens: int = 0
    grid_thw: list = field(default_factory=list)
    chunk_tokens: list = field(default_factory=list)
    sizes: list = field(default_factory=list)
    timestamps: Optional[list] = None
    placeholders: list = field(default_factory=list)
    error: Optional[str] = None
    error_kind: Optional[ErrorKind] = None
    tensor: Optional[str] = None
    tensor_sha256: Optional[str] = None
    extra: dict = field(default_factory=dict)
    encoder: dict = field(default_factory=dict, repr=False, compare=False)
    _load: Optional[Callable[[str], "torch.Tensor"]] = field(default=None, repr=False, compare=False)
    _embedding: Optional["torch.Tensor"] = field(default=None, repr=False, compare=False)
    _file: Optional[str] = field(default=None, repr=False, compare=False)  # where `_load` reads, for messages
    _embedding_sha256: Optional[str] = field(default=None, repr=False, compare=False)

    def __getattr__(self, name: str) -> Any:
        # A writer's own keys read as attributes too (`r.cached` of a service answer); only those.
        extra = self.__dict__.get("extra") or {}
        if name in extra and not name.startswith("_"):
            return extra[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def embedding(self) -> Optional["torch.Tensor"]:
        """`[tokens, text_hidden]` in the encoder's output dtype (None for an item that failed); FormatError naming
        the file and the tensor when the stored tensor does not match its record (rows, dtype, checksum)."""
        if self._embedding is None and self.tensor is not None and self._load is not None:
            embedding = self._load(self.tensor)
            check_embedding(embedding, self.tokens or sum(self.chunk_tokens), self.dtype,
                            f"tensor {self.tensor!r} of {self.source!r}", self.tensor_sha256, self._file)
            self._embedding = embedding
        return self._embedding

    @property
    def embedding_sha256(self) -> Optional[str]:
        """The checksum its embedding is filed with (`tensor_sha256`; `bivit.core.integrity.embedding_sha256` of one
        in memory), computed once: copies made with `dataclasses.replace` after it keep it (the service files one
        record under every copy of an item in a request)."""
        if self._embedding_sha256 is None:
            e = None if self.tensor_sha256 is not None else self.embedding
            self._embedding_sha256 = self.tensor_sha256 if e is None else embedding_sha256(e)
        return self._embedding_sha256

    @property
    def chunks(self) -> list["torch.Tensor"]:
        """Per chunk, its rows of `embedding` (views); [] for an item that failed."""
        e = self.embedding
        return [] if e is None else list(e.split(self.chunk_tokens))

    @property
    def model(self) -> Optional[str]:
        return self.encoder.get("model")

    @property
    def fingerprint(self) -> Optional[str]:
        return self.encoder.get("fingerprint")

    @property
    def dtype(self) -> Optional[str]:
        """The embedding's dtype by name (the encoder's output dtype)."""
        return self.encoder.get("output_dtype")

    def to_json(self) -> dict:
        """The record as files list it: `RECORD_KEYS`, then the writer's own keys."""
        out = {"tensor": self.tensor, "tensor_sha256": self.tensor_sha256, "source": self.source, "kind": self.kind,
               "sha256": self.sha256,
               "tokens": int(self.tokens), "grid_thw": [list(map(int, g)) for g in self.grid_thw],
               "chunk_tokens": [int(n) for n in self.chunk_tokens],
               "sizes": chunk_sizes(self.sizes, len(self.grid_thw)), "timestamps": self.timestamps,
               "placeholders": [dict(p) for p in self.placeholders], "error": self.error, "error_kind": self.error_kind}
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def of_result(cls, result: Any, tensor: Optional[str] = None, *, source: Optional[str] = None,
                  named: bool = False, **extra: Any) -> "Record":
        """The one converter from the core's shape: a result's (`ItemResult`, or a `Prepared`) record, its embedding
        in memory (in a file under `tensor`), filed under `source` (default its own); `named`: its error reads
        "SOURCE: reason" (the service, errors.jsonl), else the reason alone; `extra`: the writer's own keys."""
        name = result.source if source is None else source
        if result.error is not None:
            return cls.of_error(name, result.kind, result.error, result.sha256, about=result.source, named=named,
                                **extra)
        embedding = getattr(result, "embedding", None)  # a `Prepared` (Ray's rows) has none yet
        grid = [list(map(int, g)) for g in result.grid_thw]
        chunk_tokens = [int(n) for n in result.chunk_tokens]
        return cls(source=name, kind=result.kind, sha256=result.sha256, tokens=sum(chunk_tokens), grid_thw=grid,
                   chunk_tokens=chunk_tokens, sizes=chunk_sizes(result.sizes, len(grid)),
                   timestamps=None if result.timestamps is None else list(result.timestamps),
                   placeholders=[p if isinstance(p, dict) else p.to_dict() for p in result.placeholders],
                   tensor=tensor, tensor_sha256=None if embedding is None or tensor is None
                   else result.embedding_sha256, extra=dict(extra), _embedding=embedding)

    @classmethod
    def of_error(cls, source: str, kind: str, error: BaseException, sha256: Optional[str] = None, *,
                 about: Optional[str] = None, named: bool = False, **extra: Any) -> "Record":
        """The record of an input that failed with `error` (in the core, or refused before it), filed under
        `source`: its reason (`error_text`, about the input the error was raised for: `about`, default `source`)
        and its kind; `named` and `extra` as in `of_result`."""
        reason = error_text(error, source if about is None else about)
        return cls(source=source, kind=kind, sha256=sha256, error=f"{source}: {reason}" if named else reason,
                   error_kind=ErrorKind.of(error), extra=dict(extra))

    def to_item(self, cls: type) -> Any:
        """`of_result`'s inverse past a process boundary (Ray rows): its metadata as `cls` (`ItemResult`, `Prepared`),
        no pixels or embedding; an error as its kind's exception class, with the record's reason."""
        from ..media.pixels import Placeholder  # torch and PIL: a record alone stays light (`bivit.serve.client`)

        if self.error is not None:
            kind = self.error_kind if self.error_kind is not None and self.error_kind.item else ErrorKind.INVALID
            return cls(self.source, self.kind, self.sha256, error=kind.exception(self.error))
        return cls(self.source, self.kind, self.sha256, [list(g) for g in self.grid_thw], self.timestamps,
                   [Placeholder(p["text"], int(p["tokens"])) for p in self.placeholders],
                   sizes=[None if z is None else tuple(z) for z in self.sizes])

    @staticmethod
    def from_json(obj: Mapping[str, Any], encoder: Optional[dict] = None,
                  load: Optional[Callable[[str], "torch.Tensor"]] = None, file: Optional[str] = None) -> "Record":
        """A record as a file lists it (`load` reads its tensor from `file`); FormatError naming `file`, the
        record and the field for one that is not a bivit record or contradicts itself (`check_record`)."""
        where = f"{file}: " if file else ""
        if not isinstance(obj, Mapping) or not isinstance(obj.get("source"), str):
            raise FormatError(f"{where}not a bivit record (no 'source'): {str(obj)[:200]}")
        check_record(obj, where)
        try:
            return replace(Record._from_json(obj, encoder, load), _file=file)
        except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong type, from a file
            raise FormatError(f"{where}not a bivit record ({type(e).__name__}: {e}): {str(obj)[:200]}") from None

    @staticmethod
    def _from_json(obj: Mapping[str, Any], encoder: Optional[dict],
                   load: Optional[Callable[[str], "torch.Tensor"]]) -> "Record":
        for key, types in (("tensor", (str, type(None))), ("tensor_sha256", (str, type(None))),
                           ("tokens", (int, type(None))),
                           ("sha256", (str, type(None))), ("kind", (str, type(None)))):
            if not isinstance(obj.get(key), types) or isinstance(obj.get(key), bool):
                raise TypeError(f"{key!r} is a {type(obj.get(key)).__name__}")
        grid = [[int(n) for n in g] for g in obj.get("grid_thw") or []]
        chunk_tokens = obj.get("chunk_tokens")
        if chunk_tokens is None:  # records of older files: the tower's rule, h/2 * w/2 per chunk
            chunk_tokens = [(h // 2) * (w // 2) for _, h, w in grid]
        return Record(source=obj["source"], kind=obj.get("kind") or "image", sha256=obj.get("sha256"),
                      tokens=int(obj.get("tokens") or 0), grid_thw=grid, chunk_tokens=[int(n) for n in chunk_tokens],
                      sizes=chunk_sizes(obj.get("sizes"), len(grid)),  # older files: not recorded
                      timestamps=obj.get("timestamps"), placeholders=list(obj.get("placeholders") or []),
                      error=obj.get("error"), error_kind=ErrorKind.read(obj.get("error_kind")),
                      tensor=obj.get("tensor"), tensor_sha256=obj.get("tensor_sha256"),
                      extra={k: v for k, v in obj.items() if k not in RECORD_KEYS},
                      encoder=encoder if encoder is not None else {}, _load=load)


def chunk_sizes(sizes: Optional[Sequence], chunks: int) -> list:
    """A record's `sizes` as files list them: per chunk [width, height] or None; all None when not known."""
    return [None if z is None else [int(v) for v in z] for z in sizes] if sizes else [None] * chunks


def error_text(error: BaseException, source: str) -> str:
    """An item's error as its record keeps it: the reason, without the source the record names already (a
    MediaError about another file, e.g. one frame of a video, keeps its whole message); an exception that is not
    bivit's (a bug) with its type."""
    if isinstance(error, MediaError):
        return error.about(source)
    return str(error) if isinstance(error, BivitError) else f"encode failed: {type(error).__name__}: {error}"


def metadata(encoder: Mapping[str, Any], records: Sequence[Record]) -> dict[str, str]:
    """The safetensors header metadata of a file of `records` computed by `encoder` (`Encoder.describe()`), with
    its checksum."""
    meta = {"format": FORMAT, "encoder": json.dumps(dict(encoder), separators=(",", ":")),
            "items": json.dumps([r.to_json() for r in records], separators=(",", ":"), ensure_ascii=False)}
    return {**meta, CHECKSUM_KEY: metadata_sha256(meta)}


# The most of a tensor's bytes `file_pieces` copies at a time.
PIECE_BYTES = 2**20
# Safetensors' names of the dtypes an embedding file holds.
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def file_pieces(encoder: Mapping[str, Any], records: Sequence[Record],
                embeddings: Sequence[Optional["torch.Tensor"]]) -> tuple[int, Iterator[bytes]]:
    """A file as (its length, its bytes in pieces made when asked for), safetensors' layout: 8-byte header length,
    JSON header padded to 8 bytes, the tensors back to back; each record's embedding under its `tensor` key, copies
    of one item read from one tensor (safetensors' writer refuses shared storage: 199 clones for 200 copies)."""
    import torch  # heavy (torch): as in `embedding_sha256`

    header: dict[str, Any] = {"__metadata__": metadata(encoder, records)}
    tensors, offset = [], 0
    for r, e in zip(records, embeddings):
        if r.tensor is None or e is None or r.tensor in header:
            continue
        t = e.detach().cpu().contiguous()
        size = t.numel() * t.element_size()
        header[r.tensor] = {"dtype": _DTYPES[dtype_name(t.dtype)], "shape": list(t.shape),
                            "data_offsets": [offset, offset + size]}
        tensors.append(t)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def pieces() -> Iterator[bytes]:
        yield struct.pack("<Q", len(text)) + text
        for t in tensors:
            data = t.reshape(-1).view(torch.uint8).numpy()
            for start in range(0, data.size, PIECE_BYTES):
                yield data[start:start + PIECE_BYTES].tobytes()

    return 8 + len(text) + offset, pieces()


def to_bytes(encoder: Mapping[str, Any], records: Sequence[Record], embeddings: Sequence[Optional["torch.Tensor"]]
             ) -> bytes:
    """A whole file in memory (`file_pieces` joined)."""
    return b"".join(file_pieces(encoder, records, embeddings)[1])


def save(path: str | os.PathLike, encoder: Mapping[str, Any], records: Sequence[Record],
         embeddings: Sequence[Optional["torch.Tensor"]]) -> None:
    """Write a file atomically (`bivit.base.fileio.write_atomic`: a reader sees the old file or the whole new one),
    serialised in memory first so that a full disk is an OSError naming `path`."""
    write_atomic(path, to_bytes(encoder, records, embeddings))


# ------------------------------------------------------------------------------------------------ reading

class Embeddings(Sequence[Record]):
    """The records of one file or dataset folder, in input (or manifest) order: `len`, iteration, `[i]`,
    `get(source)`; `encoder` (what computed them), `format` (the format the file was written in), `path`."""

    def __init__(self, records: list[Record], encoder: dict, format: str, path: Optional[str] = None,
                 close: Optional[Callable[[], None]] = None) -> None:
        self.records, self.encoder, self.format, self.path = records, encoder, format, path
        self._close = close
        self._by_source = {r.source: r for r in records}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: Any) -> Any:
        return self.records[i]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def get(self, source: str, default: Any = None) -> Optional[Record]:
        """The (last) record of `source`, or `default`."""
        return self._by_source.get(source, default)

    @property
    def sources(self) -> list[str]:
        return [r.source for r in self.records]

    @property
    def fingerprint(self) -> Optional[str]:
        return self.encoder.get("fingerprint")

    def close(self) -> None:
        """Release the open files (also `with load_embeddings(...) as e:`); embeddings read so far stay."""
        if self._close is not None:
            self._close()

    def __enter__(self) -> "Embeddings":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{self.path!r}, " if self.path else ""
        return f"Embeddings({where}{len(self)} items, format {self.format}, model {self.encoder.get('model')!r})"


def file_metadata(path: str | os.PathLike) -> dict:
    """The safetensors header metadata of an embedding file on disk (its tensors unread); BivitError naming the
    file when it cannot be read, FormatError when it is not a safetensors file."""
    p = Path(path)
    try:
        with open_regular(p) as f:  # a FIFO or device is refused without blocking
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{p}: not a safetensors file ({len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise FormatError(f"{p}: not a safetensors file (header of {n} bytes)")
            header = f.read(n)
    except FileNotFoundError:
        raise BivitError(f"{p}: does not exist") from None
    except IsADirectoryError:
        raise BivitError(f"{p}: is a directory") from None
    except OSError as e:
        raise BivitError(f"{p}: cannot read ({e.strerror or e})") from None
    return _header_metadata(header, str(p))


def read_file(path: str | os.PathLike, meta: Optional[dict] = None) -> Embeddings:
    """One embedding file on disk (`meta`: its `file_metadata`, when read already) -> Embeddings, tensors read
    on first use. FormatError for a file that is not one, or of a format version this bivit does not read.
    `bivit.dataset.embeddings.load_embeddings` opens dataset folders and their shards too."""
    p = Path(path)
    meta = file_metadata(p) if meta is None else meta
    handle: dict[str, Any] = {}

    def load(key: str) -> "torch.Tensor":
        try:
            if "f" not in handle:
                handle["f"] = safe_open(str(p), framework="pt")
            return handle["f"].get_tensor(key)
        except Exception as e:  # noqa: BLE001 - a missing key or a damaged file, named
            raise FormatError(f"{p}: no readable tensor {key!r} ({e})") from None

    return _records(meta, str(p), load, handle.clear)


def from_bytes(body: bytes, name: str = "response") -> Embeddings:
    """A whole file held in memory (a service answer), its embeddings read at once."""
    if len(body) < 8:
        raise FormatError(f"{name}: not a safetensors file ({len(body)} bytes)")
    (n,) = struct.unpack("<Q", body[:8])
    if n > min(MAX_HEADER_BYTES, len(body) - 8):
        raise FormatError(f"{name}: not a safetensors file (header of {n} bytes)")
    meta = _header_metadata(body[8:8 + n], name)
    tensors: dict = {}

    def load(key: str) -> "torch.Tensor":
        if not tensors:
            # heavy (torch, by safetensors.torch): with the first embedding read, as above
            from safetensors.torch import load as st_load

            try:
                tensors.update(st_load(body))
            except Exception as e:  # noqa: BLE001 - SafetensorError and whatever a damaged file raises
                raise FormatError(f"{name}: not a readable safetensors file ({e})") from None
        if key not in tensors:
            raise FormatError(f"{name}: no tensor {key!r}")
        return tensors[key]

    out = _records(meta, name, load, None)
    for r in out:  # an answer is read whole: its tensors are already in memory
        r.embedding  # noqa: B018 - loads it
    return out


def _header_metadata(header: bytes, name: str) -> dict:
    try:
        meta = parse_json(header).get("__metadata__") or {}
    except (ValueError, AttributeError):  # UnicodeDecodeError, too deep, a repeated key included
        raise FormatError(f"{name}: not a safetensors file (unreadable header)") from None
    if not isinstance(meta, dict):
        raise FormatError(f"{name}: not a bivit embedding file (metadata is not an object)")
    return meta


def _json(meta: dict, key: str, name: str, fmt: str) -> Any:
    try:
        return parse_json(meta[key])
    except KeyError:
        raise FormatError(f"{name}: a {fmt} file without its {key!r} metadata") from None
    except (TypeError, ValueError) as e:
        raise FormatError(f"{name}: {fmt} metadata {key!r} is not JSON ({e})") from None


def _records(meta: dict, name: str, load: Callable, close: Optional[Callable]) -> Embeddings:
    """The records of a file's header metadata, in whichever format it was written."""
    fmt = meta.get("format")
    if fmt is None and "bivit" in meta:  # bivit.encode/1: everything under one JSON key
        old = _json(meta, "bivit", name, ENCODE_FORMAT_1)
        fmt = old.get("format") if isinstance(old, dict) else None
        if fmt == ENCODE_FORMAT_1:
            items = old.pop("items", [])
            encoder = {k: v for k, v in old.items() if k != "format"}
            rows = [{**i, "tensor": i.get("key"), "kind": i.get("kind") or ("video" if i.get("timestamps") else "image")}
                    for i in items]
            return _build(rows, encoder, fmt, name, load, close)
    if fmt in (FORMAT, FORMAT_1):
        if fmt == FORMAT:
            check_metadata(meta, name)
        else:
            said_unverified(name, f"format {FORMAT_1} (before metadata checksums): its records are read unverified")
        encoder = _json(meta, "encoder", name, fmt)
        rows = _json(meta, "items", name, fmt)
        return _build(rows, encoder, fmt, name, load, close)
    if fmt == RESPONSE_FORMAT_1:  # the service before records: name/error keys, model/fingerprint/dtype apart
        rows = [{**i, "source": i.get("name")} for i in _json(meta, "items", name, fmt)]
        encoder = {"model": meta.get("model"), "fingerprint": meta.get("fingerprint"),
                   "output_dtype": meta.get("dtype")}
        return _build(rows, encoder, fmt, name, load, close)
    if fmt is None:
        raise FormatError(f"{name}: not a bivit embedding file (no 'format' in its metadata)")
    raise FormatError(f"{name}: format {fmt!r}, which this bivit does not read (it reads {', '.join(READS)}); "
                      "a newer bivit wrote it?")


def _build(rows: Any, encoder: Any, fmt: str, name: str, load: Callable, close: Optional[Callable]) -> Embeddings:
    if not isinstance(rows, list) or not isinstance(encoder, dict):
        raise FormatError(f"{name}: {fmt} metadata of the wrong shape (items must be a list, encoder an object)")
    # A record without its tensor's checksum is one of a file written before them, and such a file has none:
    # beside records that have one it is damage (or the key altered to pass as old).
    if fmt in (FORMAT, FORMAT_1) and (fmt == FORMAT or any(isinstance(r, dict) and r.get("tensor_sha256")
                                                           for r in rows)):
        bare = next((r for r in rows if isinstance(r, dict) and r.get("tensor") is not None
                     and r.get("tensor_sha256") is None), None)
        if bare is not None:
            raise FormatError(f"{name}: record {str(bare.get('source'))[:200]!r} names tensor "
                              f"{str(bare['tensor'])[:100]!r} without its 'tensor_sha256'")
    return Embeddings([Record.from_json(r, encoder, load, name) for r in rows], encoder, fmt, name, close)
