"""The vLLM integration tests run in the virtual environment `scripts/vllm-env.sh` builds (vLLM pins its own torch
and transformers); elsewhere their modules skip with the reason. The engine fixtures live here; nothing heavy
is imported at collection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# One engine setting for every test: float32, eager, a fixed KV-cache size (vLLM's CPU backend otherwise
# reserves a fraction of the machine's memory and refuses to start when other processes use it).
ENGINE = dict(dtype="float32", max_model_len=4096, max_num_seqs=8, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=256 << 20, enable_prompt_embeds=True, limit_mm_per_prompt={"vision_chunk": 8})


def engine_environment() -> None:
    """vLLM runs the engine core and the worker in their own processes (its default; in one process, numba's
    llvmlite trips vLLM's Triton-override scan). The probes in `vllm_hooks` reach the worker by name."""
    paths = os.environ.get("PYTHONPATH", "")
    if str(HERE) not in paths.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), paths) if p)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # LLM.apply_model sends the probes by pickle


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory):
    from tiny_kimi import write_tiny_kimi

    return write_tiny_kimi(tmp_path_factory.mktemp("tiny_kimi"))


@pytest.fixture(scope="session")
def encoder(tiny_kimi):
    import bivit

    return bivit.load_encoder(str(tiny_kimi), dtype="float32")
