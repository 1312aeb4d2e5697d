"""What the benchmarks that time in this very process share: their `--repeats`, `--seed` and `--threads`
options, and `--threads` applied to this process once parsed (the ones that spawn workers pass it on instead)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch


def add_options(p: argparse.ArgumentParser, repeats: int) -> None:
    p.add_argument("--repeats", type=int, default=repeats, help="interleaved timed rounds")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 makes a shared machine's ratios less noisy")


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args
