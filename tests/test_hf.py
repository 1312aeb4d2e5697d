"""bivit inside transformers' Kimi-K2.5 model (`bivit.integrations.hf`), on a whole tiny Kimi-K2.5 checkpoint (random
weights, a DeepSeek-V3 language model, tokenizer) loaded by `Kimi_K25ForConditionalGeneration`.

After `attach`, the model's image features are `Encoder.encode`'s bits for images and video chunks (t > 1), its
parameters are exactly the tensors bivit's forward reads (gradients reach them, the optimizer steps them), and
`save_pretrained` writes the published layout, which bivit and transformers reload to the same rows (vLLM too:
tests/vllm_engine/test_vllm_rl.py). Controls: HF's own tower gives other bits (within the parity tolerance); HF's own
`save_pretrained` writes names nobody loads. (HF's tower cannot take video chunks at all: it splits its output by
t*h*w/4 rows per item.)
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import bivit
from bivit.errors import BivitError
from bivit.media.pixels import MEDIA_PAD
from bivit.model import Block
from support.media import make_video, random_image

pytest.importorskip("transformers")
from transformers import Kimi_K25ForConditionalGeneration  # noqa: E402

import bivit.integrations.hf as bh  # noqa: E402

SIZES = [(112, 112), (60, 250), (203, 97)]  # (h, w): 16, 27 and 32 rows
PARITY_RTOL = 1e-4  # fp32 bivit vs transformers' port on the same weights and pixels (measured ~1e-6)


def hf_model(ckpt, dtype="float32"):
    return Kimi_K25ForConditionalGeneration.from_pretrained(str(ckpt), dtype=getattr(torch, dtype))


@pytest.fixture(scope="module")
def images():
    return [Image.fromarray(random_image(h, w, i)) for i, (h, w) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    """8 frames at 2 fps: two chunks of 4 frames (t = 4)."""
    return make_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=8, fps=2, size=(84, 56),
                      content=lambda i, size: random_image(size[1], size[0], 100 + i))


@pytest.fixture(scope="module")
def processor(tiny_kimi_ckpt):
    return bh.Processor.from_pretrained(tiny_kimi_ckpt)


def prompt(*parts: str) -> str:
    return "<|im_user|>user<|im_middle|>" + " ".join(parts) + "<|im_end|><|im_assistant|>assistant<|im_middle|>"


def features(model, batch) -> list[torch.Tensor]:
    """The model's image features for a processor batch. (HF's own tower takes only [L, 3, 14, 14] pixels in its
    own dtype; the processor's are flattened float32, which an attached model takes as they are.)"""
    pixels = batch["pixel_values"]
    if not bh.is_attached(model):
        pixels = pixels.reshape(pixels.shape[0], 3, 14, 14).to(model.model.vision_tower.dtype)
    return list(model.model.get_image_features(pixels, batch["image_grid_thw"]).pooler_output)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def saved_keys(directory) -> set[str]:
    keys: set[str] = set()
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            keys |= set(fh.keys())
    return keys


# ------------------------------------------------------------------------------------------ the rows

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_image_features_are_the_encoders_bits_for_images_and_video_chunks(tiny_kimi_ckpt, processor, images,
                                                                         video, dtype):
    model = hf_model(tiny_kimi_ckpt, dtype)
    text = prompt("a", MEDIA_PAD, "b", MEDIA_PAD, "v", bh.VIDEO_TOKEN, "c", MEDIA_PAD)
    batch = processor(text=[text], images=images, videos=[video], return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    assert [g[0] for g in grids] == [1, 1, 4, 4, 1]  # images and the video's two chunks, in prompt order
    image_batch = processor(text=[prompt(MEDIA_PAD, MEDIA_PAD, MEDIA_PAD)], images=images, return_tensors="pt")
    with torch.no_grad():
        theirs = features(model, image_batch)  # HF's own tower, before attach (it cannot take video chunks)
    bh.attach(model)
    with torch.no_grad():
        ours = features(model, batch)
    enc = bivit.load_encoder(str(tiny_kimi_ckpt), dtype=dtype)
    want = [r.embedding for r in enc.encode_items([images[0], images[1]])]
    want += enc.encode_items([video])[0].chunks + enc.encode_items([images[2]])[0].chunks
    assert [o.shape[0] for o in ours] == [w.shape[0] for w in want] == [16, 27, 6, 6, 32]
    for o, w in zip(ours, want):
        assert o.dtype == w.dtype == getattr(torch, dtype) and torch.equal(o, w)
    # The input ids hold one <|media_pad|> per row, where the model scatters them.
    pad = processor.tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    assert int((batch["input_ids"] == pad).sum()) == sum(w.shape[0] for w in want)
    # Control: HF's tower computes other bits for the images (within the parity tolerance in fp32).
    ours_images = [ours[0], ours[1], ours[4]]
    assert any(not torch.equal(a, b) for a, b in zip(theirs, ours_images))
    if dtype == "float32":
        assert all(rel(a, b) <= PARITY_RTOL for a, b in zip(theirs, ours_images))


def test_gradients_reach_bivit_and_the_optimizer_steps_what_bivit_reads(tiny_kimi_ckpt, processor, images):
    model = hf_model(tiny_kimi_ckpt)
    vision = bh.attach(model)
    hf_vision = {n: p for n, p in model.named_parameters() if n.startswith(("model.vision_tower.",
                                                                              "model.mm_projector."))}
    # One set of parameters, bivit's, under bivit's (the checkpoint's) names: fused wqkv, no q/k/v split.
    assert {id(p) for p in hf_vision.values()} == {id(p) for p in vision.parameters()}
    assert set(hf_vision) == {"model." + k for k in vision.state_dict()}
    assert not any(".q_proj." in n for n in hf_vision) and any(".wqkv." in n for n in hf_vision)

    batch = processor(text=[prompt(MEDIA_PAD, MEDIA_PAD, "hello")], images=images[:2], return_tensors="pt")
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vision.parameters())

    enc = bivit.load_encoder(str(tiny_kimi_ckpt), dtype="float32")
    before = [r.embedding for r in enc.encode_items(images[:2])]
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    enc.update_weights(vision.state_dict())  # the trainer's state dict as it is: no renaming
    after = [r.embedding for r in enc.encode_items(images[:2])]
    with torch.no_grad():
        trained = features(model, batch)
    assert all(torch.equal(a, t) for a, t in zip(after, trained))
    assert all(not torch.equal(a, b) for a, b in zip(after, before))


def test_autocast_does_not_reach_bivit(tiny_kimi_ckpt, processor, images):
    """A bf16-autocast training step computes the image rows as the rollout encoder does (without autocast)."""
    model = hf_model(tiny_kimi_ckpt)
    bh.attach(model)
    batch = processor(text=[prompt(MEDIA_PAD)], images=images[:1], return_tensors="pt")
    with torch.no_grad():
        plain = features(model, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = features(model, batch)
            hf_lm = model.model.language_model.embed_tokens.weight @ torch.ones(256, 1)  # autocast is on here
    assert hf_lm.dtype == torch.bfloat16  # (control: autocast does reach the language model's ops)
    assert all(torch.equal(a, b) for a, b in zip(plain, cast))


# ------------------------------------------------------------------------------------- save and reload

def test_save_pretrained_writes_the_published_layout_bivit_and_transformers_reload(tiny_kimi_ckpt, processor,
                                                                                 images, tmp_path):
    published = saved_keys(tiny_kimi_ckpt)
    model = hf_model(tiny_kimi_ckpt)
    bh.attach(model)
    batch = processor(text=[prompt(MEDIA_PAD, MEDIA_PAD)], images=images[1:], return_tensors="pt")
    sum((f * f).sum() for f in features(model, batch)).backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()  # weights of its own, not the checkpoint's
    with torch.no_grad():
        rows = features(model, batch)

    out = tmp_path / "saved"
    model.save_pretrained(out)
    processor.save_pretrained(out)
    assert saved_keys(out) == published
    assert set(bh.checkpoint_state_dict(model)) == published
    assert json.loads((out / "config.json").read_text())["architectures"] == [bh.PUBLISHED_ARCHITECTURE]

    fresh = bivit.load_encoder(str(out), dtype="float32")
    assert all(torch.equal(r, f) for r, f in zip(rows, (x.embedding for x in fresh.encode_items(images[1:]))))
    assert bh.Processor.from_pretrained(out).processing == processor.processing

    again = hf_model(out)  # transformers' own classes, its own conversions on load
    state, state_again = model.state_dict(), again.state_dict()
    lm = [k for k in state if not k.startswith(("model.vision_tower.", "model.mm_projector."))]
    assert lm and all(torch.equal(state[k], state_again[k]) for k in lm)
    with torch.no_grad():
        assert all(rel(t, r) <= PARITY_RTOL for t, r in zip(features(again, batch), rows))  # HF's tower
        bh.attach(again)
        assert all(torch.equal(t, r) for t, r in zip(features(again, batch), rows))

    # Control: transformers' own save_pretrained of this model (without bivit) writes names that nothing loads
    # (its "blocks" and "wqkv" conversions reverted over the language model too).
    plain = tmp_path / "hf-saved"
    hf_model(tiny_kimi_ckpt).save_pretrained(plain)
    assert saved_keys(plain) != published


# ---------------------------------------------------------------------------------------- processor

def test_processor_errors_name_the_mismatch(processor, images):
    with pytest.raises(BivitError, match="more <\\|media_pad\\|> than the 1 image"):
        processor(text=[prompt(MEDIA_PAD, MEDIA_PAD)], images=images[:1])
    with pytest.raises(BivitError, match="2 image\\(s\\) given but the text has 1"):
        processor(text=[prompt(MEDIA_PAD)], images=images[:2])
    with pytest.raises(bivit.MediaError):
        processor(text=[prompt(MEDIA_PAD)], images=[b"not an image"])


def test_processor_spreads_images_over_samples_in_order(processor, images):
    """HF's calling convention: images flat or per sample, consumed by the texts' pads in order."""
    texts = [prompt(MEDIA_PAD), prompt(MEDIA_PAD, MEDIA_PAD)]
    flat = processor(text=texts, images=images, padding=True, return_tensors="pt")
    nested = processor(text=texts, images=[[images[0]], images[1:]], padding=True, return_tensors="pt")
    assert torch.equal(flat["pixel_values"], nested["pixel_values"])
    assert flat["image_grid_thw"].tolist() == [[1, 8, 8], [1, 6, 18], [1, 16, 8]]
    pad = processor.tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    assert ((flat["input_ids"] == pad).sum(1)).tolist() == [16, 27 + 32]


# ------------------------------------------------------------------------------ adapters and sharding

def test_peft_adapters_on_the_language_model_only(tiny_kimi_ckpt, processor, images):
    peft = pytest.importorskip("peft")
    model = hf_model(tiny_kimi_ckpt)
    vision = bh.attach(model)
    batch = processor(text=[prompt(MEDIA_PAD)], images=images[:1], return_tensors="pt")
    enc = bivit.load_encoder(str(tiny_kimi_ckpt), dtype="float32")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["kv_b_proj", "o_proj"]))
    assert not any(p.requires_grad for p in vision.parameters())  # the base model, tower included, is frozen
    out = lora(**batch, labels=batch["input_ids"])
    out.loss.backward()
    assert any(p.grad is not None for n, p in lora.named_parameters() if "lora_" in n)
    with torch.no_grad():
        assert torch.equal(features(model, batch)[0], enc.encode_items(images[:1])[0].embedding)

    wrapped_vision = peft.get_peft_model(hf_model(tiny_kimi_ckpt), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    # HF's split q_proj: LoRA lands in HF's tower; attach refuses to take it over (the adapter would be lost).
    with pytest.raises(BivitError, match="cannot take over"):
        bh.attach(wrapped_vision.base_model.model)
    fused = hf_model(tiny_kimi_ckpt)
    bh.attach(fused)
    fused = peft.get_peft_model(fused, peft.LoraConfig(r=4, target_modules=["wqkv"]))
    with pytest.raises(BivitError, match="wqkv is wrapped"):
        fused(**batch)


def test_fsdp_wrap_policy_names_bivits_block(tiny_kimi_ckpt):
    """accelerate's FSDP auto-wrap resolves `_no_split_modules` by class name in the model; after attach HF's
    vision layer class is gone (control: it resolves before), bivit's block resolves."""
    from accelerate.utils.dataclasses import get_module_class_from_name  # optional: comes with trl, not transformers

    model = hf_model(tiny_kimi_ckpt)
    assert get_module_class_from_name(model, "Kimi_K25VisionEncoderLayer") is not None
    bh.attach(model)
    assert get_module_class_from_name(model, "Kimi_K25VisionEncoderLayer") is None
    assert "Kimi_K25VisionEncoderLayer" not in model._no_split_modules
    assert all(get_module_class_from_name(model, n) is not None for n in model._no_split_modules)
    assert get_module_class_from_name(model, "Block") is Block
