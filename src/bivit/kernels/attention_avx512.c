/* Exact per-item attention on CPUs with AVX-512 BF16 (bf16 inputs: AVX-512 BF16 dot products, vdpbf16ps; fp32
 * inputs: fused multiply-adds).
 *
 * Why it exists: at Kimi's head dim 72, PyTorch's fused CPU attention reaches ~150-180 GFLOP/s in bf16 on an
 * AVX-512 BF16 machine without AMX, well under half of what a bf16 GEMM reaches there, and attention is most
 * of a large image's encode. This kernel does the same math with register-blocked dot products.
 *
 * Math: bivit-arith/1's attention (arith.h, docs/arithmetic.md; attention_avx2.c and portable.c compute the same
 * bits), per head and query row i (n keys, scale = 1/sqrt(d)):
 *   s_j = (q_i . k_j) * scale * log2(e)     fma chain over the head dim, then one multiply
 *   p_j = 2^(s_j - max_j s_j)               exp2_neg; summed in the fixed 16-lane tree (sum16); bf16: rounded to
 *                                           bf16 for the second product
 *   o_i = (sum_j p_j v_j) * (1 / sum_j p_j)  fma chains over the keys in chunks of 128, chunk sums added in order
 * which is what PyTorch's flash kernel computes, without its running-max rescaling (each query block sees all
 * of its keys at once). Items, units and invariance: common.h.
 *
 * One code path for both dtypes: the unit of every inner product step is a 32-bit word, a pair of bf16 values
 * (vdpbf16ps multiplies pairs) or one float, so packing, blocking and tails are the same; only the
 * multiply-add, the packing of a word and the stores of p and of the output differ. vdpbf16ps adds a pair's
 * upper (odd) product first, then the lower one, each rounded (flushed: arith.h), so every bf16 word holds its
 * pair swapped, element j + 1 in the lower half and j in the upper (`swap_pair`): the chain then runs in
 * element order, as the fp32 chains of the other variants do.
 */
#include <immintrin.h>
#include <math.h>

#include "common.h"
#include "norm.h"

typedef uint32_t word;  /* a pair of bf16 values, or one float */

#define BQ 24          /* query rows per work unit (a multiple of QK_R and of every PV row count) */
#define QK_R 6         /* query rows per QK^T microtile */
#define QK_C 4         /* 16-key vectors per QK^T microtile */

EXP2_NEG_DEF(__m512, _mm512, _mm512_roundscale_ps, _mm512_scalef_ps)

/* acc + a . b for one 32-bit word a (broadcast) against 16 words b: a pair product (bf16) or a product (fp32). */
static inline __attribute__((always_inline)) __m512 madd(__m512 acc, const word *a, __m512i b, const int bf) {
    __m512i av = _mm512_set1_epi32((int)*a);
    if (bf) return _mm512_dpbf16_ps(acc, (__m512bh)av, (__m512bh)b);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(av), _mm512_castsi512_ps(b), acc);
}

/* S[r][j0 + 16c + lane] = scale2 * (q_r . k_j) for QK_R rows and C key vectors.
 * kp: packed keys of the head, [steps][npad16] words; qb: [BQ][steps] words of queries. */
static inline __attribute__((always_inline)) void qk_tile(const word *qb, int steps, const word *kp,
                                                          size_t npad16, size_t j0, int C, float scale2, float *s,
                                                          size_t s_stride, const int bf) {
    __m512 acc[QK_R][QK_C];
#pragma GCC unroll 8
    for (int r = 0; r < QK_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < QK_C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < steps; p++) {
        const word *krow = kp + (size_t)p * npad16 + j0;
        __m512i kv[QK_C];
#pragma GCC unroll 4
        for (int c = 0; c < QK_C; c++)
            if (c < C) kv[c] = _mm512_loadu_si512(krow + 16 * c);
#pragma GCC unroll 8
        for (int r = 0; r < QK_R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < QK_C; c++)
                if (c < C) acc[r][c] = madd(acc[r][c], qb + (size_t)r * steps + p, kv[c], bf);
    }
    __m512 sc = _mm512_set1_ps(scale2);
#pragma GCC unroll 8
    for (int r = 0; r < QK_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < QK_C; c++)
            if (c < C) _mm512_storeu_ps(s + (size_t)r * s_stride + j0 + 16 * c, _mm512_mul_ps(acc[r][c], sc));
}

/* The 8-lane forms, for a last column vector of at most 8 columns (Kimi's head dim 72 = 4 x 16 + 8). */
static inline __attribute__((always_inline)) __m256 madd8(__m256 acc, const word *a, __m256i b, const int bf) {
    __m256i av = _mm256_set1_epi32((int)*a);
    if (bf) return _mm256_dpbf16_ps(acc, (__m256bh)av, (__m256bh)b);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(av), _mm256_castsi256_ps(b), acc);
}

static inline __attribute__((always_inline)) void clear_rows(__m512 full[4][8], __m256 half[4]) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        half[r] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) full[r][v] = _mm512_setzero_ps();
    }
}

/* 16 floats -> their bf16 bits in the low halves of the lanes, exactly as arith.h's f32_to_bf16 rounds: to
 * nearest even, any NaN to 0x7FC0 (vcvtneps2bf16 keeps a NaN's sign and payload, and reads denormals as zero). */
static inline __m512i bf16_bits16(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

static inline __m256i to_bf16_16(__m512 y) { return _mm512_cvtepi32_epi16(bf16_bits16(y)); }

static inline __m128i to_bf16_8(__m256 y) {
    return _mm256_cvtepi32_epi16(_mm512_castsi512_si256(bf16_bits16(_mm512_castps256_ps512(y))));
}

/* arith.h's 16-lane sum of the lanes of v: (l, l + 8), (l, l + 4), (l, l + 2), (0, 1), written out (the
 * compiler's _mm512_reduce_add_ps leaves its order to the compiler). */
static inline float sum16(__m512 v) {
    const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    t4 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t4, _mm_shuffle_ps(t4, t4, 1)));
}

/* o_r = sum over value steps of p_r . v for R rows, NV 16-column vectors (the last one 8 columns wide when
 * HALF) of value rows `width` words apart, then scaled by inv[r], rounded to the output dtype and stored (first
 * d columns) to the out rows that exist (`rows`). */
static inline __attribute__((always_inline)) void pv_tile(const word *pb, size_t p_stride, const word *vp,
                                                          size_t width, size_t vsteps, int R, int NV, int HALF,
                                                          const float *inv, int rows, int d, void *out,
                                                          size_t out_row, const int bf, const int obf) {
    const size_t chunk = bf ? PV_CHUNK / 2 : PV_CHUNK;  /* value steps: pairs of keys in bf16 */
    const int NF = HALF ? NV - 1 : NV;  /* full 16-lane vectors */
    __m512 tot[4][8];
    __m256 toth[4];
    clear_rows(tot, toth);
    for (size_t c0 = 0; c0 < vsteps; c0 += chunk) {
        const size_t c1 = c0 + chunk < vsteps ? c0 + chunk : vsteps;
        __m512 acc[4][8];
        __m256 acch[4];
        clear_rows(acc, acch);
        for (size_t jp = c0; jp < c1; jp++) {
            const word *vrow = vp + jp * width;
            __m512i vv[8];
            __m256i vh = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++)
                if (v < NF) vv[v] = _mm512_loadu_si512(vrow + 16 * v);
            if (HALF) vh = _mm256_loadu_si256((const __m256i *)(vrow + 16 * NF));
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                if (r >= R) break;
                const word *a = pb + (size_t)r * p_stride + jp;
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++)
                    if (v < NF) acc[r][v] = madd(acc[r][v], a, vv[v], bf);
                if (HALF) acch[r] = madd8(acch[r], a, vh, bf);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            toth[r] = _mm256_add_ps(toth[r], acch[r]);
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) tot[r][v] = _mm512_add_ps(tot[r][v], acc[r][v]);
        }
    }
    /* Plain stores for whole vectors, masked ones only past d (a masked store costs several plain ones here). */
    for (int r = 0; r < R && r < rows; r++) {
        for (int v = 0; v < NF; v++) {
            const int cols = d - 16 * v;
            const __mmask16 m = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
            const __m512 o = _mm512_mul_ps(tot[r][v], _mm512_set1_ps(inv[r]));
            bf16 *ob = (bf16 *)out + r * out_row + 16 * v;
            float *of = (float *)out + r * out_row + 16 * v;
            if (obf && cols >= 16) _mm256_storeu_si256((__m256i *)ob, to_bf16_16(o));
            else if (obf) _mm256_mask_storeu_epi16(ob, m, to_bf16_16(o));
            else if (cols >= 16) _mm512_storeu_ps(of, o);
            else _mm512_mask_storeu_ps(of, m, o);
        }
        if (HALF) {
            const int cols = d - 16 * NF;
            const __mmask8 m = (__mmask8)((1u << cols) - 1);
            const __m256 o = _mm256_mul_ps(toth[r], _mm256_set1_ps(inv[r]));
            bf16 *ob = (bf16 *)out + r * out_row + 16 * NF;
            float *of = (float *)out + r * out_row + 16 * NF;
            if (obf && cols == 8) _mm_storeu_si128((__m128i *)ob, to_bf16_8(o));
            else if (obf) _mm_mask_storeu_epi16(ob, m, to_bf16_8(o));
            else if (cols == 8) _mm256_storeu_ps(of, o);
            else _mm256_mask_storeu_ps(of, m, o);
        }
    }
}

/* Constant NV/HALF instances, so each microtile keeps its accumulators in registers: 4 rows at a time, and
 * head dims over 96 in two column passes (4 rows x 8 vectors would not fit the 32 registers). */
#define PV_CALL(COL, NVC, HALFC)                                                                          \
    pv_tile(pb, p_stride, vp + 16 * (COL), width, vsteps, 4, NVC, HALFC, inv, rows, d - 16 * (COL),       \
            (char *)out + 16 * (COL) * (obf ? 2 : 4), out_row, bf, obf)
#define PV_CASE(NVC)                                                                                     \
    case NVC:                                                                                            \
        if (NVC > 6) PV_CALL(0, 4, 0);                                                                   \
        if (half) PV_CALL(NVC > 6 ? 4 : 0, NVC > 6 ? NVC - 4 : NVC, 1);                                  \
        else PV_CALL(NVC > 6 ? 4 : 0, NVC > 6 ? NVC - 4 : NVC, 0);                                       \
        break;

static inline __attribute__((always_inline)) void pv_dispatch(const word *pb, size_t p_stride, const word *vp,
                                                              size_t vsteps, int NV, const float *inv, int rows,
                                                              int d, void *out, size_t out_row, const int bf,
                                                              const int obf) {
    const int half = d % 16 != 0 && d % 16 <= 8;
    const size_t width = (size_t)NV * 16;
    switch (NV) {
        PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7) PV_CASE(8)
    }
}


static inline __attribute__((always_inline)) void qk_dispatch(const word *qb, int steps, const word *kp,
                                                              size_t npad16, size_t j0, int C, float scale2,
                                                              float *s, size_t s_stride, const int bf) {
    switch (C) {
        case 4: qk_tile(qb, steps, kp, npad16, j0, 4, scale2, s, s_stride, bf); break;
        case 3: qk_tile(qb, steps, kp, npad16, j0, 3, scale2, s, s_stride, bf); break;
        case 2: qk_tile(qb, steps, kp, npad16, j0, 2, scale2, s, s_stride, bf); break;
        case 1: qk_tile(qb, steps, kp, npad16, j0, 1, scale2, s, s_stride, bf); break;
    }
}

/* A bf16 pair as vdpbf16ps must see it: element j + 1 in the lower half, j in the upper (it adds the upper
 * product first). */
static inline word swap_pair(word w) { return (w >> 16) | (w << 16); }

/* One 32-bit word of a row from its element c (and c + 1 in bf16, swapped: swap_pair; zero past the end). */
static inline word pack_word(const void *row, int64_t c, int64_t d, const int bf) {
    if (!bf) return ((const word *)row)[c];
    const bf16 *r = row;
    return swap_pair((word)r[c] | (c + 1 < d ? (word)r[c + 1] << 16 : 0));
}


/* The packed sizes of an item of n rows. */
struct geom {
    int per_word, steps, NV;
    size_t npad16, vsteps, kp_size, vp_size, s_stride, p_stride;  /* kp_size, vp_size: words per head */
};

static inline struct geom geometry(int64_t n, int64_t d, int bf) {
    struct geom G;
    G.per_word = bf ? 2 : 1;
    G.steps = (int)((d + G.per_word - 1) / G.per_word);  /* words per q/k row */
    G.NV = (int)round_up((size_t)d, 16) / 16;
    G.npad16 = round_up((size_t)n, 16);
    G.vsteps = (n + G.per_word - 1) / G.per_word;        /* key steps of the second product */
    G.kp_size = (size_t)G.steps * G.npad16;
    G.vp_size = G.vsteps * (size_t)G.NV * 16;
    G.s_stride = G.npad16;
    G.p_stride = round_up(G.npad16 / G.per_word, 16);
    return G;
}

static size_t kpack_bytes(int64_t n, int64_t d, int bf) { return geometry(n, d, bf).kp_size * sizeof(word); }
static size_t vpack_bytes(int64_t n, int64_t d, int bf) { return geometry(n, d, bf).vp_size * sizeof(word); }

/* Per thread: scores, softmax numerators and the unit's queries, for the largest item. */
static size_t scratch_bytes(int64_t n, int64_t d, int bf) {
    const struct geom G = geometry(n, d, bf);
    return round_up(BQ * G.s_stride * sizeof(float), 64) + round_up(BQ * G.p_stride * sizeof(word), 64)
           + round_up(BQ * (size_t)G.steps * sizeof(word), 64);
}

/* 16 lanes of a row from element i: m of them (the rest zero), as floats; a masked load only for a last
 * partial block. */
static inline __attribute__((always_inline)) __m512 load16(const void *row, int64_t i, int64_t m, const int bf) {
    const __mmask16 k = (__mmask16)((1u << m) - 1);
    if (bf) {
        const bf16 *p = (const bf16 *)row + i;
        const __m256i h = m == 16 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(k, p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const float *p = (const float *)row + i;
    return m == 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p);
}


/* Row `row` of the call's q or k rotated by its RoPE tables (d even), d elements in the input dtype into dst:
 * rope.h's products and sum in fp32, then rounded to bf16 as rope.h rounds. 16 lanes, then 8, then rope.h's
 * scalar form for the last pairs, never a masked store (measured here: masked loads and stores made the
 * rotation ~40% slower). */
static inline __attribute__((always_inline)) void rotate_row(const struct call *C, const char *src, int64_t row,
                                                             void *dst, const int bf) {
    const int64_t d = C->d;
    const float *c = C->cos + row * d, *s = C->sin + row * d;
    const __m512i swap = _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        const __m512 x = load16(src, i, 16, bf);
        const __m512 a = _mm512_mul_ps(x, _mm512_loadu_ps(c + i));
        const __m512 b = _mm512_mul_ps(_mm512_permutexvar_ps(swap, x), _mm512_loadu_ps(s + i));
        const __m512 y = _mm512_add_ps(a, b);
        if (bf) _mm256_storeu_si256((__m256i *)((bf16 *)dst + i), _mm512_cvtepi32_epi16(bf16_bits16(y)));
        else _mm512_storeu_ps((float *)dst + i, y);
    }
    if (i + 8 <= d) {
        const __m256 x = bf ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16 *)src + i))), 16))
                            : _mm256_loadu_ps((const float *)src + i);
        const __m256 a = _mm256_mul_ps(x, _mm256_loadu_ps(c + i));
        const __m256 b = _mm256_mul_ps(_mm256_permute_ps(x, 0xB1), _mm256_loadu_ps(s + i));
        const __m256 y = _mm256_add_ps(a, b);
        if (bf)
            _mm_storeu_si128((__m128i *)((bf16 *)dst + i),
                             _mm256_cvtepi32_epi16(_mm512_castsi512_si256(bf16_bits16(_mm512_castps256_ps512(y)))));
        else _mm256_storeu_ps((float *)dst + i, y);
        i += 8;
    }
    for (; i < d; i++) {
        const float y = rope_elem(load_elem(src, i, bf), load_elem(src, i ^ 1, bf), c[i], s[i]);
        if (bf) ((bf16 *)dst)[i] = f32_to_bf16(y);
        else ((float *)dst)[i] = y;
    }
}

/* Whole 32-bit words of a row: both elements of a bf16 pair inside the row (an odd head dim's last element is
 * a word of its own, upper half zero), or one float. */
static inline int64_t whole_words(int64_t d, const int bf) { return bf ? d / 2 : d; }

/* 16 lanes of byte offsets 0, stride, 2 stride, ...: a gather's rows. */
static inline __m512i lane_offsets(int64_t stride) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)stride));
}

/* Keys as [steps][keys] words and values as [key steps][columns] words: the layouts the microtiles read,
 * zero-padded so padded keys and columns contribute nothing. Data movement (and the RoPE of the keys, with
 * rope.h's bits), nothing else: how it is done cannot change a result. */
static inline __attribute__((always_inline)) void pack_head_t(const struct call *C, const struct item *it,
                                                              int64_t h, const int bf) {
    const struct geom G = geometry(it->n, C->d, bf);
    word *kp = (word *)(it->kpack + it->kp_head * h), *vp = (word *)(it->vpack + it->vp_head * h);
    const int64_t n = it->n, d = C->d, pw = G.per_word, whole = whole_words(d, bf);
    const size_t es = C->esize;
    const int64_t k_bytes = C->k_row * (int64_t)es, v_bytes = C->v_row * (int64_t)es;
    /* Keys: the [keys][words] block of 16 keys transposed by gathers, lanes past the item's end zero. Rotated
     * keys are gathered from a rotated copy of the block; others straight from k where 16 rows' byte offsets
     * fit the gather's 32-bit indices (else word by word). */
    word rot[16][MAX_D];
    const int gather = C->cos || (k_bytes > -(INT32_MAX / 16) && k_bytes < INT32_MAX / 16);
    const int64_t stride = C->cos ? (int64_t)sizeof rot[0] : k_bytes;
    const __m512i idx = lane_offsets(gather ? stride : 0);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t jn = n - j0 < 16 ? n - j0 : 16;
        const char *kr = row_of(C->k, it->row0 + j0, C->k_row, h, C->k_head, es);
        if (C->cos) {
            for (int64_t jj = 0; jj < jn; jj++) rotate_row(C, kr + jj * k_bytes, it->row0 + j0 + jj, rot[jj], bf);
            kr = (const char *)rot;
        }
        int64_t p = 0;
        if (gather) {
            const __mmask16 m = (__mmask16)((1u << jn) - 1);
            for (; p < whole; p++) {
                const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, kr + 4 * p, 1);
                _mm512_store_si512(kp + (size_t)p * G.npad16 + j0, bf ? _mm512_rol_epi32(w, 16) : w);  /* swap_pair */
            }
        }
        for (int64_t c = p * pw; c < d; c += pw, p++) {
            word *dst = kp + (size_t)p * G.npad16 + j0;
            for (int64_t jj = 0; jj < 16; jj++) dst[jj] = jj < jn ? pack_word(kr + jj * stride, c, d, bf) : 0;
        }
    }
    /* Values: rows j and j + 1 interleaved into pairs (bf16, swapped: row j in the upper halves) or copied
     * (fp32), columns past d zero. */
    for (int64_t j = 0; j < n; j += pw) {
        const char *v0 = row_of(C->v, it->row0 + j, C->v_row, h, C->v_head, es);
        word *vw = vp + (size_t)(j / pw) * G.NV * 16;
        for (int v = 0; v < G.NV; v++) {
            const int64_t m = d - 16 * v < 16 ? d - 16 * v : 16;
            __m512i w = _mm512_castps_si512(load16(v0, 16 * v, m, bf));  /* bf16: row j in the upper halves */
            if (bf && j + 1 < n)
                w = _mm512_or_si512(w, _mm512_srli_epi32(_mm512_castps_si512(load16(v0 + v_bytes, 16 * v, m, 1)), 16));
            _mm512_store_si512(vw + 16 * v, w);
        }
    }
}

/* One work unit: BQ query rows (from i0) of head h, start to finish, in this thread's scratch. */
static inline __attribute__((always_inline)) void run_unit_t(const struct call *C, const struct item *it, int64_t h,
                                                             int64_t i0, void *scratch, const int bf) {
    const int64_t n = it->n, d = C->d;
    const struct geom G = geometry(n, d, bf);
    const int rows = (int)(n - i0 < BQ ? n - i0 : BQ), steps = G.steps;
    const size_t s_stride = G.s_stride, p_stride = G.p_stride, npad16 = G.npad16;
    float *s = scratch;
    word *pb = (word *)((char *)scratch + round_up(BQ * s_stride * sizeof(float), 64));
    word *qb = (word *)((char *)pb + round_up(BQ * p_stride * sizeof(word), 64));
    float inv[BQ];
    /* Rows computed: the unit's rows rounded up to the value microtile (4 rows), then to the score microtile
     * (QK_R); rows past the unit's end are zero queries whose results are never stored. */
    const int prow = (rows + 3) / 4 * 4, srow = (prow + QK_R - 1) / QK_R * QK_R;
    const int64_t whole = whole_words(d, bf);
    for (int r = 0; r < srow; r++) {
        word *qw = qb + (size_t)r * steps;
        if (r >= rows) {
            memset(qw, 0, (size_t)steps * sizeof(word));
            continue;
        }
        const char *qr = row_of(C->q, it->row0 + i0 + r, C->q_row, h, C->q_head, C->esize);
        if (C->cos) {
            rotate_row(C, qr, it->row0 + i0 + r, qw, bf);
            if (whole < steps) qw[whole] = ((const bf16 *)qw)[2 * whole];  /* an odd d's last element alone */
        } else {
            memcpy(qw, qr, (size_t)whole * sizeof(word));
            if (whole < steps) qw[whole] = ((const bf16 *)qr)[2 * whole];
        }
        if (bf)
            for (int p = 0; p < steps; p++) qw[p] = swap_pair(qw[p]);
    }
    const word *kp = (const word *)(it->kpack + it->kp_head * h), *vp = (const word *)(it->vpack + it->vp_head * h);
    fp_set(bf);  /* the queries are rotated (IEEE, as rope.h); the products run in their dtype's mode */
    for (size_t j0 = 0; j0 < npad16; j0 += 16 * QK_C) {
        int Cn = (int)((npad16 - j0) / 16);
        if (Cn > QK_C) Cn = QK_C;
        for (int r0 = 0; r0 < srow; r0 += QK_R)
            qk_dispatch(qb + (size_t)r0 * steps, steps, kp, npad16, j0, Cn, C->scale2, s + r0 * s_stride, s_stride,
                        bf);
    }
    /* Softmax numerators in fp32 over the n real keys (zero for the padding); the sum is of the fp32 values in
     * arith.h's 16 lanes, the second product uses them rounded to the input dtype (bf16: pairs swapped, as the
     * values are; vcvtneps2bf16 rounds these normal, finite values as f32_to_bf16 does). */
    const __mmask16 tail = (n % 16) ? (__mmask16)((1u << (n % 16)) - 1) : (__mmask16)0xFFFF;
    for (int r = 0; r < prow; r++) {
        const float *sr = s + r * s_stride;
        word *pr = pb + r * p_stride;
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
            if (bf) _mm256_storeu_si256((__m256i *)((bf16 *)pr + j), (__m256i)_mm512_cvtneps_pbh(_mm512_permute_ps(e, 0xB1)));
            else _mm512_storeu_ps((float *)pr + j, e);
        }
        const float total = sum16(sum);
        inv[r] = 1.0f / total;
        if (r < rows) store_lse(C, it, h, i0 + r, mr, total);
    }
    for (int r0 = 0; r0 < rows; r0 += 4)
        pv_dispatch(pb + r0 * p_stride, p_stride, vp, G.vsteps, G.NV, inv + r0, rows - r0, (int)d,
                    C->out + ((it->row0 + i0 + r0) * C->out_row + h * C->out_head) * (int64_t)C->oesize, C->out_row,
                    bf, C->obf);
    fp_set(0);
}

BIVIT_VARIANT


#include "gemm_avx512.h"
#include "attention_amx.h"
