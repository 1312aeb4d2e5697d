"""Clients that hang up, and what the server keeps of them: RSS and error-level log lines over rounds.

    python benchmarks/hangups.py                 # 3 rounds of 80 hangups, from a cold server
    python benchmarks/hangups.py --warm 2        # the same after 2 rounds of the same load, every answer read

Each client sends a JSON request of four 448x448 PNGs on loopback and closes its socket 0-80 ms later (demo
model, default limits, one `bivit serve`). After each round, once no item is in flight: the server's RSS, the
statuses logged and the lines logged at error level. `--warm` first runs the same 80 requests with their answers
read, so the rounds start from the load's own working set (what the allocator keeps once freed). The same script
measures an older checkout (its `src` on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.media import png_bytes  # noqa: E402 - the tests' helpers, on the path above
from support.server import ServerProcess, rss_mb  # noqa: E402


def request(images: list[bytes], rid: str) -> bytes:
    body = json.dumps({"items": [{"name": f"{i}.png", "data": base64.b64encode(d).decode()}
                                 for i, d in enumerate(images)]}).encode()
    return (f"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            f"\r\nX-Request-ID: {rid}\r\n\r\n").encode() + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=80)
    ap.add_argument("--warm", type=int, default=0, help="rounds of the same load with every answer read, first")
    args = ap.parse_args()
    images = [png_bytes(448, 448, s) for s in range(16)]

    def payload(k: int, rid: str) -> bytes:
        return request([images[(k + j) % len(images)] for j in range(4)], rid)

    with tempfile.TemporaryDirectory() as logs, ServerProcess([], Path(logs)) as srv:
        def settle() -> None:
            srv.wait_for_metric("bivit_inflight_items", lambda v: v == 0)
            time.sleep(2)  # a measurement, not a test: let the last answers leave

        def answered(k: int) -> None:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=300) as s:
                s.sendall(payload(k, f"warm-{k}"))
                s.makefile("rb").readline()

        for w in range(args.warm):
            threads = [threading.Thread(target=answered, args=(k,)) for k in range(args.clients)]
            for k, t in enumerate(threads):
                t.start()
                time.sleep(0.02 * (k % 5))
            for t in threads:
                t.join()
            settle()
            print(f"warm-up {w}: RSS {rss_mb(srv.proc.pid):.0f} MB", flush=True)
        print(f"before: RSS {rss_mb(srv.proc.pid):.0f} MB", flush=True)
        for r in range(args.rounds):
            for k in range(args.clients):
                with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                    s.sendall(payload(k, f"gone-{r}-{k}"))
                    time.sleep(0.02 * (k % 5))
            settle()
            records = srv.log_records()
            statuses = {}
            for rec in records:
                if rec.get("msg") == "request" and str(rec.get("id", "")).startswith("gone-"):
                    statuses[rec["status"]] = statuses.get(rec["status"], 0) + 1
            errors = sum(rec.get("level") == "error" for rec in records)
            print(f"round {r}: RSS {rss_mb(srv.proc.pid):.0f} MB, statuses {statuses}, error lines {errors}",
                  flush=True)


if __name__ == "__main__":
    main()
