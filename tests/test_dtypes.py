"""The dtype contract: no configuration of checkpoint/tower/projector dtypes crashes, every invariant op
returns the dtype of the op it replaces, and casts happen only at declared module boundaries."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import bivit
from bivit import ops
from bivit.checkpoint.config import PRESETS
from support.media import random_image
from support.checkpoints import K3_SMALL, KIMI_SMALL, write_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The same random weights stored in fp32, bf16 and fp16, for K2.x and K3 shapes."""
    out = {}
    for (name, cfg), dt in itertools.product([("kimi", KIMI_SMALL), ("k3", K3_SMALL)], DTYPES):
        out[name, dt] = write_checkpoint(tmp_path_factory.mktemp(f"{name}_{dt}"), cfg, dtype=DTYPES[dt])
    return out


@pytest.mark.parametrize("model", ["kimi", "k3"])
@pytest.mark.parametrize("stored_dtype", list(DTYPES))
def test_dtype_matrix(stored, model, stored_dtype):
    images = [random_image(28, 28), random_image(56, 84)]
    for tower, projector, invariant in itertools.product(["float32", "bfloat16"], ["float32", "bfloat16"],
                                                         [False, True]):
        enc = bivit.load_encoder(stored[model, stored_dtype], dtype=tower, projector_dtype=projector,
                                 batch_invariant=invariant)
        assert enc.dtype == DTYPES[tower] and enc.projector_dtype == DTYPES[projector]
        assert enc.output_dtype == DTYPES[projector]  # default: the projector dtype
        outs = enc.encode_batch(enc.preprocess(images))
        for out in outs:
            assert out.dtype == DTYPES[projector]
            assert torch.isfinite(out.float()).all()
        explicit = bivit.load_encoder(stored[model, stored_dtype], dtype=tower, projector_dtype=projector,
                                      output_dtype="float16", batch_invariant=invariant)
        assert all(o.dtype == torch.float16 for o in explicit.encode_batch(explicit.preprocess(images)))


@pytest.mark.parametrize("model", ["kimi", "k3"])
@pytest.mark.parametrize("merger_dtype,projector_dtype", [(torch.float32, torch.bfloat16),
                                                          (torch.bfloat16, torch.float32)])
def test_vllm_41638_regression(stored, model, merger_dtype, projector_dtype):
    """vLLM 41638: under batch invariance a float32 merger output reached a bf16 projector LayerNorm and
    crashed. Here: tower in one dtype, projector in the other, invariant mode, both projector types (K3's
    has no pre_norm, which is what broke vLLM's first fix)."""
    enc = bivit.load_encoder(stored[model, "bfloat16"], dtype=merger_dtype, projector_dtype=projector_dtype,
                             batch_invariant=True)
    assert hasattr(enc.model.mm_projector, "pre_norm") == (model == "kimi")
    with torch.inference_mode(), ops.batch_invariant(True):
        merged = enc.model.vision_tower(enc.preprocess([random_image(56, 56)]).pixel_values, [(1, 4, 4)])
        assert merged.dtype == merger_dtype  # the invariant temporal mean kept the tower dtype
        out = enc.model.mm_projector(merged)
    assert out.dtype == projector_dtype and torch.isfinite(out.float()).all()


OP_CASES = {
    "linear": (lambda x: ops.linear(x, W(x, 48, 32), W(x, 48)), lambda x: F.linear(x, W(x, 48, 32), W(x, 48))),
    "patch_conv": (lambda x: ops.patch_conv(x.reshape(-1, 2, 4, 4), W(x, 8, 2, 4, 4), W(x, 8)),
                   lambda x: F.conv2d(x.reshape(-1, 2, 4, 4), W(x, 8, 2, 4, 4), W(x, 8), stride=4).flatten(1)),
    "layer_norm": (lambda x: ops.layer_norm(x, W(x, 32), W(x, 32), 1e-5),
                   lambda x: F.layer_norm(x, (32,), W(x, 32), W(x, 32), 1e-5)),
    "rms_norm": (lambda x: ops.rms_norm(x, W(x, 32), None), lambda x: F.rms_norm(x, (32,), W(x, 32))),
    "gelu": (lambda x: ops.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "attention": (lambda x: ops.attention(*(x.reshape(-1, 2, 16),) * 3, [3, 3]),
                  lambda x: F.scaled_dot_product_attention(*(x.reshape(-1, 2, 16).transpose(0, 1),) * 3)),
    "temporal_mean": (lambda x: ops.temporal_mean(x.reshape(3, 2, 32)), lambda x: x.reshape(3, 2, 32).mean(0)),
}


def W(x, *shape):
    return torch.ones(shape, dtype=x.dtype) * 0.1


@pytest.mark.parametrize("name", list(OP_CASES))
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("invariant", [False, True])
def test_every_op_returns_the_dtype_of_the_op_it_replaces(name, dtype, invariant):
    ours, stock = OP_CASES[name]
    x = torch.randn(6, 32).to(dtype)
    with ops.batch_invariant(invariant):
        out = ours(x)
    assert out.dtype == stock(x).dtype == dtype


def test_invariant_temporal_mean_matches_mean_and_keeps_dtype():
    x = torch.randn(4, 10, 8)
    with ops.batch_invariant():
        m = ops.temporal_mean(x)
    assert m.dtype == x.dtype and torch.allclose(m, x.mean(0), atol=1e-6)
    xb = x.bfloat16()
    with ops.batch_invariant():
        assert ops.temporal_mean(xb).dtype == torch.bfloat16


def test_bad_dtype_option_is_a_config_error():
    with pytest.raises(bivit.ConfigError, match="projector_dtype"):
        bivit.load_encoder(projector_dtype="int8")
    with pytest.raises(bivit.ConfigError, match="max_batch_patches"):
        bivit.load_encoder(max_batch_patches=0)
    with pytest.raises(bivit.ConfigError, match="max_batch_tokens"):  # an old spelling: an unknown option
        bivit.load_encoder(max_batch_tokens=64)
    with pytest.raises(bivit.ConfigError, match="nonsense"):
        bivit.load_encoder(nonsense=1)


def test_unavailable_device_is_a_config_error_naming_it():
    # No machine has a 100th GPU; without a CUDA build torch refuses "cuda" altogether.
    with pytest.raises(bivit.ConfigError, match="'cuda:99'"):
        bivit.load_encoder(device="cuda:99")


def test_the_budget_bounds_passes_never_results():
    enc = bivit.load_encoder(max_batch_patches=64)
    one = bivit.load_encoder(max_batch_patches=1)  # every item in a pass of its own
    batch = enc.preprocess([random_image(56, 56, 1), random_image(112, 84, 2)])
    assert enc.max_batch_patches == 64 and one.max_batch_patches == 1
    assert all(torch.equal(a, b) for a, b in zip(one.encode_batch(batch), enc.encode_batch(batch)))


def test_demo_preset_is_the_real_architecture_small():
    cfg = PRESETS["demo"]
    assert cfg.projector_type == "patchmerger" and cfg.merge_kernel_size == (2, 2)
    enc = bivit.load_encoder()
    assert enc.is_demo and "DEMO" in repr(enc)
