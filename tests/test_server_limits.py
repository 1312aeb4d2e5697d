"""The service against hostile and careless clients, as deployed: a real `bivit serve` process on loopback.

Every limit is in bytes or seconds and set small here so each pattern is reproduced in a few seconds: slow
headers and bodies on raw sockets, amplification (many copies of one tiny image that decodes large, many
distinct ones), work that outlives its request, malformed JSON, and nonsense options. After each, a normal
request must still succeed and the server's memory must not have grown past the documented bound.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from PIL import Image

import bivit

from support.server import ServerProcess, free_port
from support.media import png_bytes, tiny_video

pytest.importorskip("fastapi")

LIMITS = ["--header-timeout-s", "2", "--body-timeout-s", "2",
          "--max-request-pixels-mb", "12", "--max-queue-pixels-mb", "12", "--max-response-mb", "8",
          "--cache-mb", "0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(LIMITS, tmp_path_factory.mktemp("limits"), holdable=True)
    yield srv
    srv.stop()


def rss_mb(srv: ServerProcess) -> float:
    with open(f"/proc/{srv.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def normal_request_succeeds(srv: ServerProcess, seed: int = 0) -> None:
    r = httpx.post(f"{srv.url}/v1/encode", files=[("file", ("ok.png", png_bytes(56, 56, seed), "image/png"))],
                   timeout=30)
    assert r.status_code == 200, r.text


def json_items(*items: tuple[str, bytes]) -> dict:
    return {"items": [{"name": n, "data": base64.b64encode(d).decode()} for n, d in items]}


def test_nonsense_options_are_refused_at_start():
    """Each refused in one line before the model loads; `--port 70000` loaded the model, then a traceback;
    `--max-wait-ms 1e300` killed the batching thread (every request then 504); `--max-body-mb 1e-9` (0 bytes) was
    taken."""
    for option, value in [("--max-body-mb", "nan"), ("--max-body-mb", "-1"), ("--request-timeout-s", "0"),
                          ("--request-timeout-s", "inf"), ("--cache-mb", "-5"), ("--max-queue-pixels-mb", "0"),
                          ("--port", "70000"), ("--max-wait-ms", "1e300"), ("--max-body-mb", "1e-9"),
                          ("--write-timeout-s", "0"), ("--max-answers-mb", "nan"), ("--max-weights-mb", "1e300"),
                          ("--max-queue", "0"), ("--host", "192.0.2.1")]:  # an address not on this machine
        r = subprocess.run([sys.executable, "-m", "bivit", "serve", "--port", str(free_port()), option, value],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (option, value, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("bivit: error: ")]
        assert len(lines) == 1 and option in lines[0], r.stderr


def test_slow_headers_are_cut_off(server):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\n")
        closed = False
        while time.monotonic() - t0 < 8:
            try:
                s.sendall(b"X")  # one byte of a header line every 0.25 s, never finished
                time.sleep(0.25)
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                continue
            except OSError:  # reset by the server
                closed = True
                break
    assert closed and time.monotonic() - t0 < 5  # --header-timeout-s 2
    normal_request_succeeds(server)


def test_slow_body_gets_408(server):
    body = json.dumps(json_items(("a.png", png_bytes(28, 28, 1)))).encode()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        answer = b""
        for byte in body:  # one byte every 0.1 s: the whole body would take minutes
            s.sendall(bytes([byte]))
            time.sleep(0.1)
            try:
                answer += s.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            except OSError:
                break
            if answer or time.monotonic() - t0 > 8:
                break
        s.settimeout(5)
        closed = False
        try:
            while chunk := s.recv(65536):
                answer += chunk
            closed = True
        except OSError:
            closed = True  # reset
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert closed and time.monotonic() - t0 < 5  # --body-timeout-s 2, and the connection is not kept
    normal_request_succeeds(server)


def one_bit_png(size: int, seed: int = 0) -> bytes:
    """A few hundred bytes that decode to size x size RGB (38 MB of float32 patches at 1792)."""
    img = Image.new("1", (size, size))
    img.putpixel((seed % size, 0), 1)  # distinct bytes per seed
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("pattern,kind,flag", [
    # ~0.15 MB of JSON asking for ~250 MB of answer: identical copies are encoded once but each is answered.
    ("copies", "response_too_large", "--max-response-mb"),
    # 48 distinct tiny PNGs, 2.4 MB of float32 patches each once decoded: refused from their headers.
    ("distinct", "too_large", "--max-request-pixels-mb"),
])
def test_amplification_is_refused_before_decoding(server, pattern, kind, flag):
    images = [one_bit_png(1792)] * 250 if pattern == "copies" else [one_bit_png(448, i) for i in range(48)]
    before = rss_mb(server)
    r = httpx.post(f"{server.url}/v1/encode", json=json_items(*[(f"{i}.png", d) for i, d in enumerate(images)]),
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["kind"] == kind, r.text[:300]
    assert flag in r.json()["error"]["message"]
    assert rss_mb(server) - before < 100
    normal_request_succeeds(server, len(images))


def test_pixels_in_the_queue_are_budgeted_across_requests(server):
    """One admitted 896x896 image holds 9.2 MB of pixels; a second one must wait (429) under a 12 MB budget.

    The batching worker is held, so the first request is still in flight when the second arrives, however fast
    or slow this machine is."""
    first: dict = {}

    def send_first() -> None:
        first["r"] = httpx.post(f"{server.url}/v1/encode", files=[("file", ("big.png", png_bytes(896, 896, 3)))],
                                timeout=120)

    t = threading.Thread(target=send_first)
    with server.held():
        t.start()
        held = server.wait_for_metric("bivit_pixel_bytes", lambda v: v > 0)
        assert held == 896 * 896 * 3 * 4  # its preprocessed float32 pixels, counted from the PNG header
        r = httpx.post(f"{server.url}/v1/encode", files=[("file", ("big2.png", png_bytes(896, 896, 4)))],
                       timeout=60)
    t.join(120)
    assert first["r"].status_code == 200, first["r"].text[:300]
    assert r.status_code == 429 and "Retry-After" in r.headers, r.text[:300]
    assert "--max-queue-pixels-mb" in r.json()["error"]["message"]
    assert server.metrics()["bivit_pixel_bytes"] == 0  # released with the answer
    normal_request_succeeds(server, 3)


def huge_canvas_gif(frames: int) -> bytes:
    """A 6 KB GIF whose 6000x5500 canvas every decoder composes for each of its frames (1x1 pixel each)."""
    out = bytearray(b"GIF89a" + struct.pack("<HH", 6000, 5500) + bytes([0x00, 0, 0]))
    for i in range(frames):
        out += b"\x21\xf9\x04\x04" + struct.pack("<H", 10) + b"\x00\x00"  # graphic control: 0.1 s
        out += b"\x2c" + struct.pack("<HHHH", i % 2, 0, 1, 1) + bytes([0x80, i % 256, 0, 0, 255, 255, 255])
        out += b"\x02\x02\x44\x01\x00"  # one pixel, LZW-coded
    return bytes(out + b"\x3b")


def test_after_a_timeout_the_next_request_succeeds(tmp_path):
    # Its own server: a request timeout this short would also cut off ordinary requests on a busy machine.
    with ServerProcess([*LIMITS, "--request-timeout-s", "3"], tmp_path) as srv:
        files = [("file", ("a.gif", huge_canvas_gif(200))), ("file", ("b.gif", huge_canvas_gif(201)))]
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/encode", files=files, timeout=60)
        assert r.status_code == 504, r.text[:300]
        assert time.monotonic() - t0 < 6
        t1 = time.monotonic()
        normal_request_succeeds(srv, 5)  # decoding the GIFs stopped at the deadline: nothing queued ahead
        assert time.monotonic() - t1 < 3
        assert httpx.get(f"{srv.url}/ready", timeout=10).json()["ready"]


def test_json_edge_cases(server):
    png = png_bytes(28, 28, 6)
    body = {"items": [{"name": "wrapped.png", "data": base64.encodebytes(png).decode()}]}  # 76-column lines
    assert "\n" in body["items"][0]["data"]
    r = httpx.post(f"{server.url}/v1/encode", json=body, timeout=30)
    assert r.status_code == 200, r.text[:300]
    item = '{"name": "x.png", "data": "%s"}' % base64.b64encode(png).decode()
    r = httpx.post(f"{server.url}/v1/encode", content='{"items": [%s], "items": []}' % item,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "'items' appears more than once" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/encode", json=json_items(("first.png", b"junk"), ("second.png", b"junk")),
                   timeout=30)
    assert r.status_code == 422
    errors = [m["error"] for m in r.json()["items"]]
    assert errors[0].startswith("first.png: ") and errors[1].startswith("second.png: ") and "first" not in errors[1]


def test_request_id_is_echoed_only_when_plain(server):
    ok = "req-42.a:b"
    r = httpx.get(f"{server.url}/health", headers={"X-Request-ID": ok}, timeout=10)
    assert r.headers["X-Request-ID"] == ok
    for bad in ("x" * 8000, "two words", "tab\there", "caf\u00e9"):
        r = httpx.get(f"{server.url}/health", headers={"X-Request-ID": bad.encode("latin-1")}, timeout=10)
        rid = r.headers["X-Request-ID"]
        assert rid != bad and len(rid) == 32 and rid.isalnum()


def test_video_decoding_work_is_bounded_before_decoding(tmp_path):
    """200 frames of a 6000x5500 canvas are 6.6 G pixels to decode: refused from the header, before decoding (the
    request's videos are charged against --max-video-mpixels before any is decoded: 413)."""
    with ServerProcess(["--max-video-mpixels", "1000", "--cache-mb", "0"], tmp_path) as srv:
        r = httpx.post(f"{srv.url}/v1/encode", files=[("file", ("a.gif", huge_canvas_gif(200)))], timeout=60)
        assert r.status_code == 413 and r.json()["error"]["kind"] == "too_large", r.text[:300]
        assert "6600 M frame pixels" in r.json()["error"]["message"]  # all 200 frames, from the container
        normal_request_succeeds(srv)


def test_copies_of_a_failing_item_are_counted(server):
    """`{"items": [{"data": ""}] * 300000}` (4 MB) got a 90 MB 422 answer built on the event loop (/health blocked
    4.9 s): copies share one hash (one item against --max-queue), failed items have no tokens (not counted by
    --max-response-mb). Now every item counts against --max-queue (256), copies and failed ones included, and the
    JSON parse stops there; every record counts against --max-response-mb (8 MB here)."""
    before = rss_mb(server)
    body = b'{"items": [' + b",".join([b'{"data": ""}'] * 300_000) + b"]}"
    r = httpx.post(f"{server.url}/v1/encode", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["kind"] == "too_many_items", r.text[:300]
    assert len(r.content) < 1000 and "--max-queue 256" in r.json()["error"]["message"]
    for bad in ("!", ""):  # invalid base64 and an empty item: both failed items with a record to answer
        r = httpx.post(f"{server.url}/v1/encode", json={"items": [{"data": bad}] * 257}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["kind"] == "too_many_items", r.text[:300]
    r = httpx.post(f"{server.url}/v1/encode", files=[("file", ("e.png", b"", "image/png"))] * 257, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["kind"] == "too_many_items", r.text[:300]
    # Numbers are in no item, and each is a 24-32 byte object from 2 bytes of JSON: counted before parsing.
    body = b'{"items": [' + b",".join([b"0.5"] * 1_000_000) + b"]}"
    r = httpx.post(f"{server.url}/v1/encode", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "more than 2112 JSON elements" in r.json()["error"]["message"], r.text[:300]
    # 100 failing items named with 40 KB each: a 4 MB body, a 12 MB answer (each name in the record, its error
    # and the message). A name is now at most 4096 bytes: each of these items is refused for its name, its record
    # holding the name's start and length; the answer stays small.
    name = "n" * 40_000
    r = httpx.post(f"{server.url}/v1/encode", json={"items": [{"data": "!", "name": name}] * 100}, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["kind"] == "bad_item", r.text[:300]
    assert len(r.content) < 100_000 and r.json()["items"][0]["source"].endswith("... (40000 bytes)")
    # Within the limits, every failed item is answered with its record, and the message stays one line.
    r = httpx.post(f"{server.url}/v1/encode", json={"items": [{"data": "!"}] * 256}, timeout=60)
    assert r.status_code == 422 and len(r.json()["items"]) == 256, r.text[:300]
    assert r.json()["error"]["message"].endswith("; and 253 more")
    assert rss_mb(server) - before < 100
    normal_request_succeeds(server, 7)


def test_a_client_that_hangs_up_stops_costing(server):
    """A client that hung up still cost all its CPU (and was logged 200). Its request is now cancelled: what is
    queued is dropped. Shown without timing: the batching worker is held, so the item waits in its queue; the
    client closes its socket; the item leaves the queue with no forward pass (still held), logged as 499."""
    body = json.dumps(json_items(("gone.png", png_bytes(56, 56, 11)))).encode()
    request = (f"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nX-Request-ID: hung-up-client\r\n\r\n").encode() + body
    with server.held():
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(request)
            server.wait_for_metric("bivit_queue_depth", lambda v: v == 1)
        server.wait_for_metric("bivit_inflight_items", lambda v: v == 0)  # answered while no pass can run
        tokens = server.metrics()["bivit_tokens_total"]
    deadline = time.monotonic() + 60
    while not (logged := [r for r in server.log_records() if r.get("id") == "hung-up-client"]):
        assert time.monotonic() < deadline, server.log_text()[-2000:]
        time.sleep(0.05)
    assert logged[0]["status"] == 499, logged
    # Its queued item was skipped: the next request's item (ahead of none) is the only one encoded since.
    normal_request_succeeds(server, 12)
    assert server.metrics()["bivit_tokens_total"] - tokens == 4  # 56x56: one 4x4 grid of patches, merged 2x2


def test_bodies_in_flight_are_bounded(tmp_path):
    """Uploads that send 63 of 64 MB and stall held +0.5 / +1.3 / +2.3 GB at 4 / 16 / 32 of them: every body was
    its own limit, none counted what the others held. Encode bodies now count against 4 x --max-body-mb over
    all requests as they arrive: 503 beyond. Shown with --max-body-mb 1 (4 MiB for all bodies): four uploads
    send 1,000,000 of their 1 MiB and stall; a fifth one's bytes do not fit: 503, at once. Once the four hang
    up, their bytes are released and a request goes through."""
    with ServerProcess(["--max-body-mb", "1", "--body-timeout-s", "60", "--cache-mb", "0"], tmp_path) as srv:
        def stalled(n: int) -> socket.socket:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1048576\r\n\r\n" + b" " * n)
            return s

        held = [stalled(1_000_000) for _ in range(4)]
        try:
            srv.wait_for_metric("bivit_body_bytes", lambda v: v == 4_000_000)
            with stalled(300_000) as fifth:
                answer = fifth.makefile("rb").readline()
            assert answer.startswith(b"HTTP/1.1 503"), answer
        finally:
            for s in held:
                s.close()
        srv.wait_for_metric("bivit_body_bytes", lambda v: v == 0)
        normal_request_succeeds(srv, 13)


def _server_with_descriptors(tmp_path, limit: int) -> ServerProcess:
    """A server started with at most `limit` file descriptors (RLIMIT_NOFILE, which the process inherits), slow
    header senders kept (`--header-timeout-s 600`), no cache."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        return ServerProcess(["--header-timeout-s", "600", "--cache-mb", "0"], tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_are_bounded_and_slow_ones_make_room(tmp_path):
    """Nothing limited connections: with `ulimit -n 1024`, 1100 slow connections made asyncio log a traceback per
    failed accept (167 MB of log in 40 s) and probes answer 8 s late. The service keeps at most half its file
    descriptors as connections; past that the connection sending its headers longest is closed. Shown with a
    limit of 256 descriptors (128 connections): 300 connections that send nothing, then /health."""
    srv = _server_with_descriptors(tmp_path, 256)
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=60))
        r = httpx.get(f"{srv.url}/health", timeout=20)  # a bound on a hang: it is answered at once
        assert r.status_code == 200, r.text
        idle[0].settimeout(20)
        assert idle[0].recv(1) == b""  # the oldest silent connection was closed to make room
        assert "out of system resource" not in srv.log_text()
        normal_request_succeeds(srv, 14)
    finally:
        for s in idle:
            s.close()
        srv.stop()


def test_connections_queued_while_the_server_stalls_take_no_descriptor_it_lacks(tmp_path):
    """asyncio accepts up to `backlog` connections per wake-up before any reaches the protocol that closes the
    oldest; with uvicorn's backlog of 2048, connections that queued while the server was busy were all accepted
    at once, past the descriptor limit: at 256 descriptors, 300 connections made while the server was stopped
    (SIGSTOP: a stall made certain, not hoped for) gave 1801 "socket.accept() out of system resource"
    tracebacks (a loaded CI machine failed the test above this way). The backlog is now an eighth of the
    connection limit."""
    import os
    import signal

    srv = _server_with_descriptors(tmp_path, 256)
    idle = []
    try:
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(300):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", srv.port))  # completed by the kernel into the listen queue, or retried
                idle.append(s)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        r = httpx.get(f"{srv.url}/health", timeout=30)  # queued behind the burst: answered once it is taken in
        assert r.status_code == 200, r.text
        assert "out of system resource" not in srv.log_text()
    finally:
        for s in idle:
            s.close()
        srv.stop()


# ----------------------------------------------------------------------------- every body, answer and name bounded
#
# Figures from `python benchmarks/hostile_round5.py` (full size) are in docs/limits.md; these tests show each class
# at small sizes on a server whose limits are set small. Each prints what it measured (pytest -s).

SMALL = ["--max-body-mb", "4", "--max-queue", "64", "--max-response-mb", "20", "--max-answers-mb", "40",
         "--write-timeout-s", "2", "--header-timeout-s", "5", "--cache-mb", "0"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    srv = ServerProcess(SMALL, tmp_path_factory.mktemp("small"), holdable=True)
    yield srv
    srv.stop()


def measured(srv: ServerProcess, label: str, fn):
    """`fn()`, printing the server's peak RSS growth and the slowest /health answer meanwhile -> (fn's value, peak
    growth in MB)."""
    from support.server import HealthProbe, peak_mb, reset_peak

    base = rss_mb(srv)
    reset_peak(srv.proc.pid)
    probe = HealthProbe(srv.url)
    t0 = time.monotonic()
    try:
        out = fn()
    finally:
        probe.stop()
    grew = peak_mb(srv.proc.pid) - base
    print(f"\n{label}: peak RSS +{grew:.0f} MB, {probe.worst()}, wall {time.monotonic() - t0:.1f} s")
    return out, grew


JSON_UNITS = {"arrays": b"[],", "objects": b"{},", "strings": b'"ab",', "numbers": b"1,", "literals": b"null,",
              "nested": b"[[[[]]]],"}


@pytest.mark.parametrize("kind", list(JSON_UNITS))
def test_json_bombs_of_every_element_kind_are_refused_before_parsing(small, kind):
    """60 MB of `[],` took +1.45 GB and held the interpreter lock 14.9 s (/health stalled 13.5 s); `"ab",` +0.9 GB:
    the limit counted objects and numbers only. Every element is now counted before parsing, in chunks (a
    request body: 8 per item the request may hold), so nothing is built. Here 4 MB bodies, 1.3 M elements each
    (about 110 MB of Python objects if parsed)."""
    unit = JSON_UNITS[kind]
    body = b'{"items": [' + unit * (4_000_000 // len(unit)) + b"[]]}"

    def send() -> httpx.Response:
        return httpx.post(f"{small.url}/v1/encode", content=body, headers={"Content-Type": "application/json"},
                          timeout=60)
    r, grew = measured(small, f"json bomb of {kind} ({len(body)} B)", send)
    assert r.status_code == 413 and r.json()["error"]["kind"] == "too_many_items", r.text[:300]
    assert "JSON elements" in r.json()["error"]["message"]
    assert grew < 40, grew  # the body and one scanned chunk, nothing parsed
    normal_request_succeeds(small, 21)


def test_three_json_bombs_at_once(small):
    """Three 60 MB bombs at once took 2.65 GB and stalled /health 11 s; here three 4 MB ones."""
    body = b'{"items": [' + b"[]," * 1_300_000 + b"[]]}"
    out: list = []

    def three() -> None:
        def send() -> None:
            out.append(httpx.post(f"{small.url}/v1/encode", content=body,
                                  headers={"Content-Type": "application/json"}, timeout=60))
        threads = [threading.Thread(target=send) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _, grew = measured(small, "three json bombs at once", three)
    assert [r.status_code for r in out] == [413] * 3
    assert grew < 60, grew
    normal_request_succeeds(small, 22)


def _stuck_reader(port: int, body: bytes) -> socket.socket:
    """A client that sends an encode request and never reads its answer."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


@pytest.mark.parametrize("readers", [4, 8])
def test_answers_in_flight_are_bounded_and_readers_that_stop_are_cut_off(small, readers):
    """4 clients asking for ~210 MB answers and reading nothing took a server from 280 MB to 2.9 GB, for good (8:
    3.5 GB and climbing). Answers being computed or written now count against --max-answers-mb (40 MB here): two
    16 MB answers (64 copies of an 896x896 image) fit, every other request is answered 503 + Retry-After at once;
    an answer is sent in pieces
    (no copies of it pile up), and a client that reads nothing of it for --write-timeout-s (2 s) is cut off,
    releasing it. Shown without timing: the batching worker is held until the two answers are admitted and the
    others refused; then the metrics show the two released (the write timeout) and a request goes through."""
    body = json.dumps(json_items(*[(f"{i}.png", one_bit_png(896)) for i in range(64)])).encode()  # 64 x 256 KB
    normal = httpx.post(f"{small.url}/v1/encode", files=[("file", ("w.png", one_bit_png(896), "image/png"))],
                        timeout=60)
    assert normal.status_code == 200  # the same image once: what a forward pass of its size takes is allocated
    busy = small.metrics().get('bivit_errors_total{kind="busy"}', 0)

    def run() -> list:
        with small.held():
            socks = [_stuck_reader(small.port, body) for _ in range(readers)]
            small.wait_for_metric('bivit_errors_total{kind="busy"}', lambda v: v == busy + readers - 2)
            assert small.metrics()["bivit_answer_bytes"] > 32 * 2**20  # two answers of 64 x 1024 bf16 rows
        small.wait_for_metric("bivit_answer_bytes", lambda v: v == 0)  # written or cut off
        return socks
    socks, grew = measured(small, f"{readers} readers that read nothing", run)
    refused = 0
    for s in socks:
        s.settimeout(5)
        refused += s.recv(12).startswith(b"HTTP/1.1 503")
        s.close()
    assert refused == readers - 2
    # Two answers' embeddings (each 64 copies of one item's 256 KB of rows, made into the file as it is sent), their
    # pixels and one forward pass; what the others asked for is never computed. Before, each answer was held
    # whole, with 63 clones of its rows while it was made, and twice more while written: ~64 MB each.
    assert grew < 100, grew
    assert any("read nothing of its answer" in rec.get("msg", "") for rec in small.log_records())
    normal_request_succeeds(small, 23)


def test_json_answers_are_streamed(small):
    """A 145 MB `?format=json` answer was one json.dumps call: 12 s under the interpreter lock (/health stalled
    5.2 s), +1.06 GB. It is now made a row at a time as it is sent (no Content-Length); the values are the
    safetensors answer's, exactly."""
    from bivit.serve.client import parse_response

    files = [("file", ("a.png", one_bit_png(896, 3), "image/png"))] * 4
    r, _ = measured(small, "a 4-copy JSON answer", lambda: httpx.post(f"{small.url}/v1/encode?format=json",
                                                                        files=files, timeout=60))
    assert r.status_code == 200 and "content-length" not in r.headers, r.headers
    ref = parse_response(httpx.post(f"{small.url}/v1/encode", files=files, timeout=60).content)[1]
    for rec, want in zip(r.json()["items"], ref):
        assert rec["tensor_sha256"] == want.tensor_sha256
        assert torch.equal(torch.tensor(rec["embedding"]).to(want.embedding.dtype), want.embedding)


def test_content_length_with_transfer_encoding_closes_the_connection(small):
    """A request with both headers got its 400, and the request smuggled behind it on the same connection was
    answered (RFC 9112 section 6.1: close it). Now the connection is closed after the 400."""
    with socket.create_connection(("127.0.0.1", small.port), timeout=10) as s:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):  # the server closes the connection: recv returns b""
            data += chunk
    assert data.startswith(b"HTTP/1.1 400") and data.count(b"HTTP/1.1 ") == 1, data


def test_names_of_any_characters_reach_the_records(small):
    """A JSON item named with a lone surrogate was a 500 with a traceback, the request's other item lost; a 60 MB
    name made a 60 MB log line per request. Names are stored escaped where they are not text, refused per item
    when longer than 4096 bytes (their record holds the start and the length), and log lines are cut; the
    other items are encoded. A multipart part named only by RFC 5987's `filename*=` was a misleading 400."""
    png = base64.b64encode(png_bytes(56, 56, 24)).decode()
    names = ["\ud800.png", "nul\x00.png", "new\nline.png", "\u202egnp.exe", "back\\slash.png", "n" * 100_000]
    body = json.dumps({"items": [{"name": n, "data": png if i < 5 else "!"} for i, n in enumerate(names)]})
    r = httpx.post(f"{small.url}/v1/encode", content=body.encode(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text[:300]
    from bivit.serve.client import parse_response
    from bivit.media.names import unescape

    recs = parse_response(r.content)[1]
    assert [rec.source for rec in recs[:5]] == ["\\ud800.png", "nul\x00.png", "new\nline.png", "\u202egnp.exe",
                                                "back\\\\slash.png"]
    assert [unescape(rec.source) for rec in recs[:5]] == names[:5] and all(rec.ok for rec in recs[:5])
    assert recs[5].error_kind == "bad_item" and "100000 bytes" in recs[5].source and len(recs[5].error) < 300
    assert max(len(line) for line in small.log_text().splitlines()) < 5000
    part = (b'--B\r\nContent-Disposition: form-data; name="file"; filename*=UTF-8\'\'na%C3%AFve.png\r\n'
            b"Content-Type: image/png\r\n\r\n" + png_bytes(56, 56, 25) + b"\r\n--B--\r\n")
    r = httpx.post(f"{small.url}/v1/encode", content=part,
                   headers={"Content-Type": "multipart/form-data; boundary=B"}, timeout=60)
    assert r.status_code == 200 and parse_response(r.content)[1][0].source == "na\u00efve.png", r.text[:300]


def test_a_weights_body_is_streamed_and_bounded(tmp_path):
    """An 800 MiB `/v1/weights` body was held whole, outside the body budget: +2.4 GB, not given back, and the
    default limit (8192 MiB) meant ~24 GB for one request. The body now goes to a temporary file (memory: one
    chunk), tensors are read from it one at a time, one body at a time (a second is 503); the default limit is
    the served model's weights + 16 MiB (a larger body cannot be a valid update)."""
    from safetensors.torch import save

    with ServerProcess(["--cache-mb", "0", "--body-timeout-s", "60"], tmp_path, api_key="k") as srv:
        post = {"headers": {**srv.headers, "Content-Type": "application/octet-stream"}, "timeout": 120}
        junk = save({"junk": torch.zeros(4 * 2**20, dtype=torch.float32)})  # 16 MiB: under the default limit
        r, grew = measured(srv, f"a {len(junk) >> 20} MiB weights body",
                           lambda: httpx.post(f"{srv.url}/v1/weights", content=junk, **post))
        assert r.status_code == 422 and "missing tensor" in r.json()["error"]["message"], r.text[:300]
        assert grew < 8, grew  # held as it was: +48 MB
        big = save({"junk": torch.zeros(16 * 2**20, dtype=torch.float32)})
        r = httpx.post(f"{srv.url}/v1/weights", content=big, **post)
        assert r.status_code == 413 and "--max-weights-mb" in r.json()["error"]["message"], r.text[:300]
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as first:  # sends half, then stalls
            first.sendall(b"POST /v1/weights HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: "
                          b"application/octet-stream\r\nContent-Length: %d\r\n\r\n" % len(junk) + junk[:len(junk) // 2])
            deadline = time.monotonic() + 60
            while (r := httpx.post(f"{srv.url}/v1/weights", content=junk, **post)).status_code != 503:
                assert r.status_code == 422 and time.monotonic() < deadline  # the first not yet being read
            assert r.json()["error"]["kind"] == "busy" and "Retry-After" in r.headers
        trained = bivit.load_model(None, dtype="bfloat16").state_dict()  # the demo model's own weights: accepted
        r = httpx.post(f"{srv.url}/v1/weights", content=save({k: v.contiguous() for k, v in trained.items()}),
                       **post)
        assert r.status_code == 200, r.text[:300]


def test_a_planted_encoder_cache_file_is_replaced(tmp_path):
    """A zero tensor of the right shape planted at the id the next answer names (ids are predictable) was
    answered 200 with that id, the file left zeros: vLLM would read zeros as the image. A file at an id is now
    reused only when it holds exactly the rows; otherwise it is replaced atomically."""
    from safetensors.torch import load_file, save_file

    from bivit.serve.client import parse_response
    from bivit.core.encoder_cache import EC_FILE, EC_KEY, ec_id

    ec = tmp_path / "ec"
    with ServerProcess(["--ec-dir", str(ec), "--cache-mb", "0"], tmp_path) as srv:
        info = httpx.get(f"{srv.url}/v1/info", timeout=30).json()
        img = png_bytes(56, 56, 26)
        key = ec_id(info["fingerprint"], hashlib.sha256(img).hexdigest(), "image", 0)
        (ec / key).mkdir(parents=True)
        save_file({EC_KEY: torch.zeros(4, info["text_hidden_size"], dtype=torch.bfloat16)}, str(ec / key / EC_FILE))
        r = httpx.post(f"{srv.url}/v1/encode", files=[("file", ("a.png", img, "image/png"))], timeout=60)
        rec = parse_response(r.content)[1][0]
        assert rec.ec_ids == [key]
        rows = load_file(str(ec / key / EC_FILE))[EC_KEY]
        assert torch.equal(rows, rec.embedding) and rows.any()  # the answer's rows, not the planted zeros


def test_video_work_is_counted_in_frames(tmp_path):
    """A 58 MB MP4 of 4.5 M 16x16 frames at 4.5 M fps (1 s long, 1.8% of the pixel limit) was decoded frame by
    frame, ~80 s of one core; two of them made small video requests wait out their deadline. A frame now counts
    at least 128x128 pixels of decoding work, a request's videos share --max-video-mpixels, charged from their
    headers before decoding; and a container may declare at most 1000 fps. Here 200,000 16x16 frames at 1000 fps
    (200 s, 400 sampled frames) against --max-video-mpixels 1000: 200,000 x 16,384 = 3277 M, refused before
    decoding; the same frames at 2000 fps: refused by their rate."""
    bomb = tiny_video(200_000, 1000)
    with ServerProcess(["--max-video-mpixels", "1000", "--cache-mb", "0"], tmp_path) as srv:
        r, _ = measured(srv, f"a {len(bomb)} B MP4 of 200,000 16x16 frames", lambda: httpx.post(
            f"{srv.url}/v1/encode", files=[("file", ("bomb.mp4", bomb, "video/mp4"))], timeout=120))
        assert r.status_code == 413 and r.json()["error"]["kind"] == "too_large", r.text[:300]
        assert "3277 M frame pixels" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/encode", files=[("file", ("fast.mp4", tiny_video(2000, 2000), "video/mp4"))],
                       timeout=120)
        assert r.status_code == 422 and "more than max_fps=1000" in r.json()["items"][0]["error"], r.text[:300]
        small_clip = tiny_video(20, 10, 64)  # 20 frames: well within both
        r = httpx.post(f"{srv.url}/v1/encode", files=[("file", ("ok.mp4", small_clip, "video/mp4"))], timeout=120)
        assert r.status_code == 200, r.text[:300]


def test_uvicorn_is_the_minor_the_connection_limits_were_read_against():
    """The header, slow-reader and connection limits subclass uvicorn's private H11Protocol
    (`bivit.serve.transport.UVICORN_TESTED` says what they rely on): pyproject.toml pins that minor, and another one
    installed fails here rather than losing the limits silently."""
    import importlib.metadata
    import re
    from pathlib import Path

    from bivit.serve.transport import UVICORN_TESTED

    installed = importlib.metadata.version("uvicorn")
    assert installed.split(".")[:2] == UVICORN_TESTED.split("."), \
        f"uvicorn {installed} installed; bivit serve's limits were read against {UVICORN_TESTED}.x"
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    major, minor = UVICORN_TESTED.split(".")
    assert re.search(rf'"uvicorn>={major}\.{minor},<{major}\.{int(minor) + 1}"', pyproject)
