/* Exact per-item attention on CPUs with AVX2 and FMA (no AVX-512 needed): most x86 servers of the last decade,
 * among them AMD EPYC Zen 2/3, where PyTorch's fused attention runs bf16 through generic code.
 *
 * bivit-arith/1's attention (arith.h, docs/arithmetic.md; the AVX-512 and portable variants compute the same bits):
 *   s_j = (q_i . k_j) * scale * log2(e)     fma chain over the head dim, then one multiply
 *   p_j = 2^(s_j - max_j s_j)               exp2_neg; summed in the fixed 16-lane tree (two 8-lane registers:
 *                                           keys j % 16 < 8 and >= 8); bf16: p rounded to bf16 for the values
 *   o_i = (sum_j p_j v_j) * (1 / sum_j p_j)  fma chains over the keys in chunks of 128, chunk sums added in order
 * bf16 inputs are widened to fp32 in registers as keys, values and queries are packed (exact: a bf16 value is
 * an fp32 value with a shorter mantissa), so the inner loops are one FMA per multiply-add whatever the dtype;
 * a bf16 unit runs flushed (arith.h), as bf16 pair products do, and an odd count of bf16 pairs gets their
 * padding product 0 x 0. The output is rounded to the input dtype to nearest even. Items, units and
 * invariance: common.h.
 *
 * Register blocking for the 16 ymm registers: q.k^T in microtiles of 6 query rows x 16 keys (12 accumulators,
 * 2 key vectors, 1 broadcast), p.v in microtiles of 4 rows x 24 columns (12 accumulators, 3 value vectors, 1
 * broadcast).
 */
#include <immintrin.h>
#include <math.h>

#include "common.h"
#include "norm.h"

#define BQ 24        /* query rows per work unit (a multiple of QK_R and PV_R) */
#define QK_R 6       /* query rows per q.k^T microtile */
#define QK_C 2       /* 8-key vectors per q.k^T microtile */
#define PV_R 4       /* rows per p.v microtile */
#define PV_V 3       /* 8-column vectors per p.v microtile */

/* p * 2^n for an integral n >= -126: 2^n built in the exponent field (AVX2 has no scalef). */
static inline __m256 scale_pow2(__m256 p, __m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

EXP2_NEG_DEF(__m256, _mm256, _mm256_round_ps, scale_pow2)

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* The last three levels of arith.h's 16-lane tree, on its first level's 8 sums: (0+4, 1+5, 2+6, 3+7), then
 * (0+2, 1+3), then the last two. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* 8 bf16 -> 8 floats (exact). */
static inline __m256 load_bf16(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 floats -> their bf16 bits in the low halves of 8 lanes, rounded to nearest even (NaN: a quiet NaN), as
 * PyTorch converts. */
static inline __m256i bf16_bits(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

/* 8 floats -> 8 bf16 (bf16_bits, packed). */
static inline __m128i to_bf16(__m256 x) {
    const __m256i r = bf16_bits(x);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* d elements of a row -> floats at dst (d <= MAX_D), the rest of `width` zero. */
static inline void widen_row(float *dst, const char *row, int64_t d, size_t width, const int bf) {
    int64_t c = 0;
    if (bf)
        for (; c + 8 <= d; c += 8) _mm256_storeu_ps(dst + c, load_bf16((const bf16 *)row + c));
    else
        for (; c + 8 <= d; c += 8) _mm256_storeu_ps(dst + c, _mm256_loadu_ps((const float *)row + c));
    for (; c < d; c++) dst[c] = load_elem(row, c, bf);
    for (; c < (int64_t)width; c++) dst[c] = 0.0f;
}

/* Row `row` of the call's q or k rotated by its RoPE tables (d even), rounded to the input dtype as rope.h
 * rounds, then widened to floats at dst (exact): 8 lanes at a time, rope.h's scalar form for the last pairs. */
static inline void widen_rotated(const struct call *C, float *dst, const char *src, int64_t row, const int bf) {
    const int64_t d = C->d;
    const float *c = C->cos + row * d, *s = C->sin + row * d;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 x = bf ? load_bf16((const bf16 *)src + i) : _mm256_loadu_ps((const float *)src + i);
        const __m256 a = _mm256_mul_ps(x, _mm256_loadu_ps(c + i));
        const __m256 b = _mm256_mul_ps(_mm256_permute_ps(x, 0xB1), _mm256_loadu_ps(s + i));
        const __m256 y = _mm256_add_ps(a, b);
        _mm256_storeu_ps(dst + i, bf ? _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(y), 16)) : y);
    }
    for (; i < d; i++) {
        const float y = rope_elem(load_elem(src, i, bf), load_elem(src, i ^ 1, bf), c[i], s[i]);
        if (!bf) {
            dst[i] = y;
        } else {
            const uint32_t w = (uint32_t)f32_to_bf16(y) << 16;
            memcpy(dst + i, &w, sizeof w);
        }
    }
}

/* Row `row` of q or k as the microtiles read it: d floats at dst, rotated when the call has RoPE tables. */
static inline void widen_qk(const struct call *C, float *dst, const char *src, int64_t row, const int bf) {
    if (C->cos) widen_rotated(C, dst, src, row, bf);
    else widen_row(dst, src, C->d, C->d, bf);
}

/* The packed sizes of an item of n rows: keys as [d][npad] floats, values as [n][dpad] floats. */
static inline size_t npad_of(int64_t n) { return round_up((size_t)n, 8); }
static inline size_t dpad_of(int64_t d) { return round_up((size_t)d, 8); }

static size_t kpack_bytes(int64_t n, int64_t d, int bf) { (void)bf; return (size_t)d * npad_of(n) * sizeof(float); }
static size_t vpack_bytes(int64_t n, int64_t d, int bf) { (void)bf; return (size_t)n * dpad_of(d) * sizeof(float); }

/* Per thread: scores (reused for the softmax numerators) and the unit's queries, for the largest item. */
static size_t scratch_bytes(int64_t n, int64_t d, int bf) {
    (void)bf;
    return round_up(BQ * npad_of(n) * sizeof(float), 64) + round_up(BQ * (size_t)d * sizeof(float), 64);
}

static inline __attribute__((always_inline)) void pack_head_t(const struct call *C, const struct item *it,
                                                              int64_t h, const int bf) {
    const int64_t n = it->n, d = C->d;
    const size_t npad = npad_of(n), dpad = dpad_of(d), es = C->esize;
    float *kp = (float *)(it->kpack + it->kp_head * h), *vp = (float *)(it->vpack + it->vp_head * h);
    memset(kp, 0, (size_t)d * npad * sizeof(float));
    for (int64_t j0 = 0; j0 < n; j0 += 8) {  /* 8 keys at a time: each packed row gets one 32-byte run */
        const int64_t jn = n - j0 < 8 ? n - j0 : 8;
        float rows[8][MAX_D];
        for (int64_t jj = 0; jj < jn; jj++)
            widen_qk(C, rows[jj], row_of(C->k, it->row0 + j0 + jj, C->k_row, h, C->k_head, es), it->row0 + j0 + jj, bf);
        for (int64_t c = 0; c < d; c++)
            for (int64_t jj = 0; jj < jn; jj++) kp[(size_t)c * npad + j0 + jj] = rows[jj][c];
    }
    for (int64_t j = 0; j < n; j++)
        widen_row(vp + (size_t)j * dpad, row_of(C->v, it->row0 + j, C->v_row, h, C->v_head, es), d, dpad, bf);
}

/* s[r][j0 + 8c + lane] = scale2 * (q_r . k_j) for QK_R rows and NC key vectors. */
static inline __attribute__((always_inline)) void qk_tile(const float *qb, int64_t d, const float *kp, size_t npad,
                                                          size_t j0, const int NC, float scale2, float *s,
                                                          size_t s_stride, const int bf) {
    __m256 acc[QK_R][QK_C];
    for (int r = 0; r < QK_R; r++)
        for (int c = 0; c < QK_C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < d; p++) {
        const float *krow = kp + (size_t)p * npad + j0;
        __m256 kv[QK_C];
        for (int c = 0; c < QK_C; c++)
            if (c < NC) kv[c] = _mm256_loadu_ps(krow + 8 * c);
        for (int r = 0; r < QK_R; r++) {
            const __m256 a = _mm256_broadcast_ss(qb + (size_t)r * d + p);
            for (int c = 0; c < QK_C; c++)
                if (c < NC) acc[r][c] = _mm256_fmadd_ps(a, kv[c], acc[r][c]);
        }
    }
    if (bf && (d & 1))  /* bf16 pairs: an odd head dim's last pair is (q, 0) . (k, 0) */
        for (int r = 0; r < QK_R; r++)
            for (int c = 0; c < QK_C; c++) acc[r][c] = _mm256_add_ps(acc[r][c], _mm256_setzero_ps());
    const __m256 sc = _mm256_set1_ps(scale2);
    for (int r = 0; r < QK_R; r++)
        for (int c = 0; c < QK_C; c++)
            if (c < NC) _mm256_storeu_ps(s + (size_t)r * s_stride + j0 + 8 * c, _mm256_mul_ps(acc[r][c], sc));
}

/* out rows r < rows, columns [0, 8 NV) of this column block (the first `cols` stored): inv[r] * sum_j p_rj v_j. */
static inline __attribute__((always_inline)) void pv_tile(const float *pb, size_t p_stride, const float *vp,
                                                          size_t dpad, int64_t n, const int NV, const float *inv,
                                                          int rows, int64_t cols, char *out, int64_t out_row,
                                                          const int bf, const int obf) {
    __m256 tot[PV_R][PV_V];
    for (int r = 0; r < PV_R; r++)
        for (int v = 0; v < PV_V; v++) tot[r][v] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < n; c0 += PV_CHUNK) {
        const int64_t c1 = c0 + PV_CHUNK < n ? c0 + PV_CHUNK : n;
        __m256 acc[PV_R][PV_V];
        for (int r = 0; r < PV_R; r++)
            for (int v = 0; v < PV_V; v++) acc[r][v] = _mm256_setzero_ps();
        for (int64_t j = c0; j < c1; j++) {
            const float *vrow = vp + (size_t)j * dpad;
            __m256 vv[PV_V];
            for (int v = 0; v < PV_V; v++)
                if (v < NV) vv[v] = _mm256_loadu_ps(vrow + 8 * v);
            for (int r = 0; r < PV_R; r++) {
                const __m256 a = _mm256_broadcast_ss(pb + (size_t)r * p_stride + j);
                for (int v = 0; v < PV_V; v++)
                    if (v < NV) acc[r][v] = _mm256_fmadd_ps(a, vv[v], acc[r][v]);
            }
        }
        if (bf && (n & 1) && c1 == n)  /* bf16 key pairs: an odd n's last pair is (p, 0) . (v, 0) */
            for (int r = 0; r < PV_R; r++)
                for (int v = 0; v < PV_V; v++) acc[r][v] = _mm256_add_ps(acc[r][v], _mm256_setzero_ps());
        for (int r = 0; r < PV_R; r++)
            for (int v = 0; v < PV_V; v++) tot[r][v] = _mm256_add_ps(tot[r][v], acc[r][v]);
    }
    const size_t es = obf ? 2 : 4;
    for (int r = 0; r < PV_R && r < rows; r++)
        for (int v = 0; v < NV; v++) {
            const int64_t left = cols - 8 * v;
            if (left <= 0) break;
            const __m256 o = _mm256_mul_ps(tot[r][v], _mm256_set1_ps(inv[r]));
            char *dst = out + (r * out_row + 8 * v) * (int64_t)es;
            if (left >= 8) {
                if (obf) _mm_storeu_si128((__m128i *)dst, to_bf16(o));
                else _mm256_storeu_ps((float *)dst, o);
            } else {
                union { __m128i h; __m256 f; } tmp;
                if (obf) tmp.h = to_bf16(o);
                else tmp.f = o;
                memcpy(dst, &tmp, (size_t)left * es);
            }
        }
}

static inline __attribute__((always_inline)) void qk_dispatch(const float *qb, int64_t d, const float *kp,
                                                              size_t npad, size_t j0, int NC, float scale2, float *s,
                                                              size_t s_stride, const int bf) {
    if (NC == 2) qk_tile(qb, d, kp, npad, j0, 2, scale2, s, s_stride, bf);
    else qk_tile(qb, d, kp, npad, j0, 1, scale2, s, s_stride, bf);
}

static inline __attribute__((always_inline)) void pv_dispatch(const float *pb, size_t p_stride, const float *vp,
                                                              size_t dpad, int64_t n, int NV, const float *inv,
                                                              int rows, int64_t cols, char *out, int64_t out_row,
                                                              const int bf, const int obf) {
    switch (NV) {
        case 3: pv_tile(pb, p_stride, vp, dpad, n, 3, inv, rows, cols, out, out_row, bf, obf); break;
        case 2: pv_tile(pb, p_stride, vp, dpad, n, 2, inv, rows, cols, out, out_row, bf, obf); break;
        case 1: pv_tile(pb, p_stride, vp, dpad, n, 1, inv, rows, cols, out, out_row, bf, obf); break;
    }
}

static inline __attribute__((always_inline)) void run_unit_t(const struct call *C, const struct item *it, int64_t h,
                                                             int64_t i0, void *scratch, const int bf) {
    const int64_t n = it->n, d = C->d;
    const size_t npad = npad_of(n), dpad = dpad_of(d), s_stride = npad;
    const int rows = (int)(n - i0 < BQ ? n - i0 : BQ);
    float *s = scratch;  /* scores, then (in place) the softmax numerators */
    float *qb = (float *)((char *)scratch + round_up(BQ * npad_of(n) * sizeof(float), 64));
    float inv[BQ];
    for (int r = 0; r < BQ; r++) {
        if (r < rows)
            widen_qk(C, qb + (size_t)r * d, row_of(C->q, it->row0 + i0 + r, C->q_row, h, C->q_head, C->esize),
                     it->row0 + i0 + r, bf);
        else memset(qb + (size_t)r * d, 0, (size_t)d * sizeof(float));
    }
    const float *kp = (const float *)(it->kpack + it->kp_head * h), *vp = (const float *)(it->vpack + it->vp_head * h);
    fp_set(bf);  /* the queries are rotated (IEEE, as rope.h); the products run in their dtype's mode */
    for (size_t j0 = 0; j0 < npad; j0 += 8 * QK_C) {
        const int NC = (npad - j0) / 8 >= QK_C ? QK_C : (int)((npad - j0) / 8);
        for (int r0 = 0; r0 < BQ; r0 += QK_R)
            qk_dispatch(qb + (size_t)r0 * d, d, kp, npad, j0, NC, C->scale2, s + r0 * s_stride, s_stride, bf);
    }
    /* Softmax numerators in fp32 over the n real keys, zero for the padding; their sum in arith.h's 16 lanes (key
     * j in lane j % 16: blocks of 8 keys alternate between two registers), the numerators the values see rounded
     * to bf16 in bf16. */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < BQ; r++) {
        float *sr = s + r * s_stride;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + j));
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), lane));
        if (j < n) mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(sr + j), live));
        const float mr = hmax(mx);
        const __m256 m = _mm256_set1_ps(mr);
        __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (j = 0; j < (int64_t)npad; j += 8) {
            __m256 e = exp2_neg(_mm256_sub_ps(_mm256_loadu_ps(sr + j), m));
            if (j + 8 > n) e = _mm256_and_ps(e, live);
            sum[(j / 8) & 1] = _mm256_add_ps(sum[(j / 8) & 1], e);
            _mm256_storeu_ps(sr + j, bf ? _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(e), 16)) : e);
        }
        const float total = hsum(_mm256_add_ps(sum[0], sum[1]));
        inv[r] = 1.0f / total;
        if (r < rows) store_lse(C, it, h, i0 + r, mr, total);
    }
    const int NV = (int)(dpad / 8);
    for (int r0 = 0; r0 < rows; r0 += PV_R)
        for (int v0 = 0; v0 < NV; v0 += PV_V)
            pv_dispatch(s + r0 * s_stride, s_stride, vp + 8 * v0, dpad, n, NV - v0 < PV_V ? NV - v0 : PV_V, inv + r0,
                        rows - r0, d - 8 * v0,
                        C->out + ((it->row0 + i0 + r0) * C->out_row + h * C->out_head + 8 * v0) * (int64_t)C->oesize,
                        C->out_row, bf, C->obf);
    fp_set(0);
}

BIVIT_VARIANT


#include "gemm_avx2.h"
