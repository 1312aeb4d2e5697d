"""Test helpers: real random checkpoints on disk, in the layouts bivit must read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bivit.checkpoint import random_state_dict, save_checkpoint
from bivit.config import ModelConfig

# Small but Kimi-shaped: head dim 72 like the real model; an 8x8 position table so that a 112x112 image
# uses it as is and every other size interpolates. The projector input width 4*288 = 1152 is the real tower
# width: at K = 1152 stock bf16 GEMMs take another path for a single row, which the bf16 controls need.
KIMI_SMALL = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=288, num_layers=2, num_heads=4,
                         intermediate_size=384, text_hidden_size=512)
K3_SMALL = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=96, qkv_hidden_size=128, num_layers=2,
                       num_heads=4, intermediate_size=160, norm_type="rmsnorm", norm_eps=None, attn_bias=False,
                       linear_bias=False, patch_embed_bias=False, pos_emb_interpolation="bilinear",
                       projector_type="patchmergerv2", text_hidden_size=112)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json in the transformers (`Kimi_K25Config`) layout, with a tiny DeepSeek-V3 text model."""
    return {
        "model_type": "kimi_k25",
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "vision_config": {
            "model_type": "kimi_k25_vision", "patch_size": cfg.patch_size, "pos_emb_height": cfg.pos_emb_height,
            "pos_emb_width": cfg.pos_emb_width, "pos_emb_time": cfg.pos_emb_time,
            "num_attention_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2],
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
        "text_config": {
            "model_type": "deepseek_v3", "hidden_size": cfg.text_hidden_size, "num_hidden_layers": 1,
            "intermediate_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 2, "num_experts_per_tok": 1,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
            "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
            "v_head_dim": 8, "vocab_size": 64, "n_group": 1, "topk_group": 1,
        },
        "projection_hidden_size": cfg.hidden_size,
        "projection_layer_norm_eps": cfg.projector_ln_eps,
        "image_token_id": 60, "video_token_id": 61, "vision_start_token_id": 62, "vision_end_token_id": 63,
        "tie_word_embeddings": False,
    }


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
