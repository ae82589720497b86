/* A softmax router's selection from its logits: softmax over E, the K largest, renormalised.
 *
 * Shapes: T tokens, E experts, K top-k; logits float32 [T, E], w float32 [T, K], ids int64 [T, K].
 *
 * Why native: after the router's product, transformers' softmax routers (Qwen2/3-MoE, OLMoE,
 * Mixtral) run softmax, topk, a sum and a division: four tensor ops, ~12 us of dispatch per decode
 * layer here against well under 1 us of arithmetic. Precision: exp(l - max) by libm's expf (torch:
 * Sleef), divided by the sum (summed in expert order): within a few ulp of torch; the ids are
 * torch.topk's (largest first). Where two probabilities tie inside the top-k or at its edge,
 * torch.topk's choice and order are its own sort's (not the lower id), so the call returns 1 and
 * the caller runs the router's own forward (a zeroed or coarse router ties every token): the ids
 * are then always torch's (tests/test_router_call.py). Returns 0 when w and ids are set.
 */
#include <math.h>
#include <stdint.h>

typedef int64_t i64;

int router_topk(const float* logits, i64 T, i64 E, i64 K, int renorm, float* w, i64* ids) {
    float p[E];
    for (i64 t = 0; t < T; t++) {
        const float* l = logits + t * E;
        float m = l[0];
        for (i64 e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
        float s = 0.0f;
        for (i64 e = 0; e < E; e++) {
            p[e] = expf(l[e] - m);
            s += p[e];
        }
        float* wt = w + t * K;
        i64* it = ids + t * K;
        float top = 0.0f;
        for (i64 k = 0; k < K; k++) {  /* K is small (<= 16 here): K passes over E */
            i64 best = -1;
            for (i64 e = 0; e < E; e++) {
                int taken = 0;
                for (i64 j = 0; j < k; j++) taken |= it[j] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            it[k] = best;
            wt[k] = p[best] / s;
            top += wt[k];
        }
        /* a tie among the chosen (their order) or with the best one left out (the choice) */
        for (i64 e = 0; e < E; e++) {
            int chosen = -1;
            for (i64 j = 0; j < K; j++) chosen = it[j] == e ? (int)j : chosen;
            for (i64 j = 0; j < K; j++)
                if ((i64)chosen != j && it[j] != e && p[e] == p[it[j]] && (chosen >= 0 || j == K - 1)) return 1;
        }
        if (renorm)
            for (i64 k = 0; k < K; k++) wt[k] /= top;
    }
    return 0;
}
