"""GRPO runs for the RL tests (tests/test_rl_grpo.py, tests/vllm_engine/test_vllm_rl.py): TRL's GRPOTrainer on a
tiny Kimi-K2.5 (transformers' model class) with a `bivit.integrations.rl.Rollout`, recording what the rollout and the
trainer saw.

`grpo_run` trains; its `Record` holds, by step and image (`image_key`: the item's pixels), the rows the rollout
generated from and the rows each trainer forward computed, and per scored micro-batch two log-prob gaps of the
completion tokens: trainer vs rollout, and trainer vs the trainer's own forward with the rollout's rows in place of
its own (what the rows alone contribute).

Imports TRL and transformers: its users import it after `pytest.importorskip("trl")`.
"""

from __future__ import annotations

import contextlib

import torch
from datasets import Dataset
from PIL import Image
from transformers import Kimi_K25ForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutputWithPooling
from trl import GRPOConfig, GRPOTrainer

import bivit
import bivit.integrations.hf as bh
from bivit.core.items import prepare
from bivit.integrations.rl import Rollout
from bivit.integrations.rows import Media
from bivit.integrations.vllm import Target
from support.media import random_image

SIZES = [(112, 112), (60, 250), (203, 97)]  # (h, w): three prompts, one image each
STEPS = 2


def image_key(pixels: torch.Tensor, grid) -> str:
    return bh.pixel_key(pixels, list(grid))


class Record:
    """What a run saw: rollout rows by (step, image key); trainer rows as (step, image key, rows); per scored
    micro-batch, |trainer log-prob - rollout log-prob| of the completion tokens (`gaps`) and |trainer log-prob -
    the trainer's log-prob recomputed with the rollout's rows in place of its own| (`row_gaps`: what the image rows
    alone contribute)."""

    def __init__(self) -> None:
        self.rollout: dict[tuple[int, str], torch.Tensor] = {}
        self.trainer: list[tuple[int, str, torch.Tensor]] = []
        self.gaps: list[torch.Tensor] = []
        self.row_gaps: list[torch.Tensor] = []
        self.tower_calls = 0

    def mismatches(self) -> int:
        return sum(not torch.equal(rows, self.rollout[(step, key)]) for step, key, rows in self.trainer)

    def gap(self, which: str = "gaps") -> dict:
        g = torch.cat(getattr(self, which))
        return {"max": float(g.max()), "mean": float(g.mean()), "tokens": int(g.numel())}

    def report(self) -> dict:
        return {"trainer_rows": len(self.trainer), "rows_differing": self.mismatches(),
                "logprob_gap_rollout_vs_trainer": self.gap(), "logprob_gap_from_rows": self.gap("row_gaps")}


@contextlib.contextmanager
def rollout_rows(model, record: Record, step: int):
    """The model's image features replaced by the rows the rollout used (by image key), for the duration."""
    inner = model.model
    features = inner.get_image_features

    def theirs(pixel_values, image_grid_thw=None, **_):
        grid = image_grid_thw.tolist()
        parts = pixel_values.split([t * h * w for t, h, w in grid])
        return BaseModelOutputWithPooling(pooler_output=tuple(record.rollout[(step, image_key(px, g))]
                                                              for g, px in zip(grid, parts)))

    inner.get_image_features = theirs
    try:
        yield
    finally:
        inner.get_image_features = features


class RecordingTrainer(GRPOTrainer):
    """Records, for each scored micro-batch (the loss forward, before the optimizer step), the log-prob gaps of
    `Record`."""

    record: Record

    def _compute_loss(self, model, inputs):
        self._scored = inputs
        return super()._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._scored = getattr(self, "_scored", None), None
        if inputs is not None:
            mask = inputs["completion_mask"].bool()
            ours = out[0].detach().float()
            self.record.gaps.append((ours - inputs["sampling_per_token_logps"])[mask].abs())
            # The same forward (grad mode, batch and all) with the rollout's rows in place of the trainer's.
            with rollout_rows(self.accelerator.unwrap_model(model), self.record, self.state.global_step):
                again = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)[0].detach().float()
            self.record.row_gaps.append((ours - again)[mask].abs())
        return out


class RecordingRollout(Rollout):
    """bivit's rollout, recording the rows it generated from by image."""

    record: Record

    def encode(self, images):
        media = super().encode(images)
        for img, m in zip(images, media):
            p = self.encoder.prepare(img)
            self.record.rollout[(self._synced_step, image_key(p.batch.pixel_values, p.grid_thw[0]))] = m.embedding
        return media


class HFTowerRollout(Rollout):
    """The control: the rollout's rows from the model's own (HF's) tower, a batch's distinct images in one call."""

    record: Record

    def __init__(self, processor, model) -> None:
        super().__init__(None, processor)
        self.model = model
        self.features = model.model.get_image_features  # HF's, before the trainer-side recorder wraps it

    @property
    def target(self) -> Target:
        return Target(self.model.config.text_config.hidden_size, self.model.dtype)

    def sync(self, model) -> None:  # generation runs on the trainer's model; the rollout's tower is the model's
        pass

    @torch.no_grad()
    def encode(self, images):
        prepared = [prepare(img, processing=self.processor.processing).checked() for img in images]
        distinct = list({p.sha256: p for p in prepared}.values())
        pixels = torch.cat([p.batch.pixel_values for p in distinct])
        grid = torch.cat([p.batch.grid_thw for p in distinct])
        rows = dict(zip((p.sha256 for p in distinct), self.features(pixels.to(self.model.dtype), grid).pooler_output))
        for p in distinct:
            self.record.rollout[(self._synced_step, image_key(p.batch.pixel_values, p.grid_thw[0]))] = rows[p.sha256]
        return [Media(rows[p.sha256], p.placeholders, "hf-tower", p.sha256, sizes=p.sizes) for p in prepared]


def record_trainer_rows(model, trainer, record: Record) -> None:
    """Wrap the model's get_image_features (bivit's once attached, else HF's) to record each item's rows."""
    inner = model.model
    features = inner.get_image_features

    def recorded(pixel_values, image_grid_thw=None, **kwargs):
        grid = image_grid_thw.tolist()
        keys = [image_key(px, g) for g, px in zip(grid, pixel_values.split([t * h * w for t, h, w in grid]))]
        if not bh.is_attached(model):  # HF's tower takes [L, 3, 14, 14] in its own dtype
            pixel_values = pixel_values.reshape(pixel_values.shape[0], 3, 14, 14).to(model.dtype)
        out = features(pixel_values, image_grid_thw, **kwargs)
        record.trainer += [(trainer.state.global_step, k, rows.detach().clone())
                           for k, rows in zip(keys, out.pooler_output)]
        return out

    inner.get_image_features = recorded


def grpo_run(ckpt, dtype: str, mode: str, out_dir, *, engine=None, steps: int = STEPS, control=None,
             keep_model: bool = False, train_language_model: bool = True) -> tuple[Record, dict]:
    """One GRPO run of `steps` optimizer steps -> (record, {"moved": weights that changed, "steps", "model" if
    `keep_model`}). mode: "bivit" (attached, trainable), "frozen" (attached, rows from the rollout) or "hf-tower"
    (the control: HF's tower in the trainer; the rollout's rows from HF's tower too). `control(model, processor)`:
    the Rollout to use instead (e.g. vLLM encoding the images itself). `engine`: the bivit rollout's generation
    engine (default transformers' generate).
    `train_language_model=False` freezes the language model (the tower alone trains)."""
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration.from_pretrained(str(ckpt), dtype=getattr(torch, dtype))
    processor = bh.Processor.from_pretrained(ckpt)
    record = Record()
    store = bh.RowStore() if mode == "frozen" else None
    if not train_language_model:
        model.model.language_model.requires_grad_(False)
        model.lm_head.requires_grad_(False)
    if mode == "hf-tower":
        # The control compares forward rows; HF's tower stays frozen, which spares its slow backward (its bf16
        # GEMMs on CPUs without bf16 instructions) and changes nothing about where its rows come from.
        model.model.vision_tower.requires_grad_(False)
        model.model.mm_projector.requires_grad_(False)
        rollout = HFTowerRollout(processor, model) if control is None else control(model, processor)
    else:
        vision = bh.attach(model, rows=store)
        vision.vision_tower.register_forward_pre_hook(lambda *_: setattr(record, "tower_calls",
                                                                           record.tower_calls + 1))
        rollout = (RecordingRollout(bivit.load_encoder(str(ckpt), dtype=dtype), processor, rows=store, engine=engine)
                   if control is None else control(model, processor))
    rollout.record = record
    images = [Image.fromarray(random_image(h, w, i)) for i, (h, w) in enumerate(SIZES)]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Describe picture {i}."}]
                                            for i in range(len(images))], "image": images})

    def reward(completions, **_):  # anything that varies within a group, so that the advantages are not all 0
        return [sum(c[0]["content"].encode()) / 255 / (1 + len(c[0]["content"])) for c in completions]

    # One rollout per optimizer step (generation batch 6 = 3 prompts x 2), scored by the trainer in 3 micro-batches
    # of 2: the trainer's batches are not the rollout's. Weights move visibly (lr 1e-2) so step 2's rows differ.
    args = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=2, num_generations=2,
                      gradient_accumulation_steps=3, steps_per_generation=3, max_completion_length=6,
                      max_steps=steps, learning_rate=1e-2, gradient_checkpointing=False, use_cpu=True, bf16=False,
                      seed=0, logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0,
                      disable_tqdm=True)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = RecordingTrainer(model, reward_funcs=reward, args=args, train_dataset=dataset,
                               processing_class=processor, rollout_func=rollout)
    trainer.record = record
    record_trainer_rows(model, trainer, record)
    trainer.train()
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    return record, {"moved": moved, "steps": trainer.state.global_step, **({"model": model} if keep_model else {})}
