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

/* One row: x (d elements of type xt) -> y; `buf` holds 2 * (d rounded up to 16) floats. */
static void norm_row(const struct bivit_norm_args *a, int64_t r, float *buf) {
    const int64_t d = a->d, dp = (d + NORM_LANES - 1) / NORM_LANES * NORM_LANES;
    const char *xr = (const char *)a->x + r * a->x_row * (int64_t)esize_of(a->xt);
    float *x = buf, *dev = buf + dp;
    for (int64_t j = 0; j < dp; j++) x[j] = j < d ? elem_load(xr, j, a->xt) : 0.0f;
    float lane[NORM_LANES] = {0};
    float mean = 0.0f;
    if (!a->rms) {
        for (int64_t j0 = 0; j0 < dp; j0 += NORM_LANES)
            for (int l = 0; l < NORM_LANES; l++) lane[l] = lane[l] + x[j0 + l];
        mean = lanes16_sum(lane) / (float)d;
        for (int64_t j = 0; j < dp; j++) dev[j] = j < d ? x[j] - mean : 0.0f;
        for (int l = 0; l < NORM_LANES; l++) lane[l] = 0.0f;
        for (int64_t j0 = 0; j0 < dp; j0 += NORM_LANES)
            for (int l = 0; l < NORM_LANES; l++) lane[l] = fmaf(dev[j0 + l], dev[j0 + l], lane[l]);
    } else {
        for (int64_t j0 = 0; j0 < dp; j0 += NORM_LANES)
            for (int l = 0; l < NORM_LANES; l++) lane[l] = fmaf(x[j0 + l], x[j0 + l], lane[l]);
    }
    const float rstd = 1.0f / sqrtf(lanes16_sum(lane) / (float)d + a->eps);
    if (a->mean) a->mean[r] = mean;
    if (a->rstd) a->rstd[r] = rstd;
    char *yr = (char *)a->y + r * a->y_row * (int64_t)esize_of(a->yt);
    for (int64_t j = 0; j < d; j++) {
        const float w = a->w ? elem_load(a->w, j, a->wt) : 1.0f;
        float y;
        if (a->rms) {
            y = (x[j] * rstd) * w;
        } else {
            const float b = a->b ? elem_load(a->b, j, a->wt) : 0.0f;
            y = fmaf(dev[j] * rstd, w, b);
        }
        elem_store(yr, j, a->yt, y);
    }
}

/* abi.h's bivit_norm_args. Returns RC_OK, RC_NO_MEMORY when scratch memory could not be allocated, RC_BAD_SIZES
 * for bad sizes. */
int bivit_norm(const struct bivit_norm_args *a) {
    if (a->rows < 0 || a->d < 1) return RC_BAD_SIZES;
    const size_t bytes = 2 * (size_t)((a->d + NORM_LANES - 1) / NORM_LANES * NORM_LANES) * sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(a->threads)
    {
        const fp_state fp = fp_enter(0);
        float *buf = malloc(bytes);
        if (!buf) {
#pragma omp atomic write
            failed = RC_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++)
            if (buf) norm_row(a, r, buf);
        free(buf);
        fp_leave(fp);
    }
    return failed;
}

#endif
