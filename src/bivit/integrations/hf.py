"""bivit inside transformers' Kimi-K2.5 model: the image features of a `Kimi_K25ForConditionalGeneration` computed
by bivit's trainable module (`attach`), HF's processor calls answered with bivit's preprocessing (`Processor`), and
the model's weights under the checkpoint names bivit, transformers and vLLM all load (`checkpoint_state_dict`,
`save_pretrained`).

    model = Kimi_K25ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    vision = bivit.integrations.hf.attach(model)                  # bivit's tower + projector replace HF's, same weights
    processor = bivit.integrations.hf.Processor.from_pretrained(ckpt)
    batch = processor(text=[prompt], images=[image], return_tensors="pt")
    out = model(**batch)                             # the image rows are Encoder.encode's bits, with gradients

One set of parameters: `attach` converts HF's vision weights to bivit's layout once and puts bivit's modules where
HF's were (`model.model.vision_tower`, `model.model.mm_projector`), so `model.parameters()` holds exactly the
tensors bivit's forward reads and the optimizer steps them. Their names are bivit's (= the published checkpoint's):
the fused `wqkv` with its rows in the checkpoint's order, not HF's split, RoPE-permuted `q_proj`/`k_proj`/`v_proj`.
A state dict therefore goes to `Encoder.update_weights`, `bivit serve`'s `POST /v1/weights` and vLLM's
`load_weights` without conversion, and `save_pretrained` writes the published layout (docs/rl.md says why).

Frozen tower: `attach(model, rows=store)` makes the model read the rows a rollout encoded (`RowStore`) instead of
running any tower: no tower forward, no gradients, the rollout's bits.

Needs transformers (the `rl` extra), imported with this module; `import bivit` does not import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .. import model as bivit_model
from ..checkpoint.config import config_from_dict, load_config
from ..checkpoint.preprocess_config import (K25_PROCESSING, PREPROCESSOR_CONFIG, ProcessorConfig, check_alpha,
                                            load_processing, preprocessor_config_dict)
from ..checkpoint.state_dict import check_keys, expected_shapes, from_transformers_layout
from ..core.items import prepare
from ..errors import BivitError, CheckpointError, ConfigError
from ..media.pixels import MEDIA_PAD, MediaBatch
from .train import TrainableModel, trainable_from_state

try:  # the `rl` extra: this module works inside transformers' model, so it cannot load without it
    from transformers import AutoTokenizer, BatchFeature, PreTrainedModel, ProcessorMixin
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming, revert_weight_conversion
    from transformers.modeling_outputs import BaseModelOutputWithPooling
except ImportError as e:
    raise ConfigError(f"bivit.integrations.hf needs transformers>=5.19 (pip install 'bivit[rl]'): {e}") from None

__all__ = ["Processor", "RowStore", "VIDEO_TOKEN", "attach", "checkpoint_state_dict", "is_attached", "pixel_key",
           "vision_model"]

# HF's Kimi-K2.5 processor marks a video with this token and replaces it by the video's chunks; `Processor` does
# the same (its chunks' placeholders, each with one <|media_pad|>).
VIDEO_TOKEN = "<|kimi_k25_video_placeholder|>"
_ATTACHED = "_bivit_vision"  # the TrainableModel on the inner Kimi_K25Model (a plain attribute: not a submodule)
_HF_BLOCK = "Kimi_K25VisionEncoderLayer"


# ----------------------------------------------------------------------------------------------- attach

def _inner(model: Any) -> torch.nn.Module:
    """The `Kimi_K25Model` of a `Kimi_K25ForConditionalGeneration` (or the model itself)."""
    inner = getattr(model, "model", model)
    for name in ("vision_tower", "mm_projector", "get_image_features", "language_model"):
        if not hasattr(inner, name):
            raise ConfigError(f"{type(model).__name__} is not transformers' Kimi-K2.5 model (no {name!r}); attach "
                              "takes a Kimi_K25ForConditionalGeneration or a Kimi_K25Model")
    return inner


def is_attached(model: Any) -> bool:
    return _ATTACHED in vars(_inner(model))


def vision_model(model: Any) -> TrainableModel:
    """The attached bivit module (tower + projector; its `state_dict()` holds the checkpoint's vision names, what
    `Encoder.update_weights` and `POST /v1/weights` take)."""
    inner = _inner(model)
    if _ATTACHED not in vars(inner):
        raise BivitError(f"{type(model).__name__} has no bivit vision module; call bivit.integrations.hf.attach(model) first")
    return vars(inner)[_ATTACHED]


def attach(model: PreTrainedModel, *, rows: Optional["RowStore"] = None, batch_invariant: bool = True,
           activation_checkpointing: bool = False) -> TrainableModel:
    """Make `model` (transformers' `Kimi_K25ForConditionalGeneration`) compute its image and video-chunk
    features with bivit -> the bivit module now inside it.

    HF's vision tower and projector are converted to bivit's module (exactly: a permutation and a concatenation
    of the q/k/v weights; each part keeps its dtype and device) and replace them in the model; `get_image_features`
    (and so `forward`, `generate` and `get_video_features`) returns bivit's rows per item, the bits
    `Encoder.encode` gives for the same weights and dtypes, whatever the batch, with gradients to bivit's
    parameters. Items with t > 1 (video chunks) get their (h/2)*(w/2) rows (HF splits by t*h*w/4). Autocast is
    off inside it (the rollout encoder runs without one). `save_pretrained` writes the published checkpoint
    layout afterwards (`checkpoint_state_dict`), and FSDP's wrap policy (`_no_split_modules`) names bivit's
    block.

    `rows`: frozen-tower mode. The model reads each item's rows from the store a rollout filled
    (`bivit.integrations.rl.Rollout`), keyed by the item's pixels; the tower never runs, its parameters are frozen.
    """
    inner = _inner(model)
    if _ATTACHED in vars(inner):
        raise BivitError("bivit is already attached to this model")
    cfg = config_from_dict(model.config.to_dict())
    tower, projector = inner.vision_tower, inner.mm_projector
    where = Path(f"<{type(model).__name__}>")  # what conversion errors name instead of a file
    hf_state = {f"model.{part}.{k}": (t.detach(), where)
                for part, module in (("vision_tower", tower), ("mm_projector", projector))
                for k, t in module.state_dict().items()}
    try:
        state = {k: t for k, (t, _) in from_transformers_layout(hf_state, cfg).items()}
        check_keys(expected_shapes(cfg), state, lambda k, more: f"{where}: no {k!r}{more}",
                   lambda k: f"{where}: unexpected {k!r}")
    except CheckpointError as e:  # e.g. a PEFT adapter already wrapped in HF's tower
        raise BivitError(f"cannot take over this model's vision tower and projector: {e}") from None
    first = next(tower.parameters())
    net = trainable_from_state(cfg, state, device=first.device, dtype=first.dtype,
                               projector_dtype=next(projector.parameters()).dtype, batch_invariant=batch_invariant,
                               activation_checkpointing=activation_checkpointing)
    if rows is not None:
        net.requires_grad_(False)
    inner.vision_tower, inner.mm_projector = net.vision_tower, net.mm_projector
    vars(inner)[_ATTACHED] = net  # a plain attribute: the modules are registered once, under HF's names

    def get_image_features(pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor] = None, **_: Any):
        if image_grid_thw is None:
            raise ConfigError("image features need image_grid_thw (bivit.integrations.hf.Processor returns it)")
        _check_unwrapped(net)
        if pixel_values.ndim == 2:  # bivit.integrations.hf.Processor's flattened patches
            pixel_values = pixel_values.reshape(pixel_values.shape[0], 3, cfg.patch_size, cfg.patch_size)
        with torch.autocast(pixel_values.device.type, enabled=False):
            out = net(pixel_values, image_grid_thw) if rows is None else rows.lookup(pixel_values, image_grid_thw)
        return BaseModelOutputWithPooling(pooler_output=tuple(out))

    inner.get_image_features = get_image_features  # HF's forward and get_video_features call self.get_image_features
    model._weight_conversions = _checkpoint_conversions(model)
    model.save_pretrained = _saving_published_architecture(model.save_pretrained)
    block = bivit_model.Block.__name__
    for m in {id(model): model, id(inner): inner}.values():
        m._no_split_modules = [n for n in (m._no_split_modules or []) if n not in (_HF_BLOCK, block)] + [block]
    return net


def _check_unwrapped(net: TrainableModel) -> None:
    """Refuse adapters inside bivit's modules (a PEFT layer replacing a Linear): their GEMMs would run outside
    bivit's ops (and `mlp.fc0`'s, which bivit calls through its weight, would be skipped), so the trainer's rows would
    no longer be the rollout's."""
    for name, m in net.named_modules():
        if not type(m).__module__.startswith(("bivit.", "torch.nn.")):
            raise BivitError(f"{name} is wrapped ({type(m).__module__}.{type(m).__name__}): adapters on bivit's "
                             "vision tower or projector are not supported (the trainer's rows would stop being the "
                             "rollout's); target the language model's modules only, or train the tower fully")


def _checkpoint_conversions(model: PreTrainedModel) -> list:
    """transformers' weight conversions for `model` with the vision ones replaced by a plain prefix: what
    `save_pretrained` reverts to write the published layout (vision: bivit's names = the checkpoint's)."""
    current = getattr(model, "_weight_conversions", None)
    if current is None:
        current = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    # HF's vision conversions (its renames, the q/k/v split and permutation) and its bare "blocks" -> "layers"
    # rename: reverted on a model that has bivit's vision names they corrupt them, and the bare one also renames
    # the language model's layers (what transformers 5.19-5.23 write for Kimi-K2.5 without bivit).
    vision = re.compile(r"vision_tower|mm_projector|wqkv|^\^?blocks$")
    keep = [c for c in current if not any(vision.search(p) for p in [*c.source_patterns, *c.target_patterns])]
    return keep + [WeightRenaming(r"^vision_tower\.", "model.vision_tower."),
                   WeightRenaming(r"^mm_projector\.", "model.mm_projector.")]


# What the published checkpoints' config.json names, and the name vLLM's registry knows (transformers' class name
# would send vLLM to its generic Transformers backend, running HF's modules).
PUBLISHED_ARCHITECTURE = "KimiK25ForConditionalGeneration"


def _saving_published_architecture(save: Any) -> Any:
    """`save_pretrained`, then config.json's `architectures` set to the published name (transformers writes its
    own class name, `Kimi_K25ForConditionalGeneration`, which vLLM does not map to its Kimi-K2.5 model; transformers
    itself dispatches on `model_type`)."""
    def save_pretrained(save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        out = save(save_directory, *args, **kwargs)
        path = Path(save_directory) / "config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            config["architectures"] = [PUBLISHED_ARCHITECTURE]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)
        return out

    return save_pretrained


def checkpoint_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every weight of an attached model under the published checkpoint's names (`vision_tower.*`,
    `mm_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`; experts one by one): what
    `save_pretrained` writes and vLLM's Kimi-K2.5 `load_weights` takes (weight sync to a rollout engine)."""
    vision_model(model)  # attached, so the conversions are bivit's
    return revert_weight_conversion(model, model.state_dict())


# ------------------------------------------------------------------------------------- frozen-tower rows

def pixel_key(pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> str:
    """The key of one item's rows: sha256 of its grid and its pixels' bytes (the same image under the same
    preprocessing gives the same key, in the rollout and in the trainer)."""
    h = hashlib.sha256(b"bivit.pixel-key/1")
    h.update(torch.as_tensor(list(grid_thw), dtype=torch.int64).numpy().tobytes())
    h.update(pixel_values.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RowStore:
    """The rows a rollout encoded, by item pixels (`pixel_key`): what a frozen-tower model reads
    (`attach(model, rows=store)`). `bivit.integrations.rl.Rollout` replaces its contents at each rollout; a lookup of an
    item it does not hold raises (a frozen model never falls back to running a tower)."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}
        self.fingerprint: Optional[str] = None

    def __len__(self) -> int:
        return len(self._rows)

    def replace(self, rows: dict[str, torch.Tensor], fingerprint: str) -> None:
        self._rows, self.fingerprint = dict(rows), fingerprint

    def lookup(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        grid = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3).tolist()
        parts = pixel_values.split([t * h * w for t, h, w in grid])
        out = []
        for i, (g, px) in enumerate(zip(grid, parts)):
            rows = self._rows.get(pixel_key(px, g))
            if rows is None:
                raise BivitError(f"item {i} (grid {g}) has no rows from the rollout (encoder "
                                 f"{(self.fingerprint or 'none')[:12]}); a frozen-tower model reads only rows a "
                                 "rollout encoded, it never runs a tower")
            out.append(rows.to(pixel_values.device))
        return out


# ------------------------------------------------------------------------------------------- processor

class Processor(ProcessorMixin):
    """transformers' processor interface over bivit's preprocessing: `processor(text=..., images=...,
    videos=...)` gives `input_ids` with each `<|media_pad|>` expanded to its item's rows, and the items'
    `pixel_values` and `image_grid_thw` `[n, 3]` (images and video chunks together, in prompt order: the unified
    vision chunks Kimi's processor and vLLM use), as `bivit.Encoder` preprocesses them. `pixel_values` holds
    the patches flattened, `[L, 3*14*14]` (as Qwen2-VL's processor does; the attached model takes both
    layouts): TRL's GRPOTrainer reads 4-D pixel values as InternVL tiles and fails on them.

    In `text`, each image is one `<|media_pad|>` (Kimi's chat template writes one per image part) and each
    video one `VIDEO_TOKEN`, replaced by its chunks' placeholders (timestamp, `<|media_begin|>video...`).
    Images: PIL images, HxWx3 uint8 arrays, paths or bytes; videos: paths, bytes or `bivit.VideoFrames`.
    """

    image_token = MEDIA_PAD
    video_token = VIDEO_TOKEN

    def __init__(self, tokenizer: Any, processing: Optional[ProcessorConfig] = None,
                 chat_template: Optional[str] = None, alpha: str = "model") -> None:
        super().__init__(tokenizer, chat_template=chat_template)
        self.processing = processing or K25_PROCESSING
        self.alpha = check_alpha(alpha)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **tokenizer_kwargs: Any) -> "Processor":
        """The checkpoint's tokenizer and preprocessing (its `preprocessor_config.json`, else the family's
        published values). Local folders only (HF_HUB_OFFLINE works: nothing is fetched)."""
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"{path}: not a checkpoint folder")
        tokenizer = AutoTokenizer.from_pretrained(str(path), **tokenizer_kwargs)
        return cls(tokenizer, load_processing(path, load_config(path)))

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> list[str]:
        """The tokenizer and `preprocessor_config.json` (bivit, transformers' tokenizer and vLLM read them)."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = list(self.tokenizer.save_pretrained(str(directory)))
        path = directory / PREPROCESSOR_CONFIG
        path.write_text(json.dumps(preprocessor_config_dict(self.processing), indent=2))
        return files + [str(path)]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """The tokenizer's chat template (Kimi's writes one `<|media_pad|>` per image part)."""
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def __repr__(self) -> str:
        return f"bivit.integrations.hf.Processor({type(self.tokenizer).__name__}, {self.processing.processor})"

    def __call__(self, text: Any = None, images: Any = None, videos: Any = None, return_tensors: Any = None,
                 **kwargs: Any) -> Any:
        texts = [text] if isinstance(text, str) else list(text or [])
        queue = {MEDIA_PAD: _flat(images), VIDEO_TOKEN: _flat(videos)}
        used = {MEDIA_PAD: 0, VIDEO_TOKEN: 0}
        chunks, out_texts = [], []
        marker = re.compile(f"({re.escape(MEDIA_PAD)}|{re.escape(VIDEO_TOKEN)})")
        for t in texts:
            pieces = []
            for piece in marker.split(t):
                if piece not in queue:
                    pieces.append(piece)
                    continue
                if used[piece] == len(queue[piece]):
                    raise BivitError(f"the text has more {piece} than the {len(queue[piece])} "
                                     f"{'image(s)' if piece == MEDIA_PAD else 'video(s)'} given")
                src = queue[piece][used[piece]]
                used[piece] += 1
                p = prepare(src, processing=self.processing, alpha=self.alpha,
                            kind="image" if piece == MEDIA_PAD else "video").checked()
                chunks.append(p.batch)
                texts_of = [ph.text for ph in p.placeholders] if piece == VIDEO_TOKEN else [MEDIA_PAD]
                pieces += [x.replace(MEDIA_PAD, MEDIA_PAD * ph.tokens) for x, ph in zip(texts_of, p.placeholders)]
            out_texts.append("".join(pieces))
        for key, items in queue.items():
            if used[key] != len(items):
                raise BivitError(f"{len(items)} {'image(s)' if key == MEDIA_PAD else 'video(s)'} given but the "
                                 f"text has {used[key]} {key}")
        data = dict(self.tokenizer(out_texts, return_tensors=return_tensors, **kwargs)) if texts else {}
        if chunks:
            batch = MediaBatch.concat(chunks)
            data.update(pixel_values=batch.pixel_values.flatten(1), image_grid_thw=batch.grid_thw)
        return BatchFeature(data=data, tensor_type=return_tensors)


def _flat(items: Any) -> list:
    """HF's media arguments: one item, a list, or a list per sample -> the items in order."""
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        return [items]
    out: list = []
    for x in items:
        if x is not None:  # a sample without media
            out += _flat(x) if isinstance(x, (list, tuple)) else [x]
    return out
