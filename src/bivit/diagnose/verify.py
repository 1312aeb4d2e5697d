"""The invariance verifier behind `bivit verify`: does an item's embedding depend on its batch?

Every item is encoded alone (the reference), then inside several random batch layouts (other items around
it, random order, random micro-batch budgets), in invariant and default mode side by side. `bisect` names
the first op whose output for an item differs between bs=1 and bs=N, by tracing the op layer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image

from ..base.fileio import write_atomic
from ..core.encoder import Encoder
from ..core.packing import pack
from ..errors import BivitError
from ..media.pixels import MediaBatch
from .divergence import OpDiff, first_difference

# Sizes chosen to make 1, 2, 3, 4, 6 ... merged tokens: the row counts where stock GEMMs change kernels.
SYNTHETIC_SIZES = [(28, 28), (56, 28), (84, 28), (56, 56), (84, 56), (140, 112), (224, 168), (280, 252)]


def synthetic_images(seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB") for w, h in SYNTHETIC_SIZES]


@dataclass
class ItemReport:
    source: str
    tokens: int
    max_diff: float = 0.0  # max |batched - alone| over every layout tried
    layouts: int = 0

    @property
    def bit_equal(self) -> bool:
        return self.max_diff == 0.0


@dataclass
class Report:
    mode: str
    items: list[ItemReport] = field(default_factory=list)

    @property
    def stable(self) -> bool:
        return all(i.bit_equal for i in self.items)


def items_of(encoder: Encoder, inputs: list, names: list[str] | None = None,
             skip: Callable[[BivitError], None] | None = None) -> MediaBatch:
    """The model's items (each image, each video chunk) of `inputs`, packed, named by their inputs. A bad input
    raises, or with `skip` is handed to it and left out (None when none is left)."""
    names = names or [None] * len(inputs)
    batches = []
    for x, n in zip(inputs, names):
        try:
            batches.append(encoder.prepare(x, name=n).checked().batch)
        except BivitError as e:
            if skip is None:
                raise
            skip(e)
    return MediaBatch.concat(batches) if batches else None


def encode_cut(encoder: Encoder, batch: MediaBatch, budget: int | None) -> list[torch.Tensor]:
    """Encode `batch` cut into passes of at most `budget` patches by the packing rule (None: the whole batch in
    one pass), whatever the encoder's own budget: the verifier's job is to try cuts."""
    counts = batch.patch_counts
    out: list[torch.Tensor] = []
    for items in pack(counts, budget or max(1, sum(counts))):
        out += encoder.forward(MediaBatch.concat([batch.item(i) for i in items]))
    return out


def random_layouts(n: int, count: int, rng: random.Random, patch_counts: list[int]) -> list[tuple[list[int], int | None]]:
    """`count` (order, budget) pairs: permutations of all items plus random subsets, with random budgets."""
    total = sum(patch_counts)
    layouts: list[tuple[list[int], int | None]] = [(list(range(n)), None), (list(reversed(range(n))), None)]
    while len(layouts) < count:
        order = list(range(n))
        rng.shuffle(order)
        if rng.random() < 0.5 and n > 2:
            order = order[: rng.randint(2, n)]
        budget = rng.choice([None, rng.randint(1, max(1, total)), max(patch_counts)])
        layouts.append((order, budget))
    return layouts[:count]


def check(encoder: Encoder, batch: MediaBatch, layouts: list[tuple[list[int], int | None]]) -> Report:
    n = len(batch)
    alone = [encoder.encode_batch(batch.item(i))[0] for i in range(n)]
    sources = batch.sources or [f"item{i}" for i in range(n)]
    report = Report("invariant" if encoder.batch_invariant else "default",
                    [ItemReport(sources[i], int(alone[i].shape[0])) for i in range(n)])
    for order, budget in layouts:
        outs = encode_cut(encoder, MediaBatch.concat([batch.item(i) for i in order]), budget)
        for i, out in zip(order, outs):
            diff = float((out.float() - alone[i].float()).abs().max()) if out.numel() else 0.0
            if not torch.equal(out, alone[i]) and diff == 0.0:
                diff = float("nan")  # same values, different bits (e.g. -0.0 vs 0.0 or NaN payloads)
            item = report.items[i]
            item.max_diff = max(item.max_diff, diff) if not np.isnan(diff) else diff
            item.layouts += 1
    return report


# ------------------------------------------------------------------------------------------------ bisect

def bisect_report(encoder: Encoder, batch: MediaBatch, report: Report, also: Report | None = None
                  ) -> tuple[int, OpDiff | None]:
    """(needle, first op that differs for it) for the item that differs most in `report` (else the one that
    differs most in `also`, e.g. default mode's, so invariant mode is bisected on the same item; else item 0).
    Items that differ are tried largest difference first until one differs when placed first in the full batch."""
    def differing(rep: Report | None) -> list[int]:
        if rep is None:
            return []
        ranked = [i for i, it in enumerate(rep.items) if not it.bit_equal]
        return sorted(ranked, key=lambda i: -np.nan_to_num(rep.items[i].max_diff, nan=np.inf))

    candidates = differing(report) or differing(also)[:1] or [0]
    for needle in candidates:
        diff = bisect(encoder, batch, needle)
        if diff is not None:
            return needle, diff
    return candidates[0], None


def bisect(encoder: Encoder, batch: MediaBatch, needle: int = 0) -> OpDiff | None:
    """First op whose output for item `needle` differs between encoding it alone and first in a full batch.

    The needle goes first in the batch, so its rows are the leading rows of every op's output in both runs.
    Ops are matched by (module path, op kind, occurrence); per-item ops (the temporal mean) occur once per
    item, and the needle's is the first.
    """
    others = [batch.item(i) for i in range(len(batch)) if i != needle]
    return first_difference(encoder.model, lambda: encode_cut(encoder, batch.item(needle), None),
                            lambda: encode_cut(encoder, MediaBatch.concat([batch.item(needle), *others]), None))


# -------------------------------------------------------------------------------------------------- plot

def plot(reports: list[Report], path: str) -> None:
    # optional (the plot extra); a Figure of its own draws with no pyplot, no backend, no display
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6, len(reports[0].items) * 0.8), 4))
    ax = fig.subplots()
    width = 0.8 / len(reports)
    for j, rep in enumerate(reports):
        xs = [i + j * width for i in range(len(rep.items))]
        ys = [it.max_diff if it.max_diff > 0 else 1e-12 for it in rep.items]
        ax.bar(xs, ys, width=width, label=f"{rep.mode} mode")
        for x, it in zip(xs, rep.items):
            if it.bit_equal:
                ax.text(x, 1.5e-12, "=", ha="center", va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylim(1e-12, None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(reports[0].items))])
    ax.set_xticklabels([f"{it.source}\n{it.tokens} tok" for it in reports[0].items], rotation=45, ha="right",
                       fontsize=7)
    ax.set_ylabel("max |batched - alone| (\"=\": bit-identical)")
    ax.set_title("bivit verify: per-item difference, batched vs alone")
    ax.legend()
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def format_report(rep: Report) -> Iterator[str]:
    for it in rep.items:
        verdict = "bit-identical" if it.bit_equal else f"DIFFERS max |diff| = {it.max_diff:.3g}"
        tokens = "token " if it.tokens == 1 else "tokens"  # padded: the verdicts stay in one column
        layouts = "layout" if it.layouts == 1 else "layouts"
        yield f"  {it.source:<40} {it.tokens:>5} {tokens}  {verdict}  ({it.layouts} {layouts})"
