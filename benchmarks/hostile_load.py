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
from support.server import ServerProcess  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS


def peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def one_bit_png(size: int, seed: int) -> bytes:
    img = Image.new("1", (size, size))
    img.putpixel((seed % size, 0), 1)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def json_body(images: list[bytes]) -> dict:
    return {"items": [{"name": f"{i}.png", "data": base64.b64encode(d).decode()} for i, d in enumerate(images)]}


def heavy_images() -> None:
    """Two heavy images, then three small requests 1 s later, under --request-timeout-s 5."""
    big = blank_png(14000, 14000, 2)  # sent in two requests (the cache is off: both are decoded)
    with ServerProcess(["--cache-mb", "0", "--request-timeout-s", "5"], Path(tempfile.mkdtemp())) as srv:
        results: dict[str, tuple[int, float]] = {}

        def post(key: str, files: list) -> None:
            t0 = time.monotonic()
            r = httpx.post(f"{srv.url}/v1/encode", files=files, timeout=120)
            results[key] = (r.status_code, time.monotonic() - t0)

        heavy = [threading.Thread(target=post, args=(f"heavy{i}", [("file", (f"big{i}.png", big, "image/png"))]))
                 for i in range(2)]
        for t in heavy:
            t.start()
        time.sleep(1)
        small = [threading.Thread(target=post, args=(f"small{i}", [("file", (f"s{i}.png", one_bit_png(56, i + 1),
                                                                              "image/png"))])) for i in range(3)]
        for t in small:
            t.start()
        for t in heavy + small:
            t.join()
        print(f"heavy ({len(big)} B PNG of 14000x14000): " + ", ".join(
            f"{k} HTTP {code} in {sec:.2f} s" for k, (code, sec) in sorted(results.items())))


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slow-seconds", type=float, default=15.0)
    args = p.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]))
    print("cpu:", model, "| amx:", "amx_bf16" in cpu, "| avx512_bf16:", "avx512_bf16" in cpu)
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
