"""bivit's per-input results as engines and trainers consume them: `Media` (an input's rows, its prompt
placeholders, the encoder fingerprint and the content hash), `encode`, bivit's outputs read as Media
(`load_media`: over `bivit.load_embeddings`, the one reader) and each item's id (`ec_id`).

The id pins the encoder and the content: `bivit encode`, `encode-dataset`, the service and `encode` give one
image (one video chunk) one id, and anything that could change its rows changes it. vLLM uses it as the item's
encoder-cache key (`bivit.integrations.vllm`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from ..core.encoder_cache import ec_id
from ..core.items import ItemResult
from ..core.records import Record
from ..dataset.embeddings import load_embeddings
from ..errors import BivitError
from ..media.pixels import Placeholder

@dataclass(frozen=True)
class Media:
    """One input as bivit encoded it: what every engine input below is built from.

    `embedding` `[tokens, hidden]` holds the rows of every placeholder in order (a video: its chunks);
    `placeholders` one per image or video chunk (the text the model's processor writes and the rows that
    replace its `<|media_pad|>`); `fingerprint` the encoder's (weights, dtypes, mode, preprocessing);
    `sha256` the content hash of the input's bytes (of its decoded pixels for an in-memory image); `sizes`
    per placeholder the (width, height) of the image or of the chunk's frames before resizing (None: unknown);
    `frames` per placeholder the frames it holds (1 for an image).
    """

    embedding: torch.Tensor
    placeholders: tuple[Placeholder, ...]
    fingerprint: str
    sha256: str
    kind: str = "image"
    sizes: tuple[Optional[tuple[int, int]], ...] = ()
    frames: tuple[int, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "placeholders", tuple(self.placeholders))
        object.__setattr__(self, "sizes", tuple(self.sizes) or (None,) * len(self.placeholders))
        object.__setattr__(self, "frames", tuple(self.frames) or (1,) * len(self.placeholders))
        if self.kind not in ("image", "video"):
            raise BivitError(f"{self.source or 'media'}: kind {self.kind!r} is not 'image' or 'video'")
        if self.embedding.ndim != 2:
            raise BivitError(f"{self.source or 'media'}: embedding must be [tokens, hidden], got "
                             f"{list(self.embedding.shape)}")
        announced = sum(p.tokens for p in self.placeholders)
        if announced != self.embedding.shape[0]:
            raise BivitError(f"{self.source or 'media'}: its placeholders announce {announced} rows "
                             f"({', '.join(str(p.tokens) for p in self.placeholders)}) but the embedding has "
                             f"{self.embedding.shape[0]}")
        if not (len(self.sizes) == len(self.frames) == len(self.placeholders)):
            raise BivitError(f"{self.source or 'media'}: sizes and frames need one entry per placeholder")

    def chunks(self) -> list[torch.Tensor]:
        """The rows of each placeholder (an image: one; a video: one per chunk)."""
        return list(torch.split(self.embedding, [p.tokens for p in self.placeholders]))

    def ec_ids(self) -> list[str]:
        """The encoder-cache id of each placeholder's rows (`ec_id`)."""
        return [ec_id(self.fingerprint, self.sha256, self.kind, i) for i in range(len(self.placeholders))]


def media_of(result: ItemResult, fingerprint: str) -> Media:
    """An encoded input (`bivit.core.items.ItemResult`: `Encoder.encode_items`, `bivit encode`, the service) as Media,
    under the fingerprint of the encoder that computed it."""
    if result.error is not None:
        raise BivitError(f"{result.source}: has no rows to hand over ({result.error})")
    # Through its record, as every front end hands a result over: one converter to Media (`media_of_record`).
    return media_of_record(replace(Record.of_result(result), encoder={"fingerprint": fingerprint}))


def encode(encoder: Any, inputs: Sequence[Any]) -> list[Media]:
    """Encode images and videos (any input `Encoder.encode_items` takes) -> one Media per input; the first input
    that fails raises.

    The inputs share forward passes; in invariant mode each input's rows are the bits of encoding it alone.
    """
    return [media_of(r, encoder.fingerprint) for r in encoder.encode_items(inputs, raise_errors=True)]


# ---------------------------------------------------------------------------------------- reading outputs

def load_media(path: Union[str, os.PathLike]) -> list[Media]:
    """bivit's outputs as Media, for a trainer or an encoder-cache producer: any embedding file or folder
    `bivit.load_embeddings` opens (a `bivit encode` file, a saved service answer, a dataset shard or folder), its
    encoded items in order (items that failed have no rows and are left out)."""
    return list(iter_media(path))


def iter_media(path: Union[str, os.PathLike]) -> Iterator[Media]:
    with load_embeddings(path) as embeddings:
        for r in embeddings:
            if r.ok:
                yield media_of_record(r, str(path))


def media_of_record(r: Record, where: str = "") -> Media:
    """One record of an embedding file (`bivit.core.records.Record`) as Media; BivitError naming the file and the
    item when it lacks what an engine needs (files of older bivit versions: re-encode them)."""
    name = f"{where}: {r.source}" if where else r.source
    if not r.fingerprint:
        raise BivitError(f"{name}: written without the encoder fingerprint (an older bivit); re-encode it")
    if not r.sha256:
        raise BivitError(f"{name}: has no content hash (an older bivit); re-encode it")
    if len(r.placeholders) != len(r.grid_thw):
        raise BivitError(f"{name}: its prompt placeholders were not recorded (an older bivit); re-encode it")
    return Media(r.embedding, tuple(Placeholder(p["text"], int(p["tokens"])) for p in r.placeholders),
                 r.fingerprint, r.sha256, r.kind, tuple(tuple(z) if z else None for z in r.sizes),
                 tuple(int(t) for t, _, _ in r.grid_thw), r.source)
