"""Checkpoint reading (and writing, for tests and benchmarks).

A Kimi-K2.6 checkpoint is ~555 GB in 64 shards, of which the vision tower and projector are ~1 GB in the last
two. We read `model.safetensors.index.json`, open only the shards that hold `vision_tower.*` / `mm_projector.*`
tensors, memory-map them, and never read a language-model tensor. Layouts:

* Moonshot (the published one): names as in `bivit.model`, loaded as they are.
* transformers (re-saved by the HF port): split, RoPE-permuted q/k/v and other names; converted exactly
  (the permutation is inverted and q/k/v packed back into `wqkv`).

Every problem becomes a CheckpointError naming the key and the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..base.fileio import file_kind, read_json
from ..errors import CheckpointError
from ..model import VisionModel
from .config import MOONSHOT_KEYS, ModelConfig

INDEX = "model.safetensors.index.json"
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
HF_PREFIXES = ("model.vision_tower.", "model.mm_projector.")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Moonshot-layout keys and shapes a checkpoint for `cfg` must hold, read off the model itself."""
    with torch.device("meta"):
        model = VisionModel(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def is_vision_key(key: str) -> bool:
    return key.startswith(VISION_PREFIXES) or key.startswith(HF_PREFIXES)


def vision_weight_map(index: Path) -> dict[str, str]:
    """The vision/projector entries of a checkpoint's index: key -> shard file name (checked to be a file name
    inside the checkpoint folder). Read by the loader and by hub resolution, which fetches only those shards.
    An index that names a key twice is refused (which entry counts would depend on the JSON parser)."""
    try:
        weight_map = read_json(index)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except OSError as e:  # a directory, a FIFO (not waited on), a file too large to be an index, ...
        raise CheckpointError(f"{index}: cannot read the index ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: unreadable index ({e})") from None
    return {k: _shard_name(index, k, f) for k, f in weight_map.items() if is_vision_key(k)}


def vision_key_files(directory: Path) -> dict[str, Path]:
    """Map every vision/projector key to the shard that holds it, opening only the shards that must be opened."""
    index = directory / INDEX
    if os.path.lexists(index):  # a broken index is an error, not a reason to open every shard
        return {k: directory / f for k, f in vision_weight_map(index).items()}
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{directory}: no {INDEX} and no *.safetensors files")
    found: dict[str, Path] = {}
    for shard in shards:
        with _open(shard) as f:
            for k in f.keys():
                if is_vision_key(k):
                    if k in found:  # no index says which copy counts: refuse rather than let the last one win
                        raise CheckpointError(f"{directory}: tensor {k!r} is in two shards, {found[k].name} and "
                                              f"{shard.name}, and there is no {INDEX} to say which one counts")
                    found[k] = shard
    return found


def _shard_name(index: Path, key: str, name: object) -> str:
    """The shard an index entry names, which must be a file name inside the checkpoint folder."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index}: weight_map[{key!r}] = {name!r}: expected a shard file name")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts:
        raise CheckpointError(f"{index}: weight_map[{key!r}] = {name!r} points outside the checkpoint folder")
    return name


def _open(path: Path):
    if not path.exists():
        raise CheckpointError(f"{path}: shard file is missing")
    if not path.is_file():  # a FIFO would block the reader, a device would be read forever
        raise CheckpointError(f"{path}: shard is not a regular file but {file_kind(path.stat().st_mode)}")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def read_tensors(key_files: dict[str, Path]) -> dict[str, tuple[torch.Tensor, Path]]:
    by_file: dict[Path, list[str]] = {}
    for k, p in key_files.items():
        by_file.setdefault(p, []).append(k)
    out: dict[str, tuple[torch.Tensor, Path]] = {}
    for path, keys in sorted(by_file.items()):
        with _open(path) as f:
            present = set(f.keys())
            for k in keys:
                if k not in present:
                    raise CheckpointError(f"{path}: index says it holds {k!r} but it does not")
                try:
                    out[k] = (f.get_tensor(k), path)
                except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                    raise CheckpointError(f"{path}: cannot read {k!r} (truncated or corrupt shard: {e})") from None
    return out


# ------------------------------------------------------------------------------------ transformers layout

_HF_RENAMES = [
    (r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$", "vision_tower.patch_embed.pos_emb.weight"),
    (r"^model\.vision_tower\.patch_embed\.", "vision_tower.patch_embed."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.([qkv])_proj\.", r"vision_tower.encoder.blocks.\1.\2_proj."),
    (r"^model\.vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
    (r"^model\.mm_projector\.pre_norm\.", "mm_projector.pre_norm."),
    (r"^model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"^model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
]


def _unpermute_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo transformers' PermuteForRope: per head, rows (2, half) back to interleaved (half, 2)."""
    half = t.shape[0] // heads // 2
    return t.reshape(heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def from_transformers_layout(tensors: dict[str, tuple[torch.Tensor, Path]], cfg: ModelConfig
                             ) -> dict[str, tuple[torch.Tensor, Path]]:
    if cfg.projector_type != "patchmerger" or cfg.attn_width != cfg.hidden_size:
        raise CheckpointError("transformers-layout checkpoints exist only for Kimi-K2.5/K2.6; "
                              f"this config is {cfg.projector_type} with attention width {cfg.attn_width}")
    renamed: dict[str, tuple[torch.Tensor, Path]] = {}
    for key, value in tensors.items():
        new = key if key.startswith("model.") else "model." + key
        for pattern, repl in _HF_RENAMES:
            new, n = re.subn(pattern, repl, new)
            if n:
                break
        else:
            raise CheckpointError(f"{value[1]}: unexpected tensor {key!r} in a transformers-layout checkpoint")
        renamed[new] = value
    out: dict[str, tuple[torch.Tensor, Path]] = {}
    for key, value in renamed.items():
        m = re.match(r"^(vision_tower\.encoder\.blocks\.\d+)\.q_proj\.(weight|bias)$", key)
        if m:
            parts = []
            for name in "qkv":
                part_key = f"{m[1]}.{name}_proj.{m[2]}"
                if part_key not in renamed:
                    raise CheckpointError(f"{value[1]}: {part_key!r} missing (transformers layout, cannot "
                                          "rebuild wqkv)")
                t = renamed[part_key][0]
                parts.append(_unpermute_rope(t, cfg.num_heads) if name in "qk" else t)
            out[f"{m[1]}.wqkv.{m[2]}"] = (torch.cat(parts), value[1])
        elif not re.search(r"\.[kv]_proj\.", key):
            out[key] = value
    return out


# ------------------------------------------------------------------------------------------------- load

def all_finite(t: torch.Tensor) -> bool:
    # min/max propagate NaN and expose +-Inf, and are ~4x cheaper than isfinite().all() on bf16.
    return not t.numel() or all(bool(torch.isfinite(v)) for v in torch.aminmax(t))


def check_keys(expected: Iterable[str], got: Iterable[str], missing: Callable[[str, str], str],
               unexpected: Callable[[str], str]) -> None:
    """CheckpointError unless `got` holds exactly the `expected` keys: `missing(first key, " (and N more)")` or
    `unexpected(first key)` is its message (a checkpoint being loaded and a weight update both check this)."""
    absent = sorted(set(expected) - set(got))
    if absent:
        raise CheckpointError(missing(absent[0], f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
    extra = sorted(set(got) - set(expected))
    if extra:
        raise CheckpointError(unexpected(extra[0]))


def load_state_dict(directory: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read, convert and validate the vision/projector weights of a checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    key_files = vision_key_files(directory)
    if not key_files:
        raise CheckpointError(f"{directory}: no vision_tower.* / mm_projector.* tensors found")
    where = directory / INDEX if (directory / INDEX).is_file() else directory
    return checked_state(read_tensors(key_files), cfg, where)


def checked_state(tensors: dict[str, tuple[torch.Tensor, Path]], cfg: ModelConfig, where: Path
                  ) -> dict[str, torch.Tensor]:
    """Vision/projector tensors by checkpoint name (either layout), each with the file or source it came from ->
    the model's state dict, converted and validated: every key of the model, its shape, a weight dtype, finite.
    `where` names the whole set in a missing-key error (a checkpoint's index, or another source)."""
    if any(k.startswith(HF_PREFIXES) or ".layers." in k for k in tensors):
        tensors = from_transformers_layout(tensors, cfg)
    expected = expected_shapes(cfg)
    check_keys(expected, tensors, lambda k, more: f"{where}: missing vision tensor {k!r}{more}",
               lambda k: f"{tensors[k][1]}: unexpected vision tensor {k!r} (not part of a {cfg.projector_type} "
                         "model with this config)")
    state: dict[str, torch.Tensor] = {}
    for key, (t, path) in tensors.items():
        if tuple(t.shape) != expected[key]:
            raise CheckpointError(f"{path}: {key!r} has shape {tuple(t.shape)}, config expects {expected[key]}")
        if t.dtype not in WEIGHT_DTYPES:
            # Kimi's top-level quantization_config targets the language model only; quantized (int or float8)
            # vision weights would mean a checkpoint we do not understand.
            raise CheckpointError(f"{path}: {key!r} is {t.dtype}; vision weights must be bfloat16, float16, "
                                  "float32 or float64")
        if not all_finite(t):
            raise CheckpointError(f"{path}: {key!r} contains NaN or Inf")
        state[key] = t
    return state


# ------------------------------------------------------------------------------------------------ write

def _unit_uniform(g: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values uniform on (-sqrt(3), sqrt(3)) (mean 0, variance 1): integers from numpy's PCG64, exact
    conversions and one float32 multiply, so the same bits on every platform (PyTorch's randn is not: its vector
    code differs from one CPU kind to the next)."""
    k = g.integers(0, 2 ** 24, size=shape, dtype=np.int64)
    u = ((2 * k + 1 - 2 ** 24) / 2.0 ** 24).astype(np.float32)  # exact: odd multiples of 2^-24 in (-1, 1)
    return torch.from_numpy(u * np.float32(1.7320508075688772))


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights in the Moonshot layout (fp32): the demo model, tests, benchmarks. The same
    bits on every machine (`_unit_uniform`), so an encoder of them has one fingerprint and, in bivit-arith/1,
    one set of rows everywhere."""
    g = np.random.Generator(np.random.PCG64(seed))
    state = {}
    for key, shape in expected_shapes(cfg).items():
        t = _unit_uniform(g, tuple(shape))
        if key.endswith("norm0.weight") or key.endswith("norm1.weight") or key.endswith("norm.weight") or \
                key.endswith("final_layernorm.weight"):
            t = 1.0 + 0.1 * t
        elif key.endswith(".bias"):
            t = 0.02 * t
        elif key.endswith("pos_emb.weight"):
            t = 0.5 * t
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
            t = t / fan_in ** 0.5
        state[key] = t
    return state


def moonshot_config_dict(cfg: ModelConfig) -> dict:
    """A config.json in Moonshot's published layout for `cfg`."""
    fields = cfg.to_dict()
    vc = {"model_type": "kimi_k25_vision", "pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool",
          "video_attn_type": "spatial_temporal",
          **{keys[0]: fields[name] for name, keys in MOONSHOT_KEYS.items() if fields[name] is not None}}
    return {
        "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "dtype": "bfloat16",
        "vision_config": vc, "text_config": {"hidden_size": cfg.text_hidden_size},
        "quantization_config": {"quant_method": "compressed-tensors", "targets": ["Linear"],
                                "ignore": ["lm_head"]},
    }


def transformers_config_dict(cfg: ModelConfig) -> dict:
    """config.json in the transformers (`Kimi_K25Config`) layout for `cfg`, with a tiny stand-in DeepSeek-V3
    text model: the transformers port can then load a Moonshot-layout checkpoint (its conversion applies on
    load), and bivit reads this layout too, so one directory serves both (parity tests, benchmarks)."""
    return {
        "model_type": "kimi_k25",
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "vision_config": {
            "model_type": "kimi_k25_vision", "patch_size": cfg.patch_size, "pos_emb_height": cfg.pos_emb_height,
            "pos_emb_width": cfg.pos_emb_width, "pos_emb_time": cfg.pos_emb_time,
            "num_attention_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "hidden_act": cfg.hidden_act, "merge_kernel_size": list(cfg.merge_kernel_size),
            "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta},
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


def save_checkpoint(directory: str | os.PathLike, cfg: ModelConfig, state: dict[str, torch.Tensor], *,
                    dtype: torch.dtype = torch.bfloat16, shards: int = 1,
                    extra_shards: Iterable[dict[str, torch.Tensor]] = (), config: dict | None = None) -> Path:
    """Write a Moonshot-layout checkpoint (config.json + safetensors, indexed when sharded).

    `extra_shards` are written first, as stand-ins for language-model shards, so that the vision tensors sit
    in the last shards like in the published checkpoint.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or moonshot_config_dict(cfg), indent=2))
    groups = [dict(g) for g in extra_shards]
    keys = list(state)
    per = -(-len(keys) // shards)
    groups += [{k: state[k].to(dtype).contiguous() for k in keys[i:i + per]} for i in range(0, len(keys), per)]
    total = len(groups)
    if total == 1:
        save_file(groups[0], str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(group, str(directory / name))
        weight_map.update({k: name for k in group})
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return directory
