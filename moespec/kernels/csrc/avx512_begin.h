/* Compile what follows for AVX-512 (F/BW/VL/VNNI/BF16) while the rest of the library stays AVX2:
 * include this after the other headers of an avx512*.c file and avx512_end.h at its end. Only
 * cpu_isa() decides whether these functions run (avx512.h). No include guard: one begin per end. */
#if defined(__clang__)  /* clang ignores GCC's target pragma */
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")
#endif
