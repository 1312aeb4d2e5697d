"""bivit: batch-invariant vision encoding for Kimi-K2.5/K2.6/K3.

    encoder = bivit.load_encoder()            # demo model; or a checkpoint directory
    embeddings = encoder.encode(["cat.png"])  # one [tokens, text_hidden] tensor per input
    items = bivit.load_embeddings("emb.safetensors")  # any file bivit writes: records with .embedding

The names below load their module on first use (PEP 562), so `import bivit` is cheap and
`bivit.open_dataset` never loads torch, the dataset writer or the service.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import BivitError, CheckpointError, ConfigError, MediaError

# public name -> module that defines it
_LAZY = {
    "Client": ".serve.client",
    "open_dataset": ".dataset.reader",
    "load_embeddings": ".dataset.embeddings",
    "Record": ".core.records",
    "Encoder": ".core.encoder",
    "EncoderSpec": ".core.spec",
    "ItemResult": ".core.items",
    "VideoFrames": ".core.items",
    "load_encoder": ".core.encoder",
    "load_model": ".integrations.train",
    "TrainableModel": ".integrations.train",
    "MediaBatch": ".media.pixels",
    "image_token_count": ".media.grids",
    "Placeholder": ".media.pixels",
    "ProcessorConfig": ".checkpoint.preprocess_config",
    "VideoChunk": ".media.video",
}

__all__ = ["BivitError", "CheckpointError", "ConfigError", "MediaError", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bivit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
