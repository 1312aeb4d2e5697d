/* bf16 attention on AMX tiles, for CPUs with AMX-BF16 (included by the AVX-512 variant; chosen by Python only
 * where the CPU has AMX and the OS grants its tile state).
 *
 * Why: on an AMX Xeon, bf16 dot products on AVX-512 (the variant's own attention) reach a fifth of what AMX
 * tiles do, and a large image's encode is mostly attention. Same math and the same invariance as the AVX-512
 * kernel (common.h: per-item units of BQ_AMX query rows, each computed start to finish by one thread, in an
 * order that depends only on the item's size):
 *
 *   s_j = q_i . k_j                            tdpbf16ps over the head dim in steps of 32, fp32 tiles
 *   p_j = 2^(c s_j - c max_j s_j)              c = scale * log2(e); fp32, summed in fp32, rounded to bf16 for
 *                                              the second product
 *   o_i = (sum_j p_j v_j) / (sum_j p_j)        tdpbf16ps over the keys in steps of 32, rounded to bf16 once
 *
 * Layouts (bf16, zero-padded so padding contributes nothing): queries [32 rows][dq] (dq = d rounded up to 32);
 * keys per head [key groups of 16][dq / 32 steps][16 pairs of dims][16 keys][2]; values per head [key steps of
 * 32][column tiles of 16][16 pairs of keys][16 columns][2]. Tiles: 0-3 accumulators, 4-5 A, 6-7 B, all 16 rows x
 * 64 bytes (gemm_avx512.h's AMX_CONFIG).
 */
#ifndef BIVIT_ATTENTION_AMX_H
#define BIVIT_ATTENTION_AMX_H

#define BQ_AMX 32

struct amx_geom {
    int64_t dq, dsteps, dtiles, npad, ksteps;  /* ksteps: key steps of 32 */
    size_t s_stride, kp_elems, vp_elems;
};

static inline struct amx_geom amx_geometry(int64_t n, int64_t d) {
    struct amx_geom G;
    G.dq = (int64_t)round_up((size_t)d, 32);
    G.dsteps = G.dq / 32;
    G.dtiles = (int64_t)round_up((size_t)d, 16) / 16;
    G.npad = (int64_t)round_up((size_t)(n ? n : 1), 32);
    G.ksteps = G.npad / 32;
    G.s_stride = (size_t)G.npad;
    G.kp_elems = (size_t)(G.npad / 16) * G.dsteps * 512;
    G.vp_elems = (size_t)G.ksteps * G.dtiles * 512;
    return G;
}

static size_t amx_attn_kpack_bytes(int64_t n, int64_t d, int bf) { (void)bf; return amx_geometry(n, d).kp_elems * 2; }
static size_t amx_attn_vpack_bytes(int64_t n, int64_t d, int bf) { (void)bf; return amx_geometry(n, d).vp_elems * 2; }

/* Per thread: scores [32][npad] fp32, numerators [32][npad] bf16, queries [32][dq] bf16, the output tiles
 * [32][dtiles * 16] fp32. */
static size_t amx_attn_scratch_bytes(int64_t n, int64_t d, int bf) {
    (void)bf;
    const struct amx_geom G = amx_geometry(n, d);
    return round_up(BQ_AMX * G.s_stride * 4, 64) + round_up(BQ_AMX * G.s_stride * 2, 64)
           + round_up(BQ_AMX * (size_t)G.dq * 2, 64) + round_up(BQ_AMX * (size_t)G.dtiles * 16 * 4, 64);
}

/* 2^x for x <= 0 to about 2e-7 relative (degree-6 minimax-like Taylor form of 2^f on [-0.5, 0.5]): the
 * numerators are rounded to bf16 for the second product, so the AVX-512 kernel's degree 7 buys nothing here. */
static inline __m512 exp2_amx(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-04f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Keys and values of head h in the tile layouts (keys rotated by the RoPE tables, with rope.h's bits): data
 * movement only. */
static void amx_pack_head(const struct call *C, const struct item *it, int64_t h) {
    const struct amx_geom G = amx_geometry(it->n, C->d);
    bf16 *kp = (bf16 *)(it->kpack + it->kp_head * h), *vp = (bf16 *)(it->vpack + it->vp_head * h);
    const int64_t n = it->n, d = C->d;
    memset(kp, 0, G.kp_elems * 2);
    memset(vp, 0, G.vp_elems * 2);
    bf16 row[MAX_D + 32];
    for (int64_t j = 0; j < n; j++) {
        const char *kr = row_of(C->k, it->row0 + j, C->k_row, h, C->k_head, 2);
        if (C->cos) rotate_row(C, kr, it->row0 + j, row, 1);
        else memcpy(row, kr, (size_t)d * 2);
        bf16 *g = kp + (size_t)(j / 16) * G.dsteps * 512 + (j % 16) * 2;
        for (int64_t c = 0; c < d; c++) g[(c / 32) * 512 + ((c % 32) / 2) * 32 + (c % 2)] = row[c];
        const bf16 *vr = (const bf16 *)row_of(C->v, it->row0 + j, C->v_row, h, C->v_head, 2);
        bf16 *t = vp + (size_t)(j / 32) * G.dtiles * 512 + ((j % 32) / 2) * 32 + (j % 2);
        for (int64_t c = 0; c < d; c++) t[(c / 16) * 512 + (c % 16) * 2] = vr[c];
    }
}

/* S[32][32 keys from j0] = Q . K^T for key groups g0, g0 + 1: two row halves x two key groups. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_scores(const bf16 *q, int64_t dq, const bf16 *kp,
                                                                    int64_t dsteps, int64_t g0, float *s,
                                                                    size_t s_stride) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const bf16 *k0 = kp + (size_t)g0 * dsteps * 512, *k1 = k0 + (size_t)dsteps * 512;
    for (int64_t t = 0; t < dsteps; t++) {
        _tile_loadd(4, q + 32 * t, dq * 2);
        _tile_loadd(5, q + 16 * dq + 32 * t, dq * 2);
        _tile_loadd(6, k0 + t * 512, 64);
        _tile_loadd(7, k1 + t * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    const float *dst = s + g0 * 16;
    _tile_stored(0, dst, s_stride * 4);
    _tile_stored(1, dst + 16, s_stride * 4);
    _tile_stored(2, dst + 16 * s_stride, s_stride * 4);
    _tile_stored(3, dst + 16 * s_stride + 16, s_stride * 4);
}

/* O[32][16 columns of tiles v0 (and v0 + 1 when two)] = P . V over every key step. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_values(const bf16 *p, size_t p_stride, const bf16 *vp,
                                                                    int64_t ksteps, int64_t dtiles, int64_t v0,
                                                                    int two, float *o, size_t o_stride) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < ksteps; t++) {
        const bf16 *vt = vp + ((size_t)t * dtiles + v0) * 512;
        _tile_loadd(4, p + 32 * t, p_stride * 2);
        _tile_loadd(5, p + 16 * p_stride + 32 * t, p_stride * 2);
        _tile_loadd(6, vt, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, vt + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float *dst = o + v0 * 16;
    _tile_stored(0, dst, o_stride * 4);
    _tile_stored(2, dst + 16 * o_stride, o_stride * 4);
    if (two) {
        _tile_stored(1, dst + 16, o_stride * 4);
        _tile_stored(3, dst + 16 * o_stride + 16, o_stride * 4);
    }
}

/* One work unit: BQ_AMX query rows (from i0) of head h, start to finish, in this thread's scratch. */
static void amx_run_unit(const struct call *C, const struct item *it, int64_t h, int64_t i0, void *scratch) {
    const int64_t n = it->n, d = C->d;
    const struct amx_geom G = amx_geometry(n, d);
    const int rows = (int)(n - i0 < BQ_AMX ? n - i0 : BQ_AMX);
    const size_t ss = G.s_stride, os = (size_t)G.dtiles * 16;
    float *s = scratch;
    bf16 *p = (bf16 *)((char *)scratch + round_up(BQ_AMX * ss * 4, 64));
    bf16 *q = (bf16 *)((char *)p + round_up(BQ_AMX * ss * 2, 64));
    float *o = (float *)((char *)q + round_up(BQ_AMX * (size_t)G.dq * 2, 64));
    memset(q, 0, (size_t)BQ_AMX * G.dq * 2);
    for (int r = 0; r < rows; r++) {
        const char *qr = row_of(C->q, it->row0 + i0 + r, C->q_row, h, C->q_head, 2);
        if (C->cos) rotate_row(C, qr, it->row0 + i0 + r, q + (size_t)r * G.dq, 1);
        else memcpy(q + (size_t)r * G.dq, qr, (size_t)d * 2);
    }
    const bf16 *kp = (const bf16 *)(it->kpack + it->kp_head * h), *vp = (const bf16 *)(it->vpack + it->vp_head * h);
    amx_enter();
    for (int64_t g = 0; g < G.npad / 16; g += 2) amx_scores(q, G.dq, kp, G.dsteps, g, s, ss);
    /* Softmax numerators over the n real keys (zero for the padding and for rows past the unit's end): the max
     * of the raw scores (scale2 > 0 keeps the order), then 2^(scale2 s - scale2 max) by exp2_amx. */
    float inv[BQ_AMX];
    const __m512 scale = _mm512_set1_ps(C->scale2);
    const __mmask16 tail = (n % 16) ? (__mmask16)((1u << (n % 16)) - 1) : (__mmask16)0xFFFF;
    for (int r = 0; r < BQ_AMX; r++) {
        const float *sr = s + r * ss;
        bf16 *pr = p + r * ss;
        if (r >= rows) {
            memset(pr, 0, ss * 2);
            continue;
        }
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
        if (j < n) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(sr + j));
        const float mr = _mm512_reduce_max_ps(mx) * C->scale2;
        const __m512 m = _mm512_set1_ps(-mr);
        __m512 sum = _mm512_setzero_ps();
        for (j = 0; j < G.npad; j += 16) {
            __m512 e = exp2_amx(_mm512_fmadd_ps(_mm512_loadu_ps(sr + j), scale, m));
            if (j + 16 > n) e = j < n ? _mm512_maskz_mov_ps(tail, e) : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[r] = 1.0f / total;
        store_lse(C, it, h, i0 + r, mr, total);
    }
    for (int64_t v = 0; v < G.dtiles; v += 2)
        amx_values(p, ss, vp, G.ksteps, G.dtiles, v, v + 1 < G.dtiles, o, os);
    amx_leave();
    for (int r = 0; r < rows; r++) {
        char *out = C->out + ((it->row0 + i0 + r) * C->out_row + h * C->out_head) * (int64_t)C->oesize;
        const __m512 iv = _mm512_set1_ps(inv[r]);
        for (int64_t c = 0; c < d; c += 16) {
            const int64_t m = d - c < 16 ? d - c : 16;
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(o + r * os + c), iv);
            if (C->obf)
                _mm256_mask_storeu_epi16((bf16 *)out + c, (__mmask16)((1u << m) - 1), _mm512_cvtepi32_epi16(bf16_bits16(y)));
            else
                _mm512_mask_storeu_ps((float *)out + c, (__mmask16)((1u << m) - 1), y);
        }
    }
}

static const struct variant AMX_VARIANT = {BQ_AMX, amx_attn_kpack_bytes, amx_attn_vpack_bytes, amx_attn_scratch_bytes,
                                           amx_pack_head, amx_run_unit};

/* bf16 only (fp32 attention runs the AVX-512 kernel); the arguments of bivit_attention_bf16. */
int bivit_attention_amx_bf16(const struct bivit_attention_args *a) {
    struct call C = call_of(a, 1);
    return run_call(&AMX_VARIANT, &C, a->cu, a->count, a->threads);
}

#endif
