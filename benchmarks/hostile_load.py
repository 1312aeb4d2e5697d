"""Server memory under the hostile patterns of the limits section of the README, with the default limits.

    python benchmarks/hostile_load.py            # demo model, default `bivit serve` limits

Starts `bivit serve` on a free loopback port and measures its resident memory (VmRSS) before and after each
pattern, checking that a normal request still succeeds after it:

* copies: one JSON request with 500 copies of a 470-byte 1-bit PNG that decodes to 1792x1792;
* distinct: one request with 48 distinct such PNGs (each 38 MB of float32 pixels once preprocessed);
* slow clients: 32 connections sending headers at 1 byte/s and 32 sending a body at 1 byte/s, for 15 s;
* tall: a 117 KB PNG of 1x60,000,000 pixels (under the pixel limit; its decoding would take gigabytes);
* heavy (a second server, `--request-timeout-s 5`): two 14000x14000 PNGs in one request, then three small
  requests a second later; their status and latency (before the heavy-image pool, all three answered 504).

`--round4` (a third server, `--request-timeout-s 10`) runs the fourth adversarial round's attacks instead, each
with a /health probe every 0.1 s (its slowest answer is printed) and the server's peak RSS:

* scan bombs: two 5500x5500 progressive JPEGs of ~100,000 empty scans (1 MB each), small requests beside them;
* failing copies: `{"items": [{"data": ""}] * 300000}`;
* frame bomb: an MKV whose header and sampled frames say 64x48 and whose other frames are 8000x8000 MJPEG;
* still image as video: a 16000x16000 PNG named `.mp4`;
* chunk flood: an 8x8 PNG with 5,000,000 empty chunks (60 MB);
* stalled bodies: 16 uploads that send 63 of 64 MB and stall;
* head of line: two requests of 13 7500x7500 PNGs, then a small request 1 s later.
"""

from __future__ import annotations

import argparse
import base64
import io
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers' real server process
from support.media import blank_png  # noqa: E402
from support.server import HealthProbe, ServerProcess, peak_mb, reset_peak, rss_mb  # noqa: E402


def one_bit_png(size: int, seed: int) -> bytes:
    img = Image.new("1", (size, size))
    img.putpixel((seed % size, 0), 1)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def json_body(images: list[bytes]) -> dict:
    return {"items": [{"name": f"{i}.png", "data": base64.b64encode(d).decode()} for i, d in enumerate(images)]}


def beside(url: str, big: list[list], small: list[list], delay: float = 1.0) -> str:
    """Each request of `big` (its file parts) sent at once, each of `small` `delay` s later, all concurrently ->
    "bigN / smallN: status in seconds" for each."""
    results: dict[str, tuple[int, float]] = {}

    def post(key: str, files: list) -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/encode", files=files, timeout=300)
        results[key] = (r.status_code, time.monotonic() - t0)

    first = [threading.Thread(target=post, args=(f"big{i}", files)) for i, files in enumerate(big)]
    for t in first:
        t.start()
    time.sleep(delay)
    then = [threading.Thread(target=post, args=(f"small{i}", files)) for i, files in enumerate(small)]
    for t in then:
        t.start()
    for t in first + then:
        t.join()
    return ", ".join(f"{k} HTTP {code} in {sec:.2f} s" for k, (code, sec) in sorted(results.items()))


def smalls(n: int, seed: int) -> list[list]:
    return [[("file", (f"s{i}.png", one_bit_png(56, seed + i), "image/png"))] for i in range(n)]


def heavy_images() -> None:
    """Two heavy images, then three small requests 1 s later, under --request-timeout-s 5."""
    big = blank_png(14000, 14000, 2)  # sent in two requests (the cache is off: both are decoded)
    with ServerProcess(["--cache-mb", "0", "--request-timeout-s", "5"], Path(tempfile.mkdtemp())) as srv:
        big_requests = [[("file", (f"big{i}.png", big, "image/png"))] for i in range(2)]
        print(f"heavy ({len(big)} B PNG of 14000x14000): " + beside(srv.url, big_requests, smalls(3, 1)))


def slow_client(port: int, seconds: float, body: bool) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            if body:
                s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100000\r\n\r\n")
            else:
                s.sendall(b"POST /v1/encode HTTP/1.1\r\n")
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                s.sendall(b"x")
                time.sleep(1)
    except OSError:
        pass  # closed by the server: what should happen


def scan_bomb(size: int, empty_scans: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (size, size), 90).save(buf, "JPEG", progressive=True)
    return buf.getvalue()[:-2] + b"\xff\xda\x00\x08\x01\x01\x00\x01\x3f\x00" * empty_scans + b"\xff\xd9"


def frame_bomb(big: int) -> bytes:
    """An MKV whose header (and sampled frames) say 64x48, its other frames big x big MJPEG."""
    from fractions import Fraction

    import av
    import numpy as np

    buf = io.BytesIO()
    out = av.open(buf, "w", format="matroska")
    stream = out.add_stream("mjpeg", rate=10)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuvj420p"
    encoders = {}
    for w, h in ((64, 48), (big, big)):
        enc = av.CodecContext.create("mjpeg", "w")
        enc.width, enc.height, enc.pix_fmt, enc.time_base = w, h, "yuvj420p", Fraction(1, 10)
        enc.open()
        encoders[w, h] = enc
    for i in range(10):
        w, h = (64, 48) if i in (0, 9) else (big, big)  # 10 frames at 10 fps: indices 0 and 9 are sampled
        frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 100, np.uint8), "rgb24").reformat(format="yuvj420p")
        frame.pts, frame.time_base = i, Fraction(1, 10)
        for packet in encoders[w, h].encode(frame):
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, i, i, Fraction(1, 10)
            out.mux(packet)
    out.close()
    return buf.getvalue()


def chunk_flood(chunks: int) -> bytes:
    import struct
    import zlib

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    png = buf.getvalue()
    at = png.index(b"IDAT") - 4
    empty = struct.pack(">I", 0) + b"tEXt" + struct.pack(">I", zlib.crc32(b"tEXt"))
    return png[:at] + empty * chunks + png[at:]


def round4() -> None:
    """The fourth adversarial round's attacks (module doc), each timed, with /health probed meanwhile."""
    with ServerProcess(["--cache-mb", "0", "--request-timeout-s", "10"], Path(tempfile.mkdtemp())) as srv:
        pid = srv.proc.pid
        probe = HealthProbe(srv.url)

        def post(files=None, json=None, content=None, headers=None) -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = httpx.post(f"{srv.url}/v1/encode", files=files, json=json, content=content, headers=headers,
                           timeout=300)
            return r, time.monotonic() - t0

        def small(i: int) -> tuple[httpx.Response, float]:
            return post(files=[("file", (f"s{i}.png", one_bit_png(56, 100 + i), "image/png"))])

        def measured(label: str, fn) -> None:
            base = rss_mb(pid)
            reset_peak(pid)
            text = fn()
            print(f"{label}: {text}; RSS {base:.0f} MB before, peak {peak_mb(pid):.0f}, after {rss_mb(pid):.0f}; "
                  f"{probe.worst()}")

        def bombs() -> str:
            bomb = scan_bomb(5500, 100_000)
            bombs = [[("file", (f"b{i}.jpg", bomb + bytes([i]), "image/jpeg"))] for i in range(2)]
            return f"{len(bomb)} B each; " + beside(srv.url, bombs, smalls(3, 7))

        measured("scan bombs", bombs)

        def copies() -> str:
            body = b'{"items": [' + b",".join([b'{"data": ""}'] * 300_000) + b"]}"
            r, sec = post(content=body, headers={"Content-Type": "application/json"})
            return f"{len(body)} B body: HTTP {r.status_code}, answer {len(r.content)} B in {sec:.2f} s"

        measured("failing copies", copies)

        def upload(label: str, name: str, data: bytes, ctype: str) -> None:
            def send() -> str:
                r, sec = post(files=[("file", (name, data, ctype))])
                return f"{len(data)} B {name}: HTTP {r.status_code} in {sec:.2f} s"
            measured(label, send)

        upload("frame bomb", "v.mkv", frame_bomb(8000), "video/x-matroska")
        upload("still image as video", "big.mp4", blank_png(16000, 16000, 2), "video/mp4")
        upload("chunk flood", "c.png", chunk_flood(5_000_000), "image/png")

        def stalled() -> str:
            sockets, answers = [], []
            for _ in range(16):
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
                s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 67108864\r\n\r\n")
                sockets.append(s)
            chunk = b" " * (1 << 20)
            for s in sockets:
                try:
                    for _ in range(63):
                        s.sendall(chunk)
                except OSError:
                    pass
            time.sleep(2)
            held = rss_mb(pid)
            for s in sockets:
                s.settimeout(0.5)
                try:
                    answers.append(s.recv(12).decode(errors="replace"))
                except OSError:
                    answers.append("")
                s.close()
            refused = sum(a.startswith("HTTP/1.1 503") for a in answers)
            r, sec = small(0)
            return (f"RSS while held {held:.0f} MB, {refused} of 16 answered 503; a small request then "
                    f"{r.status_code} in {sec:.2f} s")

        measured("stalled bodies", stalled)
        probe.stop()
    head_of_line()


def head_of_line() -> None:
    """Two requests of 13 7500x7500 PNGs, then a small request 1 s later (default limits)."""
    with ServerProcess(["--cache-mb", "0"], Path(tempfile.mkdtemp())) as srv:
        big = [[("file", (f"r{k}-{i}.png", blank_png(7500, 7500, 2) + b"\0" * (k * 13 + i), "image/png"))
                for i in range(13)] for k in range(2)]
        print("head of line (two requests of 13 7500x7500 PNGs, a small one 1 s later): "
              + beside(srv.url, big, smalls(1, 5)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slow-seconds", type=float, default=15.0)
    p.add_argument("--round4", action="store_true", help="run the fourth round's attacks instead")
    args = p.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]))
    print("cpu:", model, "| amx:", "amx_bf16" in cpu, "| avx512_bf16:", "avx512_bf16" in cpu)
    if args.round4:
        round4()
        return
    with ServerProcess(["--cache-mb", "0"], Path(tempfile.mkdtemp())) as srv:
        pid = srv.proc.pid
        ok = json_body([one_bit_png(56, 0)])

        def normal() -> int:
            return httpx.post(f"{srv.url}/v1/encode", json=ok, timeout=120).status_code

        assert normal() == 200
        base = rss_mb(pid)
        print(f"after start and one request: {base:.0f} MB")
        r = httpx.post(f"{srv.url}/v1/encode", json=json_body([one_bit_png(1792, 0)] * 500), timeout=120)
        print(f"copies: HTTP {r.status_code} {r.json()['error']['kind']}; RSS {rss_mb(pid) - base:+.0f} MB; "
              f"next request {normal()}")
        r = httpx.post(f"{srv.url}/v1/encode", json=json_body([one_bit_png(1792, i) for i in range(48)]), timeout=120)
        print(f"distinct: HTTP {r.status_code} {r.json()['error']['kind']}; RSS {rss_mb(pid) - base:+.0f} MB; "
              f"next request {normal()}")
        threads = [threading.Thread(target=slow_client, args=(srv.port, args.slow_seconds, i % 2 == 1))
                   for i in range(64)]
        for t in threads:
            t.start()
        time.sleep(2)
        t0 = time.monotonic()
        status = normal()
        print(f"during slow clients: normal request {status} in {time.monotonic() - t0:.2f} s; "
              f"RSS {rss_mb(pid) - base:+.0f} MB")
        for t in threads:
            t.join()
        print(f"after slow clients: RSS {rss_mb(pid) - base:+.0f} MB; next request {normal()}")
        tall = blank_png(1, 60_000_000)
        before = rss_mb(pid)
        reset_peak(pid)
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/encode", files=[("file", ("tall.png", tall, "image/png"))], timeout=300)
        print(f"tall ({len(tall)} B PNG of 1x60000000): HTTP {r.status_code} in {time.monotonic() - t0:.2f} s; "
              f"RSS {before:.0f} MB before, peak {peak_mb(pid):.0f} MB, after {rss_mb(pid):.0f} MB; "
              f"next request {normal()}")
    heavy_images()


if __name__ == "__main__":
    main()
