"""The compiled kernels' variants this CPU runs: what the kernel tests parametrise over (each test names the
variants it is for and skips, with the reason, where the CPU or PyTorch's dispatch does not run one)."""

from __future__ import annotations

import pytest
import torch

from bivit import kernels

FLAGS = kernels.cpu_info()[1]
CAPABILITY = torch.backends.cpu.get_cpu_capability()


def runs_here(variant: kernels.Variant) -> bool:
    """Whether this CPU and PyTorch's dispatch run `variant` (an install without it fails `library_or_skip`)."""
    try:
        kernels.pick_variant(variant.name, FLAGS, CAPABILITY, frozenset({variant.name}))
    except kernels.KernelUnavailable:
        return False
    return True


RUNNABLE = [v for v in kernels.VARIANTS if runs_here(v)]


def library_or_skip(name: str) -> kernels.Library:
    """The variant `name`, loaded directly (a CPU that can run it must get it: an install without it fails the
    test), or a skip naming why it does not run here."""
    variant = next(v for v in kernels.VARIANTS if v.name == name)
    if not runs_here(variant):
        pytest.skip(f"the {variant.name} variant does not run here (CPU flags / PyTorch capability {CAPABILITY})")
    return kernels.load_library(variant)
