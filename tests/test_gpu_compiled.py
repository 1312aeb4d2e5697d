"""Compile what runs: every kernel launch of a bf16 invariant forward of the demo, a Kimi-K2.5-sized and a
Kimi-K3-sized model (head dims 24, 72, 128; patch GEMM K = 588), plus attention at head dim 64, compiled for
sm_90a (H100/H200) on this CPU with Triton's bundled ptxas, specialised by Triton's own JIT binder from the
recorded arguments (`bivit.diagnose.gpu_build`). Read from the compiled kernels: no register spills anywhere, the GEMMs'
and attention's K loops software-pipelined (cp.async into multi-buffered shared memory) on wgmma.

The control compiles the same attention with the head dim as a run-time argument (the kernel before it was a
`tl.constexpr`): at head dim 72 it spills and is not pipelined, so the checks above can fail.

Child processes: compiling needs triton imported without TRITON_INTERPRET (the suite's conftest sets it).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'bivit[gpu]')")

HEAD_DIMS = {"demo": 24, "kimi-k2.5": 72, "kimi-k3": 128}


def _child(args: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def records() -> list[dict]:
    args = ["-m", "bivit.diagnose.gpu_build", "--arch", "90", "--dtype", "bfloat16", "--head-dim", "64", "--json"]
    for model in HEAD_DIMS:
        args += ["--model", model]
    return json.loads(_child(args))


def _of(records, kind: str) -> list[dict]:
    return [r for r in records if r["kernel"].split()[0] == kind]


def test_every_launch_of_the_three_forwards_compiles_for_sm90a(records):
    assert {r["kernel"].split()[0] for r in records} == {"gemm", "norm", "rope", "attention", "frame_mean"}
    assert {s for r in records for s in r["sources"]} == {f"{m} bf16" for m in HEAD_DIMS} | {"head_dim=64 bf16"}
    assert all(r["target"] == "sm_90a" for r in records)
    assert {f"D={d}" for d in (24, 72, 128, 64)} <= {w for r in _of(records, "attention") for w in r["kernel"].split()}
    assert any("K=588" in r["kernel"] for r in _of(records, "gemm"))  # the patch conv as the model runs it


def test_no_kernel_spills_registers(records):
    spilled = [r for r in records if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"] or r["local_bytes"]]
    assert spilled == []
    assert all(r["registers"] <= 255 for r in records)


def test_gemm_and_attention_loops_are_pipelined_on_wgmma(records):
    for r in _of(records, "gemm"):
        assert (r["num_stages"], r["pipeline_buffers"], r["cp_async"], r["wgmma"]) == (3, 3, True, True), r
    for r in _of(records, "attention"):
        assert (r["num_stages"], r["pipeline_buffers"], r["cp_async"], r["wgmma"]) == (2, 2, True, True), r


CONTROL = """
import dataclasses, importlib.util, inspect, json, re, sys
from pathlib import Path
import torch
from bivit.diagnose import gpu_build as build
from bivit.kernels import triton_jit as kernels

source = inspect.getsource(kernels.attention_kernel.fn)
assert len(re.findall(r"\\bD: tl\\.constexpr", source)) == 1
path = Path(sys.argv[1]) / "runtime_head_dim.py"
path.write_text("import triton\\nimport triton.language as tl\\n\\n\\n@triton.jit\\n"
                + re.sub(r"\\bD: tl\\.constexpr", "D", source.split("\\n", 1)[1]))
spec = importlib.util.spec_from_file_location("runtime_head_dim", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
launch, = build.attention_launches(72, torch.bfloat16)
compiled = build.compile_launch(dataclasses.replace(launch, kernel=module.attention_kernel))
print(json.dumps(build.inspect_compiled(compiled)))
"""


def test_control_head_dim_72_as_a_runtime_argument_spills_and_is_not_pipelined(tmp_path):
    r = json.loads(_child(["-c", textwrap.dedent(CONTROL), str(tmp_path)]))
    assert r["spill_stores"] > 0 and r["stack_bytes"] > 0
    assert r["pipeline_buffers"] == 1 and not r["cp_async"]
