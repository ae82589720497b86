/* AVX-512 VNNI kernels for int8 activations (w8a8 / w4a8) and 2 <= t <= 16 tokens: each row's codes
 * are read once per call and meet every token's int8 activations by vpdpbusd.
 *
 * Shapes and formats as in common.h: xq int8 [T, C], d / qsum float32 [T, G], y float32 [T, ldy],
 * rows [r0, r1). Per block of 2 rows:
 *   - q4 rows are unpacked once into one byte per code in column order (u, 2 x C bytes in L1); q8
 *     codes are used as they are (vpdpbusd's unsigned operand);
 *   - per tile of TT <= 8 tokens (2 x TT float accumulators of 16 lanes in zmm) and per group: the
 *     integer dots of 64 columns per vpdpbusd (a group's last 32 and 16 columns by masked loads into
 *     the low lanes, as avx512.c's ymm / xmm steps), then acc[i][t] += float(dot) * s_j d_j, and y = sum of the 16 lanes - the
 *     row's zero-point term (row_prep), as the one-token kernels in avx512.c do.
 * The dots are integers (exact) with the same 64-column lanes as avx512.c's q8_a8_512_g /
 * q4_a8_512_g (their 32- and 16-column steps fill the low lanes of the same sums), and the float32
 * operations are theirs in the same order: y equals, bit for bit, what those kernels give token by
 * token (tests/test_kernels_avx512.py compares them exactly).
 * Returns 1 where it has no kernel (T < 2, T > 16), so the token-by-token loop runs.
 */
#include "avx512.h"

#include "avx512_begin.h"

/* A q4 row's C codes, one byte each in column order (u: C bytes). The format's blocks of 32 columns
 * in 16 bytes (byte i = code i | code i + 16 << 4), two at a time; the last block of 16 columns
 * (byte i = code i | code i + 8 << 4) as avx512.c's q4_a8_512_g unpacks them. */
static inline __attribute__((always_inline)) void q4_unpack(const uint8_t* b, i64 C, uint8_t* u) {
    const __m512i m15 = _mm512_set1_epi8(15), sh = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    i64 k = 0;
    for (; k + 64 <= C; k += 64) {
        const __m512i c = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b + k / 2)));
        _mm512_storeu_si512(u + k, _mm512_and_si512(_mm512_srlv_epi64(_mm512_shuffle_i64x2(c, c, 0x50), sh), m15));
    }
    if (k + 32 <= C) {
        const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + k / 2)));
        _mm256_storeu_si256((__m256i*)(u + k),
                            _mm256_and_si256(_mm256_srlv_epi64(c, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15)));
        k += 32;
    }
    if (k < C) {
        const __m128i bb = _mm_loadl_epi64((const __m128i*)(b + k / 2));
        _mm_storeu_si128((__m128i*)(u + k), _mm_and_si128(_mm_unpacklo_epi64(bb, _mm_srli_epi16(bb, 4)), _mm_set1_epi8(15)));
    }
}

/* One group's columns [k0, k0 + n) for rows c0, c1 and tokens [0, TT): the integer dots (64 columns
 * per vpdpbusd; the last 32, then 16, by masked loads into the low lanes: masked-out bytes are 0, so
 * those lanes add 0, as avx512.c's ymm / xmm steps), then acc[i][t] += float(dot) * sv[i][t][j].
 * n is g (a constant in each instance: the steps unroll) or a row's shorter last group. */
#define A8_GROUP(n_)                                                                               \
    do {                                                                                           \
        const i64 n = (n_);                                                                        \
        _Pragma("GCC unroll 8") for (int t = 0; t < TT; t++) {                                     \
            const int8_t* q = xq + t * C + k0;                                                     \
            __m512i s0 = _mm512_setzero_si512(), s1 = s0;                                          \
            i64 o = 0;                                                                             \
            for (; o + 64 <= n; o += 64) {  /* unrolled where n is a constant */                      \
                const __m512i qv = _mm512_loadu_si512(q + o);                                      \
                s0 = _mm512_dpbusd_epi32(s0, _mm512_loadu_si512(c0 + k0 + o), qv);                 \
                s1 = _mm512_dpbusd_epi32(s1, _mm512_loadu_si512(c1 + k0 + o), qv);                 \
            }                                                                                      \
            for (; o < n;) {                                                                       \
                const i64 w_ = n - o >= 32 ? 32 : 16;                                              \
                const __mmask64 m = ((__mmask64)1 << w_) - 1;                                      \
                const __m512i qv = _mm512_maskz_loadu_epi8(m, q + o);                              \
                s0 = _mm512_dpbusd_epi32(s0, _mm512_maskz_loadu_epi8(m, c0 + k0 + o), qv);         \
                s1 = _mm512_dpbusd_epi32(s1, _mm512_maskz_loadu_epi8(m, c1 + k0 + o), qv);         \
                o += w_;                                                                           \
            }                                                                                      \
            acc[0][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(sv[0][t][j]), acc[0][t]); \
            acc[1][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(sv[1][t][j]), acc[1][t]); \
        }                                                                                          \
    } while (0)

/* Rows ri[0], ri[1] (codes c0, c1 one byte each, C per row) x tokens [0, TT): y[t, r + i] for i < nr.
 * pf: the bytes ahead to prefetch (0: none) in the rows' packed codes p0, p1 (hb: 1 where a code is
 * half a byte, q4). */
static inline __attribute__((always_inline)) void a8_tile(const int TT, const int8_t* xq, const float* d,
        const float* qsum, const uint8_t* c0, const uint8_t* c1, const uint16_t* scales, const uint8_t* zeros,
        i64 C, const i64 g, const i64* ri, float* y, i64 ldy, i64 r, i64 nr, const uint8_t* p0, const uint8_t* p1,
        const int hb, i64 pf) {
    const i64 G = (C + g - 1) / g, GF = C / g;  /* groups, whole groups */
    float sv[2][8][G];
    float zt[2][8];
    _Pragma("GCC unroll 1") for (int t = 0; t < TT; t++) {  /* not unrolled: small code, quick build */
        zt[0][t] = row_prep(scales + ri[0] * G, zeros + ri[0] * G, d + t * G, qsum + t * G, 0.0f, G, sv[0][t]);
        zt[1][t] = row_prep(scales + ri[1] * G, zeros + ri[1] * G, d + t * G, qsum + t * G, 0.0f, G, sv[1][t]);
    }
    __m512 acc[2][8];
    _Pragma("GCC unroll 8") for (int t = 0; t < TT; t++) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
    const i64 gb = hb ? g / 2 : g;  /* packed bytes per group */
    for (i64 j = 0; j < GF; j++) {
        const i64 k0 = j * g, b0 = j * gb;
        if (pf && ((b0 & 63) == 0 || gb >= 64)) {  /* the rows PF_BYTES ahead, about once per 64 bytes */
            pf_span(p0 + b0 + pf, gb < 64 ? 64 : gb);
            pf_span(p1 + b0 + pf, gb < 64 ? 64 : gb);
        }
        A8_GROUP(g);
    }
    if (GF < G) {
        const i64 j = GF, k0 = j * g;
        A8_GROUP(C - k0);
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < TT; t++) {
        y[t * ldy + r] = _mm512_reduce_add_ps(acc[0][t]) - zt[0][t];
        if (nr > 1) y[t * ldy + r + 1] = _mm512_reduce_add_ps(acc[1][t]) - zt[1][t];
    }
}
#undef A8_GROUP

#define A8_TILE_G(G_)                                                                              \
    a8_tile(TT_, xq + t0 * C, d + t0 * G, qsum + t0 * G, c0, c1, scales, zeros, C, G_, ri, y + t0 * ldy, ldy, r, \
            nr, p[0], p[1], kind == KIND_Q4, t0 == 0 ? ahead : 0)
/* g = 64 (the default) and 128 as constants (a group's steps unroll), other g as a variable. */
#define A8_TILE(TT)                                                                                \
    do {                                                                                           \
        enum { TT_ = TT };                                                                         \
        if (g == 64) A8_TILE_G(64);                                                                \
        else if (g == 128) A8_TILE_G(128);                                                         \
        else A8_TILE_G(g);                                                                         \
    } while (0)

int a8_tokens_avx512(int kind, const int8_t* xq, const float* d, const float* qsum, i64 T, const uint8_t* codes,
                     const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0,
                     i64 r1) {
    if (T < 2 || T > 16 || (kind != KIND_Q8 && kind != KIND_Q4)) return 1;
    const i64 G = (C + g - 1) / g, rb = kind == KIND_Q4 ? C / 2 : C, ahead = pf_ahead(rb, 2);
    uint8_t u[2][C + 64];
    for (i64 r = r0; r < r1; r += 2) {
        const i64 nr = r1 - r < 2 ? r1 - r : 2;
        const i64 ri[2] = {r, r + nr - 1};  /* a single last row is computed twice, written once */
        const uint8_t* p[2] = {codes + ri[0] * rb, codes + ri[1] * rb};
        prefetch_scales(scales, zeros, G, r + 2 * PF_BLOCKS, 2, r1);
        const uint8_t *c0 = p[0], *c1 = p[1];
        if (kind == KIND_Q4) {
            q4_unpack(p[0], C, u[0]);
            q4_unpack(p[1], C, u[1]);
            c0 = u[0];
            c1 = u[1];
        }
        for (i64 t0 = 0; t0 < T;) {  /* tiles of 8 tokens, then 4, 2, 1 */
            const i64 left = T - t0;
            if (left >= 8) { A8_TILE(8); t0 += 8; }
            else if (left >= 4) { A8_TILE(4); t0 += 4; }
            else if (left >= 2) { A8_TILE(2); t0 += 2; }
            else { A8_TILE(1); t0 += 1; }
        }
    }
    return 0;
}
#undef A8_TILE
#undef A8_TILE_G

#include "avx512_end.h"
