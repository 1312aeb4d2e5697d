"""A tiny Kimi-K2.5-architecture checkpoint with real random weights, written for the vLLM integration tests.

One directory that both bivit and vLLM load without conversion:

* vision tower + projector: bivit's own writers (`bivit.checkpoint.state_dict`), Moonshot weight names, the transformers
  config layout (plain key names, which is what vLLM's Kimi-K2.5 model reads);
* language model: a 2-layer DeepSeek-V3 (multi-head latent attention with `kv_lora_rank` 512 and
  `qk_rope_head_dim` 64, the only MLA head size vLLM's CPU kernel takes; layer 0 dense, layer 1 a small
  mixture of experts), random weights named as vLLM's `DeepseekV2ForCausalLM` loads them;
* `preprocessor_config.json` with Kimi-K2.5's published `media_proc_cfg`;
* a tokenizer built here, offline: byte-level (every byte one token, no merges) plus Kimi's special tokens,
  saved as `tokenizer.json` with a Kimi-style chat template. Not Kimi's vocabulary: the tests need exact
  token ids around the media placeholders, not Kimi's BPE merges.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from bivit.checkpoint.config import ModelConfig
from bivit.checkpoint.preprocess_config import K25_PROCESSING, preprocessor_config_dict
from bivit.checkpoint.state_dict import random_state_dict, save_checkpoint, transformers_config_dict

# Vision: head dim 72 like the real tower; an 8x8 position table (112x112 images use it as is, other sizes
# interpolate). The projector writes the language model's width.
TEXT_HIDDEN = 256
VISION = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=288, num_layers=2, num_heads=4,
                     intermediate_size=384, text_hidden_size=TEXT_HIDDEN)
SPECIAL_TOKENS = ["[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                  "<|im_end|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]
VOCAB = 320  # 256 bytes + 11 special tokens, with room for tokens a server adds (vLLM's <prompt_embeds>)
TEXT = {
    "model_type": "deepseek_v3", "hidden_size": TEXT_HIDDEN, "num_hidden_layers": 2, "intermediate_size": 512,
    "moe_intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "vocab_size": VOCAB,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
}
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>system<|im_middle|>{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def write_tokenizer(directory: Path) -> dict[str, int]:
    """A byte-level tokenizer with Kimi's special tokens -> {special token: id}."""
    # tokenizers comes with transformers (optional here); conftest imports this module in every environment
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # optional: with transformers
    from tokenizers.pre_tokenizers import ByteLevel  # optional: with transformers

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[EOS]", "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    return ids


def language_model_state(seed: int = 1) -> dict[str, torch.Tensor]:
    """Random DeepSeek-V3 weights under the names vLLM's DeepseekV2ForCausalLM loads (prefixed for Kimi)."""
    g = torch.Generator().manual_seed(seed)
    t = TEXT
    h, heads, kv, rope, nope, v = (t["hidden_size"], t["num_attention_heads"], t["kv_lora_rank"],
                                   t["qk_rope_head_dim"], t["qk_nope_head_dim"], t["v_head_dim"])

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    def mlp(prefix: str, inner: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.gate_proj.weight": w(inner, h), f"{prefix}.up_proj.weight": w(inner, h),
                f"{prefix}.down_proj.weight": w(h, inner)}

    s = {"model.embed_tokens.weight": torch.randn(t["vocab_size"], h, generator=g),
         "model.norm.weight": norm(h), "lm_head.weight": w(t["vocab_size"], h)}
    for i in range(t["num_hidden_layers"]):
        p = f"model.layers.{i}"
        s.update({
            f"{p}.input_layernorm.weight": norm(h), f"{p}.post_attention_layernorm.weight": norm(h),
            f"{p}.self_attn.q_proj.weight": w(heads * (nope + rope), h),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": w(kv + rope, h),
            f"{p}.self_attn.kv_a_layernorm.weight": norm(kv),
            f"{p}.self_attn.kv_b_proj.weight": w(heads * (nope + v), kv),
            f"{p}.self_attn.o_proj.weight": w(h, heads * v),
        })
        if i < t["first_k_dense_replace"]:
            s.update(mlp(f"{p}.mlp", t["intermediate_size"]))
        else:
            s[f"{p}.mlp.gate.weight"] = w(t["n_routed_experts"], h)
            s[f"{p}.mlp.gate.e_score_correction_bias"] = 0.01 * torch.randn(t["n_routed_experts"], generator=g)
            for e in range(t["n_routed_experts"]):
                s.update(mlp(f"{p}.mlp.experts.{e}", t["moe_intermediate_size"]))
            s.update(mlp(f"{p}.mlp.shared_experts", t["moe_intermediate_size"] * t["n_shared_experts"]))
    return {f"language_model.{k}": x for k, x in s.items()}


def write_tiny_kimi(directory, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                    vision_seed: Optional[int] = None) -> Path:
    """Write the whole checkpoint into `directory` (created) and return it; `vision_seed` (default `seed`): other
    vision weights beside the same language model."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(directory)
    config = transformers_config_dict(VISION)
    config.update({
        "architectures": ["KimiK25ForConditionalGeneration"], "text_config": TEXT, "dtype": "float32",
        "image_token_id": ids["<|media_pad|>"], "media_placeholder_token_id": ids["<|media_pad|>"],
        "video_token_id": ids["<|media_pad|>"], "vision_start_token_id": ids["<|media_begin|>"],
        "vision_end_token_id": ids["<|media_end|>"], "bos_token_id": ids["[BOS]"], "eos_token_id": ids["[EOS]"],
        "use_unified_vision_chunk": True, "tie_word_embeddings": False,
    })
    lm = {k: x.to(dtype).contiguous() for k, x in language_model_state(seed + 1).items()}
    vision = random_state_dict(VISION, seed if vision_seed is None else vision_seed)
    save_checkpoint(directory, VISION, vision, dtype=dtype, extra_shards=[lm], config=config)
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor_config_dict(K25_PROCESSING), indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": ids["[BOS]"],
                                                                  "eos_token_id": ids["[EOS]"]}))
    return directory
