/* One token: dense and exact low-bit GEMV, and the float32-activation entry point. */
#include "avx512.h"

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
/* Dense rows (float32, bfloat16), one token. */
static inline float dense_w(const void* w, int bf16, i64 i) {
    if (!bf16) return ((const float*)w)[i];
    uint32_t bits = (uint32_t)((const uint16_t*)w)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline __attribute__((always_inline)) __m256 dense_w8(const void* w, const int bf16, i64 i) {
    return bf16 ? bf16x8((const uint16_t*)w + i) : _mm256_loadu_ps((const float*)w + i);
}

/* Dense rows, one token, one row at a time: four accumulators over 32 columns, so the weight is
 * read as ONE sequential stream (as torch.sum reads it). A block of 4 rows sharing each load of x
 * (the kernel before) read four interleaved streams that jump by three rows at every block; with
 * the default model's short rows (576 floats, 36 lines) the hardware prefetcher retrained on every
 * row. Measured (this project's AMD EPYC VM, one thread, cold weights): float32
 * (scripts/dense_gemv_bench.py) 1024x576 10.0 -> 15.4 GB/s, 8192x576 13.1 -> 18.2, 576x1024 17.4 ->
 * 24.0 (torch.sum 17-25 in the same process), with 2 MB pages (runtime/host/hugepages.py) 25.0 /
 * 22.7 / 29.7; bfloat16 (scripts/host_expert_bench.py --shapes qwen3 --formats bfloat16 --tokens 1
 * --threads 1 --reps 5 --isa avx2, 8 pairs alternating in one exclusive hold) 0.755-0.944 ->
 * 0.464-0.647 ms per expert (median share of torch.sum's read 40 -> 64 %); one accumulator (the
 * 4-row block's sum order) 0.68-1.04 ms, bound by the FMA chain's latency near 14 GB/s. A row's
 * value depends on that row alone (the sum order is fixed per row), so split products stay
 * bit-equal. bf16 is a compile-time constant in each instance; the software prefetch is bf16's only
 * (float32 rows measured no faster with it). */
static inline __attribute__((always_inline)) void dense_row_t1(const int bf16, const float* x, const void* w,
                                                               i64 C, float* y, i64 r0, i64 r1) {
    const i64 es = bf16 ? 2 : 4, ahead = pf_ahead(C * es, 1);
    for (i64 r = r0; r < r1; r++) {
        const i64 o = r * C;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        i64 k = 0;
        for (; k + 32 <= C; k += 32) {
            if (bf16) _mm_prefetch((const char*)w + (o + k) * es + ahead, _MM_HINT_T0);
            a0 = _mm256_fmadd_ps(dense_w8(w, bf16, o + k), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(dense_w8(w, bf16, o + k + 8), _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(dense_w8(w, bf16, o + k + 16), _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(dense_w8(w, bf16, o + k + 24), _mm256_loadu_ps(x + k + 24), a3);
        }
        for (; k + 8 <= C; k += 8) a0 = _mm256_fmadd_ps(dense_w8(w, bf16, o + k), _mm256_loadu_ps(x + k), a0);
        float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; k < C; k++) s += dense_w(w, bf16, o + k) * x[k];
        y[r] = s;
    }
}

static void f32_t1(const float* x, const float* w, i64 C, float* y, i64 r0, i64 r1) {
    dense_row_t1(0, x, w, C, y, r0, r1);
}

static void bf16_t1(const float* x, const uint16_t* w, i64 C, float* y, i64 r0, i64 r1) {
    dense_row_t1(1, x, w, C, y, r0, r1);
}

/* ------------------------------------------------------------------------------------------ */
/* Low-bit rows, one token, exact: two rows at a time share every load of x; per group
 * p = sum q*x (vectors), acc += s * p; y = hsum(acc) - sum_j s_j z_j xs_j. An odd last row is
 * computed as both rows of a pair (written once). */
#define Q4_BLOCK32(b_ptr, p, q)                                                                \
    do {                                                                                       \
        __m256i v0_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b_ptr)));          \
        __m256i v1_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((b_ptr) + 8)));    \
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
    const i64 ahead = pf_ahead(rb, 2);
    for (i64 r = r0; r < r1; r += 2) {
        const i64 r2 = r + 1 < r1 ? r + 1 : r;
        const uint8_t *b0 = codes + r * rb, *b1 = codes + r2 * rb;
        prefetch_scales(scales, zeros, G, r + 2 * PF_BLOCKS, 2, r1);
        const float z0 = row_prep(scales + r * G, zeros + r * G, NULL, xs, 0.0f, G, sv0);
        const float z1 = row_prep(scales + r2 * G, zeros + r2 * G, NULL, xs, 0.0f, G, sv1);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m256 p0 = _mm256_setzero_ps(), q0 = p0, p1 = p0, q1 = p0;
            i64 k = k0;
            if (((k0 * bits / 8) & 63) == 0) {  /* once per 64 bytes of each row (g * bits / 8 <= 64) */
                if (bits == 4) {
                    pf_span_t0(b0 + k0 / 2 + ahead, g / 2);
                    pf_span_t0(b1 + k0 / 2 + ahead, g / 2);
                } else {
                    pf_span(b0 + k0 + ahead, g);
                    pf_span(b1 + k0 + ahead, g);
                }
            }
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
        if (isa512_on() && t1_avx512(kind, x, xs, w, scales, zeros, C, g, y, r0, r1) == 0) return 0;
        switch (kind) {
            case KIND_F32: f32_t1(x, (const float*)w, C, y, r0, r1); return 0;
            case KIND_BF16: bf16_t1(x, (const uint16_t*)w, C, y, r0, r1); return 0;
            case KIND_Q8: q8_t1(x, xs, (const uint8_t*)w, scales, zeros, C, g, y, r0, r1); return 0;
            case KIND_Q4: q4_t1(x, xs, (const uint8_t*)w, scales, zeros, C, g, y, r0, r1); return 0;
            default: return -1;
        }
    }
    if (isa512_on() && tokens_avx512(kind, x, T, ldx, w, scales, zeros, C, g, y, ldy, r0, r1) == 0) return 0;
    if (T >= TILES_MIN_T) return linear_tiles(kind, x, T, ldx, w, scales, zeros, C, g, y, ldy, r0, r1);
    return linear_tokens(kind, x, T, ldx, w, scales, zeros, C, g, y, ldy, r0, r1);
}
