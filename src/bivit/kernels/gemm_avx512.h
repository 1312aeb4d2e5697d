/* The AVX-512 variant's GEMM kernels (gemm.h says what every kernel guarantees):
 *
 *   kind 0  fp32 weights and inputs (bf16 inputs widened exactly): 8 rows x 48 columns of fp32 FMAs
 *   kind 1  bf16: AVX-512 BF16 pair products (vdpbf16ps), 8 rows x 48 columns, fp32 accumulators
 *   kind 2  bf16 on AMX tiles (tdpbf16ps): 32 rows x 32 columns per step, fp32 accumulators in tiles
 *   kind 3  kind 2 with every bf16 pair swapped (as kind 1 stores them)
 *
 * Kinds 0 and 1 compute bivit-arith/1 (kind 1 stores each bf16 pair swapped, element k + 1 in the lower half,
 * because vdpbf16ps adds the upper product first: the chain then runs in k order, flushed, as arith.h's).
 * What tdpbf16ps computes per instruction is not documented precisely enough to rely on: kinds 2 and 3 are the
 * two orders a chain of pair products could take, and the load-time conformance check (`bivit.ops.bits`) says
 * whether either computes bivit-arith/1 on this CPU; where neither does, AMX runs only when asked for
 * (BIVIT_ARITH=native, its own class of bits).
 */
#ifndef BIVIT_GEMM_AVX512_H
#define BIVIT_GEMM_AVX512_H

#include <sys/syscall.h>
#include <unistd.h>

#include "gemm.h"

static inline uint32_t load_u32(const void *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

static inline __m512 gelu16(__m512 x, const int act) {
    GELU_BODY(__m512, _mm512, x, act);
}

/* Row i's results at columns j0.. (NV vectors of 16): acc + bias, rounded to the output dtype, the columns that
 * exist (below N). */
static inline __attribute__((always_inline)) void store_row(const struct gemm_call *C, int64_t i, int64_t j0,
                                                             const __m512 *acc, const int NV) {
#pragma GCC unroll 3
    for (int c = 0; c < NV; c++) {
        const int64_t j = j0 + 16 * c, m = C->N - j < 16 ? C->N - j : 16;
        if (m <= 0) return;
        const __mmask16 k = (__mmask16)((1u << m) - 1);
        /* + bias (0 where there is none: acc + 0 is what every kernel computes, -0 becoming +0) */
        __m512 v = _mm512_add_ps(acc[c], C->bias ? _mm512_maskz_loadu_ps(k, C->bias + j) : _mm512_setzero_ps());
        if (C->act) v = gelu16(v, C->act);
        if (C->yt == E_BF16)
            _mm256_mask_storeu_epi16((bf16 *)C->y + i * C->y_row + j, k, _mm512_cvtepi32_epi16(bf16_bits16(v)));
        else if (C->yt == E_F16)
            _mm256_mask_storeu_epi16((uint16_t *)C->y + i * C->y_row + j, k,
                                     _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        else
            _mm512_mask_storeu_ps((float *)C->y + i * C->y_row + j, k, v);
    }
}

#define MR512 8   /* rows per microtile of kinds 0 and 1: 24 accumulators, 3 weight vectors, 1 broadcast */
#define NR512 48  /* columns per panel of kinds 0 and 1 */

/* ---- kind 0: fp32. Panel p: [K][48] floats. ---- */

#define NR NR512
GEMM_F32_PACK
#undef NR

static inline __attribute__((always_inline)) void f32_micro(const struct gemm_call *C, const float *x0, int64_t xs,
                                                             int64_t i0, const int R, const float *bp, int64_t j0) {
    __m512 acc[MR512][3];
#pragma GCC unroll 8
    for (int r = 0; r < MR512; r++)
#pragma GCC unroll 3
        for (int c = 0; c < 3; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < C->K; k++) {
        const float *b = bp + k * NR512;
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
#pragma GCC unroll 8
        for (int r = 0; r < MR512; r++) {
            if (r >= R) break;
            const __m512 a = _mm512_set1_ps(x0[r * xs + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
        }
    }
    if (C->flush && (C->K & 1))  /* bf16 pairs: an odd K's last pair is (x, 0) . (w, 0) */
        for (int r = 0; r < MR512; r++)
            for (int c = 0; c < 3; c++) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_setzero_ps());
#pragma GCC unroll 8
    for (int r = 0; r < MR512; r++)
        if (r < R) store_row(C, i0 + r, j0, acc[r], 3);
}

/* ---- kind 1: bf16 pairs. Panel p: [ceil(K/2)][48] words, each the pair (w[k], w[k + 1]) of a column swapped
 * (w[k + 1] in the lower half: vdpbf16ps adds the upper product first); an odd K's last pair is (w[K - 1], 0).
 * The rows' pairs are swapped the same way as they are read (dp_word). ---- */

static size_t dp_packed_bytes(int64_t N, int64_t K) { return (size_t)ceil_div(N, NR512) * ceil_div(K, 2) * NR512 * 4; }

static void dp_pack_panel(const char *w, int64_t w_row, int wt, int64_t N, int64_t K, int64_t p, char *out) {
    bf16 *o = (bf16 *)out;
    const bf16 *wb = (const bf16 *)w;
    (void)wt;  /* bf16 weights only */
    for (int64_t q = 0; q < ceil_div(K, 2); q++)
        for (int64_t c = 0; c < NR512; c++)
            for (int e = 0; e < 2; e++) {
                const int64_t j = p * NR512 + c, k = 2 * q + 1 - e;  /* lower half: k + 1; upper: k */
                o[(q * NR512 + c) * 2 + e] = (j < N && k < K) ? wb[j * w_row + k] : 0;
            }
}

/* The pair (x[k], x[k + 1]) of a row as one swapped word (x[k + 1] in the lower half), or for an odd K's last
 * pair (`last`), (x[k], 0). Swapped in a general register between the load and the broadcast, where it takes
 * no vector port from vdpbf16ps: a vector rotate per broadcast made the GEMM 22% slower here (AMD EPYC, AVX-512
 * BF16), and a swapped copy of the rows, once per call, 0.5-3% in the model (its memory traffic). */
static inline uint32_t dp_word(const bf16 *x, int64_t k, const int last) {
    if (last) return (uint32_t)x[k] << 16;
    const uint32_t u = load_u32(x + k);
    return (u >> 16) | (u << 16);
}

/* Row r of x (K bf16) as ceil(K/2) swapped pair words at dst (an odd K's last word (x[K - 1], 0)): AMX kind 3's
 * rows. */
static inline void dp_swap_row(const bf16 *x, int64_t K, uint32_t *dst) {
    const int64_t pairs = K / 2;
    int64_t q = 0;
    for (; q + 16 <= pairs; q += 16)
        _mm512_storeu_si512(dst + q, _mm512_rol_epi32(_mm512_loadu_si512(x + 2 * q), 16));
    for (; q < pairs; q++) dst[q] = dp_word(x, 2 * q, 0);
    if (K % 2) dst[pairs] = dp_word(x, K - 1, 1);
}

/* acc[r] += row r's pair at k (x0 + r x_row) . the 48 column words at b (vdpbf16ps: x[k] w[k], then x[k + 1]
 * w[k + 1]). */
static inline __attribute__((always_inline)) void dp_step(__m512 acc[MR512][3], const int R, const bf16 *x0,
                                                           int64_t x_row, int64_t k, const bf16 *b, const int last) {
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 32), b2 = _mm512_loadu_si512(b + 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR512; r++) {
        if (r >= R) break;
        const __m512i a = _mm512_set1_epi32((int)dp_word(x0 + r * x_row, k, last));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)a, (__m512bh)b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)a, (__m512bh)b1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)a, (__m512bh)b2);
    }
}

/* R rows from row i0 against the panel bp. */
static inline __attribute__((always_inline)) void dp_micro(const struct gemm_call *C, int64_t i0, const int R,
                                                            const bf16 *bp, int64_t j0) {
    const bf16 *x0 = (const bf16 *)C->x + i0 * C->x_row;
    const int64_t pairs = C->K / 2;
    __m512 acc[MR512][3];
#pragma GCC unroll 8
    for (int r = 0; r < MR512; r++)
#pragma GCC unroll 3
        for (int c = 0; c < 3; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; q++) dp_step(acc, R, x0, C->x_row, 2 * q, bp + q * NR512 * 2, 0);
    if (C->K % 2) dp_step(acc, R, x0, C->x_row, C->K - 1, bp + pairs * NR512 * 2, 1);
#pragma GCC unroll 8
    for (int r = 0; r < MR512; r++)
        if (r < R) store_row(C, i0 + r, j0, acc[r], 3);
}

/* A block of kinds 0 and 1: microtiles of MR512 rows (the last one shorter: the same instructions per row),
 * each against panels p0..p1. */
#define MB512 64

#define MR MR512
#define NR NR512
#define MB MB512
GEMM_F32_BLOCK
#undef MB
#undef MR
#undef NR

static size_t dp_scratch(int64_t K) { (void)K; return 64; }

static void dp_block(const struct gemm_call *C, int64_t i0, int64_t rows, int64_t p0, int64_t p1, void *scratch) {
    (void)scratch;
    const size_t panel = (size_t)ceil_div(C->K, 2) * NR512 * 2;
    for (int64_t p = p0; p < p1; p++)
        for (int64_t r0 = 0; r0 < rows; r0 += MR512) {
            const int R = rows - r0 < MR512 ? (int)(rows - r0) : MR512;
            const bf16 *bp = (const bf16 *)C->w + p * panel;
            if (R == MR512) dp_micro(C, i0 + r0, MR512, bp, p * NR512);  /* as in GEMM_F32_BLOCK */
            else dp_micro(C, i0 + r0, R, bp, p * NR512);
        }
}

#define F32_FMA(acc, a) _mm512_fmadd_ps(a, a, acc)
#define DP_BF16(acc, a) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(a))
GEMM_PEAK_DEF(f32_peak, __m512, _mm512_setzero_ps(), __m512, _mm512_set1_ps(1e-3f), F32_FMA, MR512 * 3, 32)
GEMM_PEAK_DEF(dp_peak, __m512, _mm512_setzero_ps(), __m512i, _mm512_set1_epi32(0x3A833A83), DP_BF16, MR512 * 3, 64)

static const struct gemm_kernel KERNEL_F32 = {MB512, NR512, 512 * 1024, f32_packed_bytes, f32_pack_panel, f32_scratch, NULL, NULL,
                                            f32_block, f32_peak};
static const struct gemm_kernel KERNEL_DP = {MB512, NR512, 512 * 1024, dp_packed_bytes, dp_pack_panel, dp_scratch, NULL, NULL,
                                           dp_block, dp_peak};

/* ---- kind 2: AMX. 32 rows x 32 columns per step of 32 k: C tiles 0-3 (2 x 2 of 16 x 16 fp32), A tiles 4-5
 * (16 rows x 32 bf16), B tiles 6-7 (16 pairs of k x 16 columns). Panel p: [ceil(K/32)][2 halves][16 pairs][16
 * columns][2] bf16. Rows come straight from x when a chunk has 32 rows and K is a multiple of 32, else from a
 * zero-padded copy (the same values: a tile row's results depend on that row alone). ---- */

#define AMX_R 32
#define AMX_N 32

static inline int64_t amx_steps(int64_t K) { return ceil_div(K, 32); }

static size_t amx_packed_bytes(int64_t N, int64_t K) {
    return (size_t)ceil_div(N, AMX_N) * amx_steps(K) * 1024 * 2;
}

/* `swap`: each pair's elements exchanged (kind 3). */
static void amx_pack(const char *w, int64_t w_row, int64_t N, int64_t K, int64_t p, char *out, const int swap) {
    bf16 *o = (bf16 *)out;
    const bf16 *wb = (const bf16 *)w;
    for (int64_t s = 0; s < amx_steps(K); s++)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t j = p * AMX_N + 16 * h + c, k = 32 * s + 2 * r + (swap ? 1 - e : e);
                        o[((s * 2 + h) * 16 + r) * 32 + c * 2 + e] = (j < N && k < K) ? wb[j * w_row + k] : 0;
                    }
}

static void amx_pack_panel(const char *w, int64_t w_row, int wt, int64_t N, int64_t K, int64_t p, char *out) {
    (void)wt;
    amx_pack(w, w_row, N, K, p, out, 0);
}

static void amx_pack_panel_swapped(const char *w, int64_t w_row, int wt, int64_t N, int64_t K, int64_t p, char *out) {
    (void)wt;
    amx_pack(w, w_row, N, K, p, out, 1);
}

/* Steps of 32 k per pass over a task's panels: a row chunk's A rows for one pass (32 x 256 bf16, 16 KB) stay in
 * the core's L1 while each panel's B tiles stream past; the accumulators go to a per-panel buffer between
 * passes (exact: fp32 stored and reloaded, the K order unchanged). */
#define AMX_KSTEPS 8

/* Packed weights per task: 1.5 MB, within the 2 MB L2 of the AMX Xeons' cores (a task of few panels at a large K
 * reads its rows again for every panel). */
#define AMX_TASK_BYTES (1536 * 1024)

/* Panels per task at most (gemm.h's panels_per_task for this K), for the accumulators' buffer. */
static inline int64_t amx_max_panels(int64_t K) {
    const int64_t pt = (int64_t)(AMX_TASK_BYTES / amx_packed_bytes(AMX_N, K));
    return pt < 1 ? 1 : pt;
}

static size_t amx_scratch_bytes(int64_t K) {
    return (size_t)AMX_R * amx_steps(K) * 32 * 2 + AMX_R * 32 * 2 + (size_t)amx_max_panels(K) * AMX_R * AMX_N * 4;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile 16 rows x 64 bytes. A static object: GCC 12's _tile_loadconfig tells the compiler it reads only a
 * pointer's worth of its argument, so the stores filling a local configuration could be dropped. */
static const struct tile_config AMX_CONFIG __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

__attribute__((target("amx-tile"))) static void amx_enter(void) { _tile_loadconfig(&AMX_CONFIG); }

__attribute__((target("amx-tile"))) static void amx_leave(void) { _tile_release(); }

/* One step of 32 k: rows 0-15 and 16-31 of a (lda apart) times the panel step's two 16-column halves at b. */
__attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline void amx_step(const bf16 *a, int64_t lda,
                                                                                        const bf16 *b) {
    _tile_loadd(4, a, lda * 2);
    _tile_loadd(5, a + 16 * lda, lda * 2);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* 32 rows of a (lda apart) against panel bp, steps s0..s1 of 32 k straight from a, then, when `tail` is not NULL,
 * the last step from tail ([32 rows][32] bf16: the last K % 32 values of each row, zero-padded): accumulators
 * from c (zero when `first`), back into c ([32][32] fp32). */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_micro(const bf16 *a, int64_t lda, const bf16 *bp,
                                                                   int64_t s0, int64_t s1, const bf16 *tail,
                                                                   int64_t tail_step, int first, float *c) {
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c, AMX_N * 4);
        _tile_loadd(1, c + 16, AMX_N * 4);
        _tile_loadd(2, c + 16 * AMX_N, AMX_N * 4);
        _tile_loadd(3, c + 16 * AMX_N + 16, AMX_N * 4);
    }
    for (int64_t s = s0; s < s1; s++) amx_step(a + 32 * s, lda, bp + s * 1024);
    if (tail) amx_step(tail, 32, bp + tail_step * 1024);
    _tile_stored(0, c, AMX_N * 4);
    _tile_stored(1, c + 16, AMX_N * 4);
    _tile_stored(2, c + 16 * AMX_N, AMX_N * 4);
    _tile_stored(3, c + 16 * AMX_N + 16, AMX_N * 4);
}

/* Rows r0.. of a block: 32 rows straight from x (the last K % 32 of each copied, zero-padded, into `tailbuf`),
 * or, for a chunk of fewer rows or when pairs are swapped (`swap`, kind 3), all of them copied zero-padded into
 * `apad`. */
static inline void amx_rows(const struct gemm_call *C, int64_t i0, int64_t rows, int64_t p0, int64_t p1,
                            void *scratch, const int swap) {
    const int64_t steps = amx_steps(C->K), kpad = steps * 32, whole = C->K / 32, rest = C->K - whole * 32;
    bf16 *apad = (bf16 *)scratch, *tailbuf = apad + AMX_R * kpad;
    float *cbuf = (float *)(tailbuf + AMX_R * 32);
    const size_t panel = (size_t)steps * 1024;
    for (int64_t r0 = 0; r0 < rows; r0 += AMX_R) {
        const int64_t R = rows - r0 < AMX_R ? rows - r0 : AMX_R;
        const bf16 *a = (const bf16 *)C->x + (i0 + r0) * C->x_row, *tail = NULL;
        int64_t lda = C->x_row, direct = whole;
        if (R < AMX_R || swap) {
            memset(apad, 0, (size_t)AMX_R * kpad * 2);
            for (int64_t r = 0; r < R; r++) {
                if (swap) dp_swap_row(a + r * C->x_row, C->K, (uint32_t *)(apad + r * kpad));
                else memcpy(apad + r * kpad, a + r * C->x_row, (size_t)C->K * 2);
            }
            a = apad;
            lda = kpad;
            direct = steps;
        } else if (rest) {
            memset(tailbuf, 0, AMX_R * 32 * 2);
            for (int64_t r = 0; r < AMX_R; r++) memcpy(tailbuf + r * 32, a + r * C->x_row + whole * 32, (size_t)rest * 2);
            tail = tailbuf;
        }
        for (int64_t s0 = 0; s0 < direct || (s0 == direct && tail); s0 += AMX_KSTEPS) {
            const int64_t s1 = s0 + AMX_KSTEPS < direct ? s0 + AMX_KSTEPS : direct;
            const int last = s0 + AMX_KSTEPS >= direct;
            for (int64_t p = p0; p < p1; p++)
                amx_micro(a, lda, (const bf16 *)C->w + p * panel, s0, s1, last ? tail : NULL, direct, s0 == 0,
                          cbuf + (p - p0) * AMX_R * AMX_N);
            if (last) break;
        }
        for (int64_t p = p0; p < p1; p++) {
            const float *c = cbuf + (p - p0) * AMX_R * AMX_N;
            for (int64_t r = 0; r < R; r++) {
                const __m512 acc[2] = {_mm512_loadu_ps(c + r * AMX_N), _mm512_loadu_ps(c + r * AMX_N + 16)};
                store_row(C, i0 + r0 + r, p * AMX_N, acc, 2);
            }
        }
    }
}

static void amx_block(const struct gemm_call *C, int64_t i0, int64_t rows, int64_t p0, int64_t p1, void *scratch) {
    amx_rows(C, i0, rows, p0, p1, scratch, 0);
}

static void amx_block_swapped(const struct gemm_call *C, int64_t i0, int64_t rows, int64_t p0, int64_t p1,
                              void *scratch) {
    amx_rows(C, i0, rows, p0, p1, scratch, 1);
}

static const struct gemm_kernel KERNEL_AMX = {64, AMX_N, AMX_TASK_BYTES, amx_packed_bytes, amx_pack_panel, amx_scratch_bytes,
                                            amx_enter, amx_leave, amx_block};
static const struct gemm_kernel KERNEL_AMX_SWAPPED = {64, AMX_N, AMX_TASK_BYTES, amx_packed_bytes, amx_pack_panel_swapped,
                                                    amx_scratch_bytes, amx_enter, amx_leave, amx_block_swapped};

/* Linux lends AMX's tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA);
 * 0 when granted. */
int bivit_amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

static const struct gemm_kernel *gemm_kernel_of(int kind) {
    switch (kind) {
        case GEMM_FP32: return &KERNEL_F32;
        case GEMM_AVX512_BF16: return &KERNEL_DP;
        case GEMM_AMX: return &KERNEL_AMX;
        case GEMM_AMX_SWAPPED: return &KERNEL_AMX_SWAPPED;
        default: return NULL;
    }
}

BIVIT_GEMM_ENTRIES

#endif
