"""Config layouts and checkpoint loading: sharded indexes, never touching language-model shards, and a
CheckpointError / ConfigError naming the key and file for every broken input."""

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import save_file

import bivit
from bivit.checkpoint.config import PRESETS, config_from_dict, load_config
from bivit.checkpoint.state_dict import INDEX, moonshot_config_dict, random_state_dict, save_checkpoint
from support.media import random_image
from support.checkpoints import KIMI_SMALL, hf_config_dict, write_checkpoint

PUBLISHED_K25 = {  # the shape of Moonshot's published config.json (docs/model.md, "Config"), abridged text_config
    "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "dtype": "bfloat16",
    "media_placeholder_token_id": 163605, "use_unified_vision_chunk": True,
    "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61},
    "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}}}, "ignore": ["lm_head"]},
    "vision_config": {
        "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "vt_hidden_size": 1152, "vt_num_hidden_layers": 27,
        "vt_num_attention_heads": 16, "vt_intermediate_size": 4304, "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal", "mm_projector_type": "patchmerger",
        "mm_hidden_size": 1152, "text_hidden_size": 7168, "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
    },
}


def test_published_moonshot_config_reads_as_k26():
    assert config_from_dict(PUBLISHED_K25) == PRESETS["kimi-k2.6"]


def test_k3_config_and_round_trip():
    assert config_from_dict(moonshot_config_dict(PRESETS["kimi-k3"])) == PRESETS["kimi-k3"]
    assert config_from_dict(moonshot_config_dict(KIMI_SMALL)) == KIMI_SMALL


def test_hf_config_layout():
    cfg = config_from_dict(hf_config_dict(KIMI_SMALL))
    assert cfg == KIMI_SMALL


@pytest.mark.parametrize("key,value", [
    ("merge_type", "avgpool"), ("mm_projector_type", "mlp2x"), ("pos_emb_type", "rope3d"),
    ("video_attn_type", "causal"), ("vt_num_attention_heads", 7), ("merge_kernel_size", [3, 3]),
    ("norm_type", "batchnorm"), ("vt_hidden_size", "big"),
])
def test_unsupported_values_name_the_key(key, value):
    raw = json.loads(json.dumps(PUBLISHED_K25))
    raw["vision_config"][key] = value
    with pytest.raises(bivit.ConfigError, match=key):
        config_from_dict(raw)


def test_hf_unsupported_rope(tmp_path):
    raw = hf_config_dict(KIMI_SMALL)
    raw["vision_config"]["rope_parameters"]["rope_type"] = "yarn"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(bivit.ConfigError, match="rope_type") as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(bivit.ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(bivit.ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))
    with pytest.raises(bivit.ConfigError, match="vision_config"):
        load_config(tmp_path)


# ------------------------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Like the published checkpoint: language-model shards first, vision + projector in the last two."""
    return write_checkpoint(tmp_path_factory.mktemp("sharded"), KIMI_SMALL, shards=2, lm_shards=3)


def test_sharded_checkpoint_loads_without_reading_language_model_shards(sharded, kimi_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    index = json.loads((ckpt / INDEX).read_text())["weight_map"]
    lm_files = {f for k, f in index.items() if k.startswith("language_model.")}
    vision_files = {f for k, f in index.items() if not k.startswith("language_model.")}
    assert len(lm_files) == 3 and len(vision_files) == 2 and not lm_files & vision_files
    for f in lm_files:  # make the language-model shards unreadable garbage
        (ckpt / f).write_bytes(b"\x00garbage" * 1000)
    enc = bivit.load_encoder(ckpt, dtype="float32")
    ref = bivit.load_encoder(kimi_ckpt, dtype="float32")  # same seed, single file
    img = [random_image(56, 84)]
    assert torch.equal(enc.encode(img)[0], ref.encode(img)[0])
    for f in lm_files:  # and deleting them entirely changes nothing either
        (ckpt / f).unlink()
    assert torch.equal(bivit.load_encoder(ckpt, dtype="float32").encode(img)[0], ref.encode(img)[0])


def _single(tmp_path, state, cfg=KIMI_SMALL):
    save_checkpoint(tmp_path, cfg, state, dtype=torch.float32)
    return tmp_path


def test_missing_key(tmp_path):
    state = random_state_dict(KIMI_SMALL)
    del state["vision_tower.encoder.blocks.1.wo.bias"]
    with pytest.raises(bivit.CheckpointError, match=r"missing vision tensor 'vision_tower.encoder.blocks.1.wo.bias'"):
        bivit.load_encoder(_single(tmp_path, state))


def test_unexpected_key(tmp_path):
    state = random_state_dict(KIMI_SMALL)
    state["vision_tower.encoder.blocks.7.wo.bias"] = torch.zeros(3)
    with pytest.raises(bivit.CheckpointError, match=r"unexpected vision tensor 'vision_tower.encoder.blocks.7") as e:
        bivit.load_encoder(_single(tmp_path, state))
    assert "model.safetensors" in str(e.value)


def test_shape_mismatch(tmp_path):
    state = random_state_dict(KIMI_SMALL)
    state["mm_projector.proj.2.weight"] = torch.zeros(7, 1152)
    with pytest.raises(bivit.CheckpointError, match=r"'mm_projector.proj.2.weight' has shape \(7, 1152\)") as e:
        bivit.load_encoder(_single(tmp_path, state))
    assert "model.safetensors" in str(e.value)


def test_non_finite(tmp_path):
    state = random_state_dict(KIMI_SMALL)
    state["vision_tower.encoder.blocks.0.mlp.fc0.weight"][3, 3] = float("nan")
    with pytest.raises(bivit.CheckpointError, match="blocks.0.mlp.fc0.weight' contains NaN"):
        bivit.load_encoder(_single(tmp_path, state))


def test_quantized_vision_weights_are_refused(tmp_path):
    state = random_state_dict(KIMI_SMALL)
    state["vision_tower.encoder.blocks.0.wo.weight"] = torch.zeros(288, 288, dtype=torch.int8)
    save_file(state, str(tmp_path / "model.safetensors"))  # as stored: no cast on the way
    (tmp_path / "config.json").write_text(json.dumps(moonshot_config_dict(KIMI_SMALL)))
    with pytest.raises(bivit.CheckpointError, match="int8; vision weights must be bfloat16"):
        bivit.load_encoder(tmp_path)


def test_truncated_and_corrupt_shards(sharded, tmp_path):
    index = json.loads((sharded / INDEX).read_text())["weight_map"]
    last = sorted({f for k, f in index.items() if k.startswith("vision_tower.")})[-1]
    for damage in ("truncate", "header"):
        ckpt = tmp_path / damage
        shutil.copytree(sharded, ckpt)
        data = (ckpt / last).read_bytes()
        (ckpt / last).write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
        with pytest.raises(bivit.CheckpointError) as e:
            bivit.load_encoder(ckpt)
        assert last in str(e.value)


def test_index_pointing_at_missing_shard(sharded, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    index = json.loads((ckpt / INDEX).read_text())["weight_map"]
    victim = index["mm_projector.proj.0.weight"]
    (ckpt / victim).unlink()
    with pytest.raises(bivit.CheckpointError, match="shard file is missing") as e:
        bivit.load_encoder(ckpt)
    assert victim in str(e.value)


def test_index_claims_a_key_the_shard_lacks(sharded, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    raw = json.loads((ckpt / INDEX).read_text())
    first_lm = next(f for k, f in raw["weight_map"].items() if k.startswith("language_model."))
    raw["weight_map"]["vision_tower.encoder.final_layernorm.bias"] = first_lm
    (ckpt / INDEX).write_text(json.dumps(raw))
    with pytest.raises(bivit.CheckpointError, match="final_layernorm.bias"):
        bivit.load_encoder(ckpt)


def test_transformers_layout_with_missing_part_is_refused(tmp_path):
    state = {"model.vision_tower.layers.0.attn.q_proj.weight": torch.zeros(288, 288)}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(KIMI_SMALL)))
    with pytest.raises(bivit.CheckpointError, match="k_proj.weight' missing"):
        bivit.load_encoder(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(bivit.BivitError, match="checkpoint directory"):
        bivit.load_encoder(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(moonshot_config_dict(KIMI_SMALL)))
    with pytest.raises(bivit.CheckpointError, match="no model.safetensors.index.json and no"):
        bivit.load_encoder(tmp_path)


def test_fingerprint_identifies_weights_and_options(kimi_ckpt, kimi_hf_ckpt):
    a = bivit.load_encoder(kimi_ckpt, dtype="float32")
    assert a.fingerprint == bivit.load_encoder(kimi_ckpt, dtype="float32").fingerprint
    assert a.fingerprint == bivit.load_encoder(kimi_hf_ckpt, dtype="float32").fingerprint  # same weights
    assert a.fingerprint != bivit.load_encoder(kimi_ckpt, dtype="bfloat16").fingerprint
    assert a.fingerprint != bivit.load_encoder(kimi_ckpt, dtype="float32", batch_invariant=False).fingerprint


# ------------------------------------------------------------------------------ hostile checkpoints, configs


@pytest.mark.parametrize("key,value", [
    ("qkv_hidden_size", "abc"), ("merge_kernel_size", 5), ("projector_ln_eps", "x"), ("norm_eps", "tiny"),
    ("norm_eps", -1e-5), ("vt_hidden_size", 1e9), ("attn_bias", "false"), ("projector_ln_eps", float("nan")),
])
def test_mistyped_config_values_name_the_key(key, value):
    raw = json.loads(json.dumps(PUBLISHED_K25))
    raw["vision_config"][key] = value
    with pytest.raises(bivit.ConfigError, match=key):
        config_from_dict(raw)


@pytest.mark.parametrize("key,value", [("vt_num_hidden_layers", 1_000_000), ("vt_hidden_size", 1_000_000_000),
                                       ("vt_intermediate_size", 10**12), ("init_pos_emb_height", 10**7)])
def test_absurd_sizes_are_refused_before_anything_is_built(tmp_path, key, value):
    raw = moonshot_config_dict(KIMI_SMALL)
    raw["vision_config"][key] = value
    if key == "vt_hidden_size":
        raw["vision_config"].update(mm_hidden_size=value, qkv_hidden_size=value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({"vision_tower.x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    t0 = time.monotonic()
    with pytest.raises(bivit.ConfigError, match=f"num_hidden_layers|parameters|'{key}' = {value}: more than"):
        bivit.load_encoder(tmp_path)
    assert time.monotonic() - t0 < 5


def test_config_json_that_is_a_directory(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(bivit.ConfigError, match="config.json: cannot read"):
        load_config(tmp_path)


def test_float8_vision_weights_are_refused(tmp_path):
    state = random_state_dict(KIMI_SMALL)
    state["vision_tower.encoder.blocks.0.wo.weight"] = torch.zeros(288, 288).to(torch.float8_e4m3fn)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(moonshot_config_dict(KIMI_SMALL)))
    with pytest.raises(bivit.CheckpointError, match="float8_e4m3fn; vision weights must be"):
        bivit.load_encoder(tmp_path)


@pytest.mark.parametrize("value,why", [(3, "expected a shard file name"), (None, "expected a shard file name"),
                                       ("../outside.safetensors", "outside the checkpoint folder"),
                                       ("/etc/passwd", "outside the checkpoint folder")])
def test_index_entries_must_name_shards_in_the_folder(sharded, tmp_path, value, why):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    raw = json.loads((ckpt / INDEX).read_text())
    raw["weight_map"]["mm_projector.proj.0.weight"] = value
    (ckpt / INDEX).write_text(json.dumps(raw))
    with pytest.raises(bivit.CheckpointError, match=why) as e:
        bivit.load_encoder(ckpt)
    assert "mm_projector.proj.0.weight" in str(e.value)


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_shard_that_is_not_a_regular_file(sharded, tmp_path, special):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    victim = json.loads((ckpt / INDEX).read_text())["weight_map"]["mm_projector.proj.0.weight"]
    (ckpt / victim).unlink()
    if special == "fifo":
        os.mkfifo(ckpt / victim)
    else:
        (ckpt / victim).symlink_to("/dev/zero")
    with pytest.raises(bivit.CheckpointError, match="not a regular file but a (FIFO|character device)") as e:
        bivit.load_encoder(ckpt)
    assert victim in str(e.value)


@pytest.mark.parametrize("name", ["config.json", "preprocessor_config.json", INDEX])
@pytest.mark.parametrize("special", ["fifo", "directory", "dangling link"])
def test_json_files_that_are_not_regular_files_are_named_errors(sharded, tmp_path, name, special):
    """config.json, preprocessor_config.json and the shard index, each replaced by a FIFO (read without waiting
    for a writer), a directory or a dangling link: a ConfigError/CheckpointError naming the file. A broken
    preprocessor_config.json is not silently replaced by the published defaults, nor a broken index by a scan
    of every shard."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    target = ckpt / name
    if target.exists():
        target.unlink()
    if special == "fifo":
        os.mkfifo(target)
    elif special == "directory":
        target.mkdir()
    else:
        target.symlink_to(tmp_path / "nowhere.json")
    started = time.monotonic()
    with pytest.raises((bivit.ConfigError, bivit.CheckpointError), match=name) as e:
        bivit.load_encoder(ckpt)
    assert time.monotonic() - started < 30
    assert any(why in str(e.value) for why in ("cannot read", "unreadable index", "no config.json"))
