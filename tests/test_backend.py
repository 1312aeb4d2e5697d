"""Which kernel runs (`bivit.ops.backend`), and bits that depend only on the checkpoint, the dtype settings and
the input: never on what the process did before, nor on which process computes them.

The kernel choice is made once per process and per dtype from the CPU and the PyTorch build, and never switched
by a failure. Most tests here are about the fallback GEMM (PyTorch's oneDNN GEMMs at proven tiles, where no
compiled GEMM runs): they force it, and the choices a CPU of another kind would make there (bf16 widened to
float32, as on an AVX2 CPU) by monkeypatching what oneDNN reports, with fresh per-process decisions.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

import bivit
from bivit import ops, state
from bivit.client import parse_response
from bivit.kernels import cache as kernels_cache
from bivit.media import preprocess_images
from bivit.ops import backend
from support.server import ServerProcess
from support.controls import differences_found_by_check, differing
from support.media import make_video, random_image

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _broken(*args, **kwargs):
    raise RuntimeError("simulated: the kernel raised")


def _fresh_decisions(monkeypatch) -> None:
    """The fallback GEMM from now on, with the process's decisions, plans, proofs and prepared weights forgotten:
    `ops.gemm_path` decides again, from what oneDNN reports now. (The test takes `fresh_state`, which forgets
    them again after it.)"""
    monkeypatch.setattr(backend, "_decide_gemm_kernel", lambda *a: None)
    state.reset()


# ------------------------------------------------------------------------------------------ the decision

def test_the_decision_is_per_dtype(fresh_state):
    """What oneDNN says about bf16 decides bf16's path and nothing else: forced one way and the other, bf16's
    compute dtype follows it, and the float32 and float16 paths are exactly this process's real ones."""
    real = {d: backend.gemm_path(d) for d in DTYPES}
    query = "_is_mkldnn_bf16_supported"
    stock = getattr(torch.ops.mkldnn, query)
    decided = {}
    with pytest.MonkeyPatch.context() as mp:
        for native in (False, True):
            mp.setattr(torch.ops.mkldnn, query, lambda native=native: native)
            state.reset(state.CHOICES)
            decided[native] = {d: ops.gemm_path(d) for d in DTYPES}
            mp.setattr(torch.ops.mkldnn, query, _broken)  # asked again after the decision: never
            assert all(ops.gemm_path(d) is decided[native][d] and ops.gemm_path(d, "cpu") is decided[native][d]
                       for d in DTYPES)
    assert getattr(torch.ops.mkldnn, query) is stock
    assert decided[False][torch.bfloat16].compute == torch.float32
    assert decided[True][torch.bfloat16].compute == torch.bfloat16
    for native in (False, True):
        assert decided[native][torch.float32] == real[torch.float32]
        assert decided[native][torch.float16] == real[torch.float16]
    assert real[torch.float32].compute == torch.float32  # float32 is never narrowed or widened
    assert real[torch.bfloat16] in (decided[False][torch.bfloat16], decided[True][torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_failing_after_the_decision_raises_and_switches_nothing(monkeypatch, fresh_state, dtype):
    """The pre-packed GEMM raising mid-run, or the weight packing raising for a new weight (what a bf16 load
    did on an AVX2 CPU), is `KernelFailed`: nothing is switched to another kernel that rounds differently, so
    once the kernel runs again, the same call gives the same bits as before, on the same path."""
    _fresh_decisions(monkeypatch)
    path = ops.gemm_path(dtype)
    if not path.packed:
        pytest.skip(f"{path.describe()}: no pre-packed GEMM in this build, so none can fail after the decision")
    g = torch.Generator().manual_seed(0)
    x, w, w2 = (torch.randn(*s, generator=g).to(dtype) for s in ((300, 96), (64, 96), (48, 96)))
    b = torch.randn(64, generator=g).to(dtype)
    with ops.batch_invariant(), torch.inference_mode():
        before = ops.linear(x, w, b, gelu="tanh")
        stock = {name: getattr(torch.ops.mkldnn, name) for name in ("_linear_pointwise", "_reorder_linear_weight")}
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", _broken)
        with pytest.raises(ops.KernelFailed, match="packed GEMM raised"):
            ops.linear(x, w, b, gelu="tanh")
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", _broken)
        with pytest.raises(ops.KernelFailed, match="packing"):
            ops.linear(x, w2)
        for name, fn in stock.items():
            monkeypatch.setattr(torch.ops.mkldnn, name, fn)
        assert ops.gemm_path(dtype) is path
        assert torch.equal(ops.linear(x, w, b, gelu="tanh"), before)
        # The control: the kernel the old code switched to (PyTorch's GEMM) gives other bits for the same rows.
        monkeypatch.setattr(backend, "_decide_gemm_path", lambda *a: dataclasses.replace(path, packed=False,
                                                                                         fused_gelu=False))
        state.reset(state.PROOFS, state.WEIGHTS)
        assert not torch.equal(ops.linear(x, w, b, gelu="tanh"), before)


def test_a_failed_load_leaves_the_float32_bits_alone(monkeypatch, fresh_state, kimi_ckpt, tmp_path):
    """The old failure, end to end: loading a bf16 encoder whose weights cannot be packed raises `KernelFailed`
    (it used to switch the whole process to other kernels); a float32 encoder loaded before keeps its bits.
    A kernel cache of its own: with no plan recorded, the load proves the plans and packs then (where a plan is
    recorded, packing waits for the first encode, and an earlier test in this process may have recorded it)."""
    real = {d: ops.gemm_path(d) for d in DTYPES}
    _fresh_decisions(monkeypatch)
    monkeypatch.setenv(kernels_cache.CACHE_ENV, str(tmp_path / "kernel-cache"))
    if not ops.gemm_path(torch.bfloat16).packed:
        pytest.skip(f"{ops.gemm_path(torch.bfloat16).describe()}: no packing to fail")
    items = [preprocess_images([random_image(h, w, 7)]) for h, w in ((28, 28), (84, 56), (112, 140))]
    f32 = bivit.load_encoder(kimi_ckpt, dtype="float32")
    before = [f32.encode_batch(it)[0] for it in items]
    stock = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", _broken)
    with pytest.raises(ops.KernelFailed):
        bivit.load_encoder(kimi_ckpt, dtype="bfloat16")
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", stock)
    assert all(torch.equal(f32.encode_batch(it)[0], b) for it, b in zip(items, before))
    assert all(ops.gemm_path(d) == real[d] for d in DTYPES)


# ------------------------------------------------------------------------------ bf16 widened to float32

def test_widened_bf16_is_invariant_and_within_bf16_rounding_of_stock(monkeypatch, fresh_state, kimi_ckpt):
    """The path of a CPU without a bf16 GEMM (AVX2): bf16 weights widened to float32 once, exact products,
    results rounded to bf16. Forced here by what oneDNN reports. It is batch-invariant (control: the same check
    finds items that change with their batch on a default-mode encoder) and within bf16 rounding of the path
    this CPU runs by itself."""
    items = [preprocess_images([random_image(h, w, s)]) for s, (h, w) in enumerate(
        [(28, 28)] * 4 + [(28, 56), (84, 28), (56, 56), (112, 112), (140, 84)])]
    stock_enc = bivit.load_encoder(kimi_ckpt, dtype="bfloat16")
    stock = [stock_enc.encode_batch(it)[0] for it in items]

    _fresh_decisions(monkeypatch)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    path = ops.gemm_path(torch.bfloat16)
    assert path.compute == torch.float32 and "widened" in path.describe()
    enc = bivit.load_encoder(kimi_ckpt, dtype="bfloat16")
    order = list(range(len(items)))[::-1]
    assert differing(enc, items, order) == []
    assert differing(enc, items, list(range(len(items))), budget=50) == []
    wide = [enc.encode_batch(it)[0] for it in items]
    for a, b in zip(wide, stock):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        assert float((a.float() - b.float()).abs().max()) <= 2 ** -5 * float(b.float().abs().max())
    assert differences_found_by_check(bivit.load_encoder(kimi_ckpt, dtype="bfloat16", batch_invariant=False),
                                      items, order) != []


# ------------------------------------------------------------- the same bits in every process, whatever came before

_IN_ONE_PROCESS = """
import dataclasses, functools, sys
import torch, bivit
from bivit.ops import backend

ckpt, out, *inputs = sys.argv[1:]
run = lambda enc: [enc.encode([p])[0] for p in inputs]
f32 = bivit.load_encoder(ckpt, dtype="float32")
res = {"before": run(f32)}
for dtype in ("bfloat16", "float16"):
    res[dtype] = run(bivit.load_encoder(ckpt, dtype=dtype))
res["after"] = run(f32)
res["reloaded"] = run(bivit.load_encoder(ckpt, dtype="float32"))
res["paths"] = {str(d): str(backend.gemm_kernel(d)) for d in (torch.float32, torch.bfloat16, torch.float16)}
# The control: the old behaviour, a process-wide switch of the float32 GEMM kernel after the bf16 load (here
# from the compiled GEMM, or from oneDNN's packed GEMM where none runs, to PyTorch's stock call at proven tiles).
real = backend.gemm_path(torch.float32)
backend._decide_gemm_kernel = lambda *a: None
backend._decide_gemm_path = lambda *a: dataclasses.replace(real, packed=not real.packed, fused_gelu=False)
res["switched"] = run(f32)
torch.save(res, out)
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("inputs")
    paths = []
    for i, (h, w) in enumerate([(28, 28), (84, 56), (150, 100)]):
        paths.append(d / f"img{i}.png")
        Image.fromarray(random_image(h, w, seed=40 + i)).save(paths[-1])
    paths.append(make_video(d / "clip.mp4", frames=24, fps=8, size=(84, 56)))
    return paths


def _python(*args) -> None:
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_float32_bits_do_not_depend_on_the_process_or_its_history(kimi_ckpt, inputs, tmp_path):
    """In one fresh process: float32 encodes of images and a video are the same bits before and after bf16 and
    float16 encoders were loaded and used, and from a float32 encoder loaded afterwards; the same bits as
    `bivit encode` in another fresh process, as a `bivit serve` process answers, and as this (long-lived)
    test process computes. bf16 agrees between the processes too. Control: switching the float32 GEMM kernel
    mid-process, as bivit once did after a failed bf16 load, gives other bits, and the check sees it."""
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
