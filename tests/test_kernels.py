"""bivit's compiled kernels (`bivit.kernels`), every variant this CPU can run: the attention's accuracy against
float64 attention, bits independent of the batch and of the thread count (with a control that does depend on
the batch), gradients; the RoPE kernel's bits equal to PyTorch's; and the selection rules (`BIVIT_ATTENTION`, CPU
flags, PyTorch's capability, the variants installed)."""

import ctypes
import itertools
import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from bivit import kernels, ops
from bivit.kernels import abi, gemm
from bivit.ops import attend as attention_op
from support.variants import FLAGS, RUNNABLE, library_or_skip
CAN_RUN = bool(RUNNABLE)
AUTO_USES_IT = CAN_RUN and "amx_bf16" not in FLAGS  # BIVIT_ATTENTION=auto picks a variant here
needs_cpu = pytest.mark.skipif(not CAN_RUN, reason="no variant of the compiled attention runs on this CPU")


@pytest.fixture(scope="module", params=[v.name for v in kernels.VARIANTS])
def library(request):
    """Each variant of the compiled attention this CPU (and PyTorch's dispatch) can run, loaded directly (also on AMX CPUs, where `auto` would leave PyTorch's attention in place). A CPU that can run
    it must get it: an install without it fails the test. On an AVX-512 machine both variants run (AVX2 code runs
    there), so the AVX2 kernel is tested wherever the AVX-512 one is."""
    return library_or_skip(request.param)


@pytest.fixture(scope="module")
def kernel(library):
    return library.attention


def _qkv(n: int, heads: int, d: int, seed: int = 0, scale: float = 1.5,
         dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """q/k/v as the model passes them: strided views of one packed [n, 3, heads, d] tensor."""
    x = torch.randn(n, 3, heads, d, generator=torch.Generator().manual_seed(seed))
    x[:, :2] *= scale
    return x.to(dtype).unbind(1)


def _reference(q, k, v) -> torch.Tensor:
    return F.scaled_dot_product_attention(*(t.double().transpose(0, 1) for t in (q, k, v))).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,heads,d", [(1, 2, 72), (5, 3, 8), (17, 4, 24), (100, 4, 32), (513, 2, 72),
                                       (64, 2, 96), (130, 3, 128), (31, 2, 70), (1500, 2, 72)])
def test_matches_float64_attention_as_closely_as_pytorchs(kernel, n, heads, d, dtype):
    """Error against float64 attention at most twice what PyTorch's fused attention makes in the same dtype
    (plus one rounding step of the output; measured: 1.0-1.7x in fp32, equal in bf16), and the log-sum-exp the backward pass uses agrees with float64's."""
    q, k, v = _qkv(n, heads, d, seed=n + d, dtype=dtype)
    out, lse = torch.empty_like(q), torch.empty(heads, n)
    kernel(q, k, v, out, [n], lse)
    ref = _reference(q, k, v)
    ours = float((out.double() - ref).abs().max())
    stock = float((F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1).double()
                   - ref).abs().max())
    assert ours <= 2 * stock + torch.finfo(dtype).eps * float(ref.abs().max())
    scores = torch.einsum("ihd,jhd->hij", q.double(), k.double()) / math.sqrt(d)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=0, atol=2e-5)


def test_large_scores_do_not_overflow(kernel):
    """Scores far beyond float32's exp range (the max is subtracted first) and one dominant key."""
    q, k, v = _qkv(200, 2, 72, scale=40.0)
    out = torch.empty_like(q)
    kernel(q, k, v, out, [200])
    assert torch.isfinite(out.float()).all()
    ref = _reference(q, k, v)
    assert float((out.double() - ref).abs().max()) <= 2 ** -6 * float(ref.abs().max())


def test_bits_do_not_depend_on_batch_position_or_threads(kernel, monkeypatch):
    """Through `ops.attention`: an item's rows are the same bits alone, packed after or before other items,
    at 1, 2 and 3 threads (items on both sides of the kernel's 256-row split between head-by-head and
    unit-by-unit work, in one call; and with 40 more items of 64 rows, enough small heads for the kernel to
    give a thread four heads at a time and prefetch ahead at 1 and 2 threads, one head per task at 3).
    Control: attention over the packed rows with a block-diagonal mask (what a batched implementation does)
    gives the same item other bits beside other neighbours."""
    monkeypatch.setattr(kernels, "attention", lambda: kernel)
    items = [_qkv(n, 4, 72, seed=n) for n in (300, 77, 512, 1)] + [_qkv(64, 4, 72, seed=1000 + i) for i in range(40)]
    alone = []
    torch.set_num_threads(2)
    for q, k, v in items:
        alone.append(ops.attention(q, k, v, [q.shape[0]]))
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], list(range(len(items)))[::-1]):
            packed = [torch.cat([items[i][j] for i in order]) for j in range(3)]
            lens = [items[i][0].shape[0] for i in order]
            out = ops.attention(*packed, lens)
            for i, part in zip(order, out.split(lens)):
                assert torch.equal(part, alone[i])

    def masked_batch(order):  # the control
        packed = [torch.cat([items[i][j] for i in order]).transpose(0, 1) for j in range(3)]
        ids = torch.cat([torch.full((items[i][0].shape[0],), i) for i in order])
        mask = ids[:, None] == ids[None, :]
        out = F.scaled_dot_product_attention(*packed, attn_mask=mask).transpose(0, 1)
        return dict(zip(order, out.split([items[i][0].shape[0] for i in order])))

    a, b = masked_batch([0, 1]), masked_batch([1, 2, 0])
    assert not torch.equal(a[0], b[0])


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_gradients_match_pytorch_and_do_not_depend_on_the_batch(kernel, monkeypatch, dtype, tol):
    """The autograd Function: forward = the served kernel's bits; gradients close to PyTorch attention's and,
    per item, the same bits alone or packed with others. The public fallback gives PyTorch's gradients."""
    monkeypatch.setattr(kernels, "attention", lambda: kernel)
    lens = [100, 37, 163]
    base = torch.cat([torch.stack(_qkv(n, 4, 72, seed=n, dtype=dtype), 1) for n in lens]).requires_grad_()
    grad_out = torch.randn(sum(lens), 4 * 72, generator=torch.Generator().manual_seed(9)).to(dtype)

    def grads(x, seqlens, fn):
        (g,) = torch.autograd.grad(fn(*x.unbind(1), seqlens), x, grad_out[:x.shape[0]])
        return g

    ours = grads(base, lens, ops.attention)
    with torch.no_grad():
        assert torch.equal(ops.attention(*base.unbind(1), lens), ops.attention(*base.detach().unbind(1), lens))
    stock = grads(base, lens, lambda q, k, v, s: attention_op._sdpa(q, k, v, s).view(q.shape[0], -1))
    scale = float(stock.abs().max())
    assert float((ours.float() - stock.float()).abs().max()) <= tol * scale
    first = base[:lens[0]].detach().requires_grad_()
    assert torch.equal(grads(first, lens[:1], ops.attention), ours[:lens[0]])

    monkeypatch.setattr(attention_op, "flash_attention_backward", lambda: None)  # a build without it
    with attention_op.one_thread():  # the backward runs PyTorch's at one thread (ops.attend.one_thread)
        stock_one_thread = grads(base, lens, lambda q, k, v, s: attention_op._sdpa(q, k, v, s).view(q.shape[0], -1))
    assert torch.equal(grads(base, lens, ops.attention), stock_one_thread)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [72, 64, 26])
def test_rotating_q_and_k_inside_the_kernel_gives_the_bits_of_rotating_first(kernel, dtype, d):
    """`rope=`: the kernel rotates q and k as it packs them; output and log-sum-exp are the same bits as
    PyTorch's form of the rotation (`rope_reference`, an independent implementation) followed by the kernel,
    for small and large items in one call at 1-3 threads (d = 26 reaches every variant's tails: 16 + 8 + 2
    and 3 x 8 + 2 lanes). Control: the tables swapped (sin for cos) give other bits, so the comparison can
    fail; and an odd head dim, which has no pairs to rotate, is refused."""
    from bivit.ops.rotary import rope_reference

    lens = [64] * 5 + [300, 1, 257, 0, 17]
    g = torch.Generator().manual_seed(d)
    qkv = (2 * torch.randn(sum(lens), 3, 4, d, generator=g)).to(dtype)
    cos, sin = torch.randn(2, sum(lens), d, generator=g).unbind(0)
    q, k, v = qkv.unbind(1)
    ref, ref_lse = torch.empty_like(q), torch.empty(4 * sum(lens))
    kernel(rope_reference(q, cos, sin), rope_reference(k, cos, sin), v, ref, lens, ref_lse)
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        out, lse = torch.empty_like(q), torch.empty(4 * sum(lens))
        kernel(q, k, v, out, lens, lse, rope=(cos, sin))
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    swapped = torch.empty_like(q)
    kernel(q, k, v, swapped, lens, rope=(sin, cos))
    assert not torch.equal(swapped, ref)
    odd = _qkv(10, 2, 27, dtype=dtype)
    with pytest.raises(ValueError, match="head dim 27"):
        kernel(*odd, torch.empty_like(odd[0]), [10], rope=(cos[:10, :27].contiguous(), sin[:10, :27].contiguous()))


# ------------------------------------------------------------------------------------- the call's arguments

STRIDE_FIELDS = ("q_row", "k_row", "v_row", "out_row", "q_head", "k_head", "v_head", "out_head")


@dataclass(frozen=True)
class _Swapped(kernels.Attention):
    """The compiled attention called with two fields of its argument struct exchanged: a caller's mistake, made
    on purpose (every other argument as `Attention.args` fills it)."""

    swap: tuple[str, str] = ("k_row", "v_row")

    def args(self, *a, **kw):
        args = super().args(*a, **kw)
        f, g = self.swap
        first, second = getattr(args, f), getattr(args, g)
        setattr(args, f, second)
        setattr(args, g, first)
        return args


def _max_error(out, q, k, v, lens) -> float:
    err, start = 0.0, 0
    for n in lens:
        part = slice(start, start + n)
        err = max(err, float((out[part].double() - _reference(q[part], k[part], v[part])).abs().max()))
        start += n
    return err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_swapped_stride_field_fails_the_self_test(kernel, dtype):
    """The self-test's q, k, v and out are views with row and head strides of their own (eight different
    values), so the arguments reaching the wrong fields cannot pass it: the correct call is within the
    self-test's bound of float64 attention, and the call with k's and v's row strides exchanged (the control)
    is not; then for every pair of the eight stride fields, the self-test refuses the kernel called with that
    pair exchanged. Every attention path of the variant (bf16 on AMX tiles and on its own code)."""
    bound = kernels.SELF_TEST_BOUNDS[dtype]
    paths = [kernel] + ([replace(kernel, amx=False)] if kernel.amx and dtype == torch.bfloat16 else [])
    for path in paths:
        q, k, v, out, lens = kernels.self_test_inputs(dtype)
        assert len({t.stride(i) for t in (q, k, v, out) for i in (0, 1)}) == 8
        path(q, k, v, out, lens)
        assert _max_error(out, q, k, v, lens) <= bound
        swapped = _Swapped(path.lib, path.variant, path.amx, swap=("k_row", "v_row"))
        wrong = torch.empty_like(out)
        swapped(q, k, v, wrong, lens)
        assert _max_error(wrong, q, k, v, lens) > bound
        kernels._self_test(path, dtype, bound)
        for pair in itertools.combinations(STRIDE_FIELDS, 2):
            with pytest.raises(kernels.KernelUnavailable, match="failed its self-test"):
                kernels._self_test(_Swapped(path.lib, path.variant, path.amx, swap=pair), dtype, bound)


@dataclass(frozen=True)
class _SwappedGemm(kernels.GemmKernel):
    """A compiled GEMM called with x's and y's row strides exchanged, on purpose."""

    def args(self, *a, **kw):
        args = super().args(*a, **kw)
        args.x_row, args.y_row = args.y_row, args.x_row
        return args


def test_a_swapped_gemm_stride_fails_the_gemm_self_test(library):
    """The GEMM self-test's x and y have row strides of their own, so every GEMM kernel of the library passes it
    called correctly and fails it called with x's and y's row strides exchanged."""
    for kernel in library.gemms:
        for dtype in (torch.bfloat16, torch.float32):
            if not kernel.takes(dtype):
                continue
            assert gemm.self_test(kernel, dtype) is None
            why = gemm.self_test(_SwappedGemm(kernel.lib, kernel.variant, kernel.name), dtype)
            assert why is not None and "off by" in why, (kernel.name, dtype, why)


def test_gemm_peak_loops_count_what_they_execute(library):
    """A kernel's peak loop (what `bivit bench` prints cases against) reports the FLOPs of the steps it was
    asked for: steps x accumulators x FLOPs per instruction x threads, doubling with either; the portable
    kernel (scalar C, no peak loop) and an unknown kind report none."""
    for kernel in library.gemms:
        one = kernel.lib.bivit_gemm_peak(kernel.kind, 1000, 1)
        if library.variant == "portable":
            assert one == -1.0 and kernel.peak_gflops() is None
            continue
        per_step = {"avx512_bf16": 24 * 64, "fp32": 24 * 32 if library.variant == "avx512" else 12 * 16}
        if kernel.name in per_step:
            assert one == 1000 * per_step[kernel.name]
            assert kernel.lib.bivit_gemm_peak(kernel.kind, 2000, 1) == 2 * one
            assert kernel.lib.bivit_gemm_peak(kernel.kind, 1000, 2) == 2 * one
            assert kernel.peak_gflops(seconds=0.01) > 0
    assert library.attention.lib.bivit_gemm_peak(99, 1000, 1) == -1.0


def test_argument_structs_have_the_librarys_layout(library):
    """Python's mirrors of abi.h's structs have every field at the offset and size the compiled library
    reports, so a named field reaches the C field of that name. Controls: a mirror with two fields in the
    other order, or with a field the library lacks, is refused at load; a struct filled with a field missing
    (which ctypes would leave 0: a zero stride) is an error; so is a constant whose value is not the library's."""
    lib = library.attention.lib
    abi.check(lib)
    fields = list(abi.AttentionArgs._fields_)
    i, j = fields.index(("k_row", ctypes.c_int64)), fields.index(("v_row", ctypes.c_int64))
    fields[i], fields[j] = fields[j], fields[i]
    reordered = type("Reordered", (ctypes.Structure,), {"_fields_": fields})
    with pytest.raises(kernels.KernelUnavailable, match=r"lays out bivit_attention_args\.[kv]_row"):
        abi.check(lib, {"bivit_attention_args": reordered})
    extra = type("Extra", (ctypes.Structure,), {"_fields_": abi.GemmArgs._fields_ + [("z_row", ctypes.c_int64)]})
    with pytest.raises(kernels.KernelUnavailable, match="no field bivit_gemm_args.z_row"):
        abi.check(lib, {"bivit_gemm_args": extra})
    with pytest.raises(TypeError, match="missing.*'v_row'"):
        abi.fill(abi.AttentionArgs, **{name: 0 for name, _ in abi.AttentionArgs._fields_ if name != "v_row"})
    with pytest.MonkeyPatch.context() as mp:  # a constant (return code, size limit, kind) copied wrong
        mp.setitem(abi.CONSTS, "RC_NO_MEMORY", 4)
        with pytest.raises(kernels.KernelUnavailable, match="RC_NO_MEMORY = 1; bivit passes 4"):
            abi.check(lib, {})


@needs_cpu
def test_unsupported_dtypes_and_shapes_use_pytorchs_attention(kernel):
    assert kernels.Attention.supports(_qkv(10, 2, 72, dtype=torch.float32)[0])
    assert not kernels.Attention.supports(_qkv(10, 2, 72, dtype=torch.float16)[0])
    assert not kernels.Attention.supports(_qkv(10, 2, 136)[0])
    assert not kernels.Attention.supports(_qkv(10, 2, 72)[0].transpose(1, 2))
    assert kernels.Attention.supports(_qkv(10, 2, 72)[0])


# ------------------------------------------------------------------------------------------------- choice

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,heads,d", [(2048, 16, 72), (37, 3, 8), (100, 12, 128), (5, 1, 4)])
def test_rope_kernel_computes_pytorchs_bits(library, rows, heads, d, dtype):
    """The compiled RoPE against PyTorch's elementwise form on the model's strided q/k view, at 1-3 threads:
    the same bits, so which one runs never changes an embedding. Control: the exact sum rounded once (instead
    of each product and the sum) gives other bits, so the comparison can fail."""
    from bivit.ops.rotary import rope_tables
    from bivit.ops.rotary import rope_reference

    side = int(math.isqrt(rows))
    grid = [(1, side, rows // side)] if side * (rows // side) == rows else [(1, 1, rows)]
    cos, sin = rope_tables(grid, d, 10000.0)
    qkv = (4 * torch.randn(rows, 3, heads, d, generator=torch.Generator().manual_seed(rows))).to(dtype)
    x = qkv[:, :2]
    ref = rope_reference(x, cos, sin)
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        out = torch.empty(x.shape, dtype=dtype)
        library.rope(x.view(rows, 2 * heads, d), cos, sin, out.view(rows, 2 * heads, d))
        assert torch.equal(out, ref)
    if dtype == torch.float32 and rows >= 100:  # control: one rounding of the exact sum instead of three
        xd = x.double()
        swapped = xd.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        once = xd * cos.double().view(rows, 1, 1, d) + swapped * sin.double().view(rows, 1, 1, d)
        assert not torch.equal(once.float(), ref)


AVX512_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
AVX2_FLAGS = frozenset({"avx2", "fma", "avx", "f16c"})
AMX_FLAGS = AVX512_FLAGS | {"amx_bf16", "amx_tile"}


ALL = frozenset(v.name for v in kernels.VARIANTS)


@pytest.mark.parametrize("choice,flags,capability,present,expect", [
    ("auto", AVX512_FLAGS, "AVX512", ALL, "avx512"),               # AMD EPYC Zen 4
    ("auto", AVX2_FLAGS, "AVX2", ALL, "avx2"),                     # AMD EPYC Zen 2/3
    ("auto", AVX512_FLAGS, "AVX2", ALL, "avx2"),                   # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU
    ("auto", AVX512_FLAGS - {"avx512_bf16"}, "AVX512", ALL, "avx2"),  # AVX-512 without BF16 (Skylake, Ice Lake)
    ("auto", AMX_FLAGS, "AVX512", ALL, "avx512"),                  # AMX Xeon (default mode keeps PyTorch's attention)
    ("auto", AVX512_FLAGS, "DEFAULT", ALL, "portable"),            # ATEN_CPU_CAPABILITY=default: no vector code
    ("auto", frozenset({"asimd", "sve"}), "SVE256", {"portable"}, "portable"),  # Arm (Graviton): plain C
    ("auto", frozenset({"sse2"}), "DEFAULT", ALL, "portable"),     # an x86 without AVX2
    ("auto", AVX512_FLAGS, "AVX512", ALL - {"avx512"}, "avx2"),    # a build without the avx512 variant
    ("avx2", AVX512_FLAGS, "AVX512", ALL, "avx2"),                 # the override the tests use
    ("portable", AVX512_FLAGS, "AVX512", ALL, "portable"),         # any CPU runs the plain C variant
    ("avx512", AVX2_FLAGS, "AVX2", ALL, None),                     # never code the CPU cannot run
    ("avx512", AVX512_FLAGS, "AVX2", ALL, None),                   # nor code PyTorch was told not to run
    ("avx512", AVX512_FLAGS, "AVX512", ALL - {"avx512"}, None),    # nor a library the install lacks
])
def test_variant_choice_follows_cpu_flags_pytorch_capability_and_the_install(choice, flags, capability, present,
                                                                              expect):
    """The choice is a function of the configuration, the CPU's flags, PyTorch's capability and the variants
    installed only: the fastest variant all allow, the portable one where no other runs. A variant named by the
    user that cannot run here is a choice (a note, the fix: unset it)."""
    if expect is None:
        with pytest.raises(kernels.KernelUnavailable) as e:
            kernels.pick_variant(choice, flags, capability, frozenset(present))
        assert e.value.chosen
        assert kernels.ATTENTION_ENV in e.value.fix
    else:
        assert kernels.pick_variant(choice, flags, capability, frozenset(present)).name == expect


def test_an_install_without_any_library_is_a_loss_with_a_fix():
    with pytest.raises(kernels.KernelUnavailable) as e:
        kernels.pick_variant("auto", AVX512_FLAGS, "AVX512", frozenset())
    assert not e.value.chosen and "reinstall" in e.value.fix


@pytest.mark.parametrize("choice,flags,declined", [
    ("auto", AVX512_FLAGS, False), ("auto", AMX_FLAGS, True), ("bivit", AMX_FLAGS, False),
    ("sdpa", AVX512_FLAGS, True), ("avx2", AMX_FLAGS, False),
])
def test_attention_stays_pytorchs_on_amx_and_when_asked(choice, flags, declined):
    assert bool(kernels.attention_declined(choice, flags)) == declined


@pytest.mark.parametrize("choice,expect", [("sdpa", "BIVIT_ATTENTION=sdpa"), ("nonsense", None)])
def test_choice_from_environment(monkeypatch, caplog, choice, expect):
    monkeypatch.setenv(kernels.ATTENTION_ENV, choice)
    if expect:
        assert expect in kernels.attention_declined(kernels.attention_choice(), FLAGS)
        return
    with caplog.at_level(logging.WARNING, logger="bivit"):
        assert kernels.attention_choice() == "auto"
    assert "nonsense" in caplog.text


def test_every_variant_forced_gives_the_same_bits_and_pytorchs_attention_is_close(tmp_path):
    """End to end in fresh processes: invariant mode under the default choice and each variant this CPU runs,
    forced, encodes an image to the same bits (one arithmetic); default mode with `BIVIT_ATTENTION=sdpa`
    (PyTorch's attention) is within bf16 rounding of them, and other bits (the control)."""
    script = (
        "import sys, torch, bivit\n"
        "from bivit import kernels\n"
        "from support.media import random_image\n"
        "enc = bivit.load_encoder(None, dtype='bfloat16', batch_invariant=sys.argv[2] == 'invariant')\n"
        "out = enc.encode([random_image(112, 140, 3)])[0]\n"
        "lib = kernels.library()\n"
        "torch.save({'out': out, 'variant': lib and lib.variant}, sys.argv[1])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__)), *sys.path]))
    runs = {}
    configs = {"sdpa": ({kernels.ATTENTION_ENV: "sdpa"}, "default"), "auto": ({kernels.ATTENTION_ENV: "auto"},
                                                                            "invariant")}
    configs.update({v.name: ({kernels.ATTENTION_ENV: v.name}, "invariant") for v in RUNNABLE})
    for name, (extra, mode) in configs.items():
        path = tmp_path / f"{name}.pt"
        done = subprocess.run([sys.executable, "-c", script, str(path), mode], env={**env, **extra},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs[name] = torch.load(path)
    assert runs["auto"]["variant"] == RUNNABLE[0].name  # the best variant this CPU runs
    for v in RUNNABLE:
        assert runs[v.name]["variant"] == v.name and torch.equal(runs[v.name]["out"], runs["auto"]["out"]), v.name
    a, b = runs["auto"]["out"].float(), runs["sdpa"]["out"].float()
    assert float((a - b).abs().max()) <= 3e-2 * float(b.abs().max())
    assert not torch.equal(runs["auto"]["out"], runs["sdpa"]["out"])


def test_the_kernels_use_pytorchs_openmp_runtime():
    """One OpenMP runtime in the process: the installed library needs libgomp.so.1, and that need is met by the
    copy PyTorch loaded (torch/lib), not by a second one from the system (which a slim image may not have)."""
    maps = "/proc/self/maps"
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if not os.path.exists(maps) or not os.path.exists(os.path.join(torch_lib, "libgomp.so.1")):
        pytest.skip("not Linux, or a PyTorch build without its own libgomp")
    assert kernels.library() is not None
    with open(maps) as f:
        loaded = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(loaded) == 1 and os.path.dirname(next(iter(loaded))) == torch_lib, loaded
    with open(maps) as f:
        assert any(os.path.basename(str(kernels.library().path)) in line for line in f)
