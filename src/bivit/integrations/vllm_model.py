"""`BivitKimiK25ForConditionalGeneration`: vLLM's Kimi-K2.5 model (`KimiK25ForConditionalGeneration`, its language
model untouched) whose media path (vision tower, temporal-pool merger, projector) is bivit's encoder in invariant
mode, built from the vision weights vLLM reads from the checkpoint. Registered by bivit's vLLM plugin
(`bivit.integrations.vllm_plugin`), selected with `hf_overrides={"architectures": [...]}`; docs/vllm.md.

Where it plugs into vLLM (0.32):

* `embed_multimodal`: vLLM's model runner calls it with the scheduled items' patches and grids (every
  image and video chunk of an encoder batch, whatever requests they came from); here bivit computes them, so
  each item's rows are the bits `bivit.load_encoder(ckpt, ...).encode([file])` gives, whatever else is in the
  batch.
* Pixels: vLLM's Kimi-K2.5 processor resizes (PIL bicubic, the navit sizes) and zero-pads like bivit, and by
  default (`mm_device_do_normalize`) leaves the normalisation to the model, handing it raw uint8 patches; its
  own tower normalises them with another arithmetic (`x * (2/255) - 1` in float32). bivit normalises them with its
  own (`bivit.media.pixels.normalize_patches`, the model's processor bit for bit), so the tower sees bivit's pixels.
* `load_weights` (the first load, vLLM's `reload_weights` and RL frameworks' weight updates): the
  `vision_tower.*` / `mm_projector.*` tensors go to bivit (checked and converted as a checkpoint's are; after
  the first load, in place, any subset), the others to vLLM's loader. The encoder's fingerprint follows.

vLLM's own tower and projector are dropped after construction: nothing runs them, and their parameters would
only hold memory (bivit's encoder is no submodule, so vLLM's loaders and its layerwise reload never see it).

Options (`hf_overrides={"bivit": {...}}`): `dtype` (the tower's; default the engine's `--dtype`) and
`projector_dtype` (default the tower's). The rows always leave in the engine's dtype, what its language model
reads.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration
from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

from ..checkpoint.config import config_from_dict
from ..checkpoint.preprocess_config import PREPROCESSOR_CONFIG, default_processing, processing_from_dict
from ..checkpoint.state_dict import HF_PREFIXES, checked_state, from_transformers_layout, is_vision_key
from ..core.encoder import Encoder, encoder_from_state
from ..errors import BivitError, CheckpointError, ConfigError
from ..media.pixels import normalize_patches
from .vllm_plugin import ARCHITECTURE, OPTIONS_KEY

__all__ = ["BivitKimiK25ForConditionalGeneration"]

_OPTIONS = ("dtype", "projector_dtype")


@contextlib.contextmanager
def _torch_defaults() -> Iterator[None]:
    """torch's default dtype float32 inside: vLLM loads weights with the engine's dtype as torch's default, and
    bivit's encoder is built and run here as in any other process. (The kernels' checks name their dtypes,
    tests/test_backend.py; the model's construction is not proven free of the default.)"""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class BivitKimiK25ForConditionalGeneration(KimiK25ForConditionalGeneration):
    """vLLM's Kimi-K2.5 with bivit's encoder as its media path (module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        model_config = vllm_config.model_config
        if not model_config.get_multimodal_config().mm_device_do_normalize:
            # Then vLLM's processor hands over pixels it normalised with its own arithmetic, not bivit's.
            raise ConfigError(f"{ARCHITECTURE} takes vLLM's raw pixels and normalises them as the model's processor "
                              "does; leave mm_device_do_normalize on (vLLM's default)")
        options = getattr(self.config, OPTIONS_KEY, None) or {}
        unknown = sorted(set(options) - set(_OPTIONS)) if isinstance(options, dict) else ["(not an object)"]
        if unknown:
            raise ConfigError(f"hf_overrides {OPTIONS_KEY!r}: unknown option {unknown[0]!r}; expected "
                              f"{', '.join(_OPTIONS)}")
        del self.vision_tower, self.mm_projector  # bivit's encoder (built in load_weights) replaces them
        self._tower_model_names = []
        self.bivit_vision_config = config_from_dict(self.config.to_dict())
        self.bivit_options = dict(dtype=options.get("dtype") or model_config.dtype,
                                  projector_dtype=options.get("projector_dtype"), output_dtype=model_config.dtype)
        self.bivit_source = str(model_config.model)
        self.bivit_revision = model_config.revision
        # A plain attribute, not a submodule: vLLM's loaders, its layerwise reload and `.to()` never touch it.
        self.bivit_encoder: Optional[Encoder] = None

    # ----------------------------------------------------------------------------------------- media rows
    def embed_multimodal(self, **kwargs: object) -> Optional[list[torch.Tensor]]:
        media = self._parse_and_validate_media_input(**kwargs)
        if media is None:
            return None
        encoder = self.encoder()
        pixels = normalize_patches(media["pixel_values"], encoder.processing)
        with _torch_defaults():
            rows = encoder.encode_pixels(pixels, media["grid_thws"].cpu())
        return [r.to(self.device) for r in rows]

    def encoder(self) -> Encoder:
        """bivit's encoder inside this engine (its `fingerprint`, `describe()`)."""
        if self.bivit_encoder is None:
            raise BivitError(f"{ARCHITECTURE}: no vision weights were loaded (the checkpoint has no vision_tower.* / "
                             "mm_projector.* tensors?)")
        return self.bivit_encoder

    def get_encoder_cudagraph_config(self) -> Any:
        # vLLM's encoder CUDA graphs capture its own tower's forward, which this model does not have.
        raise ConfigError(f"{ARCHITECTURE} runs bivit's encoder, which vLLM's encoder CUDA graphs cannot capture; "
                          "turn them off")

    # -------------------------------------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision: dict[str, torch.Tensor] = {}

        def language_model(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if is_vision_key(name):
                    vision[name] = t.detach().to("cpu", copy=True)  # a loader may reuse its buffers
                else:
                    yield name, t

        loaded = super().load_weights(language_model(weights))
        if vision:
            with _torch_defaults():
                self._take_vision_weights(vision)
        return loaded

    def _take_vision_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        cfg, where = self.bivit_vision_config, Path(self.bivit_source)
        if self.bivit_encoder is None:
            state = checked_state({k: (t, where) for k, t in tensors.items()}, cfg, where)
            self.bivit_encoder = encoder_from_state(cfg, state, model_name=self.bivit_source,
                                                    processing=self._processing(), device=self.device,
                                                    **self.bivit_options)
            return
        if any(k.startswith(HF_PREFIXES) or ".layers." in k for k in tensors):
            tensors = {k: t for k, (t, _) in from_transformers_layout({k: (t, where) for k, t in tensors.items()},
                                                                      cfg).items()}
        current = self.bivit_encoder.model.state_dict()
        update = {}
        for key, t in tensors.items():
            if key not in current:
                raise CheckpointError(f"weight update: unexpected vision tensor {key!r} (not part of this model)")
            # Cast to the weight's dtype, as the first load does (and vLLM's loaders do for their parameters).
            update[key] = t.to(current[key].dtype)
        self.bivit_encoder.update_weights(update, source="vLLM weight update", partial=True)

    def _processing(self) -> Any:
        """The checkpoint's preprocessing, from the file vLLM's processor reads (the family's when it has none)."""
        raw = get_hf_file_to_dict(PREPROCESSOR_CONFIG, self.bivit_source, revision=self.bivit_revision)
        if raw is None:
            return default_processing(self.bivit_vision_config)
        return processing_from_dict(raw, self.bivit_vision_config, f"{self.bivit_source}/{PREPROCESSOR_CONFIG}")
