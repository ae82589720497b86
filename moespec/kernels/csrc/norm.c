/* RMSNorm of float32 rows: y[t, :] = w * (x[t, :] * rsqrt(mean(x[t, :]^2) + eps)).
 *
 * Shapes: T rows (tokens, or tokens x heads for a per-head norm), H features.
 *
 * Why native: transformers' RMSNorm is five tensor ops (cast, pow, mean, rsqrt, two products) on a
 * [1, H] row, ~25 us of dispatch per norm at decode on this VM against ~0.3 us of arithmetic; a
 * decode step of the default model runs 61 of them. Precision: the same products in the same order
 * per element (x * r first, then w *); the sum of squares in another order (8 lanes, then the
 * tail) and 1 / sqrtf instead of torch's rsqrt: within a few ulp (tests/test_norm_call.py).
 */
#include "common.h"

void rms_norm(const float* x, i64 T, i64 H, const float* w, float eps, float* y) {
    for (i64 t = 0; t < T; t++) {
        const float* xt = x + t * H;
        float* yt = y + t * H;
        __m256 acc = _mm256_setzero_ps();
        i64 k = 0;
        for (; k + 8 <= H; k += 8) {
            const __m256 v = _mm256_loadu_ps(xt + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; k < H; k++) ss += xt[k] * xt[k];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        const __m256 rv = _mm256_set1_ps(r);
        k = 0;
        for (; k + 8 <= H; k += 8)
            _mm256_storeu_ps(yt + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(xt + k), rv)));
        for (; k < H; k++) yt[k] = w[k] * (xt[k] * r);
    }
}
