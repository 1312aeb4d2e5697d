"""What `bivit bench` runs: the implementations, the fixed input mix, and the seeded checkpoint they all load."""

from __future__ import annotations

import json
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from ..base.dtypes import dtype_option, parse_dtype
from ..checkpoint.config import PRESETS, ModelConfig
from ..checkpoint.state_dict import random_state_dict, save_checkpoint, transformers_config_dict
from ..errors import BivitError
from ..media.pixels import MediaBatch, frames_to_item

IMPLS = ("bivit-invariant", "bivit-default", "hf-sdpa")
BIVIT_IMPLS = IMPLS[:2]
HF_IMPL = "hf-sdpa"
BENCH_DTYPES = ("bfloat16", "float32")  # what bench measures
DTYPE_CHOICES = {"bfloat16": ("bfloat16",), "float32": ("float32",), "both": BENCH_DTYPES}
TORCH_DTYPES = {name: parse_dtype(name, "--dtype") for name in BENCH_DTYPES}


def bench_dtypes(value: str, option: str = "--dtype") -> tuple[str, ...]:
    """The dtypes a `--dtype` of bench (or a benchmark script) names: "both", or one in any spelling every
    command accepts (`bivit.base.dtypes`)."""
    return BENCH_DTYPES if value == "both" else (dtype_option(value, option, BENCH_DTYPES),)


@dataclass
class Case:
    """One timed call: a packed batch of items encoded by one forward pass."""

    name: str
    batch: MediaBatch

    @property
    def items(self) -> int:
        return len(self.batch)

    @property
    def patches(self) -> int:
        return sum(self.batch.patch_counts)

    @property
    def tokens(self) -> int:
        return sum(self.batch.token_counts)

    def grids(self) -> list[tuple[int, int, int]]:
        return [tuple(g) for g in self.batch.grid_thw.tolist()]


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """Random RGB pixels: compute on CPU does not depend on image content, only on its size."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def make_case(name: str, items: Sequence[Sequence[Image.Image]], patch_limit: int | None = None) -> Case:
    """Each entry of `items` is one item: one image, or the frames of one video chunk."""
    pixels, grids = [], []
    for frames in items:
        kwargs = {} if patch_limit is None else {"patch_limit": patch_limit}
        px, grid = frames_to_item(list(frames), **kwargs)
        pixels.append(px)
        grids.append(grid)
    batch = MediaBatch(torch.cat(pixels), torch.tensor(grids, dtype=torch.int64), None, [name] * len(grids))
    return Case(name, batch)


def standard_cases(seed: int = 0) -> list[Case]:
    """The fixed mix: a 1024-patch image, a 3072-patch one, 32 small images in one call, a 4-frame chunk."""
    return [
        make_case("image 448x448", [[noise_image(448, 448, seed)]]),
        make_case("image 896x672", [[noise_image(896, 672, seed + 1)]]),
        make_case("32 images 112x112", [[noise_image(112, 112, seed + 2 + i)] for i in range(32)]),
        # Frames get the video budget of 4096 patches per frame: 448x252 is 32 x 18 patches, no resize or padding.
        make_case("video chunk 4x448x252", [[noise_image(448, 252, seed + 40 + f) for f in range(4)]],
                  patch_limit=4096),
    ]


def select_cases(parts: Sequence[str] | None, seed: int = 0, option: str = "--case") -> list[Case]:
    """The standard cases whose name contains any of `parts` (all of them when `parts` is empty); BivitError
    naming `option` and the cases there are when none matches."""
    cases = standard_cases(seed)
    chosen = [c for c in cases if not parts or any(part in c.name for part in parts)]
    if not chosen:
        raise BivitError(f"{option} {' '.join(parts)}: no case matches (cases: {', '.join(c.name for c in cases)})")
    return chosen


def square_case(patches: int, seed: int = 0) -> Case:
    """One square image of exactly `patches` patches (a perfect square of an even side, <= 16384)."""
    side = int(round(patches ** 0.5))
    if side * side != patches or side % 2 or patches > 16384:
        raise BivitError(f"{patches} patches: need an even square side and at most 16384 patches")
    return make_case(f"{patches} patches", [[noise_image(side * 14, side * 14, seed)]])


def hf_supports(cfg: ModelConfig) -> bool:
    """The transformers port implements the K2.x design only (LayerNorm, patchmerger, attention width = D)."""
    return (cfg.projector_type == "patchmerger" and cfg.norm_type == "layernorm"
            and cfg.attn_width == cfg.hidden_size and cfg.pos_emb_interpolation == "bicubic")


def write_checkpoint(directory: Path, preset: str, seed: int = 0) -> Path:
    """Seeded random weights of `preset`, bf16 on disk like the published checkpoint."""
    # A transformers-native config.json, which bivit reads too: one directory serves both implementations.
    cfg = PRESETS[preset]
    config = transformers_config_dict(cfg) if hf_supports(cfg) else None
    return save_checkpoint(directory, cfg, random_state_dict(cfg, seed), dtype=torch.bfloat16, config=config)


def _write_checkpoint_child(directory: str, preset: str, seed: int) -> None:
    write_checkpoint(Path(directory), preset, seed)


def write_checkpoint_isolated(directory: Path, preset: str, seed: int = 0) -> None:
    """Write the checkpoint in a child process, so the fp32 random weights never inflate this process."""
    proc = multiprocessing.get_context("spawn").Process(target=_write_checkpoint_child,
                                                         args=(str(directory), preset, seed))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise BivitError(f"writing the benchmark checkpoint to {directory} failed (exit code {proc.exitcode})")


def save_cases(path: Path, cases: Sequence[Case]) -> None:
    """The cases' pixels in one safetensors file: the parent preprocesses once, every worker reads the same."""
    tensors = {}
    for i, c in enumerate(cases):
        tensors[f"{i}.pixel_values"] = c.batch.pixel_values.contiguous()
        tensors[f"{i}.grid_thw"] = c.batch.grid_thw.contiguous()
    save_file(tensors, str(path), metadata={"names": json.dumps([c.name for c in cases])})


def load_cases(path: Path) -> list[Case]:
    with safe_open(str(path), framework="pt") as f:
        names = json.loads(f.metadata()["names"])
        return [Case(name, MediaBatch(f.get_tensor(f"{i}.pixel_values"), f.get_tensor(f"{i}.grid_thw"), None,
                                      [name])) for i, name in enumerate(names)]
