/* bivit-arith/1 in plain C: the scalar definitions every kernel computes (docs/arithmetic.md is the text).
 *
 * Every variant's library includes this file. The portable variant (portable.c) is built from these functions
 * alone; the vector variants compute the same operations in the same order with their own instructions, and the
 * load-time conformance check (`bivit.ops.bits`) holds each of them to this file's bits. Compiled with
 * -ffp-contract=off and without -ffast-math: every `*` and `+` written apart is rounded apart, every fused
 * multiply-add is an explicit fmaf, and nothing is reassociated.
 *
 * Denormals (the "flush mode" of bf16): a bf16 product is exact in fp32, but the instructions that multiply bf16
 * pairs (vdpbf16ps; AMX's tdpbf16ps) read denormal inputs as zero and flush denormal results to zero whatever
 * the thread's MXCSR says. So every fp32 operation of a bf16 GEMM or bf16 attention runs flushed (x86: MXCSR
 * DAZ + FTZ; AArch64: FPCR.FZ), and every fp32 or fp16 computation, and every norm, runs IEEE (denormals kept):
 * `fp_enter` sets the mode a call needs on the calling thread, whatever the process set before
 * (torch.set_flush_denormal), and `fp_leave` restores it. On other architectures (no such switch here) bf16 runs
 * IEEE: its bits then differ wherever a denormal arises, which in practice is nowhere.
 */
#ifndef BIVIT_ARITH_H
#define BIVIT_ARITH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define MXCSR_DAZ 0x0040u
#define MXCSR_FTZ 0x8000u

typedef struct {
    uint64_t saved;
} fp_state;

/* Set this thread's denormal mode for a call: flushed (`flush` != 0) or IEEE. */
static inline fp_state fp_enter(int flush) {
    fp_state s = {0};
#if defined(__x86_64__) || defined(__i386__)
    const unsigned csr = _mm_getcsr();
    s.saved = csr;
    _mm_setcsr(flush ? (csr | MXCSR_DAZ | MXCSR_FTZ) : (csr & ~(MXCSR_DAZ | MXCSR_FTZ)));
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    s.saved = fpcr;
    fpcr = flush ? (fpcr | (1ull << 24)) : (fpcr & ~(1ull << 24));
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#else
    (void)flush;
#endif
    return s;
}

/* Switch this thread's mode inside a region fp_enter opened (fp_leave restores what was there before it). */
static inline void fp_set(int flush) { (void)fp_enter(flush); }

static inline void fp_leave(fp_state s) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr((unsigned)s.saved);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(s.saved));
#else
    (void)s;
#endif
}

static inline float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* bf16 -> fp32, exact. */
static inline float bf16_to_f32(uint16_t b) { return f32_of_bits((uint32_t)b << 16); }

/* fp32 -> bf16 to nearest even; any NaN -> 0x7FC0 (as c10::BFloat16 rounds). */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = bits_of_f32(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE binary16 -> fp32, exact (what F16C's vcvtph2ps computes). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1F) return f32_of_bits(sign | 0x7F800000u | (man << 13));  /* inf, NaN (payload kept) */
    if (exp) return f32_of_bits(sign | ((exp + 112u) << 23) | (man << 13));
    const float m = (float)man * 5.9604644775390625e-08f;  /* 2^-24: exact (man < 2^10) */
    return sign ? -m : m;
}

/* fp32 -> IEEE binary16 to nearest even, overflow to infinity, NaN quieted with its payload's top bits (what
 * F16C's vcvtps2ph computes with _MM_FROUND_TO_NEAREST_INT, IEEE mode). */
static inline uint16_t f32_to_f16(float f) {
    const uint32_t u = bits_of_f32(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  /* rounds to >= 65520: infinity */
    if (a < 0x38800000u) {  /* below 2^-14: a half denormal (or zero), one rounding at 2^-24 */
        const int shift = 126 - (int)(a >> 23);  /* mantissa (with its hidden bit) >> shift = multiples of 2^-24 */
        if (shift > 24) return (uint16_t)sign;   /* below 2^-25: rounds to zero */
        const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
        const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        return (uint16_t)(sign | (q + (rem > half || (rem == half && (q & 1)))));
    }
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);  /* to nearest even at bit 13 */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

/* Element types (of GEMM inputs, weights and outputs, norm rows): a product of two bf16 or two fp16 values is exact
 * in fp32, so kernels that widen them compute the products a native 16-bit GEMM with fp32 accumulation computes. */
enum { E_F32 = 0, E_BF16 = 1, E_F16 = 2 };

static inline size_t esize_of(int et) { return et == E_F32 ? 4 : 2; }

/* Element c of a row of type et as a float, exactly. */
static inline __attribute__((always_inline)) float elem_load(const void *row, int64_t c, const int et) {
    if (et == E_F32) return ((const float *)row)[c];
    const uint16_t h = ((const uint16_t *)row)[c];
    return et == E_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* v rounded to type et (to nearest even) as element c of a row. */
static inline __attribute__((always_inline)) void elem_store(void *row, int64_t c, const int et, float v) {
    if (et == E_F32) ((float *)row)[c] = v;
    else ((uint16_t *)row)[c] = et == E_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
}

/* 2^x for x <= 0: x clamped at -126 (a NaN too), n = x rounded to nearest even, f = x - n in [-0.5, 0.5],
 * 2^f by the degree-7 polynomial below (Horner, fused multiply-adds), times 2^n (n >= -126: a normal power of
 * two, so the product is rounded once and, since 2^f >= 2^-0.5, never denormal). Every vector variant's
 * exp2_neg computes these bits. */
#define EXP2_C7 1.5252733804059841e-05f
#define EXP2_C6 1.5403530393381606e-04f
#define EXP2_C5 1.3333558146428443e-03f
#define EXP2_C4 9.6181291076284772e-03f
#define EXP2_C3 5.5504108664821580e-02f
#define EXP2_C2 2.4022650695910071e-01f
#define EXP2_C1 6.9314718055994531e-01f
#define EXP2_LO -126.0f

static inline float exp2_neg_s(float x) {
    x = x > EXP2_LO ? x : EXP2_LO;
    const float n = rintf(x), f = x - n;
    float p = EXP2_C7;
    p = fmaf(p, f, EXP2_C6);
    p = fmaf(p, f, EXP2_C5);
    p = fmaf(p, f, EXP2_C4);
    p = fmaf(p, f, EXP2_C3);
    p = fmaf(p, f, EXP2_C2);
    p = fmaf(p, f, EXP2_C1);
    p = fmaf(p, f, 1.0f);
    return p * f32_of_bits((uint32_t)((int32_t)n + 127) << 23);
}

/* GELU after a GEMM (gemm.h's GELU_BODY is the vector form, operation for operation). */
enum { ACT_NONE = 0, ACT_GELU_TANH = 1, ACT_GELU_ERF = 2 };

static inline float gelu_s(float x, int act) {
    float u, e, t;
    if (act == ACT_GELU_TANH) {
        u = 0.7978845608028654f * fmaf(0.044715f * x, x * x, x);
        e = exp2_neg_s(fabsf(u) * (-2.0f * 1.4426950408889634f));
        t = (1.0f - e) / (1.0f + e);
    } else {
        u = x * 0.7071067811865476f;
        const float a = fabsf(u), r = 1.0f / fmaf(0.3275911f, a, 1.0f);
        float poly = fmaf(1.061405429f, r, -1.453152027f);
        poly = fmaf(poly, r, 1.421413741f);
        poly = fmaf(poly, r, -0.284496736f);
        poly = fmaf(poly, r, 0.254829592f);
        poly = poly * r;
        e = exp2_neg_s((a * a) * -1.4426950408889634f);
        t = fmaf(-poly, e, 1.0f);
    }
    t = f32_of_bits(bits_of_f32(t) | (bits_of_f32(u) & 0x80000000u));  /* the sign of u */
    return (0.5f * x) * (1.0f + t);
}

/* 16 lanes of floats as one value (GCC's vector extension: + and * act lane by lane, each rounded as the scalar
 * operation is, on whatever vector width the build has), for the sums that arith.h defines in 16 lanes. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_unaligned __attribute__((vector_size(64), aligned(4)));

static inline __attribute__((always_inline)) f32x16 v16_load(const float *p) { return *(const f32x16_unaligned *)p; }

static inline __attribute__((always_inline)) void v16_store(float *p, f32x16 v) { *(f32x16_unaligned *)p = v; }

/* fma(a, b, c) lane by lane: the ISA's fused multiply-add where the build has one, else arith's fmaf. */
static inline __attribute__((always_inline)) f32x16 v16_fma(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    union { f32x16 v; __m256 h[2]; } x = {a}, y = {b}, z = {c};
    z.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
    z.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
    return z.v;
#else
    f32x16 r;
    for (int l = 0; l < 16; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

/* The fixed 16-lane sum: lane l holds the terms j = l, l + 16, l + 32, ... added in order (from +0); the lanes are
 * then added as a tree, (l, l + 8), (l, l + 4), (l, l + 2), (0, 1), whatever the vector width computing it. */
static inline float lanes16_sum(const float lane[16]) {
    float t8[8], t4[4];
    for (int l = 0; l < 8; l++) t8[l] = lane[l] + lane[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

static inline float lanes16_sum16(f32x16 v) {
    float lane[16];
    v16_store(lane, v);
    return lanes16_sum(lane);
}

#endif
