"""`bivit doctor`: what this machine and this install run, in the words a bug report needs.

`report()` gathers, without loading a model: bivit and Python; the CPU kind (model name and the instruction
sets bivit's kernel choices depend on); what PyTorch reports (version, the CPU capability it dispatches, whether
oneDNN has bf16/fp16 GEMMs here, threads, the environment variables that change any of it); the class of bits
invariant mode computes per dtype (`bivit-arith/1`, the same rows on every CPU, or this machine kind's own:
`bivit.ops.bits`) or why it is refused here; invariant mode's GEMM kernel per dtype; the compiled kernels (the
variants this install has, the library loaded, or why none is and the fix); the extras installed; and every
fallback said (`bivit.base.notices`). Each section is gathered on its own: one that fails says so in its place, it never
stops the report. `prove()` adds the load-time proof on a model's shapes and the golden rows (`bivit.diagnose.golden`):
the demo model's rows for fixed inputs against the committed ones, which a machine computing bivit-arith/1
reproduces bit for bit.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
import time
from typing import Any, Callable

import torch

from .. import __version__, errors, kernels, ops
from ..base import notices
from ..base.notices import Notice
from ..core.encoder import load_encoder
from ..core.spec import EncoderSpec
from ..kernels.cpu import FLAGS, cpu_info
from ..ops import attention_kernel, bits_class, gemm_kernel
from ..ops.bits import mode
from ..ops.selection import compute_dtype
from . import golden

# Environment variables that change a kernel choice or the threads (docs/cpu-kinds.md: what each does to the class).
ENV_VARS = ("BIVIT_ARITH", "BIVIT_ATTENTION", "BIVIT_GEMM", "ATEN_CPU_CAPABILITY", *ops.bits.STEERING_ENV,
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")
GEMM_DTYPES = ("float32", "bfloat16", "float16")
_EXTRA = re.compile(r"""^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?[^;]*;\s*extra\s*==\s*["']([\w-]+)["']""")


def _section(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a doctor reports a broken part, it does not die of it
        return {"error": f"{type(e).__name__}: {e}"}


def cpu() -> dict:
    model, flags = cpu_info()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {"model": model or platform.processor() or "unknown", "machine": platform.machine(),
            "cores": os.cpu_count(), "cores_usable": usable,
            "flags": {f: f in flags for f in FLAGS} if flags else "unknown (no /proc/cpuinfo)"}


def pytorch() -> dict:
    def query(name: str) -> Any:
        fn = getattr(torch.ops.mkldnn, name, None)
        try:
            return bool(fn()) if fn is not None else None
        except Exception:  # noqa: BLE001
            return None

    return {"version": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "onednn": torch.backends.mkldnn.is_available(), "onednn_bf16_gemm": query("_is_mkldnn_bf16_supported"),
            "onednn_fp16_gemm": query("_is_mkldnn_fp16_supported"), "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ}}


def _invariant(fn: Callable[[], Any]) -> Any:
    """`fn()`, or why invariant mode is refused in this process (its one line)."""
    try:
        return fn()
    except (errors.ConfigError, errors.InvarianceError) as e:
        return f"refused: {e}"


def bits() -> dict:
    """The class of bits invariant mode computes here, per dtype (a tower and projector of that dtype), and the
    arithmetic mode (`BIVIT_ARITH`)."""
    cpu = torch.device("cpu")
    return {"mode": mode(), **{name: _invariant(lambda: bits_class((getattr(torch, name),) * 2, cpu, True))
                               for name in GEMM_DTYPES}}


def gemm() -> dict:
    """Invariant mode's GEMM per dtype: bivit's compiled kernel (invariant by construction)."""
    return {name: {"path": _invariant(lambda: f"{name}: {gemm_kernel(getattr(torch, name)).describe()}, reduction "
                                              "order fixed by bivit")} for name in GEMM_DTYPES}


def attention() -> dict:
    def path(dtype: torch.dtype) -> str:
        return f"bivit compiled ({attention_kernel(dtype).name_for(compute_dtype(dtype))})"

    invariant = ", ".join(f"{name} {_invariant(lambda: path(getattr(torch, name)))}" for name in GEMM_DTYPES)
    return {**kernels.status(), "choice": os.environ.get(kernels.ATTENTION_ENV, "auto"), "invariant_mode": invariant}


def prove(spec: EncoderSpec) -> dict:
    """Run the load-time proof now (`bivit.ops.proof`) on the real shapes of `spec`'s model (its dtypes, loaded
    in default mode: the proof is what runs here): the table, its cost, and whether it passes; then the golden rows
    (`bivit.diagnose.golden`): the demo model's rows at `spec.dtype` against the committed ones. Raises InvarianceError
    where an op has no invariant path."""
    encoder = load_encoder(spec, batch_invariant=False)
    start = time.perf_counter()
    ops.pack_weights(ops.gemms(encoder.model))
    packed = time.perf_counter() - start
    proof = ops.prove(encoder.model, fresh=True)
    rows = golden.check(load_encoder(EncoderSpec(dtype=spec.dtype)))
    return {"model": encoder.model_name, "dtype": spec.dtype, **proof.to_dict(), "pack_seconds": round(packed, 3),
            "table": proof.table(), "golden": {"bits": rows.bits, "match": rows.match, "committed": rows.committed,
                                               "differ": list(rows.differ), "inputs": rows.total,
                                               "line": rows.line()}}


def extras() -> dict:
    """Per extra of bivit's package metadata: its packages and their installed versions (None: not installed)."""
    try:
        requires = importlib.metadata.requires("bivit") or []
    except importlib.metadata.PackageNotFoundError:
        return {"error": "bivit's package metadata is missing (install it with pip install -e .)"}
    out: dict[str, dict] = {}
    for req in requires:
        m = _EXTRA.match(req)
        if m is None or m.group(1).lower() == "bivit":
            continue
        dist, extra = m.groups()
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        out.setdefault(extra, {})[dist] = version
    try:  # not an extra: the vLLM integration runs in an environment of its own (vLLM pins its own torch)
        out["vllm"] = {"vllm": importlib.metadata.version("vllm")}
    except importlib.metadata.PackageNotFoundError:
        out["vllm"] = {"vllm": None}
    return out


def report() -> dict:
    """Everything `bivit doctor` prints, as JSON. Loads no model; loads and self-tests the installed kernels
    (what every encoder does at load)."""
    out = {"bivit": {"version": __version__, "python": platform.python_version(),
                     "platform": f"{platform.system()} {platform.release()}", "executable": sys.executable}}
    for name, fn in (("cpu", cpu), ("pytorch", pytorch), ("bits", bits), ("gemm", gemm), ("attention", attention),
                     ("extras", extras)):
        out[name] = _section(fn)
    out["fallbacks"] = _section(lambda: [n.to_dict() for n in notices.said() if n.warning])
    return out


def _yes(v: Any) -> str:
    return {True: "yes", False: "no", None: "unknown"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)


def format_report(r: dict) -> list[str]:
    """The report as the lines `bivit doctor` prints."""
    lines = []
    b = r["bivit"]
    lines.append(f"bivit        {b['version']} (Python {b['python']}, {b['platform']})")

    def failed(name: str) -> bool:
        if isinstance(r.get(name), dict) and "error" in r[name]:
            lines.append(f"{name:<12} could not be checked: {r[name]['error']}")
            return True
        return False

    if not failed("cpu"):
        c = r["cpu"]
        lines.append(f"cpu          {c['model']} ({c['machine']}, {c['cores']} cores, {c['cores_usable']} usable)")
        flags = c["flags"]
        lines.append("  flags      " + (flags if isinstance(flags, str) else
                                        " ".join(f"{f}:{_yes(v)}" for f, v in flags.items())))
    if not failed("pytorch"):
        t = r["pytorch"]
        lines.append(f"pytorch      {t['version']}, capability {t['capability']}, oneDNN {_yes(t['onednn'])} "
                     f"(bf16 GEMM {_yes(t['onednn_bf16_gemm'])}, fp16 GEMM {_yes(t['onednn_fp16_gemm'])}), "
                     f"threads {t['threads']} (interop {t['interop_threads']})")
        if t["env"]:
            lines.append("  env        " + " ".join(f"{k}={v}" for k, v in t["env"].items()))
    if not failed("bits"):
        b = r["bits"]
        classes = {d: c for d, c in b.items() if d != "mode"}
        lines.append("bits         " + "; ".join(f"{d}: {c}" for d, c in classes.items())
                     + (f" (BIVIT_ARITH={b['mode']})" if b["mode"] != "canonical" else ""))
    if not failed("gemm"):
        for name, g in r["gemm"].items():
            lines.append(f"gemm         {g['path']}" + (f" — {g['note']}" if g.get("note") else ""))
    if not failed("attention"):
        a = r["attention"]
        installed = ", ".join(a["installed"]) or "none"
        if a["in_use"]:
            lines.append(f"kernels      {a['variant']} (installed: {installed}), self-tested: {a['library']}")
        else:
            lines.append(f"kernels      none in use (installed: {installed}): {a['why']}"
                         + (f"; fix: {a['fix']}" if a.get("fix") else ""))
        lines.append(f"attention    default mode: {a['kernel']}; invariant mode: {a['invariant_mode']} "
                     f"(BIVIT_ATTENTION={a['choice']})")
    if not failed("extras"):
        for extra, dists in r["extras"].items():
            have = [f"{d} {v}" for d, v in dists.items() if v]
            missing = [d for d, v in dists.items() if not v]
            state = ("installed: " + ", ".join(have)) if not missing else (
                "not installed" if not have else "partly installed: " + ", ".join(have) + "; missing " +
                ", ".join(missing))
            hint = "" if not missing else (
                " (runs in its own environment: scripts/vllm-env.sh)" if extra == "vllm"
                else f" (pip install 'bivit[{extra}]')")
            lines.append(f"extra        {extra:<6} {state}{hint}")
    fallbacks = r.get("fallbacks")
    if isinstance(fallbacks, list):
        lines.append("fallbacks    " + ("none" if not fallbacks else f"{len(fallbacks)}:"))
        lines += ["  - " + Notice(**n).line().removeprefix("bivit: ") for n in fallbacks]
    return lines
