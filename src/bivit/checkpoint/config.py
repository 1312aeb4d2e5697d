"""Model configuration: one dataclass, named presets, and readers for both config.json layouts.

Moonshot's published `config.json` keeps the vision settings under `vision_config` with `vt_*` keys; the
transformers port (`Kimi_K25Config`) uses plain names. Both map onto `ModelConfig`. Anything bivit does not
implement raises ConfigError naming the key, rather than being silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.fileio import read_json
from ..errors import ConfigError


# Bounds on what a config may ask bivit to build: K2.6 has 27 layers and 0.47B parameters.
MAX_LAYERS = 1024
MAX_PARAMETERS = 20_000_000_000
# Each size key's own bound, so that no one key asks for a table or a layer nobody built (`init_pos_emb_time`
# 2e9 failed the first video with "Unable to allocate 7.45 GiB"): K2.6's values are 14, 64x64x4, widths of 1152
# to 7168; these are at least 64x them. The model's size as a whole is bounded by MAX_PARAMETERS.
MAX_SIZES = {"patch_size": 1024, "pos_emb_height": 4096, "pos_emb_width": 4096, "pos_emb_time": 4096,
             "hidden_size": 1 << 17, "intermediate_size": 1 << 19, "qkv_hidden_size": 1 << 17,
             "mm_hidden_size": 1 << 17, "text_hidden_size": 1 << 19, "num_heads": 4096}
# The float values' ranges, so that no accepted config makes every output NaN. The model computes in float32 or
# narrower: an eps below float32's smallest normal number rounds to zero or loses precision (a constant row then
# divides 0 by 0), one above 1 outweighs any normalised activation's variance; a RoPE base at or below 1 gives
# frequencies of 1 or more (1e-300 overflows them to inf: NaN everywhere), one beyond float32 is inf.
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e+38
EPS_RANGE = (FLOAT32_TINY, 1.0)


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
        for key, most in MAX_SIZES.items():
            _check(getattr(self, key) <= most, key, getattr(self, key), f"more than {most}")
        for key in ("norm_eps", "projector_ln_eps"):
            eps = getattr(self, key)
            _check(eps is None or (_is_number(eps) and EPS_RANGE[0] <= eps <= EPS_RANGE[1]), key, eps,
                   f"must be a number in [{EPS_RANGE[0]:g}, {EPS_RANGE[1]:g}]")
        _check(_is_number(self.rope_theta) and 1 < self.rope_theta <= FLOAT32_MAX, "rope_theta", self.rope_theta,
               f"the RoPE base must be a number above 1 and at most {FLOAT32_MAX:g} (Kimi's is 10000)")
        # Refused before anything is built: a typo in a size must not allocate for minutes or exhaust memory.
        _check(self.num_layers <= MAX_LAYERS, "num_layers", self.num_layers, f"more than {MAX_LAYERS} layers")
        if self.parameter_estimate > MAX_PARAMETERS:
            raise ConfigError(f"config sizes give a model of about {self.parameter_estimate / 1e9:.3g}B parameters, "
                              f"more than the {MAX_PARAMETERS / 1e9:g}B bivit will build (hidden_size "
                              f"{self.hidden_size}, num_layers {self.num_layers}, intermediate_size "
                              f"{self.intermediate_size}, qkv_hidden_size {self.qkv_hidden_size}, text_hidden_size "
                              f"{self.text_hidden_size}, pos_emb {self.pos_emb_height}x{self.pos_emb_width}x"
                              f"{self.pos_emb_time}, patch_size {self.patch_size})")

    @property
    def parameter_estimate(self) -> int:
        """Weights of the tower and projector, give or take biases and norms, and the temporal table the model
        builds of every size key (K2.6: 471M)."""
        d, a, m = self.hidden_size, self.attn_width, self.projector_input_size * self.merge_area
        per_layer = 4 * a * d + 2 * d * self.intermediate_size
        return (self.num_layers * per_layer + self.pos_emb_height * self.pos_emb_width * d
                + self.pos_emb_time * d + 3 * self.patch_size ** 2 * d + m * m + m * self.text_hidden_size)

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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, key: str, value: Any, why: str = "unsupported value") -> None:
    if not ok:
        err = ConfigError(f"config key {key!r} = {value!r}: {why}")
        err.key = key
        raise err


# The config key table, once per layout: ModelConfig field -> (key in the file, other spellings read too).
# Reading, the key named in an error, and writing (`bivit.checkpoint.state_dict.moonshot_config_dict`) all use it.
MOONSHOT_KEYS: dict[str, tuple[str, ...]] = {
    "patch_size": ("patch_size",),
    "pos_emb_height": ("init_pos_emb_height",),
    "pos_emb_width": ("init_pos_emb_width",),
    "pos_emb_time": ("init_pos_emb_time",),
    "hidden_size": ("vt_hidden_size", "hidden_size"),  # plain names: vLLM's spelling
    "num_layers": ("vt_num_hidden_layers", "num_hidden_layers"),
    "num_heads": ("vt_num_attention_heads", "num_attention_heads"),
    "intermediate_size": ("vt_intermediate_size", "intermediate_size"),
    "qkv_hidden_size": ("qkv_hidden_size",),
    "merge_kernel_size": ("merge_kernel_size",),
    "norm_type": ("norm_type",),
    "norm_eps": ("norm_eps",),
    "attn_bias": ("attn_bias",),
    "linear_bias": ("linear_bias",),
    "patch_embed_bias": ("patch_embed_proj_bias",),
    "pos_emb_interpolation": ("pos_emb_interpolation_mode",),
    "hidden_act": ("activation_func", "vt_hidden_act"),
    "projector_type": ("mm_projector_type",),
    "mm_hidden_size": ("mm_hidden_size",),
    "text_hidden_size": ("text_hidden_size",),
    "projector_ln_eps": ("projector_ln_eps",),
    "projector_hidden_act": ("projector_hidden_act",),
}
# Moonshot fields that may also sit at the top level of config.json.
_MOONSHOT_TOP_LEVEL = ("projector_type", "mm_hidden_size", "text_hidden_size", "projector_ln_eps")
HF_KEYS: dict[str, str] = {  # field -> dotted path in the transformers layout
    "patch_size": "vision_config.patch_size", "pos_emb_height": "vision_config.pos_emb_height",
    "pos_emb_width": "vision_config.pos_emb_width", "pos_emb_time": "vision_config.pos_emb_time",
    "hidden_size": "vision_config.hidden_size", "num_layers": "vision_config.num_hidden_layers",
    "num_heads": "vision_config.num_attention_heads", "intermediate_size": "vision_config.intermediate_size",
    "merge_kernel_size": "vision_config.merge_kernel_size", "hidden_act": "vision_config.hidden_act",
    "rope_theta": "vision_config.rope_parameters.rope_theta", "mm_hidden_size": "projection_hidden_size",
    "text_hidden_size": "text_config.hidden_size", "projector_ln_eps": "projection_layer_norm_eps",
}
_INTS = {"patch_size", "pos_emb_height", "pos_emb_width", "pos_emb_time", "hidden_size", "num_layers", "num_heads",
         "intermediate_size", "qkv_hidden_size", "mm_hidden_size", "text_hidden_size"}
_FLOATS = {"norm_eps", "projector_ln_eps", "rope_theta"}
_BOOLS = {"attn_bias", "linear_bias", "patch_embed_bias"}


def _typed(field: str, value: Any, key: str) -> Any:
    """A config value checked for its field's type (sizes are whole numbers, eps finite numbers, ...)."""
    if field in _INTS:
        return _int(value, key)
    if field in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"config key {key!r} = {value!r}: expected a finite number")
        return float(value)
    if field in _BOOLS:
        if value not in (True, False):  # 0 and 1 compare equal to them
            raise ConfigError(f"config key {key!r} = {value!r}: expected true or false")
        return bool(value)
    if field == "merge_kernel_size":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"config key {key!r} = {value!r}: expected two integers")
        return tuple(_int(v, key) for v in value)
    if not isinstance(value, str):
        raise ConfigError(f"config key {key!r} = {value!r}: expected a string")
    return value


def _build(fields: dict[str, Any], key_of: dict[str, str]) -> ModelConfig:
    """ModelConfig(**fields), with validation errors naming the key as spelled in the file."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        key = getattr(e, "key", None)
        if key in key_of:
            raise ConfigError(str(e).replace(f"{key!r}", repr(key_of[key]), 1)) from None
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


def read_json_file(path: Path) -> Any:
    """A config file's JSON value (config.json, preprocessor_config.json); a ConfigError naming the file when
    it cannot be read or is not JSON."""
    try:
        return read_json(path)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a directory, a FIFO (not waited on), a dangling link, a permission problem, ...
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None


def load_config(path: str | Path) -> ModelConfig:
    """Read a checkpoint's config.json in either the Moonshot (`vt_*`) or the transformers layout."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():  # missing, or a dangling link
        raise ConfigError(f"{path}: no config.json")
    raw = read_json_file(path)
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
    # Moonshot's layout is recognised by its vt_* keys; plain names are accepted as a fallback (vLLM's naming).
    if any(k.startswith("vt_") for k in vc) or "mm_projector_type" in vc or "mm_projector_type" in raw:
        return _from_moonshot(vc, raw)
    return _from_hf(raw)


def _expect(d: dict, key: str, allowed: tuple, default: Any) -> None:
    value = d.get(key, default)
    if value not in allowed:
        raise ConfigError(f"config key {key!r} = {value!r}: unsupported (bivit implements {', '.join(map(repr, allowed))})")


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key {key!r} = {value!r}: expected an integer")
    return value


def _from_moonshot(vc: dict, raw: dict) -> ModelConfig:
    _expect(vc, "merge_type", ("sd2_tpool",), "sd2_tpool")
    _expect(vc, "pos_emb_type", ("divided_fixed",), "divided_fixed")
    _expect(vc, "video_attn_type", ("spatial_temporal",), "spatial_temporal")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    fields: dict[str, Any] = {}
    for name, keys in MOONSHOT_KEYS.items():
        found = [(k, vc[k]) for k in keys if vc.get(k) is not None]
        if not found and name in _MOONSHOT_TOP_LEVEL and raw.get(keys[0]) is not None:
            found = [(keys[0], raw[keys[0]])]
        if not found and name == "text_hidden_size" and text.get("hidden_size") is not None:
            found = [("text_config.hidden_size", text["hidden_size"])]
        if found:
            fields[name] = _typed(name, found[0][1], found[0][0])
    if "norm_eps" not in fields and fields.get("norm_type", "layernorm") != "layernorm":
        fields["norm_eps"] = None  # torch's RMSNorm default
    return _build(fields, {name: keys[0] for name, keys in MOONSHOT_KEYS.items()})


def _from_hf(raw: dict) -> ModelConfig:
    vc = raw["vision_config"]
    _expect(vc.get("rope_parameters") or {}, "rope_type", ("axial",), "axial")
    if not isinstance(raw.get("text_config"), dict) or "hidden_size" not in raw["text_config"]:
        raise ConfigError("config key 'text_config.hidden_size' is missing (projector output width)")
    fields: dict[str, Any] = {}
    for name, path in HF_KEYS.items():
        value: Any = raw
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            fields[name] = _typed(name, value, path)
    return _build(fields, HF_KEYS)
