"""One input's trip through the core, outside the model: what it is, its preprocessed chunks, its result.

    prepare(input)              -> Prepared: its kind, content hash, chunks (a MediaBatch: one item per image,
                                   one per video chunk) and their metadata, or the error that stopped it
    (packing, Encoder.forward)     the chunks of any mix of inputs go through the model in shared passes
    assemble(prepared, outputs) -> ItemResult: the chunks' embeddings joined in order, with the metadata

`Encoder.encode_items` / `Encoder.encode_stream` compose the stages; the service and the dataset job call them
separately (preprocessing in threads or Ray tasks, forward passes in their own workers). Nothing here depends
on how inputs are batched.

Inputs: a path or bytes (an image or a video by `bivit.media.kinds`: the name's extension, else the first bytes), a
PIL image, an HxWx3 uint8 array, or `VideoFrames` (a video already decoded and sampled).

Content hash (`sha256`, `content_sha256`): for a path or bytes, the sha256 of the bytes. For a PIL image or an
array, which have no file bytes, the sha256 of a tag, the mode and size, then the raw pixels (and the palette and
transparency when the image has them): two images with the same pixels share it, an array and
`Image.fromarray(array)` share it, and it never collides with a file's hash by accident of layout. For
`VideoFrames`, the same over the frame rate, the frame indices and every frame. Equal hashes mean the same
encoder input, so the same embedding under one encoder fingerprint (and the same ids in vLLM's encoder cache,
`bivit.core.encoder_cache.ec_id`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from ..base.fileio import NotRegularFile, open_regular, sha256_file
from ..checkpoint.preprocess_config import ProcessorConfig, check_alpha
from ..errors import BivitError, MediaError
from ..media.container import check_container
from ..media.decode import MAX_IMAGE_BYTES, image_size, input_bytes, input_name
from ..media.grids import grid_tokens, image_grid, processing_of
from ..media.kinds import media_kind
from ..media.names import stored
from ..media.pixels import MediaBatch, Placeholder, batch_placeholders, image_placeholder_text, preprocess_images
from ..media.video import preprocess_frames, preprocess_video
from .integrity import embedding_sha256

PIXELS_TAG = b"bivit.pixels/1"
FRAMES_TAG = b"bivit.frames/1"


@dataclass(frozen=True)
class VideoFrames:
    """A video already decoded and sampled: `frames[i]` (a PIL image or HxWx3 uint8 array) is frame
    `indices[i]` (default i) of a video at `fps`. Chunked and timestamped as a video file would be whose
    sampler picked these frames (`bivit.media.video.preprocess_frames`)."""

    frames: Sequence[Any]
    fps: float
    indices: Optional[Sequence[int]] = None
    name: Optional[str] = None


@dataclass
class _Item:
    """What a prepared input and its result share: its name, kind and content hash; per chunk its `grid_thw`
    [t, h, w], `timestamps` (videos only), prompt `placeholders` and `sizes` (the image's or the chunk's frames'
    (width, height) before resizing, None where unknown); or the `error` that stopped it."""

    source: str
    kind: str
    sha256: Optional[str] = None
    grid_thw: list = field(default_factory=list)
    timestamps: Optional[list] = None
    placeholders: list = field(default_factory=list)
    error: Optional[BaseException] = None
    sizes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def chunk_tokens(self) -> list[int]:
        return [grid_tokens(h, w) for _, h, w in self.grid_thw]


@dataclass
class Prepared(_Item):
    """One input after preprocessing: its chunks packed in `batch` (None once it failed, or when prepared without
    pixels). `error` is a BivitError (a MediaError for a bad input)."""

    batch: Optional[MediaBatch] = None

    @property
    def patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grid_thw)

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    def chunks(self) -> list[MediaBatch]:
        """Its chunks, each a batch of one (an image: itself)."""
        return [] if self.batch is None else [self.batch.item(i) for i in range(len(self.batch))]

    def checked(self) -> "Prepared":
        """Itself, or its error raised."""
        if self.error is not None:
            raise self.error
        return self


@dataclass
class ItemResult(_Item):
    """One input's result: `embedding` `[tokens, text_hidden]` (a video: its chunks' embeddings joined in time
    order). `error` is a MediaError for an input that could not be read or decoded, else what its forward pass
    raised."""

    embedding: Optional[torch.Tensor] = None
    _embedding_sha256: Optional[str] = field(default=None, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        return 0 if self.embedding is None else int(self.embedding.shape[0])

    @property
    def embedding_sha256(self) -> Optional[str]:
        """`bivit.core.integrity.embedding_sha256` of its embedding (its record's `tensor_sha256`), computed once:
        copies made with `dataclasses.replace` keep it."""
        if self._embedding_sha256 is None and self.embedding is not None:
            self._embedding_sha256 = embedding_sha256(self.embedding)
        return self._embedding_sha256

    @property
    def chunks(self) -> list[torch.Tensor]:
        """Per chunk, its rows of `embedding` (views)."""
        return [] if self.embedding is None else list(self.embedding.split(self.chunk_tokens))



def prepare(src: Any, *, processing: ProcessorConfig | str | None = None, alpha: str = "model",
            name: Optional[str] = None, kind: Optional[str] = None, sha256: Optional[str] = None, pixels: bool = True,
            deadline: Optional[float] = None, video_options: Optional[dict] = None) -> Prepared:
    """Read, classify, hash and preprocess one input under the model's `processing` and `alpha`.

    Never raises for a bad input: a BivitError (MediaError for an unreadable or undecodable input) becomes
    `Prepared.error`; a bad `processing` (a ProcessorConfig or a preset name; default K2.x's) or `alpha` raises
    ConfigError. `name`: how results and messages call it, as records store it (`bivit.media.names.stored`; default:
    its path so stored, `<N bytes>`, ...); `kind`: "image" or "video" when the caller has decided (else
    `bivit.media.kinds` decides); `sha256`: its content hash when the caller has computed it already. `pixels=False`:
    images are read up to their header only (grid and placeholders without pixels); videos are decoded all the
    same (their chunks come from the frames). `deadline` (a `time.monotonic()` value): decoding stops with a
    MediaError once it has passed (nobody waits for the result any more). `video_options`: passed to
    `bivit.media.video.preprocess_video` (its limits).
    """
    proc = processing_of(processing)  # a bad option is the caller's mistake, not the input's: it raises
    check_alpha(alpha)
    if isinstance(src, VideoFrames):
        name = name or stored(src.name or "<video frames>")
    else:
        name = name or stored(f"<video {len(src)} bytes>" if kind == "video" and isinstance(src, bytes)
                              else input_name(src))
    try:
        return _prepare(src, name, kind, sha256, proc, alpha, pixels, deadline, video_options or {})
    except BivitError as e:
        guess = kind or ("video" if isinstance(src, VideoFrames) else None)
        if guess is None and isinstance(src, (str, os.PathLike)):
            guess = media_kind(src)
        return Prepared(name, guess or "image", sha256, error=e)


def _prepare(src: Any, name: str, kind: Optional[str], sha: Optional[str], proc: ProcessorConfig, alpha: str,
             pixels: bool, deadline: Optional[float], video_options: dict) -> Prepared:
    video_options = {"deadline": deadline, **video_options}
    if isinstance(src, VideoFrames):
        batch = preprocess_frames(src.frames, src.fps, src.indices, processing=proc, name=name)
        return _with_batch(name, "video", sha or content_sha256(src), batch, proc)
    if isinstance(src, (str, os.PathLike)):
        kind = kind or media_kind(src)
        if kind == "video":  # decoded from the path: a video may not fit in memory
            batch = preprocess_video(src, processing=proc, name=name, **video_options)
            return _with_batch(name, kind, sha or _file_sha256(src, name), batch, proc)
        data = input_bytes(src, name, MAX_IMAGE_BYTES)  # read once: the bytes hashed are the bytes decoded
        src, kind = data, kind or media_kind(src, data) or "image"
    elif isinstance(src, bytes):
        kind = kind or media_kind(name, src) or "image"
    else:
        kind = "image"
    if isinstance(src, bytes):
        sha = sha or content_sha256(src)
        if kind == "video":
            return _with_batch(name, kind, sha, preprocess_video(src, processing=proc, name=name, **video_options),
                               proc)
    if not pixels:
        w, h = image_size(src, name=name)
        gh, gw = image_grid(w, h, proc)
        return Prepared(name, kind, sha, grid_thw=[[1, gh, gw]], sizes=[(w, h)],
                        placeholders=[Placeholder(image_placeholder_text(proc, w, h), grid_tokens(gh, gw))])
    batch = preprocess_images([src], names=[name], processing=proc, alpha=alpha, deadline=deadline)
    if isinstance(src, (Image.Image, np.ndarray)):
        sha = sha or content_sha256(src)
    return _with_batch(name, kind, sha, batch, proc)


def _with_batch(name: str, kind: str, sha: Optional[str], batch: MediaBatch, proc: ProcessorConfig) -> Prepared:
    if len(batch) == 0:
        raise MediaError(f"{name}: no frames to encode", name)
    stamps = None if batch.timestamps is None else list(batch.timestamps)
    return Prepared(name, kind, sha, batch.grid_thw.tolist(), stamps, batch_placeholders(batch, proc),
                    sizes=list(batch.sizes), batch=batch)


def check_input(path: str | os.PathLike, name: Optional[str] = None) -> str:
    """Before any model loads: `path` names a readable, non-empty regular file of a kind bivit reads -> "image"
    or "video"; else MediaError naming it and the reason (does not exist, a directory, cannot be read, empty,
    not an image or video). An image is read up to its header (its size checked against the pixel limit); a
    video's container is opened and its stream list read, no frame decoded. What decoding finds later (a
    truncated stream, a corrupt frame) is still reported then."""
    name = name or stored(os.fspath(path))
    try:
        with open_regular(path) as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise MediaError(f"{name}: does not exist", name) from None
    except NotRegularFile as e:
        raise MediaError(f"{name}: {e.strerror}", name) from None
    except OSError as e:
        raise MediaError(f"{name}: cannot read ({e.strerror or e})", name) from None
    if not head:
        raise MediaError(f"{name}: file is empty", name)
    try:
        if media_kind(path, head) == "video":
            check_container(path, name)
            return "video"
        image_size(path, name=name)  # its own messages: not an image format bivit reads, corrupt, too many pixels
        return "image"
    except MediaError as e:
        e.source = name
        raise


def assemble(prepared: Prepared, outputs: Sequence[Any] = ()) -> ItemResult:
    """A prepared input and its chunks' outputs (embeddings in chunk order, or the exception a chunk's forward
    pass raised) -> its result."""
    p = prepared
    error = p.error or next((o for o in outputs if isinstance(o, BaseException)), None)
    if error is not None:
        return ItemResult(p.source, p.kind, p.sha256, error=error)
    if len(outputs) != len(p.grid_thw):
        raise ValueError(f"{len(outputs)} outputs for the {len(p.grid_thw)} chunks of {p.source}")
    # A fresh tensor, never a view into a pass's output buffer (which it would keep alive, and which
    # safetensors refuses to save twice).
    return ItemResult(p.source, p.kind, p.sha256, p.grid_thw, p.timestamps, p.placeholders, sizes=p.sizes,
                      embedding=torch.cat(list(outputs)))


# ------------------------------------------------------------------------------------------- content hash

def content_sha256(src: Any) -> str:
    """The content hash of an input (see the module docstring): a path's or bytes' sha256, an image's or array's
    pixels', a `VideoFrames`'. BivitError for anything else."""
    if isinstance(src, bytes):
        return hashlib.sha256(src).hexdigest()
    if isinstance(src, (str, os.PathLike)):
        return sha256_file(src)
    if isinstance(src, (Image.Image, np.ndarray)):
        return pixels_sha256(src)
    if isinstance(src, VideoFrames):
        return frames_sha256(src)
    raise BivitError(f"cannot hash an input of type {type(src).__name__}; pass a path, bytes, a PIL image, an "
                     "HxWx3 uint8 array or VideoFrames")


def _file_sha256(path: str | os.PathLike, name: str) -> str:
    try:
        return sha256_file(path)
    except OSError as e:
        raise MediaError(f"{name}: cannot read ({e.strerror or e})", name) from None


def _update_pixels(h: Any, img: Image.Image | np.ndarray) -> None:
    if isinstance(img, np.ndarray):  # hashed as the RGB image it becomes
        if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
            raise MediaError(f"numpy images must be HxWx3 uint8, got shape {img.shape} dtype {img.dtype}")
        mode, size, raw, extra = "RGB", (img.shape[1], img.shape[0]), np.ascontiguousarray(img).tobytes(), b""
    else:
        mode, size, raw, extra = img.mode, img.size, img.tobytes(), b""
        if img.mode in ("P", "PA") and img.getpalette() is not None:
            extra += bytes(img.getpalette())
        if "transparency" in img.info:
            extra += repr(img.info["transparency"]).encode()
    h.update(PIXELS_TAG + f" {mode} {size[0]}x{size[1]} {len(extra)}\n".encode() + extra)
    h.update(raw)


def pixels_sha256(img: Image.Image | np.ndarray) -> str:
    """The content hash of a decoded image (see the module docstring); MediaError for an array that is not
    HxWx3 uint8."""
    h = hashlib.sha256()
    _update_pixels(h, img)
    return h.hexdigest()


def frames_sha256(video: VideoFrames) -> str:
    """The content hash of a decoded video: its frame rate, frame indices and frames."""
    h = hashlib.sha256(FRAMES_TAG + f" {float(video.fps)!r} {list(video.indices or [])}\n".encode())
    for frame in video.frames:
        _update_pixels(h, frame)
    return h.hexdigest()
