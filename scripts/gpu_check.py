"""The GPU check of bivit's invariant path (run by scripts/gpu-check.sh; docs/gpu.md).

On a CUDA machine, with the full-size Kimi-K2.5 vision model (seeded random weights: nothing is downloaded):
  1. invariance, bf16: each item alone vs packed behind a filler vs in reverse order vs alone on N concurrent
     CUDA streams, bit for bit, in invariant mode; the same check in default mode (cuBLAS, SDPA) for comparison;
  2. guard: the CUDA kernels an invariant forward launches (torch.profiler): none from cuBLAS/cuDNN/SDPA;
  3. parity with bivit's CPU fp32 forward on the same weights and patches (GPU fp32 and GPU bf16);
  4. images/s over the model forward (patches in, embeddings out; preprocessing not included) at 448x448 and
     896x672: invariant vs default mode vs the transformers port's Kimi-K2.5 vision tower on the same GPU.
Writes one JSON and a short text table into --out. Sections that run out of the time budget are recorded as
skipped, never dropped silently.

`--dry-run` runs the same code on the CPU at toy size under Triton's interpreter (fp32: the interpreter's bf16
dot is wrong); its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from bivit import gpu, ops  # noqa: E402
from bivit.checkpoint import random_state_dict, save_checkpoint, transformers_config_dict  # noqa: E402
from bivit.config import PRESETS, ModelConfig  # noqa: E402
from bivit.model import VisionModel  # noqa: E402

TOY = ModelConfig(pos_emb_height=8, pos_emb_width=8, hidden_size=288, num_layers=1, num_heads=4,
                  intermediate_size=384, text_hidden_size=512)
# cuBLAS / cuDNN / CUTLASS / fused-attention kernel names (any of these in the invariant forward fails the guard)
STOCK_KERNELS = ("cublas", "cutlass", "xmma", "nvjet", "gemv", "gemmk", "sm90_", "sm80_", "ampere_", "flash",
                 "fmha", "attention", "cudnn", "layer_norm", "gelu")
TRITON_KERNELS = ("gemm_kernel", "norm_kernel", "rope_kernel", "attention_kernel", "frame_mean_kernel")


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def grid_of(width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
    return frames, height // 14, width // 14


def make_pixels(grid, seed: int, device) -> torch.Tensor:
    t, h, w = grid
    g = torch.Generator().manual_seed(seed)
    return torch.rand(t * h * w, 3, 14, 14, generator=g).mul_(2).sub_(1).to(device)  # normalised pixel range


class Runner:
    """The model on the device, run in one mode; `on_device` wraps calls in `gpu.interpreted()` for a dry run."""

    def __init__(self, net: VisionModel, device: torch.device) -> None:
        self.net, self.device = net, device

    def __call__(self, grids, pixels, invariant: bool) -> list[torch.Tensor]:
        with torch.inference_mode(), ops.batch_invariant(invariant):
            if self.device.type == "cpu":
                with gpu.interpreted():
                    return self.net(torch.cat(pixels), torch.tensor(grids))
            return self.net(torch.cat(pixels), torch.tensor(grids))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def build(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, state=None) -> VisionModel:
    with torch.device("meta"):
        net = VisionModel(cfg)
    net.load_state_dict(state if state is not None else random_state_dict(cfg, 0), strict=True, assign=True)
    return net.to(device=device, dtype=dtype).eval()


def invariance(run: Runner, items, streams: int) -> dict:
    filler = grid_of(28 * 3, 28)  # shifts every item to a row offset that is no multiple of any tile
    grids = [filler] + [g for g, _ in items]
    pixels = [make_pixels(filler, 99, run.device)] + [p for _, p in items]
    out = {}
    for mode, invariant in (("invariant", True), ("default", False)):
        alone = [run([g], [p], invariant)[0] for g, p in items]
        packed = run(grids, pixels, invariant)[1:]
        reversed_ = run(grids[::-1], pixels[::-1], invariant)[::-1][1:]
        concurrent: list = [None] * len(items)

        def worker(i: int) -> None:
            with torch.cuda.stream(torch.cuda.Stream()):
                concurrent[i] = run([items[i][0]], [items[i][1]], invariant)[0]
                torch.cuda.current_stream().synchronize()

        if run.device.type != "cuda":  # dry run: Triton's interpreter is not thread-safe; one after the other
            concurrent = [run([g], [p], invariant)[0] for g, p in items]
        for start in range(0, len(items), streams if run.device.type == "cuda" else len(items)):
            threads = [threading.Thread(target=worker, args=(i,))
                       for i in range(start, min(start + streams, len(items))) if run.device.type == "cuda"]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        out[mode] = {"items": len(items),
                     "packed_equal": sum(torch.equal(a, b) for a, b in zip(alone, packed)),
                     "reversed_equal": sum(torch.equal(a, b) for a, b in zip(alone, reversed_)),
                     f"{streams}_streams_equal": sum(torch.equal(a, b) for a, b in zip(alone, concurrent)),
                     "max_abs_diff_packed": max(float((a.float() - b.float()).abs().max()) for a, b in zip(alone, packed))}
    out["invariant"]["ok"] = all(out["invariant"][k] == len(items) for k in out["invariant"] if k.endswith("equal"))
    return out


def guard(run: Runner, grid, pixels) -> dict:
    """Which kernels (CUDA) or aten ops (dry run) an invariant forward runs; stock GEMM/attention ones fail it."""
    if run.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run([grid], [pixels], True)
            run.sync()
        names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
        forbidden = [n for n in names if any(s in n.lower() for s in STOCK_KERNELS)
                     and not n.startswith(TRITON_KERNELS)]
        return {"kernels": names, "forbidden": forbidden, "ok": not forbidden,
                "triton_kernels_seen": sorted(k for k in TRITON_KERNELS if any(k in n for n in names))}
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Log():
        run([grid], [pixels], True)
    stock = {"mm", "addmm", "bmm", "matmul", "linear", "convolution", "native_layer_norm", "rms_norm", "gelu",
             "_linear_pointwise", "scaled_dot_product_attention"}
    forbidden = sorted(n for n in seen if n in stock or n.startswith("_scaled_dot_product"))
    return {"aten_ops": sorted(seen), "forbidden": forbidden, "ok": not forbidden}


def parity(cfg, state, device, grid, pixels) -> dict:
    """GPU (fp32 and bf16, invariant) vs bivit's CPU fp32 forward (invariant mode, its own kernels)."""
    cpu = build(cfg, torch.float32, torch.device("cpu"), state)
    with torch.inference_mode(), ops.batch_invariant(True):
        ref = cpu(pixels.cpu(), torch.tensor([grid]))[0]
    del cpu
    scale = float(ref.abs().max())
    out = {"reference": "bivit CPU fp32 forward, invariant mode", "ref_max_abs": scale}
    dtypes = (torch.float32,) if device.type == "cpu" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        net = build(cfg, dtype, device, state)
        ours = Runner(net, device)([grid], [pixels.to(dtype)], True)[0].float().cpu()
        del net
        err = (ours - ref).abs()
        name = str(dtype).removeprefix("torch.")
        out[name] = {"max_abs": float(err.max()), "max_rel_to_scale": float(err.max()) / scale,
                     "mean_abs": float(err.mean())}
    return out


def throughput(run: Runner, sizes, batch: int, iters: int, budget: Budget, hf=None) -> dict:
    out = {}
    for width, height in sizes:
        grid = grid_of(width, height)
        pixels = [make_pixels(grid, 7 + i, run.device).to(run.net.vision_tower.dtype) for i in range(batch)]
        row = {}
        fns = {"invariant": lambda: run([grid] * batch, pixels, True),
               "default": lambda: run([grid] * batch, pixels, False)}
        if hf is not None:
            fns["transformers"] = lambda: hf(torch.cat(pixels), torch.tensor([grid] * batch))
        for name, fn in fns.items():
            if budget.left() < 20:
                row[name] = "skipped: time budget"
                continue
            fn()
            run.sync()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            run.sync()
            row[name] = round(batch * iters / (time.perf_counter() - start), 2)
        if isinstance(row.get("invariant"), float) and isinstance(row.get("default"), float):
            row["invariant_over_default"] = round(row["invariant"] / row["default"], 3)
        out[f"{width}x{height}"] = row
    return out


def transformers_tower(cfg, state, device, dtype):
    """The transformers port's Kimi-K2.5 model on the same weights, as `(pixels, grid_thw) -> embeddings`."""
    from transformers import Kimi_K25Model

    tmp = tempfile.mkdtemp(prefix="bivit-gpu-check-")
    save_checkpoint(tmp, cfg, state, dtype=dtype, config=transformers_config_dict(cfg))
    model = Kimi_K25Model.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa").to(device).eval()

    def forward(pixels, grid_thw):
        with torch.inference_mode():
            # the port takes its device from grid_thw
            return model.get_image_features(pixels.to(dtype), grid_thw.to(device)).pooler_output

    return forward


def save(results: dict, out: Path) -> str:
    """Write the JSON and the table now (after every section: a run cut short still leaves what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (out / "gpu-check.txt").write_text(text + "\n")
    return text


def section(results: dict, name: str, budget: Budget, need: float, fn, out: Path) -> None:
    if budget.left() < need:
        results[name] = {"skipped": f"time budget ({budget.left():.0f} s left, needs about {need:.0f} s)"}
        return
    start = time.monotonic()
    try:
        results[name] = fn()
    except Exception as e:  # recorded, and the next section still runs
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    if isinstance(results[name], dict):
        results[name]["seconds"] = round(time.monotonic() - start, 1)
    print(f"[gpu-check] {name}: {json.dumps(results[name])[:400]}", flush=True)
    save(results, out)


def table(results: dict) -> str:
    lines = [f"bivit gpu-check ({'DRY RUN on CPU, toy model: no GPU figure' if results['dry_run'] else 'GPU'}): "
             f"{results['environment'].get('device') or 'cpu'}"]
    inv = results.get("invariance", {})
    for mode in ("invariant", "default"):
        if mode in inv:
            r = inv[mode]
            lines.append(f"  invariance {mode:<9}: " + ", ".join(f"{k} {v}/{r['items']}" for k, v in r.items()
                                                              if k.endswith("equal")))
    g = results.get("guard", {})
    if "ok" in g:
        lines.append(f"  guard (no cuBLAS/SDPA in invariant forward): {'ok' if g['ok'] else 'FAILED'} "
                     f"{g.get('forbidden') or ''}")
    p = results.get("parity", {})
    for d in ("float32", "bfloat16"):
        if d in p:
            lines.append(f"  parity vs CPU fp32, GPU {d:<8}: max abs {p[d]['max_abs']:.3g} "
                         f"({p[d]['max_rel_to_scale']:.3g} of max |ref|)")
    for size, row in results.get("throughput", {}).items():
        if isinstance(row, dict) and "invariant" in row:
            lines.append(f"  images/s {size:<8}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "seconds"))
    for name, r in results.items():
        if isinstance(r, dict) and ("error" in r or "skipped" in r):
            lines.append(f"  {name}: {r.get('error') or r.get('skipped')}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy model, Triton interpreter")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-results"))
    parser.add_argument("--budget-s", type=float, default=360.0, help="stop starting sections after this")
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()
    budget = Budget(args.budget_s)
    if args.dry_run:
        device, cfg, dtype = torch.device("cpu"), TOY, torch.float32
        item_sizes, speed_sizes, batch, iters = [(56, 56), (84, 28), (28, 112)], [(56, 56), (112, 84)], 2, 1
    else:
        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
            return 2
        device, cfg, dtype = torch.device("cuda"), PRESETS["kimi-k2.5"], torch.bfloat16
        item_sizes, speed_sizes, batch, iters = ([(448, 448), (896, 672), (224, 336), (1344, 756), (28, 28)],
                                                 [(448, 448), (896, 672)], 8, 5)
    results: dict = {"dry_run": args.dry_run, "command": " ".join([sys.executable] + sys.argv),
                     "environment": gpu.facts(device, True) | {"python": sys.version.split()[0]}}
    print(f"[gpu-check] {json.dumps(results['environment'])}", flush=True)
    state = random_state_dict(cfg, 0)
    net = build(cfg, dtype, device, state)
    run = Runner(net, device)
    items = [(grid_of(w, h), make_pixels(grid_of(w, h), i, device).to(dtype)) for i, (w, h) in enumerate(item_sizes)]
    video = grid_of(*item_sizes[0], frames=4)
    items.append((video, make_pixels(video, 50, device).to(dtype)))  # a 4-frame chunk: the temporal mean

    section(results, "invariance", budget, 30, lambda: invariance(run, items, args.streams), args.out)
    section(results, "guard", budget, 10, lambda: guard(run, *items[0]), args.out)
    section(results, "parity", budget, 40, lambda: parity(cfg, state, device, items[0][0], items[0][1].float()), args.out)
    hf = None
    try:
        hf = transformers_tower(cfg, state, device, dtype)
    except Exception as e:  # the baseline is optional: recorded, the rest still runs
        results["transformers"] = {"error": f"{type(e).__name__}: {e}"}
    section(results, "throughput", budget, 30, lambda: throughput(run, speed_sizes, batch, iters, budget, hf), args.out)

    if device.type == "cuda":
        results["environment"]["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(save(results, args.out))
    inv, g = results.get("invariance", {}).get("invariant", {}), results.get("guard", {})
    return 0 if inv.get("ok") and g.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
