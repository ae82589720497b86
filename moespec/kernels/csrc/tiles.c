/* Several tokens (t > 1) with each weight read ONCE for all of them: register tiles of rows x tokens.
 *
 * Shapes: T tokens, R rows, C columns; TP = T rounded up to 8 (the tokens of one column of x, padded
 * with zeros, are one or two ymm registers). x is transposed once per call into xt [C, TP] float32,
 * so a column's tokens are one contiguous vector. For each block of MR rows, KC columns at a time:
 *   - the rows' weights are dequantised into an L1 buffer exactly as the reference does ((q - z) * s,
 *     one rounding; bf16 widened; f32 rows are read in place), so every product below is the
 *     reference's product and only the order of the float32 sum differs;
 *   - for each tile of up to 16 tokens, per column c: one broadcast of w[i, c] per row and one FMA
 *     per 8 tokens: acc[i][t] += w[i, c] * xt[c, t]. MR x NV accumulators (NV = 1 or 2 ymm) stay in
 *     registers for the chunk (12 of 16 ymm), so a weight costs one load and NV FMAs for 8 or 16
 *     tokens: no per-token GEMV and no horizontal sums (the shape of llama.cpp's and KTransformers'
 *     AVX2 tiles: a weight broadcast against a vector of tokens).
 * Tiles: 16 tokens -> MR = 6 rows x 2 vectors; 8 tokens -> MR = 12 rows x 1 vector.
 * Returns 0, or -1 when the scratch memory could not be allocated. */
#include "common.h"

#define TKC 256               /* columns per chunk: MR x TKC floats of buffer stay in L1 */
#define TLD (TKC + 16)        /* buffer row stride (not a multiple of 4 KiB: rows do not share L1 sets) */
#define MRMAX 12

/* acc[i][v] (MR rows x NV vectors of 8 tokens) += sum over k < kc of u[i][k] * xt[k][8v .. 8v + 8):
 * the registers sum TSUB columns from zero, then are added into acc (a two-level sum: a single
 * chain over 2048 columns measured 2.0e-6 relative error against F.linear, this 4e-7 or less). */
#define TSUB 64
static inline __attribute__((always_inline)) void tile(const int MR, const int NV, const int PF,
                                                        const float* const* u, const float* xt, i64 ldx, i64 kc,
                                                        float* acc) {
    for (i64 k0 = 0; k0 < kc; k0 += TSUB) {
        const i64 k1 = kc - k0 < TSUB ? kc : k0 + TSUB;
        __m256 a[MRMAX][2];
        for (int i = 0; i < MR; i++)
            for (int v = 0; v < NV; v++) a[i][v] = _mm256_setzero_ps();
        for (i64 k = k0; k < k1; k++) {
            if (PF && (k & 15) == 0)  /* float32 rows read in place: the next chunk, one line per row */
                for (int i = 0; i < MR; i++) _mm_prefetch((const char*)(u[i] + k + TKC), _MM_HINT_T0);
            const float* xk = xt + k * ldx;
            const __m256 x0 = _mm256_loadu_ps(xk);
            const __m256 x1 = NV > 1 ? _mm256_loadu_ps(xk + 8) : x0;
            for (int i = 0; i < MR; i++) {
                const __m256 wb = _mm256_broadcast_ss(u[i] + k);
                a[i][0] = _mm256_fmadd_ps(wb, x0, a[i][0]);
                if (NV > 1) a[i][1] = _mm256_fmadd_ps(wb, x1, a[i][1]);
            }
        }
        for (int i = 0; i < MR; i++)
            for (int v = 0; v < NV; v++) {
                float* p = acc + (i * NV + v) * 8;
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), a[i][v]));
            }
    }
}

static void tile_6x16(int pf, const float* const* u, const float* xt, i64 ldx, i64 kc, float* acc) {
    if (pf) tile(6, 2, 1, u, xt, ldx, kc, acc);
    else tile(6, 2, 0, u, xt, ldx, kc, acc);
}
static void tile_12x8(int pf, const float* const* u, const float* xt, i64 ldx, i64 kc, float* acc) {
    if (pf) tile(12, 1, 1, u, xt, ldx, kc, acc);
    else tile(12, 1, 0, u, xt, ldx, kc, acc);
}

int linear_tiles(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                 const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1) {
    const i64 TP = (T + 7) / 8 * 8;
    const int wide = TP >= 16, MR = wide ? 6 : 12, NV = wide ? 2 : 1, TT = NV * 8;  /* tokens per tile */
    const i64 ntiles = (TP + TT - 1) / TT, TPP = ntiles * TT;                     /* xt row: whole tiles */
    float* xt = (float*)aligned_alloc(64, (size_t)(C * TPP + MRMAX * TLD + ntiles * MRMAX * 16) * sizeof(float));
    if (!xt) return -1;
    float* buf = xt + C * TPP;
    float* acc = buf + MRMAX * TLD;  /* [ntiles][MR][TT] */
    for (i64 c = 0; c < C; c++) {
        float* d = xt + c * TPP;
        for (i64 t = 0; t < T; t++) d[t] = x[t * ldx + c];
        for (i64 t = T; t < TPP; t++) d[t] = 0.0f;
    }
    const float* u[MRMAX];
    for (i64 r = r0; r < r1; r += MR) {
        const i64 nr = r1 - r < MR ? r1 - r : MR;  /* a short block repeats its last row (not written) */
        memset(acc, 0, (size_t)(ntiles * MR * TT) * sizeof(float));
        for (i64 k0 = 0; k0 < C; k0 += TKC) {
            const i64 kc = C - k0 < TKC ? C - k0 : TKC;
            for (i64 i = 0; i < MR; i++) {
                const i64 ri = r + (i < nr ? i : nr - 1);
                if (kind == KIND_F32) {
                    u[i] = (const float*)w + ri * C + k0;
                } else {
                    if (i < nr) {
                        /* the row's next chunk (or the next row's first), requested one chunk ahead */
                        const i64 nb = kind == KIND_BF16 ? 2 * C : kind == KIND_Q8 ? C : C / 2;  /* bytes per row */
                        pf_span((const uint8_t*)w + ri * nb + (k0 + TKC) * nb / C, TKC * nb / C);
                        decode_cols(kind, w, scales, zeros, C, g, ri, k0, k0 + kc, buf + i * TLD);
                    }
                    u[i] = buf + (i < nr ? i : nr - 1) * TLD;
                }
            }
            for (i64 tt = 0; tt < ntiles; tt++) {
                if (wide) tile_6x16(kind == KIND_F32, u, xt + k0 * TPP + tt * TT, TPP, kc, acc + tt * MR * TT);
                else tile_12x8(kind == KIND_F32, u, xt + k0 * TPP + tt * TT, TPP, kc, acc + tt * MR * TT);
            }
        }
        for (i64 t = 0; t < T; t++) {
            const float* a = acc + (t / TT) * MR * TT + t % TT;
            for (i64 i = 0; i < nr; i++) y[t * ldy + r + i] = a[i * TT];
        }
    }
    free(xt);
    return 0;
}
