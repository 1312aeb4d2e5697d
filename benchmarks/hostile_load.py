"""Server memory under the hostile patterns of the limits section of the README, with the default limits.

    python benchmarks/hostile_load.py            # demo model, default `bivit serve` limits

Starts `bivit serve` on a free loopback port and measures its resident memory (VmRSS) before and after each
pattern, checking that a normal request still succeeds after it:

* copies: one JSON request with 500 copies of a 470-byte 1-bit PNG that decodes to 1792x1792;
* distinct: one request with 48 distinct such PNGs (each 38 MB of float32 pixels once preprocessed);
* slow clients: 32 connections sending headers at 1 byte/s and 32 sending a body at 1 byte/s, for 15 s.
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
from support.server import ServerProcess  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def one_bit_png(size: int, seed: int) -> bytes:
    img = Image.new("1", (size, size))
    img.putpixel((seed % size, 0), 1)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def json_body(images: list[bytes]) -> dict:
    return {"items": [{"name": f"{i}.png", "data": base64.b64encode(d).decode()} for i, d in enumerate(images)]}


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


if __name__ == "__main__":
    main()
