/* The AVX2 variant's GEMM kernel (gemm.h says what every kernel guarantees): kind 0 only, fp32 FMAs in
 * microtiles of 6 rows x 16 columns (12 accumulators, 2 weight vectors, 1 broadcast of the 16 ymm registers).
 * bf16 weights are widened to fp32 when packed and bf16 inputs as they are broadcast (both exact: a product of
 * two bf16 values is exact in fp32); flushed (`flush`), that is bivit-arith/1's bf16 GEMM, the bits vdpbf16ps
 * computes on the same pairs.
 */
#ifndef BIVIT_GEMM_AVX2_H
#define BIVIT_GEMM_AVX2_H

#include "gemm.h"

#define MR2 6
#define NR2 16
#define MB2 60

#define NR NR2
GEMM_F32_PACK
#undef NR

static inline __m256 gelu8(__m256 x, const int act) {
    GELU_BODY(__m256, _mm256, x, act);
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
            *y = C->yt == E_BF16 ? f32_to_bf16(v[c]) : _cvtss_sh(v[c], _MM_FROUND_TO_NEAREST_INT);
        }
    }
}

static inline __attribute__((always_inline)) void f32_micro(const struct gemm_call *C, const float *x0, int64_t xs,
                                                             int64_t i0, const int R, const float *bp, int64_t j0) {
    __m256 acc[MR2][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR2; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < C->K; k++) {
        const __m256 b0 = _mm256_loadu_ps(bp + k * NR2), b1 = _mm256_loadu_ps(bp + k * NR2 + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR2; r++) {
            if (r >= R) break;
            const __m256 a = _mm256_set1_ps(x0[r * xs + k]);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    if (C->flush && (C->K & 1))  /* bf16 pairs: an odd K's last pair is (x, 0) . (w, 0) */
        for (int r = 0; r < MR2; r++) {
            acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_setzero_ps());
            acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_setzero_ps());
        }
#pragma GCC unroll 6
    for (int r = 0; r < MR2; r++)
        if (r < R) store_row16(C, i0 + r, j0, acc[r][0], acc[r][1]);
}

#define MR MR2
#define NR NR2
#define MB MB2
GEMM_F32_BLOCK
#undef MB
#undef MR
#undef NR


#define F32_FMA8(acc, a) _mm256_fmadd_ps(a, a, acc)
GEMM_PEAK_DEF(f32_peak, __m256, _mm256_setzero_ps(), __m256, _mm256_set1_ps(1e-3f), F32_FMA8, MR2 * 2, 16)

static const struct gemm_kernel KERNEL_F32 = {MB2, NR2, 512 * 1024, f32_packed_bytes, f32_pack_panel, f32_scratch, NULL, NULL,
                                            f32_block, f32_peak};

static const struct gemm_kernel *gemm_kernel_of(int kind) { return kind == GEMM_FP32 ? &KERNEL_F32 : NULL; }

int bivit_amx_init(void) { return -1; }

BIVIT_GEMM_ENTRIES

#endif
