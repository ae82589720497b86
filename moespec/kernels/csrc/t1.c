/* One token: dense and exact low-bit GEMV, and the float32-activation entry point. */
#include "common.h"

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
