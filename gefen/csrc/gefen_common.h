/* What the C sources of gefen._gefen_step (and kmeans_dp.c) share: the export attribute, the
 * dtype codes that gefen.c_kernels passes (gefen.c_kernels._DT), exact bf16 widening and rounding,
 * 1-, 8- and 16-lane loads and stores, the per-call mode and the fields every step's arguments start
 * with, the parameter update, the thread split and the CPU's instruction sets. */
#ifndef GEFEN_COMMON_H
#define GEFEN_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

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

/* store v at i of an fp32 or bf16 array (bf16: round to nearest even) */
static inline void st_g(void *dst, int dt, int64_t i, float v) {
    if (dt == DT_F32) ((float *)dst)[i] = v;
    else ((uint16_t *)dst)[i] = f32_to_bf16(v);
}

/* Software prefetch of element i + PREFETCH_AHEAD of an fp32/bf16 (esz 4/2) or uint8 (esz 1)
 * array.  The streaming loops issue one per vector step: on the virtual machines we measured the
 * hardware prefetcher left the m4v4 step waiting on its gradient loads (4.4 -> 2.3 ns per element
 * with it).  A hint only: it never changes a result, and prefetching past the end is harmless. */
#define PREFETCH_AHEAD 1024
#if GEFEN_X86
#define PREFETCH(base, esz, i) _mm_prefetch((const char *)(base) + ((i) + PREFETCH_AHEAD) * (esz), _MM_HINT_T0)
#else
#define PREFETCH(base, esz, i) __builtin_prefetch((const char *)(base) + ((i) + PREFETCH_AHEAD) * (esz))
#endif
#define DT_SIZE(dt) ((dt) == DT_F32 ? 4 : 2)

/* ----- how one call computes ------------------------------------------------------------------
 * gefen.c_kernels passes its calibrated (immutable) choice with every call: no process-wide switch,
 * so calibration trying a candidate can never change what a concurrent step computes.
 * torch.sqrt on CPU is MKL's vmsSqrt (VML_HA) when torch is built with MKL, which is not always
 * correctly rounded (about 0.75 ulp here); gefen.c_kernels hands us the very function torch calls
 * (exported by libtorch_cpu) so the 1-D AdamW step (m4v4_step.c) rounds as torch's does, else
 * NULL: IEEE sqrtf, what torch's own vectorised sqrt computes.  The other kernels use sqrtf.
 * MKL_Set_Num_Threads_Local (C ABI: the lowercase symbol is the Fortran one) keeps MKL from
 * threading each call made from our OpenMP threads. */
typedef void (*vms_sqrt_fn)(int n, const float *a, float *r, long long mode);
typedef int (*mkl_threads_fn)(int n);
typedef struct {
    vms_sqrt_fn sqrt;           /* or NULL: sqrtf */
    mkl_threads_fn mkl_threads; /* or NULL */
    int32_t isa;                /* widest kernels allowed: 0 portable, 1 AVX2, 2 AVX-512 (capped by the CPU) */
} gefen_mode;

#define VML_MODE 0x140102LL /* VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as ATen's vml.h */

/* torch's square root of x[0 .. n), in place (n: one chunk of the AdamW step) */
static inline void mode_sqrt_n(const gefen_mode *m, float *x, int n) {
    if (m->sqrt) {
        m->sqrt(n, x, x, VML_MODE);
        return;
    }
    for (int i = 0; i < n; ++i) x[i] = sqrtf(x[i]);
}

/* MKL single-threaded in this (OpenMP) thread; returns what mode_threads_end restores */
static inline int mode_threads_begin(const gefen_mode *m) { return m->mkl_threads ? m->mkl_threads(1) : 0; }
static inline void mode_threads_end(const gefen_mode *m, int prev) {
    if (m->mkl_threads) m->mkl_threads(prev);
}

/* The fields every step's arguments start with (gefen.c_kernels._HEAD mirrors them): the
 * parameter, the gradient, the step count and the step's scalars exactly as the reference forms
 * them (Python floats; each kernel rounds them to fp32 once, as torch does with a Python scalar). */
#define GEFEN_ARGS_HEAD                                                                      \
    void *param;                                                                             \
    const void *grad;                                                                        \
    int64_t *step_ptr; /* state["step"], or NULL (the caller writes it) */                   \
    int64_t step;                                                                            \
    double beta1, omb1, beta2, omb2, bias1, bias2_sqrt, eps, neg_lr, decay, inv_bound;       \
    int32_t param_dtype, grad_dtype, has_wd;                                                 \
    const gefen_mode *mode /* required */

/* those scalars in fp32: beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta1^t, sqrt(1 - beta2^t),
 * eps, -lr, 1 - lr * weight_decay, 1 / step_bound(t) (gefen.functional.inverse_step_bound) */
typedef struct {
    float b1, o1, b2, o2, bc1, b2s, eps, nlr, decay, ib;
} hyper_f32;
#define HYPER_F32(a)                                                                                 \
    ((hyper_f32){(float)(a)->beta1, (float)(a)->omb1, (float)(a)->beta2, (float)(a)->omb2,          \
                 (float)(a)->bias1, (float)(a)->bias2_sqrt, (float)(a)->eps, (float)(a)->neg_lr,    \
                 (float)(a)->decay, (float)(a)->inv_bound})

/* gefen.functional.bounded_denominator: max(root_v, |m_hat| * ib) + eps.  Where either is NaN the
 * update m_hat / den is NaN whichever is taken, so (f > root ? f : root) -- what MAXPS computes
 * as max(f, root) -- gives the reference's update on every input. */
static inline float bounded_den(float root_v, float m_hat, float ib, float eps) {
    const float f = fabsf(m_hat) * ib;
    return (f > root_v ? f : root_v) + eps;
}

/* p[i] = p[i] * (1 - lr wd) + (-lr) * (u / den), as torch's mul_ and add_(alpha) (one fused
 * multiply-add), where u is the bias-corrected step numerator */
static inline void update_param(void *param, int dt, int64_t i, float u, float den, const hyper_f32 *s, int has_wd) {
    u = u / den;
    float p = ld_g(param, dt, i);
    if (has_wd) p = p * s->decay;
    st_g(param, dt, i, fmaf(u, s->nlr, p));
}

/* ----- the largest |x| of a block or row, and whether an x is NaN ----------------------------
 * The vector kernels take one unsigned integer max of the sign-cleared bits per vector instead of
 * a float max and a NaN test: on sign-cleared floats the unsigned order of the bits is the float
 * order, and every NaN is above +inf (0x7F800000).  max_abs_bits turns the largest bits back into
 * a float and sets *nan for a NaN (which discards the max); fold_max_abs is the scalar loops' step. */
static inline float max_abs_bits(uint32_t bits, int *nan) {
    float f;
    if (bits > 0x7F800000u) *nan = 1;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void fold_max_abs(float x, float *most, int *nan) {
    const float a = fabsf(x);
    *nan |= a != a;
    *most = a > *most ? a : *most;
}

/* ----- threads ------------------------------------------------------------------------------ */
#ifdef _OPENMP
static inline int thread_id(void) { return omp_get_thread_num(); }
static inline int thread_count(void) { return omp_get_num_threads(); }
static inline int max_threads(void) { return omp_get_max_threads(); }
#else
static inline int thread_id(void) { return 0; }
static inline int thread_count(void) { return 1; }
static inline int max_threads(void) { return 1; }
#endif

/* This thread's share [*b0, *b1) of n items split evenly (the first n % nt threads take one more). */
static inline void thread_range(int64_t n, int64_t *b0, int64_t *b1) {
    const int64_t tid = thread_id(), nt = thread_count(), per = n / nt, extra = n % nt;
    *b0 = tid * per + (tid < extra ? tid : extra);
    *b1 = *b0 + per + (tid < extra ? 1 : 0);
}

#if GEFEN_X86
#define AVX2 __attribute__((target("avx2,fma")))

/* The widest kernels this CPU runs: 2 AVX-512, 1 AVX2 + FMA, 0 portable. */
static inline int cpu_isa(void) {
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        isa = avx2 ? (__builtin_cpu_supports("avx512f") ? 2 : 1) : 0;
    }
    return isa;
}

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

/* max |x| of 8 lanes as sign-cleared bits (see max_abs_bits) */
static AVX2 inline __m256i abs_bits8(__m256 x) {
    return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
}

static AVX2 inline uint32_t hmax8_u32(__m256i v) {
    uint32_t t[8], m = 0;
    _mm256_storeu_si256((__m256i *)t, v);
    for (int i = 0; i < 8; ++i) m = t[i] > m ? t[i] : m;
    return m;
}

/* The parameter update's scalars on 8 lanes, broadcast once per row or block. */
typedef struct {
    __m256 ib, eps, nlr, decay;
} update8_scalars;

static AVX2 inline update8_scalars update8_scalars_of(const hyper_f32 *s) {
    return (update8_scalars){_mm256_set1_ps(s->ib), _mm256_set1_ps(s->eps), _mm256_set1_ps(s->nlr),
                             _mm256_set1_ps(s->decay)};
}

/* update_param(m_hat, bounded_den(root, m_hat)) on 8 lanes at i; max_ps(f, root) is bounded_den's
 * (f > root ? f : root) */
static AVX2 inline void bounded_update8(void *param, int dt, int64_t i, __m256 m_hat, __m256 root,
                                       const update8_scalars *k, int has_wd) {
    const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(abs_bits8(m_hat)), k->ib);
    const __m256 u = _mm256_div_ps(m_hat, _mm256_add_ps(_mm256_max_ps(f, root), k->eps));
    __m256 p = ld8_g(param, dt, i);
    if (has_wd) p = _mm256_mul_ps(p, k->decay);
    st8_g(param, dt, i, _mm256_fmadd_ps(u, k->nlr, p));
}

/* ----- 16 lanes (AVX-512: m4v4_step.c's row kernels, gefen_step.c's block kernel) ---------- */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

/* 16 elements of an fp32 or bf16 array from i, as fp32 (exact) */
static AVX512 inline __m512 ld16_g(const void *g, int dt, int64_t i) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)g + i);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* store 16 fp32 values at i of an fp32 or bf16 array (bf16: f32_to_bf16 in every lane) */
static AVX512 inline void st16_g(void *dst, int dt, int64_t i, __m512 v) {
    if (dt == DT_F32) {
        _mm512_storeu_ps((float *)dst + i, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), _mm512_cvtepi32_epi16(r));
}

/* abs_bits8 on 16 lanes */
static AVX512 inline __m512i abs_bits16(__m512 x) {
    return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
}

typedef struct {
    __m512 ib, eps, nlr, decay;
} update16_scalars;

static AVX512 inline update16_scalars update16_scalars_of(const hyper_f32 *s) {
    return (update16_scalars){_mm512_set1_ps(s->ib), _mm512_set1_ps(s->eps), _mm512_set1_ps(s->nlr),
                              _mm512_set1_ps(s->decay)};
}

/* bounded_update8 on 16 lanes */
static AVX512 inline void bounded_update16(void *param, int dt, int64_t i, __m512 m_hat, __m512 root,
                                           const update16_scalars *k, int has_wd) {
    const __m512 f = _mm512_mul_ps(_mm512_abs_ps(m_hat), k->ib);
    const __m512 u = _mm512_div_ps(m_hat, _mm512_add_ps(_mm512_max_ps(f, root), k->eps));
    __m512 p = ld16_g(param, dt, i);
    if (has_wd) p = _mm512_mul_ps(p, k->decay);
    st16_g(param, dt, i, _mm512_fmadd_ps(u, k->nlr, p));
}
#else
static inline int cpu_isa(void) { return 0; }
#endif

/* The end of every fixed-order float64 sum of g^2 (m4v4_step.c's row sums, gefen_step.c's block
 * sums): lane l holds the elements e = l mod 16 below the last multiple of 16, the tail the rest in
 * order; the lanes are added 0..15, then the tail. */
static inline double lanes_total(const double *lanes, double tail) {
    double s = lanes[0];
    for (int l = 1; l < 16; ++l) s += lanes[l];
    return s + tail;
}

/* The kernels one call runs: what it allows, capped by the CPU. */
static inline int call_isa(const gefen_mode *m) {
    const int cpu = cpu_isa();
    return m->isa < cpu ? m->isa : cpu;
}

#endif
