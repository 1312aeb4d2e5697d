"""docs/encode-once.md's bivit code runs as written on a tiny Kimi-K2.5-architecture checkpoint (the one the
vLLM tests serve), and on the demo model, which has no checkpoint folder. The guide's vLLM code runs in
tests/vllm_engine (the vLLM environment) the same way."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from bivit.core.encoder_cache import EC_FILE, EC_KEY
from bivit.integrations import vllm as bv
from support import doc_code


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory):
    pytest.importorskip("tokenizers", reason="the tiny checkpoint's tokenizer is built with `tokenizers`")
    from vllm_engine.tiny_kimi import write_tiny_kimi

    return write_tiny_kimi(tmp_path_factory.mktemp("tiny_kimi"))


def test_encode_and_trainer_code_run_as_written(tiny_kimi, tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the guide's trainer reads the tokenizer with transformers")
    monkeypatch.chdir(tmp_path)
    doc_code.write_inputs(tmp_path)
    ns = doc_code.run(["encode"], {}, ckpt=tiny_kimi)
    encoded = ns["media"]
    assert [m.kind for m in encoded] == ["image", "video"] and encoded[0].embedding.dtype == torch.bfloat16
    assert ns["target"] == bv.Target.from_checkpoint(tiny_kimi, "bfloat16", fingerprint=ns["encoder"].fingerprint)

    # The guide's `bivit encode ... --ec-dir` command, then its trainer code on the file that command wrote.
    cmd = doc_code.line("bivit encode cat.png", ckpt=tiny_kimi, ec_dir=tmp_path / "ec").split()
    done = subprocess.run([sys.executable, "-m", "bivit", *cmd[1:]], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for m in encoded:
        for i, rows in zip(m.ec_ids(), m.chunks()):
            with safe_open(str(tmp_path / "ec" / i / EC_FILE), framework="pt") as f:
                # the command's files: the same ids, the same bits (what the command said, if not)
                assert torch.equal(f.get_tensor(EC_KEY), rows), (m.source, done.stderr)
    doc_code.run(["trainer"], ns)
    assert all(torch.equal(a.embedding, b.embedding) for a, b in zip(ns["media"], encoded))

    # lm_inputs with the checkpoint's own token embeddings: text positions embedded, bivit's rows at the span.
    from safetensors.torch import load_file

    table = next(t for shard in tiny_kimi.glob("*.safetensors") for k, t in load_file(str(shard)).items()
                 if k == "language_model.model.embed_tokens.weight")
    embed = torch.nn.Embedding.from_pretrained(table.to(torch.bfloat16))
    prompt = ns["prompt"]
    x = ns["lm_inputs"](prompt, embed)
    ((start, n),) = prompt.spans
    assert torch.equal(x[start:start + n], encoded[0].embedding)
    ids = torch.tensor(prompt.prompt_token_ids)
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[start:start + n] = False
    assert torch.equal(x[keep], embed(ids)[keep])
    assert not torch.equal(x[start:start + n], embed(ids)[start:start + n])  # control: the span was replaced


def test_encode_code_runs_on_the_demo_model(tmp_path, monkeypatch):
    """`ckpt = None`: bivit's demo model (no checkpoint folder), its Target from the encoder."""
    monkeypatch.chdir(tmp_path)
    doc_code.write_inputs(tmp_path)
    ns = doc_code.run(["encode"], {}, ckpt=None)
    t = ns["target"]
    assert ns["encoder"].is_demo and (t.hidden_size, t.dtype, t.fingerprint) == (128, torch.bfloat16,
                                                                                ns["encoder"].fingerprint)
    pads = sum(len(m.placeholders) for m in ns["media"])
    prompt = bv.build_prompt([1] + [0] * pads, ns["media"], target=t, media_pad_id=0)
    assert [n for _, n in prompt.spans] == [p.tokens for m in ns["media"] for p in m.placeholders]
