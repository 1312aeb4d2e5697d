"""Public API: `load_encoder` and `Encoder`.

The encoder owns the three dtype decisions (tower, projector, output) and the batching policy; the model
computes, the op layer decides how. Casts happen at three declared boundaries only: pixels -> tower dtype
(tower input), merged tokens -> projector dtype (projector input, derived from the projector's own
parameters), projector output -> output dtype (here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from . import kernels, ops
from .checkpoint import all_finite, load_state_dict, random_state_dict
from .config import PRESETS, ModelConfig, load_config
from .dtypes import dtype_name, resolve_dtypes
from .errors import BivitError, CheckpointError, ConfigError, MediaError
from .media import MediaBatch, Placeholder, batch_placeholders, image_placeholder_text, image_size, \
    image_token_count, preprocess_images
from .model import VisionModel, gemms
from .hub import parse_repo_ref, resolve as resolve_repo
from .preprocess_config import ProcessorConfig, check_alpha, default_processing, load_processing, resolve_processing
from .video import is_video_path, join_chunks, preprocess_video, split_by_input, video_chunks

log = logging.getLogger("bivit")

DEMO_SEED = 0
DEMO_NOTICE = "bivit: using the built-in DEMO model (tiny, seeded random weights) — its embeddings are not Kimi's"


class Encoder:
    """Images and videos in, Kimi vision embeddings out. Not re-entrant: call it from one thread at a time."""

    def __init__(self, model: VisionModel, *, model_name: str, is_demo: bool, batch_invariant: bool,
                 output_dtype: torch.dtype, max_batch_tokens: int | None, device: torch.device,
                 processing: ProcessorConfig | None = None, alpha: str = "model") -> None:
        self.model = model.eval()
        self.config: ModelConfig = model.config
        self.processing: ProcessorConfig = (default_processing(model.config) if processing is None
                                            else resolve_processing(processing, model.config))
        self.alpha = check_alpha(alpha)
        self.model_name = model_name
        self.is_demo = is_demo
        self.batch_invariant = batch_invariant
        self.output_dtype = output_dtype
        self.max_batch_tokens = max_batch_tokens
        self.device = device
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------------------------- properties
    @property
    def dtype(self) -> torch.dtype:
        return self.model.vision_tower.dtype

    @property
    def projector_dtype(self) -> torch.dtype:
        return self.model.mm_projector.dtype

    @property
    def fingerprint(self) -> str:
        """Content hash of config + weights + dtypes + mode; the same for two loads of the same weights."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
            h.update(f"{self.dtype}|{self.projector_dtype}|{self.output_dtype}|{self.batch_invariant}".encode())
            # Same bytes in, same embedding out only under the same preprocessing (the server cache relies on it).
            h.update(json.dumps([self.processing.to_dict(), self.alpha], sort_keys=True).encode())
            for key, t in sorted(self.model.state_dict().items()):
                h.update(key.encode())
                h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"Encoder({self.model_name!r}{' [DEMO weights]' if self.is_demo else ''}, "
                f"dtype={dtype_name(self.dtype)}, projector_dtype={dtype_name(self.projector_dtype)}, "
                f"output_dtype={dtype_name(self.output_dtype)}, batch_invariant={self.batch_invariant})")

    # ----------------------------------------------------------------------------------- weight sync
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, source: str = "weight update") -> str:
        """Replace every vision/projector weight at once (e.g. from a trainer's `state_dict()`) -> new fingerprint.

        All or nothing: the update must hold exactly the model's tensors, by checkpoint name, each with the
        model's shape and dtype (no silent casts: the served bits must be the trainer's) and finite; otherwise
        a CheckpointError names `source` and the first offending key and the old weights stay. Not re-entrant
        with `encode`: call it between forward passes (the server serialises both).
        """
        current = self.model.state_dict()
        missing = sorted(set(current) - set(state_dict))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{source}: missing tensor {missing[0]!r}{more}; an update replaces every weight")
        unexpected = sorted(set(state_dict) - set(current))
        if unexpected:
            raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} (not a weight of this model)")
        for key, old in current.items():
            new = state_dict[key]
            if not isinstance(new, torch.Tensor):
                raise CheckpointError(f"{source}: {key!r} is a {type(new).__name__}, not a tensor")
            if new.shape != old.shape:
                raise CheckpointError(f"{source}: {key!r} has shape {tuple(new.shape)}, the model's is "
                                      f"{tuple(old.shape)}")
            if new.dtype != old.dtype:
                raise CheckpointError(f"{source}: {key!r} is {dtype_name(new.dtype)}, the model computes it in "
                                      f"{dtype_name(old.dtype)}")
            if not all_finite(new):
                raise CheckpointError(f"{source}: {key!r} contains NaN or Inf")
        with torch.no_grad():
            for key, old in current.items():
                old.copy_(state_dict[key])  # in place: bumps the version that packed copies and tables key on
        self._fingerprint = None
        if self.batch_invariant:
            ops.self_check(gemms(self.model), prepare=True)  # re-pack now rather than on the next request
        return self.fingerprint

    # ---------------------------------------------------------------------------------- preprocessing
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

    def placeholders(self, inputs: Sequence[Any]) -> list[list[Placeholder]]:
        """Per input, one Placeholder per image or video chunk: `.text` is what the model's processor writes
        into the prompt (with its single `<|media_pad|>`), `.tokens` the embedding rows that replace that pad.

        Images are read up to their header only; a video is decoded and sampled (its chunks' sizes and
        timestamps come from the frames themselves).
        """
        out = []
        for src in _as_list(inputs):
            if isinstance(src, (str, os.PathLike)) and is_video_path(src):
                out.append(batch_placeholders(self.preprocess_video(src), self.processing))
            else:
                w, h = image_size(src)
                out.append([Placeholder(image_placeholder_text(self.processing, w, h), self.image_token_count(w, h))])
        return out

    # --------------------------------------------------------------------------------------- encoding
    def encode(self, inputs: Sequence[Any], *, alpha: str | None = None) -> list[torch.Tensor]:
        """One `[tokens_i, text_hidden]` tensor per input, in input order.

        Inputs are images (PIL, arrays, paths, bytes) or video paths; a video's entry is the concatenation of
        its chunks' embeddings along the token axis (chunk boundaries: `encode_video`). All items share the
        forward passes; in invariant mode each result is the same bits as encoding that input alone.
        """
        batches = []
        for src in _as_list(inputs):
            if isinstance(src, (str, os.PathLike)) and is_video_path(src):
                batches.append(self.preprocess_video(src))
            else:
                batches.append(self.preprocess([src], alpha=alpha))
        outs = self.encode_batch(MediaBatch.concat(batches))
        return [join_chunks(c) for c in split_by_input(outs, [len(b) for b in batches])]

    def encode_video(self, path: str | os.PathLike, **limits: Any) -> list:
        """A video -> one `bivit.VideoChunk` (embedding, grid_thw, timestamp) per chunk, in time order."""
        batch = self.preprocess_video(path, **limits)
        return video_chunks(batch, self.encode_batch(batch))

    def encode_batch(self, batch: MediaBatch, max_batch_tokens: int | None = None) -> list[torch.Tensor]:
        return self.encode_pixels(batch.pixel_values, batch.grid_thw, max_batch_tokens)

    def encode_pixels(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                      max_batch_tokens: int | None = None) -> list[torch.Tensor]:
        """Packed patches `[L, 3, p, p]` + `grid_thw` `[n, 3]` -> one embedding per item (output dtype).

        `max_batch_tokens` bounds the patches of one forward pass for this call only (default: the encoder's).
        """
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3)
        check_pixels(self.config, pixel_values, grid_thw)
        _check_budget(max_batch_tokens)
        counts = [int(t * h * w) for t, h, w in grid_thw.tolist()]
        results: list[torch.Tensor] = []
        with torch.inference_mode(), ops.batch_invariant(self.batch_invariant):
            for first, last in self._passes(counts, max_batch_tokens or self.max_batch_tokens):
                start, stop = sum(counts[:first]), sum(counts[:last])
                outs = self.model(pixel_values[start:stop].to(self.device), grid_thw[first:last])
                results.extend(o.to(self.output_dtype) for o in outs)
        return results

    @staticmethod
    def _passes(counts: list[int], budget: int | None) -> list[tuple[int, int]]:
        """Greedy micro-batches of consecutive items with at most `budget` patches each."""
        if not budget:
            return [(0, len(counts))] if counts else []
        passes, first, used = [], 0, 0
        for i, n in enumerate(counts):
            if i > first and used + n > budget:
                passes.append((first, i))
                first, used = i, 0
            used += n
        if counts:
            passes.append((first, len(counts)))
        return passes


def check_pixels(config: ModelConfig, pixels: torch.Tensor, grid_thw: torch.Tensor) -> None:
    """Raise MediaError unless `pixels` `[L, 3, p, p]` and `grid_thw` `[n, 3]` describe valid packed items."""
    p = config.patch_size
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, p, p):
        raise MediaError(f"pixel_values must be [L, 3, {p}, {p}], got {list(pixels.shape)}")
    if (grid_thw <= 0).any():
        raise MediaError(f"grid_thw entries must be positive, got {grid_thw.tolist()}")
    if ((grid_thw[:, 1:] % 2) != 0).any():
        raise MediaError(f"grid h and w must be even (2x2 merge), got {grid_thw.tolist()}")
    if (grid_thw[:, 0] > config.pos_emb_time).any():
        raise MediaError(f"chunks hold at most {config.pos_emb_time} frames, got {grid_thw.tolist()}")
    total = int(grid_thw.prod(-1).sum())
    if total != pixels.shape[0]:
        raise MediaError(f"grid_thw describes {total} patches but pixel_values has {pixels.shape[0]}")


def _check_budget(max_batch_tokens: Any) -> None:
    if max_batch_tokens is not None and (isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int)
                                         or max_batch_tokens < 1):
        raise ConfigError(f"option 'max_batch_tokens' = {max_batch_tokens!r}: expected a positive integer")


def _as_list(inputs: Any) -> list:
    if isinstance(inputs, (str, os.PathLike, bytes)) or not isinstance(inputs, Sequence):
        return [inputs]
    return list(inputs)


def build_model(model: str | os.PathLike | None, *, device: torch.device, dtype: torch.dtype,
                projector_dtype: torch.dtype, seed: int = DEMO_SEED, revision: str | None = None,
                processing: ProcessorConfig | str | dict | None = None,
                cls: type[VisionModel] = VisionModel) -> tuple[VisionModel, str, bool, ProcessorConfig]:
    """Read a checkpoint (a directory or a hub repo id), or make the demo model, into `cls`
    -> (model, name, is_demo, preprocessing).

    The one loading path of `load_encoder` and `bivit.load_model`: both see the same weights in the same dtypes.
    """
    if model is None or str(model) == "demo":
        cfg = PRESETS["demo"]
        state = random_state_dict(cfg, seed)
        proc = resolve_processing("demo" if processing is None else processing, cfg)
        name, is_demo = "demo", True
        log.warning(DEMO_NOTICE)
    else:
        path, name = Path(model), str(model)
        if not path.is_dir():
            if parse_repo_ref(model, revision) is None:
                raise BivitError(f"{path}: model must be a checkpoint directory, a hub repo id (org/name[@rev]) "
                                 "or None for the demo model")
            path = resolve_repo(str(model), revision)
            name = str(model) + (f"@{revision}" if revision and "@" not in str(model) else "")
        cfg = load_config(path)
        proc = load_processing(path, cfg) if processing is None else resolve_processing(processing, cfg)
        state = load_state_dict(path, cfg)
        is_demo = False

    with torch.device("meta"):
        net = cls(cfg)
    net.load_state_dict(state, strict=True, assign=True)
    net.vision_tower.to(device=device, dtype=dtype)
    net.mm_projector.to(device=device, dtype=projector_dtype)
    if device.type == "cpu":
        kernels.library()  # build (or find in the cache) and self-test the compiled kernels now, not mid-request
        kernels.attention()
    return net, name, is_demo, proc


def parse_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
        torch.empty(0, device=device)  # a device this torch build or machine lacks fails here, not mid-load
    except (RuntimeError, TypeError, AssertionError) as e:
        raise ConfigError(f"option 'device' = {str(device)!r} is not available here ({str(e).splitlines()[0]})") \
            from None
    return device


def load_encoder(model: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "bfloat16", batch_invariant: bool = True,
                 projector_dtype: str | torch.dtype | None = None, output_dtype: str | torch.dtype | None = None,
                 max_batch_tokens: int | None = None, seed: int = DEMO_SEED, alpha: str = "model",
                 processing: ProcessorConfig | str | dict | None = None, revision: str | None = None,
                 **options: Any) -> Encoder:
    """Load an encoder.

    model: None (or "demo") for the built-in demo model, a checkpoint directory (Moonshot weights, either
    config layout), or a Hugging Face repo id ("moonshotai/Kimi-K2.6", "org/name@rev" or `revision=`), of which
    only the config files and the vision shards are fetched (or found in the local cache; HF_HUB_OFFLINE=1
    works). dtype: tower compute dtype; projector_dtype: defaults to dtype; output_dtype: defaults to
    projector_dtype. max_batch_tokens: at most this many patches per forward pass (an item larger than that
    runs alone). batch_invariant: bit-identical results per item whatever the batching (default on).
    alpha: transparency, "model" (what the model's processor does), "drop" or "white" (vLLM's loader).
    processing: overrides the preprocessing (a ProcessorConfig, a preset name or a `media_proc_cfg` dict);
    by default the checkpoint's `preprocessor_config.json`, else the published values of the model family.
    """
    if options:
        raise ConfigError(f"unknown option(s) {', '.join(map(repr, sorted(options)))}")
    check_alpha(alpha)
    tower_dtype, proj_dtype, out_dtype = resolve_dtypes(dtype, projector_dtype, output_dtype)
    _check_budget(max_batch_tokens)
    device = parse_device(device)
    net, name, is_demo, proc = build_model(model, device=device, dtype=tower_dtype, projector_dtype=proj_dtype,
                                           seed=seed, revision=revision, processing=processing)
    net.requires_grad_(False)  # an inference engine: no autograd bookkeeping, ever
    if batch_invariant:
        # Prove now, not on the first request, that the pinned GEMMs are row-position invariant here.
        ops.self_check(gemms(net))
    return Encoder(net, model_name=name, is_demo=is_demo, batch_invariant=batch_invariant, output_dtype=out_dtype,
                   max_batch_tokens=max_batch_tokens, device=device, processing=proc, alpha=alpha)
