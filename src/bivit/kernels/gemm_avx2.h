/* The AVX2 variant's GEMM kernel (gemm.h says what every kernel guarantees): kind 0 only, fp32 FMAs in
 * microtiles of 6 rows x 16 columns (12 accumulators, 2 weight vectors, 1 broadcast of the 16 ymm registers).
 * bf16 weights are widened to fp32 when packed and bf16 inputs as they are broadcast (both exact: a product of
 * two bf16 values is exact in fp32), so bf16 is the same math as a bf16 GEMM with fp32 accumulation.
 */
#ifndef BIVIT_GEMM_AVX2_H
#define BIVIT_GEMM_AVX2_H

#include "gemm.h"

#define MR2 6
#define NR2 16
#define MB2 60

static size_t f32_packed_bytes(int64_t N, int64_t K) { return (size_t)ceil_div(N, NR2) * K * NR2 * 4; }

static void f32_pack_panel(const char *w, int64_t w_row, int wt, int64_t N, int64_t K, int64_t p, char *out) {
    float *o = (float *)out;
    for (int64_t k = 0; k < K; k++)
        for (int64_t c = 0; c < NR2; c++) {
            const int64_t j = p * NR2 + c;
            o[k * NR2 + c] = j < N ? gemm_elem(w + j * w_row * esize_of(wt), k, wt) : 0.0f;
        }
}

static inline __m256 gelu8(__m256 x, const int act) {
    GELU_CONSTS;
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 u, a, e, t;
    if (act == ACT_GELU_TANH) {
        u = _mm256_mul_ps(_mm256_set1_ps(k_sqrt2_pi),
                          _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k_cubic), x), _mm256_mul_ps(x, x), x));
        a = _mm256_andnot_ps(sign, u);
        e = exp2_neg(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f * k_log2e)));
        t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    } else {
        u = _mm256_mul_ps(x, _mm256_set1_ps(k_rsqrt2));
        a = _mm256_andnot_ps(sign, u);
        const __m256 r = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(k_p), a, one));
        __m256 poly = _mm256_set1_ps(k_a5);
        poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(k_a4));
        poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(k_a3));
        poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(k_a2));
        poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(k_a1));
        poly = _mm256_mul_ps(poly, r);
        e = exp2_neg(_mm256_mul_ps(_mm256_mul_ps(a, a), _mm256_set1_ps(-k_log2e)));
        t = _mm256_fnmadd_ps(poly, e, one);
    }
    t = _mm256_or_ps(t, _mm256_and_ps(u, sign));  /* the sign of u */
    return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
}

/* Row i's 16 results at j0: acc + bias, rounded to the output dtype, the columns below N. */
static inline __attribute__((always_inline)) void store_row16(const struct gemm_call *C, int64_t i, int64_t j0,
                                                               __m256 a0, __m256 a1) {
    const int64_t m = C->N - j0 < NR2 ? C->N - j0 : NR2;
    float v[NR2], b[NR2] = {0};
    if (C->bias) memcpy(b, C->bias + j0, (size_t)m * 4);
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(b));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(b + 8));
    if (C->act) {
        a0 = gelu8(a0, C->act);
        a1 = gelu8(a1, C->act);
    }
    _mm256_storeu_ps(v, a0);
    _mm256_storeu_ps(v + 8, a1);
    if (m == NR2 && C->yt == E_BF16) {
        bf16 *y = (bf16 *)C->y + i * C->y_row + j0;
        _mm_storeu_si128((__m128i *)y, to_bf16(_mm256_loadu_ps(v)));
        _mm_storeu_si128((__m128i *)(y + 8), to_bf16(_mm256_loadu_ps(v + 8)));
    } else if (m == NR2 && C->yt == E_F16) {
        uint16_t *y = (uint16_t *)C->y + i * C->y_row + j0;
        _mm_storeu_si128((__m128i *)y, _mm256_cvtps_ph(_mm256_loadu_ps(v), _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128((__m128i *)(y + 8), _mm256_cvtps_ph(_mm256_loadu_ps(v + 8), _MM_FROUND_TO_NEAREST_INT));
    } else if (C->yt == E_F32) {
        memcpy((float *)C->y + i * C->y_row + j0, v, (size_t)m * 4);
    } else {
        for (int64_t c = 0; c < m; c++) {
            uint16_t *y = (uint16_t *)C->y + i * C->y_row + j0 + c;
            *y = C->yt == E_BF16 ? rope_bf16(v[c]) : _cvtss_sh(v[c], _MM_FROUND_TO_NEAREST_INT);
        }
    }
}

static inline __attribute__((always_inline)) void f32_micro(const struct gemm_call *C, int64_t i0, const int R,
                                                             const float *bp, int64_t j0, const int XT) {
    __m256 acc[MR2][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR2; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const char *x0 = C->x + i0 * C->x_row * esize_of(XT);
    const size_t xs = (size_t)C->x_row * esize_of(XT);
    for (int64_t k = 0; k < C->K; k++) {
        const __m256 b0 = _mm256_loadu_ps(bp + k * NR2), b1 = _mm256_loadu_ps(bp + k * NR2 + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR2; r++) {
            if (r >= R) break;
            const __m256 a = _mm256_set1_ps(gemm_elem(x0 + r * xs, k, XT));
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR2; r++)
        if (r < R) store_row16(C, i0 + r, j0, acc[r][0], acc[r][1]);
}

static void f32_block(const struct gemm_call *C, int64_t i0, int64_t rows, int64_t p0, int64_t p1, void *scratch) {
    (void)scratch;
    const size_t panel = (size_t)C->K * NR2;
    for (int64_t p = p0; p < p1; p++)
        for (int64_t r0 = 0; r0 < rows; r0 += MR2) {
            const int R = rows - r0 < MR2 ? (int)(rows - r0) : MR2;
            const float *bp = (const float *)C->w + p * panel;
#define F32_CALL(n) (C->xt == E_BF16 ? f32_micro(C, i0 + r0, n, bp, p * NR2, E_BF16)        \
                   : C->xt == E_F16 ? f32_micro(C, i0 + r0, n, bp, p * NR2, E_F16)        \
                                    : f32_micro(C, i0 + r0, n, bp, p * NR2, E_F32))
            if (R == MR2) F32_CALL(MR2);  /* as in gemm_avx512.h's MICRO_DISPATCH */
            else F32_CALL(R);
#undef F32_CALL
        }
}

static size_t no_scratch(int64_t K) { (void)K; return 64; }

static const struct gemm_kernel GEMM_F32 = {MB2, NR2, 512 * 1024, f32_packed_bytes, f32_pack_panel, no_scratch, NULL, NULL,
                                            f32_block};

static const struct gemm_kernel *gemm_kernel_of(int kind) { return kind == 0 ? &GEMM_F32 : NULL; }

int bivit_amx_init(void) { return -1; }

BIVIT_GEMM_ENTRIES

#endif
