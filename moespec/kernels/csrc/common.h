/* moespec CPU kernels (common.h: shared helpers; t1.c, tokens.c, tiles.c, a8.c, expert.c): y[t, r] = sum_c x[t, c] * W[r, c] for a row range [r0, r1) of one weight.
 *
 * Shapes: T tokens, R rows (output features), C columns (input features), g group size,
 * G = ceil(C / g) groups per row. x is float32 [T, ldx], y float32 [T, ldy]; rows are independent, so
 * threads split a weight by row ranges.
 *
 * Weights (moespec/kernels/lowbit.py describes the same formats from the Python side):
 *   f32   float32 [R, C]; bf16 uint16 [R, C] (bfloat16 bits).
 *   q8    codes uint8 [R, C]; q4 codes uint8 [R, C/2]; with scales float16 [R, G] and zeros uint8
 *         [R, G]: w = (code - zero) * scale, groups of g consecutive columns of a row (the last
 *         group of a row may be shorter). C % 16 == 0 and g % 32 == 0.
 *   q4 code order within a row: blocks of 32 columns in 16 bytes, byte i = code i | code (i+16) << 4;
 *         when C % 32 == 16 the row ends with a block of 16 columns in 8 bytes, byte i = code i |
 *         code (i+8) << 4. Either block unpacks with one AND and one shift (llama.cpp's Q4 order).
 *
 * Exact kernels (float32 activations, float32 accumulation): for t = 1 the group's zero point is
 * factored out, sum_c (q_c - z) s x_c = s * (sum_c q_c x_c - z * sum_c x_c), so each weight costs
 * one integer->float conversion and one FMA; for t > 1 rows are dequantised exactly as the
 * reference does ((q - z) * s, one rounding) and multiplied with every token: t < TILES_MIN_T up to
 * 4 tokens at a time (tokens.c), more as register tiles of rows x 8 or 16 tokens (tiles.c).
 *
 * a8 kernels (int8 activations): each token's activations are quantised per weight group to int8
 * with one float32 scale (d = max|x| / 127, round to nearest even), and the dot products are integer
 * (vpmaddubsw + vpmaddwd, as llama.cpp's Q4_1 x Q8_1): NOT exact, chosen by --expert-dtype w8a8 | w4a8.
 *
 * Every function needs AVX2, FMA and F16C; lowbit.py checks the CPU before loading this library.
 */
#ifndef MOESPEC_KERNELS_COMMON_H
#define MOESPEC_KERNELS_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline __m256 bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 u8x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline i64 group_len(i64 j, i64 g, i64 C) { return (j + 1) * g <= C ? g : C - j * g; }

/* Prefetch the scales and zeros [*, G] of rows [r, r + n): the kernels call it for the block of
 * rows PF_BLOCKS blocks ahead of the one they compute (a few lines per block; the codes are
 * prefetched as they stream, below). */
#define PF_BLOCKS 2
static inline void prefetch_scales(const uint16_t* scales, const uint8_t* zeros, i64 G, i64 r, i64 n, i64 rows) {
    if (r >= rows) return;
    if (r + n > rows) n = rows - r;
    const char* s = (const char*)(scales + r * G);
    for (i64 o = 0; o < n * G * 2; o += 64) _mm_prefetch(s + o, _MM_HINT_T0);
    const char* z = (const char*)(zeros + r * G);
    for (i64 o = 0; o < n * G; o += 64) _mm_prefetch(z + o, _MM_HINT_T0);
}

/* Streaming prefetch inside the column loop: each row's line PF_BYTES ahead in the row stream is
 * requested as the kernel reaches the line before it, one request per 64 bytes consumed, so the
 * misses in flight stay steady instead of bursting (a burst of 32-64 requests per row block fills
 * the core's miss queue and the excess waits). */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif
static inline i64 pf_ahead(i64 rb, i64 rows_per_block) {
    const i64 blk = rb * rows_per_block;
    return (PF_BYTES + blk - 1) / blk * blk;  /* whole row blocks ahead: the same columns of later rows */
}
/* prefetcht1 (into L2), not t0: measured on this project's AMD EPYC VM (24 cold Qwen3-shaped
 * experts, one thread, exclusive lock, best of 10 passes, two rounds): int8 t = 1 0.36-0.41 ms
 * with t1 against 0.54-0.59 with t0 at every distance from 1 to 16 KiB (t0 requests hold the
 * L1's few miss buffers); w8a8 / w4a8 faster too in the benchmark (0.72-0.84 -> 0.43-0.55 ms,
 * 0.48-0.52 -> 0.38-0.41); the exact int4 kernel keeps t0 (pf_span_t0). */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
static inline __attribute__((always_inline)) void pf_span(const uint8_t* p, i64 n) {
    for (i64 o = 0; o < n; o += 64) _mm_prefetch((const char*)p + o, PF_HINT);
}
/* The exact int4 t = 1 kernel keeps t0: with t1 it measured slower in the same hold (24 cold
 * experts, best of 10: 0.336 / 0.322 ms with t0, 0.366 / 0.450 with t1). */
static inline __attribute__((always_inline)) void pf_span_t0(const uint8_t* p, i64 n) {
    for (i64 o = 0; o < n; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_Q8 = 2, KIND_Q4 = 3 };


/* Per row, before its groups: sv[j] = s_j * (dmul ? dmul[j] : 1) for every group j (float32, read by
 * the group loop with one broadcast load), and the row's zero-point term sum_j sv_j (z_j - zoff) w_j,
 * vectorised over groups (w: the activations' group sums). */
static inline float row_prep(const uint16_t* s, const uint8_t* z, const float* dmul, const float* w, float zoff, i64 G,
                      float* sv) {
    __m256 acc = _mm256_setzero_ps();
    const __m256 off = _mm256_set1_ps(zoff);
    i64 j = 0;
    for (; j + 8 <= G; j += 8) {
        __m256 sj = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + j)));
        if (dmul) sj = _mm256_mul_ps(sj, _mm256_loadu_ps(dmul + j));
        _mm256_storeu_ps(sv + j, sj);
        __m256 zj = _mm256_sub_ps(u8x8(z + j), off);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(sj, zj), _mm256_loadu_ps(w + j), acc);
    }
    float zt = hsum(acc);
    for (; j < G; j++) {
        sv[j] = half_to_float(s[j]) * (dmul ? dmul[j] : 1.0f);
        zt += sv[j] * ((float)z[j] - zoff) * w[j];
    }
    return zt;
}

/* The bit width and the group size as constants in each instance (measured: 3.5 -> 4.9 weights per
 * cycle for q8, g = 64, L2-resident), so each loop compiles without the other's branch and a
 * group's blocks unroll. CASE_G(f, ...) calls f with g = 32, 64, 128, 256 or the variable. */
#define CASE_G(call_g)                                                                             \
    switch (g) {                                                                                   \
        case 32: call_g(32); break;                                                                \
        case 64: call_g(64); break;                                                                \
        case 128: call_g(128); break;                                                              \
        case 256: call_g(256); break;                                                              \
        default: call_g(g); break;                                                                 \
    }
/* Entry points (declared here so the files call each other; Python binds them in native.py). */
void group_sums(const float* x, i64 T, i64 ldx, i64 C, i64 g, float* xs);
int linear_f32act(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                  const uint8_t* zeros, const float* xs, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1);
/* t >= TILES_MIN_T tokens: linear_tiles (tiles.c, each weight read once for every token); 2 <= t < it:
 * linear_tokens (tokens.c; measured faster there: a tile of 8 tokens computes padding lanes). */
#define TILES_MIN_T 5
int linear_tiles(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                 const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1);
void decode_cols(int kind, const void* w, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, i64 r, i64 k0,
                 i64 k1, float* out);
int linear_tokens(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                  const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1);
void dequant_q4(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* out,
                i64 r0, i64 r1);
void dequant_q8(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* out,
                i64 r0, i64 r1);
void quantize_act(const float* x, i64 T, i64 ldx, i64 C, i64 g, int8_t* xq, float* d, float* qsum);
int linear_a8(int kind, const int8_t* xq, const float* d, const float* qsum, i64 T, const uint8_t* codes,
              const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1);
void silu_mul(const float* gu, i64 T, i64 I, float* h, int bf16);
int expert_swiglu(int kind, int a8, int bf16_act, const float* x, i64 T, const uint8_t* base, i64 ow1, i64 os1,
                  i64 oz1, i64 ow2, i64 os2, i64 oz2, i64 H, i64 I, i64 g, float* y);
int experts_swiglu(int kind, int a8, int bf16_act, const float* x, i64 T, const uint8_t* base, i64 stride,
                   const i64* rows, i64 n, i64 ow1, i64 os1, i64 oz1, i64 ow2, i64 os2, i64 oz2, i64 H, i64 I,
                   i64 g, float* y);

#endif
