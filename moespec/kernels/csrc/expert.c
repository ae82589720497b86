/* One SwiGLU expert in one call, and the SiLU both expert paths share. */
#include <sched.h>
#include <time.h>

#include "common.h"

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

/* n SwiGLU experts of one layer in one call (one GIL release for the layer): expert j's row starts at
 * base + rows[j] * stride bytes (a slot of the expert cache), its output is y + j * T * H. Each is
 * expert_swiglu's exact computation, so the batch equals n single calls bit for bit.
 * Returns 0, or the first non-zero code an expert returned. */
int experts_swiglu(int kind, int a8, int bf16_act, const float* x, i64 T, const uint8_t* base, i64 stride,
                   const i64* rows, i64 n, i64 ow1, i64 os1, i64 oz1, i64 ow2, i64 os2, i64 oz2, i64 H, i64 I,
                   i64 g, float* y) {
    for (i64 j = 0; j < n; j++) {
        int rc = expert_swiglu(kind, a8, bf16_act, x, T, base + rows[j] * stride, ow1, os1, oz1, ow2, os2, oz2,
                               H, I, g, y + j * T * H);
        if (rc != 0) return rc;
    }
    return 0;
}

/* One decoder layer's host experts as ONE batch that several threads run together (the host pool:
 * moespec/kernels/native_batch.py). Item i is four int64 {x [T, H] float32, T, row, y [T, H] float32}
 * (pointers as integers); every item is expert_swiglu on its own row with the layout's offsets.
 * Each caller claims items from state[0] (atomic) until none is left, so threads that arrive late
 * claim nothing and return at once; state[1] counts finished items, state[2] keeps a non-zero code
 * an expert returned. times[2i], times[2i + 1]: item i's start and end, CLOCK_MONOTONIC seconds
 * (Python's perf_counter clock on Linux). Why in C: per expert, the Python of a pool unit and the
 * layout's forward cost 25-35 us on this project's VM, 15-20 % of a cold int4 expert.
 * Returns 1 when this call finished the batch's last item (its caller resolves the batch), else 0. */
static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int host_experts(int kind, int a8, int bf16_act, const i64* items, i64 n, i64 ow1, i64 os1, i64 oz1, i64 ow2,
                 i64 os2, i64 oz2, i64 H, i64 I, i64 g, double* times, i64* state) {
    int last = 0;
    for (;;) {
        const i64 i = __atomic_fetch_add(&state[0], 1, __ATOMIC_RELAXED);
        if (i >= n) return last;
        const i64* it = items + 4 * i;
        const double t0 = mono_s();
        const int rc = expert_swiglu(kind, a8, bf16_act, (const float*)(intptr_t)it[0], it[1],
                                     (const uint8_t*)(intptr_t)it[2], ow1, os1, oz1, ow2, os2, oz2, H, I, g,
                                     (float*)(intptr_t)it[3]);
        times[2 * i] = t0;
        times[2 * i + 1] = mono_s();
        if (rc) __atomic_store_n(&state[2], (i64)rc, __ATOMIC_RELAXED);
        /* acq_rel: the last finisher sees every other thread's outputs before it resolves the batch */
        if (__atomic_add_fetch(&state[1], 1, __ATOMIC_ACQ_REL) == n) last = 1;
    }
}

/* Wait, spinning (the GIL released by ctypes), until a host_experts batch of n items has finished
 * (state[1] == n) or spin_ns passed; the core is yielded every 20 us in case the thread it waits for
 * needs it. Returns 1 when finished. Why spin: a waiter asleep on a condition variable costs a
 * wake-up of 20-60 us on this project's VM per batch, a quarter of a cold int4 expert. */
int host_experts_wait(const i64* state, i64 n, i64 spin_ns) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const i64 start = (i64)ts.tv_sec * 1000000000L + ts.tv_nsec;
    i64 next_yield = start + 20000;
    for (int k = 0;; k++) {
        if (__atomic_load_n(&state[1], __ATOMIC_ACQUIRE) >= n) return 1;
        _mm_pause();
        if ((k & 63) == 63) {
            clock_gettime(CLOCK_MONOTONIC, &ts);
            const i64 t = (i64)ts.tv_sec * 1000000000L + ts.tv_nsec;
            if (t - start > spin_ns) return 0;
            if (t > next_yield) {
                sched_yield();
                next_yield = t + 20000;
            }
        }
    }
}
