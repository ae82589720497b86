/* The AVX-512 kernels (avx512.c) and their runtime switch, declared for t1.c and a8.c.
 *
 * The library is built for AVX2 (FLAGS in native.py); avx512.c alone is compiled for AVX-512 (a
 * target pragma), and its functions run only when cpu_isa() says so: the CPU has AVX512F/BW/VL/VNNI/
 * BF16 (and the OS saves zmm state: __builtin_cpu_supports checks both), and nobody chose AVX2
 * (MOESPEC_CPU_ISA=avx2, native.set_isa). */
#ifndef MOESPEC_KERNELS_AVX512_H
#define MOESPEC_KERNELS_AVX512_H

#include "common.h"

/* want -1: query; 0: AVX2; 1: AVX-512 where the CPU has it. Returns the ISA in use (0 or 1). */
int cpu_isa(int want);
int isa512_on(void);
/* One token, float32 activations (exact): returns 1 where it has no AVX-512 kernel (float32 rows,
 * or bfloat16 rows with activations that are not bfloat16 values), so the AVX2 kernel runs. */
int t1_avx512(int kind, const float* x, const float* xs, const void* w, const uint16_t* scales,
              const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1);
/* One token of a dense linear's bound weight (spin.c; avx512_dense.c): int8 rows with g % 64 == 0
 * and C % g == 0, one at a time; equal to t1_avx512's within float32 rounding. xs: the group sums
 * (not NULL). Returns 1 where it has no kernel (t1_avx512 / the AVX2 kernels run). */
int dense_t1_avx512(int kind, const float* x, const float* xs, const void* w, const uint16_t* scales,
                    const uint8_t* zeros, i64 C, i64 g, float* y, i64 r0, i64 r1);
/* 2 <= T <= 16 tokens, float32 activations (exact products; avx512_tokens.c): returns 1 where it
 * has no kernel, so the AVX2 ones run. */
int tokens_avx512(int kind, const float* x, i64 T, i64 ldx, const void* w, const uint16_t* scales,
                  const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1);
/* int8 activations (linear_a8's contract; VNNI dot products). */
int a8_avx512(int kind, const int8_t* xq, const float* d, const float* qsum, i64 T, const uint8_t* codes,
              const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0, i64 r1);
/* int8 activations, 2 <= T <= 16 tokens (avx512_a8_tokens.c; each row's codes unpacked once, vpdpbusd
 * against every token): y equals a8_avx512's token-by-token y bit for bit. Returns 1 where it has
 * no kernel. */
int a8_tokens_avx512(int kind, const int8_t* xq, const float* d, const float* qsum, i64 T, const uint8_t* codes,
                     const uint16_t* scales, const uint8_t* zeros, i64 C, i64 g, float* y, i64 ldy, i64 r0,
                     i64 r1);

#endif
