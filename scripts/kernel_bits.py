"""The bits of every compiled kernel on fixed inputs, saved before a change to the kernels and compared after it.

For changes that must not change a bit (how arguments reach the C code, refactors of the sources): every
variant this CPU runs (AVX-512, with and without AMX tiles, and AVX2), attention with and without RoPE and
log-sum-exp at 1 and 2 threads, the RoPE kernel, and every GEMM kernel's packed weights and outputs (each
weight dtype it takes, bias or none, each GELU, fp32 and 16-bit outputs); q, k, v, out, x and y are views with
strides of their own. It uses only the kernels' Python surface, so it runs on the install before and after (each
built with `pip install -e .`, which compiles the kernels into the checkout):

  PYTHONPATH=<old checkout>/src python scripts/kernel_bits.py save /tmp/bits.pt
  PYTHONPATH=src python scripts/kernel_bits.py compare /tmp/bits.pt

`compare` exits 1 and names the results that differ (torch.equal).
"""
import sys
from dataclasses import replace

import torch

from bivit import kernels


def strided(rows, heads, d, pad_row, pad_head, g, dtype):
    base = torch.randn(rows, heads, d + pad_head, generator=g)
    base = torch.cat([base.flatten(1), torch.randn(rows, pad_row, generator=g)], 1).to(dtype)
    return base[:, :heads * (d + pad_head)].view(rows, heads, d + pad_head)[:, :, :d]


def run():
    res = {}
    for variant in kernels.VARIANTS:
        try:
            kernels.pick_variant(variant.name, kernels.cpu_info()[1], torch.backends.cpu.get_cpu_capability(),
                                 kernels.installed())
        except kernels.KernelUnavailable:
            continue
        lib = kernels.load_library(variant)
        attns = [lib.attention] + ([replace(lib.attention, amx=False)] if lib.attention.amx else [])
        for dtype in (torch.bfloat16, torch.float32):
            for att in attns:
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    g = torch.Generator().manual_seed(1)
                    lens = [64, 300, 7, 0, 130]
                    L, H, d = sum(lens), 4, 72
                    q = strided(L, H, d, 5, 3, g, dtype)
                    k = strided(L, H, d, 11, 1, g, dtype)
                    v = strided(L, H, d, 0, 7, g, dtype)
                    out = strided(L, H, d, 2, 2, g, dtype).zero_()
                    lse = torch.zeros(H * L)
                    cos, sin = torch.randn(2, L, d, generator=g).unbind(0)
                    att(q, k, v, out, lens, lse)
                    res[f"attn/{variant.name}/{att.name_for(dtype)}/{dtype}/t{threads}"] = (out.clone(), lse.clone())
                    out.zero_(); lse.zero_()
                    att(q, k, v, out, lens, lse, rope=(cos.contiguous(), sin.contiguous()))
                    res[f"attn-rope/{variant.name}/{att.name_for(dtype)}/{dtype}/t{threads}"] = (out.clone(), lse.clone())
            torch.set_num_threads(2)
            g = torch.Generator().manual_seed(2)
            x = strided(300, 1, 72, 9, 0, g, dtype)[:, 0]
            cos, sin = torch.randn(2, 300, 72, generator=g).unbind(0)
            xr = strided(300, 3, 72, 4, 2, g, dtype)
            o = torch.zeros(300, 3, 72, dtype=dtype)
            lib.rope(xr, cos.contiguous(), sin.contiguous(), o)
            res[f"rope/{variant.name}/{dtype}"] = o.clone()
            for gk in lib.gemms:
                for wdt in (torch.bfloat16, torch.float32, torch.float16):
                    if not gk.takes(wdt):
                        continue
                    g = torch.Generator().manual_seed(3)
                    m, n, kk = 67, 130, 200
                    w = torch.randn(n, kk + 8, generator=g).to(wdt)[:, :kk]
                    xx = torch.randn(m, kk + 5, generator=g).to(wdt)[:, :kk]
                    bias = torch.randn(n, generator=g)
                    packed = gk.pack(w)
                    for gelu in (None, "tanh", "erf"):
                        for odt in (torch.float32, wdt):
                            y = torch.zeros(m, n + 3, dtype=odt)[:, :n]
                            gk(xx, packed, n, bias, y, gelu=gelu)
                            res[f"gemm/{variant.name}/{gk.name}/{wdt}/{gelu}/{odt}"] = (packed.clone(), y.clone())
                    y = torch.zeros(m, n)
                    gk(xx, packed, n, None, y)
                    res[f"gemm-nobias/{variant.name}/{gk.name}/{wdt}"] = y.clone()
    return res


def flat(v):
    return v if isinstance(v, tuple) else (v,)


if __name__ == "__main__":
    cmd, path = sys.argv[1], sys.argv[2]
    res = run()
    if cmd == "save":
        torch.save(res, path)
        print(f"saved {len(res)} results")
    else:
        before = torch.load(path)
        assert set(before) == set(res), set(before) ^ set(res)
        bad = [k for k in res if not all(torch.equal(a, b) for a, b in zip(flat(before[k]), flat(res[k])))]
        nonzero = sum(bool(t.abs().sum() > 0) for k in res for t in flat(res[k]) if t.is_floating_point())
        print(f"{len(res)} results compared, {len(res) - len(bad)} bit-identical, {nonzero} non-zero tensors; differ: {bad}")
        sys.exit(1 if bad else 0)
