"""bivit's vLLM plugin through vLLM's OpenAI-compatible server: a real server process on loopback, started as
docs/vllm.md writes it (`--hf-overrides` naming BivitKimiK25ForConditionalGeneration) with the test settings, one
per dtype (bfloat16, float32).

A chat message with two images as `image_url` parts (PNG data URLs, as a client sends a file): the rows the server
computed for each are `torch.equal` to `bivit.load_encoder(ckpt, dtype=...).encode([file])`. The rows are read
where vLLM's encoder-cache connector (`ec_both` on a test folder) saves what the model computed, under the ids
the parts carry (`uuid`). Control: the same message to the same server with the plugin's override left out (vLLM's
own tower, a second server) saves other bits for each image.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed here; run scripts/vllm-env.sh test (its own venv)")

from engine_support import engine_environment, load_ec, server_options  # noqa: E402
from support.media import random_image  # noqa: E402
from test_vllm_server import free_port, png_url, stop, wait_ready  # noqa: E402

from bivit.integrations.vllm_plugin import ARCHITECTURE  # noqa: E402

IMAGES = {"wide": (140, 112), "odd": (203, 97)}


def start(tiny_kimi, dtype: str, ec_dir: Path, log_path: Path, overrides: dict | None):
    """`python -m vllm.entrypoints.openai.api_server` (docs/vllm.md's command, with the tests' engine settings and an
    encoder-cache folder the test reads) -> (process, url, log file)."""
    engine_environment()
    port = free_port()
    ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_both",
          "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_kimi), "--host",
           "127.0.0.1", "--port", str(port), *server_options(dtype), "--ec-transfer-config", json.dumps(ec),
           *(["--hf-overrides", json.dumps(overrides)] if overrides else [])]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}", log


def rows_of(url: str, model: str, ec_dir: Path, paths: dict, run: str) -> dict[str, torch.Tensor]:
    """One chat message with every image as an `image_url` part named `run-<name>` -> name -> the rows the server
    computed for it (its encoder-cache file)."""
    content = [{"type": "text", "text": "Look: "}]
    for name, path in paths.items():
        content.append({"type": "image_url", "image_url": {"url": png_url(Image.open(path))}, "uuid": f"{run}-{name}"})
    content.append({"type": "text", "text": " what now?"})
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return {name: load_ec(ec_dir, f"{run}-{name}") for name in paths}


def test_the_servers_rows_are_bivits(tiny_kimi, encoders, dtype, tmp_path):
    paths = {}
    for seed, (name, (w, h)) in enumerate(IMAGES.items()):
        paths[name] = tmp_path / f"{name}.png"
        Image.fromarray(random_image(h, w, 50 + seed), "RGB").save(paths[name])
    encoder = encoders(dtype)
    want = {name: encoder.encode([path])[0] for name, path in paths.items()}
    got = {}
    for label, overrides in (("plugin", {"architectures": [ARCHITECTURE]}), ("stock", None)):
        ec_dir = tmp_path / f"ec-{label}"
        ec_dir.mkdir()
        proc, url, log = start(tiny_kimi, dtype, ec_dir, tmp_path / f"{label}.log", overrides)
        try:
            wait_ready(proc, url, log)
            got[label] = rows_of(url, str(tiny_kimi), ec_dir, paths, f"{dtype}-{label}")
        finally:
            stop(proc, log)
    assert {n: torch.equal(got["plugin"][n], want[n]) for n in paths} == {n: True for n in paths}
    # Control: vLLM's own tower, the same message: other bits (the same token counts).
    assert {n: got["stock"][n].shape == want[n].shape and not torch.equal(got["stock"][n], want[n])
            for n in paths} == {n: True for n in paths}
