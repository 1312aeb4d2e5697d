"""TRL's GRPOTrainer on a tiny Kimi-K2.5 (transformers' model class, random weights), 2 optimizer steps on CPU, with
bivit's `rollout_func` (`bivit.integrations.rl.Rollout`: bivit's Encoder, transformers' `generate` fed bivit's rows).

What is proven, every step (the second one after a weight update, synced to the rollout encoder):
* with bivit attached, the rows each trainer forward computed for an image are the bits the rollout generated
  from (`torch.equal`), so the trainer's log-probs are exactly those it computes with the rollout's rows in their
  place; the rollout's rows move from step to step (the update reached the rollout encoder);
* frozen tower (`attach(model, rows=store)`): the trainer reads the rollout's rows, runs no tower and its tower
  weights do not move while the language model's do;
* control: the same run with HF's own tower in the rollout and in the trainer (the rollout encodes a batch's
  distinct images together, the trainer its micro-batches) gives rows that differ, and log-probs that move when
  the rollout's rows replace the trainer's; with stock kernels, or where those happen to be row-count invariant
  on this CPU at these shapes, with deliberately row-count-dependent GEMMs.

Reported, not asserted (printed with the CPU): the rollout-vs-trainer gap of the completion tokens' log-probs, fp32
and bf16, with and without bivit. It holds the language model's own difference (transformers' incremental decoding
in the rollout vs one forward over the whole sequence in the trainer), which bivit does not touch, and the rows'.
"""

from __future__ import annotations

import json
import os
import platform

import pytest
import torch

from support import doc_code
from support.controls import row_count_dependent_gemms
from support.media import png_bytes

pytest.importorskip("trl")
import bivit  # noqa: E402
import bivit.integrations.hf as bh  # noqa: E402
from support.grpo import STEPS, grpo_run  # noqa: E402

@pytest.fixture(scope="module")
def runs(tiny_kimi_ckpt, tmp_path_factory):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
    cache: dict = {}

    def get(dtype: str, mode: str):
        if (dtype, mode) not in cache:
            cache[(dtype, mode)] = grpo_run(tiny_kimi_ckpt, dtype, mode, tmp_path_factory.mktemp(f"{mode}-{dtype}"))
        return cache[(dtype, mode)]

    yield get
    report = {f"{mode} {dtype}": rec.report() for (dtype, mode), (rec, _) in cache.items()}
    print(f"\nGRPO rollout vs trainer ({platform.processor() or platform.machine()}, {STEPS} steps):",
          json.dumps(report, indent=1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_rollout_and_trainer_rows_are_the_same_bits_every_step(runs, dtype):
    record, info = runs(dtype, "bivit")
    assert info["steps"] == STEPS
    assert {step for step, _, _ in record.trainer} == set(range(STEPS))  # every step's forwards, 3 images each
    assert len(record.trainer) == STEPS * 3 * 2
    assert record.mismatches() == 0
    assert record.gap("row_gaps")["max"] == 0.0  # the trainer's log-probs are those of the rollout's rows
    assert record.tower_calls > 0  # (the counter the frozen-tower test reads: it sees the trainer's tower run)
    assert any(k.startswith("model.vision_tower.") for k in info["moved"])  # the tower trained ...
    keys = {key for _, key in record.rollout}
    assert all(not torch.equal(record.rollout[(0, k)], record.rollout[(1, k)]) for k in keys)  # ... and synced
    print(f"\nbivit {dtype}:", json.dumps(record.report()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_control_hf_tower_rows_differ_between_rollout_and_trainer(runs, dtype, tiny_kimi_ckpt, tmp_path):
    record, info = runs(dtype, "hf-tower")
    assert info["steps"] == STEPS and len(record.trainer) == STEPS * 3 * 2
    print(f"\nHF tower {dtype}:", json.dumps(record.report()))
    if not record.mismatches():  # stock kernels row-count invariant here at these shapes: make them not
        with row_count_dependent_gemms():
            record = grpo_run(tiny_kimi_ckpt, dtype, "hf-tower", tmp_path)[0]
        print(f"HF tower {dtype}, row-count-dependent GEMMs:", json.dumps(record.report()))
    assert record.mismatches() > 0 and record.gap("row_gaps")["max"] > 0


def test_frozen_tower_reads_the_rollouts_rows(runs):
    record, info = runs("float32", "frozen")
    assert len(record.trainer) == STEPS * 3 * 2 and record.mismatches() == 0
    assert record.gap("row_gaps")["max"] == 0.0
    assert record.tower_calls == 0  # the trainer never ran its tower
    assert info["moved"] and not any(k.startswith(("model.vision_tower.", "model.mm_projector."))
                                     for k in info["moved"])


def test_guides_trl_recipe_runs_as_written(tiny_kimi_ckpt, tmp_path, monkeypatch):
    """docs/rl.md's TRL blocks, in order, on the tiny checkpoint (the reader's checkpoint and output folder put in;
    the reader's pictures written here)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cat.png").write_bytes(png_bytes(140, 112, 41))
    (tmp_path / "dog.png").write_bytes(png_bytes(98, 154, 42))
    ns = doc_code.run(["model", "grpo", "save"], {}, guide=doc_code.RL_GUIDE, ckpt=tiny_kimi_ckpt,
                      out=tmp_path / "out")
    assert ns["trainer"].state.global_step == 2
    trained, model, processor = ns["trained"], ns["model"], ns["processor"]
    batch = processor(text=["<|media_pad|>"], images=[ns["images"][0]], return_tensors="pt")
    with torch.no_grad():
        (rows,) = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    assert torch.equal(rows, trained.encode([ns["images"][0]])[0])  # the saved checkpoint serves the trained bits

    doc_code.run(["frozen"], ns, guide=doc_code.RL_GUIDE)
    assert ns["trainer"].state.global_step == 2 and len(ns["store"]) == 1  # the last rollout's picture
    frozen = bh.vision_model(ns["model"]).state_dict()
    loaded = bivit.load_model(str(tiny_kimi_ckpt), dtype="float32").state_dict()
    assert all(torch.equal(frozen[k], loaded[k]) for k in loaded)  # the tower did not move
