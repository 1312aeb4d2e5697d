"""The vLLM integration tests run in the virtual environment `scripts/vllm-env.sh` builds (vLLM pins its own torch
and transformers); elsewhere their modules skip with the reason. Nothing heavy is imported at collection."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory):
    from tiny_kimi import write_tiny_kimi

    return write_tiny_kimi(tmp_path_factory.mktemp("tiny_kimi"))


@pytest.fixture(scope="session")
def encoder(tiny_kimi):
    import bivit

    return bivit.load_encoder(str(tiny_kimi), dtype="float32")
