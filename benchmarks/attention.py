"""Exact per-item attention at Kimi's head dim 72 on this CPU: PyTorch's fused SDPA against the alternatives.

    python benchmarks/attention.py                           # n = 1024 and 3072 patches, bf16 and fp32
    python benchmarks/attention.py --n 3072 --dtype bfloat16 --repeats 5

One item of n patches, 16 heads, [1, heads, n, 72] q/k/v. Variants, each timed interleaved with the others
(median of `--repeats`), each checked against float64 attention (max |error| relative to max |reference|):
* bivit-avx512, bivit-avx2: bivit's compiled attention (`bivit.kernels`), each variant this CPU (and PyTorch's
  dispatch, e.g. under `ATEN_CPU_CAPABILITY=avx2`) can run; `auto` picks the first (not on AMX CPUs).
* sdpa: `F.scaled_dot_product_attention` (PyTorch's fused CPU flash kernel; what bivit runs elsewhere).
* sdpa-pad80/96/128: head dim zero-padded (the scale kept at 1/sqrt(72)); the output sliced back.
* sdpa-bhnd-contig: the same kernel on contiguous [1, heads, n, 72] inputs (bivit passes strided views).
* bmm-fp32: per head-block, scores = q k^T in fp32, softmax, @ v (unfused, exact per item).
* bmm-native: the same in the input dtype (bf16 softmax in fp32 internally).
* flex: `torch.compile(flex_attention)` on CPU, if it compiles here.
All are per item, so all are batch-invariant by construction; the question is only speed and accuracy.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bivit import bench, kernels


def bmm_attention(q, k, v, dtype, block: int = 4):
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for h in range(0, q.shape[1], block):
        qs, ks, vs = (t[0, h:h + block].to(dtype) for t in (q, k, v))
        s = torch.bmm(qs, ks.transpose(1, 2)).mul_(scale)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(dtype)
        out[0, h:h + block] = torch.bmm(p, vs).to(q.dtype)
    return out


def compiled_attention(kernel, q, k, v):
    out = torch.empty_like(q[0].transpose(0, 1))
    kernel(*(t[0].transpose(0, 1) for t in (q, k, v)), out, [q.shape[2]])
    return out.transpose(0, 1)[None]


def padded_sdpa(q, k, v, dim):
    pad = dim - q.shape[-1]
    qp, kp, vp = (F.pad(t, (0, pad)) for t in (q, k, v))
    return F.scaled_dot_product_attention(qp, kp, vp, scale=1 / math.sqrt(q.shape[-1]))[..., :q.shape[-1]]


def main(argv: list[str] | None = None) -> int:
    p = bench.script_args(__doc__.split("\n\n")[0], dtype="both", dtypes=sorted(bench.DTYPE_CHOICES))
    p.add_argument("--n", type=int, nargs="*", default=[1024, 3072])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=72)
    p.add_argument("--no-flex", action="store_true", help="skip torch.compile'd flex_attention")
    args = p.parse_args(argv)
    bench.start(args)
    compiled = {}
    flags, capability = kernels.cpu_info()[1], torch.backends.cpu.get_cpu_capability()
    for variant in kernels.VARIANTS:
        try:
            if kernels.pick_variant(variant.name, flags, capability, kernels.installed()) == variant:
                compiled[f"bivit-{variant.name}"] = kernels.load_library(variant).attention
        except (kernels.KernelUnavailable, OSError) as e:
            print(f"bivit's compiled attention ({variant.name}) unavailable: {e}")
    flex = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"flex_attention unavailable: {type(e).__name__}: {e}")
    print("\n| dtype | n | variant | median ms | GFLOP/s | vs sdpa | max rel. error |")
    print("|---|---:|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for dname in bench.DTYPE_CHOICES[args.dtype]:
            dtype = bench.TORCH_DTYPES[dname]
            for n in args.n:
                packed = torch.randn(n, 3, args.heads, args.head_dim, generator=g).to(dtype)
                q, k, v = (packed[:, i].transpose(0, 1)[None] for i in range(3))  # bivit's strided views
                ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
                variants = {
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
                    "sdpa-bhnd-contig": lambda: F.scaled_dot_product_attention(q.contiguous(), k.contiguous(),
                                                                               v.contiguous()),
                    "sdpa-pad80": lambda: padded_sdpa(q, k, v, 80),
                    "sdpa-pad96": lambda: padded_sdpa(q, k, v, 96),
                    "sdpa-pad128": lambda: padded_sdpa(q, k, v, 128),
                    "bmm-fp32": lambda: bmm_attention(q, k, v, torch.float32),
                }
                for name, kernel in compiled.items():
                    variants[name] = lambda kernel=kernel: compiled_attention(kernel, q, k, v)
                if dtype != torch.float32:
                    variants["bmm-native"] = lambda: bmm_attention(q, k, v, dtype)
                if flex is not None:
                    variants["flex"] = lambda: flex(q.contiguous(), k.contiguous(), v.contiguous())
                times, errors = {}, {}
                for name, fn in list(variants.items()):
                    try:
                        out = fn()  # warm-up (and compilation)
                        errors[name] = float((out.double() - ref).abs().max() / ref.abs().max())
                        times[name] = []
                    except Exception as e:  # noqa: BLE001 - a variant that cannot run here is reported
                        print(f"| {dname} | {n} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | |")
                        del variants[name]
                for r in range(args.repeats):
                    for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                        t0 = time.perf_counter()
                        variants[name]()
                        times[name].append(time.perf_counter() - t0)
                flops = 4 * n * n * args.heads * args.head_dim
                base = statistics.median(times["sdpa"])
                for name in variants:
                    t = statistics.median(times[name])
                    print(f"| {dname} | {n} | {name} | {1e3 * t:.1f} | {flops / t / 1e9:.0f} | {base / t:.2f}x | "
                          f"{errors[name]:.1e} |")
    print(f"\nat the end: {bench.load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
