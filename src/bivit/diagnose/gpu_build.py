"""Compile what a forward launches, for a GPU architecture, without a GPU: `python -m bivit.diagnose.gpu_build [--arch
90] [--model kimi-k2.5 ...] [--head-dim 64 ...] [--dtype bfloat16] [--json]` (sm_90a = H100/H200). Must run without
TRITON_INTERPRET. A tool of the `gpu` extra: it imports triton at its top, and nothing in bivit imports it.

"What runs" is taken from the code, not written down a second time: the model's forward runs on the CPU with
uninitialised weights of the preset's exact shapes while `ops.recording()` captures every kernel launch (tensors,
integers, constexprs, options), and each distinct launch is compiled through Triton's own JIT binder, so the
specialisation (which integers are divisible by 16, which pointers are aligned, which arguments are constexpr)
is the one the JIT makes on the GPU for the same arguments. Per variant it reads the compiled kernel: registers,
spills (STL/LDL in the SASS, the stack frame), whether the K loop is software-pipelined (multi-buffered shared
memory in the TTGIR, cp.async in the PTX) and whether the MMA is Hopper's wgmma.

The JIT binder is a Triton internal (checked with triton 3.8); the GPU check (scripts/gpu_check.py) reads the
same registers and spills from the kernels the GPU's own triton compiled.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from .. import ops
from ..checkpoint.config import PRESETS
from ..kernels.cuda import interpreting
from ..model import VisionModel
from ..ops.dispatch import recording

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
IMAGE, VIDEO = (1, 4, 4), (4, 4, 4)  # grids (t, h, w) of the recorded forward: an image and a 4-frame chunk


def model_launches(cfg, dtype: torch.dtype) -> list:
    """Every launch an invariant forward of `cfg` in `dtype` makes (an image and a video chunk), recorded, not
    run: the weights are allocated at full size and never initialised (nothing is computed)."""
    with torch.device("meta"):
        net = VisionModel(cfg)
    net = net.to_empty(device="cpu").to(dtype).eval()
    grids = [IMAGE, VIDEO]
    pixels = torch.empty(sum(t * h * w for t, h, w in grids), 3, cfg.patch_size, cfg.patch_size, dtype=dtype)
    with torch.inference_mode(), ops.batch_invariant(True), recording() as launches:
        net(pixels, torch.tensor(grids))
    return launches


def attention_launches(head_dim: int, dtype: torch.dtype, heads: int = 8) -> list:
    """The attention launch at one head dim (for head dims no preset has), recorded."""
    q = torch.empty(32, heads, head_dim, dtype=dtype)
    with ops.batch_invariant(True), recording() as launches:
        ops.attention(q, q, q, [32])
    return launches


def label(launch) -> str:
    """A launch in words: kernel name and the constexprs that tell variants apart."""
    name = launch.kernel.fn.__name__.removesuffix("_kernel")
    dtype = _TY.get(launch.args[0].dtype, str(launch.args[0].dtype))
    shown = [f"{k}={v}" for k, v in launch.kwargs.items() if not k.startswith(("BLOCK", "PRECISION", "num_", "enable"))]
    # the integers the JIT specialises: 1 becomes a constant, a multiple of 16 an alignment hint
    for param, arg in zip(launch.kernel.params, launch.args):
        if type(arg) is int and not param.do_not_specialize and (arg == 1 or arg % 16 == 0):
            shown.append(f"{param.name}={arg}" if arg == 1 else f"{param.name}%16=0")
    return f"{name} {dtype} " + " ".join(shown)


def compile_launch(launch, arch: int = 90):
    """Compile one recorded launch for CUDA capability `arch` exactly as the JIT would: Triton's binder
    specialises the recorded arguments, then `triton.compile` builds the kernel."""
    if interpreting():
        raise RuntimeError("bivit.diagnose.gpu_build compiles kernels: run it without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization,
                                                               options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def inspect_compiled(compiled) -> dict:
    """What the compiled kernel is: registers, spills, pipelining, MMA instructions."""
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    resources = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    # a pipelined operand lives in a rank-3 shared buffer [stages, rows, cols]; unpipelined ones are rank 2
    buffers = [int(m) for m in re.findall(r"memdesc<(\d+)x\d+x\d+x", compiled.asm["ttgir"])]
    return {"registers": int(resources["REG"]), "stack_bytes": int(resources["STACK"]),
            "local_bytes": int(resources["LOCAL"]), "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            "spill_loads": len(re.findall(r"\bLDL\b", sass)), "num_stages": compiled.metadata.num_stages,
            "num_warps": compiled.metadata.num_warps, "pipeline_buffers": max(buffers, default=1),
            "cp_async": "cp.async" in ptx, "wgmma": "wgmma.mma_async" in ptx,
            "target": next((ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".target")), "")}


def compile_all(launches: dict[str, list], arch: int = 90) -> list[dict]:
    """Compile each distinct launch of `launches` (source name -> launches) once -> one record per variant, with
    the sources that launch it."""
    seen: dict[str, dict] = {}
    for source, recorded in launches.items():
        for launch in recorded:
            key = label(launch) + repr(sorted((k, v) for k, v in launch.kwargs.items()))
            key += repr([(tuple(a.shape[1:]), a.stride()[1:], a.data_ptr() % 16)
                         if isinstance(a, torch.Tensor) else (a if a == 1 or not isinstance(a, int) else a % 16)
                         for a in launch.args])
            if key in seen:
                seen[key]["sources"] = sorted(set(seen[key]["sources"]) | {source})
                continue
            start = time.monotonic()
            record = {"kernel": label(launch), "sources": [source]}
            record.update(inspect_compiled(compile_launch(launch, arch)))
            record["seconds"] = round(time.monotonic() - start, 2)
            seen[key] = record
    return list(seen.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bivit.diagnose.gpu_build", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90 = sm_90a)")
    parser.add_argument("--model", choices=sorted(PRESETS), action="append",
                        help="record this preset's forward (repeatable; default: demo, kimi-k2.5, kimi-k3)")
    parser.add_argument("--head-dim", type=int, action="append", default=[],
                        help="also the attention at this head dim (repeatable)")
    parser.add_argument("--dtype", choices=[str(d).removeprefix("torch.") for d in _TY], action="append",
                        help="compute dtype (repeatable; default: bfloat16)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    launches = {}
    for dtype in [getattr(torch, d) for d in args.dtype or ["bfloat16"]]:
        for name in args.model or ["demo", "kimi-k2.5", "kimi-k3"]:
            launches[f"{name} {_TY[dtype]}"] = model_launches(PRESETS[name], dtype)
        for d in args.head_dim:
            launches[f"head_dim={d} {_TY[dtype]}"] = attention_launches(d, dtype)
    records = compile_all(launches, args.arch)
    if args.json:
        print(json.dumps(records))
    else:
        for r in records:
            print(f"{r['kernel']:<58} {r['target']:<7} reg={r['registers']:<3} spills={r['spill_stores']}/"
                  f"{r['spill_loads']} stack={r['stack_bytes']:<3} stages={r['num_stages']} "
                  f"buffers={r['pipeline_buffers']} cp.async={r['cp_async']!s:<5} wgmma={r['wgmma']!s:<5} "
                  f"{r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
