"""Load test of the encoder service: throughput and latency at several concurrency levels.

    python benchmarks/loadtest.py                       # demo model, levels 1,4,16,32, 8 s each
    python benchmarks/loadtest.py --model DIR --dtype bfloat16 --duration 30
    python benchmarks/loadtest.py --url http://host:8000 --api-key KEY   # an already running server

It starts `bivit serve` on a free loopback port (unless --url), then for each level runs that many
closed-loop clients (each sends its next request as soon as the previous one is answered) for a bounded time,
cycling through a fixed mix of image sizes. Every answer is checked bit for bit against offline encoding of the
same image (--no-verify to skip; needs the same --model/--dtype as the server). The server's cache is off by
default, so the numbers measure encoding, not cache hits. Client and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import io
import shlex
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load as st_load

from bivit.bench import noise_image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers' real server process
from support.server import ServerProcess, metric_values  # noqa: E402

# (w, h): 1 to 256 tokens; the mix every level cycles through.
MIX = [(28, 28), (56, 56), (112, 112), (200, 150), (224, 224), (448, 448), (640, 480)]


def png_bytes(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    noise_image(w, h, seed).save(buf, format="PNG")
    return buf.getvalue()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def run_level(url: str, headers: dict, images: list[bytes], refs: list | None, clients: int, duration: float,
              per_request: int) -> dict:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    mismatches = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def worker(w: int) -> None:
        nonlocal mismatches
        k = w * per_request  # clients start at different points of the mix
        with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
            while time.monotonic() < stop_at:
                idx = [(k + j) % len(images) for j in range(per_request)]
                k += per_request
                t0 = time.perf_counter()
                r = http.post("/v1/encode", files=[("file", (f"{i}.png", images[i], "image/png")) for i in idx])
                dt = time.perf_counter() - t0
                bad = 0
                if r.status_code == 200 and refs is not None:
                    got = st_load(r.content)
                    bad = sum(not torch.equal(got[str(j)], refs[i]) for j, i in enumerate(idx))
                with lock:
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    mismatches += bad
                    if r.status_code == 200:
                        latencies.append(dt)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    ok = len(latencies)
    return {"clients": clients, "requests": ok, "req_s": ok / elapsed, "img_s": ok * per_request / elapsed,
            "p50_ms": 1000 * percentile(latencies, 50) if ok else float("nan"),
            "p99_ms": 1000 * percentile(latencies, 99) if ok else float("nan"),
            "statuses": statuses, "mismatches": mismatches, "elapsed": elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: demo model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--levels", default="1,4,16,32", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per level")
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--max-batch-patches", type=int, default=16384)
    p.add_argument("--cache-mb", type=float, default=0.0, help="server cache (default off: measure encoding)")
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-verify", action="store_true", help="skip the bit-for-bit check against offline encoding")
    args = p.parse_args()
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]))

    import bivit

    images = [png_bytes(w, h, seed=i) for i, (w, h) in enumerate(MIX)]
    refs = None
    enc = None
    if not args.no_verify or args.url is None:
        enc = bivit.load_encoder(args.model, dtype=args.dtype)
    if not args.no_verify:
        refs = [enc.encode([img])[0] for img in images]

    # Offline baseline in this process: one image per call, and the whole mix in one call.
    if enc is not None:
        n = 3
        enc.encode(images)  # first calls per shape are slower (allocations, kernel selection); not measured
        for img in images:
            enc.encode([img])
        t0 = time.perf_counter()
        for _ in range(n):
            for img in images:
                enc.encode([img])
        alone = n * len(images) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(n):
            enc.encode(images)
        together = n * len(images) / (time.perf_counter() - t0)
        print(f"offline baseline ({enc!r}): {alone:.1f} img/s one per call, {together:.1f} img/s whole mix per call")
    tokens = [bivit.image_token_count(w, h) for w, h in MIX]
    print(f"image mix (w x h -> tokens): {', '.join(f'{w}x{h}->{t}' for (w, h), t in zip(MIX, tokens))}")

    server = None
    if args.url is None:
        server_args = ["--dtype", args.dtype, "--max-wait-ms", str(args.max_wait_ms), "--max-batch-patches",
                       str(args.max_batch_patches), "--cache-mb", str(args.cache_mb), "--max-queue", "4096",
                       "--log-level", "warning"]
        if args.model:
            server_args += ["--model", args.model]
        server = ServerProcess(server_args, Path("/tmp"), api_key=args.api_key)
        url = server.url
        print("server:", shlex.join(["bivit", "serve", *server_args]))
    else:
        url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    try:
        # Warm the server on the mix once (first calls per shape are slower), unmeasured.
        with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
            for i, img in enumerate(images):
                r = http.post("/v1/encode", files=[("file", (f"{i}.png", img, "image/png"))])
                if r.status_code != 200:
                    raise SystemExit(f"warm-up request failed: HTTP {r.status_code} {r.text[:200]}")
        print()
        print("| clients | requests | req/s | images/s | p50 ms | p99 ms | items/batch | non-200 | mismatches |")
        print("|---|---|---|---|---|---|---|---|---|")
        for level in [int(x) for x in args.levels.split(",")]:
            before = metric_values(httpx.get(f"{url}/metrics", headers=headers).text)
            res = run_level(url, headers, images, refs, level, args.duration, args.images_per_request)
            after = metric_values(httpx.get(f"{url}/metrics", headers=headers).text)
            batches = after["bivit_batch_items_count"] - before["bivit_batch_items_count"]
            items = after["bivit_batch_items_sum"] - before["bivit_batch_items_sum"]
            non200 = sum(v for k, v in res["statuses"].items() if k != 200)
            print(f"| {level} | {res['requests']} | {res['req_s']:.1f} | {res['img_s']:.1f} | {res['p50_ms']:.1f} | "
                  f"{res['p99_ms']:.1f} | {items / max(batches, 1):.2f} | {non200} | "
                  f"{'-' if refs is None else res['mismatches']} |", flush=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
