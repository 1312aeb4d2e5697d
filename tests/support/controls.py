"""Controls: ways to show that an invariance check can fail on the machine it runs on."""

import contextlib

import torch

from bivit.diagnose.verify import encode_cut
from bivit.media.pixels import MediaBatch


@contextlib.contextmanager
def row_count_dependent_gemms():
    """Stock `F.linear`, except that the K reduction is split into partial GEMMs whose number depends on the
    row count (1, 2 or 3 parts for M mod 3); the partials, in the input dtype, are added in float32.

    That is what library GEMMs do (they pick kernels and reduction orders by shape), made deliberate so that
    it happens on every CPU: stock kernels differ by row count on some machines and dtypes (fp32 everywhere
    we have run; bf16 on AVX-512 EPYC) but not on others (bf16 on AMX Xeon), and a control must show the
    check can fail on the machine it runs on. Invariant mode never calls `F.linear` at a batch-dependent row
    count, so it stays bit-stable under this GEMM too.
    """
    stock = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        parts = 1 + x.reshape(-1, x.shape[-1]).shape[0] % 3
        acc = sum(stock(xs, ws).float() for xs, ws in zip(x.tensor_split(parts, dim=-1),
                                                          weight.tensor_split(parts, dim=-1)))
        return (acc if bias is None else acc + bias.float()).to(x.dtype)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = stock


def differing(enc, items: list[MediaBatch], order: list[int], budget: int | None = None) -> list[int]:
    """Indices (into `items`) whose embedding, encoded in one call in `order` (micro-batched by `budget`), differs
    from the item encoded alone."""
    alone = [enc.encode_batch(it)[0] for it in items]
    batched = encode_cut(enc, MediaBatch.concat([items[i] for i in order]), budget)
    return [i for i, out in zip(order, batched) if not torch.equal(out, alone[i])]


def differences_found_by_check(enc, items: list[MediaBatch], order: list[int], budget: int | None = None) -> list[int]:
    """The control of `differing`: on a default-mode encoder it finds items that change with their batch.

    First with stock kernels; where those happen to be row-count invariant on this CPU at these shapes,
    with `row_count_dependent_gemms` — either way a non-empty list proves the check can fail here.
    """
    found = differing(enc, items, order, budget)
    if not found:
        with row_count_dependent_gemms():
            found = differing(enc, items, order, budget)
    return found
