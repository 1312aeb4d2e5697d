"""Preprocessing configuration per model: the checkpoint's `media_proc_cfg`, or the published values per preset.

Moonshot's processors take every preprocessing number from `media_proc_cfg` in the checkpoint's
`preprocessor_config.json`. `ProcessorConfig` holds every key they read, with its meaning:

==============================  =====================================================================
`patch_size`                    patch side in pixels (must equal the tower's)
`merge_kernel_size`             side of the merge window; images are padded to multiples of patch*merge
`in_patch_limit`                image patch budget (navit resize keeps w//p * h//p under it)
`patch_limit_on_one_side`       at most this many patches along either side
`fixed_output_tokens`           a processor that announces a fixed token count (not supported: the tower
                                always produces (h/2)*(w/2) rows, so a prompt built from it would not fit)
`in_patch_limit_each_frame`     per-frame budget of a video chunk (None: `in_patch_limit`)
`in_patch_limit_video`          budget of a whole chunk: each frame gets min(round(total / frames), per frame)
`max_num_frames_each_video`     read by the K2.5 processor but discarded on its chunk path: no effect
`sample_fps`                    frames sampled per second (at most the video's own rate)
`temporal_merge_kernel_size`    sampled frames per chunk (at most the tower's `init_pos_emb_time`)
`timestamp_mode`                chunk timestamp format: `hh:mm:ss.fff`, `mm:ss.fff` or `mm:ss`
`image_mean`, `image_std`       per-channel normalisation: (x/255 - mean) * (1/std)
`transparent_bg_config`         K3: background a transparent image is composited onto (None: alpha dropped)
`transparent_bg_fill_stage`     K3: composite `before_resize` or `after_resize`
==============================  =====================================================================

Which processor runs is part of the config too: Kimi-K2.5/K2.6's (`kimi_k25`: images and video chunks, alpha
dropped) or Kimi-K3's (`kimi_k3`: images only, transparency composited, size in the image placeholder).
A value the processors cannot honour, or one that contradicts the model's config.json, raises ConfigError
naming the key. A key they do not read is ignored, as Moonshot's processors ignore it, with a warning naming it
(a published config may carry bookkeeping keys; a typo should still be seen).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from .config import FLOAT32_MAX, ModelConfig, read_json_file

log = logging.getLogger("bivit")

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSORS = ("kimi_k25", "kimi_k3")
TIMESTAMP_MODES = ("hh:mm:ss.fff", "mm:ss.fff", "mm:ss")
FILL_STAGES = ("before_resize", "after_resize")
BG_PATTERNS = ("white", "black", "gray", "chessboard")
ALPHA_MODES = ("model", "drop", "white")
# Keys the processors carry as bookkeeping and never use for pixels.
_IGNORED_KEYS = frozenset({"config_type"})


@dataclass(frozen=True)
class TransparentBg:
    """K3's `transparent_bg_config`: the background a transparent image is composited onto."""

    pattern: str = "black"
    chessboard_square_size: int = 16
    chessboard_square_on_top_left: bool = True
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 200

    def __post_init__(self) -> None:
        key = "transparent_bg_config"
        if self.pattern not in BG_PATTERNS:
            _fail(f"{key}.pattern", self.pattern, f"expected one of {', '.join(BG_PATTERNS)}")
        if not _is_int(self.chessboard_square_size) or self.chessboard_square_size < 1:
            _fail(f"{key}.chessboard_square_size", self.chessboard_square_size, "expected a positive integer")
        if not isinstance(self.chessboard_square_on_top_left, bool):
            _fail(f"{key}.chessboard_square_on_top_left", self.chessboard_square_on_top_left, "expected a boolean")
        for name in ("chessboard_white_value", "chessboard_gray_value"):
            v = getattr(self, name)
            if not _is_int(v) or not 0 <= v <= 255:
                _fail(f"{key}.{name}", v, "expected an integer in 0..255")


@dataclass(frozen=True)
class ProcessorConfig:
    processor: str = "kimi_k25"
    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: Optional[int] = None
    in_patch_limit_each_frame: Optional[int] = 4096
    in_patch_limit_video: Optional[int] = None
    max_num_frames_each_video: Optional[int] = None
    sample_fps: float = 2.0
    temporal_merge_kernel_size: int = 4
    timestamp_mode: str = "hh:mm:ss.fff"
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg_config: Optional[TransparentBg] = None
    transparent_bg_fill_stage: str = "before_resize"

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", tuple(self.image_mean))
        object.__setattr__(self, "image_std", tuple(self.image_std))
        if isinstance(self.transparent_bg_config, dict):
            object.__setattr__(self, "transparent_bg_config", _bg(self.transparent_bg_config))
        if self.processor not in PROCESSORS:
            _fail("processor", self.processor, f"expected one of {', '.join(PROCESSORS)}")
        for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                    "temporal_merge_kernel_size"):
            _positive_int(key, getattr(self, key))
        for key in ("in_patch_limit_each_frame", "in_patch_limit_video", "max_num_frames_each_video"):
            if getattr(self, key) is not None:
                _positive_int(key, getattr(self, key))
        if self.fixed_output_tokens is not None:
            _fail("fixed_output_tokens", self.fixed_output_tokens,
                  "the tower always returns (h/2)*(w/2) rows per item, so a fixed announced token count would "
                  "not match the embeddings; bivit supports only null")
        if self.patch_limit_on_one_side % self.merge_kernel_size:
            # The reference asserts token_side * merge <= patch_limit_on_one_side after padding; with an odd
            # limit an image that hits the side cap would fail that assertion.
            _fail("patch_limit_on_one_side", self.patch_limit_on_one_side,
                  f"must be a multiple of merge_kernel_size {self.merge_kernel_size}")
        fps = self.sample_fps
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (math.isfinite(fps) and fps > 0):
            _fail("sample_fps", fps, "expected a positive number")
        if self.timestamp_mode not in TIMESTAMP_MODES:
            _fail("timestamp_mode", self.timestamp_mode, f"expected one of {', '.join(TIMESTAMP_MODES)}")
        for key in ("image_mean", "image_std"):
            v = getattr(self, key)
            if len(v) != 3 or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                                      for c in v):
                _fail(key, list(v), "expected 3 finite numbers (R, G, B)")
        if any(c <= 0 for c in self.image_std):
            _fail("image_std", list(self.image_std), "a standard deviation must be positive (zero divides by zero)")
        # (x/255 - mean) / std for x in 0..255 must stay finite in float32 (std 1e-300 would make every pixel inf).
        if any(max(abs(m), abs(1 - m)) / s > FLOAT32_MAX for m, s in zip(self.image_mean, self.image_std)):
            _fail("image_std", list(self.image_std), f"normalised pixels (x/255 - image_mean) / image_std overflow "
                  f"float32 with image_mean {list(self.image_mean)}")
        if self.transparent_bg_config is not None and not isinstance(self.transparent_bg_config, TransparentBg):
            _fail("transparent_bg_config", self.transparent_bg_config, "expected an object or null")
        if self.transparent_bg_fill_stage not in FILL_STAGES:
            _fail("transparent_bg_fill_stage", self.transparent_bg_fill_stage,
                  f"expected one of {', '.join(FILL_STAGES)}")

    @property
    def accepts_video(self) -> bool:
        """K3's published processor handles images only ("Unsupported type" for a video chunk)."""
        return self.processor == "kimi_k25"

    @property
    def frame_patch_limit(self) -> int:
        return self.in_patch_limit if self.in_patch_limit_each_frame is None else self.in_patch_limit_each_frame

    def chunk_frame_limit(self, frames: int) -> int:
        """Per-frame patch budget of a chunk of `frames` frames.

        The K2.5 processor sizes each chunk on its own (its frame count, fps 1), so `in_patch_limit_video`
        is shared by the frames of one chunk: a shorter last chunk may get a larger per-frame budget.
        """
        limit = self.frame_patch_limit
        if self.in_patch_limit_video is not None:
            limit = min(round(self.in_patch_limit_video / frames), limit)
        return limit

    def replace(self, **changes: Any) -> "ProcessorConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fail(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"preprocessing key {key!r} = {value!r}: {why}")


def _positive_int(key: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        _fail(key, value, "expected a positive integer")


def _bg(raw: Any) -> TransparentBg:
    if not isinstance(raw, dict):
        _fail("transparent_bg_config", raw, "expected an object or null")
    fields = {f.name for f in dataclasses.fields(TransparentBg)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        _fail(f"transparent_bg_config.{unknown[0]}", raw[unknown[0]], "not a key of K3's TransparentBgConfig")
    return TransparentBg(**raw)


K25_PROCESSING = ProcessorConfig()
K3_PROCESSING = ProcessorConfig(
    processor="kimi_k3", in_patch_limit=65536, in_patch_limit_each_frame=16384, sample_fps=8.0,
    transparent_bg_config=TransparentBg(pattern="chessboard", chessboard_square_size=8,
                                        chessboard_square_on_top_left=True, chessboard_white_value=255,
                                        chessboard_gray_value=180),
    transparent_bg_fill_stage="after_resize",
)
# Published media_proc_cfg values per preset (the demo model runs K2.x's processor).
PROCESSING_PRESETS: dict[str, ProcessorConfig] = {
    "kimi-k2.5": K25_PROCESSING, "kimi-k2.6": K25_PROCESSING, "kimi-k3": K3_PROCESSING, "demo": K25_PROCESSING,
}


# The published values of each processor, which a checkpoint's `media_proc_cfg` overrides key by key.
PROCESSOR_DEFAULTS = {"kimi_k25": K25_PROCESSING, "kimi_k3": K3_PROCESSING}


def processor_for_model(cfg: ModelConfig) -> str:
    """K3's vision variant is the one with the `patchmergerv2` projector."""
    return "kimi_k3" if cfg.projector_type == "patchmergerv2" else "kimi_k25"


def default_processing(cfg: ModelConfig) -> ProcessorConfig:
    """The published preprocessing of the model family `cfg` belongs to."""
    return PROCESSOR_DEFAULTS[processor_for_model(cfg)].replace(patch_size=cfg.patch_size)


def _processor_from_auto_map(raw: dict) -> Optional[str]:
    names = []
    auto_map = raw.get("auto_map")
    if isinstance(auto_map, dict):
        names += [str(v) for v in auto_map.values()]
    for key in ("image_processor_type", "processor_class"):
        if isinstance(raw.get(key), str):
            names.append(raw[key])
    text = " ".join(names)
    if "KimiK3" in text:
        return "kimi_k3"
    if "KimiK25" in text:
        return "kimi_k25"
    return None


def processing_from_dict(raw: Any, cfg: ModelConfig, where: str = PREPROCESSOR_CONFIG) -> ProcessorConfig:
    """A `preprocessor_config.json` object -> ProcessorConfig, checked against the model's config.

    Keys absent from `media_proc_cfg` take the published value of the model's family (so a file that sets
    only what it changes works); `transparent_bg_config` and its stage, which K3's processor reads with a
    default, take that default (no compositing, `before_resize`) when the file omits them.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    media = raw.get("media_proc_cfg")
    if not isinstance(media, dict):
        raise ConfigError(f"{where}: key 'media_proc_cfg' is missing or not an object")
    try:
        return _parse_media_proc_cfg(media, _processor_from_auto_map(raw) or processor_for_model(cfg), cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _parse_media_proc_cfg(media: dict, processor: str, cfg: ModelConfig) -> ProcessorConfig:
    base = PROCESSOR_DEFAULTS[processor]
    fields = {f.name for f in dataclasses.fields(ProcessorConfig)} - {"processor"}
    values: dict[str, Any] = {"processor": processor,
                              "transparent_bg_config": None, "transparent_bg_fill_stage": "before_resize"}
    for key, value in media.items():
        if key in _IGNORED_KEYS:
            continue
        if key not in fields:
            log.warning("bivit: media_proc_cfg key %r is not one Moonshot's processors read; ignored", key)
            continue
        if key == "transparent_bg_config":
            value = None if value is None else _bg(value)
        elif key == "merge_kernel_size" and isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            value = value[0]
        elif key in ("image_mean", "image_std"):
            if not isinstance(value, (list, tuple)):
                _fail(key, value, "expected 3 finite numbers (R, G, B)")
            value = tuple(value)
        values[key] = value
    try:
        out = base.replace(**values)
    except TypeError as e:  # a wrongly typed value that the dataclass checks trip over
        raise ConfigError(str(e)) from None
    check_against_model(out, cfg, "media_proc_cfg")
    return out


def check_against_model(proc: ProcessorConfig, cfg: ModelConfig, where: str = "preprocessing") -> None:
    """Values that would contradict the model's own config.json."""
    if proc.patch_size != cfg.patch_size:
        raise ConfigError(f"{where}: preprocessing key 'patch_size' = {proc.patch_size} contradicts the model's "
                          f"patch_size {cfg.patch_size}")
    if (proc.merge_kernel_size, proc.merge_kernel_size) != tuple(cfg.merge_kernel_size):
        raise ConfigError(f"{where}: preprocessing key 'merge_kernel_size' = {proc.merge_kernel_size} contradicts "
                          f"the model's merge_kernel_size {list(cfg.merge_kernel_size)}")
    if proc.accepts_video and proc.temporal_merge_kernel_size > cfg.pos_emb_time:
        raise ConfigError(f"{where}: preprocessing key 'temporal_merge_kernel_size' = "
                          f"{proc.temporal_merge_kernel_size} exceeds the model's init_pos_emb_time "
                          f"{cfg.pos_emb_time} (frames per chunk)")
    if proc.processor == "kimi_k3" and cfg.projector_type != "patchmergerv2":
        raise ConfigError(f"{where}: names Kimi-K3's processor but the model's projector is {cfg.projector_type}")


def preprocessor_config_dict(proc: ProcessorConfig) -> dict[str, Any]:
    """`preprocessor_config.json` for `proc`, as Moonshot's processors (and `processing_from_dict`) read it: its
    `media_proc_cfg`. Which processor runs is the model's (`processor_for_model`), so it is not written; K2.x's
    processor has no transparency keys."""
    media = {k: v for k, v in proc.to_dict().items()
             if k != "processor" and (proc.processor == "kimi_k3" or not k.startswith("transparent"))}
    return {"media_proc_cfg": media}


def load_processing(directory: str | Path, cfg: ModelConfig) -> ProcessorConfig:
    """The checkpoint's preprocessing: its `preprocessor_config.json` if present, else the published defaults."""
    path = Path(directory) / PREPROCESSOR_CONFIG
    if not os.path.lexists(path):
        return default_processing(cfg)
    # Present but unreadable (a directory, a FIFO, a dangling link): an error, not silently the defaults.
    return processing_from_dict(read_json_file(path), cfg, str(path))


def resolve_processing(value: Any, cfg: ModelConfig) -> ProcessorConfig:
    """A ProcessorConfig, a preset name or a `media_proc_cfg`-shaped dict -> ProcessorConfig checked for `cfg`."""
    if isinstance(value, ProcessorConfig):
        check_against_model(value, cfg)
        return value
    if isinstance(value, str):
        if value not in PROCESSING_PRESETS:
            raise ConfigError(f"option 'processing' = {value!r}: expected one of {', '.join(PROCESSING_PRESETS)}")
        out = PROCESSING_PRESETS[value].replace(patch_size=cfg.patch_size)
        check_against_model(out, cfg)
        return out
    if isinstance(value, dict):
        return processing_from_dict(value if "media_proc_cfg" in value else {"media_proc_cfg": value}, cfg,
                                    "option 'processing'")
    raise ConfigError(f"option 'processing' = {value!r}: expected a ProcessorConfig, a preset name or a dict")


def check_alpha(alpha: Any, option: str = "alpha") -> str:
    if alpha not in ALPHA_MODES:
        raise ConfigError(f"option {option!r} = {alpha!r}: expected one of {', '.join(ALPHA_MODES)}")
    return alpha
