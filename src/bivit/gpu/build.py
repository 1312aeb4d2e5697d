"""Compile every kernel of the invariant GPU path for a GPU architecture, without a GPU: `python -m bivit.gpu.build
[--arch 90] [--json]` (sm_90a = H100/H200). Proves here that what runs there builds for it (and shows which
instructions it builds to: wgmma for the 16-bit GEMM and attention). Must run without TRITON_INTERPRET.

The variants compiled are the ones a Kimi forward launches: the GEMM in bf16/fp16/fp32 with and without bias,
each GELU and the fused residual add; LayerNorm and RMSNorm at the tower and projector widths; the rotary
embedding; attention at head dims 72 (Kimi-K2.x) and 64; the temporal mean.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def variants(dtypes=tuple(_TY)) -> list[tuple[str, object, dict, dict, object]]:
    """(label, kernel, signature, constexprs, launch tiles) of every variant to compile, in `dtypes`."""
    import triton

    from . import kernels as K
    from . import ops

    out = []
    for dtype in dtypes:
        ty = _TY[dtype]
        t = ops.gemm_tiles(dtype)
        for has_bias, gelu, residual in ((True, K.GELU_NONE, False), (True, K.GELU_TANH, False),
                                         (True, K.GELU_ERF, False), (True, K.GELU_NONE, True),
                                         (False, K.GELU_ERF, False), (False, K.GELU_NONE, True)):
            sig = {"x_ptr": f"*{ty}", "w_ptr": f"*{ty}", "b_ptr": f"*{ty}", "r_ptr": f"*{ty}", "y_ptr": f"*{ty}",
                   "M": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "stride_w": "i32", "stride_y": "i32"}
            const = dict(HAS_BIAS=has_bias, GELU=gelu, RESIDUAL=residual, PRECISION=ops.PRECISION,
                         BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k)
            out.append((f"gemm {ty} bias={has_bias} gelu={gelu} residual={residual}", K.gemm_kernel, sig, const,
                        t))
        for n, rms in ((1152, False), (1152, True), (288, False)):
            sig = {"x_ptr": f"*{ty}", "w_ptr": f"*{ty}", "b_ptr": f"*{ty}", "y_ptr": f"*{ty}", "M": "i32",
                   "N": "i32", "stride_x": "i32", "eps": "fp32"}
            const = dict(RMS=rms, HAS_WEIGHT=True, HAS_BIAS=not rms, BLOCK_N=triton.next_power_of_2(n))
            out.append((f"norm {ty} n={n} rms={rms}", K.norm_kernel, sig, const, None))
        for d in (72, 64):
            sig = {"x_ptr": f"*{ty}", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": f"*{ty}", "L": "i32",
                   "SLOTS": "i32", "D": "i32", "stride_row": "i32", "stride_slot": "i32"}
            out.append((f"rope {ty} d={d}", K.rope_kernel, sig,
                        dict(BLOCK_R=ops.ROPE_ROWS, BLOCK_D=triton.next_power_of_2(d)), None))
            a = ops.attention_tiles(d)
            sig = {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "o_ptr": f"*{ty}", "table_ptr": "*i32",
                   "D": "i32", "stride_q": "i32", "stride_k": "i32", "stride_v": "i32", "stride_o": "i32",
                   "scale": "fp32"}
            out.append((f"attention {ty} d={d}", K.attention_kernel, sig,
                        dict(PRECISION=ops.PRECISION, BLOCK_M=a.block_m, BLOCK_N=a.block_n, BLOCK_D=a.block_k), a))
        sig = {"x_ptr": f"*{ty}", "y_ptr": f"*{ty}", "T": "i32", "E": "i32"}
        out.append((f"frame_mean {ty}", K.frame_mean_kernel, sig, dict(BLOCK=ops.MEAN_BLOCK), None))
    return out


def compile_all(arch: int = 90, dtypes=tuple(_TY)) -> list[dict]:
    """Compile every variant for CUDA compute capability `arch` -> one record per variant: label, whether
    the PTX uses wgmma, the PTX target line and the cubin's size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import interpreting, ops

    if interpreting():
        raise RuntimeError("bivit.gpu.build compiles kernels: run it without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", arch, 32)
    records = []
    for label, kernel, sig, const, tiles in variants(dtypes):
        sig = dict(sig, **{k: "constexpr" for k in const})
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                   if name in sig and (sig[name].startswith("*") or name.startswith("stride") or name in ("N", "K", "D"))}
        options = {"enable_fp_fusion": ops.FP_FUSION}
        if tiles is not None:
            options.update(num_warps=tiles.warps, num_stages=tiles.stages)
        start = time.monotonic()
        compiled = triton.compile(ASTSource(kernel, sig, const, aligned), target=target, options=options)
        ptx = compiled.asm["ptx"]
        records.append({"kernel": label, "wgmma": "wgmma" in ptx,
                        "target": next((ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".target")), ""),
                        "cubin_bytes": len(compiled.asm["cubin"]), "seconds": round(time.monotonic() - start, 2)})
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bivit.gpu.build", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90 = sm_90a)")
    parser.add_argument("--dtype", choices=[str(d).removeprefix("torch.") for d in _TY], action="append",
                        help="only the variants of this dtype (repeatable; default: all)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtype] if args.dtype else list(_TY)
    records = compile_all(args.arch, dtypes)
    if args.json:
        print(json.dumps(records))
    else:
        for r in records:
            print(f"{r['kernel']:<45} {r['target']:<8} wgmma={str(r['wgmma']):<5} cubin={r['cubin_bytes']:>7} B "
                  f"{r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
