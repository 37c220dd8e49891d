/*
 * The one-time work of Gefen's first step on CPU: the block-normalised histogram the codebook
 * is learned from.  Part of gefen._gefen_step (loaded with ctypes by gefen.native); the torch
 * reference is gefen.codebook.histogram_normalised_blocks.
 *
 * Why it exists: the reference spends several passes (and their allocations) over every
 * gradient; here one pass per block.
 *
 * What matches the reference, and how exactly: the histogram counts are identical: max-abs,
 * one fp32 division, +1, /2, *bins and truncation are each one IEEE rounding in both (NaN ->
 * bin 0, as torch's float -> int64 cast and clamp give on x86; a block holding a NaN has a NaN
 * scale, so all of it).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gefen_common.h"

#define HIST_PAR_MIN 65536 /* elements below which one thread does the histogram */

/* ----- block-normalised histogram ---------------------------------------------------- */

#define HIST_RUN 1024 /* elements binned per pass over a block (bounds the index buffer) */

/* max |x| over x[0..n) in fp32; *nan set when any element is NaN. */
static float block_amax_portable(const float *x, int64_t n, int *nan) {
    float m = 0.0f;
    int bad = 0;
    for (int64_t j = 0; j < n; j++) {
        float a = fabsf(x[j]);
        bad |= a != a;
        m = a > m ? a : m;
    }
    *nan = bad;
    return m;
}

/* The bin of every x[j] / scale: clamp(trunc(((x / scale + 1) / 2) * bins), 0, bins - 1), NaN -> 0. */
static void bin_run_portable(const float *x, int64_t n, float scale, float fbins, int32_t last, int32_t *idx) {
    for (int64_t j = 0; j < n; j++) {
        float v = x[j] / scale;
        int32_t i = 0;
        if (v == v) {
            i = (int32_t)(((v + 1.0f) * 0.5f) * fbins); /* == (v + 1) / 2: halving is exact */
            i = i > last ? last : (i < 0 ? 0 : i);
        }
        idx[j] = i;
    }
}

static void widen_portable(const void *x, int64_t off, int64_t n, float *conv) {
    for (int64_t j = 0; j < n; j++) conv[j] = ld_g(x, DT_BF16, off + j);
}

#if GEFEN_X86
/* The same operations eight lanes at a time (each an IEEE rounding, so the same bits). */
static AVX2 float block_amax_avx2(const float *x, int64_t n, int *nan) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        PREFETCH(x, 4, j);
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        m = _mm256_max_ps(a, m); /* a NaN lane keeps m; NaNs are reported through bad */
    }
    const float out = hmax8(m); /* all lanes >= +0 */
    int tail_nan = 0;
    float tail = block_amax_portable(x + j, n - j, &tail_nan);
    *nan = tail_nan || _mm256_movemask_ps(bad) != 0;
    return tail > out ? tail : out;
}

static AVX2 void bin_run_avx2(const float *x, int64_t n, float scale, float fbins, int32_t last, int32_t *idx) {
    const __m256 s = _mm256_set1_ps(scale), one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f),
                 b = _mm256_set1_ps(fbins);
    const __m256i hi = _mm256_set1_epi32(last), lo = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + j), s);
        __m256 ok = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(v, one), half), b);
        __m256i i = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvttps_epi32(t), hi), lo);
        _mm256_storeu_si256((__m256i *)(idx + j), _mm256_and_si256(i, _mm256_castps_si256(ok)));
    }
    bin_run_portable(x + j, n - j, scale, fbins, last, idx + j);
}

/* conv[0 .. n) = bf16 x[off ..] widened (exact) */
static AVX2 void widen_avx2(const void *x, int64_t off, int64_t n, float *conv) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        PREFETCH(x, 2, off + j);
        _mm256_storeu_ps(conv + j, ld8_g(x, DT_BF16, off + j));
    }
    for (; j < n; j++) conv[j] = ld_g(x, DT_BF16, off + j);
}
#define widen(x, off, n, conv) (cpu_isa() ? widen_avx2(x, off, n, conv) : widen_portable(x, off, n, conv))
#define block_amax(x, n, nan) (cpu_isa() ? block_amax_avx2(x, n, nan) : block_amax_portable(x, n, nan))
#define bin_run(x, n, s, f, l, i) (cpu_isa() ? bin_run_avx2(x, n, s, f, l, i) : bin_run_portable(x, n, s, f, l, i))
#else
#define widen widen_portable
#define block_amax block_amax_portable
#define bin_run bin_run_portable
#endif

static void hist_blocks(const void *x, int dt, int64_t b0, int64_t b1, int64_t P, int64_t bins, const float *scales,
                        int64_t *counts, float *conv, int32_t *idx) {
    const float fbins = (float)bins;
    for (int64_t b = b0; b < b1; b++) {
        const float *blk = (const float *)x + b * P;
        if (dt == DT_BF16) { /* widen the block once (exact), then share the fp32 code */
            widen(x, b * P, P, conv);
            blk = conv;
        }
        int nan = 0;
        float scale = scales ? scales[b] : block_amax(blk, P, &nan);
        nan |= scale != scale; /* a given NaN scale: every value NaN -> bin 0, as torch's */
        if (nan) { /* torch: a NaN max-abs makes every value of the block NaN -> bin 0 */
            counts[0] += P;
            continue;
        }
        if (scale == 0.0f) scale = 1.0f;
        for (int64_t j = 0; j < P; j += HIST_RUN) {
            int64_t len = P - j < HIST_RUN ? P - j : HIST_RUN;
            bin_run(blk + j, len, scale, fbins, (int32_t)(bins - 1), idx);
            int64_t k = 0; /* four interleaved histograms: repeated bins do not chain on one counter */
            for (; k + 4 <= len; k += 4) {
                counts[idx[k]]++;
                counts[bins + idx[k + 1]]++;
                counts[2 * bins + idx[k + 2]]++;
                counts[3 * bins + idx[k + 3]]++;
            }
            for (; k < len; k++) counts[idx[k]]++;
        }
    }
}

/*
 * x: nblocks x P (contiguous fp32 or bf16).  Adds each normalised value's bin to counts[bins]
 * (int64, not cleared).  scales: NULL (each block's max-abs) or [nblocks] fp32, the blocks' scales
 * given (a column split's whole rows' max-abs, reduced over tensor parallelism).  Returns 0, or
 * -1 when out of memory (counts untouched).
 */
GEFEN_EXPORT int gefen_block_histogram(const void *x, int dt, int64_t nblocks, int64_t P, int64_t bins,
                                       int64_t *counts, const float *scales) {
    if (bins < 1 || P < 1) return -2;
    const int nt = nblocks * P >= HIST_PAR_MIN ? max_threads() : 1;
    if (bins > INT32_MAX) return -2;
    int64_t *local = calloc((size_t)nt * 4 * (size_t)bins, sizeof(int64_t));
    int failed = 0;
    if (!local) return -1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = thread_id(), T = thread_count();
        int64_t per = (nblocks + T - 1) / T, b0 = t * per, b1 = b0 + per < nblocks ? b0 + per : nblocks;
        float *conv = dt == DT_BF16 ? malloc(sizeof(float) * (size_t)P) : NULL;
        int32_t *idx = malloc(sizeof(int32_t) * HIST_RUN);
        if (!idx || (dt == DT_BF16 && !conv)) {
#pragma omp atomic write
            failed = 1;
        } else if (b0 < b1) {
            hist_blocks(x, dt, b0, b1, P, bins, scales, local + (int64_t)t * 4 * bins, conv, idx);
        }
        free(conv);
        free(idx);
    }
    if (failed) {
        free(local);
        return -1;
    }
    for (int64_t c = 0; c < (int64_t)nt * 4; c++)
        for (int64_t i = 0; i < bins; i++) counts[i] += local[c * bins + i];
    free(local);
    return 0;
}
