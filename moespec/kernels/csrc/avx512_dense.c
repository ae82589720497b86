/* The dense path's int8 rows at one token (its bound weights, spin.c), AVX-512.
 *
 * Shapes and format as common.h's q8: codes uint8 [R, C], scales float16 / zeros uint8 [R, G]; this
 * kernel takes g % 64 == 0 and C % g == 0 (the dense path's int8 weights: g = 64, C = 576 or 1024
 * on the default model) and returns 1 for anything else (avx512.c's q8 kernel runs).
 *
 * Exact as avx512.c's q8_t1_512_g: the group's zero point factored out, per group p = sum q * x in
 * float32 (two partial sums), acc += s * p, y = sum(acc) - sum_j s_j z_j xs_j; the columns meet
 * their partial sums in another order (so the two kernels agree within float32 rounding, not bit
 * for bit). What differs is how the codes become floats: 64 codes per load, spread to the low
 * bytes of dwords by vpshufb within each 128-bit lane (dword 4k + j of step b holds column
 * 16k + 4b + j of the 64), against x permuted once per call into that order, instead of one
 * cross-lane vpmovzxbd per 16 codes; and one row at a time, so the codes are one sequential
 * stream (as t1.c's dense_row_t1 reads float32 rows). A row's value depends on that row alone, so
 * a product split over the spin pool stays bit-equal to the serial one.
 * Measured in scripts/dense_lowbit_bench.py (one thread, 2 MB pages, one exclusive hold, 5 pairs
 * alternating with main's kernel): see docs/decisions.md 2026-12-03 "int8 dense rows".
 */
#include "avx512.h"
#include "avx512_begin.h"

#define SHUF_LANE(b) (4 * (b)), -128, -128, -128, (4 * (b) + 1), -128, -128, -128, (4 * (b) + 2), -128, -128, -128, \
                     (4 * (b) + 3), -128, -128, -128
#define SHUF_ROW(b) {SHUF_LANE(b), SHUF_LANE(b), SHUF_LANE(b), SHUF_LANE(b)}
static const int8_t SHUF[4][64] __attribute__((aligned(64))) = {SHUF_ROW(0), SHUF_ROW(1), SHUF_ROW(2), SHUF_ROW(3)};
#undef SHUF_ROW
#undef SHUF_LANE

static inline __attribute__((always_inline)) void q8_dense_g(const float* x, const float* xs, const uint8_t* codes,
        const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0, i64 r1) {
    const i64 G = C / g;
    float sv[G];
    /* x in the codes' lane order: per 64 columns a 4 x 4 transpose of 4-float blocks, block (k, b) =
     * columns 16k + 4b .. + 3 to lanes 4k .. 4k + 3 of step b (once per call: a product split over
     * the pool permutes it once per chunk, so it is 16 shuffles per 64 columns, not a scalar loop) */
    float xp[C] __attribute__((aligned(64)));
    for (i64 c = 0; c < C; c += 64) {
        const __m512 r0 = _mm512_loadu_ps(x + c), r1 = _mm512_loadu_ps(x + c + 16);
        const __m512 r2 = _mm512_loadu_ps(x + c + 32), r3 = _mm512_loadu_ps(x + c + 48);
        const __m512 t0 = _mm512_shuffle_f32x4(r0, r1, 0x44), t1 = _mm512_shuffle_f32x4(r0, r1, 0xEE);
        const __m512 t2 = _mm512_shuffle_f32x4(r2, r3, 0x44), t3 = _mm512_shuffle_f32x4(r2, r3, 0xEE);
        _mm512_store_ps(xp + c, _mm512_shuffle_f32x4(t0, t2, 0x88));
        _mm512_store_ps(xp + c + 16, _mm512_shuffle_f32x4(t0, t2, 0xDD));
        _mm512_store_ps(xp + c + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
        _mm512_store_ps(xp + c + 48, _mm512_shuffle_f32x4(t1, t3, 0xDD));
    }
    __m512i m[4];  /* step b: byte 4b + j of each 128-bit lane to the low byte of its dword j */
    for (int b = 0; b < 4; b++) m[b] = _mm512_loadu_si512(SHUF[b]);
    const i64 ahead = pf_ahead(C, 1);
    for (i64 r = r0; r < r1; r++) {
        const uint8_t* row = codes + r * C;
        prefetch_scales(scales, zeros, G, r + 2 * PF_BLOCKS, 1, r1);
        const float z = row_prep(scales + r * G, zeros + r * G, NULL, xs, 0.0f, G, sv);
        __m512 acc = _mm512_setzero_ps();
        for (i64 j = 0; j < G; j++) {
            __m512 p = _mm512_setzero_ps(), q = p;
            for (i64 k = j * g; k < (j + 1) * g; k += 64) {
                _mm_prefetch((const char*)row + k + ahead, PF_HINT);
                const __m512i v = _mm512_loadu_si512(row + k);
                p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, m[0])), _mm512_load_ps(xp + k), p);
                q = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, m[1])), _mm512_load_ps(xp + k + 16), q);
                p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, m[2])), _mm512_load_ps(xp + k + 32), p);
                q = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, m[3])), _mm512_load_ps(xp + k + 48), q);
            }
            acc = _mm512_fmadd_ps(_mm512_add_ps(p, q), _mm512_set1_ps(sv[j]), acc);
        }
        y[r] = _mm512_reduce_add_ps(acc) - z;
    }
}

int dense_t1_avx512(int kind, const float* x, const float* xs, const void* w, const uint16_t* scales,
                    const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
    if (kind != KIND_Q8 || !xs || g % 64 != 0 || C % g != 0) return 1;
    const uint8_t* codes = (const uint8_t*)w;
#define Q8_DENSE(G_) q8_dense_g(x, xs, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q8_DENSE)
#undef Q8_DENSE
    return 0;
}

#include "avx512_end.h"
