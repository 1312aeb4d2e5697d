"""Exact on every machine: invariance by construction (bivit's compiled GEMM and attention) and proven where it runs
(the load-time proof, `bivit.ops.proof`). Every property is checked on whatever CPU runs the suite, with a
control that shows the same check fails for a GEMM that is not invariant; no test names the kernel a CPU has.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from PIL import Image

import bivit
from bivit import kernels, ops
from bivit.kernels.gemm import APPROXIMATE
from support.controls import row_count_dependent_gemms
from support.media import make_video, random_image

# Mixed sizes up to 448x336 (w x h) and odd aspect ratios: several 24-row attention units, both sides of the
# compiled attention's small-item split, GEMM row counts off every block size.
IMAGE_SIZES = [(300, 40), (224, 224), (448, 336), (90, 250), (28, 28)]
THREADS = (1, 2, 3, 4)  # 3 and 4: more threads than a 2-core CI machine has


def _rows_invariant(gemm, x: torch.Tensor) -> bool:
    """`gemm(rows) -> outputs`: each row bit-identical alone (1 thread), in the call (2), reversed (3), and at 4
    threads, in any row count."""
    torch.set_num_threads(2)
    ref = gemm(x)
    for threads, m in ((1, 1), (1, 2), (3, 5), (4, 64), (3, 77), (1, x.shape[0] - 1)):
        torch.set_num_threads(threads)
        if not (torch.equal(gemm(x[:m]), ref[:m]) and torch.equal(gemm(x[m:]), ref[m:])):
            return False
    torch.set_num_threads(3)
    return torch.equal(gemm(x.flip(0)).flip(0), ref)


@pytest.mark.parametrize("name,dtype", [("amx", torch.bfloat16), ("avx512_bf16", torch.bfloat16),
                                        ("fp32", torch.float32), ("fp32", torch.bfloat16), ("fp32", torch.float16)])
@pytest.mark.parametrize("gelu", [None, "tanh", "erf"])
def test_every_compiled_gemm_kernel_is_row_invariant_and_accurate(name, dtype, gelu):
    """Every GEMM kernel this CPU runs (not only the one chosen): a row's bits do not depend on the rows beside it,
    their number or the thread count, at shapes off every block size (K = 4304 and 588: the tower's MLP and patch
    GEMMs; N = 436); and its result is float64's within rounding. Control: the same check on a GEMM whose
    reduction order depends on the row count fails."""
    kernel = next((k for k in kernels.gemm_kernels() if k.name == name), None)
    if kernel is None:
        pytest.skip(f"this CPU does not run the {name} GEMM kernel")
    g = torch.Generator().manual_seed(1)
    for n, k in ((436, 4304), (96, 588)):
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        bias = torch.randn(n, generator=g)
        x = torch.randn(300, k, generator=g).to(dtype)
        packed = kernel.pack(w)

        def gemm(rows):
            return kernel(rows.contiguous(), packed, n, bias, torch.empty(rows.shape[0], n, dtype=dtype), gelu=gelu)

        assert _rows_invariant(gemm, x), (kernel.name, dtype, n, k)
        ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        if gelu is not None:
            ref = torch.nn.functional.gelu(ref, approximate=APPROXIMATE[gelu])
        tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(gemm(x).double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    with row_count_dependent_gemms():
        assert not _rows_invariant(lambda rows: torch.nn.functional.linear(rows, w), x)


def _inputs(tmp_path):
    images = [Image.fromarray(random_image(h, w, seed=i)) for i, (w, h) in enumerate(IMAGE_SIZES)]
    return images + [str(make_video(tmp_path / "clip.mp4", frames=6, size=(96, 64)))]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["demo", "kimi"])
def test_items_are_bit_identical_alone_packed_reversed_at_1_to_4_threads(model, dtype, kimi_ckpt, tmp_path):
    """The promise itself, on this machine: images up to 448x336 and a video, each encoded alone, packed with the
    others and packed in reverse order, at 1, 2, 3 and 4 threads: one set of bits. Control: default mode on the
    same inputs differs (stock kernels, or where those are row-count invariant here, row-count-dependent GEMMs)."""
    inputs = _inputs(tmp_path)
    path = None if model == "demo" else str(kimi_ckpt)
    threads = torch.get_num_threads()

    def runs(enc):
        out = []
        for t in THREADS:
            torch.set_num_threads(t)
            out.append([enc.encode([x])[0] for x in inputs])
            out.append(enc.encode(inputs))
            out.append(enc.encode(inputs[::-1])[::-1])
        return out

    try:
        results = runs(bivit.load_encoder(path, dtype=dtype))
        assert all(torch.equal(a, b) for run in results[1:] for a, b in zip(run, results[0]))
        default = bivit.load_encoder(path, dtype=dtype, batch_invariant=False)
        stock = runs(default)
        if all(torch.equal(a, b) for run in stock[1:] for a, b in zip(run, stock[0])):
            with row_count_dependent_gemms():
                stock = runs(default)
        assert not all(torch.equal(a, b) for run in stock[1:] for a, b in zip(run, stock[0]))
    finally:
        torch.set_num_threads(threads)


ENCODE = [sys.executable, "-m", "bivit", "encode"]


@pytest.mark.slow
def test_four_first_runs_started_together_give_the_same_bits(tmp_path):
    """Four `bivit encode` processes started at once, each loading the installed kernels and proving them: the same
    bits, which are also the bits of this process's encoder."""
    inputs = _inputs(tmp_path)
    files = []
    for i, im in enumerate(inputs[:-1]):
        im.save(tmp_path / f"im{i}.png")
        files.append(str(tmp_path / f"im{i}.png"))
    files.append(inputs[-1])
    procs = [subprocess.Popen([*ENCODE, *files, "--out", str(tmp_path / f"out{i}.safetensors")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    runs = [bivit.load_embeddings(tmp_path / f"out{i}.safetensors") for i in range(4)]
    mine = bivit.load_encoder(None, dtype="bfloat16").encode(files)
    for run in runs:
        assert [r.error for r in run] == [None] * len(files)
        assert all(torch.equal(r.embedding, m) for r, m in zip(run, mine))


BROKEN_KERNEL = textwrap.dedent("""
    import json, sys, torch
    import bivit
    from bivit import kernels
    from bivit.base import notices
    from bivit.kernels.gemm import APPROXIMATE
    from bivit.ops import bits

    class RowCountDependent:
        '''A GEMM whose rounding depends on the row count once a call has 64 rows or more (as a library GEMM
        that picks another kernel by shape): it passes the kernel self-test (at most 37 rows) and must be
        refused by the load-time proof.'''
        name, variant = "broken", "test"

        def takes(self, dtype):
            return dtype == torch.float32

        def describe(self):
            return "a row-count-dependent test GEMM"

        def pack(self, weight):
            return weight.detach().float().contiguous()

        def __call__(self, x, packed, n, bias, out, gelu=None, threads=None, bf16=None):
            acc = x.double() @ packed.double().t()
            if x.shape[0] >= 64 and x.shape[0] % 2:  # "another kernel": one more rounding step
                acc = acc + acc.abs() * 2.0 ** -20
            acc = acc.float() if bias is None else acc.float() + bias
            if gelu is not None:
                acc = torch.nn.functional.gelu(acc, approximate=APPROXIMATE[gelu])
            return out.copy_(acc)

    # Placed first among the library's GEMMs, and taken as computing bivit-arith/1 (its committed bits are
    # another matter): the load-time proof is then the one check that can refuse it.
    broken = RowCountDependent()
    library, conformance = kernels.gemm_kernels, bits.conformance
    kernels.gemm_kernels = lambda: (broken, *library())
    bits.conformance = lambda op, kernel, dtype: None if kernel is broken else conformance(op, kernel, dtype)
    enc = bivit.load_encoder(None, dtype="float32")
    d = enc.describe()
    x = [torch.rand(3, 28 * k, 28 * (k + 1)) for k in range(1, 6)]
    from bivit.media.pixels import preprocess_images
    items = [preprocess_images([(t * 255).byte().permute(1, 2, 0).numpy()]) for t in x]
    from bivit.media.pixels import MediaBatch
    alone = [enc.encode_batch(it)[0] for it in items]
    packed = enc.encode_batch(MediaBatch.concat(items))
    print(json.dumps({"gemm": d["kernels"]["gemm"], "refused": d["kernels"]["proof"]["refused"],
                      "invariant": all(torch.equal(a, b) for a, b in zip(alone, packed))}))
""")


def test_the_proof_refuses_a_gemm_that_is_not_invariant():
    """The refusal path: a GEMM kernel placed first (as a faster kernel would be) that computes a row differently
    at different row counts is refused at load, said once on stderr, listed in describe(); the next kernel
    runs and the encoder is invariant."""
    done = subprocess.run([sys.executable, "-c", BROKEN_KERNEL], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["invariant"] is True
    assert [r[:2] for r in out["refused"]] and all(r[:2] == ["gemm", "broken"] for r in out["refused"])
    assert "row-count-dependent" not in " ".join(out["gemm"])
    said = [line for line in done.stderr.splitlines() if "gemm path broken refused" in line]
    assert len(said) == 1, done.stderr


def test_doctor_prove_prints_the_table():
    """`bivit doctor --prove`: the proof run now on the demo model's shapes, one row per op, each proven."""
    done = subprocess.run([sys.executable, "-m", "bivit", "doctor", "--prove", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("proof "))
    table = lines[start + 2:-1]
    assert lines[start + 1].split()[:2] == ["op", "path"]
    ops_seen = {row.split()[0] for row in table}
    assert {"gemm", "attention", "layer_norm"} <= ops_seen
    assert all(" yes " in row for row in table)
    assert lines[-1].startswith(f"bits {ops.ARITH}: match (6 inputs, demo at float32)")


@pytest.mark.parametrize("name", ["amx", "avx512_bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_kernel_keeps_the_dtype_contract(monkeypatch, name, dtype):
    """`ops.linear` (with and without GELU, forward and backward) returns the weights' dtype whichever GEMM kernel
    this CPU runs computes it: a kernel that widens bf16 to fp32 must not hand fp32 on (the vLLM 41638 class of
    crash: a bf16 LayerNorm fed fp32)."""
    from bivit.ops import selection

    kernel = next((k for k in kernels.gemm_kernels() if k.name == name), None)
    if kernel is None or not kernel.takes(dtype):
        pytest.skip(f"this CPU does not run the {name} GEMM kernel for {dtype}")
    monkeypatch.setattr(selection, "_decide_gemm_kernel", lambda *a: kernel)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(40, 70, generator=g) / 8).to(dtype).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).requires_grad_()
    x = torch.randn(33, 70, generator=g).to(dtype).requires_grad_()
    with ops.batch_invariant():
        for gelu in (None, "tanh"):
            with torch.inference_mode():
                assert ops.linear(x.detach(), w.detach(), b.detach(), gelu=gelu).dtype == dtype
            y = ops.linear(x, w, b, gelu=gelu)
            assert y.dtype == dtype
            gx, gw, gb = torch.autograd.grad(y.float().sum(), (x, w, b))
            assert (gx.dtype, gw.dtype, gb.dtype) == (dtype,) * 3


def test_rope_tables_are_each_angles_float64_value_rounded_once():
    """RoPE's cos/sin tables came from PyTorch's float32 cos/sin, which (built with MKL) call MKL's vector math:
    on an AMX Xeon about one process in twenty got other last bits for one grid's table, so other embeddings
    for the same image (four first runs of one `bivit encode`, two answers). Each value is now the float64
    cos/sin of its float32 angle rounded once: a function of the angle alone, whatever the process, the grid
    or where the value sits. Checked against torch's float64 cos/sin of the same angles (formed as the
    reference forms them); the control shows float32 cos/sin, what bivit used, is not that function here."""
    from bivit.ops.rotary import _rope_cos_sin

    h, w, head_dim, theta = 64, 48, 72, 10000.0
    freqs = 1.0 / theta ** (torch.arange(0, head_dim // 4, dtype=torch.float32) * 4 / head_dim)
    rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float32).repeat(h)
    angles = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1).flatten(1)

    def layout(c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return c.repeat_interleave(2, dim=-1), torch.stack([-s, s], dim=-1).flatten(1)

    cos, sin = _rope_cos_sin(h, w, head_dim, theta)
    want = layout(angles.double().cos().float(), angles.double().sin().float())
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    small = _rope_cos_sin(h // 2, w, head_dim, theta)  # the same positions in another grid: the same values
    assert torch.equal(small[0], cos[: h // 2 * w]) and torch.equal(small[1], sin[: h // 2 * w])
    float32 = layout(angles.cos(), angles.sin())  # control
    assert not (torch.equal(float32[0], want[0]) and torch.equal(float32[1], want[1]))
