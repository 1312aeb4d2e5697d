"""MoonViT-3D vision tower -> sd2_tpool merger -> projector, written to read like the math
(docs/model.md, "Forward pass").

Items are packed along the row axis: `pixel_values` is `[L, 3, p, p]` and `grid_thw[i] = (t, h, w)` says item i
owns the next t*h*w rows (frame-major, row-major). Reductions go through `bivit.ops`; this file never needs to
know whether invariant mode is on. Module and parameter names are the Moonshot checkpoint's, so its weights
load without renaming; other layouts are converted in `bivit.checkpoint.state_dict`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import ops
from .checkpoint.config import ModelConfig


class Linear(nn.Linear):
    """nn.Linear, optionally followed by GELU (`gelu`: "erf" or "tanh", the form it computes), which bivit.ops may
    fuse into the GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gelu: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gelu = gelu

    def forward(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """The layer applied to `x`, plus `add_to` when given (a residual): the sum is written into `add_to` unless
        autograd records, so the add makes no tensor of its own, and on the GPU no pass of its own (the GEMM adds
        in its epilogue)."""
        return ops.linear(x, self.weight, self.bias, gelu=self.gelu, add_to=add_to)


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm_type == "rmsnorm":
        return RMSNorm(dim, eps=cfg.norm_eps)
    return LayerNorm(dim, eps=cfg.norm_eps)


def grids(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


# ------------------------------------------------------------------------------------------------- tower

class PositionEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))
        self.mode = cfg.pos_emb_interpolation
        self.max_frames = cfg.pos_emb_time
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def spatial(self, h: int, w: int) -> torch.Tensor:
        """The learned table resampled to an h x w grid, `[h*w, D]` in the table's dtype (exact when the sizes
        match). Resampled in fp32 (`ops.resample`) and rounded once, as the reference's GPU kernels (fp32
        accumulation) do."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return self._resample(h, w)  # training: recomputed, so gradients reach the table and never go stale
        key = (h, w, self.weight._version)  # an in-place weight update invalidates the cached tables
        if key not in self._cache:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = self._resample(h, w)
        return self._cache[key]

    def _resample(self, h: int, w: int) -> torch.Tensor:
        table = self.weight
        if (h, w) != tuple(table.shape[:2]):
            table = ops.resample(table.float(), h, w, self.mode).to(self.weight.dtype)
        return table.reshape(h * w, -1)

    def temporal(self, t: int) -> torch.Tensor:
        """The sin-cos term of a t-frame chunk `[t, D]`, held in the table's dtype like the reference's buffer."""
        if t > self.max_frames:
            raise ValueError(f"a chunk of {t} frames exceeds init_pos_emb_time = {self.max_frames}")
        return ops.temporal_embedding(t, self.weight.shape[-1]).to(device=self.weight.device, dtype=self.weight.dtype)

    def _apply(self, fn, recurse=True):  # a dtype/device change invalidates the resampled tables
        self._cache = {}
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        # The reference's rounding order: table (tower dtype) + temporal term (tower dtype), then + patches.
        parts = []
        for t, h, w in grid_thw:
            pos = self.spatial(h, w)
            if t > 1:
                pos = (pos[None] + self.temporal(t)[:, None, :]).flatten(0, 1)
            parts.append(pos)
        return x + torch.cat(parts).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_bias)
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.pos_emb(ops.patch_conv(pixels, self.proj.weight, self.proj.bias), grid_thw)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc0 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.linear_bias, gelu="tanh")
        self.fc1 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.linear_bias)

    def forward(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc1(self.fc0(x), add_to=add_to)  # [add_to +] fc1(gelu_tanh(fc0(x)))


class Block(nn.Module):
    """Pre-LN transformer block; `wqkv`/`wo` sit directly on the block, as in the checkpoint."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = make_norm(cfg, cfg.hidden_size)
        self.wqkv = Linear(cfg.hidden_size, 3 * cfg.attn_width, bias=cfg.attn_bias)
        self.wo = Linear(cfg.attn_width, cfg.hidden_size, bias=cfg.attn_bias)
        self.norm1 = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seqlens: list[int],
                  add_to: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.wqkv(x).view(x.shape[0], 3, self.heads, self.head_dim)
        out = ops.attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], seqlens, rope=rope)  # q and k rotated first
        return self.wo(out, add_to=add_to)  # [add_to +] wo(out)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seqlens: list[int]) -> torch.Tensor:
        # x = x + attention(norm0(x)); x = x + mlp(norm1(x)): each add made by the branch's last GEMM (`add_to`),
        # into x itself unless autograd records.
        x = self.attention(self.norm0(x), rope, seqlens, add_to=x)
        return self.mlp(self.norm1(x), add_to=x)


class BlockStack(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = make_norm(cfg, cfg.hidden_size)
        self.checkpoint_blocks = False  # training: recompute each block's activations in backward

    def forward(self, x: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        rope = tuple(t.to(x.device) for t in ops.rope_tables(grid_thw, self.head_dim, self.theta))
        seqlens = [t * h * w for t, h, w in grid_thw]  # an item's frames attend jointly, to nothing else
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = ops.checkpoint(block, x, rope, seqlens)
            else:
                x = block(x, rope, seqlens)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = BlockStack(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """`[L, 3, p, p]` pixels -> merged sub-tokens `[N, 4, D]` in the tower dtype (sd2_tpool)."""
        x = self.encoder(self.patch_embed(pixels.to(self.dtype), grid_thw), grid_thw)
        merged, start = [], 0
        for t, h, w in grid_thw:
            item = x[start:start + t * h * w].view(t, h // 2, 2, w // 2, 2, -1)
            start += t * h * w
            # Mean over frames, then (h/2, w/2, 2, 2, D): sub-token order (0,0), (0,1), (1,0), (1,1).
            merged.append(ops.temporal_mean(item).permute(0, 2, 1, 3, 4).reshape((h // 2) * (w // 2), 4, -1))
        return torch.cat(merged)


# --------------------------------------------------------------------------------------------- projectors

class Projector(nn.Module):
    """Base: the projector computes in the dtype of its own parameters, whatever it holds (no `pre_norm`
    lookups), and casts its input to that dtype at its boundary. This is the whole fix for vLLM 41638."""

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x.to(self.dtype))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PatchMerger(Projector):
    """K2.x: LayerNorm per sub-token -> concat the 4 -> Linear -> GELU(erf) -> Linear."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.projector_input_size * cfg.merge_area
        self.pre_norm = LayerNorm(cfg.projector_input_size, eps=cfg.projector_ln_eps)
        # proj.0 ends in GELU(erf); the parameter-less slot proj.1 keeps the checkpoint's indices.
        self.proj = nn.Sequential(Linear(d, d, gelu="erf"), nn.Identity(), Linear(d, cfg.text_hidden_size))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(x).flatten(1))


class PatchMergerV2(Projector):
    """K3: concat the 4 -> Linear -> GELU(erf) -> Linear (no biases) -> RMSNorm `post_norm`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.projector_input_size * cfg.merge_area
        self.proj = nn.Sequential(Linear(d, d, bias=False, gelu="erf"), nn.Identity(),
                                  Linear(d, cfg.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x.flatten(1)))


PROJECTORS = {"patchmerger": PatchMerger, "patchmergerv2": PatchMergerV2}


class VisionModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = VisionTower(cfg)
        self.mm_projector = PROJECTORS[cfg.projector_type](cfg)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Packed items in, one `[tokens_i, text_hidden]` tensor per item out (projector dtype)."""
        g = grids(grid_thw)
        out = self.mm_projector(self.vision_tower(pixels, g))
        return list(out.split([(h // 2) * (w // 2) for _, h, w in g]))

