"""The vLLM integration tests run in the virtual environment `scripts/vllm-env.sh` builds (vLLM pins its own torch
and transformers); elsewhere their modules skip with the reason. vLLM itself is imported only by the test modules
(after their importorskip) and inside the helpers that need it."""

from __future__ import annotations

import pytest
from engine_support import DTYPES, cannot_run, ec_engine
from tiny_kimi import write_tiny_kimi

import bivit


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory):
    return write_tiny_kimi(tmp_path_factory.mktemp("tiny_kimi"))


@pytest.fixture(scope="session")
def encoders(tiny_kimi):
    """dtype name -> bivit's encoder of the tiny checkpoint with rows in that dtype (loaded once)."""
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


@pytest.fixture(scope="module")
def ec_dir(tmp_path_factory, dtype):
    """The module's encoder-cache folder (the engine's, and bivit's files for it)."""
    return tmp_path_factory.mktemp(f"ec-{dtype}")


@pytest.fixture(scope="module")
def llm(tiny_kimi, ec_dir, dtype):
    """The module's engine of the tiny checkpoint in `dtype` (`ec_engine`: encoder-cache producer and consumer on
    `ec_dir`)."""
    with ec_engine(tiny_kimi, ec_dir, dtype) as engine:
        yield engine
