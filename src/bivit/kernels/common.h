/* What every attention variant shares: the items of a call, the packed scratch, the split into work units and
 * the entry points. A variant (one .c file per instruction set) supplies how one head of one item is packed
 * and how one unit is computed; this file hands them out.
 *
 * One call covers every item of a packed batch (`cu[i]`..`cu[i + 1]` are item i's rows): one OpenMP region per
 * layer instead of one per item, which is what many small items (32 images of 64 patches) pay for otherwise.
 *
 * Invariance: an item's work is split into (head, block of `bq` query rows) units, each computed start to
 * finish by one thread (SMALL_N: how units are grouped into tasks), in an order that depends only on that
 * item's size; items never share a unit. So an item's output bits depend neither on the other items of the
 * call, nor on the thread count, nor on which thread ran which unit. Units are handed out dynamically: a
 * descheduled thread on a shared machine does not hold the others back, and bits cannot change.
 *
 * Layout: q/k/v/out rows are `*_row` elements apart, heads `*_head` apart, head_dim contiguous. `lse`, when not
 * NULL, receives each row's log-sum-exp of the scaled scores, item by item as [heads][n] floats (what a
 * backward pass needs).
 *
 * RoPE: when `cos`/`sin` are not NULL (fp32 [rows][d] tables, row = row of the call, d even), q and k are
 * rotated as they are packed, with rope.h's arithmetic: the same bits as rotating them first (rope.h's kernel
 * or PyTorch's form), without writing the rotated q and k out and reading them back (a pass over 2 x rows x
 * heads x d values that costs as much as the attention of small items).
 */
#ifndef BIVIT_ATTENTION_COMMON_H
#define BIVIT_ATTENTION_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "arith.h"
#include "rope.h"

typedef uint16_t bf16;

#define MAX_D 128  /* the register blocking of every variant covers head dims up to this (K2.x: 72, K3: 128) */
/* Keys per chunk of the values' sums, chunk sums added in order (arith.h; every variant): an fp32 sum of
 * thousands of terms loses less than one running accumulator does. */
#define PV_CHUNK 128

/* `static V exp2_neg(V x)`: 2^x for x <= 0 on a vector of floats, arith.h's exp2_neg_s lane by lane. x is clamped
 * at EXP2_LO (-126, the smallest normal power: terms below 2^-126 of the largest cannot move a sum), n = ROUND(x)
 * to nearest, p = 2^(x - n) for x - n in [-0.5, 0.5] by arith.h's degree-7 polynomial (coefficients ln2^k / k!)
 * in Horner's rule with the variant's fused multiply-add, then SCALE(p, n) = p * 2^n (exact: a power of two
 * times a normal number, one rounding). V: the vector type; P: its intrinsics' prefix (_mm256, _mm512). */
#define EXP2_NEG_DEF(V, P, ROUND, SCALE)                                                                         \
    static inline V exp2_neg(V x) {                                                                             \
        x = P##_max_ps(x, P##_set1_ps(EXP2_LO));                                                                \
        const V n = ROUND(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                    \
        const V f = P##_sub_ps(x, n);                                                                           \
        V p = P##_set1_ps(EXP2_C7);                                                                             \
        p = P##_fmadd_ps(p, f, P##_set1_ps(EXP2_C6));                                                           \
        p = P##_fmadd_ps(p, f, P##_set1_ps(EXP2_C5));                                                           \
        p = P##_fmadd_ps(p, f, P##_set1_ps(EXP2_C4));                                                           \
        p = P##_fmadd_ps(p, f, P##_set1_ps(EXP2_C3));                                                           \
        p = P##_fmadd_ps(p, f, P##_set1_ps(EXP2_C2));                                                           \
        p = P##_fmadd_ps(p, f, P##_set1_ps(EXP2_C1));                                                           \
        p = P##_fmadd_ps(p, f, P##_set1_ps(1.0f));                                                              \
        return SCALE(p, n);                                                                                     \
    }

static inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

static void *alloc64(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, round_up(bytes ? bytes : 64, 64)) != 0) return NULL;
    return p;
}

/* One item of a call: its rows, its packed keys/values (all heads; NULL for a small item, whose heads are packed
 * into the running thread's own buffer), its first task. */
struct item {
    int64_t n, row0, qblocks, task0;
    int small;
    char *kpack, *vpack;
    size_t kp_head, vp_head;  /* bytes per head */
};

/* An item of at most SMALL_N rows is done head by head: one task packs a head's keys and values into the
 * thread's own buffer and runs all of that head's units at once, while they are in the core's cache. Larger
 * items pack every head first (one pass, all threads), then hand out single units, so one large image keeps
 * many cores busy. Which way an item goes does not change a unit's arithmetic: only where its packed keys
 * live. (Packing 32 items of 64 rows up front wrote 10 MB that the units then read back from far caches: the
 * call ran at half the speed of the same items one by one.) */
#define SMALL_N 256

struct call {
    const char *q, *k, *v;
    char *out;
    int64_t d, heads, q_row, k_row, v_row, out_row, q_head, k_head, v_head, out_head;
    float scale2, *lse;  /* scale2 = scale * log2(e): scores are exponentiated base 2 */
    const float *cos, *sin; /* RoPE tables, or NULL */
    int64_t hgroup;      /* heads per task of a small item */
    int bf;              /* bf16 q/k/v (else float32) */
    int obf;             /* bf16 out (else float32) */
    size_t esize, oesize;
};

static inline const char *row_of(const char *base, int64_t row, int64_t row_stride, int64_t h, int64_t head_stride,
                                  size_t esize) {
    return base + (row * row_stride + h * head_stride) * (int64_t)esize;
}

/* What a variant supplies. Sizes are in bytes, per head of an item of n rows (scratch: per thread, for the
 * largest item of the call). */
struct variant {
    int64_t bq;
    size_t (*kpack_bytes)(int64_t n, int64_t d, int bf);
    size_t (*vpack_bytes)(int64_t n, int64_t d, int bf);
    size_t (*scratch_bytes)(int64_t n, int64_t d, int bf);
    void (*pack_head)(const struct call *C, const struct item *it, int64_t h);
    void (*run_unit)(const struct call *C, const struct item *it, int64_t h, int64_t i0, void *scratch);
};

/* Row i of head h of an item gets its log-sum-exp of the scaled scores (natural log), from the base-2 maximum
 * `max2` and the sum `total` of 2^(s - max2): the [heads][n]-per-item layout of `lse` the backward pass reads. */
static inline void store_lse(const struct call *C, const struct item *it, int64_t h, int64_t i, float max2,
                             float total) {
    if (C->lse) C->lse[it->row0 * C->heads + h * it->n + i] = (max2 + log2f(total)) * 0.6931471805599453f;
}

/* The item that owns task t: the last one starting at or before t (an empty item owns no task and shares its
 * task0 with the next item, so the last one is never empty). */
static const struct item *task_item(const struct item *items, int64_t count, int64_t t) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (items[mid].task0 <= t) lo = mid;
        else hi = mid - 1;
    }
    return &items[lo];
}

/* Ask for head h's q, k and v rows of an item while the previous head is computed: the rows of one head are a
 * few hundred bytes each, a whole qkv row apart, a stride the hardware prefetchers do not follow. */
static void prefetch_head(const struct call *C, const struct item *it, int64_t h) {
    const int64_t bytes = C->d * (int64_t)C->esize;
    for (int64_t j = 0; j < it->n; j++) {
        const char *rows[3] = {row_of(C->q, it->row0 + j, C->q_row, h, C->q_head, C->esize),
                               row_of(C->k, it->row0 + j, C->k_row, h, C->k_head, C->esize),
                               row_of(C->v, it->row0 + j, C->v_row, h, C->v_head, C->esize)};
        for (int t = 0; t < 3; t++)
            for (uintptr_t a = (uintptr_t)rows[t] & ~(uintptr_t)63; a < (uintptr_t)rows[t] + bytes; a += 64)
                __builtin_prefetch((const void *)a, 0, 3);
    }
}

/* One task: `hgroup` heads of a small item (each packed here, into `kbuf`/`vbuf`, the next one's rows prefetched
 * meanwhile), or one unit of a large item. */
static void run_task(const struct variant *V, const struct call *C, const struct item *it, int64_t local,
                     void *scratch, char *kbuf, char *vbuf) {
    if (!it->small) {
        V->run_unit(C, it, local / it->qblocks, (local % it->qblocks) * V->bq, scratch);
        return;
    }
    struct item mine = *it;  /* this head's packed keys/values, alone in the thread's buffers */
    mine.kpack = kbuf;
    mine.vpack = vbuf;
    mine.kp_head = mine.vp_head = 0;
    const int64_t h0 = local * C->hgroup, h1 = h0 + C->hgroup < C->heads ? h0 + C->hgroup : C->heads;
    for (int64_t h = h0; h < h1; h++) {
        if (h + 1 < h1) prefetch_head(C, it, h + 1);
        V->pack_head(C, &mine, h);
        for (int64_t b = 0; b < it->qblocks; b++) V->run_unit(C, &mine, h, b * V->bq, scratch);
    }
}

/* Heads per task of a small item: 4 where small items give every thread at least 16 such tasks (what the
 * prefetch of the next head needs: the same thread computes it), else 1 (a lone small item still spreads over
 * the threads). Grouping only decides which thread runs a head, never its arithmetic. */
#define HEAD_GROUP 4

static int64_t head_group(const struct item *items, int64_t count, int64_t heads, int threads) {
    int64_t small = 0;
    for (int64_t i = 0; i < count; i++) small += items[i].n && items[i].small;
    return small * heads >= (int64_t)HEAD_GROUP * 16 * threads ? HEAD_GROUP : 1;
}

/* Returns RC_OK, RC_NO_MEMORY, RC_UNSUPPORTED for an unsupported head dim (or an odd one with RoPE tables), or
 * RC_BAD_SIZES for bad offsets (abi.h). */
static int run_call(const struct variant *V, struct call *C, const int64_t *cu, int64_t count, int threads) {
    if (C->d < 1 || C->d > MAX_D || (C->cos && C->d % 2)) return RC_UNSUPPORTED;
    if (count <= 0 || C->heads <= 0) return 0;
    struct item *items = malloc((size_t)count * sizeof *items);
    if (!items) return RC_NO_MEMORY;
    size_t kbytes = 0, vbytes = 0, kbuf_bytes = 64, vbuf_bytes = 64;
    int64_t tasks = 0, nmax = 0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = cu[i + 1] - cu[i];
        if (n < 0) { free(items); return RC_BAD_SIZES; }
        struct item *it = &items[i];
        it->n = n;
        it->row0 = cu[i];
        it->qblocks = (n + V->bq - 1) / V->bq;
        it->small = n <= SMALL_N;
        it->kpack = it->vpack = NULL;
        it->kp_head = n ? round_up(V->kpack_bytes(n, C->d, C->bf), 64) : 0;
        it->vp_head = n ? round_up(V->vpack_bytes(n, C->d, C->bf), 64) : 0;
        if (!n) continue;
        if (it->small) {
            if (it->kp_head > kbuf_bytes) kbuf_bytes = it->kp_head;
            if (it->vp_head > vbuf_bytes) vbuf_bytes = it->vp_head;
        } else {
            kbytes += it->kp_head * C->heads;
            vbytes += it->vp_head * C->heads;
        }
        if (n > nmax) nmax = n;
    }
    C->hgroup = head_group(items, count, C->heads, threads);
    for (int64_t i = 0; i < count; i++) {
        items[i].task0 = tasks;
        if (items[i].n) tasks += items[i].small ? (C->heads + C->hgroup - 1) / C->hgroup : C->heads * items[i].qblocks;
    }
    char *kpack = alloc64(kbytes), *vpack = alloc64(vbytes);
    if (!kpack || !vpack) { free(kpack); free(vpack); free(items); return RC_NO_MEMORY; }
    for (int64_t i = 0, ko = 0, vo = 0; i < count; i++) {
        if (items[i].small) continue;
        items[i].kpack = kpack + ko;
        items[i].vpack = vpack + vo;
        ko += items[i].kp_head * C->heads;
        vo += items[i].vp_head * C->heads;
    }
    const size_t scratch = round_up(V->scratch_bytes(nmax, C->d, C->bf), 64);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* Packing (and RoPE) runs IEEE; a unit switches to its dtype's mode for its products (arith.h). */
        const fp_state fp = fp_enter(0);
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < count * C->heads; p++) {
            const struct item *it = &items[p / C->heads];
            if (it->n && !it->small) V->pack_head(C, it, p % C->heads);
        }
        char *buf = alloc64(scratch + kbuf_bytes + vbuf_bytes);
        if (!buf) {
#pragma omp atomic write
            failed = RC_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!buf) continue;
            const struct item *it = task_item(items, count, t);
            if (t + threads < tasks) {  /* likely this thread's next task (units are handed out in turn) */
                const struct item *next = task_item(items, count, t + threads);
                if (next->small) prefetch_head(C, next, (t + threads - next->task0) * C->hgroup);
            }
            run_task(V, C, it, t - it->task0, buf, buf + scratch, buf + scratch + kbuf_bytes);
        }
        free(buf);
        fp_leave(fp);
    }
    free(kpack);
    free(vpack);
    free(items);
    return failed;
}

/* The call a variant computes, from the exported arguments (abi.h): scores are exponentiated base 2. */
static inline struct call call_of(const struct bivit_attention_args *a, int bf) {
    struct call C = {.q = a->q, .k = a->k, .v = a->v, .out = a->out, .d = a->d, .heads = a->heads,
                     .q_row = a->q_row, .k_row = a->k_row, .v_row = a->v_row, .out_row = a->out_row,
                     .q_head = a->q_head, .k_head = a->k_head, .v_head = a->v_head, .out_head = a->out_head,
                     .scale2 = a->scale * 1.4426950408889634f, .lse = a->lse, .cos = a->cos, .sin = a->sin,
                     .bf = bf, .obf = bf && a->yt == E_BF16, .esize = bf ? 2 : 4,
                     .oesize = bf && a->yt == E_BF16 ? 2 : 4};
    return C;
}

/* The exported entry points of a variant whose file defines `BQ`, the size functions and the dtype-generic
 * `pack_head_t(C, it, h, bf)` and `run_unit_t(C, it, h, i0, scratch, bf)`: per-dtype instances (the dtype is
 * a constant inside each, so every branch on it folds away) and `bivit_attention_bf16` / `_f32`, each taking
 * `const struct bivit_attention_args *`. */
#define BIVIT_ATTENTION_ENTRY(FN, BF)                                                                            \
    int FN(const struct bivit_attention_args *a) {                                                              \
        struct call C = call_of(a, BF);                                                                         \
        return run_call(&VARIANT, &C, a->cu, a->count, a->threads);                                             \
    }
#define BIVIT_VARIANT                                                                                            \
    static void pack_head(const struct call *C, const struct item *it, int64_t h) {                             \
        if (C->bf) pack_head_t(C, it, h, 1);                                                                    \
        else pack_head_t(C, it, h, 0);                                                                          \
    }                                                                                                           \
    static void run_unit(const struct call *C, const struct item *it, int64_t h, int64_t i0, void *scratch) {   \
        if (C->bf) run_unit_t(C, it, h, i0, scratch, 1);                                                        \
        else run_unit_t(C, it, h, i0, scratch, 0);                                                              \
    }                                                                                                           \
    static const struct variant VARIANT = {BQ, kpack_bytes, vpack_bytes, scratch_bytes, pack_head, run_unit};   \
    BIVIT_ATTENTION_ENTRY(bivit_attention_bf16, 1)                                                              \
    BIVIT_ATTENTION_ENTRY(bivit_attention_f32, 0)

#endif
