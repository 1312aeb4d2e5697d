/* Exact per-item attention for bf16 q/k/v on CPUs with AVX-512 BF16 dot products (vdpbf16ps).
 *
 * Why it exists: at Kimi's head dim 72, PyTorch's fused CPU attention reaches ~180 GFLOP/s on an AVX-512 BF16
 * machine without AMX, a fifth of what a bf16 GEMM reaches there, and attention is most of a large image's
 * encode. This kernel does the same math with register-blocked bf16 dot products.
 *
 * Math, per head and query row i (n keys, scale = 1/sqrt(d)):
 *   s_j = (q_i . k_j) * scale * log2(e)                  fp32 accumulation of bf16 products
 *   p_j = 2^(s_j - max_j s_j)                             fp32, then rounded to bf16 for the second product
 *   o_i = (sum_j bf16(p_j) v_j) / (sum_j p_j)             fp32 accumulation, rounded to bf16 once
 * which is what PyTorch's flash kernel computes, without its running-max rescaling (each query block sees all
 * of its keys at once).
 *
 * Invariance: work is split into (head, block of BQ query rows) units; each unit is computed by one thread in
 * a fixed order that depends only on the item (n, d), so an item's output bits do not depend on the thread
 * count, on which thread ran a unit, or on other items (each item is a separate call).
 *
 * Layout: q/k/v/out rows are `*_row` elements apart, heads `*_head` apart, head_dim contiguous. `lse`, when not
 * NULL, receives each row's log-sum-exp of the scaled scores as [heads][n] floats (what a backward pass needs).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define BQ 24          /* query rows per work unit (a multiple of QK_R and of every PV row count) */
#define QK_R 6         /* query rows per QK^T microtile */
#define QK_C 4         /* 16-key vectors per QK^T microtile */
#define MAX_D 128

static inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

static void *alloc64(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, round_up(bytes ? bytes : 64, 64)) != 0) return NULL;
    return p;
}

/* 2^x for x <= 0 (x = -inf gives 0): n = round(x), 2^(x-n) by a degree-6 polynomial, scaled by 2^n. */
static inline __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    /* coefficients ln2^k / k! */
    __m512 p = _mm512_set1_ps(1.5403530393381606e-04f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512bh bcast_pair(const bf16 *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* S[r][j0 + 16c + lane] = scale2 * sum_p Q[r][2p..2p+1] . K[j][2p..2p+1] for QK_R rows and C key vectors.
 * kp: packed keys of the head, [pairs][npad16][2]; qb: [BQ][d2] bf16 block of queries. */
static inline __attribute__((always_inline)) void qk_tile(const bf16 *qb, int d2, const bf16 *kp, size_t npad16,
                                                          int j0, int C, float scale2, float *s, size_t s_stride) {
    __m512 acc[QK_R][QK_C];
#pragma GCC unroll 8
    for (int r = 0; r < QK_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < QK_C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < d2 / 2; p++) {
        const bf16 *krow = kp + ((size_t)p * npad16 + j0) * 2;
        __m512bh kv[QK_C];
#pragma GCC unroll 4
        for (int c = 0; c < QK_C; c++)
            if (c < C) kv[c] = (__m512bh)_mm512_loadu_si512(krow + 32 * c);
#pragma GCC unroll 8
        for (int r = 0; r < QK_R; r++) {
            __m512bh a = bcast_pair(qb + (size_t)r * d2 + 2 * p);
#pragma GCC unroll 4
            for (int c = 0; c < QK_C; c++)
                if (c < C) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, kv[c]);
        }
    }
    __m512 sc = _mm512_set1_ps(scale2);
#pragma GCC unroll 8
    for (int r = 0; r < QK_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < QK_C; c++)
            if (c < C) _mm512_storeu_ps(s + (size_t)r * s_stride + j0 + 16 * c, _mm512_mul_ps(acc[r][c], sc));
}

/* O[r][:] = sum_jp P[r][2jp..2jp+1] . V[2jp..2jp+1][:] for R rows, NV 16-column vectors; then scaled by inv[r],
 * rounded to bf16 and stored (first d columns) to out rows. */
static inline __attribute__((always_inline)) void pv_tile(const bf16 *pb, size_t p_stride, const bf16 *vp,
                                                          size_t pairs, int R, int NV, const float *inv, int rows,
                                                          int d, bf16 *out, size_t out_row_stride) {
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) acc[r][v] = _mm512_setzero_ps();
    for (size_t jp = 0; jp < pairs; jp++) {
        const bf16 *vrow = vp + jp * (size_t)NV * 32;
        __m512bh vv[8];
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++)
            if (v < NV) vv[v] = (__m512bh)_mm512_loadu_si512(vrow + 32 * v);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            if (r >= R) break;
            __m512bh a = bcast_pair(pb + (size_t)r * p_stride + 2 * jp);
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++)
                if (v < NV) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, vv[v]);
        }
    }
    for (int r = 0; r < R && r < rows; r++) {
        __m512 sc = _mm512_set1_ps(inv[r]);
        bf16 *o = out + (size_t)r * out_row_stride;
        for (int v = 0; v < NV; v++) {
            int cols = d - 16 * v;
            if (cols <= 0) break;
            __mmask16 m = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
            __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][v], sc));
            _mm256_mask_storeu_epi16(o + 16 * v, m, (__m256i)h);
        }
    }
}

/* Constant R/NV instances, so each microtile keeps its accumulators in registers. */
#define PV_CASE(NVC, RC) \
    case NVC: pv_tile(pb, p_stride, vp, pairs, RC, NVC, inv, rows, d, out, out_row_stride); break;

static void pv_dispatch(const bf16 *pb, size_t p_stride, const bf16 *vp, size_t pairs, int NV, const float *inv,
                        int rows, int d, bf16 *out, size_t out_row_stride) {
    switch (NV) {
        PV_CASE(1, 4) PV_CASE(2, 4) PV_CASE(3, 4) PV_CASE(4, 4) PV_CASE(5, 4) PV_CASE(6, 4)
        PV_CASE(7, 2) PV_CASE(8, 2)
    }
}

static int pv_rows(int NV) { return NV <= 6 ? 4 : 2; }

static void qk_dispatch(const bf16 *qb, int d2, const bf16 *kp, size_t npad16, int j0, int C, float scale2,
                        float *s, size_t s_stride) {
    switch (C) {
        case 4: qk_tile(qb, d2, kp, npad16, j0, 4, scale2, s, s_stride); break;
        case 3: qk_tile(qb, d2, kp, npad16, j0, 3, scale2, s, s_stride); break;
        case 2: qk_tile(qb, d2, kp, npad16, j0, 2, scale2, s, s_stride); break;
        case 1: qk_tile(qb, d2, kp, npad16, j0, 1, scale2, s, s_stride); break;
    }
}

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 for an unsupported head dim. */
int bivit_attention_bf16(const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, int64_t n, int64_t heads,
                         int64_t d, int64_t q_row, int64_t k_row, int64_t v_row, int64_t out_row, int64_t q_head,
                         int64_t k_head, int64_t v_head, int64_t out_head, float scale, float *lse,
                         int threads) {
    if (d < 1 || d > MAX_D) return 2;
    if (n <= 0 || heads <= 0) return 0;
    const int d2 = (int)round_up((size_t)d, 2);
    const int NV = (int)round_up((size_t)d, 16) / 16;
    const size_t npad16 = round_up((size_t)n, 16);
    const size_t pairs = round_up((size_t)n, 2) / 2;
    const size_t kp_size = (size_t)(d2 / 2) * npad16 * 2;   /* per head */
    const size_t vp_size = pairs * (size_t)NV * 32;           /* per head */
    bf16 *kpack = alloc64(kp_size * heads * sizeof(bf16));
    bf16 *vpack = alloc64(vp_size * heads * sizeof(bf16));
    if (!kpack || !vpack) { free(kpack); free(vpack); return 1; }
    const float scale2 = scale * 1.4426950408889634f;
    const int64_t qblocks = (n + BQ - 1) / BQ;
    int failed = 0;

#pragma omp parallel num_threads(threads)
    {
        /* Pack each head's keys as [pairs of dims][keys][2] and values as [pairs of keys][columns][2]: the
         * layouts vdpbf16ps reads, zero-padded so padded keys and columns contribute nothing. */
#pragma omp for schedule(static)
        for (int64_t h = 0; h < heads; h++) {
            bf16 *kp = kpack + kp_size * h, *vp = vpack + vp_size * h;
            memset(kp, 0, kp_size * sizeof(bf16));
            memset(vp, 0, vp_size * sizeof(bf16));
            for (int64_t j = 0; j < n; j++) {
                const bf16 *kr = k + j * k_row + h * k_head;
                uint32_t *kp32 = (uint32_t *)kp + j;
                for (int64_t c = 0; c + 1 < d; c += 2)
                    kp32[(size_t)(c / 2) * npad16] = (uint32_t)kr[c] | (uint32_t)kr[c + 1] << 16;
                if (d & 1) kp32[(size_t)(d / 2) * npad16] = kr[d - 1];
            }
            for (int64_t j = 0; j < n; j += 2) {
                const bf16 *v0 = v + j * v_row + h * v_head, *v1 = v0 + v_row;
                uint32_t *vp32 = (uint32_t *)vp + (size_t)(j / 2) * NV * 16;
                if (j + 1 < n)
                    for (int64_t c = 0; c < d; c++) vp32[c] = (uint32_t)v0[c] | (uint32_t)v1[c] << 16;
                else
                    for (int64_t c = 0; c < d; c++) vp32[c] = v0[c];
            }
        }
        const size_t s_stride = npad16, p_stride = round_up(pairs * 2, 32);
        float *s = alloc64(BQ * s_stride * sizeof(float));
        bf16 *pb = alloc64(BQ * p_stride * sizeof(bf16));
        bf16 *qb = alloc64(BQ * (size_t)d2 * sizeof(bf16));
        float inv[BQ];
        if (!s || !pb || !qb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < heads * qblocks; u++) {
            if (!s || !pb || !qb) continue;
            const int64_t h = u / qblocks, i0 = (u % qblocks) * BQ;
            const int rows = (int)(n - i0 < BQ ? n - i0 : BQ);
            memset(qb, 0, BQ * (size_t)d2 * sizeof(bf16));
            for (int r = 0; r < rows; r++) memcpy(qb + (size_t)r * d2, q + (i0 + r) * q_row + h * q_head, d * sizeof(bf16));
            const bf16 *kp = kpack + kp_size * h, *vp = vpack + vp_size * h;
            for (size_t j0 = 0; j0 < npad16; j0 += 16 * QK_C) {
                int C = (int)((npad16 - j0) / 16);
                if (C > QK_C) C = QK_C;
                for (int r0 = 0; r0 < BQ; r0 += QK_R)
                    qk_dispatch(qb + (size_t)r0 * d2, d2, kp, npad16, (int)j0, C, scale2, s + r0 * s_stride, s_stride);
            }
            /* Softmax numerators in fp32 over the n real keys; the bf16 copy feeds the second product. */
            const __mmask16 tail = (n % 16) ? (__mmask16)((1u << (n % 16)) - 1) : (__mmask16)0xFFFF;
            for (int r = 0; r < BQ; r++) {
                float *sr = s + r * s_stride;
                bf16 *pr = pb + r * p_stride;
                __m512 mx = _mm512_set1_ps(-INFINITY);
                int64_t j = 0;
                for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
                if (j < n) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(sr + j));
                const float mr = _mm512_reduce_max_ps(mx);
                const __m512 m = _mm512_set1_ps(mr);
                __m512 sum = _mm512_setzero_ps();
                for (j = 0; j < (int64_t)npad16; j += 16) {
                    __m512 e = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m));
                    if (j + 16 > n) e = _mm512_maskz_mov_ps(tail, e);
                    sum = _mm512_add_ps(sum, e);
                    _mm256_storeu_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
                }
                for (int64_t z = npad16; z < (int64_t)p_stride; z++) pr[z] = 0;
                const float total = _mm512_reduce_add_ps(sum);
                inv[r] = 1.0f / total;
                /* log-sum-exp of the scaled scores in natural-log units, for the backward pass */
                if (lse && r < rows) lse[h * n + i0 + r] = (mr + log2f(total)) * 0.6931471805599453f;
            }
            const int R = pv_rows(NV);
            for (int r0 = 0; r0 < rows; r0 += R)
                pv_dispatch(pb + r0 * p_stride, p_stride, vp, pairs, NV, inv + r0, rows - r0, (int)d,
                            out + (i0 + r0) * out_row + h * out_head, out_row);
        }
        free(s);
        free(pb);
        free(qb);
    }
    free(kpack);
    free(vpack);
    return failed;
}
