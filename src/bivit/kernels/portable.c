/* bivit-arith/1 in plain C, for any CPU with a C compiler: the portable variant (no instruction-set flags, no
 * intrinsics but the denormal-mode switch of arith.h).
 *
 * What it is for: the same bits as the vector variants on a CPU none of them runs on (an x86 without AVX2, an Arm
 * server), slowly; and, everywhere, the kernel the conformance check and the tests hold every other kernel to
 * (its arithmetic is arith.h's scalar definitions, written once, in the order docs/arithmetic.md states). Loops
 * run over independent accumulators innermost, so a compiler may vectorise them without reordering any sum.
 *
 * GEMM: y = act(chain_k fma(x, w, acc) + bias), microtiles of MR_P rows x NR_P columns. Attention, per query
 * row: scores as fma chains over the head dim, the row max, exp2_neg, the 16-lane sum, the numerators (bf16:
 * rounded to bf16) and the values' chains in chunks of 128 keys. Items, units and invariance: common.h.
 */
#include "common.h"
#include "gemm.h"
#include "norm.h"

/* ---------------------------------------------------------------------------------------------- attention */

#define BQ 16          /* query rows per work unit */

/* Keys and values of a head as [n][d] floats: keys rotated (rope.h's bits, rounded to the input dtype). */
static size_t kpack_bytes(int64_t n, int64_t d, int bf) { (void)bf; return (size_t)n * d * sizeof(float); }
static size_t vpack_bytes(int64_t n, int64_t d, int bf) { (void)bf; return (size_t)n * d * sizeof(float); }

/* Per thread: one row's scores and numerators, its query, and the values' partial and total sums. */
static size_t scratch_bytes(int64_t n, int64_t d, int bf) { (void)bf; return (2 * (size_t)n + 3 * d) * sizeof(float); }

/* Row `row` of q or k, rotated by the call's RoPE tables when it has them, as the kernels read it: d floats. */
static void widen_qk(const struct call *C, float *dst, const char *src, int64_t row, const int bf) {
    const int64_t d = C->d;
    if (!C->cos) {
        for (int64_t i = 0; i < d; i++) dst[i] = load_elem(src, i, bf);
        return;
    }
    const float *c = C->cos + row * d, *s = C->sin + row * d;
    for (int64_t i = 0; i < d; i++) {
        const float y = rope_elem(load_elem(src, i, bf), load_elem(src, i ^ 1, bf), c[i], s[i]);
        dst[i] = bf ? bf16_to_f32(f32_to_bf16(y)) : y;
    }
}

static void pack_head_t(const struct call *C, const struct item *it, int64_t h, const int bf) {
    const int64_t d = C->d;
    float *kp = (float *)(it->kpack + it->kp_head * h), *vp = (float *)(it->vpack + it->vp_head * h);
    for (int64_t j = 0; j < it->n; j++) {
        widen_qk(C, kp + j * d, row_of(C->k, it->row0 + j, C->k_row, h, C->k_head, C->esize), it->row0 + j, bf);
        const char *vr = row_of(C->v, it->row0 + j, C->v_row, h, C->v_head, C->esize);
        for (int64_t c = 0; c < d; c++) vp[j * d + c] = load_elem(vr, c, bf);
    }
}

static void run_unit_t(const struct call *C, const struct item *it, int64_t h, int64_t i0, void *scratch,
                       const int bf) {
    const int64_t n = it->n, d = C->d;
    const int rows = (int)(n - i0 < BQ ? n - i0 : BQ);
    const float *kp = (const float *)(it->kpack + it->kp_head * h), *vp = (const float *)(it->vpack + it->vp_head * h);
    float *s = scratch, *p = s + n, *q = p + n, *part = q + d, *tot = part + d;
    for (int r = 0; r < rows; r++) {
        const int64_t row = it->row0 + i0 + r;
        widen_qk(C, q, row_of(C->q, row, C->q_row, h, C->q_head, C->esize), row, bf);  /* IEEE, as rope.h */
        fp_set(bf);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < d; c++) acc = fmaf(q[c], kp[j * d + c], acc);
            if (bf && (d & 1)) acc = acc + 0.0f;  /* a bf16 pair's padding: 0 x 0 */
            s[j] = acc * C->scale2;
            mx = s[j] > mx ? s[j] : mx;
        }
        float lane[16] = {0};
        for (int64_t j = 0; j < n; j++) {
            const float e = exp2_neg_s(s[j] - mx);
            lane[j % 16] = lane[j % 16] + e;
            p[j] = bf ? bf16_to_f32(f32_to_bf16(e)) : e;
        }
        const float total = lanes16_sum(lane), inv = 1.0f / total;
        store_lse(C, it, h, i0 + r, mx, total);
        for (int64_t c = 0; c < d; c++) tot[c] = 0.0f;
        for (int64_t c0 = 0; c0 < n; c0 += PV_CHUNK) {
            const int64_t c1 = c0 + PV_CHUNK < n ? c0 + PV_CHUNK : n;
            for (int64_t c = 0; c < d; c++) part[c] = 0.0f;
            for (int64_t j = c0; j < c1; j++)
                for (int64_t c = 0; c < d; c++) part[c] = fmaf(p[j], vp[j * d + c], part[c]);
            if (bf && (n & 1) && c1 == n)  /* keys in bf16 pairs: an odd n's last pair is (p, 0) */
                for (int64_t c = 0; c < d; c++) part[c] = part[c] + 0.0f;
            for (int64_t c = 0; c < d; c++) tot[c] = tot[c] + part[c];
        }
        char *out = C->out + (row * C->out_row + h * C->out_head) * (int64_t)C->oesize;
        for (int64_t c = 0; c < d; c++) elem_store(out, c, C->obf ? E_BF16 : E_F32, tot[c] * inv);
        fp_set(0);
    }
}

BIVIT_VARIANT

/* ---------------------------------------------------------------------------------------------------- GEMM */

#define MR_P 4
#define NR_P 16
#define MB_P 32

#define NR NR_P
GEMM_F32_PACK
#undef NR

static inline void f32_micro(const struct gemm_call *C, const float *x0, int64_t xs, int64_t i0, const int R,
                             const float *bp, int64_t j0) {
    float acc[MR_P][NR_P];
    for (int r = 0; r < MR_P; r++)
        for (int c = 0; c < NR_P; c++) acc[r][c] = 0.0f;
    for (int64_t k = 0; k < C->K; k++)
        for (int r = 0; r < R; r++) {
            const float a = x0[r * xs + k];
            for (int c = 0; c < NR_P; c++) acc[r][c] = fmaf(a, bp[k * NR_P + c], acc[r][c]);
        }
    if (C->flush && (C->K & 1))  /* bf16 pairs: an odd K's last pair is (x, 0) */
        for (int r = 0; r < R; r++)
            for (int c = 0; c < NR_P; c++) acc[r][c] = acc[r][c] + 0.0f;
    const int64_t m = C->N - j0 < NR_P ? C->N - j0 : NR_P;
    for (int r = 0; r < R; r++) {
        char *y = C->y + (i0 + r) * C->y_row * (int64_t)esize_of(C->yt);
        for (int64_t c = 0; c < m; c++) {
            float v = acc[r][c] + (C->bias ? C->bias[j0 + c] : 0.0f);
            if (C->act) v = gelu_s(v, C->act);
            elem_store(y, j0 + c, C->yt, v);
        }
    }
}

#define MR MR_P
#define NR NR_P
#define MB MB_P
GEMM_F32_BLOCK
#undef MB
#undef MR
#undef NR

static const struct gemm_kernel KERNEL_F32 = {MB_P, NR_P, 256 * 1024, f32_packed_bytes, f32_pack_panel, f32_scratch,
                                            NULL, NULL, f32_block};

static const struct gemm_kernel *gemm_kernel_of(int kind) { return kind == GEMM_FP32 ? &KERNEL_F32 : NULL; }

int bivit_amx_init(void) { return -1; }

BIVIT_GEMM_ENTRIES
