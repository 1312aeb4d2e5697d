"""The encoder service, tested as deployed: a real `bivit serve` process on loopback.

The central property: whatever else is in flight and however the server coalesces items into forward passes,
every answer is bit-identical (`torch.equal`) to offline `load_encoder(same options).encode([same input])`
computed in this process. The rest: per-item failures, request limits, auth, overload, graceful shutdown,
the exact cache and the metrics.
"""

from __future__ import annotations

import base64
import io
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
from bivit.client import Client, EncodeError, ServerError, parse_response
from support.server import ServerProcess, free_port, metric_values
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
                         "--max-batch-patches", "2048"], tmp_path_factory.mktemp("srv"), api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url, api_key=KEY, timeout=60) as c:
        yield c


def _metrics(srv: ServerProcess) -> dict[str, float]:
    r = httpx.get(f"{srv.url}/metrics", headers=srv.headers, timeout=10)
    assert r.status_code == 200
    return metric_values(r.text)


def _post_files(srv: ServerProcess, parts: list[tuple[str, bytes]], **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/encode", headers=srv.headers, timeout=60,
                      files=[("file", (name, data, "application/octet-stream")) for name, data in parts], **kw)


def _assert_serving(srv: ServerProcess, enc, seed: int) -> None:
    img = png_bytes(56, 84, seed)
    r = _post_files(srv, [("check.png", img)])
    assert r.status_code == 200, r.text
    assert torch.equal(st_load(r.content)["0"], enc.encode([img])[0])


def test_concurrent_clients_get_offline_bits(server, enc32):
    """32 threads, mixed sizes, 1-3 images per request: every tensor equals offline encode([img]) alone."""
    before = _metrics(server)
    n_threads, rounds = 32, 2
    work = {(t, r): [png_bytes(*SIZES[(3 * t + 5 * r + k) % len(SIZES)], seed=10_000 + 100 * t + 10 * r + k)
                     for k in range(1 + (t + r) % 3)] for t in range(n_threads) for r in range(rounds)}
    got: dict = {}
    errors: list = []
    barrier = threading.Barrier(n_threads)

    def run(t: int) -> None:
        try:
            with Client(server.url, api_key=KEY, timeout=60) as c:
                barrier.wait()
                for r in range(rounds):
                    got[(t, r)] = c.encode(work[(t, r)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    n_items = 0
    for key, images in work.items():
        assert len(got[key]) == len(images)
        for img, emb in zip(images, got[key]):
            ref = enc32.encode([img])[0]
            assert emb.dtype == torch.float32 and emb.shape == ref.shape
            assert torch.equal(emb, ref), key
            n_items += 1
    after = _metrics(server)
    batches = after["bivit_batch_items_count"] - before.get("bivit_batch_items_count", 0)
    items = after["bivit_batch_items_sum"] - before.get("bivit_batch_items_sum", 0)
    assert items == n_items
    # The server really coalesced concurrent requests (otherwise the test proves nothing about batching).
    assert batches < items, (batches, items)


def test_control_without_batch_invariance(tmp_path):
    """Control: the same load against --no-batch-invariant gives answers that differ from encoding alone
    (so the test above can fail), and the cache is off because it would no longer be exact."""
    enc = bivit.load_encoder(dtype="float32", batch_invariant=False)
    with ServerProcess(["--dtype", "float32", "--no-batch-invariant", "--max-wait-ms", "20"], tmp_path) as srv:
        work = [[png_bytes(*SIZES[(t + k) % len(SIZES)], seed=20_000 + 10 * t + k) for k in range(2)]
                for t in range(16)]
        got: dict = {}
        barrier = threading.Barrier(len(work))

        def run(t: int) -> None:
            with Client(srv.url, timeout=60) as c:
                barrier.wait()
                got[t] = c.encode_results(work[t])

        threads = [threading.Thread(target=run, args=(t,)) for t in range(len(work))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        differ = sum(not torch.equal(r.embedding, enc.encode([img])[0])
                     for t, imgs in enumerate(work) for img, r in zip(imgs, got[t]))
        assert differ > 0
        with Client(srv.url) as c:
            again = c.encode_results([work[0][0]])[0]
        assert not again.cached
        m = _metrics(srv)
        assert m["bivit_cache_hits_total"] == 0 and m["bivit_cache_bytes"] == 0


def test_response_metadata_and_fingerprint(server, enc32):
    img = png_bytes(200, 150, seed=1)
    r = _post_files(server, [("a.png", img)])
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/vnd.bivit.safetensors"
    assert r.headers["x-request-id"]
    meta, [res] = parse_response(r.content)
    assert meta["fingerprint"] == enc32.fingerprint and meta["dtype"] == "float32" and meta["model"] == "demo"
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
    assert info == enc32.describe()  # the same weights (fingerprint), dtypes, preprocessing and kernels
    meta, _ = parse_response(_post_files(server, [("a.png", png_bytes(28, 28, seed=40))]).content)
    assert (meta["model"], meta["fingerprint"], meta["dtype"]) == (info["model"], info["fingerprint"],
                                                                   info["output_dtype"])


def test_json_response_round_trips_exactly(server, enc32):
    imgs = [png_bytes(28, 28, seed=2), png_bytes(97, 61, seed=3)]
    r = _post_files(server, [("a.png", imgs[0]), ("b.png", imgs[1])], params={"format": "json"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["dtype"] == "float32" and doc["fingerprint"] == enc32.fingerprint
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
    assert torch.equal(good.embedding, enc32.encode([img])[0]) and good.name == "x.png"
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
    before = _metrics(server)
    second = _post_files(server, [("same-bytes-other-name.png", img)])
    after = _metrics(server)
    (_, [r1]), (_, [r2]) = parse_response(first.content), parse_response(second.content)
    assert not r1.cached and r2.cached
    assert torch.equal(r1.embedding, r2.embedding) and torch.equal(r2.embedding, enc32.encode([img])[0])
    assert after["bivit_cache_hits_total"] == before["bivit_cache_hits_total"] + 1
    assert after["bivit_cache_misses_total"] == before["bivit_cache_misses_total"]
    assert after["bivit_cache_bytes"] > 0
    # The same bytes twice in one request: encoded once, answered twice.
    img2 = png_bytes(84, 56, seed=21)
    r = _post_files(server, [("x.png", img2), ("y.png", img2)])
    later = _metrics(server)
    t = st_load(r.content)
    assert torch.equal(t["0"], t["1"]) and torch.equal(t["0"], enc32.encode([img2])[0])
    assert later["bivit_batch_items_sum"] == after["bivit_batch_items_sum"] + 1
    _, both = parse_response(_post_files(server, [("x.png", img2), ("y.png", img2)]).content)  # two hits
    assert [b.cached for b in both] == [True, True] and [b.name for b in both] == ["x.png", "y.png"]
    assert all(torch.equal(b.embedding, t["0"]) for b in both)


def test_metrics_series(server):
    m = _metrics(server)
    for name in ("bivit_queue_depth", "bivit_inflight_items", "bivit_batch_items_count", "bivit_batch_patches_sum",
                 "bivit_request_latency_seconds_count", "bivit_tokens_total", "bivit_cache_hits_total",
                 "bivit_cache_misses_total"):
        assert name in m, name
    assert m["bivit_tokens_total"] > 0
    assert m['bivit_errors_total{kind="auth"}'] >= 1 and m['bivit_errors_total{kind="media"}'] >= 1
    assert m['bivit_errors_total{kind="too_large"}'] >= 2
    assert m['bivit_requests_total{status="200"}'] >= 1
    # One JSON log line per request with id, items, status and latency.
    recs = [r for r in server.log_records() if r.get("msg") == "request"]
    assert recs and all({"id", "items", "status", "latency_ms"} <= set(r) for r in recs)
    assert {401, 413, 415, 422, 200} <= {r["status"] for r in recs}


def test_queue_full_answers_429_then_recovers(tmp_path, enc32):
    # One item in flight at most, and a long batching wait so the first request holds its slot.
    with ServerProcess(["--dtype", "float32", "--max-queue", "1", "--max-wait-ms", "400"], tmp_path) as srv:
        imgs = [png_bytes(56, 56, seed=100 + i) for i in range(10)]
        out: list = [None] * len(imgs)
        barrier = threading.Barrier(len(imgs))

        def run(i: int) -> None:
            barrier.wait()
            out[i] = _post_files(srv, [(f"{i}.png", imgs[i])])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(imgs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        statuses = [r.status_code for r in out]
        assert set(statuses) <= {200, 429}, statuses
        assert 429 in statuses and 200 in statuses
        for img, r in zip(imgs, out):
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["kind"] == "queue_full"
            else:
                assert torch.equal(st_load(r.content)["0"], enc32.encode([img])[0])
        _assert_serving(srv, enc32, seed=120)
        assert _metrics(srv)['bivit_errors_total{kind="queue_full"}'] == statuses.count(429)


def test_request_timeout_gives_504(tmp_path, enc32):
    with ServerProcess(["--dtype", "float32", "--max-wait-ms", "1500", "--request-timeout-s", "0.3"],
                       tmp_path) as srv:
        r = _post_files(srv, [("a.png", png_bytes(28, 28, seed=130))])
        assert r.status_code == 504 and r.json()["error"]["kind"] == "timeout"
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200


def test_sigterm_finishes_accepted_requests(tmp_path):
    """SIGTERM mid-load: every request is a complete correct 200 or was never accepted (refused)."""
    enc = bivit.load_encoder()  # bf16, the serve default: the other dtype path
    srv = ServerProcess(["--max-wait-ms", "150"], tmp_path)
    try:
        n_threads, per_thread = 8, 6
        imgs = [png_bytes(*SIZES[i % len(SIZES)], seed=200 + i) for i in range(n_threads * per_thread)]
        outcome: list = [None] * len(imgs)
        done = threading.Semaphore(0)

        def run(t: int) -> None:
            for i in range(t, len(imgs), n_threads):
                t0 = time.monotonic()
                try:  # a fresh connection per request, as independent clients would do
                    r = _post_files(srv, [(f"{i}.png", imgs[i])])
                    outcome[i] = ("response", r, t0, time.monotonic())
                except httpx.ConnectError:
                    outcome[i] = ("refused", None, t0, time.monotonic())
                except httpx.TransportError as e:
                    outcome[i] = ("dropped", e, t0, time.monotonic())
                done.release()

        threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for _ in range(n_threads + 2):  # let the first wave complete, so the server is mid-load
            done.acquire(timeout=30)
        t_term = time.monotonic()
        srv.terminate()
        for th in threads:
            th.join(60)
        srv.proc.wait(30)  # it exits on its own after draining
        # uvicorn re-raises the captured SIGTERM once shut down cleanly, hence -15.
        assert srv.proc.returncode in (0, -15), srv.log_text()
        records = srv.log_records()
        assert any(r.get("msg") == "stopped" for r in records)

        responses = [o for o in outcome if o[0] == "response"]
        for i, o in enumerate(outcome):
            if o[0] == "response":
                assert o[1].status_code == 200, (i, o[1].status_code, o[1].text)
                assert torch.equal(st_load(o[1].content)["0"], enc.encode([imgs[i]])[0]), i
            elif o[0] == "dropped":
                # Only a connection the server closed before reading a request (never accepted), not a
                # truncated answer.
                assert "without sending a response" in str(o[1]) or "reset" in str(o[1]).lower(), repr(o[1])
                assert o[2] >= t_term - 0.5
        straddling = [o for o in responses if o[2] < t_term < o[3]]
        assert straddling, "no request was in flight when SIGTERM arrived"
        assert any(o[0] != "response" for o in outcome), "shutdown began after the last request"
        # Nothing the server answered got lost on the way: its request log and the clients agree.
        served = [r for r in records if r.get("msg") == "request" and r.get("path") == "/v1/encode"]
        assert len(served) == len(responses) and all(r["status"] == 200 for r in served)
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
