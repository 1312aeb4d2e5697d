"""What bivit's vLLM plugin builds on, without vLLM: an encoder over weights already in memory is `load_encoder`'s
(`encoder_from_state`), a partial weight update replaces only what it names, and raw uint8 patches (what vLLM's
Kimi-K2.5 processor hands a model that normalises them) normalise to the pixels bivit's preprocessing gives.
The plugin itself runs in the vLLM tests (tests/vllm_engine/test_vllm_plugin.py)."""

from pathlib import Path

import numpy as np
import pytest
import torch

import bivit
from bivit.checkpoint.config import load_config
from bivit.checkpoint.preprocess_config import load_processing
from bivit.checkpoint.state_dict import checked_state, random_state_dict
from bivit.core.encoder import encoder_from_state
from bivit.errors import CheckpointError, MediaError
from bivit.media.pixels import _resize_pad, normalize_patches
from support.media import random_image

IMAGES = [random_image(97, 203, 1), random_image(56, 84, 2)]


def test_an_encoder_from_weights_in_memory_is_load_encoders(kimi_ckpt):
    cfg = load_config(kimi_ckpt)
    state = checked_state({k: (t, Path("mem")) for k, t in random_state_dict(cfg, 0).items()}, cfg, Path("mem"))
    for dtypes in ({"dtype": "float32"}, {"dtype": "bfloat16", "projector_dtype": "float32"}):
        loaded = bivit.load_encoder(str(kimi_ckpt), **dtypes)
        built = encoder_from_state(cfg, state, model_name="mem", processing=load_processing(kimi_ckpt, cfg), **dtypes)
        assert built.fingerprint == loaded.fingerprint
        assert all(torch.equal(a, b) for a, b in zip(built.encode(IMAGES), loaded.encode(IMAGES)))
    # Control: other dtypes, another fingerprint.
    assert built.fingerprint != bivit.load_encoder(str(kimi_ckpt), dtype="bfloat16").fingerprint


def test_a_partial_update_replaces_what_it_names(kimi_ckpt):
    enc = bivit.load_encoder(str(kimi_ckpt), dtype="float32")
    before, rows = enc.fingerprint, enc.encode(IMAGES[:1])[0]
    key = "mm_projector.proj.2.bias"
    with pytest.raises(CheckpointError, match="missing tensor"):  # control: a whole update needs every weight
        enc.update_weights({key: torch.zeros_like(enc.model.state_dict()[key])})
    with pytest.raises(CheckpointError, match="unexpected tensor 'nope'"):
        enc.update_weights({"nope": torch.zeros(1)}, partial=True)
    assert enc.fingerprint == before
    old = enc.model.state_dict()[key].clone()
    assert enc.update_weights({key: old + 1}, partial=True) != before
    assert torch.equal(enc.model.state_dict()[key], old + 1) and not torch.equal(enc.encode(IMAGES[:1])[0], rows)
    assert enc.update_weights({key: old}, partial=True) == before  # the other weights stayed: back to the start
    assert torch.equal(enc.encode(IMAGES[:1])[0], rows)


def vllm_raw_patches(image: np.ndarray, processing) -> torch.Tensor:
    """What vLLM's Kimi-K2.5 processor gives with normalisation left to the model: the resized, zero-padded uint8
    pixels cut into [L, 3, p, p] patches (its layout: row-major patches, channel, row, column)."""
    from PIL import Image  # only this helper needs it

    arr = _resize_pad(Image.fromarray(image, "RGB"), processing.in_patch_limit, processing)
    p = processing.patch_size
    h, w, _ = arr.shape
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(h // p, p, w // p, p, 3).transpose(0, 2, 4, 1, 3)
                                                 .reshape(-1, 3, p, p)))


def test_raw_patches_normalise_to_bivits_pixels(kimi_ckpt):
    enc = bivit.load_encoder(str(kimi_ckpt), dtype="float32")
    for image in IMAGES:
        raw = vllm_raw_patches(image, enc.processing)
        want = enc.preprocess([image]).pixel_values
        assert torch.equal(normalize_patches(raw, enc.processing), want)
        # Control: vLLM's own device normalisation, x * (rescale / std) + (-mean / std) in float32, is another
        # arithmetic (it differs at 111 of the 256 byte values for mean = std = 0.5).
        w = torch.tensor(1 / 255, dtype=torch.float32) / torch.tensor(0.5)
        b = torch.tensor(-0.5, dtype=torch.float32) / torch.tensor(0.5)
        assert not torch.equal(raw.float() * w + b, want)
    with pytest.raises(MediaError, match="raw uint8 patches"):
        normalize_patches(raw.float(), enc.processing)

