/* Several tokens (t > 1), and the exact dequantisation of rows (both through decode_cols). */
#include "common.h"

/* ------------------------------------------------------------------------------------------ */
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
void decode_cols(int kind, const void* w, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g,
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
    /* one group at a time, its zero and scale broadcast once (per 8 codes they cost as much as the
     * codes' own conversion); k0 and k1 are multiples of 16, groups multiples of 32 */
#define DQ(v, dst) _mm256_storeu_ps((dst), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32((v), zv)), sv))
    const __m256i m15 = _mm256_set1_epi32(15);
    for (i64 ka = k0; ka < k1;) {
        const i64 j = ka / g, kb = (j + 1) * g < k1 ? (j + 1) * g : k1;
        const __m256i zv = _mm256_set1_epi32(zr[j]);
        const __m256 sv = _mm256_set1_ps(half_to_float(sr[j]));
        i64 k = ka;
        if (kind == KIND_Q8) {
            const uint8_t* b = (const uint8_t*)w + r * C;
            for (; k < kb; k += 8) DQ(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + k))), out + k - k0);
        } else {
            const uint8_t* b = (const uint8_t*)w + r * (C / 2);
            for (; k + 32 <= kb && k + 32 <= C / 32 * 32; k += 32) {
                __m128i bb = _mm_loadu_si128((const __m128i*)(b + k / 2));
                __m256i v0 = _mm256_cvtepu8_epi32(bb), v1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bb, bb));
                DQ(_mm256_and_si256(v0, m15), out + k - k0);
                DQ(_mm256_and_si256(v1, m15), out + k - k0 + 8);
                DQ(_mm256_srli_epi32(v0, 4), out + k - k0 + 16);
                DQ(_mm256_srli_epi32(v1, 4), out + k - k0 + 24);
            }
            if (k < kb) {  /* the row's last block of 16 */
                __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + k / 2)));
                DQ(_mm256_and_si256(v0, m15), out + k - k0);
                DQ(_mm256_srli_epi32(v0, 4), out + k - k0 + 8);
                k += 16;
            }
        }
        ka = kb;
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

int linear_tokens(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
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

/* Exact dequantisation of rows [r0, r1) into out [r1 - r0, C] float32: (q - z) * s, one rounding,
 * as the torch reference computes it (bit for bit). */
void dequant_q4(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g,
                float* out, i64 r0, i64 r1) {
    for (i64 r = r0; r < r1; r++) decode_cols(KIND_Q4, codes, scales, zeros, C, g, r, 0, C, out + (r - r0) * C);
}

void dequant_q8(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g,
                float* out, i64 r0, i64 r1) {
    for (i64 r = r0; r < r1; r++) decode_cols(KIND_Q8, codes, scales, zeros, C, g, r, 0, C, out + (r - r0) * C);
}
