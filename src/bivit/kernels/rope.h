/* The 2-D rotary position embedding of q and k, compiled into every variant's library (its instruction set
 * only makes it faster: the bits are the same everywhere).
 *
 * Per row l, head slot j and interleaved pair (x0, x1) = (x[2i], x[2i + 1]), with the tables of
 * `bivit.ops.rotary` (cos = (c0, c0, ...), sin = (-s0, s0, ...)):
 *   out[2i]     = x0 * cos[2i]     + x1 * sin[2i]
 *   out[2i + 1] = x1 * cos[2i + 1] + x0 * sin[2i + 1]
 * each product and the sum rounded to fp32 separately (no fused multiply-add: this file is compiled with
 * -ffp-contract=off), then rounded once to the output dtype (bf16: to nearest even): exactly what PyTorch's
 * elementwise mul, add and conversion compute, so both paths give the same bits.
 *
 * Why: in PyTorch the same math on a strided bf16 view times fp32 tables takes the slow mixed-dtype path of
 * TensorIterator (measured: RoPE was a third of a 32 x 112x112 encode on one thread); here it is one pass. Rows
 * are independent, so any split over threads gives the same bits. Where the compiled attention runs, it rotates
 * q and k itself as it reads them (common.h), with this formula and rounding (`rope_elem`, arith.h's `f32_to_bf16`; its
 * vector forms are held to these bits by the tests): this pass then runs only beside PyTorch's attention.
 */
#ifndef BIVIT_ROPE_H
#define BIVIT_ROPE_H

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "arith.h"

#define ROPE_MAX_D 256  /* the widest head a row's scratch holds */

/* Element c of a row (bf16 or float) as a float, exactly. */
static inline float load_elem(const void *row, int64_t c, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)row)[c]) : ((const float *)row)[c];
}

/* Element i of a rotated row from x_i, its pair partner x_p (x[i ^ 1]) and the tables' c_i, s_i: the formula above
 * (the attention kernels' fused rotation uses it for the elements its vector code leaves). */
static inline float rope_elem(float xi, float xp, float ci, float si) {
    const float a = xi * ci, b = xp * si;
    return a + b;
}

static inline __attribute__((always_inline)) void rope_rows(const char *x, char *out, const float *cos,
                                                            const float *sin, int64_t rows, int64_t slots,
                                                            int64_t d, int64_t x_row, int64_t x_slot,
                                                            int64_t out_row, int64_t out_slot, int threads,
                                                            const int bf) {
    const int64_t es = bf ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
    const fp_state fp = fp_enter(0);  /* IEEE, whatever the calling process set */
#pragma omp for schedule(static)
    for (int64_t l = 0; l < rows; l++) {
        const float *c = cos + l * d, *s = sin + l * d;
        for (int64_t j = 0; j < slots; j++) {
            const char *xr = x + (l * x_row + j * x_slot) * es;
            char *orow = out + (l * out_row + j * out_slot) * es;
            float xf[ROPE_MAX_D], y[ROPE_MAX_D];
            for (int64_t i = 0; i < d; i++) xf[i] = load_elem(xr, i, bf);
            for (int64_t i = 0; i < d; i += 2) {
                y[i] = rope_elem(xf[i], xf[i + 1], c[i], s[i]);
                y[i + 1] = rope_elem(xf[i + 1], xf[i], c[i + 1], s[i + 1]);
            }
            if (bf)
                for (int64_t i = 0; i < d; i++) ((uint16_t *)orow)[i] = f32_to_bf16(y[i]);
            else
                memcpy(orow, y, (size_t)d * sizeof(float));
        }
    }
    fp_leave(fp);
    }
}

/* abi.h's bivit_rope_args: x, out [rows][slots][d] (head_dim contiguous, even, at most ROPE_MAX_D), any row
 * and slot strides; cos, sin: contiguous fp32 [rows][d]. Returns RC_OK, or RC_UNSUPPORTED for another d. */
#define BIVIT_ROPE_ENTRY(FN, BF)                                                                                 \
    int FN(const struct bivit_rope_args *a) {                                                                   \
        if (a->d < 2 || a->d > ROPE_MAX_D || a->d % 2) return RC_UNSUPPORTED;                                   \
        rope_rows(a->x, a->out, a->cos, a->sin, a->rows, a->slots, a->d, a->x_row, a->x_slot, a->out_row,       \
                  a->out_slot, a->threads, BF);                                                                 \
        return 0;                                                                                               \
    }
BIVIT_ROPE_ENTRY(bivit_rope_bf16, 1)
BIVIT_ROPE_ENTRY(bivit_rope_f32, 0)

#endif
