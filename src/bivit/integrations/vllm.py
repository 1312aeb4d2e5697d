"""bivit feeds vLLM: the exact inputs that make a vLLM engine run its language model on bivit's embedding rows.

For a Kimi-K2.5-architecture checkpoint served by vLLM (no vLLM patch), three ways in:

* **Offline prompt embeddings** (`LLM(..., enable_prompt_embeds=True)`): `build_prompt` expands each media
  placeholder of a prompt to its rows and returns the token ids, the `[len, hidden]` embedding tensor and the
  token-id mask of vLLM's `EmbedsPrompt` (`VllmPrompt.embeds_prompt()`).
* **The OpenAI-compatible server** (`vllm serve --enable-prompt-embeds`): `chat_content` gives a message's
  content parts, text around `{"type": "prompt_embeds", "data": <base64 of torch.save(rows)>}` parts.
* **The encoder-cache connector** (`ECExampleConnector`, `ec_role` `ec_consumer`): `write_encoder_cache` writes
  `DIR/<id>/encoder_cache.safetensors` (one tensor `"ec_cache"`, the item's rows) under ids derived from the
  item's content hash and the encoder fingerprint, and `ec_prompt` names the items by those ids in a request
  (`multi_modal_uuids`), so vLLM loads the rows and never runs its own vision tower for them.

Every way checks the rows against the language model (`Target`: its width, its dtype, and the encoder
fingerprint the rollout expects) and the prompt against the rows (one `<|media_pad|>` per image or video chunk,
each placeholder's row count), and refuses a mismatch with a bivit error naming it. The rows are never cast:
the bits that go in are the bits bivit produced, so a trainer reading the same files (`load_media`,
`VllmPrompt.spans`, `VllmPrompt.scatter`) sees what the rollout engine saw. The records themselves (`Media`,
`encode`, `load_media`, the ids) live in `bivit.integrations.rows` and are re-exported here.

No vLLM import here: prompts are plain dicts and tensors that vLLM accepts.
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from PIL import Image
from safetensors import safe_open

from ..base.dtypes import dtype_name, parse_dtype
from ..checkpoint.config import read_json_file
from ..core.encoder_cache import EC_FILE, EC_KEY, SAFETENSORS_DTYPES, write_rows
from ..core.encoder_cache import EC_ID_SCHEME, ec_id
from ..core.items import content_sha256
from ..errors import BivitError, ConfigError
from ..media.pixels import MEDIA_PAD
from .rows import Media, encode, iter_media, load_media

__all__ = ["EC_FILE", "EC_ID_SCHEME", "EC_KEY", "MODALITY", "Media", "Target", "VllmPrompt", "build_prompt",
           "chat_content", "check_encoder_cache", "content_sha256", "ec_chat_content", "ec_id", "ec_prompt", "encode",
           "iter_media", "load_media", "media_pad_id", "placeholder_text", "render", "serialize_rows", "stand_ins",
           "write_encoder_cache"]

# vLLM's modality for Kimi-K2.5 images and video chunks.
MODALITY = "vision_chunk"


# ------------------------------------------------------------------------------------ the language model

@dataclass(frozen=True)
class Target:
    """The language model the rows go into: its embedding width, the dtype vLLM runs it in (`--dtype`), and
    optionally the encoder fingerprint the rollout expects (rows from any other encoder are refused).

    `from_encoder` works for any encoder bivit loads (a checkpoint folder, a hub id, the demo): the projector
    writes the language model's width, so the encoder knows it. `from_checkpoint` reads it from the
    checkpoint vLLM serves instead (a cross-check that the encoder and the language model belong together)."""

    hidden_size: int
    dtype: torch.dtype
    fingerprint: Optional[str] = None

    @classmethod
    def from_encoder(cls, encoder: Any, dtype: Any = None) -> "Target":
        """The language model `encoder`'s projector writes for, expecting that encoder's fingerprint, run in
        `dtype` (vLLM's `--dtype`; default: the encoder's output dtype). An encoder whose rows are not in that
        dtype is refused here (bivit never casts rows on the way in)."""
        want = parse_dtype(dtype, "dtype") or encoder.output_dtype
        if want != encoder.output_dtype:
            raise ConfigError(f"the encoder writes {dtype_name(encoder.output_dtype)} rows but the language model "
                              f"runs in {dtype_name(want)}; load the encoder with output_dtype={dtype_name(want)}")
        return cls(int(encoder.config.text_hidden_size), want, encoder.fingerprint)

    @classmethod
    def from_checkpoint(cls, path: Union[str, os.PathLike], dtype: Any = "bfloat16",
                        fingerprint: Optional[str] = None) -> "Target":
        """The language model of a checkpoint directory (its config.json's `text_config.hidden_size`), run in
        `dtype` (what vLLM's `--dtype` resolves to)."""
        if not Path(path).exists():
            raise ConfigError(f"{path}: no such checkpoint folder or config.json (for an encoder without one, "
                              "such as the demo model, use Target.from_encoder(encoder))")
        config = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        raw = read_json_file(config)
        text = raw.get("text_config") if isinstance(raw, dict) else None
        hidden = text.get("hidden_size") if isinstance(text, dict) else None
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ConfigError(f"{config}: config key 'text_config.hidden_size' = {hidden!r}: expected the language "
                              "model's width (a positive integer)")
        return cls(hidden, parse_dtype(dtype, "dtype"), fingerprint)

    def check(self, media: Media) -> None:
        """Refuse rows this language model must not be fed (another encoder, width or dtype)."""
        name = media.source or "media"
        if self.fingerprint is not None and media.fingerprint != self.fingerprint:
            raise BivitError(f"{name}: encoded by model fingerprint {media.fingerprint[:12]}..., but this "
                             f"language model expects {self.fingerprint[:12]}... (another checkpoint, dtype or "
                             "preprocessing); re-encode with the rollout's encoder")
        if media.embedding.shape[1] != self.hidden_size:
            raise ConfigError(f"{name}: rows are {media.embedding.shape[1]} wide but the language model's hidden "
                              f"size is {self.hidden_size}")
        if media.embedding.dtype != self.dtype:
            raise ConfigError(f"{name}: rows are {dtype_name(media.embedding.dtype)} but the language model runs "
                              f"in {dtype_name(self.dtype)}; encode with output_dtype={dtype_name(self.dtype)} "
                              "(bivit never casts rows on the way in)")


def _checked(media: Sequence[Media], target: Target) -> list[Media]:
    media = list(media)
    for m in media:
        if not isinstance(m, Media):
            raise BivitError(f"expected bivit.integrations.rows.Media, got {type(m).__name__}")
        target.check(m)
    prints = {m.fingerprint for m in media}
    if len(prints) > 1:
        raise BivitError(f"one prompt mixes rows of {len(prints)} encoders (fingerprints "
                         f"{', '.join(sorted(p[:12] + '...' for p in prints))})")
    return media


# ------------------------------------------------------------------------------------------------ prompts

def media_pad_id(tokenizer: Any) -> int:
    """The token id of `<|media_pad|>` in a tokenizer (how vLLM's Kimi-K2.5 model resolves it too)."""
    pad = tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(pad, int) or (unk is not None and pad == unk):
        raise ConfigError(f"the tokenizer has no {MEDIA_PAD} token; it is not a Kimi-K2.5-architecture tokenizer")
    return pad


def _token_ids(prompt: Union[str, Sequence[int]], tokenizer: Any, add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BivitError("a text prompt needs the model's tokenizer (or pass token ids)")
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return [int(t) for t in prompt]


def _pad_id(tokenizer: Any, pad: Optional[int]) -> int:
    if pad is not None:
        return int(pad)
    if tokenizer is None:
        raise BivitError(f"pass the tokenizer or media_pad_id (the id of {MEDIA_PAD})")
    return media_pad_id(tokenizer)


def _pad_positions(ids: list[int], pad: int, placeholders: int) -> list[int]:
    positions = [i for i, t in enumerate(ids) if t == pad]
    if len(positions) != placeholders:
        raise BivitError(f"the prompt has {len(positions)} {MEDIA_PAD} token(s) but the media have {placeholders} "
                         "placeholder(s) (one per image and one per video chunk, in order)")
    return positions


def placeholder_text(media: Media) -> str:
    """The prompt text the model's processor writes for one input (its placeholders, in order)."""
    return "".join(p.text for p in media.placeholders)


def render(segments: Sequence[Union[str, Media]]) -> str:
    """Text and media, in order -> one prompt string with each input's placeholders in place."""
    return "".join(s if isinstance(s, str) else placeholder_text(s) for s in segments)


@dataclass
class VllmPrompt:
    """A prompt with every placeholder expanded to its rows: the three fields of vLLM's `EmbedsPrompt`, and
    `spans`, the (start, length) of each placeholder's rows in `prompt_token_ids` (in order)."""

    prompt_token_ids: list[int]
    prompt_embeds: torch.Tensor
    prompt_is_token_ids: list[bool]
    spans: list[tuple[int, int]] = field(default_factory=list)

    def embeds_prompt(self) -> dict:
        """The prompt for `LLM.generate` (an `EmbedsPrompt`; the engine needs `enable_prompt_embeds=True`)."""
        return {"prompt_embeds": self.prompt_embeds, "prompt_token_ids": list(self.prompt_token_ids),
                "prompt_is_token_ids": list(self.prompt_is_token_ids)}

    def rows(self) -> torch.Tensor:
        """The media rows, in prompt order (`[sum of lengths, hidden]`)."""
        return torch.cat([self.prompt_embeds[s:s + n] for s, n in self.spans]) if self.spans else \
            self.prompt_embeds[:0]

    def scatter(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """A trainer's token embeddings of `prompt_token_ids` (`[len, hidden]`, or `[1, len, hidden]`) with the
        media rows written at their spans: what vLLM's language model sees. Returns a new tensor."""
        x = inputs_embeds
        squeeze = x.ndim == 3 and x.shape[0] == 1
        x = x[0] if squeeze else x
        if x.ndim != 2 or tuple(x.shape) != tuple(self.prompt_embeds.shape):
            raise BivitError(f"inputs_embeds must be [{len(self.prompt_token_ids)}, "
                             f"{self.prompt_embeds.shape[1]}], got {list(inputs_embeds.shape)}")
        if x.dtype != self.prompt_embeds.dtype:
            raise ConfigError(f"inputs_embeds are {x.dtype} but the rows are {self.prompt_embeds.dtype}")
        out = x.clone()
        for s, n in self.spans:
            out[s:s + n] = self.prompt_embeds[s:s + n]
        return out[None] if squeeze else out


def build_prompt(prompt: Union[str, Sequence[int]], media: Sequence[Media], *, target: Target,
                 tokenizer: Any = None, media_pad_id: Optional[int] = None,
                 add_special_tokens: bool = False) -> VllmPrompt:
    """A prompt with one `<|media_pad|>` per image or video chunk (as the model's chat template or `render`
    writes it) and the media in the same order -> the expanded prompt for `LLM.generate`.

    The text is tokenized with `tokenizer.encode(prompt, add_special_tokens=add_special_tokens)` (a chat
    template's output already holds its special tokens), or pass token ids. Each pad becomes as many pad
    tokens as its placeholder has rows (as vLLM's processor expands it), masked as embedding positions.
    """
    media = _checked(media, target)
    ids = _token_ids(prompt, tokenizer, add_special_tokens)
    pad = _pad_id(tokenizer, media_pad_id)
    chunks = [c for m in media for c in m.chunks()]
    positions = _pad_positions(ids, pad, len(chunks))
    out_ids: list[int] = []
    mask: list[bool] = []
    spans: list[tuple[int, int]] = []
    last = 0
    for pos, rows in zip(positions, chunks):
        out_ids += ids[last:pos]
        mask += [True] * (pos - last)
        spans.append((len(out_ids), rows.shape[0]))
        out_ids += [pad] * rows.shape[0]
        mask += [False] * rows.shape[0]
        last = pos + 1
    out_ids += ids[last:]
    mask += [True] * (len(ids) - last)
    embeds = torch.zeros(len(out_ids), target.hidden_size, dtype=target.dtype)
    for (start, n), rows in zip(spans, chunks):
        embeds[start:start + n] = rows
    return VllmPrompt(out_ids, embeds, mask, spans)


def chat_content(segments: Sequence[Union[str, Media]], *, target: Target) -> list[dict]:
    """A chat message's content for vLLM's OpenAI-compatible server (`--enable-prompt-embeds`): text parts and
    one `prompt_embeds` part per image or video chunk, in place of its `<|media_pad|>`.

    The server renders text parts and the prompt-embeds marker inline, in order, when the chat template's
    content format is "openai" (Kimi's template; force it with `--chat-template-content-format openai`); with
    the "string" format vLLM joins parts with newlines and the tokens around the rows change.
    """
    media = _checked([s for s in segments if not isinstance(s, str)], target)
    parts: list[dict] = []

    def text(t: str) -> None:
        if not t:
            return
        if parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += t
        else:
            parts.append({"type": "text", "text": t})

    it = iter(media)
    for seg in segments:
        if isinstance(seg, str):
            text(seg)
            continue
        m = next(it)
        for p, rows in zip(m.placeholders, m.chunks()):
            before, sep, after = p.text.partition(MEDIA_PAD)
            if not sep:
                raise BivitError(f"{m.source or 'media'}: placeholder {p.text!r} has no {MEDIA_PAD}")
            text(before)
            parts.append({"type": "prompt_embeds", "data": serialize_rows(rows)})
            text(after)
    return parts


def serialize_rows(rows: torch.Tensor) -> str:
    """Rows as the server's `prompt_embeds` data: base64 of `torch.save` (loaded with `weights_only=True`)."""
    buf = io.BytesIO()
    torch.save(rows.detach().cpu().contiguous().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ------------------------------------------------------------------------------------------ encoder cache

def write_encoder_cache(directory: Union[str, os.PathLike], media: Sequence[Media], *,
                        target: Optional[Target] = None) -> list[list[str]]:
    """Write each image's / video chunk's rows for vLLM's ECExampleConnector -> per input, its ids (for the
    request's `multi_modal_uuids`; `ec_prompt` builds it).

    `DIR/<id>/encoder_cache.safetensors` holds one contiguous CPU tensor `"ec_cache"`, the rows (vLLM loads it
    as the item's encoder output); written as `bivit.core.encoder_cache.write_rows` writes (atomic, complete files
    kept, anything else replaced). With `target`, rows the language model must not be fed are refused before
    anything is written.
    """
    media = list(media)
    if target is not None:
        media = _checked(media, target)
    out = []
    for m in media:
        ids = m.ec_ids()
        write_rows(directory, ids, m.chunks())
        out.append(ids)
    return out


def check_encoder_cache(directory: Union[str, os.PathLike], media: Sequence[Media], target: Target) -> None:
    """Raise unless every item's file is in `directory` with rows of its expected shape and the target's dtype
    (a consumer request must never fall back to vLLM's vision tower on a stand-in image)."""
    for m in media:
        for i, p in zip(m.ec_ids(), m.placeholders):
            path = Path(directory) / i / EC_FILE
            if not path.is_file():
                raise BivitError(f"{path}: missing encoder-cache file for {m.source or 'media'} (write it with "
                                 "write_encoder_cache or `bivit encode --ec-dir`)")
            try:
                with safe_open(str(path), framework="pt") as f:
                    sl = f.get_slice(EC_KEY)
                    shape, dtype = list(sl.get_shape()), sl.get_dtype()
            except Exception as e:  # a truncated or foreign file
                raise BivitError(f"{path}: not a readable encoder-cache file ({e})") from None
            short = SAFETENSORS_DTYPES[dtype_name(target.dtype)]
            if shape != [p.tokens, target.hidden_size] or dtype != short:
                raise BivitError(f"{path}: holds {dtype} {shape}, expected {short} {[p.tokens, target.hidden_size]}")


def stand_ins(media: Media) -> list[dict]:
    """vLLM `vision_chunk` items standing in for an input's images / video chunks: black pictures of the
    original sizes, from which vLLM's processor computes the same placeholder lengths. Their pixels are never
    encoded when the rows come from the encoder cache (`ec_prompt` checks the files are there)."""
    items = []
    for n, (p, size, t) in enumerate(zip(media.placeholders, media.sizes, media.frames)):
        if size is None:
            raise BivitError(f"{media.source or 'media'}: the size of placeholder {n} is unknown (not recorded "
                             "where these rows were read from); pass vLLM the real media with the ids instead")
        picture = Image.new("RGB", tuple(size))
        if media.kind == "image":
            items.append({"type": "image", "image": picture, "uuid": None})
        else:
            items.append({"type": "video_chunk", "video_chunk": [picture] * t, "uuid": None, "prompt": "",
                          "video_idx": 0})
    return items


def ec_prompt(prompt: Union[str, Sequence[int]], media: Sequence[Media], *, target: Target,
              ec_dir: Union[str, os.PathLike], tokenizer: Any = None, media_pad_id: Optional[int] = None,
              add_special_tokens: bool = False, items: Optional[Sequence[dict]] = None) -> dict:
    """A request for a vLLM started with the encoder-cache connector as consumer on `ec_dir`: the prompt's
    token ids (one `<|media_pad|>` per image or chunk, which vLLM expands), the `vision_chunk` items (default:
    `stand_ins`; or the real ones, one per placeholder) and `multi_modal_uuids` naming bivit's files. Refuses
    media whose files are missing or malformed.

    Pass no `mm_processor_kwargs` with it: vLLM then hashes the ids with them and looks up other names.
    """
    media = _checked(media, target)
    ids = _token_ids(prompt, tokenizer, add_special_tokens)
    _pad_positions(ids, _pad_id(tokenizer, media_pad_id), sum(len(m.placeholders) for m in media))
    check_encoder_cache(ec_dir, media, target)
    items = [item for m in media for item in stand_ins(m)] if items is None else list(items)
    if len(items) != sum(len(m.placeholders) for m in media):
        raise BivitError(f"{len(items)} vision_chunk items for {sum(len(m.placeholders) for m in media)} "
                         "placeholders")
    return {"prompt_token_ids": ids,
            "multi_modal_data": {MODALITY: items},
            "multi_modal_uuids": {MODALITY: [i for m in media for i in m.ec_ids()]}}



def ec_chat_content(segments: Sequence[Union[str, Media]], *, target: Target,
                    ec_dir: Union[str, os.PathLike]) -> list[dict]:
    """A chat message's content for vLLM's OpenAI-compatible server started as encoder-cache consumer on
    `ec_dir`: text parts and, per image, an `image_url` part holding a black stand-in of the image's size (a
    PNG data URL) with the item's id as its `uuid`. Refuses media whose files are missing, and videos (the
    server decodes and splits a video itself; send video rows as `chat_content`'s prompt embeddings).
    """
    media = _checked([s for s in segments if not isinstance(s, str)], target)
    for m in media:
        if m.kind != "image":
            raise BivitError(f"{m.source or 'media'}: the server splits videos into chunks itself; send a video's "
                             "rows with chat_content (prompt embeddings) instead")
    check_encoder_cache(ec_dir, media, target)
    parts: list[dict] = []
    it = iter(media)
    for seg in segments:
        if isinstance(seg, str):
            if seg:
                parts.append({"type": "text", "text": seg})
            continue
        m = next(it)
        (item,), (id_,) = stand_ins(m), m.ec_ids()
        buf = io.BytesIO()
        item["image"].save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        parts.append({"type": "image_url", "image_url": {"url": url}, "uuid": id_})
    return parts
