/* Force-included (-include) before attention_avx512.c to build the avx512 variant for a CPU with AVX2 only:
 * SIMDe (simde-py) supplies AVX-512 F/BW/VL/DQ on AVX2 + FMA; what SIMDe does not model bit for bit, or lacks, is
 * modelled here, exactly as the instructions are documented:
 *
 *   vdpbf16ps      per lane: acc = fma(upper pair product), then fma(lower pair product), each rounded, bf16
 *                  and acc denormals read as zero, denormal results flushed (the SDM's "DAZ, FTZ, RNE")
 *   vcvtneps2bf16  to nearest even, denormal in and out as zero
 *   AMX tiles      eight 16 x 64-byte tiles; tdpbf16ps as a chain of such pair products in k order, the upper
 *                  element of each pair first (emu_set_amx_order(1)) or the lower first (0)
 *   masked loads and stores, gathers, narrowing conversions, permutes, reductions: element by element
 *
 * (the reductions as GCC's immintrin writes them). Test-only: tests/test_arith.py builds the variant with it. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include "simde/x86/avx512.h"

static inline float emu_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t emu_u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float emu_flush(float x) { return fabsf(x) < 1.17549435e-38f ? copysignf(0.0f, x) : x; }
static inline float emu_bf(uint16_t b) { return emu_flush(emu_f((uint32_t)b << 16)); }
static inline float emu_step(float acc, uint16_t a, uint16_t b) { return emu_flush(fmaf(emu_bf(a), emu_bf(b), emu_flush(acc))); }

static inline simde__m512 emu_dp512(simde__m512 src, simde__m512i a, simde__m512i b) {
    float s[16]; uint32_t x[16], y[16];
    memcpy(s, &src, 64); memcpy(x, &a, 64); memcpy(y, &b, 64);
    for (int i = 0; i < 16; i++) { s[i] = emu_step(s[i], x[i] >> 16, y[i] >> 16); s[i] = emu_step(s[i], x[i] & 0xFFFF, y[i] & 0xFFFF); }
    simde__m512 r; memcpy(&r, s, 64); return r;
}
static inline simde__m256 emu_dp256(simde__m256 src, simde__m256i a, simde__m256i b) {
    float s[8]; uint32_t x[8], y[8];
    memcpy(s, &src, 32); memcpy(x, &a, 32); memcpy(y, &b, 32);
    for (int i = 0; i < 8; i++) { s[i] = emu_step(s[i], x[i] >> 16, y[i] >> 16); s[i] = emu_step(s[i], x[i] & 0xFFFF, y[i] & 0xFFFF); }
    simde__m256 r; memcpy(&r, s, 32); return r;
}
static inline uint16_t emu_rne(float f) { uint32_t u = emu_u(emu_flush(f)); return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }
static inline simde__m256i emu_cvt512(simde__m512 v) { float f[16]; uint16_t o[16]; memcpy(f, &v, 64); for (int i = 0; i < 16; i++) o[i] = emu_rne(f[i]); simde__m256i r; memcpy(&r, o, 32); return r; }
static inline simde__m128i emu_cvt256(simde__m256 v) { float f[8]; uint16_t o[8]; memcpy(f, &v, 32); for (int i = 0; i < 8; i++) o[i] = emu_rne(f[i]); simde__m128i r; memcpy(&r, o, 16); return r; }
static inline simde__m256i emu_narrow512(simde__m512i v) { uint32_t x[16]; uint16_t o[16]; memcpy(x, &v, 64); for (int i = 0; i < 16; i++) o[i] = (uint16_t)x[i]; simde__m256i r; memcpy(&r, o, 32); return r; }
static inline simde__m128i emu_narrow256(simde__m256i v) { uint32_t x[8]; uint16_t o[8]; memcpy(x, &v, 32); for (int i = 0; i < 8; i++) o[i] = (uint16_t)x[i]; simde__m128i r; memcpy(&r, o, 16); return r; }
static inline void emu_mstore(void *p, unsigned k, const void *v, int n, int size) { for (int i = 0; i < n; i++) if ((k >> i) & 1) memcpy((char *)p + size * i, (const char *)v + size * i, size); }
static inline simde__m512 emu_mload512ps(unsigned k, const void *p) { float o[16] = {0}; for (int i = 0; i < 16; i++) if ((k >> i) & 1) memcpy(&o[i], (const char *)p + 4 * i, 4); simde__m512 r; memcpy(&r, o, 64); return r; }
static inline simde__m256i emu_mload256epi16(unsigned k, const void *p) { uint16_t o[16] = {0}; for (int i = 0; i < 16; i++) if ((k >> i) & 1) memcpy(&o[i], (const char *)p + 2 * i, 2); simde__m256i r; memcpy(&r, o, 32); return r; }
static inline simde__m512i emu_gather(simde__m512i src, unsigned k, simde__m512i idx, const void *base, int scale) {
    uint32_t s[16]; int32_t i[16]; memcpy(s, &src, 64); memcpy(i, &idx, 64);
    for (int l = 0; l < 16; l++) if ((k >> l) & 1) memcpy(&s[l], (const char *)base + (int64_t)i[l] * scale, 4);
    simde__m512i r; memcpy(&r, s, 64); return r;
}
static inline simde__m512 emu_permute(simde__m512 v, int imm) {
    float a[16], o[16]; memcpy(a, &v, 64);
    for (int l = 0; l < 16; l++) o[l] = a[(l & ~3) + ((imm >> (2 * (l & 3))) & 3)];
    simde__m512 r; memcpy(&r, o, 64); return r;
}
static inline simde__m256i emu_cvtps_ph(simde__m512 v) {
    float f[16]; uint16_t o[16]; memcpy(f, &v, 64);
    for (int i = 0; i < 16; i++) o[i] = _cvtss_sh(f[i], _MM_FROUND_TO_NEAREST_INT);
    simde__m256i r; memcpy(&r, o, 32); return r;
}
static inline float emu_reduce_add(simde__m512 v) {  /* GCC's order: halves, quarters, (0+2, 1+3), (0+1) */
    float a[16], t8[8], t4[4]; memcpy(a, &v, 64);
    for (int l = 0; l < 8; l++) t8[l] = a[l + 8] + a[l];
    for (int l = 0; l < 4; l++) t4[l] = t8[l + 4] + t8[l];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}
static inline float emu_reduce_max(simde__m512 v) { float a[16]; memcpy(a, &v, 64); float m = a[0]; for (int l = 1; l < 16; l++) m = a[l] > m ? a[l] : m; return m; }

#undef __m512bh
#undef __m256bh
#define __m512bh simde__m512i
#define __m256bh simde__m256i
#undef _mm512_dpbf16_ps
#undef _mm256_dpbf16_ps
#undef _mm512_cvtneps_pbh
#undef _mm256_cvtneps_pbh
#undef _mm512_cvtepi32_epi16
#undef _mm256_cvtepi32_epi16
#undef _mm_mask_storeu_epi16
#undef _mm256_mask_storeu_epi16
#undef _mm256_mask_storeu_ps
#undef _mm512_mask_storeu_ps
#undef _mm512_maskz_loadu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm512_mask_i32gather_epi32
#undef _mm512_permute_ps
#undef _mm512_cvtps_ph
#undef _mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_dpbf16_ps(s, a, b) emu_dp512((s), (simde__m512i)(a), (simde__m512i)(b))
#define _mm256_dpbf16_ps(s, a, b) emu_dp256((s), (simde__m256i)(a), (simde__m256i)(b))
#define _mm512_cvtneps_pbh(v) emu_cvt512(v)
#define _mm256_cvtneps_pbh(v) emu_cvt256(v)
#define _mm512_cvtepi32_epi16(v) emu_narrow512(v)
#define _mm256_cvtepi32_epi16(v) emu_narrow256(v)
#define _mm_mask_storeu_epi16(p, k, v) do { simde__m128i _v = (v); emu_mstore((p), (k), &_v, 8, 2); } while (0)
#define _mm256_mask_storeu_epi16(p, k, v) do { simde__m256i _v = (v); emu_mstore((p), (k), &_v, 16, 2); } while (0)
#define _mm256_mask_storeu_ps(p, k, v) do { simde__m256 _v = (v); emu_mstore((p), (k), &_v, 8, 4); } while (0)
#define _mm512_mask_storeu_ps(p, k, v) do { simde__m512 _v = (v); emu_mstore((p), (k), &_v, 16, 4); } while (0)
#define _mm512_maskz_loadu_ps(k, p) emu_mload512ps((k), (p))
#define _mm256_maskz_loadu_epi16(k, p) emu_mload256epi16((k), (p))
#define _mm512_mask_i32gather_epi32(src, k, idx, base, scale) emu_gather((src), (k), (idx), (base), (scale))
#define _mm512_permute_ps(v, imm) emu_permute((v), (imm))
#define _mm512_cvtps_ph(v, imm) emu_cvtps_ph(v)
#define _mm512_reduce_add_ps(v) emu_reduce_add(v)
#define _mm512_reduce_max_ps(v) emu_reduce_max(v)

/* AMX tiles. */
static __thread unsigned char emu_tiles[8][16][64];
static int emu_amx_upper_first = 1;
void emu_set_amx_order(int upper_first) { emu_amx_upper_first = upper_first; }
static inline void emu_loadd(int t, const void *base, long stride) { for (int r = 0; r < 16; r++) memcpy(emu_tiles[t][r], (const char *)base + r * stride, 64); }
static inline void emu_stored(int t, void *base, long stride) { for (int r = 0; r < 16; r++) memcpy((char *)base + r * stride, emu_tiles[t][r], 64); }
static inline void emu_tdp(int c, int a, int b) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc;
            memcpy(&acc, &emu_tiles[c][m][4 * n], 4);
            for (int k = 0; k < 16; k++) {
                uint16_t a0, a1, b0, b1;
                memcpy(&a0, &emu_tiles[a][m][4 * k], 2); memcpy(&a1, &emu_tiles[a][m][4 * k + 2], 2);
                memcpy(&b0, &emu_tiles[b][k][4 * n], 2); memcpy(&b1, &emu_tiles[b][k][4 * n + 2], 2);
                if (emu_amx_upper_first) { acc = emu_step(acc, a1, b1); acc = emu_step(acc, a0, b0); }
                else { acc = emu_step(acc, a0, b0); acc = emu_step(acc, a1, b1); }
            }
            memcpy(&emu_tiles[c][m][4 * n], &acc, 4);
        }
}
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(p) ((void)(p))
#define _tile_release() ((void)0)
#define _tile_zero(t) memset(emu_tiles[t], 0, 1024)
#define _tile_loadd(t, base, stride) emu_loadd((t), (const void *)(base), (long)(stride))
#define _tile_stored(t, base, stride) emu_stored((t), (void *)(base), (long)(stride))
#define _tile_dpbf16ps(c, a, b) emu_tdp((c), (a), (b))
