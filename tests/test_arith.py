"""One set of bits on every CPU: bivit-arith/1 (docs/arithmetic.md), computed by every kernel this machine runs and
checked against committed hashes, whatever CPU runs the suite.

* The committed conformance hashes (`bivit.ops.bits.CONFORMANCE`) are the bits of a numpy transcription of the
  arithmetic (tests/support/arith_reference.py: no C, no PyTorch op), and a changed order of any reduction (a
  bf16 pair, an 8-lane sum, another chunk of keys, a numerator left unrounded) gives other ones (controls).
* Every kernel of every variant this CPU runs computes them (AMX tiles: measured and reported, used only where
  they do).
* Whole rows: bivit's model equals a numpy forward pass written from the spec (tests/support/arith_model.py), and
  the golden inputs' rows from every kernel, at 1-4 threads, alone, packed and reversed, equal the committed ones
  (bivit/diagnose/golden.json), held to AVX2 too where the CPU has more.
* The class of bits travels: describe(), the fingerprint, encoder-cache ids, doctor; mixing classes is refused.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bivit
from bivit import kernels, ops
from bivit.base import state
from bivit.diagnose import golden
from bivit.kernels.gemm import APPROXIMATE
from bivit.ops import bits, selection
from support import arith_model, arith_reference as R
from support.variants import CAPABILITY, FLAGS, RUNNABLE, library_or_skip



def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def _hash(*arrays: np.ndarray) -> str:
    return bits.digest(*(torch.from_numpy(np.ascontiguousarray(a, np.float32)) for a in arrays))


# --------------------------------------------------------------------------------- the committed bits


def _reference(op: str, dtype: torch.dtype, **variation) -> str:
    """The numpy transcription's hash of a conformance problem (with a variation of the order: the controls)."""
    name = str(dtype).removeprefix("torch.")
    if op == "gemm":
        x, w, b = (_np(t) for t in bits.gemm_problem(dtype))
        return _hash(*(R.gemm(x, w, b, act, dtype == torch.bfloat16, **variation) for act in (None, "tanh", "erf")))
    if op == "attention":
        q, k, v, lens, (cos, sin) = bits.attention_problem(dtype)
        return _hash(R.attention(_np(q), _np(k), _np(v), lens, name, (_np(cos), _np(sin)), **variation))
    x, w, b = (_np(t) for t in bits.norm_problem(dtype))
    return _hash(R.layer_norm(x, w, b, 1e-5, **variation), R.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("op,dtype", [(op, name) for op, name in bits.CONFORMANCE])
def test_committed_conformance_bits_are_the_numpy_transcriptions(op, dtype):
    assert _reference(op, getattr(torch, dtype)) == bits.CONFORMANCE[(op, dtype)]


@pytest.mark.parametrize("op,dtype,variation", [
    ("gemm", torch.bfloat16, {"pairs_swapped": True}),   # vdpbf16ps on pairs as stored: k + 1 before k
    ("gemm", torch.float32, {"pairs_swapped": True}),
    ("attention", torch.float32, {"lanes": 8}),          # the softmax sum in AVX2's 8 lanes
    ("attention", torch.bfloat16, {"lanes": 8}),
    ("attention", torch.bfloat16, {"round_p": False}),   # numerators left in fp32 for the values
    ("attention", torch.float32, {"chunk": 256}),        # the values' sums in chunks of 128 bf16 pairs
    ("norm", torch.float32, {"lanes": 8}),               # PyTorch's AVX2 LayerNorm width
    ("norm", torch.bfloat16, {"lanes": 4}),              # ... and NEON's
])
def test_control_a_changed_order_gives_other_bits(op, dtype, variation):
    """The check can fail: each of the orders other kernels computed before bivit-arith/1 gives other bits on the
    conformance problems (they are built so that any change of order shows)."""
    assert _reference(op, dtype, **variation) != bits.CONFORMANCE[(op, str(dtype).removeprefix("torch."))]


# ----------------------------------------------------------------------------------- every kernel


@pytest.fixture(scope="module")
def emulated_avx512(tmp_path_factory):
    """The avx512 variant's own C source built for this CPU with every AVX-512 and AMX instruction emulated
    (tests/support/emu/avx512_on_avx2.h: SIMDe, and exact models of vdpbf16ps, vcvtneps2bf16 and AMX tiles), so
    that a machine without AVX-512 runs its code too."""
    simde = pytest.importorskip("simde_py", reason="simde-py (the test extra) emulates AVX-512 here")
    if not {"avx2", "fma", "f16c"} <= FLAGS:
        pytest.skip("the emulation itself needs AVX2, FMA and F16C")
    import ctypes

    from bivit.kernels import abi

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the emulated variant with (the suite's own build, not bivit's)")
    here = os.path.dirname(__file__)
    out = tmp_path_factory.mktemp("emu") / "avx512_emulated.so"
    src = Path(kernels.__file__).parent / kernels.VARIANTS[0].source
    done = subprocess.run([cc, "-O1", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-mavx2",
                           "-mfma", "-mf16c", "-Wno-psabi", f"-I{simde.get_include()}", "-include",
                           os.path.join(here, "support", "emu", "avx512_on_avx2.h"), str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    abi.bind(lib)
    return lib


def test_the_avx512_variant_computes_the_committed_bits_emulated(emulated_avx512):
    """The avx512 variant's code, run here under emulation: its fp32 and avx512_bf16 GEMMs, attention (bf16 pairs
    swapped for vdpbf16ps) and norms give the committed bits. AMX GEMMs under the two orders a chain of pair
    products could take: exactly the packing made for that order conforms (so a CPU whose tdpbf16ps is such a
    chain runs bivit-arith/1 on its tiles), and the AMX attention (its own exp and sums) does not."""
    from bivit.kernels.gemm import GemmKernel

    lib = emulated_avx512
    for name in ("fp32", "avx512_bf16"):
        kernel = GemmKernel(lib, "avx512", name)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if kernel.takes(dtype):
                assert bits.conformance("gemm", kernel, dtype) is None, (name, dtype)
    attention = kernels.Attention(lib, "avx512")
    for dtype in (torch.float32, torch.bfloat16):
        assert bits.conformance("attention", attention, dtype) is None, dtype
        assert bits.conformance("norm", kernels.Norm(lib), dtype) is None, dtype
    assert bits.conformance("attention", kernels.Attention(lib, "avx512", True), torch.bfloat16) is not None
    for upper_first, conforming in ((1, "amx_swapped"), (0, "amx")):
        lib.emu_set_amx_order(upper_first)
        state.reset(state.PROOFS)  # (proven per kernel; the same kernels compute otherwise now)
        for name in ("amx", "amx_swapped"):
            kernel = GemmKernel(lib, "avx512", name)
            assert (bits.conformance("gemm", kernel, torch.bfloat16) is None) == (name == conforming), \
                (upper_first, name)
    state.reset()


@pytest.fixture(scope="module", params=[v.name for v in kernels.VARIANTS])
def library(request):
    return library_or_skip(request.param)


def test_every_kernel_of_the_variant_computes_the_committed_bits(library, record_property):
    """GEMMs (every kernel, every dtype it takes), attention and norms of each variant this CPU runs: the
    committed bits. AMX tiles are measured, not required: which pair order (if any) tdpbf16ps computes as
    bivit-arith/1 is reported, and the kernel the backend chooses for bf16 is one that conforms."""
    found = {}
    for kernel in library.gemms:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if kernel.takes(dtype):
                found[f"gemm {kernel.name} {dtype}"] = bits.conformance("gemm", kernel, dtype)
    for dtype in (torch.float32, torch.bfloat16):
        found[f"attention {library.attention.name} {dtype}"] = bits.conformance("attention", library.attention, dtype)
    if library.attention_amx is not None:
        found["attention amx bf16"] = bits.conformance("attention", library.attention_amx, torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        found[f"norm {dtype}"] = bits.conformance("norm", library.norm, dtype)
    record_property("conformance", json.dumps(found))
    print(json.dumps(found, indent=1))
    required = {k: v for k, v in found.items() if "amx" not in k}
    assert all(v is None for v in required.values()), required


def test_the_chosen_kernels_compute_the_committed_bits():
    """In canonical mode (the default) every kernel the backend chooses here conforms, and the class is
    bivit-arith/1."""
    for dtype in (torch.float32, torch.bfloat16):
        assert bits.conformance("gemm", selection.gemm_kernel(dtype), dtype) is None
        assert bits.conformance("attention", selection.attention_kernel(dtype), dtype) is None
        assert bits.conformance("norm", selection.norm_kernel(dtype), dtype) is None
        assert ops.bits_class((dtype, dtype), torch.device("cpu"), True) == bits.ARITH


def test_control_a_kernel_of_another_order_is_not_conformant():
    """The conformance check refuses a kernel whose bits differ: PyTorch's own GEMM in the GEMM kernel's shape."""

    class Stock:
        name = "stock"

        def pack(self, w):
            return w.detach().clone()

        def __call__(self, x, packed, n, bias, out, gelu=None, bf16=None):
            y = torch.nn.functional.linear(x.float(), packed.float(), bias)
            return out.copy_(y if gelu is None else torch.nn.functional.gelu(y, approximate=APPROXIMATE[gelu]))

    for dtype in (torch.float32, torch.bfloat16):
        assert "not bivit-arith/1's" in bits.conformance("gemm", Stock(), dtype)


# ------------------------------------------------------------------------------------- whole rows


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["demo", "kimi"])
def test_rows_equal_a_numpy_forward_written_from_the_spec(model, dtype, kimi_ckpt):
    """bivit's rows for an image of 48 patches (attention over more than 16 keys, position table resampled) and a
    2-frame video chunk (temporal term and mean) equal, bit for bit, a forward pass written from the spec in
    numpy, which shares no code with bivit's model, ops or kernels."""
    enc = bivit.load_encoder(None if model == "demo" else kimi_ckpt, dtype=dtype)
    images = [golden.pixels(84, 112, 7), golden.pixels(56, 56, 8)]
    video = bivit.VideoFrames([golden.pixels(56, 56, 9), golden.pixels(56, 56, 10)], 2.0)
    batch = bivit.MediaBatch.concat([enc.preprocess([images[0]]), enc.prepare(video).batch])
    grids = [tuple(g) for g in batch.grid_thw.tolist()]
    assert grids[0][0] == 1 and grids[1][0] == 2 and grids[0][1] * grids[0][2] > 16
    got = enc.encode_batch(batch)
    state = {k: _np(v) for k, v in enc.model.state_dict().items()}
    want = arith_model.forward(state, enc.config, _np(batch.pixel_values), grids, dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, torch.from_numpy(w).to(g.dtype))


HELD_TO_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _golden_configs() -> list[tuple[str, dict]]:
    """(name, environment) of each kernel set this CPU runs: every variant with each bf16 GEMM kernel of it that
    computes bivit-arith/1 (the first: the variant's default); the avx2 one, where PyTorch runs AVX-512, with the
    whole process held to AVX2 (PyTorch's and oneDNN's kernels too)."""
    out = []
    for v in RUNNABLE:
        env = {"BIVIT_ATTENTION": v.name, **(HELD_TO_AVX2 if v.name == "avx2" and CAPABILITY == "AVX512" else {})}
        gemms = [g.name for g in kernels.load_library(v).gemms
                 if g.takes(torch.bfloat16) and bits.conformance("gemm", g, torch.bfloat16) is None]
        out.append((v.name, env))
        out += [(f"{v.name} {g}", {**env, "BIVIT_GEMM": g}) for g in gemms[1:]]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", [name for name, _ in _golden_configs()])
def test_golden_rows_from_every_kernel_at_1_to_4_threads_alone_packed_reversed(config, kimi_ckpt):
    """The golden inputs (five images of mixed sizes, a video) encoded by each kernel set this CPU runs, in a
    process of its own, on the demo model and the Kimi-shaped checkpoint in bf16 and fp32: alone at 1 thread,
    packed at 2, reversed at 3 and alone at 4 (the portable variant, slow: alone at 1 and packed at 2) give the
    committed rows, bit for bit."""
    env = dict(_golden_configs())[config]
    committed = golden.committed()[bits.ARITH]
    layouts = "alone@1,packed@2" if config == "portable" else "alone@1,packed@2,reversed@3,alone@4"
    specs = {f"{path}:{dtype}": (model, dtype) for model, path in (("demo", "demo"), ("kimi-small", str(kimi_ckpt)))
             for dtype in ("bfloat16", "float32")}
    done = subprocess.run([sys.executable, "-m", "support.golden_rows", layouts, *specs], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=1200, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr
    for spec, out in json.loads(done.stdout.splitlines()[-1]).items():
        model, dtype = specs[spec]
        want = committed[model][dtype]
        assert out["bits"] == bits.ARITH, (model, dtype, out)
        for layout, rows in out["rows"].items():
            assert rows == want, (model, dtype, layout, out["kernels"],
                                  {k: (rows[k][:12], want[k][:12]) for k in rows if rows[k] != want.get(k)})


# ----------------------------------------------------------------------------------- the class travels


def test_the_class_is_in_describe_the_fingerprint_and_every_encoder_cache_id():
    """describe()["bits"] names the class; the fingerprint (hence every encoder-cache id and cache key) is a function
    of it: the same weights computed by another class of kernels get other ids."""
    from bivit.core.encoder_cache import ec_id
    from bivit.checkpoint.weights import fingerprint

    enc = bivit.load_encoder(None, dtype="bfloat16")
    assert enc.describe()["bits"] == enc.bits
    other = f"native/gemm-bfloat16=amx/{enc.bits}"
    prints = {b: fingerprint(enc.model, output_dtype=enc.output_dtype, batch_invariant=True,
                             processing=enc.processing, alpha=enc.alpha, bits=b) for b in (enc.bits, other)}
    assert prints[enc.bits] == enc.fingerprint != prints[other]
    assert ec_id(prints[enc.bits], "0" * 64, "image", 0) != ec_id(prints[other], "0" * 64, "image", 0)
    assert bivit.load_encoder(None, dtype="bfloat16", batch_invariant=False).bits.startswith("stock/")


@pytest.mark.slow
def test_a_dataset_folder_refuses_a_run_of_another_class(tmp_path):
    """`bivit encode-dataset` into a folder written by this class, rerun by a process whose kernels compute another
    class (on one CPU every configuration of invariant mode is bivit-arith/1 or refused, save AMX's native class,
    so the rerun's class is set in the process: `native/...`): one line naming both classes, exit 1, nothing
    written."""
    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    Image.fromarray(golden.pixels(56, 84, 1)).save(src / "a.png")
    args = ["encode-dataset", str(src), "--out", str(tmp_path / "out"), "--no-progress"]
    first = subprocess.run([sys.executable, "-m", "bivit", *args], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    Image.fromarray(golden.pixels(56, 56, 2)).save(src / "b.png")
    other = ("import sys; from bivit.ops import dispatch; from bivit.cli import main; "
             "dispatch.CpuBackend.bits = lambda self, dtypes, invariant: 'native/gemm-bfloat16=amx/test'; "
             "sys.argv[0] = 'bivit'; main()")
    again = subprocess.run([sys.executable, "-c", other, *args], capture_output=True, text=True, timeout=600)
    assert again.returncode != 0
    lines = [line for line in again.stderr.splitlines() if "written by a different encoder" in line]
    assert len(lines) == 1 and f"bits '{bits.ARITH}' there vs 'native/" in lines[0], again.stderr
    assert "Traceback" not in again.stderr
    assert len(bivit.load_embeddings(tmp_path / "out")) == 1


def test_the_proof_loads_a_checkpoint_whose_gemm_shapes_coincide(tmp_path):
    """Text hidden size 4x the vision hidden size: the projector's two GEMMs are both 256x256, one with GELU and one
    without. The load-time proof keys GEMMs by shape and GELU (it sorted None against a GELU's name and crashed)."""
    from bivit.checkpoint.config import ModelConfig
    from support.checkpoints import write_checkpoint

    cfg = ModelConfig(pos_emb_height=4, pos_emb_width=4, hidden_size=64, num_layers=1, num_heads=2,
                      intermediate_size=96, text_hidden_size=256)
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg)
    enc = bivit.load_encoder(ckpt, dtype="bfloat16")
    checks = [c["op"] for c in enc.describe()["kernels"]["proof"]["checks"]]
    assert {"gemm 256->256+gelu bfloat16", "gemm 256->256 bfloat16"} <= set(checks)
    assert enc.encode([golden.pixels(56, 56, 3)])[0].shape == (4, 256)
