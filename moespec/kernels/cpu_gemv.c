/* moespec CPU kernels: y[t, r] = sum_c x[t, c] * W[r, c] for a row range [r0, r1) of one weight.
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
 * one integer->float conversion and one FMA; for t > 1 two rows are dequantised exactly as the
 * reference does ((q - z) * s, one rounding) and multiplied with up to 4 tokens at a time.
 *
 * a8 kernels (int8 activations): each token's activations are quantised per weight group to int8
 * with one float32 scale (d = max|x| / 127, round to nearest even), and the dot products are integer
 * (vpmaddubsw + vpmaddwd, as llama.cpp's Q4_1 x Q8_1): NOT exact, chosen by --expert-dtype w8a8 | w4a8.
 *
 * Every function needs AVX2, FMA and F16C; lowbit.py checks the CPU before loading this library.
 */
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

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_Q8 = 2, KIND_Q4 = 3 };

/* ------------------------------------------------------------------------------------------ */
/* Group sums of the activations: xs[t, j] = sum of x[t, c] over group j (the exact t = 1 kernels). */
void group_sums(const float* x, i64 T, i64 ldx, i64 C, i64 g, float* xs) {
    const i64 G = (C + g - 1) / g;
    for (i64 t = 0; t < T; t++)
        for (i64 j = 0; j < G; j++) {
            const float* p = x + t * ldx + j * g;
            const i64 n = group_len(j, g, C);
            __m256 a = _mm256_setzero_ps();
            i64 k = 0;
            for (; k + 8 <= n; k += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(p + k));
            float s = hsum(a);
            for (; k < n; k++) s += p[k];
            xs[t * G + j] = s;
        }
}

/* ------------------------------------------------------------------------------------------ */
/* Dense rows, one token: 4 rows share each load of x (memory-bound streaming). */
static void f32_t1(const float* x, const float* w, i64 C, float* y, i64 r0, i64 r1) {
    i64 r = r0;
    for (; r + 4 <= r1; r += 4) {
        const float *w0 = w + r * C, *w1 = w0 + C, *w2 = w1 + C, *w3 = w2 + C;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        i64 k = 0;
        for (; k + 8 <= C; k += 8) {
            __m256 xv = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
        }
        float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
        for (; k < C; k++) { s0 += w0[k] * x[k]; s1 += w1[k] * x[k]; s2 += w2[k] * x[k]; s3 += w3[k] * x[k]; }
        y[r] = s0; y[r + 1] = s1; y[r + 2] = s2; y[r + 3] = s3;
    }
    for (; r < r1; r++) {
        const float* w0 = w + r * C;
        __m256 a0 = _mm256_setzero_ps();
        i64 k = 0;
        for (; k + 8 <= C; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), _mm256_loadu_ps(x + k), a0);
        float s0 = hsum(a0);
        for (; k < C; k++) s0 += w0[k] * x[k];
        y[r] = s0;
    }
}

static void bf16_t1(const float* x, const uint16_t* w, i64 C, float* y, i64 r0, i64 r1) {
    i64 r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint16_t *w0 = w + r * C, *w1 = w0 + C, *w2 = w1 + C, *w3 = w2 + C;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        i64 k = 0;
        for (; k + 8 <= C; k += 8) {
            __m256 xv = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(bf16x8(w0 + k), xv, a0);
            a1 = _mm256_fmadd_ps(bf16x8(w1 + k), xv, a1);
            a2 = _mm256_fmadd_ps(bf16x8(w2 + k), xv, a2);
            a3 = _mm256_fmadd_ps(bf16x8(w3 + k), xv, a3);
        }
        float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
        for (; k < C; k++)
            for (int i = 0; i < 4; i++) {
                uint32_t bits = (uint32_t)w[(r + i) * C + k] << 16;
                float wf;
                memcpy(&wf, &bits, 4);
                s[i] += wf * x[k];
            }
        for (int i = 0; i < 4; i++) y[r + i] = s[i];
    }
    for (; r < r1; r++) {
        const uint16_t* w0 = w + r * C;
        __m256 a0 = _mm256_setzero_ps();
        i64 k = 0;
        for (; k + 8 <= C; k += 8) a0 = _mm256_fmadd_ps(bf16x8(w0 + k), _mm256_loadu_ps(x + k), a0);
        float s0 = hsum(a0);
        for (; k < C; k++) {
            uint32_t bits = (uint32_t)w0[k] << 16;
            float wf;
            memcpy(&wf, &bits, 4);
            s0 += wf * x[k];
        }
        y[r] = s0;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Per row, before its groups: sv[j] = s_j * (dmul ? dmul[j] : 1) for every group j (float32, read by
 * the group loop with one broadcast load), and the row's zero-point term sum_j sv_j (z_j - zoff) w_j,
 * vectorised over groups (w: the activations' group sums). */
static float row_prep(const uint16_t* s, const uint8_t* z, const float* dmul, const float* w, float zoff, i64 G,
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

/* Low-bit rows, one token, exact: two rows at a time share every load of x; per group
 * p = sum q*x (vectors), acc += s * p; y = hsum(acc) - sum_j s_j z_j xs_j. An odd last row is
 * computed as both rows of a pair (written once). */
#define Q4_BLOCK32(b_ptr, p, q)                                                                \
    do {                                                                                       \
        __m128i b_ = _mm_loadu_si128((const __m128i*)(b_ptr));                                 \
        __m256i v0_ = _mm256_cvtepu8_epi32(b_), v1_ = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b_, b_)); \
        p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0_, m15)), x0, p);           \
        q = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1_, m15)), x1, q);           \
        p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0_, 4)), x2, p);            \
        q = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1_, 4)), x3, q);            \
    } while (0)

#define Q4_BLOCK16(b_ptr, p, q)                                                                \
    do {                                                                                       \
        __m256i v0_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b_ptr)));          \
        p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0_, m15)), x0, p);           \
        q = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0_, 4)), x1, q);            \
    } while (0)

static inline __attribute__((always_inline)) void lowbit_t1(const int bits, const float* x, const float* xs, const uint8_t* codes, const uint16_t* scales,
                      const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C * bits / 8;
    const __m256i m15 = _mm256_set1_epi32(15);
    float sv0[G], sv1[G];
    for (i64 r = r0; r < r1; r += 2) {
        const i64 r2 = r + 1 < r1 ? r + 1 : r;
        const uint8_t *b0 = codes + r * rb, *b1 = codes + r2 * rb;
        const float z0 = row_prep(scales + r * G, zeros + r * G, NULL, xs, 0.0f, G, sv0);
        const float z1 = row_prep(scales + r2 * G, zeros + r2 * G, NULL, xs, 0.0f, G, sv1);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m256 p0 = _mm256_setzero_ps(), q0 = p0, p1 = p0, q1 = p0;
            i64 k = k0;
            if (bits == 4) {
                for (; k + 32 <= k1; k += 32) {
                    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
                    const __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
                    Q4_BLOCK32(b0 + k / 2, p0, q0);
                    Q4_BLOCK32(b1 + k / 2, p1, q1);
                }
                if (k < k1) {
                    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
                    Q4_BLOCK16(b0 + k / 2, p0, q0);
                    Q4_BLOCK16(b1 + k / 2, p1, q1);
                }
            } else {
                for (; k < k1; k += 16) {
                    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
                    p0 = _mm256_fmadd_ps(u8x8(b0 + k), x0, p0);
                    q0 = _mm256_fmadd_ps(u8x8(b0 + k + 8), x1, q0);
                    p1 = _mm256_fmadd_ps(u8x8(b1 + k), x0, p1);
                    q1 = _mm256_fmadd_ps(u8x8(b1 + k + 8), x1, q1);
                }
            }
            acc0 = _mm256_fmadd_ps(_mm256_add_ps(p0, q0), _mm256_broadcast_ss(sv0 + j), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_add_ps(p1, q1), _mm256_broadcast_ss(sv1 + j), acc1);
        }
        y[r] = hsum(acc0) - z0;
        if (r2 != r) y[r2] = hsum(acc1) - z1;
    }
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
static void q8_t1(const float* x, const float* xs, const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros,
                  i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q8_T1(G_) lowbit_t1(8, x, xs, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q8_T1)
}
static void q4_t1(const float* x, const float* xs, const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros,
                  i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q4_T1(G_) lowbit_t1(4, x, xs, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q4_T1)
}

/* ------------------------------------------------------------------------------------------ */
/* Exact dequantisation of rows [r0, r1) into out [r1 - r0, C] float32: (q - z) * s, one rounding,
 * as the torch reference computes it (bit for bit). */
void dequant_q4(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g,
                float* out, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g, nb = C / 2;
    const __m256i m15 = _mm256_set1_epi32(15);
    for (i64 r = r0; r < r1; r++) {
        const uint8_t* b = codes + r * nb;
        float* o = out + (r - r0) * C;
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            const __m256i z = _mm256_set1_epi32(zeros[r * G + j]);
            const __m256 s = _mm256_set1_ps(half_to_float(scales[r * G + j]));
#define DQ(v, dst) _mm256_storeu_ps((dst), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32((v), z)), s))
            i64 k = k0;
            for (; k + 32 <= k1; k += 32) {
                __m128i bb = _mm_loadu_si128((const __m128i*)(b + k / 2));
                __m256i v0 = _mm256_cvtepu8_epi32(bb), v1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bb, bb));
                DQ(_mm256_and_si256(v0, m15), o + k);
                DQ(_mm256_and_si256(v1, m15), o + k + 8);
                DQ(_mm256_srli_epi32(v0, 4), o + k + 16);
                DQ(_mm256_srli_epi32(v1, 4), o + k + 24);
            }
            if (k < k1) {
                __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + k / 2)));
                DQ(_mm256_and_si256(v0, m15), o + k);
                DQ(_mm256_srli_epi32(v0, 4), o + k + 8);
            }
        }
    }
}

void dequant_q8(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g,
                float* out, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g;
    for (i64 r = r0; r < r1; r++) {
        const uint8_t* b = codes + r * C;
        float* o = out + (r - r0) * C;
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            const __m256i z = _mm256_set1_epi32(zeros[r * G + j]);
            const __m256 s = _mm256_set1_ps(half_to_float(scales[r * G + j]));
            for (i64 k = k0; k < k1; k += 8)
                DQ(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + k))), o + k);
        }
    }
#undef DQ
}


/* ------------------------------------------------------------------------------------------ */
/* Several tokens: blocks of RB rows are dequantised (exactly as the reference: (q - z) * s) KC columns
 * at a time into an L1-sized buffer, then multiplied with tiles of up to 4 tokens, two rows at a
 * time (8 accumulators), adding into y; x's tile and the buffer stay in L1 (measured: the whole-row
 * version streamed x from L2 and ran at a third of the FMA rate). */
#define KC 256
#define RB 8
#define LD (KC + 16)  /* buffer row stride: not a multiple of 4 KiB, so rows do not share L1 sets */

static inline void copy_floats(float* dst, const float* src, i64 n) {
    i64 k = 0;
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, _mm256_loadu_ps(src + k));
    for (; k < n; k++) dst[k] = src[k];
}

/* Columns [k0, k1) of row r, dequantised into out[0 .. k1 - k0) (k0 a multiple of 32). */
static void decode_cols(int kind, const void* w, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g,
                        i64 r, i64 k0, i64 k1, float* out) {
    if (kind == KIND_BF16) {
        const uint16_t* p = (const uint16_t*)w + r * C;
        i64 k = k0;
        for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(out + k - k0, bf16x8(p + k));
        for (; k < k1; k++) {
            uint32_t bits = (uint32_t)p[k] << 16;
            memcpy(out + k - k0, &bits, 4);
        }
        return;
    }
    const i64 G = (C + g - 1) / g;
    const uint8_t* zr = zeros + r * G;
    const uint16_t* sr = scales + r * G;
#define DQ(v, dst, j) _mm256_storeu_ps((dst), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32((v), \
                          _mm256_set1_epi32(zr[j]))), _mm256_set1_ps(half_to_float(sr[j]))))
    if (kind == KIND_Q8) {
        const uint8_t* b = (const uint8_t*)w + r * C;
        for (i64 k = k0; k < k1; k += 8) DQ(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + k))), out + k - k0, k / g);
        return;
    }
    const uint8_t* b = (const uint8_t*)w + r * (C / 2);
    const __m256i m15 = _mm256_set1_epi32(15);
    i64 k = k0;
    for (; k + 32 <= k1 && k + 32 <= C / 32 * 32; k += 32) {
        const i64 j = k / g;
        __m128i bb = _mm_loadu_si128((const __m128i*)(b + k / 2));
        __m256i v0 = _mm256_cvtepu8_epi32(bb), v1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bb, bb));
        DQ(_mm256_and_si256(v0, m15), out + k - k0, j);
        DQ(_mm256_and_si256(v1, m15), out + k - k0 + 8, j);
        DQ(_mm256_srli_epi32(v0, 4), out + k - k0 + 16, j);
        DQ(_mm256_srli_epi32(v1, 4), out + k - k0 + 24, j);
    }
    if (k < k1) {  /* the row's last block of 16 */
        __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + k / 2)));
        DQ(_mm256_and_si256(v0, m15), out + k - k0, k / g);
        DQ(_mm256_srli_epi32(v0, 4), out + k - k0 + 8, k / g);
    }
#undef DQ
}

/* y[t, r], y[t, r + 1] += the dot products of rows u0, u1 [n] with tokens x[t, 0 .. n) for t < nt
 * (nt <= 4; u1 == u0 for a single row, written once). */
static void micro_2x4(const float* u0, const float* u1, const float* x, i64 ldx, i64 nt, i64 n, float* y,
                      i64 ldy, i64 r, int two) {
    const float* xt[4];
    for (i64 i = 0; i < 4; i++) xt[i] = x + (i < nt ? i : nt - 1) * ldx;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    i64 k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(u0 + k), w1 = _mm256_loadu_ps(u1 + k);
        __m256 xv = _mm256_loadu_ps(xt[0] + k);
        a00 = _mm256_fmadd_ps(w0, xv, a00);
        a10 = _mm256_fmadd_ps(w1, xv, a10);
        xv = _mm256_loadu_ps(xt[1] + k);
        a01 = _mm256_fmadd_ps(w0, xv, a01);
        a11 = _mm256_fmadd_ps(w1, xv, a11);
        xv = _mm256_loadu_ps(xt[2] + k);
        a02 = _mm256_fmadd_ps(w0, xv, a02);
        a12 = _mm256_fmadd_ps(w1, xv, a12);
        xv = _mm256_loadu_ps(xt[3] + k);
        a03 = _mm256_fmadd_ps(w0, xv, a03);
        a13 = _mm256_fmadd_ps(w1, xv, a13);
    }
    float s[2][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)}, {hsum(a10), hsum(a11), hsum(a12), hsum(a13)}};
    for (; k < n; k++)
        for (int i = 0; i < 4; i++) {
            s[0][i] += u0[k] * xt[i][k];
            s[1][i] += u1[k] * xt[i][k];
        }
    for (i64 i = 0; i < nt; i++) {
        y[i * ldy + r] += s[0][i];
        if (two) y[i * ldy + r + 1] += s[1][i];
    }
}

static int linear_tokens(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                         const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1) {
    /* Why both buffers: rows of 2^k floats (H = 2048, ...) put every weight row and token row in the
     * same L1 sets (a multiple of 4 KiB apart); packed at stride LD they do not (the micro-kernel
     * alone runs at 2 FMA/cycle on packed rows, 1.5 on 8 KiB-strided ones). */
    float buf[RB * LD], xb[4 * LD];
    for (i64 r = r0; r < r1; r += RB) {
        const i64 nr = r1 - r < RB ? r1 - r : RB;
        for (i64 t = 0; t < T; t++)
            for (i64 i = 0; i < nr; i++) y[t * ldy + r + i] = 0.0f;
        for (i64 k0 = 0; k0 < C; k0 += KC) {
            const i64 kc = C - k0 < KC ? C - k0 : KC;
            for (i64 i = 0; i < nr; i++) {
                if (kind == KIND_F32) copy_floats(buf + i * LD, (const float*)w + (r + i) * C + k0, kc);
                else decode_cols(kind, w, scales, zeros, C, g, r + i, k0, k0 + kc, buf + i * LD);
            }
            for (i64 t0 = 0; t0 < T; t0 += 4) {
                const i64 nt = T - t0 < 4 ? T - t0 : 4;
                for (i64 i = 0; i < nt; i++) copy_floats(xb + i * LD, x + (t0 + i) * ldx + k0, kc);
                for (i64 i = 0; i < nr; i += 2) {
                    const int two = i + 1 < nr;
                    micro_2x4(buf + i * LD, buf + (two ? i + 1 : i) * LD, xb, LD, nt, kc, y + t0 * ldy, ldy,
                              r + i, two);
                }
            }
        }
    }
    return 0;
}


/* The one entry point for float32 activations (exact).
 *   kind: KIND_*; w: the weight (f32/bf16) or the codes (q8/q4); scales/zeros: q8/q4 only;
 *   xs: group sums [T, G] (q8/q4 with T == 1; from group_sums), or NULL: computed here.
 * Returns 0, or -1 when a scratch buffer could not be allocated. */
int linear_f32act(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                  const uint8_t* zeros, const float* xs, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1) {
    if (T == 1) {
        float xs_buf[(kind == KIND_Q8 || kind == KIND_Q4) && !xs ? (C + g - 1) / g : 1];
        if ((kind == KIND_Q8 || kind == KIND_Q4) && !xs) {
            group_sums(x, 1, ldx, C, g, xs_buf);
            xs = xs_buf;
        }
        switch (kind) {
            case KIND_F32: f32_t1(x, (const float*)w, C, y, r0, r1); return 0;
            case KIND_BF16: bf16_t1(x, (const uint16_t*)w, C, y, r0, r1); return 0;
            case KIND_Q8: q8_t1(x, xs, (const uint8_t*)w, scales, zeros, C, g, y, r0, r1); return 0;
            case KIND_Q4: q4_t1(x, xs, (const uint8_t*)w, scales, zeros, C, g, y, r0, r1); return 0;
            default: return -1;
        }
    }
    return linear_tokens(kind, x, T, ldx, w, scales, zeros, C, g, y, ldy, r0, r1);
}

/* ------------------------------------------------------------------------------------------ */
/* int8 activations (not exact). quantize_act: per token and weight group, d = max|x| / 127,
 * xq = round_half_even(x * (127 / max|x|)) (int8), qsum = sum of xq (as float) over the group. */
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

/* Low-bit rows x int8 activations for rows [r0, r1), two rows at a time sharing the loads of xq: per
 * group the integer dot sum q * xq, then y = sum_j s_j d_j (dot_j - z_j * qsum_j).
 * int4: codes (<= 15) are vpmaddubsw's unsigned operand. int8: codes are unsigned, so c = (c - 128)
 * + 128; vpmaddubsw takes |c - 128| (<= 128, unsigned) with the sign of c - 128 moved onto xq
 * (|xq| <= 127, so negating is exact), the products stay within int16, and the zero point is
 * applied as z - 128. */
#define A8_Q4_32(bb_ptr, ia)                                                                       \
    do {                                                                                           \
        __m128i bb_ = _mm_loadu_si128((const __m128i*)(bb_ptr));                                   \
        __m256i c_ = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bb_, 4), bb_), m15);        \
        ia = _mm256_add_epi32(ia, sum_i16_pairs(_mm256_maddubs_epi16(c_, q)));                     \
    } while (0)
#define A8_Q4_16(bb_ptr, ia)                                                                       \
    do {                                                                                           \
        __m128i bb_ = _mm_loadl_epi64((const __m128i*)(bb_ptr));                                   \
        __m128i c_ = _mm_and_si128(_mm_unpacklo_epi64(bb_, _mm_srli_epi16(bb_, 4)), _mm256_castsi256_si128(m15)); \
        __m128i p_ = _mm_madd_epi16(_mm_maddubs_epi16(c_, q16), _mm_set1_epi16(1));               \
        ia = _mm256_add_epi32(ia, _mm256_inserti128_si256(_mm256_setzero_si256(), p_, 0));         \
    } while (0)
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

/* q4 x int8, four rows at a time (g a compile-time constant in each instance, so a group's blocks unroll): a 32-column block is loaded into both 128-bit lanes and shifted by
 * 0 / 4 bits per lane (one vpsrlvd) to give its 32 codes in order; products of a group are summed
 * in int16 before one vpmaddwd (a pair is at most 2 * 15 * 127 = 3810, so a group of up to 256
 * columns, 8 blocks, stays below 32767). */
static inline __attribute__((always_inline)) void q4_a8_rows4_g(const int8_t* xq, const float* d, const float* qsum,
        const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0,
        i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C / 2;
    const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    float sv[4][G];
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

static inline __attribute__((always_inline)) void lowbit_a8_t1(int bits, const int8_t* xq, const float* d, const float* qsum, const uint8_t* codes,
                         const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C * bits / 8;
    const __m256i m15 = _mm256_set1_epi8(15), bias = _mm256_set1_epi8((char)0x80);
    const float zoff = bits == 8 ? 128.0f : 0.0f;
    float sv0[G], sv1[G];
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
            for (; k + 32 <= k1; k += 32) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(xq + k));
                if (bits == 4) { A8_Q4_32(b0 + k / 2, i0); A8_Q4_32(b1 + k / 2, i1); }
                else { A8_Q8_32(b0 + k, i0); A8_Q8_32(b1 + k, i1); }
            }
            if (k < k1) {
                const __m128i q16 = _mm_loadu_si128((const __m128i*)(xq + k));
                if (bits == 4) { A8_Q4_16(b0 + k / 2, i0); A8_Q4_16(b1 + k / 2, i1); }
                else { A8_Q8_16(b0 + k, i0); A8_Q8_16(b1 + k, i1); }
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
#define Q8_A8(G_) lowbit_a8_t1(8, xq, d, qsum, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q8_A8)
}

/* The entry point for int8 activations (from quantize_act): kind KIND_Q8 or KIND_Q4; tokens one by
 * one over each block of 8 rows, so a block's codes are read from memory once. */
int linear_a8(int kind, const int8_t* xq, const float* d, const float* qsum, i64 T,
              const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y,
              i64 ldy, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g;
    if (kind != KIND_Q8 && kind != KIND_Q4) return -1;
    for (i64 r = r0; r < r1; r += 8) {
        const i64 re = r + 8 < r1 ? r + 8 : r1;
        for (i64 t = 0; t < T; t++) {
            if (kind == KIND_Q4)
                q4_a8_rows4(xq + t * C, d + t * G, qsum + t * G, codes, scales, zeros, C, g, y + t * ldy, r, re);
            else
                q8_a8_t1(xq + t * C, d + t * G, qsum + t * G, codes, scales, zeros, C, g, y + t * ldy, r, re);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* One SwiGLU expert in one call: y = W2 (silu(W1_gate x) * W1_up x), W1 = gate_up [2I, H] (gate rows
 * first), W2 = down [H, I], rows [0, R) of each. The caller passes the row's base and the byte
 * offsets of each weight's data / scales / zeros (scales and zeros unused for f32/bf16).
 * bf16_act: the model computes in bfloat16, so the stage outputs are rounded to bfloat16 where torch
 * rounds them (gate_up, silu(gate), silu(gate) * up); y is float32 (the caller rounds it once).
 * a8: low-bit rows with int8 activations. silu(v) = v / (1 + exp(-v)) (libm expf).
 * Returns 0, or -1 when scratch memory could not be allocated. */
static inline float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) u = (u | 0x00400000u) & 0xffff0000u;  /* NaN stays NaN */
    else u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;                   /* nearest even */
    memcpy(&f, &u, 4);
    return f;
}

static int linear_any(int kind, int a8, const float* x, i64 T, i64 C, const uint8_t* base, i64 ow, i64 os,
                      i64 oz, i64 g, float* y, i64 R, void* scratch) {
    const void* w = base + ow;
    const uint16_t* s = (const uint16_t*)(base + os);
    const uint8_t* z = base + oz;
    if (!a8 || (kind != KIND_Q8 && kind != KIND_Q4))
        return linear_f32act(kind, x, T, C, w, s, z, NULL, C, g, y, R, 0, R);
    const i64 G = (C + g - 1) / g;
    int8_t* xq = (int8_t*)scratch;
    float* d = (float*)(xq + ((T * C + 63) / 64) * 64);
    float* qs = d + T * G;
    quantize_act(x, T, C, C, g, xq, d, qs);
    return linear_a8(kind, xq, d, qs, T, (const uint8_t*)w, s, z, C, g, y, R, 0, R);
}

/* h [T, I] = silu(gate) * up of gu [T, 2I] (gate columns first), float32; bf16: rounded as torch
 * rounds a bfloat16 model's tensors. The one SiLU both the one-call expert and the row-split path use. */
void silu_mul(const float* gu, i64 T, i64 I, float* h, int bf16) {
    for (i64 t = 0; t < T; t++) {
        const float* gate = gu + t * 2 * I;
        const float* up = gate + I;
        float* ht = h + t * I;
        for (i64 i = 0; i < I; i++) {
            if (bf16) {
                const float gv = bf16_round(gate[i]);
                ht[i] = bf16_round(bf16_round(gv / (1.0f + expf(-gv))) * bf16_round(up[i]));
            } else {
                ht[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
            }
        }
    }
}

int expert_swiglu(int kind, int a8, int bf16_act, const float* x, i64 T, const uint8_t* base, i64 ow1, i64 os1,
                  i64 oz1, i64 ow2, i64 os2, i64 oz2, i64 H, i64 I, i64 g, float* y) {
    const i64 gg = g > 0 ? g : 16;  /* float rows have no groups: only sizes the scratch */
    const i64 Gmax = (H + gg - 1) / gg + (I + gg - 1) / gg;
    const i64 nbytes = sizeof(float) * (T * 2 * I + T * I) + T * (H + I) + 128 + sizeof(float) * 2 * T * Gmax;
    float* gu = (float*)malloc(nbytes);
    if (!gu) return -1;
    float* h = gu + T * 2 * I;
    void* scratch = h + T * I;
    int rc = linear_any(kind, a8, x, T, H, base, ow1, os1, oz1, g, gu, 2 * I, scratch);
    if (rc == 0) silu_mul(gu, T, I, h, bf16_act);
    if (rc == 0) rc = linear_any(kind, a8, h, T, I, base, ow2, os2, oz2, g, y, H, scratch);
    free(gu);
    return rc;
}
