"""The implementations `bivit bench` times, each in its own worker process, and what a worker measures: wall and
CPU seconds, page faults, memory, subnormal values.

* **One worker process per implementation.** Each is spawned fresh and holds its model for the whole run; the
  parent sends "run case c" to one worker at a time and waits, so workers never compete for the cores.
* **Memory is per process.** A worker reads its own peak resident set size from `/proc/self/status`
  (VmHWM), resets that high-water mark after loading (`/proc/self/clear_refs`), and reports the load peak, the
  resident size once loaded, and the run peak (the high-water mark over warm-up and timed runs). We do not
  use `getrusage(RUSAGE_SELF).ru_maxrss` as the primary number: Linux folds the high-water mark of the forked
  pre-exec image into it, so a spawned child can inherit its parent's peak; and it cannot be reset. It is
  still recorded in the JSON. Off Linux, ru_maxrss is all there is and the run peak is not separable.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from .. import ops
from ..base.allocator import tune
from ..checkpoint.config import ModelConfig
from ..core.encoder import load_encoder
from ..errors import BivitError
from ..media.pixels import MediaBatch
from .workload import BIVIT_IMPLS, HF_IMPL, TORCH_DTYPES, hf_supports, load_cases


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



# ------------------------------------------------------------------------------------------------- runners

def load_runner(impl: str, checkpoint: Path, dtype: str) -> Callable[[MediaBatch], list[torch.Tensor]]:
    """A callable batch -> one embedding per item, for one implementation. Load time is not timed by callers."""
    if impl in BIVIT_IMPLS:
        enc = load_encoder(checkpoint, dtype=dtype, batch_invariant=impl == "bivit-invariant")
        return enc.encode_batch
    if impl == HF_IMPL:
        return _hf_runner(checkpoint, TORCH_DTYPES[dtype])
    raise BivitError(f"unknown implementation {impl!r}")


def _hf_runner(checkpoint: Path, dtype: torch.dtype) -> Callable[[MediaBatch], list[torch.Tensor]]:
    import transformers  # optional (the port), and only its worker imports it: its memory is the port's

    transformers.logging.set_verbosity_error()  # the stand-in text model's "newly initialized" notice
    transformers.logging.disable_progress_bar()
    model = transformers.Kimi_K25Model.from_pretrained(str(checkpoint), dtype=dtype,
                                                       attn_implementation="sdpa").eval()
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
        import transformers  # optional: its absence is the reason returned
    except ImportError:
        return "transformers is not installed (pip install transformers==5.23.0, or the 'test' extra)"
    if not hasattr(transformers, "Kimi_K25Model"):
        return f"transformers {transformers.__version__} has no Kimi_K25Model (needs 5.23.0)"
    return None



# -------------------------------------------------------------------------------------------------- workers

def source_hash() -> str:
    """Short hash of the bivit sources this process has imported and of the compiled kernels' C sources: the
    lead edits them while benchmarks run, so the record says which version every worker measured."""
    h = hashlib.sha256()
    for name in sorted(m for m in sys.modules if m == "bivit" or m.startswith("bivit.")):
        path = getattr(sys.modules[name], "__file__", None)
        if path and os.path.isfile(path):
            h.update(name.encode())
            h.update(Path(path).read_bytes())
    for path in sorted((Path(__file__).parent.parent / "kernels").glob("*.[ch]")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def count_subnormals(runner: Callable[[MediaBatch], Any], batch: MediaBatch) -> dict[str, int]:
    """Subnormal values among all op outputs of one bivit forward (`bivit.ops.trace`). Random weights at the
    wrong scale make a deep tower chaotic and full of denormals, which time the FPU's slow path, not the model:
    the benchmark weights (std 1/sqrt(fan_in)) must show none."""
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
