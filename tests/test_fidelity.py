"""Reference fidelity per model, against the transcriptions in `support.reference`: K3's resize and token counts,
transparency (K3's chessboard, vLLM's white), the checkpoint's own preprocessor_config.json, position-term
rounding, timestamps, prompt placeholders and the image pixel limit."""

import json
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import bivit
from bivit.checkpoint.config import ModelConfig
from bivit.checkpoint.preprocess_config import K3_PROCESSING, K25_PROCESSING, load_processing, processing_from_dict
from bivit.media.decode import image_size, load_image
from bivit.media.grids import navit_size
from bivit.media.pixels import composite, preprocess_images
from bivit.media.video import chunk_timestamp
from bivit.model import PositionEmbedding
from bivit.ops import resample, temporal_embedding
from support import reference as ref
from support.checkpoints import K3_SMALL, KIMI_SMALL
from support.media import make_video

ODD_SIZES = [(1, 1), (13, 7), (27, 29), (641, 479), (999, 1001), (4000, 3000), (3001, 4003), (12345, 6789),
             (20000, 30), (30, 20000), (7169, 5), (5000, 5000), (3585, 3585), (7168, 7168), (1023, 17)]


def _cfg(base: dict, **changes) -> dict:
    return {**base, **changes}


# ------------------------------------------------------------------------------------ K3 resize rules
@pytest.mark.parametrize("w,h", ODD_SIZES)
@pytest.mark.parametrize("model,cfg", [("kimi-k3", ref.K3_MEDIA_PROC_CFG), ("kimi-k2.6", ref.K25_MEDIA_PROC_CFG)])
def test_token_counts_and_resize_follow_each_models_rules(w, h, model, cfg):
    r = ref.navit_resize_image(w, h, 14, 2, cfg["in_patch_limit"], 512, None)
    assert bivit.image_token_count(w, h, model=model) == r["num_tokens"]
    assert navit_size(w, h, cfg["in_patch_limit"]) == (r["new_width"], r["new_height"])


def test_4000x3000_is_15444_tokens_under_k3_and_4200_under_k25():
    # The numbers the issue measured with the published processors.
    assert bivit.image_token_count(4000, 3000, model="kimi-k3") == 15444
    assert bivit.image_token_count(4000, 3000) == bivit.image_token_count(4000, 3000, model="kimi-k2.6") == 4200
    batch = preprocess_images([np.zeros((3000, 4000, 3), np.uint8)], processing=K3_PROCESSING)
    assert batch.token_counts == [15444]


@pytest.mark.parametrize("w,h", [(333, 517), (29, 1), (1201, 403), (97, 2011)])
def test_k3_pixels_equal_the_reference_processor(w, h):
    rgb = np.random.default_rng(w * h).integers(0, 256, (h, w, 3), np.uint8)
    cfg = _cfg(ref.K3_MEDIA_PROC_CFG, in_patch_limit=1024)  # forces a real resize at these sizes
    proc = K3_PROCESSING.replace(in_patch_limit=1024)
    want, grid = ref.process_image(Image.fromarray(rgb), cfg, "kimi_k3")
    got = preprocess_images([rgb], processing=proc)
    assert got.grid_thw.tolist() == [grid]
    assert torch.equal(got.pixel_values, want)


# --------------------------------------------------------------------------------------- transparency
def _transparent_images(w=45, h=37, seed=0) -> dict[str, Image.Image]:
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (h, w, 4), np.uint8)
    rgba[:5, :, 3], rgba[5:9, :, 3] = 0, 255  # fully transparent and opaque rows as well
    la = np.stack([rng.integers(0, 256, (h, w), np.uint8), rgba[..., 3]], axis=-1)
    pal = Image.fromarray(rgba[..., :3]).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.info["transparency"] = 3
    return {"RGBA": Image.fromarray(rgba, "RGBA"), "LA": Image.fromarray(la, "LA"), "P": pal,
            "RGB": Image.fromarray(rgba[..., :3])}


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "RGB"])
@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
@pytest.mark.parametrize("limit", [65536, 4])  # no resize / a real resize
def test_k3_chessboard_compositing_pixels(mode, stage, limit):
    img = _transparent_images()[mode]
    cfg = _cfg(ref.K3_MEDIA_PROC_CFG, transparent_bg_fill_stage=stage, in_patch_limit=limit)
    want, grid = ref.process_image(img.copy(), cfg, "kimi_k3")
    got = preprocess_images([img], processing=K3_PROCESSING.replace(transparent_bg_fill_stage=stage,
                                                                    in_patch_limit=limit))
    assert got.grid_thw.tolist() == [grid]
    assert torch.equal(got.pixel_values, want)


@pytest.mark.parametrize("bg", [
    {"pattern": "chessboard", "chessboard_square_size": 3, "chessboard_square_on_top_left": False,
     "chessboard_white_value": 250, "chessboard_gray_value": 7},
    {"pattern": "white"}, {"pattern": "black"}, {"pattern": "gray"}, None,
])
def test_composite_equals_the_reference_fill(bg):
    from bivit.checkpoint.preprocess_config import TransparentBg

    for img in _transparent_images(31, 23, seed=1).values():
        want = np.asarray(ref.fill_transparent_bg(img, bg))
        got = np.asarray(composite(img, None if bg is None else TransparentBg(**bg)))
        assert np.array_equal(got, want)


def test_transparency_control_k3_composites_where_k25_drops():
    img = _transparent_images()["RGBA"]
    k3 = preprocess_images([img], processing=K3_PROCESSING).pixel_values
    dropped = preprocess_images([img], processing=K3_PROCESSING, alpha="drop").pixel_values
    k25 = preprocess_images([img]).pixel_values
    assert torch.equal(dropped, k25)  # same grid here (no resize), and both drop alpha
    assert not torch.equal(k3, dropped)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "RGB"])
@pytest.mark.parametrize("processor,proc,cfg", [("kimi_k25", K25_PROCESSING, ref.K25_MEDIA_PROC_CFG),
                                                ("kimi_k3", K3_PROCESSING, ref.K3_MEDIA_PROC_CFG)])
def test_alpha_white_is_vllms_loader_then_the_processor(mode, processor, proc, cfg):
    img = _transparent_images(seed=2)[mode]
    cfg = _cfg(cfg, in_patch_limit=4)
    want, _ = ref.process_image(ref.vllm_load_rgb(img), cfg, processor)
    got = preprocess_images([img], processing=proc.replace(in_patch_limit=4), alpha="white").pixel_values
    assert torch.equal(got, want)


def test_alpha_option_on_encoder_and_its_errors(k3_ckpt):
    img = _transparent_images()["RGBA"]
    enc = bivit.load_encoder(k3_ckpt, dtype="float32")
    assert enc.processing.processor == "kimi_k3" and enc.alpha == "model"
    white = bivit.load_encoder(k3_ckpt, dtype="float32", alpha="white")
    assert torch.equal(white.preprocess([img]).pixel_values, enc.preprocess([img], alpha="white").pixel_values)
    assert not torch.equal(white.preprocess([img]).pixel_values, enc.preprocess([img]).pixel_values)
    assert white.fingerprint != enc.fingerprint  # a cache must not serve one for the other
    assert torch.equal(white.encode([img])[0], enc.encode([img], alpha="white")[0])
    with pytest.raises(bivit.ConfigError, match="alpha"):
        bivit.load_encoder(alpha="transparent")
    with pytest.raises(bivit.ConfigError, match="alpha"):
        enc.preprocess([img], alpha="black")


# ------------------------------------------------------------------------- preprocessor_config.json
def _ckpt_with(tmp_path, src, media_proc_cfg, **top) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    (d / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media_proc_cfg, **top}))
    return d


def test_published_k3_and_k25_files_read_as_the_presets():
    k3 = {"auto_map": {"AutoImageProcessor": "kimi_k3_vision_processing.KimiK3VisionProcessor"},
          "media_proc_cfg": ref.K3_MEDIA_PROC_CFG}
    assert processing_from_dict(k3, K3_SMALL) == K3_PROCESSING
    k25 = {"auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
           "media_proc_cfg": ref.K25_MEDIA_PROC_CFG}
    assert processing_from_dict(k25, KIMI_SMALL) == K25_PROCESSING


def test_checkpoint_preprocessor_config_changes_token_counts(tmp_path, kimi_ckpt):
    image = np.random.default_rng(0).integers(0, 256, (300, 420, 3), np.uint8)
    cfg = _cfg(ref.K25_MEDIA_PROC_CFG, in_patch_limit=100, image_mean=[0.48, 0.46, 0.41],
               image_std=[0.27, 0.26, 0.28])
    preset = bivit.load_encoder(kimi_ckpt, dtype="float32")
    custom = bivit.load_encoder(_ckpt_with(tmp_path, kimi_ckpt, cfg), dtype="float32")
    assert custom.processing.in_patch_limit == 100
    want, grid = ref.process_image(Image.fromarray(image), cfg)
    batch = custom.preprocess([image])
    assert batch.grid_thw.tolist() == [grid] and torch.equal(batch.pixel_values, want)
    want_tokens = ref.navit_resize_image(420, 300, 14, 2, 100, 512)["num_tokens"]
    assert custom.encode([image])[0].shape[0] == want_tokens == custom.image_token_count(420, 300)
    assert preset.encode([image])[0].shape[0] == preset.image_token_count(420, 300) != want_tokens
    assert custom.fingerprint != preset.fingerprint


def test_checkpoint_preprocessor_config_drives_video(tmp_path, kimi_ckpt):
    video = make_video(tmp_path / "v.mp4", frames=40, fps=10, size=(120, 90))
    cfg = _cfg(ref.K25_MEDIA_PROC_CFG, sample_fps=4.0, temporal_merge_kernel_size=3, in_patch_limit_each_frame=30,
               in_patch_limit_video=50, timestamp_mode="mm:ss.fff")
    enc = bivit.load_encoder(_ckpt_with(tmp_path, kimi_ckpt, cfg), dtype="float32")
    batch = enc.preprocess_video(video)
    indices = ref.sample_indices(40, 10.0, 4.0)
    chunks = [indices[i:i + 3] for i in range(0, len(indices), 3)]
    assert batch.timestamps == [ref.timestamp(c[0] / 10.0, "mm:ss.fff") for c in chunks]
    grids = []
    for c in chunks:
        limit = ref.chunk_frame_limit(cfg, len(c))
        r = ref.navit_resize_image(120, 90, 14, 2, limit, 512)
        grids.append([len(c), (r["new_height"] + r["pad_height"]) // 14, (r["new_width"] + r["pad_width"]) // 14])
    assert batch.grid_thw.tolist() == grids
    assert grids[-1] != grids[0]  # the short last chunk shares in_patch_limit_video among fewer frames


BAD = [
    ({"timestamp_mode": "hh:mm"}, "timestamp_mode"), ({"patch_size": 16}, "patch_size"),
    ({"merge_kernel_size": 3}, "merge_kernel_size"), ({"sample_fps": 0}, "sample_fps"),
    ({"in_patch_limit": "many"}, "in_patch_limit"), ({"image_std": [0.5, 0, 0.5]}, "image_std"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"), ({"fixed_output_tokens": 256}, "fixed_output_tokens"),
    ({"transparent_bg_fill_stage": "sometime"}, "transparent_bg_fill_stage"),
    ({"transparent_bg_config": {"pattern": "stripes"}}, "pattern"),
    ({"transparent_bg_config": {"type": "white"}}, "type"),
    ({"temporal_merge_kernel_size": 8}, "temporal_merge_kernel_size"),
    ({"patch_limit_on_one_side": 511}, "patch_limit_on_one_side"),
    ({"in_patch_limit_each_frame": -4}, "in_patch_limit_each_frame"),
]


def test_unknown_preprocessor_key_is_ignored_with_a_warning_naming_it(tmp_path, kimi_ckpt, caplog):
    """The processors ignore keys they do not read; bivit does too (a real checkpoint must load), but says so."""
    d = _ckpt_with(tmp_path, kimi_ckpt, _cfg(ref.K25_MEDIA_PROC_CFG, bogus_key=1))
    with caplog.at_level(logging.WARNING, logger="bivit"):
        enc = bivit.load_encoder(d, dtype="float32")
    assert "bogus_key" in caplog.text
    assert enc.processing == bivit.load_encoder(kimi_ckpt, dtype="float32").processing


@pytest.mark.parametrize("change,key", BAD)
def test_bad_preprocessor_config_raises_config_error_naming_the_key(tmp_path, kimi_ckpt, change, key):
    d = _ckpt_with(tmp_path, kimi_ckpt, _cfg(ref.K25_MEDIA_PROC_CFG, **change))
    with pytest.raises(bivit.ConfigError, match=key) as info:
        bivit.load_encoder(d)
    assert "preprocessor_config.json" in str(info.value)


def test_unreadable_preprocessor_config(tmp_path, kimi_ckpt):
    d = _ckpt_with(tmp_path, kimi_ckpt, {})
    (d / "preprocessor_config.json").write_text('{"media_proc_cfg": ')
    with pytest.raises(bivit.ConfigError, match="not valid JSON"):
        load_processing(d, KIMI_SMALL)
    (d / "preprocessor_config.json").write_text('{"image_processor_type": "X"}')
    with pytest.raises(bivit.ConfigError, match="media_proc_cfg"):
        load_processing(d, KIMI_SMALL)
    (d / "preprocessor_config.json").unlink()
    assert load_processing(d, KIMI_SMALL) == K25_PROCESSING and load_processing(d, K3_SMALL) == K3_PROCESSING


def test_k3_file_without_transparency_keys_takes_the_processors_defaults():
    cfg = {k: v for k, v in ref.K3_MEDIA_PROC_CFG.items() if not k.startswith("transparent")}
    proc = processing_from_dict({"media_proc_cfg": cfg}, K3_SMALL)
    assert proc.transparent_bg_config is None and proc.transparent_bg_fill_stage == "before_resize"
    img = _transparent_images()["RGBA"]
    want, _ = ref.process_image(img, cfg, "kimi_k3")
    assert torch.equal(preprocess_images([img], processing=proc).pixel_values, want)


def test_k3_refuses_video_like_its_processor(tmp_path, k3_ckpt):
    video = make_video(tmp_path / "v.mp4", frames=8, fps=10)
    enc = bivit.load_encoder(k3_ckpt, dtype="float32")
    with pytest.raises(bivit.MediaError, match="accepts images only"):
        enc.encode([video])
    with pytest.raises(bivit.MediaError, match="accepts images only"):
        enc.placeholders([video])


# ------------------------------------------------------------------------------------- position terms
def _within_the_references_own_error(table: np.ndarray, reference: np.ndarray, angles: np.ndarray) -> bool:
    """Whether `table` is `reference` up to what the reference's float32 kernels may err by: a few ulps of each
    angle (its pow, through the product) and of each value (its sin and cos). An ulp of the value alone is no
    bound: near a zero of sin or cos one ulp of the angle is thousands of the value's (numpy's AVX-512 kernels
    land there)."""
    angles = np.concatenate([angles, angles], axis=1)
    allowed = 4 * (np.spacing(np.abs(angles)) + np.spacing(np.abs(table).astype(np.float32)))
    return bool((np.abs(table.astype(np.float64) - reference.astype(np.float64)) <= allowed).all())


@pytest.mark.parametrize("dim", [96, 288, 1024, 1152])
def test_temporal_term_is_the_references_table_in_bivits_arithmetic(dim):
    """The reference's sin-cos buffer (numpy float32: its pow, sin and cos are vector kernels whose last bits
    depend on the CPU) in bivit-arith/1: each power, sine and cosine computed in float64 by the C library and
    rounded once, the rest float32 as the reference writes it. Within the reference's own error of its table;
    control: the next frame's rows are not."""
    frames = 6
    e = np.arange(dim // 2, dtype=np.float32) / np.float32(dim / 2)
    w = np.float32(1) / np.array([np.float32(10000.0 ** float(v)) for v in e], np.float32)
    angles = np.arange(frames, dtype=np.float32)[:, None] * w[None, :]
    want = np.concatenate([np.vectorize(lambda a: np.float32(math.sin(a)))(angles.astype(np.float64)),
                           np.vectorize(lambda a: np.float32(math.cos(a)))(angles.astype(np.float64))], axis=1)
    got = temporal_embedding(frames, dim)
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))
    assert torch.equal(temporal_embedding(3, dim), got[:3])  # a row depends on its frame alone
    reference = ref.sincos_table(dim, frames)
    assert _within_the_references_own_error(got.numpy(), reference, angles)
    assert not _within_the_references_own_error(temporal_embedding(frames + 1, dim).numpy()[1:], reference, angles)


def _interpolate(x: torch.Tensor, size, mode: str) -> torch.Tensor:
    """bivit's resampling in F.interpolate's signature ([1, D, H, W] -> [1, D, h, w])."""
    return resample(x[0].permute(1, 2, 0), *size, mode).permute(2, 0, 1)[None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_video_position_terms_round_in_the_references_order(dtype, mode):
    """The position terms of images and multi-frame chunks, rounded where the reference rounds them (table
    resampled in fp32 and rounded to the tower dtype; temporal term in the tower dtype, added to it; then added
    to the patches), given the same resampled table and sin-cos buffer."""
    cfg = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=1152, num_heads=16, num_layers=1,
                      pos_emb_interpolation=mode)
    weight = torch.randn(8, 8, 1152, generator=torch.Generator().manual_seed(1))
    ours = PositionEmbedding(cfg)
    ours.weight = torch.nn.Parameter(weight, requires_grad=False)
    ours = ours.to(dtype)
    table = temporal_embedding(4, 1152)
    theirs = ref.PositionTerms(weight, 4, mode, table=table, interpolate=_interpolate).to(dtype)
    grids = [[4, 10, 14], [3, 8, 8], [2, 6, 22], [1, 12, 10], [4, 8, 8]]
    x = torch.randn(sum(t * h * w for t, h, w in grids), 1152, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        got = ours(x.clone(), [tuple(g) for g in grids])
        want = theirs(x.clone(), grids)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)
    if dtype != torch.float32:
        # Control: adding the terms in fp32 and rounding once (bivit's old order) differs from the reference.
        once = []
        for t, h, w in grids:
            t32 = weight.to(dtype).float()
            t32 = t32.reshape(64, -1) if (h, w) == (8, 8) else resample(t32, h, w, mode).reshape(h * w, -1)
            if t > 1:
                t32 = (t32[None] + table[:t, None]).flatten(0, 1)
            once.append(t32)
        assert not torch.equal(x + torch.cat(once).to(dtype), want)


RESAMPLE_SCRIPT = """
import json, sys, torch, torch.nn.functional as F
from bivit.ops import resample
g = torch.Generator().manual_seed(0)
out = []
for H, W, h, w in [(16, 16, 37, 23), (8, 8, 10, 14), (64, 64, 64, 100), (64, 64, 20, 9)]:
    t = torch.randn(H, W, 40, generator=g)
    theirs = F.interpolate(t.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)[0]
    out.append(torch.equal(resample(t, h, w, "bicubic"), theirs.permute(1, 2, 0)))
print(json.dumps(out))
"""


def test_resampling_is_pytorchs_bicubic_without_fused_multiply_adds():
    """bivit's position-table resampling computes PyTorch's bicubic interpolation operation for operation: bit for
    bit what PyTorch's scalar build (ATEN_CPU_CAPABILITY=default, no fused multiply-adds) computes; PyTorch's
    vector builds fuse some products into FMAs, as the CPU kind allows (their bits differ, by a few ulps)."""
    done = subprocess.run([sys.executable, "-c", RESAMPLE_SCRIPT], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [True] * 4
    g = torch.Generator().manual_seed(3)
    for mode in ("bicubic", "bilinear"):
        t = torch.randn(16, 16, 40, generator=g)
        theirs = F.interpolate(t.permute(2, 0, 1)[None], size=(21, 9), mode=mode, align_corners=False)[0]
        torch.testing.assert_close(resample(t, 21, 9, mode), theirs.permute(1, 2, 0), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- timestamps
@pytest.mark.parametrize("fps", [Fraction(24000, 1001), Fraction(30000, 1001), Fraction(60000, 1001)])
def test_timestamps_over_four_hours_equal_the_reference(fps):
    rate = float(fps)
    n = int(4 * 3600 * rate) + 1
    # Every frame that starts within 2 ms of a whole second (where microsecond rounding and millisecond
    # truncation disagree), and every 10th frame elsewhere: the whole 4 hours, at a tenth of the cost.
    near = [i for i in range(n) if abs(i / rate - round(i / rate)) < 0.002 or i % 10 == 0]
    assert len(near) > n // 10
    for i in near:
        assert chunk_timestamp(i, rate) == ref.timestamp(i / rate), i


def test_timestamp_modes_and_the_issue_example():
    t = 24000 / (24000 / 1001)  # 1000.9999999999999
    assert chunk_timestamp(24000, 24000 / 1001) == "00:16:41.999" == ref.timestamp(t)
    # Control: flooring the seconds (bivit's old formatting) gives another string for this frame.
    assert time.strftime("%H:%M:%S", time.gmtime(t)) + ".999" == "00:16:40.999"
    for i in range(0, 200_000, 997):
        for mode in ("hh:mm:ss.fff", "mm:ss.fff", "mm:ss"):
            assert chunk_timestamp(i, 29.97, mode) == ref.timestamp(i / 29.97, mode)


# ---------------------------------------------------------------------------------------- placeholders
def test_placeholders_for_images_and_video_chunks(tmp_path):
    enc = bivit.load_encoder()
    video = make_video(tmp_path / "v.mp4", frames=30, fps=Fraction(30000, 1001), size=(120, 90))
    img = np.zeros((90, 200, 3), np.uint8)
    got = enc.placeholders([img, video])
    embs = enc.encode([img, video])
    assert got[0] == [bivit.Placeholder(ref.image_prompt("kimi_k25", 200, 90), embs[0].shape[0])]
    rate = float(Fraction(30000, 1001))
    indices = ref.sample_indices(30, rate, 2.0)
    chunks = enc.encode_video(video)
    assert [p.text for p in got[1]] == [ref.chunk_prompt(ref.timestamp(indices[4 * c] / rate))
                                        for c in range(len(chunks))]
    assert [p.tokens for p in got[1]] == [c.embedding.shape[0] for c in chunks]
    assert sum(p.tokens for p in got[1]) == embs[1].shape[0]
    assert all(p.text.count("<|media_pad|>") == 1 for ps in got for p in ps)


def test_k3_placeholder_carries_the_image_size(tmp_path, k3_ckpt):
    enc = bivit.load_encoder(k3_ckpt, dtype="float32")
    path = tmp_path / "odd.png"
    Image.fromarray(np.zeros((517, 333, 3), np.uint8)).save(path)
    (p,) = enc.placeholders([path])[0]
    assert p.text == ref.image_prompt("kimi_k3", 333, 517)
    assert p.tokens == enc.encode([path])[0].shape[0] == ref.navit_resize_image(333, 517, 14, 2, 65536, 512)[
        "num_tokens"]


# ------------------------------------------------------------------------------------------ pixel limit
def _png_header(width: int, height: int, mode_byte: int = 0) -> bytes:
    """A PNG with only a header (no pixel data): enough for the size checks, which never decode."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, mode_byte, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.mark.parametrize("w,h", [(10000, 9000), (13000, 13000), (14000, 14000)])  # 90, 169 and 196 MP
def test_images_up_to_the_documented_200mp_pass_the_size_checks(w, h):
    saved = Image.MAX_IMAGE_PIXELS
    assert image_size(_png_header(w, h)) == (w, h)
    assert Image.MAX_IMAGE_PIXELS == saved  # Pillow's global guard is left as it was


def test_over_200mp_is_a_media_error():
    with pytest.raises(bivit.MediaError, match="exceeds the limit of 200000000"):
        image_size(_png_header(15000, 14000))
    with pytest.raises(bivit.MediaError, match="exceeds the limit"):
        load_image(_png_header(20000, 20000))


def test_a_real_90mp_image_decodes(tmp_path):
    # Above Pillow's 89.5 MP warning threshold, which bivit used to turn into an error.
    path = tmp_path / "big.png"
    Image.new("1", (9500, 9500)).save(path)
    img = load_image(path)
    assert img.size == (9500, 9500)
    assert bivit.image_token_count(*img.size) == ref.navit_resize_image(9500, 9500, 14, 2, 16384, 512)["num_tokens"]
