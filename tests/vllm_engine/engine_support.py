"""What every vLLM test engine shares: the engine settings, the environment its processes need, and the test
prompts' chat framing."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
# float32, eager, a fixed KV-cache size (vLLM's CPU backend otherwise reserves a fraction of the machine's
# memory and refuses to start while other processes use it), prompt embeddings on.
ENGINE = dict(dtype="float32", max_model_len=4096, max_num_seqs=8, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=256 << 20, enable_prompt_embeds=True, limit_mm_per_prompt={"vision_chunk": 8})
USER, ASSISTANT = "<|im_user|>user<|im_middle|>", "<|im_end|><|im_assistant|>assistant<|im_middle|>"


def engine_environment() -> None:
    """vLLM runs the engine core and the worker in their own processes (its default; in one process, numba's
    llvmlite, which vLLM's Kimi image processor imports, trips vLLM's Triton-override scan of sys.modules). The
    probes in `vllm_hooks` reach the worker by module name, so this folder goes on PYTHONPATH."""
    paths = os.environ.get("PYTHONPATH", "")
    if str(HERE) not in paths.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), paths) if p)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # LLM.apply_model sends the probes by pickle
    # Tests never reach the network: no usage report to vLLM's collector, no hub look-ups.
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
