"""The fallback invariant GEMM (`bivit.ops.tiles`), where bivit's compiled GEMM does not run (no C compiler, a CPU
without a variant): PyTorch's GEMMs at row counts proven on this machine, the proof recorded per machine kind,
library and thread count. Each test forces the fallback on whatever machine it runs."""

import pytest
import torch

import bivit
from bivit.media import preprocess_images
from support.controls import differing
from support.media import random_image


@pytest.fixture
def fallback(monkeypatch, fresh_state):
    """This process without a compiled GEMM (as on a machine without a C compiler), for the test's duration."""
    from bivit.ops import backend

    monkeypatch.setattr(backend, "_decide_gemm_kernel", lambda *a: None)


def _item(h: int, w: int, seed: int):
    return preprocess_images([random_image(h, w, seed)])


def test_exact_fallback_path_is_invariant_and_exact(monkeypatch, fallback, kimi_ckpt):
    """If the probe found the pinned GEMM not row-invariant, the row-by-row path must still be invariant."""
    from bivit import ops
    from bivit.ops import tiles

    monkeypatch.setattr(tiles, "_probe", lambda *a: ops.GemmPlan(()))
    enc = bivit.load_encoder(str(kimi_ckpt), dtype="float32")
    items = [_item(h, w, 2) for h, w in ((28, 28), (28, 56), (84, 28), (56, 56))]
    assert differing(enc, items, [3, 1, 0, 2], None) == []
    x = torch.randn(5, 288)
    w, b = torch.randn(64, 288), torch.randn(64)
    with ops.batch_invariant():
        out = ops.linear(x, w, b)
    assert torch.equal(out[2], torch.nn.functional.linear(x[2:3], w, b)[0])


def test_self_check_proves_tiles_on_this_machine(fallback):
    """`self_check` returns the plan inference uses: row counts the probe proved on this machine, the reference
    tile among them, each computing every row bit-identically to reference tiles (checked here on other data).
    Which other sizes are proven depends on the CPU and library (all of them on AVX-512 EPYC, and with torch
    restricted to AVX2); that the reference tile is, on every kind bivit runs on."""
    from bivit import ops
    from bivit.ops.tiles import Gemm

    g = torch.Generator().manual_seed(5)
    ref_rows = ops.REFERENCE_TILE
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(96, 192, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
        plan = ops.self_check([(w, b)])[0]
        gemm = Gemm(w, b, w)
        assert ops.gemm_plan(gemm) is plan
        assert ref_rows in plan.tiles and set(plan.tiles) <= set(ops.CANDIDATE_TILES)
        x = torch.randn(max(plan.tiles), 192, generator=g).to(dtype)
        ref = torch.cat([gemm(x[i:i + ref_rows]) for i in range(0, x.shape[0], ref_rows)])
        for tile in plan.tiles:
            assert torch.equal(gemm(x[:tile]), ref[:tile]), (dtype, tile)


def _fresh_plans(monkeypatch, cache_dir) -> list:
    """Forget every plan this process knows and point the kernel cache at `cache_dir`; returns the list the
    shapes proven from now on are appended to."""
    from bivit import state
    from bivit.ops import tiles

    monkeypatch.setenv("BIVIT_KERNEL_CACHE", str(cache_dir))
    state.reset(state.PROOFS)
    proven = []
    real = tiles._prove
    monkeypatch.setattr(tiles, "_prove", lambda g: proven.append(g.plan_key()) or real(g))
    return proven


def test_proven_plans_are_recorded_and_reused_on_this_machine_kind(monkeypatch, fallback, tmp_path):
    """A plan is proven once per machine kind, library and thread count: a later load (a new process: nothing in
    memory) reads it from the kernel cache instead of computing the probe again; under another thread count it
    is proven again."""
    from bivit import ops

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    w, b = torch.randn(96, 192).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    proven = _fresh_plans(monkeypatch, cache)
    first = ops.self_check([(w, b)])[0]
    assert len(proven) == 1 and list(cache.glob("gemm-plans-*.json"))
    proven = _fresh_plans(monkeypatch, cache)
    assert ops.self_check([(w, b)])[0] == first and proven == []
    torch.set_num_threads(torch.get_num_threads() + 1)
    proven = _fresh_plans(monkeypatch, cache)
    assert ops.self_check([(w, b)])[0] == first and len(proven) == 1


@pytest.mark.parametrize("attack", ["loose directory", "tiles never proven"])
def test_a_planted_plan_is_not_used(monkeypatch, fallback, tmp_path, attack):
    """A plan record in a cache others can write, or naming a tile size the probe never considers, is ignored:
    the plan is proven here."""
    import json

    from bivit import ops

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    w = torch.randn(96, 192)
    proven = _fresh_plans(monkeypatch, cache)
    ops.self_check([(w, None)])
    (record,) = cache.glob("gemm-plans-*.json")
    planted = {shape: [3000] if attack == "tiles never proven" else [64] for shape in json.loads(record.read_text())}
    record.write_text(json.dumps(planted))
    if attack == "loose directory":
        cache.chmod(0o777)
    proven = _fresh_plans(monkeypatch, cache)
    plan = ops.self_check([(w, None)])[0]
    assert len(proven) == 1 and plan.tiles[-1] == max(ops.CANDIDATE_TILES)
