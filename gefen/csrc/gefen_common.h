/* What the C sources of gefen._gefen_step share: the export attribute, the dtype codes that
 * gefen.native passes (gefen.native._DT), exact bf16 widening and rounding, 8-lane loads and
 * stores, and the helpers gefen_step.c lends the other kernels. */
#ifndef GEFEN_COMMON_H
#define GEFEN_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GEFEN_X86 1
#include <immintrin.h>
#else
#define GEFEN_X86 0
#endif

#if defined(_WIN32)
#define GEFEN_EXPORT __declspec(dllexport)
#else
#define GEFEN_EXPORT __attribute__((visibility("default")))
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* c10::BFloat16 round-to-nearest-even (NaN -> 0x7FC0). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    if (f != f) return 0x7FC0;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

/* element i of an fp32 or bf16 array, as fp32 (exact) */
static inline float ld_g(const void *g, int dt, int64_t i) {
    return dt == DT_F32 ? ((const float *)g)[i] : bf16_to_f32(((const uint16_t *)g)[i]);
}

#if GEFEN_X86
#define AVX2 __attribute__((target("avx2,fma")))

/* 8 elements of an fp32 or bf16 array from i, as fp32 (exact) */
static AVX2 inline __m256 ld8_g(const void *g, int dt, int64_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)g + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* store 8 fp32 values at i of an fp32 or bf16 array (bf16: f32_to_bf16 in every lane) */
static AVX2 inline void st8_g(void *dst, int dt, int64_t i, __m256 v) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float *)dst + i, v);
        return;
    }
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(isnan));
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), packed);
}
#endif

/* Defined in gefen_step.c for the other kernels: torch's square root in place (see sqrt_n there),
 * MKL's thread-local thread count (returns the previous count, -1 without MKL) and whether the
 * AVX2 kernels are on (CPU support, not forced portable). */
void gefen_sqrt_n(float *x, int64_t n);
int gefen_mkl_threads_local(int n);
int gefen_avx2_on(void);

#endif
