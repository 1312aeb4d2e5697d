"""Test helpers: real random checkpoints on disk, in the layouts bivit must read."""

from __future__ import annotations

from pathlib import Path

import torch

from bivit.checkpoint.config import ModelConfig
from bivit.checkpoint.state_dict import random_state_dict, save_checkpoint, transformers_config_dict as hf_config_dict

# Small but Kimi-shaped: head dim 72 like the real model; an 8x8 position table so that a 112x112 image
# uses it as is and every other size interpolates. The projector input width 4*288 = 1152 is the real tower
# width: on AVX-512 EPYC stock bf16 GEMMs take another path for a single row at K = 1152, so the bf16 controls
# find stock differences there (elsewhere they fall back to a deliberately row-count-dependent GEMM).
KIMI_SMALL = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=288, num_layers=2, num_heads=4,
                         intermediate_size=384, text_hidden_size=512)
K3_SMALL = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=96, qkv_hidden_size=128, num_layers=2,
                       num_heads=4, intermediate_size=160, norm_type="rmsnorm", norm_eps=None, attn_bias=False,
                       linear_bias=False, patch_embed_bias=False, pos_emb_interpolation="bilinear",
                       projector_type="patchmergerv2", text_hidden_size=112)


def write_checkpoint(directory, cfg: ModelConfig = KIMI_SMALL, *, seed: int = 0, dtype=torch.float32,
                     layout: str = "moonshot", shards: int = 1, lm_shards: int = 0) -> Path:
    """A real random checkpoint: Moonshot-layout weights, config.json in `layout` ("moonshot" | "hf-config").

    `lm_shards` adds stand-in language-model shards before the vision ones, like the published checkpoint.
    """
    state = random_state_dict(cfg, seed)
    extra = [{f"language_model.model.layers.{i}.mlp.weight": torch.full((4, 4), float(i))} for i in range(lm_shards)]
    config = hf_config_dict(cfg) if layout == "hf-config" else None
    return save_checkpoint(directory, cfg, state, dtype=dtype, shards=shards, extra_shards=extra, config=config)


def load_hf(directory, dtype=torch.float32):
    """The transformers port on the same checkpoint (its Moonshot-layout conversion applies on load)."""
    from transformers import Kimi_K25Model

    model = Kimi_K25Model.from_pretrained(str(directory), dtype=dtype, attn_implementation="sdpa")
    return model.eval()
