"""The GPU check of bivit's invariant path: one run that brings back every number (scripts/gpu-check.sh runs it;
docs/gpu.md says how to read it).

Sections, each on its own (a failure is recorded in its JSON and the next section runs), each written to
`<out>/<section>.json` as soon as it ends, then a one-screen `summary.txt`:
  preflight    one line per need (python and its pip, CUDA device, driver, libcuda, C compiler, Python.h, torch
               and triton versions against the gpu extra, free memory, TRITON_CACHE_DIR), the carried wheels
               installed for what is missing, and a bf16 `tl.dot` smoke launch of bivit's GEMM kernel
  correctness  invariant (Triton) vs stock PyTorch (cuBLAS, SDPA) forward on the same GPU, fp32 and bf16
  invariance   items (images and a video chunk) alone vs packed vs reversed, at 2 batch sizes, bit for bit;
               on a difference, the first op where the item departs
  ops          each GEMM shape of the model vs torch.matmul (cuBLAS), attention vs SDPA: TFLOP/s, CUDA events,
               >= 20 iterations after warm-up; registers and spills of the kernels this GPU's triton compiled
  model        images/s, invariant vs stock: 448x448 x64, 896x672 x16, a video (4-frame chunks of 448x448 x16)
  cross_device GPU rows vs bivit's CPU rows (fp32, invariant) on the same weights and pixels
Full-size Kimi-K2.5 vision model with seeded random weights: nothing is downloaded.

`--dry-run` runs every section on the CPU under Triton's interpreter at toy size (fp16 stands in for bf16: the
interpreter's bf16 dot is wrong); its numbers say nothing about a GPU. `--fail SECTION` makes that section raise
(the suite uses it to show a failing section is recorded while the others run).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("preflight", "correctness", "invariance", "ops", "model", "cross_device")
NEEDED = ("numpy", "safetensors", "packaging")  # what the check imports beyond torch and triton (no PyAV, no PIL)
SITE = Path("/tmp/bivit-gpu-site")  # carried wheels install here (--target: no PEP 668 refusal, system untouched)
# Tolerances of the correctness section, relative to max|stock|: fp32 dots are IEEE on both sides (TF32 off),
# bf16 rounds each op's output on both sides in different places (fused epilogues, flash attention's blocks).
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
TARGETS = {"invariant_over_stock_min": 0.77, "images_per_s_448x448_min": 300.0}


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, toy model, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="fewer shapes and iterations: under 3 minutes on an H200")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else
                   ROOT / "gpu-check-results", help="folder for the JSON files (default: $OUT when set)")
    p.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels", help="carried wheels")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting work after this (default 450, quick 160)")
    p.add_argument("--fail", choices=SECTIONS, action="append", default=[], help="make a section raise (tests)")
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 160.0 if args.quick else 450.0
    return args


# ----------------------------------------------------------------------------------------------- preflight

def install_missing(wheels: Path) -> list[dict]:
    """Install what the check needs and lacks from the carried wheels (never from a network)."""
    lines = []
    for name in NEEDED:
        if importlib.util.find_spec(name) is not None:
            continue
        found = sorted(wheels.glob(f"{name}-*.whl"))
        if not found:
            lines.append({"need": f"module {name}", "ok": False,
                          "detail": f"missing, and no wheel in {wheels} (run scripts/gpu-check.sh --fetch-wheels "
                                    "where there is a network, and carry the folder)"})
            continue
        run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                              "--no-compile", "--target", str(SITE), str(found[-1])], capture_output=True, text=True)
        lines.append({"need": f"module {name}", "ok": run.returncode == 0,
                      "detail": f"installed from {found[-1].name} into {SITE}" if run.returncode == 0
                      else run.stderr.strip()[-300:]})
    if SITE.is_dir() and str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
    importlib.invalidate_caches()
    return lines


def preflight(ctx) -> dict:
    import torch

    from bivit.kernels.cuda import gpu_extra, triton_mismatch, triton_version

    lines = ctx.installed[:]

    def need(name, ok, detail):
        lines.append({"need": name, "ok": bool(ok), "detail": str(detail)})

    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    need("python and its pip", pip.returncode == 0, f"{sys.executable} {platform.python_version()}; "
         + (pip.stdout.strip() or pip.stderr.strip()[-200:]))
    managed = Path(sysconfig.get_paths()["stdlib"]) / "EXTERNALLY-MANAGED"
    need("pip may install (PEP 668)", True, f"{'externally managed' if managed.exists() else 'not managed'}; "
         f"wheels go to --target {SITE} either way")
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        need("CUDA device", True, f"{props.name}, capability {props.major}.{props.minor}, "
             f"{props.multi_processor_count} SMs")
        smi = shutil.which("nvidia-smi")
        driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip() if smi else "nvidia-smi not on PATH"
        need("driver", bool(driver), f"{driver}; CUDA runtime of torch {torch.version.cuda}")
        free, total = torch.cuda.mem_get_info(ctx.device)
        need("free GPU memory", free > 20 * 2**30, f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB")
        try:
            from triton.backends.nvidia.driver import libcuda_dirs

            need("libcuda", True, libcuda_dirs())
        except Exception as e:  # noqa: BLE001 - reported, not raised
            need("libcuda", False, f"{type(e).__name__}: {e}")
    else:
        need("CUDA device", True, "none: dry run on the CPU (Triton interpreter)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    need("C compiler (Triton's launcher)", cc, cc or "none: set CC or install gcc")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    need("Python.h (Triton's launcher)", header.exists(), header)
    torch_pin = [r for r in (importlib.metadata.requires("torch") or []) if r.startswith("triton")]
    unlisted = triton_mismatch()
    need("torch and triton", unlisted is None, f"torch {torch.__version__} (pins {torch_pin or 'no triton'}), "
         f"triton {triton_version()}, gpu extra {gpu_extra()}" + (f": {unlisted}" if unlisted else ""))
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / ".bivit-write-test").write_text("ok")
        need("TRITON_CACHE_DIR writable", True, cache)
    except OSError as e:
        need("TRITON_CACHE_DIR writable", False, f"{cache}: {e}")
    lines.append(smoke(ctx))
    return {"needs": lines, "ok": all(line["ok"] for line in lines)}


def smoke(ctx) -> dict:
    """One launch of bivit's GEMM kernel (a 16-bit `tl.dot` on wgmma): compiler, launcher, driver all work."""
    import torch

    from bivit.kernels import triton_jit

    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(256, 192, generator=g).to(ctx.dtype16).to(ctx.device) for _ in range(2))
    start = time.monotonic()
    with ctx.triton():
        y = triton_jit.gemm(x, w, None)
    ref = (x.float() @ w.float().T).to(ctx.dtype16)
    err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
    return {"need": f"{str(ctx.dtype16).removeprefix('torch.')} tl.dot smoke (bivit GEMM kernel, JIT)",
            "ok": err < 1e-2, "detail": f"max rel diff to torch {err:.2e}, {time.monotonic() - start:.1f} s with JIT"}


# ------------------------------------------------------------------------------------------ the model runs

class Context:
    """The device, the dtypes, the model's weights and the sizes of this run."""

    def __init__(self, args) -> None:
        import torch

        from bivit.checkpoint.config import PRESETS

        self.args = args
        self.dry = args.dry_run
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.dtype16 = torch.float16 if self.dry else torch.bfloat16
        if self.dry:
            self.cfg = PRESETS["demo"].replace(num_layers=1)
            self.items = [(56, 28, 1), (28, 56, 1), (28, 28, 2)]
            self.speed = [("56x56", (56, 56, 1), 2)]
            self.cross = (56, 28, 1)
            self.iters = 2
        else:
            self.cfg = PRESETS["kimi-k2.5"]
            self.items = [(448, 448, 1), (896, 672, 1), (224, 336, 1), (28, 28, 1), (448, 448, 4)]
            self.speed = [("448x448", (448, 448, 1), 64)] + ([] if args.quick else [
                ("896x672", (896, 672, 1), 16), ("video 4x448x448", (448, 448, 4), 16)])
            self.cross = (224, 224, 1)
            self.iters = 20
        self.installed: list = []
        self._state = None
        self._nets: dict = {}

    def triton(self):
        """The context the Triton path needs here: none on a GPU, the interpreter's routing on a CPU."""
        import contextlib

        from bivit.ops.dispatch import interpreted

        return interpreted() if self.dry else contextlib.nullcontext()

    def state(self):
        from bivit.checkpoint.state_dict import random_state_dict

        if self._state is None:
            self._state = random_state_dict(self.cfg, 0)
        return self._state

    def net(self, dtype, device=None):
        import torch

        from bivit.model import VisionModel

        key = (dtype, device or self.device)
        if key not in self._nets:
            with torch.device("meta"):
                net = VisionModel(self.cfg)
            net.load_state_dict(self.state(), strict=True, assign=True)
            self._nets[key] = net.to(device=key[1], dtype=dtype).eval()
        return self._nets[key]

    def pixels(self, size, seed: int, dtype):
        import torch

        w, h, t = size
        n = t * (h // 14) * (w // 14)
        g = torch.Generator().manual_seed(seed)
        return torch.rand(n, 3, 14, 14, generator=g).mul_(2).sub_(1).to(device=self.device, dtype=dtype)

    def forward(self, net, sizes, pixels, invariant: bool):
        import torch

        from bivit import ops

        grids = torch.tensor([(t, h // 14, w // 14) for w, h, t in sizes])
        with torch.inference_mode(), ops.batch_invariant(invariant):
            if invariant:
                with self.triton():
                    return net(torch.cat(pixels), grids)
            return net(torch.cat(pixels), grids)

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def seconds_per_call(self, fn, iters: int) -> float:
        """Mean seconds of `fn` over `iters` calls after one warm-up: CUDA events on a GPU, wall time on a CPU."""
        import torch

        fn()
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) / iters
        self.sync()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000 / iters


def _diff(a, b) -> dict:
    err = (a.float() - b.float()).abs()
    scale = float(b.float().abs().max())
    return {"max_abs": float(err.max()), "max_rel_to_scale": float(err.max()) / scale if scale else float("nan")}


def correctness(ctx) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # stock fp32 in IEEE float32 too, as the Triton kernels
    torch.backends.cudnn.allow_tf32 = False
    out = {"reference": "bivit default mode on the same device (cuBLAS GEMMs, SDPA)", "tolerance": TOLERANCE}
    sizes = [ctx.items[0], ctx.items[-1]]  # an image and the video chunk
    for dtype in (torch.float32, ctx.dtype16):
        net = ctx.net(dtype)
        pixels = [ctx.pixels(s, i, dtype) for i, s in enumerate(sizes)]
        ours = ctx.forward(net, sizes, pixels, True)
        stock = ctx.forward(net, sizes, pixels, False)
        name = str(dtype).removeprefix("torch.")
        rows = [_diff(a, b) for a, b in zip(ours, stock)]
        worst = max(r["max_rel_to_scale"] for r in rows)
        out[name] = {"items": rows, "worst_rel": worst, "ok": worst <= TOLERANCE[name],
                     "dtype_kept": all(a.dtype == b.dtype for a, b in zip(ours, stock))}
    out["ok"] = all(out[k]["ok"] and out[k]["dtype_kept"] for k in out if isinstance(out[k], dict) and "ok" in out[k])
    return out


def invariance(ctx) -> dict:
    from bivit.diagnose.divergence import first_difference

    dtype = ctx.dtype16
    net = ctx.net(dtype)
    items = ctx.items
    pixels = [ctx.pixels(s, i, dtype) for i, s in enumerate(items)]
    filler = (28 * 3, 28, 1)  # shifts every item to a row offset that is no multiple of any tile
    fill = [ctx.pixels(filler, 100 + i, dtype) for i in range(8)]
    out = {"dtype": str(dtype).removeprefix("torch."), "items": [f"{w}x{h}x{t}" for w, h, t in items]}
    for mode, invariant in (("invariant", True), ("default", False)):
        alone = [ctx.forward(net, [s], [p], invariant)[0] for s, p in zip(items, pixels)]
        small = ctx.forward(net, [filler] + items, fill[:1] + pixels, invariant)[1:]
        reverse = ctx.forward(net, items[::-1] + [filler], pixels[::-1] + fill[:1], invariant)[:-1][::-1]
        # a larger batch: fillers between the items
        sizes, pix, where = [], [], []
        for i, (s, p) in enumerate(zip(items, pixels)):
            sizes += [filler, s]
            pix += [fill[i % len(fill)], p]
            where.append(len(sizes) - 1)
        large_out = ctx.forward(net, sizes, pix, invariant)
        large = [large_out[i] for i in where]
        r = {"batch_sizes": [len(items) + 1, len(sizes)],
             "packed_equal": sum(map(_equal, alone, small)), "reversed_equal": sum(map(_equal, alone, reverse)),
             "large_batch_equal": sum(map(_equal, alone, large)),
             "max_abs_diff": max(float((a.float() - b.float()).abs().max()) for a, b in zip(alone, small + large))}
        r["ok"] = r["packed_equal"] == r["reversed_equal"] == r["large_batch_equal"] == len(items)
        if invariant and not r["ok"]:
            bad = next(i for i in range(len(items)) if not (_equal(alone[i], small[i]) and _equal(alone[i], large[i])))
            diff = first_difference(net, lambda: ctx.forward(net, [items[bad]], [pixels[bad]], True),
                                    lambda: ctx.forward(net, [items[bad]] + sizes, [pixels[bad]] + pix, True))
            r["first_difference"] = {"item": out["items"][bad], **(vars(diff) if diff else {"op": None})}
        out[mode] = r
    out["ok"] = out["invariant"]["ok"]
    return out


def _equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def ops_section(ctx) -> dict:
    import torch
    import torch.nn.functional as F

    from bivit.kernels.cuda import triton_version
    from bivit.kernels import triton_jit as K

    cfg, dtype, iters = ctx.cfg, ctx.dtype16, ctx.iters
    images, tokens = (2, 16) if ctx.dry else (64, 1024)  # 64 images of 448x448
    m = images * tokens
    d, f, a = cfg.hidden_size, cfg.intermediate_size, cfg.attn_width
    shapes = {"patch_conv": (m, d, 3 * cfg.patch_size ** 2), "qkv": (m, 3 * a, d), "attn_out": (m, d, a),
              "fc1": (m, f, d), "fc2": (m, d, f), "projector_1": (m // 4, 4 * d, 4 * d),
              "projector_2": (m // 4, cfg.text_hidden_size, 4 * d)}
    if ctx.args.quick:
        shapes = {k: shapes[k] for k in ("qkv", "fc1", "fc2")}
    g = torch.Generator().manual_seed(1)
    out = {"dtype": str(dtype).removeprefix("torch."), "iterations": iters, "gemm": {}}
    for name, (rows, n, k) in shapes.items():
        x = torch.randn(rows, k, generator=g).to(device=ctx.device, dtype=dtype)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device=ctx.device, dtype=dtype)
        b = torch.randn(n, generator=g).to(device=ctx.device, dtype=dtype)
        flop = 2 * rows * n * k
        with ctx.triton():
            ours = ctx.seconds_per_call(lambda: K.gemm(x, w, b), iters)
        stock = ctx.seconds_per_call(lambda: F.linear(x, w, b), iters)
        out["gemm"][name] = {"m_n_k": [rows, n, k], "triton_tflops": flop / ours / 1e12,
                             "cublas_tflops": flop / stock / 1e12, "triton_over_cublas": stock / ours}
        del x, w, b
    heads, hd = cfg.num_heads, cfg.head_dim
    q, k, v = (torch.randn(m, heads, hd, generator=g).to(device=ctx.device, dtype=dtype) for _ in range(3))
    seqlens = [tokens] * images
    flop = 4 * images * tokens * tokens * hd * heads
    with ctx.triton():
        ours = ctx.seconds_per_call(lambda: K.attention(q, k, v, seqlens), iters)
    q4, k4, v4 = (t.view(images, tokens, heads, hd).transpose(1, 2) for t in (q, k, v))
    stock = ctx.seconds_per_call(lambda: F.scaled_dot_product_attention(q4, k4, v4), iters)
    out["attention"] = {"items_tokens_heads_dim": [images, tokens, heads, hd], "triton_tflops": flop / ours / 1e12,
                        "sdpa_tflops": flop / stock / 1e12, "triton_over_sdpa": stock / ours}
    out["compiled"] = compiled_kernels(ctx, K) if not ctx.dry else "interpreter: nothing compiled"
    out["triton"] = triton_version()
    return out


def compiled_kernels(ctx, K) -> list | str:
    """Registers and spills of every kernel variant this GPU's triton compiled in this process (its JIT cache:
    a Triton internal, so read defensively)."""
    rows = []
    try:
        for kernel in (K.gemm_kernel, K.norm_kernel, K.rope_kernel, K.attention_kernel, K.frame_mean_kernel):
            for caches in kernel.device_caches.values():
                for compiled in caches[0].values():
                    rows.append({"kernel": kernel.fn.__name__, "registers": compiled.n_regs,
                                 "spills": compiled.n_spills, "num_stages": compiled.metadata.num_stages,
                                 "num_warps": compiled.metadata.num_warps})
    except Exception as e:  # noqa: BLE001 - a changed internal loses this table only
        return f"not read: {type(e).__name__}: {e}"
    return rows


def model_section(ctx) -> dict:
    net = ctx.net(ctx.dtype16)
    out = {"dtype": str(ctx.dtype16).removeprefix("torch."), "targets": TARGETS, "cases": {}}
    for name, size, batch in ctx.speed:
        if ctx.budget.left() < 40 and not ctx.dry:
            out["cases"][name] = {"skipped": f"time budget ({ctx.budget.left():.0f} s left)"}
            continue
        pixels = [ctx.pixels(size, i, ctx.dtype16) for i in range(batch)]
        iters = 1 if ctx.dry else 3
        row = {"batch": batch}
        for mode, invariant in (("invariant", True), ("stock", False)):
            sec = ctx.seconds_per_call(lambda: ctx.forward(net, [size] * batch, pixels, invariant), iters)
            row[f"{mode}_images_per_s"] = batch / sec
        row["invariant_over_stock"] = row["invariant_images_per_s"] / row["stock_images_per_s"]
        out["cases"][name] = row
    first = out["cases"].get("448x448", {})
    if "invariant_images_per_s" in first and not ctx.dry:
        out["targets_met"] = {"invariant_over_stock": first["invariant_over_stock"] >= TARGETS["invariant_over_stock_min"],
                              "images_per_s_448x448": first["invariant_images_per_s"] >= TARGETS["images_per_s_448x448_min"]}
    return out


def cross_device(ctx) -> dict:
    import torch

    size = ctx.cross
    cpu_pixels = ctx.pixels(size, 7, torch.float32).cpu()
    cpu = ctx.net(torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        from bivit import ops

        with ops.batch_invariant(True):
            ref = cpu(cpu_pixels, torch.tensor([(size[2], size[1] // 14, size[0] // 14)]))[0]
    out = {"reference": "bivit CPU forward, fp32, invariant mode (bivit's compiled CPU kernels)",
           "why_not_equal": "different arithmetic: the GPU's tiles, wgmma/FMA accumulation order and exp/erf "
                            "against the CPU kernels' own order; each is fixed per device, neither is the other",
           "item": f"{size[0]}x{size[1]}x{size[2]}"}
    for dtype in (torch.float32, ctx.dtype16):
        ours = ctx.forward(ctx.net(dtype), [size], [cpu_pixels.to(device=ctx.device, dtype=dtype)], True)[0]
        out[str(dtype).removeprefix("torch.")] = _diff(ours.cpu(), ref) | {"equal": bool(torch.equal(ours.cpu(), ref))}
    return out


# ------------------------------------------------------------------------------------------------ running

def run_section(ctx, name: str, fn, results: dict) -> None:
    start = time.monotonic()
    try:
        if name in ctx.args.fail:
            raise RuntimeError(f"injected failure (--fail {name})")
        if ctx.budget.left() <= 0:
            results[name] = {"skipped": "time budget spent"}
        else:
            results[name] = fn(ctx)
    except Exception as e:  # noqa: BLE001 - recorded; the next section runs
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    results[name]["seconds"] = round(time.monotonic() - start, 1)
    ctx.args.out.mkdir(parents=True, exist_ok=True)
    (ctx.args.out / f"{name}.json").write_text(json.dumps(results[name], indent=1, default=str))
    print(f"[gpu-check] {name}: {'error' if 'error' in results[name] else 'done'} in {results[name]['seconds']} s",
          flush=True)


def summary(results: dict, ctx) -> str:
    head = "DRY RUN on the CPU (interpreter, toy model): no GPU figure" if ctx.dry else "GPU"
    lines = [f"bivit gpu-check ({head}), {sum(r['seconds'] for r in results.values()):.0f} s"]
    for name in SECTIONS:
        r = results.get(name, {})
        state = ("ERROR " + r["error"][:90]) if "error" in r else r.get("skipped") or (
            "ok" if r.get("ok", True) else "FAILED")
        lines.append(f"{name:<13}{state}  ({r.get('seconds', 0)} s)")
        if name == "preflight" and "needs" in r:
            lines += [f"  {'ok  ' if n['ok'] else 'FAIL'} {n['need']}: {n['detail'][:100]}" for n in r["needs"]]
        if name == "correctness" and "error" not in r:
            lines += [f"  {k}: worst {v['worst_rel']:.2e} of max|stock| (tolerance {TOLERANCE[k]:g})"
                      for k, v in r.items() if isinstance(v, dict) and "worst_rel" in v]
        if name == "invariance" and "invariant" in r:
            for mode in ("invariant", "default"):
                m = r[mode]
                lines.append(f"  {mode:<9} packed {m['packed_equal']}, reversed {m['reversed_equal']}, large batch "
                             f"{m['large_batch_equal']} of {len(r['items'])} bit-identical"
                             + (f"; first difference {m['first_difference']}" if "first_difference" in m else ""))
        if name == "ops" and "gemm" in r:
            lines += [f"  {k:<11} triton {v['triton_tflops']:.3g} TFLOP/s, cuBLAS {v['cublas_tflops']:.3g} "
                      f"({v['triton_over_cublas']:.2f}x)" for k, v in r["gemm"].items()]
            a = r["attention"]
            lines.append(f"  attention   triton {a['triton_tflops']:.3g} TFLOP/s, SDPA {a['sdpa_tflops']:.3g} "
                         f"({a['triton_over_sdpa']:.2f}x)")
        if name == "model" and "cases" in r:
            lines += [f"  {k:<16} " + (v.get("skipped") or f"invariant {v['invariant_images_per_s']:.1f}/s, stock "
                      f"{v['stock_images_per_s']:.1f}/s ({v['invariant_over_stock']:.2f}x)") for k, v in r["cases"].items()]
        if name == "cross_device" and "float32" in r:
            lines += [f"  {k}: max abs {r[k]['max_abs']:.2e} ({r[k]['max_rel_to_scale']:.2e} of max|CPU|)"
                      for k in r if isinstance(r[k], dict) and "max_abs" in r[k]]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    installed = install_missing(args.wheels)
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); --dry-run runs on a CPU",
              file=sys.stderr)
        return 2
    ctx = Context(args)
    ctx.installed, ctx.budget = installed, Budget(args.budget_s)
    results: dict = {}
    for name, fn in zip(SECTIONS, (preflight, correctness, invariance, ops_section, model_section, cross_device)):
        run_section(ctx, name, fn, results)
    text = summary(results, ctx)
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)
    failed = [n for n, r in results.items() if "error" in r or r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
