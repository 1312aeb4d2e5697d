"""Weight sync from a trainer (transformers' Kimi-K2.5 with bivit attached) to a running `bivit serve` process
(`POST /v1/weights` through `bivit.Client.update_weights`, as `bivit.integrations.rl.Rollout` does with
`push_to_server`): after one optimizer step and the sync, the server answers with the bits, and under the
fingerprint, of a fresh encoder loaded from the checkpoint the trainer saved (control: before the sync it does
not). The vLLM side (the same weights under vLLM's names, and the saved checkpoint loaded by vLLM) is in
tests/vllm_engine/test_vllm_rl.py.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import bivit
from bivit.media.pixels import MEDIA_PAD
from bivit.serve.client import ServerError
from support.media import png_bytes, random_image
from support.server import ServerProcess

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
from transformers import Kimi_K25ForConditionalGeneration  # noqa: E402

import bivit.integrations.hf as bh  # noqa: E402
from bivit.integrations.rl import Rollout, push_to_server  # noqa: E402

KEY = "sync-key-7"


@pytest.fixture(scope="module")
def server(tiny_kimi_ckpt, tmp_path_factory):
    with ServerProcess(["--model", str(tiny_kimi_ckpt), "--dtype", "float32"], tmp_path_factory.mktemp("sync"),
                       api_key=KEY) as srv:
        yield srv


def test_trainer_weights_reach_bivit_serve_as_the_saved_checkpoint_loads(server, tiny_kimi_ckpt, tmp_path):
    model = Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_kimi_ckpt), dtype=torch.float32)
    vision = bh.attach(model)
    processor = bh.Processor.from_pretrained(tiny_kimi_ckpt)
    images = [Image.fromarray(random_image(h, w, 5 + i)) for i, (h, w) in enumerate([(84, 140), (112, 56)])]
    batch = processor(text=[MEDIA_PAD * 2], images=images, return_tensors="pt")
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True).step()  # transformers' default optimizer
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    fresh = bivit.load_encoder(str(tmp_path), dtype="float32")
    files = [png_bytes(70, 42, 11), png_bytes(30, 90, 12)]  # what the server is asked to encode
    want = fresh.encode(files)

    with bivit.Client(server.url, api_key=KEY) as client:
        before = client.encode_results(files)
        assert not any(torch.equal(r.embedding, w) for r, w in zip(before, want))  # control: the old weights
        encoder = bivit.load_encoder(str(tiny_kimi_ckpt), dtype="float32")  # the rollout's own encoder
        pushed = []
        Rollout(encoder, processor, sync_to=[lambda m: pushed.append(push_to_server(client)(m))]).sync(model)
        after = client.encode_results(files)
        with torch.no_grad():
            assert all(torch.equal(r, w) for r, w in zip(vision(batch["pixel_values"].reshape(-1, 3, 14, 14),
                                                                 batch["image_grid_thw"]),
                                                          fresh.encode(images)))

    assert all(torch.equal(r.embedding, w) for r, w in zip(after, want))
    assert pushed[0]["fingerprint"] == fresh.fingerprint == encoder.fingerprint
    assert pushed[0]["previous_fingerprint"] == before[0].fingerprint != fresh.fingerprint
    assert all(r.fingerprint == fresh.fingerprint for r in after)


def test_a_refused_update_names_the_key(server, tiny_kimi_ckpt):
    trainer = bivit.load_model(str(tiny_kimi_ckpt), dtype="bfloat16")  # the server computes in float32
    with bivit.Client(server.url, api_key=KEY) as client:
        with pytest.raises(ServerError, match="proj.weight.* is bfloat16, the model computes it in float32"):
            client.update_weights(trainer.state_dict())
