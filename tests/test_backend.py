"""Which kernel runs (`bivit.ops.selection`): invariant mode on a CPU runs bivit's installed kernels and nothing else,
or is refused with one line saying why; and bits that depend only on the checkpoint, the dtype settings and the
input, never on what the process did before, nor on which process computes them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

import bivit
from bivit import kernels
from bivit.base import state
from bivit.serve.client import parse_response
from support.installs import env_for, package_without
from support.media import mixed_inputs
from support.server import ServerProcess


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    return mixed_inputs(tmp_path_factory.mktemp("inputs"), [(28, 28), (84, 56), (150, 100)], 40, frames=24, fps=8)


def _bivit(args: list, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bivit", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=env)


def _said(done: subprocess.CompletedProcess) -> list[str]:
    """What a command said on stderr, less the demo model's notice (said by every command on the demo)."""
    return [line for line in done.stderr.strip().splitlines() if "DEMO model" not in line]


# ----------------------------------------------------------------------------- invariant mode: the kernels or no

def test_an_install_without_kernels_refuses_invariant_mode_in_one_line(tmp_path, inputs):
    """bivit installed without any of its compiled libraries: `bivit encode` in invariant mode says in one line
    why it cannot run (no traceback, nothing written), and default mode still encodes there. Control: the
    install under test encodes the same command."""
    env = env_for(package_without(tmp_path / "bare", [v.name for v in kernels.VARIANTS if v.name in
                                                      kernels.installed()]))
    out = tmp_path / "out.safetensors"
    refused = _bivit(["encode", inputs[0], "--out", out], env)
    lines = _said(refused)
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "invariant mode runs bivit's compiled kernels only" in lines[0] and "reinstall" in lines[0]
    assert not out.exists()
    stock = _bivit(["encode", inputs[0], "--out", out, "--no-batch-invariant"], env)
    assert stock.returncode == 0 and out.exists(), stock.stderr
    out.unlink()
    control = _bivit(["encode", inputs[0], "--out", out])
    assert control.returncode == 0 and out.exists(), control.stderr


def test_pytorchs_attention_is_refused_in_invariant_mode(tmp_path, inputs):
    """BIVIT_ATTENTION=sdpa (PyTorch's attention: another arithmetic) is refused by invariant mode in one line
    naming the variable; default mode runs it."""
    env = env_for(Path(bivit.__file__).parent.parent, BIVIT_ATTENTION="sdpa")
    out = tmp_path / "out.safetensors"
    refused = _bivit(["encode", inputs[0], "--out", out], env)
    lines = _said(refused)
    assert refused.returncode == 2 and len(lines) == 1 and "BIVIT_ATTENTION=sdpa" in lines[0], refused.stderr
    stock = _bivit(["encode", inputs[0], "--out", out, "--no-batch-invariant"], env)
    assert stock.returncode == 0 and out.exists(), stock.stderr


# ------------------------------------------------------------- the same bits in every process, whatever came before

_IN_ONE_PROCESS = """
import sys
import torch, bivit
from bivit.base import state
from bivit.kernels.gemm import APPROXIMATE
from bivit.ops import selection

ckpt, out, *inputs = sys.argv[1:]
run = lambda enc: [enc.encode([p])[0] for p in inputs]
f32 = bivit.load_encoder(ckpt, dtype="float32")
res = {"before": run(f32)}
for dtype in ("bfloat16", "float16"):
    res[dtype] = run(bivit.load_encoder(ckpt, dtype=dtype))
res["after"] = run(f32)
res["reloaded"] = run(bivit.load_encoder(ckpt, dtype="float32"))
res["paths"] = {str(d): str(selection.gemm_kernel(d)) for d in (torch.float32, torch.bfloat16, torch.float16)}


class Stock:
    '''PyTorch's GEMM behind the compiled kernel's interface: another arithmetic.'''
    name = variant = "stock"

    def describe(self):
        return "PyTorch F.linear"

    def pack(self, weight):
        return weight.detach()

    def __call__(self, x, packed, n, bias, out, gelu=None, threads=None, bf16=None):
        y = torch.nn.functional.linear(x.to(packed.dtype), packed, None if bias is None else bias.to(packed.dtype))
        return out.copy_(y if gelu is None else torch.nn.functional.gelu(y, approximate=APPROXIMATE[gelu]))


# The control: a process-wide switch of the float32 GEMM kernel after the other loads, as bivit once did.
selection._decide_gemm_kernel = lambda *a: Stock()
state.reset(state.WEIGHTS)
res["switched"] = run(f32)
torch.save(res, out)
"""


def _python(*args) -> None:
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_float32_bits_do_not_depend_on_the_process_or_its_history(kimi_ckpt, inputs, tmp_path):
    """In one fresh process: float32 encodes of images and a video are the same bits before and after bf16 and
    float16 encoders were loaded and used, and from a float32 encoder loaded afterwards; the same bits as
    `bivit encode` in another fresh process, as a `bivit serve` process answers, and as this (long-lived)
    test process computes. bf16 agrees between the processes too. Control: switching the float32 GEMM kernel
    mid-process to PyTorch's gives other bits, and the check sees it."""
    _python("-c", _IN_ONE_PROCESS, kimi_ckpt, tmp_path / "one.pt", *inputs)
    one = torch.load(tmp_path / "one.pt")
    n = len(inputs)
    for phase in ("after", "reloaded"):
        assert all(torch.equal(a, b) for a, b in zip(one[phase], one["before"])), (phase, one["paths"])
    assert [t.dtype for t in one["before"] + one["bfloat16"] + one["float16"]] == \
        [torch.float32] * n + [torch.bfloat16] * n + [torch.float16] * n
    assert not all(torch.equal(a, b) for a, b in zip(one["switched"], one["before"]))  # the control

    cli_out = tmp_path / "cli.safetensors"
    _python("-m", "bivit", "encode", *inputs, "--model", kimi_ckpt, "--dtype", "float32", "--out", cli_out)
    with bivit.load_embeddings(cli_out) as f:
        assert f.encoder["dtype"] == "float32"
        cli = [r.embedding for r in f]
    assert all(torch.equal(a, b) for a, b in zip(cli, one["before"]))

    with ServerProcess(["--model", str(kimi_ckpt), "--dtype", "float32"], tmp_path) as srv:
        files = [("file", (p.name, p.read_bytes(), "video/mp4" if p.suffix == ".mp4" else "image/png"))
                 for p in inputs]
        r = httpx.post(f"{srv.url}/v1/encode", files=files, timeout=300)
        assert r.status_code == 200, r.text[:500]
        _, served = parse_response(r.content)
    assert [s.kind for s in served] == ["image"] * (n - 1) + ["video"]
    assert all(torch.equal(s.embedding, b) for s, b in zip(served, one["before"]))

    here = {d: bivit.load_encoder(kimi_ckpt, dtype=d) for d in ("float32", "bfloat16")}
    assert all(torch.equal(here["float32"].encode([p])[0], b) for p, b in zip(inputs, one["before"]))
    assert all(torch.equal(here["bfloat16"].encode([p])[0], b) for p, b in zip(inputs, one["bfloat16"]))


def test_kernel_choices_and_bits_do_not_depend_on_torchs_default_dtype(fresh_state):
    """vLLM loads a model with torch's default dtype set to the engine's (bf16): the kernels' self-tests,
    conformance problems and proof name their dtypes, so the same kernels pass, the class is the same, and the
    load-time proof holds. Control: a conformance problem built in the default dtype is not the committed one."""
    from bivit.ops import bits

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        kinds = {d: backend_kernels(d) for d in (torch.float32, torch.bfloat16)}
        classes = {d: bivit.ops.bits_class((d, d), torch.device("cpu"), True) for d in kinds}
        built_by_default = torch.empty(3)
    finally:
        torch.set_default_dtype(before)
    assert all(c == bits.ARITH for c in classes.values()), classes
    state.reset()
    assert kinds == {d: backend_kernels(d) for d in kinds}
    assert built_by_default.dtype == torch.bfloat16  # the control: what an unnamed dtype would have been


def backend_kernels(dtype: torch.dtype) -> tuple[str, str]:
    from bivit.ops import selection

    return selection.gemm_kernel(dtype).name, selection.attention_kernel(dtype).name_for(dtype)


def test_a_forced_gemm_kernel_that_does_not_conform_is_refused_naming_the_variable(monkeypatch, fresh_state):
    """`BIVIT_GEMM=<kernel>` naming a kernel whose bits are not bivit-arith/1 here (AMX tiles may not be) leaves
    invariant mode nothing to run: a ConfigError naming the variable and the fix, not another arithmetic. Here the
    conformance check is made to fail for the kernel this CPU runs bf16 on. Control: unforced, the next kernel
    (fp32, widened) runs."""
    from bivit.ops import selection, bits

    name = selection.gemm_kernel(torch.bfloat16).name
    state.reset()
    real = bits.conformance
    monkeypatch.setattr(bits, "conformance", lambda op, k, d: "off (test)" if k.name == name else real(op, k, d))
    monkeypatch.setenv(selection.GEMM_ENV, name)
    with pytest.raises(bivit.ConfigError, match=f"{selection.GEMM_ENV}={name}: .*unset {selection.GEMM_ENV}"):
        selection.gemm_kernel(torch.bfloat16)
    monkeypatch.delenv(selection.GEMM_ENV)
    state.reset()
    if name != "fp32":
        assert selection.gemm_kernel(torch.bfloat16).name == "fp32"
