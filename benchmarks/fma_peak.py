"""The arithmetic peak of one core: what no GEMM on this CPU can exceed.

    python benchmarks/fma_peak.py                 # every instruction this CPU has, 1 thread
    python benchmarks/fma_peak.py --seconds 2     # longer runs per instruction

Compiles (system C compiler, as bivit's kernels) and runs a loop of independent multiply-adds that keeps every
FMA pipe busy and touches no memory: independent accumulators (24 in the 32 AVX-512 registers, 12 in the
16 AVX2 ones: more than latency x pipes) of AVX-512 BF16 pair dot products
(`vdpbf16ps`: 64 FLOPs each, what oneDNN's bf16 GEMM runs on CPUs with AVX-512 BF16 but no AMX), AVX-512 fp32
FMAs (32 FLOPs) and AVX2 fp32 FMAs (16 FLOPs), each where the CPU has it. Prints GFLOP/s per core. Compare with
`bivit bench`'s "machine rates": a GEMM at 90-95% of this is at the limit of the hardware, and a case whose
GEMM FLOPs alone take t seconds at this rate cannot run in less than t, whatever the implementation.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from bivit import bench
from bivit.kernels import cpu_info

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define LOOP(TYPE, ZERO, OP, FLOPS)                                                   \
    TYPE acc[ACC]; for (int i = 0; i < ACC; i++) acc[i] = ZERO;                          \
    double t0 = now(), t = 0; long n = 0;                                               \
    do { for (long it = 0; it < 1000000; it++) {                                       \
             _Pragma("GCC unroll 24") for (int i = 0; i < ACC; i++) acc[i] = OP;          \
             __asm__ volatile("" : "+v"(b)); }                                           \
         n += 1000000; t = now() - t0; } while (t < seconds);                           \
    float sink = 0; for (int i = 0; i < ACC; i++) sink += ((float *)&acc[i])[0];        \
    printf("%.1f %g\n", n * (double)ACC * FLOPS / t / 1e9, sink);
int main(int argc, char **argv) {
    double seconds = atof(argv[2]);
#if defined(WANT_BF16)
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = a;
    LOOP(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(acc[i], a, b), 64)
#elif defined(WANT_512)
    __m512 a = _mm512_set1_ps(1e-9f), b = a;
    LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(a, b, acc[i]), 32)
#else
    __m256 a = _mm256_set1_ps(1e-9f), b = a;
    LOOP(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(a, b, acc[i]), 16)
#endif
    (void)argc; return 0;
}
"""

KINDS = (("AVX-512 BF16 vdpbf16ps (bf16 pairs)", "avx512_bf16", ["-DWANT_BF16", "-DACC=24", "-mavx512f", "-mavx512bf16"]),
         ("AVX-512 fp32 FMA", "avx512f", ["-DWANT_512", "-DACC=24", "-mavx512f"]),
         ("AVX2 fp32 FMA", "fma", ["-DACC=12", "-mavx2", "-mfma"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("fma_peak.py: needs a C compiler (cc or gcc)")
    model, flags = cpu_info()
    print("$", bench.command_line())
    print(f"CPU {model}; {bench.load_line()}")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "peak.c"
        src.write_text(SOURCE)
        for name, flag, cflags in KINDS:
            if flag not in flags:
                print(f"{name}: not on this CPU")
                continue
            exe = Path(tmp) / f"peak-{flag}"
            subprocess.run([cc, "-O2", *cflags, str(src), "-o", str(exe)], check=True)
            rate = float(subprocess.run([str(exe), "x", str(args.seconds)], capture_output=True, text=True,
                                        check=True).stdout.split()[0])
            print(f"{name}: {rate:.0f} GFLOP/s per core")


if __name__ == "__main__":
    main()
