"""Fixtures shared by the test modules: real random checkpoints on disk, written once per session."""

import pytest
import torch

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
def k3_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("k3"), K3_SMALL)


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
