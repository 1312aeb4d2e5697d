"""The encoder service, tested as deployed: a real `bivit serve` process on loopback.

The central property: whatever else is in flight and however the server coalesces items into forward passes,
every answer is bit-identical (`torch.equal`) to offline `load_encoder(same options).encode([same input])`
computed in this process. The rest: per-item failures, request limits, auth, overload, graceful shutdown,
the exact cache and the metrics.
"""

from __future__ import annotations

import base64
import io
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load as st_load

import bivit
from bivit.serve.client import Client, EncodeError, ServerError, parse_response
from support.server import ServerProcess, free_port
from support.media import make_video, png_bytes

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "test-key-123"
# 28x28 is one token; the rest spans 1..48 tokens, square and not, multiples of 28 and not.
SIZES = [(28, 28), (56, 28), (28, 56), (56, 56), (84, 56), (29, 29), (97, 61), (112, 84), (140, 140),
         (150, 200), (200, 150), (180, 120)]


@pytest.fixture(scope="module")
def enc32():
    return bivit.load_encoder(dtype="float32")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--dtype", "float32", "--max-body-mb", "1", "--max-wait-ms", "10",
                         "--max-batch-patches", "2048"], tmp_path_factory.mktemp("srv"), api_key=KEY, holdable=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url, api_key=KEY, timeout=60) as c:
        yield c


def _post_files(srv: ServerProcess, parts: list[tuple[str, bytes]], **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/encode", headers=srv.headers, timeout=60,
                      files=[("file", (name, data, "application/octet-stream")) for name, data in parts], **kw)


def _assert_serving(srv: ServerProcess, enc, seed: int) -> None:
    img = png_bytes(56, 84, seed)
    r = _post_files(srv, [("check.png", img)])
    assert r.status_code == 200, r.text
    assert torch.equal(st_load(r.content)["0"], enc.encode([img])[0])


def test_concurrent_clients_get_offline_bits(server, enc32):
    """32 threads, mixed sizes, 1-3 images per request: every tensor equals offline encode([img]) alone.

    The first round is queued whole while the batching worker is held, so the server certainly coalesces
    requests (else this would prove nothing about batching); the second runs as the requests come."""
    before = server.metrics()
    n_threads, rounds = 32, 2
    work = {(t, r): [png_bytes(*SIZES[(3 * t + 5 * r + k) % len(SIZES)], seed=10_000 + 100 * t + 10 * r + k)
                     for k in range(1 + (t + r) % 3)] for t in range(n_threads) for r in range(rounds)}
    got: dict = {}
    errors: list = []
    barrier = threading.Barrier(n_threads)

    def run(t: int) -> None:
        try:
            with Client(server.url, api_key=KEY, timeout=120) as c:
                barrier.wait()
                for r in range(rounds):
                    got[(t, r)] = c.encode(work[(t, r)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    with server.held():
        for th in threads:
            th.start()
        first_round = sum(len(work[(t, 0)]) for t in range(n_threads))
        server.wait_for_metric("bivit_queue_depth", lambda v: v == first_round)
    for th in threads:
        th.join(300)
    assert not errors, errors
    n_items = 0
    for key, images in work.items():
        assert len(got[key]) == len(images)
        for img, emb in zip(images, got[key]):
            ref = enc32.encode([img])[0]
            assert emb.dtype == torch.float32 and emb.shape == ref.shape
            assert torch.equal(emb, ref), key
            n_items += 1
    after = server.metrics()
    batches = after["bivit_batch_items_count"] - before.get("bivit_batch_items_count", 0)
    items = after["bivit_batch_items_sum"] - before.get("bivit_batch_items_sum", 0)
    assert items == n_items
    assert batches < items, (batches, items)


def test_control_without_batch_invariance(tmp_path):
    """Control: the same load against --no-batch-invariant gives answers that differ from encoding alone
    (so the test above can fail), and the cache is off because it would no longer be exact. The requests are
    queued while the worker is held, so they certainly share forward passes."""
    enc = bivit.load_encoder(dtype="float32", batch_invariant=False)
    with ServerProcess(["--dtype", "float32", "--no-batch-invariant", "--max-wait-ms", "20"], tmp_path,
                       holdable=True) as srv:
        work = [[png_bytes(*SIZES[(t + k) % len(SIZES)], seed=20_000 + 10 * t + k) for k in range(2)]
                for t in range(16)]
        got: dict = {}

        def run(t: int) -> None:
            with Client(srv.url, timeout=120) as c:
                got[t] = c.encode_results(work[t])

        threads = [threading.Thread(target=run, args=(t,)) for t in range(len(work))]
        with srv.held():
            for th in threads:
                th.start()
            srv.wait_for_metric("bivit_queue_depth", lambda v: v == sum(map(len, work)))
        for th in threads:
            th.join(120)
        differ = sum(not torch.equal(r.embedding, enc.encode([img])[0])
                     for t, imgs in enumerate(work) for img, r in zip(imgs, got[t]))
        assert differ > 0
        with Client(srv.url) as c:
            again = c.encode_results([work[0][0]])[0]
        assert not again.cached
        m = srv.metrics()
        assert m["bivit_cache_hits_total"] == 0 and m["bivit_cache_bytes"] == 0


def test_response_metadata_and_fingerprint(server, enc32):
    img = png_bytes(200, 150, seed=1)
    r = _post_files(server, [("a.png", img)])
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/vnd.bivit.safetensors"
    assert r.headers["x-request-id"]
    meta, [res] = parse_response(r.content)
    assert meta["fingerprint"] == enc32.fingerprint and meta["output_dtype"] == "float32" and meta["model"] == "demo"
    assert res.source == "a.png" and res.dtype == "float32" and res.fingerprint == enc32.fingerprint
    import hashlib

    assert res.sha256 == hashlib.sha256(img).hexdigest()
    assert res.tokens == 48 == bivit.image_token_count(200, 150)
    assert res.grid_thw == [[1, 12, 16]] and res.kind == "image" and res.error is None
    assert torch.equal(res.embedding, enc32.encode([img])[0])
    assert res.placeholders == [{"text": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
                                 "tokens": 48}]


def test_info_is_the_encoders_description(server, enc32):
    r = httpx.get(f"{server.url}/v1/info", headers=server.headers, timeout=10)
    assert r.status_code == 200
    info = r.json()
    # The same weights (fingerprint), dtypes, preprocessing and kernels; the fallbacks said are each process's.
    here = enc32.describe()
    assert info["kernels"].pop("fallbacks") is not None and here["kernels"].pop("fallbacks") is not None
    assert info == here
    meta, _ = parse_response(_post_files(server, [("a.png", png_bytes(28, 28, seed=40))]).content)
    assert meta == r.json()  # every answer names its encoder as /v1/info does


def test_serve_takes_the_projector_and_output_dtype(tmp_path):
    """The same encoder options as `bivit encode`: /v1/info reports them and the answers are in the output dtype."""
    enc = bivit.load_encoder(dtype="bfloat16", projector_dtype="float32", output_dtype="float16")
    img = png_bytes(56, 28, seed=41)
    with ServerProcess(["--projector-dtype", "float32", "--output-dtype", "float16", "--device", "cpu"],
                       tmp_path) as srv:
        info = httpx.get(f"{srv.url}/v1/info", timeout=10).json()
        assert (info["dtype"], info["projector_dtype"], info["output_dtype"]) == ("bfloat16", "float32", "float16")
        assert info["fingerprint"] == enc.fingerprint
        meta, [res] = parse_response(_post_files(srv, [("a.png", img)]).content)
    assert res.embedding.dtype == torch.float16 and torch.equal(res.embedding, enc.encode([img])[0])


def test_json_response_round_trips_exactly(server, enc32):
    imgs = [png_bytes(28, 28, seed=2), png_bytes(97, 61, seed=3)]
    r = _post_files(server, [("a.png", imgs[0]), ("b.png", imgs[1])], params={"format": "json"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["format"] == "bivit.embeddings/2"
    assert doc["encoder"]["output_dtype"] == "float32" and doc["encoder"]["fingerprint"] == enc32.fingerprint
    for img, item in zip(imgs, doc["items"]):
        emb = torch.tensor(item["embedding"], dtype=torch.float64).to(torch.float32)
        assert torch.equal(emb, enc32.encode([img])[0])
        assert item["tokens"] == emb.shape[0]


def test_json_request_body(server, enc32):
    img = png_bytes(56, 56, seed=4)
    body = {"items": [{"data": base64.b64encode(img).decode(), "name": "x.png"}, {"data": "!!not base64!!"}]}
    r = httpx.post(f"{server.url}/v1/encode", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200
    _, (good, bad) = parse_response(r.content)
    assert torch.equal(good.embedding, enc32.encode([img])[0]) and good.source == "x.png"
    assert bad.embedding is None and "base64" in bad.error


def test_client_input_kinds(client, enc32, tmp_path):
    rng = np.random.default_rng(5)
    arr = rng.integers(0, 256, (61, 97, 3), dtype=np.uint8)
    rgba = Image.fromarray(rng.integers(0, 256, (50, 70, 4), dtype=np.uint8), "RGBA")
    path = tmp_path / "p.jpg"
    Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(path, quality=90)
    raw = png_bytes(33, 45, seed=6)
    inputs = [str(path), raw, rgba, arr]
    out = client.encode(inputs)
    for src, emb in zip(inputs, out):
        assert torch.equal(emb, enc32.encode([src])[0])
    assert client.health() == {"status": "ok"}
    assert client.ready()["ready"] is True


def test_video_item_matches_offline(client, enc32, tmp_path):
    path = make_video(tmp_path / "clip.mp4", frames=12, fps=4, size=(84, 56))
    img = png_bytes(56, 56, seed=7)
    [vres, ires] = client.encode_results([path, img])
    ref = enc32.encode([str(path)])[0]
    assert vres.kind == "video" and vres.error is None
    assert torch.equal(vres.embedding, ref)
    chunks = enc32.encode_video(path)
    assert vres.timestamps == [c.timestamp for c in chunks]
    assert vres.grid_thw == [list(c.grid_thw) for c in chunks]
    assert vres.tokens == sum(c.token_count for c in chunks)
    assert vres.placeholders == [{"text": p.text, "tokens": p.tokens} for p in enc32.placeholders([path])[0]]
    assert torch.equal(ires.embedding, enc32.encode([img])[0])


def test_corrupt_item_fails_alone(server, client, enc32):
    corrupt = png_bytes(56, 56, seed=8)[:60]  # a truncated PNG
    r = _post_files(server, [("broken.png", corrupt)])
    assert r.status_code == 422
    err = r.json()
    assert err["error"]["kind"] == "media" and "broken.png" in err["error"]["message"]
    assert err["items"][0]["error"].startswith("broken.png")
    # Mixed: the neighbours (same request, so the same forward pass) still get their exact answers.
    good = [png_bytes(28, 28, seed=9), png_bytes(140, 140, seed=10)]
    r = _post_files(server, [("g0.png", good[0]), ("broken.png", corrupt), ("g1.png", good[1])])
    assert r.status_code == 200
    tensors = st_load(r.content)
    assert sorted(tensors) == ["0", "2"]
    assert torch.equal(tensors["0"], enc32.encode([good[0]])[0])
    assert torch.equal(tensors["2"], enc32.encode([good[1]])[0])
    with pytest.raises(EncodeError) as info:
        client.encode([good[0], b"not an image at all", good[1]])
    assert list(info.value.errors) == [1] and "not an image format bivit reads" in info.value.errors[1]
    assert info.value.results[1] is None and torch.equal(info.value.results[2], tensors["2"])
    _assert_serving(server, enc32, seed=11)


def test_request_level_errors(server, enc32):
    url = f"{server.url}/v1/encode"
    img = png_bytes(28, 28, seed=12)
    # Wrong content type.
    r = httpx.post(url, content=img, headers={**server.headers, "Content-Type": "image/png"}, timeout=30)
    assert r.status_code == 415 and r.json()["error"]["kind"] == "unsupported_media_type"
    _assert_serving(server, enc32, seed=13)
    # Oversized body (--max-body-mb 1), declared by Content-Length...
    big = png_bytes(28, 28, seed=14) + bytes(1_200_000)
    r = _post_files(server, [("big.png", big)])
    assert r.status_code == 413 and "max-body-mb" in r.json()["error"]["message"]
    _assert_serving(server, enc32, seed=15)

    # ... and chunked, where only counting while reading can catch it.
    def chunks():
        for _ in range(40):
            yield bytes(64 * 1024)

    r = httpx.post(url, content=chunks(), timeout=30,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 413
    _assert_serving(server, enc32, seed=16)
    # Malformed JSON, empty request.
    r = httpx.post(url, content=b"{", headers={**server.headers, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(url, json={"items": []}, headers=server.headers, timeout=30)
    assert r.status_code == 400
    _assert_serving(server, enc32, seed=17)


def test_unknown_route_and_wrong_method_answer_in_the_error_shape(server):
    """The router's own 404 and 405 are the service's {"error": {"kind", "message"}}, like every other error."""
    r = httpx.get(f"{server.url}/v1/nope", headers=server.headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["kind"] == "not_found"
    assert "/v1/nope" in r.json()["error"]["message"] and "POST /v1/encode" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/encode", headers=server.headers, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["kind"] == "method_not_allowed"
    assert r.json()["error"]["message"] == "GET is not allowed on /v1/encode" and "POST" in r.headers["allow"]


def test_auth(server, enc32):
    img = png_bytes(28, 28, seed=18)
    files = [("file", ("a.png", img))]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.url}/v1/encode", files=files, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        for path in ("/ready", "/metrics", "/v1/info"):
            assert httpx.get(f"{server.url}{path}", headers=headers, timeout=10).status_code == 401
    with Client(server.url, api_key="wrong") as c:
        with pytest.raises(ServerError) as info:
            c.encode([img])
        assert info.value.status == 401
        assert c.health()["status"] == "ok"
    _assert_serving(server, enc32, seed=19)


def test_cache_hit_is_exact_and_counted(server, enc32):
    img = png_bytes(150, 200, seed=20)
    first = _post_files(server, [("a.png", img)])
    before = server.metrics()
    second = _post_files(server, [("same-bytes-other-name.png", img)])
    after = server.metrics()
    (_, [r1]), (_, [r2]) = parse_response(first.content), parse_response(second.content)
    assert not r1.cached and r2.cached
    assert torch.equal(r1.embedding, r2.embedding) and torch.equal(r2.embedding, enc32.encode([img])[0])
    assert after["bivit_cache_hits_total"] == before["bivit_cache_hits_total"] + 1
    assert after["bivit_cache_misses_total"] == before["bivit_cache_misses_total"]
    assert after["bivit_cache_bytes"] > 0
    # The same bytes twice in one request: encoded once, answered twice.
    img2 = png_bytes(84, 56, seed=21)
    r = _post_files(server, [("x.png", img2), ("y.png", img2)])
    later = server.metrics()
    t = st_load(r.content)
    assert torch.equal(t["0"], t["1"]) and torch.equal(t["0"], enc32.encode([img2])[0])
    assert later["bivit_batch_items_sum"] == after["bivit_batch_items_sum"] + 1
    _, both = parse_response(_post_files(server, [("x.png", img2), ("y.png", img2)]).content)  # two hits
    assert [b.cached for b in both] == [True, True] and [b.source for b in both] == ["x.png", "y.png"]
    assert all(torch.equal(b.embedding, t["0"]) for b in both)


def test_metrics_series(server):
    m = server.metrics()
    for name in ("bivit_queue_depth", "bivit_inflight_items", "bivit_batch_items_count", "bivit_batch_patches_sum",
                 "bivit_request_latency_seconds_count", "bivit_tokens_total", "bivit_cache_hits_total",
                 "bivit_cache_misses_total"):
        assert name in m, name
    assert m["bivit_tokens_total"] > 0
    assert m['bivit_errors_total{kind="auth"}'] >= 1 and m['bivit_errors_total{kind="media"}'] >= 1
    assert m['bivit_errors_total{kind="too_large"}'] >= 2
    assert m['bivit_requests_total{route="/v1/encode",status="200"}'] >= 1
    # One JSON log line per request with id, items, status and latency.
    recs = [r for r in server.log_records() if r.get("msg") == "request"]
    assert recs and all({"id", "items", "status", "latency_ms"} <= set(r) for r in recs)
    assert {401, 413, 415, 422, 200} <= {r["status"] for r in recs}


def test_queue_full_answers_429_then_recovers(tmp_path, enc32):
    """One item in flight at most: while the first request's item is held in the queue, every other request is
    refused with 429; once it is answered, the server serves again."""
    with ServerProcess(["--dtype", "float32", "--max-queue", "1"], tmp_path, holdable=True) as srv:
        imgs = [png_bytes(56, 56, seed=100 + i) for i in range(10)]
        out: list = [None] * len(imgs)

        def run(i: int) -> None:
            out[i] = _post_files(srv, [(f"{i}.png", imgs[i])])

        first = threading.Thread(target=run, args=(0,))
        with srv.held():
            first.start()
            srv.wait_for_metric("bivit_inflight_items", lambda v: v == 1)
            others = [threading.Thread(target=run, args=(i,)) for i in range(1, len(imgs))]
            for th in others:
                th.start()
            for th in others:
                th.join(60)
        first.join(60)
        assert [r.status_code for r in out] == [200] + [429] * (len(imgs) - 1), [r.text[:200] for r in out]
        assert torch.equal(st_load(out[0].content)["0"], enc32.encode([imgs[0]])[0])
        for r in out[1:]:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["kind"] == "queue_full"
        _assert_serving(srv, enc32, seed=120)
        assert srv.metrics()['bivit_errors_total{kind="queue_full"}'] == len(imgs) - 1


def test_request_timeout_gives_504(tmp_path, enc32):
    with ServerProcess(["--dtype", "float32", "--max-wait-ms", "1500", "--request-timeout-s", "0.3"],
                       tmp_path) as srv:
        r = _post_files(srv, [("a.png", png_bytes(28, 28, seed=130))])
        assert r.status_code == 504 and r.json()["error"]["kind"] == "timeout"
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200


def _refuses_connections(srv: ServerProcess, timeout: float = 60.0) -> None:
    """Wait until the server has closed its listening socket (what uvicorn does first on SIGTERM)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", srv.port), timeout=10).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < deadline, "the server still accepts connections after SIGTERM"
        time.sleep(0.01)


def test_sigterm_finishes_accepted_requests(tmp_path):
    """SIGTERM with requests in flight: every accepted request still gets its complete, correct 200; a request
    after shutdown began is refused; the process then exits on its own. The requests are held in the queue
    when SIGTERM arrives, so they are certainly in flight then, on a fast machine or a busy one."""
    enc = bivit.load_encoder()  # bf16, the serve default: the other dtype path
    srv = ServerProcess(["--max-wait-ms", "150"], tmp_path, holdable=True)
    try:
        imgs = [png_bytes(*SIZES[i % len(SIZES)], seed=200 + i) for i in range(8)]
        out: list = [None] * len(imgs)

        def run(i: int) -> None:  # a fresh connection per request, as independent clients would do
            out[i] = _post_files(srv, [(f"{i}.png", imgs[i])])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(imgs))]
        with srv.held():
            for th in threads:
                th.start()
            srv.wait_for_metric("bivit_inflight_items", lambda v: v == len(imgs))
            srv.terminate()
            _refuses_connections(srv)
            with pytest.raises(httpx.ConnectError):
                _post_files(srv, [("late.png", png_bytes(56, 56, seed=300))])
        for th in threads:
            th.join(120)
        srv.proc.wait(60)  # it exits on its own after draining
        # uvicorn re-raises the captured SIGTERM once shut down cleanly, hence -15.
        assert srv.proc.returncode in (0, -15), srv.log_text()
        for i, r in enumerate(out):
            assert r.status_code == 200, (i, r.status_code, r.text)
            assert torch.equal(st_load(r.content)["0"], enc.encode([imgs[i]])[0]), i
        records = srv.log_records()
        assert any(r.get("msg") == "stopped" for r in records)
        # Nothing the server answered got lost on the way: its request log and the clients agree.
        served = [r for r in records if r.get("msg") == "request" and r.get("path") == "/v1/encode"]
        assert len(served) == len(imgs) and all(r["status"] == 200 for r in served)
    finally:
        srv.stop()


def test_cli_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bivit", "serve", "--model", str(tmp_path / "missing"),
                        "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: error:")]
    assert len(lines) == 1 and "missing" in lines[0]


def test_server_follows_the_models_preprocessing_and_alpha(tmp_path, k3_ckpt):
    from support.media import random_image

    rgba = np.dstack([random_image(40, 50, seed=8), random_image(40, 50, seed=9)[..., :1]])
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    data = buf.getvalue()
    enc = bivit.load_encoder(k3_ckpt, dtype="float32", alpha="white")
    with ServerProcess(["--model", str(k3_ckpt), "--dtype", "float32", "--alpha", "white"], tmp_path) as srv:
        r = _post_files(srv, [("t.png", data)])
        assert r.status_code == 200, r.text
        meta, [res] = parse_response(r.content)
        assert meta["fingerprint"] == enc.fingerprint
        assert torch.equal(res.embedding, enc.encode([data])[0])
        assert res.placeholders == [{"text": p.text, "tokens": p.tokens} for p in enc.placeholders([data])[0]]
        assert res.placeholders[0]["text"].startswith("<|media_begin|>image 50x40<|media_content|>")
        # The client keeps transparency for the server's alpha mode: a PIL RGBA image, as offline.
        pil = Image.fromarray(rgba, "RGBA")
        with Client(srv.url, timeout=60) as c:
            assert torch.equal(c.encode([pil])[0], enc.encode([pil])[0])


def test_a_cache_hit_writes_missing_encoder_cache_files_again(tmp_path):
    """With --ec-dir, a cache hit handed out ids whose files had been deleted since (vLLM then finds nothing
    under the id). A hit now writes whatever is missing; a file still there is left as it is."""
    ec = tmp_path / "ec"
    png = png_bytes(56, 56, 31)
    with ServerProcess(["--ec-dir", str(ec)], tmp_path) as srv, Client(srv.url) as c:
        first = c.encode_results([png])[0]
        (path,) = [ec / i / "encoder_cache.safetensors" for i in first.ec_ids]
        written = path.read_bytes()
        path.unlink()
        again = c.encode_results([png])[0]
        assert again.cached and again.ec_ids == first.ec_ids
        assert path.read_bytes() == written
