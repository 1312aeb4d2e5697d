"""Public API: `load_encoder` and `Encoder`, the core every front end (CLI, service, dataset job) goes through.

The encoder owns the three dtype decisions (tower, projector, output) and the path from inputs to per-input
results: `prepare` (one input -> its chunks, `bivit.core.items`), passes cut by the one packing rule
(`bivit.core.packing`), `forward` (one pass through the model), `assemble` (chunks -> one result per input). The
model computes, the op layer decides how. Casts happen at three declared boundaries only: pixels -> tower
dtype (tower input), merged tokens -> projector dtype (projector input, derived from the projector's own
parameters), projector output -> output dtype (here).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .. import ops
from ..base import notices
from ..base.dtypes import dtype_name, resolve_dtypes
from ..base.options import DEMO_SEED
from ..checkpoint.config import ModelConfig
from ..checkpoint.preprocess_config import ProcessorConfig, check_alpha, default_processing, resolve_processing
from ..checkpoint.weights import DEMO_NOTICE, build_model, fingerprint, model_from_state, replace_weights
from ..errors import ConfigError
from ..media.grids import image_token_count
from ..media.pixels import MediaBatch, Placeholder, preprocess_images
from ..media.video import preprocess_video, video_chunks
from ..model import VisionModel
from .items import ItemResult, Prepared, assemble, prepare
from .packing import MAX_BATCH_PATCHES, Pass, check_pixels
from .spec import EncoderSpec

__all__ = ["DEMO_NOTICE", "DEMO_SEED", "Encoder", "encoder_from_state", "load_encoder"]


class Encoder:
    """Images and videos in, Kimi vision embeddings out. Not re-entrant: call it from one thread at a time."""

    def __init__(self, model: VisionModel, *, model_name: str, is_demo: bool, batch_invariant: bool,
                 output_dtype: torch.dtype, device: torch.device, max_batch_patches: int = MAX_BATCH_PATCHES,
                 processing: ProcessorConfig | None = None, alpha: str = "model",
                 spec: EncoderSpec | None = None) -> None:
        self.model = model.eval()
        self.config: ModelConfig = model.config
        self.processing: ProcessorConfig = (default_processing(model.config) if processing is None
                                            else resolve_processing(processing, model.config))
        self.alpha = check_alpha(alpha)
        self.model_name = model_name
        self.is_demo = is_demo
        self.batch_invariant = batch_invariant
        self.output_dtype = output_dtype
        self.max_batch_patches = max_batch_patches  # patches per forward pass (checked by load_encoder: bivit.core.packing)
        self.device = device
        self.spec = spec  # what it was loaded from (`load_encoder`), checked; None for one built by hand
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------------------------- properties
    @property
    def dtype(self) -> torch.dtype:
        return self.model.vision_tower.dtype

    @property
    def projector_dtype(self) -> torch.dtype:
        return self.model.mm_projector.dtype

    @property
    def bits(self) -> str:
        """The class of bits this encoder's rows are (`bivit.ops.bits`): `bivit-arith/1` where every op runs a
        kernel that computes bivit's written arithmetic (the same rows on every CPU), else the class of what
        runs here (a machine kind's own)."""
        return ops.bits_class((self.dtype, self.projector_dtype), self.device, self.batch_invariant)

    @property
    def fingerprint(self) -> str:
        """Content hash of config + weights + dtypes + mode + preprocessing + class of bits; the same for two loads
        of the same weights (`bivit.checkpoint.weights.fingerprint`)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model, output_dtype=self.output_dtype,
                                            batch_invariant=self.batch_invariant, processing=self.processing,
                                            alpha=self.alpha, bits=self.bits)
        return self._fingerprint

    def describe(self) -> dict:
        """What computes this encoder's embeddings, as JSON: every front end reports it (the `bivit encode` file,
        a dataset's header, the service's /v1/info and response header)."""
        dtypes = list(dict.fromkeys((self.dtype, self.projector_dtype)))
        # the variant too: the kernels per dtype, the load-time proof (per op, the path and whether it is
        # bit-identical alone, packed and reversed at several thread counts on this machine: bivit.ops.proof)
        kernels = ops.backend_for(self.device).describe(self.model, dtypes, self.batch_invariant)
        return {"model": self.model_name, "demo": self.is_demo, "fingerprint": self.fingerprint, "bits": self.bits,
                "dtype": dtype_name(self.dtype), "projector_dtype": dtype_name(self.projector_dtype),
                "output_dtype": dtype_name(self.output_dtype), "batch_invariant": self.batch_invariant,
                "text_hidden_size": int(self.config.text_hidden_size), "alpha": self.alpha,
                "processing": self.processing.to_dict(),
                # and every faster path this process leaves off, why and the fix (bivit.base.notices)
                "kernels": {**kernels, "fallbacks": notices.warnings()}}

    def __repr__(self) -> str:
        return (f"Encoder({self.model_name!r}{' [DEMO weights]' if self.is_demo else ''}, "
                f"dtype={dtype_name(self.dtype)}, projector_dtype={dtype_name(self.projector_dtype)}, "
                f"output_dtype={dtype_name(self.output_dtype)}, batch_invariant={self.batch_invariant})")

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, source: str = "weight update",
                       partial: bool = False) -> str:
        """Replace every vision/projector weight at once (e.g. from a trainer's `state_dict()`) -> new fingerprint.

        All or nothing (`bivit.checkpoint.weights.replace_weights`: the model's keys, shapes and dtypes, finite); a
        CheckpointError names `source` and the first offending key and the old weights stay. `partial`: the
        update may hold only some of the weights (an engine's weight loader streams them in parts); the others
        stay. Not re-entrant with `encode`: call it between forward passes (the server serialises both).
        """
        replace_weights(self.model, state_dict, source, partial=partial)
        self._fingerprint = None
        if self.batch_invariant:
            ops.backend_for(self.device).pack_and_prove(self.model)  # re-pack (and prove) now rather than on the next request
        return self.fingerprint

    # ------------------------------------------------------------------------------------------ stages
    def prepare(self, src: Any, *, alpha: str | None = None, **options: Any) -> Prepared:
        """One input -> its chunks and metadata, or its error, under this model's preprocessing (stage 1;
        `bivit.core.items.prepare` for the options)."""
        return prepare(src, processing=self.processing, alpha=self.alpha if alpha is None else alpha, **options)

    def forward(self, batch: MediaBatch) -> list[torch.Tensor]:
        """One forward pass over every item of `batch` (no cutting) -> one embedding per item (output dtype)."""
        with torch.inference_mode(), ops.batch_invariant(self.batch_invariant):
            outs = self.model(batch.pixel_values.to(self.device), batch.grid_thw)
            return [o.to(self.output_dtype).cpu() for o in outs]  # on the CPU, whatever the device: to files, replies

    def forward_each(self, batch: MediaBatch) -> list[torch.Tensor | Exception]:
        """`forward`, except that a pass that raises is run again item by item, so that one item that breaks it
        fails only itself: per item its embedding or the exception its pass raised."""
        try:
            return list(self.forward(batch))
        except Exception as e:  # noqa: BLE001 - handed to the item's result
            if len(batch) == 1:
                return [e]
        return [out for i in range(len(batch)) for out in self.forward_each(batch.item(i))]

    def encode_stream(self, prepared: Iterable[Prepared], *,
                      on_pass: Callable[[int], Any] | None = None) -> Iterator[ItemResult]:
        """Prepared inputs (any iterable: consumed as passes fill) -> one ItemResult each, in order, as soon as all
        its chunks are through: the one way inputs are cut into forward passes. Chunks of consecutive inputs
        share passes cut by the packing rule under `max_batch_patches`; at most one pass of pixels is held beyond
        the inputs the iterable has produced and not yet handed back. A pass that raises is run again item by
        item (`forward_each`): one bad item fails only itself. `on_pass(chunks)` is called after each forward
        pass (a progress bar)."""
        waiting: collections.deque[tuple[Prepared, list]] = collections.deque()
        filling: Pass[tuple[list, int, MediaBatch]] = Pass(self.max_batch_patches)  # (outputs slot, index, chunk)

        def run() -> None:
            if filling:
                chunks = filling.take()
                outs = self.forward_each(MediaBatch.concat([c for _, _, c in chunks]))
                for (slot, i, _), out in zip(chunks, outs):
                    slot[i] = out
                if on_pass is not None:
                    on_pass(len(chunks))

        def done() -> Iterator[ItemResult]:
            while waiting and all(o is not None for o in waiting[0][1]):
                p, outs = waiting.popleft()
                yield assemble(p, outs)

        for p in prepared:
            slot: list = [None] * (0 if p.error is not None else len(p.grid_thw))
            waiting.append((p, slot))
            for i, chunk in enumerate(p.chunks() if p.error is None else ()):
                n = sum(chunk.patch_counts)
                if not filling.fits(n):
                    run()
                    yield from done()
                filling.add((slot, i, chunk), n)
            yield from done()
        run()
        yield from done()

    def encode_items(self, inputs: Sequence[Any], *, alpha: str | None = None,
                     raise_errors: bool = False) -> list[ItemResult]:
        """Any mix of inputs (paths, bytes, PIL images, arrays, `bivit.core.items.VideoFrames`) -> one ItemResult per
        input, in order: embedding, per-chunk grid, timestamps and placeholders, content hash, or the error.

        Inputs are prepared one by one as passes fill (memory holds about one pass of pixels, whatever the
        number of inputs) and share the forward passes; in invariant mode each result is the same bits as
        encoding that input alone. `raise_errors`: raise the first input's error instead (a bad input's as soon
        as it is read).
        """
        def prepared() -> Iterator[Prepared]:
            for src in _as_list(inputs):
                p = self.prepare(src, alpha=alpha)
                yield p.checked() if raise_errors else p

        results = list(self.encode_stream(prepared()))
        if raise_errors:
            for r in results:
                if r.error is not None:
                    raise r.error
        return results

    # ------------------------------------------------------------------------------------ conveniences
    def encode(self, inputs: Sequence[Any], *, alpha: str | None = None) -> list[torch.Tensor]:
        """One `[tokens_i, text_hidden]` tensor per input, in input order (`encode_items`, raising the first
        error); a video's entry is its chunks' embeddings joined (chunk boundaries: `encode_video`)."""
        return [r.embedding for r in self.encode_items(inputs, alpha=alpha, raise_errors=True)]

    def encode_video(self, path: str | os.PathLike | bytes, **limits: Any) -> list:
        """A video -> one `bivit.VideoChunk` (embedding, grid_thw, timestamp) per chunk, in time order."""
        p = self.prepare(path, kind="video", video_options=limits).checked()
        (result,) = self.encode_stream([p])
        if result.error is not None:
            raise result.error
        return video_chunks(p.batch, result.chunks)

    def placeholders(self, inputs: Sequence[Any]) -> list[list[Placeholder]]:
        """Per input, one Placeholder per image or video chunk: `.text` is what the model's processor writes
        into the prompt (with its single `<|media_pad|>`), `.tokens` the embedding rows that replace that pad.

        Images are read up to their header only; a video is decoded and sampled (its chunks' sizes and
        timestamps come from the frames themselves).
        """
        return [self.prepare(src, pixels=False).checked().placeholders for src in _as_list(inputs)]

    def preprocess(self, images: Sequence[Any], *, alpha: str | None = None) -> MediaBatch:
        """Images (PIL, HxWx3 uint8 arrays, paths, bytes) -> one packed MediaBatch, under the model's
        preprocessing (`self.processing`); `alpha` ("model" | "drop" | "white") overrides the encoder's."""
        return preprocess_images(_as_list(images), processing=self.processing,
                                 alpha=self.alpha if alpha is None else alpha)

    def preprocess_video(self, path: str | os.PathLike, **limits: Any) -> MediaBatch:
        """A video file -> one item per chunk of sampled frames (the model's `sample_fps` and
        `temporal_merge_kernel_size`), with chunk timestamps. MediaError for an image-only model (K3)."""
        return preprocess_video(path, processing=self.processing, **limits)

    def image_token_count(self, width: int, height: int) -> int:
        """Tokens this model produces for a `width` x `height` image, without loading it."""
        return image_token_count(width, height, model=self.processing)

    def encode_batch(self, batch: MediaBatch) -> list[torch.Tensor]:
        """A packed MediaBatch -> one embedding per item (`encode_pixels`)."""
        return self.encode_pixels(batch.pixel_values, batch.grid_thw)

    def encode_pixels(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Packed patches `[L, 3, p, p]` + `grid_thw` `[n, 3]` -> one embedding per item (output dtype), through
        `encode_stream` like any input; the first item whose pass fails raises."""
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3)
        check_pixels(self.config, pixel_values, grid_thw)
        batch = MediaBatch(pixel_values, grid_thw)
        items = [Prepared(f"item {i}", "image", grid_thw=[grid_thw[i].tolist()], batch=batch.item(i))
                 for i in range(len(batch))]
        out = []
        for r in self.encode_stream(items):
            if r.error is not None:
                raise r.error
            out.append(r.embedding)
        return out


def _as_list(inputs: Any) -> list:
    if isinstance(inputs, (str, os.PathLike, bytes)) or not isinstance(inputs, Sequence):
        return [inputs]
    return list(inputs)


def load_encoder(model: EncoderSpec | str | os.PathLike | None = None, **options: Any) -> Encoder:
    """Load the encoder an `EncoderSpec` describes: `load_encoder(spec)`, or its fields as keywords (the
    convenience: `load_encoder("moonshotai/Kimi-K2.6", dtype="bfloat16")` is
    `load_encoder(EncoderSpec("moonshotai/Kimi-K2.6", dtype="bfloat16"))`; keywords after a spec replace its fields).

    model: None (or "demo") for the built-in demo model, a checkpoint directory (Moonshot weights, either
    config layout), or a Hugging Face repo id ("moonshotai/Kimi-K2.6", "org/name@rev" or `revision=`), of which
    only the config files and the vision shards are fetched (or found in the local cache; HF_HUB_OFFLINE=1
    works). dtype: tower compute dtype; projector_dtype: defaults to dtype; output_dtype: defaults to
    projector_dtype (`bivit.base.dtypes`). max_batch_patches: at most this many patches per forward pass (default
    `bivit.core.packing.MAX_BATCH_PATCHES`; an item larger than that runs alone; a memory bound, never a change of
    results in invariant mode). batch_invariant: bit-identical
    results per item whatever the batching (default on). alpha: transparency, "model" (what the model's
    processor does), "drop" or "white" (vLLM's loader). processing: overrides the preprocessing (a
    ProcessorConfig, a preset name or a `media_proc_cfg` dict); by default the checkpoint's
    `preprocessor_config.json`, else the published values of the model family.
    """
    spec = EncoderSpec.of(model, **options).checked()
    device = torch.device(spec.device)
    tower_dtype, proj_dtype, out_dtype = resolve_dtypes(spec.dtype, spec.projector_dtype, spec.output_dtype)
    net, name, is_demo, proc = build_model(spec.model, device=device, dtype=tower_dtype, projector_dtype=proj_dtype,
                                           seed=spec.seed, revision=spec.revision, processing=spec.processing)
    return _ready(net, spec, model_name=name, is_demo=is_demo, output_dtype=out_dtype, processing=proc)


def encoder_from_state(config: ModelConfig, state: Mapping[str, torch.Tensor], spec: EncoderSpec | None = None,
                       **options: Any) -> Encoder:
    """An encoder over vision weights already in memory (checkpoint names, checked by
    `bivit.checkpoint.state_dict.checked_state`), e.g. those an inference engine read from the checkpoint: for the same
    weights, dtypes and preprocessing it is `load_encoder`'s encoder, the same rows and the same fingerprint.
    `spec` (or its fields as keywords, `model_name` for its `model`): `model` only names the weights, and
    `processing` is required (a checkpoint's, `bivit.checkpoint.preprocess_config.load_processing`)."""
    if "model_name" in options:
        options["model"] = options.pop("model_name")
    spec = EncoderSpec.of(spec, **options).checked(model=False)
    if spec.processing is None:
        raise ConfigError("encoder_from_state: option 'processing' is required (the checkpoint's preprocessing)")
    device = torch.device(spec.device)
    tower_dtype, proj_dtype, out_dtype = resolve_dtypes(spec.dtype, spec.projector_dtype, spec.output_dtype)
    net = model_from_state(config, state, device=device, dtype=tower_dtype, projector_dtype=proj_dtype)
    return _ready(net, spec, model_name=str(spec.model), is_demo=False, output_dtype=out_dtype,
                  processing=resolve_processing(spec.processing, config))


def _ready(net: VisionModel, spec: EncoderSpec, **options: Any) -> Encoder:
    net.requires_grad_(False)  # an inference engine: no autograd bookkeeping, ever
    device = torch.device(spec.device)
    if spec.batch_invariant:
        # CPU: pack the weights and prove every op invariant on this machine now, not on the first request;
        # CUDA: check the Triton kernels can run (fixed tiles, nothing to probe).
        ops.backend_for(device).pack_and_prove(net)
    return Encoder(net, batch_invariant=spec.batch_invariant, device=device, max_batch_patches=spec.max_batch_patches,
                   alpha=spec.alpha, spec=spec, **options)
