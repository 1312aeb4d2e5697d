"""An encoder's weights: building the model (a checkpoint directory, a hub repo id, or the seeded demo), the
device, the fingerprint that names exactly what computes, and replacing every weight at once.

`build_model` is the one loading path of `load_encoder` and `bivit.load_model`: both see the same weights in the
same dtypes, so an encoder and a trainer computing with them agree bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Mapping

import torch

from .. import ops
from ..base.dtypes import dtype_name
from ..base.options import DEMO_SEED
from ..errors import CheckpointError, ConfigError
from ..model import VisionModel
from .config import PRESETS, ModelConfig, load_config
from .hub import check_model, resolve as resolve_repo
from .preprocess_config import ProcessorConfig, load_processing, resolve_processing
from .state_dict import all_finite, check_keys, load_state_dict, random_state_dict

log = logging.getLogger("bivit")

DEMO_NOTICE = "bivit: using the built-in DEMO model (tiny, seeded random weights) — its embeddings are not Kimi's"


def build_model(model: str | os.PathLike | None, *, device: torch.device, dtype: torch.dtype,
                projector_dtype: torch.dtype, seed: int = DEMO_SEED, revision: str | None = None,
                processing: ProcessorConfig | str | dict | None = None,
                cls: type[VisionModel] = VisionModel) -> tuple[VisionModel, str, bool, ProcessorConfig]:
    """Read a checkpoint (a directory or a hub repo id), or make the demo model, into `cls`
    -> (model, name, is_demo, preprocessing)."""
    if model is None or str(model) == "demo":
        cfg = PRESETS["demo"]
        state = random_state_dict(cfg, seed)
        proc = resolve_processing("demo" if processing is None else processing, cfg)
        name, is_demo = "demo", True
        log.warning(DEMO_NOTICE)
    else:
        path, name = Path(model), str(model)
        check_model(model, revision)
        if not path.is_dir():
            path = resolve_repo(str(model), revision)
            name = str(model) + (f"@{revision}" if revision and "@" not in str(model) else "")
        cfg = load_config(path)
        proc = load_processing(path, cfg) if processing is None else resolve_processing(processing, cfg)
        state = load_state_dict(path, cfg)
        is_demo = False
    return model_from_state(cfg, state, device=device, dtype=dtype, projector_dtype=projector_dtype, cls=cls), \
        name, is_demo, proc


def model_from_state(cfg: ModelConfig, state: Mapping[str, torch.Tensor], *, device: torch.device,
                     dtype: torch.dtype, projector_dtype: torch.dtype, cls: type[VisionModel] = VisionModel
                     ) -> VisionModel:
    """`cls` over a checked state dict (`bivit.checkpoint.state_dict.checked_state`): the tower in `dtype`, the
    projector in `projector_dtype`, on `device` (each weight cast once, here)."""
    with torch.device("meta"):
        net = cls(cfg)
    net.load_state_dict(dict(state), strict=True, assign=True)
    net.vision_tower.to(device=device, dtype=dtype)
    net.mm_projector.to(device=device, dtype=projector_dtype)
    ops.backend_for(device).load()  # CPU: load and self-test the installed kernels now
    return net


def parse_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
        torch.empty(0, device=device)  # a device this torch build or machine lacks fails here, not mid-load
    except (RuntimeError, TypeError, AssertionError) as e:
        raise ConfigError(f"option 'device' = {str(device)!r} is not available here ({str(e).splitlines()[0]})") \
            from None
    return device


def fingerprint(model: VisionModel, *, output_dtype: torch.dtype, batch_invariant: bool,
                processing: ProcessorConfig, alpha: str, bits: str) -> str:
    """Content hash of config + weights + dtypes + mode + preprocessing + the class of bits that computes them
    (`bits`: `bivit-arith/1`, the same on every CPU, or a machine kind's own, `bivit.ops.bits`): the same for two
    loads of the same weights; the same bytes in give the same embedding out under one fingerprint, on any
    machine (the caches, the encoder-cache ids and the dataset jobs rely on it)."""
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    h.update(f"{model.vision_tower.dtype}|{model.mm_projector.dtype}|{output_dtype}|{batch_invariant}".encode())
    h.update(json.dumps([processing.to_dict(), alpha, bits], sort_keys=True).encode())
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def replace_weights(model: VisionModel, state_dict: Mapping[str, torch.Tensor], source: str, *,
                    partial: bool = False) -> None:
    """Copy every weight of `state_dict` into `model` in place, all or nothing.

    The update must hold exactly the model's tensors (`partial`: some of them), by checkpoint name, each with the
    model's shape and dtype (no silent casts: the computed bits must be the sender's) and finite; otherwise a
    CheckpointError names `source` and the first offending key and nothing is changed.
    """
    current = model.state_dict()
    if partial:
        current = {k: t for k, t in current.items() if k in state_dict}
    check_keys(current, state_dict, lambda k, more: f"{source}: missing tensor {k!r}{more}; an update replaces "
                                                    "every weight",
               lambda k: f"{source}: unexpected tensor {k!r} (not a weight of this model)")
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
