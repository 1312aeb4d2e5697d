/* bivit's invariant GEMM, shared by every variant: y[M][N] = x[M][K] . w[N][K]^T (+ bias[N]).
 *
 * Why bivit computes its own GEMMs: a library GEMM (oneDNN, MKL) picks its blocking, its kernel and whether
 * threads split the K reduction by the shape and the thread count, so a row's bits can change with the rows
 * beside it or with the thread count (seen on an Intel AMX Xeon: oneDNN's packed bf16 GEMM at one row count
 * gave other bits at 3-4 threads than at 1), and from one CPU kind to the next. Here every kernel computes
 * bivit-arith/1 (arith.h, docs/arithmetic.md):
 *
 *   y[i][j] = round(act(acc + bias[j])),  acc = fma(x[i][k], w[j][k], acc) for k = 0, 1, ..., K-1 from +0,
 *
 * one fp32 accumulator per output element (bias 0 where there is none; bf16: flushed, and an odd K ends with one
 * more product 0 x 0). Work is split over threads by (block of rows, group of column panels) only, never over K;
 * a row's arithmetic does not depend on which block it is in, how many rows the block has (short blocks run the
 * same instruction sequence per row, or a zero-padded copy of the rows), the row count M, or which thread runs
 * it. Padding past K or N is zeros in the packed weights and never reaches an output. So an output row's bits
 * are a function of that input row and the weights, the same from every kernel (the load-time conformance
 * check holds each kernel to the portable one's bits: `bivit.ops.bits`).
 *
 * A variant supplies `struct gemm_kernel`: its weight packing (done once per weight, at load), and a `block`
 * computing up to `mb` rows against one packed column panel of `nr` columns into y (bias added, rounded).
 */
#ifndef BIVIT_GEMM_H
#define BIVIT_GEMM_H

#include "arith.h"
#include "common.h"

/* Element c of a row of type et (arith.h's E_*) as a float, exactly. */
#define gemm_elem elem_load

/* The GEMM kernels (`kind` of the arguments); a variant's gemm_kernel_of returns NULL for those it lacks. */
enum { GEMM_FP32 = 0, GEMM_AVX512_BF16 = 1, GEMM_AMX = 2, GEMM_AMX_SWAPPED = 3 };

/* Every constant Python passes to these kernels or reads from them (return codes, size limits), by name:
 * `bivit_abi_const` lets it check at load that its own copy of each (bivit/kernels/abi.py's CONSTS) is this
 * library's. */
#define BIVIT_CONSTS(X)                                                                                          \
    X(E_F32) X(E_BF16) X(E_F16) X(ACT_NONE) X(ACT_GELU_TANH) X(ACT_GELU_ERF)                                     \
    X(GEMM_FP32) X(GEMM_AVX512_BF16) X(GEMM_AMX) X(GEMM_AMX_SWAPPED)                                             \
    X(RC_OK) X(RC_NO_MEMORY) X(RC_UNSUPPORTED) X(RC_BAD_SIZES) X(MAX_D) X(ROPE_MAX_D)

#define BIVIT_CONST_ENTRY(N) {#N, (int64_t)(N)},
static const struct { const char *name; int64_t value; } BIVIT_CONST_TABLE[] = {BIVIT_CONSTS(BIVIT_CONST_ENTRY)};

/* 0 and *value for a constant this library has, -1 otherwise. */
int bivit_abi_const(const char *name, int64_t *value) {
    for (size_t i = 0; i < sizeof BIVIT_CONST_TABLE / sizeof BIVIT_CONST_TABLE[0]; i++)
        if (!strcmp(BIVIT_CONST_TABLE[i].name, name)) {
            *value = BIVIT_CONST_TABLE[i].value;
            return 0;
        }
    return -1;
}

struct gemm_call {
    const char *x;      /* [M] rows, x_row elements apart, K contiguous elements each, of type xt */
    int64_t x_row;
    int xt;
    const char *w;      /* packed by the same kernel's `pack` */
    const float *bias;  /* [N] or NULL */
    char *y;            /* [M] rows, y_row elements apart, of type yt */
    int64_t y_row;
    int yt;
    int act;            /* ACT_*: what is applied to acc + bias before rounding */
    int flush;          /* bf16 arithmetic: the whole call runs flushed (arith.h), and an odd K's chain ends with
                           one product 0 x 0, as bf16 pairs compute it */
    int64_t M, N, K;
};

/* GELU after the GEMM (arith.h's ACT_*), on the fp32 sum, in the kernel's own vector code: every element takes
 * the same instructions whatever its position or the thread count (PyTorch's GELU kernel cuts its range by the
 * thread count above 16384 elements, and its scalar tail rounds differently from its vector body). */

/* The GELUs from exp: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = sign(u) (1 - e) / (1 + e) with
 * e = exp(-2|u|); and 0.5 x (1 + erf(x / sqrt(2))), erf(z) = sign(z) (1 - poly(t) exp(-z^2)), t = 1 / (1 +
 * 0.3275911 |z|) (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7). The body of a variant's GELU on vector type V
 * with intrinsics prefix P (_mm512, _mm256), from its exp2_neg (2^x for x <= 0): arith.h's gelu_s, operation for
 * operation. */
#define GELU_BODY(V, P, x, act)                                                                                  \
    const V half = P##_set1_ps(0.5f), one = P##_set1_ps(1.0f), sign = P##_set1_ps(-0.0f);                     \
    V u, e, t;                                                                                                  \
    if ((act) == ACT_GELU_TANH) {                                                                               \
        u = P##_mul_ps(P##_set1_ps(0.7978845608028654f),                                                       \
                       P##_fmadd_ps(P##_mul_ps(P##_set1_ps(0.044715f), x), P##_mul_ps(x, x), x));              \
        e = exp2_neg(P##_mul_ps(P##_andnot_ps(sign, u), P##_set1_ps(-2.0f * 1.4426950408889634f)));           \
        t = P##_div_ps(P##_sub_ps(one, e), P##_add_ps(one, e));                                                \
    } else {                                                                                                    \
        u = P##_mul_ps(x, P##_set1_ps(0.7071067811865476f));                                                   \
        const V a = P##_andnot_ps(sign, u);                                                                     \
        const V r = P##_div_ps(one, P##_fmadd_ps(P##_set1_ps(0.3275911f), a, one));                            \
        V poly = P##_fmadd_ps(P##_set1_ps(1.061405429f), r, P##_set1_ps(-1.453152027f));                        \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(1.421413741f));                                                \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(-0.284496736f));                                               \
        poly = P##_fmadd_ps(poly, r, P##_set1_ps(0.254829592f));                                                \
        poly = P##_mul_ps(poly, r);                                                                             \
        e = exp2_neg(P##_mul_ps(P##_mul_ps(a, a), P##_set1_ps(-1.4426950408889634f)));                          \
        t = P##_fnmadd_ps(poly, e, one);                                                                        \
    }                                                                                                           \
    t = P##_or_ps(t, P##_and_ps(u, sign)); /* the sign of u */                                                 \
    return P##_mul_ps(P##_mul_ps(half, x), P##_add_ps(one, t))


struct gemm_kernel {
    int64_t mb, nr;  /* rows per block (a multiple of the microtile's), columns per packed panel */
    size_t task_bytes;  /* packed weights per task: what stays in a core's L2 while the task's rows stream past */
    size_t (*packed_bytes)(int64_t N, int64_t K);
    void (*pack_panel)(const char *w, int64_t w_row, int wt, int64_t N, int64_t K, int64_t p, char *out);
    size_t (*scratch_bytes)(int64_t K);
    void (*enter)(void);  /* per thread, before its first block (AMX: load the tile configuration) */
    void (*leave)(void);
    void (*block)(const struct gemm_call *G, int64_t i0, int64_t rows, int64_t p0, int64_t p1, void *scratch);
    /* Optional: the kernel's multiply-add instruction at its peak on one core (GEMM_PEAK_DEF); FLOPs done. */
    double (*peak)(int64_t steps);
};

/* The empty asm statements that keep a peak loop from being folded: the operand in a vector register, or, under
 * an emulation of the instruction set (tests/support/emu: its vector types are structs), in memory. */
#ifdef SIMDE_VERSION_MAJOR
#define PEAK_OPAQUE(v) __asm__ volatile("" : "+m"(v))
#define PEAK_KEEP(v) __asm__ volatile("" : : "m"(v))
#else
#define PEAK_OPAQUE(v) __asm__ volatile("" : "+v"(v))
#define PEAK_KEEP(v) __asm__ volatile("" : : "v"(v))
#endif

/* `static double NAME(int64_t steps)`: `steps` rounds of ACC independent multiply-adds OP(acc[i], a) with vector
 * accumulators of type V (from ZERO) and an operand `a` of type A (from INIT), touching no memory: the rate no
 * GEMM built on that instruction can pass on this core (`bivit bench` prints its cases against it). The empty
 * asm statements keep the compiler from folding the loop. FLOPS: per instruction. */
#define GEMM_PEAK_DEF(NAME, V, ZERO, A, INIT, OP, ACC, FLOPS)                                                     \
    static double NAME(int64_t steps) {                                                                          \
        V acc[ACC];                                                                                              \
        for (int i = 0; i < (ACC); i++) acc[i] = (ZERO);                                                         \
        A a = (INIT);                                                                                            \
        for (int64_t s = 0; s < steps; s++) {                                                                    \
            _Pragma("GCC unroll 32") for (int i = 0; i < (ACC); i++) acc[i] = OP(acc[i], a);                     \
            PEAK_OPAQUE(a);                                                                                      \
        }                                                                                                        \
        for (int i = 0; i < (ACC); i++) PEAK_KEEP(acc[i]);                                                       \
        return (double)steps * (ACC) * (FLOPS);                                                                  \
    }

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Pack w ([N] rows of K elements of type wt, w_row apart) panel by panel into out (packed_bytes(N, K) bytes). */
static int gemm_pack(const struct gemm_kernel *G, const void *w, int64_t w_row, int wt, int64_t N, int64_t K,
                     void *out, int threads) {
    if (N <= 0 || K <= 0) return RC_BAD_SIZES;
    const int64_t panels = ceil_div(N, G->nr);
    const size_t panel_bytes = G->packed_bytes(G->nr, K);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t p = 0; p < panels; p++)
        G->pack_panel((const char *)w, w_row, wt, N, K, p, (char *)out + p * panel_bytes);
    return 0;
}

/* Column panels per task: as many as keep a task's packed weights within the kernel's task_bytes (they stay in
 * the core's cache while its row blocks stream past), at least one. Only which thread computes what depends on
 * this. */
static inline int64_t panels_per_task(const struct gemm_kernel *G, int64_t K, int64_t panels) {
    int64_t pt = (int64_t)(G->task_bytes / (G->packed_bytes(G->nr, K) ? G->packed_bytes(G->nr, K) : 1));
    if (pt < 1) pt = 1;
    return pt < panels ? pt : panels;
}

/* Returns RC_OK, RC_NO_MEMORY when scratch memory could not be allocated, RC_BAD_SIZES for bad sizes. */
static int gemm_run(const struct gemm_kernel *G, const struct gemm_call *C, int threads) {
    if (C->M < 0 || C->N <= 0 || C->K <= 0) return RC_BAD_SIZES;
    if (C->M == 0) return 0;
    const int64_t panels = ceil_div(C->N, G->nr), pt = panels_per_task(G, C->K, panels);
    const int64_t mblocks = ceil_div(C->M, G->mb), pgroups = ceil_div(panels, pt), tasks = mblocks * pgroups;
    if (threads > tasks) threads = (int)tasks;
    const size_t scratch = G->scratch_bytes(C->K);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const fp_state fp = fp_enter(C->flush);
        void *buf = alloc64(scratch);
        if (!buf) {
#pragma omp atomic write
            failed = RC_NO_MEMORY;
        } else if (G->enter) {
            G->enter();
        }
        /* Tasks go column group by column group, so the threads work on the same packed weights at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!buf) continue;
            const int64_t g = t / mblocks, b = t % mblocks;
            const int64_t i0 = b * G->mb, rows = C->M - i0 < G->mb ? C->M - i0 : G->mb;
            const int64_t p0 = g * pt, p1 = p0 + pt < panels ? p0 + pt : panels;
            G->block(C, i0, rows, p0, p1, buf);
        }
        if (buf && G->leave) G->leave();
        free(buf);
        fp_leave(fp);
    }
    return failed;
}

/* A variant's fp32 packing: panel p of NR columns as [K][NR] floats (weights widened exactly, zero past N). */
#define GEMM_F32_PACK                                                                                            \
    static size_t f32_packed_bytes(int64_t N, int64_t K) { return (size_t)ceil_div(N, (NR)) * K * (NR) * 4; }    \
    static void f32_pack_panel(const char *w, int64_t w_row, int wt, int64_t N, int64_t K, int64_t p,            \
                               char *out) {                                                                     \
        float *o = (float *)out;                                                                                \
        for (int64_t k = 0; k < K; k++)                                                                         \
            for (int64_t c = 0; c < (NR); c++) {                                                                \
                const int64_t j = p * (NR) + c;                                                                 \
                o[k * (NR) + c] = j < N ? gemm_elem(w + j * w_row * esize_of(wt), k, wt) : 0.0f;                \
            }                                                                                                   \
    }

/* A variant's fp32 kernel block: microtiles of MR rows (f32_micro(C, rows, row stride, i0, R, panel, j0), rows as
 * floats) against panels p0..p1 of NR columns. 16-bit rows are widened into the thread's scratch once per block
 * (exact: the microtiles see the same values), so the inner loop broadcasts floats. A full microtile gets its
 * row count as a constant (the unrolled code), a short one at run time: the same instructions per row either
 * way (no reassociation: -ffp-contract=off, no fast-math), one instance each, which keeps the first load's
 * compile short. */
#define GEMM_F32_BLOCK                                                                                           \
    static size_t f32_scratch(int64_t K) { return (size_t)(MB) * K * 4 + 64; }                                  \
    static void f32_block(const struct gemm_call *C, int64_t i0, int64_t rows, int64_t p0, int64_t p1,          \
                          void *scratch) {                                                                      \
        const float *x = (const float *)C->x + i0 * C->x_row;                                                   \
        int64_t xs = C->x_row;                                                                                  \
        if (C->xt != E_F32) {                                                                                   \
            float *wide = scratch;                                                                              \
            const size_t es = esize_of(C->xt);                                                                  \
            for (int64_t r = 0; r < rows; r++)                                                                  \
                for (int64_t k = 0; k < C->K; k++)                                                              \
                    wide[r * C->K + k] = gemm_elem(C->x + (i0 + r) * C->x_row * es, k, C->xt);                  \
            x = wide;                                                                                           \
            xs = C->K;                                                                                          \
        }                                                                                                       \
        const size_t panel = (size_t)C->K * (NR);                                                               \
        for (int64_t p = p0; p < p1; p++)                                                                       \
            for (int64_t r0 = 0; r0 < rows; r0 += (MR)) {                                                       \
                const int R = rows - r0 < (MR) ? (int)(rows - r0) : (MR);                                       \
                const float *bp = (const float *)C->w + p * panel;                                              \
                if (R == (MR)) f32_micro(C, x + r0 * xs, xs, i0 + r0, (MR), bp, p * (NR));                      \
                else f32_micro(C, x + r0 * xs, xs, i0 + r0, R, bp, p * (NR));                                   \
            }                                                                                                   \
    }

/* The exported entry points, for a variant that defines `gemm_kernel_of(kind)` (NULL for a kind it lacks):
 * `kind` names a kernel to Python, so one library holds several. Arguments: abi.h's structs. */
#define BIVIT_GEMM_ENTRIES                                                                                       \
    size_t bivit_gemm_packed_bytes(const struct bivit_gemm_pack_args *a) {                                      \
        const struct gemm_kernel *G = gemm_kernel_of(a->kind);                                                  \
        return G && a->N > 0 && a->K > 0 ? G->packed_bytes(a->N, a->K) : 0;                                    \
    }                                                                                                           \
    int bivit_gemm_pack(const struct bivit_gemm_pack_args *a) {                                                 \
        const struct gemm_kernel *G = gemm_kernel_of(a->kind);                                                  \
        return G ? gemm_pack(G, a->w, a->w_row, a->wt, a->N, a->K, a->out, a->threads) : RC_UNSUPPORTED;        \
    }                                                                                                           \
    int bivit_gemm(const struct bivit_gemm_args *a) {                                                           \
        const struct gemm_kernel *G = gemm_kernel_of(a->kind);                                                  \
        if (!G) return RC_UNSUPPORTED;                                                                          \
        const struct gemm_call C = {.x = a->x, .x_row = a->x_row, .xt = a->xt, .w = a->w, .bias = a->bias,     \
                                    .y = a->y, .y_row = a->y_row, .yt = a->yt, .act = a->act,                   \
                                    .flush = a->flush, .M = a->M, .N = a->N, .K = a->K};                        \
        return gemm_run(G, &C, a->threads);                                                                     \
    }                                                                                                           \
    /* FLOPs of `steps` rounds of kernel `kind`'s peak loop on each of `threads` threads; -1 where it has none. */ \
    double bivit_gemm_peak(int kind, int64_t steps, int threads) {                                              \
        const struct gemm_kernel *G = gemm_kernel_of(kind);                                                     \
        if (!G || !G->peak || steps < 1 || threads < 1) return -1.0;                                            \
        double flops = 0.0;                                                                                     \
        _Pragma("omp parallel num_threads(threads) reduction(+ : flops)") flops += G->peak(steps);              \
        return flops;                                                                                           \
    }

#endif
