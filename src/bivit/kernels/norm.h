/* LayerNorm and RMSNorm of bivit-arith/1, compiled into every variant's library from this one plain-C source.
 *
 * Why bivit's own: PyTorch's CPU LayerNorm sums a row in as many lanes as its vector type has (8 on AVX2, 16
 * on AVX-512, 4 on NEON), so its bits depend on the CPU kind. Here a row's sums run in 16 lanes whatever the
 * vector width (arith.h's lanes16_sum), each lane an independent chain, so the compiler vectorises the lanes
 * without reordering anything (-ffp-contract=off, no fast-math): the same bits from every variant's build.
 *
 * Per row of d elements x (widened to fp32, IEEE arithmetic whatever the process's denormal mode):
 *   LayerNorm  mean = sum16(x) / d;  var = sum16(fma(x - mean, x - mean, .)) / d;  rstd = 1 / sqrt(var + eps);
 *              y = fma((x - mean) * rstd, w, b)                 (w = 1, b = 0 where absent)
 *   RMSNorm    ms = sum16(fma(x, x, .)) / d;  rstd = 1 / sqrt(ms + eps);  y = (x * rstd) * w
 * rounded once to the output type. Rows are independent, so any split over threads gives the same bits.
 */
#ifndef BIVIT_NORM_H
#define BIVIT_NORM_H

#include <omp.h>
#include <stdlib.h>

#include "abi.h"
#include "arith.h"

#define NORM_LANES 16

/* w and b as the formulas read them, widened once per call: an absent weight as 1, an absent bias as 0 (so
 * y = fma(z, 1, 0) and (x * rstd) * 1 without them, the same bits as the formulas above). 2 * d floats at buf. */
static void norm_params(const struct bivit_norm_args *a, float *buf) {
    for (int64_t j = 0; j < a->d; j++) {
        buf[j] = a->w ? elem_load(a->w, j, a->wt) : 1.0f;
        buf[a->d + j] = a->b ? elem_load(a->b, j, a->wt) : 0.0f;
    }
}

/* Rows whose sums interleave: each lane of a row's sum is a chain of dependent adds, so one row at a time would
 * wait on the adder's latency; NORM_GROUP rows' chains in turn keep it busy. Each chain is unchanged. */
#define NORM_GROUP 4

/* x - mean of elements j0..j0+15 of a row widened at x (zero past d, as the sums read them). */
static inline __attribute__((always_inline)) f32x16 norm_dev16(const float *x, int64_t j0, int64_t d, float mean) {
    f32x16 v = v16_load(x + j0) - mean;
    if (j0 + NORM_LANES > d)
        for (int l = (int)(d - j0); l < NORM_LANES; l++) v[l] = 0.0f;
    return v;
}

/* Rows r0..r0+count-1 (count <= NORM_GROUP): x (d elements of type xt) -> y (type yt); `buf` holds NORM_GROUP *
 * (d rounded up to 16) floats. The types and the kind are constants of each instance (norm_rows), so every loop
 * compiles to straight vector code. */
static inline __attribute__((always_inline)) void norm_group(const struct bivit_norm_args *a, int64_t r0,
                                                              const int count, float *buf, const float *w,
                                                              const float *b, const int xt, const int yt,
                                                              const int rms) {
    const int64_t d = a->d, dp = (d + NORM_LANES - 1) / NORM_LANES * NORM_LANES;
    for (int g = 0; g < count; g++) {
        const char *xr = (const char *)a->x + (r0 + g) * a->x_row * (int64_t)esize_of(xt);
        float *x = buf + g * dp;
        for (int64_t j = 0; j < d; j++) x[j] = elem_load(xr, j, xt);
        for (int64_t j = d; j < dp; j++) x[j] = 0.0f;
    }
    f32x16 acc[NORM_GROUP];  /* arith.h's 16 lanes per row, each a chain from +0 */
    float mean[NORM_GROUP] = {0}, rstd[NORM_GROUP];
    for (int g = 0; g < count; g++) acc[g] = (f32x16){0};
    if (!rms) {
        for (int64_t j0 = 0; j0 < dp; j0 += NORM_LANES)
            for (int g = 0; g < count; g++) acc[g] = acc[g] + v16_load(buf + g * dp + j0);
        for (int g = 0; g < count; g++) {
            mean[g] = lanes16_sum16(acc[g]) / (float)d;
            acc[g] = (f32x16){0};
        }
        for (int64_t j0 = 0; j0 < dp; j0 += NORM_LANES)
            for (int g = 0; g < count; g++) {
                const f32x16 v = norm_dev16(buf + g * dp, j0, d, mean[g]);
                acc[g] = v16_fma(v, v, acc[g]);
            }
    } else {
        for (int64_t j0 = 0; j0 < dp; j0 += NORM_LANES)
            for (int g = 0; g < count; g++) {
                const f32x16 v = v16_load(buf + g * dp + j0);
                acc[g] = v16_fma(v, v, acc[g]);
            }
    }
    for (int g = 0; g < count; g++) {
        rstd[g] = 1.0f / sqrtf(lanes16_sum16(acc[g]) / (float)d + a->eps);
        if (a->mean) a->mean[r0 + g] = mean[g];
        if (a->rstd) a->rstd[r0 + g] = rstd[g];
        const float *x = buf + g * dp, m = mean[g], s = rstd[g];
        char *yr = (char *)a->y + (r0 + g) * a->y_row * (int64_t)esize_of(yt);
        if (rms)
            for (int64_t j = 0; j < d; j++) elem_store(yr, j, yt, (x[j] * s) * w[j]);
        else
            for (int64_t j = 0; j < d; j++) elem_store(yr, j, yt, fmaf((x[j] - m) * s, w[j], b[j]));
    }
}

/* Rows r0..r1 by the instance of norm_group for this call's types and kind. */
#define NORM_ROWS(XT, YT, RMS)                                                                                   \
    for (int64_t r = r0; r < r1; r += NORM_GROUP) {                                                              \
        if (r1 - r >= NORM_GROUP) norm_group(a, r, NORM_GROUP, buf, w, b, XT, YT, RMS);                          \
        else norm_group(a, r, (int)(r1 - r), buf, w, b, XT, YT, RMS);                                            \
    }
#define NORM_RMS(XT, YT)                                                                                         \
    if (a->rms) NORM_ROWS(XT, YT, 1)                                                                             \
    else NORM_ROWS(XT, YT, 0)
#define NORM_YT(XT)                                                                                              \
    switch (a->yt) {                                                                                             \
        case E_F32: NORM_RMS(XT, E_F32); break;                                                                  \
        case E_BF16: NORM_RMS(XT, E_BF16); break;                                                                \
        default: NORM_RMS(XT, E_F16); break;                                                                     \
    }

static void norm_rows(const struct bivit_norm_args *a, int64_t r0, int64_t r1, float *buf, const float *w,
                      const float *b) {
    switch (a->xt) {
        case E_F32: NORM_YT(E_F32); break;
        case E_BF16: NORM_YT(E_BF16); break;
        default: NORM_YT(E_F16); break;
    }
}

/* abi.h's bivit_norm_args. Returns RC_OK, RC_NO_MEMORY when scratch memory could not be allocated, RC_BAD_SIZES
 * for bad sizes. */
int bivit_norm(const struct bivit_norm_args *a) {
    if (a->rows < 0 || a->d < 1) return RC_BAD_SIZES;
    const size_t bytes = NORM_GROUP * (size_t)((a->d + NORM_LANES - 1) / NORM_LANES * NORM_LANES) * sizeof(float);
    float *params = malloc(2 * (size_t)a->d * sizeof(float));
    if (!params) return RC_NO_MEMORY;
    norm_params(a, params);
    int failed = 0;
    /* Rows in blocks, so a call's instance is chosen once per block, not per row. */
    const int64_t block = 16, blocks = (a->rows + block - 1) / block;
#pragma omp parallel num_threads(a->threads)
    {
        const fp_state fp = fp_enter(0);
        float *buf = malloc(bytes);
        if (!buf) {
#pragma omp atomic write
            failed = RC_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t k = 0; k < blocks; k++)
            if (buf) norm_rows(a, k * block, k * block + block < a->rows ? k * block + block : a->rows, buf, params,
                               params + a->d);
        free(buf);
        fp_leave(fp);
    }
    free(params);
    return failed;
}

#endif
