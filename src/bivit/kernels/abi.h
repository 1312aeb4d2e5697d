/* The arguments of every exported entry point: one struct of named fields, passed by pointer.
 *
 * Why not positional arguments: the attention took 21 of them, 8 of them strides of the same type, and ctypes
 * declares a C signature by counting; two swapped strides would compile, load and run. Python fills a
 * `ctypes.Structure` mirroring each struct field by field (bivit/kernels/abi.py), so no call depends on an
 * order, and `bivit_abi_field` lets it check at load that every field of its mirror is where this struct has
 * it (a library built from other sources is refused before anything is called).
 *
 * Strides are in elements, not bytes. Sizes and strides are int64_t; kinds, element types and thread counts int.
 */
#ifndef BIVIT_ABI_H
#define BIVIT_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* One call of the compiled attention: q/k/v/out are [rows][heads][d] with d contiguous; item i owns rows
 * cu[i] .. cu[i + 1] - 1 (count + 1 offsets). `lse`: NULL or [heads][n] floats per item, item by item. `cos`,
 * `sin`: NULL or RoPE tables, fp32 [rows][d]. */
struct bivit_attention_args {
    const void *q, *k, *v;
    void *out;
    const int64_t *cu;
    float *lse;
    const float *cos, *sin;
    int64_t count, heads, d;
    int64_t q_row, k_row, v_row, out_row;      /* elements between consecutive rows */
    int64_t q_head, k_head, v_head, out_head;  /* elements between consecutive heads of a row */
    float scale;                               /* applied to q.k before the softmax */
    int threads;
};

/* Packing a weight w [N][K] (element type wt, rows w_row apart) for GEMM kernel `kind` into `out`
 * (bivit_gemm_packed_bytes(args) bytes; that call reads kind, N and K only). */
struct bivit_gemm_pack_args {
    const void *w;
    void *out;
    int64_t w_row, N, K;
    int kind, wt, threads;
};

/* y[M][N] (type yt, rows y_row apart) = act(x[M][K] (type xt, rows x_row apart) . w^T + bias), w packed for
 * `kind`; bias NULL or fp32 [N]. */
struct bivit_gemm_args {
    const void *x, *w;
    const float *bias;
    void *y;
    int64_t x_row, y_row, M, N, K;
    int kind, xt, yt, act, threads;
};

/* RoPE on x [rows][slots][d] into out (same shape), tables fp32 [rows][d] contiguous. */
struct bivit_rope_args {
    const void *x;
    void *out;
    const float *cos, *sin;
    int64_t rows, slots, d;
    int64_t x_row, x_slot, out_row, out_slot;  /* elements between consecutive rows / head slots */
    int threads;
};

struct bivit_abi_entry {
    const char *strct, *field;  /* field "": the struct itself */
    int64_t offset, size;
};

#define BIVIT_ABI_STRUCT(S) {#S, "", 0, (int64_t)sizeof(struct S)}
#define BIVIT_ABI_FIELD(S, F) {#S, #F, (int64_t)offsetof(struct S, F), (int64_t)sizeof(((struct S *)0)->F)}

static const struct bivit_abi_entry BIVIT_ABI[] = {
    BIVIT_ABI_STRUCT(bivit_attention_args),
    BIVIT_ABI_FIELD(bivit_attention_args, q), BIVIT_ABI_FIELD(bivit_attention_args, k),
    BIVIT_ABI_FIELD(bivit_attention_args, v), BIVIT_ABI_FIELD(bivit_attention_args, out),
    BIVIT_ABI_FIELD(bivit_attention_args, cu), BIVIT_ABI_FIELD(bivit_attention_args, lse),
    BIVIT_ABI_FIELD(bivit_attention_args, cos), BIVIT_ABI_FIELD(bivit_attention_args, sin),
    BIVIT_ABI_FIELD(bivit_attention_args, count), BIVIT_ABI_FIELD(bivit_attention_args, heads),
    BIVIT_ABI_FIELD(bivit_attention_args, d), BIVIT_ABI_FIELD(bivit_attention_args, q_row),
    BIVIT_ABI_FIELD(bivit_attention_args, k_row), BIVIT_ABI_FIELD(bivit_attention_args, v_row),
    BIVIT_ABI_FIELD(bivit_attention_args, out_row), BIVIT_ABI_FIELD(bivit_attention_args, q_head),
    BIVIT_ABI_FIELD(bivit_attention_args, k_head), BIVIT_ABI_FIELD(bivit_attention_args, v_head),
    BIVIT_ABI_FIELD(bivit_attention_args, out_head), BIVIT_ABI_FIELD(bivit_attention_args, scale),
    BIVIT_ABI_FIELD(bivit_attention_args, threads),
    BIVIT_ABI_STRUCT(bivit_gemm_pack_args),
    BIVIT_ABI_FIELD(bivit_gemm_pack_args, w), BIVIT_ABI_FIELD(bivit_gemm_pack_args, out),
    BIVIT_ABI_FIELD(bivit_gemm_pack_args, w_row), BIVIT_ABI_FIELD(bivit_gemm_pack_args, N),
    BIVIT_ABI_FIELD(bivit_gemm_pack_args, K), BIVIT_ABI_FIELD(bivit_gemm_pack_args, kind),
    BIVIT_ABI_FIELD(bivit_gemm_pack_args, wt), BIVIT_ABI_FIELD(bivit_gemm_pack_args, threads),
    BIVIT_ABI_STRUCT(bivit_gemm_args),
    BIVIT_ABI_FIELD(bivit_gemm_args, x), BIVIT_ABI_FIELD(bivit_gemm_args, w),
    BIVIT_ABI_FIELD(bivit_gemm_args, bias), BIVIT_ABI_FIELD(bivit_gemm_args, y),
    BIVIT_ABI_FIELD(bivit_gemm_args, x_row), BIVIT_ABI_FIELD(bivit_gemm_args, y_row),
    BIVIT_ABI_FIELD(bivit_gemm_args, M), BIVIT_ABI_FIELD(bivit_gemm_args, N), BIVIT_ABI_FIELD(bivit_gemm_args, K),
    BIVIT_ABI_FIELD(bivit_gemm_args, kind), BIVIT_ABI_FIELD(bivit_gemm_args, xt),
    BIVIT_ABI_FIELD(bivit_gemm_args, yt), BIVIT_ABI_FIELD(bivit_gemm_args, act),
    BIVIT_ABI_FIELD(bivit_gemm_args, threads),
    BIVIT_ABI_STRUCT(bivit_rope_args),
    BIVIT_ABI_FIELD(bivit_rope_args, x), BIVIT_ABI_FIELD(bivit_rope_args, out),
    BIVIT_ABI_FIELD(bivit_rope_args, cos), BIVIT_ABI_FIELD(bivit_rope_args, sin),
    BIVIT_ABI_FIELD(bivit_rope_args, rows), BIVIT_ABI_FIELD(bivit_rope_args, slots),
    BIVIT_ABI_FIELD(bivit_rope_args, d), BIVIT_ABI_FIELD(bivit_rope_args, x_row),
    BIVIT_ABI_FIELD(bivit_rope_args, x_slot), BIVIT_ABI_FIELD(bivit_rope_args, out_row),
    BIVIT_ABI_FIELD(bivit_rope_args, out_slot), BIVIT_ABI_FIELD(bivit_rope_args, threads),
};

/* Where `field` of `strct` is (field "": the struct's size): 0 and *offset, *size set, or -1 for a name this
 * library does not have. */
int bivit_abi_field(const char *strct, const char *field, int64_t *offset, int64_t *size) {
    for (size_t i = 0; i < sizeof BIVIT_ABI / sizeof BIVIT_ABI[0]; i++)
        if (!strcmp(BIVIT_ABI[i].strct, strct) && !strcmp(BIVIT_ABI[i].field, field)) {
            *offset = BIVIT_ABI[i].offset;
            *size = BIVIT_ABI[i].size;
            return 0;
        }
    return -1;
}

#endif
