"""Probes run inside vLLM's worker process (through `LLM.apply_model`, so they must be importable there by
name: the test puts this folder on PYTHONPATH before the engine starts).

`install` wraps the model's two doors for media rows: `embed_multimodal` (vLLM's own vision tower and
projector: every call is an encoder run, counted per item) and `embed_input_ids` (where the rows of every
scheduled item, computed or loaded from the encoder cache, are merged into the language model's input:
recorded exactly). `take` returns and clears what was seen since the last call.
"""

from __future__ import annotations


def install(model) -> bool:
    if getattr(model, "_bivit_probe", None) is not None:
        return False
    probe = model._bivit_probe = {"encoded_items": 0, "encoder_calls": 0, "items_per_call": [], "rows_in": []}
    embed_multimodal, embed_input_ids = model.embed_multimodal, model.embed_input_ids

    def counted_embed_multimodal(**kwargs):
        out = embed_multimodal(**kwargs)
        probe["encoder_calls"] += 1
        probe["encoded_items"] += len(out) if out is not None else 0
        probe["items_per_call"].append(len(out) if out is not None else 0)
        return out

    def recorded_embed_input_ids(input_ids, multimodal_embeddings=None, **kwargs):
        if multimodal_embeddings is not None:
            probe["rows_in"].extend(t.detach().cpu().clone() for t in multimodal_embeddings)
        return embed_input_ids(input_ids, multimodal_embeddings=multimodal_embeddings, **kwargs)

    model.embed_multimodal = counted_embed_multimodal
    model.embed_input_ids = recorded_embed_input_ids
    return True


def take(model) -> dict:
    probe = model._bivit_probe
    out = dict(probe)
    probe.update(encoded_items=0, encoder_calls=0, items_per_call=[], rows_in=[])
    return out


def model_class(model) -> str:
    return f"{type(model).__module__}.{type(model).__name__}"


def bivit_fingerprint(model) -> str:
    """The fingerprint of bivit's encoder inside the engine (BivitKimiK25ForConditionalGeneration)."""
    return model.encoder().fingerprint


def load_weights(weights, model) -> None:
    """The model's own `load_weights` with these (name, tensor) pairs, as RL frameworks call it between steps."""
    model.load_weights(weights)
