"""Train-inference parity: `bivit.load_model` under autograd reproduces the served bits, with exact gradients.

Every bitwise property has a control: the same check in default mode finds a difference on this machine.
"""

import functools
import os
import socket
import warnings

import pytest
import torch
from torch.autograd import gradcheck

import bivit
from bivit import ops
from bivit.checkpoint.state_dict import from_transformers_layout
from bivit.media.pixels import MediaBatch, preprocess_images
from support.controls import row_count_dependent_gemms
from support.media import random_image
from support.checkpoints import load_hf

# (h, w) -> 1, 2, 3 merged tokens, then larger and non-square (interpolated position table).
SIZES = [(28, 28), (28, 56), (84, 28), (56, 56), (112, 112), (84, 140)]


@functools.lru_cache(maxsize=None)
def _item(index: int, seed: int) -> MediaBatch:
    h, w = SIZES[index]
    return preprocess_images([random_image(h, w, seed)])


@functools.lru_cache(maxsize=None)
def _encoder(path: str, dtype: str, invariant: bool) -> bivit.Encoder:
    return bivit.load_encoder(path, dtype=dtype, batch_invariant=invariant)


def _probe(out: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(out.shape[0] * 1009 + out.shape[1])
    return torch.randn(out.shape, generator=g)


def item_loss(out: torch.Tensor) -> torch.Tensor:
    """A loss whose value depends on every output element; reduced row-wise then over the item's few rows, so
    that the reduction itself runs in one order whatever the thread count."""
    return (out.float() * _probe(out)).sum(-1).sum()


def train_step(model, items: list[MediaBatch]):
    """Forward + backward of the summed item losses -> (outputs, item losses, item pixel grads, weight grads)."""
    batch = MediaBatch.concat(items)
    model.zero_grad(set_to_none=True)
    pixels = batch.pixel_values.clone().requires_grad_(True)
    outs = model(pixels, batch.grid_thw)
    losses = [item_loss(o) for o in outs]
    torch.stack(losses).sum().backward()
    counts = [int(t * h * w) for t, h, w in batch.grid_thw.tolist()]
    pixel_grads = list(pixels.grad.split(counts))
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], [loss.detach() for loss in losses], pixel_grads, grads


def _control_items():
    # Many 1-token items plus 2- and 3-token ones: alone, each runs GEMMs at M = 1..3 rows.
    return [_item(0, s) for s in range(4)] + [_item(1, 0), _item(2, 0)] + [_item(0, s) for s in range(4, 12)]


@pytest.fixture(scope="module")
def paths(kimi_ckpt, k3_ckpt):
    return {"kimi": str(kimi_ckpt), "k3": str(k3_ckpt)}


# ------------------------------------------------------------------------------ served bits == trainer bits

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["kimi", "k3"])
def test_trainer_outputs_are_the_served_bits_in_any_layout(paths, model, dtype):
    enc = _encoder(paths[model], dtype, True)
    trainer = bivit.load_model(paths[model], dtype=dtype)
    assert all(p.requires_grad for p in trainer.parameters())
    assert set(trainer.state_dict()) == set(enc.model.state_dict())  # the checkpoint's names
    items = [_item(i, 0) for i in range(len(SIZES))] + [_item(0, 1), _item(4, 1)]
    served = [enc.encode_batch(it)[0] for it in items]
    g = torch.Generator().manual_seed(0)
    for size in (1, 3, len(items)):  # micro-batch size, composition and order all vary
        order = torch.randperm(len(items), generator=g).tolist()
        for first in range(0, len(order), size):
            chunk = order[first:first + size]
            outs, _, _, _ = train_step(trainer, [items[i] for i in chunk])
            for i, out in zip(chunk, outs):
                assert out.dtype == served[i].dtype and torch.equal(out, served[i]), (i, chunk)


def test_control_default_mode_trainer_batch_differs_from_served_alone(paths):
    enc = _encoder(paths["kimi"], "float32", False)
    trainer = bivit.load_model(paths["kimi"], dtype="float32", batch_invariant=False)
    items = _control_items()

    def differs_from_alone() -> bool:
        outs, _, _, _ = train_step(trainer, items)
        # The same layout, served, is the same bits: the trainer adds nothing of its own.
        assert all(torch.equal(o, s) for o, s in zip(outs, enc.encode_batch(MediaBatch.concat(items))))
        return any(not torch.equal(o, enc.encode_batch(it)[0]) for o, it in zip(outs, items))

    if not differs_from_alone():  # stock kernels row-count invariant here: GEMMs that are not
        with row_count_dependent_gemms():
            assert differs_from_alone()


def test_frozen_tower_trains_projector_only(paths):
    trainer = bivit.load_model(paths["kimi"], dtype="bfloat16", projector_dtype="float32")
    trainer.vision_tower.requires_grad_(False)
    items = [_item(4, 0), _item(1, 1)]
    outs, _, _, grads = train_step(trainer, items)
    assert grads and all(k.startswith("mm_projector.") for k in grads)
    assert len(grads) == len(list(trainer.mm_projector.parameters()))
    enc = bivit.load_encoder(paths["kimi"], dtype="bfloat16", projector_dtype="float32")
    assert all(torch.equal(o, enc.encode_batch(it)[0]) for o, it in zip(outs, items))
    assert outs[0].dtype == torch.float32  # the projector's dtype, as served


# ------------------------------------------------------------------------------ determinism of training

@pytest.mark.parametrize("model,dtype", [("kimi", "float32"), ("kimi", "bfloat16"), ("k3", "bfloat16")])
def test_loss_and_gradients_repeat_and_do_not_depend_on_threads(paths, model, dtype):
    """Invariant: same batch -> same loss and gradients, bitwise, run to run and at 1 or 2 threads.
    Control: default mode's LayerNorm weight gradient is summed in per-thread partials and changes (K3 has
    RMSNorm only, whose stock backward happens to be thread-independent: no control there)."""
    items = [_item(i, 3) for i in range(len(SIZES))] + [_item(0, 4)]
    results = {}
    for invariant in (True, False):
        trainer = bivit.load_model(paths[model], dtype=dtype, batch_invariant=invariant)
        runs = []
        for threads in (2, 2, 1):
            torch.set_num_threads(threads)
            runs.append(train_step(trainer, items))
        results[invariant] = [_same_step(runs[0], runs[1]), _same_step(runs[0], runs[2])]
    assert results[True] == [True, True]
    assert results[False][0]  # run to run, stock kernels are deterministic too
    if model == "kimi":
        assert not results[False][1]


def _same_step(a, b) -> bool:
    outs_a, loss_a, px_a, w_a = a
    outs_b, loss_b, px_b, w_b = b
    return (all(torch.equal(x, y) for x, y in zip(outs_a + loss_a + px_a, outs_b + loss_b + px_b))
            and w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a))


@pytest.mark.parametrize("model,dtype", [("kimi", "float32"), ("kimi", "bfloat16"), ("k3", "float32")])
def test_item_loss_and_pixel_gradient_do_not_depend_on_the_batch(paths, model, dtype):
    """Invariant: an item's loss and pixel gradient are the same bits alone, in a batch, in another order.
    Control: default mode finds differences (with stock kernels, or where those are row-count invariant on this
    CPU at these shapes — bf16 here — with deliberately row-count-dependent GEMMs)."""
    items = _control_items()[:8]

    def differences(trainer) -> int:
        _, losses, px, _ = train_step(trainer, items)
        diffs = 0
        for i, it in enumerate(items):
            _, loss_alone, px_alone, _ = train_step(trainer, [it])
            diffs += (not torch.equal(losses[i], loss_alone[0])) + (not torch.equal(px[i], px_alone[0]))
        # And inside another batch, in another order.
        order = list(range(len(items)))[::-1]
        _, losses2, px2, _ = train_step(trainer, [items[i] for i in order] + [_item(4, 7)])
        return diffs + sum(not torch.equal(losses[i], losses2[j]) or not torch.equal(px[i], px2[j])
                           for j, i in enumerate(order))

    assert differences(bivit.load_model(paths[model], dtype=dtype, batch_invariant=True)) == 0
    default = bivit.load_model(paths[model], dtype=dtype, batch_invariant=False)
    found = differences(default)
    if not found:
        with row_count_dependent_gemms():
            found = differences(default)
    assert found > 0


@pytest.mark.parametrize("invariant", [True, False])
def test_activation_checkpointing_gives_the_same_bits(paths, invariant):
    items = [_item(i, 5) for i in range(len(SIZES))]
    plain = bivit.load_model(paths["kimi"], dtype="bfloat16", batch_invariant=invariant)
    ckpt = bivit.load_model(paths["kimi"], dtype="bfloat16", batch_invariant=invariant,
                            activation_checkpointing=True)
    assert ckpt.activation_checkpointing and not plain.activation_checkpointing
    assert _same_step(train_step(plain, items), train_step(ckpt, items))


# ------------------------------------------------------------------------------ gradients vs the port

def test_fp32_gradients_match_the_transformers_port(kimi_hf_ckpt):
    hf = load_hf(kimi_hf_ckpt, torch.float32)
    hf.requires_grad_(True)
    ours = bivit.load_model(kimi_hf_ckpt, dtype="float32")
    batch = preprocess_images([random_image(h, w, 9) for h, w in [(112, 112), (84, 140), (28, 56)]])

    pixels = batch.pixel_values.clone().requires_grad_(True)
    sum(item_loss(o) for o in hf.get_image_features(pixels, batch.grid_thw).pooler_output).backward()
    ref_px = pixels.grad
    hf_grads = {"model." + k: (p.grad, None) for k, p in hf.named_parameters()
                if k.startswith(("vision_tower.", "mm_projector."))}
    # Converting q/k/v gradients like the weights is exact: the conversion is a permutation and a concat.
    ref = {k: g for k, (g, _) in from_transformers_layout(hf_grads, ours.config).items()}

    _, _, px, grads = train_step(ours, [batch])
    assert set(grads) == set(ref)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(torch.cat(px), ref_px) <= 1e-4
    worst = max((rel(grads[k], ref[k]), k) for k in ref)
    assert worst[0] <= 1e-4, worst


# ------------------------------------------------------------------------------ each op's backward

def _f32(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _gradcheck(fn, inputs, **kw) -> bool:
    """torch's gradcheck in float32, the widest dtype bivit's kernels compute (float64 is no dtype of theirs):
    central differences of step 1e-2 against the analytic gradient, within what float32 rounding leaves."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not a double precision.*")
        return gradcheck(fn, inputs, eps=1e-2, atol=2e-2, rtol=2e-2, **kw)


def test_gradcheck_invariant_ops():
    with ops.batch_invariant():
        # Fast mode (random projections of the Jacobian) keeps this quick; the full Jacobian once, on 5 rows.
        # gradcheck perturbs weights through `.data`, which a packed copy does not see (its tensor version does
        # not move): each call packs a fresh copy.
        linear = lambda x, w, b=None: ops.linear(x, w.clone(), b)
        x, w, b = _f32(260, 3), _f32(4, 3, seed=1), _f32(4, seed=2)
        assert _gradcheck(linear, (x, w, b), fast_mode=True)
        assert _gradcheck(linear, (x, w), fast_mode=True)
        assert _gradcheck(linear, (x[:5].detach().requires_grad_(), w, b))
        px, cw, cb = _f32(5, 2, 2, 2), _f32(3, 2, 2, 2, seed=3), _f32(3, seed=4)
        assert _gradcheck(lambda p, w, b: ops.patch_conv(p, w.clone(), b), (px, cw, cb), fast_mode=True)
        y, lw, lb = _f32(6, 2, 7), _f32(7, seed=5), _f32(7, seed=6)
        assert _gradcheck(lambda y, lw, lb: ops.layer_norm(y, lw, lb, 1e-5), (y, lw, lb), fast_mode=True)
        for kind in ("tanh", "erf"):  # more than one chunk, and a padded tail
            big = _f32(ops.POINTWISE_CHUNK + 37, seed=7)
            assert _gradcheck(lambda t: ops.gelu(t, kind), (big,), fast_mode=True)
        assert _gradcheck(ops.temporal_mean, (_f32(3, 2, 5, seed=8),))
        q, k, v = _f32(10, 2, 4, seed=9), _f32(10, 2, 4, seed=10), _f32(10, 2, 4, seed=11)
        assert _gradcheck(lambda q, k, v: ops.attention(q, k, v, [3, 7]), (q, k, v), fast_mode=True)
    # The control: a wrong gradient (the linear's, doubled) fails the same check.
    doubled = lambda x, w: linear(x, w) + (linear(x, w) - linear(x, w).detach())
    with ops.batch_invariant():
        assert not _gradcheck(doubled, (x[:5].detach().requires_grad_(), w), raise_exception=False)


def test_invariant_bf16_linear_backward_rows_do_not_depend_on_the_batch():
    """The input-gradient GEMM runs in bivit's compiled GEMM: a row's gradient is the same bits in any batch and
    close to the fp32 gradient."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1152, 288, generator=g).bfloat16().requires_grad_(True)
    x = torch.randn(300, 288, generator=g).bfloat16().requires_grad_(True)
    gy = torch.randn(300, 1152, generator=g).bfloat16()

    def input_grad(rows):
        xs = x.detach()[rows].requires_grad_(True)
        with ops.batch_invariant():
            ops.linear(xs, w).backward(gy[rows])
        return xs.grad

    full = input_grad(slice(None))
    slices = (slice(0, 1), slice(1, 3), slice(5, 70), slice(299, 300), slice(40, 297))
    for rows in slices:
        assert torch.equal(input_grad(rows), full[rows])
    exact = gy.float() @ w.detach().float()
    assert float((full.float() - exact).abs().max() / exact.abs().max()) < 1e-2

    # The control: the same check on a stock input-gradient GEMM (gy @ w, as a linear) finds rows that change
    # with the rows around them, else (stock kernels row-count invariant on this CPU) a row-count-dependent one.
    def stock_differs() -> bool:
        wt = w.detach().t()
        whole = torch.nn.functional.linear(gy, wt)
        return any(not torch.equal(torch.nn.functional.linear(gy[rows], wt), whole[rows]) for rows in slices)

    if not stock_differs():
        with row_count_dependent_gemms():
            assert stock_differs()


def test_checkpoint_recomputes_in_the_forward_mode():
    x = _f32(300, 3)
    w = _f32(4, 3, seed=1)
    with ops.batch_invariant():
        out = ops.checkpoint(lambda t: ops.gelu(ops.linear(t, w), "tanh"), x)
    out.sum().backward()  # outside the mode: the recomputation must still run the invariant ops
    gx = x.grad.clone()
    x.grad = None
    with ops.batch_invariant():
        ops.gelu(ops.linear(x, w), "tanh").sum().backward()
    assert torch.equal(gx, x.grad)


def _ddp_worker(rank: int, world: int, ckpt: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model = DistributedDataParallel(bivit.load_model(ckpt, dtype="float32"))
        items = [_item(i, rank) for i in range(rank, len(SIZES), world)]  # each rank its own micro-batch
        batch = MediaBatch.concat(items)
        outs = model(batch.pixel_values, batch.grid_thw)
        sum(item_loss(o) for o in outs).backward()
        enc = bivit.load_encoder(ckpt, dtype="float32")
        same = [torch.equal(o.detach(), enc.encode_batch(it)[0]) for o, it in zip(outs, items)]
        grads = {k: p.grad for k, p in model.module.named_parameters()}
        torch.save({"same": same, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_gloo_two_processes_outputs_are_the_served_bits(kimi_ckpt, tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, str(kimi_ckpt), port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["same"] and all(r0["same"]) and r1["same"] and all(r1["same"])
    assert all(torch.equal(r0["grads"][k], r1["grads"][k]) for k in r0["grads"])  # averaged across ranks


# ------------------------------------------------------------------------------ weight sync

def _optimizer_step(trainer, items, lr=1e-2):
    opt = torch.optim.SGD(trainer.parameters(), lr=lr)
    train_step(trainer, items)
    opt.step()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_update_weights_serves_the_trainers_new_bits(paths, dtype, tmp_path):
    from bivit.checkpoint.state_dict import save_checkpoint

    enc = bivit.load_encoder(paths["kimi"], dtype=dtype)
    trainer = bivit.load_model(paths["kimi"], dtype=dtype)
    items = [_item(4, 2), _item(5, 2), _item(0, 2)]
    before, fp_before = [enc.encode_batch(it)[0] for it in items], enc.fingerprint
    _optimizer_step(trainer, items)
    fp_after = enc.update_weights(trainer.state_dict())
    assert fp_after != fp_before and enc.fingerprint == fp_after
    after = [enc.encode_batch(it)[0] for it in items]
    with torch.no_grad():
        trained = trainer(MediaBatch.concat(items).pixel_values, MediaBatch.concat(items).grid_thw)
    assert all(torch.equal(a, t) for a, t in zip(after, trained))  # packed copies and tables were refreshed
    assert all(not torch.equal(a, b) for a, b in zip(after, before))
    # A fresh load of the same weights: the same bits and the same fingerprint.
    save_checkpoint(tmp_path, enc.config, trainer.state_dict(), dtype=enc.dtype)
    fresh = bivit.load_encoder(tmp_path, dtype=dtype)
    assert fresh.fingerprint == fp_after
    assert all(torch.equal(fresh.encode_batch(it)[0], a) for it, a in zip(items, after))


def test_fused_optimizer_steps_reach_the_next_forward(paths):
    """torch's fused AdamW (transformers' default optimizer) writes the weights in place without bumping their
    version counters, which bivit's packed-weight and position-table caches key on: the module bumps them after
    any step (else the next forward computes with the old weights)."""
    enc = bivit.load_encoder(paths["kimi"], dtype="float32")
    trainer = bivit.load_model(paths["kimi"], dtype="float32")
    items = [_item(4, 3), _item(5, 3)]
    train_step(trainer, items)
    bystander = torch.nn.Parameter(torch.zeros(3))
    bystander.grad = torch.ones(3)
    version = bystander._version
    torch.optim.AdamW([*trainer.parameters(), bystander], lr=1e-2, fused=True).step()
    assert bystander._version == version and bool((bystander != 0).all())  # control: updated, version as it was
    enc.update_weights(trainer.state_dict())
    outs, _, _, _ = train_step(trainer, items)
    assert all(torch.equal(o, enc.encode_batch(it)[0]) for o, it in zip(outs, items))


def _bad_updates(state):
    key = "vision_tower.encoder.blocks.1.mlp.fc0.weight"
    extra = dict(state, **{"vision_tower.extra.weight": torch.zeros(3)})
    missing = {k: v for k, v in state.items() if k != key}
    nan, inf = state[key].clone(), state[key].clone()
    nan[3, 5], inf[0, 0] = float("nan"), float("-inf")
    return {
        "missing": (missing, key), "extra": (extra, "vision_tower.extra.weight"),
        "shape": (dict(state, **{key: state[key][:, :-1]}), key),
        "dtype": (dict(state, **{key: state[key].to(torch.float16)}), key),
        "nan": (dict(state, **{key: nan}), key), "inf": (dict(state, **{key: inf}), key),
        "not a tensor": (dict(state, **{key: state[key].tolist()}), key),
    }


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "dtype", "nan", "inf", "not a tensor"])
def test_bad_weight_update_is_refused_whole_and_names_the_key(paths, case):
    enc = bivit.load_encoder(paths["kimi"], dtype="bfloat16")
    trainer = bivit.load_model(paths["kimi"], dtype="bfloat16")
    _optimizer_step(trainer, [_item(3, 0)])
    item = _item(4, 0)
    before, fp = enc.encode_batch(item)[0], enc.fingerprint
    weights = {k: v.clone() for k, v in enc.model.state_dict().items()}
    bad, key = _bad_updates(trainer.state_dict())[case]
    with pytest.raises(bivit.CheckpointError, match=key.replace(".", r"\.")):
        enc.update_weights(bad)
    assert enc.fingerprint == fp and torch.equal(enc.encode_batch(item)[0], before)
    assert all(torch.equal(v, weights[k]) for k, v in enc.model.state_dict().items())  # nothing half-copied
