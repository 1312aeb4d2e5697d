"""The trainer's side: `load_model`, the vision encoder as a trainable `nn.Module`.

An RL or post-training loop encodes images twice: in the inference engine for rollouts (`Encoder`,
`bivit serve`) and in the trainer, with autograd, to compute log-probabilities and gradients. If the two
forwards differ, the policy is silently off-policy. `load_model` returns the same model, loaded by the same
code, running the same ops: its per-item outputs are the bits `Encoder.encode_pixels` returns for those items
(same weights and dtypes), and in invariant mode they do not depend on the micro-batch the trainer chose.
"""

from __future__ import annotations

import os
import weakref
from typing import Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import ops
from ..base.dtypes import resolve_dtypes
from ..base.options import DEMO_SEED
from ..checkpoint.config import ModelConfig
from ..checkpoint.weights import build_model, model_from_state, parse_device
from ..core.packing import check_pixels
from ..model import VisionModel


class TrainableModel(VisionModel):
    """`forward(pixel_values, grid_thw)` -> one `[tokens_i, text_hidden]` tensor per item (projector dtype).

    Parameter names are the checkpoint's (`vision_tower.*`, `mm_projector.*`), so a state dict goes back to
    `Encoder.update_weights` or a safetensors file as it is. Freeze parts with `requires_grad_` as usual.
    """

    def __init__(self, cfg, batch_invariant: bool = True, activation_checkpointing: bool = False) -> None:
        super().__init__(cfg)
        self.batch_invariant = batch_invariant
        self.activation_checkpointing = activation_checkpointing

    @property
    def activation_checkpointing(self) -> bool:
        """Recompute each tower block's activations in backward (less memory, same bits)."""
        return self.vision_tower.encoder.checkpoint_blocks

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        self.vision_tower.encoder.checkpoint_blocks = bool(enabled)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3)
        check_pixels(self.config, pixel_values, grid_thw)
        with ops.batch_invariant(self.batch_invariant):
            return super().forward(pixel_values.to(next(self.parameters()).device), grid_thw)


# Every trainable module alive, and per optimizer stepping them the version of each of their parameters before the
# step: what `_follow_optimizer_steps`' two hooks (registered once per process) share.
_MODELS: "weakref.WeakSet[TrainableModel]" = weakref.WeakSet()
_BEFORE_STEP: "weakref.WeakKeyDictionary[object, dict[int, int]]" = weakref.WeakKeyDictionary()
_hooked = False


def _follow_optimizer_steps(net: TrainableModel) -> None:
    """After any optimizer step that left one of `net`'s parameters with its version counter unchanged, bump it.

    bivit's ops key what they derive from a weight (pre-packed GEMM copies, resampled position tables) on the
    tensor's version counter. torch's fused optimizers (`AdamW(fused=True)`, transformers' default optimizer
    `adamw_torch_fused`, on CPU too) write parameters in place without bumping it, and the next forward would
    compute with the old weights. `mul_(1)` changes no bit of any value and bumps the counter; optimizers that
    bump it themselves cost nothing here. torch has no per-parameter hook: the two hooks are global, registered
    once, and look after every trainable module alive.
    """
    global _hooked
    _MODELS.add(net)
    if not _hooked:
        register_optimizer_step_pre_hook(_versions_before_step)
        register_optimizer_step_post_hook(_bump_unchanged_versions)
        _hooked = True


def _owned(optimizer) -> list[torch.Tensor]:
    mine = {id(p) for m in list(_MODELS) for p in m.parameters()}
    return [p for group in optimizer.param_groups for p in group["params"] if id(p) in mine]


def _versions_before_step(optimizer, args, kwargs) -> None:
    _BEFORE_STEP[optimizer] = {id(p): p._version for p in _owned(optimizer)}


def _bump_unchanged_versions(optimizer, args, kwargs) -> None:
    before = _BEFORE_STEP.pop(optimizer, {})
    with torch.no_grad():
        for p in _owned(optimizer):
            if before.get(id(p)) == p._version:
                p.mul_(1)


def load_model(model: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "bfloat16", projector_dtype: str | torch.dtype | None = None,
               batch_invariant: bool = True, activation_checkpointing: bool = False,
               seed: int = DEMO_SEED, revision: str | None = None) -> TrainableModel:
    """Load the vision tower + projector as a trainable module (all parameters require grad).

    Same arguments and defaults as `load_encoder` (`model` may be a hub repo id too): load both with the same
    `model`, `dtype` and `projector_dtype` and the module's outputs equal the encoder's, bit for bit.
    """
    tower_dtype, proj_dtype, _ = resolve_dtypes(dtype, projector_dtype)
    device = parse_device(device)
    net, _, _, _ = build_model(model, device=device, dtype=tower_dtype, projector_dtype=proj_dtype,
                               seed=seed, revision=revision, cls=TrainableModel)
    return _ready(net, batch_invariant, activation_checkpointing)


def trainable_from_state(cfg: ModelConfig, state: Mapping[str, torch.Tensor], *, device: torch.device,
                         dtype: torch.dtype, projector_dtype: torch.dtype, batch_invariant: bool = True,
                         activation_checkpointing: bool = False) -> TrainableModel:
    """The trainable module over weights already in memory (checkpoint names, e.g. converted from another
    implementation's module: `bivit.integrations.hf.attach`), ready as `load_model` leaves it."""
    net = model_from_state(cfg, state, device=device, dtype=dtype, projector_dtype=projector_dtype,
                           cls=TrainableModel)
    return _ready(net, batch_invariant, activation_checkpointing)


def _ready(net: TrainableModel, batch_invariant: bool, activation_checkpointing: bool) -> TrainableModel:
    net.batch_invariant = batch_invariant
    net.activation_checkpointing = activation_checkpointing
    net.requires_grad_(True)
    _follow_optimizer_steps(net)
    if batch_invariant:  # (the GPU path's forward refuses autograd: bivit.ops.cuda)
        ops.backend_for(next(net.parameters()).device).pack_and_prove(net)
    return net
