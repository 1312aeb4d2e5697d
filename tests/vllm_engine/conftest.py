"""The vLLM integration tests run in the virtual environment `scripts/vllm-env.sh` builds (vLLM pins its own torch
and transformers); elsewhere their modules skip with the reason. Nothing heavy is imported at collection."""

from __future__ import annotations

import pytest
from engine_support import DTYPES, cannot_run


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory):
    from tiny_kimi import write_tiny_kimi

    return write_tiny_kimi(tmp_path_factory.mktemp("tiny_kimi"))


@pytest.fixture(scope="session")
def encoders(tiny_kimi):
    """dtype name -> bivit's encoder of the tiny checkpoint with rows in that dtype (loaded once)."""
    import bivit

    loaded = {}

    def get(dtype: str):
        if dtype not in loaded:
            loaded[dtype] = bivit.load_encoder(str(tiny_kimi), dtype=dtype)
        return loaded[dtype]

    return get


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request):
    """The dtype of the language model and of bivit's rows. One engine per dtype and module: pytest runs a
    module's tests for one dtype, tears that engine down, then starts the next."""
    reason = cannot_run(request.param)
    if reason:
        pytest.skip(reason)
    return request.param
