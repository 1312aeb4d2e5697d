"""Fixtures shared by the test modules: real random checkpoints on disk, written once per session."""

import os

# Triton (the GPU path's kernels, tests/test_gpu_triton.py) runs on CPU tensors in its interpreter; it reads this
# when it is imported, so before anything imports it. Nothing else in the suite uses triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from bivit.base import state
from support.checkpoints import K3_SMALL, KIMI_SMALL, write_checkpoint


@pytest.fixture(scope="session")
def kimi_ckpt(tmp_path_factory):
    """A Kimi-shaped (head dim 72) random checkpoint, Moonshot layout, fp32 on disk."""
    return write_checkpoint(tmp_path_factory.mktemp("kimi"), KIMI_SMALL)


@pytest.fixture(scope="session")
def kimi_hf_ckpt(tmp_path_factory):
    """The same weights with a transformers-layout config.json, loadable by the HF port and by bivit."""
    return write_checkpoint(tmp_path_factory.mktemp("kimi_hf"), KIMI_SMALL, layout="hf-config")


@pytest.fixture(scope="session")
def tiny_kimi_ckpt(tmp_path_factory):
    """A whole tiny Kimi-K2.5 checkpoint, published layout: vision tower and projector, a 2-layer DeepSeek-V3
    language model, tokenizer, preprocessing; transformers' Kimi_K25ForConditionalGeneration, bivit and vLLM all
    load it (tests/vllm_engine/tiny_kimi.py)."""
    from vllm_engine.tiny_kimi import write_tiny_kimi

    return write_tiny_kimi(tmp_path_factory.mktemp("tiny_kimi"))


@pytest.fixture(scope="session")
def k3_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("k3"), K3_SMALL)


@pytest.fixture
def fresh_state():
    """bivit's per-process kernel choices, proofs and prepared weights (`bivit.base.state.reset`) forgotten before the
    test and again after it: what the test decides under conditions of its own (a forced kernel, a patched
    PyTorch) neither sees what came before it nor outlives it."""
    state.reset()
    yield
    state.reset()


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
