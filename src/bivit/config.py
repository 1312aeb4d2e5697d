"""Model configuration: one dataclass, named presets, and readers for both config.json layouts.

Moonshot's published `config.json` keeps the vision settings under `vision_config` with `vt_*` keys; the
transformers port (`Kimi_K25Config`) uses plain names. Both map onto `ModelConfig`. Anything bivit does not
implement raises ConfigError naming the key, rather than being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    qkv_hidden_size: int | None = None  # None: same as hidden_size (K2.x); K3 widens attention to 1536
    merge_kernel_size: tuple[int, int] = (2, 2)
    norm_type: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float | None = 1e-5  # None: torch's RMSNorm default (machine epsilon of the dtype)
    attn_bias: bool = True
    linear_bias: bool = True
    patch_embed_bias: bool = True
    pos_emb_interpolation: str = "bicubic"  # "bicubic" | "bilinear"
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    projector_type: str = "patchmerger"  # "patchmerger" (K2.x) | "patchmergerv2" (K3)
    mm_hidden_size: int | None = None  # projector input width per sub-token; None: hidden_size
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    projector_hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        # Normalise "same as hidden" so that two spellings of one model compare equal.
        if self.qkv_hidden_size is None:
            object.__setattr__(self, "qkv_hidden_size", self.hidden_size)
        if self.mm_hidden_size is None:
            object.__setattr__(self, "mm_hidden_size", self.hidden_size)
        object.__setattr__(self, "merge_kernel_size", tuple(self.merge_kernel_size))
        _check(self.patch_size > 0, "patch_size", self.patch_size)
        _check(tuple(self.merge_kernel_size) == (2, 2), "merge_kernel_size", self.merge_kernel_size,
               "only the 2x2 sd2_tpool merger exists")
        _check(self.norm_type in ("layernorm", "rmsnorm"), "norm_type", self.norm_type)
        _check(self.pos_emb_interpolation in ("bicubic", "bilinear"), "pos_emb_interpolation",
               self.pos_emb_interpolation)
        _check(self.hidden_act in ("gelu_pytorch_tanh",), "hidden_act", self.hidden_act)
        _check(self.projector_hidden_act in ("gelu",), "projector_hidden_act", self.projector_hidden_act)
        _check(self.projector_type in ("patchmerger", "patchmergerv2"), "projector_type", self.projector_type)
        _check(self.num_heads > 0 and self.attn_width % self.num_heads == 0, "num_heads", self.num_heads,
               f"must divide the attention width {self.attn_width}")
        _check(self.head_dim % 4 == 0, "num_heads", self.num_heads,
               f"head dim {self.head_dim} must be a multiple of 4 for 2-D RoPE")
        _check(self.hidden_size % 2 == 0, "hidden_size", self.hidden_size, "must be even (temporal sin-cos term)")
        _check(self.projector_input_size == self.hidden_size, "mm_hidden_size", self.mm_hidden_size,
               f"must equal the tower width {self.hidden_size}")
        for key in ("hidden_size", "num_layers", "intermediate_size", "text_hidden_size",
                    "pos_emb_height", "pos_emb_width", "pos_emb_time"):
            _check(getattr(self, key) > 0, key, getattr(self, key))

    @property
    def attn_width(self) -> int:
        return self.qkv_hidden_size

    @property
    def head_dim(self) -> int:
        return self.attn_width // self.num_heads

    @property
    def projector_input_size(self) -> int:
        return self.mm_hidden_size

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        return d


def _check(ok: bool, key: str, value: Any, why: str = "unsupported value") -> None:
    if not ok:
        err = ConfigError(f"config key {key!r} = {value!r}: {why}")
        err.key = key
        raise err


def _build(fields: dict[str, Any], source_keys: dict[str, str]) -> ModelConfig:
    """ModelConfig(**fields), with validation errors naming the key as spelled in the file."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        key = getattr(e, "key", None)
        if key in source_keys:
            raise ConfigError(str(e).replace(f"{key!r}", repr(source_keys[key]), 1)) from None
        raise


PRESETS: dict[str, ModelConfig] = {
    "kimi-k2.6": ModelConfig(),
    "kimi-k3": ModelConfig(
        hidden_size=1024, qkv_hidden_size=1536, num_heads=12, intermediate_size=4096, norm_type="rmsnorm",
        norm_eps=None, attn_bias=False, linear_bias=False, patch_embed_bias=False, pos_emb_interpolation="bilinear",
        projector_type="patchmergerv2",
    ),
    # The real K2.x architecture at toy size, so the demo runs in milliseconds anywhere.
    "demo": ModelConfig(
        pos_emb_height=16, pos_emb_width=16, hidden_size=96, num_layers=2, num_heads=4, intermediate_size=192,
        text_hidden_size=128,
    ),
}
PRESETS["kimi-k2.5"] = PRESETS["kimi-k2.6"]


def load_config(path: str | Path) -> ModelConfig:
    """Read a checkpoint's config.json in either the Moonshot (`vt_*`) or the transformers layout."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    vc = raw.get("vision_config")
    if not isinstance(vc, dict):
        raise ConfigError("config key 'vision_config' is missing or not an object")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    # Moonshot's layout is recognised by its vt_* keys; plain names are accepted as a fallback (vLLM's naming).
    if any(k.startswith("vt_") for k in vc) or "mm_projector_type" in vc or "mm_projector_type" in raw:
        return _from_moonshot(vc, raw, text)
    return _from_hf(vc, raw, text)


def _get(d: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def _expect(d: dict, key: str, allowed: tuple, default: Any) -> None:
    value = d.get(key, default)
    if value not in allowed:
        raise ConfigError(f"config key {key!r} = {value!r}: unsupported (bivit implements {', '.join(map(repr, allowed))})")


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key {key!r} = {value!r}: expected an integer")
    return value


def _from_moonshot(vc: dict, raw: dict, text: dict) -> ModelConfig:
    base = ModelConfig()
    _expect(vc, "merge_type", ("sd2_tpool",), "sd2_tpool")
    _expect(vc, "pos_emb_type", ("divided_fixed",), "divided_fixed")
    _expect(vc, "video_attn_type", ("spatial_temporal",), "spatial_temporal")
    projector = _get(vc, "mm_projector_type", default=_get(raw, "mm_projector_type", default="patchmerger"))
    norm_type = vc.get("norm_type", "layernorm")
    hidden = _int(_get(vc, "vt_hidden_size", "hidden_size", default=base.hidden_size), "vt_hidden_size")
    fields = dict(
        patch_size=_int(_get(vc, "patch_size", default=14), "patch_size"),
        pos_emb_height=_int(_get(vc, "init_pos_emb_height", default=64), "init_pos_emb_height"),
        pos_emb_width=_int(_get(vc, "init_pos_emb_width", default=64), "init_pos_emb_width"),
        pos_emb_time=_int(_get(vc, "init_pos_emb_time", default=4), "init_pos_emb_time"),
        hidden_size=hidden,
        num_layers=_int(_get(vc, "vt_num_hidden_layers", "num_hidden_layers", default=27), "vt_num_hidden_layers"),
        num_heads=_int(_get(vc, "vt_num_attention_heads", "num_attention_heads", default=16), "vt_num_attention_heads"),
        intermediate_size=_int(_get(vc, "vt_intermediate_size", "intermediate_size", default=4304),
                               "vt_intermediate_size"),
        qkv_hidden_size=_get(vc, "qkv_hidden_size"),
        merge_kernel_size=tuple(_get(vc, "merge_kernel_size", default=(2, 2))),
        norm_type=norm_type,
        norm_eps=_get(vc, "norm_eps", default=1e-5 if norm_type == "layernorm" else None),
        attn_bias=bool(vc.get("attn_bias", True)),
        linear_bias=bool(vc.get("linear_bias", True)),
        patch_embed_bias=bool(vc.get("patch_embed_proj_bias", True)),
        pos_emb_interpolation=vc.get("pos_emb_interpolation_mode", "bicubic"),
        hidden_act=_get(vc, "activation_func", "vt_hidden_act", default="gelu_pytorch_tanh"),
        projector_type=projector,
        mm_hidden_size=_get(vc, "mm_hidden_size", default=_get(raw, "mm_hidden_size")),
        text_hidden_size=_int(_get(vc, "text_hidden_size", default=_get(raw, "text_hidden_size",
                                   default=_get(text, "hidden_size", default=base.text_hidden_size))),
                              "text_hidden_size"),
        projector_ln_eps=float(_get(vc, "projector_ln_eps", default=_get(raw, "projector_ln_eps", default=1e-5))),
        projector_hidden_act=_get(vc, "projector_hidden_act", default="gelu"),
    )
    return _build(fields, {
        "num_heads": "vt_num_attention_heads", "hidden_size": "vt_hidden_size", "num_layers": "vt_num_hidden_layers",
        "intermediate_size": "vt_intermediate_size", "pos_emb_height": "init_pos_emb_height",
        "pos_emb_width": "init_pos_emb_width", "pos_emb_time": "init_pos_emb_time", "hidden_act": "activation_func",
        "pos_emb_interpolation": "pos_emb_interpolation_mode", "projector_type": "mm_projector_type",
    })


def _from_hf(vc: dict, raw: dict, text: dict) -> ModelConfig:
    rope = vc.get("rope_parameters") or {}
    _expect(rope, "rope_type", ("axial",), "axial")
    if "hidden_size" not in text:
        raise ConfigError("config key 'text_config.hidden_size' is missing (projector output width)")
    hidden = _int(vc.get("hidden_size", 1152), "vision_config.hidden_size")
    return _build(dict(
        patch_size=_int(vc.get("patch_size", 14), "vision_config.patch_size"),
        pos_emb_height=_int(vc.get("pos_emb_height", 64), "vision_config.pos_emb_height"),
        pos_emb_width=_int(vc.get("pos_emb_width", 64), "vision_config.pos_emb_width"),
        pos_emb_time=_int(vc.get("pos_emb_time", 4), "vision_config.pos_emb_time"),
        hidden_size=hidden,
        num_layers=_int(vc.get("num_hidden_layers", 27), "vision_config.num_hidden_layers"),
        num_heads=_int(vc.get("num_attention_heads", 16), "vision_config.num_attention_heads"),
        intermediate_size=_int(vc.get("intermediate_size", 4304), "vision_config.intermediate_size"),
        merge_kernel_size=tuple(vc.get("merge_kernel_size", (2, 2))),
        hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        mm_hidden_size=raw.get("projection_hidden_size"),
        text_hidden_size=_int(text["hidden_size"], "text_config.hidden_size"),
        projector_ln_eps=float(raw.get("projection_layer_norm_eps", 1e-5)),
    ), {"num_heads": "vision_config.num_attention_heads", "hidden_size": "vision_config.hidden_size",
        "num_layers": "vision_config.num_hidden_layers", "mm_hidden_size": "projection_hidden_size",
        "intermediate_size": "vision_config.intermediate_size", "hidden_act": "vision_config.hidden_act",
        "text_hidden_size": "text_config.hidden_size", "merge_kernel_size": "vision_config.merge_kernel_size"})
