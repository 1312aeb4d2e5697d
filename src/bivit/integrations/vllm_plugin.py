"""bivit's vLLM general plugin: the entry point `bivit` in group `vllm.general_plugins` (pyproject.toml) names
`register`, which vLLM calls in each of its processes at start.

It registers one architecture, `ARCHITECTURE`: vLLM's own Kimi-K2.5 model whose media path runs bivit's encoder
(`bivit.integrations.vllm_model`, docs/vllm.md). A user selects it per engine:

    LLM(ckpt, hf_overrides={"architectures": ["BivitKimiK25ForConditionalGeneration"]})
    python -m vllm.entrypoints.openai.api_server --model CKPT \\
        --hf-overrides '{"architectures": ["BivitKimiK25ForConditionalGeneration"]}'

`register` only names the class (vLLM imports it when a model selects it, `<module>:<class>`), so installing
bivit changes nothing for an engine that does not select it: no vLLM model module imported, no other
architecture touched.
"""

from __future__ import annotations

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "OPTIONS_KEY", "register"]

ARCHITECTURE = "BivitKimiK25ForConditionalGeneration"
MODEL_CLASS = "bivit.integrations.vllm_model:BivitKimiK25ForConditionalGeneration"
# The config key (set with hf_overrides) holding the plugin's options: {"dtype": tower, "projector_dtype": ...}.
OPTIONS_KEY = "bivit"


def register() -> None:
    # vLLM calls this from its own processes: vLLM is there, and is no dependency of bivit's
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
