/*
 * The one-time work of Gefen's first step on CPU: the block-normalised histogram the codebook
 * is learned from.  Part of gefen._gefen_step (loaded with ctypes by gefen.c_kernels); the torch
 * reference is gefen.codebook.histogram_normalised_blocks.
 *
 * Why it exists: the reference spends several passes (and their allocations) over every
 * gradient; here one call takes every tensor, and each block is read twice while it is in cache
 * (its max-abs, then its bins).
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
#define HIST_RUN 1024      /* elements binned per pass over a block (bounds the index buffer) */
#define HIST_MAX_P ((int64_t)1 << 31) /* a uint32 counter holds one block's count and more */

/* ----- block-normalised histogram ---------------------------------------------------- */

/* max |x| over x[off .. off + n) (fp32 or bf16) in fp32; *nan set when any element is NaN. */
static float block_amax_portable(const void *x, int dt, int64_t off, int64_t n, int *nan) {
    float m = 0.0f;
    for (int64_t j = 0; j < n; j++) fold_max_abs(ld_g(x, dt, off + j), &m, nan);
    return m;
}

/* The bin of every x[off + j] / scale, j < n: clamp(trunc(((x / scale + 1) / 2) * bins), 0, bins - 1),
 * NaN -> 0. */
static void bin_run_portable(const void *x, int dt, int64_t off, int64_t n, float scale, float fbins, int32_t last,
                             int32_t *idx) {
    for (int64_t j = 0; j < n; j++) {
        float v = ld_g(x, dt, off + j) / scale;
        int32_t i = 0;
        if (v == v) {
            i = (int32_t)(((v + 1.0f) * 0.5f) * fbins); /* == (v + 1) / 2: halving is exact */
            i = i > last ? last : (i < 0 ? 0 : i);
        }
        idx[j] = i;
    }
}

#if GEFEN_X86
/* The same operations 8 lanes at a time (each an IEEE rounding, so the same bits); AVX-512 CPUs run
 * them too: 16 lanes bin no faster (the counting dominates). */
static AVX2 float block_amax_avx2(const void *x, int dt, int64_t off, int64_t n, int *nan) {
    __m256i m = _mm256_setzero_si256(); /* max |x| as bits */
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        PREFETCH(x, DT_SIZE(dt), off + j);
        m = _mm256_max_epu32(m, abs_bits8(ld8_g(x, dt, off + j)));
    }
    const float out = max_abs_bits(hmax8_u32(m), nan);
    const float tail = block_amax_portable(x, dt, off + j, n - j, nan);
    return tail > out ? tail : out;
}

static AVX2 void bin_run_avx2(const void *x, int dt, int64_t off, int64_t n, float scale, float fbins, int32_t last,
                              int32_t *idx) {
    const __m256 s = _mm256_set1_ps(scale), one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f),
                 b = _mm256_set1_ps(fbins);
    const __m256i hi = _mm256_set1_epi32(last), lo = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_div_ps(ld8_g(x, dt, off + j), s);
        __m256 ok = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(v, one), half), b);
        __m256i i = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvttps_epi32(t), hi), lo);
        _mm256_storeu_si256((__m256i *)(idx + j), _mm256_and_si256(i, _mm256_castps_si256(ok)));
    }
    bin_run_portable(x, dt, off + j, n - j, scale, fbins, last, idx + j);
}
#endif

/* isa: 0 portable, else AVX2 (the same counts) */
static float block_amax(int isa, const void *x, int dt, int64_t off, int64_t n, int *nan) {
#if GEFEN_X86
    if (isa) return block_amax_avx2(x, dt, off, n, nan);
#endif
    (void)isa;
    return block_amax_portable(x, dt, off, n, nan);
}

static void bin_run(int isa, const void *x, int dt, int64_t off, int64_t n, float scale, float fbins, int32_t last,
                    int32_t *idx) {
#if GEFEN_X86
    if (isa) {
        bin_run_avx2(x, dt, off, n, scale, fbins, last, idx);
        return;
    }
#endif
    (void)isa;
    bin_run_portable(x, dt, off, n, scale, fbins, last, idx);
}

/* Block b of x (P elements from b * P) into counts[4][bins]: four interleaved uint32 histograms, so
 * repeated bins do not chain on one counter; the caller flushes them before they can overflow. */
static void hist_block(const void *x, int dt, int64_t b, int64_t P, int64_t bins, const float *scales,
                       uint32_t *counts, int32_t *idx, int isa) {
    int nan = 0;
    float scale = scales ? scales[b] : block_amax(isa, x, dt, b * P, P, &nan);
    if (nan || scale != scale) { /* torch: a NaN max-abs (found or given) makes the whole block NaN -> bin 0 */
        counts[0] += (uint32_t)P;
        return;
    }
    if (scale == 0.0f) scale = 1.0f;
    for (int64_t j = 0; j < P; j += HIST_RUN) {
        const int64_t len = P - j < HIST_RUN ? P - j : HIST_RUN;
        bin_run(isa, x, dt, b * P + j, len, scale, (float)bins, (int32_t)(bins - 1), idx);
        int64_t k = 0;
        for (; k + 4 <= len; k += 4) {
            counts[idx[k]]++;
            counts[bins + idx[k + 1]]++;
            counts[2 * bins + idx[k + 2]]++;
            counts[3 * bins + idx[k + 3]]++;
        }
        for (; k < len; k++) counts[idx[k]]++;
    }
}

/* counts[k] += this thread's four histograms at k, which start again from 0 (one thread at a time:
 * integer sums, so the order does not matter) */
static void flush_counts(uint32_t *mine, int64_t bins, int64_t *counts) {
#pragma omp critical(gefen_histogram)
    for (int64_t k = 0; k < 4 * bins; k++) {
        counts[k % bins] += mine[k];
        mine[k] = 0;
    }
}

/*
 * The first step's histogram of n tensors in one parallel pass.  Tensor i: xs[i], nblocks[i] x Ps[i]
 * contiguous fp32 or bf16 (dts[i]), with scales[i] NULL (each block's max-abs) or [nblocks[i]] fp32,
 * the blocks' scales given (a column split's whole rows' max-abs, reduced over tensor parallelism).
 * Adds every normalised value's bin to counts[bins] (int64, not cleared).  The threads take equal
 * shares of all the elements, whole blocks each; integer counts do not depend on who counted what.
 * isa: the widest kernels allowed (capped by the CPU).  flush: how many elements (1 .. 2^31) a
 * thread counts in its uint32 counters before adding them to counts (2^31; tests lower it).
 * Returns 0, -1 when out of memory, -2 on bad arguments (counts untouched).
 */
GEFEN_EXPORT int gefen_block_histograms(int64_t n, const void *const *xs, const int32_t *dts, const int64_t *nblocks,
                                        const int64_t *Ps, const float *const *scales, int64_t bins, int64_t *counts,
                                        int32_t isa, int64_t flush) {
    if (n < 0 || bins < 1 || bins > INT32_MAX || flush < 1 || flush > HIST_MAX_P) return -2;
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (nblocks[i] < 0 || Ps[i] < 1 || Ps[i] > HIST_MAX_P || (dts[i] != DT_F32 && dts[i] != DT_BF16)) return -2;
        total += nblocks[i] * Ps[i];
    }
    const int cpu = cpu_isa();
    isa = isa < cpu ? isa : cpu;
    const int nt = total >= HIST_PAR_MIN ? max_threads() : 1;
    uint32_t *local = calloc((size_t)nt * 4 * (size_t)bins, sizeof(uint32_t));
    if (!local) return -1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        thread_range(total, &lo, &hi);
        uint32_t *mine = local + (int64_t)thread_id() * 4 * bins;
        int32_t idx[HIST_RUN];
        int64_t since = 0, off = 0;
        for (int64_t i = 0; i < n; off += nblocks[i] * Ps[i], i++) {
            const int64_t P = Ps[i]; /* this thread's blocks: those that start in [lo, hi) */
            const int64_t b0 = lo > off ? (lo - off + P - 1) / P : 0;
            int64_t b1 = hi > off ? (hi - off + P - 1) / P : 0;
            b1 = b1 < nblocks[i] ? b1 : nblocks[i];
            for (int64_t b = b0; b < b1; b++) {
                if (since > 0 && since + P > flush) { /* no uint32 counter passes 2^31 */
                    flush_counts(mine, bins, counts);
                    since = 0;
                }
                hist_block(xs[i], dts[i], b, P, bins, scales[i], mine, idx, isa);
                since += P;
            }
        }
        flush_counts(mine, bins, counts);
    }
    free(local);
    return 0;
}
