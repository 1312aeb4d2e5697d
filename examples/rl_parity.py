"""RL with exact train-inference parity: rollouts from a running `bivit serve`, the trainer recomputes them.

    bivit serve --api-key s3cret &                                  # the demo model (or --model DIR)
    python examples/rl_parity.py --url http://127.0.0.1:8000 --api-key s3cret

1. Rollout: the server encodes the prompt images; a tiny language model samples a response per image from
   those embeddings and records the log-probabilities of the sampled tokens (the behaviour policy).
2. Trainer: `bivit.load_model` recomputes the embeddings under autograd, the same language model scores the
   same tokens: the log-probabilities are equal bit for bit, so the update is exactly on-policy (importance
   ratio 1, not "about 1").
3. One optimizer step (a REINFORCE loss) on the vision encoder and the language model.
4. The new vision weights go to the server: `POST /v1/weights` with a safetensors body.
5. The next rollout again equals the trainer, bit for bit, and names the new weights' fingerprint.

Exits 1 if any of this does not hold. Use the model and dtype the server was started with.
"""

from __future__ import annotations

import argparse
import sys

import httpx
import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import save as safetensors_bytes

import bivit
from bivit.media.pixels import MediaBatch, preprocess_images
from bivit.serve.client import parse_response

RESPONSE_TOKENS = 8


class TinyLM(nn.Module):
    """A stand-in language model: image context + previous token -> next-token distribution."""

    def __init__(self, hidden: int, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def next_logprobs(self, image: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        context = image.float().mean(0)
        return torch.log_softmax(self.head(torch.tanh(self.mix(self.embed(prev) + context))), -1)

    def score(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of tokens[1:] given the image and the tokens before each."""
        return self.next_logprobs(image, tokens[:-1]).gather(-1, tokens[1:, None])[:, 0]

    @torch.no_grad()
    def sample(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        tokens = [0]  # BOS
        for _ in range(RESPONSE_TOKENS):
            probs = self.next_logprobs(image, torch.tensor(tokens[-1:])).exp()[0]
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
        return torch.tensor(tokens)


def rollout(http: httpx.Client, images: list[np.ndarray], lm: TinyLM, gen: torch.Generator):
    """Images -> (server embeddings, response fingerprint, sampled tokens, behaviour log-probabilities)."""
    from PIL import Image
    import io

    files = []
    for i, img in enumerate(images):
        buf = io.BytesIO()
        Image.fromarray(img, "RGB").save(buf, format="PNG")
        files.append(("file", (f"prompt{i}.png", buf.getvalue(), "image/png")))
    r = http.post("/v1/encode", files=files)
    r.raise_for_status()
    meta, results = parse_response(r.content)
    embeddings = [res.embedding for res in results]
    tokens = [lm.sample(e, gen) for e in embeddings]
    with torch.no_grad():
        logprobs = [lm.score(e, t) for e, t in zip(embeddings, tokens)]
    return embeddings, meta["fingerprint"], tokens, logprobs, [res.extra["cached"] for res in results]


def push_weights(http: httpx.Client, model: nn.Module) -> dict:
    body = safetensors_bytes({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    r = http.post("/v1/weights", content=body, headers={"Content-Type": "application/octet-stream"})
    r.raise_for_status()
    return r.json()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="the server's checkpoint directory (default: the demo model)")
    p.add_argument("--dtype", default="bfloat16", help="the server's --dtype")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    vision = bivit.load_model(args.model, dtype=args.dtype)  # the trainer's copy of the served encoder
    lm = TinyLM(vision.config.text_hidden_size)
    opt = torch.optim.SGD(list(vision.parameters()) + list(lm.parameters()), lr=0.05)
    rng = np.random.default_rng(args.seed)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(56, 56), (84, 112), (28, 28), (112, 84)]]
    batch = preprocess_images(images)  # the pixels the server computes from the same images
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ok = True
    with httpx.Client(base_url=args.url, headers=headers, timeout=120) as http:
        gen = torch.Generator().manual_seed(args.seed)
        served, fingerprint, tokens, behaviour, _ = rollout(http, images, lm, gen)

        # The trainer's forward: one micro-batch of all prompts, in reverse order (it must not matter).
        order = list(range(len(images)))[::-1]
        reordered = MediaBatch.concat([batch.item(i) for i in order])
        outs = vision(reordered.pixel_values, reordered.grid_thw)
        trained = [outs[order.index(i)] for i in range(len(images))]
        logprobs = [lm.score(e, t) for e, t in zip(trained, tokens)]
        same_emb = all(torch.equal(a.detach(), b) for a, b in zip(trained, served))
        same_lp = all(torch.equal(a.detach(), b) for a, b in zip(logprobs, behaviour))
        print(f"rollout 1 (weights {fingerprint[:12]}): embeddings bitwise equal: {same_emb}; "
              f"token log-probs bitwise equal: {same_lp}")
        ok &= same_emb and same_lp

        rewards = torch.tensor([float((t[1:] % 2 == 0).float().mean()) for t in tokens])
        advantage = rewards - rewards.mean()
        loss = -(advantage * torch.stack([lp.sum() for lp in logprobs])).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"optimizer step: loss {loss.item():.6f}")

        update = push_weights(http, vision)
        print(f"pushed {update['tensors']} tensors: fingerprint {update['previous_fingerprint'][:12]} -> "
              f"{update['fingerprint'][:12]}")
        ok &= update["fingerprint"] != fingerprint

        served2, fingerprint2, tokens2, behaviour2, cached = rollout(http, images, lm, gen)
        with torch.no_grad():
            trained2 = vision(batch.pixel_values, batch.grid_thw)
            logprobs2 = [lm.score(e, t) for e, t in zip(trained2, tokens2)]
        same_emb = all(torch.equal(a, b) for a, b in zip(trained2, served2))
        same_lp = all(torch.equal(a, b) for a, b in zip(logprobs2, behaviour2))
        print(f"rollout 2 (weights {fingerprint2[:12]}, cached: {any(cached)}): embeddings bitwise equal: "
              f"{same_emb}; token log-probs bitwise equal: {same_lp}")
        ok &= same_emb and same_lp and fingerprint2 == update["fingerprint"] and not any(cached)
    print("parity holds" if ok else "PARITY BROKEN")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
