"""`bivit bench`: bivit (invariant and default mode) against the transformers port, on one fixed input mix.

How the numbers are made (they are meant to be compared *within* one run, on one machine):

* **Same weights, same pixels.** One seeded random state dict is written once as a Moonshot-layout bf16
  checkpoint with a transformers-native config.json; bivit and `transformers.Kimi_K25Model` both load that
  directory (the port converts the layout on load). The inputs are preprocessed once by the parent and handed
  to every implementation as the same float32 pixels; each implementation's timed call includes its own cast
  to the compute dtype. A parity line (max relative difference to the port) proves both ran the same model.
* **One worker process per implementation.** Each is spawned fresh and holds its model for the whole run; the
  parent sends "run case c" to one worker at a time and waits, so workers never compete for the cores.
  Repeats are interleaved (round r, case c: A B C, the starting implementation rotating per round) so that
  the noise of a shared machine lands on every implementation alike; reported times are medians.
* **Memory is per process.** A worker reads its own peak resident set size from `/proc/self/status`
  (VmHWM), resets that high-water mark after loading (`/proc/self/clear_refs`), and reports the load peak, the
  resident size once loaded, and the run peak (the high-water mark over warm-up and timed runs). We do not
  use `getrusage(RUSAGE_SELF).ru_maxrss` as the primary number: Linux folds the high-water mark of the forked
  pre-exec image into it, so a spawned child can inherit its parent's peak; and it cannot be reset. It is
  still recorded in the JSON. Off Linux, ru_maxrss is all there is and the run peak is not separable.
* **FLOPs** are the useful work: `bivit.model.flops_per_item` (GEMMs incl. the patch conv and projector, plus
  attention's two matmuls per item), verified against `torch.utils.flop_counter` by the tests. Invariant mode
  executes more (zero-padded GEMM tiles); that is a cost, not extra work, so it is not counted.
* **GEMM peak**: best-of-3 `F.linear` GFLOP/s at the tower's GEMM shapes with 2048 rows, measured in every
  round between the workers' turns; the best over shapes and rounds is "the peak". Also recorded: the same
  GEMMs at invariant mode's largest tile. "GEMM roofline" = (the item's GEMM FLOPs at peak speed) / measured
  time: 1.0 would mean nothing but GEMMs, all at peak.
* **Roofline per case**: the time the case's GEMM FLOPs take at the GEMM peak plus the time its attention
  FLOPs take at the rate of PyTorch's fused attention (SDPA), measured at each item's sequence length in
  every round too (best of 3 per round, best over rounds). "% of roofline" = that time / measured time: how
  close an implementation comes to doing nothing but the two essential kernels, each at its measured speed.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .config import PRESETS, ModelConfig
from .dtypes import parse_dtype
from .errors import BivitError
from .fileio import write_atomic
from .media import MediaBatch, frames_to_item
from .model import VisionModel, flops_per_item, gemms

IMPLS = ("bivit-invariant", "bivit-default", "hf-sdpa")
BIVIT_IMPLS = IMPLS[:2]
HF_IMPL = "hf-sdpa"
DTYPE_CHOICES = {"bfloat16": ("bfloat16",), "float32": ("float32",), "both": ("bfloat16", "float32")}
TORCH_DTYPES = {name: parse_dtype(name, "--dtype") for name in ("bfloat16", "float32")}  # what bench runs
PEAK_ROWS = 2048
GEMM_TRIES = 3


# ------------------------------------------------------------------------------------------------ workload

@dataclass
class Case:
    """One timed call: a packed batch of items encoded by one forward pass."""

    name: str
    batch: MediaBatch

    @property
    def items(self) -> int:
        return len(self.batch)

    @property
    def patches(self) -> int:
        return sum(self.batch.patch_counts)

    @property
    def tokens(self) -> int:
        return sum(self.batch.token_counts)

    def grids(self) -> list[tuple[int, int, int]]:
        return [tuple(g) for g in self.batch.grid_thw.tolist()]


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """Random RGB pixels: compute on CPU does not depend on image content, only on its size."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def make_case(name: str, items: Sequence[Sequence[Image.Image]], patch_limit: int | None = None) -> Case:
    """Each entry of `items` is one item: one image, or the frames of one video chunk."""
    pixels, grids = [], []
    for frames in items:
        kwargs = {} if patch_limit is None else {"patch_limit": patch_limit}
        px, grid = frames_to_item(list(frames), **kwargs)
        pixels.append(px)
        grids.append(grid)
    batch = MediaBatch(torch.cat(pixels), torch.tensor(grids, dtype=torch.int64), None, [name] * len(grids))
    return Case(name, batch)


def standard_cases(seed: int = 0) -> list[Case]:
    """The fixed mix: a 1024-patch image, a 3072-patch one, 32 small images in one call, a 4-frame chunk."""
    return [
        make_case("image 448x448", [[noise_image(448, 448, seed)]]),
        make_case("image 896x672", [[noise_image(896, 672, seed + 1)]]),
        make_case("32 images 112x112", [[noise_image(112, 112, seed + 2 + i)] for i in range(32)]),
        # Frames get the video budget of 4096 patches per frame: 448x252 is 32 x 18 patches, no resize or padding.
        make_case("video chunk 4x448x252", [[noise_image(448, 252, seed + 40 + f) for f in range(4)]],
                  patch_limit=4096),
    ]


def square_case(patches: int, seed: int = 0) -> Case:
    """One square image of exactly `patches` patches (a perfect square of an even side, <= 16384)."""
    side = int(round(patches ** 0.5))
    if side * side != patches or side % 2 or patches > 16384:
        raise BivitError(f"{patches} patches: need an even square side and at most 16384 patches")
    return make_case(f"{patches} patches", [[noise_image(side * 14, side * 14, seed)]])


# --------------------------------------------------------------------------------------------------- FLOPs

def attention_flops_per_item(cfg: ModelConfig, t: int, h: int, w: int) -> int:
    """QK^T and PV over all t*h*w patches of the item (they attend to each other, to nothing else)."""
    n = t * h * w
    return cfg.num_layers * 2 * 2 * n * n * cfg.attn_width


def gemm_flops_per_item(cfg: ModelConfig, t: int, h: int, w: int) -> int:
    """FLOPs of the GEMM-shaped work of one item: every linear, the patch conv, the projector."""
    return flops_per_item(cfg, t, h, w) - attention_flops_per_item(cfg, t, h, w)


def case_flops(cfg: ModelConfig, case: Case) -> tuple[int, int]:
    """(total FLOPs, GEMM FLOPs) of a case."""
    grids = case.grids()
    return (sum(flops_per_item(cfg, *g) for g in grids), sum(gemm_flops_per_item(cfg, *g) for g in grids))


def gemm_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of the GEMMs of one tower block (wqkv, wo, mlp.fc0, mlp.fc1), read off the model itself."""
    with torch.device("meta"):
        block = VisionModel(cfg.replace(num_layers=1)).vision_tower.encoder.blocks[0]
    return list(dict.fromkeys(tuple(w.shape) for w, *_ in gemms(block)))


def sdpa_gflops(dtype: torch.dtype, cfg: ModelConfig, lengths: Iterable[int], tries: int = GEMM_TRIES,
                seed: int = 0) -> dict[int, float]:
    """Best-of-`tries` GFLOP/s of PyTorch's fused attention for one item of n patches, per n in `lengths`."""
    g = torch.Generator().manual_seed(seed)
    result = {}
    with torch.inference_mode():
        for n in sorted(set(lengths)):
            q, k, v = (torch.randn(1, cfg.num_heads, n, cfg.head_dim, generator=g).to(dtype) for _ in range(3))
            F.scaled_dot_product_attention(q, k, v)
            best = float("inf")
            for _ in range(tries):
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v)
                best = min(best, time.perf_counter() - t0)
            result[n] = 4 * n * n * cfg.num_heads * cfg.head_dim / best / 1e9
    return result


def invariant_tile_rows() -> int:
    """Rows per GEMM call in invariant mode (the largest candidate tile of `bivit.ops`)."""
    from . import ops

    return int(getattr(ops, "TILE_ROWS", None) or max(getattr(ops, "CANDIDATE_TILES", (256,))))


def gemm_gflops(dtype: torch.dtype, shapes: Iterable[tuple[int, int]], rows: int, tries: int = GEMM_TRIES,
                seed: int = 0) -> dict[str, float]:
    """Best-of-`tries` GFLOP/s of `F.linear` (with bias, as the model calls it) per (out, in) shape."""
    g = torch.Generator().manual_seed(seed)
    result = {}
    with torch.inference_mode():
        for n, k in shapes:
            x = torch.randn(rows, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            F.linear(x, w, b)  # the first call at a shape may pick or JIT a kernel
            best = float("inf")
            for _ in range(tries):
                t0 = time.perf_counter()
                F.linear(x, w, b)
                best = min(best, time.perf_counter() - t0)
            result[f"{n}x{k}"] = 2 * rows * n * k / best / 1e9
    return result


# -------------------------------------------------------------------------------------------------- memory

def _status_kib() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0). False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_snapshot() -> dict[str, float | None]:
    """Resident set size now and its high-water mark, in MiB (VmRSS / VmHWM, else ru_maxrss)."""
    st = _status_kib()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    maxrss_kib = maxrss / 1024 if sys.platform == "darwin" else maxrss  # bytes on macOS, KiB on Linux
    return {"rss_mib": st["VmRSS"] / 1024 if "VmRSS" in st else None,
            "hwm_mib": st["VmHWM"] / 1024 if "VmHWM" in st else maxrss_kib / 1024,
            "ru_maxrss_mib": maxrss_kib / 1024}


# ------------------------------------------------------------------------------------------- checkpoint

def hf_supports(cfg: ModelConfig) -> bool:
    """The transformers port implements the K2.x design only (LayerNorm, patchmerger, attention width = D)."""
    return (cfg.projector_type == "patchmerger" and cfg.norm_type == "layernorm"
            and cfg.attn_width == cfg.hidden_size and cfg.pos_emb_interpolation == "bicubic")


def write_checkpoint(directory: Path, preset: str, seed: int = 0) -> Path:
    """Seeded random weights of `preset`, bf16 on disk like the published checkpoint."""
    from .checkpoint import random_state_dict, save_checkpoint, transformers_config_dict

    # A transformers-native config.json, which bivit reads too: one directory serves both implementations.
    cfg = PRESETS[preset]
    config = transformers_config_dict(cfg) if hf_supports(cfg) else None
    return save_checkpoint(directory, cfg, random_state_dict(cfg, seed), dtype=torch.bfloat16, config=config)


def _write_checkpoint_child(directory: str, preset: str, seed: int) -> None:
    write_checkpoint(Path(directory), preset, seed)


def write_checkpoint_isolated(directory: Path, preset: str, seed: int = 0) -> None:
    """Write the checkpoint in a child process, so the fp32 random weights never inflate this process."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=_write_checkpoint_child,
                                                         args=(str(directory), preset, seed))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise BivitError(f"writing the benchmark checkpoint to {directory} failed (exit code {proc.exitcode})")


def save_cases(path: Path, cases: Sequence[Case]) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for i, c in enumerate(cases):
        tensors[f"{i}.pixel_values"] = c.batch.pixel_values.contiguous()
        tensors[f"{i}.grid_thw"] = c.batch.grid_thw.contiguous()
    save_file(tensors, str(path), metadata={"names": json.dumps([c.name for c in cases])})


def load_cases(path: Path) -> list[Case]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = json.loads(f.metadata()["names"])
        return [Case(name, MediaBatch(f.get_tensor(f"{i}.pixel_values"), f.get_tensor(f"{i}.grid_thw"), None,
                                      [name])) for i, name in enumerate(names)]


# ------------------------------------------------------------------------------------------------- runners

def load_runner(impl: str, checkpoint: Path, dtype: str) -> Callable[[MediaBatch], list[torch.Tensor]]:
    """A callable batch -> one embedding per item, for one implementation. Load time is not timed by callers."""
    if impl in BIVIT_IMPLS:
        from .encoder import load_encoder

        enc = load_encoder(checkpoint, dtype=dtype, batch_invariant=impl == "bivit-invariant")
        return enc.encode_batch
    if impl == HF_IMPL:
        return _hf_runner(checkpoint, TORCH_DTYPES[dtype])
    raise BivitError(f"unknown implementation {impl!r}")


def _hf_runner(checkpoint: Path, dtype: torch.dtype) -> Callable[[MediaBatch], list[torch.Tensor]]:
    import transformers
    from transformers import Kimi_K25Model

    transformers.logging.set_verbosity_error()  # the stand-in text model's "newly initialized" notice
    transformers.logging.disable_progress_bar()
    model = Kimi_K25Model.from_pretrained(str(checkpoint), dtype=dtype, attn_implementation="sdpa").eval()
    merge = model.vision_tower.merge_kernel_size

    def run(batch: MediaBatch) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        grids = batch.grid_thw
        counts = batch.patch_counts
        with torch.inference_mode():
            pixels = batch.pixel_values.to(dtype)  # the port expects the caller to cast
            # The port cannot mix chunk lengths in one call (its merge index concatenates differently shaped
            # tensors), and get_image_features splits multi-frame outputs wrongly: run runs of equal t, and
            # multi-frame ones through the tower and projector directly (spec section 8).
            i = 0
            while i < len(counts):
                j = i
                while j < len(counts) and int(grids[j, 0]) == int(grids[i, 0]):
                    j += 1
                px = pixels[sum(counts[:i]):sum(counts[:j])]
                g = grids[i:j]
                if int(g[0, 0]) == 1:
                    out.extend(model.get_image_features(px, g).pooler_output)
                else:
                    pooled = model.vision_tower(px, grid_thw=g).pooler_output
                    emb = model.mm_projector(pooled).squeeze(1)
                    out.extend(emb.split([(int(h) // merge[0]) * (int(w) // merge[1]) for _, h, w in g.tolist()]))
                i = j
        return out

    return run


def hf_unavailable_reason(cfg: ModelConfig) -> str | None:
    """Why the transformers comparison cannot run here, or None."""
    if not hf_supports(cfg):
        return "the transformers port implements only the Kimi-K2.x vision design"
    try:
        import transformers
    except ImportError:
        return "transformers is not installed (pip install transformers==5.23.0, or the 'test' extra)"
    if not hasattr(transformers, "Kimi_K25Model"):
        return f"transformers {transformers.__version__} has no Kimi_K25Model (needs 5.23.0)"
    return None


# -------------------------------------------------------------------------------------------------- workers

def source_hash() -> str:
    """Short hash of the bivit sources this process has imported: the lead edits them while benchmarks run, so
    the record says which version every worker measured."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(m for m in sys.modules if m == "bivit" or m.startswith("bivit.")):
        path = getattr(sys.modules[name], "__file__", None)
        if path and os.path.isfile(path):
            h.update(name.encode())
            h.update(Path(path).read_bytes())
    return h.hexdigest()[:12]


def count_subnormals(runner: Callable[[MediaBatch], Any], batch: MediaBatch) -> dict[str, int]:
    """Subnormal values among all op outputs of one bivit forward (`bivit.ops.trace`). Random weights at the
    wrong scale make a deep tower chaotic and full of denormals, which time the FPU's slow path, not the model:
    the benchmark weights (std 1/sqrt(fan_in)) must show none."""
    from . import ops

    counts = {"subnormal": 0, "values": 0}

    def seen(kind: str, out: torch.Tensor) -> None:
        if out.is_floating_point():
            a = out.detach().abs()
            counts["subnormal"] += int(((a < torch.finfo(out.dtype).tiny) & (a > 0)).sum())
            counts["values"] += out.numel()

    with ops.trace(seen):
        runner(batch)
    return counts


def _timed(runner: Callable, batch: MediaBatch) -> tuple[float, float, list[torch.Tensor]]:
    """(wall seconds, CPU seconds of this process, outputs). On an oversubscribed machine wall time inflates
    while CPU time (all threads) stays near the work done: their ratio shows how contended a run was."""
    gc.collect()  # a collection inside the timed region would be noise
    c0, t0 = time.process_time(), time.perf_counter()
    out = runner(batch)
    return time.perf_counter() - t0, time.process_time() - c0, out


def _minor_faults() -> int:
    """Minor page faults of this process so far: each is a fresh 4 KiB page the kernel had to zero and map,
    which is what large short-lived allocations cost when the allocator returns them to the OS every time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _worker_main(conn, impl: str, checkpoint: str, dtype: str, threads: int, inputs: str) -> None:
    """Worker process: load one implementation, then serve ("run", case, want_output) requests until "close"."""
    try:
        from .allocator import tune

        tune()  # every implementation's worker alike (the port too); BIVIT_MALLOC_TUNE=0 turns it off
        torch.set_num_threads(threads)
        cases = load_cases(Path(inputs))
        mem = {"baseline": memory_snapshot()}
        t0 = time.perf_counter()
        runner = load_runner(impl, Path(checkpoint), dtype)
        load_s = time.perf_counter() - t0
        gc.collect()
        mem["loaded"] = memory_snapshot()
        mem["peak_reset"] = reset_peak_rss()
        conn.send(("ready", {"load_s": load_s, "memory": mem, "source": source_hash()}))
        while True:
            msg = conn.recv()
            if msg[0] == "run":
                _, index, want_output = msg
                faults = _minor_faults()
                seconds, cpu, out = _timed(runner, cases[index].batch)
                faults = _minor_faults() - faults
                payload = [o.float().numpy() for o in out] if want_output else None
                conn.send(("ok", {"seconds": seconds, "cpu_s": cpu, "minor_faults": faults, "items": len(out),
                                  "output": payload}))
            elif msg[0] == "subnormals":
                conn.send(("ok", count_subnormals(runner, cases[msg[1]].batch)))
            elif msg[0] == "memory":
                conn.send(("ok", memory_snapshot()))
            elif msg[0] == "reset_peak":
                conn.send(("ok", reset_peak_rss()))
            else:
                conn.send(("ok", None))
                return
    except BaseException as e:  # report anything to the parent as one line, then exit
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except (OSError, BrokenPipeError):
            pass


class Worker:
    """One implementation in its own spawned process (see the module docstring for why)."""

    def __init__(self, impl: str, checkpoint: Path, dtype: str, threads: int, inputs: Path) -> None:
        import multiprocessing

        self.impl = impl
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, impl, str(checkpoint), dtype, threads, str(inputs)),
                                daemon=True, name=f"bivit-bench-{impl}")
        self.proc.start()
        child.close()
        self.info = self._recv("ready")

    def _recv(self, expect: str = "ok") -> Any:
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise BivitError(f"benchmark worker {self.impl} died (exit code {self.proc.exitcode}); "
                                 "out of memory?")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise BivitError(f"benchmark worker {self.impl} closed its pipe (exit code {self.proc.exitcode})") from None
        if msg[0] == "error":
            raise BivitError(f"benchmark worker {self.impl}: {msg[1]}")
        if msg[0] != expect:
            raise BivitError(f"benchmark worker {self.impl}: unexpected reply {msg[0]!r}")
        return msg[1]

    def run(self, index: int, want_output: bool = False) -> dict:
        self.conn.send(("run", index, want_output))
        return self._recv()

    def memory(self) -> dict:
        self.conn.send(("memory",))
        return self._recv()

    def subnormals(self, index: int) -> dict:
        self.conn.send(("subnormals", index))
        return self._recv()

    def reset_peak(self) -> bool:
        self.conn.send(("reset_peak",))
        return self._recv()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("close",))
                self.conn.poll(10)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        self.conn.close()


class InProcessWorker:
    """The same interface in this process: for tests and debugging; memory numbers are then not per implementation."""

    def __init__(self, impl: str, checkpoint: Path, dtype: str, threads: int, inputs: Path) -> None:
        self.impl = impl
        torch.set_num_threads(threads)
        self.cases = load_cases(inputs)
        t0 = time.perf_counter()
        self.runner = load_runner(impl, checkpoint, dtype)
        self.info = {"load_s": time.perf_counter() - t0, "memory": None, "source": source_hash()}

    def run(self, index: int, want_output: bool = False) -> dict:
        seconds, cpu, out = _timed(self.runner, self.cases[index].batch)
        return {"seconds": seconds, "cpu_s": cpu, "minor_faults": None, "items": len(out),
                "output": [o.float().numpy() for o in out] if want_output else None}

    def memory(self) -> None:
        return None

    def subnormals(self, index: int) -> dict:
        return count_subnormals(self.runner, self.cases[index].batch)

    def reset_peak(self) -> bool:
        return False

    def close(self) -> None:
        self.runner = None


# ------------------------------------------------------------------------------------------------- running

def _rel_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> dict[str, float]:
    x, y = np.concatenate([t.ravel() for t in a]), np.concatenate([t.ravel() for t in b])
    scale = float(np.abs(y).max()) or 1.0
    d = np.abs(x.astype(np.float64) - y)
    return {"max_rel": float(d.max()) / scale, "mean_rel": float(d.mean()) / scale}


# CPU features that decide which bf16 GEMM and attention kernels run (AMX tiles or AVX-512 BF16 dot products).
CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")


def environment(threads: int) -> dict:
    from . import kernels

    model, present = kernels.cpu_info()
    cpu, flags = model or platform.processor(), [f for f in CPU_FLAGS if f in present]
    attention = "bivit compiled" if kernels.attention() is not None else "PyTorch SDPA"
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    try:
        import subprocess

        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        git = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": tf_version,
            "git_head": git,
            "cpu": cpu, "cpu_flags": flags, "attention": attention, "cpu_count": os.cpu_count(), "threads": threads,
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def cpu_flags_text(env: dict) -> str:
    """'amx_bf16: no, avx512_bf16: yes; attention: bivit compiled' for a report line."""
    have = env.get("cpu_flags")
    text = ("CPU flags unknown" if have is None
            else ", ".join(f"{f}: {'yes' if f in have else 'no'}" for f in ("amx_bf16", "avx512_bf16")))
    return text + (f"; attention: {env['attention']}" if env.get("attention") else "")


def command_line() -> str:
    """The command as typed: `bivit bench ...`, `python benchmarks/x.py ...` or `python -m bivit.bench ...`."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", os.path.relpath(argv[0])]
        argv = head + argv[1:]
    elif argv:
        argv[0] = os.path.basename(argv[0])
    return " ".join(shlex.quote(a) for a in argv)


def run_benchmark(*, preset: str = "kimi-k2.6", dtypes: Sequence[str] = ("bfloat16", "float32"),
                  impls: Sequence[str] = IMPLS, repeats: int = 3, warmup: int = 1, threads: int | None = None,
                  seed: int = 0, isolate: bool = True, cases: Sequence[Case] | None = None,
                  checkpoint: Path | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Run `impls` on `cases` (default: the standard mix) for each dtype, interleaved; returns the raw record.

    Raises BivitError for unusable options. The HF implementation is dropped (with the reason recorded under
    "skipped") when it cannot run here.
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if preset not in PRESETS:
        raise BivitError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    for d in dtypes:
        if d not in TORCH_DTYPES:
            raise BivitError(f"dtype {d!r}: expected bfloat16 or float32")
    for impl in impls:
        if impl not in IMPLS:
            raise BivitError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
    if repeats < 1 or warmup < 0:
        raise BivitError("repeats must be >= 1 and warmup >= 0")
    cfg = PRESETS[preset]
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    cases = list(cases) if cases is not None else standard_cases(seed)
    impls = list(impls)
    skipped: dict[str, str] = {}
    if HF_IMPL in impls:
        reason = hf_unavailable_reason(cfg)
        if reason:
            skipped[HF_IMPL] = reason
            impls.remove(HF_IMPL)
            log(f"bivit bench: transformers comparison skipped: {reason}")
    if not impls:
        raise BivitError("nothing to benchmark")

    record: dict[str, Any] = {
        "format": "bivit.bench/1", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "preset": preset,
        "config": cfg.to_dict(), "repeats": repeats, "warmup": warmup, "isolated": isolate,
        "env": environment(threads), "skipped": skipped, "impls": impls,
        "cases": [], "runs": {},
    }
    for c in cases:
        total, gemm = case_flops(cfg, c)
        record["cases"].append({"name": c.name, "items": c.items, "patches": c.patches, "tokens": c.tokens,
                                "grid_thw": c.batch.grid_thw.tolist(), "flops": total, "gemm_flops": gemm,
                                "attention_flops": [[t * h * w, attention_flops_per_item(cfg, t, h, w)]
                                                    for t, h, w in c.grids()]})

    with tempfile.TemporaryDirectory(prefix="bivit-bench-") as tmp:
        tmp = Path(tmp)
        if checkpoint is None:
            checkpoint = tmp / "checkpoint"
            t0 = time.perf_counter()
            log(f"writing a seeded random {preset} checkpoint (bf16) to {checkpoint} ...")
            (write_checkpoint_isolated if isolate else write_checkpoint)(checkpoint, preset, seed)
            log(f"  done in {time.perf_counter() - t0:.1f} s")
        inputs = tmp / "inputs.safetensors"
        save_cases(inputs, cases)
        for dtype in dtypes:
            record["runs"][dtype] = _run_dtype(cfg, dtype, impls, cases, checkpoint, inputs, repeats, warmup,
                                               threads, isolate, log)
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record["env"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return record


def _run_dtype(cfg, dtype, impls, cases, checkpoint, inputs, repeats, warmup, threads, isolate, log) -> dict:
    make = Worker if isolate else InProcessWorker
    workers: dict[str, Any] = {}
    out: dict[str, Any] = {"impls": {}, "gemm_peak": {"rows": PEAK_ROWS, "tile_rows": None, "rounds": []},
                           "parity": {}}
    tile_rows = invariant_tile_rows()
    out["gemm_peak"]["tile_rows"] = tile_rows
    try:
        for impl in impls:
            log(f"[{dtype}] loading {impl} ...")
            workers[impl] = make(impl, checkpoint, dtype, threads, inputs)
            info = workers[impl].info
            out["impls"][impl] = {"load_s": info["load_s"], "memory": info["memory"], "source": info["source"],
                                  "times": {c.name: [] for c in cases}, "warmup_times": {c.name: [] for c in cases},
                                  "cpu_times": {c.name: [] for c in cases},
                                  "minor_faults": {c.name: [] for c in cases}}
            log(f"[{dtype}]   loaded in {info['load_s']:.1f} s")
        outputs: dict[str, dict[int, list]] = {impl: {} for impl in impls}
        first = next((i for i in impls if i in BIVIT_IMPLS), None)
        if first is not None:  # once, untimed: one forward of the first case with every op output inspected
            out["subnormals"] = {"impl": first, "case": cases[0].name, **workers[first].subnormals(0)}
        shapes = gemm_shapes(cfg)
        lengths = [t * h * w for c in cases for t, h, w in c.grids()]
        for r in range(warmup + repeats):
            timed = r >= warmup
            peak = {"M": gemm_gflops(TORCH_DTYPES[dtype], shapes, PEAK_ROWS),
                    "tile": gemm_gflops(TORCH_DTYPES[dtype], shapes, tile_rows),
                    "sdpa": {str(n): v for n, v in sdpa_gflops(TORCH_DTYPES[dtype], cfg, lengths).items()}}
            out["gemm_peak"]["rounds"].append(peak)
            for ci, case in enumerate(cases):
                order = impls[r % len(impls):] + impls[:r % len(impls)]  # rotate who goes first
                for impl in order:
                    want = ci not in outputs[impl]
                    res = workers[impl].run(ci, want_output=want)
                    if res["items"] != case.items:
                        raise BivitError(f"{impl} returned {res['items']} embeddings for {case.items} items")
                    if want:
                        outputs[impl][ci] = res["output"]
                    key = "times" if timed else "warmup_times"
                    out["impls"][impl][key][case.name].append(res["seconds"])
                    if timed:
                        out["impls"][impl]["cpu_times"][case.name].append(res["cpu_s"])
                        out["impls"][impl]["minor_faults"][case.name].append(res.get("minor_faults"))
                key = "times" if timed else "warmup_times"
                line = "  ".join(f"{impl} {out['impls'][impl][key][case.name][-1]:7.2f}s" for impl in impls)
                log(f"[{dtype}] {'round ' + str(r - warmup + 1) if timed else 'warm-up ' + str(r + 1)}"
                    f" | {case.name:<22} | {line}")
        for impl in impls:
            mem = workers[impl].memory()
            if mem is not None and out["impls"][impl]["memory"] is not None:
                out["impls"][impl]["memory"]["final"] = mem
        ref = HF_IMPL if HF_IMPL in impls else impls[-1]
        for ci, case in enumerate(cases):
            out["parity"][case.name] = {f"{impl} vs {ref}": _rel_diff(outputs[impl][ci], outputs[ref][ci])
                                        for impl in impls if impl != ref}
    finally:
        for w in workers.values():
            w.close()
    return out


# ------------------------------------------------------------------------------------------------ summary

def peak_gflops(run: dict) -> tuple[float, float]:
    """(peak over shapes and rounds at PEAK_ROWS, same at the invariant tile) in GFLOP/s."""
    rounds = run["gemm_peak"]["rounds"]
    return (max(v for r in rounds for v in r["M"].values()), max(v for r in rounds for v in r["tile"].values()))


def sdpa_peaks(run: dict) -> dict[str, float]:
    """Best SDPA GFLOP/s over rounds per sequence length (empty for records made before it was measured)."""
    rounds = [r["sdpa"] for r in run["gemm_peak"]["rounds"] if "sdpa" in r]
    return {n: max(r[n] for r in rounds) for n in rounds[0]} if rounds else {}


def roofline_s(case: dict, peak: float, run: dict) -> float | None:
    """Seconds for the case's GEMM FLOPs at the GEMM peak plus its attention FLOPs at the measured SDPA rate."""
    sdpa = sdpa_peaks(run)
    if "attention_flops" not in case or not sdpa:
        return None
    return case["gemm_flops"] / (peak * 1e9) + sum(f / (sdpa[str(n)] * 1e9) for n, f in case["attention_flops"])


def summarize(record: dict) -> dict:
    """Derived numbers per dtype: per-case and whole-mix rows per implementation, ratios, memory."""
    cases = record["cases"]
    result = {}
    for dtype, run in record["runs"].items():
        peak, tile_peak = peak_gflops(run)
        roof = {c["name"]: roofline_s(c, peak, run) for c in cases}
        rows, mix = [], {}
        for impl, data in run["impls"].items():
            per_case = []
            threads = record["env"]["threads"]
            for c in cases:
                times = data["times"][c["name"]]
                med = statistics.median(times)
                row = _row(impl, c["name"], c["items"], c["tokens"], c["flops"], c["gemm_flops"], med, min(times),
                           max(times), peak)
                cpu = data.get("cpu_times", {}).get(c["name"])
                row["cpu_s"] = statistics.median(cpu) if cpu else None
                # CPU seconds per wall second per thread: ~1.0 = had its cores; well below = shared them.
                row["cpu_use"] = row["cpu_s"] / (med * threads) if cpu else None
                faults = [f for f in data.get("minor_faults", {}).get(c["name"], []) if f is not None]
                row["minor_faults"] = statistics.median(faults) if faults else None
                row["roofline_s"] = roof[c["name"]]
                row["pct_roofline"] = roof[c["name"]] / med if roof[c["name"]] else None
                per_case.append(row)
            rows.extend(per_case)
            total = sum(r["median_s"] for r in per_case)
            round_totals = [sum(data["times"][c["name"]][i] for c in cases) for i in range(record["repeats"])]
            mix[impl] = _row(impl, "whole mix", sum(c["items"] for c in cases), sum(c["tokens"] for c in cases),
                             sum(c["flops"] for c in cases), sum(c["gemm_flops"] for c in cases), total,
                             min(round_totals), max(round_totals), peak)
            mix[impl]["round_totals"] = round_totals
            mix_roof = sum(roof.values()) if None not in roof.values() else None
            mix[impl]["roofline_s"] = mix_roof
            mix[impl]["pct_roofline"] = mix_roof / total if mix_roof else None
            cpus = [r["cpu_s"] for r in per_case]
            mix[impl]["cpu_s"] = sum(cpus) if None not in cpus else None
            mix[impl]["cpu_use"] = mix[impl]["cpu_s"] / (total * threads) if mix[impl]["cpu_s"] is not None else None
            faults = [r["minor_faults"] for r in per_case]
            mix[impl]["minor_faults"] = sum(faults) if None not in faults else None
            mix[impl]["memory"] = _memory_row(data.get("memory"))
            mix[impl]["load_s"] = data["load_s"]
        ratios = {}
        impls = list(run["impls"])
        pairs = [("bivit-invariant", "bivit-default"), ("bivit-invariant", HF_IMPL), ("bivit-default", HF_IMPL)]
        for a, b in pairs:
            if a in impls and b in impls:
                per_round = [x / y for x, y in zip(mix[a]["round_totals"], mix[b]["round_totals"])]
                per_case = {c["name"]: statistics.median(run["impls"][a]["times"][c["name"]]) /
                            statistics.median(run["impls"][b]["times"][c["name"]]) for c in cases}
                ratios[f"{a} / {b}"] = {"time_ratio": mix[a]["median_s"] / mix[b]["median_s"],
                                        "per_round": per_round, "per_case": per_case}
        result[dtype] = {"peak_gflops": peak, "tile_peak_gflops": tile_peak, "sdpa_gflops": sdpa_peaks(run),
                         "rows": rows, "mix": mix,
                         "ratios": ratios, "parity": run["parity"], "gemm": run["gemm_peak"]}
    return result


def _row(impl, case, items, tokens, flops, gemm_flops, med, lo, hi, peak) -> dict:
    gflops = flops / med / 1e9
    return {"impl": impl, "case": case, "items": items, "tokens": tokens, "median_s": med, "min_s": lo, "max_s": hi,
            "items_per_s": items / med, "tokens_per_s": tokens / med, "gflops": gflops,
            "pct_peak": gflops / peak, "roofline": gemm_flops / (peak * 1e9) / med}


def _memory_row(mem: dict | None) -> dict | None:
    if not mem:
        return None
    loaded, final = mem["loaded"], mem.get("final") or mem["loaded"]
    peak_run = final["hwm_mib"] if mem.get("peak_reset") else None
    return {"baseline_rss_mib": mem["baseline"]["rss_mib"], "loaded_rss_mib": loaded["rss_mib"],
            "load_peak_mib": loaded["hwm_mib"], "run_peak_mib": peak_run,
            "peak_mib": max(loaded["hwm_mib"], final["hwm_mib"]), "ru_maxrss_mib": final["ru_maxrss_mib"]}


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1024:.2f} GiB" if v >= 1024 else f"{v:.0f} MiB"


def format_report(record: dict, summary: dict | None = None) -> str:
    """Markdown: GEMM peak, whole-mix summary, ratios, per-case table, parity, memory."""
    summary = summary or summarize(record)
    env = record["env"]
    lines = [f"bivit bench: preset {record['preset']}, {env['threads']} threads, torch {env['torch']}, "
             f"transformers {env['transformers']}, CPU {env['cpu']} ({cpu_flags_text(env)}); {record['repeats']} interleaved repeat(s) "
             f"(+{record['warmup']} warm-up), medians; load average {_fmt_load(env.get('loadavg'))} -> "
             f"{_fmt_load(env.get('loadavg_end'))}"]
    for name, reason in record["skipped"].items():
        lines.append(f"{name} skipped: {reason}")
    lines.append("")
    lines.append("Cases: " + "; ".join(f"{c['name']} ({c['items']} item{'s' if c['items'] > 1 else ''}, "
                                       f"{c['patches']} patches, {c['tokens']} tokens, {c['flops'] / 1e12:.2f} TFLOP)"
                                       for c in record["cases"]))
    for dtype, s in summary.items():
        lines += ["", f"### {dtype}", "",
                  f"GEMM peak (`F.linear`, best of {GEMM_TRIES} x {record['repeats'] + record['warmup']} rounds):",
                  "", "| GEMM (out x in) | M = %d GFLOP/s | M = %d (tile) GFLOP/s |" % (
                      s["gemm"]["rows"], s["gemm"]["tile_rows"]), "|---|---:|---:|"]
        for shape in s["gemm"]["rounds"][0]["M"]:
            best_m = max(r["M"][shape] for r in s["gemm"]["rounds"])
            best_t = max(r["tile"][shape] for r in s["gemm"]["rounds"])
            lines.append(f"| {shape} | {best_m:.0f} | {best_t:.0f} |")
        sdpa = ", ".join(f"n = {n}: {v:.0f}" for n, v in sorted(s["sdpa_gflops"].items(), key=lambda kv: int(kv[0])))
        lines += ["", f"Peak used below: **{s['peak_gflops']:.0f} GFLOP/s**. Fused attention (SDPA, one item of n "
                  f"patches, best of {GEMM_TRIES} per round) GFLOP/s: {sdpa or 'not measured'}.", "",
                  "| implementation | whole mix s (min-max) | items/s | tokens/s | GFLOP/s | % of GEMM peak | "
                  "GEMM roofline | % of roofline | speed vs HF | CPU use | page faults | peak RSS | RSS loaded | "
                  "run peak RSS |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        hf = s["mix"].get(HF_IMPL)
        for impl, m in s["mix"].items():
            mem = m["memory"] or {}
            speed = f"{hf['median_s'] / m['median_s']:.2f}x" if hf else "n/a"
            lines.append(f"| {impl} | {m['median_s']:.2f} ({m['min_s']:.2f}-{m['max_s']:.2f}) | "
                         f"{m['items_per_s']:.2f} | {m['tokens_per_s']:.0f} | {m['gflops']:.0f} | "
                         f"{100 * m['pct_peak']:.0f}% | {m['roofline']:.2f} | {_pct(m.get('pct_roofline'))} | "
                         f"{speed} | {_pct(m['cpu_use'])} | "
                         f"{_count(m['minor_faults'])} | "
                         f"{_mib(mem.get('peak_mib'))} | "
                         f"{_mib(mem.get('loaded_rss_mib'))} | {_mib(mem.get('run_peak_mib'))} |")
        lines.append("")
        for pair, r in s["ratios"].items():
            pr = r["per_round"]
            lines.append(f"time {pair}: {r['time_ratio']:.3f} (per round: median {statistics.median(pr):.3f}, "
                         f"range {min(pr):.3f}-{max(pr):.3f}); per case: "
                         + ", ".join(f"{k} {v:.3f}" for k, v in r["per_case"].items()))
        lines += ["", "| case | implementation | median s (min-max) | items/s | tokens/s | GFLOP/s | % of peak | "
                  "GEMM roofline | roofline s | % of roofline | CPU use |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in sorted(s["rows"], key=lambda r: [c["name"] for c in record["cases"]].index(r["case"])):
            lines.append(f"| {row['case']} | {row['impl']} | {row['median_s']:.3f} ({row['min_s']:.3f}-"
                         f"{row['max_s']:.3f}) | {row['items_per_s']:.2f} | {row['tokens_per_s']:.0f} | "
                         f"{row['gflops']:.0f} | {100 * row['pct_peak']:.0f}% | {row['roofline']:.2f} | "
                         f"{_secs(row.get('roofline_s'))} | {_pct(row.get('pct_roofline'))} | {_pct(row['cpu_use'])} |")
        lines.append("")
        parity = "; ".join(f"{case}: " + ", ".join(f"{k} max {v['max_rel']:.1e} mean {v['mean_rel']:.1e}"
                                                   for k, v in d.items()) for case, d in s["parity"].items())
        lines.append(f"Parity (|a - b| relative to max |b|, first run of each case): {parity}")
        sub = record["runs"][dtype].get("subnormals")
        if sub:
            lines.append(f"Subnormal values among all op outputs of one {sub['impl']} forward of {sub['case']}: "
                         f"{sub['subnormal']} of {sub['values']}.")
        sources = {impl: d.get("source") for impl, d in record["runs"][dtype]["impls"].items() if impl in BIVIT_IMPLS}
        lines.append("bivit source versions measured (hash of imported modules): "
                     + ", ".join(f"{k} {v}" for k, v in sources.items()))
    lines += ["", "Memory: per worker process, VmHWM/VmRSS of /proc/self/status. 'RSS loaded' = resident after "
              "imports + model load; 'run peak' = high-water mark over warm-up and timed runs (reset after load), "
              "so run peak - RSS loaded = working memory of encoding; 'peak RSS' = max(load peak, run peak).",
              "CPU use: CPU seconds of the worker process per wall second per thread; near 100% means the run had "
              "its cores, far below means it shared them with other processes (the numbers are then inflated).",
              "Page faults: minor page faults per whole mix (median per case, summed): freshly mapped 4 KiB pages, "
              "i.e. large temporaries the allocator returned to the OS and had to fault in again."]
    return "\n".join(lines)


def _secs(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _count(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e3:.0f}k" if v >= 1e3 else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _fmt_load(v) -> str:
    return "n/a" if not v else "/".join(f"{x:.1f}" for x in v)


def plot_report(summary: dict, path: Path, title: str) -> None:
    """Bar charts: tokens/s per case and % of GEMM peak, one column per dtype, one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(summary)
    fig, axes = plt.subplots(2, len(dtypes), figsize=(7 * len(dtypes), 8), squeeze=False)
    for col, dtype in enumerate(dtypes):
        s = summary[dtype]
        impls = list(s["mix"])
        case_names = list(dict.fromkeys(r["case"] for r in s["rows"])) + ["whole mix"]
        rows = {(r["impl"], r["case"]): r for r in s["rows"]}
        rows.update({(impl, "whole mix"): m for impl, m in s["mix"].items()})
        width = 0.8 / len(impls)
        for row, (metric, label) in enumerate((("tokens_per_s", "tokens/s"), ("pct_peak", "% of GEMM peak"))):
            ax = axes[row][col]
            for k, impl in enumerate(impls):
                values = [rows[(impl, c)][metric] * (100 if metric == "pct_peak" else 1) for c in case_names]
                bars = ax.bar([i + k * width for i in range(len(case_names))], values, width, label=impl)
                ax.bar_label(bars, fmt="%.0f", fontsize=7)
            ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(case_names))])
            ax.set_xticklabels(case_names, rotation=15, fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{dtype}: {label}" + (f" (peak {s['peak_gflops']:.0f} GFLOP/s)" if row else ""))
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())


def write_outputs(record: dict, report: str, summary: dict, out_dir: Path, stem: str, title: str,
                  log: Callable[[str], None]) -> list[Path]:
    """JSON (raw record + summary), Markdown report, PNG chart (skipped with a note if matplotlib is missing)."""
    written = []
    write_text_atomic(out_dir / f"{stem}.json", json.dumps({"record": record, "summary": summary}, indent=1,
                                                            default=str))
    written.append(out_dir / f"{stem}.json")
    write_text_atomic(out_dir / f"{stem}.md", report + "\n")
    written.append(out_dir / f"{stem}.md")
    try:
        plot_report(summary, out_dir / f"{stem}.png", title)
        written.append(out_dir / f"{stem}.png")
    except ImportError:
        log("bivit bench: PNG chart skipped: matplotlib is not installed (pip install 'bivit[plot]')")
    return written
