"""The fifth adversarial round's attacks at full size, each measured: peak RSS of the server (VmHWM after a
reset), the slowest /health answer of a probe running alongside (every 0.1 s), and wall time.

    python benchmarks/hostile_round5.py                    # every case
    python benchmarks/hostile_round5.py --only json,weights

Cases (demo model, one `bivit serve` per case on a free loopback port, `--cache-mb 0`):

* json: a 60 MB JSON body of each element kind (`[],`, `{},`, `"ab",`, `1,`, `null,`), then three `[],` bodies at
  once;
* readers: 4 and 8 clients each asking for a ~210 MB answer (200 copies of a 1792x1792 PNG) and never
  reading it; RSS 10 s and 45 s later;
* json-answer: one `?format=json` answer of ~145 MB (25 copies of the 1792x1792 PNG);
* video: an MP4 of 200,000 16x16 frames at 200,000 fps (1 s long), and a small video request beside two of them;
* names: a JSON item named with a lone surrogate, one with a 60 MB name (the server log's growth);
* weights: an 800 MiB `POST /v1/weights` body (with an API key);
* smuggle: Content-Length and Transfer-Encoding on one request, a second request behind it on the connection;
* ec: a zero tensor planted in `--ec-dir` at the id the next answer will name;
* shard: one bit flipped per KB of a dataset shard's tensor data, read back with `load_embeddings`.

The same script measures an older checkout (run it with that checkout's `src` on PYTHONPATH): what it
measures is the server's behaviour, through the options both know.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hostile_load import one_bit_png  # noqa: E402
from support.media import png_bytes, tiny_video  # noqa: E402
from support.server import HealthProbe, ServerProcess, peak_mb, reset_peak, rss_mb  # noqa: E402

MB = 2**20


class Measured:
    """One server, a /health probe beside it, and `measure(label, fn)` printing fn's text with RSS and probe."""

    def __init__(self, args: list[str], api_key: str | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="round5-"))
        self.srv = ServerProcess(["--cache-mb", "0", *args], self.dir, api_key=api_key)
        self.pid = self.srv.proc.pid
        self.probe = HealthProbe(self.srv.url)

    def measure(self, label: str, fn) -> None:
        base = rss_mb(self.pid)
        reset_peak(self.pid)
        self.probe.worst()
        t0 = time.monotonic()
        text = fn()
        wall = time.monotonic() - t0
        print(f"{label}: {text}; wall {wall:.1f} s; RSS {base:.0f} MB before, peak {peak_mb(self.pid):.0f} MB "
              f"(+{peak_mb(self.pid) - base:.0f}), after {rss_mb(self.pid):.0f} MB; {self.probe.worst()}",
              flush=True)

    def post(self, path: str = "/v1/encode", **kw) -> tuple[httpx.Response, float]:
        headers = {**self.srv.headers, **kw.pop("headers", {})}
        body = kw.pop("content", None)
        if body is not None:  # sent in 1 MiB views: httpx slices what is left of a body after every send (copies)
            view = memoryview(body)
            kw["content"] = (view[i:i + MB] for i in range(0, len(view), MB))
            headers["Content-Length"] = str(len(body))
        t0 = time.monotonic()
        r = httpx.post(f"{self.srv.url}{path}", timeout=600, headers=headers, **kw)
        return r, time.monotonic() - t0

    def close(self) -> None:
        self.probe.stop()
        self.srv.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def answer(r: httpx.Response) -> str:
    try:
        kind = r.json()["error"]["kind"]
    except Exception:  # noqa: BLE001 - not an error body
        kind = f"{len(r.content)} B"
    return f"HTTP {r.status_code} {kind}"


def case_json() -> None:
    m = Measured([])
    try:
        units = {"arrays": b"[],", "objects": b"{},", "strings": b'"ab",', "numbers": b"1,", "literals": b"null,"}
        bodies = {k: b'{"items": [' + u * (60 * MB // len(u)) + b'[]]}' for k, u in units.items()}
        for kind, body in bodies.items():
            def one(body=body) -> str:
                r, sec = m.post(content=body, headers={"Content-Type": "application/json"})
                return f"{len(body) / MB:.0f} MB body: {answer(r)} in {sec:.1f} s"
            m.measure(f"json bomb of {kind}", one)

        def three() -> str:
            out = []

            def send() -> None:
                r, sec = m.post(content=bodies["arrays"], headers={"Content-Type": "application/json"})
                out.append(f"{answer(r)} in {sec:.1f} s")
            threads = [threading.Thread(target=send) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return "; ".join(out)
        m.measure("json bomb of arrays x3 at once", three)
    finally:
        m.close()


def _stuck_reader(port: int, body: bytes, sockets: list) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sockets.append(s)  # never read


def case_readers() -> None:
    img = one_bit_png(1792, 0)  # 4096 tokens: ~1 MB of bf16 rows per copy
    body = json.dumps({"items": [{"name": f"{i}.png", "data": base64.b64encode(img).decode()}
                                 for i in range(200)]}).encode()
    for n in (4, 8):
        m = Measured([])
        try:
            def readers(n=n) -> str:
                sockets: list = []
                for _ in range(n):
                    _stuck_reader(m.srv.port, body, sockets)
                time.sleep(10)
                at10 = rss_mb(m.pid)
                time.sleep(35)
                at45 = rss_mb(m.pid)
                heads = []
                for s in sockets:
                    s.settimeout(1)
                    try:
                        heads.append(s.recv(12).decode(errors="replace")[9:12] or "closed")
                    except OSError:
                        heads.append("-")
                    s.close()
                r, sec = m.post(files=[("file", ("ok.png", png_bytes(56, 56, 1), "image/png"))])
                return (f"{n} readers of {len(body) / MB:.1f} MB requests: RSS {at10:.0f} MB at 10 s, {at45:.0f} MB "
                        f"at 45 s; first bytes {heads}; then a small request {answer(r)} in {sec:.2f} s")
            m.measure(f"{n} slow readers", readers)
        finally:
            m.close()


def case_json_answer() -> None:
    m = Measured(["--max-response-mb", "1024"])
    try:
        img = one_bit_png(1792, 0)
        body = {"items": [{"name": f"{i}.png", "data": base64.b64encode(img).decode()} for i in range(25)]}

        def big() -> str:
            r, sec = m.post(params={"format": "json"}, json=body)
            return f"?format=json: HTTP {r.status_code}, {len(r.content) / MB:.0f} MB in {sec:.1f} s"
        m.measure("json answer", big)
    finally:
        m.close()


def case_video() -> None:
    m = Measured([])
    try:
        t0 = time.monotonic()
        bomb = tiny_video(200_000, 200_000)
        print(f"(made a {len(bomb) / MB:.1f} MB MP4 of 200,000 16x16 frames at 200,000 fps in "
              f"{time.monotonic() - t0:.1f} s)")

        def one() -> str:
            r, sec = m.post(files=[("file", ("bomb.mp4", bomb, "video/mp4"))])
            return f"{answer(r)} in {sec:.1f} s"
        m.measure("200k-frame tiny video", one)

        def beside() -> str:
            small = tiny_video(20, 10, 64)
            out = {}

            def send(key: str, data: bytes) -> None:
                r, sec = m.post(files=[("file", (f"{key}.mp4", data, "video/mp4"))])
                out[key] = f"{answer(r)} in {sec:.1f} s"
            bombs = [threading.Thread(target=send, args=(f"bomb{i}", bomb + bytes(i))) for i in range(2)]
            for t in bombs:
                t.start()
            time.sleep(1)
            send("small", small)
            for t in bombs:
                t.join()
            return ", ".join(f"{k} {v}" for k, v in sorted(out.items()))
        m.measure("two 200k-frame videos, a small video 1 s later", beside)
    finally:
        m.close()


def case_names() -> None:
    m = Measured([])
    try:
        img = base64.b64encode(png_bytes(56, 56, 3)).decode()

        def surrogate() -> str:
            body = '{"items": [{"name": "\\ud800.png", "data": "%s"}, {"name": "ok.png", "data": "%s"}]}' % (img, img)
            r, sec = m.post(content=body.encode(), headers={"Content-Type": "application/json"})
            return f"{answer(r)} in {sec:.2f} s"
        m.measure("lone surrogate name", surrogate)

        def long_name() -> str:
            log0 = m.srv.log_path.stat().st_size
            r, sec = m.post(json={"items": [{"name": "n" * (60 * MB), "data": "!"}]})  # fails: its error names it
            time.sleep(0.5)
            return f"{answer(r)} in {sec:.1f} s, server log +{(m.srv.log_path.stat().st_size - log0) / MB:.1f} MB"
        m.measure("60 MB name", long_name)
    finally:
        m.close()


def case_weights() -> None:
    from safetensors.torch import save

    m = Measured(["--max-weights-mb", "1024", "--body-timeout-s", "600"], api_key="k")
    try:
        import torch

        body = save({"junk": torch.zeros(800 * MB // 4, dtype=torch.float32)})

        def push() -> str:
            r, sec = m.post("/v1/weights", content=body, headers={"Content-Type": "application/octet-stream"})
            return f"{len(body) / MB:.0f} MiB body: {answer(r)} in {sec:.1f} s"
        m.measure("800 MiB weights body", push)
        del body
    finally:
        m.close()


def case_smuggle() -> None:
    m = Measured([])
    try:
        def smuggle() -> str:
            with socket.create_connection(("127.0.0.1", m.srv.port), timeout=10) as s:
                s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                          b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                s.settimeout(3)
                try:
                    while chunk := s.recv(65536):
                        data += chunk
                except OSError:
                    pass
            statuses = [m.decode() for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]
            return f"answers on the connection: {statuses}"
        m.measure("CL+TE smuggle", smuggle)
    finally:
        m.close()


def case_ec() -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from bivit.core import records
    from bivit.core.encoder_cache import EC_FILE, EC_KEY, ec_id

    ec = Path(tempfile.mkdtemp(prefix="round5-ec-"))
    m = Measured(["--ec-dir", str(ec)])
    try:
        img = png_bytes(56, 56, 9)

        def planted() -> str:
            info = httpx.get(f"{m.srv.url}/v1/info", timeout=30).json()
            tokens = 4
            import hashlib
            key = ec_id(info["fingerprint"], hashlib.sha256(img).hexdigest(), "image", 0)
            (ec / key).mkdir(parents=True)
            save_file({EC_KEY: torch.zeros(tokens, info["text_hidden_size"], dtype=torch.bfloat16)},
                      str(ec / key / EC_FILE))
            r, sec = m.post(files=[("file", ("a.png", img, "image/png"))])
            rec = records.from_bytes(r.content)[0]
            rows = load_file(str(ec / key / EC_FILE))[EC_KEY]
            same = torch.equal(rows, rec.embedding)
            return (f"{answer(r)}, ec_ids names the planted id: {rec.extra.get('ec_ids') == [key]}; the file holds "
                    f"{'the answer' if same else 'zeros' if not rows.any() else 'other rows'}")
        m.measure("planted ec file", planted)
    finally:
        m.close()
        shutil.rmtree(ec, ignore_errors=True)


def case_shard() -> None:
    import torch

    import bivit

    d = Path(tempfile.mkdtemp(prefix="round5-shard-"))
    try:
        src = d / "src"
        src.mkdir()
        for i in range(8):
            (src / f"{i}.png").write_bytes(png_bytes(56 + 28 * i, 56, i))
        subprocess.run([sys.executable, "-m", "bivit", "encode-dataset", str(src), "--out", str(d / "out")],
                       check=True, capture_output=True)
        good = [r.embedding.clone() for r in bivit.load_embeddings(d / "out")]
        shard = next((d / "out").glob("shard-*.safetensors"))
        data = bytearray(shard.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        for at in range(start, len(data), 1024):
            data[at] ^= 0x10
        shard.write_bytes(bytes(data))
        t0 = time.monotonic()
        try:
            got = [r.embedding for r in bivit.load_embeddings(d / "out")]
            wrong = sum(not torch.equal(a, b) for a, b in zip(good, got))
            nan = sum(bool(torch.isnan(g.float()).any()) for g in got)
            text = f"load_embeddings returned {len(got)} embeddings, {wrong} wrong ({nan} with NaN)"
        except bivit.BivitError as e:
            text = f"{type(e).__name__}: {e}"
        print(f"bit-flipped shard: {text}; {time.monotonic() - t0:.2f} s", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


CASES = {"json": case_json, "readers": case_readers, "json-answer": case_json_answer, "video": case_video,
         "names": case_names, "weights": case_weights, "smuggle": case_smuggle, "ec": case_ec, "shard": case_shard}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases: {', '.join(CASES)}")
    args = p.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]))
    print(f"cpu: {model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    import bivit
    print("bivit from:", Path(bivit.__file__).parent)
    for name in args.only.split(","):
        CASES[name]()


if __name__ == "__main__":
    main()
