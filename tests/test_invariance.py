"""Batch invariance: an item's embedding is the same bits alone or with any others, in any order, under any
micro-batch budget and thread count. Every property has a control showing stock kernels break it."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bivit
from bivit.diagnose.verify import encode_cut
from bivit.kernels.gemm import APPROXIMATE
from bivit.media.pixels import MediaBatch, preprocess_images
from support.controls import differences_found_by_check, differing, row_count_dependent_gemms
from support.media import random_image

# (h, w): 1, 2, 3 merged tokens (the row counts where stock GEMMs switch kernels), then larger and non-square.
SIZES = [(28, 28), (28, 56), (84, 28), (56, 56), (84, 56), (112, 112), (140, 84), (168, 196)]

MODELS = ["demo", "kimi", "k3"]


@functools.lru_cache(maxsize=None)
def _encoder(model: str, path: str | None, dtype: str, invariant: bool) -> bivit.Encoder:
    return bivit.load_encoder(path, dtype=dtype, batch_invariant=invariant)


@pytest.fixture(scope="module")
def paths(kimi_ckpt, k3_ckpt):
    return {"demo": None, "kimi": str(kimi_ckpt), "k3": str(k3_ckpt)}


@functools.lru_cache(maxsize=None)
def _item(index: int, seed: int) -> MediaBatch:
    h, w = SIZES[index]
    return preprocess_images([random_image(h, w, seed)])


def encode_layout(enc: bivit.Encoder, items: list[MediaBatch], budget: int | None) -> list[torch.Tensor]:
    return encode_cut(enc, MediaBatch.concat(items), budget)  # the packing rule under `budget`


layouts = st.tuples(
    st.lists(st.tuples(st.integers(0, len(SIZES) - 1), st.integers(0, 3)), min_size=1, max_size=7),
    st.randoms(use_true_random=False),
    st.one_of(st.none(), st.integers(1, 400)),
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts)
def test_item_is_bit_identical_in_any_layout(paths, model, dtype, layout):
    specs, rnd, budget = layout
    items = [_item(i, s) for i, s in specs]
    order = list(range(len(items)))
    rnd.shuffle(order)
    enc = _encoder(model, paths[model], dtype, True)
    assert differing(enc, items, order, budget) == []


def _control_items():
    # Many 1-token items plus 2- and 3-token ones: alone, each runs GEMMs at M = 1..3 rows.
    return [_item(0, s) for s in range(4)] + [_item(1, 0), _item(2, 0)] + [_item(0, s) for s in range(4, 16)]


@pytest.mark.parametrize("dtype,model", [("float32", "demo"), ("float32", "kimi"), ("float32", "k3"),
                                         ("bfloat16", "kimi"), ("bfloat16", "demo")])
def test_control_default_mode_detects_differences(paths, model, dtype):
    """The same check in default mode finds items that change with their batch; invariant mode finds none,
    with stock kernels and with deliberately row-count-dependent GEMMs alike."""
    items = _control_items()
    order = list(range(len(items)))
    assert differences_found_by_check(_encoder(model, paths[model], dtype, False), items, order, None) != []
    invariant = _encoder(model, paths[model], dtype, True)
    assert differing(invariant, items, order, None) == []
    with row_count_dependent_gemms():
        assert differing(invariant, items, order, None) == []


def test_row_count_dependent_gemm_is_a_real_difference():
    """The injected GEMM is not a strawman: it computes a row differently at different row counts, in both
    dtypes, on any CPU (partial sums in a different order)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1152, generator=g), torch.randn(64, 1152, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        with row_count_dependent_gemms():
            rows = [torch.nn.functional.linear(xd[:m], wd)[0] for m in (1, 2, 3)]
        assert not (torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_micro_batch_budgets_and_item_larger_than_budget(paths, dtype):
    enc = _encoder("kimi", paths["kimi"], dtype, True)
    items = [_item(i, 1) for i in range(len(SIZES))]
    ref = encode_layout(enc, items, None)
    for budget in (1, 4, 16, 100, 257, 10_000):  # 1: every item alone in its own pass, larger than the budget
        assert all(torch.equal(a, b) for a, b in zip(encode_layout(enc, items, budget), ref))


def test_budget_splits_into_passes_of_at_most_n_patches():
    from bivit.core.packing import pack

    enc = bivit.load_encoder(max_batch_patches=100)
    counts = [4, 8, 200, 16, 64, 30, 1]
    passes = pack(counts, enc.max_batch_patches)
    assert [i for p in passes for i in p] == list(range(len(counts)))
    for p in passes:
        assert sum(counts[i] for i in p) <= 100 or len(p) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_threads_and_repeats(paths, dtype):
    """Invariant: batched at 1 thread == alone at 2 threads == again. Control: default mode differs (with
    stock kernels, or where those are row-count invariant on this CPU, with row-count-dependent GEMMs)."""
    items = _control_items()

    def same_as_alone(enc) -> bool:
        torch.set_num_threads(2)
        alone = [enc.encode_batch(it)[0] for it in items]
        torch.set_num_threads(1)
        batched = encode_layout(enc, items, None)
        again = encode_layout(enc, items, None)
        assert all(torch.equal(a, b) for a, b in zip(batched, again))  # run-to-run determinism, both modes
        return all(torch.equal(a, b) for a, b in zip(batched, alone))

    assert same_as_alone(_encoder("kimi", paths["kimi"], dtype, True))
    default = _encoder("kimi", paths["kimi"], dtype, False)
    if same_as_alone(default):
        with row_count_dependent_gemms():
            assert not same_as_alone(default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_branch_gives_the_bits_of_whole_layers(dtype):
    """`ops.linear(..., add_to=residual)` (the MLP chain into the residual): each row's bits equal those of running
    each invariant linear over all rows, then adding (2500 rows, and 700 of them). Control: the same chain in
    default mode gives other bits."""
    from bivit import ops

    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(2500, 96, generator=g).to(dtype) for _ in range(2))
    w0, b0 = (torch.randn(200, 96, generator=g) / 10).to(dtype), torch.randn(200, generator=g).to(dtype)
    w1, b1 = (torch.randn(96, 200, generator=g) / 14).to(dtype), torch.randn(96, generator=g).to(dtype)

    def residual_mlp(res, x):
        return ops.linear(ops.linear(x, w0, b0, gelu="tanh"), w1, b1, add_to=res)

    with torch.inference_mode():
        with ops.batch_invariant():
            whole = res + ops.linear(ops.linear(x, w0, b0, gelu="tanh"), w1, b1)
            tiled = residual_mlp(res.clone(), x)
            assert torch.equal(tiled, whole)
            assert torch.equal(residual_mlp(res[:700].clone(), x[:700]), whole[:700])
        with ops.batch_invariant(False):
            assert not torch.equal(residual_mlp(res.clone(), x), whole)


@pytest.mark.parametrize("kind", ["tanh", "erf"])
def test_pointwise_gelu_is_independent_of_tensor_size_and_threads(kind):
    """Vectorised kernels compute each thread's last elements with scalar code that rounds differently (tanh
    GELU in fp32), and PyTorch's GELU cuts a large tensor into one range per thread: stock GELU gives a row
    different bits depending on how many rows share the tensor and on the thread count (3: ranges that are no
    multiple of the vector width). The invariant op does not. 4304 is the real MLP width (not a multiple of the
    vector width)."""
    from bivit import ops

    x = torch.randn(130, 4304, generator=torch.Generator().manual_seed(0))
    counts = {}
    for invariant in (False, True):
        with ops.batch_invariant(invariant):
            torch.set_num_threads(2)
            ref = ops.gelu(x, kind)
            diffs = 0
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                for m in (1, 2, 3, 5, 13, 34, 89):
                    diffs += int((ops.gelu(x[:m], kind) != ref[:m]).sum())
                    diffs += int((ops.gelu(x[m:], kind) != ref[m:]).sum())
        counts[invariant] = diffs
    assert counts[True] == 0
    if kind == "tanh":
        assert counts[False] > 0  # the control: the check can fail


@pytest.mark.parametrize("kind", ["tanh", "erf"])
def test_gemm_gelu_rows_do_not_depend_on_position_batch_or_threads(kind):
    """Linear + GELU (the MLP's fc0, the projector's first layer) runs as one invariant GEMM with GELU applied
    to the fp32 sum inside it. A row's bits must not depend on how many rows share the call, where in it the
    row sits, or the thread count (1-4: more threads than this CI machine's cores), in bf16 and fp32. Control:
    the stock ops (default mode) give some row other bits (stock fp32 GEMMs switch kernels with the row count;
    bf16 may or may not, by CPU), else deliberately row-count-dependent GEMMs do."""
    from bivit import ops

    g = torch.Generator().manual_seed(0)
    k, n, rows = 288, 436, 700  # 436: not a multiple of any vector width; 700 rows: several blocks and a tail
    counts = {False: 0, True: 0}
    threads = torch.get_num_threads()
    try:
        for dtype in (torch.bfloat16, torch.float32):
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = (0.02 * torch.randn(n, generator=g)).to(dtype)
            x = torch.randn(rows, k, generator=g).to(dtype)
            for invariant in (False, True):
                with ops.batch_invariant(invariant), torch.inference_mode():
                    torch.set_num_threads(2)
                    ref = ops.linear(x, w, b, gelu=kind)
                    for t in (1, 2, 3, 4):
                        torch.set_num_threads(t)
                        out = ops.linear(x.flip(0), w, b, gelu=kind).flip(0)
                        counts[invariant] += int((out != ref).sum())
                        for m in (1, 2, 3, 5, 64, 77, 256, 300):
                            counts[invariant] += int((ops.linear(x[:m], w, b, gelu=kind) != ref[:m]).sum())
                            counts[invariant] += int((ops.linear(x[m:], w, b, gelu=kind) != ref[m:]).sum())
            # GELU on the float32 sum rounds once, the stock pair twice: close, not always equal.
            stock = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate=APPROXIMATE[kind])
            tol = 1.6e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(ref, stock, rtol=tol, atol=tol)
        if counts[False] == 0:  # stock kernels row-count invariant here: the control uses GEMMs that are not
            with row_count_dependent_gemms(), ops.batch_invariant(False), torch.inference_mode():
                counts[False] += int((ops.linear(x[:1], w, b, gelu=kind)
                                      != ops.linear(x[:3], w, b, gelu=kind)[:1]).sum())
    finally:
        torch.set_num_threads(threads)
    assert counts[True] == 0
    assert counts[False] > 0  # the control: the check can fail
