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

/* What every entry point returns (abi.py's CONSTS names them; checked at load like the structs). */
enum { RC_OK = 0, RC_NO_MEMORY = 1, RC_UNSUPPORTED = 2, RC_BAD_SIZES = 3 };

/* Each struct's fields are listed once, as X(struct, type, name): the struct is declared from the list and so is
 * the table `bivit_abi_field` reads (a field cannot be in one and not the other). */

/* One call of the compiled attention: q/k/v/out are [rows][heads][d] with d contiguous; item i owns rows
 * cu[i] .. cu[i + 1] - 1 (count + 1 offsets). `lse`: NULL or [heads][n] floats per item, item by item. `cos`,
 * `sin`: NULL or RoPE tables, fp32 [rows][d]. Strides: `*_row` between consecutive rows, `*_head` between
 * consecutive heads of a row. `scale` is applied to q.k before the softmax. `yt`: out's element type (E_F32 or the
 * inputs': bf16 attention written unrounded, in fp32, is what the conformance check reads). */
#define BIVIT_ATTENTION_FIELDS(X)                                                                                \
    X(bivit_attention_args, const void *, q) X(bivit_attention_args, const void *, k)                           \
    X(bivit_attention_args, const void *, v) X(bivit_attention_args, void *, out)                               \
    X(bivit_attention_args, const int64_t *, cu) X(bivit_attention_args, float *, lse)                          \
    X(bivit_attention_args, const float *, cos) X(bivit_attention_args, const float *, sin)                     \
    X(bivit_attention_args, int64_t, count) X(bivit_attention_args, int64_t, heads)                             \
    X(bivit_attention_args, int64_t, d) X(bivit_attention_args, int64_t, q_row)                                 \
    X(bivit_attention_args, int64_t, k_row) X(bivit_attention_args, int64_t, v_row)                            \
    X(bivit_attention_args, int64_t, out_row) X(bivit_attention_args, int64_t, q_head)                          \
    X(bivit_attention_args, int64_t, k_head) X(bivit_attention_args, int64_t, v_head)                           \
    X(bivit_attention_args, int64_t, out_head) X(bivit_attention_args, float, scale)                            \
    X(bivit_attention_args, int, yt) X(bivit_attention_args, int, threads)

/* Packing a weight w [N][K] (element type wt, rows w_row apart) for GEMM kernel `kind` into `out`
 * (bivit_gemm_packed_bytes(args) bytes; that call reads kind, N and K only). */
#define BIVIT_GEMM_PACK_FIELDS(X)                                                                                \
    X(bivit_gemm_pack_args, const void *, w) X(bivit_gemm_pack_args, void *, out)                               \
    X(bivit_gemm_pack_args, int64_t, w_row) X(bivit_gemm_pack_args, int64_t, N)                                 \
    X(bivit_gemm_pack_args, int64_t, K) X(bivit_gemm_pack_args, int, kind) X(bivit_gemm_pack_args, int, wt)     \
    X(bivit_gemm_pack_args, int, threads)

/* y[M][N] (type yt, rows y_row apart) = act(x[M][K] (type xt, rows x_row apart) . w^T + bias), w packed for
 * `kind`; bias NULL or fp32 [N]; `flush`: bf16 arithmetic (arith.h: flushed, odd K padded by one 0 x 0). */
#define BIVIT_GEMM_FIELDS(X)                                                                                     \
    X(bivit_gemm_args, const void *, x) X(bivit_gemm_args, const void *, w)                                     \
    X(bivit_gemm_args, const float *, bias) X(bivit_gemm_args, void *, y) X(bivit_gemm_args, int64_t, x_row)    \
    X(bivit_gemm_args, int64_t, y_row) X(bivit_gemm_args, int64_t, M) X(bivit_gemm_args, int64_t, N)            \
    X(bivit_gemm_args, int64_t, K) X(bivit_gemm_args, int, kind) X(bivit_gemm_args, int, xt)                    \
    X(bivit_gemm_args, int, yt) X(bivit_gemm_args, int, act) X(bivit_gemm_args, int, flush)                     \
    X(bivit_gemm_args, int, threads)

/* RoPE on x [rows][slots][d] into out (same shape), tables fp32 [rows][d] contiguous; strides between
 * consecutive rows (`*_row`) and head slots (`*_slot`). */
#define BIVIT_ROPE_FIELDS(X)                                                                                     \
    X(bivit_rope_args, const void *, x) X(bivit_rope_args, void *, out) X(bivit_rope_args, const float *, cos)  \
    X(bivit_rope_args, const float *, sin) X(bivit_rope_args, int64_t, rows) X(bivit_rope_args, int64_t, slots) \
    X(bivit_rope_args, int64_t, d) X(bivit_rope_args, int64_t, x_row) X(bivit_rope_args, int64_t, x_slot)       \
    X(bivit_rope_args, int64_t, out_row) X(bivit_rope_args, int64_t, out_slot) X(bivit_rope_args, int, threads)

/* LayerNorm (rms = 0) or RMSNorm (rms = 1) of each row of x [rows][d] (type xt, rows x_row apart) into y (type
 * yt, rows y_row apart), with weight w and bias b (type wt; NULL: 1 and 0) and eps; mean and rstd: NULL or [rows]
 * floats (what a backward pass needs; RMSNorm writes rstd only). Element types: gemm.h's E_*. */
#define BIVIT_NORM_FIELDS(X)                                                                                     \
    X(bivit_norm_args, const void *, x) X(bivit_norm_args, const void *, w) X(bivit_norm_args, const void *, b)  \
    X(bivit_norm_args, void *, y) X(bivit_norm_args, float *, mean) X(bivit_norm_args, float *, rstd)           \
    X(bivit_norm_args, int64_t, rows) X(bivit_norm_args, int64_t, d) X(bivit_norm_args, int64_t, x_row)         \
    X(bivit_norm_args, int64_t, y_row) X(bivit_norm_args, float, eps) X(bivit_norm_args, int, rms)              \
    X(bivit_norm_args, int, xt) X(bivit_norm_args, int, wt) X(bivit_norm_args, int, yt)                         \
    X(bivit_norm_args, int, threads)

#define BIVIT_ABI_DECLARE(S, T, F) T F;
struct bivit_attention_args { BIVIT_ATTENTION_FIELDS(BIVIT_ABI_DECLARE) };
struct bivit_gemm_pack_args { BIVIT_GEMM_PACK_FIELDS(BIVIT_ABI_DECLARE) };
struct bivit_gemm_args { BIVIT_GEMM_FIELDS(BIVIT_ABI_DECLARE) };
struct bivit_rope_args { BIVIT_ROPE_FIELDS(BIVIT_ABI_DECLARE) };
struct bivit_norm_args { BIVIT_NORM_FIELDS(BIVIT_ABI_DECLARE) };

struct bivit_abi_entry {
    const char *strct, *field;  /* field "": the struct itself */
    int64_t offset, size;
};

#define BIVIT_ABI_STRUCT(S) {#S, "", 0, (int64_t)sizeof(struct S)},
#define BIVIT_ABI_FIELD(S, T, F) {#S, #F, (int64_t)offsetof(struct S, F), (int64_t)sizeof(((struct S *)0)->F)},

static const struct bivit_abi_entry BIVIT_ABI[] = {
    BIVIT_ABI_STRUCT(bivit_attention_args) BIVIT_ATTENTION_FIELDS(BIVIT_ABI_FIELD)
    BIVIT_ABI_STRUCT(bivit_gemm_pack_args) BIVIT_GEMM_PACK_FIELDS(BIVIT_ABI_FIELD)
    BIVIT_ABI_STRUCT(bivit_gemm_args) BIVIT_GEMM_FIELDS(BIVIT_ABI_FIELD)
    BIVIT_ABI_STRUCT(bivit_rope_args) BIVIT_ROPE_FIELDS(BIVIT_ABI_FIELD)
    BIVIT_ABI_STRUCT(bivit_norm_args) BIVIT_NORM_FIELDS(BIVIT_ABI_FIELD)
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
