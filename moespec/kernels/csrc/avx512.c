/* AVX-512 kernels for one token (exact, float32 activations) and for int8 activations (VNNI).
 *
 * Shapes and formats as in common.h. Only this file is compiled for AVX-512 (the target pragma
 * below), so the library still loads on an AVX2-only CPU; cpu_isa() picks the kernels at run time.
 *   bf16 rows, one token: when every activation is a bfloat16 value (a bfloat16 model's x, widened
 *     to float32 by the caller), x is packed to bfloat16 (exact) and each pair of products is one
 *     vdpbf16ps: the products are exact in float32 and summed in float32, as the AVX2 kernel does
 *     (another order of the sum; vdpbf16ps treats bfloat16 subnormals as zero). Other activations:
 *     the AVX2 kernel.
 *   q8 / q4 rows, one token: as lowbit_t1 in t1.c (the group's zero point factored out; per group
 *     p = sum q * x in float32), 16 columns per zmm. q4: 128 columns per 64-byte load with no
 *     shuffle but one vpermps per 16 codes (a 16-entry table of 0..15 as floats, indexed by the
 *     shifted dword's low 4 bits: shift, look up, FMA), x permuted once per call to the codes'
 *     order (q4_t1_sf_g). Measured (a C loop, [1536, 2048] g = 64, 24 cold weights, best of 5):
 *     133-137 us against 154-209 for the per-block zmm kernel and 175-236 for AVX2.
 *     One token, q4 (q4_t1_int_g, below): the activations as 24-bit integers per group (within 2**-24
 *     of the group's largest |x|), integer dots by vpdpbusd: 1.7x q4_t1_sf_g's speed from L2;
 *     q4_t1_sf_g stays for activations that are not finite.
 *   int8 activations: per group the integer dot sum q * xq by vpdpbusd (unsigned codes x signed
 *     xq, 4 products per int32 lane, no saturation: |sum| <= 256 * 255 * 127 < 2**31), then
 *     y = sum_j s_j d_j (dot_j - z_j qsum_j), as the AVX2 kernels (equal integer dots).
 * float32 rows stay on AVX2 at t = 1: zmm measured slower there (0.841 vs 0.775 ms per Qwen3-shaped
 * expert). Several tokens (2 <= t <= 16, every row format): avx512_tokens.c.
 */
#include "avx512.h"

static int isa = -1;  /* -1: not chosen yet; 0: AVX2; 1: AVX-512 */

static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bf16");
}

int cpu_isa(int want) {
    if (want >= 0) isa = want && cpu_has_avx512();
    else if (isa < 0) isa = cpu_has_avx512();
    return isa;
}

int isa512_on(void) { return isa < 0 ? cpu_isa(-1) : isa; }

#include "avx512_begin.h"

/* ------------------------------------------------------------------------------------------ */
/* bf16 rows, one token, bfloat16 activations: one row at a time, so the weight is read as one
 * sequential stream (as t1.c's dense_row_t1), one accumulator over 32 columns: the per-row sum of
 * the 4-row block before it, so bit-equal to it. Measured (scripts/host_expert_bench.py --shapes
 * qwen3 --tokens 1 --threads 1 --reps 5, ms per expert, old and new alternating in one exclusive
 * hold, 8 pairs): 4 rows 0.74-0.99, 1 row 0.44-0.66 (38 -> 68 % of torch.sum's read, median).
 * q8 / q4 below keep two rows a pass: one row measured no faster (10 pairs: q4 median 0.272 vs
 * 0.242, q8 0.335 vs 0.403, both spread 0.23-0.55 run to run). */
static int bf16_exact(const float* x, i64 C) {
    __mmask16 bad = 0;
    i64 k = 0;
    for (; k + 16 <= C; k += 16) bad |= _mm512_test_epi32_mask(_mm512_loadu_si512(x + k), _mm512_set1_epi32(0xffff));
    if (k < C) {
        const __mmask16 m = (__mmask16)((1u << (C - k)) - 1);
        bad |= _mm512_mask_test_epi32_mask(m, _mm512_maskz_loadu_epi32(m, x + k), _mm512_set1_epi32(0xffff));
    }
    return bad == 0;
}

static void bf16_t1_512(const float* x, const uint16_t* w, i64 C, float* y, i64 r0, i64 r1) {
    uint16_t xb[C + 32];
    for (i64 k = 0; k < C; k += 16) {
        const __mmask16 m = C - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (C - k)) - 1);
        __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k));
        _mm256_storeu_si256((__m256i*)(xb + k), (__m256i)h);
    }
    const i64 ahead = pf_ahead(C * 2, 1);
    for (i64 r = r0; r < r1; r++) {
        const uint16_t* p = w + r * C;
        __m512 a = _mm512_setzero_ps();
        i64 k = 0;
        for (; k + 32 <= C; k += 32) {
            _mm_prefetch((const char*)(p + k) + ahead, _MM_HINT_T0);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(p + k), (__m512bh)_mm512_loadu_si512(xb + k));
        }
        if (k < C) {  /* the last C % 32 columns (a zero-padded pair where C is odd) */
            const __mmask32 m = (__mmask32)((1ull << (C - k)) - 1);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, p + k),
                                 (__m512bh)_mm512_maskz_loadu_epi16(m, xb + k));
        }
        y[r] = _mm512_reduce_add_ps(a);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* q8 / q4 rows, one token, exact: two rows share every load of x (t1.c's lowbit_t1 in zmm). */
static inline __attribute__((always_inline)) __m512 q4_lo(__m512i v, __m512 lut) {
    return _mm512_permutexvar_ps(v, lut);  /* lut[v & 15]: vpermps reads the index's low 4 bits */
}
static inline __attribute__((always_inline)) __m512 q4_hi(__m512i v) {
    return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
static inline __attribute__((always_inline)) __m512i u8x16(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}

static inline __attribute__((always_inline)) void q8_t1_512_g(const float* x, const float* xs, const uint8_t* codes,
        const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C;
    float sv0[G], sv1[G];
    const i64 ahead = pf_ahead(rb, 2);
    for (i64 r = r0; r < r1; r += 2) {
        const i64 r2 = r + 1 < r1 ? r + 1 : r;
        const uint8_t *b0 = codes + r * rb, *b1 = codes + r2 * rb;
        prefetch_scales(scales, zeros, G, r + 2 * PF_BLOCKS, 2, r1);
        const float z0 = row_prep(scales + r * G, zeros + r * G, NULL, xs, 0.0f, G, sv0);
        const float z1 = row_prep(scales + r2 * G, zeros + r2 * G, NULL, xs, 0.0f, G, sv1);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m512 p0 = _mm512_setzero_ps(), q0 = p0, p1 = p0, q1 = p0;
            i64 k = k0;
            if ((k0 & 63) == 0) {  /* once per 64 bytes of each row */
                pf_span(b0 + k0 + ahead, g);
                pf_span(b1 + k0 + ahead, g);
            }
            for (; k + 32 <= k1; k += 32) {
                const __m512 xa = _mm512_loadu_ps(x + k), xb = _mm512_loadu_ps(x + k + 16);
                p0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u8x16(b0 + k)), xa, p0);
                q0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u8x16(b0 + k + 16)), xb, q0);
                p1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u8x16(b1 + k)), xa, p1);
                q1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u8x16(b1 + k + 16)), xb, q1);
            }
            if (k < k1) {
                const __m512 xa = _mm512_loadu_ps(x + k);
                p0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u8x16(b0 + k)), xa, p0);
                p1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u8x16(b1 + k)), xa, p1);
            }
            acc0 = _mm512_fmadd_ps(_mm512_add_ps(p0, q0), _mm512_set1_ps(sv0[j]), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_add_ps(p1, q1), _mm512_set1_ps(sv1[j]), acc1);
        }
        y[r] = _mm512_reduce_add_ps(acc0) - z0;
        if (r2 != r) y[r2] = _mm512_reduce_add_ps(acc1) - z1;
    }
}

/* The one-token q4 kernels' chunk lanes: lane i of a 128-column chunk's partial sums belongs to group
 * (i / 4) * 32 / g of the chunk's first (0 for g >= 128: the chunk lies in one group). */
static inline __attribute__((always_inline)) __m512i q4_group_lanes(i64 g) {
    int32_t t[16];
    for (int i = 0; i < 16; i++) t[i] = g >= 128 ? 0 : (i / 4) * 32 / (int)g;
    return _mm512_loadu_si512(t);
}

/* A chunk's group scales sv[0..3] spread over its lanes (q4_group_lanes). */
static inline __attribute__((always_inline)) __m512 q4_chunk_scales(const float* sv, __m512i sidx) {
    return _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_loadu_ps(sv)));
}

/* Two q4 rows' last columns [k, C) (C % 128 of them: blocks of 32, then 16) into acc0/acc1, at the
 * rows' group scales sv0/sv1: the tail both one-token q4 kernels share (x: the activations as
 * floats; the integer kernel passes its integers as floats, so the tail stays exact). */
static inline __attribute__((always_inline)) void q4_tail_2rows(const float* x, const uint8_t* b0, const uint8_t* b1,
                                                                const float* sv0, const float* sv1, i64 k, i64 C,
                                                                i64 g, __m512* acc0, __m512* acc1) {
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i tail_shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    while (k < C) {
        const i64 j = k / g;
        const __m512 xa = _mm512_loadu_ps(x + k);
        __m512 p0, p1;
        if (k + 32 <= C) {
            const __m512 xb = _mm512_loadu_ps(x + k + 16);
            const __m512i v0 = u8x16(b0 + k / 2), v1 = u8x16(b1 + k / 2);
            p0 = _mm512_fmadd_ps(q4_hi(v0), xb, _mm512_mul_ps(q4_lo(v0, lut), xa));
            p1 = _mm512_fmadd_ps(q4_hi(v1), xb, _mm512_mul_ps(q4_lo(v1, lut), xa));
            k += 32;
        } else {
            __m128i c0 = _mm_loadl_epi64((const __m128i*)(b0 + k / 2));
            __m128i c1 = _mm_loadl_epi64((const __m128i*)(b1 + k / 2));
            const __m512i v0 = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(c0, c0)), tail_shift);
            const __m512i v1 = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(c1, c1)), tail_shift);
            p0 = _mm512_mul_ps(q4_lo(v0, lut), xa);
            p1 = _mm512_mul_ps(q4_lo(v1, lut), xa);
            k += 16;
        }
        *acc0 = _mm512_fmadd_ps(p0, _mm512_set1_ps(sv0[j]), *acc0);
        *acc1 = _mm512_fmadd_ps(p1, _mm512_set1_ps(sv1[j]), *acc1);
    }
}

/* q4 rows, one token, without shuffles: a 64-byte load holds 128 columns (4 blocks); dword lane i
 * holds bytes 4i .. 4i+3 of the chunk, so (lane >> (8b + 4h)) & 15 is, for every lane at once, the
 * code of column (i / 4) * 32 + 4 (i % 4) + b + 16 h. x is permuted once per call into that order
 * (xp), so each of the 8 shifts gives 16 codes that meet their activations with one FMA; a lane's
 * partial sum stays within its block, so the group scales apply per lane (one vpermps per chunk).
 * Columns past the last whole chunk (C % 128) go block by block (32 columns: the low nibbles by a
 * vpermps table, the high ones shifted and converted; a last 16). */
static inline __attribute__((always_inline)) __m512 q4_nib(__m512i v, const int s, __m512 lut) {
    return _mm512_permutexvar_ps(s ? _mm512_srli_epi32(v, s) : v, lut);  /* lut[(v >> s) & 15] */
}

static inline __attribute__((always_inline)) void q4_t1_sf_g(const float* x, const float* xs, const uint8_t* codes,
        const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C / 2, NC = C / 128;
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sidx = q4_group_lanes(g);
    float xp[NC * 128 + 16] __attribute__((aligned(64)));
    for (i64 c = 0; c < NC; c++)
        for (int s = 0; s < 8; s++)
            for (int i = 0; i < 16; i++)
                xp[c * 128 + s * 16 + i] = x[c * 128 + (i / 4) * 32 + 4 * (i % 4) + s / 2 + 16 * (s % 2)];
    float sv0[G + 4], sv1[G + 4];
    const i64 ahead = pf_ahead(rb, 2);
    for (i64 r = r0; r < r1; r += 2) {
        const i64 r2 = r + 1 < r1 ? r + 1 : r;
        const uint8_t *b0 = codes + r * rb, *b1 = codes + r2 * rb;
        prefetch_scales(scales, zeros, G, r + 2 * PF_BLOCKS, 2, r1);
        const float z0 = row_prep(scales + r * G, zeros + r * G, NULL, xs, 0.0f, G, sv0);
        const float z1 = row_prep(scales + r2 * G, zeros + r2 * G, NULL, xs, 0.0f, G, sv1);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
        for (i64 c = 0; c < NC; c++) {
            pf_span(b0 + c * 64 + ahead, 64);
            pf_span(b1 + c * 64 + ahead, 64);
            const __m512i v0 = _mm512_loadu_si512(b0 + c * 64), v1 = _mm512_loadu_si512(b1 + c * 64);
            const float* xc = xp + c * 128;
            __m512 p0 = _mm512_setzero_ps(), q0 = p0, p1 = p0, q1 = p0;
#define SF_STEP(s_, pa, pb)                                                                        \
    do {                                                                                           \
        const __m512 xv = _mm512_loadu_ps(xc + (s_) * 16);                                          \
        pa = _mm512_fmadd_ps(q4_nib(v0, 8 * ((s_) / 2) + 4 * ((s_) % 2), lut), xv, pa);             \
        pb = _mm512_fmadd_ps(q4_nib(v1, 8 * ((s_) / 2) + 4 * ((s_) % 2), lut), xv, pb);             \
    } while (0)
            SF_STEP(0, p0, p1); SF_STEP(1, q0, q1); SF_STEP(2, p0, p1); SF_STEP(3, q0, q1);
            SF_STEP(4, p0, p1); SF_STEP(5, q0, q1); SF_STEP(6, p0, p1); SF_STEP(7, q0, q1);
#undef SF_STEP
            const i64 base = c * 128 / g;
            const __m512 s0 = q4_chunk_scales(sv0 + base, sidx);
            const __m512 s1 = q4_chunk_scales(sv1 + base, sidx);
            acc0 = _mm512_fmadd_ps(_mm512_add_ps(p0, q0), s0, acc0);
            acc1 = _mm512_fmadd_ps(_mm512_add_ps(p1, q1), s1, acc1);
        }
        q4_tail_2rows(x, b0, b1, sv0, sv1, NC * 128, C, g, &acc0, &acc1);
        y[r] = _mm512_reduce_add_ps(acc0) - z0;
        if (r2 != r) y[r2] = _mm512_reduce_add_ps(acc1) - z1;
    }
}

/* q4 rows, one token, integer dots: the activations as 24-bit integers, so each 64-byte chunk of
 * codes (128 columns) costs two nibble masks and six vpdpbusd instead of 8 x (shift, vpermps, FMA).
 * Measured (this project's AMD EPYC VM, a 512-row x 2048-column weight in L2, best of 200): 21.7 us
 * against 37.1 for q4_t1_sf_g (48 against 28 G weights/s; a cold int4 expert is ~2.6 MB, about 93 us
 * of the one-thread memory read), so the kernel no longer bounds the row stream.
 *
 * Activations (q4_quant_x, once per call, shared by every row): per group j, xi = rint(x * Q4X_MAX /
 * m_j) with m_j = max |x| of the group, and dx_j = m_j / Q4X_MAX, so x = xi * dx_j within dx_j / 2 =
 * m_j * 2**-24 (float32's own rounding at the group's largest value). xi = b2 * 65536 + b1 * 256 +
 * b0 with signed digits b in [-128, 127] (b0 = the low byte sign-extended, and so on). Per chunk and
 * row, a dword lane sums 8 products q * b of one digit (|sum| <= 8 * 15 * 128 = 15360), so (a2 << 16)
 * + (a1 << 8) + a0 = sum q * xi over the lane's 8 columns is exact in int32 (< 2**30); one conversion
 * to float32 and one FMA with the lane's scale s_j * dx_j follow. The zero-point term uses the group
 * sums of xi (xsi), so the q and z terms see the same activations: y = sum_j s_j dx_j (sum q xi - z_j
 * sum xi). Columns past the last whole chunk run the float block code on xi as float32 (exact: |xi| <
 * 2**24). Activations that are not finite: q4_t1_sf_g (the float kernel). */
#define Q4X_MAX 8323072.0f /* 127 * 65536: the top digit stays within int8 */

/* xd: [NC][3 digits][lo, hi][64] int8 in the codes' nibble order (lo byte 16k + i: column 32k + i of the
 * chunk, hi: column 32k + 16 + i), top digit first; xf [C]: xi as float32 (read for the tail); dx, xsi
 * [G]. Returns 1 (nothing usable) when some activation is not finite. */
static int q4_quant_x(const float* x, i64 C, i64 g, int8_t* xd, float* xf, float* dx, float* xsi) {
    const i64 G = (C + g - 1) / g, NC = C / 128;
    for (i64 j = 0; j < G; j++) {
        const i64 k0 = j * g, n = group_len(j, g, C);
        __m512 m = _mm512_setzero_ps();
        for (i64 k = 0; k < n; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k0 + k)));
        const float mj = _mm512_reduce_max_ps(m);
        if (!isfinite(mj)) return 1;  /* inf; a NaN is caught per vector below */
        const __m512 inv = _mm512_set1_ps(mj > 0 ? Q4X_MAX / mj : 0.0f);
        dx[j] = mj / Q4X_MAX;
        int64_t sum = 0;
        for (i64 k = k0; k < k0 + n; k += 16) {
            const __m512 xv = _mm512_loadu_ps(x + k);
            if (_mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q)) return 1;
            const __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(xv, inv));  /* nearest even */
            sum += _mm512_reduce_add_epi32(xi);
            _mm512_storeu_ps(xf + k, _mm512_cvtepi32_ps(xi));
            if (k >= NC * 128) continue;
            const __m512i b0 = _mm512_srai_epi32(_mm512_slli_epi32(xi, 24), 24);
            const __m512i r1 = _mm512_srai_epi32(_mm512_sub_epi32(xi, b0), 8);
            const __m512i b1 = _mm512_srai_epi32(_mm512_slli_epi32(r1, 24), 24);
            const __m512i b2 = _mm512_srai_epi32(_mm512_sub_epi32(r1, b1), 8);
            const i64 c = k / 128, blk = (k % 128) / 32, hi = (k % 32) / 16;
            int8_t* d = xd + c * 384 + hi * 64 + blk * 16;
            _mm_storeu_si128((__m128i*)d, _mm512_cvtepi32_epi8(b2));
            _mm_storeu_si128((__m128i*)(d + 128), _mm512_cvtepi32_epi8(b1));
            _mm_storeu_si128((__m128i*)(d + 256), _mm512_cvtepi32_epi8(b0));
        }
        xsi[j] = (float)sum;
    }
    return 0;
}

static inline __attribute__((always_inline)) int q4_t1_int_g(const float* x, const uint8_t* codes,
        const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C / 2, NC = C / 128;
    int8_t xd[NC * 384 + 64];
    float xf[C + 16], dx[G + 4], xsi[G + 4];
    if (q4_quant_x(x, C, g, xd, xf, dx, xsi)) return 1;
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i sidx = q4_group_lanes(g);
    float sv0[G + 4], sv1[G + 4];
    const i64 ahead = pf_ahead(rb, 2);
    for (i64 r = r0; r < r1; r += 2) {
        const i64 r2 = r + 1 < r1 ? r + 1 : r;
        const uint8_t *b0 = codes + r * rb, *b1 = codes + r2 * rb;
        prefetch_scales(scales, zeros, G, r + 2 * PF_BLOCKS, 2, r1);
        const float z0 = row_prep(scales + r * G, zeros + r * G, dx, xsi, 0.0f, G, sv0);
        const float z1 = row_prep(scales + r2 * G, zeros + r2 * G, dx, xsi, 0.0f, G, sv1);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
        for (i64 c = 0; c < NC; c++) {
            pf_span(b0 + c * 64 + ahead, 64);
            pf_span(b1 + c * 64 + ahead, 64);
            const __m512i v0 = _mm512_loadu_si512(b0 + c * 64), v1 = _mm512_loadu_si512(b1 + c * 64);
            const __m512i l0 = _mm512_and_si512(v0, m15), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m15);
            const __m512i l1 = _mm512_and_si512(v1, m15), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m15);
            const int8_t* xc = xd + c * 384;
            __m512i t0[3], t1[3];
            for (int L = 0; L < 3; L++) {
                const __m512i xl = _mm512_loadu_si512(xc + L * 128), xh = _mm512_loadu_si512(xc + L * 128 + 64);
                t0[L] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, xl), h0, xh);
                t1[L] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l1, xl), h1, xh);
            }
            const __m512i i0 = _mm512_add_epi32(_mm512_slli_epi32(t0[0], 16), _mm512_add_epi32(_mm512_slli_epi32(t0[1], 8), t0[2]));
            const __m512i i1 = _mm512_add_epi32(_mm512_slli_epi32(t1[0], 16), _mm512_add_epi32(_mm512_slli_epi32(t1[1], 8), t1[2]));
            const i64 base = c * 128 / g;
            const __m512 s0 = q4_chunk_scales(sv0 + base, sidx);
            const __m512 s1 = q4_chunk_scales(sv1 + base, sidx);
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), s0, acc0);
            acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), s1, acc1);
        }
        q4_tail_2rows(xf, b0, b1, sv0, sv1, NC * 128, C, g, &acc0, &acc1);  /* on xi as floats */
        y[r] = _mm512_reduce_add_ps(acc0) - z0;
        if (r2 != r) y[r2] = _mm512_reduce_add_ps(acc1) - z1;
    }
    return 0;
}

static void q8_t1_512(const float* x, const float* xs, const uint8_t* codes, const uint16_t* scales,
                      const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q8_T1_512(G_) q8_t1_512_g(x, xs, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q8_T1_512)
}
static void q4_t1_512(const float* x, const float* xs, const uint8_t* codes, const uint16_t* scales,
                      const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q4_INT_512(G_) rc = q4_t1_int_g(x, codes, scales, zeros, C, G_, y, r0, r1)
    int rc;
    CASE_G(Q4_INT_512)
    if (rc == 0) return;
#define Q4_T1_512(G_) q4_t1_sf_g(x, xs, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q4_T1_512)
}

int t1_avx512(int kind, const float* x, const float* xs, const void* w, const uint16_t* scales,
              const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
    switch (kind) {
        case KIND_BF16:
            if (!bf16_exact(x, C)) return 1;
            bf16_t1_512(x, (const uint16_t*)w, C, y, r0, r1);
            return 0;
        case KIND_Q8: q8_t1_512(x, xs, (const uint8_t*)w, scales, zeros, C, g, y, r0, r1); return 0;
        case KIND_Q4: q4_t1_512(x, xs, (const uint8_t*)w, scales, zeros, C, g, y, r0, r1); return 0;
        default: return 1;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* int8 activations, VNNI. A group's integer dots: 64 columns per zmm, then 32 (ymm) and 16 (xmm). */
static inline __attribute__((always_inline)) __m512i dot_fold(__m512i a512, __m256i a256, __m128i a128) {
    __m256i t = _mm256_add_epi32(a256, _mm256_zextsi128_si256(a128));
    return _mm512_add_epi32(a512, _mm512_zextsi256_si512(t));
}

/* q4 codes, four rows: 64 columns are 32 bytes [blk0, blk1]; each block's 16 bytes go to two
 * 128-bit lanes, the second shifted by 4 (vpsrlvq), masked to nibbles: lanes in column order. */
static inline __attribute__((always_inline)) void q4_a8_512_g(const int8_t* xq, const float* d, const float* qsum,
        const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0,
        i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C / 2;
    const __m512i m15 = _mm512_set1_epi8(15), sh = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    const __m256i m15y = _mm256_set1_epi8(15), shy = _mm256_setr_epi64x(0, 0, 4, 4);
    float sv[4][G];
    const i64 ahead = pf_ahead(rb, 4);
    for (i64 r = r0; r < r1; r += 4) {
        const uint8_t* b[4];
        float zt[4];
        __m512 acc[4];
        for (int i = 0; i < 4; i++) {
            const i64 ri = r + i < r1 ? r + i : r1 - 1;
            b[i] = codes + ri * rb;
            zt[i] = row_prep(scales + ri * G, zeros + ri * G, d, qsum, 0.0f, G, sv[i]);
            acc[i] = _mm512_setzero_ps();
        }
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m512i s5[4];
            __m256i s2[4];
            __m128i s1[4];
            for (int i = 0; i < 4; i++) {
                s5[i] = _mm512_setzero_si512();
                s2[i] = _mm256_setzero_si256();
                s1[i] = _mm_setzero_si128();
            }
            i64 k = k0;
            if (((k0 / 2) & 63) == 0)
                for (int i = 0; i < 4; i++) pf_span(b[i] + k0 / 2 + ahead, g / 2);
            for (; k + 64 <= k1; k += 64) {
                const __m512i q = _mm512_loadu_si512(xq + k);
                for (int i = 0; i < 4; i++) {
                    const __m512i c = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b[i] + k / 2)));
                    const __m512i v = _mm512_and_si512(_mm512_srlv_epi64(_mm512_shuffle_i64x2(c, c, 0x50), sh), m15);
                    s5[i] = _mm512_dpbusd_epi32(s5[i], v, q);
                }
            }
            if (k + 32 <= k1) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(xq + k));
                for (int i = 0; i < 4; i++) {
                    const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b[i] + k / 2)));
                    s2[i] = _mm256_dpbusd_epi32(s2[i], _mm256_and_si256(_mm256_srlv_epi64(c, shy), m15y), q);
                }
                k += 32;
            }
            if (k < k1) {  /* the last 16 columns of a row: byte i = code i | code i + 8 << 4 */
                const __m128i q = _mm_loadu_si128((const __m128i*)(xq + k));
                for (int i = 0; i < 4; i++) {
                    const __m128i bb = _mm_loadl_epi64((const __m128i*)(b[i] + k / 2));
                    const __m128i c = _mm_and_si128(_mm_unpacklo_epi64(bb, _mm_srli_epi16(bb, 4)), _mm_set1_epi8(15));
                    s1[i] = _mm_dpbusd_epi32(s1[i], c, q);
                }
            }
            for (int i = 0; i < 4; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_fold(s5[i], s2[i], s1[i])), _mm512_set1_ps(sv[i][j]),
                                         acc[i]);
        }
        for (int i = 0; i < 4 && r + i < r1; i++) y[r + i] = _mm512_reduce_add_ps(acc[i]) - zt[i];
    }
}

/* q8 codes, two rows: the codes are vpdpbusd's unsigned operand as they are (no bias). */
static inline __attribute__((always_inline)) void q8_a8_512_g(const int8_t* xq, const float* d, const float* qsum,
        const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, const i64 g, float* y, i64 r0,
        i64 r1) {
    const i64 G = (C + g - 1) / g, rb = C;
    float sv0[G], sv1[G];
    const i64 ahead = pf_ahead(rb, 2);
    for (i64 r = r0; r < r1; r += 2) {
        const i64 r2 = r + 1 < r1 ? r + 1 : r;
        const uint8_t *b0 = codes + r * rb, *b1 = codes + r2 * rb;
        const float z0 = row_prep(scales + r * G, zeros + r * G, d, qsum, 0.0f, G, sv0);
        const float z1 = row_prep(scales + r2 * G, zeros + r2 * G, d, qsum, 0.0f, G, sv1);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
        for (i64 j = 0; j < G; j++) {
            const i64 k0 = j * g, k1 = k0 + group_len(j, g, C);
            __m512i i0 = _mm512_setzero_si512(), i1 = i0;
            __m256i h0 = _mm256_setzero_si256(), h1 = h0;
            __m128i l0 = _mm_setzero_si128(), l1 = l0;
            i64 k = k0;
            pf_span(b0 + k0 + ahead, g);
            pf_span(b1 + k0 + ahead, g);
            for (; k + 64 <= k1; k += 64) {
                const __m512i q = _mm512_loadu_si512(xq + k);
                i0 = _mm512_dpbusd_epi32(i0, _mm512_loadu_si512(b0 + k), q);
                i1 = _mm512_dpbusd_epi32(i1, _mm512_loadu_si512(b1 + k), q);
            }
            if (k + 32 <= k1) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(xq + k));
                h0 = _mm256_dpbusd_epi32(h0, _mm256_loadu_si256((const __m256i*)(b0 + k)), q);
                h1 = _mm256_dpbusd_epi32(h1, _mm256_loadu_si256((const __m256i*)(b1 + k)), q);
                k += 32;
            }
            if (k < k1) {
                const __m128i q = _mm_loadu_si128((const __m128i*)(xq + k));
                l0 = _mm_dpbusd_epi32(l0, _mm_loadu_si128((const __m128i*)(b0 + k)), q);
                l1 = _mm_dpbusd_epi32(l1, _mm_loadu_si128((const __m128i*)(b1 + k)), q);
            }
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_fold(i0, h0, l0)), _mm512_set1_ps(sv0[j]), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_fold(i1, h1, l1)), _mm512_set1_ps(sv1[j]), acc1);
        }
        y[r] = _mm512_reduce_add_ps(acc0) - z0;
        if (r2 != r) y[r2] = _mm512_reduce_add_ps(acc1) - z1;
    }
}

static void q4_a8_512(const int8_t* xq, const float* d, const float* qsum, const uint8_t* codes,
                      const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q4_A8_512(G_) q4_a8_512_g(xq, d, qsum, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q4_A8_512)
}
static void q8_a8_512(const int8_t* xq, const float* d, const float* qsum, const uint8_t* codes,
                      const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1) {
#define Q8_A8_512(G_) q8_a8_512_g(xq, d, qsum, codes, scales, zeros, C, G_, y, r0, r1)
    CASE_G(Q8_A8_512)
}

/* linear_a8 (a8.c) in AVX-512: 2 <= T <= 16 tokens by avx512_a8_tokens.c (the same y, bit for bit,
 * as T calls with one token each); otherwise tokens one by one over each block of 8 rows (a block's
 * codes are read from memory once). */
int a8_avx512(int kind, const int8_t* xq, const float* d, const float* qsum, i64 T, const uint8_t* codes,
              const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1) {
    const i64 G = (C + g - 1) / g;
    if (kind != KIND_Q8 && kind != KIND_Q4) return -1;
    if (a8_tokens_avx512(kind, xq, d, qsum, T, codes, scales, zeros, C, g, y, ldy, r0, r1) == 0)
        return 0;
    for (i64 r = r0; r < r1; r += 8) {
        const i64 re = r + 8 < r1 ? r + 8 : r1;
        prefetch_scales(scales, zeros, G, r + 8 * PF_BLOCKS, 8, r1);
        for (i64 t = 0; t < T; t++) {
            if (kind == KIND_Q4)
                q4_a8_512(xq + t * C, d + t * G, qsum + t * G, codes, scales, zeros, C, g, y + t * ldy, r, re);
            else
                q8_a8_512(xq + t * C, d + t * G, qsum + t * G, codes, scales, zeros, C, g, y + t * ldy, r, re);
        }
    }
    return 0;
}

#include "avx512_end.h"
