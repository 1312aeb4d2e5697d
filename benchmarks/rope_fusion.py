"""RoPE fused into bivit's compiled attention against RoPE as its own pass, on the forward's q/k/v layout.

    python benchmarks/rope_fusion.py                       # 32 items of 64 patches, 1 x 1024, 1 x 3072
    python benchmarks/rope_fusion.py --threads 1 --repeats 60

Per layout, the same q/k/v (strided views of one `[L, 3, heads, 72]` tensor, as the model passes them) and the
model's RoPE tables, two ways, interleaved round by round, with the caches evicted before every call (in a
forward the GEMMs between two attention calls do that): "separate" = the RoPE kernel writes rotated q and k,
then the attention kernel reads them (bivit before the fusion, and what runs beside PyTorch's attention);
"fused" = the attention kernel rotates q and k as it packs them (`Attention(..., rope=)`, what `ops.attention`
runs). Both give the same bits (checked here with `torch.equal` before timing). Medians; one run, one machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bivit import bench, kernels
from bivit.ops import rope_tables

LAYOUTS = {"32x64": (32, 8, 8), "1x1024": (1, 32, 32), "1x3072": (1, 48, 64)}  # items, grid h, grid w


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], repeats=30)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=72)
    args = p.parse_args(argv)
    bench.start(args)
    library = kernels.library()
    if library is None:
        print("bivit's compiled kernels do not run here (`bivit doctor` says why): nothing to compare")
        return 1
    dtype = bench.TORCH_DTYPES[args.dtype]
    evict = torch.empty(64 << 20, dtype=torch.uint8)  # twice this machine's L3
    g = torch.Generator().manual_seed(args.seed)
    print(f"\nattention variant: {library.variant}, {args.dtype}, {torch.get_num_threads()} threads\n")
    print("| layout | separate: RoPE + attention ms | fused ms | fused / separate | same bits |")
    print("|---|---:|---:|---:|---|")
    for name in args.layouts:
        items, h, w = LAYOUTS[name]
        n = h * w
        rows, heads, d = items * n, args.heads, args.head_dim
        cos, sin = rope_tables([(1, h, w)] * items, d, 10000.0)
        qkv = torch.randn(rows, 3, heads, d, generator=g).to(dtype)
        q, k, v = qkv.unbind(1)
        qk = torch.empty(rows, 2, heads, d, dtype=dtype)
        out = torch.empty(rows, heads, d, dtype=dtype)

        def separate():
            library.rope(qkv[:, :2].view(rows, 2 * heads, d), cos, sin, qk.view(rows, 2 * heads, d))
            library.attention(qk[:, 0], qk[:, 1], v, out, [n] * items)

        def fused():
            library.attention(q, k, v, out, [n] * items, rope=(cos, sin))

        separate()
        expected = out.clone()
        fused()
        same = torch.equal(out, expected)
        times = {separate: [], fused: []}
        for r in range(args.repeats):
            for fn in ((separate, fused) if r % 2 == 0 else (fused, separate)):
                evict.add_(1)
                t0 = time.perf_counter()
                fn()
                times[fn].append(time.perf_counter() - t0)
        a, b = statistics.median(times[separate]), statistics.median(times[fused])
        print(f"| {items} x {n} | {1e3 * a:.2f} | {1e3 * b:.2f} | {b / a:.3f} | {'yes' if same else 'NO'} |")
    print(f"\nat the end: {bench.load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
