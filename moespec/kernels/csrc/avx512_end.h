/* Ends what avx512_begin.h began (the AVX-512 target of an avx512*.c file). */
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
