"""Running a benchmark: the machine and command it ran on, and `run_benchmark`, which times every implementation
on every case in interleaved rounds and measures the machine's GEMM and attention rates between them.

* **Same weights, same pixels.** One seeded random state dict is written once as a Moonshot-layout bf16
  checkpoint with a transformers-native config.json; bivit and `transformers.Kimi_K25Model` both load that
  directory (the port converts the layout on load). The inputs are preprocessed once by the parent and handed
  to every implementation as the same float32 pixels; each implementation's timed call includes its own cast
  to the compute dtype. A parity line (max relative difference to the port) proves both ran the same model.
* **Interleaved.** Repeats are interleaved (round r, case c: A B C, the starting implementation rotating per
  round) so that the noise of a shared machine lands on every implementation alike; reported times are
  medians, and ratios are taken within the run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import kernels, ops
from ..base import notices
from ..base.dtypes import dtype_option
from ..checkpoint.config import PRESETS
from ..errors import BivitError, ConfigError
from ..kernels import cpu
from .roofline import (PEAK_ROWS, attention_flops_per_item, attention_gflops, case_flops, gemm_gflops, gemm_shapes,
                       kernel_peak_gflops)
from .workers import InProcessWorker, Worker, hf_unavailable_reason
from .workload import BIVIT_IMPLS, HF_IMPL, IMPLS, TORCH_DTYPES, Case, bench_dtypes, save_cases, standard_cases, \
    write_checkpoint, write_checkpoint_isolated


# ------------------------------------------------------------------------------------------- the machine

def rt_share() -> float | None:
    """The share of each second Linux lets this process run when it runs at a real-time priority (`chrt -f`):
    kernel.sched_rt_runtime_us / sched_rt_period_us (95% by default). A timed call longer than the rest of a period
    stalls until the next one, so it reads up to 5% slow, while the short rate probes beside it do not: a
    roofline ratio measured so is low by that much (and "CPU use" reads 95%, not 100%). None at a normal
    priority, or where nothing caps real-time tasks."""
    try:
        if os.sched_getscheduler(0) not in (os.SCHED_FIFO, os.SCHED_RR):
            return None
        runtime = int(Path("/proc/sys/kernel/sched_rt_runtime_us").read_text())
        period = int(Path("/proc/sys/kernel/sched_rt_period_us").read_text())
    except (AttributeError, OSError, ValueError):  # not Linux
        return None
    return runtime / period if 0 <= runtime < period else None


def environment(threads: int) -> dict:
    """The machine and software a run measured (recorded in every result)."""
    model, present = cpu.cpu_info()
    lib = kernels.library()
    attention = ops.attention_kernel(torch.bfloat16)  # invariant mode's (default mode may keep PyTorch's on AMX)
    # The invariant-mode GEMM kernels of the dtypes bench runs, and every faster path this machine leaves off.
    gemm = {name: ops.gemm_kernel(TORCH_DTYPES[name]).describe() for name in TORCH_DTYPES}
    try:  # optional, and seconds to import: only its version is wanted
        tf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        tf_version = None
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        git = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": tf_version,
            "git_head": git, "cpu": model or platform.processor(),
            "cpu_flags": [f for f in cpu.FLAGS if f in present],
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_limits": {k: v for k, v in os.environ.items() if k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                                     "MKL_ENABLE_INSTRUCTIONS")},
            "kernels": lib.variant if lib else None,
            "attention": f"bivit compiled ({attention.name})" if attention else "PyTorch SDPA",  # invariant mode
            "bits": {name: ops.bits_class((dt, dt), torch.device("cpu"), True) for name, dt in TORCH_DTYPES.items()},
            "gemm": gemm, "fallbacks": notices.warnings(),
            "cpu_count": os.cpu_count(), "threads": threads, "rt_share": rt_share(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def machine_line(env: dict) -> str:
    """'CPU AMD EPYC (avx2, avx512_bf16; no amx_bf16; PyTorch AVX512 kernels; attention: ...), 2 threads, ...'"""
    flags = env.get("cpu_flags")
    have = "CPU flags unknown" if flags is None else ", ".join(
        f for f in cpu.TIERS if f in flags) or "no AVX2"
    lacks = [f for f in cpu.TIERS[1:] if flags is not None and f not in flags]
    limits = ", ".join(f"{k}={v}" for k, v in (env.get("isa_limits") or {}).items())
    parts = [have + (f"; no {', '.join(lacks)}" if lacks else ""),
             f"PyTorch {env.get('torch_capability', '?')} kernels", f"attention: {env.get('attention', '?')}"]
    if limits:
        parts.append(f"restricted by {limits} (an emulation of that CPU kind)")
    if env.get("rt_share"):
        parts.append(f"real-time priority: capped at {100 * env['rt_share']:.0f}% of each second")
    return (f"CPU {env['cpu']} ({'; '.join(parts)}), {env['threads']} threads, torch {env['torch']}, "
            f"load average {fmt_load(env.get('loadavg'))}")


def fmt_load(v) -> str:
    return "n/a" if not v else "/".join(f"{x:.1f}" for x in v)


def load_line() -> str:
    return f"load average {fmt_load(os.getloadavg() if hasattr(os, 'getloadavg') else None)}"


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
    limits = [f"{k}={v}" for k, v in os.environ.items() if k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                                 "MKL_ENABLE_INSTRUCTIONS", "BIVIT_ATTENTION")]
    return " ".join([*limits, *(shlex.quote(a) for a in argv)])


# --------------------------------------------------------------------------------------------- scripts

def script_args(description: str, *, dtype: str = "bfloat16", dtypes: Sequence[str] = ("bfloat16", "float32"),
                repeats: int = 3) -> argparse.ArgumentParser:
    """A parser with the options every benchmark script shares: --preset, --dtype, --repeats, --threads, --seed."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="kimi-k2.6", choices=sorted(PRESETS))
    p.add_argument("--dtype", default=dtype, type=script_dtype(dtypes), metavar="{" + ",".join(dtypes) + "}")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 makes a shared machine's ratios less noisy")
    p.add_argument("--seed", type=int, default=0)
    return p


def script_dtype(dtypes: Sequence[str]) -> Callable[[str], str]:
    """A script's --dtype parser: "both" (where `dtypes` lists it), or one of `dtypes` in any spelling the commands
    accept, as its canonical name; refused in the commands' words (`bivit.base.dtypes.dtype_option`)."""
    runs = [d for d in dtypes if d != "both"]

    def parse(value: str) -> str:
        if value == "both" and "both" in dtypes:
            return value
        try:
            return dtype_option(value, "--dtype", runs)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def start(args: argparse.Namespace) -> dict:
    """Apply --threads, print the command and the machine line; returns the environment record."""
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(torch.get_num_threads())
    print(f"$ {command_line()}")
    print(machine_line(env), flush=True)
    return env


# ----------------------------------------------------------------------------------------------- a run

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
    dtypes = [n for d in dtypes for n in bench_dtypes(d, "dtypes")]
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
        "format": "bivit.bench/2", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "preset": preset,
        "config": cfg.to_dict(), "repeats": repeats, "warmup": warmup, "isolated": isolate,
        "env": environment(threads), "skipped": skipped, "impls": impls,
        "cases": [], "runs": {},
    }
    for c in cases:
        flops = case_flops(cfg, c)
        record["cases"].append({"name": c.name, "items": c.items, "patches": c.patches, "tokens": c.tokens,
                                "grid_thw": c.batch.grid_thw.tolist(), "flops": flops.total,
                                "gemm_flops": flops.gemm, "other_flops": flops.other,
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


def machine_rates(cfg, dtype: torch.dtype, lengths: Sequence[int]) -> dict:
    """One round of the machine's rates (GFLOP/s): GEMMs both ways at PEAK_ROWS rows per tower shape, attention
    both ways per item length (bivit's: None where it does not run here), the kernel peak (None where none)."""
    shapes = gemm_shapes(cfg)
    bivit_attention = attention_gflops(dtype, cfg, lengths, how="bivit")
    return {"gemm": {"stock": gemm_gflops(dtype, shapes, how="stock"), "bivit": gemm_gflops(dtype, shapes, how="bivit")},
            "attention": {"sdpa": {str(n): v for n, v in attention_gflops(dtype, cfg, lengths).items()},
                          "bivit": None if bivit_attention is None else
                          {str(n): v for n, v in bivit_attention.items()}},
            "kernel_peak": kernel_peak_gflops(dtype)}


def _run_dtype(cfg, dtype, impls, cases, checkpoint, inputs, repeats, warmup, threads, isolate, log) -> dict:
    make = Worker if isolate else InProcessWorker
    workers: dict[str, Any] = {}
    out: dict[str, Any] = {"impls": {}, "rates": {"rows": PEAK_ROWS, "rounds": []}, "parity": {}}
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
        lengths = [t * h * w for c in cases for t, h, w in c.grids()]
        for r in range(warmup + repeats):
            timed = r >= warmup
            out["rates"]["rounds"].append(machine_rates(cfg, TORCH_DTYPES[dtype], lengths))
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


def _rel_diff(a, b) -> dict[str, float]:
    x, y = np.concatenate([t.ravel() for t in a]), np.concatenate([t.ravel() for t in b])
    scale = float(np.abs(y).max()) or 1.0
    d = np.abs(x.astype(np.float64) - y)
    return {"max_rel": float(d.max()) / scale, "mean_rel": float(d.mean()) / scale}
