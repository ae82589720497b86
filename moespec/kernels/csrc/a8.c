/* int8 activations (--expert-dtype w8a8 | w4a8): not exact.
 *
 * quantize_act: per token and weight group, d = max|x| / 127,
 * xq = round_half_even(x * (127 / max|x|)) (int8), qsum = sum of xq (as float) over the group. */
#include "avx512.h"

void quantize_act(const float* x, i64 T, i64 ldx, i64 C, i64 g, int8_t* xq, float* d,
                  float* qsum) {
    const i64 G = (C + g - 1) / g;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (i64 t = 0; t < T; t++)
        for (i64 j = 0; j < G; j++) {
            const float* p = x + t * ldx + j * g;
            int8_t* q = xq + t * C + j * g;
            const i64 n = group_len(j, g, C);
            __m256 m = _mm256_setzero_ps();
            for (i64 k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + k)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float mx = _mm_cvtss_f32(m4);
            const float dd = mx / 127.0f, inv = mx > 0 ? 127.0f / mx : 0.0f;
            d[t * G + j] = dd;
            int32_t s = 0;
            for (i64 k = 0; k < n; k += 8) {
                __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + k), _mm256_set1_ps(inv)));
                int32_t tmp[8];
                _mm256_storeu_si256((__m256i*)tmp, v);
                for (int i = 0; i < 8; i++) {
                    int32_t qi = tmp[i] > 127 ? 127 : (tmp[i] < -127 ? -127 : tmp[i]);
                    q[k + i] = (int8_t)qi;
                    s += qi;
                }
            }
            qsum[t * G + j] = (float)s;
        }
}

static inline __m256i sum_i16_pairs(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

/* Low-bit rows x int8 activations: per group the integer dot sum q * xq, then
 * y = sum_j s_j d_j (dot_j - z_j * qsum_j).
 * int4: codes (<= 15) are vpmaddubsw's unsigned operand. int8: codes are unsigned, so c = (c - 128)
 * + 128; vpmaddubsw takes |c - 128| (<= 128, unsigned) with the sign of c - 128 moved onto xq
 * (|xq| <= 127, so negating is exact), the products stay within int16, and the zero point is
 * applied as z - 128 (two rows at a time sharing the loads of xq). */
#define A8_Q8_32(b_ptr, ia)                                                                        \
    do {                                                                                           \
        __m256i c_ = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(b_ptr)), bias);          \
        ia = _mm256_add_epi32(ia, sum_i16_pairs(_mm256_maddubs_epi16(_mm256_abs_epi8(c_), _mm256_sign_epi8(q, c_)))); \
    } while (0)
#define A8_Q8_16(b_ptr, ia)                                                                        \
    do {                                                                                           \
        __m128i c_ = _mm_xor_si128(_mm_loadu_si128((const __m128i*)(b_ptr)), _mm256_castsi256_si128(bias)); \
        __m128i p_ = _mm_madd_epi16(_mm_maddubs_epi16(_mm_abs_epi8(c_), _mm_sign_epi8(q16, c_)), _mm_set1_epi16(1)); \
        ia = _mm256_add_epi32(ia, _mm256_inserti128_si256(_mm256_setzero_si256(), p_, 0));         \
    } while (0)

/* q4 x int8, four rows at a time (g a compile-time constant in each instance, so a group's blocks
 * unroll): a 32-column block is loaded into both 128-bit lanes and shifted by 0 / 4 bits per lane
 * (one vpsrlvd) to give its 32 codes in order; products of a group are summed in int16 before one
 * vpmaddwd (a pair is at most 2 * 15 * 127 = 3810, so a group of up to 256 columns, 8 blocks,
 * stays below 32767). */
static inline __attribute__((always_inline)) void q4_a8_rows4_g(const int8_t* xq, const float* d, const float* qsum,
        const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0,
        i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C / 2;
    const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    float sv[4][G];
    const i64 ahead = pf_ahead(rb, 4);
    for (i64 r = r0; r < r1; r += 4) {
        i64 rr[4];
        const uint8_t* b[4];
        float zt[4];
        __m256 acc[4];
        for (int i = 0; i < 4; i++) {
            rr[i] = r + i < r1 ? r + i : r1 - 1;
            b[i] = codes + rr[i] * rb;
            zt[i] = row_prep(scales + rr[i] * G, zeros + rr[i] * G, d, qsum, 0.0f, G, sv[i]);
            acc[i] = _mm256_setzero_ps();
        }
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m256i s16[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                              _mm256_setzero_si256()};
            i64 k = k0;
            if (((k0 / 2) & 63) == 0)  /* once per 64 bytes of each row (g / 2 <= 128) */
                for (int i = 0; i < 4; i++) pf_span(b[i] + k0 / 2 + ahead, g / 2);
            for (; k + 32 <= k1; k += 32) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(xq + k));
                for (int i = 0; i < 4; i++) {
                    __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b[i] + k / 2)));
                    c = _mm256_and_si256(_mm256_srlv_epi32(c, shift), m15);
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(c, q));
                }
            }
            if (k < k1) {  /* the last 16 columns of a row */
                const __m128i q16 = _mm_loadu_si128((const __m128i*)(xq + k));
                for (int i = 0; i < 4; i++) {
                    __m128i bb = _mm_loadl_epi64((const __m128i*)(b[i] + k / 2));
                    __m128i c = _mm_and_si128(_mm_unpacklo_epi64(bb, _mm_srli_epi16(bb, 4)), _mm_set1_epi8(15));
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                                              _mm_maddubs_epi16(c, q16), 0));
                }
            }
            for (int i = 0; i < 4; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones)),
                                         _mm256_broadcast_ss(sv[i] + j), acc[i]);
        }
        for (int i = 0; i < 4 && r + i < r1; i++) y[r + i] = hsum(acc[i]) - zt[i];
    }
}

static void q4_a8_rows4(const int8_t* xq, const float* d, const float* qsum, const uint8_t* codes,
                        const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q4_A8(G_) q4_a8_rows4_g(xq, d, qsum, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q4_A8)
}

static inline __attribute__((always_inline)) void q8_a8_rows2_g(const int8_t* xq, const float* d, const float* qsum,
        const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0,
        i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C;
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    const float zoff = 128.0f;
    float sv0[G], sv1[G];
    const i64 ahead = pf_ahead(rb, 2);
    for (i64 r = r0; r < r1; r += 2) {
        const i64 r2 = r + 1 < r1 ? r + 1 : r;
        const uint8_t *b0 = codes + r * rb, *b1 = codes + r2 * rb;
        const float z0 = row_prep(scales + r * G, zeros + r * G, d, qsum, zoff, G, sv0);
        const float z1 = row_prep(scales + r2 * G, zeros + r2 * G, d, qsum, zoff, G, sv1);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m256i i0 = _mm256_setzero_si256(), i1 = i0;
            i64 k = k0;
            pf_span(b0 + k0 + ahead, g);  /* g bytes of each row: g >= 32, so about once per line */
            pf_span(b1 + k0 + ahead, g);
            for (; k + 32 <= k1; k += 32) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(xq + k));
                A8_Q8_32(b0 + k, i0);
                A8_Q8_32(b1 + k, i1);
            }
            if (k < k1) {
                const __m128i q16 = _mm_loadu_si128((const __m128i*)(xq + k));
                A8_Q8_16(b0 + k, i0);
                A8_Q8_16(b1 + k, i1);
            }
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(sv0 + j), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(sv1 + j), acc1);
        }
        y[r] = hsum(acc0) - z0;
        if (r2 != r) y[r2] = hsum(acc1) - z1;
    }
}

static void q8_a8_t1(const int8_t* xq, const float* d, const float* qsum, const uint8_t* codes,
                     const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q8_A8(G_) q8_a8_rows2_g(xq, d, qsum, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q8_A8)
}

/* The entry point for int8 activations (from quantize_act): kind KIND_Q8 or KIND_Q4; tokens one by
 * one over each block of 8 rows, so a block's codes are read from memory once. */
int linear_a8(int kind, const int8_t* xq, const float* d, const float* qsum, i64 T,
              const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y,
              i64 ldy, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g;
    if (kind != KIND_Q8 && kind != KIND_Q4) return -1;
    if (isa512_on()) return a8_avx512(kind, xq, d, qsum, T, codes, scales, zeros, C, g, y, ldy, r0, r1);
    for (i64 r = r0; r < r1; r += 8) {
        const i64 re = r + 8 < r1 ? r + 8 : r1;
        prefetch_scales(scales, zeros, G, r + 8 * PF_BLOCKS, 8, r1);  /* codes: in the row loops */
        for (i64 t = 0; t < T; t++) {
            if (kind == KIND_Q4)
                q4_a8_rows4(xq + t * C, d + t * G, qsum + t * G, codes, scales, zeros, C, g, y + t * ldy, r, re);
            else
                q8_a8_t1(xq + t * C, d + t * G, qsum + t * G, codes, scales, zeros, C, g, y + t * ldy, r, re);
        }
    }
    return 0;
}
