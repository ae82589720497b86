/* AVX-512 kernels for several tokens (2 <= t <= 16), exact, float32 activations: each weight is
 * read from memory once and dequantised once per tile of up to 8 tokens.
 *
 * Shapes and formats as in common.h: x float32 [T, ldx], y float32 [T, ldy], rows [r0, r1).
 * For a block of R rows and a tile of TT tokens (R = 4 for TT <= 4, else 2; R x TT accumulators of
 * 16 lanes stay in zmm registers), 16 columns at a time:
 *   - each row's 16 weights are dequantised into one zmm exactly as the reference does
 *     ((q - z) * s in float32, one rounding; q4 by a 16-entry vpermps table of (v - z) * s built once
 *     per group; bf16 widened; f32 loaded), so every product is the reference's product;
 *   - one FMA per row and token: acc[i][t] += w_i * x[t, k .. k + 16).
 * Only the order of the float32 sum differs from F.linear (16 lanes, then one horizontal sum).
 * The row block's bytes (<= 16 KiB) stay in L1/L2 across the tiles of a call, so with t = 16 the
 * codes come from memory once and are decoded twice. Lower bound on this project's Zen 4 (one zmm
 * FMA per cycle): t x R x C / 16 cycles, e.g. 4.7 M cycles (1.8 ms at 2.6 GHz) for a Qwen3-shaped
 * expert at t = 16, whatever the row format.
 * Returns 1 where it has no kernel (bf16 / f32 rows with C % 16 != 0, T > 16), so the AVX2 ones run.
 */
#include "avx512.h"

#include "avx512_begin.h"

/* The bytes of a row's columns [0, k): per format. */
static inline __attribute__((always_inline)) i64 col_bytes(const int kind, i64 k) {
    return kind == KIND_F32 ? 4 * k : kind == KIND_BF16 ? 2 * k : kind == KIND_Q8 ? k : k / 2;
}

/* acc[i][t] += w[i] * x[t, k .. k + 16) for the R rows and TT tokens. */
#define TOK_FMA(k_)                                                                                \
    do {                                                                                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < TT; t++) {                                     \
            const __m512 xv = _mm512_loadu_ps(x + t * ldx + (k_));                                 \
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) acc[i][t] =                        \
                _mm512_fmadd_ps(wv[i], xv, acc[i][t]);                                             \
        }                                                                                          \
    } while (0)

/* Rows [r, r + nr) (nr <= R; a short block repeats its last row, not written) x tokens [0, TT). */
static inline __attribute__((always_inline)) void tok_block(const int kind, const int R, const int TT,
        const float* x, i64 ldx, const void* w, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g,
        float* y, i64 ldy, i64 r, i64 nr, i64 ahead) {
    const i64 G = (C + g - 1) / g, nb = col_bytes(kind, C);
    const uint8_t* b[4];
    i64 ri[4];
    for (int i = 0; i < R; i++) {
        ri[i] = r + (i < nr ? i : nr - 1);
        b[i] = (const uint8_t*)w + ri[i] * nb;
    }
    __m512 acc[4][8], wv[4];
    _Pragma("GCC unroll 8") for (int t = 0; t < TT; t++)
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) acc[i][t] = _mm512_setzero_ps();
    if (kind == KIND_F32 || kind == KIND_BF16) {
        for (i64 k = 0; k < C; k += 16) {
            if ((col_bytes(kind, k) & 63) == 0)
                for (int i = 0; i < R; i++) _mm_prefetch((const char*)b[i] + col_bytes(kind, k) + ahead, PF_HINT);
            for (int i = 0; i < R; i++)
                wv[i] = kind == KIND_F32
                            ? _mm512_loadu_ps((const float*)b[i] + k)
                            : _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)b[i] + k))),
                                  16));
            TOK_FMA(k);
        }
    } else {
        const __m512 lut0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i tail_shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m512 zf[4], sf[4];
            for (int i = 0; i < R; i++) {
                zf[i] = _mm512_set1_ps((float)zeros[ri[i] * G + j]);
                sf[i] = _mm512_set1_ps(half_to_float(scales[ri[i] * G + j]));
                if (kind == KIND_Q4) zf[i] = _mm512_mul_ps(_mm512_sub_ps(lut0, zf[i]), sf[i]);  /* (v - z) * s */
            }
            if (kind == KIND_Q8) {
                for (i64 k = k0; k < k1; k += 16) {
                    if ((k & 63) == 0)
                        for (int i = 0; i < R; i++) _mm_prefetch((const char*)b[i] + k + ahead, PF_HINT);
                    for (int i = 0; i < R; i++)
                        wv[i] = _mm512_mul_ps(
                            _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b[i] + k)))),
                                          zf[i]),
                            sf[i]);
                    TOK_FMA(k);
                }
            } else {
                i64 k = k0;
                for (; k + 32 <= k1 && k + 32 <= C / 32 * 32; k += 32) {  /* a block of 32 columns in 16 bytes */
                    if ((k & 127) == 0)
                        for (int i = 0; i < R; i++) _mm_prefetch((const char*)b[i] + k / 2 + ahead, PF_HINT);
                    __m512i v[4];
                    for (int i = 0; i < R; i++) {
                        v[i] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b[i] + k / 2)));
                        wv[i] = _mm512_permutexvar_ps(v[i], zf[i]);  /* low nibbles: columns k .. k + 16 */
                    }
                    TOK_FMA(k);
                    for (int i = 0; i < R; i++) wv[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(v[i], 4), zf[i]);
                    TOK_FMA(k + 16);
                }
                if (k < k1) {  /* the row's last block of 16 columns in 8 bytes: byte i = code i | code i + 8 << 4 */
                    for (int i = 0; i < R; i++) {
                        const __m128i c = _mm_loadl_epi64((const __m128i*)(b[i] + k / 2));
                        wv[i] = _mm512_permutexvar_ps(
                            _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(c, c)), tail_shift), zf[i]);
                    }
                    TOK_FMA(k);
                }
            }
        }
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < TT; t++)
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) if (i < nr) y[t * ldy + r + i] = _mm512_reduce_add_ps(acc[i][t]);
}
#undef TOK_FMA

/* One kind: rows [r0, r1) in blocks of R; per block, tiles of up to 8 tokens (the block's bytes stay
 * in cache from one tile to the next, so each weight comes from memory once). */
#define TOK_TILE(R_, TT_) tok_block(kk, R_, TT_, x + t0 * ldx, ldx, w, scales, zeros, C, g, y + t0 * ldy, ldy, r, nr, ahead)
#define TOK_KIND(name, KIND)                                                                       \
    static void name(i64 T, const float* x, i64 ldx, const void* w, const uint16_t* scales,        \
                     const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1) {      \
        const int kk = KIND;                                                                       \
        const i64 R = T <= 4 ? 4 : 2, ahead = pf_ahead(col_bytes(kk, C), R);                       \
        for (i64 r = r0; r < r1; r += R) {                                                         \
            const i64 nr = r1 - r < R ? r1 - r : R;                                                \
            for (i64 t0 = 0; t0 < T; t0 += 8) {                                                    \
                switch (T - t0 < 8 ? T - t0 : 8) {                                                 \
                    case 1: TOK_TILE(2, 1); break;                                                 \
                    case 2: if (R == 4) TOK_TILE(4, 2); else TOK_TILE(2, 2); break;                \
                    case 3: if (R == 4) TOK_TILE(4, 3); else TOK_TILE(2, 3); break;                \
                    case 4: if (R == 4) TOK_TILE(4, 4); else TOK_TILE(2, 4); break;                \
                    case 5: TOK_TILE(2, 5); break;                                                 \
                    case 6: TOK_TILE(2, 6); break;                                                 \
                    case 7: TOK_TILE(2, 7); break;                                                 \
                    default: TOK_TILE(2, 8); break;                                                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
TOK_KIND(tok_f32, KIND_F32)
TOK_KIND(tok_bf16, KIND_BF16)
TOK_KIND(tok_q8, KIND_Q8)
TOK_KIND(tok_q4, KIND_Q4)
#undef TOK_KIND
#undef TOK_TILE

int tokens_avx512(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                  const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1) {
    if (T < 2 || T > 16 || ((kind == KIND_F32 || kind == KIND_BF16) && C % 16 != 0)) return 1;
    switch (kind) {
        case KIND_F32: tok_f32(T, x, ldx, w, scales, zeros, C, g, y, ldy, r0, r1); return 0;
        case KIND_BF16: tok_bf16(T, x, ldx, w, scales, zeros, C, g, y, ldy, r0, r1); return 0;
        case KIND_Q8: tok_q8(T, x, ldx, w, scales, zeros, C, g, y, ldy, r0, r1); return 0;
        case KIND_Q4: tok_q4(T, x, ldx, w, scales, zeros, C, g, y, ldy, r0, r1); return 0;
        default: return 1;
    }
}

#include "avx512_end.h"
