"""Transcriptions of the reference implementations' behaviour, written for the tests (independent of bivit).

Sources: Moonshot's Kimi-K2.5 `kimi_k25_vision_processing.py` + `media_utils.py`, Kimi-K3's image processor and
`media_utils.py`, the Kimi vision modeling code (its `Learnable2DInterpPosEmbDivided_fixed` and 1-D sin-cos
table) and vLLM's image loader (`ImageMediaIO` with `rgba_to_rgb`). Each function does what the reference
does, step by step, in plain numpy / PIL / torch.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

K25_MEDIA_PROC_CFG = {  # the published Kimi-K2.5/K2.6 media_proc_cfg
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}
K3_MEDIA_PROC_CFG = {  # the published Kimi-K3 media_proc_cfg
    "in_patch_limit": 65536, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 16384, "sample_fps": 8.0, "temporal_merge_kernel_size": 4,
    "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                              "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                              "chessboard_gray_value": 180},
    "transparent_bg_fill_stage": "after_resize",
    "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
}


# ------------------------------------------------------------------------------------------- resizing
def navit_resize_image(width, height, patch_size, merge_kernel_size, in_patch_limit, patch_limit_on_one_side,
                       fixed_output_tokens=None) -> dict:
    s1 = math.sqrt(in_patch_limit / (max(1.0, width // patch_size) * max(1.0, height // patch_size)))
    scale = min(1.0, s1, patch_limit_on_one_side * patch_size / width, patch_limit_on_one_side * patch_size / height)
    new_w = min(max(1, int(width * scale)), patch_limit_on_one_side * patch_size)
    new_h = min(max(1, int(height * scale)), patch_limit_on_one_side * patch_size)
    factor = merge_kernel_size * patch_size
    pad_h, pad_w = (factor - new_h % factor) % factor, (factor - new_w % factor) % factor
    if fixed_output_tokens is not None:
        tokens = fixed_output_tokens
    else:
        th, tw = (new_h + pad_h) // factor, (new_w + pad_w) // factor
        assert th * merge_kernel_size <= patch_limit_on_one_side and tw * merge_kernel_size <= patch_limit_on_one_side
        tokens = th * tw
    return {"num_tokens": tokens, "new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h}


def chunk_frame_limit(cfg: dict, frames_in_chunk: int) -> int:
    """K2.5's get_resize_config for a video_chunk: fps 1, sample_fps inf -> every chunk frame counts."""
    per_frame = cfg["in_patch_limit_each_frame"]
    if per_frame is None:
        per_frame = cfg["in_patch_limit"]
    sampled = max(round(frames_in_chunk * min(math.inf, 1.0) / 1.0), 1)
    if cfg.get("in_patch_limit_video") is not None:
        per_frame = min(round(cfg["in_patch_limit_video"] / sampled), per_frame)
    return per_frame


# --------------------------------------------------------------------------------------- transparency
def chessboard(height, width, square, on_top_left, white, gray) -> np.ndarray:
    bg = np.ones((height, width, 3), dtype=np.uint8) * white
    for y in range(0, height, square):
        for x in range(0, width, square):
            if (y // square + x // square) % 2 == (1 if on_top_left else 0):
                bg[y:y + square, x:x + square] = gray
    return bg


def fill_transparent_bg(image: Image.Image, bg_cfg: dict | None) -> Image.Image:
    if bg_cfg is None:
        return image.convert("RGB")
    if image.mode == "RGB":
        return image
    if not ("A" in image.getbands() or "transparency" in image.info):
        return image.convert("RGB")
    cfg = {"pattern": "black", "chessboard_square_size": 16, "chessboard_square_on_top_left": True,
           "chessboard_white_value": 255, "chessboard_gray_value": 200, **bg_cfg}
    img = np.array(image.convert("RGBA"))
    h, w = img.shape[:2]
    if cfg["pattern"] == "chessboard":
        bg = chessboard(h, w, cfg["chessboard_square_size"], cfg["chessboard_square_on_top_left"],
                        cfg["chessboard_white_value"], cfg["chessboard_gray_value"])
    else:
        bg = np.full((h, w, 3), {"white": 255, "black": 0, "gray": 128}[cfg["pattern"]], dtype=np.uint8)
    alpha = np.stack([img[:, :, 3].astype(np.float32) / 255.0] * 3, axis=2)
    return Image.fromarray((alpha * img[:, :, :3] + (1 - alpha) * bg).astype(np.uint8))


def vllm_load_rgb(image: Image.Image) -> Image.Image:
    """vLLM's ImageMediaIO(image_mode="RGB") with the default white rgba_background_color."""
    if image.mode == "RGB":
        return image
    if image.mode == "RGBA":
        out = Image.new("RGB", image.size, (255, 255, 255))
        out.paste(image, mask=image.split()[3])
        return out
    return image.convert("RGB")


# ----------------------------------------------------------------------------------------- processors
def normalize(x: np.ndarray, mean, std) -> np.ndarray:
    x = (x / 255.0).astype(np.float32)
    x -= np.array(mean)
    x *= 1.0 / np.array(std)
    return x


def patchify(pixels: np.ndarray, patch: int) -> tuple[torch.Tensor, list[int]]:
    t, h, w, c = pixels.shape
    out = pixels.reshape(t, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 5, 2, 4)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(-1, c, patch, patch))), [t, h // patch, w // patch]


def process_image(image: Image.Image, cfg: dict, processor: str = "kimi_k25") -> tuple[torch.Tensor, list[int]]:
    """One image through the K2.5 (`kimi_k25`) or K3 (`kimi_k3`) image processor."""
    bg, stage = cfg.get("transparent_bg_config"), cfg.get("transparent_bg_fill_stage", "before_resize")
    if processor == "kimi_k25":
        image, bg, stage = image.convert("RGB"), None, "before_resize"
    elif stage == "before_resize":
        image = fill_transparent_bg(image, bg)
    r = navit_resize_image(*image.size, cfg["patch_size"], cfg["merge_kernel_size"], cfg["in_patch_limit"],
                           cfg["patch_limit_on_one_side"], cfg["fixed_output_tokens"])
    image = image.resize((r["new_width"], r["new_height"]), resample=Image.Resampling.BICUBIC)
    if processor == "kimi_k3" and stage == "after_resize":
        image = fill_transparent_bg(image, bg)
    arr = np.pad(np.asarray(image), ((0, r["pad_height"]), (0, r["pad_width"]), (0, 0)), constant_values=0)
    return patchify(normalize(arr[None], cfg["image_mean"], cfg["image_std"]), cfg["patch_size"])


def process_chunk(frames: list[Image.Image], cfg: dict) -> tuple[torch.Tensor, list[int]]:
    """One video chunk through the K2.5 processor."""
    frames = [f.convert("RGB") for f in frames]
    r = navit_resize_image(*frames[0].size, cfg["patch_size"], cfg["merge_kernel_size"],
                           chunk_frame_limit(cfg, len(frames)), cfg["patch_limit_on_one_side"],
                           cfg["fixed_output_tokens"])
    arrs = [np.pad(np.asarray(f.resize((r["new_width"], r["new_height"]), resample=Image.Resampling.BICUBIC)),
                   ((0, r["pad_height"]), (0, r["pad_width"]), (0, 0))) for f in frames]
    return patchify(normalize(np.stack(arrs), cfg["image_mean"], cfg["image_std"]), cfg["patch_size"])


def sample_indices(num_frames: int, fps: float, sample_fps: float) -> list[int]:
    sample_fps = min(sample_fps, fps)
    n = max(round(num_frames * sample_fps / fps), 1)
    return np.linspace(0, num_frames - 1, n).round().astype(int).tolist()


def timestamp(t: float, mode: str = "hh:mm:ss.fff") -> str:
    clock = datetime.fromtimestamp(t, tz=timezone.utc)
    if mode == "hh:mm:ss.fff":
        return clock.strftime("%H:%M:%S") + f".{int((t % 1) * 1000):03d}"
    if mode == "mm:ss.fff":
        return clock.strftime("%M:%S") + f".{int((t % 1) * 1000):03d}"
    assert mode == "mm:ss"
    return clock.strftime("%M:%S")


def image_prompt(processor: str, width: int, height: int) -> str:
    if processor == "kimi_k3":
        return f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>"
    return "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


def chunk_prompt(timestamp_text: str) -> str:
    return f"{timestamp_text}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"


# ------------------------------------------------------------------------------------ position terms
def sincos_table(embed_dim: int, frames: int) -> np.ndarray:
    omega = np.arange(embed_dim // 2, dtype=np.float32)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("m,d->md", np.arange(frames, dtype=np.float32).reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


class PositionTerms(torch.nn.Module):
    """The reference's divided-fixed position embedding, its buffer and table in the tower dtype.

    The table is resampled with fp32 accumulation and rounded once to the table dtype, as the reference's GPU
    kernels (eager CUDA and its compiled graph) do; CPU eager bf16 interpolation rounds intermediate values and
    is not what the reference runs.
    """

    def __init__(self, weight: torch.Tensor, frames: int, mode: str, table=None, interpolate=None) -> None:
        """`table` (the sin-cos buffer) and `interpolate` (`F.interpolate`'s signature) default to the reference's;
        a test passes its own to compare the order of roundings alone."""
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        self.mode = mode
        self.interpolate = interpolate or F.interpolate
        table = sincos_table(weight.shape[-1], frames) if table is None else table
        self.register_buffer("time_weight", torch.as_tensor(table).float().unsqueeze(1), persistent=False)

    def forward(self, x: torch.Tensor, grid_thws: list[list[int]]) -> torch.Tensor:
        parts = []
        for t, h, w in grid_thws:
            if (h, w) == tuple(self.weight.shape[:-1]):
                pos2d = self.weight.flatten(end_dim=1)
            else:
                pos2d = (self.interpolate(self.weight.float().permute(2, 0, 1).unsqueeze(0), size=(h, w),
                                          mode=self.mode).to(self.weight.dtype)
                         .squeeze(0).permute(1, 2, 0).flatten(end_dim=1))
            pos3d = pos2d if t == 1 else pos2d.unsqueeze(0).repeat(t, 1, 1) + self.time_weight[0:t]
            parts.append(pos3d.reshape(-1, pos3d.shape[-1]))
        return x + torch.cat(parts)
